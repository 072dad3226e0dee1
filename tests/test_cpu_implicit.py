"""The cpu backend's implicit algorithms (one group: the micro-kernel reading windows in a
padded channels-last copy of the input rows). The weight gradient against the reference in
both layouts over strides, dilations, asymmetric padding, 1D/2D/3D, output channels that
fill whole micro-kernel tiles (dy read in place, channels-last) or not (dy copied),
channels-first rows transposed in whole register blocks and edges, tiles split by rows;
the forward (with bias) and the stride-1 data gradient (written over NaN and accumulated)
over the stride-1 cases, with rows that end inside a tile and one-pixel rows; the strided
data gradient by stride phases (channels-last) and the transposed convolution; the register
transpose itself; long rows split into parts; NaN and infinity at the borders; bitwise determinism across thread
counts; the heuristic's choice; a build for 256-bit vectors; a NUMBA_BOUNDSCHECK=1 pass."""


import numpy as np
import pytest

import numbaconv as nc
from numbaconv import dispatch
from numbaconv import problem as pb
from numbaconv._kernel_geometry import geom
from numbaconv.cpu._implicit import _row_taps
from numbaconv.testing import relative_error

import background
from non_finite import assert_non_finite_like

TOL = {"float32": 2e-5, "float64": 1e-11}


def _lanes(dtype):
    from numbaconv.cpu._microkernel import tile_shape, vector_lanes
    return tile_shape(dtype)[1] * vector_lanes(dtype)


# (name, x shape channels-first, kernel, stride, padding, dilation, out channels; "nr":
# one whole micro-kernel tile of columns, so dy is read in place; "lanes": one vector, the
# one-vector tiles' columns, dy read in place too)
CASES = [
    ("2d", (2, 3, 9, 8), (3, 3), 1, 1, 1, 5),
    ("2d-whole-tiles", (2, 4, 7, 6), (3, 3), 1, 1, 1, "nr"),
    ("2d-one-vector", (2, 5, 7, 9), (3, 3), 1, 1, 1, "lanes"),
    ("2d-stem", (1, 3, 13, 12), (7, 7), 2, 3, 1, "nr"),
    ("2d-strided-asymmetric", (1, 5, 11, 13), (3, 2), (2, 3), ((1, 2), (0, 1)), 1, 7),
    ("2d-column-dilation", (2, 6, 6, 11), (3, 3), 1, (1, 2), (1, 2), "nr"),
    ("2d-row-dilation", (1, 3, 9, 7), (3, 2), (1, 2), 1, (2, 1), 4),
    ("2d-no-padding", (2, 13, 6, 6), (2, 2), 1, 0, 1, 3),
    ("2d-wide", (1, 20, 5, 37), (3, 3), 1, 1, 1, 35),
    ("1d", (2, 6, 17), (4,), 2, 3, 3, "nr"),
    ("3d", (3, 4, 6, 7, 8), (2, 3, 2), (1, 2, 1), 1, (2, 1, 1), 9),
    ("3d-depth-stride", (1, 3, 5, 4, 6), (2, 3, 3), (2, 1, 1), (0, 1, 1), 1, "nr"),
]


def _arrays(case, dtype, seed=0, layout="channels_last"):
    _, x_shape, kernel, stride, padding, dilation, k = case
    if k in ("nr", "lanes"):
        from numbaconv.cpu._microkernel import vector_lanes
        k = _lanes(dtype) if k == "nr" else vector_lanes(dtype)
    rng = np.random.default_rng(seed)
    kw = dict(stride=stride, padding=padding, dilation=dilation)
    w_shape = (k, x_shape[1]) + kernel
    x = rng.standard_normal(x_shape).astype(dtype)
    dy = rng.standard_normal(nc.conv_output_shape(x_shape, w_shape, **kw)).astype(dtype)
    kw["layout"] = layout
    if layout == "channels_last":
        x, dy = np.moveaxis(x, 1, -1).copy(), np.moveaxis(dy, 1, -1).copy()
    return x, dy, w_shape, kw


def _implicit(x, dy, w_shape, out=None, accumulate=False, **kw):
    problem = pb.conv_backward_weight_problem(x, dy, w_shape, out=out, accumulate=accumulate,
                                              **kw)
    backend = dispatch.get_backend("cpu")
    assert "implicit" in backend.algorithms("conv_backward_weight", problem)
    return backend.run("conv_backward_weight", problem, (x, dy), out, "implicit")


def _reference(x, dy, w_shape, **kw):
    with nc.use_backend("reference"):
        return nc.conv_backward_weight(x, dy, w_shape, **kw)


@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_implicit_weight_gradient_matches_the_reference(case, dtype, layout):
    x, dy, w_shape, kw = _arrays(case, dtype, layout=layout)
    expected = _reference(x, dy, w_shape, **kw)
    assert relative_error(_implicit(x, dy, w_shape, **kw), expected) < TOL[dtype]
    out = np.ones(w_shape, dtype)
    _implicit(x, dy, w_shape, out=out, accumulate=True, **kw)
    assert relative_error(out, expected + 1) < TOL[dtype]


@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
def test_implicit_weight_gradient_splits_long_rows(layout, monkeypatch):
    """Rows longer than LONG_ROW pixels go through the micro-kernel in parts of at least 32
    pixels (here 32, 32 and 6 of 70), summed into the same tiles."""
    from numbaconv.cpu import _implicit as kernels
    monkeypatch.setattr(kernels, "LONG_ROW", 40)
    monkeypatch.setattr(kernels, "DEPTH_BYTES", 1)
    assert kernels._depth(70, 64) == 32 and kernels._depth(40, 64) == 40
    case = ("1d-long-row", (2, 5, 72), (3,), 1, 0, 1, 6)
    x, dy, w_shape, kw = _arrays(case, "float64", layout=layout)
    assert dy.shape[-1 if layout == "channels_first" else -2] == 70
    expected = _reference(x, dy, w_shape, **kw)
    assert relative_error(_implicit(x, dy, w_shape, **kw), expected) < TOL["float64"]


#: Stride 1 (the forward and the data gradient): "k" output channels of the forward form.
STRIDE_1 = [c for c in CASES if c[3] == 1] + [
    ("2d-wide-strided-positions", (2, 24, 5, 29), (3, 3), 1, 1, 1, 70),
    ("2d-one-pixel-rows", (2, 17, 6, 1), (3, 1), 1, (1, 0), 1, "nr"),
    # Output channels the narrow tiles fill (with AVX-512: 32 float32 columns, 16 float64):
    # the forward's 32 and 96, the data gradient's 32 (x's channels).
    ("2d-narrow-tiles", (2, 32, 6, 19), (3, 3), 1, 1, 1, 32),
    ("1d-narrow-tiles", (2, 16, 37), (5,), 1, 2, 1, 96),
]
#: Strided data gradients (channels-last, by stride phases): dx channels (C, the tiles'
#: columns) in whole tiles and not, phase runs that end inside a micro-kernel tile, rows and
#: phases no tap reaches (stride above the kernel), dilation with a stride.
STRIDED = [c for c in CASES if c[3] != 1] + [
    ("2d-s2-resnet", (2, 32, 9, 14), (3, 3), 2, 1, 1, 12),
    ("2d-s2-edge-channels", (1, 21, 7, 19), (3, 3), 2, 1, 1, 5),
    ("2d-s3-gaps", (2, 17, 10, 11), (2, 2), 3, 0, 1, 6),
    ("2d-s2-dilated", (1, 16, 12, 13), (3, 3), 2, 2, 2, 8),
    ("3d-s2", (2, 16, 5, 6, 7), (3, 3, 3), 2, 1, 1, 9),
    # Row taps of a phase two dy pixels apart (no shared product), and pairs of taps that
    # are not neighbours in the kernel (kx 3 and 0) multiplied as one.
    ("2d-s2-dilated-gaps", (1, 16, 11, 21), (3, 3), 2, 4, (1, 4), 8),
    ("2d-s3-k5-pairs", (1, 16, 9, 23), (1, 5), 3, (0, 2), 1, 7),
    # dx channels the narrow tiles fill (with AVX-512: 32 float32 columns, 16 float64), and
    # not the 64-wide ones.
    ("2d-s2-narrow-tiles", (1, 96, 7, 9), (3, 3), 2, 1, 1, 8),
    ("3d-s2-narrow-tiles", (1, 32, 5, 6, 7), (3, 3, 3), 2, 1, 1, 6),
]


def test_channels_first_1d_runs_on_channels_last_copies(monkeypatch):
    """The channels-first 1D forward and data gradient (written over NaN, and accumulated)
    by ``implicit`` go through channels-last copies (``_forward_through_copies``), and 2D
    ones do not; STRIDE_1's 1D cases check the results in both layouts."""
    from numbaconv.cpu import _implicit
    runs = []
    real = _implicit._forward_through_copies
    monkeypatch.setattr(_implicit, "_forward_through_copies",
                        lambda *a: runs.append(1) or real(*a))
    case = next(c for c in STRIDE_1 if c[0] == "1d-narrow-tiles")
    x, dy, w_shape, kw = _arrays(case, "float64", layout="channels_first")
    w = np.random.default_rng(5).standard_normal(w_shape)
    _check_data_gradient(x, dy, w, kw, "float64")
    assert len(runs) == 2
    backend = dispatch.get_backend("cpu")
    with nc.use_backend("reference"):
        y_ref = nc.conv(x, w, **kw)
    got = backend.run("conv", pb.conv_problem(x, w, **kw), (x, w, None), None, "implicit")
    assert relative_error(got, y_ref) < TOL["float64"] and len(runs) == 3
    case = next(c for c in STRIDE_1 if c[0] == "2d-narrow-tiles")
    x, dy, w_shape, kw = _arrays(case, "float64", layout="channels_first")
    _check_data_gradient(x, dy, np.random.default_rng(5).standard_normal(w_shape), kw,
                         "float64")
    assert len(runs) == 3


@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", STRIDE_1, ids=[c[0] for c in STRIDE_1])
def test_implicit_forward_and_data_gradient_match_the_reference(case, dtype, layout):
    x, dy, w_shape, kw = _arrays(case, dtype, layout=layout)
    w = np.random.default_rng(5).standard_normal(w_shape).astype(dtype)
    bias = np.random.default_rng(6).standard_normal(w_shape[0]).astype(dtype)
    backend = dispatch.get_backend("cpu")
    with nc.use_backend("reference"):
        y_ref = nc.conv(x, w, bias, **kw)
    problem = pb.conv_problem(x, w, bias, **kw)
    assert "implicit" in backend.algorithms("conv", problem)
    got = backend.run("conv", problem, (x, w, bias), None, "implicit")
    assert relative_error(got, y_ref) < TOL[dtype]
    _check_data_gradient(x, dy, w, kw, dtype)


def _check_data_gradient(x, dy, w, kw, dtype):
    """dx by ``implicit`` against the reference: written over NaN, and accumulated."""
    backend = dispatch.get_backend("cpu")
    with nc.use_backend("reference"):
        expected = nc.conv_backward_data(dy, w, x.shape, **kw)
    for accumulate, start in ((False, np.nan), (True, 1.0)):
        out = np.full_like(x, start)
        problem = pb.conv_backward_data_problem(dy, w, x.shape, out=out, accumulate=accumulate,
                                                **kw)
        assert "implicit" in backend.algorithms("conv_backward_data", problem)
        backend.run("conv_backward_data", problem, (dy, w), out, "implicit")
        assert relative_error(out, expected + (1 if accumulate else 0)) < TOL[dtype]


@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", STRIDED, ids=[c[0] for c in STRIDED])
def test_implicit_strided_data_gradient_matches_the_reference(case, dtype, layout):
    """By stride phases (channels-first through channels-last copies): written over NaN,
    accumulated, and the transposed convolution."""
    x, dy, w_shape, kw = _arrays(case, dtype, layout=layout)
    w = np.random.default_rng(5).standard_normal(w_shape).astype(dtype)
    _check_data_gradient(x, dy, w, kw, dtype)
    backend = dispatch.get_backend("cpu")
    bias = np.full(w_shape[1], 0.25, dtype)
    padding = _output_padding(x, dy, w, kw)
    with nc.use_backend("reference"):
        expected = nc.conv_transpose(dy, w, bias, output_padding=padding, **kw)
    problem = pb.conv_transpose_problem(dy, w, bias, output_padding=padding, **kw)
    assert "implicit" in backend.algorithms("conv_transpose", problem)
    got = backend.run("conv_transpose", problem, (dy, w, bias), None, "implicit")
    assert got.shape == x.shape and relative_error(got, expected) < TOL[dtype]


def test_narrow_tiles_where_they_fill_their_columns_and_wide_ones_would_not():
    from numbaconv.cpu._microkernel import narrow_strided_shape, narrow_tiles, vector_lanes
    if narrow_strided_shape(np.float32) is None:            # no AVX-512: 16-wide tiles
        assert not any(narrow_tiles(c, np.float32) for c in (16, 32, 96))
        return
    assert vector_lanes(np.float32) == 16
    for channels, want in ((32, True), (96, True), (480, True), (64, False), (128, False),
                           (16, False), (48, False), (544, False)):
        assert narrow_tiles(channels, np.float32) == want, channels
    assert narrow_tiles(16, np.float64) and not narrow_tiles(32, np.float64)


def test_a_phases_neighbouring_row_taps_are_one_product():
    """3x3, stride 2, padding 1: phase 0 has kx = 1 alone; phase 1 has kx = 2 and 0, which
    read neighbouring dy pixels, as one product of twice the depth (weights in that
    order); with dilation 4 the taps of a phase read pixels 2 apart and stay apart."""
    def row_taps(stride, padding, dilation):
        g = geom(pb.conv_backward_data_problem(
            np.zeros((1, 5, 5, 8), np.float32), np.zeros((8, 4, 3, 3), np.float32),
            (1, 9, 9, 4), stride=stride, padding=padding, dilation=dilation,
            layout="channels_last"))
        groups, order = _row_taps(g)
        return groups.tolist(), order

    assert row_taps(2, 1, 1) == ([[0, 0, 1, 0], [1, 1, 2, 0]], [1, 2, 0])
    assert row_taps(2, (1, 4), (1, 4)) == ([[0, 0, 1, -2], [0, 1, 1, 0], [0, 2, 1, 2]],
                                           [2, 1, 0])


def _output_padding(x, dy, w, kw):
    """The transposed convolution's output_padding that gives back x's shape."""
    spatial = slice(1, -1) if kw.get("layout") == "channels_last" else slice(2, None)
    with nc.use_backend("reference"):
        plain = nc.conv_transpose(dy, w, None, **kw).shape[spatial]
    return tuple(a - b for a, b in zip(x.shape[spatial], plain))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_strided_data_gradient_with_non_finite_values_like_the_reference():
    """dy's zero columns are multiplied: an infinite weight sends the problem to col2im;
    NaN and inf in dy propagate through the phases."""
    x, dy, w_shape, kw = _arrays(("nan", (1, 17, 9, 8), (3, 3), 2, 1, 1, 6), "float64")
    w = np.random.default_rng(5).standard_normal(w_shape)
    dy[0, 0, 0, 1], dy[0, 4, 3, 2] = np.inf, np.nan
    w_inf = w.copy()
    w_inf[1, 2, 0, 0] = np.inf
    backend = dispatch.get_backend("cpu")
    for weights in (w, w_inf):
        with nc.use_backend("reference"):
            want = nc.conv_backward_data(dy, weights, x.shape, **kw)
        got = backend.run("conv_backward_data",
                          pb.conv_backward_data_problem(dy, weights, x.shape, **kw),
                          (dy, weights), None, "implicit")
        assert np.isnan(want).any() and np.isinf(want).any()
        assert_non_finite_like(got, want)


@pytest.mark.parametrize("images, rows, columns", [(1, 1, 1), (2, 3, 70), (3, 64, 64),
                                                   (2, 130, 17), (1, 65, 129)])
def test_images_transpose_by_blocks_moves_every_value_once(images, rows, columns):
    """Whole blocks and partial ones in both directions, and partial register tiles."""
    from numbaconv.cpu._microkernel import images_transposed, vector_lanes
    src = np.arange(images * rows * columns, dtype=np.float32)
    dst = np.full_like(src, np.nan)
    images_transposed(src, dst, images, rows, columns, vector_lanes(src.dtype))
    want = src.reshape(images, rows, columns).transpose(0, 2, 1).reshape(-1)
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("dims", [(1, 1, 3, 1, 9, 12, 3, 4, 7), (3, 3, 3, 3, 5, 8, 5, 6, 70),
                                  (8, 3, 3, 1, 48, 48, 16, 2, 129),
                                  (2, 1, 1, 2, 20, 24, 40, 0, 64)])
def test_weight_sums_are_the_slot_sums_trimmed_and_laid_out_as_the_weight(parallel, dims):
    """_weight_sums: parts (slots, T01, runs, padded length, padded K) summed in slot order
    (add_partials' bits), the padding dropped, (t, c) runs laid out as dw (K, C, T01, r2),
    ragged blocks of channels and output channels; every value of dw written."""
    from numbaconv.config import serial_version
    from numbaconv.cpu._implicit import _weight_sums
    from numbaconv.cpu._microkernel import vector_lanes
    from numbaconv.cpu._tiles import add_partials
    slots, taps01, r2, runs, length, padded_length, c, unused, k = dims
    assert runs * length == r2 * c
    padded_k = k + unused
    rng = np.random.default_rng(5)
    parts = rng.standard_normal((slots, taps01, runs, padded_length, padded_k)) * 1e3
    total = np.empty(parts[0].size)
    add_partials(parts.reshape(slots, -1), total)
    total = total.reshape(parts.shape[1:])[..., :length, :k].reshape(taps01, r2, c, k)
    dw = np.full((k, c, taps01, r2), np.nan)
    kernel = _weight_sums if parallel else serial_version(_weight_sums)
    kernel(parts.reshape(-1), dw.reshape(-1), slots, taps01, r2, runs, length, padded_length,
           padded_k, c, k, vector_lanes(dw.dtype))
    np.testing.assert_array_equal(dw, total.transpose(3, 2, 0, 1))


def test_a_grouped_data_gradient_is_not_implicit():
    x, dy, w_shape, kw = _arrays(("cf", (1, 4, 8, 8), (3, 3), 2, 1, 1, 4), "float64",
                                 layout="channels_first")
    w_shape = (4, 2, 3, 3)
    w = np.zeros(w_shape)
    problem = pb.conv_backward_data_problem(dy, w, x.shape, groups=2, **kw)
    backend = dispatch.get_backend("cpu")
    assert "implicit" not in backend.algorithms("conv_backward_data", problem)
    with pytest.raises(ValueError, match="one group"):
        backend.run("conv_backward_data", problem, (dy, w), None, "implicit")


def test_the_heuristic_picks_stride_phases_for_shallow_strided_data_gradients(monkeypatch):
    from numbaconv.cpu import _heuristics
    backend = dispatch.get_backend("cpu")
    monkeypatch.setattr(_heuristics, "wide_registers", lambda: False)     # AVX2's rules

    def choice(x_shape, w_shape, layout="channels_last", **kw):
        dy = np.zeros(nc.conv_output_shape(x_shape, w_shape, layout=layout, **kw), np.float32)
        problem = pb.conv_backward_data_problem(dy, np.zeros(w_shape, np.float32), x_shape,
                                                layout=layout, **kw)
        return backend.choose("conv_backward_data", problem)

    algorithm, why = choice((8, 56, 56, 32), (32, 32, 3, 3), stride=2, padding=1)
    assert algorithm == "implicit" and "stride phases" in why
    assert choice((2, 16, 56, 56, 16), (16, 16, 3, 3, 3), stride=2, padding=1)[0] == \
        "implicit"
    assert choice((8, 56, 56, 64), (64, 64, 3, 3), stride=2, padding=1)[0] == "implicit"
    for x_shape, w_shape in (((8, 28, 28, 256), (256, 256, 3, 3)),    # deep dy
                             ((8, 28, 28, 128), (128, 128, 3, 3)),
                             ((8, 56, 56, 8), (32, 8, 3, 3)),          # few dx channels
                             ((2, 14, 14, 32), (32, 32, 3, 3)),        # few pixels
                             ((8, 56, 56, 32), (32, 32, 1, 1))):       # one tap
        assert choice(x_shape, w_shape, stride=2, padding=1 if w_shape[-1] == 3 else 0)[0] \
            != "implicit", (x_shape, w_shape)
    # Channels-first likewise, for kernels of IMPLICIT_PHASED_CF_MIN_TAPS taps or more.
    algorithm, why = choice((8, 32, 56, 56), (32, 32, 3, 3), layout="channels_first",
                            stride=2, padding=1)
    assert algorithm == "implicit" and "channels-first (9 taps" in why
    assert choice((2, 16, 16, 56, 56), (16, 16, 3, 3, 3), layout="channels_first",
                  stride=2, padding=1)[0] == "implicit"
    for x_shape, w_shape in (((16, 64, 1024), (64, 64, 5)),             # five taps
                             ((8, 256, 28, 28), (256, 256, 3, 3))):     # deep dy
        assert choice(x_shape, w_shape, layout="channels_first", stride=2,
                      padding=1)[0] != "implicit", (x_shape, w_shape)
    # With AVX-512, only for dx channels that fill the micro-kernel's 64-wide tiles, or its
    # 32-wide narrow ones.
    monkeypatch.setattr(_heuristics, "wide_registers", lambda: True)
    for layout, x_shape in (("channels_last", (8, 56, 56, 64)),
                            ("channels_first", (8, 64, 56, 56))):
        for dx_channels, want in ((64, "implicit"), (32, "implicit"), (96, "implicit"),
                                  (16, "im2col"), (48, "im2col")):
            shape = x_shape[:-1] + (dx_channels,) if layout == "channels_last" else \
                (8, dx_channels) + x_shape[2:]
            assert choice(shape, (32, dx_channels, 3, 3), layout=layout, stride=2,
                          padding=1)[0] == want, (layout, dx_channels)
    # And channels-last, dy of up to IMPLICIT_PHASED_MAX_DEPTH_CL channels; channels-first
    # still up to IMPLICIT_PHASED_MAX_DEPTH.
    assert choice((8, 56, 56, 128), (128, 128, 3, 3), stride=2, padding=1)[0] == "implicit"
    assert choice((8, 56, 56, 96), (96, 96, 3, 3), stride=2, padding=1)[0] == "implicit"
    assert choice((8, 28, 28, 256), (256, 256, 3, 3), stride=2, padding=1)[0] != "implicit"
    assert choice((8, 128, 56, 56), (128, 128, 3, 3), layout="channels_first", stride=2,
                  padding=1)[0] != "implicit"


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_tap_weights_are_the_weights_by_phase_order_padded_with_zeros(dims):
    """The strided data gradient's weight panels against NumPy's relayout: wt[t * R + i,
    k, c] = w[k, c, t, order[i]] for c < C, zero past C (filled over NaN)."""
    from numbaconv.cpu._implicit import _tap_weights
    rng = np.random.default_rng(dims)
    k, c, r = 5, 7, 3
    w = rng.standard_normal((k, c) + (r,) * dims).astype(np.float32)
    order = np.array([1, 0, 2], np.int64)
    w4 = w.reshape(k, c, -1, r)
    wt = np.full((w4.shape[2] * r, k, c + 9), np.nan, np.float32)
    _tap_weights(w4, order, wt)
    expected = np.zeros_like(wt)
    expected[:, :, :c] = w4[:, :, :, order].reshape(k, c, -1).transpose(2, 0, 1)
    np.testing.assert_array_equal(wt, expected)


@pytest.mark.parametrize("left", [0, 1, 3])
def test_padded_rows_copy_each_row_between_zeros(left):
    from numbaconv.cpu._rows import padded_rows
    rows, length, pitch = 6, 10, 17
    src = np.arange(rows * length, dtype=np.float64) + 1
    dst = np.full(rows * pitch, np.nan)
    padded_rows(src, dst, rows, length, pitch, left)
    expected = np.zeros((rows, pitch))
    expected[:, left:left + length] = src.reshape(rows, length)
    np.testing.assert_array_equal(dst.reshape(rows, pitch), expected)


def test_short_runs_take_seven_row_tiles_where_they_pad_less():
    from numbaconv.cpu._implicit import _tile_rows
    assert _tile_rows(21, 12) == 7 and _tile_rows(35, 12) == 7      # the stem: 3 x 7
    assert _tile_rows(192, 12) == 12 and _tile_rows(9, 12) == 12
    assert _tile_rows(21, 6) == 6                                    # no AVX-512: 6 x 2


def test_tiles_split_by_rows_give_the_same_result(monkeypatch):
    from numbaconv.cpu import _implicit as implicit
    x, dy, w_shape, kw = _arrays(("split", (1, 5, 23, 9), (3, 3), 1, 1, 1, "nr"), "float64")
    expected = _reference(x, dy, w_shape, **kw)
    whole = _implicit(x, dy, w_shape, **kw)
    # One image: 8 tiles of 3 rows; then a window budget of about one row per tile.
    monkeypatch.setattr(implicit, "WINDOW_BYTES", 9 * 5 * 8)
    split = _implicit(x, dy, w_shape, **kw)
    for got in (whole, split):
        assert relative_error(got, expected) < TOL["float64"]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
def test_nan_and_inf_at_the_borders_propagate_like_the_reference(layout):
    # The padding is multiplied as the reference multiplies it: an infinite dy at the
    # border times a padded zero gives NaN in dw.
    x, dy, w_shape, kw = _arrays(("nan", (1, 3, 5, 6), (3, 3), 1, 1, 1, "nr"), "float64",
                                 layout="channels_first")
    x[0, 0, 0, 1], x[0, 2, 4, 5], x[0, 0, 3, 2] = np.nan, np.inf, -np.inf
    dy[0, 3, 0, 0], dy[0, 7, 4, 2] = np.inf, np.nan
    if layout == "channels_last":
        x, dy = np.moveaxis(x, 1, -1).copy(), np.moveaxis(dy, 1, -1).copy()
        kw["layout"] = layout
    expected = _reference(x, dy, w_shape, **kw)
    got = _implicit(x, dy, w_shape, **kw)
    assert np.isnan(expected).any() and np.isinf(expected).any()
    assert_non_finite_like(got, expected)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_register_transpose_moves_every_value_once(dtype):
    """_microkernel._transpose: whole vector-wide blocks, the columns past them in 8- and
    4-wide blocks (where the lanes are wider) and then one by one, rows past the blocks one
    by one; nothing outside the destination's block written."""
    import numba

    from numbaconv.cpu._implicit import _transpose
    from numbaconv.cpu._microkernel import vector_lanes
    lanes = vector_lanes(dtype)

    @numba.njit
    def transpose(src, s0, lds, dst, d0, ldd, rows, columns):
        _transpose(src, s0, lds, dst, d0, ldd, rows, columns, lanes)

    src = np.arange(70 * 90, dtype=dtype).reshape(70, 90)
    for rows, columns in ((lanes, lanes), (2 * lanes + 3, lanes + 5), (3, 2 * lanes + 1),
                          (2 * lanes, lanes + 8), (lanes, lanes + 13), (lanes + 3, 12),
                          (lanes, 4), (2 * lanes, 3 * lanes + 8)):
        dst = np.full((80, 100), -1, dtype)
        transpose(src.reshape(-1), 2 * 90 + 4, 90, dst.reshape(-1), 3 * 100 + 1, 100, rows,
                  columns)
        expected = np.full_like(dst, -1)
        expected[3:3 + columns, 1:1 + rows] = src[2:2 + rows, 4:4 + columns].T
        np.testing.assert_array_equal(dst, expected)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
def test_non_finite_values_in_the_forward_and_data_gradient_propagate_like_the_reference(
        layout):
    # The forward multiplies padding: an infinite weight gives NaN where its tap reads it.
    x, dy, w_shape, kw = _arrays(("nan", (1, 17, 5, 6), (3, 3), 1, 1, 1, 20), "float64",
                                 layout="channels_first")
    w = np.random.default_rng(5).standard_normal(w_shape)
    x[0, 3, 0, 1], dy[0, 2, 4, 5], w[1, 2, 0, 0], w[4, 0, 2, 1] = np.inf, np.nan, np.inf, -np.inf
    if layout == "channels_last":
        x, dy = np.moveaxis(x, 1, -1).copy(), np.moveaxis(dy, 1, -1).copy()
        kw["layout"] = layout
    backend = dispatch.get_backend("cpu")
    with nc.use_backend("reference"):
        expected = {"conv": nc.conv(x, w, **kw),
                    "conv_backward_data": nc.conv_backward_data(dy, w, x.shape, **kw)}
    # The data gradient never multiplies by padding there: a non-finite weight sends the
    # forward forms (implicit, and im2col's for stride 1) to col2im, which is exact.
    got = {"conv": backend.run("conv", pb.conv_problem(x, w, None, **kw), (x, w, None),
                               None, "implicit")}
    for algorithm in ("implicit", "im2col"):
        got[f"conv_backward_data {algorithm}"] = backend.run(
            "conv_backward_data", pb.conv_backward_data_problem(dy, w, x.shape, **kw),
            (dy, w), None, algorithm)
        expected[f"conv_backward_data {algorithm}"] = expected["conv_backward_data"]
    del expected["conv_backward_data"]
    for op, want in expected.items():
        assert np.isnan(want).any() and np.isinf(want).any(), op
        assert_non_finite_like(got[op], want, op)


def test_the_same_dw_bit_for_bit_on_one_thread_or_two():
    import numba
    x, dy, w_shape, kw = _arrays(("det", (5, 7, 12, 10), (3, 3), 1, 1, 1, "nr"), "float32")
    x *= 10.0 ** np.random.default_rng(1).integers(-4, 4, x.shape)   # rounding-sensitive
    first = _implicit(x, dy, w_shape, **kw)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = _implicit(x, dy, w_shape, **kw)
    finally:
        numba.set_num_threads(threads)
    assert np.array_equal(first, one)
    assert np.array_equal(first, _implicit(x, dy, w_shape, **kw))


def test_without_avx512_thin_products_take_implicit(monkeypatch):
    """AVX2's rules: weight gradients of narrow rows with at most 64 channels, and stride-1
    data gradients and forwards into 16 float32 channels from at most 32 (before winograd),
    take implicit; wider channels, 8 outputs, float64 or a deeper input do not."""
    from numbaconv.cpu import _heuristics
    backend = dispatch.get_backend("cpu")
    monkeypatch.setattr(_heuristics, "wide_registers", lambda: False)

    def weight(n, c, k, size, dtype="float32", **kw):
        x = np.zeros((n, c, size, size), dtype)
        dy = np.zeros(nc.conv_output_shape(x.shape, (k, c, 3, 3), **kw), dtype)
        problem = pb.conv_backward_weight_problem(x, dy, (k, c, 3, 3), **kw)
        return backend.choose("conv_backward_weight", problem)[0]

    def data(n, c, k, size, dtype="float32", layout="channels_first"):
        shape = (n, c, size, size) if layout == "channels_first" else (n, size, size, c)
        dy = np.zeros(shape[:1] + ((k,) + shape[2:] if layout == "channels_first"
                                   else shape[1:-1] + (k,)), dtype)
        problem = pb.conv_backward_data_problem(dy, np.zeros((k, c, 3, 3), dtype), shape,
                                                padding=1, layout=layout)
        return backend.choose("conv_backward_data", problem)[0]

    assert weight(32, 16, 32, 14, padding=1) == "implicit"
    assert weight(32, 64, 16, 14, stride=2, padding=1) == "implicit"
    assert weight(32, 128, 32, 7, padding=1) == "im2col"
    assert weight(32, 64, 64, 8, padding=1) == "winograd"      # winograd's, as before
    for layout in ("channels_first", "channels_last"):
        assert data(64, 16, 32, 14, layout=layout) == "implicit"
        assert data(32, 16, 16, 8, layout=layout) == "implicit"
    assert data(64, 16, 64, 14) == "winograd"
    assert data(64, 8, 16, 28) == "im2col"
    assert data(64, 16, 32, 14, "float64") == "winograd"
    for c, k, want in ((32, 16, "implicit"), (16, 32, "winograd")):       # the forward
        problem = pb.conv_problem(np.zeros((64, c, 14, 14), np.float32),
                                  np.zeros((k, c, 3, 3), np.float32), None, padding=1)
        assert backend.choose("conv", problem)[0] == want
    # With AVX-512 the narrow weight gradients keep implicit; the thin data gradients and
    # forwards do not.
    monkeypatch.setattr(_heuristics, "wide_registers", lambda: True)
    assert weight(32, 16, 32, 14, padding=1) == "implicit"
    assert weight(32, 128, 32, 7, padding=1) == "im2col"
    assert data(64, 16, 32, 14) == "winograd"


def test_the_heuristic_picks_implicit_for_wide_rows_and_the_stem(monkeypatch):
    from numbaconv.cpu import _heuristics
    backend = dispatch.get_backend("cpu")
    monkeypatch.setattr(_heuristics, "wide_registers", lambda: True)        # AVX-512's rules

    def choice(x_shape, w_shape, **kw):
        x = np.zeros(x_shape, np.float32)
        y_shape = nc.conv_output_shape((x_shape[0], x_shape[-1]) + x_shape[1:-1], w_shape, **kw)
        dy = np.zeros((y_shape[0],) + y_shape[2:] + (y_shape[1],), np.float32)
        problem = pb.conv_backward_weight_problem(x, dy, w_shape, layout="channels_last", **kw)
        return backend.choose("conv_backward_weight", problem)

    algorithm, reason = choice((1, 40, 40, 3), (64, 3, 7, 7), stride=2, padding=3)
    assert algorithm == "implicit" and "21 values" in reason
    assert choice((1, 20, 20, 8), (32, 8, 3, 3), padding=1)[0] == "implicit"
    assert choice((1, 9, 9, 8), (32, 8, 3, 3), padding=1)[0] == "implicit"    # narrow
    assert choice((1, 9, 9, 96), (32, 96, 3, 3), padding=1)[0] == "im2col"    # short rows
    # Channels-last with stride 2 and long runs: from 16 input channels, to 256 channels.
    algorithm, reason = choice((1, 40, 40, 64), (32, 64, 3, 3), stride=2, padding=1)
    assert algorithm == "implicit" and "64 input channels" in reason
    assert choice((1, 40, 40, 32), (256, 32, 3, 3), stride=2, padding=1)[0] == "implicit"
    assert choice((1, 40, 40, 32), (512, 32, 3, 3), stride=2, padding=1)[0] == "im2col"
    assert choice((1, 40, 40, 512), (32, 512, 3, 3), stride=2, padding=1)[0] == "im2col"
    assert choice((1, 40, 40, 12), (32, 12, 3, 3), stride=2, padding=1)[0] == "im2col"
    assert choice((1, 20, 20, 64), (64, 32, 3, 3), padding=1, groups=2)[0] == "im2col"
    x = np.zeros((1, 8, 20, 20), np.float32)
    problem = pb.conv_backward_weight_problem(x, np.zeros((1, 32, 20, 20), np.float32),
                                              (32, 8, 3, 3), padding=1)
    assert backend.choose("conv_backward_weight", problem)[0] == "implicit"
    # Forward and data gradient: stride 1, rows of 16 pixels or more, channels-first with
    # 16 input channels of the forward form or more, output channels in whole 64s (or 32s).
    def forward(x_shape, w_shape, **kw):
        problem = pb.conv_problem(np.zeros(x_shape, np.float32), np.zeros(w_shape, np.float32),
                                  None, **kw)
        return backend.choose("conv", problem)[0]

    def data(x_shape, w_shape, **kw):
        y_shape = nc.conv_output_shape(x_shape, w_shape, **kw)
        problem = pb.conv_backward_data_problem(np.zeros(y_shape, np.float32),
                                                np.zeros(w_shape, np.float32), x_shape, **kw)
        return backend.choose("conv_backward_data", problem)[0]

    assert forward((1, 16, 20, 20), (64, 16, 3, 3), padding=1) == "implicit"
    assert forward((1, 8, 20, 20), (64, 8, 3, 3), padding=1) == "im2col"     # 8 channels cf
    assert forward((1, 16, 20, 20), (48, 16, 3, 3), padding=1) == "im2col"   # 48 outputs
    assert forward((1, 16, 20, 20), (32, 16, 3, 3), padding=1) == "implicit"  # narrow tiles
    assert forward((1, 16, 20, 20), (96, 16, 3, 3), padding=1) == "implicit"
    assert forward((1, 16, 20, 20), (64, 16, 3, 3), padding=1, stride=2) == "im2col"
    assert data((1, 64, 20, 20), (32, 64, 3, 3), padding=1) == "implicit"
    assert data((1, 64, 9, 9), (32, 64, 3, 3), padding=1) == "im2col"        # short rows
    assert data((1, 16, 20, 20), (32, 16, 3, 3), padding=1) == "im2col"      # dx: 16
    assert data((1, 32, 20, 20), (32, 32, 3, 3), padding=1) == "implicit"    # narrow tiles
    # Channels-first 1D runs on channels-last copies; 2D kernels of other shapes in place.
    for op in (forward, data):
        assert op((1, 64, 40), (64, 64, 5), padding=2) == "implicit"
        assert "1D, through channels-last copies" in backend.choose(
            "conv" if op is forward else "conv_backward_data",
            pb.conv_problem(np.zeros((1, 64, 40), np.float32),
                            np.zeros((64, 64, 5), np.float32), padding=2)
            if op is forward else pb.conv_backward_data_problem(
                np.zeros((1, 64, 40), np.float32), np.zeros((64, 64, 5), np.float32),
                (1, 64, 40), padding=2))[1]
    assert data((1, 64, 20, 20), (64, 64, 5, 5), padding=2) == "implicit"
    # Without AVX-512 the forward and the data gradient keep im2col; the weight gradient
    # keeps its rules...
    monkeypatch.setattr(_heuristics, "wide_registers", lambda: False)
    assert forward((1, 16, 20, 20), (64, 16, 3, 3), padding=1) == "im2col"
    assert data((1, 64, 20, 20), (32, 64, 3, 3), padding=1) == "im2col"
    assert choice((1, 20, 20, 8), (32, 8, 3, 3), padding=1)[0] == "implicit"
    # ... and channels-last strided weight gradients take it with 16 input channels or more,
    # without an upper bound.
    algorithm, reason = choice((1, 40, 40, 64), (32, 64, 3, 3), stride=2, padding=1)
    assert algorithm == "implicit" and "64 input channels" in reason
    assert choice((1, 40, 40, 16), (32, 16, 3, 3), stride=2, padding=1)[0] == "implicit"
    assert choice((1, 40, 40, 32), (512, 32, 3, 3), stride=2, padding=1)[0] == "implicit"
    assert choice((1, 40, 40, 12), (32, 12, 3, 3), stride=2, padding=1)[0] == "im2col"


BOUNDSCHECK = background.boundscheck(
    "implicit kernels under NUMBA_BOUNDSCHECK",
    "from test_cpu_implicit import CASES, test_implicit_weight_gradient_matches_the_reference\n"
    "from test_cpu_implicit import STRIDE_1\n"
    "from test_cpu_implicit import \\\n"
    "    test_implicit_forward_and_data_gradient_match_the_reference as fwd\n"
    "from test_cpu_implicit import STRIDED\n"
    "from test_cpu_implicit import \\\n"
    "    test_implicit_strided_data_gradient_matches_the_reference as strided\n"
    "for layout in ('channels_last', 'channels_first'):\n"
    "    for c in CASES:\n"
    "        test_implicit_weight_gradient_matches_the_reference(c, 'float64', layout)\n"
    "    for c in STRIDE_1:\n"
    "        fwd(c, 'float64', layout)\n"
    "for c in STRIDED:\n"
    "    for layout in ('channels_last', 'channels_first'):\n"
    "        strided(c, 'float64', layout)\n")


@BOUNDSCHECK.mark
def test_implicit_stays_in_bounds_under_numba_boundscheck():
    BOUNDSCHECK.result().check()


WIDTH_256 = background.python_code(
    "implicit kernels for 256-bit vectors",
    "import numpy as np\n"
    "from numbaconv.cpu import _implicit, _microkernel as mk\n"
    "mk.vector_lanes = _implicit.vector_lanes = lambda dtype: 32 // np.dtype(dtype).itemsize\n"
    "import test_cpu_implicit as t\n"
    "assert mk.tile_shape('float32') == mk.strided_shape('float32') == (6, 2)\n"
    "for name in ('2d', '2d-stem', '2d-wide', '3d'):\n"
    "    case = next(c for c in t.CASES if c[0] == name)\n"
    "    for layout in ('channels_last', 'channels_first'):\n"
    "        for dtype in ('float32', 'float64'):\n"
    "            t.test_implicit_weight_gradient_matches_the_reference(case, dtype, layout)\n"
    "            if case[3] == 1:\n"
    "                t.test_implicit_forward_and_data_gradient_match_the_reference(\n"
    "                    case, dtype, layout)\n"
    "print('ok')\n", dict(NUMBACONV_JIT_CACHE="0"))


@WIDTH_256.mark
def test_implicit_built_for_256_bit_vectors():
    """The implicit kernels as a CPU with 256-bit vectors gets them (6 x 2 tiles, 8 x 8
    float32 transposes), in a fresh process with the vector width overridden before the
    first compilation."""
    WIDTH_256.result().check()
