"""numbaconv.nn: the Conv and ConvTranspose layers and Adam.

The layers' backward passes are spelled out as plain numbaconv calls (the transposed
convolution's weight gradient as the convolution's with input and output swapped); these
tests hold them to numbaconv's own conv_backward / conv_transpose_backward and to finite
differences of a whole layer in float64.
"""

import numpy as np
import pytest

import numbaconv as nc
from numbaconv.nn import Adam, Conv, ConvTranspose

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
