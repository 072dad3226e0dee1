"""RNN semantics: against PyTorch (every mode x feature, float32 and float64), gradients
against finite differences in float64 (dropout included, with a fixed seed), the parameter
layout, the reserve protocol, dropout statistics, and cpu against reference.

Every test that takes the ``backend`` fixture runs once per built-in CPU backend.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numbaconv as nc
from numbaconv.testing import relative_error

import background

rnn_oracle = pytest.importorskip("rnn_oracle")
from rnn_oracle import (FD_FEATURES, FEATURES, HIDDEN, INPUT, LENGTHS,  # noqa: E402
                        MODES, N, PROJ, T, make_arrays, make_spec, torch_forward_backward,
                        torch_param_count, torch_param_shapes)

pytestmark = pytest.mark.filterwarnings(
    "ignore:LSTM with projections is not supported with oneDNN")

BACKENDS = ("reference", "cpu")
TOL = {"float32": 1e-4, "float64": 1e-10}


@pytest.fixture(params=BACKENDS)
def backend(request):
    with nc.use_backend(request.param):
        yield request.param


def train_step(cfg, a, *, dropout_seed=None, reserve=None):
    """Training forward, backward_data, backward_weights: numbaconv's side of the oracle."""
    y, hy, cy, reserve = nc.rnn_forward(cfg, a["x"], a["params"], a["hx"], a["cx"],
                                        seq_lengths=a["lengths"], training=True,
                                        dropout_seed=dropout_seed, reserve=reserve)
    dx, dhx, dcx = nc.rnn_backward_data(cfg, y, a["dy"], a["params"], reserve, hx=a["hx"],
                                        cx=a["cx"], dhy=a["dhy"], dcy=a["dcy"],
                                        seq_lengths=a["lengths"])
    dparams = nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, hx=a["hx"],
                                      seq_lengths=a["lengths"])
    return {"y": y, "hy": hy, "cy": cy, "dx": dx, "dhx": dhx, "dcx": dcx,
            "dparams": dparams, "reserve": reserve}


def forward(cfg, a, **kw):
    return nc.rnn_forward(cfg, a["x"], a["params"], a["hx"], a["cx"],
                          seq_lengths=a["lengths"], **kw)


# --- against PyTorch ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_forward_and_gradients_match_pytorch(backend, mode, feature, dtype):
    spec = make_spec(mode, feature)
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, dtype)
    inputs = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in a.items()}
    want = torch_forward_backward(spec, a, dtype)
    got = train_step(cfg, a)
    tol = TOL[dtype]
    for key in ("y", "hy", "dx", "dhx"):
        assert got[key].dtype == np.dtype(dtype), key
        assert got[key].shape == want[key].shape, (key, got[key].shape, want[key].shape)
        assert relative_error(got[key], want[key]) < tol, (key, relative_error(got[key],
                                                                               want[key]))
    if spec.is_lstm:
        for key in ("cy", "dcx"):
            assert got[key].shape == want[key].shape, key
            assert relative_error(got[key], want[key]) < tol, key
    else:
        assert got["cy"] is None and got["dcx"] is None
    assert got["dparams"].shape == (cfg.num_params,)
    assert got["dparams"].dtype == np.dtype(dtype)
    views = nc.rnn_param_views(cfg, got["dparams"])
    assert set(views) == set(want["grads"])
    for name, g in want["grads"].items():
        assert views[name].shape == g.shape, name
        assert relative_error(views[name], g) < tol, (name, relative_error(views[name], g))
    # Training with dropout = 0 and inference agree exactly in what they return.
    y, hy, cy, reserve = forward(cfg, a)
    assert reserve is None
    np.testing.assert_allclose(y, got["y"], rtol=tol, atol=0)
    np.testing.assert_allclose(hy, got["hy"], rtol=tol, atol=0)
    # Nothing the caller passed in was written.
    for k, v in inputs.items():
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(a[k], v, err_msg=k)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_inference_with_dropout_matches_pytorch_eval(backend, mode):
    """training=False ignores dropout, like torch's eval()."""
    spec = make_spec(mode, "everything")
    spec = type(spec)(spec.name, spec.mode, {**spec.kwargs, "dropout": 0.5}, spec.lengths,
                      spec.initial_state)
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, "float64")
    want = torch_forward_backward(spec, a, "float64")
    y, hy, cy, reserve = forward(cfg, a, dropout_seed=3)
    assert reserve is None
    assert relative_error(y, want["y"]) < 1e-10
    assert relative_error(hy, want["hy"]) < 1e-10
    if spec.is_lstm:
        assert relative_error(cy, want["cy"]) < 1e-10


@pytest.mark.parametrize("mode", sorted(MODES))
def test_padding_is_zero_and_ignored(backend, mode):
    """y and dx are zero past each sequence's end; dy there changes nothing."""
    spec = make_spec(mode, "everything")
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, "float64")
    got = train_step(cfg, a)
    past = np.arange(T)[:, None] >= np.asarray(LENGTHS)[None, :]      # (T, N)
    if spec.batch_first:
        past = past.T
    assert np.all(got["y"][past] == 0)
    assert np.all(got["dx"][past] == 0)
    a2 = dict(a, dy=a["dy"].copy())
    a2["dy"][past] = 1e3
    again = train_step(cfg, a2)
    for key in ("dx", "dhx", "dparams") + (("dcx",) if spec.is_lstm else ()):
        np.testing.assert_allclose(again[key], got[key], rtol=1e-12, atol=1e-14, err_msg=key)


def test_full_lengths_equal_no_lengths(backend):
    spec = make_spec("lstm_proj", "everything")
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, "float64")
    a["lengths"] = None
    plain = train_step(cfg, a)
    for lengths in ([T] * N, np.full(N, T, dtype=np.int32)):
        full = train_step(cfg, dict(a, lengths=lengths))
        for key in ("y", "hy", "cy", "dx", "dhx", "dcx", "dparams"):
            np.testing.assert_allclose(full[key], plain[key], rtol=1e-12, atol=1e-14,
                                       err_msg=key)


def test_seq_lengths_accepts_array_likes(backend):
    spec = make_spec("gru", "lengths")
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, "float64")
    base = train_step(cfg, a)
    for lengths in (list(LENGTHS), tuple(LENGTHS), np.array(LENGTHS, dtype=np.int32),
                    np.array(LENGTHS, dtype=np.int64)):
        got = train_step(cfg, dict(a, lengths=lengths))
        for key in ("y", "hy", "dx", "dhx", "dparams"):
            np.testing.assert_array_equal(got[key], base[key], err_msg=key)


def test_none_states_are_zeros(backend):
    """hx/cx None mean zeros; dhy/dcy None mean zero gradients."""
    spec = make_spec("lstm", "two_layers")
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, "float64")
    zeros = dict(a, hx=np.zeros_like(a["hx"]), cx=np.zeros_like(a["cx"]),
                 dhy=np.zeros_like(a["dhy"]), dcy=np.zeros_like(a["dcy"]))
    nones = dict(a, hx=None, cx=None, dhy=None, dcy=None)
    z, n = train_step(cfg, zeros), train_step(cfg, nones)
    for key in ("y", "hy", "cy", "dx", "dhx", "dcx", "dparams"):
        np.testing.assert_allclose(n[key], z[key], rtol=1e-13, atol=1e-15, err_msg=key)


def test_non_contiguous_and_read_only_inputs(backend):
    spec = make_spec("lstm_proj", "everything")
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, "float64")
    base = train_step(cfg, a)

    def odd(v):
        if v is None or not isinstance(v, np.ndarray) or v.ndim < 2:
            return v
        # Same values, Fortran order (non-contiguous in C sense), read-only.
        f = np.asfortranarray(v)
        f.setflags(write=False)
        return f

    b = {k: odd(v) for k, v in a.items()}
    strided = np.zeros(2 * cfg.num_params)
    strided[::2] = a["params"]
    b["params"] = strided[::2]
    b["params"].setflags(write=False)
    got = train_step(cfg, b)
    for key in ("y", "hy", "cy", "dx", "dhx", "dcx", "dparams"):
        np.testing.assert_allclose(got[key], base[key], rtol=1e-13, atol=1e-15, err_msg=key)
    # Byte-swapped (non-native) arrays are the same dtype, read correctly.
    swapped = {k: (v.astype(v.dtype.newbyteorder()) if isinstance(v, np.ndarray) and v.ndim
                   and v.dtype.kind == "f" else v) for k, v in a.items()}
    got = train_step(cfg, swapped)
    for key in ("y", "hy", "cy", "dx", "dhx", "dcx", "dparams"):
        np.testing.assert_allclose(got[key], base[key], rtol=1e-13, atol=1e-15, err_msg=key)


# --- finite differences -------------------------------------------------------------------

def directional_check(loss, grad, value, rng, what, h=1e-6, directions=2):
    """<grad, v> against the central difference of loss along random directions v."""
    for _ in range(directions):
        v = rng.standard_normal(value.shape)
        saved = value.copy()
        value += h * v
        plus = loss()
        value[...] = saved - h * v
        minus = loss()
        value[...] = saved
        numeric = (plus - minus) / (2 * h)
        analytic = float(np.sum(grad * v))
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (what, numeric,
                                                                             analytic)


@pytest.mark.parametrize("feature", sorted(FD_FEATURES))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_gradients_match_finite_differences(backend, mode, feature):
    spec = make_spec(mode, feature, FD_FEATURES)
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, "float64", seed=5)
    seed = 11

    def loss():
        y, hy, cy, _ = forward(cfg, a, training=True, dropout_seed=seed)
        total = np.sum(y * a["dy"]) + np.sum(hy * a["dhy"])
        if cy is not None:
            total += np.sum(cy * a["dcy"])
        return float(total)

    got = train_step(cfg, a, dropout_seed=seed)
    rng = np.random.default_rng(0)
    directional_check(loss, got["dx"], a["x"], rng, "x")
    directional_check(loss, got["dparams"], a["params"], rng, "params")
    directional_check(loss, got["dhx"], a["hx"], rng, "hx")
    if spec.is_lstm:
        directional_check(loss, got["dcx"], a["cx"], rng, "cx")
    if not spec.kwargs.get("dropout"):
        return  # PyTorch checks each tensor's gradient separately; with dropout only we can.
    # Each parameter tensor on its own, so a wrong gradient in a small tensor (a bias, the
    # reverse direction's projection) is not hidden by large ones.
    views = nc.rnn_param_views(cfg, a["params"])
    grads = nc.rnn_param_views(cfg, got["dparams"])
    for name, view in views.items():
        directional_check(loss, grads[name], view, rng, name, directions=1)


# --- dropout ------------------------------------------------------------------------------

def dropout_probe(p, dtype=np.float64, T_=40, N_=16, H=8):
    """A 2-layer relu RNN whose output is exactly layer 1's dropout mask / (1 - p).

    Layer 0 outputs relu(bias) = 1 everywhere; layer 1 is the identity on its input."""
    cfg = nc.RNNConfig("rnn_relu", 4, H, num_layers=2, dropout=p)
    params = np.zeros(cfg.num_params, dtype)
    views = nc.rnn_param_views(cfg, params)
    views["bias_ih_l0"][:] = 1
    views["weight_ih_l1"][:] = np.eye(H)
    x = np.random.default_rng(0).standard_normal((T_, N_, 4)).astype(dtype)
    return cfg, x, params


@pytest.mark.parametrize("p", [0.25, 0.6])
def test_dropout_is_inverted_with_rate_p(backend, p):
    cfg, x, params = dropout_probe(p)
    y, _, _, _ = nc.rnn_forward(cfg, x, params, training=True, dropout_seed=1)
    kept = y != 0
    assert abs(1 - kept.mean() - p) < 0.03, 1 - kept.mean()
    np.testing.assert_allclose(y[kept], 1 / (1 - p), rtol=1e-12)
    y_eval, _, _, _ = nc.rnn_forward(cfg, x, params, training=False, dropout_seed=1)
    np.testing.assert_array_equal(y_eval, 1.0)


def test_dropout_seed_reproducible_and_seeds_differ(backend):
    spec = make_spec("lstm", "everything_dropout", FD_FEATURES)
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, "float32")
    first = train_step(cfg, a, dropout_seed=123)
    second = train_step(cfg, a, dropout_seed=123)
    for key in ("y", "hy", "cy", "dx", "dhx", "dcx", "dparams"):
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    other = train_step(cfg, a, dropout_seed=124)
    assert not np.array_equal(first["y"], other["y"])
    inference, hy_eval, cy_eval, _ = forward(cfg, a, training=False)
    assert not np.array_equal(first["y"], inference)
    # Dropout sits between layers only: layer 0 (both directions) sees x undropped, so its
    # final states do not depend on the seed and equal inference's.
    D = cfg.num_directions
    for key, want in (("hy", hy_eval), ("cy", cy_eval)):
        np.testing.assert_allclose(first[key][:D], want[:D], rtol=1e-5, atol=1e-6,
                                   err_msg=key)
        np.testing.assert_array_equal(first[key][:D], other[key][:D], err_msg=key)


def test_dropout_masks_also_apply_to_backward(backend):
    """With the probe, dx is zero (layer 0 ignores x) and the weight gradient of layer 1
    only sees kept inputs: grad weight_ih_l1 = sum over (t, n) of dy outer (mask / (1-p))."""
    p = 0.5
    cfg, x, params = dropout_probe(p, T_=6, N_=4, H=3)
    y, hy, _, reserve = nc.rnn_forward(cfg, x, params, training=True, dropout_seed=9)
    dy = np.random.default_rng(1).standard_normal(y.shape)
    dx, _, _ = nc.rnn_backward_data(cfg, y, dy, params, reserve)
    assert np.all(dx == 0)
    dparams = nc.rnn_backward_weights(cfg, x, params, reserve)
    g = nc.rnn_param_views(cfg, dparams)
    # relu'(.) = 1 where kept (output 1/(1-p) > 0) and 0 where dropped (output exactly 0).
    kept = (y != 0).astype(float)
    layer1_input = y  # = mask / (1 - p), which here equals layer 1's output
    expected = np.einsum("tnh,tnk->hk", dy * kept, layer1_input)
    np.testing.assert_allclose(g["weight_ih_l1"], expected, rtol=1e-10, atol=1e-12)


# --- parameters and configuration ---------------------------------------------------------

CONFIG_KWARGS = [
    ("rnn_tanh", {}), ("rnn_relu", {"num_layers": 3, "bias": False}),
    ("lstm", {"bidirectional": True}), ("lstm", {"proj_size": PROJ, "num_layers": 2}),
    ("lstm", {"proj_size": 1, "num_layers": 2, "bidirectional": True, "bias": False}),
    ("gru", {"num_layers": 2, "bidirectional": True}),
]


@pytest.mark.parametrize("mode,kwargs", CONFIG_KWARGS)
def test_config_properties_and_layout_match_pytorch(mode, kwargs):
    cfg = nc.RNNConfig(mode, INPUT, HIDDEN, **kwargs)
    assert cfg.num_params == torch_param_count(mode, kwargs)
    assert cfg.num_directions == (2 if kwargs.get("bidirectional") else 1)
    assert cfg.out_size == (kwargs.get("proj_size", 0) or HIDDEN)
    assert cfg.gates == {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3}[mode]
    same = nc.RNNConfig(mode, INPUT, HIDDEN, **kwargs)
    assert cfg == same and hash(cfg) == hash(same)
    assert {cfg: 1}[same] == 1
    assert cfg != nc.RNNConfig(mode, INPUT, HIDDEN + 1, **kwargs)
    with pytest.raises(AttributeError):
        cfg.hidden_size = 7
    # Layout: PyTorch's _flat_weights_names order, each tensor C-contiguous with torch's shape.
    flat = np.arange(cfg.num_params, dtype=np.float64)
    views = nc.rnn_param_views(cfg, flat)
    shapes = torch_param_shapes(mode, kwargs)
    assert set(views) == {name for name, _ in shapes}
    offset = 0
    for name, shape in shapes:
        v = views[name]
        assert v.shape == shape, (name, v.shape, shape)
        assert v.flags.c_contiguous and np.shares_memory(v, flat), name
        size = int(np.prod(shape))
        np.testing.assert_array_equal(v.ravel(), np.arange(offset, offset + size), name)
        offset += size
    assert offset == cfg.num_params


def test_param_views_write_through():
    cfg = nc.RNNConfig("lstm", INPUT, HIDDEN, proj_size=PROJ, bidirectional=True)
    for dtype in (np.float32, np.float64):
        flat = np.zeros(cfg.num_params, dtype)
        views = nc.rnn_param_views(cfg, flat)
        assert all(v.dtype == dtype for v in views.values())
        views["weight_hr_l0_reverse"][1, 0] = 5
        views["bias_hh_l0"][:] = 2
        assert flat.sum() == 5 + 2 * 4 * HIDDEN
        flat[:] = 3
        assert np.all(views["weight_ih_l0"] == 3)


@pytest.mark.parametrize("mode,kwargs", CONFIG_KWARGS[:4])
def test_init_params_range_and_determinism(mode, kwargs):
    cfg = nc.RNNConfig(mode, 8, 16, **kwargs)
    p = nc.rnn_init_params(cfg, seed=3)
    assert p.shape == (cfg.num_params,) and p.dtype == np.float32
    bound = 1 / np.sqrt(16)
    assert np.all(np.abs(p) <= bound * (1 + 1e-6))
    assert p.max() > 0.9 * bound and p.min() < -0.9 * bound
    assert abs(p.mean()) < 0.15 * bound
    np.testing.assert_array_equal(p, nc.rnn_init_params(cfg, seed=3))
    assert not np.array_equal(p, nc.rnn_init_params(cfg, seed=4))
    p64 = nc.rnn_init_params(cfg, seed=3, dtype=np.float64)
    assert p64.dtype == np.float64 and p64.shape == p.shape
    assert np.all(np.abs(p64) <= bound)
    assert nc.rnn_init_params(cfg).shape == p.shape


def test_reserve_size_grows_with_length_and_batch():
    for mode, kwargs in CONFIG_KWARGS:
        cfg = nc.RNNConfig(mode, INPUT, HIDDEN, **kwargs)
        size = nc.rnn_reserve_size(cfg, T, N)
        assert int(size) == size and size > 0
        assert nc.rnn_reserve_size(cfg, T + 1, N) > size
        assert nc.rnn_reserve_size(cfg, T, N + 1) > size
        assert nc.rnn_reserve_size(cfg, 2 * T, 2 * N) > nc.rnn_reserve_size(cfg, T + 1, N + 1)


# --- reserve, out=, accumulate= -----------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_new_and_preallocated_reserve(backend, dtype):
    spec = make_spec("lstm_proj", "everything_dropout", FD_FEATURES)
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, dtype)
    fresh = train_step(cfg, a, dropout_seed=4)
    size = nc.rnn_reserve_size(cfg, T, N)
    r = fresh["reserve"]
    assert isinstance(r, np.ndarray) and r.ndim == 1 and r.size == size
    assert r.dtype == np.dtype(dtype)
    for buffer in (np.empty(size, dtype), np.full(size + 37, np.nan, dtype)):
        # Reused across iterations of a training loop, as cuDNN users do.
        for _ in range(2):
            got = train_step(cfg, a, dropout_seed=4, reserve=buffer)
            assert got["reserve"] is buffer
            for key in ("y", "hy", "cy", "dx", "dhx", "dcx", "dparams"):
                np.testing.assert_array_equal(got[key], fresh[key], err_msg=key)


def test_backward_weights_out_and_accumulate(backend):
    spec = make_spec("gru", "everything")
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, "float64")
    y, hy, _, reserve = forward(cfg, a, training=True)
    nc.rnn_backward_data(cfg, y, a["dy"], a["params"], reserve, hx=a["hx"], dhy=a["dhy"],
                         seq_lengths=a["lengths"])
    kw = dict(hx=a["hx"], seq_lengths=a["lengths"])
    dparams = nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, **kw)
    # It only reads the reserve: calling it again gives the same answer.
    np.testing.assert_array_equal(
        nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, **kw), dparams)
    out = np.full(cfg.num_params, 7.0)
    result = nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, **kw, out=out)
    assert result is out
    np.testing.assert_array_equal(out, dparams)
    out = np.full(cfg.num_params, 2.0)
    result = nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, **kw, out=out,
                                     accumulate=True)
    assert result is out
    np.testing.assert_allclose(out, dparams + 2.0, rtol=1e-14, atol=1e-15)
    # Strided out is written in place too.
    storage = np.zeros(2 * cfg.num_params)
    strided = storage[::2]
    assert nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, **kw,
                                   out=strided) is strided
    np.testing.assert_array_equal(strided, dparams)
    assert np.all(storage[1::2] == 0)
    storage[:] = 1.0
    assert nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, **kw, out=strided,
                                   accumulate=True) is strided
    np.testing.assert_allclose(strided, dparams + 1.0, rtol=1e-14, atol=1e-15)
    assert np.all(storage[1::2] == 1.0)


def test_reserve_protocol(backend):
    spec = make_spec("lstm", "two_layers")
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, "float32")
    kw_w = dict(hx=a["hx"])
    kw_d = dict(hx=a["hx"], cx=a["cx"], dhy=a["dhy"], dcy=a["dcy"])
    y, _, _, reserve = forward(cfg, a, training=True)
    # backward_weights needs backward_data first.
    with pytest.raises(ValueError, match="reserve"):
        nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, **kw_w)
    nc.rnn_backward_data(cfg, y, a["dy"], a["params"], reserve, **kw_d)
    # backward_data consumed the reserve: a second call is an error.
    with pytest.raises(ValueError, match="reserve"):
        nc.rnn_backward_data(cfg, y, a["dy"], a["params"], reserve, **kw_d)
    first = nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, **kw_w)
    second = nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, **kw_w)
    np.testing.assert_array_equal(first, second)
    # Inference makes no reserve; backward without one names it.
    y, _, _, none = forward(cfg, a, training=False)
    assert none is None
    with pytest.raises(ValueError, match="reserve"):
        nc.rnn_backward_data(cfg, y, a["dy"], a["params"], None, **kw_d)
    with pytest.raises(ValueError, match="reserve"):
        nc.rnn_backward_weights(cfg, a["x"], a["params"], None, **kw_w)
    # A new training forward re-arms the same buffer.
    y, _, _, again = forward(cfg, a, training=True, reserve=reserve)
    assert again is reserve
    nc.rnn_backward_data(cfg, y, a["dy"], a["params"], reserve, **kw_d)
    np.testing.assert_array_equal(
        nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, **kw_w), first)


def test_explain_names_the_backend(backend):
    spec = make_spec("lstm_proj", "everything")
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, "float32")
    choice = nc.explain("rnn_forward", cfg, a["x"], a["params"])
    assert choice.backend == backend
    choice = nc.explain("rnn_forward", cfg, a["x"], a["params"], a["hx"], a["cx"],
                        seq_lengths=a["lengths"], training=True, dropout_seed=1)
    assert choice.backend == backend
    y, _, _, reserve = forward(cfg, a, training=True)
    kw = dict(hx=a["hx"], cx=a["cx"], dhy=a["dhy"], dcy=a["dcy"], seq_lengths=a["lengths"])
    choice = nc.explain("rnn_backward_data", cfg, y, a["dy"], a["params"], reserve, **kw)
    assert choice.backend == backend
    # explain computes nothing, so the reserve is still unconsumed.
    nc.rnn_backward_data(cfg, y, a["dy"], a["params"], reserve, **kw)
    choice = nc.explain("rnn_backward_weights", cfg, a["x"], a["params"], reserve,
                        hx=a["hx"], seq_lengths=a["lengths"])
    assert choice.backend == backend


# --- cpu against reference ----------------------------------------------------------------

def both_backends(cfg, a, seed):
    results = {}
    for name in BACKENDS:
        with nc.use_backend(name):
            results[name] = train_step(cfg, a, dropout_seed=seed)
    return results


@pytest.mark.parametrize("steps", ["chains", "chains, weights as MR side", "batch chains",
                                   "parallel steps", "parallel steps, weights as MR side"])
@pytest.mark.parametrize("dropout", [0.0, 0.35])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_cpu_matches_reference_with_every_feature(mode, dropout, steps, monkeypatch):
    """The bidirectional problem runs each direction as a chain of steps on a tile worker,
    its products with the weights packed as the micro-kernel's NR side (chains of a few
    rows, as these are), or as its MR side (chains of NR rows); "batch chains" also cuts the
    batch into chains (as a batch of more than 16 rows does in float32 with AVX2); "parallel
    steps" runs the chains one after another with the step kernels' parallel compilations,
    which a single chain of real size runs (N * gate width >= PARALLEL_MIN_ELEMENTS) and
    these small ones would not: the GRU's backward step once left its n-gate gradient
    unwritten there."""
    from numbaconv.cpu import _rnn_cells, rnn_forward
    if steps.endswith("weights as MR side"):
        monkeypatch.setattr(rnn_forward, "weights_as_columns", lambda rows, dtype: False)
    if steps == "batch chains":
        monkeypatch.setattr(rnn_forward, "chain_rows", lambda dtype: 2)
        assert len(rnn_forward.batch_chains(3, np.float64)) == 2
    if steps.startswith("parallel steps"):
        monkeypatch.setattr(rnn_forward, "share_chains", lambda chains: False)
        monkeypatch.setattr(_rnn_cells, "PARALLEL_MIN_ELEMENTS", 0)
    check_cpu_against_reference(mode, dropout)


def test_small_batches_step_in_two_chains_in_all():
    """A batch narrower than a tile's columns is still cut into two chains (a single chain
    would step with a barrier among the threads at every step), in all: two directions are
    two chains already. The cut follows the shape alone."""
    from numbaconv.cpu import rnn_forward
    nr = rnn_forward.chain_rows(np.float32)
    assert rnn_forward.batch_chains(8, np.float32) == [(0, 4), (4, 8)]
    assert rnn_forward.batch_chains(8, np.float32, 2) == [(0, 8)]
    assert rnn_forward.batch_chains(1, np.float32) == [(0, 1)]
    assert len(rnn_forward.batch_chains(2 * nr, np.float32)) == 2
    assert len(rnn_forward.batch_chains(3 * nr, np.float32, 2)) == 3


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_chain_loops_give_the_bits_of_stepping_from_python(mode, dtype, monkeypatch):
    """The chains' steps in Numba loops (:mod:`numbaconv.cpu._rnn_chains`, blocks of a few
    steps) give the outputs and gradients of the same kernels stepped from Python, bit for
    bit: bidirectional, three layers, dropout, variable lengths, chains of a few rows
    (STEP_BLOCK lowered so that a call runs several blocks). The LSTM with projections
    steps from Python either way."""
    from numbaconv.cpu import _rnn_chains, rnn_forward
    monkeypatch.setattr(_rnn_chains, "STEP_BLOCK", 2)
    monkeypatch.setattr(rnn_forward, "chain_rows", lambda dtype: 2)
    spec = make_spec(mode, "everything")
    spec = type(spec)(spec.name, spec.mode, {**spec.kwargs, "dropout": 0.35, "num_layers": 3},
                      spec.lengths, spec.initial_state)
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, dtype, seed=4)
    ran = []
    chains = _rnn_chains.by_steps
    monkeypatch.setattr(_rnn_chains, "by_steps", lambda view: ran.append(1) or chains(view))
    looped = train_step(cfg, a, dropout_seed=5)
    assert ran
    monkeypatch.setattr(_rnn_chains, "by_steps", lambda view: None)
    stepped = train_step(cfg, a, dropout_seed=5)
    for key in ("y", "hy", "cy", "dx", "dhx", "dcx", "dparams"):
        if stepped[key] is None:
            assert looped[key] is None, key
        else:
            np.testing.assert_array_equal(looped[key], stepped[key], err_msg=key)


def test_by_steps_takes_views_whose_steps_are_contiguous_blocks():
    from numbaconv.cpu._rnn_chains import by_steps
    gates = np.arange(5 * 6 * 8, dtype=np.float32).reshape(5, 6, 8)
    flat, step = by_steps(gates[:, 2:4])
    assert step == 48 and flat[0] == gates[0, 2, 0] and flat[-1] == gates[-1, 3, -1]
    np.testing.assert_array_equal(flat[3 * step:3 * step + 16].reshape(2, 8), gates[3, 2:4])
    flat[step] = -1                                    # a view: writes reach the array
    assert gates[1, 2, 0] == -1
    for view in (gates[:, :, :4], gates[:, ::2], gates[::-1], gates[:0]):
        assert by_steps(view) is None


def check_cpu_against_reference(mode, dropout):
    spec = make_spec(mode, "everything")
    spec = type(spec)(spec.name, spec.mode, {**spec.kwargs, "dropout": dropout, "num_layers": 3},
                      spec.lengths, spec.initial_state)
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, "float64", seed=8)
    r = both_backends(cfg, a, seed=21)
    for key in ("y", "hy", "cy", "dx", "dhx", "dcx", "dparams"):
        if r["reference"][key] is None:
            assert r["cpu"][key] is None, key
            continue
        err = relative_error(r["cpu"][key], r["reference"][key])
        assert err < 1e-12, (key, err)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nan_propagates_like_the_reference():
    """fastmath without nnan/ninf: a NaN in x reaches the same outputs and gradients."""
    spec = make_spec("lstm_proj", "everything")
    cfg = spec.config()
    a = make_arrays(spec, cfg.num_params, "float64", seed=2)
    a["x"][1, 2, 0] = np.nan    # sequence 1 (length 5) at step 2
    a["hx"][0, 0, 1] = np.inf   # layer 0 forward, sequence 0
    r = both_backends(cfg, a, seed=None)
    for key in ("y", "hy", "cy", "dx", "dhx", "dcx", "dparams"):
        ref, cpu = r["reference"][key], r["cpu"][key]
        assert np.isnan(ref).any(), key
        np.testing.assert_array_equal(np.isnan(cpu), np.isnan(ref), err_msg=key)
        np.testing.assert_array_equal(np.isinf(cpu), np.isinf(ref), err_msg=key)
        finite = np.isfinite(ref)
        assert relative_error(cpu[finite], ref[finite]) < 1e-12, key


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(sorted(MODES)), layers=st.integers(1, 2),
       bidirectional=st.booleans(), bias=st.booleans(), batch_first=st.booleans(),
       lengths=st.lists(st.integers(1, 4), min_size=1, max_size=3) | st.none(),
       dtype=st.sampled_from(["float32", "float64"]), seed=st.integers(0, 2**16))
def test_cpu_matches_reference_random_problems(mode, layers, bidirectional, bias,
                                               batch_first, lengths, dtype, seed):
    mode_name, mode_kw = MODES[mode]
    cfg = nc.RNNConfig(mode_name, 2, 3, num_layers=layers, bidirectional=bidirectional,
                       bias=bias, batch_first=batch_first, **mode_kw)
    n = len(lengths) if lengths else 2
    t = max(lengths) if lengths else 3
    rng = np.random.default_rng(seed)
    L, D, out = layers * cfg.num_directions, cfg.num_directions, cfg.out_size
    x = rng.standard_normal((n, t, 2) if batch_first else (t, n, 2)).astype(dtype)
    a = {"x": x, "params": nc.rnn_init_params(cfg, seed=seed, dtype=dtype),
         "hx": rng.standard_normal((L, n, out)).astype(dtype),
         "cx": rng.standard_normal((L, n, 3)).astype(dtype) if mode_name == "lstm" else None,
         "dy": rng.standard_normal(x.shape[:2] + (D * out,)).astype(dtype),
         "dhy": rng.standard_normal((L, n, out)).astype(dtype),
         "dcy": rng.standard_normal((L, n, 3)).astype(dtype) if mode_name == "lstm" else None,
         "lengths": lengths}
    r = both_backends(cfg, a, seed=None)
    tol = 1e-5 if dtype == "float32" else 1e-12
    for key in ("y", "hy", "cy", "dx", "dhx", "dcx", "dparams"):
        if r["reference"][key] is None:
            assert r["cpu"][key] is None, key
            continue
        assert relative_error(r["cpu"][key], r["reference"][key]) < tol, key


BOUNDSCHECK = background.boundscheck(
    "recurrent kernels under NUMBA_BOUNDSCHECK",
    "import test_rnn\n"
    "for mode in sorted(test_rnn.MODES):\n"
    "    test_rnn.check_cpu_against_reference(mode, 0.35)\n")


@BOUNDSCHECK.mark
def test_cpu_kernels_stay_in_bounds_under_numba_boundscheck():
    """Every mode with every feature once more, compiled with NUMBA_BOUNDSCHECK=1."""
    BOUNDSCHECK.result().check()
