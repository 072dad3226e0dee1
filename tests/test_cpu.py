"""The ``cpu`` backend: every algorithm against the reference, forced one by one; random
problems (hypothesis); workspace tiling; determinism; a NUMBA_BOUNDSCHECK=1 pass.

(The conformance helper in test_builtin_conformance also checks the heuristic's choices with
out=, accumulate and read-only operands.)
"""

import itertools
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

import background

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


def assert_shared_geometry_intact(c, layout, dtype):
    """The int arrays the cpu kernels take are made once per geometry and shared by every
    call: after all algorithms ran, each still holds its geometry (no kernel wrote one)."""
    from numbaconv._kernel_geometry import data_gradient_as_forward, geom
    from numbaconv.cpu import _direct
    for op in OPS[:3]:
        g = geom(build_problem(op, c, layout, case_arrays(c, layout, dtype))[0])
        pairs = []
        for geometry in (g, data_gradient_as_forward(g)):
            pairs += zip(geometry.geometry_args(), (geometry.s, geometry.r, geometry.p,
                                                    geometry.stride, geometry.dilation,
                                                    geometry.before))
        for form in (_direct._forward_form(g), _direct._transposed_form(g)):
            pairs += zip(form.args(), form)
            pairs.append((_direct._column_mask(form), _direct._column_mask.__wrapped__(form)))
        pairs.append((_direct._channel_map(g)[0], _direct._channel_map.__wrapped__(g)[0]))
        for shared, fresh in pairs:
            np.testing.assert_array_equal(shared, fresh, err_msg=f"{c.name} {op}")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_every_algorithm_matches_the_reference(conv_case, layout, dtype):
    assert check_every_algorithm(conv_case, layout, dtype) >= len(OPS)
    assert_shared_geometry_intact(conv_case, layout, dtype)


def test_gemm_and_direct_are_offered_where_they_apply():
    backend = dispatch.get_backend("cpu")

    def algorithms(name, op="conv", layout="channels_first"):
        c = next(c for c in CASES if c.name == name)
        a = case_arrays(c, layout, "float32")
        return backend.algorithms(op, build_problem(op, c, layout, a)[0])

    assert algorithms("2d_1x1") == ("gemm", "implicit", "im2col")
    assert algorithms("2d_kernel_is_input", "conv_backward_weight") == \
        ("gemm", "implicit", "im2col")
    assert algorithms("2d_pad1", "conv_backward_weight", "channels_last") == \
        ("implicit", "winograd", "im2col")
    assert algorithms("2d_depthwise") == ("direct", "im2col")
    assert algorithms("2d_pad1", "conv_backward_data", "channels_last") == \
        ("implicit", "winograd", "im2col")
    assert algorithms("2d_pad1") == ("implicit", "winograd", "im2col")
    assert algorithms("2d_1x1_stride2") == ("im2col",)
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


def _force_tile_workers(monkeypatch, workers):
    """Run the GEMM algorithms' tiles one after another (1) or shared out (2), whatever
    the thread count."""
    from numbaconv.cpu import _tiles
    if workers > 1 and _tiles._blas() is None:
        pytest.skip("NumPy's BLAS is not an OpenBLAS numbaconv can set the threads of")
    monkeypatch.setattr(_tiles, "tile_workers",
                        lambda jobs: 1 if _tiles.in_tile_worker() else min(workers, jobs))


@pytest.mark.parametrize("c", [
    ConvCase("taps_in_padding", (1, 1, 2, 1, 1), (1, 1, 1, 1, 3), padding=(0, 0, 2),
             dilation=(1, 1, 2)),
    ConvCase("taps_past_input", (2, 1, 1, 1, 3), (1, 1, 1, 1, 3), padding=(0, 0, (2, 0)),
             dilation=(1, 1, 2)),
], ids=lambda c: c.name)
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_taps_that_read_no_input_at_all(c, layout):
    """Taps whose every window position falls in the padding (found by hypothesis: the
    valid range came out empty with lo > hi, and slicing with it wrapped around)."""
    check_every_algorithm(c, layout, "float64")


@pytest.mark.parametrize("workers", [1, 2, "twins"])
def test_workspace_tiling_splits_batches_and_rows(monkeypatch, workers):
    from numbaconv.cpu import _tiles
    if workers == "twins":  # the packing kernels' serial twins (workqueue threading layer)
        monkeypatch.setattr(_tiles, "_parallel_kernels_in_workers", lambda: False)
        workers = 2
    _force_tile_workers(monkeypatch, workers)
    c = ConvCase("tiled", (3, 4, 9, 8), (6, 2, 3, 3), stride=(2, 1), padding=1, groups=2,
                 output_padding=(1, 0))
    monkeypatch.setattr(_tiles, "WORKSPACE_BYTES", 0)   # the largest operand bounds it
    monkeypatch.setattr(_tiles, "TILE_BYTES", 2**40)
    for layout in ("channels_first", "channels_last"):
        check_every_algorithm(c, layout, "float64")
    tiles = list(_tiles.tiles(_geom_of(c), 4 * 1000, 1))
    assert all(nb == 1 for _, nb, _, _ in tiles) and len(tiles) > 3  # one row per tile
    monkeypatch.setattr(_tiles, "WORKSPACE_BYTES", 2**40)
    per_position = 4 * 9 * 8                     # channels * taps * float64
    monkeypatch.setattr(_tiles, "TILE_BYTES", 2 * per_position * 5 * 8)  # two images
    tiles = list(_tiles.tiles(_geom_of(c), per_position, 1))
    assert [(n0, nb) for n0, nb, _, _ in tiles] == [(0, 2), (2, 1)]
    for layout in ("channels_first", "channels_last"):
        check_every_algorithm(c, layout, "float64")
    # Stride 1 and output rows as long as input rows: the packing copies runs of rows,
    # here split across row tiles, 3D, dilated.
    monkeypatch.setattr(_tiles, "WORKSPACE_BYTES", 0)
    monkeypatch.setattr(_tiles, "TILE_BYTES", 2**40)
    for same in (ConvCase("runs", (2, 3, 5, 7, 6), (4, 3, 3, 3, 3), padding=(1, 2, 2),
                          dilation=(1, 2, 2)),
                 ConvCase("runs_uneven", (2, 3, 9, 5), (4, 3, 2, 3), padding=((1, 0), 1)),
                 # Stride 2 along rows: phase-split input rows, per row tile.
                 ConvCase("phased", (2, 3, 4, 9, 11), (4, 3, 2, 3, 3), stride=(2, 1, 2),
                          padding=(1, 1, 2), dilation=(1, 2, 1)),
                 ConvCase("phased_3", (2, 2, 12, 13), (3, 2, 3, 4), stride=(1, 3),
                          padding=(2, (1, 2)))):
        for layout in ("channels_first", "channels_last"):
            check_every_algorithm(same, layout, "float64")


def test_phased_packing_equals_the_strided_gather_on_any_row_tile():
    """im2col_cf_phased splits only the input rows a row tile reads: the same packed
    windows as im2col_cf for random 2D/3D geometries and tiles (NaN-filled, so an unwritten
    element shows)."""
    from numbaconv.cpu._im2col_kernels import im2col_cf, im2col_cf_phased
    rng = np.random.default_rng(14)

    def ints(*t):
        return np.array(t, np.int64)

    checked = 0
    while checked < 60:
        deep = bool(rng.integers(0, 2))
        s = [int(rng.integers(1, 6)) if deep else 1, int(rng.integers(1, 9)),
             int(rng.integers(1, 12))]
        r = [int(rng.integers(1, 4)) if deep else 1, int(rng.integers(1, 4)),
             int(rng.integers(1, 4))]
        stride = [int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(2, 4))]
        dil = [int(v) for v in rng.integers(1, 3, 3)]
        before = [int(v) for v in rng.integers(0, 3, 3)]
        p = [(s[i] + 2 * before[i] - dil[i] * (r[i] - 1) - 1) // stride[i] + 1
             for i in range(3)]
        if min(p) <= 0:
            continue
        x = rng.standard_normal((2, 3, *s))
        q0 = int(rng.integers(0, p[0] * p[1]))
        q1 = int(rng.integers(q0 + 1, p[0] * p[1] + 1))
        args = tuple(ints(*v) for v in (s, r, p, stride, dil, before))
        shape = (2, 3 * r[0] * r[1] * r[2], (q1 - q0) * p[2])
        plain, phased = np.full(shape, np.nan), np.full(shape, np.nan)
        im2col_cf(x, plain, False, 0, 0, q0, q1, *args)
        im2col_cf_phased(x, phased, False, 0, 0, q0, q1, *args)
        np.testing.assert_array_equal(phased, plain)
        checked += 1


@pytest.mark.parametrize("name", ["2d_pad1", "2d_depthwise_multiplier", "2d_stride2",
                                  "2d_1x1"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_run_copies_strided_operands_once_and_refuses_a_strided_out(name, layout):
    """Backend.run takes C-contiguous operands from the public calls; handed strided ones
    directly, every algorithm gives the contiguous result (they once raised in im2col, and
    the channels-last direct weight gradient of a depthwise multiplier misread them), and a
    strided ``out`` is refused by name."""
    backend = dispatch.get_backend("cpu")
    case = next(c for c in CASES if c.name == name)
    a = case_arrays(case, layout, "float64")

    def strided(v):
        return None if v is None else np.repeat(v, 2, axis=-1)[..., ::2]

    for op in OPS:
        problem, operands = build_problem(op, case, layout, a)
        wide = tuple(strided(v) for v in operands)
        assert all(v is None or not v.flags.c_contiguous for v in wide)
        for algorithm in backend.algorithms(op, problem):
            expected = backend.run(op, problem, operands, None, algorithm)
            got = backend.run(op, problem, wide, None, algorithm)
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12,
                                       err_msg=f"{op} {algorithm}")
        out = strided(np.zeros_like(expected))
        with pytest.raises(ValueError, match="out"):
            backend.run(op, problem, operands, out, backend.algorithms(op, problem)[0])


def _random_packing_geometry(rng, unit_rows, phase_planes=False):
    """(s, r, p, stride, dil, before) of a random 2D/3D problem with at least one output
    position; ``unit_rows``: stride 1 in the last two dimensions and output rows as long as
    input rows (im2col_cf's contiguous runs); ``phase_planes``: 2D, a stride above 1 along
    rows and output rows as long as a column phase (im2col_cf_phased's _phase_planes)."""
    while True:
        deep = bool(rng.integers(0, 2)) and not phase_planes
        s = [int(rng.integers(1, 6)) if deep else 1, int(rng.integers(1, 9)),
             int(rng.integers(1, 12))]
        r = [int(rng.integers(1, 4)) if deep else 1, int(rng.integers(1, 4)),
             int(rng.integers(1, 4))]
        stride = [int(v) for v in rng.integers(1, 3, 3)]
        dil = [int(v) for v in rng.integers(1, 3, 3)]
        before = [int(v) for v in rng.integers(0, 3, 3)]
        if unit_rows:
            stride[1:] = [1, 1]
            before[2] = dil[2] * (r[2] - 1) // 2
            if dil[2] * (r[2] - 1) % 2:
                continue
        if phase_planes:
            before[0] = 0
            stride[2] = int(rng.integers(2, 4))
        p = [(s[i] + 2 * before[i] - dil[i] * (r[i] - 1) - 1) // stride[i] + 1
             for i in range(3)]
        if phase_planes and p[2] != -(-s[2] // stride[2]):
            continue
        if min(p) > 0 and (not unit_rows or p[2] == s[2]):
            return s, r, p, stride, dil, before


def _window_index(s, r, p, stride, dil, before, q0, q1):
    """For every tap t and output position of rows [q0, q1): the flat input index that
    the window reads, or -1 where it falls outside (the plain NumPy gather of im2col)."""
    taps = np.indices(r).reshape(3, -1)                       # (3, taps)
    out = np.indices(p).reshape(3, -1)[:, q0 * p[2]:q1 * p[2]]  # (3, positions)
    where = (out[:, None, :] * np.array(stride)[:, None, None]
             + taps[:, :, None] * np.array(dil)[:, None, None]
             - np.array(before)[:, None, None])               # (3, taps, positions)
    inside = np.all((where >= 0) & (where < np.array(s)[:, None, None]), axis=0)
    flat = np.ravel_multi_index(tuple(np.clip(where, 0, np.array(s)[:, None, None] - 1)), s)
    return np.where(inside, flat, -1)


@pytest.mark.parametrize("unit_rows, phase_planes", [(True, False), (False, False),
                                                     (False, True)])
def test_channels_first_packing_equals_a_plain_gather_on_any_row_tile(unit_rows,
                                                                      phase_planes):
    """im2col_cf (contiguous runs where the rows allow, else row by row) and, with a stride
    above 1 along rows, im2col_cf_phased pack the windows of random 2D/3D geometries and
    row tiles, both orders of the packed rows, of every channel or of a run of them,
    exactly as a plain NumPy gather (NaN-filled, so an unwritten element shows)."""
    from numbaconv.cpu._im2col_kernels import im2col_cf, im2col_cf_phased
    rng = np.random.default_rng(41)
    for _ in range(60):
        s, r, p, stride, dil, before = _random_packing_geometry(rng, unit_rows,
                                                                phase_planes)
        n, c, n0 = 3, 3, int(rng.integers(0, 2))
        c0 = int(rng.integers(0, c))
        cc = int(rng.integers(1, c - c0 + 1))               # channels [c0, c0 + cc)
        nb = int(rng.integers(1, n - n0 + 1))
        x = rng.standard_normal((n, c) + tuple(s))
        q0 = int(rng.integers(0, p[0] * p[1]))
        q1 = int(rng.integers(q0 + 1, p[0] * p[1] + 1))
        index = _window_index(s, r, p, stride, dil, before, q0, q1)
        planes = np.concatenate([x.reshape(n, c, -1), np.zeros((n, c, 1))], axis=2)
        expected = planes[n0:n0 + nb, c0:c0 + cc, index]  # (nb, cc, taps, positions)
        expected = expected.reshape(nb, cc * index.shape[0], -1)
        args = tuple(np.array(v, np.int64) for v in (s, r, p, stride, dil, before))
        kernels = (im2col_cf, im2col_cf_phased) if stride[2] > 1 else (im2col_cf,)
        for kernel, rows_first in itertools.product(kernels, (False, True)):
            shape = expected.shape[1::-1] + expected.shape[2:] if rows_first else \
                expected.shape
            col = np.full(shape, np.nan)
            kernel(x, col, rows_first, n0, c0, q0, q1, *args)
            got = col.transpose(1, 0, 2) if rows_first else col
            np.testing.assert_array_equal(got, expected)


def test_channels_first_col2im_equals_a_plain_scatter_add_on_any_row_tile():
    """col2im_cf (stride phases gathered first where the stride along rows is above 1) adds
    every packed value into the input element its window reads, as np.add.at does, for
    random 2D/3D geometries and row tiles, into images that already hold values."""
    from numbaconv.cpu._im2col_kernels import col2im_cf
    rng = np.random.default_rng(42)
    for _ in range(60):
        s, r, p, stride, dil, before = _random_packing_geometry(rng, False)
        n, c, n0 = 3, 2, int(rng.integers(0, 2))
        nb = int(rng.integers(1, n - n0 + 1))
        q0 = int(rng.integers(0, p[0] * p[1]))
        q1 = int(rng.integers(q0 + 1, p[0] * p[1] + 1))
        index = _window_index(s, r, p, stride, dil, before, q0, q1)
        taps = index.shape[0]
        dcol = rng.standard_normal((nb, c * taps, index.shape[1]))
        dx = rng.standard_normal((n, c) + tuple(s))
        expected = np.concatenate([dx.reshape(n, c, -1), np.zeros((n, c, 1))], axis=2)
        for b in range(nb):
            for ch in range(c):
                np.add.at(expected[n0 + b, ch], index.reshape(-1),
                          dcol[b, ch * taps:(ch + 1) * taps].reshape(-1))
        args = tuple(np.array(v, np.int64) for v in (s, r, p, stride, dil, before))
        col2im_cf(dcol, dx, n0, q0, q1, *args)
        np.testing.assert_allclose(dx.reshape(n, c, -1), expected[:, :, :-1], rtol=1e-12,
                                   atol=1e-12)


@pytest.mark.parametrize("groups", [1, 2])
def test_channels_last_col2im_equals_a_plain_scatter_add_on_any_row_tile(groups):
    """col2im_cl (one run of r2 * C values per window row with one group and no dilation
    along rows, else a run per tap and group) adds every packed value into the input
    element its window reads, as np.add.at does, for random 2D/3D geometries, row tiles
    and 3-channel groups, into images that already hold values."""
    from numbaconv.cpu._im2col_kernels import col2im_cl
    rng = np.random.default_rng(43)
    for _ in range(60):
        s, r, p, stride, dil, before = _random_packing_geometry(rng, False)
        n, cg, n0 = 3, 3, int(rng.integers(0, 2))
        c = groups * cg
        nb = int(rng.integers(1, n - n0 + 1))
        q0 = int(rng.integers(0, p[0] * p[1]))
        q1 = int(rng.integers(q0 + 1, p[0] * p[1] + 1))
        index = _window_index(s, r, p, stride, dil, before, q0, q1)   # (taps, positions)
        taps, positions = index.shape
        dcol = rng.standard_normal((nb * positions, groups, taps, cg))
        dx = rng.standard_normal((n,) + tuple(s) + (c,))
        expected = np.concatenate([dx.reshape(n, -1, c), np.zeros((n, 1, c))], axis=1)
        for b in range(nb):
            rows = dcol[b * positions:(b + 1) * positions]          # (positions, G, t, cg)
            for g in range(groups):
                for ch in range(cg):
                    np.add.at(expected[n0 + b, :, g * cg + ch], index.reshape(-1),
                              rows[:, g, :, ch].T.reshape(-1))
        args = tuple(np.array(v, np.int64) for v in (s, r, p, stride, dil, before))
        col2im_cl(dcol, dx, n0, q0, q1, groups, *args)
        np.testing.assert_allclose(dx.reshape(n, -1, c), expected[:, :-1], rtol=1e-12,
                                   atol=1e-12)


def test_tile_workers_give_the_same_weight_gradient(monkeypatch):
    """Tiles shared out among threads, or run one after another, are summed in the same
    fixed order (slots chosen by the shape alone)."""
    from numbaconv.cpu import _tiles
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 5, 9, 9)).astype(np.float32)
    dy = rng.standard_normal((6, 7, 9, 9)).astype(np.float32)
    monkeypatch.setattr(_tiles, "TILE_BYTES", 4 * 5 * 9 * 9 * 9)     # one image per tile
    results = []
    for workers, twins in ((1, False), (2, False), (2, False), (2, True)):
        _force_tile_workers(monkeypatch, workers)
        # The serial twins of the packing kernels, which workers use under the workqueue
        # threading layer.
        monkeypatch.setattr(_tiles, "_parallel_kernels_in_workers", lambda: not twins)
        with nc.use_backend("cpu"):
            results.append(nc.conv_backward_weight(x, dy, (7, 5, 3, 3), padding=1))
    with nc.use_backend("reference"):
        expected = nc.conv_backward_weight(x, dy, (7, 5, 3, 3), padding=1)
    assert relative_error(results[0], expected) < TOL["float32"]
    assert np.array_equal(results[1], results[2])
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(results[3], results[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("images, tiles, k, pixels", [
    (8, 1, 20, (16, 16)),       # 8 partial sums; dy's rows: 3 whole MR tiles and 2 more
    (3, 2, 13, (16, 17)),       # 3 partial sums of 1 image, 3 row blocks (the last: edge)
    (5, 1, 6, (4, 4)),          # 80 positions: one partial sum, one row block of one tile
    (2, 3, 40, (20, 30))])      # 600 positions: chunks of 256, 256, 88; 2 x 4 blocks
def test_channels_first_pointwise_weight_gradient_reads_dy_in_place(monkeypatch, dtype,
                                                                      images, tiles, k,
                                                                      pixels):
    """Channels-first one-group 1x1 weight gradients whose x channels fill the strided
    micro-kernel's tiles (AVX-512) read dy's rows in place (``_gemm._pointwise_cf_in_place``):
    the float64 sum's result, however the images fall into partial sums and dy's rows into
    blocks and whole tiles, and bitwise the same when the call is cut into one parallel
    region per image."""
    from numbaconv.cpu import _gemm, _heuristics, _tiles
    from numbaconv.cpu._microkernel import strided_shape, vector_lanes
    mr, nv = strided_shape(dtype)
    c = tiles * nv * vector_lanes(dtype)
    rng = np.random.default_rng(17)
    x = rng.standard_normal((images, c) + pixels).astype(dtype)
    dy = rng.standard_normal((images, k) + pixels).astype(dtype)
    expected = np.einsum("nkp,ncp->kc", dy.reshape(images, k, -1).astype(np.float64),
                         x.reshape(images, c, -1).astype(np.float64))[:, :, None, None]
    runs = []
    real = _gemm._pointwise_cf_in_place
    monkeypatch.setattr(_gemm, "_pointwise_cf_in_place", lambda *a: runs.append(1) or real(*a))
    monkeypatch.setattr(_heuristics, "wide_registers", lambda: True)
    with nc.use_backend("cpu"):
        assert nc.explain("conv_backward_weight", x, dy, (k, c, 1, 1)).algorithm == "gemm"
        got = nc.conv_backward_weight(x, dy, (k, c, 1, 1))
        assert runs and relative_error(got, expected) < TOL[dtype]
        monkeypatch.setattr(_heuristics, "IMPLICIT_PIECE_MACS", 1)
        monkeypatch.setattr(_gemm, "interruptible_ranges",
                            lambda *a: _tiles.interruptible_ranges(*a[:3], 1))
        assert np.array_equal(nc.conv_backward_weight(x, dy, (k, c, 1, 1)), got)
    assert len(runs) == 2


def test_pointwise_rows_in_place_only_where_the_tiles_fill():
    from numbaconv.cpu import _heuristics
    from numbaconv._kernel_geometry import geom
    from numbaconv.cpu._microkernel import strided_shape, vector_lanes

    def applies(c, k, groups=1, layout="channels_first", kernel=1, dtype="float32"):
        x = np.zeros((2, c, 6, 6) if layout == "channels_first" else (2, 6, 6, c), dtype)
        w_shape = (k, c // groups, kernel, kernel)
        dy_shape = nc.conv_output_shape((2, c, 6, 6), w_shape, groups=groups)
        dy = np.zeros(dy_shape if layout == "channels_first" else
                      (2,) + dy_shape[2:] + (k,), dtype)
        p = pb.conv_backward_weight_problem(x, dy, w_shape, groups=groups, layout=layout)
        return _heuristics.pointwise_rows_in_place(geom(p), np.dtype(dtype))

    wide = _heuristics.wide_registers()
    nr = strided_shape(np.float32)[1] * vector_lanes(np.float32)
    assert applies(nr, 8) == applies(2 * nr, 256) == wide
    assert not applies(nr, 8, layout="channels_last")
    assert not applies(2 * nr, 8, groups=2)
    assert not applies(nr + 16, 8) and not applies(nr, 3) and not applies(nr, 8, kernel=3)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("images, m, depth, s", [
    (3, 13, 20, 300),       # an edge row tile (8 + 5); column blocks of 128, 128, 44
    (2, 8, 300, 129),       # two blocks of KC rows (the second added), a one-column block
    (1, 24, 7, 1030)])      # one image, 9 column blocks: 3 row tiles
def test_streamed_matmul(monkeypatch, dtype, images, m, depth, s):
    """``_gemm.streamed_matmul`` (the channels-first 1x1 data gradient and forward with dy's
    blocks prefetched): the float64 product's result, nothing written outside ``out``, and
    bitwise the same results whatever the number of workers or parallel regions."""
    from numbaconv.cpu import _gemm, _heuristics, _tiles
    rng = np.random.default_rng(3)
    a = rng.standard_normal((depth, m)).astype(dtype).T        # any strides
    b = rng.standard_normal((images, depth, s)).astype(dtype)
    expected = np.einsum("mp,nps->nms", a.astype(np.float64), b.astype(np.float64))
    size = images * m * s
    results = []
    for workers, pieces in ((1, False), (2, False), (5, False), (2, True)):
        memory = np.full(size + 70, 7.0, dtype)
        out = memory[:size].reshape(images, m, s)
        with monkeypatch.context() as mp:
            mp.setattr(_gemm, "numba_threads", lambda: workers)
            if pieces:
                mp.setattr(_heuristics, "IMPLICIT_PIECE_MACS", 1)
                mp.setattr(_gemm, "interruptible_ranges",
                           lambda *a: _tiles.interruptible_ranges(*a[:3], 1))
            _gemm.streamed_matmul(a, b, out)
        assert np.all(memory[size:] == 7.0)
        results.append(out.tobytes())
    assert relative_error(out, expected) < TOL[dtype]
    assert all(r == results[0] for r in results)
    # a with unit stride along its rows (the forward's W) packs by another route.
    again = _gemm.streamed_matmul(np.ascontiguousarray(a), b, np.empty_like(out))
    assert again.tobytes() == results[0]


@pytest.mark.parametrize("layout_out", ["given", "accumulate", "strided"])
def test_channels_first_pointwise_data_gradient_and_forward_streamed(monkeypatch, layout_out):
    """Channels-first one-group 1x1 data gradients, transposed and forward convolutions of
    at least STREAMED_POSITIONS positions an image run through ``_gemm.streamed_matmul``:
    the reference's results, into a given, accumulated or strided ``out``."""
    from numbaconv.cpu import _gemm, _heuristics
    runs = []
    real = _gemm.streamed_matmul
    monkeypatch.setattr(_gemm, "streamed_matmul", lambda *a: runs.append(1) or real(*a))
    monkeypatch.setattr(_heuristics, "wide_registers", lambda: True)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 12, 32, 33)).astype(np.float32)
    w = rng.standard_normal((20, 12, 1, 1)).astype(np.float32)
    dy = rng.standard_normal((2, 20, 32, 33)).astype(np.float32)
    bias = rng.standard_normal(12).astype(np.float32)

    def outs(shape):
        if layout_out == "strided":
            return np.zeros(shape[:-1] + (shape[-1] + 3,), np.float32)[..., :shape[-1]]
        return rng.standard_normal(shape).astype(np.float32)

    results = {}
    for backend in ("cpu", "reference"):
        dx, y = outs(x.shape), outs(dy.shape)
        dx0 = dx.copy()
        with nc.use_backend(backend):
            if backend == "cpu":
                assert nc.explain("conv_backward_data", dy, w, x.shape).algorithm == "gemm"
            nc.conv_backward_data(dy, w, x.shape, out=dx,
                                  accumulate=layout_out == "accumulate")
            results[backend] = (dx - dx0 if layout_out == "accumulate" else dx,
                                nc.conv(x, w, out=y), nc.conv_transpose(dy, w, bias))
    for got, expected in zip(results["cpu"], results["reference"]):
        assert relative_error(got, expected) < TOL["float32"]
    assert len(runs) == 3


def test_pointwise_streamed_only_where_images_are_large():
    from numbaconv.cpu import _heuristics
    from numbaconv._kernel_geometry import geom

    def applies(c, k, size, groups=1, layout="channels_first", kernel=1):
        x_shape = (2, c, size, size) if layout == "channels_first" else (2, size, size, c)
        dy_shape = nc.conv_output_shape((2, c, size, size), (k, c // groups, kernel, kernel),
                                        groups=groups)
        if layout == "channels_last":
            dy_shape = (2,) + dy_shape[2:] + (k,)
        p = pb.conv_backward_data_problem(np.zeros(dy_shape, np.float32),
                                          np.zeros((k, c // groups, kernel, kernel),
                                                   np.float32),
                                          x_shape, groups=groups, layout=layout)
        return _heuristics.pointwise_streamed(geom(p), np.dtype(np.float32))

    wide = _heuristics.wide_registers()
    assert applies(64, 256, 32) == applies(3, 5, 56) == wide
    assert not applies(64, 256, 31) and not applies(64, 256, 32, layout="channels_last")
    assert not applies(64, 256, 32, groups=2) and not applies(64, 256, 34, kernel=3)


@pytest.mark.parametrize("channels, groups, pixels", [
    ((3, 5), 1, (3, 7, 5)), ((5, 3), 1, (3, 7, 5)), ((4, 4), 1, (3, 7, 5)),  # 105: runs of 14
    ((6, 4), 2, (3, 7, 5)), ((40, 28), 1, (3, 16, 14)),
    ((32, 44), 1, (3, 16, 15)), ((48, 16), 1, (2, 28, 14))])   # micro-kernel tiles, + rest
def test_pointwise_weight_gradient_over_runs_of_positions(monkeypatch, channels, groups,
                                                          pixels):
    """Channels-last 1x1 weight gradients with many positions per channel are summed over
    SLOTS runs of positions (one group of channels that fill the micro-kernel's tiles: its
    products, whichever side the wider; else BLAS's): the reference's result, bitwise the
    same however the runs are shared out, and the one-product path's result when the split
    is switched off."""
    from numbaconv.cpu import _gemm, _heuristics, _tiles
    from numbaconv.cpu._microkernel import gram_runs
    c, k = channels
    grams = []
    monkeypatch.setattr(_gemm, "gram_runs",
                        lambda *args: grams.append(1) or gram_runs(*args))
    rng = np.random.default_rng(13)
    x = rng.standard_normal(pixels + (c,))
    dy = rng.standard_normal(pixels + (k,))
    shape = (k, c // groups, 1, 1)
    assert np.prod(pixels) >= _heuristics.POSITION_SPLIT_FROM * max(c, k) // groups
    with nc.use_backend("reference"):
        expected = nc.conv_backward_weight(x, dy, shape, groups=groups, layout="channels_last")
    results = []
    with nc.use_backend("cpu"):
        assert nc.explain("conv_backward_weight", x, dy, shape, groups=groups,
                          layout="channels_last").algorithm == "gemm"
        for workers in (1, 2):
            # Shared out: BLAS's runs among tile workers, the micro-kernel's among threads.
            _force_tile_workers(monkeypatch, workers)
            monkeypatch.setattr(_gemm, "numba_threads", lambda workers=workers: workers + 1)
            results.append(nc.conv_backward_weight(x, dy, shape, groups=groups,
                                                   layout="channels_last"))
        monkeypatch.setattr(_heuristics, "POSITION_SPLIT_FROM", 2**62)
        one_product = nc.conv_backward_weight(x, dy, shape, groups=groups,
                                              layout="channels_last")
    # float64 tiles are 16 columns wide with AVX-512, 8 with AVX2.
    assert bool(grams) == (groups == 1 and min(c, k) in (16, 32)), grams
    assert relative_error(results[0], expected) < TOL["float64"]
    if _tiles._blas() is not None:
        assert np.array_equal(results[0], results[1])
    assert results[0].flags.c_contiguous
    np.testing.assert_allclose(one_product, results[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", ["conv", "conv_backward_data", "conv_transpose"])
def test_pointwise_products_reading_rows_in_place(monkeypatch, op):
    """Channels-last 1x1 forward, data gradient and transposed convolution with many rows
    per channel go to _microkernel.rows_gemm (rows shared out in whole micro-kernel bands):
    the reference's result, bitwise the same on one thread or shared out among three, close
    to BLAS's when the rule is switched off."""
    from numbaconv.cpu import _gemm, _heuristics
    calls = []
    monkeypatch.setattr(_gemm, "rows_matmul",
                        lambda *args, real=_gemm.rows_matmul: calls.append(1) or real(*args))
    rng = np.random.default_rng(17)
    c, k = 24, 40                          # columns: whole tiles and an edge either way
    x = rng.standard_normal((2, 23, 16, c)).astype(np.float32)     # 736 rows: bands + 4
    w = rng.standard_normal((k, c, 1, 1)).astype(np.float32)
    dy = rng.standard_normal((2, 23, 16, k)).astype(np.float32)
    kw = dict(layout="channels_last")
    if op == "conv":
        args = (x, w)
    elif op == "conv_backward_data":
        args = (dy, w, x.shape)
    else:
        args = (dy, w)
    fn = getattr(nc, op)
    with nc.use_backend("reference"):
        expected = fn(*args, **kw)
    results = []
    with nc.use_backend("cpu"):
        for workers in (1, 3):
            monkeypatch.setattr(_gemm, "numba_threads", lambda workers=workers: workers)
            results.append(fn(*args, **kw))
        assert calls
        monkeypatch.setattr(_heuristics, "ROWS_GEMM_FROM", 2**62)
        blas = fn(*args, **kw)
    assert relative_error(results[0], expected) < TOL["float32"]
    assert np.array_equal(results[0], results[1])
    np.testing.assert_allclose(blas, results[0], rtol=1e-5, atol=1e-5)


def _channels_last(*arrays):
    return tuple(np.moveaxis(a, 1, -1).copy() for a in arrays)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("tile_bytes", [1, 2 * 3 * 9 * 23 * 23 * 8])
def test_weight_gradient_sums_several_tiles_per_slot(monkeypatch, layout, tile_bytes):
    """More tiles than slots: later tiles' products go through the reused product buffer
    (one output row per tile; two 23x23 images per tile, multiplied image by image)."""
    from numbaconv.cpu import _tiles
    _force_tile_workers(monkeypatch, 2)
    monkeypatch.setattr(_tiles, "TILE_BYTES", tile_bytes)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((18, 3, 23, 23))
    dy = rng.standard_normal((18, 4, 23, 23))
    if layout == "channels_last":
        x, dy = _channels_last(x, dy)
    with nc.use_backend("reference"):
        expected = nc.conv_backward_weight(x, dy, (4, 3, 3, 3), padding=1, layout=layout)
    with nc.use_backend("cpu"):
        got = nc.conv_backward_weight(x, dy, (4, 3, 3, 3), padding=1, layout=layout)
        again = nc.conv_backward_weight(x, dy, (4, 3, 3, 3), padding=1, layout=layout)
    assert relative_error(got, expected) < TOL["float64"]
    assert np.array_equal(got, again)
    assert got.base is None or got.base.nbytes == got.nbytes


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 130, 67), (2, 3, 70, 5), (3, 2, 16, 64),
                                   (4, 1, 65, 129), (2, 0, 5), (1, 4, 0, 3)])
def test_summed_partials_have_the_bits_of_numpy_sums_one_after_another(monkeypatch, dtype,
                                                                         parallel, shape):
    """_tiles.summed: slot sums added in slot order, as NumPy adds them one after another
    (the same bits), swapped or not: whole register-transpose tiles, blocks and ragged
    edges, batches, empty parts; on one thread or in parallel."""
    from numbaconv.cpu import _tiles
    monkeypatch.setattr(_tiles, "PARALLEL_SUM_ABOVE", 0 if parallel else 2**40)
    parts = np.random.default_rng(3).standard_normal(shape).astype(dtype) * 1e3
    before = parts.copy()
    expected = _tiles.sum_in_order(list(parts.copy()))
    for transpose in (False, True):
        got = _tiles.summed(parts, transpose=transpose)
        want = np.swapaxes(expected, -1, -2) if transpose else expected
        assert got.shape == want.shape and got.dtype == parts.dtype
        np.testing.assert_array_equal(got, want)
        assert got.flags.c_contiguous
    np.testing.assert_array_equal(parts, before)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 9, 70), (3, 5, 25, 64), (1, 2, 9, 129),
                                   (2, 0, 9, 4), (2, 3, 4, 0)])
def test_summed_taps_last_has_the_bits_of_numpy_sums_then_a_relayout(monkeypatch, parallel,
                                                                      shape):
    """_tiles.summed_taps_last: (S, K, taps, Cg) parts added in slot order and laid out as
    (K, Cg, taps), the bits of NumPy's sums one after another; ragged channel blocks."""
    from numbaconv.cpu import _tiles
    monkeypatch.setattr(_tiles, "PARALLEL_SUM_ABOVE", 0 if parallel else 2**40)
    parts = np.random.default_rng(4).standard_normal(shape).astype(np.float32) * 1e3
    expected = _tiles.sum_in_order(list(parts.copy())).transpose(0, 2, 1)
    got = _tiles.summed_taps_last(parts)
    assert got.shape == expected.shape and got.flags.c_contiguous
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("case", [
    ConvCase("s1", (5, 7, 6, 6), (4, 7, 3, 3), padding=1),
    ConvCase("s2", (4, 5, 9, 8), (6, 5, 3, 3), stride=2, padding=1),
    ConvCase("s2_3d", (3, 4, 3, 7, 6), (5, 4, 2, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1)),
], ids=lambda c: c.name)
def test_channels_first_weight_gradient_by_pieces_of_channels(monkeypatch, transposed, case):
    """im2col's channels-first weight gradient by pieces of input channels (forced: small
    pieces, tiles of two images): the reference's values, both orientations, float32 and
    float64, bit for bit the same on one tile worker or two and from call to call."""
    from numbaconv._kernel_geometry import geom
    from numbaconv.cpu import _heuristics, _im2col, _tiles
    monkeypatch.setattr(_heuristics, "FEATURE_PIECE_ROWS", 1)
    monkeypatch.setattr(_heuristics, "FEATURE_PIECES", 3)
    for name in ("TRANSPOSED_BELOW", "TRANSPOSED_BELOW_CF"):
        monkeypatch.setattr(_heuristics, name, 2**31 if transposed else 0)
    pieces = []
    original = _im2col._weight_gradient_by_features
    monkeypatch.setattr(_im2col, "_weight_gradient_by_features",
                        lambda *a: pieces.append(a[-1]) or original(*a))
    backend = dispatch.get_backend("cpu")
    op = "conv_backward_weight"
    for dtype in ("float32", "float64"):
        a = case_arrays(case, "channels_first", dtype)
        with nc.use_backend("reference"):
            expected = run_op(op, case, "channels_first", a)
        problem, operands = build_problem(op, case, "channels_first", a)
        g = geom(problem)
        monkeypatch.setattr(_tiles, "TILE_BYTES",           # two images a tile
                            2 * g.c * g.taps * g.positions * np.dtype(dtype).itemsize)
        results = []
        for workers in (1, 2, 2):
            _force_tile_workers(monkeypatch, workers)
            results.append(backend.run(op, problem, operands, None, "im2col"))
        assert relative_error(results[0], expected) < TOL[dtype], (case.name, dtype)
        assert all(np.array_equal(results[0], got) for got in results[1:])
    assert pieces and min(pieces) >= 2, pieces


@pytest.mark.parametrize("channels, cores, expected", [
    (256, 1, 2), (256, 2, 2), (256, 3, 3), (256, 4, 4), (256, 16, 4),   # 2,304 rows
    (512, 2, 4), (512, 6, 6), (512, 16, 8),                              # 4,608 rows
    (128, 2, 2), (128, 8, 2),                                            # 1,152 rows
    (64, 2, 0), (64, 8, 0),                                              # 576 rows
])
def test_feature_pieces_follow_the_shape_and_the_machine(channels, cores, expected):
    """The pieces of im2col's channels-first weight gradient (8 images, 3x3 stride 2 at
    28x28, tiles of two images): FEATURE_PIECE_ROWS rows a piece, more and smaller pieces
    (down to FEATURE_PIECE_MIN_ROWS) on a machine with more cores, none below two; the
    thread settings play no part (the CPU count is the machine's)."""
    from numbaconv import problem as pb
    from numbaconv._kernel_geometry import geom
    from numbaconv.cpu import _heuristics
    x = np.zeros((8, channels, 28, 28), np.float32)
    dy = np.zeros((8, channels, 14, 14), np.float32)
    g = geom(pb.conv_backward_weight_problem(x, dy, (channels, channels, 3, 3), stride=2,
                                             padding=1))
    tiles = [(n0, 2, 0, 14) for n0 in range(0, 8, 2)]
    assert _heuristics.feature_pieces(g, tiles, cores) == expected
    import numba
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        assert _heuristics.feature_pieces(g, tiles) == \
            _heuristics.feature_pieces(g, tiles, os.cpu_count())
    finally:
        numba.set_num_threads(threads)


def test_made_once_makes_each_value_once_for_every_thread():
    """_tiles.made_once: each value made by the first thread that asks for it, once, while
    the others that ask at the same time wait for it and get the same object."""
    import threading
    import time
    from numbaconv.cpu import _tiles
    calls = []

    def maker(i):
        def make():
            calls.append(i)
            time.sleep(0.01)            # long enough for the other threads to ask meanwhile
            return [i]
        return make

    get = _tiles.made_once([maker(i) for i in range(3)])
    got = [[] for _ in range(8)]
    start = threading.Barrier(8)

    def ask(k):
        start.wait()
        got[k] = [get((k + step) % 3) for step in range(3)]

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == [0, 1, 2]
    for values in got:
        assert sorted(values) == [[0], [1], [2]]
        assert all(v is get(v[0]) for v in values)


@pytest.mark.parametrize("transposed", [False, True])
def test_im2col_weight_gradient_in_either_orientation(monkeypatch, transposed):
    """im2col's weight gradient multiplied as dw (Kg, features) or transposed, (features,
    Kg), then summed and transposed back (_tiles.summed), on every shared case, both layouts
    and dtypes: which one runs depends on Kg and the layout (_heuristics.TRANSPOSED_BELOW)."""
    from numbaconv.cpu import _heuristics
    for name in ("TRANSPOSED_BELOW", "TRANSPOSED_BELOW_CF"):
        monkeypatch.setattr(_heuristics, name, 2**31 if transposed else 0)
    backend = dispatch.get_backend("cpu")
    op = "conv_backward_weight"
    for c, layout, dtype in itertools.product(CASES, ("channels_first", "channels_last"),
                                              ("float32", "float64")):
        a = case_arrays(c, layout, dtype)
        with nc.use_backend("reference"):
            expected = run_op(op, c, layout, a)
        problem, operands = build_problem(op, c, layout, a)
        if "im2col" not in backend.algorithms(op, problem):
            continue
        got = backend.run(op, problem, operands, None, "im2col")
        assert relative_error(got, expected) < TOL[dtype], (c.name, layout, dtype)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("tile_bytes", [1, 2**40])
def test_strided_data_gradient_overwrites_every_element_of_out(monkeypatch, layout,
                                                               tile_bytes):
    """col2im adds into dx, which each tile job zeroes first (its own images): NaN in
    ``out`` must not survive, with row tiles of one image or one tile of all images."""
    from numbaconv.cpu import _tiles
    _force_tile_workers(monkeypatch, 2)
    monkeypatch.setattr(_tiles, "TILE_BYTES", tile_bytes)
    rng = np.random.default_rng(12)
    dy = rng.standard_normal((3, 5, 6, 6))
    w = rng.standard_normal((5, 4, 3, 3))
    shape = (3, 4, 11, 11)
    if layout == "channels_last":
        dy, = _channels_last(dy)
        shape = (3, 11, 11, 4)
    with nc.use_backend("reference"):
        expected = nc.conv_backward_data(dy, w, shape, stride=2, padding=1, layout=layout)
    out = np.full(shape, np.nan)
    with nc.use_backend("cpu"):
        assert nc.explain("conv_backward_data", dy, w, shape, stride=2, padding=1,
                          layout=layout).algorithm == "im2col"
        got = nc.conv_backward_data(dy, w, shape, stride=2, padding=1, layout=layout,
                                    out=out)
    assert got is out
    assert relative_error(got, expected) < TOL["float64"]


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_relayout_in_pieces_equals_a_contiguous_copy(monkeypatch, axis):
    from numbaconv.cpu import _tiles
    _force_tile_workers(monkeypatch, 2)
    monkeypatch.setattr(_tiles, "SHARED_RELAYOUT_ABOVE", 0)
    view = np.arange(5 * 7 * 3 * 2, dtype=np.float32).reshape(5, 7, 3, 2)[..., ::-1]
    view = view.transpose(2, 0, 3, 1)
    got = _tiles.relayout(view, axis)
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(got, view)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_weight_relayouts_shared_out_give_the_same_gradients(monkeypatch, layout):
    """Data gradient (flipped weight), channels-last forward and weight gradient with the
    weight re-layouts copied in pieces by the workers."""
    from numbaconv.cpu import _tiles
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 6, 7, 7))
    w = rng.standard_normal((5, 6, 3, 3))
    dy = rng.standard_normal((2, 5, 7, 7))
    if layout == "channels_last":
        x, dy = _channels_last(x, dy)
    kw = dict(padding=1, layout=layout)
    results = []
    for shared in (False, True):
        _force_tile_workers(monkeypatch, 2 if shared else 1)
        monkeypatch.setattr(_tiles, "SHARED_RELAYOUT_ABOVE", 0 if shared else 2**62)
        with nc.use_backend("cpu"):
            results.append((nc.conv_backward_data(dy, w, x.shape, **kw),
                            nc.conv_backward_weight(x, dy, w.shape, **kw), nc.conv(x, w, **kw)))
    with nc.use_backend("reference"):
        expected = (nc.conv_backward_data(dy, w, x.shape, **kw),
                    nc.conv_backward_weight(x, dy, w.shape, **kw), nc.conv(x, w, **kw))
    for one, shared, reference in zip(*results, expected):
        assert relative_error(shared, reference) < TOL["float64"]
        np.testing.assert_allclose(shared, one, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shapes", [
    ((3, 4), (2, 4, 40), (2, 3, 40)),       # a broadcast, the columns split
    ((50, 4), (4, 3), (50, 3)),             # the rows split
    ((9, 2, 3, 4), (9, 2, 4, 5), (9, 2, 3, 5)),   # the batch split
    ((2, 1, 3), (2, 3, 60), (2, 1, 60)),
])
def test_products_shared_out_among_the_workers(monkeypatch, shapes):
    """_tiles.matmul slices out's longest axis among the workers: the same product as
    np.matmul, and called from a worker it multiplies there (no job waits on the pool)."""
    from numbaconv.cpu import _tiles
    _force_tile_workers(monkeypatch, 2)
    monkeypatch.setattr(_tiles, "SHARED_PRODUCT_ABOVE", 0)
    rng = np.random.default_rng(15)
    a, b = rng.standard_normal(shapes[0]), rng.standard_normal(shapes[1])
    out = np.full(shapes[2], np.nan)
    assert _tiles.matmul(a, b, out) is out
    np.testing.assert_allclose(out, np.matmul(a, b), rtol=1e-13, atol=1e-13)
    outs = [np.full(shapes[2], np.nan) for _ in range(3)]
    _tiles.run_tiles(lambda i, pick: _tiles.matmul(a, b, outs[i]), [0, 1, 2])
    for got in outs:
        np.testing.assert_array_equal(got, np.matmul(a, b))
    # In a worker, a re-layout copies there, and a nested run_tiles runs its jobs there,
    # instead of waiting on the pool the worker occupies.
    monkeypatch.setattr(_tiles, "SHARED_RELAYOUT_ABOVE", 0)
    copies = _tiles.run_tiles(lambda i, pick: _tiles.relayout(b.swapaxes(-1, -2), 0),
                             [0, 1, 2, 3])
    for got in copies:
        np.testing.assert_array_equal(got, b.swapaxes(-1, -2))
    nested = _tiles.run_tiles(
        lambda i, pick: _tiles.run_tiles(lambda j, pick: (i, j, _tiles.in_tile_worker()),
                                        [0, 1]), [0, 1, 2, 3])
    assert nested == [[(i, j, True) for j in (0, 1)] for i in range(4)]


@pytest.mark.parametrize("out_shape, split", [
    ((8, 1, 6, 70), 8),         # eight whole products, four a worker
    ((5, 1, 6, 70), 5),         # three and two: within WHOLE_PRODUCTS_IMBALANCE
    ((3, 1, 6, 70), 70),        # two and one would leave a worker idle: the columns
    ((1, 1, 90, 7), 90),        # no stack: the longest axis
])
def test_stacks_of_products_are_shared_out_whole_where_they_divide_evenly(monkeypatch,
                                                                         out_shape, split):
    """_tiles.matmul gives each worker whole products of a stack that divides evenly
    enough among them, else slices of out's longest axis."""
    from numbaconv.cpu import _tiles
    _force_tile_workers(monkeypatch, 2)
    monkeypatch.setattr(_tiles, "SHARED_PRODUCT_ABOVE", 0)
    sizes = []
    real = _tiles.worker_ranges
    monkeypatch.setattr(_tiles, "worker_ranges",
                        lambda size, share=True: sizes.append(size) or real(size, share))
    rng = np.random.default_rng(16)
    a = rng.standard_normal(out_shape[:-1] + (4,))
    b = rng.standard_normal(out_shape[:-2] + (4, out_shape[-1]))
    out = np.full(out_shape, np.nan)
    _tiles.matmul(a, b, out)
    assert sizes == [split]
    np.testing.assert_allclose(out, np.matmul(a, b), rtol=1e-13, atol=1e-13)


def test_tile_workers_leave_blas_threads_as_they_were(monkeypatch):
    """The workers hold NumPy's OpenBLAS to one thread (a process-wide setting) only while
    they run: a leaked setting once halved the speed of every later product."""
    from numbaconv.cpu import _tiles
    _force_tile_workers(monkeypatch, 2)
    monkeypatch.setattr(_tiles, "TILE_BYTES", 1)                  # one output row per tile
    blas = _tiles._blas()
    before = blas.get_num_threads()
    x = np.ones((2, 3, 6, 6))
    with nc.use_backend("cpu"):
        for threads in (2, 1):
            blas.set_num_threads(threads)
            nc.conv_backward_weight(x, nc.conv(x, np.ones((4, 3, 3, 3))), (4, 3, 3, 3))
            assert blas.get_num_threads() == threads
    blas.set_num_threads(before)


def _geom_of(c):
    from numbaconv._kernel_geometry import geom
    a = case_arrays(c, "channels_first", "float64")
    return geom(build_problem("conv", c, "channels_first", a)[0])


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_reductions_are_deterministic(layout):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 8, 12, 12)).astype(np.float32)
    dy = rng.standard_normal((4, 8, 12, 12)).astype(np.float32)
    if layout == "channels_last":
        x, dy = _channels_last(x, dy)
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


BOUNDSCHECK = background.boundscheck(
    "cpu algorithms under NUMBA_BOUNDSCHECK",
    "from test_cpu import check_every_algorithm\n"
    "from numbaconv.testing import CASES\n"
    "from numbaconv.cpu import _tiles\n"
    "_tiles.PARALLEL_BIAS_FROM = 0  # every bias by the kernels\n"
    "_tiles.PARALLEL_SUM_ABOVE = 0  # every sum of partials by the parallel kernels\n"
    "for c in CASES:\n"
    "    for layout in ('channels_first', 'channels_last'):\n"
    "        check_every_algorithm(c, layout, 'float64')\n"
    "# im2col's channels-first weight gradient by pieces of channels, a tile an image\n"
    "from numbaconv._kernel_geometry import geom\n"
    "from numbaconv.cpu import _heuristics\n"
    "from numbaconv.testing import case_arrays\n"
    "from test_cpu import build_problem\n"
    "_heuristics.FEATURE_PIECE_ROWS = 1\n"
    "for c in CASES:\n"
    "    a = case_arrays(c, 'channels_first', 'float64')\n"
    "    g = geom(build_problem('conv_backward_weight', c, 'channels_first', a)[0])\n"
    "    _tiles.TILE_BYTES = g.c * g.taps * g.positions * 8\n"
    "    check_every_algorithm(c, 'channels_first', 'float64', ops=('conv_backward_weight',))\n"
    "# the channels-first 1x1 weight gradient reading dy in place (its edge rows, its blocks)\n"
    "import test_cpu\n"
    "from _pytest.monkeypatch import MonkeyPatch\n"
    "for case in ((8, 1, 20, (16, 16)), (3, 2, 13, (16, 17))):\n"
    "    with MonkeyPatch.context() as mp:\n"
    "        test_cpu.test_channels_first_pointwise_weight_gradient_reads_dy_in_place(\n"
    "            mp, 'float64', *case)\n"
    "# the channels-first 1x1 data gradient with dy's blocks prefetched (edge tiles, blocks)\n"
    "for case in ((3, 13, 20, 300), (2, 8, 300, 129)):\n"
    "    with MonkeyPatch.context() as mp:\n"
    "        test_cpu.test_streamed_matmul(mp, 'float64', *case)\n"
    "# channels-last 1x1 products reading rows in place, on one thread and shared out\n"
    "for op in ('conv', 'conv_backward_data'):\n"
    "    with MonkeyPatch.context() as mp:\n"
    "        test_cpu.test_pointwise_products_reading_rows_in_place(mp, op)\n"
    "# the channels-last 1x1 weight gradient's runs of positions (micro-kernel, edge columns)\n"
    "for case in (((32, 44), 1, (3, 16, 15)), ((48, 16), 1, (2, 28, 14))):\n"
    "    with MonkeyPatch.context() as mp:\n"
    "        test_cpu.test_pointwise_weight_gradient_over_runs_of_positions(mp, *case)\n"
    "# the two products alone: rows in blocks of one tile, runs with short tiles and edges\n"
    "import test_cpu_microkernel\n"
    "for dtype in ('float32', 'float64'):\n"
    "    test_cpu_microkernel.test_gram_runs_match_numpy_whatever_the_workers(dtype)\n"
    "    with MonkeyPatch.context() as mp:\n"
    "        test_cpu_microkernel.test_rows_gemm_matches_numpy_inside_a_guarded_output(\n"
    "            mp, dtype, 1)\n",
    first=True)


@BOUNDSCHECK.mark
def test_kernels_stay_in_bounds_under_numba_boundscheck():
    """Every algorithm on every case once more, compiled with NUMBA_BOUNDSCHECK=1."""
    BOUNDSCHECK.result().check()


def test_importing_the_backend_compiles_nothing():
    code = ("import sys, numbaconv as nc\n"
            "nc.backends()\n"
            "assert 'numba' not in sys.modules, 'numba imported by backend discovery'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_bias_gradient_on_one_thread_or_in_parallel_is_the_same_bits(layout, monkeypatch):
    """dy below PARALLEL_FROM is summed by the kernels compiled for one thread: the same
    order of additions, so the same bits as the parallel kernels, on either side of it."""
    from numbaconv.cpu import conv_backward_bias as bias_gradient
    rng = np.random.default_rng(12)
    dy = rng.standard_normal((3, 7, 37, 41)).astype(np.float32)
    if layout == "channels_last":
        dy = np.ascontiguousarray(np.moveaxis(dy, 1, -1))
    with nc.use_backend("reference"):
        expected = nc.conv_backward_bias(dy, layout=layout)
    got = {}
    for threshold in (dy.size + 1, 0):
        monkeypatch.setattr(bias_gradient, "PARALLEL_FROM", threshold)
        with nc.use_backend("cpu"):
            got[threshold] = nc.conv_backward_bias(dy, layout=layout)
    serial, parallel = got.values()
    assert np.array_equal(serial, parallel)
    assert relative_error(serial, expected) < TOL["float32"]


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_bias_gradient_of_many_rows(layout):
    """Enough rows that each channels-last chunk runs its four-rows-at-a-time loop and its
    remainder; a NaN in one row reaches only its channel."""
    rng = np.random.default_rng(11)
    dy = rng.standard_normal((3, 11, 13, 5)).astype(np.float32)   # 429 rows of 5
    dy[1, 4, 7, 2] = np.nan
    if layout == "channels_first":
        dy = np.ascontiguousarray(np.moveaxis(dy, -1, 1))
    with nc.use_backend("reference"):
        expected = nc.conv_backward_bias(dy, layout=layout)
    with nc.use_backend("cpu"):
        got = nc.conv_backward_bias(dy, layout=layout)
    assert np.isnan(got[2]) and np.isnan(expected[2])
    keep = np.arange(5) != 2
    assert relative_error(got[keep], expected[keep]) < TOL["float32"]


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bias_added_by_the_tile_workers_equals_numpy(monkeypatch, workers, layout, dtype):
    """Above PARALLEL_BIAS_FROM the bias is added by a Numba kernel in chunks of rows shared
    among the tile workers (channels-first chunks start at any plane, not only at a whole
    image): bit for bit NumPy's broadcast add, NaN and infinities included."""
    from numbaconv.cpu import _tiles
    _force_tile_workers(monkeypatch, workers)
    monkeypatch.setattr(_tiles, "PARALLEL_BIAS_FROM", 0)
    rng = np.random.default_rng(21)
    for shape in ((1, 5, 3, 7), (3, 7, 2, 1), (2, 1, 4, 4)):       # (N, C, H, W)
        a = rng.standard_normal(shape).astype(dtype)
        a[0, -1, 0, 0], a.flat[-1] = np.inf, np.nan
        v = rng.standard_normal(shape[1]).astype(dtype)
        v[0] = -np.inf
        if layout == "channels_last":
            a = np.ascontiguousarray(np.moveaxis(a, 1, -1))
        with np.errstate(invalid="ignore"):                # inf - inf
            expected = a + (v if layout == "channels_last" else v[:, None, None])
        _tiles.add_channel_vector(None, a, v, layout == "channels_last")
        np.testing.assert_array_equal(a, expected)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_forward_and_transposed_bias_by_the_tile_workers(monkeypatch, layout):
    """Every forward and transposed algorithm with its bias added by the kernels (not
    NumPy) still matches the reference."""
    from numbaconv.cpu import _tiles
    _force_tile_workers(monkeypatch, 2)
    monkeypatch.setattr(_tiles, "PARALLEL_BIAS_FROM", 0)
    for c in CASES:
        check_every_algorithm(c, layout, "float64", ops=("conv", "conv_transpose"))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_tile_workers_in_a_forked_child(monkeypatch):
    """A child forked after the tile workers started gets its own pool (the parent's
    threads do not exist in it) and the same result."""
    import multiprocessing
    from numbaconv.cpu import _tiles
    _force_tile_workers(monkeypatch, 2)
    monkeypatch.setattr(_tiles, "TILE_BYTES", 1)
    x = np.arange(2 * 3 * 6 * 6, dtype=np.float64).reshape(2, 3, 6, 6) % 7
    w = np.ones((4, 3, 3, 3))
    with nc.use_backend("cpu"):
        expected = nc.conv(x, w, padding=1)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply(_conv_in_child, (x, w))
    np.testing.assert_array_equal(got, expected)


def _conv_in_child(x, w):
    with nc.use_backend("cpu"):
        return nc.conv(x, w, padding=1)
