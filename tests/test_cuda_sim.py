"""The ``cuda`` backend under Numba's simulator: every op and algorithm against the reference.

Runs only with NUMBA_ENABLE_CUDASIM=1 set before Numba is imported (or, on a machine with a
GPU, with NUMBACONV_TEST_GPU=1: the same checks on the device); tests/test_cuda.py runs
this file in such a subprocess, with 4x8 tiles (step 4) and 32 threads per block so that
last blocks are partly filled. The simulator runs each block's threads as Python threads:
cases are the tiniest of numbaconv.testing.CASES plus two tiny 2D/3D ones with every feature.
"""

import os

import numpy as np
import pytest

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
if not SIMULATED and os.environ.get("NUMBACONV_TEST_GPU", "0") in ("", "0"):
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 (tests/test_cuda.py runs this file so), or "
                "NUMBACONV_TEST_GPU=1 on a machine with a GPU", allow_module_level=True)
pytest.importorskip("numba_cuda")

from numba import cuda  # noqa: E402

import numbaconv as nc  # noqa: E402
from numbaconv import dispatch  # noqa: E402
from numbaconv.testing import (TOLERANCE, ConvCase, case, case_arrays,  # noqa: E402
                               relative_error, run_op)

OPS = ("conv", "conv_backward_data", "conv_backward_weight", "conv_backward_bias",
       "conv_transpose")

SIM_CASES = (
    case("1d_basic"),
    case("1d_stride_dilation_groups"),
    case("1d_asymmetric_stride3"),
    ConvCase("2d_tiny_everything", (1, 4, 5, 4), (4, 2, 3, 2), stride=(2, 1),
             padding=((1, 0), (0, 1)), dilation=(1, 2), groups=2, output_padding=(1, 0)),
    ConvCase("3d_tiny_depthwise", (1, 2, 3, 4, 3), (4, 1, 2, 2, 2), stride=(1, 2, 1),
             padding=1, groups=2, output_padding=(0, 1, 0)),
    case("2d_depthwise"),
    ConvCase("1d_depthwise_dilated", (2, 3, 9), (3, 1, 3), padding=2, dilation=2, groups=3),
)


def device(arrays):
    return {name: cuda.to_device(a) for name, a in arrays.items()}


def expected(op, c, layout, a):
    with nc.use_backend("reference"):
        return run_op(op, c, layout, a)


@pytest.mark.skipif(not SIMULATED, reason="a check of the simulator's shared arrays")
def test_the_simulator_makes_a_launchs_shared_arrays_once():
    """tests/simulator.py: four shared arrays of a block filled by its 32 threads and read
    by all of them after a barrier, launch after launch at a 0.01 ms switch interval (each
    launch makes its arrays anew). With Numba's own FakeCUDAShared.array a few in a
    hundred such launches go wrong (a thread writing to an array the others never read;
    docs/cuda.md, "How it is tested", has the counts): 300 launches all right would be
    a rare chance."""
    import sys

    import simulator

    @cuda.jit
    def sums(x, out):
        a = cuda.shared.array(32, np.float64)
        b = cuda.shared.array(32, np.float64)
        c = cuda.shared.array(32, np.float64)
        d = cuda.shared.array(32, np.float64)
        t = cuda.threadIdx.x
        a[t] = x[t]
        b[t] = t + 1
        c[t] = 2 * x[t]
        d[t] = 1
        cuda.syncthreads()
        total = 0.0
        for i in range(32):
            j = (t + i) % 32
            total += a[j] * b[j] + c[j] * d[j]
        out[t] = total

    assert sys.getswitchinterval() == pytest.approx(simulator.SWITCH_INTERVAL_S)
    x = np.random.default_rng(0).standard_normal(32)
    want = np.full(32, x @ np.arange(1, 33) + 2 * x.sum())
    wrong = 0
    sys.setswitchinterval(1e-5)
    try:
        for _ in range(300):
            out = np.zeros(32)
            sums[1, 32](x, out)
            wrong += not np.allclose(out, want, rtol=1e-12, atol=0)
    finally:
        sys.setswitchinterval(simulator.SWITCH_INTERVAL_S)
    assert wrong == 0, f"{wrong} of 300 launches wrong"


@pytest.mark.parametrize("c", SIM_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_every_op_and_algorithm(c, layout):
    dtype = "float64" if layout == "channels_first" else "float32"
    a = case_arrays(c, layout, dtype)
    d = device(a)
    backend = dispatch.get_backend("cuda")
    for op in OPS:
        want = expected(op, c, layout, a)
        choice = nc.explain(op, *_explain_args(op, c, layout, d), **_explain_kwargs(op, c,
                                                                                     layout))
        assert choice.backend == "cuda"
        got = run_op(op, c, layout, d)                      # the public path
        assert getattr(got, "__cuda_ndarray__", False), type(got)
        assert relative_error(got.copy_to_host(), want) < TOLERANCE[dtype], op
        problem = choice_problem(op, c, layout, d)
        for algorithm in backend.algorithms(op, problem):  # each algorithm, forced
            got = backend.run(op, problem, _operands(op, d), None, algorithm)
            host = got.copy_to_host()
            assert host.dtype == np.dtype(dtype) and host.shape == want.shape
            err = relative_error(host, want)
            assert err < TOLERANCE[dtype], (op, algorithm, err)


@pytest.mark.parametrize("op", ["conv_backward_data", "conv_backward_weight",
                                "conv_backward_bias"])
def test_out_and_accumulate(op):
    c, layout = case("1d_stride_dilation_groups"), "channels_last"
    a = case_arrays(c, layout, "float64")
    d = device(a)
    want = expected(op, c, layout, a)
    start = np.random.default_rng(3).uniform(-1, 1, want.shape)
    out = cuda.to_device(start)
    assert run_op(op, c, layout, d, out=out) is out
    assert relative_error(out.copy_to_host(), want) < 1e-11
    out = cuda.to_device(start)
    assert run_op(op, c, layout, d, out=out, accumulate=True) is out
    assert relative_error(out.copy_to_host(), start + want) < 1e-11


#: The weight gradient's reduction runs over (image, output position) with carries between
#: rows and images inside a step: rows shorter than the step (several carries a step), every
#: dimension wrapping, a step crossing an image.
WEIGHT_CASES = SIM_CASES + (
    ConvCase("2d_rows_shorter_than_a_step", (3, 3, 4, 5), (5, 3, 2, 3), stride=(1, 2),
             padding=1, dilation=(2, 1)),
    ConvCase("3d_every_carry", (2, 3, 3, 4, 5), (2, 3, 2, 2, 3), stride=(1, 1, 2),
             padding=(1, 0, 1)),
)


@pytest.fixture
def fresh_setups():
    """The drivers' remembered setups and tile choices dropped before and after the test:
    for tests that change what they are worked out from (the split functions, forced tiles,
    the TF32 setting)."""
    from numbaconv.cuda import _implicit_gemm
    _implicit_gemm.forget_setups()
    yield
    _implicit_gemm.forget_setups()


#: (case, chunks) pairs: the shape's split of 2d_depthwise (a chunk per step of many groups,
#: this test's slowest case under the simulator) already runs in test_every_op_and_algorithm.
WEIGHT_SPLITS = [pytest.param(c, chunks, id=f"{c.name}-{chunks}")
                 for c in WEIGHT_CASES for chunks in ("by_shape", 1, 2)
                 if not (chunks == "by_shape" and c.name == "2d_depthwise")]


@pytest.mark.parametrize("c, chunks", WEIGHT_SPLITS)
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_conv_backward_weight_implicit_gemm(c, layout, chunks, monkeypatch, fresh_setups):
    """weight_gemm on its own, with the split the shape gives (tiny cases: one step a chunk),
    as one chunk (every step of the reduction in one block: the wraps run) and as two (a
    chunk starting inside a row)."""
    from numbaconv.cuda import _implicit_gemm
    if chunks != "by_shape":
        monkeypatch.setattr(_implicit_gemm, "weight_chunks", lambda *shape: chunks)
    op = "conv_backward_weight"
    for dtype in ("float64", "float32", "float16"):
        a = case_arrays(c, layout, dtype)
        d = device(a)
        want = expected(op, c, layout, {k: v.astype(np.float64) for k, v in a.items()})
        problem = choice_problem(op, c, layout, d)
        got = dispatch.get_backend("cuda").run(op, problem, _operands(op, d), None,
                                                 "implicit_gemm").copy_to_host()
        assert got.dtype == np.dtype(dtype) and got.shape == want.shape
        err = relative_error(got, want)
        assert err < TOLERANCE[dtype], (dtype, err)


#: Depthwise layers whose weight gradient's lanes step over rows, images and (3D) planes:
#: channels-last lanes step 8 rows (here 2 columns, 2 rows and no plane a step, with
#: carries; 108 rows), channels-first 256 (3 images and 4 columns a step, with carries;
#: 336 rows).
DW_WALKS = (
    ("channels_last", ConvCase("3d_dw_walk", (3, 4, 3, 4, 5), (4, 1, 2, 2, 3),
                               stride=(1, 1, 2), padding=(1, 0, 1), groups=4)),
    ("channels_first", ConvCase("2d_dw_walk", (4, 2, 12, 15), (2, 1, 1, 3), stride=(1, 2),
                                padding=(0, 1), dilation=(1, 2), groups=2)),
)


@pytest.mark.parametrize("layout, c", DW_WALKS, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("chunks", [1, 3])
def test_depthwise_weight_walks_its_rows(layout, c, chunks, monkeypatch, fresh_setups):
    """dw_weight's lanes decode their first row once and then step by the lanes' count in
    the rows' mixed radix: against the reference with every row in one chunk (each lane
    walks several rows) and in three (chunks that start inside a row)."""
    from numbaconv.cuda import _implicit_gemm
    monkeypatch.setattr(_implicit_gemm, "row_chunks", lambda rows, blocks, lanes, aim: (
        chunks, -(-rows // chunks)))
    op = "conv_backward_weight"
    a = case_arrays(c, layout, "float64")
    d = device(a)
    problem = choice_problem(op, c, layout, d)
    assert "depthwise" in dispatch.get_backend("cuda").algorithms(op, problem)
    got = dispatch.get_backend("cuda").run(op, problem, _operands(op, d), None,
                                             "depthwise").copy_to_host()
    assert relative_error(got, expected(op, c, layout, a)) < TOLERANCE["float64"]


def test_float16_accumulates_in_float32():
    c, layout = case("1d_basic"), "channels_first"
    a = case_arrays(c, layout, "float16")
    d = device(a)
    for op in OPS:
        want = expected(op, c, layout, {k: v.astype(np.float64) for k, v in a.items()})
        got = run_op(op, c, layout, d).copy_to_host()
        assert got.dtype == np.float16
        assert relative_error(got, want) < TOLERANCE["float16"], op


def test_strided_operands_and_out():
    c, layout = case("1d_basic"), "channels_first"
    a = case_arrays(c, layout, "float64")
    wide = np.zeros(a["x"].shape[:2] + (2 * a["x"].shape[2],))
    wide[:, :, ::2] = a["x"]
    x = cuda.to_device(wide)[:, :, ::2]          # a strided view on the device
    d = device(a)
    want = expected("conv", c, layout, a)
    out_wide = cuda.to_device(np.zeros(want.shape[:2] + (want.shape[2] * 3,)))
    out = out_wide[:, :, ::3]
    bias_wide = np.zeros(2 * a["bias"].shape[0])
    bias_wide[::2] = a["bias"]
    bias = cuda.to_device(bias_wide)[::2]                 # a strided bias too
    got = nc.conv(x, d["w"], bias, out=out)
    assert relative_error(got.copy_to_host(), want) < 1e-11
    assert not out_wide.copy_to_host()[:, :, 1::3].any()   # nothing written between


#: dy views for the bias gradient, each walked with a different number of carrying digits
#: (:func:`numbaconv.cuda._bias.walk`): (label, layout, logical shape, physical shape of
#: the array the view is cut from, the cut).
BIAS_VIEWS = (
    ("cl_contiguous", "channels_last", (3, 5, 4, 7), (3, 4, 7, 5), None),
    ("cf_contiguous", "channels_first", (3, 5, 4, 7), (3, 5, 4, 7), None),
    ("cf_every_other_column", "channels_first", (2, 3, 4, 5), (2, 3, 4, 10),
     (Ellipsis, slice(None, None, 2))),
    ("cl_3d_rows_cut", "channels_last", (2, 33, 3, 4, 2), (2, 5, 4, 2, 33),
     (slice(None), slice(1, -1))),
    ("cf_1d_negative", "channels_first", (2, 3, 9), (2, 3, 9),
     (Ellipsis, slice(None, None, -1))),
    ("cl_2d_window", "channels_last", (2, 3, 4, 5), (2, 6, 7, 3),
     (slice(None), slice(1, -1), slice(1, -1))),
    ("cf_3d_window", "channels_first", (2, 2, 3, 4, 5), (2, 2, 5, 6, 7),
     (slice(None), slice(None), slice(1, -1), slice(1, -1), slice(1, -1))),
)


@pytest.mark.parametrize("label, layout, shape, physical, cut", BIAS_VIEWS,
                         ids=lambda v: v if isinstance(v, str) and "_" in v else "")
@pytest.mark.parametrize("threads, chunks", [(None, "by_shape"), (None, 1), (None, 3),
                                             (64, 2)], ids=["split", "1", "3", "64threads"])
def test_conv_backward_bias_walks_every_view(label, layout, shape, physical, cut, threads,
                                             chunks, monkeypatch, fresh_setups):
    """The bias gradient against NumPy on contiguous and strided dy (rows walked with no
    carrying digit, one, several; a negative stride, which is copied first), with the
    shape's split, one chunk, three (chunks that start inside a row) and 64 threads a block
    (channels-last: two row lanes a channel); float64 accumulating into a strided out, and
    float16."""
    from numbaconv.cuda import _implicit_gemm, conv_backward_bias
    if chunks != "by_shape":
        monkeypatch.setattr(_implicit_gemm, "row_chunks", lambda rows, blocks, lanes, aim: (
            chunks, -(-rows // chunks)))
    if threads:
        monkeypatch.setattr(conv_backward_bias, "cuda_threads_per_block", lambda: threads)
    big = np.random.default_rng(7).uniform(-1, 1, physical)
    dy = cuda.to_device(big)
    if cut is not None:
        big, dy = big[cut], dy[cut]
    channel_axis = len(shape) - 1 if layout == "channels_last" else 1
    want = big.sum(axis=tuple(i for i in range(len(shape)) if i != channel_axis))
    assert want.shape == (shape[1],)
    start = np.arange(2 * shape[1], dtype=np.float64)
    out_wide = cuda.to_device(start)
    got = nc.conv_backward_bias(dy, layout=layout, out=out_wide[::-2], accumulate=True)
    after = out_wide.copy_to_host()
    assert np.allclose(after[::-2], start[::-2] + want, rtol=1e-12, atol=1e-12), label
    assert np.array_equal(after[-2::-2], start[-2::-2])  # nothing written between
    assert got.shape == (shape[1],)
    half = nc.conv_backward_bias(cuda.to_device(np.ascontiguousarray(big).astype(np.float16)),
                                 layout=layout).copy_to_host()
    assert half.dtype == np.float16
    assert relative_error(half, want) < TOLERANCE["float16"], label


def test_reductions_are_deterministic():
    c, layout = case("1d_stride_dilation_groups"), "channels_first"
    d = device(case_arrays(c, layout, "float32"))
    for op in ("conv_backward_weight", "conv_backward_bias"):
        first = run_op(op, c, layout, d).copy_to_host()
        again = run_op(op, c, layout, d).copy_to_host()
        assert np.array_equal(first, again), op


#: Tensor-core tiles (bm, bn, bk, tm, tn) for the TF32 tests, with a layout each (the
#: layout changes only the gathers): two warps side by side along the columns, 16 deep
#: (two m16n8 products a warp a step, as the 128x128 tile's step runs), two warps along
#: the rows (two products a warp along the columns), 16 deep (channels-last gathers at 4
#: places a step), and one warp of two products along the rows, 8 deep (one product a
#: step). Each tile costs tens of seconds of simulation: no more tiles than arrangements.
TF32_TILES = (("channels_first", "16,16,16,2,2"), ("channels_last", "32,16,16,2,4"),
              ("channels_last", "32,16,8,4,2"))
#: A case with a reduction of more than one step (12 channels: a partial second step), a
#: partial row tile and, in the data gradient, two stride phases.
TF32_CASE = ConvCase("2d_tf32", (2, 12, 5, 4), (10, 12, 3, 2), stride=(2, 1), padding=1)
#: What TF32's 10 mantissa bits cost these sums at most (errors of 2-5e-4 seen; the
#: documented bound, docs/cuda.md), and what accumulation order alone gives at most.
TF32_ERROR, TF32_ORDER_ERROR = 2e-3, 1e-5


@pytest.fixture
def tf32(monkeypatch, fresh_setups):
    """NUMBACONV_CUDA_TF32=1, the drivers' remembered setups and tiles dropped before and
    after."""
    monkeypatch.setenv("NUMBACONV_CUDA_TF32", "1")
    return monkeypatch


@pytest.mark.parametrize("layout, tile", TF32_TILES)
def test_tf32_tensor_cores(layout, tile, tf32):
    """With NUMBACONV_CUDA_TF32=1 the float32 GEMMs multiply on (simulated) tensor cores:
    every product op matches the reference on operands rounded to TF32 up to accumulation
    order, differs from the float32 one by what TF32 costs (so the rounding did happen),
    and float16 keeps its own path."""
    from numbaconv.cuda import _implicit_gemm
    from numbaconv.cuda._mma import round_tf32
    tf32.setenv("NUMBACONV_CUDA_GEMM_TILE", tile)
    c = TF32_CASE
    a = case_arrays(c, layout, "float32")
    d = device(a)
    rounded = {k: (v if k.startswith("bias") else round_tf32(v)) for k, v in a.items()}
    for op in ("conv", "conv_backward_data", "conv_backward_weight", "conv_transpose"):
        problem = choice_problem(op, c, layout, d)
        got = dispatch.get_backend("cuda").run(op, problem, _operands(op, d), None,
                                                 "implicit_gemm").copy_to_host()
        want = expected(op, c, layout, {k: v.astype(np.float64) for k, v in a.items()})
        want_tf32 = expected(op, c, layout, {k: v.astype(np.float64)
                                             for k, v in rounded.items()})
        assert relative_error(got, want_tf32) < TF32_ORDER_ERROR, (op, tile)
        assert 0.1 * TF32_ORDER_ERROR < relative_error(got, want) < TF32_ERROR, (op, tile)
        why = nc.explain(op, *_explain_args(op, c, layout, d), **_explain_kwargs(op, c, layout))
        assert "TF32 tensor cores where NUMBACONV_CUDA_TF32=1" in why.reason, why
    assert _implicit_gemm.tensor_cores("float32", _implicit_gemm.forced_tile())
    assert not _implicit_gemm.tensor_cores("float16", _implicit_gemm.forced_tile())
    tf32.setenv("NUMBACONV_CUDA_TF32", "0")
    assert not _implicit_gemm.tensor_cores("float32", _implicit_gemm.forced_tile())


def test_tf32_needs_a_tensor_core_tile(tf32):
    """A forced tile the warps' products cannot cover keeps the FFMA kernels: float32
    results, no TF32 rounding."""
    from numbaconv.cuda import _implicit_gemm
    tf32.setenv("NUMBACONV_CUDA_GEMM_TILE", "8,16,8,2,2")
    assert not _implicit_gemm.tensor_cores("float32", _implicit_gemm.forced_tile())
    c, layout = TF32_CASE, "channels_last"
    a = case_arrays(c, layout, "float32")
    got = run_op("conv", c, layout, device(a)).copy_to_host()
    want = expected("conv", c, layout, {k: v.astype(np.float64) for k, v in a.items()})
    assert relative_error(got, want) < TOLERANCE["float32"]


def test_mma_follows_the_ptx_fragment_layout():
    """``mma_tf32`` on one warp: A (16 x 8), B (8 x 8) and C (16 x 8) handed over in the
    PTX ISA's m16n8k8 fragments (lane's group = lane // 4, member = lane % 4), D read back
    from C's places; against NumPy on the operands cut to TF32 (what a tensor core reads of
    an unrounded float32)."""
    from numbaconv.cuda._mma import mma_tf32
    rng = np.random.default_rng(3)
    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)

    @cuda.jit
    def kernel(a, b, c, d):
        lane = cuda.threadIdx.x
        g, m = lane // 4, lane % 4
        d0, d1, d2, d3 = mma_tf32(a[g, m], a[g + 8, m], a[g, m + 4], a[g + 8, m + 4],
                                  b[m, g], b[m + 4, g],
                                  c[g, 2 * m], c[g, 2 * m + 1], c[g + 8, 2 * m],
                                  c[g + 8, 2 * m + 1])
        d[g, 2 * m], d[g, 2 * m + 1], d[g + 8, 2 * m], d[g + 8, 2 * m + 1] = d0, d1, d2, d3

    d = cuda.device_array((16, 8), np.float32)
    kernel[1, 32](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c), d)

    def cut(v):
        return (v.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)
    want = cut(a) @ cut(b) + c
    assert np.allclose(d.copy_to_host(), want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(d.copy_to_host(), a.astype(np.float64) @ b + c, rtol=1e-6,
                           atol=1e-6)


# --- helpers -------------------------------------------------------------------------------

def _explain_args(op, c, layout, d):
    return {"conv": (d["x"], d["w"], d["bias"]),
            "conv_backward_data": (d["dy"], d["w"], tuple(d["x"].shape)),
            "conv_backward_weight": (d["x"], d["dy"], tuple(d["w"].shape)),
            "conv_backward_bias": (d["dy"],),
            "conv_transpose": (d["xt"], d["w"], d["bias_t"])}[op]


def _explain_kwargs(op, c, layout):
    if op == "conv_backward_bias":
        return dict(layout=layout)
    extra = dict(output_padding=c.output_padding) if op == "conv_transpose" else {}
    return dict(c.kwargs, layout=layout, **extra)


def choice_problem(op, c, layout, d):
    from numbaconv.problem import PROBLEM_BUILDERS
    return PROBLEM_BUILDERS[op](*_explain_args(op, c, layout, d), **_explain_kwargs(op, c, layout))

def _operands(op, d):
    return {"conv": (d["x"], d["w"], d["bias"]), "conv_backward_data": (d["dy"], d["w"]),
            "conv_backward_weight": (d["x"], d["dy"]), "conv_backward_bias": (d["dy"],),
            "conv_transpose": (d["xt"], d["w"], d["bias_t"])}[op]
