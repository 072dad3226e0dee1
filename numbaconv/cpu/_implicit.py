"""Implicit GEMM: the micro-kernel of :mod:`._microkernel` reading the convolution's windows
where they lie in a padded copy of the input rows, with no im2col matrix.

One group, channels-last: a window's features for one tap row (kd, kh) are the run
``x[n, id, ih, iw0:iw0 + KW, :]``, KW * C contiguous values (with dilation along W, KW
runs of C values), and the windows of consecutive output pixels of a row start
``stride_w * C`` values apart. So for one output row and one tap row, the windows are the
rows of a matrix with row stride ``stride_w * C`` and unit column stride, which the
micro-kernel reads as its A operand; dy's row of pixels is B as it lies. The weight
gradient is then a sum over output rows and tap rows of such products, each of depth OW,
into an accumulator tile that stays in cache. Each tile of output rows first copies the
input rows it reads into a zero-padded channels-last window buffer, so the products need
no bounds logic. Channels-first problems take the same path: the window copy interleaves
x's channel rows, and dy's rows are transposed into a buffer, both in register blocks
(:func:`._microkernel._transpose`; a plain loop cost 1 ms per stem image of dy).

The forward (and the stride-1 data gradient, a forward convolution of dy) turns the
product around: a tile is MR output pixels x NR output channels, A's values for one pixel
are its window's features (one tap row: KW * C adjacent values, the next pixel's C values
further on; :func:`._microkernel._micro_tile_strided`), B the weights of that tap row, and
the depth one tap row's features, so the products are long.

The channels-last data gradient with a stride runs by stride phases instead
(:func:`strided_data_gradient`): dy's pixels are the A operand as they lie, each tap's
weights B, and the products go straight into the dx pixels of the tap's phase.

Against im2col + BLAS this saves writing and re-reading the packed matrix, KD*KH*KW /
(stride product) times the input's size. The weight gradient's products are short,
though: each one's depth is one output row, and the accumulator tile is loaded and stored
once per product; the forward's short rows carry many padding pixels. Measured figures,
and the choices they lead to, are at ``_heuristics.IMPLICIT_MIN_WIDTH`` (docs/cpu-algorithms.md).

A call of more than ``_heuristics.IMPLICIT_PIECE_MACS`` multiply-adds runs its tiles (the
strided data gradient: its rows) as several parallel regions, so that Ctrl-C, which Python
sees only between two regions, ends it soon; the weight gradient's regions are whole rounds
of its slots, each slot adding its tiles in the same order. The results are those of one
region, bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..config import parallel_jit, serial_jit
from .._kernel_geometry import Geom
from . import _heuristics, _tiles
from ._microkernel import (_at, _micro_tile, _micro_tile_strided, _micro_tile_strided_narrow,
                           _transpose, kernel_twin, micro_tile_rows, narrow_strided_shape,
                           narrow_tiles, single_vector_rows, strided_shape, strided_tile_rows,
                           tile_shape, vector_lanes)
from ._rows import copy_run, padded_rows, slot_sums, zero_run
from ._sliding import row_pitch
from ._tiles import SLOTS, interruptible_ranges

#: A tile's padded copy of the input rows it reads is kept under this many bytes.
WINDOW_BYTES = 2**20

#: The weight gradient's products are one output row deep. Rows longer than LONG_ROW
#: pixels are split into parts of about DEPTH_BYTES of dy per part (at least 32 pixels), so
#: that a micro-kernel tile's operands stay in L1 while it sweeps dy's tiles: a window
#: panel (depth x MR features) takes a cache line per pixel, 64 KiB for 1,024 pixels.
#: Measured on Zen 3 (AVX2, 2 cores, medians of 4 alternating rounds), the 1D k5 128c
#: layer (rows of 1,024): whole rows 15.5 ms channels-first, 16.9 channels-last; parts of
#: 128 pixels 12.0, 13.3; 64: 11.4, 11.4; 32 (this rule): 10.1, 9.9 (im2col, in another
#: run: 9.1, 13.5; and in a later one against this rule, 11.6 and 14.5 against 10.0, 9.6).
#: Rows of 256 pixels or fewer gain nothing (1D k3 stride-2 256c: 7.5 and 9.0 ms whole,
#: 7.9 and 8.9 in parts of 32; ResNet 64c 56x56 and the stem within noise).
LONG_ROW = 256
DEPTH_BYTES = 2**14


def _pieces(g: Geom, units: int, multiple: int = 0) -> list:
    """Ranges of ``units`` (tiles or rows), one parallel region each: several for a call of
    more than IMPLICIT_PIECE_MACS multiply-adds, so that Ctrl-C ends it between them (see
    :func:`._tiles.interruptible_ranges`)."""
    macs = g.n * g.positions * g.k * g.c * g.taps
    return interruptible_ranges(units, macs, _heuristics.IMPLICIT_PIECE_MACS, multiple)


def _runs(g: Geom) -> tuple:
    """(runs per tap row, values per run): one run of KW * C values, or with dilation along
    W, KW runs of C values."""
    return (1, g.r[2] * g.c) if g.dilation[2] == 1 else (g.r[2], g.c)


def _tiling(g: Geom, itemsize: int) -> tuple:
    """(output rows per tile, tiles): at least SLOTS tiles in all where the rows allow,
    each tile's window under WINDOW_BYTES."""
    planes = g.n * g.p[0]
    width = (g.p[2] - 1) * g.stride[2] + (g.r[2] - 1) * g.dilation[2] + 1
    row_bytes = g.r[0] * g.stride[1] * width * g.c * itemsize
    blocks = min(g.p[1], max(-(-SLOTS // max(planes, 1)),
                             -(-row_bytes * g.p[1] // WINDOW_BYTES)))
    rows = -(-g.p[1] // max(blocks, 1))
    return rows, planes * -(-g.p[1] // rows)


def forward(g: Geom, x, wmat, y, accumulate: bool) -> None:
    """y (=|+=) the stride-1 convolution of x with the kernel ``wmat`` (taps * C, K),
    features ordered (tap, c), for one group, both layouts (y C-contiguous); a
    channels-first 1D one on channels-last copies of x and y
    (``_heuristics.implicit_through_copies``, :func:`_forward_through_copies`).

    The micro-kernel's tile is MR output pixels x NR output channels; its depth is one tap
    row's window features, KW * C (the windows of adjacent pixels lie C values apart in the
    padded copy). With stride 1 the pixels of a tile's rows lie at one stride in that copy
    if each row is taken with its KW - 1 padding pixels: tiles run over those "virtual"
    pixels, and the few that are padding are computed and dropped (ResNet's 56x56 rows: 2
    of 58). The data gradient of stride 1 is such a convolution of dy (see
    ``conv_backward_data``)."""
    if g.stride != (1, 1, 1):
        raise ValueError("implicit forward: stride 1 only")
    if _heuristics.implicit_through_copies(g):
        _forward_through_copies(g, x, wmat, y, accumulate)
        return
    dtype = y.dtype
    kernel, mr, nr = _strided_tiles(_forward_rows, g.k, dtype)
    lanes = vector_lanes(dtype)
    runs, length = _runs(g)
    padded_k = -(-g.k // nr) * nr
    weights = np.zeros((wmat.shape[0], padded_k), dtype)
    weights[:, :g.k] = wmat
    rows, tiles = _tiling(g, x.itemsize)
    s, r, p, stride, dil, before = g.geometry_args()
    overrun = np.zeros(tiles, np.int64)
    args = (np.ascontiguousarray(x).reshape(-1), np.array(g.strides_of(g.s, g.c)),
            weights.reshape(-1), y.reshape(-1), np.array(g.strides_of(g.p, g.k)), overrun)
    for first, last in _pieces(g, tiles):
        kernel(*args, first, last, s, p, g.c, g.k, r, stride, dil, before, rows, runs, length,
               padded_k, accumulate, mr, nr, lanes)
    if overrun.any():
        raise IndexError("implicit forward: a product would reach past its arrays")


def _forward_through_copies(g: Geom, x, wmat, y, accumulate: bool) -> None:
    """:func:`forward` of a channels-first problem on channels-last copies of x and of y
    (and of y's values first, to accumulate) in the calling thread's workspace
    (:func:`._tiles.via_channels_last`; ``_heuristics.implicit_through_copies``)."""
    _tiles.via_channels_last(lambda gl, x_cl, y_cl: forward(gl, x_cl, wmat, y_cl, accumulate),
                             g, x, g.c, "layout_x", y, g.k, "layout_y", accumulate)


def _tile_rows(length: int, mr: int) -> int:
    """Micro-kernel rows for runs of ``length`` features: MR, or 7 where that pads less and
    the register file holds 7 rows (MR 12: AVX-512). The 7x7 stem's runs of 21 features
    take 3 tiles of 7 rows instead of 2 of 12, which computed 24: one core, float32, 23.4 ->
    19.2 ms channels-last, 23.0 -> 20.4 ms channels-first."""
    if mr == 12 and -(-length // 7) * 7 < -(-length // mr) * mr:
        return 7
    return mr


def _depth(row: int, dy_pixel_bytes: int) -> int:
    """Pixels per product of the weight gradient: the whole output row, or parts of long
    rows (see LONG_ROW)."""
    if row <= LONG_ROW:
        return max(row, 1)
    return max(32, DEPTH_BYTES // dy_pixel_bytes)


def weight_gradient(g: Geom, x, dy) -> np.ndarray:
    """dw (K, C, *R) of a one-group problem (see the module docstring)."""
    dtype = x.dtype
    mr, nv = tile_shape(dtype)
    runs, length = _runs(g)
    single = single_vector_rows(length, g.k, dtype)
    mr, nv = (single, 1) if single else (_tile_rows(length, mr), nv)
    nr = nv * vector_lanes(dtype)
    padded_length = -(-length // mr) * mr
    padded_k = -(-g.k // nr) * nr
    rows, tiles = _tiling(g, x.itemsize)
    slots = max(1, min(SLOTS, tiles))
    parts = np.empty((slots, g.r[0], g.r[1], runs, padded_length, padded_k), dtype)
    s, r, p, stride, dil, before = g.geometry_args()
    overrun = np.zeros(slots, np.int64)
    kernel = _weight_kernel((mr, nv), tile_shape(dtype))
    args = (np.ascontiguousarray(x).reshape(-1), np.ascontiguousarray(dy).reshape(-1), parts,
            overrun, np.array(g.strides_of(g.s, g.c)), np.array(g.strides_of(g.p, g.k)))
    # Pieces of whole rounds of the slots (a slot per prange job: a round keeps them all
    # busy); each slot still adds its tiles in tile order, from its first piece to its last.
    for first, last in _pieces(g, tiles, slots):
        kernel(*args, first, last, g.n, s, p, g.c, g.k, r, stride, dil, before, rows, mr, nr,
               vector_lanes(dtype), _depth(g.p[2], padded_k * x.itemsize))
    if overrun.any():
        raise IndexError("implicit weight gradient: a product would reach past its arrays")
    dw = np.empty((g.k, g.c) + g.r, dtype)
    _tiles.sums_kernel(_weight_sums, parts.size)(
        parts.reshape(-1), dw.reshape(-1), slots, g.r[0] * g.r[1], g.r[2], runs, length,
        padded_length, padded_k, g.c, g.k, vector_lanes(dtype))
    return dw


#: The blocks of :func:`_weight_sums`' tasks: channels (times the taps: the rows of a block)
#: and output channels; a block of 16 x 9 rows of 64 values is 36 KiB of float32 (L1).
SUM_BLOCK = (16, 64)


@parallel_jit
def _weight_sums(parts, dw, slots, taps01, r2, runs, length, padded_length, padded_k,
                 c_total, k_total, lanes):
    """dw[k, c, t01, t2] = parts[0, t01, run, l, k] + parts[1, ...] + ... (in slot order:
    the bits of add_partials' sums), where run * length + l = t2 * C + c: the slots' sums,
    trimmed of their padding and laid out as the weight in one pass. Each task gathers the
    rows (c, t) of a block of channels, summed over the slots, for a block of output
    channels, then moves them by the register transpose, in place of NumPy's sum and copy of
    the reversed view (figures: docs/cpu-algorithms.md, the `implicit` weight gradient)."""
    block_c, block_k = SUM_BLOCK
    taps = taps01 * r2
    across = (k_total + block_k - 1) // block_k
    stack = taps01 * runs * padded_length * padded_k
    for task in prange(((c_total + block_c - 1) // block_c) * across):
        c0 = (task // across) * block_c
        k0 = (task % across) * block_k
        nc = min(block_c, c_total - c0)
        nk = min(block_k, k_total - k0)
        block = np.empty(nc * taps * nk, dw.dtype)
        for cc in range(nc):
            for t01 in range(taps01):
                for t2 in range(r2):
                    j = t2 * c_total + c0 + cc
                    run = j // length
                    slot_sums(parts, ((t01 * runs + run) * padded_length + j - run * length)
                              * padded_k + k0, stack, slots, block,
                              ((cc * taps01 + t01) * r2 + t2) * nk, nk)
        _transpose(block, 0, nk, dw, (k0 * c_total + c0) * taps, c_total * taps, nc * taps,
                   nk, lanes)


@serial_jit
def _tile(t, per_plane, rows, p):
    """Tile t's image, output plane and output rows [o0, o1): tiles run over the planes
    (n, od), ``per_plane`` tiles of ``rows`` rows each."""
    plane = t // per_plane
    o0 = (t % per_plane) * rows
    return plane // p[0], plane % p[0], o0, min(p[1], o0 + rows)


@serial_jit
def _copy_window(x, xs, window, n, od, o0, o1, s, c, r, stride, dil, before, width, rows_in,
                 lanes):
    """The input rows that output rows [o0, o1) of plane (n, od) read, for every kd, into
    ``window`` (KD, rows_in, width pixels, c), zero where they fall outside x. x is flat,
    ``xs`` its element strides along (N, D, H, W, C) (channels-last or channels-first).
    The runs are zeroed and copied with uint64 indices (:func:`._rows.zero_run`,
    :func:`._rows.copy_run`)."""
    pitch = width * c
    plane_values = rows_in * pitch
    lo = min(max(before[2], 0), width)        # padded columns [lo, hi) hold input pixels
    hi = max(lo, min(width, before[2] + s[2]))
    needed = (o1 - o0 - 1) * stride[1] + (r[1] - 1) * dil[1] + 1
    ih0 = o0 * stride[1] - before[1]
    for kd in range(r[0]):
        i_d = od * stride[0] + kd * dil[0] - before[0]
        for rr in range(needed):
            ih = ih0 + rr
            base = kd * plane_values + rr * pitch
            if i_d < 0 or i_d >= s[0] or ih < 0 or ih >= s[1]:
                zero_run(window, base, pitch)
                continue
            zero_run(window, base, lo * c)
            src = n * xs[0] + i_d * xs[1] + ih * xs[2] + (lo - before[2]) * xs[3]
            if xs[4] == 1:                      # channels-last: one run
                copy_run(x, src, window, base + lo * c, (hi - lo) * c)
            else:                               # channels-first: interleave rows
                _transpose(x, src, xs[4], window, base + lo * c, c, c, hi - lo, lanes)
            zero_run(window, base + hi * c, pitch - hi * c)


@parallel_jit
def _forward_rows(x, xs, weights, y, ys, overrun, first_tile, last_tile, s, p, c, k, r,
                  stride, dil, before, rows, runs, length, padded_k, accumulate, mr, nr, lanes):
    """y (=|+=) x * weights, stride 1, one tile of output rows per job, tiles
    [first_tile, last_tile) (see :func:`forward`); x and y flat with element strides ``xs``,
    ``ys`` along (N, D, H, W, C). A product that would reach past an array is skipped and
    flagged."""
    per_plane = (p[1] + rows - 1) // rows
    width = p[2] + (r[2] - 1) * dil[2]        # padded pixels per row: p[2] windows
    pitch = width * c
    rows_in = rows + (r[1] - 1) * dil[1]
    plane_values = rows_in * pitch
    # Spare values past the padded rows for the last tile's virtual pixels and run.
    size = r[0] * plane_values + (mr + (r[2] - 1) * dil[2]) * c + length
    for job in prange(last_tile - first_tile):
        t = first_tile + job
        window = np.zeros(size, x.dtype)
        tile = np.empty(mr * nr, y.dtype)
        n, od, o0, o1 = _tile(t, per_plane, rows, p)
        _copy_window(x, xs, window, n, od, o0, o1, s, c, r, stride, dil, before, width,
                     rows_in, lanes)
        virtual = (o1 - o0) * width
        first_row = n * ys[0] + od * ys[1] + o0 * ys[2]
        for j0 in range(0, padded_k, nr):
            for q0 in range(0, virtual, mr):
                ow0 = q0 % width
                direct = ys[4] == 1 and ow0 + mr <= p[2] and j0 + nr <= k
                target = first_row + (q0 // width) * ys[2] + ow0 * ys[3] + j0
                first = True
                for kd in range(r[0]):
                    for kh in range(r[1]):
                        for run in range(runs):
                            a = kd * plane_values + kh * dil[1] * pitch + run * dil[2] * c \
                                + q0 * c
                            b = ((kd * r[1] + kh) * r[2] + run) * c * padded_k + j0
                            # The micro-kernel's pointer accesses are not bounds-checked.
                            if a + (mr - 1) * c + length > window.size or \
                                    b + (length - 1) * padded_k + nr > weights.size or \
                                    (direct and target + (mr - 1) * ys[3] + nr > y.size):
                                overrun[t] = 1
                                continue
                            # Into y itself, or into the scratch tile (one call site: the
                            # tile's IR is large, and each site costs compile time).
                            add = 0 if first and not (direct and accumulate) else 1
                            _micro_tile_strided(_at(window, a), c, _at(weights, b),
                                                _at(y, target) if direct else _at(tile, 0),
                                                length, ys[3] if direct else nr, add, 1,
                                                padded_k)
                            first = False
                if direct:
                    continue
                # An edge tile: its real pixels and channels out of the scratch tile.
                for i in range(min(mr, virtual - q0)):
                    q = q0 + i
                    ow = q % width
                    if ow >= p[2]:
                        continue
                    base = first_row + (q // width) * ys[2] + ow * ys[3]
                    for j in range(min(nr, k - j0)):
                        at = base + (j0 + j) * ys[4]
                        if accumulate:
                            y[at] += tile[i * nr + j]
                        else:
                            y[at] = tile[i * nr + j]


def _weight_kernel(shape: tuple, default_shape: tuple):
    """_weight_partials with micro-kernel tiles of ``shape`` (rows, vectors): itself for the
    default, else its twin with :func:`._microkernel.micro_tile_rows` as its tile."""
    if shape == default_shape:
        return _weight_partials
    rows, vectors = shape
    suffix = f"rows{rows}" if vectors == default_shape[1] else f"rows{rows}x{vectors}"
    return _twin(_weight_partials, suffix, _micro_tile=micro_tile_rows(rows, vectors))


def _twin(kernel, suffix: str, **tiles):
    """The parallel ``kernel`` with the micro-kernel intrinsics ``tiles`` in place of its own
    (:func:`._microkernel.kernel_twin`)."""
    return kernel_twin(kernel, suffix, parallel_jit, **tiles)


@parallel_jit
def _weight_partials(x, dy, parts, overrun, xs, ys, first_tile, last_tile, n_images, s, p, c,
                     k, r, stride, dil, before, rows, mr, nr, lanes, depth):
    """parts[slot] (+)= the sum over the slot's tiles in [first_tile, last_tile) of their
    windows.T @ dy, as (KD, KH, runs, padded run, padded K): written from tile 0, added to
    after it (tile t is slot t % slots's, each slot's tiles added in tile order). x and dy
    are flat; ``xs`` and ``ys`` are their element strides along (N, D, H, W, C):
    channels-last or channels-first. A product that would reach past an array is skipped
    and flagged in ``overrun[slot]``."""
    slots, _, _, runs, padded_length, padded_k = parts.shape
    planes = n_images * p[0]
    per_plane = (p[1] + rows - 1) // rows
    width = (p[2] - 1) * stride[2] + (r[2] - 1) * dil[2] + 1
    pitch = width * c                         # values per padded row
    rows_in = (rows - 1) * stride[1] + (r[1] - 1) * dil[1] + 1
    plane_values = rows_in * pitch
    copy_dy = padded_k != k or ys[4] != 1    # dy is B in place when channels-last
    lda = stride[2] * c
    for slot in prange(slots):
        part = parts[slot]
        if first_tile == 0:
            part[...] = 0
        # The padded rows, then padded_length spare values that the last window's padded
        # run reads past them (those columns only reach the discarded rows of part). Each
        # tile writes every row its products read (_copy_window): only the spare is zeroed.
        window = np.empty(r[0] * plane_values + padded_length, x.dtype)
        window[r[0] * plane_values:] = 0
        grads = np.zeros(rows * p[2] * padded_k if copy_dy else 1, x.dtype)
        start = first_tile + (slot - first_tile % slots + slots) % slots
        for t in range(start, min(last_tile, planes * per_plane), slots):
            n, od, o0, o1 = _tile(t, per_plane, rows, p)
            _copy_window(x, xs, window, n, od, o0, o1, s, c, r, stride, dil, before, width,
                         rows_in, lanes)
            first_row = n * ys[0] + od * ys[1] + o0 * ys[2]
            if copy_dy:
                for o in range(o1 - o0):
                    src = first_row + o * ys[2]
                    dst = o * p[2] * padded_k
                    if ys[4] == 1:
                        for q in range(p[2]):
                            copy_run(dy, src + q * k, grads, dst + q * padded_k, k)
                    else:
                        _transpose(dy, src, ys[4], grads, dst, padded_k, k, p[2], lanes)
            source = grads if copy_dy else dy
            ldb = padded_k if copy_dy else k
            for o in range(o1 - o0):
                b = o * p[2] * padded_k if copy_dy else first_row + o * ys[2]
                for kd in range(r[0]):
                    for kh in range(r[1]):
                        row = kd * plane_values + (o * stride[1] + kh * dil[1]) * pitch
                        for run in range(runs):
                            a = row + run * dil[2] * c
                            out = ((kd * r[1] + kh) * runs + run) * padded_length
                            # The micro-kernel's pointer accesses are not bounds-checked:
                            # the last tile's reach, checked once per product (negligible;
                            # a raise here would make Numba run the prange serially).
                            if a + (p[2] - 1) * lda + padded_length > window.size or \
                                    b + (p[2] - 1) * ldb + padded_k > source.size or \
                                    (out + padded_length) * padded_k > part.size:
                                overrun[slot] = 1
                                continue
                            for d0 in range(0, p[2], depth):
                                kc = min(depth, p[2] - d0)
                                for i in range(0, padded_length, mr):
                                    for j in range(0, padded_k, nr):
                                        _micro_tile(_at(window, a + d0 * lda + i),
                                                    _at(source, b + d0 * ldb + j),
                                                    _at(part, (out + i) * padded_k + j), kc,
                                                    padded_k, 1, lda, ldb)


# --- the strided data gradient -------------------------------------------------------------

def strided_data_gradient(g: Geom, dy, w, dx, accumulate: bool) -> None:
    """dx (=|+=) the data gradient of a one-group channels-last convolution of any stride,
    by stride phases: the pixels of a dx row whose column has one phase (x mod stride)
    receive from the same taps, each a product of dy's pixels in a run (MR pixels, K values
    each, read where they lie in a copy of dy with zero columns either side) by that tap's
    weights (K, C), written MR pixels at a time ``stride * C`` values apart. No packed
    matrix, no col2im: dx is written once. The taps of a row's depth and height phase are
    found per row; a row or phase with none is zero.

    A phase's taps along the row whose dy pixels lie one apart (all of them without
    dilation) are one product: a run's A values for them are adjacent in dy, so the depth
    is their count times K, with their weights stacked in that order (:func:`_row_taps`),
    and the accumulators are loaded and stored once for them all."""
    dtype = dx.dtype
    kernel, mr, nr = _strided_tiles(_strided_rows, g.c, dtype)
    tail = -(-g.s[2] // g.stride[2]) % mr
    if tail:
        # The last run of the widest phase's rows on a tile of its own height.
        kernel = _twin(kernel, f"tail{tail}", TAIL_ROWS=tail, _micro_tile_strided_tail=(
            strided_tile_rows(tail, narrow_tiles(g.c, dtype))))
    padded_c = -(-g.c // nr) * nr
    groups, order = _row_taps(g)
    # (taps, K, pitch): the tiles' columns C' padded to whole tiles (zero columns), rows an
    # odd number of cache lines apart (_sliding.row_pitch): the micro-kernel reads a
    # panel's K rows one after another, and at a power-of-two pitch they would all fall
    # into a few L1 sets (ResNet's 256-channel stride-2 layer, measured beside another
    # job: 42 -> 32 ms). The taps of a tap row are in the order of ``groups``.
    pitch = row_pitch(padded_c, dtype)
    wt = np.empty((g.taps, g.k, pitch), dtype)
    _tap_weights(w.reshape(g.k, g.c, -1, g.r[2]), np.array(order, np.int64), wt)
    shifts = list(groups[:, 3])
    left = max([0] + [-d for d in shifts])
    widest = -(-g.s[2] // g.stride[2])
    width = left + max(g.p[2], widest + max(d + count - 1 for d, count in
                                            zip(shifts, groups[:, 2]))) + mr
    rows_in = g.n * g.p[0] * g.p[1]
    dyp = _tiles.scratch((rows_in, width, g.k), dtype, "padded")
    padded_rows(np.ascontiguousarray(dy).reshape(-1), dyp.reshape(-1), rows_in, g.p[2] * g.k,
                width * g.k, left * g.k)
    s, r, p, stride, dil, before = g.geometry_args()
    rows = g.n * g.s[0] * g.s[1]
    overrun = np.zeros(rows, np.int64)
    for first, last in _pieces(g, rows):
        kernel(dyp.reshape(-1), wt.reshape(-1), dx.reshape(-1), groups, overrun, first, last, s,
               r, p, stride, dil, before, g.k, g.c, padded_c, pitch, width, left, accumulate,
               mr, nr)
    if overrun.any():
        raise IndexError("implicit data gradient: a product would reach past its arrays")


@parallel_jit
def _tap_weights(w, order, wt):
    """wt[t * R2 + i, k, c] = w[k, c, t, order[i]] (R2 = w.shape[3], t the tap rows), zero
    for c past C: the strided data gradient's weight panels, in parallel over K (NumPy's
    fancy-indexed copy ran on the calling thread; docs/cpu-algorithms.md, "The strided data
    gradient's operands")."""
    k_count, c_count, tap_rows, r2 = w.shape
    pitch = wt.shape[2]
    for k in prange(k_count):
        for t in range(tap_rows):
            for i in range(r2):
                kx = order[i]
                panel = t * r2 + i
                for c in range(c_count):
                    wt[panel, k, c] = w[k, c, t, kx]
                for c in range(c_count, pitch):
                    wt[panel, k, c] = 0


def _strided_tiles(kernel, outputs: int, dtype) -> tuple:
    """(kernel, MR, NR) for products into ``outputs`` channels on the strided micro-kernel:
    ``kernel`` (:func:`_forward_rows`, :func:`_strided_rows`) on :func:`strided_shape`'s
    tiles, or its twin on the narrow ones where they fill their columns
    (:func:`._microkernel.narrow_tiles`)."""
    if narrow_tiles(outputs, dtype):
        mr, nv = narrow_strided_shape(dtype)
        kernel = _twin(kernel, "narrow", _micro_tile_strided=_micro_tile_strided_narrow)
    else:
        mr, nv = strided_shape(dtype)
    return kernel, mr, nv * vector_lanes(dtype)


def strided_data_gradient_cf(g: Geom, dy, w, dx, accumulate: bool) -> None:
    """:func:`strided_data_gradient` of a channels-first problem, on channels-last copies of
    dy and dx (and of dx's values first, to accumulate): :func:`._tiles.via_channels_last`.
    The copies cost less than col2im's scattered adds where a pixel's product is deep
    enough (``_heuristics.IMPLICIT_PHASED_CF_MIN_TAPS``; docs/cpu-algorithms.md)."""
    _tiles.via_channels_last(
        lambda gl, dy_cl, dx_cl: strided_data_gradient(gl, dy_cl, w, dx_cl, accumulate),
        g, dy, g.k, "layout_dy", dx, g.c, "layout_x", accumulate)


def _row_taps(g: Geom) -> tuple:
    """The taps along the row (kx) as the strided data gradient multiplies them: (groups,
    order). ``groups`` (G, 4) int64, rows (phase, first slot, count, shift) in the order of
    the phases: ``count`` taps whose weights lie in slots ``first ...`` of a tap row's
    reordered ``order`` (slot i holds tap kx = order[i]), reading dy ``shift``, ``shift``
    + 1, ... pixels from the phase's pixel; every kx is in one group."""
    s2, b2, d2, r2 = g.stride[2], g.before[2], g.dilation[2], g.r[2]
    groups, order = [], []
    for rx in range(s2):
        # This phase's taps, by the dy pixel they read.
        taps = sorted(((rx + b2 - kx * d2) // s2, kx) for kx in range(r2)
                      if (rx + b2 - kx * d2) % s2 == 0)
        for shift, kx in taps:
            if groups and groups[-1][0] == rx and \
                    groups[-1][3] + groups[-1][2] == shift:
                groups[-1][2] += 1
            else:
                groups.append([rx, len(order), 1, shift])
            order.append(kx)
    return np.array(groups, np.int64).reshape(-1, 4), order


#: The rows of :func:`_strided_rows`' tile for a run's last pixels
#: (``_micro_tile_strided_tail``), set in its twins; 0: every run on whole tiles.
TAIL_ROWS = 0
_micro_tile_strided_tail = _micro_tile_strided


@parallel_jit
def _strided_rows(dyp, wt, dx, groups, overrun, first_row, last_row, s, r, p, stride, dil,
                  before, k, c, padded_c, pitch, width, left, accumulate, mr, nr):
    """One dx row (n, z, y) a job, rows [first_row, last_row) of the N * S0 * S1 (see
    :func:`strided_data_gradient`); dyp (N * P0 * P1, width, K), wt (taps, K, pitch), dx
    (N, S0, S1, S2, C), all flat; groups: :func:`_row_taps`. For each phase and block of NR
    channels, group of taps after group over the row's runs of MR pixels (the group's weight
    panel stays in L1 through the row); runs that end past the row or channels past C go
    through scratch tiles, one per run."""
    row_values = s[2] * c
    widest = (s[2] + stride[2] - 1) // stride[2]
    for job in prange(last_row - first_row):
        t = first_row + job
        tiles = np.empty(((widest + mr - 1) // mr) * mr * nr, dx.dtype)
        y = t % s[1]
        z = (t // s[1]) % s[0]
        n = t // (s[1] * s[0])
        # The (kz, ky) taps of this row, and the dy rows they read.
        taps = np.empty(r[0] * r[1], np.int64)
        srcs = np.empty(r[0] * r[1], np.int64)
        found = 0
        for kz in range(r[0]):
            uz = z + before[0] - kz * dil[0]
            if uz % stride[0] != 0 or not 0 <= uz // stride[0] < p[0]:
                continue
            for ky in range(r[1]):
                uy = y + before[1] - ky * dil[1]
                if uy % stride[1] != 0 or not 0 <= uy // stride[1] < p[1]:
                    continue
                taps[found] = kz * r[1] + ky
                srcs[found] = ((n * p[0] + uz // stride[0]) * p[1] + uy // stride[1]) * width
                found += 1
        row = t * row_values
        for rx in range(stride[2]):
            wq = (s[2] - rx + stride[2] - 1) // stride[2]
            for j0 in range(0, padded_c, nr):
                first = True
                for f in range(found):
                    for gi in range(groups.shape[0]):
                        if groups[gi, 0] != rx:
                            continue
                        depth = groups[gi, 2] * k
                        b = ((taps[f] * r[2] + groups[gi, 1]) * k) * pitch + j0
                        for q0 in range(0, wq, mr):
                            height = min(mr, wq - q0)
                            direct = (height == mr or height == TAIL_ROWS) and j0 + nr <= c
                            target = row + (q0 * stride[2] + rx) * c + j0
                            a = (srcs[f] + q0 + groups[gi, 3] + left) * k
                            # The micro-kernel's pointer accesses are not bounds-checked.
                            if a < 0 or a + (mr - 1) * k + depth > dyp.size or \
                                    b + (depth - 1) * pitch + nr > wt.size or \
                                    (direct and target + (height - 1) * stride[2] * c + nr >
                                     dx.size):
                                overrun[t] = 1
                                continue
                            add = 0 if first and not (direct and accumulate) else 1
                            if direct and height < mr:
                                _micro_tile_strided_tail(
                                    _at(dyp, a), k, _at(wt, b), _at(dx, target), depth,
                                    stride[2] * c, add, 1, pitch)
                                continue
                            _micro_tile_strided(
                                _at(dyp, a), k, _at(wt, b),
                                _at(dx, target) if direct else _at(tiles, q0 * nr), depth,
                                stride[2] * c if direct else nr, add, 1, pitch)
                        first = False
                # The runs that went through scratch tiles (or that no tap reaches:
                # zero): their real pixels and channels.
                for q0 in range(0, wq, mr):
                    height = min(mr, wq - q0)
                    if (height == mr or height == TAIL_ROWS) and j0 + nr <= c and not first:
                        continue
                    for i in range(min(mr, wq - q0)):
                        base = row + ((q0 + i) * stride[2] + rx) * c + j0
                        for j in range(min(nr, c - j0)):
                            value = tiles[(q0 + i) * nr + j] if not first else \
                                dx.dtype.type(0)
                            if accumulate:
                                dx[base + j] += value
                            else:
                                dx[base + j] = value
