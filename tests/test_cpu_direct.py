"""The cpu backend's direct kernels on depthwise problems, both layouts, where the data
gradient writes dx instead of zeroing it and adding (the fused channels-last 3x3 rows, the
channels-first plane kernels): forward, data gradient (written over garbage and
accumulated), weight gradient, against the reference; NaN and infinity at the borders;
bitwise determinism; a NUMBA_BOUNDSCHECK=1 pass; that ``same`` 3x3 windows take their
kernels (_cl_same3, _cl_same3_weight, _cf_same3, _cf_same3_weight); the sliding rows built
for 128- and 512-bit vectors."""


import numpy as np
import pytest

import numbaconv as nc
from numbaconv import dispatch
from numbaconv import problem as pb
from numbaconv.testing import relative_error

import background
from non_finite import assert_non_finite_like

TOL = {"float32": 2e-5, "float64": 1e-11}

# (name, x shape channels-first, kernel, padding, stride, dilation[, outputs per channel])
CASES = [
    ("2d", (2, 5, 6, 7), (3, 3), 1, 1, 1),
    ("2d-two-columns", (1, 3, 4, 2), (3, 3), 1, 1, 1),
    ("2d-one-row", (2, 4, 1, 5), (3, 3), 1, 1, 1),
    ("2d-tall-kernel", (1, 6, 7, 5), (5, 3), (2, 1), 1, 1),
    ("2d-row-dilation", (1, 4, 9, 6), (3, 3), (2, 1), 1, (2, 1)),
    ("2d-wide-channels", (1, 130, 5, 4), (3, 3), 1, 1, 1),
    ("2d-row-stride", (2, 3, 9, 5), (3, 3), 1, (2, 1), 1),
    ("2d-stride-2", (2, 4, 9, 8), (3, 3), 1, 2, 1),
    ("2d-no-padding", (1, 3, 6, 7), (3, 3), 0, 1, 1),
    ("2d-5x5", (1, 3, 7, 6), (5, 5), 2, 1, 1),
    ("2d-wide-rows", (2, 5, 4, 19), (3, 3), 1, 1, 1),
    ("2d-column-dilation", (1, 3, 5, 12), (3, 3), (1, 2), 1, (1, 2)),
    ("2d-depth-multiplier", (1, 3, 5, 6), (3, 3), 1, 1, 1, 2),
    ("1d", (2, 6, 9), (3,), 1, 1, 1),
    ("3d", (1, 3, 4, 5, 6), (3, 3, 3), 1, 1, 1),
    ("3d-depth-stride", (1, 3, 5, 4, 6), (2, 3, 3), (0, 1, 1), (2, 1, 1), 1),
    # Channels in whole vectors: channels-last 3x3 rows of stride 1 (the data gradient's
    # at any stride) slide one vector of channels along the row (_sliding); 64 float32 and
    # 32 float64 channels are 256 bytes a pixel, whose row buffers get a padded pitch.
    ("2d-vector-channels", (2, 16, 5, 6), (3, 3), 1, 1, 1),
    ("2d-vector-padded-pitch", (1, 64, 4, 9), (3, 3), 1, 1, 1),
    ("2d-vector-pitch-f64", (2, 32, 3, 5), (3, 3), ((0, 2), (2, 0)), 1, 1),
    ("2d-vector-stride-2", (2, 32, 7, 9), (3, 3), 1, 2, 1),
    ("2d-vector-one-column", (1, 16, 3, 1), (3, 3), 1, 1, 1),
    ("2d-vector-no-padding", (1, 32, 5, 6), (3, 3), 0, 1, 1),
    ("2d-vector-row-dilation", (1, 16, 9, 6), (3, 3), (2, 1), 1, (2, 1)),
    ("3d-vector", (1, 16, 4, 3, 5), (3, 3, 3), 1, 1, 1),
    ("2d-vector-multiplier", (1, 8, 5, 6), (3, 3), 1, 1, 1, 2),
    # Of these (and the vector cases above with one pixel of padding either side along the
    # rows and stride 1 there) the forward and the written data gradient read and write
    # the rows in place (_direct._cl_same3): 120 float32 channels take 8 + 4 + 2 + 1
    # vectors a call with AVX2 (float64: 8 + 8 + 8 + 4 + 2).
    ("2d-vector-same-mixed-units", (1, 120, 3, 4), (3, 3), 1, 1, 1),
    ("2d-vector-same-one-row", (2, 16, 1, 5), (3, 3), 1, 1, 1),
    ("2d-vector-same-two-columns", (2, 32, 4, 2), (3, 3), 1, 1, 1),
    ("2d-vector-same-row-stride", (2, 16, 7, 6), (3, 3), 1, (2, 1), 1),
    # 11 rows: two blocks of the four-row weight walk where a job holds a plane (below).
    ("2d-vector-same-tall", (2, 32, 11, 6), (3, 3), 1, 1, 1),
    ("3d-vector-same-one-tap-plane", (1, 16, 3, 4, 5), (1, 3, 3), (0, 1, 1), 1, 1),
    # Channels-first, the same geometry walks strips of columns down each plane
    # (_direct._cf_same3): whole vectors here (16 columns), narrower strips at the row's
    # end in every other case of that geometry above.
    ("2d-same-whole-vectors", (2, 3, 4, 16), (3, 3), 1, 1, 1),
]


def _arrays(x_shape, kernel, dtype, layout, seed=0, multiplier=1, **kw):
    rng = np.random.default_rng(seed)
    c = x_shape[1]
    x = rng.standard_normal(x_shape).astype(dtype)
    w = rng.standard_normal((c * multiplier, 1) + kernel).astype(dtype)
    kw.setdefault("groups", c)
    y_shape = nc.conv_output_shape(x_shape, w.shape, **kw)
    dy = rng.standard_normal(y_shape).astype(dtype)
    if layout == "channels_last":
        x, dy = np.moveaxis(x, 1, -1).copy(), np.moveaxis(dy, 1, -1).copy()
    return x, w, dy


def _placed(a, offset):
    """A copy of ``a`` whose first element lies ``offset`` bytes past a cache line."""
    from numbaconv.cpu._sliding import LINE, empty_at
    b = empty_at(offset, a.shape, a.dtype)
    b[...] = a
    assert b.ctypes.data % LINE == offset
    return b


def _run(op, problem, operands, out=None):
    return dispatch.get_backend("cpu").run(op, problem, operands, out, "direct")


def _same_bits_at_every_start(x, dy, w_shape, kw, dtype):
    """The depthwise weight gradient of x and dy placed on a cache line: the reference's
    (to rounding), and bitwise the same with x and dy starting at every offset past a line
    (alike) and at two different ones. Returns the problem."""
    from numbaconv.cpu._sliding import LINE
    itemsize = np.dtype(dtype).itemsize
    with nc.use_backend("reference"):
        expected = nc.conv_backward_weight(x, dy, w_shape, **kw)
    p = pb.conv_backward_weight_problem(x, dy, w_shape, **kw)
    on_line = _run("conv_backward_weight", p, (_placed(x, 0), _placed(dy, 0)))
    assert relative_error(on_line, expected) < TOL[dtype]
    for x_offset, dy_offset in [(o, o) for o in range(itemsize, LINE, itemsize)] + [(16, 48)]:
        dw = _run("conv_backward_weight", p, (_placed(x, x_offset), _placed(dy, dy_offset)))
        assert np.array_equal(dw, on_line), (x_offset, dy_offset)
    return p


@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_depthwise_direct_matches_the_reference(case, dtype, layout):
    _, x_shape, kernel, padding, stride, dilation = case[:6]
    multiplier = case[6] if len(case) > 6 else 1
    kw = dict(padding=padding, stride=stride, dilation=dilation, groups=x_shape[1])
    x, w, dy = _arrays(x_shape, kernel, dtype, "channels_first", multiplier=multiplier, **kw)
    if layout == "channels_last":
        x, dy = np.moveaxis(x, 1, -1).copy(), np.moveaxis(dy, 1, -1).copy()
    kw["layout"] = layout
    with nc.use_backend("reference"):
        y_ref = nc.conv(x, w, **kw)
        dx_ref = nc.conv_backward_data(dy, w, x.shape, **kw)
        dw_ref = nc.conv_backward_weight(x, dy, w.shape, **kw)
    tol = TOL[dtype]
    p = pb.conv_problem(x, w, None, **kw)
    assert relative_error(_run("conv", p, (x, w, None)), y_ref) < tol
    # Written (into garbage) and accumulated (onto ones).
    out = np.full_like(x, np.nan)
    p = pb.conv_backward_data_problem(dy, w, x.shape, **kw, out=out)
    assert relative_error(_run("conv_backward_data", p, (dy, w), out), dx_ref) < tol
    out = np.ones_like(x)
    p = pb.conv_backward_data_problem(dy, w, x.shape, **kw, out=out, accumulate=True)
    assert relative_error(_run("conv_backward_data", p, (dy, w), out), dx_ref + 1) < tol
    p = pb.conv_backward_weight_problem(x, dy, w.shape, **kw)
    assert relative_error(_run("conv_backward_weight", p, (x, dy)), dw_ref) < tol


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_four_row_weight_walk_matches_the_reference(case, dtype, monkeypatch):
    """The channels-last weight gradient with the four-row walk taken wherever it applies
    (both thresholds down, a job a plane so that a job holds 4 rows): every case of the
    table against the reference."""
    from numbaconv.cpu import _direct, _heuristics
    monkeypatch.setattr(_heuristics, "SAME_WEIGHT_ROWS_MIN_BYTES", 0)
    monkeypatch.setattr(_heuristics, "SAME_WEIGHT_ROWS_MIN_WIDTH", 2)
    monkeypatch.setattr(_direct, "MIN_JOBS", 1)
    _, x_shape, kernel, padding, stride, dilation = case[:6]
    multiplier = case[6] if len(case) > 6 else 1
    kw = dict(padding=padding, stride=stride, dilation=dilation, groups=x_shape[1])
    x, w, dy = _arrays(x_shape, kernel, dtype, "channels_last", multiplier=multiplier, **kw)
    kw["layout"] = "channels_last"
    with nc.use_backend("reference"):
        expected = nc.conv_backward_weight(x, dy, w.shape, **kw)
    p = pb.conv_backward_weight_problem(x, dy, w.shape, **kw)
    assert relative_error(_run("conv_backward_weight", p, (x, dy)), expected) < TOL[dtype]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("channels, width", [(3, 6), (16, 6), (16, 11)])
@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
def test_nan_and_inf_at_the_borders_propagate_like_the_reference(layout, channels, width):
    # 16 channels: the channels-last vector rows; 11 columns, channels-first: the column
    # strips of the weight gradient (8 + 2 + 1 with AVX2).
    x_shape = (1, channels, 5, width)
    x, w, dy = _arrays(x_shape, (3, 3), "float64", "channels_first", padding=1,
                       groups=channels)
    end = width - 1
    for a, b, v in ((0, 0, np.nan), (0, end, np.inf), (4, 0, -np.inf), (2, end, np.nan),
                    (4, 3, np.inf)):
        x[0, 1, a, b] = v
        dy[0, 2, 4 - a, end - b] = v
    dy[0, 0, 0, 2] = np.inf
    if layout == "channels_last":
        x, dy = np.moveaxis(x, 1, -1).copy(), np.moveaxis(dy, 1, -1).copy()
    kw = dict(padding=1, groups=channels, layout=layout)
    calls = (lambda: nc.conv(x, w, **kw),
             lambda: nc.conv_backward_data(dy, w, x.shape, **kw),
             lambda: nc.conv_backward_weight(x, dy, w.shape, **kw))
    for fn in calls:
        with nc.use_backend("reference"):
            expected = fn()
        with nc.use_backend("cpu"):
            got = fn()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-9, atol=1e-9)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
def test_non_finite_weights_take_the_packed_path_like_the_reference(layout, stride):
    # The direct kernels multiply no padding, so a non-finite weight goes to im2col there,
    # for the forward and for the data gradient written (over garbage) or accumulated.
    kw = dict(padding=1, stride=stride, groups=3)
    x, w, dy = _arrays((2, 3, 5, 6), (3, 3), "float64", layout, **kw)
    kw["layout"] = layout
    w[0, 0, 0, 0], w[2, 0, 1, 2] = np.inf, np.nan
    with nc.use_backend("reference"):
        y_ref = nc.conv(x, w, **kw)
        dx_ref = nc.conv_backward_data(dy, w, x.shape, **kw)
    p = pb.conv_problem(x, w, None, **kw)
    got = {"y": _run("conv", p, (x, w, None))}
    out = np.full_like(x, np.nan)
    p = pb.conv_backward_data_problem(dy, w, x.shape, **kw, out=out)
    got["dx"] = _run("conv_backward_data", p, (dy, w), out)
    out = np.ones_like(x)
    p = pb.conv_backward_data_problem(dy, w, x.shape, **kw, out=out, accumulate=True)
    got["dx + 1"] = _run("conv_backward_data", p, (dy, w), out)
    for name, expected in (("y", y_ref), ("dx", dx_ref), ("dx + 1", dx_ref + 1)):
        assert np.isnan(expected).any() and np.isinf(expected).any(), name
        assert_non_finite_like(got[name], expected, name)


@pytest.mark.parametrize("layout, kernel", [("channels_last", "_cl_same3"),
                                            ("channels_first", "_cf_same3")])
def test_same_windows_take_their_kernel_with_strided_operands_copied_once(
        monkeypatch, layout, kernel):
    """The forward and the written data gradient of a depthwise 3x3 layer with ``same``
    padding and stride 1 run _cl_same3 / _cf_same3 (which the cases above check against
    the reference); strided (non-contiguous) operands, which the public calls never hand a
    backend but its run() takes, are copied once by run(), so the same kernels run them,
    with the same result."""
    from numbaconv.cpu import _direct_cf_plane, _direct_cl
    module = _direct_cl if kernel == "_cl_same3" else _direct_cf_plane
    calls = []
    real = getattr(module, kernel)
    monkeypatch.setattr(module, kernel, lambda *a: calls.append(1) or real(*a))
    x, w, dy = _arrays((2, 16, 5, 6), (3, 3), "float32", layout, padding=1)
    kw = dict(padding=1, groups=16, layout=layout)

    def both(x, dy):
        p = pb.conv_problem(x, w, None, **kw)
        y = _run("conv", p, (x, w, None))
        p = pb.conv_backward_data_problem(dy, w, x.shape, **kw)
        return y, _run("conv_backward_data", p, (dy, w))

    y, dx = both(x, dy)
    assert len(calls) == 2
    wide_x, wide_dy = np.repeat(x, 2, axis=-1), np.repeat(dy, 2, axis=-1)
    y2, dx2 = both(wide_x[..., ::2], wide_dy[..., ::2])
    assert len(calls) == 4
    np.testing.assert_allclose(y2, y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx2, dx, rtol=1e-6, atol=1e-6)


def test_same_rows_weight_gradient_reads_the_rows_in_place(monkeypatch):
    """A channels-last depthwise 3x3 weight gradient of ``same`` windows along rows of at
    least 2 pixels, the channels in whole vectors, runs _cl_same3_weight (x's rows read
    where they lie, no ring), like the reference: rows of 2 pixels (no middle pixel), 3
    and 9, any stride and dilation from row to row; one pixel, or channels not in whole
    vectors, take the ring kernel. A non-finite dy at either end of a row makes its padding
    tap's sum NaN, as in the reference."""
    from numbaconv.cpu import _direct_cl
    from numbaconv.cpu._sliding import row_lanes
    calls = []
    real = _direct_cl._cl_same3_weight
    monkeypatch.setattr(_direct_cl, "_cl_same3_weight", lambda *a: calls.append(1) or real(*a))
    lanes = row_lanes(np.float64)
    for channels, width, stride, dilation, taken in (
            (lanes, 2, 1, 1, 1), (2 * lanes, 3, 1, 1, 1), (lanes, 9, (2, 1), (2, 1), 1),
            (lanes, 1, 1, 1, 0), (lanes + 1, 9, 1, 1, 0)):
        kw = dict(padding=1, groups=channels, stride=stride, dilation=dilation)
        x, w, dy = _arrays((3, channels, 7, width), (3, 3), "float64", "channels_last", **kw)
        kw["layout"] = "channels_last"
        with nc.use_backend("reference"):
            expected = nc.conv_backward_weight(x, dy, w.shape, **kw)
        p = pb.conv_backward_weight_problem(x, dy, w.shape, **kw)
        calls.clear()
        assert relative_error(_run("conv_backward_weight", p, (x, dy)), expected) < 1e-11
        assert len(calls) == taken, (channels, width, stride)
        dy[0, 1, 0, 0], dy[1, 2, -1, 1] = np.inf, -np.inf       # a row's first and last pixel
        with nc.use_backend("reference"), np.errstate(invalid="ignore"):
            expected = nc.conv_backward_weight(x, dy, w.shape, **kw)
        assert_non_finite_like(_run("conv_backward_weight", p, (x, dy)), expected, "dw")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_channel_pieces_cover_the_channels_once_within_cache_lines(dtype):
    """_sliding.channel_pieces: for every start past a cache line, its whole vectors and
    narrow pieces cover each channel once; where it takes the narrow pieces, no vector
    crosses a line (the pixels all start alike: channels fill whole lines); pixels that fall
    in many L1 sets take the plain split."""
    from numbaconv.cpu._sliding import LINE, channel_pieces, row_lanes
    itemsize, lanes = np.dtype(dtype).itemsize, row_lanes(dtype)
    taken = 0
    for channels in (lanes, 4 * lanes, 64, 128, 512):
        for offset in range(0, LINE, itemsize):
            (head, tail), narrow = channel_pieces(offset, channels, dtype)
            vectors = [(k, lanes) for k in range(head, channels - tail, lanes)]
            vectors += [tuple(piece) for piece in narrow.tolist()]
            covered = np.zeros(channels, int)
            for first, width in vectors:
                assert 0 < width <= lanes and first + width <= channels
                covered[first:first + width] += 1
            assert (covered == 1).all(), (channels, offset)
            if len(narrow):
                taken += 1
                assert all((offset + first * itemsize) // LINE
                           == (offset + (first + width) * itemsize - 1) // LINE
                           for first, width in vectors), (channels, offset)
    assert taken
    assert not len(channel_pieces(16, LINE // itemsize * 24, dtype)[1])     # 8 sets


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_same_rows_weight_gradient_is_the_same_wherever_the_rows_start(dtype):
    """The channels-last ``same`` 3x3 weight gradient (_cl_same3_weight) walks narrower
    vectors up to the first cache line of each pixel and from its last where x and dy start
    past a line alike (_sliding.channel_pieces): bitwise the dw of the same arrays on a
    line, at every start (and where x and dy start differently), and the reference's."""
    from numbaconv.cpu._sliding import channel_pieces
    channels = 1024 // np.dtype(dtype).itemsize     # 1 KB a pixel: 4 L1 sets, pieces taken
    assert len(channel_pieces(16, channels, dtype)[1])
    kw = dict(padding=1, groups=channels, layout="channels_last")
    x, w, dy = _arrays((2, channels, 4, 6), (3, 3), dtype, "channels_last", padding=1)
    _same_bits_at_every_start(x, dy, w.shape, kw, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_four_row_weight_kernels_match_numpy(dtype):
    """_sliding.grad3_rows4x2 and grad3_rows4x1 (4 output rows, 2 vectors of channels or
    1) add each tap's sum over the rows and pixels to the sums they are given, ``same``
    padding along the rows; with ``split`` < lanes (one vector) lanes from ``split`` on are
    the next pixel's: every row length from 1, every split, against NumPy in float64."""
    import numba
    from numbaconv.cpu import _sliding
    from numbaconv.cpu._microkernel import _at
    lanes = _sliding.row_lanes(dtype)
    tol = TOL[dtype] * 10

    def caller(kernel):
        @numba.njit
        def call(x, dy, acc, first, at, width, split):
            row = width * x.shape[2]
            kernel(_at(x, first), row, x.shape[2], _at(dy, first), row, dy.shape[2],
                   _at(acc, 0), at, width, split)
        return call

    rng = np.random.default_rng(5)
    for units, kernel in ((2, _sliding.grad3_rows4x2), (1, _sliding.grad3_rows4x1)):
        call = caller(kernel)
        channels = 3 * lanes
        for width in (1, 2, 3, 4, 7):
            x = rng.standard_normal((6, width, channels)).astype(dtype)
            dy = rng.standard_normal((4, width, channels)).astype(dtype)
            padded = np.pad(x, ((0, 0), (1, 1), (0, 0))).astype(np.float64)
            # tap sums of every channel, taps (i, m): output row j reads x row j + i
            taps = np.array([[np.einsum("jqc,jqc->c", dy.astype(np.float64),
                                        padded[i:i + 4, m:m + width]) for m in range(3)]
                             for i in range(3)]).reshape(9, channels)
            splits = [lanes] + ([1, lanes // 2, lanes - 1] if units == 1 else [])
            for split in splits:
                first = lanes if split == lanes else channels - split
                # lane l: channel first + l of pixel q, or of pixel q + 1 past the row's end
                channel = (first + np.arange(units * lanes)) % channels
                start = rng.standard_normal((9, units * lanes)).astype(dtype)
                acc = start.copy()
                call(x, dy, acc, first, units * lanes, width, split)
                expected = start + taps[:, channel]
                assert relative_error(acc, expected) < tol, (units, width, split)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_four_row_weight_gradient_is_the_same_wherever_the_rows_start(dtype, monkeypatch):
    """Rows of at least SAME_WEIGHT_ROWS_MIN_WIDTH pixels (of operands of at least
    SAME_WEIGHT_ROWS_MIN_BYTES) take 4 output rows a walk
    (_direct_cl._same3_weight_rows), on whole cache lines with a wrapping vector where x
    and dy start past a line alike: the reference's dw (to rounding), bitwise the same at
    every start, and a non-finite dy at a row's first and last pixel (in a row walked 4 at
    a time) makes its padding taps' sums NaN, as in the reference."""
    from numbaconv.cpu import _heuristics
    from numbaconv.cpu._sliding import row_lanes
    monkeypatch.setattr(_heuristics, "SAME_WEIGHT_ROWS_MIN_WIDTH", 3)
    monkeypatch.setattr(_heuristics, "SAME_WEIGHT_ROWS_MIN_BYTES", 0)
    channels = 3 * row_lanes(dtype)             # a pair of vectors, one alone, the wrap
    kw = dict(padding=1, groups=channels, layout="channels_last")
    # 8 images of 11 rows: jobs of 6 and 5 rows, each with a walk of 4
    x, w, dy = _arrays((8, channels, 11, 5), (3, 3), dtype, "channels_last", padding=1)
    p = _same_bits_at_every_start(x, dy, w.shape, kw, dtype)
    dy[0, 2, 0, 1], dy[3, 7, -1, channels - 1] = np.inf, -np.inf
    with nc.use_backend("reference"), np.errstate(invalid="ignore"):
        expected = nc.conv_backward_weight(x, dy, w.shape, **kw)
    for offset in (0, 16):
        dw = _run("conv_backward_weight", p, (_placed(x, offset), _placed(dy, offset)))
        if dtype == "float64":
            assert_non_finite_like(dw, expected, "dw")
        else:                                   # float32 rounds past assert_non_finite_like's
            assert np.array_equal(np.isnan(dw), np.isnan(expected))
            assert relative_error(dw[np.isfinite(dw)], expected[np.isfinite(dw)]) < TOL[dtype]


def test_same_planes_weight_gradient_takes_the_column_strips(monkeypatch):
    """A channels-first depthwise 3x3 weight gradient of ``same`` windows on rows of at
    least SAME_WEIGHT_MIN_WIDTH pixels runs _cf_same3_weight (strips of 8, 2 and 1 columns
    with AVX2 on 11), like the reference; narrower rows take the flat kernel."""
    from numbaconv.cpu import _direct_cf_plane, _heuristics
    calls = []
    real = _direct_cf_plane._cf_same3_weight
    monkeypatch.setattr(_direct_cf_plane, "_cf_same3_weight",
                        lambda *a: calls.append(1) or real(*a))
    kw = dict(padding=1, groups=4, layout="channels_first")
    for width, taken in ((11, 1), (_heuristics.SAME_WEIGHT_MIN_WIDTH - 1, 0)):
        x, w, dy = _arrays((3, 4, 6, width), (3, 3), "float64", "channels_first", padding=1)
        with nc.use_backend("reference"):
            expected = nc.conv_backward_weight(x, dy, w.shape, **kw)
        p = pb.conv_backward_weight_problem(x, dy, w.shape, **kw)
        calls.clear()
        assert relative_error(_run("conv_backward_weight", p, (x, dy)), expected) < 1e-11
        assert len(calls) == taken


@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
def test_depthwise_weight_gradient_is_bitwise_deterministic(layout):
    x, w, dy = _arrays((4, 24, 10, 9), (3, 3), "float32", layout, padding=1, groups=24)
    kw = dict(padding=1, groups=24, layout=layout)
    with nc.use_backend("cpu"):
        first = nc.conv_backward_weight(x, dy, w.shape, **kw)
        for _ in range(3):
            assert np.array_equal(first, nc.conv_backward_weight(x, dy, w.shape, **kw))


BOUNDSCHECK = background.boundscheck(
    "direct kernels under NUMBA_BOUNDSCHECK",
    "from test_cpu_direct import CASES, test_depthwise_direct_matches_the_reference\n"
    "from numbaconv.cpu import _heuristics\n"
    "for c in CASES:\n"
    "    for layout in ('channels_last', 'channels_first'):\n"
    "        test_depthwise_direct_matches_the_reference(c, 'float64', layout)\n"
    "from numbaconv.cpu import _direct\n"
    "_heuristics.SAME_WEIGHT_ROWS_MIN_BYTES, _heuristics.SAME_WEIGHT_ROWS_MIN_WIDTH = 0, 2\n"
    "_direct.MIN_JOBS = 1                   # a job a plane: the four-row walk's blocks\n"
    "for c in CASES:\n"
    "    test_depthwise_direct_matches_the_reference(c, 'float64', 'channels_last')\n")


@BOUNDSCHECK.mark
def test_direct_kernels_stay_in_bounds_under_numba_boundscheck():
    BOUNDSCHECK.result().check()


def test_partials_sum_in_the_same_order_on_one_thread_or_several():
    from numbaconv.config import serial_version
    from numbaconv.cpu._rows import sum_partials
    rng = np.random.default_rng(3)
    # Magnitudes 1e-6..1e6: any other order of the additions rounds differently.
    partial = (rng.standard_normal((7, 1000)) * 10.0 ** rng.integers(-6, 6, (7, 1000))
               ).astype(np.float32)
    expected = partial[0].copy()
    for row in partial[1:]:
        expected += row
    for kernel in (sum_partials, serial_version(sum_partials)):
        total = np.full(1000, np.nan, np.float32)
        kernel(partial, total)
        assert np.array_equal(total, expected)


#: The sliding row kernels built for other vector widths: {(vector bytes, dtype): command}.
WIDTHS = {
    (vector_bytes, dtype): background.python_code(
        f"sliding rows for {vector_bytes}-byte vectors, {dtype}",
        "import numpy as np\n"
        "from numbaconv.cpu import _sliding\n"
        f"_sliding.vector_lanes = lambda dtype: {vector_bytes} // np.dtype(dtype).itemsize\n"
        f"assert _sliding.lanes_for(16, 'float32') == {vector_bytes} // 4\n"
        "from test_cpu_direct import CASES, test_depthwise_direct_matches_the_reference as t\n"
        "for case in CASES:\n"
        "    if 'vector' in case[0]:\n"
        f"        t(case, {dtype!r}, 'channels_last')\n"
        "    if 'same' in case[0]:\n"
        f"        t(case, {dtype!r}, 'channels_first')\n"
        "print('ok')\n", dict(NUMBACONV_JIT_CACHE="0"))
    for vector_bytes, dtype in ((16, "float64"), (64, "float32"))}


@pytest.mark.parametrize("width", [pytest.param(key, marks=command.mark, id=f"{key[0]}-{key[1]}")
                                   for key, command in WIDTHS.items()])
def test_sliding_rows_built_for_other_vector_widths(width):
    """The sliding row kernels as CPUs with 128-bit (SSE: 2 float64 lanes) and 512-bit
    (AVX-512: 16 float32 lanes) vectors get them, on the vector cases (channels-last) and
    the ``same`` cases (channels-first), in a fresh process
    with the width overridden before the first compilation (LLVM splits or narrows the
    vectors this CPU lacks). One dtype each: the compilations are most of the time."""
    WIDTHS[width].result().check()
