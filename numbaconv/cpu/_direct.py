"""Direct (loop) kernels for grouped convolutions with few channels per group: depthwise above
all, where a GEMM has one-column matrices and packing costs more than the arithmetic.

Every op runs in *forward form*: ``out[o] = sum_t w[t] * src[o * stride + t * dilation]`` over a
source that is zero-padded and, for the data gradient, zero-stuffed: the transposed convolution
is a stride-1 convolution of dy, spread ``stride`` apart, with the flipped kernel. Each job
copies the source rows it reads into a local zero-padded buffer, so that the arithmetic runs
without bounds checks. The three families of kernels, one module each:

- channels-last (:mod:`._direct_cl`): a ring of padded rows (pixels x channels). The bodies
  vectorise over the contiguous channels and keep four output pixels in registers; a 3x3 window
  is one fused body (nine taps per store). Where the channels fill whole vectors, 3x3 rows of
  stride 1 (every data gradient's, whose source is stuffed instead) run the row kernels of
  :mod:`._sliding` instead: one vector of channels walks the row with its nine weights in
  registers. The ring's pixel pitch is then an odd number of cache lines
  (:func:`._sliding.row_pitch`), so that a row walked that way does not sit in a few L1 sets.
  Depthwise 3x3 rows with one pixel of padding either side (``same``) and stride 1 along them,
  written (the forward, the data gradient unless accumulated), need no ring at all
  (:func:`._direct_cl._cl_same3`): the rows are read and written where they lie, four cache
  lines of channels a call, so that no line is needed again after it left L1 (1.3-2x faster than
  the ring on 256-1024 channels at 28x28-7x7, Zen 3).
- channels-first, stride 1 with rows as wide as the source's (``same`` padding)
  (:mod:`._direct_cf_plane`): whole planes as flat runs over a guarded copy of the source plane;
  a column mask per tap column selects zero where a flat shift wraps around a row end. Depthwise
  3x3 planes with one pixel of padding on every side, written, instead walk a vector of adjacent
  columns down a copy of the plane with zero columns around it, the sliding row turned on its
  side (:func:`._direct_cf_plane._cf_same3`; 1.3-1.8x faster than the flat runs, Zen 3); their
  weight gradient likewise carries nine vector sums per strip of columns
  (:func:`._direct_cf_plane._cf_same3_weight`).
- channels-first otherwise (:mod:`._direct_cf_slab`): a padded slab of rows, split by stride
  phase, so that every tap is one contiguous shift of a flat array.

A group with several channels (or outputs) is a sum of such passes: over source planes
(channels-first), or over channels gathered into the output-channel order (channels-last).
Zero padding is multiplied like the reference multiplies it, so NaN and infinity in x and dy
propagate exactly as there; non-finite weights take the packed (im2col) path, which is exact
for them too. The weight gradient keeps one partial per job, over a split fixed by the problem
shape (never the thread count), and adds the partials in order: the same inputs give bitwise
the same dw on every run. A call of more than ``_heuristics.DIRECT_PIECE_MACS`` multiply-adds
runs its jobs as several parallel regions (:func:`_pieces`), so that Ctrl-C, which Python
sees only between two regions, ends it soon; each job computes the same in any region.

Two LLVM habits shape the code. Indices into the vectorised dimension start at zero or are
unsigned (a signed offset brings Numba's negative-index wraparound into the address, and the
loop stays scalar). And a loop that reads and writes through many pointers makes LLVM check
them for overlap at run time, once per loop entry: the bodies write one array, read few, and
no body re-reads what it writes; shared arrays are indexed, never sliced, inside parallel
loops (a slice touches the array's reference count, one cache line for every thread).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from .._geometry import dgrad_as_conv
from .._kernel_geometry import int64_arrays
from . import _direct_cf_plane as cf_plane
from . import _direct_cf_slab as cf_slab
from . import _direct_cl as cl
from . import _heuristics
from ._rows import zero_rows
from ._sliding import (LINE, channel_pieces, empty_at, lanes_for, line_head, row_lanes,
                       row_pitch, same_units)
from ._tiles import add_partials, interruptible_ranges

#: Parallel jobs to aim for: spatial rows are split until a problem has this many (or runs
#: out of rows). Fixed, so the weight-gradient split never depends on the thread count.
MIN_JOBS = 16
#: Most buffer-sharing chunks of channels-first jobs (each chunk allocates its buffers once).
MAX_CHUNKS = 64


class _Form(NamedTuple):
    """A convolution in forward form over a padded, zero-stuffed source, three spatial dims.

    Source element ``a`` sits at padded index ``before + a * spread`` (``spread``: the input
    dilation, the data gradient's stride); output ``o`` reads the padded indices ``o * stride
    + t * dilation`` for the taps ``t < kernel``.
    """

    out: tuple
    size: tuple
    spread: tuple
    before: tuple
    stride: tuple
    dilation: tuple
    kernel: tuple

    def args(self) -> tuple:
        """The fields as int64 arrays for the kernels: made once per form and shared by
        every call (kernels only read them)."""
        return int64_arrays(tuple(self))


def _forward_form(g) -> _Form:
    return _Form(g.p, g.s, (1, 1, 1), g.before, g.stride, g.dilation, g.r)


def _transposed_form(g) -> _Form:
    """dx as a stride-1 convolution of dy, spread ``stride`` apart, with the flipped kernel
    (the padding before it: :func:`numbaconv._geometry.dgrad_as_conv`)."""
    before = tuple(dgrad_as_conv(*dims).padding[0]
                   for dims in zip(g.s, g.p, g.r, g.stride, g.dilation, g.before))
    return _Form(g.s, g.p, g.stride, before, (1, 1, 1), g.dilation, g.r)


def _pieces(g, jobs: int) -> list:
    """Ranges of a kernel's ``jobs``, one parallel region each: several for a call of more
    than DIRECT_PIECE_MACS multiply-adds, so that Ctrl-C ends it between them. A job
    computes the same whatever region runs it, so the pieces change no bit."""
    macs = g.n * max(g.positions, math.prod(g.s)) * g.k * g.cg * g.taps
    return interruptible_ranges(jobs, macs, _heuristics.DIRECT_PIECE_MACS)


def _row_split(rows: int, outer: int) -> int:
    """Output rows per job: split ``rows`` until ``outer * blocks`` reaches MIN_JOBS."""
    blocks = min(rows, max(1, -(-MIN_JOBS // max(outer, 1))))
    return -(-rows // blocks)


# --------------------------------------------------------------------------------------------
# Drivers
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1024)
def _channel_map(g) -> tuple:
    """cmap[c, k]: the input channel that output channel k reads in pass c (channels-last);
    remembered per geometry (kernels only read it)."""
    k = np.arange(g.k, dtype=np.int64)
    cmap = (k // g.kg)[None, :] * g.cg + np.arange(g.cg, dtype=np.int64)[:, None]
    return np.ascontiguousarray(cmap), g.cg == 1 and g.kg == 1


def forward(g, x, w, y) -> None:
    """y = conv(x, w) over the problem's groups; every weight finite (the padding is not
    multiplied: see :func:`._tiles.finite`)."""
    form = _forward_form(g)
    if g.channels_last:
        cmap, identity = _channel_map(g)
        wk = np.ascontiguousarray(w.reshape(g.k, g.cg, g.taps).transpose(1, 2, 0))
        y3 = y.reshape(g.n * g.p[0] * g.p[1], g.p[2], g.k)
        if _same_rows(g, form, x, y):
            _same3(g, form, g.x5(x), wk, y3)
            return
        rows = _row_split(g.p[1], g.n * g.p[0])
        for first, last in _pieces(g, g.n * g.p[0] * -(-g.p[1] // rows)):
            cl._cl_conv(g.x5(x), wk, y3, _rows2d(y3), cmap, identity, False, g.cg, g.kg,
                        *form.args(), rows, False, *_row_kernels(g.k, y.dtype), first, last)
    else:
        _cf_convolve(g, form, g.x5(x), w.reshape(g.k, g.cg, g.taps), g.y5(y), g.kg, False)


def data_gradient(g, dy, w, dx, accumulate: bool = True) -> None:
    """dx += the data gradient, or dx = it when not ``accumulate``; every weight finite."""
    form = _transposed_form(g)
    flipped = w.reshape(g.k, g.cg, g.taps)[:, :, ::-1]
    if g.channels_last:
        # Depthwise 3x3 windows write dx rows straight from the fused body, as forward does.
        overwrite = (not accumulate and g.cg == 1 and g.kg == 1 and form.kernel[0] == 1
                     and form.kernel[1:] == (3, 3) and form.dilation[2] == 1)
        if not accumulate and not overwrite:
            _zero_rows(dx)
        wk = np.ascontiguousarray(flipped.transpose(1, 2, 0))        # (Cg, taps, K)
        cmap = np.zeros((g.cg, 1), np.int64)                         # dy is read as is
        dx3 = dx.reshape(g.n * g.s[0] * g.s[1], g.s[2], g.c)
        if overwrite and _same_rows(g, form, dy, dx):
            _same3(g, form, g.y5(dy), wk, dx3)
            return
        rows = _row_split(g.s[1], g.n * g.s[0])
        for first, last in _pieces(g, g.n * g.s[0] * -(-g.s[1] // rows)):
            cl._cl_conv(g.y5(dy), wk, dx3, _rows2d(dx3), cmap, True, True, g.cg, g.kg,
                        *form.args(), rows, overwrite, *_row_kernels(g.k, dx.dtype), first,
                        last)
    else:
        # dx plane g*Cg + c sums dy planes g*Kg + j, each with flip(w[g*Kg + j, c]).
        wsrc = np.ascontiguousarray(
            flipped.reshape(g.groups, g.kg, g.cg, g.taps).transpose(0, 2, 1, 3)
            .reshape(g.c, g.kg, g.taps))
        # Added into dx, or written (zeros where no dy reaches) when not accumulating.
        _cf_convolve(g, form, g.y5(dy), wsrc, g.x5(dx), g.cg, accumulate)


def weight_gradient(g, x, dy) -> np.ndarray:
    """dw (K, Cg, *R), summed over a fixed split in a fixed order (bitwise reproducible)."""
    form = _forward_form(g)
    out, size, _, before, stride, dil, r = form.args()
    if g.channels_last:
        rows = _row_split(g.p[1], g.n * g.p[0])
        jobs = g.n * g.p[0] * -(-g.p[1] // rows)
        x5 = g.x5(x)
        dy3 = dy.reshape(g.n * g.p[0] * g.p[1], g.p[2], g.k)
        shape = (jobs, g.cg, g.taps, g.k)
        if _same_weight_rows(g, form, x5, dy):           # one pass (cg = 1), 9 taps
            # Vectors on whole cache lines where x's and dy's pixels start alike (and fall
            # in few L1 sets), the partial sums' too (allocated as far past a line).
            # Rows walked 4 at a time (where the operands are large) go on whole lines
            # wherever the pixels start: ``head`` channels before the first.
            offset = _line_offset(x, dy)
            whole, narrow = channel_pieces(offset, g.k, dy.dtype)
            four = (g.p[2] >= _heuristics.SAME_WEIGHT_ROWS_MIN_WIDTH
                    and x.nbytes + dy.nbytes >= _heuristics.SAME_WEIGHT_ROWS_MIN_BYTES)
            head = line_head(offset, g.k, dy.dtype) if four else 0
            partial = (empty_at(offset, shape, dy.dtype) if len(narrow) or head
                       else np.empty(shape, dy.dtype))
            zero = np.zeros(x5.shape[3] * g.k, dy.dtype)
            lanes = row_lanes(dy.dtype)
            scratch = np.empty((jobs if head else 1, 9 * lanes), dy.dtype)
            for first, last in _pieces(g, jobs):
                cl._cl_same3_weight(x5, dy3, partial, zero, scratch, out, before, stride, dil,
                                    lanes, head, four, whole, narrow, rows, first, last)
        else:
            partial = np.empty(shape, dy.dtype)
            cmap, identity = _channel_map(g)
            for first, last in _pieces(g, jobs):
                cl._cl_weight_partials(x5, dy3, partial, cmap, identity, out, size, before,
                                       stride, dil, r, rows, *_row_kernels(g.k, dy.dtype),
                                       first, last)
        total = np.empty(g.cg * g.taps * g.k, dy.dtype)
        add_partials(partial.reshape(jobs, -1), total)
        return np.ascontiguousarray(total.reshape(g.cg, g.taps, g.k).transpose(2, 0, 1))
    x5, dy5 = g.x5(x), g.y5(dy)
    lanes = (_same_planes(form, None, x5, dy5, False)
             if g.cg == 1 and g.kg == 1 and g.p[2] >= _heuristics.SAME_WEIGHT_MIN_WIDTH else 0)
    if lanes:
        dw = np.empty((g.k, g.taps), dy.dtype)
        for first, last in _pieces(g, g.k):     # its sums run over the images: by channels
            cf_plane._cf_same3_weight(_planes(x5), _planes(dy5), dw, g.p[1], g.p[2],
                                      _chunks(last - first), lanes, first, last)
        return dw.reshape((g.k, g.cg) + g.r)
    rows = _row_split(g.p[1], g.n * g.k * g.p[0])
    split = g.p[0] * -(-g.p[1] // rows)                   # jobs per (image, output plane)
    jobs = g.n * g.k * split
    partial = np.empty((jobs, g.cg, g.taps), dy.dtype)
    for first, last in _pieces(g, jobs):
        chunks = _chunks(last - first)
        if _flat(form):
            cf_plane._cf_flat_weight(_planes(x5), _planes(dy5), partial, g.kg,
                                     _column_mask(form), out, size, before, stride, dil, r,
                                     rows, chunks, _zero(dy), first, last)
        else:
            cf_slab._cf_weight_partials(x5, dy5, partial, g.kg, out, size, before, stride, dil,
                                        r, rows, chunks, _zero(dy), first, last)
    # Jobs run (image, plane, split): bring the images and splits of each plane together.
    ordered = partial.reshape(g.n, g.k, split, g.cg * g.taps).transpose(0, 2, 1, 3)
    total = np.empty(g.k * g.cg * g.taps, dy.dtype)
    add_partials(np.ascontiguousarray(ordered).reshape(g.n * split, -1), total)
    return total.reshape((g.k, g.cg) + g.r)


def _row_kernels(channels: int, dtype) -> tuple:
    """(pitch, vec) of the channels-last kernels' row buffers, K = ``channels`` wide: the
    pixel pitch (:func:`._sliding.row_pitch`) and the vector width of the sliding row
    kernels (0: not used)."""
    return row_pitch(channels, dtype), lanes_for(channels, dtype)


def _same_along_rows(form) -> bool:
    """3x3 windows of stride and dilation 1 along the rows with ``same`` padding there (one
    pixel each side), nothing stuffed, 2D (or 3D with one tap plane of stride 1 and no
    depth padding): the geometry every ``same`` kernel needs; the rows' own dimension is
    each kernel's business."""
    return (form.kernel == (1, 3, 3) and form.spread == (1, 1, 1)
            and form.stride[0] == 1 and form.before[0] == 0 and form.size[0] == form.out[0]
            and form.stride[2] == 1 and form.dilation[2] == 1 and form.before[2] == 1
            and form.size[2] == form.out[2])


def _same_rows(g, form, src, dst) -> bool:
    """Whether :func:`._direct_cl._cl_same3` computes this channels-last problem: depthwise
    (one channel per group and output), :func:`_same_along_rows` (any stride and dilation
    from row to row), the channels in whole vectors, both arrays C-contiguous."""
    return (g.cg == 1 and g.kg == 1 and _same_along_rows(form)
            and same_units(g.k, dst.dtype)[0] != 0
            and src.flags.c_contiguous and dst.flags.c_contiguous)


def _same_weight_rows(g, form, x5, dy) -> bool:
    """Whether :func:`._direct_cl._cl_same3_weight` computes this channels-last weight
    gradient: :func:`_same_rows` and rows of at least 2 pixels."""
    return _same_rows(g, form, x5, dy) and form.out[2] >= 2


def _same3(g, form, src5, wk, dst3) -> None:
    out, _, _, before, stride, dil, _ = form.args()
    zero = np.zeros(src5.shape[3] * src5.shape[4], dst3.dtype)
    for first, last in _pieces(g, dst3.shape[0]):
        cl._cl_same3(src5, wk, dst3, zero, out, before, stride, dil,
                     *same_units(src5.shape[4], dst3.dtype), first, last)


def _line_offset(a: np.ndarray, b: np.ndarray) -> int:
    """How far past a cache line both arrays start, 0 where they differ (see
    :func:`._sliding.channel_pieces`)."""
    offset = a.ctypes.data % LINE
    return offset if b.ctypes.data % LINE == offset else 0


def _same_planes(form, wsrc, src5, dst5, add) -> int:
    """The vector width for :func:`._direct_cf_plane._cf_same3` (and ``_cf_same3_weight``,
    ``wsrc`` None) where it computes this channels-first convolution, else 0: depthwise (one
    source plane per output), :func:`_same_along_rows` and the same from row to row (stride and
    dilation 1, one row of padding above and below), written, both arrays C-contiguous."""
    ok = (not add and (wsrc is None or wsrc.shape[1] == 1)
          and src5.shape[1] == dst5.shape[1] and _same_along_rows(form)
          and form.stride[1] == 1 and form.dilation[1] == 1 and form.before[1] == 1
          and form.size[1] == form.out[1]
          and src5.flags.c_contiguous and dst5.flags.c_contiguous)
    return row_lanes(dst5.dtype) if ok else 0


def _cf_convolve(g, form, src5, wsrc, dst5, per_group, add) -> None:
    lanes = _same_planes(form, wsrc, src5, dst5, add)
    if lanes:
        # (C, 9, lanes): each weight broadcast to a vector, the 3x3 window transposed.
        taps = wsrc.reshape(-1, 3, 3).transpose(0, 2, 1).reshape(-1, 9)
        wb = np.ascontiguousarray(np.broadcast_to(taps[:, :, None], taps.shape + (lanes,)))
        planes = dst5.shape[0] * dst5.shape[1] * dst5.shape[2]
        for first, last in _pieces(g, planes):
            cf_plane._cf_same3(_planes(src5), wb, _planes(dst5), form.out[1], form.out[2],
                               _chunks(last - first), lanes, first, last)
        return
    n, o = dst5.shape[0], dst5.shape[1]
    rows = _row_split(form.out[1], n * o * form.out[0])
    for first, last in _pieces(g, n * o * form.out[0] * -(-form.out[1] // rows)):
        chunks = _chunks(last - first)
        if _flat(form):
            cf_plane._cf_flat_conv(_planes(src5), wsrc, _planes(dst5), per_group, add,
                                   _column_mask(form), *form.args(), rows, chunks, _zero(dst5),
                                   first, last)
        else:
            cf_slab._cf_conv(src5, wsrc, dst5, per_group, add, *form.args(), rows, chunks,
                             _zero(dst5), first, last)


def _zero_rows(a) -> None:
    zero_rows(a.reshape(a.shape[0], -1))


def _flat(form) -> bool:
    """Stride 1, nothing stuffed, output rows as wide as source rows: whole-plane runs."""
    return (form.stride[1:] == (1, 1) and form.spread[1:] == (1, 1)
            and form.out[2] == form.size[2])


def _rows2d(a3):
    """(rows, pixels, channels) as (rows, pixels * channels)."""
    return a3.reshape(a3.shape[0], -1)


def _planes(a5):
    """(N, C, D0, D1, D2) as (N, C, D0, D1 * D2)."""
    return a5.reshape(a5.shape[:3] + (-1,))


@functools.lru_cache(maxsize=1024)
def _column_mask(form) -> np.ndarray:
    """mask[t2, q]: output position q (flat over rows) reads inside its row at tap column t2
    (remembered per form; kernels only read it)."""
    width = form.size[2]
    col = np.arange(form.out[1] * width) % width
    shift = np.arange(form.kernel[2])[:, None] * form.dilation[2] - form.before[2]
    return ((col + shift >= 0) & (col + shift < width)).astype(np.uint8)


def _zero(a):
    """A zero of a's dtype (kernels start sums from it)."""
    return a.dtype.type(0)


def _chunks(jobs: int) -> int:
    return max(1, min(jobs, MAX_CHUNKS))
