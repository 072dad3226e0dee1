"""The ``cuda`` backend's recurrent ops under Numba's simulator, against the reference.

Runs only with NUMBA_ENABLE_CUDASIM=1 set before Numba is imported; tests/test_cuda.py runs
this file in such a subprocess, with 4x8 tiles (step 4) and 32 threads per block, so that
GEMM tiles and element-wise blocks are partly filled (T=3, N=3, I=4, H=5).
"""

import os

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") in ("", "0"):
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 (tests/test_cuda.py runs this file so)",
                allow_module_level=True)
pytest.importorskip("numba_cuda")

from numba import cuda  # noqa: E402

import numbaconv as nc  # noqa: E402
from numbaconv.testing import relative_error  # noqa: E402

T, N, I, H = 3, 3, 4, 5
TOL = {"float32": 2e-5, "float64": 1e-11}


def arrays(cfg, dtype, lengths=None, seed=0):
    rng = np.random.default_rng(seed)
    ld, d = cfg.num_layers * cfg.num_directions, cfg.num_directions
    a = dict(x=rng.uniform(-1, 1, (T, N, I)),
             params=nc.rnn_init_params(cfg, seed=seed, dtype=np.float64),
             hx=rng.uniform(-1, 1, (ld, N, H)),
             cx=rng.uniform(-1, 1, (ld, N, H)) if cfg.mode == "lstm" else None,
             dy=rng.uniform(-1, 1, (T, N, d * H)),
             dhy=rng.uniform(-1, 1, (ld, N, H)),
             dcy=rng.uniform(-1, 1, (ld, N, H)) if cfg.mode == "lstm" else None)
    a = {k: (None if v is None else v.astype(dtype)) for k, v in a.items()}
    a["lengths"] = lengths
    return a


def train_step(cfg, a):
    y, hy, cy, reserve = nc.rnn_forward(cfg, a["x"], a["params"], a["hx"], a["cx"],
                                        seq_lengths=a["lengths"], training=True)
    dx, dhx, dcx = nc.rnn_backward_data(cfg, y, a["dy"], a["params"], reserve, hx=a["hx"],
                                        cx=a["cx"], dhy=a["dhy"], dcy=a["dcy"],
                                        seq_lengths=a["lengths"])
    dparams = nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, hx=a["hx"],
                                      seq_lengths=a["lengths"])
    return dict(y=y, hy=hy, cy=cy, dx=dx, dhx=dhx, dcx=dcx, dparams=dparams,
                reserve=reserve)


def host(v):
    return None if v is None else (v if isinstance(v, np.ndarray) else v.copy_to_host())


def device(a):
    return {k: (cuda.to_device(v) if isinstance(v, np.ndarray) and k != "lengths" else v)
            for k, v in a.items()}


def regions(cfg, reserve):
    """The reserve's header and regions without their alignment padding (never written)."""
    layout = nc.problem.rnn_reserve_layout(cfg, T, N)
    parts = [layout.header(reserve)[:6]]
    for layer in range(cfg.num_layers):
        for d in range(cfg.num_directions):
            parts.append(layout.gates(reserve, layer, d).ravel())
            if cfg.mode == "lstm":
                parts.append(layout.cells(reserve, layer, d).ravel())
        parts.append(layout.outputs(reserve, layer).ravel())
    return np.concatenate(parts)


def compare(cfg, dtype, lengths=None):
    a = arrays(cfg, dtype, lengths)
    with nc.use_backend("reference"):
        want = train_step(cfg, a)
    with nc.use_backend("cuda"):
        got = train_step(cfg, device(a))
    want["reserve"] = regions(cfg, want["reserve"])
    got["reserve"] = regions(cfg, host(got["reserve"]))
    for k, w in want.items():
        g = host(got[k])
        if w is None:
            assert g is None, k
            continue
        assert g.dtype == np.dtype(dtype) and g.shape == w.shape, k
        assert relative_error(g, w) < TOL[dtype], (k, relative_error(g, w))
    return a, got


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_single_layer(mode, dtype):
    compare(nc.RNNConfig(mode, I, H), dtype)


@pytest.mark.parametrize("mode, layers", [("lstm", 2), ("gru", 1)])
def test_bidirectional_with_lengths(mode, layers):
    cfg = nc.RNNConfig(mode, I, H, num_layers=layers, bidirectional=True)
    compare(cfg, "float64", lengths=np.array([3, 1, 2]))


def test_no_bias_and_lengths_float32():
    compare(nc.RNNConfig("gru", I, H, bias=False), "float32", lengths=np.array([2, 3, 1]))


def test_inference_forward_and_default_states():
    cfg = nc.RNNConfig("lstm", I, H, num_layers=2)
    a = arrays(cfg, "float64")
    with nc.use_backend("reference"):
        want = nc.rnn_forward(cfg, a["x"], a["params"])
    with nc.use_backend("cuda"):
        d = device(a)
        got = nc.rnn_forward(cfg, d["x"], d["params"])
    assert got[3] is None
    for w, g in zip(want[:3], got[:3]):
        assert relative_error(host(g), w) < TOL["float64"]


def test_reserves_are_interchangeable_with_cpu():
    """A reserve filled by the cuda forward is differentiated by the cpu backward, and the
    other way round, with the same results."""
    cfg = nc.RNNConfig("gru", I, H, bidirectional=True)
    a = arrays(cfg, "float64", lengths=np.array([1, 3, 2]))
    with nc.use_backend("cuda"):
        d = device(a)
        _, _, _, reserve = nc.rnn_forward(cfg, d["x"], d["params"], d["hx"],
                                          seq_lengths=a["lengths"], training=True)
    with nc.use_backend("cpu"):
        _, _, _, cpu_reserve = nc.rnn_forward(cfg, a["x"], a["params"], a["hx"],
                                              seq_lengths=a["lengths"], training=True)
    assert relative_error(regions(cfg, reserve.copy_to_host()),
                          regions(cfg, cpu_reserve)) < 1e-11


def test_weight_gradient_is_deterministic_and_accumulates():
    cfg = nc.RNNConfig("rnn_tanh", I, H)
    a = arrays(cfg, "float32")
    runs = []
    for _ in range(2):
        with nc.use_backend("cuda"):
            got = train_step(cfg, device(a))
        runs.append(host(got["dparams"]))
    assert np.array_equal(runs[0], runs[1])
    start = np.random.default_rng(1).uniform(-1, 1, cfg.num_params).astype(np.float32)
    out = cuda.to_device(start)
    with nc.use_backend("cuda"):
        d = device(a)
        _, _, _, reserve = nc.rnn_forward(cfg, d["x"], d["params"], d["hx"], d["cx"],
                                          training=True)
        nc.rnn_backward_data(cfg, cuda.to_device(np.zeros((T, N, H), np.float32)), d["dy"],
                             d["params"], reserve, hx=d["hx"], cx=d["cx"], dhy=d["dhy"],
                             dcy=d["dcy"])
        back = nc.rnn_backward_weights(cfg, d["x"], d["params"], reserve, hx=d["hx"],
                                       out=out, accumulate=True)
    assert back is out
    assert relative_error(out.copy_to_host(), start + runs[0]) < 1e-5


def test_declines_what_it_does_not_implement():
    from numbaconv import dispatch
    from numbaconv.rnn import rnn_problem
    backend = dispatch.get_backend("cuda")
    x = cuda.to_device(np.zeros((T, N, I), np.float32))
    for cfg, word in ((nc.RNNConfig("lstm", I, H, proj_size=2), "proj_size"),
                      (nc.RNNConfig("gru", I, H, batch_first=True), "batch_first"),
                      (nc.RNNConfig("gru", I, H, num_layers=2, dropout=0.5), "dropout")):
        params = cuda.to_device(np.zeros(cfg.num_params, np.float32))
        problem = rnn_problem("rnn_forward", cfg, x, params, training=True)
        assert word in backend.supports("rnn_forward", problem)
