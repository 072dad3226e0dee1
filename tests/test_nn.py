"""numbaconv.nn: the Conv, ConvTranspose and LSTM layers and Adam.

The layers' backward passes are spelled out as plain numbaconv calls (the transposed
convolution's weight gradient as the convolution's with input and output swapped; the LSTM's
as rnn_backward_data then rnn_backward_weights); these tests hold them to numbaconv's own
conv_backward / conv_transpose_backward, to PyTorch (LSTM) and to finite differences of a
whole layer in float64.
"""

import numpy as np
import pytest

import numbaconv as nc
from numbaconv.nn import LSTM, Adam, Conv, ConvTranspose

LAYER_CASES = [
    # (in, out, kernel, keywords, input spatial shape)
    (3, 4, 3, dict(padding=1), (7, 6)),
    (4, 6, (3, 2), dict(stride=(2, 1), padding=((1, 0), (0, 1)), dilation=(1, 2), groups=2),
     (9, 8)),
    (2, 3, 3, dict(stride=2, padding="same"), (8, 8)),
    (2, 2, 3, dict(stride=3, dilation=2, ndim=1), (10,)),
    (2, 3, (2, 2, 2), dict(stride=2, layout="channels_last"), (4, 5, 4)),
]
IDS = ["pad1", "grouped_asymmetric", "same_stride2", "1d_dilated", "3d_channels_last"]


def _x(rng, n_in, spatial, layout, dtype=np.float64):
    shape = ((2,) + spatial + (n_in,) if layout == "channels_last"
             else (2, n_in) + spatial)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("case", LAYER_CASES, ids=IDS)
def test_conv_layer_matches_conv_backward(case, rng):
    n_in, n_out, kernel, kw, spatial = case
    layer = Conv(n_in, n_out, kernel, **kw, dtype=np.float64, rng=rng)
    x = _x(rng, n_in, spatial, kw.get("layout"))
    y = layer.forward(x)
    geometry = {k: v for k, v in kw.items() if k != "ndim"}
    np.testing.assert_allclose(y, nc.conv(x, layer.w, layer.b, **geometry), rtol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx = layer.backward(dy)
    expected = nc.conv_backward(dy, x, layer.w, **geometry)
    for got, want in zip((dx, layer.dw, layer.db), expected):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert layer.backward(dy, need_dx=False) is None


@pytest.mark.parametrize("case", LAYER_CASES, ids=IDS)
def test_conv_transpose_layer_matches_conv_transpose_backward(case, rng):
    n_in, n_out, kernel, kw, spatial = case
    extra = dict(output_padding=1) if kw.get("stride") == 2 and kw.get("padding") != "same" \
        else {}
    layer = ConvTranspose(n_in, n_out, kernel, **kw, **extra, dtype=np.float64, rng=rng)
    x = _x(rng, n_in, spatial, kw.get("layout"))
    y = layer.forward(x)
    geometry = {k: v for k, v in kw.items() if k != "ndim"}
    np.testing.assert_allclose(
        y, nc.conv_transpose(x, layer.w, layer.b, **geometry, **extra), rtol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx = layer.backward(dy)
    expected = nc.conv_transpose_backward(dy, x, layer.w, **geometry, **extra)
    for got, want in zip((dx, layer.dw, layer.db), expected):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layer_type", [Conv, ConvTranspose])
def test_layer_gradients_match_finite_differences(layer_type, rng):
    kw = dict(stride=2, padding=1, dtype=np.float64, rng=rng)
    if layer_type is ConvTranspose:
        kw["output_padding"] = 1
    layer = layer_type(2, 3, 3, **kw)
    x = rng.standard_normal((2, 2, 5, 4))
    target = rng.standard_normal(layer.forward(x).shape)

    def loss():  # a nonlinear loss, so the check is more than an adjoint identity
        return 0.5 * float(np.sum((np.tanh(layer.forward(x)) - target) ** 2))

    y = layer.forward(x)
    dx = layer.backward((np.tanh(y) - target) * (1 - np.tanh(y) ** 2))
    h = 1e-6
    for array, grad in [(x, dx), (layer.w, layer.dw), (layer.b, layer.db)]:
        v = rng.standard_normal(array.shape)
        array += h * v
        plus = loss()
        array -= 2 * h * v
        minus = loss()
        array += h * v
        assert (plus - minus) / (2 * h) == pytest.approx(np.vdot(grad, v), rel=1e-7)


@pytest.mark.parametrize("layer_type", [Conv, ConvTranspose])
def test_accumulate_adds_micro_batch_gradients(layer_type, rng):
    layer = layer_type(2, 2, 3, padding=1, dtype=np.float64, rng=rng)
    x = rng.standard_normal((4, 2, 5, 5))
    dy = rng.standard_normal(layer.forward(x).shape)
    layer.backward(dy, need_dx=False)
    whole = [g.copy() for g in layer.grads()]
    layer.forward(x[:2])
    layer.backward(dy[:2], need_dx=False)
    layer.forward(x[2:])
    layer.backward(dy[2:], need_dx=False, accumulate=True)
    for got, want in zip(layer.grads(), whole):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_layer_without_bias(rng):
    layer = Conv(2, 3, 3, bias=False, rng=rng)
    assert layer.b is None and layer.db is None
    assert len(layer.params()) == len(layer.grads()) == 1
    x = rng.standard_normal((1, 2, 4, 4)).astype(np.float32)
    layer.backward(layer.forward(x))
    assert layer.dw.dtype == np.float32


def test_weights_have_pytorch_shapes_and_initialisation(rng):
    conv, transpose = Conv(4, 6, 3, groups=2, rng=rng), ConvTranspose(4, 6, 3, groups=2, rng=rng)
    assert conv.w.shape == (6, 2, 3, 3) and conv.b.shape == (6,)
    assert transpose.w.shape == (4, 3, 3, 3) and transpose.b.shape == (6,)
    assert np.abs(conv.w).max() <= 1 / np.sqrt(2 * 9)
    assert np.abs(transpose.w).max() <= 1 / np.sqrt(3 * 9)
    assert Conv(1, 1, 3, rng=7).w.tolist() == Conv(1, 1, 3, rng=7).w.tolist()


def test_backward_before_forward_says_so():
    with pytest.raises(RuntimeError, match="call forward first"):
        Conv(1, 1, 3).backward(np.zeros((1, 1, 3, 3), np.float32))


@pytest.mark.parametrize("make, name", [
    (lambda: Conv(0, 1, 3), "in_channels"),
    (lambda: Conv(3, 4, 3, groups=2), "in_channels"),
    (lambda: Conv(2, 3, 3, groups=2), "out_channels"),
    (lambda: Conv(1, 1, 0), "kernel_size"),
    (lambda: Conv(1, 1, (3, 3, 3, 3)), "kernel_size"),
    (lambda: Conv(1, 1, 3, ndim=4), "ndim"),
    (lambda: ConvTranspose(1, 1, 3, stride=2, output_padding=2), "output_padding"),
    (lambda: ConvTranspose(1, 1, 3, stride=(2, 2, 2)), "stride"),
])
def test_bad_arguments_are_named(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_bad_dtype_is_named():
    with pytest.raises(TypeError, match="dtype"):
        Conv(1, 1, 3, dtype=np.int32)


def test_adam_minimises_a_quadratic():
    p = np.array([3.0, -2.0])
    optimiser = Adam([p], lr=0.1)
    for _ in range(300):
        optimiser.step([2 * p])
    assert np.abs(p).max() < 1e-2


def test_adam_checks_its_arguments():
    with pytest.raises(ValueError, match="lr"):
        Adam([np.zeros(2)], lr=0)
    with pytest.raises(ValueError, match="grads"):
        Adam([np.zeros(2)]).step([])


# --- LSTM ----------------------------------------------------------------------------------

LSTM_CASES = {
    # name: (keywords, T, N)
    "one_layer": (dict(), 5, 3),
    "projection": (dict(proj_size=2), 4, 2),
    "two_layers_bidirectional": (dict(num_layers=2, bidirectional=True), 4, 2),
    "batch_first_no_bias": (dict(batch_first=True, bias=False), 3, 2),
}
LSTM_INPUT, LSTM_HIDDEN = 4, 3


def _lstm_arrays(layer, t, n, rng):
    """x, h0, c0, dy, dhy, dcy for ``layer``, float64."""
    cfg = layer.config
    ld = cfg.num_layers * cfg.num_directions
    x = rng.standard_normal((n, t, LSTM_INPUT) if cfg.batch_first else (t, n, LSTM_INPUT))
    h0 = 0.5 * rng.standard_normal((ld, n, cfg.out_size))
    c0 = 0.5 * rng.standard_normal((ld, n, cfg.hidden_size))
    y_shape = x.shape[:2] + (cfg.num_directions * cfg.out_size,)
    return (x, h0, c0, rng.standard_normal(y_shape), rng.standard_normal(h0.shape),
            rng.standard_normal(c0.shape))


@pytest.mark.parametrize("name", LSTM_CASES)
def test_lstm_layer_matches_pytorch(name, rng):
    torch = pytest.importorskip("torch")
    kw, t, n = LSTM_CASES[name]
    layer = LSTM(LSTM_INPUT, LSTM_HIDDEN, **kw, dtype=np.float64, rng=rng)
    x, h0, c0, dy, dhy, dcy = _lstm_arrays(layer, t, n, rng)
    module = torch.nn.LSTM(LSTM_INPUT, LSTM_HIDDEN, **kw).double()
    with torch.no_grad():  # load the layer's weights by PyTorch's names
        for param_name in module._flat_weights_names:
            getattr(module, param_name).copy_(torch.from_numpy(layer.views[param_name]))
    tx, th0, tc0 = (torch.tensor(a, requires_grad=True) for a in (x, h0, c0))
    ty, (thy, tcy) = module(tx, (th0, tc0))
    ((ty * torch.from_numpy(dy)).sum() + (thy * torch.from_numpy(dhy)).sum()
     + (tcy * torch.from_numpy(dcy)).sum()).backward()

    y, hy, cy = layer.forward(x, h0, c0)
    dx, dh0, dc0 = layer.backward(dy, dhy, dcy)
    for got, want in [(y, ty), (hy, thy), (cy, tcy), (dx, tx.grad), (dh0, th0.grad),
                      (dc0, tc0.grad)]:
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-10, atol=1e-12)
    dviews = nc.rnn_param_views(layer.config, layer.dw)
    for param_name in module._flat_weights_names:
        np.testing.assert_allclose(dviews[param_name],
                                   getattr(module, param_name).grad.numpy(),
                                   rtol=1e-10, atol=1e-12, err_msg=param_name)


@pytest.mark.parametrize("name", ["one_layer", "projection"])
def test_lstm_layer_gradients_match_finite_differences(name, rng):
    kw, t, n = LSTM_CASES[name]
    layer = LSTM(LSTM_INPUT, LSTM_HIDDEN, **kw, dtype=np.float64, rng=rng)
    x, h0, c0, _, _, _ = _lstm_arrays(layer, t, n, rng)
    y, hy, cy = layer.forward(x, h0, c0, training=False)
    targets = [rng.standard_normal(a.shape) for a in (y, hy, cy)]

    def loss():  # nonlinear in every output, so the check is more than an adjoint identity
        outputs = layer.forward(x, h0, c0, training=False)
        return 0.5 * sum(float(np.sum((np.tanh(o) - g) ** 2)) for o, g in zip(outputs, targets))

    outputs = layer.forward(x, h0, c0)
    douts = [(np.tanh(o) - g) * (1 - np.tanh(o) ** 2) for o, g in zip(outputs, targets)]
    dx, dh0, dc0 = layer.backward(*douts)
    h = 1e-6
    for array, grad in [(x, dx), (h0, dh0), (c0, dc0), (layer.w, layer.dw)]:
        v = rng.standard_normal(array.shape)
        array += h * v
        plus = loss()
        array -= 2 * h * v
        minus = loss()
        array += h * v
        assert (plus - minus) / (2 * h) == pytest.approx(np.vdot(grad, v), rel=1e-7)


def test_lstm_reserve_is_allocated_once_and_grown_only_when_needed(rng):
    layer = LSTM(3, 4, rng=rng)
    assert layer.reserve is None
    x = rng.standard_normal((6, 2, 3)).astype(np.float32)
    layer.forward(x)
    reserve = layer.reserve
    assert reserve.size == nc.rnn_reserve_size(layer.config, 6, 2)
    for step in range(3):  # a training loop: same shapes, same reserve
        y, _, _ = layer.forward(x)
        layer.backward(np.ones_like(y))
        assert layer.reserve is reserve
    y, _, _ = layer.forward(x[:4])  # a shorter window fits in it too
    layer.backward(np.ones_like(y))
    assert layer.reserve is reserve
    layer.forward(np.concatenate([x, x]))
    assert layer.reserve is not reserve
    assert layer.reserve.size == nc.rnn_reserve_size(layer.config, 12, 2)


def test_lstm_backward_once_per_training_forward(rng):
    layer = LSTM(2, 3, rng=rng)
    x = rng.standard_normal((3, 1, 2)).astype(np.float32)
    with pytest.raises(RuntimeError, match="call forward"):
        layer.backward(np.zeros((3, 1, 3), np.float32))
    y, _, _ = layer.forward(x)
    layer.backward(np.ones_like(y))
    with pytest.raises(RuntimeError, match="one backward"):
        layer.backward(np.ones_like(y))
    layer.forward(x)
    layer.forward(x, training=False)  # predicting drops what the backward would need
    with pytest.raises(RuntimeError, match="training=True"):
        layer.backward(np.ones_like(y))


def test_lstm_accumulate_adds_micro_batch_gradients(rng):
    layer = LSTM(2, 3, dtype=np.float64, rng=rng)
    x = rng.standard_normal((4, 4, 2))
    dy = rng.standard_normal((4, 4, 3))
    layer.forward(x)
    layer.backward(dy)
    whole = layer.dw.copy()
    layer.forward(x[:, :2])
    layer.backward(dy[:, :2])
    layer.forward(x[:, 2:])
    layer.backward(dy[:, 2:], accumulate=True)
    np.testing.assert_allclose(layer.dw, whole, rtol=1e-12)


def test_lstm_weights_have_pytorch_names_shapes_and_initialisation(rng):
    layer = LSTM(5, 4, proj_size=2, rng=rng)
    assert layer.views["weight_ih_l0"].shape == (16, 5)
    assert layer.views["weight_hh_l0"].shape == (16, 2)
    assert layer.views["weight_hr_l0"].shape == (2, 4)
    assert np.abs(layer.w).max() <= 0.5 and layer.w.dtype == np.float32
    layer.views["bias_ih_l0"][...] = 7  # views write the flat vector the optimiser updates
    assert np.count_nonzero(layer.w == 7) == 16
    assert layer.params()[0] is layer.w and layer.grads()[0] is layer.dw
    assert LSTM(2, 2, rng=3).w.tolist() == LSTM(2, 2, rng=3).w.tolist()
    with pytest.raises(TypeError, match="dtype"):
        LSTM(2, 2, dtype=np.int32)
    with pytest.raises(ValueError, match="proj_size"):
        LSTM(2, 2, proj_size=2)
