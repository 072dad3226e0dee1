"""The cpu backend's ``winograd`` algorithm (F(2x2, 3x3) for 2D 3x3 convolutions with stride
and dilation 1, one group): the forward (with bias), the data gradient (written over NaN,
and accumulated), the transposed convolution and the weight gradient (and accumulated)
against the reference, in both layouts and both dtypes, over odd and even sizes,
symmetric, asymmetric, ``same`` and wide padding (a data gradient whose forward form reads
past its input), one-pixel outputs; jobs of one or a few tiles that cut tile rows and
images; non-finite values (recomputed by im2col); the transformed weights; the workspace
planes' skew; the heuristic's choice and its errors; a NUMBA_BOUNDSCHECK=1 pass; the weight
gradient bit for bit the same on one thread or two. 3D 3x3x3 forwards, data gradients and
transposed convolutions (F(2x2, 3x3) per depth slice, summed over the depth
taps) likewise, with jobs that split depth slices.
"""

import platform

import numba
import numpy as np
import pytest

import numbaconv as nc
from numbaconv import dispatch
from numbaconv import problem as pb
from numbaconv.testing import relative_error

import background
from non_finite import assert_non_finite_like

TOL = {"float32": 2e-5, "float64": 1e-11}

# (name, x shape channels-first, padding, out channels)
CASES = [
    ("even", (2, 3, 8, 6), 1, 4),
    ("odd", (2, 5, 9, 7), 1, 3),
    ("valid", (1, 4, 7, 10), 0, 6),
    ("asymmetric", (2, 3, 6, 9), ((2, 0), (1, 2)), 5),
    ("same", (1, 6, 5, 5), "same", 2),
    ("wide-padding", (1, 2, 4, 5), 3, 3),
    ("one-pixel", (3, 4, 3, 3), 0, 7),
    ("one-row", (2, 3, 3, 11), ((0, 0), (2, 1)), 4),
]


def _backend():
    return dispatch.get_backend("cpu")


def _arrays(case, dtype, layout, seed=0):
    _, x_shape, padding, k = case
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, x_shape[1], 3, 3)).astype(dtype)
    x = rng.standard_normal(x_shape).astype(dtype)
    dy = rng.standard_normal(nc.conv_output_shape(x_shape, w.shape, padding=padding)).astype(
        dtype)
    bias = rng.standard_normal(k).astype(dtype)
    if layout == "channels_last":
        x, dy = np.moveaxis(x, 1, -1).copy(), np.moveaxis(dy, 1, -1).copy()
    return x, dy, w, bias, dict(padding=padding, layout=layout)


def _check_forward_forms(label, x, dy, w, bias, kw, dtype):
    """The forward (with bias), the data gradient (over NaN, so every value is written;
    then accumulated onto ones) and the transposed convolution by ``winograd``, against
    the reference."""
    backend = _backend()
    t_bias = np.full(w.shape[1], 0.5, dtype)             # over the transposed output's C
    with nc.use_backend("reference"):
        y_ref = nc.conv(x, w, bias, **kw)
        dx_ref = nc.conv_backward_data(dy, w, x.shape, **kw)
        t_ref = nc.conv_transpose(dy, w, t_bias, **kw)
    p = pb.conv_problem(x, w, bias, **kw)
    assert "winograd" in backend.algorithms("conv", p)
    y = backend.run("conv", p, (x, w, bias), None, "winograd")
    assert y.dtype == dtype and relative_error(y, y_ref) < TOL[dtype], label
    p = pb.conv_backward_data_problem(dy, w, x.shape, **kw)
    dx = np.full(x.shape, np.nan, dtype)
    backend.run("conv_backward_data", p, (dy, w), dx, "winograd")
    assert relative_error(dx, dx_ref) < TOL[dtype], label
    p = pb.conv_backward_data_problem(dy, w, x.shape, out=np.ones_like(x), accumulate=True,
                                      **kw)
    acc = np.ones_like(x)
    backend.run("conv_backward_data", p, (dy, w), acc, "winograd")
    assert relative_error(acc, dx_ref + 1) < TOL[dtype], label
    p = pb.conv_transpose_problem(dy, w, t_bias, **kw)
    t = backend.run("conv_transpose", p, (dy, w, t_bias), None, "winograd")
    assert relative_error(t, t_ref) < TOL[dtype], label


def _check_all_ops(case, dtype, layout):
    x, dy, w, bias, kw = _arrays(case, dtype, layout)
    _check_forward_forms(case[0], x, dy, w, bias, kw, dtype)
    _check_weight_gradient(case[0], x, dy, w, kw, dtype)


def _check_weight_gradient(label, x, dy, w, kw, dtype):
    """The weight gradient by ``winograd``, and accumulated onto ones, against the
    reference."""
    backend = _backend()
    with nc.use_backend("reference"):
        dw_ref = nc.conv_backward_weight(x, dy, w.shape, **kw)
    p = pb.conv_backward_weight_problem(x, dy, w.shape, **kw)
    assert "winograd" in backend.algorithms("conv_backward_weight", p)
    dw = backend.run("conv_backward_weight", p, (x, dy), None, "winograd")
    assert dw.dtype == dtype and relative_error(dw, dw_ref) < TOL[dtype], label
    p = pb.conv_backward_weight_problem(x, dy, w.shape, out=np.ones_like(w),
                                        accumulate=True, **kw)
    acc = np.ones_like(w)
    backend.run("conv_backward_weight", p, (x, dy), acc, "winograd")
    assert relative_error(acc, dw_ref + 1) < TOL[dtype], label


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_winograd_matches_the_reference(case, layout, dtype):
    _check_all_ops(case, dtype, layout)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_by_blocks_of_output_channels(monkeypatch, layout, dtype):
    """F(2x2, 3x3) by blocks of output channels (``_forward_by_outputs``: U of every tile,
    then each block's V, products and outputs), forced on every case in blocks of 3 (a
    partial last block), the channels-first ones through channels-last copies, non-finite
    values too; and the rule: few tiles, many channels, channels-last (or copies)."""
    from numbaconv.cpu import _heuristics, _winograd
    runs = []
    real = _winograd._forward_by_outputs
    monkeypatch.setattr(_winograd, "_forward_by_outputs", lambda *a: runs.append(1) or real(*a))
    monkeypatch.setattr(_heuristics, "WINOGRAD_BY_OUTPUTS_TILES", 10**9)
    monkeypatch.setattr(_heuristics, "WINOGRAD_BY_PANELS_TILES", 0)
    monkeypatch.setattr(_heuristics, "winograd_via_copies", lambda c, k: True)
    monkeypatch.setattr(_winograd, "OUTPUT_BLOCK", 3)
    for case in CASES:
        x, dy, w, bias, kw = _arrays(case, dtype, layout)
        _check_forward_forms(case[0], x, dy, w, bias, kw, dtype)
    test_non_finite_values_propagate_like_the_reference(layout)
    assert len(runs) == 3 * len(CASES) + 4
    monkeypatch.undo()

    def by_outputs(n, c, size, layout="channels_last"):
        return _rule_on_layer(_heuristics.winograd_by_outputs, n, c, size, layout)

    assert by_outputs(8, 512, 7) and by_outputs(4, 512, 14) and by_outputs(32, 512, 7)
    assert not by_outputs(8, 256, 14) and not by_outputs(8, 64, 56)
    assert not by_outputs(8, 512, 7, "channels_first")


def _rule_on_layer(rule, n, c, size, layout):
    """``rule(g, 4)`` (a float32 heuristic) on a 3x3 ``same`` layer of n images of c channels,
    size x size, c -> c."""
    from numbaconv._kernel_geometry import geom
    shape = (n, size, size, c) if layout == "channels_last" else (n, c, size, size)
    return rule(geom(pb.conv_problem(np.zeros(shape, np.float32),
                                     np.zeros((c, c, 3, 3), np.float32), padding=1,
                                     layout=layout)), 4)


def _assert_same_bits_however_shared(monkeypatch, run):
    """``run()`` (a call by panels) gives the same bits in jobs of one panel and of all on
    two threads, and on one thread."""
    from numbaconv.cpu import _winograd
    results, previous = [], numba.get_num_threads()
    try:
        for per_job, threads in ((1, 2), (100, 2), (1, 1)):
            monkeypatch.setattr(_winograd, "BLOCKS_PER_JOB", per_job)
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            results.append(run())
    finally:
        numba.set_num_threads(previous)
    for other in results[1:]:
        np.testing.assert_array_equal(results[0], other)


#: Wider than a micro-kernel panel (32 float32 columns, 16 float64), with a partial one.
PANEL_CASES = CASES + [("panels", (2, 40, 6, 5), 1, 37)]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_by_panels_of_output_channels(monkeypatch, layout, dtype):
    """F(2x2, 3x3) by panels of output channels (``_forward_by_panels``: U of every tile
    transposed, then each panel's V, its 16 products on the micro-kernel and its outputs),
    forced on every case (partial panels, tiles that do not fill the micro-kernel's rows),
    in jobs of one panel and of all, both layouts (channels-first through copies), with
    non-finite values; the same bits however the panels are shared out; and the rule:
    very few tiles, many channels, in either layout."""
    from numbaconv.cpu import _heuristics, _winograd
    runs = []
    real = _winograd._forward_by_panels
    monkeypatch.setattr(_winograd, "_forward_by_panels", lambda *a: runs.append(1) or real(*a))
    monkeypatch.setattr(_heuristics, "WINOGRAD_BY_PANELS_TILES", 10**9)
    for per_job in (1, 100):
        monkeypatch.setattr(_winograd, "BLOCKS_PER_JOB", per_job)
        for case in PANEL_CASES:
            x, dy, w, bias, kw = _arrays(case, dtype, layout)
            _check_forward_forms(case[0], x, dy, w, bias, kw, dtype)
    assert len(runs) == 2 * 3 * len(PANEL_CASES)
    test_non_finite_values_propagate_like_the_reference(layout)
    assert len(runs) == 2 * 3 * len(PANEL_CASES) + 4
    x, dy, w, bias, kw = _arrays(PANEL_CASES[-1], dtype, layout)
    p = pb.conv_problem(x, w, **kw)
    _assert_same_bits_however_shared(
        monkeypatch, lambda: _backend().run("conv", p, (x, w, None), None, "winograd"))
    monkeypatch.undo()

    def by_panels(n, c, size, layout="channels_last"):
        return _rule_on_layer(_heuristics.winograd_by_panels, n, c, size, layout)

    assert by_panels(8, 512, 7) and by_panels(8, 512, 7, "channels_first")
    assert by_panels(4, 512, 14) and not by_panels(8, 512, 14) and not by_panels(32, 512, 7)
    assert not by_panels(8, 256, 14) and not by_panels(8, 64, 56)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="reads x86-64 assembly")
def test_the_weight_transform_of_a_block_prefetches_the_runs_ahead():
    """``_weights`` on a block of V's columns (the paths by panels and by outputs) fetches
    the run of w WEIGHT_RUNS_AHEAD rows on (docs/cpu-algorithms.md, "winograd: the weight
    transform's reads"): its machine code has the prefetch, and a block's V is the whole
    transform's columns."""
    from numbaconv.cpu import _winograd
    rows, columns, width, b0 = 9, 40, 16, 8
    w = np.random.default_rng(3).standard_normal((rows, columns, 3, 3)).astype(np.float32)
    whole = np.empty((16, rows, columns), np.float32)
    block = np.full((16, rows, width), np.nan, np.float32)
    half = np.float32(0.5)
    _winograd._weights(w.reshape(-1), whole.reshape(-1), np.uint64(rows * columns), 0, rows,
                       rows, columns, False, True, half, 0, columns)
    _winograd._weights(w.reshape(-1), block.reshape(-1), np.uint64(rows * width), 0, rows,
                       rows, width, False, True, half, b0, columns)
    np.testing.assert_array_equal(block, whole[:, :, b0:b0 + width])
    # Compiled again, apart from Numba's disk cache (a cached kernel keeps no assembly).
    from numbaconv.config import jit_options
    fresh = numba.njit(**dict(jit_options(), cache=False))(_winograd._weights.py_func)
    fresh(w.reshape(-1), block.reshape(-1), np.uint64(rows * width), 0, rows, rows, width,
          False, True, half, b0, columns)
    assert "prefetcht0" in "".join(fresh.inspect_asm().values())


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_weight_gradient_by_panels_of_output_channels(monkeypatch, layout, dtype):
    """The weight gradient by panels of output channels (``_weight_gradient_by_panels``: U
    and D of every tile, then each panel's dV summed over the tiles on the micro-kernel and
    transformed back), forced on every case, in jobs of one panel and of all, with
    non-finite values; the same bits however the panels are shared out; and the rule."""
    from numbaconv.cpu import _heuristics, _winograd
    from numbaconv._kernel_geometry import geom
    runs = []
    real = _winograd._weight_gradient_by_panels
    monkeypatch.setattr(_winograd, "_weight_gradient_by_panels",
                        lambda *a: runs.append(1) or real(*a))
    monkeypatch.setattr(_heuristics, "WINOGRAD_WGRAD_BY_PANELS_TILES", 10**9)
    monkeypatch.setattr(_heuristics, "WINOGRAD_WGRAD_BY_PANELS_MIN_TILES", 0)
    for per_job in (1, 100):
        monkeypatch.setattr(_winograd, "BLOCKS_PER_JOB", per_job)
        for case in PANEL_CASES:
            x, dy, w, bias, kw = _arrays(case, dtype, layout)
            _check_weight_gradient(case[0], x, dy, w, kw, dtype)
    assert len(runs) == 2 * 2 * len(PANEL_CASES)
    test_non_finite_values_propagate_like_the_reference(layout)
    assert len(runs) == 2 * 2 * len(PANEL_CASES) + 2
    x, dy, w, bias, kw = _arrays(PANEL_CASES[-1], dtype, layout)
    p = pb.conv_backward_weight_problem(x, dy, w.shape, **kw)
    _assert_same_bits_however_shared(
        monkeypatch, lambda: _backend().run("conv_backward_weight", p, (x, dy), None,
                                            "winograd"))
    monkeypatch.undo()

    def by_panels(n, c, size, layout="channels_last"):
        shape = (n, size, size, c) if layout == "channels_last" else (n, c, size, size)
        x = np.zeros(shape, np.float32)
        w = np.zeros((c, c, 3, 3), np.float32)
        dy = np.zeros(nc.conv_output_shape(x.shape, w.shape, padding=1, layout=layout),
                      np.float32)
        p = pb.conv_backward_weight_problem(x, dy, w.shape, padding=1, layout=layout)
        chosen = _backend().choose("conv_backward_weight", p)
        assert (chosen[0] == "winograd" and "by panels" in chosen[1]) == \
            _heuristics.winograd_wgrad_by_panels(geom(p), 4)
        return _heuristics.winograd_wgrad_by_panels(geom(p), 4)

    assert by_panels(8, 512, 7) and by_panels(8, 512, 7, "channels_first")
    assert by_panels(32, 512, 7) and by_panels(4, 256, 14) and not by_panels(1, 512, 7)
    assert not by_panels(8, 256, 14) and not by_panels(8, 64, 56)


def check_by_panels_on_the_shared_cases(dtype="float64"):
    """``winograd`` by panels (forward forms and weight gradient, forced) on every case of
    the shared case table it applies to, both layouts, against the reference; how many
    problems ran by panels."""
    from numbaconv.cpu import _heuristics, _winograd
    from numbaconv.testing import CASES as SHARED, case_arrays, run_op
    from test_cpu import OPS, build_problem
    saved = (_heuristics.WINOGRAD_BY_PANELS_TILES, _heuristics.WINOGRAD_WGRAD_BY_PANELS_TILES,
             _heuristics.WINOGRAD_WGRAD_BY_PANELS_MIN_TILES, _winograd._forward_by_panels,
             _winograd._weight_gradient_by_panels)
    runs = []
    _heuristics.WINOGRAD_BY_PANELS_TILES = _heuristics.WINOGRAD_WGRAD_BY_PANELS_TILES = 10**9
    _heuristics.WINOGRAD_WGRAD_BY_PANELS_MIN_TILES = 0
    _winograd._forward_by_panels = lambda *a: runs.append(1) or saved[3](*a)
    _winograd._weight_gradient_by_panels = lambda *a: runs.append(1) or saved[4](*a)
    backend = _backend()
    try:
        for c in SHARED:
            for layout in ("channels_first", "channels_last"):
                a = case_arrays(c, layout, dtype)
                for op in OPS:
                    problem, operands = build_problem(op, c, layout, a)
                    if "winograd" not in backend.algorithms(op, problem):
                        continue
                    with nc.use_backend("reference"):
                        expected = run_op(op, c, layout, a)
                    got = backend.run(op, problem, operands, None, "winograd")
                    assert relative_error(got, expected) < TOL[dtype], (c.name, op, layout)
    finally:
        (_heuristics.WINOGRAD_BY_PANELS_TILES, _heuristics.WINOGRAD_WGRAD_BY_PANELS_TILES,
         _heuristics.WINOGRAD_WGRAD_BY_PANELS_MIN_TILES, _winograd._forward_by_panels,
         _winograd._weight_gradient_by_panels) = saved
    return len(runs)


def test_by_panels_on_the_shared_case_table():
    assert check_by_panels_on_the_shared_cases() >= 8


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("tiles", [1, 3, 7])
def test_jobs_that_cut_tile_rows_and_images(monkeypatch, layout, tiles):
    from numbaconv.cpu import _winograd
    monkeypatch.setattr(_winograd, "MIN_JOB_TILES", tiles)
    monkeypatch.setattr(_winograd, "JOB_BYTES", 1)
    x, dy, w, bias, kw = _arrays(("jobs", (3, 4, 7, 9), 1, 5), "float64", layout)
    # 4 x 5 tiles an image: jobs of 3 or 7 tiles end inside tile rows and inside images.
    assert tiles == 1 or (5 % tiles and 20 % tiles)
    with nc.use_backend("reference"):
        y_ref = nc.conv(x, w, bias, **kw)
        dx_ref = nc.conv_backward_data(dy, w, x.shape, **kw)
    p = pb.conv_problem(x, w, bias, **kw)
    y = _backend().run("conv", p, (x, w, bias), None, "winograd")
    assert relative_error(y, y_ref) < TOL["float64"]
    p = pb.conv_backward_data_problem(dy, w, x.shape, **kw)
    dx = _backend().run("conv_backward_data", p, (dy, w), None, "winograd")
    assert relative_error(dx, dx_ref) < TOL["float64"]
    # The weight gradient's jobs go to 8 partial sums, several jobs each.
    with nc.use_backend("reference"):
        dw_ref = nc.conv_backward_weight(x, dy, w.shape, **kw)
    p = pb.conv_backward_weight_problem(x, dy, w.shape, **kw)
    dw = _backend().run("conv_backward_weight", p, (x, dy), None, "winograd")
    assert relative_error(dw, dw_ref) < TOL["float64"]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_non_finite_values_propagate_like_the_reference(layout):
    # The transforms would turn inf into NaN (inf - inf) where the reference keeps inf: a
    # problem with a non-finite output is computed again by im2col.
    x, dy, w, bias, kw = _arrays(("nan", (1, 3, 6, 7), 1, 4), "float64", "channels_first")
    x[0, 1, 2, 3], x[0, 0, 0, 0] = np.inf, np.nan
    dy[0, 2, 5, 6] = -np.inf
    if layout == "channels_last":
        x, dy = np.moveaxis(x, 1, -1).copy(), np.moveaxis(dy, 1, -1).copy()
        kw["layout"] = layout
    w_inf = w.copy()
    w_inf[1, 2, 0, 0] = np.inf
    backend = _backend()
    for name, weights in (("finite w", w), ("infinite w", w_inf)):
        with nc.use_backend("reference"):
            want = {"conv": nc.conv(x, weights, **kw),
                    "dgrad": nc.conv_backward_data(dy, weights, x.shape, **kw),
                    "wgrad": nc.conv_backward_weight(x, dy, weights.shape, **kw)}
        got = {"conv": backend.run("conv", pb.conv_problem(x, weights, **kw),
                                   (x, weights, None), None, "winograd"),
               "dgrad": backend.run("conv_backward_data",
                                    pb.conv_backward_data_problem(dy, weights, x.shape, **kw),
                                    (dy, weights), None, "winograd"),
               "wgrad": backend.run("conv_backward_weight",
                                    pb.conv_backward_weight_problem(x, dy, weights.shape,
                                                                    **kw),
                                    (x, dy), None, "winograd")}
        for op in want:
            label = f"{name} {op}"
            assert np.isinf(want[op]).any(), label
            assert_non_finite_like(got[op], want[op], label)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_the_transformed_weights_are_g_w_g_transposed(layout):
    from numbaconv.cpu import _winograd
    from numbaconv._kernel_geometry import geom
    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 3, 3, 3))
    x = np.zeros((1, 3, 4, 4)) if layout == "channels_first" else np.zeros((1, 4, 4, 3))
    g = geom(pb.conv_problem(x, w, layout=layout))
    G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
    expected = np.einsum("ai,kcij,bj->abkc", G, w, G).reshape(16, 5, 3)
    v = _winograd.transformed_weights(g, w, False)
    np.testing.assert_allclose(v, expected.transpose(0, 2, 1) if layout == "channels_last"
                               else expected, rtol=1e-14, atol=1e-14)
    # Flipped: the data gradient's weight (w's (K, C) blocks transposed, taps reversed)
    # for the forward form over dy, whose input channels are w's K.
    gd = g._replace(c=5, k=3)
    flipped = np.einsum("ai,ckij,bj->abck", G, w.transpose(1, 0, 2, 3)[..., ::-1, ::-1],
                        G).reshape(16, 3, 5)
    v = _winograd.transformed_weights(gd, w, True)
    np.testing.assert_allclose(v, flipped.transpose(0, 2, 1) if layout == "channels_last"
                               else flipped, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_workspace_planes_are_skewed_off_4k_multiples(dtype):
    from numbaconv.cpu import _winograd
    for shape in ((256, 64), (64, 512), (3, 5)):
        planes, flat, step = _winograd._planes(shape, dtype, "packed")
        assert planes.shape == (16,) + shape
        distance = planes.strides[0]
        assert distance == int(step) * np.dtype(dtype).itemsize
        assert distance % 4096 == _winograd.PLANE_SKEW
        assert distance >= shape[0] * shape[1] * np.dtype(dtype).itemsize
        assert np.shares_memory(planes, flat) and flat.size >= 16 * int(step)


# 3D: (name, x shape channels-first, padding, out channels)
CASES_3D = [
    ("3d-same", (2, 3, 4, 6, 7), 1, 5),
    ("3d-valid", (1, 4, 5, 5, 4), 0, 3),
    ("3d-asymmetric", (2, 2, 3, 9, 8), ((2, 0), (1, 1), (0, 2)), 4),
    ("3d-wide-depth-padding", (1, 3, 2, 4, 5), ((3, 3), (1, 1), (1, 1)), 2),
    ("3d-one-slice", (3, 2, 1, 5, 6), 1, 3),
]


def _check_3d(case, dtype, layout):
    """The forward (with bias), the data gradient (over NaN, and accumulated), the
    transposed convolution and the weight gradient (and accumulated) of a 3D case by
    ``winograd``."""
    _, x_shape, padding, k = case
    rng = np.random.default_rng(1)
    x = rng.standard_normal(x_shape).astype(dtype)
    if layout == "channels_last":
        x = np.moveaxis(x, 1, -1).copy()
    w = rng.standard_normal((k, x_shape[1], 3, 3, 3)).astype(dtype)
    bias = rng.standard_normal(k).astype(dtype)
    kw = dict(padding=padding, layout=layout)
    dy = rng.standard_normal(nc.conv_output_shape(x.shape, w.shape, **kw)).astype(dtype)
    _check_forward_forms(case[0], x, dy, w, bias, kw, dtype)
    _check_weight_gradient(case[0], x, dy, w, kw, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("case", CASES_3D, ids=[c[0] for c in CASES_3D])
def test_3d_matches_the_reference(case, layout, dtype):
    """3x3x3 kernels: F(2x2, 3x3) on each depth slice, summed over the depth taps inside x
    (padding slices on either side, or every tap in the padding)."""
    _check_3d(case, dtype, layout)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("tiles", [1, 3])
def test_3d_jobs_split_each_depth_slice(monkeypatch, layout, tiles):
    """Jobs of 1 and 3 tiles, their workspaces filled with garbage first: a weight gradient
    job whose depth taps lie partly in the padding must still write all of its part (and
    not by im2col: garbage that is not finite would send the problem there)."""
    from numbaconv.cpu import _im2col, _tiles, _winograd
    monkeypatch.setattr(_winograd, "MIN_JOB_TILES", tiles)
    monkeypatch.setattr(_winograd, "JOB_BYTES", 1)
    workspace = _tiles.workspace

    def poisoned(*args, **kwargs):
        buffer = workspace(*args, **kwargs)
        buffer[...] = 7
        return buffer

    monkeypatch.setattr(_tiles, "workspace", poisoned)
    monkeypatch.setattr(_im2col, "weight_gradient", None)
    _check_3d(("3d-jobs", (2, 3, 3, 7, 9), 1, 4), "float64", layout)  # 4 x 5 tiles a slice


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_3d_non_finite_values_propagate_like_the_reference(layout):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 3, 5, 6))
    x[0, 1, 1, 2, 3], x[0, 0, 2, 0, 0] = np.inf, np.nan
    if layout == "channels_last":
        x = np.moveaxis(x, 1, -1).copy()
    w = rng.standard_normal((3, 2, 3, 3, 3))
    kw = dict(padding=1, layout=layout)
    dy = rng.standard_normal(nc.conv_output_shape(x.shape, w.shape, **kw))
    with nc.use_backend("reference"):
        want = nc.conv(x, w, **kw)
        dw_want = nc.conv_backward_weight(x, dy, w.shape, **kw)
    got = _backend().run("conv", pb.conv_problem(x, w, **kw), (x, w, None), None, "winograd")
    assert np.isinf(want).any() and np.isnan(want).any()
    assert_non_finite_like(got, want)
    p = pb.conv_backward_weight_problem(x, dy, w.shape, **kw)
    dw = _backend().run("conv_backward_weight", p, (x, dy), None, "winograd")
    assert np.isinf(dw_want).any()
    assert_non_finite_like(dw, dw_want)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("copies", [False, True])
def test_channels_first_natively_and_on_channels_last_copies(monkeypatch, copies):
    """Channels-first forwards, data gradients and transposed convolutions run natively or,
    with AVX-512 up to WINOGRAD_COPIES_MAX_CHANNELS, on channels-last copies of their input
    and output (weight gradients on a copy of x): each way against the reference (2D and 3D,
    non-finite values too), whatever this CPU would pick; and the rule itself."""
    from numbaconv.cpu import _heuristics, _tiles
    calls = []
    real = _tiles.images_transposed           # the copies' (_tiles.channels_last_copy)
    monkeypatch.setattr(_heuristics, "winograd_via_copies", lambda c, k: copies)
    monkeypatch.setattr(_tiles, "images_transposed", lambda *a: calls.append(1) or real(*a))
    for case in CASES:
        _check_all_ops(case, "float64", "channels_first")
    for case in CASES_3D:
        _check_3d(case, "float64", "channels_first")
    assert bool(calls) == copies
    test_non_finite_values_propagate_like_the_reference("channels_first")
    test_3d_non_finite_values_propagate_like_the_reference("channels_first")
    monkeypatch.undo()
    for wide, c, k, want in ((True, 256, 64, True), (True, 16, 512, False),
                             (False, 16, 16, False)):
        monkeypatch.setattr(_heuristics, "wide_registers", lambda: wide)
        assert _heuristics.winograd_via_copies(c, k) == want, (wide, c, k)


def test_3d_winograd_needs_3x3x3_kernels():
    backend = _backend()
    x = np.zeros((1, 2, 4, 6, 6))
    w = np.zeros((3, 2, 3, 3, 5))
    dy = np.zeros(nc.conv_output_shape(x.shape, w.shape, padding=1))
    p = pb.conv_backward_weight_problem(x, dy, w.shape, padding=1)
    assert "winograd" not in backend.algorithms("conv_backward_weight", p)
    with pytest.raises(ValueError, match="a 2D 3x3 or 3D 3x3x3 kernel"):
        backend.run("conv_backward_weight", p, (x, dy), None, "winograd")
    p = pb.conv_problem(x, w, padding=1)
    assert "winograd" not in backend.algorithms("conv", p)
    with pytest.raises(ValueError, match="algorithm: 'winograd'"):
        backend.run("conv", p, (x, w, None), None, "winograd")


def test_the_heuristic_picks_winograd_for_resnet_layers_only(monkeypatch):
    from numbaconv.cpu import _heuristics
    backend = _backend()

    def choice(op, c, size, n=8, k=None, kernel=3, stride=1, groups=1, layout=None):
        x = np.zeros((n, c, size, size), np.float32)
        w = np.zeros((k or c, c // groups, kernel, kernel), np.float32)
        if op == "conv":
            p = pb.conv_problem(x, w, stride=stride, padding=1, groups=groups)
        elif op == "conv_backward_weight":
            dy_shape = nc.conv_output_shape(x.shape, w.shape, stride=stride, padding=1,
                                            groups=groups)
            dy = np.zeros(dy_shape, np.float32)
            if layout:              # the same arrays, read as channels-last
                x, dy = x.transpose(0, 2, 3, 1).copy(), dy.transpose(0, 2, 3, 1).copy()
            p = pb.conv_backward_weight_problem(x, dy, w.shape, stride=stride, padding=1,
                                                groups=groups, layout=layout or
                                                "channels_first")
        else:
            dy_shape = nc.conv_output_shape(x.shape, w.shape, stride=stride, padding=1,
                                            groups=groups)
            p = pb.conv_backward_data_problem(np.zeros(dy_shape, np.float32), w, x.shape,
                                              stride=stride, padding=1, groups=groups)
        return backend.choose(op, p)

    monkeypatch.setattr(_heuristics, "wide_registers", lambda: False)
    for c, size in ((64, 56), (128, 28), (256, 14)):
        assert choice("conv_backward_weight", c, size)[0] == "winograd", c
    # With AVX-512, channels-first ones with rows of 28 pixels or more from 96 channels
    # (narrower rows, and channels-last, from 64), unless they take F(4x4, 3x3).
    monkeypatch.setattr(_heuristics, "wide_registers", lambda: True)
    assert choice("conv_backward_weight", 64, 28, n=2)[0] == "implicit"
    assert choice("conv_backward_weight", 64, 32, n=2)[0] == "implicit"
    for n, size in ((8, 56), (8, 28)):
        algorithm, why = choice("conv_backward_weight", 64, size, n=n)
        assert algorithm == "winograd" and "F(4x4, 3x3)" in why, (size, why)
    assert choice("conv_backward_weight", 96, 28)[0] == "winograd"
    assert choice("conv_backward_weight", 64, 16, n=32)[0] == "winograd"
    assert choice("conv_backward_weight", 128, 28)[0] == "winograd"
    assert choice("conv_backward_weight", 64, 56, layout="channels_last")[0] == "winograd"
    monkeypatch.undo()
    assert choice("conv_backward_weight", 512, 7)[1].count("by panels") == 1  # 128 tiles
    assert choice("conv_backward_weight", 512, 7, n=1)[0] != "winograd"  # 16 tiles
    assert choice("conv_backward_weight", 32, 56)[0] != "winograd"     # 32 channels
    # Nor thin ones: 16 channels, either layout, with or without AVX-512 (implicit's
    # one-vector tiles, ``_microkernel.single_vector_rows``).
    for wide in (True, False):
        monkeypatch.setattr(_heuristics, "wide_registers", lambda: wide)
        assert choice("conv_backward_weight", 16, 32, n=16,
                      layout="channels_last")[0] == "implicit"
        assert choice("conv_backward_weight", 16, 32, n=16)[0] != "winograd"
        assert choice("conv_backward_weight", 16, 32, n=16, k=32,
                      layout="channels_last")[0] != "winograd"
        assert choice("conv_backward_weight", 1, 32, n=16, k=16,
                      layout="channels_last")[0] != "winograd"
    monkeypatch.undo()
    for op in ("conv", "conv_backward_data"):
        for c, size in ((64, 56), (128, 28), (256, 14), (512, 7)):
            algorithm, why = choice(op, c, size)
            assert algorithm == "winograd" and "Winograd" in why, (op, c)
        assert choice(op, 8, 56)[0] != "winograd"              # few channels
        assert choice(op, 64, 56, k=8)[0] != "winograd"
        assert choice(op, 64, 9, n=2)[0] != "winograd"         # few tiles
        assert choice(op, 64, 56, stride=2)[0] != "winograd"
        assert choice(op, 64, 56, kernel=5)[0] != "winograd"
        assert choice(op, 64, 56, groups=2)[0] != "winograd"
    with nc.use_backend("cpu"):
        explained = nc.explain("conv_backward_data", np.zeros((8, 64, 56, 56), np.float32),
                               np.zeros((64, 64, 3, 3), np.float32), (8, 64, 56, 56),
                               padding=1)
    assert explained.algorithm == "winograd"


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_the_heuristic_picks_winograd_for_3d_layers(monkeypatch, layout):
    """3D 3x3x3 layers of stride 1: the forward and data gradient from 16 channels, the
    weight gradient from 64 (not stride 2)."""
    backend = _backend()

    def problems(stride, c=64):
        x = np.zeros((2, 8, 28, 28, c) if layout == "channels_last" else (2, c, 8, 28, 28),
                     np.float32)
        w = np.zeros((c, c, 3, 3, 3), np.float32)
        kw = dict(stride=stride, padding=1, layout=layout)
        dy = np.zeros(nc.conv_output_shape(x.shape, w.shape, **kw), np.float32)
        return {"conv": pb.conv_problem(x, w, **kw),
                "conv_backward_data": pb.conv_backward_data_problem(dy, w, x.shape, **kw),
                "conv_backward_weight": pb.conv_backward_weight_problem(x, dy, w.shape, **kw)}

    for op, p in problems(1).items():
        algorithm, why = backend.choose(op, p)
        assert algorithm == "winograd" and "3D 3x3x3" in why, (op, why)
    for op, p in problems(2).items():
        assert backend.choose(op, p)[0] != "winograd", op
    assert backend.choose("conv", problems(1, c=8)["conv"])[0] != "winograd"
    assert backend.choose("conv", problems(1, c=32)["conv"])[0] == "winograd"
    wgrad = problems(1, c=32)["conv_backward_weight"]
    assert backend.choose("conv_backward_weight", wgrad)[0] != "winograd"
    # Nor 16 -> 16 channels-last with AVX-512 (as in 2D).
    from numbaconv.cpu import _heuristics
    monkeypatch.setattr(_heuristics, "wide_registers", lambda: True)
    wgrad = problems(1, c=16)["conv_backward_weight"]
    assert backend.choose("conv_backward_weight", wgrad)[0] != "winograd"
    x = np.zeros((8, 4, 6, 6, 64) if layout == "channels_last" else (8, 64, 4, 6, 6),
                 np.float32)                                      # 9 tiles a depth slice
    p = pb.conv_problem(x, np.zeros((64, 64, 3, 3, 3), np.float32), padding=1, layout=layout)
    assert backend.choose("conv", p)[0] != "winograd"


def test_forcing_winograd_where_it_does_not_apply_names_the_argument():
    backend = _backend()
    x = np.zeros((1, 2, 8, 8))
    w = np.zeros((3, 2, 3, 3))
    for kw in (dict(stride=2), dict(dilation=2)):
        p = pb.conv_problem(x, w, **kw)
        assert "winograd" not in backend.algorithms("conv", p)
        with pytest.raises(ValueError, match="algorithm: 'winograd'"):
            backend.run("conv", p, (x, w, None), None, "winograd")
    w5 = np.zeros((3, 2, 5, 5))
    dy = np.zeros(nc.conv_output_shape(x.shape, w5.shape))
    p = pb.conv_backward_data_problem(dy, w5, x.shape)
    with pytest.raises(ValueError, match="algorithm: 'winograd'"):
        backend.run("conv_backward_data", p, (dy, w5), None, "winograd")


BOUNDSCHECK = background.boundscheck(
    "winograd kernels under NUMBA_BOUNDSCHECK",
    "from test_cpu_winograd import CASES, CASES_3D, _check_all_ops, _check_3d\n"
    "from numbaconv.cpu import _heuristics, _winograd\n"
    "_heuristics.WINOGRAD_BY_OUTPUTS_TILES, _winograd.OUTPUT_BLOCK = 10**9, 3\n"
    "for c in CASES:\n"
    "    _check_all_ops(c, 'float64', 'channels_last')\n"
    "_heuristics.WINOGRAD_BY_PANELS_TILES = 10**9\n"
    "_heuristics.WINOGRAD_WGRAD_BY_PANELS_TILES = 10**9\n"
    "_heuristics.WINOGRAD_WGRAD_BY_PANELS_MIN_TILES = 0\n"
    "for c in CASES + [('panels', (2, 20, 6, 5), 1, 19)]:\n"
    "    for layout in ('channels_first', 'channels_last'):\n"
    "        _check_all_ops(c, 'float64', layout)\n"
    "from test_cpu_winograd import check_by_panels_on_the_shared_cases\n"
    "assert check_by_panels_on_the_shared_cases() >= 8\n"
    "_heuristics.WINOGRAD_BY_PANELS_TILES = 0\n"
    "_heuristics.WINOGRAD_WGRAD_BY_PANELS_TILES = 0\n"
    "_heuristics.WINOGRAD_BY_OUTPUTS_TILES = 0\n"
    "for tiles in (None, 3):\n"
    "    if tiles:\n"
    "        _winograd.MIN_JOB_TILES, _winograd.JOB_BYTES = tiles, 1\n"
    "    for c in CASES:\n"
    "        for layout in ('channels_first', 'channels_last'):\n"
    "            _check_all_ops(c, 'float64', layout)\n"
    "    for c in CASES_3D:\n"
    "        for layout in ('channels_first', 'channels_last'):\n"
    "            _check_3d(c, 'float64', layout)\n")


@BOUNDSCHECK.mark
def test_kernels_stay_in_bounds_under_numba_boundscheck():
    """Every case in both layouts, whole and in jobs of 3 tiles, compiled with
    NUMBA_BOUNDSCHECK=1 (the transforms read clamped indices at the borders)."""
    BOUNDSCHECK.result().check()


def test_numbaconv_winograd_0_takes_it_off_the_table(monkeypatch):
    backend = _backend()
    x = np.zeros((8, 64, 28, 28), np.float32)
    w = np.zeros((64, 64, 3, 3), np.float32)
    p = pb.conv_problem(x, w, padding=1)
    assert backend.choose("conv", p)[0] == "winograd"
    monkeypatch.setenv("NUMBACONV_WINOGRAD", "0")
    assert "winograd" not in backend.algorithms("conv", p)
    assert backend.choose("conv", p)[0] != "winograd"
    monkeypatch.setenv("NUMBACONV_WINOGRAD", "yes")
    with pytest.raises(ValueError, match="NUMBACONV_WINOGRAD"):
        backend.algorithms("conv", p)


@pytest.mark.parametrize("shape", [(4, 6, 12, 10), (2, 6, 3, 8, 6)], ids=["2d", "3d"])
def test_the_weight_gradient_is_the_same_bit_for_bit_on_one_thread_or_two(shape):
    import numba
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    x *= 10.0 ** rng.integers(-4, 4, x.shape)                       # rounding-sensitive
    x = np.moveaxis(x, 1, -1).copy()
    w = np.zeros((5, shape[1]) + (3,) * (len(shape) - 2), np.float32)
    kw = dict(padding=1, layout="channels_last")
    dy = rng.standard_normal(nc.conv_output_shape(x.shape, w.shape, **kw)).astype(np.float32)
    p = pb.conv_backward_weight_problem(x, dy, w.shape, **kw)
    from numbaconv.cpu import _winograd
    previous = numba.get_num_threads(), _winograd.MIN_JOB_TILES, _winograd.JOB_BYTES
    _winograd.MIN_JOB_TILES, _winograd.JOB_BYTES = 5, 1        # 24 (3D: 18) jobs, 8 slots
    try:
        runs = []
        for threads in (2, 1, 2):
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            runs.append(_backend().run("conv_backward_weight", p, (x, dy), None, "winograd"))
    finally:
        numba.set_num_threads(previous[0])
        _winograd.MIN_JOB_TILES, _winograd.JOB_BYTES = previous[1:]
    for other in runs[1:]:
        np.testing.assert_array_equal(runs[0], other)


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_weight_transforms_shared_among_the_workers(monkeypatch, layout, workers):
    """Large weights are transformed (G g G^T) and large weight gradients transformed
    back (G^T dV G) in ranges of output channels shared among the tile workers: every op
    still matches the reference, and dw is bit for bit the one of a single job."""
    from numbaconv.cpu import _tiles
    if _tiles._blas() is None:
        pytest.skip("NumPy's BLAS is not an OpenBLAS numbaconv can set the threads of")
    x, dy, w, _, kw = _arrays(CASES[1], "float64", layout)
    p = pb.conv_backward_weight_problem(x, dy, w.shape, **kw)
    whole = _backend().run("conv_backward_weight", p, (x, dy), None, "winograd")
    monkeypatch.setattr(_tiles, "SHARED_RELAYOUT_ABOVE", 0)
    monkeypatch.setattr(_tiles, "tile_workers",
                        lambda jobs: 1 if _tiles.in_tile_worker() else min(workers, jobs))
    shared = _backend().run("conv_backward_weight", p, (x, dy), None, "winograd")
    np.testing.assert_array_equal(shared, whole)
    for case in CASES:
        _check_all_ops(case, "float64", layout)
