"""Depthwise 3x3 rows in explicit LLVM vector IR: one vector of channels slides along a row.

The channels-last direct kernels (:mod:`._direct`) vectorise over the contiguous channels
and keep a few output pixels per loop body: each body reloads its nine weights and its
window columns for every vector of channels, and LLVM spills the many row pointers
(about 24 instructions and 10 loads per output vector). Here one vector of channels walks a
whole row instead, the nine weights staying in registers:

- :func:`conv3_row` (forward form: the forward convolution and the stride-1 data gradient):
  each source column's three vectors (one per tap row) are loaded once and feed the three
  output pixels that read them, as running sums: 3 loads, 9 FMAs and 1 store per output
  vector.
- :func:`grad3_row` (the weight gradient): the nine tap sums of one vector of channels are
  carried through the row, each output pixel's dy times its nine window values;
  :func:`grad3_same` on rows of ``same`` padding read where they lie, each source pixel
  loaded once for the three taps that read it (:func:`._direct_cl._cl_same3_weight`);
  ``grad3_rows4x2`` and ``grad3_rows4x1`` walk 4 such rows at once, each source pixel
  fetched once for the rows that read it, on whole cache lines wherever the pixels start.
- ``conv3_same1`` .. ``conv3_same8``: :func:`conv3_row` on rows of ``same`` padding read
  where they lie (the padding pixels are left out, not read), 1 to 8 vectors of channels
  side by side (:data:`SAME_ROW_BYTES`), for :func:`._direct_cl._cl_same3`;
  the same row at fixed widths (``conv3_lanes16`` .. ``conv3_lanes1``, likewise
  ``grad3_lanes*``) walks strips of adjacent columns down a channels-first plane
  (:func:`._direct_cf_plane._cf_same3`, :func:`._direct_cf_plane._cf_same3_weight`), rows
  and columns swapped.

Walking a row one vector at a time strides through memory by the pixel pitch, so rows whose
pitch is a multiple of 256 bytes put a row's pixels in the same few L1 sets and thrash; the
callers' padded row buffers therefore get a pitch of an odd number of cache lines
(:func:`row_pitch`). Measured on one core (Zen 3, AVX2, float32, three source rows and the
outputs resident in L1/L2, against the fused loop body of :mod:`._direct`): 56 pixels x 128
channels 2.03x, 28 x 64 3.68x, 14 x 512 1.52x, 7 x 512 1.47x, 28 x 256 1.62x; with the
unpadded pitch 1.20x, 2.99x, 0.62x, 0.89x, 0.71x. Whole depthwise 3x3 calls (2 cores, N = 8,
channels-last, against the same kernels with the loop bodies, alternating in one process,
best of 80): 128 channels at 56x56 forward 1.38x, data gradient 1.30x, weight gradient
1.17x; 32 at 112x112 1.21x, 1.23x, 1.92x; 512 at 14x14 1.05-1.10x, where filling the row
buffers and writing dx weigh as much as the arithmetic.

Pointers come from ``_microkernel._at`` and nothing is checked here: the callers make sure
that every source row holds ``npx + 2`` pixels (``npx`` for the ``same`` rows, npx >= 1)
and every row ``units * lanes`` channels from the pointer on.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._microkernel import _emit_prefetch, _llvm_float, vector_lanes

#: Bytes per cache line: row buffers get a pitch of an odd number of them, and a vector
#: load that crosses one costs two (see :func:`channel_pieces`).
LINE = 64


def row_pitch(channels: int, dtype) -> int:
    """Elements between pixels of a padded row buffer of ``channels`` channels: a pitch of an
    odd number of cache lines where the rows are 256 bytes or more a pixel (so that a row's
    pixels spread over the L1 sets), ``channels`` otherwise (fewer than 4 lines a pixel put
    a row in enough sets already, and padding would double a small row's size)."""
    size = np.dtype(dtype).itemsize
    if channels * size < 4 * LINE:
        return channels
    lines = -(-channels * size // LINE)
    lines += 1 - lines % 2
    return lines * LINE // size


def row_lanes(dtype) -> int:
    """Lanes of the row kernels' vectors for ``dtype`` (what callers must step by)."""
    return vector_lanes(dtype)


#: Sets of the L1 data cache (64 on Zen 4, Zen 5 and recent Intel cores: 32-48 KB, 8-12
#: ways, 64-byte lines): consecutive pixels of a row whose pitch is a multiple of many lines
#: fall in few of them.
L1_SETS = 64
#: The narrow pieces (:func:`channel_pieces`) are taken where a row's pixels fall in at most
#: this many L1 sets (there a vector that straddles two lines loses its second line before
#: the next vector's walk reads it), and where they add at most PIECES_PER_VECTOR times the
#: plain split's walks: elsewhere the extra walks cost more (docs/cpu-algorithms.md).
PIECES_MAX_SETS = 4
PIECES_PER_VECTOR = 1.25


def channel_pieces(offset: int, channels: int, dtype) -> tuple:
    """How vectors walk a pixel's ``channels`` values, its first at ``offset`` bytes past a
    cache line (the same for every pixel): ``((head, tail), narrow)``, whole
    :func:`row_lanes` vectors from channel ``head`` to ``tail`` channels before the last and
    the ``narrow`` pieces (first channel, lanes), int64 (P, 2), on 8, 4, 2 or 1 lanes,
    before and after them. Whole vectors from channel 0 and nothing narrow where the pixels
    start on a line, or do not all start alike, or fall in many L1 sets
    (:data:`PIECES_MAX_SETS`); else the narrow pieces up to the first line and from the
    last, whole vectors on whole lines between. NumPy allocates 16 bytes past a line.
    ``channels`` is a multiple of the row lanes."""
    itemsize = np.dtype(dtype).itemsize
    lanes = row_lanes(dtype)
    plain = ((0, 0), np.zeros((0, 2), np.int64))
    head = (LINE - offset) % LINE // itemsize
    pitch = channels * itemsize
    if not head or offset % itemsize or pitch % LINE:
        return plain
    if L1_SETS // math.gcd(pitch // LINE, L1_SETS) > PIECES_MAX_SETS:
        return plain
    tail = LINE // itemsize - head
    narrow = _binary(0, head, lanes) + _binary(channels - tail, tail, lanes)
    walks = len(narrow) + (channels - head - tail) // lanes
    if walks > PIECES_PER_VECTOR * (channels // lanes):
        return plain
    return (head, tail), np.array(narrow, np.int64)


def line_head(offset: int, channels: int, dtype) -> int:
    """Channels of each pixel before its first cache line where its ``channels`` values start
    ``offset`` bytes past one (every pixel alike) and a :func:`row_lanes` vector fills a
    line: there the weight-gradient rows (:func:`_emit_grad3_rows`) walk vectors on whole
    lines, the last one wrapping into the next pixel. 0 where the pixels start on a line or
    the vectors are not a line wide (``channels`` a multiple of the row lanes)."""
    itemsize = np.dtype(dtype).itemsize
    if row_lanes(dtype) * itemsize != LINE or offset % itemsize or channels * itemsize % LINE:
        return 0
    return (LINE - offset) % LINE // itemsize


def empty_at(offset: int, shape: tuple, dtype) -> np.ndarray:
    """``np.empty(shape, dtype)`` whose first element lies ``offset`` bytes past a cache
    line (a view of a slightly larger array)."""
    itemsize = np.dtype(dtype).itemsize
    count = math.prod(shape)
    spare = np.empty(count + LINE // itemsize, dtype)
    skip = (offset - spare.ctypes.data) % LINE // itemsize
    return spare[skip:skip + count].reshape(shape)


def _binary(start: int, count: int, lanes: int) -> list:
    """[(first, width), ...]: ``count`` values from ``start`` in power-of-two pieces of at
    most ``lanes``, largest first."""
    pieces = []
    width = lanes
    while count:
        while width > count:
            width //= 2
        pieces.append((start, width))
        start, count = start + width, count - width
    return pieces


def lanes_for(channels: int, dtype) -> int:
    """The vector width (channels per call) of the row kernels for ``channels`` channels,
    or 0 where they do not apply (channels not a whole number of vectors)."""
    lanes = row_lanes(dtype)
    return lanes if channels % lanes == 0 else 0


#: Bytes of channels per call of the ``same`` rows (:data:`conv3_same8` and smaller), which
#: read and write rows where they lie, a pixel's channels often a multiple of 256 bytes apart:
#: each call takes whole cache lines (4 of them), so that no line is needed again after it
#: left L1. Measured on Zen 3 (AVX2, 32-byte vectors, 2 cores, N = 8, float32 depthwise
#: 3x3 data gradients, channels-last, best of 120): 1, 2, 4 and 8 vectors a call, 512
#: channels at 14x14 377, 230, 187, 183 us; 128 at 56x56 1745, 1729, 1181, 1125; 256 at
#: 28x28 909, 652, 551, 500; 1024 at 7x7 291, 192, 151, 144 (the ring-buffer kernel of
#: :mod:`._direct`: 342, 1615, 893, 318). One run each; 128 at 56x56 is bound by memory
#: and moved by 40% between runs (whole calls against the ring: 0.8-1.4x).
SAME_ROW_BYTES = 4 * LINE


def same_units(channels: int, dtype) -> tuple:
    """(lanes, units) of the ``same`` rows for ``channels`` channels: the vector width and
    the most vectors a call (8, 4, 2 or 1; fewer where fewer channels are left), or (0, 0)
    where the channels are not a whole number of vectors."""
    lanes = lanes_for(channels, dtype)
    if not lanes:
        return 0, 0
    units = SAME_ROW_BYTES // (lanes * np.dtype(dtype).itemsize)
    return lanes, max(1, min(8, units))


class _Emitter:
    """IR helpers shared by the row kernels: vectors of ``dtype`` (``lanes`` wide, by
    default :func:`row_lanes`) and their FMA."""

    def __init__(self, builder, dtype, lanes=None):
        self.builder = builder
        self.lanes = lanes or row_lanes(dtype)
        self.i64 = ir.IntType(64)
        self.vec = ir.VectorType(_llvm_float(dtype), self.lanes)
        #: The vector type's name in LLVM intrinsics' names (``v16f32``).
        self.kind = f"v{self.lanes}{'f32' if np.dtype(dtype) == np.float32 else 'f64'}"
        self.fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(self.vec, [self.vec] * 3), f"llvm.fma.{self.kind}")

    def const(self, value):
        return ir.Constant(self.i64, value)

    def wide(self, value):
        return self.builder.sext(value, self.i64) if value.type.width < 64 else value

    def at(self, pointer, index, stride):
        """The vector at ``pointer + index * stride`` elements."""
        where = self.builder.gep(pointer, [self.builder.mul(index, stride)])
        return self.builder.bitcast(where, self.vec.as_pointer())

    def load(self, pointer, index, stride):
        return self.builder.load(self.at(pointer, index, stride), align=1)

    def store(self, value, pointer, index, stride):
        self.builder.store(value, self.at(pointer, index, stride), align=1)

    def madd(self, a, b, acc):
        return self.builder.call(self.fma, [a, b, acc])

    def open_loop(self, name, trips):
        """Blocks (entry, loop, done) of a loop run when ``trips`` > 0, the builder placed at
        the loop's start; the caller adds the phis, the back branch and moves to done."""
        builder = self.builder
        entry = builder.block
        loop = builder.append_basic_block(f"{name}.loop")
        done = builder.append_basic_block(f"{name}.done")
        builder.cbranch(builder.icmp_signed(">", trips, self.const(0)), loop, done)
        builder.position_at_end(loop)
        return entry, loop, done

    @staticmethod
    def carry(phis, first, again, entry, loop):
        """Loop-carried values: each phi takes ``first`` from ``entry``, ``again`` from
        ``loop``."""
        for phi, a, b in zip(phis, first, again):
            phi.add_incoming(a, entry)
            phi.add_incoming(b, loop)

    def merged(self, first, again, entry, loop):
        """Vector phis where a loop opened by :meth:`open_loop` is done: ``first`` where it
        never ran, its last ``again`` otherwise (the builder placed in the done block)."""
        phis = [self.builder.phi(self.vec) for _ in first]
        self.carry(phis, first, again, entry, loop)
        return phis


def _row_kernel(emit, lanes=None):
    """An intrinsic ``kernel(pa, pb, pc, ps, p1, s1, p2, s2, npx)`` on one vector of
    channels: three source rows at pixel 0, their pixels ``ps`` elements apart, and two
    more strided operands (pointer, stride), for ``npx`` output pixels. ``emit(e, rows, ps,
    p1, s1, p2, s2, npx)`` writes its IR (:class:`_Emitter` ``e``, integers 64-bit).
    ``lanes``: the vectors' width, where not :func:`row_lanes`'s."""

    @intrinsic
    def kernel(typingctx, pa, pb, pc, ps, p1, s1, p2, s2, npx):
        if not (isinstance(pa, types.CPointer) and pa.dtype in (types.float32, types.float64)):
            return None
        dtype = np.dtype(str(pa.dtype))

        def codegen(context, builder, signature, args):
            pa, pb, pc, ps, p1, s1, p2, s2, npx = args
            e = _Emitter(builder, dtype, lanes)
            emit(e, (pa, pb, pc), e.wide(ps), p1, e.wide(s1), p2, e.wide(s2), e.wide(npx))
            return context.get_dummy_value()

        return types.void(pa, pb, pc, ps, p1, s1, p2, s2, npx), codegen

    kernel.__doc__ = getattr(emit, "__doc__", None)
    return kernel


def _emit_conv3(e, rows, ps, pw, wt, pd, dps, npx, units=1, same=False):
    """out[q] = sum over the tap rows i (source rows a, b, c) and tap columns m < 3 of
    w[3i + m] * row_i[q + m], for the output pixels q < npx, ``units`` vectors of channels.

    ``conv3_row(pa, pb, pc, ps, pw, wt, pd, dps, npx)``: the three source rows at pixel 0,
    pixels ``ps`` elements apart (npx + 2 of them are read); ``pw``: tap 0's weights, taps
    ``wt`` apart; ``pd``: output pixel 0, pixels ``dps`` apart (written, not added to).
    With ``same``, the rows hold npx pixels, with one pixel of zero padding on either side
    that is never read (``same`` padding: output q reads pixels q - 1 .. q + 1); npx >= 1.
    """
    builder = e.builder
    span = [e.const(v * e.lanes) for v in range(units)]

    def part(pointer, v):
        return builder.gep(pointer, [span[v]]) if v else pointer

    w = [[e.load(part(pw, v), e.const(t), wt) for t in range(9)] for v in range(units)]

    def column(j, v):
        return [e.load(part(p, v), j, ps) for p in rows]

    def taps(v, m, src, acc):
        """acc plus tap column m (of every tap row) times the source column src."""
        for i in range(3):
            acc = builder.fmul(w[v][3 * i + m], src[i]) if acc is None else \
                e.madd(w[v][3 * i + m], src[i], acc)
        return acc

    # Output q collects tap column m from source column q + m - shift (shift 1: the
    # padding pixel before column 0 is not there): after column j, output j + shift - 2 is
    # done and the running sums of the next two outputs are carried on. Two columns prime
    # the sums, or with ``same`` column 0 alone, the padding's terms being left out.
    shift = 1 if same else 0
    older, newer = [], []
    for v in range(units):
        if same:
            first = column(e.const(0), v)
            older.append(taps(v, 1, first, None))
            newer.append(taps(v, 0, first, None))
        else:
            first, second = column(e.const(0), v), column(e.const(1), v)
            older.append(taps(v, 1, second, taps(v, 0, first, None)))
            newer.append(taps(v, 0, second, None))
    start, end = (1, npx) if same else (2, builder.add(npx, e.const(2)))
    entry, loop, done = e.open_loop("conv3", builder.sub(end, e.const(start)))
    j = builder.phi(e.i64)
    carried_older = [builder.phi(e.vec) for _ in range(units)]
    carried_newer = [builder.phi(e.vec) for _ in range(units)]
    next_older, next_newer = [], []
    for v in range(units):
        src = column(j, v)
        e.store(taps(v, 2, src, carried_older[v]), part(pd, v),
                builder.sub(j, e.const(2 - shift)), dps)
        next_older.append(taps(v, 1, src, carried_newer[v]))
        next_newer.append(taps(v, 0, src, None))
    j_next = builder.add(j, e.const(1))
    j.add_incoming(e.const(start), entry)
    j.add_incoming(j_next, loop)
    e.carry(carried_older, older, next_older, entry, loop)
    e.carry(carried_newer, newer, next_newer, entry, loop)
    builder.cbranch(builder.icmp_signed("<", j_next, end), loop, done)
    builder.position_at_end(done)
    if same:
        # The last output's third tap column is padding: its sum is done as carried.
        last = e.merged(older, next_older, entry, loop)
        for v in range(units):
            e.store(last[v], part(pd, v), builder.sub(npx, e.const(1)), dps)


def _emit_grad3(e, rows, ps, pdy, dps, pacc, at, npx):
    """acc[3i + m] += sum over q < npx of dy[q] * row_i[q + m], for the tap rows i (source
    rows a, b, c) and tap columns m < 3, one vector of channels.

    ``grad3_row(pa, pb, pc, ps, pdy, dps, pacc, at, npx)``: the source rows at pixel 0,
    pixels ``ps`` elements apart (npx + 2 of them are read); ``pdy``: dy at output pixel 0,
    pixels ``dps`` apart; ``pacc``: tap 0's sums, taps ``at`` apart (loaded, added to,
    stored).
    """
    builder = e.builder
    start = [e.load(pacc, e.const(t), at) for t in range(9)]
    entry, loop, done = e.open_loop("grad3", npx)
    q = builder.phi(e.i64)
    sums = [builder.phi(e.vec) for _ in range(9)]
    g = e.load(pdy, q, dps)
    updated = []
    for i in range(3):
        for m in range(3):
            src = e.load(rows[i], builder.add(q, e.const(m)), ps)
            updated.append(e.madd(g, src, sums[3 * i + m]))
    q_next = builder.add(q, e.const(1))
    q.add_incoming(e.const(0), entry)
    q.add_incoming(q_next, loop)
    e.carry(sums, start, updated, entry, loop)
    builder.cbranch(builder.icmp_signed("<", q_next, npx), loop, done)
    builder.position_at_end(done)
    final = e.merged(start, updated, entry, loop)
    for t in range(9):
        e.store(final[t], pacc, e.const(t), at)


def _emit_grad3_same(e, rows, ps, pdy, dps, pacc, at, npx):
    """acc[3i + m] += sum over q < npx of dy[q] * row_i[q + m - 1], for the tap rows i
    (source rows a, b, c, read where they lie) and tap columns m < 3, one vector of
    channels, with ``same`` padding: row_i[-1] and row_i[npx] are zeros, multiplied (a
    non-finite dy at a row's end makes its padding tap's sum NaN, as the reference's).

    ``grad3_same(pa, pb, pc, ps, pdy, dps, pacc, at, npx)``: the source rows at pixel 0,
    pixels ``ps`` elements apart (npx of them are read); ``pdy``: dy at output pixel 0,
    pixels ``dps`` apart; ``pacc``: tap 0's sums, taps ``at`` apart (loaded, added to,
    stored); npx >= 2. Each source pixel is loaded once and kept for the three outputs that
    read it: 4 loads and 9 FMAs per output vector (:func:`grad3_row` loads 10).
    """
    builder = e.builder
    zero = ir.Constant(e.vec, None)
    acc = [e.load(pacc, e.const(t), at) for t in range(9)]
    # Output 0: tap column 0 reads the padding, 1 and 2 pixels 0 and 1.
    g = e.load(pdy, e.const(0), dps)
    older = [e.load(p, e.const(0), ps) for p in rows]
    newer = [e.load(p, e.const(1), ps) for p in rows]
    for i in range(3):
        acc[3 * i] = e.madd(g, zero, acc[3 * i])
        acc[3 * i + 1] = e.madd(g, older[i], acc[3 * i + 1])
        acc[3 * i + 2] = e.madd(g, newer[i], acc[3 * i + 2])
    # Outputs 1 .. npx - 2: pixel q + 1 loaded, q - 1 and q carried.
    last = builder.sub(npx, e.const(1))
    entry, loop, done = e.open_loop("grad3s", builder.sub(npx, e.const(2)))
    q = builder.phi(e.i64)
    sums = [builder.phi(e.vec) for _ in range(9)]
    carried_older = [builder.phi(e.vec) for _ in range(3)]
    carried_newer = [builder.phi(e.vec) for _ in range(3)]
    g = e.load(pdy, q, dps)
    q_next = builder.add(q, e.const(1))
    ahead = [e.load(p, q_next, ps) for p in rows]
    updated = []
    for i in range(3):
        for m, src in enumerate((carried_older[i], carried_newer[i], ahead[i])):
            updated.append(e.madd(g, src, sums[3 * i + m]))
    q.add_incoming(e.const(1), entry)
    q.add_incoming(q_next, loop)
    e.carry(sums, acc, updated, entry, loop)
    e.carry(carried_older, older, carried_newer, entry, loop)
    e.carry(carried_newer, newer, ahead, entry, loop)
    builder.cbranch(builder.icmp_signed("<", q_next, last), loop, done)
    builder.position_at_end(done)
    acc = e.merged(acc, updated, entry, loop)
    older = e.merged(older, carried_newer, entry, loop)
    newer = e.merged(newer, ahead, entry, loop)
    # Output npx - 1: tap column 2 reads the padding.
    g = e.load(pdy, last, dps)
    for i in range(3):
        acc[3 * i] = e.madd(g, older[i], acc[3 * i])
        acc[3 * i + 1] = e.madd(g, newer[i], acc[3 * i + 1])
        acc[3 * i + 2] = e.madd(g, zero, acc[3 * i + 2])
    for t in range(9):
        e.store(acc[t], pacc, e.const(t), at)


def _emit_grad3_rows(e, px, rs, ps, pdy, drs, dps, pacc, at, npx, split, rows, units):
    """acc[3i + m] += sum over output rows j < ``rows`` and pixels q < npx of dy_j[q] *
    src_{j+i}[q + m - 1]: the depthwise 3x3 weight gradient of ``rows`` adjacent output rows
    (``same`` padding along them, stride and dilation 1 across them), ``units`` vectors of
    channels side by side, read where they lie. Each source row's pixels come to L1 once for
    the ``rows`` outputs that read them (:func:`_emit_grad3_same` fetches each three times).

    ``grad3_rows*(px, rs, ps, pdy, drs, dps, pacc, at, npx, split)``: source row 0 (the row
    of the first output's tap row 0) at pixel 0, ``rows + 2`` rows ``rs`` elements apart,
    pixels ``ps`` apart; dy's rows from ``pdy``, ``drs`` apart, pixels ``dps`` apart;
    ``pacc``: tap 0's sums, taps ``at`` apart (loaded, added to, stored); npx >= 1.

    ``split`` < lanes makes the walk wrap a pixel (one unit): lanes from ``split`` on are
    the next pixel's (a vector on a whole cache line that starts ``split`` lanes before a
    pixel's end), so that rows whose pixels do not start on a line are still read a line a
    vector; the walk then starts a pixel early. Lanes whose output pixel lies outside the
    row are left as they are and taps on the padding multiply zeros, masked loads touching
    only the row's pixels: each lane adds what a plain walk of its channel adds, in the same
    order (the bits do not depend on where the arrays lie).

    Each step also prefetches, into L2, the same pixel's lines of the next call's new rows
    (source rows ``rows + 2`` .. ``2 * rows + 1``, dy's ``rows`` .. ``2 * rows - 1``): the
    rows arrive while these are summed, as the strided walk alone does not bring them.
    """
    builder = e.builder
    lanes = e.lanes
    mask_type = ir.VectorType(ir.IntType(1), lanes)
    lane_ints = ir.VectorType(e.i64, lanes)
    masked_load = cgutils.get_or_insert_function(
        builder.module,
        ir.FunctionType(e.vec, [e.vec.as_pointer(), ir.IntType(32), mask_type, e.vec]),
        f"llvm.masked.load.{e.kind}.p0")
    zero = ir.Constant(e.vec, None)

    def splat(value):
        return _splat(builder, value, lane_ints)

    def offset(pointer, index, stride):
        return builder.gep(pointer, [builder.mul(e.const(index), stride)]) if index else pointer

    sources = [offset(px, r, rs) for r in range(rows + 2)]
    grads = [offset(pdy, j, drs) for j in range(rows)]
    ahead_rows = ([offset(px, r, rs) for r in range(rows + 2, 2 * rows + 2)]
                  + [offset(pdy, j, drs) for j in range(rows, 2 * rows)])
    units_at = [e.const(v * lanes) for v in range(units)]

    def unit(pointer, v):
        return builder.gep(pointer, [units_at[v]]) if v else pointer

    # Lane l's pixel is q + ahead[l]: 1 for the lanes from split on (the wrap's next pixel).
    iota = ir.Constant(lane_ints, [ir.Constant(e.i64, lane) for lane in range(lanes)])
    ahead = builder.zext(builder.icmp_signed(">=", iota, splat(split)), lane_ints)
    wraps = builder.zext(builder.icmp_signed("<", split, e.const(lanes)), e.i64)
    count = splat(npx)
    nil = splat(e.const(0))

    def inside(pixels):
        return builder.and_(builder.icmp_signed(">=", pixels, nil),
                            builder.icmp_signed("<", pixels, count))

    def step(q, acc, masked):
        if masked:
            pixel = builder.add(splat(q), ahead)
            live = inside(pixel)
            reads = [builder.and_(live, inside(builder.add(pixel, splat(e.const(m - 1)))))
                     for m in range(3)]

        def load(pointer, index, stride, mask):
            if not masked:
                return e.load(pointer, index, stride)
            return builder.call(masked_load, [e.at(pointer, index, stride),
                                              ir.Constant(ir.IntType(32), 1), mask, zero])

        new = list(acc)
        if not masked:      # the next call's new rows, a line a unit
            for v in range(units):
                for pointer in ahead_rows:
                    _emit_prefetch(builder, e.at(unit(pointer, v), q, ps), 2)
        for v in range(units):
            cols = [[load(unit(sources[r], v), builder.add(q, e.const(m - 1)), ps,
                          reads[m] if masked else None) for m in range(3)]
                    for r in range(rows + 2)]
            for j in range(rows):
                g = load(unit(grads[j], v), q, dps, live if masked else None)
                for i in range(3):
                    for m in range(3):
                        t = 9 * v + 3 * i + m
                        new[t] = e.madd(g, cols[j + i][m], new[t])
        if masked:      # lanes whose output pixel is outside the row keep their sums
            new = [builder.select(live, a, b) for a, b in zip(new, acc)]
        return new

    def walk(name, first, last, acc, masked):
        """acc after steps q = first .. last - 1 (none where first >= last)."""
        entry, loop, done = e.open_loop(name, builder.sub(last, first))
        q = builder.phi(e.i64)
        sums = [builder.phi(e.vec) for _ in acc]
        updated = step(q, sums, masked)
        q_next = builder.add(q, e.const(1))
        q.add_incoming(first, entry)
        q.add_incoming(q_next, builder.block)
        e.carry(sums, acc, updated, entry, builder.block)
        builder.cbranch(builder.icmp_signed("<", q_next, last), loop, done)
        tail = builder.block
        builder.position_at_end(done)
        return e.merged(acc, updated, entry, tail)

    acc = [e.load(unit(pacc, v), e.const(t), at) for v in range(units) for t in range(9)]
    one = e.const(1)
    # Pixels whose taps all lie in the row for every lane: q in [1, npx - 1 - wraps).
    inner = builder.sub(builder.sub(npx, one), wraps)
    head_end = _smin(builder, one, npx)
    tail_start = _smax(builder, one, inner)
    acc = walk("grad3r.head", builder.neg(wraps), head_end, acc, True)
    acc = walk("grad3r.body", one, inner, acc, False)
    acc = walk("grad3r.tail", tail_start, npx, acc, True)
    for v in range(units):
        for t in range(9):
            e.store(acc[9 * v + t], unit(pacc, v), e.const(t), at)


def _splat(builder, value, vector_type):
    """``value`` in every lane of ``vector_type``."""
    undef = ir.Constant(vector_type, ir.Undefined)
    first = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(first, undef,
                                  ir.Constant(ir.VectorType(ir.IntType(32), vector_type.count),
                                              [0] * vector_type.count))


def _smin(builder, a, b):
    return builder.select(builder.icmp_signed("<", a, b), a, b)


def _smax(builder, a, b):
    return builder.select(builder.icmp_signed(">", a, b), a, b)


def _rows_kernel(rows, units):
    """An intrinsic ``kernel(px, rs, ps, pdy, drs, dps, pacc, at, npx, split)``: the
    weight gradient of ``rows`` output rows, ``units`` vectors of channels
    (:func:`_emit_grad3_rows`)."""

    @intrinsic
    def kernel(typingctx, px, rs, ps, pdy, drs, dps, pacc, at, npx, split):
        if not (isinstance(px, types.CPointer) and px.dtype in (types.float32, types.float64)):
            return None
        dtype = np.dtype(str(px.dtype))

        def codegen(context, builder, signature, args):
            px, rs, ps, pdy, drs, dps, pacc, at, npx, split = args
            e = _Emitter(builder, dtype)
            _emit_grad3_rows(e, px, e.wide(rs), e.wide(ps), pdy, e.wide(drs), e.wide(dps),
                             pacc, e.wide(at), e.wide(npx), e.wide(split), rows, units)
            return context.get_dummy_value()

        return types.void(px, rs, ps, pdy, drs, dps, pacc, at, npx, split), codegen

    kernel.__doc__ = _emit_grad3_rows.__doc__
    return kernel


#: The forward-form row (see :func:`_emit_conv3`).
conv3_row = _row_kernel(_emit_conv3)
#: Forward-form rows of ``same`` padding, read and written where they lie, 1, 2, 4 or 8
#: vectors of channels a call (see :data:`SAME_ROW_BYTES`).
conv3_same1, conv3_same2, conv3_same4, conv3_same8 = (
    _row_kernel(functools.partial(_emit_conv3, units=units, same=True))
    for units in (1, 2, 4, 8))
#: The ``same`` row on one vector of 16, 8, 4, 2 and 1 lanes (any dtype): the channels-first
#: planes' column strips narrow down to the row's end (:func:`._direct_cf_plane._cf_same3`).
conv3_lanes16, conv3_lanes8, conv3_lanes4, conv3_lanes2, conv3_lanes1 = (
    _row_kernel(functools.partial(_emit_conv3, same=True), lanes)
    for lanes in (16, 8, 4, 2, 1))
#: The weight-gradient row (see :func:`_emit_grad3`).
grad3_row = _row_kernel(_emit_grad3)
#: The weight-gradient row of ``same`` padding, read where it lies (see
#: :func:`_emit_grad3_same`).
grad3_same = _row_kernel(_emit_grad3_same)
#: The ``same`` weight-gradient row on vectors of 8, 4, 2 and 1 lanes (any dtype): the
#: pieces of a row's channels before its first and after its last cache line
#: (:func:`channel_pieces`).
grad3_same8, grad3_same4, grad3_same2, grad3_same1 = (
    _row_kernel(_emit_grad3_same, lanes) for lanes in (8, 4, 2, 1))
#: The weight gradient of 4 output rows on 2 vectors of channels and on 1 (see
#: :func:`_emit_grad3_rows`).
grad3_rows4x2, grad3_rows4x1 = (_rows_kernel(4, units) for units in (2, 1))
#: The weight-gradient row on vectors of 16, 8, 4, 2 and 1 lanes (any dtype), whatever the
#: CPU's width: the channels-first planes' column strips narrow down to the row's end
#: (:func:`._direct_cf_plane._cf_same3_weight`).
grad3_lanes16, grad3_lanes8, grad3_lanes4, grad3_lanes2, grad3_lanes1 = (
    _row_kernel(_emit_grad3, lanes) for lanes in (16, 8, 4, 2, 1))
