"""The ``cpu`` backend: every algorithm against the reference, forced one by one; random
problems (hypothesis); workspace tiling; determinism; a NUMBA_BOUNDSCHECK=1 pass.

(The conformance helper in test_builtin_conformance also checks the heuristic's choices with
out=, accumulate and read-only operands.)
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import numbaconv as nc
from numbaconv import dispatch
from numbaconv import problem as pb
from numbaconv.testing import CASES, ConvCase, case_arrays, relative_error, run_op

OPS = ("conv", "conv_backward_data", "conv_backward_weight", "conv_transpose")
TOL = {"float32": 2e-5, "float64": 1e-11}


def build_problem(op, c, layout, a, accumulate=False):
    kw = dict(c.kwargs, layout=layout)
    if op == "conv":
        return pb.conv_problem(a["x"], a["w"], a["bias"], **kw), (a["x"], a["w"], a["bias"])
    if op == "conv_backward_data":
        return (pb.conv_backward_data_problem(a["dy"], a["w"], a["x"].shape, **kw,
                                              out=np.empty_like(a["x"]),
                                              accumulate=accumulate), (a["dy"], a["w"]))
    if op == "conv_backward_weight":
        return (pb.conv_backward_weight_problem(a["x"], a["dy"], a["w"].shape, **kw,
                                                out=np.empty_like(a["w"]),
                                                accumulate=accumulate), (a["x"], a["dy"]))
    if op == "conv_transpose":
        return (pb.conv_transpose_problem(a["xt"], a["w"], a["bias_t"], **kw,
                                          output_padding=c.output_padding),
                (a["xt"], a["w"], a["bias_t"]))
    raise ValueError(op)


def check_every_algorithm(c, layout, dtype, ops=OPS):
    backend = dispatch.get_backend("cpu")
    a = case_arrays(c, layout, dtype)
    checked = 0
    for op in ops:
        with nc.use_backend("reference"):
            expected = run_op(op, c, layout, a)
        problem, operands = build_problem(op, c, layout, a)
        for algorithm in backend.algorithms(op, problem):
            got = backend.run(op, problem, operands, None, algorithm)
            err = relative_error(got, expected)
            assert err < TOL[dtype], (c.name, op, layout, dtype, algorithm, err)
            checked += 1
        if op in ("conv_backward_data", "conv_backward_weight"):
            problem, operands = build_problem(op, c, layout, a, accumulate=True)
            for algorithm in backend.algorithms(op, problem):
                out = np.ones_like(expected)
                backend.run(op, problem, operands, out, algorithm)
                assert relative_error(out, expected + 1) < TOL[dtype], (c.name, op, algorithm)
    return checked


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_every_algorithm_matches_the_reference(conv_case, layout, dtype):
    assert check_every_algorithm(conv_case, layout, dtype) >= len(OPS)


def test_gemm_and_direct_are_offered_where_they_apply():
    backend = dispatch.get_backend("cpu")

    def algorithms(name, op="conv", layout="channels_first"):
        c = next(c for c in CASES if c.name == name)
        a = case_arrays(c, layout, "float32")
        return backend.algorithms(op, build_problem(op, c, layout, a)[0])

    assert algorithms("2d_1x1") == ("gemm", "im2col")
    assert algorithms("2d_kernel_is_input", "conv_backward_weight") == ("gemm", "im2col")
    assert algorithms("2d_depthwise") == ("direct", "im2col")
    assert algorithms("2d_pad1", "conv_backward_data", "channels_last") == ("im2col",)
    assert "gemm" not in algorithms("2d_1x1_stride2")
    with nc.use_backend("cpu"):
        x = np.ones((2, 16, 5, 5), np.float32)
        choice = nc.explain("conv", x, np.ones((8, 16, 1, 1), np.float32))
    assert choice.algorithm == "gemm" and "1x1" in choice.reason


sizes = st.integers(1, 7)


@st.composite
def small_problems(draw):
    nd = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    cg, kg = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    padding = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(nd))
    size = tuple(draw(st.integers(max(1, (k - 1) * d + 1 - b - a), 9))
                 for k, d, (b, a) in zip(kernel, dilation, padding))
    n = draw(st.integers(1, 2))
    opad = tuple(draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
    return ConvCase("random", (n, cg * groups) + size, (kg * groups, cg) + kernel,
                    stride=stride, padding=padding, dilation=dilation, groups=groups,
                    output_padding=opad)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems(), st.sampled_from(["channels_first", "channels_last"]))
def test_random_problems_match_the_reference(c, layout):
    try:
        case_arrays(c, layout, "float64")
    except ValueError:
        assume(False)  # the transposed convolution of this geometry would be empty
    check_every_algorithm(c, layout, "float64")


def test_workspace_tiling_splits_batches_and_rows(monkeypatch):
    from numbaconv.cpu import _gemm
    c = ConvCase("tiled", (3, 4, 9, 8), (6, 2, 3, 3), stride=(2, 1), padding=1, groups=2,
                 output_padding=(1, 0))
    monkeypatch.setattr(_gemm, "WORKSPACE_BYTES", 0)   # the largest operand bounds it
    monkeypatch.setattr(_gemm, "TILE_BYTES", 2**40)
    for layout in ("channels_first", "channels_last"):
        check_every_algorithm(c, layout, "float64")
    tiles = list(_gemm.tiles(_geom_of(c), 4 * 1000, 1))
    assert all(nb == 1 for _, nb, _, _ in tiles) and len(tiles) > 3  # one row per tile
    monkeypatch.setattr(_gemm, "WORKSPACE_BYTES", 2**40)
    per_position = 4 * 9 * 8                     # channels * taps * float64
    monkeypatch.setattr(_gemm, "TILE_BYTES", 2 * per_position * 5 * 8)  # two images
    tiles = list(_gemm.tiles(_geom_of(c), per_position, 1))
    assert [(n0, nb) for n0, nb, _, _ in tiles] == [(0, 2), (2, 1)]
    for layout in ("channels_first", "channels_last"):
        check_every_algorithm(c, layout, "float64")


def _geom_of(c):
    from numbaconv.cpu._layout import geom
    a = case_arrays(c, "channels_first", "float64")
    return geom(build_problem("conv", c, "channels_first", a)[0])


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_reductions_are_deterministic(layout):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 8, 12, 12)).astype(np.float32)
    dy = rng.standard_normal((4, 8, 12, 12)).astype(np.float32)
    if layout == "channels_last":
        x, dy = np.moveaxis(x, 1, -1).copy(), np.moveaxis(dy, 1, -1).copy()
    with nc.use_backend("cpu"):
        for shape, groups in (((8, 8, 3, 3), 1), ((8, 1, 3, 3), 8)):
            first = nc.conv_backward_weight(x, dy, shape, padding=1, groups=groups,
                                            layout=layout)
            for _ in range(3):
                again = nc.conv_backward_weight(x, dy, shape, padding=1, groups=groups,
                                                layout=layout)
                assert np.array_equal(first, again)
        db = nc.conv_backward_bias(dy, layout=layout)
        assert np.array_equal(db, nc.conv_backward_bias(dy, layout=layout))


def test_nan_and_inf_propagate_like_the_reference():
    x = np.ones((1, 2, 5, 5))
    x[0, 0, 2, 2] = np.nan
    x[0, 1, 0, 0] = np.inf
    w = np.ones((3, 2, 3, 3))
    dy = np.ones((1, 3, 5, 5))
    for fn in (lambda: nc.conv(x, w, padding=1),
               lambda: nc.conv_backward_weight(x, dy, w.shape, padding=1),
               lambda: nc.conv_backward_data(dy * x[:, :1].repeat(3, 1), w, x.shape,
                                             padding=1)):
        with nc.use_backend("reference"):
            expected = fn()
        with nc.use_backend("cpu"):
            got = fn()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))


def test_kernels_stay_in_bounds_under_numba_boundscheck():
    """Every algorithm on every case once more, compiled with NUMBA_BOUNDSCHECK=1."""
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBACONV_JIT_CACHE="0")
    code = ("import sys; sys.path.insert(0, {tests!r})\n"
            "from test_cpu import check_every_algorithm\n"
            "from numbaconv.testing import CASES\n"
            "for c in CASES:\n"
            "    for layout in ('channels_first', 'channels_last'):\n"
            "        check_every_algorithm(c, layout, 'float64')\n"
            "print('boundscheck ok')\n").format(tests=os.path.dirname(__file__))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "boundscheck ok" in result.stdout


def test_importing_the_backend_compiles_nothing():
    code = ("import sys, numbaconv as nc\n"
            "nc.backends()\n"
            "assert 'numba' not in sys.modules, 'numba imported by backend discovery'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
