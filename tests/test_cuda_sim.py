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

if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") in ("", "0") and \
        os.environ.get("NUMBACONV_TEST_GPU", "0") in ("", "0"):
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


#: (case, chunks) pairs: the shape's split of 2d_depthwise (a chunk per step of many groups,
#: this test's slowest case under the simulator) already runs in test_every_op_and_algorithm.
WEIGHT_SPLITS = [pytest.param(c, chunks, id=f"{c.name}-{chunks}")
                 for c in WEIGHT_CASES for chunks in ("by_shape", 1, 2)
                 if not (chunks == "by_shape" and c.name == "2d_depthwise")]


@pytest.mark.parametrize("c, chunks", WEIGHT_SPLITS)
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_conv_backward_weight_implicit_gemm(c, layout, chunks, monkeypatch):
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
                                             chunks, monkeypatch):
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
