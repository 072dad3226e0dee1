"""The ``cuda`` backend's recurrent ops under Numba's simulator, against the reference.

Runs only with NUMBA_ENABLE_CUDASIM=1 set before Numba is imported; tests/test_cuda.py runs
this file in such a subprocess, with 4x8 tiles (step 4) and 32 threads per block, so that
GEMM tiles and element-wise blocks are partly filled (T=3, N=3, I=4, H=5; batch_first
tests use T != N, so that a missed axis swap cannot pass). Every test runs twice: products
on the Numba gemm kernel, and through the cuBLAS mapping (a NumPy stand-in for cuBLAS under
the simulator; see the ``product_path`` fixture).
"""

import os

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") in ("", "0") and \
        os.environ.get("NUMBACONV_TEST_GPU", "0") in ("", "0"):
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 (tests/test_cuda.py runs this file so), or "
                "NUMBACONV_TEST_GPU=1 on a machine with a GPU", allow_module_level=True)
pytest.importorskip("numba_cuda")

from numba import cuda  # noqa: E402

import numbaconv as nc  # noqa: E402
from numbaconv.testing import relative_error  # noqa: E402

import cublas_standin  # noqa: E402

T, N, I, H = 3, 3, 4, 5
#: float16: storage rounding (2**-11 relative) of every gate, state and gradient, summed in
#: float32; measured errors against the float64 reference stay below 1e-3 on these shapes.
TOL = {"float16": 4e-3, "float32": 2e-5, "float64": 1e-11}
SEED = 7  # dropout_seed of every training forward here


SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


#: Tests (by a word of their names) that make no product through the stand-in: float16
#: products take the Numba kernel, and some tests call no product at all.
WITHOUT_PRODUCTS = ("float16", "supports", "elementwise", "reduction_split")


@pytest.fixture(autouse=True, params=["numba", "cublas"])
def product_path(request, monkeypatch):
    """Every test runs its products on two paths (float16 products take the Numba kernel on
    both): the Numba gemm kernel, and the cuBLAS mapping of numbaconv/cuda/_blas.py, with
    cuBLAS itself on a GPU and, under the simulator, the NumPy stand-in of
    tests/cublas_standin.py (every simulated device buffer registered with it, so that it
    resolves the pointers it is given). Yields "numba", "cublas" (a GPU) or the stand-in."""
    from numbaconv.cuda import _blas
    if request.param == "numba":
        previous = _blas.set_binding(None)
        yield "numba"
        _blas.restore(previous)
        return
    if not SIMULATED:
        binding, why = _blas.binding()
        if binding is None:
            pytest.skip(f"cuBLAS did not load: {why}")
        yield "cublas"
        return
    from numba.cuda.simulator.cudadrv import devicearray
    memory = cublas_standin.Memory()
    init = devicearray.FakeCUDAArray.__init__

    def register(self, ary, stream=0):
        init(self, ary, stream)
        memory.register(ary)

    monkeypatch.setattr(devicearray.FakeCUDAArray, "__init__", register)
    from numbaconv.cuda import rnn_forward
    rnn_forward._workspace.__dict__.clear()  # scratch made before registration: made anew
    standin = cublas_standin.StandIn(memory)
    previous = _blas.set_binding(_blas.Cublas(
        "a NumPy stand-in", standin.sgemm, standin.dgemm, standin.create, standin.set_stream,
        standin.set_math_mode, cublas_standin.OP_N, cublas_standin.OP_T,
        cublas_standin.DEFAULT_MATH, cublas_standin.TF32_TENSOR_OP_MATH))
    yield standin
    _blas.restore(previous)
    if not any(word in request.node.name for word in WITHOUT_PRODUCTS):
        assert standin.calls, "no product reached the stand-in"


def arrays(cfg, dtype, lengths=None, seed=0, t_len=T, n=N):
    """Inputs in cfg's layout (batch-first sequences with batch_first), drawn in float64
    and rounded to dtype."""
    rng = np.random.default_rng(seed)
    ld, d, p = cfg.num_layers * cfg.num_directions, cfg.num_directions, cfg.out_size
    hs = cfg.hidden_size

    def seq(features):
        return rng.uniform(-1, 1, (n, t_len, features) if cfg.batch_first
                           else (t_len, n, features))

    a = dict(x=seq(I),
             params=nc.rnn_init_params(cfg, seed=seed, dtype=np.float64),
             hx=rng.uniform(-1, 1, (ld, n, p)),
             cx=rng.uniform(-1, 1, (ld, n, hs)) if cfg.mode == "lstm" else None,
             dy=seq(d * p),
             dhy=rng.uniform(-1, 1, (ld, n, p)),
             dcy=rng.uniform(-1, 1, (ld, n, hs)) if cfg.mode == "lstm" else None)
    a = {k: (None if v is None else v.astype(dtype)) for k, v in a.items()}
    a["lengths"] = lengths
    return a


def forward(cfg, a):
    return nc.rnn_forward(cfg, a["x"], a["params"], a["hx"], a["cx"],
                          seq_lengths=a["lengths"], training=True, dropout_seed=SEED)


def backward_data(cfg, a, y, reserve):
    return nc.rnn_backward_data(cfg, y, a["dy"], a["params"], reserve, hx=a["hx"],
                                cx=a["cx"], dhy=a["dhy"], dcy=a["dcy"],
                                seq_lengths=a["lengths"])


def backward_weights(cfg, a, reserve, **kwargs):
    return nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, hx=a["hx"],
                                   seq_lengths=a["lengths"], **kwargs)


def train_step(cfg, a):
    y, hy, cy, reserve = forward(cfg, a)
    dx, dhx, dcx = backward_data(cfg, a, y, reserve)
    dparams = backward_weights(cfg, a, reserve)
    return dict(y=y, hy=hy, cy=cy, dx=dx, dhx=dhx, dcx=dcx, dparams=dparams,
                reserve=reserve)


def host(v):
    return None if v is None else (v if isinstance(v, np.ndarray) else v.copy_to_host())


def device(a):
    return {k: (cuda.to_device(v) if isinstance(v, np.ndarray) and k != "lengths" else v)
            for k, v in a.items()}


def regions(cfg, reserve, header=True, dproj=True):
    """The reserve's header and regions without their alignment padding (never written);
    dproj only after rnn_backward_data (the forward leaves it unwritten)."""
    t_len, n = int(reserve[2]), int(reserve[3])  # header slots 2 and 3
    layout = nc.problem.rnn_reserve_layout(cfg, t_len, n)
    parts = [layout.header(reserve)[:6]] if header else []
    for layer in range(cfg.num_layers):
        for d in range(cfg.num_directions):
            parts.append(layout.gates(reserve, layer, d).ravel())
            if cfg.mode == "lstm":
                parts.append(layout.cells(reserve, layer, d).ravel())
            if cfg.proj_size and dproj:
                parts.append(layout.dproj(reserve, layer, d).ravel())
        parts.append(layout.outputs(reserve, layer).ravel())
        masks = layout.masks(reserve, layer)
        if masks is not None:
            parts.append(masks.ravel())
    return np.concatenate(parts)


def compare(cfg, dtype, lengths=None, t_len=T, n=N):
    """A training step on cuda (device arrays of dtype) against the reference (float64 for
    float16, which the reference lacks: the same rounded inputs, exact arithmetic)."""
    a = arrays(cfg, dtype, lengths, t_len=t_len, n=n)
    ref = a if dtype != "float16" else \
        {k: (v.astype(np.float64) if isinstance(v, np.ndarray) and k != "lengths" else v)
         for k, v in a.items()}
    with nc.use_backend("reference"):
        want = train_step(cfg, ref)
    with nc.use_backend("cuda"):
        got = train_step(cfg, device(a))
    # float16 headers hold the tags rounded (config and length tags overflow to inf)
    want["reserve"] = regions(cfg, want["reserve"], header=dtype != "float16")
    got["reserve"] = regions(cfg, host(got["reserve"]), header=dtype != "float16")
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
    """Also a strided (non-contiguous) device x, copied once on the device."""
    cfg = nc.RNNConfig("lstm", I, H, num_layers=2)
    a = arrays(cfg, "float64")
    with nc.use_backend("reference"):
        want = nc.rnn_forward(cfg, a["x"], a["params"])
    with nc.use_backend("cuda"):
        d = device(a)
        x = cuda.to_device(np.repeat(a["x"], 2, axis=2))[:, :, ::2]
        assert not x.is_c_contiguous()
        got = nc.rnn_forward(cfg, x, d["params"])
    assert got[3] is None
    for w, g in zip(want[:3], got[:3]):
        assert relative_error(host(g), w) < TOL["float64"]


@pytest.mark.parametrize("cfg, lengths", [
    (nc.RNNConfig("gru", I, H, bidirectional=True), np.array([1, 3, 2])),
    (nc.RNNConfig("lstm", I, H, num_layers=2, dropout=0.5, proj_size=2),
     np.array([2, 3, 1])),
], ids=["gru-bidirectional", "lstm-proj-dropout"])
@pytest.mark.parametrize("product_path", ["cublas"], indirect=True)
def test_reserves_are_interchangeable_with_cpu(product_path, cfg, lengths):
    """A reserve filled by the cuda forward is differentiated by the cpu backward, and the
    other way round, with the same results (the same dropout_seed: the same masks). The
    reserve's layout does not depend on the product path: the cuBLAS one (the simulator's
    Numba products are slow; compare() checks both paths' reserves)."""
    a = arrays(cfg, "float64", lengths=lengths)
    d = device(a)
    with nc.use_backend("cuda"):
        y_cuda, _, _, reserve_cuda = forward(cfg, d)
    with nc.use_backend("cpu"):
        y_cpu, _, _, reserve_cpu = forward(cfg, a)
    assert relative_error(regions(cfg, reserve_cuda.copy_to_host(), dproj=False),
                          regions(cfg, reserve_cpu, dproj=False)) < 1e-11
    # swap: cpu differentiates the cuda forward's reserve, cuda the cpu forward's
    from_cuda = reserve_cuda.copy_to_host()
    from_cpu = cuda.to_device(reserve_cpu)
    with nc.use_backend("cpu"):
        want = backward_data(cfg, a, y_cpu, from_cuda) + \
            (backward_weights(cfg, a, from_cuda),)
    with nc.use_backend("cuda"):
        got = backward_data(cfg, d, y_cuda, from_cpu) + (backward_weights(cfg, d, from_cpu),)
    for name, w, g in zip(("dx", "dhx", "dcx", "dparams"), want, got):
        assert (g is None) == (w is None), name
        if w is not None:
            assert relative_error(host(g), w) < 1e-11, name
    assert relative_error(regions(cfg, from_cpu.copy_to_host()), regions(cfg, from_cuda)) \
        < 1e-11


def test_dropout_masks_follow_the_seed_as_on_cpu():
    """The same dropout_seed gives cuda the cpu's masks, bit for bit, and its results."""
    cfg = nc.RNNConfig("rnn_tanh", I, H, num_layers=3, dropout=0.4)
    a = arrays(cfg, "float32")
    with nc.use_backend("cpu"):
        want = train_step(cfg, a)
    with nc.use_backend("cuda"):
        got = train_step(cfg, device(a))
    layout = nc.problem.rnn_reserve_layout(cfg, T, N)
    reserve = got["reserve"].copy_to_host()
    for layer in (1, 2):
        masks = layout.masks(reserve, layer)
        assert np.array_equal(masks, layout.masks(want["reserve"], layer)), layer
        assert set(np.unique(masks)) == {0.0, np.float32(1 / 0.6)}
    for k in ("y", "hy", "dx", "dhx", "dparams"):
        assert relative_error(host(got[k]), want[k]) < TOL["float32"], k


def test_batch_first_device_arrays():
    """batch_first device arrays are swapped on the device and come back batch-first
    (T = 4 and N = 2 here, so that a missed swap cannot pass)."""
    cfg = nc.RNNConfig("rnn_tanh", I, H, bidirectional=True, batch_first=True)
    a, got = compare(cfg, "float32", lengths=np.array([4, 2]), t_len=4, n=2)
    for k, shape in (("y", (2, 4, 2 * H)), ("dx", (2, 4, I))):
        assert not isinstance(got[k], np.ndarray) and hasattr(got[k], "copy_to_host"), k
        assert tuple(got[k].shape) == shape, k
    with nc.use_backend("cuda"):  # inference returns batch-first too
        d = device(a)
        y = nc.rnn_forward(cfg, d["x"], d["params"], d["hx"], seq_lengths=a["lengths"])[0]
    assert relative_error(y.copy_to_host(), host(got["y"])) < TOL["float32"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_projection(dtype):
    compare(nc.RNNConfig("lstm", I, H, proj_size=2), dtype)


def test_every_feature_at_once():
    """Projection, two layers with dropout, both directions, lengths and batch_first."""
    cfg = nc.RNNConfig("lstm", I, H, num_layers=2, bidirectional=True, dropout=0.5,
                       proj_size=3, batch_first=True)
    compare(cfg, "float64", lengths=np.array([1, 3]), t_len=3, n=2)


@pytest.mark.parametrize("cfg", [
    nc.RNNConfig("lstm", I, H, proj_size=2),
    nc.RNNConfig("gru", I, H),
    nc.RNNConfig("rnn_relu", I, H, bidirectional=True),
], ids=["lstm-proj", "gru", "rnn_relu-bidirectional"])
def test_float16(cfg):
    """float16 storage, float32 accumulation, against the float64 reference."""
    compare(cfg, "float16", lengths=np.array([3, 1, 2]))


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
    # A strided out (every other element of a buffer): accumulated into, and written, in
    # place; the elements between stay untouched.
    buffer = np.full(2 * cfg.num_params, 99.0, np.float32)
    buffer[::2] = start
    base = cuda.to_device(buffer)
    strided = base[::2]
    with nc.use_backend("cuda"):
        back = nc.rnn_backward_weights(cfg, d["x"], d["params"], reserve, hx=d["hx"],
                                       out=strided, accumulate=True)
    assert back is strided
    got = base.copy_to_host()
    assert np.array_equal(got[1::2], buffer[1::2])
    assert relative_error(got[::2], start + runs[0]) < 1e-5
    with nc.use_backend("cuda"):
        nc.rnn_backward_weights(cfg, d["x"], d["params"], reserve, hx=d["hx"], out=strided)
    got = base.copy_to_host()
    assert np.array_equal(got[1::2], buffer[1::2])
    assert np.array_equal(got[::2], runs[0])


def test_supports_every_rnn_feature():
    from numbaconv import dispatch
    from numbaconv.problem import PROBLEM_BUILDERS
    backend = dispatch.get_backend("cuda")
    x = cuda.to_device(np.zeros((T, N, I), np.float16))
    for cfg in (nc.RNNConfig("lstm", I, H, proj_size=2),
                nc.RNNConfig("gru", I, H, batch_first=True),
                nc.RNNConfig("gru", I, H, num_layers=2, dropout=0.5)):
        params = cuda.to_device(np.zeros(cfg.num_params, np.float16))
        problem = PROBLEM_BUILDERS["rnn_forward"](cfg, x, params, training=True)
        assert backend.supports("rnn_forward", problem) is None, cfg


@pytest.mark.parametrize("cfg, lengths", [
    (nc.RNNConfig("lstm", I, H, num_layers=2, bidirectional=True, dropout=0.5, proj_size=3),
     np.array([1, 3, 2])),
    (nc.RNNConfig("gru", I, H, num_layers=2, bidirectional=True, dropout=0.5),
     np.array([3, 2, 3])),
    (nc.RNNConfig("rnn_relu", I, H, num_layers=2, bias=False), None),
], ids=["lstm-every-feature", "gru-every-feature", "rnn_relu-no-bias"])
def test_every_product_goes_through_cublas(product_path, cfg, lengths):
    """With cuBLAS (or its stand-in) loaded, every float32/float64 product of a training
    step, the accumulating weight gradient included, is one cuBLAS gemm: none falls back to
    the Numba kernel. Under the simulator the stand-in also shows every kind of call:
    both transposes of both operands, beta 0 and 1."""
    from numbaconv.cuda import _blas
    before = dict(_blas.counts)
    if product_path == "numba":  # the other way round: every product on the Numba kernel
        a = device(arrays(cfg, "float32", lengths))
        with nc.use_backend("cuda"):
            nc.rnn_forward(cfg, a["x"], a["params"], a["hx"], a["cx"],
                           seq_lengths=lengths)
        assert _blas.counts["cublas"] == before["cublas"]
        assert _blas.counts["numba"] > before["numba"]
        return
    a = arrays(cfg, "float64", lengths)
    d = device(a)
    with nc.use_backend("cuda"):
        got = train_step(cfg, d)
        out = cuda.to_device(np.zeros(cfg.num_params))
        nc.rnn_backward_weights(cfg, d["x"], d["params"], got["reserve"], hx=d["hx"],
                                seq_lengths=lengths, out=out, accumulate=True)
    assert _blas.counts["numba"] == before["numba"]
    assert _blas.counts["cublas"] > before["cublas"]
    if product_path != "cublas":  # the stand-in saw them all
        assert _blas.counts["cublas"] - before["cublas"] == len(product_path.calls)
        kinds = {(call[1], call[2], call[10]) for call in product_path.calls}
        assert {t for t, _, _ in kinds} == {0, 1} and {t for _, t, _ in kinds} == {0, 1}
        assert {beta for _, _, beta in kinds} == {0.0, 1.0}
    with nc.use_backend("reference"):
        want = train_step(cfg, a)
    for k in ("y", "dx", "dhx", "dparams"):
        assert relative_error(host(got[k]), want[k]) < TOL["float64"], k
    assert relative_error(out.copy_to_host(), want["dparams"]) < TOL["float64"]


@pytest.fixture
def persistent():
    """The cuda backend's rnn_forward and rnn_backward_data on the ``persistent`` algorithm,
    whatever was chosen (:func:`numbaconv.testing.algorithm_forced`: ``state["runs"]``
    counts the forced runs, ``state["algorithm"] = None`` stops forcing)."""
    from numbaconv.cuda import CudaBackend
    from numbaconv.testing import algorithm_forced
    with algorithm_forced(CudaBackend, ("rnn_forward", "rnn_backward_data"),
                          "persistent") as state:
        yield state


@pytest.mark.parametrize("cfg, lengths", [
    (nc.RNNConfig("lstm", I, H), None),
    (nc.RNNConfig("gru", I, H, num_layers=2, bidirectional=True), np.array([3, 1, 2])),
    (nc.RNNConfig("rnn_relu", I, H, num_layers=2, dropout=0.5), np.array([2, 3, 3])),
    (nc.RNNConfig("lstm", I, H, proj_size=2, num_layers=2, bidirectional=True),
     np.array([1, 3, 2])),
], ids=["lstm", "gru-bidirectional-lengths", "rnn_relu-dropout-lengths",
        "lstm-proj-bidirectional-lengths"])
def test_persistent_forward_and_data_gradient(product_path, persistent, cfg, lengths):
    """The persistent forward and data gradient (every step of a layer and direction in one
    cooperative launch) against the reference, through a whole training step; on the Numba
    product path the step's results and reserve are the step loops' bit for bit (the same
    sums in the same order): there, the step loops stand for the reference (they are checked
    against it throughout this file), since the simulator's Numba products are slow."""
    if product_path != "numba":
        compare(cfg, "float64", lengths)
        assert persistent["runs"] == 2
        return
    a = arrays(cfg, "float32", lengths, seed=2)
    results = []
    for on in (True, False):
        persistent["algorithm"] = "persistent" if on else None
        with nc.use_backend("cuda"):
            got = {k: host(v) for k, v in train_step(cfg, device(a)).items()}
        got["reserve"] = regions(cfg, got["reserve"])  # without its unwritten padding
        results.append(got)
    assert persistent["runs"] == 2
    for k, want in results[1].items():
        if want is None:
            assert results[0][k] is None, k
        else:
            np.testing.assert_array_equal(results[0][k], want, err_msg=k)


@pytest.mark.parametrize("product_path, mode, t_len, proj", [
    ("numba", "lstm", 3, 0), ("cublas", "lstm", 3, 0), ("cublas", "lstm", 4, 0),
    ("cublas", "gru", 4, 0), ("cublas", "lstm", 3, 3)], indirect=["product_path"])
def test_persistent_loops_walk_several_tiles_a_block(product_path, persistent, mode, t_len,
                                                     proj):
    """More tiles than the cooperative grid's blocks (one block of 32 threads under the
    simulator, 8 x 16 block tiles): N x H = 14 x 5 cells make the forward's LSTM tiles 8
    rows by 4 units of 4 gates (2 x 2 tiles, the block walking them by adding the grid's
    stride with a carry), GRU's 8 rows by 5 units of 3 gates (40 cells, more than a
    thread each), the data gradient's 8 x 16 (4 cells a thread). A block's tile reads
    every unit of the state its own cells of the tile before update, so the state must
    alternate between two arrays; odd and even T leave the last one in either. With a
    projection, its tiles and the data gradient's N x P ones walk too. Against the
    reference; the loops are the same device code on both product paths, which differ in
    the products around them: one case takes the Numba path (the simulator's are slow)."""
    compare(nc.RNNConfig(mode, I, H, proj_size=proj), "float64", t_len=t_len, n=14)
    assert persistent["runs"] == 2


@pytest.fixture
def split_everything(monkeypatch):
    """The persistent loops' recurrent products split wherever a split is two product
    steps or more (``SPLIT_MIN_STEPS`` 1; the simulator's tiles are 4 deep); yields the
    persistent kernels launched, by name."""
    from numbaconv.cuda import _rnn_kernels
    monkeypatch.setattr(_rnn_kernels, "SPLIT_MIN_STEPS", 1)
    real = _rnn_kernels.kernel
    names = []
    monkeypatch.setattr(_rnn_kernels, "kernel",
                        lambda name, *key: names.append(name) or real(name, *key))
    yield names


@pytest.mark.parametrize("product_path, mode, h, n, t_len, lengths, bidirectional, proj", [
    ("numba", "lstm", 9, 3, 3, None, False, 0),
    ("cublas", "lstm", 9, 9, 4, None, False, 0),
    ("cublas", "gru", 9, 3, 3, np.array([3, 1, 2]), True, 0),
    ("numba", "rnn_tanh", 9, 9, 3, None, False, 0),
    ("cublas", "rnn_relu", 9, 3, 4, np.array([2, 4, 4]), True, 0),
    ("numba", "lstm", 9, 3, 3, np.array([1, 3, 2]), True, 3),
    ("cublas", "lstm", 18, 9, 3, None, False, 17),
], ids=["numba-lstm", "cublas-lstm-two-row-tiles-even-T", "cublas-gru-bidirectional-lengths",
        "numba-rnn_tanh-two-row-tiles", "cublas-rnn_relu-bidirectional-lengths",
        "numba-lstm-proj-bidirectional-lengths", "cublas-lstm-proj-two-row-and-column-tiles"],
    indirect=["product_path"])
def test_split_persistent_loops(product_path, persistent, split_everything, mode, h, n,
                                t_len, lengths, bidirectional, proj):
    """The persistent loops with each step's recurrent product (with a projection: the
    forward's projection, the data gradient's ``rec``) split along its reduction (partial
    sums, a grid barrier, the cells summing them in split order): against the reference
    through a whole training step. The simulator's 8 x 16 tiles and 4-deep steps: H = 9
    splits the forward's reduction (9) in 8 + 1 and the data gradient's (G*H) in 4s; one
    block walks every (row tile, split, column tile), with carries; N = 9 gives two row
    tiles, P = 17 two column tiles of the projection (its 18 deep in 8 + 8 + 2). The
    loops' own products are the same device code on both product paths, which differ in
    the products around them: the larger cases take the cuBLAS path (the simulator's
    Numba products are slow)."""
    cfg = nc.RNNConfig(mode, I, h, bidirectional=bidirectional, proj_size=proj)
    compare(cfg, "float64", lengths, t_len=t_len, n=n)
    assert persistent["runs"] == 2
    twins = ("forward_split_sequence", "backward_split_sequence")
    if proj:
        twins = tuple(name.replace("_split", "_projected_split") for name in twins)
    assert set(twins) <= set(split_everything), split_everything


def test_reduction_split_depends_on_the_shape_alone():
    """The splits of the GPU benchmark's layers (default 16 x 16 x 16 tile, 32 x 32 block
    tiles): the LSTM's data gradient (N = 64, H = 512, 32 tiles) in 4 of 512, none for its
    forward (128 gate tiles); the 2-layer bidirectional LSTM's (N = 32, H = 256) forward
    in 2 and data gradient in 8; with P = 256 the projection in 4 and rec in 8; chunks are
    whole product steps and cover the reduction."""
    from numbaconv.cuda import _rnn_kernels
    tile = (16, 16, 16)
    split = _rnn_kernels.reduction_split
    assert split("backward_sequence", "lstm", tile, 64, 512, 2048) == (4, 512)
    assert split("forward_sequence", "lstm", tile, 64, 512, 512) == (1, 512)
    assert split("forward_sequence", "lstm", tile, 32, 256, 256) == (2, 128)
    assert split("backward_sequence", "lstm", tile, 32, 256, 1024) == (8, 128)
    assert split("backward_sequence", "gru", tile, 64, 512, 1536) == (4, 384)
    # LSTM N = 64, H = 512, P = 256: the projection (16 tiles, 512 deep), rec (2048 deep)
    assert split("forward_projected_sequence", "lstm", tile, 64, 512, 512, 256) == (4, 128)
    assert split("backward_projected_sequence", "lstm", tile, 64, 512, 2048, 256) == (8, 256)
    for rows, units, k in ((3, 5, 20), (64, 100, 300), (1, 1, 4096), (500, 1000, 4000)):
        for name in ("forward_sequence", "backward_sequence"):
            splits, chunk = split(name, "lstm", tile, rows, units, k)
            assert (splits == 1 and chunk == k) or (chunk % tile[2] == 0
                                                    and (splits - 1) * chunk < k
                                                    <= splits * chunk), (rows, units, k)


def launch_counts(cfg, t_len, monkeypatch):
    """{op: (kernel launches, products)} of one training step on (t_len, N): kernels counted
    at the launch (the step kernels', the element-wise and bias ones'), products on either
    path (Numba gemm launches, cuBLAS calls)."""
    from numbaconv.cuda import _bias, _blas, _rnn_elementwise, _rnn_kernels
    real = _rnn_kernels.kernel
    seen = {"kernels": 0, "gemm": 0}
    real_launches = {module: module.launch for module in (_rnn_elementwise, _bias)}

    for module, real_launch in real_launches.items():  # the element-wise and bias kernels
        def launch(kernel, grid, block, *args, real_launch=real_launch):
            seen["kernels"] += 1
            real_launch(kernel, grid, block, *args)
        monkeypatch.setattr(module, "launch", launch)

    def counting(name, *key):
        kernel = real(name, *key)

        class Counted:
            def __getattr__(self, name):  # overloads, typeof_pyval, compile
                return getattr(kernel, name)

            def __getitem__(self, config):
                launch = kernel[config]

                def run(*args):
                    seen["gemm" if name == "gemm" else "kernels"] += 1
                    return launch(*args)
                return run
        return Counted()

    monkeypatch.setattr(_rnn_kernels, "kernel", counting)
    a = device(arrays(cfg, "float32", t_len=t_len))
    counts = {}
    state = {}

    def measure(op, call):
        before = (seen["kernels"], seen["gemm"] + _blas.counts["cublas"])
        state[op] = call()
        counts[op] = (seen["kernels"] - before[0],
                      seen["gemm"] + _blas.counts["cublas"] - before[1])

    with nc.use_backend("cuda"):
        measure("forward", lambda: forward(cfg, a))
        y, _, _, reserve = state["forward"]
        measure("backward_data", lambda: backward_data(cfg, a, y, reserve))
        measure("backward_weights", lambda: backward_weights(cfg, a, reserve))
    monkeypatch.setattr(_rnn_kernels, "kernel", real)
    for module, real_launch in real_launches.items():
        monkeypatch.setattr(module, "launch", real_launch)
    return counts


#: Launches a time step adds, per layer and direction: (kernels, products). Reported in
#: docs/cuda.md ("Launches per step").
LAUNCHES_PER_STEP = {
    "lstm": {"forward": (1, 1), "backward_data": (1, 1), "backward_weights": (0, 0)},
    "lstm-proj": {"forward": (2, 2), "backward_data": (2, 2), "backward_weights": (0, 0)},
    "gru": {"forward": (1, 1), "backward_data": (1, 1), "backward_weights": (0, 0)},
}


@pytest.mark.parametrize("product_path, name, cfg", [
    ("numba", "lstm", nc.RNNConfig("lstm", I, H)),
    ("cublas", "lstm", nc.RNNConfig("lstm", I, H)),
    ("numba", "lstm-proj", nc.RNNConfig("lstm", I, H, proj_size=2)),
    ("cublas", "lstm-proj", nc.RNNConfig("lstm", I, H, proj_size=2)),
    ("cublas", "gru", nc.RNNConfig("gru", I, H, num_layers=2, bidirectional=True)),
], ids=["numba-lstm", "cublas-lstm", "numba-lstm-proj", "cublas-lstm-proj",
        "cublas-gru-2-layers-bidirectional"], indirect=["product_path"])
def test_launches_per_step(product_path, name, cfg, monkeypatch):
    """A step costs one product and one kernel forward and backward (two and two with a
    projection), the weight gradient none: counted as the difference between T = 4 and
    T = 3, divided by layers x directions (the 2-layer case on the cuBLAS path alone: the
    simulator's Numba products are slow)."""
    short = launch_counts(cfg, 3, monkeypatch)
    long = launch_counts(cfg, 4, monkeypatch)
    per = cfg.num_layers * cfg.num_directions
    for op, (kernels, products) in LAUNCHES_PER_STEP[name].items():
        step = ((long[op][0] - short[op][0]) / per, (long[op][1] - short[op][1]) / per)
        assert step == (kernels, products), (op, step, short[op])


GRU_2_BIDIRECTIONAL = nc.RNNConfig("gru", I, H, num_layers=2, bidirectional=True)


@pytest.mark.parametrize("product_path, split, cfg", [
    ("numba", False, nc.RNNConfig("lstm", I, H, proj_size=2)),
    ("numba", True, nc.RNNConfig("lstm", I, H, proj_size=2)),
    ("cublas", False, GRU_2_BIDIRECTIONAL),
    ("cublas", True, GRU_2_BIDIRECTIONAL),
], ids=["numba-unsplit-lstm-proj", "numba-split-lstm-proj",
        "cublas-unsplit-gru-2-layers-bidirectional", "cublas-split-gru-2-layers-bidirectional"],
    indirect=["product_path"])
def test_the_persistent_loops_launch_nothing_per_step(product_path, persistent, cfg, split,
                                                      monkeypatch, request):
    """With the persistent forward and data gradient a longer sequence adds no launch and
    no product: one cooperative launch per layer and direction runs every step, split
    products too (their data gradients' here: G*H deep). Each product path on one layer
    kind (the simulator's Numba products are slow)."""
    names = request.getfixturevalue("split_everything") if split else []
    short = launch_counts(cfg, 3, monkeypatch)
    long = launch_counts(cfg, 4, monkeypatch)
    for op in ("forward", "backward_data", "backward_weights"):
        assert long[op] == short[op], op
    assert persistent["runs"] == 4
    assert split == any("backward" in name and "split" in name for name in names)


def test_a_steady_training_step_allocates_only_its_results(monkeypatch):
    """The second training step of the same shapes allocates its results and nothing else
    (scratch comes from the thread's workspace) and copies nothing to the device when the
    sequences are full length; another thread gets its own scratch."""
    import threading

    from numbaconv.cuda import rnn_backward_data, rnn_backward_weights, rnn_forward
    cfg = nc.RNNConfig("lstm", I, H, num_layers=2, dropout=0.5, proj_size=2)
    a = device(arrays(cfg, "float32"))
    with nc.use_backend("cuda"):
        train_step(cfg, a)  # fills the workspace
    made, copied = [], []
    for module in (rnn_forward, rnn_backward_data, rnn_backward_weights):
        real = module.device_array
        monkeypatch.setattr(module, "device_array",
                            lambda shape, dtype, real=real, name=module.__name__:
                            made.append((name.rsplit(".", 1)[1], tuple(shape)))
                            or real(shape, dtype))
    real_to_device = cuda.to_device
    monkeypatch.setattr(cuda, "to_device",
                        lambda *args, **kw: copied.append(1) or real_to_device(*args, **kw))
    with nc.use_backend("cuda"):
        forward(cfg, a)
        forward_made = list(made)
        got = train_step(cfg, a)
    # forward: hy, cy, y (a copy of the reserve's last outputs); data gradient: dhx, dcx
    # and dx of each layer; weight gradient: dparams
    ld = cfg.num_layers
    assert sorted(forward_made) == sorted([("rnn_forward", (ld, N, 2)),
                                           ("rnn_forward", (ld, N, H)),
                                           ("rnn_forward", (T, N, 2))])
    assert len(made) == 2 * len(forward_made) + 2 + cfg.num_layers + 1, made
    assert len(copied) == 2  # the frontend's dropout masks, one transfer a forward
    assert got["dparams"] is not None
    scratch = rnn_forward.scratch("forward h", (N, 2), "float32")
    assert rnn_forward.scratch("forward h", (N, 2), "float32") is scratch
    other = []
    thread = threading.Thread(target=lambda: other.append(
        rnn_forward.scratch("forward h", (N, 2), "float32")))
    thread.start()
    thread.join()
    assert other[0] is not scratch


# --- the element-wise kernels outside the step loops ------------------------------------------

def _views(dtype):
    """3-D device views of one shape (2, 3, 4) over fresh memory: C-contiguous, transposed,
    reversed along two axes (negative strides), and strided with a gap."""
    rng = np.random.default_rng(3)

    def fresh(shape):
        return cuda.to_device(rng.uniform(-1, 1, shape).astype(dtype))
    return {"contiguous": fresh((2, 3, 4)),
            "transposed": fresh((4, 3, 2)).transpose((2, 1, 0)),
            "reversed": fresh((2, 3, 4))[::-1, :, ::-1],
            "gapped": fresh((2, 6, 5))[:, ::2, 1:]}


@pytest.mark.parametrize("wide", [False, True], ids=["32-bit", "64-bit"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_elementwise_map_on_any_strides(dtype, wide, monkeypatch):
    """copy, add, mul and zero of ``_rnn_elementwise.apply`` on every pair of views (negative
    strides too), 1-D and 2-D arrays and the time/batch swap, in both index widths, against
    NumPy; ``out`` may be ``a``."""
    from numbaconv.cuda import _implicit_gemm, _rnn_elementwise as ew
    if wide:  # every operand then counts as too large for 32-bit offsets
        monkeypatch.setattr(_implicit_gemm, "INDEX32_LIMIT", 0)
    built, real = [], ew.kernel
    monkeypatch.setattr(ew, "kernel", lambda *key: built.append(key) or real(*key))
    views = list(_views(dtype).items())
    for i, (no, out) in enumerate(views):  # each kind of view as out, a and b
        (na, a), (nb, b) = views[(i + 1) % 4], views[(i + 2) % 4]
        ha, hb = a.copy_to_host(), b.copy_to_host()
        for op, want in (("copy", ha), ("add", ha + hb), ("mul", ha * hb),
                         ("zero", 0 * ha)):
            ew.apply(op, out, a, b)
            np.testing.assert_array_equal(out.copy_to_host(), want, err_msg=(op, na, nb, no))
    a = _views(dtype)["reversed"]
    before = a.copy_to_host()
    ew.apply("mul", a, a, a)                   # in place
    np.testing.assert_array_equal(a.copy_to_host(), before * before)
    src = _views(dtype)["gapped"]
    swapped = cuda.device_array((3, 2, 4), dtype)
    ew.apply("copy", swapped, src, swap=True)
    np.testing.assert_array_equal(swapped.copy_to_host(),
                                  src.copy_to_host().transpose(1, 0, 2))
    one = cuda.to_device(np.arange(7, dtype=dtype))[::-2]
    dst = cuda.device_array(4, dtype)
    ew.apply("copy", dst, one)
    np.testing.assert_array_equal(dst.copy_to_host(), np.arange(7, dtype=dtype)[::-2])
    two = cuda.to_device(np.arange(12, dtype=dtype).reshape(3, 4)).T
    dst = cuda.device_array((4, 3), dtype)
    ew.apply("add", dst, two, two)
    np.testing.assert_array_equal(dst.copy_to_host(), 2 * np.arange(12).reshape(3, 4).T)
    assert {key[2] for key in built} == {wide}


def test_elementwise_checks_shapes_and_dtypes_before_launching():
    from numbaconv.cuda import _rnn_elementwise as ew
    out = cuda.to_device(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="a: shape"):
        ew.apply("copy", out, cuda.to_device(np.ones((3, 2), np.float32)))
    with pytest.raises(ValueError, match="b: shape .* float64"):
        ew.apply("add", out, out, cuda.to_device(np.ones((2, 3), np.float64)))
    with pytest.raises(ValueError, match="lengths"):
        ew.previous_states(cuda.to_device(np.ones((2, 3, 4), np.float32)),
                           cuda.to_device(np.ones((3, 4), np.float32)),
                           cuda.device_array((2, 3, 4), np.float32),
                           cuda.to_device(np.ones(3, np.int32)), False)
    np.testing.assert_array_equal(out.copy_to_host(), 0)


@pytest.mark.parametrize("reverse", [False, True])
def test_elementwise_previous_states_on_strided_views(reverse):
    """The states each step read, from views with gaps and negative strides, against the
    loop it stands for."""
    from numbaconv.cuda import _rnn_elementwise as ew
    rng = np.random.default_rng(5)
    t_len, n, p = 4, 3, 2
    outputs = cuda.to_device(rng.uniform(-1, 1, (t_len, n, 2 * p)))[:, :, p:]
    h0 = cuda.to_device(rng.uniform(-1, 1, (n, p)))[::-1]
    lengths = np.array([4, 1, 3], np.int64)
    out = cuda.device_array((t_len, n, p))
    ew.previous_states(outputs, h0, out, cuda.to_device(lengths), reverse)
    ho, hh = outputs.copy_to_host(), h0.copy_to_host()
    want = np.empty((t_len, n, p))
    for t in range(t_len):
        for b in range(n):
            first = t + 1 >= lengths[b] if reverse else t == 0
            want[t, b] = hh[b] if first else ho[t + 1 if reverse else t - 1, b]
    np.testing.assert_array_equal(out.copy_to_host(), want)


def _counting_transfers(monkeypatch) -> list:
    """Every host/device transfer made from the host thread from now on, by kind (the
    simulated kernels' own element writes, in threads of their own, aside)."""
    import threading

    from numba.cuda.simulator.cudadrv import devicearray
    copies = []
    real_to_device = cuda.to_device
    monkeypatch.setattr(cuda, "to_device", lambda *args, **kw: copies.append("to_device")
                        or real_to_device(*args, **kw))
    fake = devicearray.FakeCUDAArray
    host_thread = threading.main_thread()
    for method, kind in (("copy_to_device", "host to device"), ("__setitem__", "setitem"),
                         ("copy_to_host", "device to host")):
        def counting(self, *args, real=getattr(fake, method), kind=kind, **kw):
            if threading.current_thread() is host_thread and not (
                    kind == "host to device" and isinstance(args[0], fake)):
                copies.append(kind)
            return real(self, *args, **kw)
        monkeypatch.setattr(fake, method, counting)
    return copies


def test_a_training_step_without_states_copies_nothing(monkeypatch):
    """With the optional states, lengths and dropout left out, a training step copies
    nothing between the host and the device: the zero states are filled and the reserve's
    header written by kernels, and the backward functions check the header numbaconv
    noted when it wrote it (a copy either way would wait for the device's queued work)."""
    cfg = nc.RNNConfig("lstm", I, H, num_layers=2)
    a = device(arrays(cfg, "float32"))
    for name in ("hx", "cx", "dhy", "dcy"):
        a[name] = None
    with nc.use_backend("cuda"):
        want = {k: host(v) for k, v in train_step(cfg, a).items()}
    copies = _counting_transfers(monkeypatch)
    with nc.use_backend("cuda"):
        got = train_step(cfg, a)
    assert copies == [], copies
    monkeypatch.undo()
    for name, value in want.items():    # and the step computes what it did before
        if value is not None and name != "reserve":   # (its padding is never written)
            np.testing.assert_array_equal(host(got[name]), value, err_msg=name)


def test_device_reserve_checks_read_only_headers_numbaconv_did_not_write(monkeypatch):
    """The backward functions check a device reserve's header as numbaconv last wrote it
    to that array object, without a transfer: every misuse the header catches is still
    caught. A reserve numbaconv did not write (a copy, a fresh array) is read from the
    device, once a check."""
    cfg = nc.RNNConfig("gru", I, H)
    a = device(arrays(cfg, "float32", lengths=np.array([3, 1, 2])))
    copies = _counting_transfers(monkeypatch)
    reads = lambda: copies.count("device to host")   # noqa: E731
    with nc.use_backend("cuda"):
        y, _, _, reserve = forward(cfg, a)
        with pytest.raises(ValueError, match="rnn_backward_data to have run"):
            backward_weights(cfg, a, reserve)
        with pytest.raises(ValueError, match="seq_lengths: expected the lengths"):
            backward_data(cfg, dict(a, lengths=np.array([3, 2, 2])), y, reserve)
        backward_data(cfg, a, y, reserve)
        with pytest.raises(ValueError, match="already ran on this reserve"):
            backward_data(cfg, a, y, reserve)
        got = backward_weights(cfg, a, reserve)
        assert reads() == 0, copies
        copied = cuda.to_device(reserve.copy_to_host())    # not written by numbaconv
        before = reads()
        from_copy = backward_weights(cfg, a, copied)
        assert reads() == before + 1, copies               # its header
        np.testing.assert_array_equal(host(from_copy), host(got))
        fresh = cuda.to_device(np.zeros(reserve.shape, np.float32))
        with pytest.raises(ValueError, match="an array it did not fill"):
            backward_data(cfg, a, y, fresh)
        _, _, _, other = forward(cfg, dict(a, lengths=np.array([2, 2, 2])))
        before = reads()
        with pytest.raises(ValueError, match="seq_lengths: expected the lengths"):
            backward_data(cfg, a, y, other)
        assert reads() == before, copies
