"""numbaconv.cpu._microkernel: ``gemm`` (packed; not yet used by an algorithm), ``gram`` (in
place; the channels-last weight gradient's product), ``rows_gemm`` (in place; the
channels-last 1x1 forward and data gradient's) and ``RowPanels`` (weights packed once; the
recurrent networks' per-step products) against NumPy's: edge tiles in every
direction, more than one block of the shared dimension and of the columns, strided operands,
an empty shared dimension, adding, bitwise repeatability, and nothing written outside
``out``."""


import numpy as np
import pytest

from numbaconv.cpu import _microkernel as mk

import background

TOL = {"float32": 2e-6, "float64": 1e-14}


def _shapes(dtype):
    mr, nv = mk.tile_shape(dtype)
    nr = nv * mk.vector_lanes(dtype)
    kc = mk.KC
    return [(1, 1, 1), (mr, kc, nr), (mr - 1, 3, nr + 1), (2 * mr + 5, kc + 1, 3 * nr - 7),
            (7, 2 * kc + 3, 1), (1, 9, 70 * nr + 3), (13 * mr + 1, 5, 2), (0, 4, 3), (3, 4, 0)]


def _guarded(shape, dtype, left=1, right=2):
    """(out, outside): out of ``shape`` (..., rows, columns), a view into a NaN-filled frame
    with a row above and below, ``left`` columns before and ``right`` after each matrix, and
    a function that gives the frame's values outside out (all NaN while nothing was written
    there)."""
    *batch, rows, columns = shape
    frame = np.full((*batch, rows + 2, left + columns + right), np.nan, dtype)
    inside = np.zeros(frame.shape, bool)
    inside[..., 1:rows + 1, left:left + columns] = True
    return frame[..., 1:rows + 1, left:left + columns], lambda: frame[~inside]


def _assert_product(out, a, b, dtype, label):
    """out == a @ b within TOL[dtype] of the sum of the products' magnitudes."""
    expected = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64) + 1e-300
    assert np.all(np.abs(out - expected) <= TOL[dtype] * scale), label


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gemm_matches_numpy_inside_a_guarded_output(dtype):
    rng = np.random.default_rng(0)
    for m, k, n in _shapes(dtype):
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)
        out, outside = _guarded((m, n), dtype)
        assert mk.gemm(a, b, out) is out
        _assert_product(out, a, b, dtype, (m, k, n))
        assert np.isnan(outside()).all(), (m, k, n)


def test_gemm_reads_strided_operands_and_overwrites_out():
    rng = np.random.default_rng(1)
    big = rng.standard_normal((70, 900)).astype(np.float32)
    a = big[::2, ::3]                       # (35, 300), both strides above one element
    b = rng.standard_normal((37, 300)).astype(np.float32).T      # (300, 37), transposed
    out = np.full((35, 37), np.nan, np.float32)
    mk.gemm(a, b, out)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b.astype(np.float64),
                               rtol=1e-5, atol=1e-4)


def test_gemm_with_an_empty_shared_dimension_writes_zeros():
    out = np.full((5, 6), np.nan)
    mk.gemm(np.empty((5, 0)), np.empty((0, 6)), out)
    assert np.array_equal(out, np.zeros((5, 6)))


def test_gemm_rejects_bad_operands():
    a = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="float32 or float64"):
        mk.gemm(a, np.ones((3, 4)), np.empty((2, 4), np.float32))
    with pytest.raises(ValueError, match="do not match"):
        mk.gemm(a, np.ones((4, 4), np.float32), np.empty((2, 4), np.float32))
    with pytest.raises(ValueError, match="unit stride"):
        mk.gemm(a, np.ones((3, 4), np.float32), np.empty((2, 8), np.float32)[:, ::2])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("add", [False, True])
def test_gram_matches_numpy_inside_a_guarded_output(dtype, add):
    rng = np.random.default_rng(4)
    for m, f, k, a, b in _gram_cases(dtype, rng):
        start = rng.standard_normal((f, k)).astype(dtype)
        out, outside = _guarded((f, k), dtype)
        out[...] = start if add else np.nan
        assert mk.gram(a, b, out, add=add) is out
        _assert_gram(out, a, b, start if add else 0, dtype, (m, f, k))
        assert np.isnan(outside()).all(), (m, f, k)
        again = np.empty_like(out)
        again[...] = start if add else 0
        assert np.array_equal(mk.gram(a, b, again, add=add), out)


def _gram_cases(dtype, rng):
    """(M, F, K, a, b) of gram's tests, a (M, F) and b (M, K) row slices of wider arrays
    (row stride above the row length): edges either side, several chunks (the last short),
    and gram_runs's shorter tiles after the tall ones (AVX-512), with an edge."""
    mr, nv = mk.tile_shape(dtype)
    nr = nv * mk.vector_lanes(dtype)
    for m, f, k in ((1, 1, 1), (3, mr, nr), (700, 2 * mr + 3, nr - 1), (1100, mr - 1, 3 * nr),
                    (5, 147, 64), (0, mr, nr), (513, 4 * mr, 2 * nr + 5),
                    (1157, 22 * mr, 2 * nr), (150, 16, nr), (200, 20, nr + 3),
                    (517, 64, 2 * nr), (90, 29, nr)):
        a = rng.standard_normal((m, f + 3)).astype(dtype)[:, 2:f + 2]
        b = rng.standard_normal((m, k + 5)).astype(dtype)[:, 1:k + 1]
        yield m, f, k, a, b


def _assert_gram(out, a, b, start, dtype, where):
    expected = a.T.astype(np.float64) @ b.astype(np.float64) + start
    scale = np.abs(a.T).astype(np.float64) @ np.abs(b).astype(np.float64) + 1
    assert np.all(np.abs(out - expected) <= TOL[dtype] * scale), where


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gram_prefetching_one_line_a_tile_ends(dtype):
    """A chunk followed by one more row, with more tiles than lines to prefetch (a share
    of one line a tile): the spacing of the fetches was widened forever there (the test
    of gram_runs hung on AVX2 machines, whose tiles made that share for 513 rows)."""
    mr, nv = mk.tile_shape(dtype)
    nr = nv * mk.vector_lanes(dtype)
    f, k = 8 * mr, 4 * nr
    itemsize = np.dtype(dtype).itemsize
    depth = min(512, max(64, mk.GRAM_CHUNK_BYTES // ((f + k) * itemsize)))
    rng = np.random.default_rng(3)
    a = rng.standard_normal((depth + 1, f)).astype(dtype)
    b = rng.standard_normal((depth + 1, k)).astype(dtype)
    out = np.empty((1, f, k), dtype)
    assert mk.gram_runs(a, b, out, depth + 1) is out
    _assert_gram(out[0], a, b, 0, dtype, (f, k))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gram_tile_rows_cover_all_but_a_short_edge(dtype):
    """Tall and short tiles cover every row they can: all of a multiple of 4 from 16 on
    with AVX-512 (12- and 8-row tiles), fewer than MR rows left in any case."""
    mr = mk.tile_shape(dtype)[0]
    low = mk.STREAM_TILE[0]
    for rows in range(mr, 300):
        tall, short = mk.gram_tile_rows(rows, dtype)
        covered = tall * mr + (short * low if low < mr else 0)
        assert tall >= 0 and short >= 0 and 0 <= rows - covered < mr, rows
        if low < mr and rows % 4 == 0 and rows >= 16:
            assert covered == rows, rows
    if mr == 12:
        assert mk.gram_tile_rows(256, dtype) == (20, 2)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gram_runs_match_numpy_whatever_the_workers(dtype):
    """Each run of rows its own a.T @ b (chunks of about GRAM_CHUNK_BYTES, each chunk's
    tiles prefetching the next), bitwise the same on one thread or shared out, nothing
    written outside ``out``."""
    for m, f, k, a, b in _gram_cases(dtype, np.random.default_rng(5)):
        for run in (1, 97, 600, max(m, 1)):
            runs = max(1, -(-m // run))
            results = []
            for workers in (1, 2, 5):
                out, outside = _guarded((runs, f, k), dtype)
                assert mk.gram_runs(a, b, out, run, workers) is out
                assert np.isnan(outside()).all(), (m, f, k, run, workers)
                results.append(out)
            for index in range(runs):
                rows = slice(index * run, (index + 1) * run)
                _assert_gram(results[0][index], a[rows], b[rows], 0, dtype,
                             (m, f, k, run, index))
            assert all(np.array_equal(r, results[0]) for r in results[1:]), (m, f, k, run)
    with pytest.raises(ValueError, match="needs 3 runs"):
        mk.gram_runs(np.ones((5, 2), dtype), np.ones((5, 2), dtype),
                     np.empty((2, 2, 2), dtype), 2)


def test_gram_rejects_bad_operands():
    a = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="do not match"):
        mk.gram(a, np.ones((5, 2), np.float32), np.empty((3, 2), np.float32))
    with pytest.raises(ValueError, match="unit stride"):
        mk.gram(np.ones((4, 6), np.float32)[:, ::2], np.ones((4, 2), np.float32),
                np.empty((3, 2), np.float32))
    with pytest.raises(TypeError, match="float32 or float64"):
        mk.gram(a, np.ones((4, 2)), np.empty((3, 2), np.float32))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("block_bytes", [None, 1])
def test_rows_gemm_matches_numpy_inside_a_guarded_output(monkeypatch, dtype, block_bytes):
    """``block_bytes`` 1: blocks of b one tile wide (the columns in several blocks)."""
    mr, nv = mk.strided_shape(dtype)
    nr = nv * mk.vector_lanes(dtype)
    kc, nc = mk.ROWS_KC, 2 * nr
    if block_bytes is not None:
        monkeypatch.setattr(mk, "ROWS_B_BYTES", block_bytes)
    rng = np.random.default_rng(6)
    for m, k, n in ((1, 1, 1), (mr, kc, nr), (mr - 1, 3, nr + 1), (3 * mr + 5, 2 * kc + 3, nc + nr),
                    (4 * mr, 7, 2 * nc + 3), (mr + 1, 9, nr - 1), (50, 64, 3 * nr), (0, 4, 3),
                    (5, 4, 0), (2 * mr, 0, nr + 2)):
        # a's, b's and out's rows as slices of wider arrays (row stride above the length).
        a = rng.standard_normal((m, k + 3)).astype(dtype)[:, 1:k + 1]
        b = rng.standard_normal((k, n + 2)).astype(dtype)[:, 2:]
        out, outside = _guarded((m, n), dtype, left=2, right=3)
        assert mk.rows_gemm(a, b, out) is out
        _assert_product(out, a, b, dtype, (m, k, n))
        assert np.isnan(outside()).all(), (m, k, n)
        assert np.array_equal(mk.rows_gemm(a, b, np.empty_like(out)), out)
        # Shared out among threads (a run of whole bands each, more workers than bands
        # included): the same bits, and nothing written outside.
        for workers in (2, 3, 7):
            shared, outside = _guarded((m, n), dtype, left=2, right=3)
            assert mk.rows_gemm(a, b, shared, workers) is shared
            assert np.array_equal(shared, out), (m, k, n, workers)
            assert np.isnan(outside()).all(), (m, k, n, workers)


def test_rows_gemm_blocks_of_columns():
    """The fewest blocks of b of at most ROWS_B_BYTES, as even as whole tiles allow."""
    nr = mk.strided_shape(np.float32)[1] * mk.vector_lanes(np.float32)
    budget = mk.ROWS_B_BYTES // 4                   # float32 values in a block
    assert mk.rows_columns(1, 1, np.float32) == nr
    assert mk.rows_columns(64, 4 * nr, np.float32) == 4 * nr
    assert mk.rows_columns(budget // (4 * nr), 4 * nr, np.float32) == 4 * nr
    assert mk.rows_columns(budget // (4 * nr) + 1, 4 * nr, np.float32) == 2 * nr
    assert mk.rows_columns(budget // (4 * nr) + 1, 4 * nr + 1, np.float32) == 3 * nr
    assert mk.rows_columns(10 * budget, nr, np.float32) == nr


def test_rows_gemm_rejects_bad_operands():
    a = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="do not match"):
        mk.rows_gemm(a, np.ones((4, 2), np.float32), np.empty((4, 2), np.float32))
    with pytest.raises(ValueError, match="unit stride"):
        mk.rows_gemm(np.ones((4, 6), np.float32)[:, ::2], np.ones((3, 2), np.float32),
                     np.empty((4, 2), np.float32))
    with pytest.raises(TypeError, match="float32 or float64"):
        mk.rows_gemm(a, np.ones((3, 2)), np.empty((4, 2), np.float32))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_row_panels_match_numpy_whatever_the_panels_shared_out(dtype):
    """Weights packed once, multiplied by several right operands (loaded transposed, as the
    recurrences load each step's states); the product of a run of panels has the same bits
    as the whole product's rows."""
    rng = np.random.default_rng(5)
    mr, nv = mk.tile_shape(dtype)
    for m, k, width in _shapes(dtype):
        a = rng.standard_normal((m, k)).astype(dtype)
        panels = mk.RowPanels(a)
        assert panels.count == -(-m // mr) and panels.rows == m and panels.depth == k
        # packed from a transposed view (the backward's W_hh.T): the same panels
        np.testing.assert_array_equal(mk.RowPanels(np.ascontiguousarray(a.T).T).panels,
                                      panels.panels)
        b = panels.columns(width)
        out = panels.output(width)
        for step in range(2):
            states = rng.standard_normal((width, k + 3)).astype(dtype)[:, :k]  # row stride
            assert panels.load(states, b) is b
            np.testing.assert_array_equal(b[:, :width], states.T)
            assert not b[:, width:].any()
            assert panels.multiply(b, out) is out
            _assert_product(out[:m, :width], a, states.T, dtype, (m, k, width, step))
            whole = out.copy()
            out[...] = np.nan
            for start in range(panels.count):          # one panel at a time
                panels.multiply(b, out, start, start + 1)
            np.testing.assert_array_equal(out, whole)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("height", ["mr", "nr"])
def test_row_panels_pack_any_strides_like_numpy(dtype, height):
    """Each of the three packing kernels (unit stride along the rows: register transposes;
    down the columns, as W_hh.T: copies; neither: element by element) gives the panels of a
    plain NumPy packing, whole and partial last panels, and a refill over old values leaves
    the rows past the matrix zero."""
    rng = np.random.default_rng(9)
    h = mk.tile_shape(dtype)[0] if height == "mr" else mk.RowPanels.tile_columns(dtype)
    for rows, depth in ((1, 1), (h, 3), (2 * h + 1, 17), (3 * h - 1, 40)):
        a = rng.standard_normal((rows, depth)).astype(dtype)
        count = -(-rows // h)
        want = np.zeros((count * h, depth), dtype)
        want[:rows] = a
        want = want.reshape(count, h, depth).transpose(0, 2, 1)
        neither = np.zeros((2 * rows, 2 * depth), dtype)[::2, ::2]
        neither[...] = a
        views = {"rows": a, "columns": np.asfortranarray(a), "neither": neither}
        for name, view in views.items():
            panels = mk.RowPanels(view, height=h)
            np.testing.assert_array_equal(panels.panels, want, err_msg=(name, rows, depth))
            panels.refill(view * 2)
            np.testing.assert_array_equal(panels.panels, want * 2, err_msg=(name, rows, depth))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_columns_product_matches_numpy_whatever_the_panels_shared_out(dtype):
    """States transposed into columns (each step) times weights packed once in NR-row
    panels; a run of the weights' panels gives the same bits as the whole."""
    rng = np.random.default_rng(6)
    nr = mk.RowPanels.tile_columns(dtype)
    for width, k, m in _shapes(dtype):
        w = rng.standard_normal((m, k)).astype(dtype)
        weights = mk.RowPanels(w, height=nr)
        columns = mk.state_columns(width, k, dtype)
        height = mk.panel_rows(width, dtype)
        out = np.full((-(-width // height) * height, weights.count * nr), np.nan, dtype)
        for step in range(2):
            h = rng.standard_normal((width, k + 3)).astype(dtype)[:, :k]  # a row stride
            assert mk.load_columns(h, columns) is columns
            np.testing.assert_array_equal(columns[:, :width], h.T)
            assert not columns[:, width:].any()
            assert mk.columns_product(columns, width, weights, out) is out
            _assert_product(out[:width, :m], h, w.T, dtype, (width, k, m, step))
            assert not out[width:].any() and not out[:, m:].any()
            whole = out.copy()
            out[...] = np.nan
            for start in range(weights.count):
                mk.columns_product(columns, width, weights, out, start, start + 1)
            np.testing.assert_array_equal(out, whole)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_columns_product_on_lower_tiles_has_the_bits_of_mr_row_tiles(dtype):
    """The states' tiles of any height up to MR (:func:`panel_rows` picks one per chain)
    give the product of MR-row tiles bit for bit: each value is the same chain of fused
    multiply-adds, whatever the height of the tile that computes it."""
    rng = np.random.default_rng(8)
    mr = mk.tile_shape(dtype)[0]
    nr = mk.RowPanels.tile_columns(dtype)
    k, m = 2 * mk.KC + 5, 2 * nr + 3
    w = rng.standard_normal((m, k)).astype(dtype)
    weights = mk.RowPanels(w, height=nr)
    for width in (1, mr - 1, mr + 1, 16, 2 * mr + 3):
        h = rng.standard_normal((width, k)).astype(dtype)
        columns = np.zeros((k, 4 * width + 2 * mr), dtype)
        mk.load_columns(h, columns)
        results = {}
        for height in sorted({1, mr // 2, mr - 1, mr, mk.panel_rows(width, dtype)}):
            count = -(-width // height)
            out = np.full((count * height, weights.count * nr), np.nan, dtype)
            mk._columns_kernel(height, mr)(columns, weights.panels, out, 0, weights.count,
                                           count, height, nr, mk.KC)
            results[height] = out[:width]
            assert not out[width:].any()
        for height, got in results.items():
            np.testing.assert_array_equal(got, results[mr], err_msg=(width, height))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_planes_product_matches_numpy_and_checks_its_reach(dtype):
    """Planes of A read in place, transposed (rows at a pitch, the last MR-row tile whole),
    times one NR-column panel each, over one and several KC-deep chunks; arrays too short
    for what the call would read or write are refused before anything is written."""
    rng = np.random.default_rng(9)
    mr = mk.tile_shape(dtype)[0]
    nr = mk.RowPanels.tile_columns(dtype)
    for rows, depth, planes in ((1, 3, 1), (mr + 5, mk.KC + 7, 3), (2 * mr, 2 * mk.KC, 2)):
        count = -(-rows // mr)
        pitch, step, panel_step = rows + 3, (depth + 1) * (rows + 3), depth * nr + 5
        out_step = count * mr * nr + 7
        a = rng.standard_normal((planes, rows, depth)).astype(dtype)
        b = rng.standard_normal((planes, depth, nr)).astype(dtype)
        columns = np.zeros(planes * step + mr, dtype)
        panels = np.zeros(planes * panel_step, dtype)
        for q in range(planes):
            columns[q * step:q * step + depth * pitch].reshape(depth, pitch)[:, :rows] = a[q].T
            panels[q * panel_step:q * panel_step + depth * nr] = b[q].reshape(-1)
        out = np.full(planes * out_step, np.nan, dtype)
        mk.planes_product(columns, step, pitch, rows, depth, panels, panel_step, out,
                          out_step, planes)
        for q in range(planes):
            got = out[q * out_step:q * out_step + rows * nr].reshape(rows, nr)
            _assert_product(got, a[q], b[q], dtype, (rows, depth, q))
        assert np.isnan(out[planes * out_step - 7:]).all()      # past the last plane's tiles
        short = (columns[:(planes - 1) * step + (depth - 1) * pitch + count * mr - 1],
                 panels, out)
        for args in (short, (columns, panels[:-6], out), (columns, panels, out[:-8])):
            before = args[2].copy()
            with pytest.raises(ValueError, match="planes_product"):
                mk.planes_product(args[0], step, pitch, rows, depth, args[1], panel_step,
                                  args[2], out_step, planes)
            np.testing.assert_array_equal(args[2], before)


def test_panel_rows_pad_the_least_with_enough_accumulators():
    for dtype in ("float32", "float64"):
        mr, nv = mk.tile_shape(dtype)
        low = min(mr, -(-mk.PANEL_ACCUMULATORS // nv))
        for rows in range(1, 5 * mr):
            height = mk.panel_rows(rows, dtype)
            padded = -(-rows // height) * height
            assert low <= height <= mr, (dtype, rows)
            assert all(padded <= -(-rows // h) * h for h in range(low, mr + 1)), (dtype, rows)
    if mk.tile_shape(np.float32) == (12, 2):
        assert [mk.panel_rows(r, np.float32) for r in (2, 10, 16, 20, 24, 32)] == \
            [6, 10, 8, 10, 12, 8]


def test_single_vector_rows_only_for_one_vector_of_columns_padding_the_least():
    for dtype in ("float32", "float64"):
        lanes = mk.vector_lanes(dtype)
        high = mk.SINGLE_VECTOR_MAX_ROWS[lanes * np.dtype(dtype).itemsize]
        low = min(mk.PANEL_ACCUMULATORS, high)
        assert mk.single_vector_rows(48, lanes + 1, dtype) is None
        for columns in (1, lanes):
            for rows in range(1, 4 * high):
                height = mk.single_vector_rows(rows, columns, dtype)
                padded = -(-rows // height) * height
                assert low <= height <= high, (dtype, rows)
                assert all(padded <= -(-rows // h) * h for h in range(low, high + 1))
                # The tallest of those that pad the least.
                assert not any(-(-rows // h) * h == padded for h in range(height + 1, high + 1))
    if mk.vector_lanes(np.float32) == 16:
        # 3x3 windows of 16 channels: 48 features a tap row, 2 tiles of 24; the stem's 21.
        assert [mk.single_vector_rows(r, 16, np.float32) for r in (48, 21, 9, 100)] == \
            [24, 21, 12, 25]


def test_columns_product_rejects_what_does_not_fit():
    nr = mk.RowPanels.tile_columns(np.float32)
    columns = mk.state_columns(3, 5, np.float32)
    weights = mk.RowPanels(np.ones((7, 5), np.float32), height=nr)
    height = mk.panel_rows(3, np.float32)
    out = np.empty((height, weights.count * nr), np.float32)
    for args in ((columns, 3, mk.RowPanels(np.ones((7, 5), np.float32)), out),  # MR panels
                 (columns, 3, weights, out[:, 1:]), (columns[:4], 3, weights, out),
                 (columns[:, :2], 3, weights, out), (columns, 3, weights, out, 0, 9),
                 (columns, 3, mk.RowPanels(np.ones((7, 4), np.float32), height=nr), out)):
        with pytest.raises(ValueError, match="do not match"):
            mk.columns_product(*args)
    for src in (np.ones((3, 4), np.float32), np.ones((columns.shape[1] + 1, 5), np.float32),
                np.ones((3, 10), np.float32)[:, ::2], np.ones((3, 5))):
        with pytest.raises(ValueError, match="does not fit"):
            mk.load_columns(src, columns)
    with pytest.raises(ValueError, match="do not match"):
        weights.multiply(weights.columns(3), weights.output(3))   # NR panels: not for A


def test_row_panels_reject_what_does_not_fit():
    panels = mk.RowPanels(np.ones((7, 5), np.float32))
    b, out = panels.columns(3), panels.output(3)
    with pytest.raises(ValueError, match="do not match"):
        panels.multiply(b[:4], out)
    with pytest.raises(ValueError, match="do not match"):
        panels.multiply(b, out[:-1])
    with pytest.raises(ValueError, match="do not match"):
        panels.multiply(b, out, 0, panels.count + 1)
    with pytest.raises(ValueError, match="does not fit"):
        panels.load(np.ones((3, 4), np.float32), b)
    with pytest.raises(ValueError, match="does not fit"):
        panels.load(np.ones((b.shape[1] + 1, 5), np.float32), b)
    with pytest.raises(ValueError, match="does not fit"):
        panels.load(np.ones((3, 10), np.float32)[:, ::2], b)
    with pytest.raises(TypeError, match="float32 or float64"):
        mk.RowPanels(np.ones((3, 3), np.int32))


_NARROW_SCRIPT = (
    "import numpy as np\n"
    "from numbaconv.cpu import _microkernel as mk\n"
    "mk.vector_lanes = lambda dtype: BITS // (8 * np.dtype(dtype).itemsize)\n"
    "rng = np.random.default_rng(2)\n"
    "for dtype in ('float32', 'float64'):\n"
    "    assert mk.tile_shape(dtype) == (6, 2)\n"
    "    for m, k, n in ((1, 1, 1), (13, 300, 37), (6, 256, 16)):\n"
    "        a = rng.standard_normal((m, k)).astype(dtype)\n"
    "        b = rng.standard_normal((k, n)).astype(dtype)\n"
    "        out = np.full((m, n), np.nan, dtype)\n"
    "        mk.gemm(a, b, out)\n"
    "        assert np.allclose(out, a @ b, rtol=1e-4, atol=1e-4), ('gemm', dtype, m, k, n)\n"
    "        out = np.full((m, n), np.nan, dtype)\n"
    "        mk.gram(a.T.copy(), b, out)\n"
    "        assert np.allclose(out, a @ b, rtol=1e-4, atol=1e-4), ('gram', dtype, m, k, n)\n"
    "        out = np.full((m, n), np.nan, dtype)\n"
    "        mk.rows_gemm(a, b, out)\n"
    "        assert np.allclose(out, a @ b, rtol=1e-4, atol=1e-4), ('rows', dtype, m, k, n)\n"
    "        out = np.full((m, n), np.nan, dtype)\n"
    "        mk.rows_gemm(a, b, out, 2)\n"
    "        assert np.allclose(out, a @ b, rtol=1e-4, atol=1e-4), ('rows 2', dtype, m, k, n)\n"
    "        out = np.full((1, m, n), np.nan, dtype)\n"
    "        mk.gram_runs(a.T.copy(), b, out, k, 2)\n"
    "        assert np.allclose(out[0], a @ b, rtol=1e-4, atol=1e-4), ('runs', dtype, m, k, n)\n"
    "        panels = mk.RowPanels(a)\n"
    "        columns, out = panels.columns(n), panels.output(n)\n"
    "        panels.multiply(panels.load(b.T.copy(), columns), out)\n"
    "        assert np.allclose(out[:m, :n], a @ b, rtol=1e-4, atol=1e-4), ('panels', dtype, m, k, n)\n"
    "        columns = mk.load_columns(a, mk.state_columns(m, k, dtype))\n"
    "        weights = mk.RowPanels(b.T.copy(), height=mk.RowPanels.tile_columns(dtype))\n"
    "        height = mk.panel_rows(m, dtype)\n"
    "        out = np.empty((-(-m // height) * height, weights.count * weights.height), dtype)\n"
    "        mk.columns_product(columns, m, weights, out)\n"
    "        assert np.allclose(out[:m, :n], a @ b, rtol=1e-4, atol=1e-4), ('states', dtype, m, k, n)\n"
    "print('ok')\n")

#: The products built for 256- and 128-bit vectors: {bits: command}.
NARROW = {bits: background.python_code(f"micro-kernel products for {bits}-bit vectors",
                                       f"BITS = {bits}\n" + _NARROW_SCRIPT,
                                       dict(NUMBACONV_JIT_CACHE="0"), timeout=600)
          for bits in (256, 128)}


@NARROW[256].mark
@NARROW[128].mark
def test_gemm_built_for_narrower_vectors():
    """``gemm``, ``gram``, ``rows_gemm`` and ``RowPanels`` as a CPU with 256- or 128-bit vectors gets them
    (other tile shapes), in a fresh process with the host's vector width overridden before
    the first compilation."""
    for command in NARROW.values():
        command.result().check()
