"""Direct (loop) kernels for grouped convolutions with few channels per group: depthwise above
all, where a GEMM has one-column matrices and packing costs more than the arithmetic.

Every op runs in *forward form*: ``out[o] = sum_t w[t] * src[o * stride + t * dilation]`` over a
source that is zero-padded and, for the data gradient, zero-stuffed: the transposed convolution
is a stride-1 convolution of dy, spread ``stride`` apart, with the flipped kernel. Each job
copies the source rows it reads into a local zero-padded buffer, so that the arithmetic runs
without bounds checks:

- channels-last: a ring of padded rows (pixels x channels). The bodies vectorise over the
  contiguous channels and keep four output pixels in registers; a 3x3 window is one fused
  body (nine taps per store). Where the channels fill whole vectors, 3x3 rows of stride 1
  (every data gradient's, whose source is stuffed instead) run the row kernels of
  :mod:`._sliding` instead: one vector of channels walks the row with its nine weights in
  registers. The ring's pixel pitch is then an odd number of cache lines
  (:func:`._sliding.row_pitch`), so that a row walked that way does not sit in a few L1 sets.
  Depthwise 3x3 rows with one pixel of padding either side (``same``) and stride 1 along
  them, written (the forward, the data gradient unless accumulated), need no ring at all
  (:func:`_cl_same3`): the rows are read and written where they lie, four cache lines of
  channels a call, so that no line is needed again after it left L1 (1.3-2x faster than the
  ring on 256-1024 channels at 28x28-7x7, Zen 3).
- channels-first, stride 1 with rows as wide as the source's (``same`` padding): whole planes
  as flat runs over a guarded copy of the source plane; a column mask per tap column selects
  zero where a flat shift wraps around a row end. Depthwise 3x3 planes with one pixel of
  padding on every side, written, instead walk a vector of adjacent columns down a copy of
  the plane with zero columns around it, the sliding row turned on its side
  (:func:`_cf_same3`; 1.3-1.8x faster than the flat runs, Zen 3); their weight gradient
  likewise carries nine vector sums per strip of columns (:func:`_cf_same3_weight`).
- channels-first otherwise: a padded slab of rows, split by stride phase, so that every tap
  is one contiguous shift of a flat array.

A group with several channels (or outputs) is a sum of such passes: over source planes
(channels-first), or over channels gathered into the output-channel order (channels-last).
Zero padding is multiplied like the reference multiplies it, so NaN and infinity in x and dy
propagate exactly as there; non-finite weights take the packed (im2col) path, which is exact
for them too. The weight gradient keeps one partial per job, over a split fixed by the problem
shape (never the thread count), and adds the partials in order: the same inputs give bitwise
the same dw on every run.

Two LLVM habits shape the code. Indices into the vectorised dimension start at zero or are
unsigned (a signed offset brings Numba's negative-index wraparound into the address, and the
loop stays scalar). And a loop that reads and writes through many pointers makes LLVM check
them for overlap at run time, once per loop entry: the bodies write one array, read few, and
no body re-reads what it writes; shared arrays are indexed, never sliced, inside parallel
loops (a slice touches the array's reference count, one cache line for every thread).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import prange, uint64

from ..config import inline_jit, parallel_jit, serial_jit
from .._geometry import dgrad_as_conv
from .._kernel_geometry import int64_arrays
from . import _heuristics
from ._rows import zero_rows
from ._tiles import add_partials
from ._microkernel import _at
from ._sliding import (conv3_lanes1, conv3_lanes2, conv3_lanes4, conv3_lanes8,
                       conv3_lanes16, conv3_row, conv3_same1, conv3_same2, conv3_same4, conv3_same8,
                       grad3_lanes1, grad3_lanes2, grad3_lanes4, grad3_lanes8, grad3_lanes16,
                       grad3_row, lanes_for, row_lanes, row_pitch, same_units)

#: Row-level helpers of the channels-last kernels are called (``serial_jit``), not inlined:
#: inlined into _cl_conv's parallel loop they compile far slower and run no faster
#: (docs/cpu-algorithms.md, "Compile times").

#: Parallel jobs to aim for: spatial rows are split until a problem has this many (or runs
#: out of rows). Fixed, so the weight-gradient split never depends on the thread count.
MIN_JOBS = 16
#: Most buffer-sharing chunks of channels-first jobs (each chunk allocates its buffers once).
MAX_CHUNKS = 64


class _Form(NamedTuple):
    """A convolution in forward form over a padded, stuffed source, three spatial dims.

    Source element ``a`` sits at padded index ``before + a * stuff``; output ``o`` reads the
    padded indices ``o * stride + t * dilation`` for the taps ``t < kernel``.
    """

    out: tuple
    size: tuple
    stuff: tuple
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


def _row_split(rows: int, outer: int) -> int:
    """Output rows per job: split ``rows`` until ``outer * blocks`` reaches MIN_JOBS."""
    blocks = min(rows, max(1, -(-MIN_JOBS // max(outer, 1))))
    return -(-rows // blocks)


# --------------------------------------------------------------------------------------------
# Channels-last bodies: vectorised over channels k, four output pixels per call.
# buf[row, column, k] is a padded source row; columns of pixel q, tap m: col + q*st + m*dl.
# --------------------------------------------------------------------------------------------

@inline_jit
def _px3(buf, row, col, dl, k):
    """The three tap columns of one output pixel in a padded source row."""
    return buf[row, col, k], buf[row, col + dl, k], buf[row, col + 2 * dl, k]


# The bodies only write, and load everything before they store: LLVM then needs few
# run-time alias checks per call (a read-modify-write of four output pixels costs more in
# checks than the arithmetic, for a hundred channels) and reuses the loads of overlapping
# windows. Sums of several bodies go through a scratch row and a flat add.

@inline_jit
def _cl_taps9(out, orow, op, buf, ra, rb, rc, col, st, dl, wk, c, t, kk):
    """out[orow, op:op+4] = taps t..t+8: three source rows of three columns each."""
    c1 = col + st
    c2 = col + 2 * st
    c3 = col + 3 * st
    for k in range(kk):
        w0, w1, w2 = wk[c, t, k], wk[c, t + 1, k], wk[c, t + 2, k]
        w3, w4, w5 = wk[c, t + 3, k], wk[c, t + 4, k], wk[c, t + 5, k]
        w6, w7, w8 = wk[c, t + 6, k], wk[c, t + 7, k], wk[c, t + 8, k]
        a0, a1, a2 = _px3(buf, ra, col, dl, k)
        b0, b1, b2 = _px3(buf, rb, col, dl, k)
        d0, d1, d2 = _px3(buf, rc, col, dl, k)
        s0 = (w0 * a0 + w1 * a1 + w2 * a2 + w3 * b0 + w4 * b1 + w5 * b2
              + w6 * d0 + w7 * d1 + w8 * d2)
        a0, a1, a2 = _px3(buf, ra, c1, dl, k)
        b0, b1, b2 = _px3(buf, rb, c1, dl, k)
        d0, d1, d2 = _px3(buf, rc, c1, dl, k)
        s1 = (w0 * a0 + w1 * a1 + w2 * a2 + w3 * b0 + w4 * b1 + w5 * b2
              + w6 * d0 + w7 * d1 + w8 * d2)
        a0, a1, a2 = _px3(buf, ra, c2, dl, k)
        b0, b1, b2 = _px3(buf, rb, c2, dl, k)
        d0, d1, d2 = _px3(buf, rc, c2, dl, k)
        s2 = (w0 * a0 + w1 * a1 + w2 * a2 + w3 * b0 + w4 * b1 + w5 * b2
              + w6 * d0 + w7 * d1 + w8 * d2)
        a0, a1, a2 = _px3(buf, ra, c3, dl, k)
        b0, b1, b2 = _px3(buf, rb, c3, dl, k)
        d0, d1, d2 = _px3(buf, rc, c3, dl, k)
        s3 = (w0 * a0 + w1 * a1 + w2 * a2 + w3 * b0 + w4 * b1 + w5 * b2
              + w6 * d0 + w7 * d1 + w8 * d2)
        out[orow, op, k] = s0
        out[orow, op + 1, k] = s1
        out[orow, op + 2, k] = s2
        out[orow, op + 3, k] = s3


@inline_jit
def _cl_taps9_pair(out, orow, op, buf, ra, rb, rc, col, st, wk, c, t, kk):
    """out[orow, op:op+2] = taps t..t+8 (dilation 1). Stride 2 uses pairs throughout: the
    nine columns of four pixels would need more run-time alias checks than LLVM makes."""
    for k in range(kk):
        w0, w1, w2 = wk[c, t, k], wk[c, t + 1, k], wk[c, t + 2, k]
        w3, w4, w5 = wk[c, t + 3, k], wk[c, t + 4, k], wk[c, t + 5, k]
        w6, w7, w8 = wk[c, t + 6, k], wk[c, t + 7, k], wk[c, t + 8, k]
        a0, a1, a2 = _px3(buf, ra, col, 1, k)
        b0, b1, b2 = _px3(buf, rb, col, 1, k)
        d0, d1, d2 = _px3(buf, rc, col, 1, k)
        s0 = (w0 * a0 + w1 * a1 + w2 * a2 + w3 * b0 + w4 * b1 + w5 * b2
              + w6 * d0 + w7 * d1 + w8 * d2)
        a0, a1, a2 = _px3(buf, ra, col + st, 1, k)
        b0, b1, b2 = _px3(buf, rb, col + st, 1, k)
        d0, d1, d2 = _px3(buf, rc, col + st, 1, k)
        s1 = (w0 * a0 + w1 * a1 + w2 * a2 + w3 * b0 + w4 * b1 + w5 * b2
              + w6 * d0 + w7 * d1 + w8 * d2)
        out[orow, op, k] = s0
        out[orow, op + 1, k] = s1


@inline_jit
def _cl_taps9_one(out, orow, op, buf, ra, rb, rc, col, wk, c, t, kk):
    """out[orow, op] = taps t..t+8 (dilation 1): row tails."""
    for k in range(kk):
        a0, a1, a2 = _px3(buf, ra, col, 1, k)
        b0, b1, b2 = _px3(buf, rb, col, 1, k)
        d0, d1, d2 = _px3(buf, rc, col, 1, k)
        out[orow, op, k] = (wk[c, t, k] * a0 + wk[c, t + 1, k] * a1 + wk[c, t + 2, k] * a2
                            + wk[c, t + 3, k] * b0 + wk[c, t + 4, k] * b1
                            + wk[c, t + 5, k] * b2 + wk[c, t + 6, k] * d0
                            + wk[c, t + 7, k] * d1 + wk[c, t + 8, k] * d2)


@serial_jit
def _cl_row9(out, orow, buf, ra, rb, rc, step, wk, c, t, kk, npx, vec, slide):
    """out[orow, :npx] = taps t..t+8 over one output row: stride 1 with ``vec`` (nonzero:
    the channels in whole vectors of that many) one vector of channels at a time along the
    row (:func:`._sliding.conv3_row`), otherwise in blocks of 4, 2 and 1 pixels.

    The sliding kernel writes ``slide`` (a row of the buffer's pitch), copied into out as
    whole pixels: written one vector at a time straight into out, whose pitch is often a
    multiple of 256 bytes, the row's lines left L1 before their other half came.
    """
    if step == 1 and vec:
        width, pitch = buf.shape[1], buf.shape[2]
        taps, pixels, channels = wk.shape[1], out.shape[1], out.shape[2]
        wbase = (c * taps + t) * kk
        obase = orow * pixels * channels
        for k0 in range(0, kk, vec):
            conv3_row(_at(buf, ra * width * pitch + k0), _at(buf, rb * width * pitch + k0),
                      _at(buf, rc * width * pitch + k0), pitch, _at(wk, wbase + k0), kk,
                      _at(slide, k0), pitch, npx)
        for p in range(npx):
            for k in range(kk):
                out[orow, p, k] = slide[p, k]
        return
    # Loop bounds stay plain (npx - 3, not npx // 4 * 4): with a division in the trip count,
    # LLVM re-runs the bodies' alias checks on every call and the row costs seven times more.
    if step == 1:
        for q in range(0, npx - 3, 4):
            _cl_taps9(out, orow, q, buf, ra, rb, rc, q, 1, 1, wk, c, t, kk)
        p2 = npx - npx % 4
        if p2 + 2 <= npx:
            _cl_taps9_pair(out, orow, p2, buf, ra, rb, rc, p2, 1, wk, c, t, kk)
            p2 += 2
    else:
        for q in range(0, npx - 1, 2):
            _cl_taps9_pair(out, orow, q, buf, ra, rb, rc, 2 * q, 2, wk, c, t, kk)
        p2 = npx - npx % 2
    if p2 < npx:
        _cl_taps9_one(out, orow, p2, buf, ra, rb, rc, p2 * step, wk, c, t, kk)


@inline_jit
def _cl_taps3(out, orow, op, buf, row, col, st, dl, wk, c, t, kk):
    """out[orow, op:op+4] = taps t..t+2: one source row, three columns."""
    c1 = col + st
    c2 = col + 2 * st
    c3 = col + 3 * st
    for k in range(kk):
        w0, w1, w2 = wk[c, t, k], wk[c, t + 1, k], wk[c, t + 2, k]
        a0, a1, a2 = _px3(buf, row, col, dl, k)
        s0 = w0 * a0 + w1 * a1 + w2 * a2
        a0, a1, a2 = _px3(buf, row, c1, dl, k)
        s1 = w0 * a0 + w1 * a1 + w2 * a2
        a0, a1, a2 = _px3(buf, row, c2, dl, k)
        s2 = w0 * a0 + w1 * a1 + w2 * a2
        a0, a1, a2 = _px3(buf, row, c3, dl, k)
        s3 = w0 * a0 + w1 * a1 + w2 * a2
        out[orow, op, k] = s0
        out[orow, op + 1, k] = s1
        out[orow, op + 2, k] = s2
        out[orow, op + 3, k] = s3


@inline_jit
def _cl_taps1(out, orow, op, buf, row, col, st, wk, c, t, kk):
    """out[orow, op:op+4] = tap t."""
    for k in range(kk):
        w0 = wk[c, t, k]
        s0 = w0 * buf[row, col, k]
        s1 = w0 * buf[row, col + st, k]
        s2 = w0 * buf[row, col + 2 * st, k]
        s3 = w0 * buf[row, col + 3 * st, k]
        out[orow, op, k] = s0
        out[orow, op + 1, k] = s1
        out[orow, op + 2, k] = s2
        out[orow, op + 3, k] = s3


@inline_jit
def _cl_grad3(acc, t, dy3, drow, dp, buf, row, col, st, dl, kk):
    """acc[t..t+2] += dy at pixels dp..dp+3 times one source row at three tap columns.

    Three accumulator rows per loop: more would exceed what LLVM checks for aliasing at
    run time, and the loop would stay scalar.
    """
    c1 = col + st
    c2 = col + 2 * st
    c3 = col + 3 * st
    for k in range(kk):
        g0, g1 = dy3[drow, dp, k], dy3[drow, dp + 1, k]
        g2, g3 = dy3[drow, dp + 2, k], dy3[drow, dp + 3, k]
        a0, a1, a2 = _px3(buf, row, col, dl, k)
        b0, b1, b2 = _px3(buf, row, c1, dl, k)
        d0, d1, d2 = _px3(buf, row, c2, dl, k)
        e0, e1, e2 = _px3(buf, row, c3, dl, k)
        s0 = acc[t, k] + g0 * a0 + g1 * b0 + g2 * d0 + g3 * e0
        s1 = acc[t + 1, k] + g0 * a1 + g1 * b1 + g2 * d1 + g3 * e1
        s2 = acc[t + 2, k] + g0 * a2 + g1 * b2 + g2 * d2 + g3 * e2
        acc[t, k] = s0
        acc[t + 1, k] = s1
        acc[t + 2, k] = s2


@inline_jit
def _cl_grad3_pair(acc, t, dy3, drow, dp, buf, row, col, st, kk):
    """acc[t..t+2] += dy at pixels dp, dp+1 times three tap columns (dilation 1): tails."""
    for k in range(kk):
        g0, g1 = dy3[drow, dp, k], dy3[drow, dp + 1, k]
        a0, a1, a2 = _px3(buf, row, col, 1, k)
        b0, b1, b2 = _px3(buf, row, col + st, 1, k)
        s0 = acc[t, k] + g0 * a0 + g1 * b0
        s1 = acc[t + 1, k] + g0 * a1 + g1 * b1
        s2 = acc[t + 2, k] + g0 * a2 + g1 * b2
        acc[t, k] = s0
        acc[t + 1, k] = s1
        acc[t + 2, k] = s2


@inline_jit
def _cl_grad1(acc, t, dy3, drow, dp, buf, row, col, st, kk):
    """acc[t] += dy at pixels dp..dp+3 times one tap column."""
    for k in range(kk):
        acc[t, k] += (dy3[drow, dp, k] * buf[row, col, k]
                      + dy3[drow, dp + 1, k] * buf[row, col + st, k]
                      + dy3[drow, dp + 2, k] * buf[row, col + 2 * st, k]
                      + dy3[drow, dp + 3, k] * buf[row, col + 3 * st, k])


@inline_jit
def _cl_grad_pixel(acc, t, taps, dy3, drow, dp, buf, row, col, dl, kk):
    """acc[t..t+taps] += dy at one pixel times taps consecutive columns (row tails)."""
    for m in range(taps):
        c = col + m * dl
        for k in range(kk):
            acc[t + m, k] += dy3[drow, dp, k] * buf[row, c, k]


@inline_jit
def _cl_fill(buf, slot, src, n, a0, a1, before, stuff, size, width, cmap, c, identity, kk):
    """buf[slot] <- source row (n, a0, a1), its pixels at columns before + a*stuff.

    The other columns of a slot are never written, so they keep the zeros of allocation.
    """
    for a2 in range(size):
        col = before + a2 * stuff
        if col >= width:
            break
        if col >= 0:
            if identity:
                for k in range(kk):
                    buf[slot, col, k] = src[n, a0, a1, a2, k]
            else:
                for k in range(kk):
                    buf[slot, col, k] = src[n, a0, a1, a2, cmap[c, k]]


@serial_jit
def _cl_rows(rowslot, tag, buf, src, n, o0, p1, out, size, stuff, before, stride, dil, r,
             span, width, cmap, c, identity, kk):
    """Make sure the source rows of output row (o0, p1) are in the ring; rowslot[t0, t1] is
    the slot of each (the last slot is all zeros: padding, stuffing)."""
    zero = tag.shape[0]
    for t0 in range(r[0]):
        num0 = o0 * stride[0] + t0 * dil[0] - before[0]
        a0 = num0 // stuff[0]
        plane = num0 >= 0 and num0 - a0 * stuff[0] == 0 and a0 < size[0]
        for t1 in range(r[1]):
            j1 = p1 * stride[1] + t1 * dil[1]
            num1 = j1 - before[1]
            a1 = num1 // stuff[1]
            if plane and num1 >= 0 and num1 - a1 * stuff[1] == 0 and a1 < size[1]:
                slot = t0 * span + j1 % span
                if tag[slot] != j1:
                    _cl_fill(buf, slot, src, n, a0, a1, before[2], stuff[2], size[2], width,
                             cmap, c, identity, kk)
                    tag[slot] = j1
                rowslot[t0, t1] = slot
            else:
                rowslot[t0, t1] = zero


@parallel_jit
def _cl_conv(src, wk, dst3, dst2, cmap, identity, transposed, cg, kg, out, size, stuff, before,
             stride, dil, r, rows, overwrite, pitch, vec):
    """Channels-last forward-form convolution, K channels wide.

    src (N, A0, A1, A2, Cs); wk (passes, taps, K): the weights of each pass, K-space;
    dst3 (N * O0 * O1, O2, Cd), and dst2 the same array as (N * O0 * O1, O2 * Cd). Forward
    (``transposed`` False): y channel k gathers source channel cmap[pass, k]; passes add up.
    Data gradient: the source is dy (K channels) and pass c adds, for every group, the sum
    over its kg outputs into dx channel g*cg + c; ``overwrite`` (depthwise, one fused 3x3
    body per row) writes dx instead, like the forward. Source rows are copied into buffers
    ``pitch`` (>= K) elements a pixel; ``vec`` nonzero (K in whole vectors of that many)
    runs fused 3x3 rows of stride 1 as :func:`._sliding.conv3_row`.
    """
    n_total = src.shape[0]
    passes, kk = wk.shape[0], wk.shape[2]
    o0n, o1n, o2n = out[0], out[1], out[2]
    blocks = (o1n + rows - 1) // rows
    p2r = (o2n + 3) // 4 * 4
    width = (p2r - 1) * stride[2] + (r[2] - 1) * dil[2] + 1
    span = (r[1] - 1) * dil[1] + 1
    slots = r[0] * span
    # Three-tap bodies only with a compile-time step (their loads must fold together, or LLVM
    # gives up on the many run-time alias checks and runs them scalar): stride 1 or 2,
    # dilation 1. Anything else goes tap by tap.
    step = stride[2] if dil[2] == 1 and stride[2] <= 2 else 0
    fused = r[1] == 3 and r[2] == 3 and step != 0
    plain = cg == 1 and kg == 1
    # Output rows go straight into y (or an overwritten dx) when one fused 3x3 body makes
    # them (exactly O2 pixels wide); otherwise the data gradient adds a finished row into dx.
    direct = fused and r[0] == 1 and passes == 1 and (overwrite or not transposed)
    groups = kk // kg
    if pitch < kk or width < o2n + 2:
        vec = 0        # the row kernel's reach (o2n + 2 pixels of vec channels) is not there
    for job in prange(n_total * o0n * blocks):
        blk = job % blocks
        rest = job // blocks
        o0 = rest % o0n
        n = rest // o0n
        buf = np.zeros((slots + 1, width, pitch), dst3.dtype)
        tag = np.empty(slots, np.int64)
        rowslot = np.empty((r[0], r[1]), np.int64)
        rowbuf = np.empty((1, p2r, kk), dst3.dtype)
        part = np.empty((1, p2r, kk), dst3.dtype)
        slide = np.empty((p2r, pitch), dst3.dtype)
        rflat = rowbuf.reshape(1, p2r * kk)
        pflat = part.reshape(1, p2r * kk)
        for c in range(passes):
            tag[:] = -1
            for p1 in range(blk * rows, min(blk * rows + rows, o1n)):
                _cl_rows(rowslot, tag, buf, src, n, o0, p1, out, size, stuff, before, stride,
                         dil, r, span, width, cmap, c, identity, kk)
                drow = (n * o0n + o0) * o1n + p1
                # The first body writes the row (into y itself when nothing is left to do
                # with it); every further body writes a scratch row that is added on.
                if direct:
                    target = dst3
                    trow = drow
                else:
                    target = rowbuf
                    trow = 0
                count = 0
                for t0 in range(r[0]):
                    ra, rb, rc = rowslot[t0, 0], rowslot[t0, r[1] // 2], rowslot[t0, r[1] - 1]
                    # Zero rows are skipped tap row by tap row below, except when writing
                    # straight into y: the fused body covers the row exactly.
                    if fused and (direct or (ra != slots and rb != slots and rc != slots)):
                        out3 = target if count == 0 else part
                        orow = trow if count == 0 else 0
                        t = t0 * 9
                        _cl_row9(out3, orow, buf, ra, rb, rc, step, wk, c, t, kk, o2n, vec, slide)
                        if count > 0:
                            for e in range(o2n * kk):
                                rflat[0, e] += pflat[0, e]
                        count += 1
                        continue
                    for t1 in range(r[1]):
                        row = rowslot[t0, t1]
                        if row == slots:
                            continue  # all zeros: the weights are finite
                        t2 = 0
                        while t2 < r[2]:
                            t = (t0 * r[1] + t1) * r[2] + t2
                            out3 = target if count == 0 else part
                            orow = trow if count == 0 else 0
                            if r[2] - t2 >= 3 and step != 0:
                                for p2 in range(0, p2r, 4):
                                    col = p2 * step + t2
                                    if step == 1:
                                        _cl_taps3(out3, orow, p2, buf, row, col, 1, 1, wk, c, t,
                                                  kk)
                                    else:
                                        _cl_taps3(out3, orow, p2, buf, row, col, 2, 1, wk, c, t,
                                                  kk)
                                t2 += 3
                            else:
                                for p2 in range(0, p2r, 4):
                                    _cl_taps1(out3, orow, p2, buf, row,
                                              p2 * stride[2] + t2 * dil[2], stride[2], wk, c, t,
                                              kk)
                                t2 += 1
                            if count > 0:
                                for e in range(p2r * kk):
                                    rflat[0, e] += pflat[0, e]
                            count += 1
                if count == 0:
                    # No source row at all: the output row is zero (or adds nothing).
                    if transposed:
                        continue
                    for e in range(p2r * kk):
                        rflat[0, e] = 0
                if direct:
                    continue
                # Whole rows as flat runs (pixels x channels are contiguous in both).
                width_out = o2n * kk
                if not transposed:
                    if c == 0:
                        for e in range(width_out):
                            dst2[drow, e] = rflat[0, e]
                    else:
                        for e in range(width_out):
                            dst2[drow, e] += rflat[0, e]
                elif plain:
                    for e in range(width_out):
                        dst2[drow, e] += rflat[0, e]
                else:
                    for p2 in range(o2n):
                        for grp in range(groups):
                            total = rowbuf[0, p2, grp * kg]
                            for kq in range(1, kg):
                                total += rowbuf[0, p2, grp * kg + kq]
                            dst3[drow, p2, grp * cg + c] += total


@parallel_jit
def _cl_same3(src, wk, dst3, zero, out, before, stride, dil, lanes, units):
    """Depthwise 3x3 rows of ``same`` padding and stride 1 along them, channels-last, read
    from src and written into dst3 where they lie (no row buffers): one output row a job,
    each call of the :mod:`._sliding` ``same`` rows ``units`` vectors of ``lanes`` channels
    (fewer for the last channels).

    src (N, A0, A1, A2, K) C-contiguous; wk (1, 9, K); dst3 (N * O0 * O1, O2, K)
    C-contiguous, O2 == A2, written; zero: A2 * K zeros, the rows above and below the
    source. The callers check the geometry (:func:`_same_rows`).
    """
    n_total, a0n, a1n, a2n, kk = src.shape
    o0n, o1n = out[0], out[1]
    for job in prange(n_total * o0n * o1n):
        p1 = job % o1n
        rest = job // o1n
        o0 = rest % o0n
        n = rest // o0n
        plane = (n * a0n + o0) * a1n
        base = job * a2n * kk
        a = p1 * stride[1] - before[1]
        ra = (plane + a) * a2n * kk if 0 <= a < a1n else -1
        rb = (plane + a + dil[1]) * a2n * kk if 0 <= a + dil[1] < a1n else -1
        rc = (plane + a + 2 * dil[1]) * a2n * kk if 0 <= a + 2 * dil[1] < a1n else -1
        k0 = 0
        while k0 < kk:
            pa = _at(src, ra + k0) if ra >= 0 else _at(zero, k0)
            pb = _at(src, rb + k0) if rb >= 0 else _at(zero, k0)
            pc = _at(src, rc + k0) if rc >= 0 else _at(zero, k0)
            pw, pd = _at(wk, k0), _at(dst3, base + k0)
            left = kk - k0
            if units >= 8 and left >= 8 * lanes:
                conv3_same8(pa, pb, pc, kk, pw, kk, pd, kk, a2n)
                k0 += 8 * lanes
            elif units >= 4 and left >= 4 * lanes:
                conv3_same4(pa, pb, pc, kk, pw, kk, pd, kk, a2n)
                k0 += 4 * lanes
            elif units >= 2 and left >= 2 * lanes:
                conv3_same2(pa, pb, pc, kk, pw, kk, pd, kk, a2n)
                k0 += 2 * lanes
            else:
                conv3_same1(pa, pb, pc, kk, pw, kk, pd, kk, a2n)
                k0 += lanes


@parallel_jit
def _cf_same3(src4, wb, dst4, height, width, chunks, lanes):
    """Depthwise 3x3 planes of ``same`` padding and stride 1, channels-first: strips of
    adjacent columns walk down the plane as one vector (the ``same`` row of
    :mod:`._sliding`, rows and columns swapped: its three source "rows" are the plane
    shifted by 0, 1 and 2 columns, its pixels the plane's rows), over a copy of the plane
    with a zero column either side: ``lanes`` columns at a time, then 2 ** k fewer up to
    the row's end. Against whole vectors through a scratch plane (Zen 3, 2 cores, N = 8,
    float32 data gradients, best of 90, two runs): 512 channels at 14x14 1.15x, 256 at
    28x28 1.22-1.27x, 1024 at 7x7 0.94x, 128 at 56x56 (whole vectors either way) 0.98x.

    src4 and dst4 (N, C, P, height * width) (P: the planes of a 3D problem's depth, one tap
    plane), C-contiguous, dst4 written; wb (C, 9, lanes): each channel's weights with the
    window transposed (tap column major), each broadcast to a vector. The planes are dealt
    to ``chunks`` jobs, each allocating its buffer once. The callers check the geometry
    (:func:`_same_planes`).
    """
    n_total, c_total, depth = src4.shape[0], src4.shape[1], src4.shape[2]
    planes = n_total * c_total * depth
    pitch = width + 2
    per_chunk = (planes + chunks - 1) // chunks
    for chunk in prange(chunks):
        buf = np.zeros((height, pitch), dst4.dtype)
        for plane in range(chunk * per_chunk, min(planes, chunk * per_chunk + per_chunk)):
            a0 = plane % depth
            rest = plane // depth
            c = rest % c_total
            n = rest // c_total
            _bordered_plane(buf, 0, src4, n, c, a0, height, width)
            base = plane * height * width
            q = 0
            while q < width:
                strip = _strip(width - q, lanes)
                pa, pb, pc = _at(buf, q), _at(buf, q + 1), _at(buf, q + 2)
                pw, pd = _at(wb, c * 9 * lanes), _at(dst4, base + q)
                if strip == 16:
                    conv3_lanes16(pa, pb, pc, pitch, pw, lanes, pd, width, height)
                elif strip == 8:
                    conv3_lanes8(pa, pb, pc, pitch, pw, lanes, pd, width, height)
                elif strip == 4:
                    conv3_lanes4(pa, pb, pc, pitch, pw, lanes, pd, width, height)
                elif strip == 2:
                    conv3_lanes2(pa, pb, pc, pitch, pw, lanes, pd, width, height)
                else:
                    conv3_lanes1(pa, pb, pc, pitch, pw, lanes, pd, width, height)
                q += strip


@inline_jit
def _bordered_plane(buf, top, src4, n, c, a0, height, width):
    """buf[top + h, 1 + q] = plane (n, c, a0) of src4 (N, C, P, height * width); the
    border columns (and rows) of buf are never written."""
    for h in range(height):
        for q in range(width):
            buf[top + h, q + 1] = src4[n, c, a0, h * width + q]


@inline_jit
def _strip(left, lanes):
    """Columns of the next strip: ``lanes``, or the largest power of two <= ``left``."""
    strip = lanes
    while strip > left:
        strip //= 2
    return strip


@parallel_jit
def _cf_same3_weight(x4, dy4, dw, height, width, chunks, lanes):
    """dw[c, t]: the weight gradient of a depthwise 3x3 layer of ``same`` padding and stride
    1, channels-first, the taps in w's order: strips of adjacent columns walk down each
    plane (:func:`._sliding.grad3_row` turned on its side, as in :func:`_cf_same3`),
    ``lanes`` columns at a time, then 2 ** k fewer up to the row's end, each column's nine
    tap sums carried in a vector through all planes of a channel (images, then depth),
    then summed across the lanes: a fixed order, whatever the thread count.

    x4 and dy4 (N, C, P, height * width), C-contiguous; dw (C, 9). Padding is multiplied
    (zeros around a copy of each plane), as the reference multiplies it.
    """
    n_total, c_total, depth = x4.shape[0], x4.shape[1], x4.shape[2]
    pitch = width + 2
    per_chunk = (c_total + chunks - 1) // chunks
    for chunk in prange(chunks):
        buf = np.zeros((height + 2, pitch), dw.dtype)
        acc = np.empty((9, lanes), dw.dtype)
        for c in range(chunk * per_chunk, min(c_total, chunk * per_chunk + per_chunk)):
            acc[:] = 0
            for n in range(n_total):
                for a0 in range(depth):
                    _bordered_plane(buf, 1, x4, n, c, a0, height, width)
                    base = ((n * c_total + c) * depth + a0) * height * width
                    _cf_strips(buf, pitch, dy4, base, acc, height, width, lanes)
            # acc[3i + m]: column tap i, row tap m (the kernel's rows are column shifts).
            for t in range(9):
                total = acc[t, 0]
                for lane in range(1, lanes):
                    total += acc[t, lane]
                dw[c, (t % 3) * 3 + t // 3] = total


@inline_jit
def _cf_strips(buf, pitch, dy4, base, acc, height, width, lanes):
    """acc += one plane's column strips (see :func:`_cf_same3_weight`)."""
    q = 0
    while q < width:
        strip = _strip(width - q, lanes)
        pa, pb, pc = _at(buf, q), _at(buf, q + 1), _at(buf, q + 2)
        pdy, pacc = _at(dy4, base + q), _at(acc, 0)
        if strip == 16:
            grad3_lanes16(pa, pb, pc, pitch, pdy, width, pacc, lanes, height)
        elif strip == 8:
            grad3_lanes8(pa, pb, pc, pitch, pdy, width, pacc, lanes, height)
        elif strip == 4:
            grad3_lanes4(pa, pb, pc, pitch, pdy, width, pacc, lanes, height)
        elif strip == 2:
            grad3_lanes2(pa, pb, pc, pitch, pdy, width, pacc, lanes, height)
        else:
            grad3_lanes1(pa, pb, pc, pitch, pdy, width, pacc, lanes, height)
        q += strip


@parallel_jit
def _cl_weight_partials(src, dy3, partial, cmap, identity, out, size, before, stride, dil, r,
                        rows, pitch, vec):
    """partial[job, c, t, k]: the weight gradient of one job's output rows, channels-last.

    src is x (N, S0, S1, S2, C); dy3 is dy as (N * P0 * P1, P2, K); pass c gathers x channel
    cmap[c, k] for output channel k. Padding rows are read as zeros and multiplied, as the
    reference does, so a non-finite dy next to the border poisons dw exactly like there.
    Source rows are copied into buffers ``pitch`` (>= K) elements a pixel; ``vec`` nonzero
    (K in whole vectors of that many) runs 3x3 tap rows of stride 1 as
    :func:`._sliding.grad3_row`.
    """
    n_total = src.shape[0]
    kk = partial.shape[3]
    passes = partial.shape[1]
    o0n, o1n, o2n = out[0], out[1], out[2]
    blocks = (o1n + rows - 1) // rows
    width = (o2n - 1) * stride[2] + (r[2] - 1) * dil[2] + 1
    span = (r[1] - 1) * dil[1] + 1
    slots = r[0] * span
    step = stride[2] if dil[2] == 1 and stride[2] <= 2 else 0    # as in _cl_conv
    body = o2n - o2n % 4
    ones = np.ones(3, np.int64)
    sliding = vec != 0 and step == 1 and r[1] == 3 and r[2] == 3 and pitch >= kk and \
        width >= o2n + 2 and dy3.shape[1] >= o2n and dy3.shape[2] == kk
    for job in prange(n_total * o0n * blocks):
        blk = job % blocks
        rest = job // blocks
        o0 = rest % o0n
        n = rest // o0n
        buf = np.zeros((slots + 1, width, pitch), partial.dtype)
        tag = np.empty(slots, np.int64)
        rowslot = np.empty((r[0], r[1]), np.int64)
        acc = np.empty((partial.shape[2], kk), partial.dtype)
        for c in range(passes):
            acc[:] = 0
            tag[:] = -1
            for p1 in range(blk * rows, min(blk * rows + rows, o1n)):
                _cl_rows(rowslot, tag, buf, src, n, o0, p1, out, size, ones, before, stride,
                         dil, r, span, width, cmap, c, identity, kk)
                drow = (n * o0n + o0) * o1n + p1
                for t0 in range(r[0]):
                    if sliding:
                        ra, rb, rc = rowslot[t0, 0], rowslot[t0, 1], rowslot[t0, 2]
                        for k0 in range(0, kk, vec):
                            grad3_row(_at(buf, ra * width * pitch + k0),
                                      _at(buf, rb * width * pitch + k0),
                                      _at(buf, rc * width * pitch + k0), pitch,
                                      _at(dy3, drow * dy3.shape[1] * kk + k0), kk,
                                      _at(acc, t0 * 9 * kk + k0), kk, o2n)
                        continue
                    for t1 in range(r[1]):
                        row = rowslot[t0, t1]
                        t2 = 0
                        while t2 < r[2]:
                            t = (t0 * r[1] + t1) * r[2] + t2
                            m = 3 if r[2] - t2 >= 3 and step != 0 else 1
                            for p2 in range(0, o2n - 3, 4):        # plain bound: see _cl_row9
                                col = p2 * stride[2] + t2 * dil[2]
                                if m == 1:
                                    _cl_grad1(acc, t, dy3, drow, p2, buf, row, col, stride[2],
                                              kk)
                                elif step == 1:
                                    _cl_grad3(acc, t, dy3, drow, p2, buf, row, col, 1, 1, kk)
                                else:
                                    _cl_grad3(acc, t, dy3, drow, p2, buf, row, col, 2, 1, kk)
                            p2 = body
                            if m == 3 and p2 + 2 <= o2n:
                                col = p2 * stride[2] + t2
                                if step == 1:
                                    _cl_grad3_pair(acc, t, dy3, drow, p2, buf, row, col, 1, kk)
                                else:
                                    _cl_grad3_pair(acc, t, dy3, drow, p2, buf, row, col, 2, kk)
                                p2 += 2
                            for p in range(p2, o2n):
                                _cl_grad_pixel(acc, t, m, dy3, drow, p, buf, row,
                                               p * stride[2] + t2 * dil[2], dil[2], kk)
                            t2 += m
            for t in range(acc.shape[0]):
                for k in range(kk):
                    partial[job, c, t, k] = acc[t, k]


# --------------------------------------------------------------------------------------------
# Channels-first bodies: flat shifts of a padded, phase-split slab of rows.
# buf[phase, flat]; tap i reads buf[plane[i], offset[i] + q] for output position q.
# --------------------------------------------------------------------------------------------

@inline_jit
def _cf_axpy9(out, q, buf, plane, offset, weight, i, write):
    """out[:q] (=|+=) the taps i..i+8: weight times a shifted run of one phase of buf."""
    p0, p1, p2 = plane[i], plane[i + 1], plane[i + 2]
    p3, p4, p5 = plane[i + 3], plane[i + 4], plane[i + 5]
    p6, p7, p8 = plane[i + 6], plane[i + 7], plane[i + 8]
    # Unsigned offsets: no negative-index wraparound, so the loads stay affine (vectorised).
    f0, f1, f2 = uint64(offset[i]), uint64(offset[i + 1]), uint64(offset[i + 2])
    f3, f4, f5 = uint64(offset[i + 3]), uint64(offset[i + 4]), uint64(offset[i + 5])
    f6, f7, f8 = uint64(offset[i + 6]), uint64(offset[i + 7]), uint64(offset[i + 8])
    w0, w1, w2 = weight[i], weight[i + 1], weight[i + 2]
    w3, w4, w5 = weight[i + 3], weight[i + 4], weight[i + 5]
    w6, w7, w8 = weight[i + 6], weight[i + 7], weight[i + 8]
    if write:
        for m in range(uint64(q)):
            out[m] = (w0 * buf[p0, f0 + m] + w1 * buf[p1, f1 + m] + w2 * buf[p2, f2 + m]
                      + w3 * buf[p3, f3 + m] + w4 * buf[p4, f4 + m] + w5 * buf[p5, f5 + m]
                      + w6 * buf[p6, f6 + m] + w7 * buf[p7, f7 + m] + w8 * buf[p8, f8 + m])
    else:
        for m in range(uint64(q)):
            out[m] += (w0 * buf[p0, f0 + m] + w1 * buf[p1, f1 + m] + w2 * buf[p2, f2 + m]
                       + w3 * buf[p3, f3 + m] + w4 * buf[p4, f4 + m] + w5 * buf[p5, f5 + m]
                       + w6 * buf[p6, f6 + m] + w7 * buf[p7, f7 + m] + w8 * buf[p8, f8 + m])


@inline_jit
def _cf_axpy3(out, q, buf, plane, offset, weight, i, write):
    p0, p1, p2 = plane[i], plane[i + 1], plane[i + 2]
    f0, f1, f2 = uint64(offset[i]), uint64(offset[i + 1]), uint64(offset[i + 2])
    w0, w1, w2 = weight[i], weight[i + 1], weight[i + 2]
    if write:
        for m in range(uint64(q)):
            out[m] = w0 * buf[p0, f0 + m] + w1 * buf[p1, f1 + m] + w2 * buf[p2, f2 + m]
    else:
        for m in range(uint64(q)):
            out[m] += w0 * buf[p0, f0 + m] + w1 * buf[p1, f1 + m] + w2 * buf[p2, f2 + m]


@inline_jit
def _cf_axpy1(out, q, buf, plane, offset, weight, i, write):
    p0, f0, w0 = plane[i], uint64(offset[i]), weight[i]
    if write:
        for m in range(uint64(q)):
            out[m] = w0 * buf[p0, f0 + m]
    else:
        for m in range(uint64(q)):
            out[m] += w0 * buf[p0, f0 + m]


@inline_jit
def _cf_dot9(acc, t, q, dyb, buf, plane, offset, i):
    """acc[t..t+8] += dot(dyb[:q], the shifted runs of taps i..i+8)."""
    p0, p1, p2 = plane[i], plane[i + 1], plane[i + 2]
    p3, p4, p5 = plane[i + 3], plane[i + 4], plane[i + 5]
    p6, p7, p8 = plane[i + 6], plane[i + 7], plane[i + 8]
    f0, f1, f2 = uint64(offset[i]), uint64(offset[i + 1]), uint64(offset[i + 2])
    f3, f4, f5 = uint64(offset[i + 3]), uint64(offset[i + 4]), uint64(offset[i + 5])
    f6, f7, f8 = uint64(offset[i + 6]), uint64(offset[i + 7]), uint64(offset[i + 8])
    s0, s1, s2 = acc[t], acc[t + 1], acc[t + 2]
    s3, s4, s5 = acc[t + 3], acc[t + 4], acc[t + 5]
    s6, s7, s8 = acc[t + 6], acc[t + 7], acc[t + 8]
    for m in range(uint64(q)):
        d = dyb[m]
        s0 += d * buf[p0, f0 + m]
        s1 += d * buf[p1, f1 + m]
        s2 += d * buf[p2, f2 + m]
        s3 += d * buf[p3, f3 + m]
        s4 += d * buf[p4, f4 + m]
        s5 += d * buf[p5, f5 + m]
        s6 += d * buf[p6, f6 + m]
        s7 += d * buf[p7, f7 + m]
        s8 += d * buf[p8, f8 + m]
    acc[t], acc[t + 1], acc[t + 2] = s0, s1, s2
    acc[t + 3], acc[t + 4], acc[t + 5] = s3, s4, s5
    acc[t + 6], acc[t + 7], acc[t + 8] = s6, s7, s8


@inline_jit
def _cf_dot3(acc, t, q, dyb, buf, plane, offset, i):
    p0, p1, p2 = plane[i], plane[i + 1], plane[i + 2]
    f0, f1, f2 = uint64(offset[i]), uint64(offset[i + 1]), uint64(offset[i + 2])
    s0, s1, s2 = acc[t], acc[t + 1], acc[t + 2]
    for m in range(uint64(q)):
        d = dyb[m]
        s0 += d * buf[p0, f0 + m]
        s1 += d * buf[p1, f1 + m]
        s2 += d * buf[p2, f2 + m]
    acc[t], acc[t + 1], acc[t + 2] = s0, s1, s2


@inline_jit
def _cf_dot1(acc, t, q, dyb, buf, plane, offset, i):
    p0, f0 = plane[i], uint64(offset[i])
    s0 = acc[t]
    for m in range(uint64(q)):
        s0 += dyb[m] * buf[p0, f0 + m]
    acc[t] = s0


@inline_jit
def _cf_fill(buf, src, n, ch, a0, row0, nrows, size, stuff, before, s1, s2, zero):
    """Padded rows row0 .. row0+nrows of source plane (n, ch, a0) into buf, phase-split.

    buf is (s1 * s2, M1, M2), zeroed when allocated: padded row row0 + i goes to row phase
    i % s1, block row i // s1; padded column j to column phase j % s2, position j // s2. Data
    always lands on the same positions, so padding and stuffing columns stay zero and only
    rows of padding are cleared. Returns 0, or NaN when a copied value is not finite (the
    weight gradient then keeps the pitch's spare columns out). The test is a sum of v * 0:
    fast-math reassociation folds v - v to zero even for NaN, but not v * 0.
    """
    check = zero
    m2 = buf.shape[2]
    b1, u1, n1 = before[1], stuff[1], size[1]
    b2, u2, n2 = before[2], stuff[2], size[2]
    for ph1 in range(s1):
        for mr in range((nrows - ph1 + s1 - 1) // s1):
            num1 = row0 + mr * s1 + ph1 - b1
            a1 = num1
            if u1 != 1:
                a1 = num1 // u1
            if num1 < 0 or num1 - a1 * u1 != 0 or a1 >= n1:
                for ph2 in range(s2):
                    for m in range(m2):
                        buf[ph1 * s2 + ph2, mr, m] = 0
                continue
            if u2 == 1 and s2 == 2 and b2 >= 0:
                # Stride 2: source pairs (2k, 2k+1) go to the two column phases. A loop that
                # uses both loads of each pair vectorises (one loop per phase is a gather).
                pe, po = ph1 * 2 + b2 % 2, ph1 * 2 + (b2 + 1) % 2
                qe, qo = b2 // 2, (b2 + 1) // 2
                pairs = max(min(n2 // 2, m2 - max(qe, qo)), 0)
                uqe, uqo = uint64(qe), uint64(qo)
                for k in range(uint64(pairs)):
                    v0 = src[n, ch, a0, a1, k * uint64(2)]
                    v1 = src[n, ch, a0, a1, k * uint64(2) + uint64(1)]
                    buf[pe, mr, uqe + k] = v0
                    buf[po, mr, uqo + k] = v1
                    check += v0 * 0 + v1 * 0
                for a2 in range(2 * pairs, n2):
                    j = b2 + a2
                    if j // 2 < m2:
                        v = src[n, ch, a0, a1, a2]
                        buf[ph1 * 2 + j % 2, mr, j // 2] = v
                        check += v * 0
            elif u2 == 1:
                # Column phase ph2, position m reads source column ph2 + m * s2 - b2.
                for ph2 in range(s2):
                    f = ph2 - b2
                    lo = 0 if f >= 0 else (s2 - 1 - f) // s2
                    hi = min(m2, (n2 - 1 - f) // s2 + 1) if n2 - 1 - f >= 0 else 0
                    if hi > lo:
                        pl = ph1 * s2 + ph2
                        ulo, ua, us = uint64(lo), uint64(f + lo * s2), uint64(s2)
                        if s2 == 1:
                            for m in range(uint64(hi - lo)):
                                v = src[n, ch, a0, a1, ua + m]
                                buf[pl, mr, ulo + m] = v
                                check += v * 0
                        else:
                            for m in range(uint64(hi - lo)):
                                v = src[n, ch, a0, a1, ua + m * us]
                                buf[pl, mr, ulo + m] = v
                                check += v * 0
            else:
                # Stuffed (then s2 == 1): source column a2 sits at position b2 + a2 * u2.
                alo = 0 if b2 >= 0 else (u2 - 1 - b2) // u2
                ahi = min(n2, (m2 - 1 - b2) // u2 + 1) if m2 - 1 - b2 >= 0 else 0
                if ahi > alo:
                    pl = ph1 * s2
                    ub, ua, uu = uint64(b2 + alo * u2), uint64(alo), uint64(u2)
                    for m in range(uint64(ahi - alo)):
                        v = src[n, ch, a0, a1, ua + m]
                        buf[pl, mr, ub + m * uu] = v
                        check += v * 0
    return check


@inline_jit
def _cf_taps(r, dil, s1, s2, m2, plane, offset):
    """Phase plane and flat offset of each in-plane tap (t1, t2)."""
    for t1 in range(r[1]):
        for t2 in range(r[2]):
            e1, e2 = t1 * dil[1], t2 * dil[2]
            plane[t1 * r[2] + t2] = (e1 % s1) * s2 + e2 % s2
            offset[t1 * r[2] + t2] = (e1 // s1) * m2 + e2 // s2


@parallel_jit
def _cf_conv(src, wsrc, dst, per_group, add, out, size, stuff, before, stride, dil, r,
             rows, chunks, zero):
    """Channels-first forward-form convolution, plane by plane.

    src (N, Cs, A0, A1, A2); wsrc (O, J, taps); dst (N, O, O0, O1, O2). Output plane o sums
    its J source planes (o // per_group) * J + j, each with kernel wsrc[o, j]. ``add``
    adds into dst (the data gradient with accumulation); otherwise dst is overwritten.
    """
    n_total, o_total = dst.shape[0], dst.shape[1]
    jn = wsrc.shape[1]
    o0n, o1n, o2n = out[0], out[1], out[2]
    s1, s2 = stride[1], stride[2]
    m2 = ((o2n - 1) * s2 + (r[2] - 1) * dil[2] + s2) // s2
    m1 = ((rows - 1) * s1 + (r[1] - 1) * dil[1] + s1) // s1
    blocks = (o1n + rows - 1) // rows
    jobs = n_total * o_total * o0n * blocks
    t12 = r[1] * r[2]
    for chunk in prange(chunks):
        buf = np.zeros((s1 * s2, m1, m2), dst.dtype)
        flat = buf.reshape(s1 * s2, m1 * m2)
        yb = np.empty((rows, m2), dst.dtype)
        yflat = yb.reshape(rows * m2)
        plane = np.empty(t12, np.int64)
        offset = np.empty(t12, np.int64)
        weight = np.empty(t12, dst.dtype)
        _cf_taps(r, dil, s1, s2, m2, plane, offset)
        start = chunk * jobs // chunks
        # (n, o, o0, blk) of the chunk's first job, then counted up like an odometer.
        blk = start % blocks
        rest = start // blocks
        o0 = rest % o0n
        rest //= o0n
        o = rest % o_total
        n = rest // o_total
        for _ in range(start, (chunk + 1) * jobs // chunks):
            pa = blk * rows
            nr = min(rows, o1n - pa)
            q = (nr - 1) * m2 + o2n
            hb = (nr - 1) * s1 + (r[1] - 1) * dil[1] + 1
            first = True
            for j in range(jn):
                for t0 in range(r[0]):
                    num0 = o0 * stride[0] + t0 * dil[0] - before[0]
                    a0 = num0
                    if stuff[0] != 1:
                        a0 = num0 // stuff[0]
                    if num0 < 0 or num0 - a0 * stuff[0] != 0 or a0 >= size[0]:
                        continue  # a plane of zeros: the weights are finite
                    _cf_fill(buf, src, n, (o // per_group) * jn + j, a0, pa * s1, hb,
                             size, stuff, before, s1, s2, zero)
                    for i in range(t12):
                        weight[i] = wsrc[o, j, t0 * t12 + i]
                    i = 0
                    while i < t12:
                        if t12 - i >= 9:
                            _cf_axpy9(yflat, q, flat, plane, offset, weight, i, first)
                            i += 9
                        elif t12 - i >= 3:
                            _cf_axpy3(yflat, q, flat, plane, offset, weight, i, first)
                            i += 3
                        else:
                            _cf_axpy1(yflat, q, flat, plane, offset, weight, i, first)
                            i += 1
                        first = False
            if first:
                if not add:
                    for i in range(nr):
                        for m in range(o2n):
                            dst[n, o, o0, pa + i, m] = 0
            elif add:
                for i in range(nr):
                    for m in range(o2n):
                        dst[n, o, o0, pa + i, m] += yb[i, m]
            else:
                for i in range(nr):
                    for m in range(o2n):
                        dst[n, o, o0, pa + i, m] = yb[i, m]
            blk += 1
            if blk == blocks:
                blk = 0
                o0 += 1
                if o0 == o0n:
                    o0 = 0
                    o += 1
                    if o == o_total:
                        o = 0
                        n += 1


@parallel_jit
def _cf_weight_partials(x, dy, partial, per_group, out, size, before, stride, dil, r, rows,
                        chunks, zero):
    """partial[job, j, t]: weight gradient of one job (image, output plane, rows), CF.

    x (N, C, S0, S1, S2); dy (N, K, P0, P1, P2); output plane k pairs with the J source planes
    (k // per_group) * J + j. dy is copied into the slab's pitch, spare columns zero; a plane
    whose values are not all finite is summed row by row instead, without the spare columns,
    so that nothing is multiplied that the reference does not multiply.
    """
    n_total, o_total = dy.shape[0], dy.shape[1]
    jn, taps = partial.shape[1], partial.shape[2]
    o0n, o1n, o2n = out[0], out[1], out[2]
    s1, s2 = stride[1], stride[2]
    m2 = ((o2n - 1) * s2 + (r[2] - 1) * dil[2] + s2) // s2
    m1 = ((rows - 1) * s1 + (r[1] - 1) * dil[1] + s1) // s1
    blocks = (o1n + rows - 1) // rows
    jobs = n_total * o_total * o0n * blocks
    t12 = r[1] * r[2]
    ones = np.ones(3, np.int64)
    for chunk in prange(chunks):
        buf = np.zeros((s1 * s2, m1, m2), partial.dtype)
        flat = buf.reshape(s1 * s2, m1 * m2)
        dyb = np.empty((rows, m2), partial.dtype)
        dflat = dyb.reshape(rows * m2)
        plane = np.empty(t12, np.int64)
        offset = np.empty(t12, np.int64)
        acc = np.empty(taps, partial.dtype)
        _cf_taps(r, dil, s1, s2, m2, plane, offset)
        start = chunk * jobs // chunks
        blk = start % blocks
        rest = start // blocks
        o0 = rest % o0n
        rest //= o0n
        o = rest % o_total
        n = rest // o_total
        for job in range(start, (chunk + 1) * jobs // chunks):
            pa = blk * rows
            nr = min(rows, o1n - pa)
            q = (nr - 1) * m2 + o2n
            hb = (nr - 1) * s1 + (r[1] - 1) * dil[1] + 1
            for i in range(nr):
                for m in range(o2n):
                    dyb[i, m] = dy[n, o, o0, pa + i, m]
                for m in range(m2 - o2n):
                    dyb[i, o2n + m] = 0
            for j in range(jn):
                for t in range(taps):
                    acc[t] = zero
                for t0 in range(r[0]):
                    num0 = o0 * stride[0] + t0 * dil[0] - before[0]
                    if num0 < 0 or num0 >= size[0]:
                        # A plane of padding: dy times zero, for NaN and inf to show.
                        z = zero
                        for m in range(q):
                            z += dflat[m] * 0
                        for i in range(t12):
                            acc[t0 * t12 + i] += z
                        continue
                    check = _cf_fill(buf, x, n, (o // per_group) * jn + j, num0, pa * s1,
                                     hb, size, ones, before, s1, s2, zero)
                    if check == 0:
                        i = 0
                        while i < t12:
                            if t12 - i >= 9:
                                _cf_dot9(acc, t0 * t12 + i, q, dflat, flat, plane, offset, i)
                                i += 9
                            elif t12 - i >= 3:
                                _cf_dot3(acc, t0 * t12 + i, q, dflat, flat, plane, offset, i)
                                i += 3
                            else:
                                _cf_dot1(acc, t0 * t12 + i, q, dflat, flat, plane, offset, i)
                                i += 1
                    else:
                        for i in range(t12):
                            total = acc[t0 * t12 + i]
                            for p1 in range(nr):
                                d = dyb[p1]
                                a = flat[plane[i], offset[i] + p1 * m2:offset[i] + p1 * m2 + o2n]
                                for m in range(o2n):
                                    total += d[m] * a[m]
                            acc[t0 * t12 + i] = total
                for t in range(taps):
                    partial[job, j, t] = acc[t]
            blk += 1
            if blk == blocks:
                blk = 0
                o0 += 1
                if o0 == o0n:
                    o0 = 0
                    o += 1
                    if o == o_total:
                        o = 0
                        n += 1


# --------------------------------------------------------------------------------------------
# Channels-first, stride 1, output as wide as the source: whole planes as flat runs.
# The source plane sits in a guarded buffer (zeros above, below and around it), so a tap is
# one flat shift: xg[guard + q + offset]. A shift that crosses a row end reads the next row's
# edge instead of padding; a column mask per horizontal tap selects zero there (select, not
# multiply, so NaN and inf in the wrapped value do not leak).
# --------------------------------------------------------------------------------------------

@inline_jit
def _sel(keep, v, zero):
    return v if keep else zero


@inline_jit
def _flat9(out, n, o, o0, q0, q, xg, fo, mask, mo, w, i, write, zero):
    """out[n, o, o0, q0:q0+q] (=|+=) taps i..i+8: three tap rows of three columns."""
    f0, f1, f2 = uint64(fo[i] + q0), uint64(fo[i + 1] + q0), uint64(fo[i + 2] + q0)
    f3, f4, f5 = uint64(fo[i + 3] + q0), uint64(fo[i + 4] + q0), uint64(fo[i + 5] + q0)
    f6, f7, f8 = uint64(fo[i + 6] + q0), uint64(fo[i + 7] + q0), uint64(fo[i + 8] + q0)
    m0, m1, m2 = mo[i], mo[i + 1], mo[i + 2]
    w0, w1, w2 = w[i], w[i + 1], w[i + 2]
    w3, w4, w5 = w[i + 3], w[i + 4], w[i + 5]
    w6, w7, w8 = w[i + 6], w[i + 7], w[i + 8]
    u0 = uint64(q0)
    for m in range(uint64(q)):
        k0 = mask[m0, u0 + m] != 0
        k1 = mask[m1, u0 + m] != 0
        k2 = mask[m2, u0 + m] != 0
        v = (w0 * _sel(k0, xg[f0 + m], zero) + w1 * _sel(k1, xg[f1 + m], zero)
             + w2 * _sel(k2, xg[f2 + m], zero) + w3 * _sel(k0, xg[f3 + m], zero)
             + w4 * _sel(k1, xg[f4 + m], zero) + w5 * _sel(k2, xg[f5 + m], zero)
             + w6 * _sel(k0, xg[f6 + m], zero) + w7 * _sel(k1, xg[f7 + m], zero)
             + w8 * _sel(k2, xg[f8 + m], zero))
        if not write:
            v += out[n, o, o0, u0 + m]
        out[n, o, o0, u0 + m] = v


@inline_jit
def _flat3(out, n, o, o0, q0, q, xg, fo, mask, mo, w, i, write, zero):
    f0, f1, f2 = uint64(fo[i] + q0), uint64(fo[i + 1] + q0), uint64(fo[i + 2] + q0)
    m0, m1, m2 = mo[i], mo[i + 1], mo[i + 2]
    w0, w1, w2 = w[i], w[i + 1], w[i + 2]
    u0 = uint64(q0)
    for m in range(uint64(q)):
        v = (w0 * _sel(mask[m0, u0 + m] != 0, xg[f0 + m], zero)
             + w1 * _sel(mask[m1, u0 + m] != 0, xg[f1 + m], zero)
             + w2 * _sel(mask[m2, u0 + m] != 0, xg[f2 + m], zero))
        if not write:
            v += out[n, o, o0, u0 + m]
        out[n, o, o0, u0 + m] = v


@inline_jit
def _flat1(out, n, o, o0, q0, q, xg, fo, mask, mo, w, i, write, zero):
    f0, m0, w0 = uint64(fo[i] + q0), mo[i], w[i]
    u0 = uint64(q0)
    for m in range(uint64(q)):
        v = w0 * _sel(mask[m0, u0 + m] != 0, xg[f0 + m], zero)
        if not write:
            v += out[n, o, o0, u0 + m]
        out[n, o, o0, u0 + m] = v


@inline_jit
def _flat_dot9(acc, t, dy, n, o, o0, q0, q, xg, fo, mask, mo, i, zero):
    """acc[t..t+8] += sum over q of dy times taps i..i+8 (three tap rows of three)."""
    f0, f1, f2 = uint64(fo[i] + q0), uint64(fo[i + 1] + q0), uint64(fo[i + 2] + q0)
    f3, f4, f5 = uint64(fo[i + 3] + q0), uint64(fo[i + 4] + q0), uint64(fo[i + 5] + q0)
    f6, f7, f8 = uint64(fo[i + 6] + q0), uint64(fo[i + 7] + q0), uint64(fo[i + 8] + q0)
    m0, m1, m2 = mo[i], mo[i + 1], mo[i + 2]
    s0, s1, s2 = acc[t], acc[t + 1], acc[t + 2]
    s3, s4, s5 = acc[t + 3], acc[t + 4], acc[t + 5]
    s6, s7, s8 = acc[t + 6], acc[t + 7], acc[t + 8]
    u0 = uint64(q0)
    for m in range(uint64(q)):
        d = dy[n, o, o0, u0 + m]
        k0 = mask[m0, u0 + m] != 0
        k1 = mask[m1, u0 + m] != 0
        k2 = mask[m2, u0 + m] != 0
        s0 += d * _sel(k0, xg[f0 + m], zero)
        s1 += d * _sel(k1, xg[f1 + m], zero)
        s2 += d * _sel(k2, xg[f2 + m], zero)
        s3 += d * _sel(k0, xg[f3 + m], zero)
        s4 += d * _sel(k1, xg[f4 + m], zero)
        s5 += d * _sel(k2, xg[f5 + m], zero)
        s6 += d * _sel(k0, xg[f6 + m], zero)
        s7 += d * _sel(k1, xg[f7 + m], zero)
        s8 += d * _sel(k2, xg[f8 + m], zero)
    acc[t], acc[t + 1], acc[t + 2] = s0, s1, s2
    acc[t + 3], acc[t + 4], acc[t + 5] = s3, s4, s5
    acc[t + 6], acc[t + 7], acc[t + 8] = s6, s7, s8


@inline_jit
def _flat_dot3(acc, t, dy, n, o, o0, q0, q, xg, fo, mask, mo, i, zero):
    f0, f1, f2 = uint64(fo[i] + q0), uint64(fo[i + 1] + q0), uint64(fo[i + 2] + q0)
    m0, m1, m2 = mo[i], mo[i + 1], mo[i + 2]
    s0, s1, s2 = acc[t], acc[t + 1], acc[t + 2]
    u0 = uint64(q0)
    for m in range(uint64(q)):
        d = dy[n, o, o0, u0 + m]
        s0 += d * _sel(mask[m0, u0 + m] != 0, xg[f0 + m], zero)
        s1 += d * _sel(mask[m1, u0 + m] != 0, xg[f1 + m], zero)
        s2 += d * _sel(mask[m2, u0 + m] != 0, xg[f2 + m], zero)
    acc[t], acc[t + 1], acc[t + 2] = s0, s1, s2


@inline_jit
def _flat_dot1(acc, t, dy, n, o, o0, q0, q, xg, fo, mask, mo, i, zero):
    f0, m0 = uint64(fo[i] + q0), mo[i]
    s0 = acc[t]
    u0 = uint64(q0)
    for m in range(uint64(q)):
        s0 += dy[n, o, o0, u0 + m] * _sel(mask[m0, u0 + m] != 0, xg[f0 + m], zero)
    acc[t] = s0


@inline_jit
def _flat_plan(r, dil, before, width, fo, mo, chunk):
    """Flat offset (before the guard), mask row and chunk size of each in-plane tap.

    Chunks: nine (three tap rows of a 3-wide kernel), three (three columns of one row) or one.
    """
    t = 0
    for t1 in range(r[1]):
        for t2 in range(r[2]):
            fo[t] = (t1 * dil[1] - before[1]) * width + t2 * dil[2] - before[2]
            mo[t] = t2
            t += 1
    t = 0
    while t < r[1] * r[2]:
        t1 = t // r[2]
        t2 = t - t1 * r[2]
        if r[2] == 3 and t2 == 0 and r[1] - t1 >= 3:
            chunk[t] = 9
        elif r[2] - t2 >= 3:
            chunk[t] = 3
        else:
            chunk[t] = 1
        t += chunk[t]


@inline_jit
def _flat_fill(xg, src, n, ch, a0, lo, hi, guard, width):
    """Source rows lo..hi of plane (n, ch, a0) into the guarded buffer (src is 4D, flat)."""
    start = uint64(guard + lo * width)
    first = uint64(lo * width)
    for m in range(uint64((hi - lo) * width)):
        xg[start + m] = src[n, ch, a0, first + m]


@parallel_jit
def _cf_flat_conv(src4, wsrc, dst4, per_group, add, mask, out, size, stuff, before,
                  stride, dil, r, rows, chunks, zero):
    """Channels-first convolution, stride 1, output rows as wide as the source rows.

    src4 (N, Cs, A0, A1 * W); dst4 (N, O, O0, O1 * W); wsrc (O, J, taps); mask (r2, O1 * W):
    column q % W of tap column t2 reads inside the row. See _cf_conv for the rest.
    """
    n_total, o_total = dst4.shape[0], dst4.shape[1]
    jn = wsrc.shape[1]
    o0n, o1n = out[0], out[1]
    a1n, width = size[1], size[2]
    t12 = r[1] * r[2]
    guard = max(before[1] * width + before[2], 0)
    reach = max(((r[1] - 1) * dil[1] - before[1]) * width + (r[2] - 1) * dil[2] - before[2], 0)
    length = guard + max(o1n, a1n) * width + reach + width
    blocks = (o1n + rows - 1) // rows
    jobs = n_total * o_total * o0n * blocks
    for chunk in prange(chunks):
        xg = np.zeros(length, dst4.dtype)
        fo = np.empty(t12, np.int64)
        mo = np.empty(t12, np.int64)
        size9 = np.empty(t12, np.int64)
        w = np.empty(t12, dst4.dtype)
        _flat_plan(r, dil, before, width, fo, mo, size9)
        for i in range(t12):
            fo[i] += guard
        start = chunk * jobs // chunks
        blk = start % blocks
        rest = start // blocks
        o0 = rest % o0n
        rest //= o0n
        o = rest % o_total
        n = rest // o_total
        for _ in range(start, (chunk + 1) * jobs // chunks):
            pa = blk * rows
            pb = min(pa + rows, o1n)
            q0 = pa * width
            q = (pb - pa) * width
            # Source rows these output rows read (rows outside the plane stay guard zeros).
            lo = min(max(pa - before[1], 0), a1n)
            hi = min(max(pb - 1 - before[1] + (r[1] - 1) * dil[1] + 1, lo), a1n)
            first = True
            for j in range(jn):
                for t0 in range(r[0]):
                    num0 = o0 * stride[0] + t0 * dil[0] - before[0]
                    a0 = num0
                    if stuff[0] != 1:
                        a0 = num0 // stuff[0]
                    if num0 < 0 or num0 - a0 * stuff[0] != 0 or a0 >= size[0]:
                        continue  # a plane of zeros: the weights are finite
                    _flat_fill(xg, src4, n, (o // per_group) * jn + j, a0, lo, hi, guard, width)
                    for i in range(t12):
                        w[i] = wsrc[o, j, t0 * t12 + i]
                    i = 0
                    while i < t12:
                        write = first and not add
                        if size9[i] == 9:
                            _flat9(dst4, n, o, o0, q0, q, xg, fo, mask, mo, w, i, write, zero)
                        elif size9[i] == 3:
                            _flat3(dst4, n, o, o0, q0, q, xg, fo, mask, mo, w, i, write, zero)
                        else:
                            _flat1(dst4, n, o, o0, q0, q, xg, fo, mask, mo, w, i, write, zero)
                        i += size9[i]
                        first = False
            if first and not add:
                u0 = uint64(q0)
                for m in range(uint64(q)):
                    dst4[n, o, o0, u0 + m] = zero
            blk += 1
            if blk == blocks:
                blk = 0
                o0 += 1
                if o0 == o0n:
                    o0 = 0
                    o += 1
                    if o == o_total:
                        o = 0
                        n += 1


@parallel_jit
def _cf_flat_weight(x4, dy4, partial, per_group, mask, out, size, before, stride, dil, r, rows,
                    chunks, zero):
    """partial[job, j, t] for stride 1 and output rows as wide as x rows (see _cf_flat_conv).

    Padding is read as zeros and multiplied (rows from the guard, columns by the mask), as
    the reference multiplies it.
    """
    n_total, o_total = dy4.shape[0], dy4.shape[1]
    jn, taps = partial.shape[1], partial.shape[2]
    o0n, o1n = out[0], out[1]
    a1n, width = size[1], size[2]
    t12 = r[1] * r[2]
    guard = max(before[1] * width + before[2], 0)
    reach = max(((r[1] - 1) * dil[1] - before[1]) * width + (r[2] - 1) * dil[2] - before[2], 0)
    length = guard + max(o1n, a1n) * width + reach + width
    blocks = (o1n + rows - 1) // rows
    jobs = n_total * o_total * o0n * blocks
    for chunk in prange(chunks):
        xg = np.zeros(length, partial.dtype)
        fo = np.empty(t12, np.int64)
        mo = np.empty(t12, np.int64)
        size9 = np.empty(t12, np.int64)
        acc = np.empty(taps, partial.dtype)
        _flat_plan(r, dil, before, width, fo, mo, size9)
        for i in range(t12):
            fo[i] += guard
        start = chunk * jobs // chunks
        blk = start % blocks
        rest = start // blocks
        o0 = rest % o0n
        rest //= o0n
        o = rest % o_total
        n = rest // o_total
        for job in range(start, (chunk + 1) * jobs // chunks):
            pa = blk * rows
            pb = min(pa + rows, o1n)
            q0 = pa * width
            q = (pb - pa) * width
            lo = min(max(pa - before[1], 0), a1n)
            hi = min(max(pb - 1 - before[1] + (r[1] - 1) * dil[1] + 1, lo), a1n)
            for j in range(jn):
                for t in range(taps):
                    acc[t] = zero
                for t0 in range(r[0]):
                    num0 = o0 * stride[0] + t0 * dil[0] - before[0]
                    if num0 < 0 or num0 >= size[0]:
                        # A plane of padding: dy times zero, for NaN and inf to show.
                        z = zero
                        u0 = uint64(q0)
                        for m in range(uint64(q)):
                            z += dy4[n, o, o0, u0 + m] * 0
                        for i in range(t12):
                            acc[t0 * t12 + i] += z
                        continue
                    _flat_fill(xg, x4, n, (o // per_group) * jn + j, num0, lo, hi, guard, width)
                    i = 0
                    while i < t12:
                        if size9[i] == 9:
                            _flat_dot9(acc, t0 * t12 + i, dy4, n, o, o0, q0, q, xg, fo, mask,
                                       mo, i, zero)
                        elif size9[i] == 3:
                            _flat_dot3(acc, t0 * t12 + i, dy4, n, o, o0, q0, q, xg, fo, mask,
                                       mo, i, zero)
                        else:
                            _flat_dot1(acc, t0 * t12 + i, dy4, n, o, o0, q0, q, xg, fo, mask,
                                       mo, i, zero)
                        i += size9[i]
                for t in range(taps):
                    partial[job, j, t] = acc[t]
            blk += 1
            if blk == blocks:
                blk = 0
                o0 += 1
                if o0 == o0n:
                    o0 = 0
                    o += 1
                    if o == o_total:
                        o = 0
                        n += 1


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
            _same3(form, g.x5(x), wk, y3)
            return
        rows = _row_split(g.p[1], g.n * g.p[0])
        _cl_conv(g.x5(x), wk, y3, _rows2d(y3), cmap, identity, False, g.cg, g.kg,
                 *form.args(), rows, False, *_row_kernels(g.k, y.dtype))
    else:
        _cf_convolve(form, g.x5(x), w.reshape(g.k, g.cg, g.taps), g.y5(y), g.kg, False)


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
            _same3(form, g.y5(dy), wk, dx3)
            return
        rows = _row_split(g.s[1], g.n * g.s[0])
        _cl_conv(g.y5(dy), wk, dx3, _rows2d(dx3), cmap, True, True, g.cg, g.kg, *form.args(),
                 rows, overwrite, *_row_kernels(g.k, dx.dtype))
    else:
        # dx plane g*Cg + c sums dy planes g*Kg + j, each with flip(w[g*Kg + j, c]).
        wsrc = np.ascontiguousarray(
            flipped.reshape(g.groups, g.kg, g.cg, g.taps).transpose(0, 2, 1, 3)
            .reshape(g.c, g.kg, g.taps))
        # Added into dx, or written (zeros where no dy reaches) when not accumulating.
        _cf_convolve(form, g.y5(dy), wsrc, g.x5(dx), g.cg, accumulate)


def weight_gradient(g, x, dy) -> np.ndarray:
    """dw (K, Cg, *R), summed over a fixed split in a fixed order (bitwise reproducible)."""
    form = _forward_form(g)
    out, size, _, before, stride, dil, r = form.args()
    if g.channels_last:
        cmap, identity = _channel_map(g)
        rows = _row_split(g.p[1], g.n * g.p[0])
        jobs = g.n * g.p[0] * -(-g.p[1] // rows)
        partial = np.empty((jobs, g.cg, g.taps, g.k), dy.dtype)
        dy3 = dy.reshape(g.n * g.p[0] * g.p[1], g.p[2], g.k)
        _cl_weight_partials(g.x5(x), dy3, partial, cmap, identity, out, size, before, stride,
                            dil, r, rows, *_row_kernels(g.k, dy.dtype))
        total = np.empty(g.cg * g.taps * g.k, dy.dtype)
        add_partials(partial.reshape(jobs, -1), total)
        return np.ascontiguousarray(total.reshape(g.cg, g.taps, g.k).transpose(2, 0, 1))
    x5, dy5 = g.x5(x), g.y5(dy)
    lanes = (_same_planes(form, None, x5, dy5, False)
             if g.cg == 1 and g.kg == 1 and g.p[2] >= _heuristics.SAME_WEIGHT_MIN_WIDTH else 0)
    if lanes:
        dw = np.empty((g.k, g.taps), dy.dtype)
        _cf_same3_weight(_planes(x5), _planes(dy5), dw, g.p[1], g.p[2], _chunks(g.k), lanes)
        return dw.reshape((g.k, g.cg) + g.r)
    rows = _row_split(g.p[1], g.n * g.k * g.p[0])
    split = g.p[0] * -(-g.p[1] // rows)                   # jobs per (image, output plane)
    jobs = g.n * g.k * split
    partial = np.empty((jobs, g.cg, g.taps), dy.dtype)
    if _flat(form):
        _cf_flat_weight(_planes(x5), _planes(dy5), partial, g.kg, _column_mask(form), out,
                        size, before, stride, dil, r, rows, _chunks(jobs), _zero(dy))
    else:
        _cf_weight_partials(x5, dy5, partial, g.kg, out, size, before, stride, dil, r, rows,
                            _chunks(jobs), _zero(dy))
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
    return (form.kernel == (1, 3, 3) and form.stuff == (1, 1, 1)
            and form.stride[0] == 1 and form.before[0] == 0 and form.size[0] == form.out[0]
            and form.stride[2] == 1 and form.dilation[2] == 1 and form.before[2] == 1
            and form.size[2] == form.out[2])


def _same_rows(g, form, src, dst) -> bool:
    """Whether :func:`_cl_same3` computes this channels-last problem: depthwise (one channel
    per group and output), :func:`_same_along_rows` (any stride and dilation from row to
    row), the channels in whole vectors, both arrays C-contiguous."""
    return (g.cg == 1 and g.kg == 1 and _same_along_rows(form)
            and same_units(g.k, dst.dtype)[0] != 0
            and src.flags.c_contiguous and dst.flags.c_contiguous)


def _same3(form, src5, wk, dst3) -> None:
    out, _, _, before, stride, dil, _ = form.args()
    zero = np.zeros(src5.shape[3] * src5.shape[4], dst3.dtype)
    _cl_same3(src5, wk, dst3, zero, out, before, stride, dil,
              *same_units(src5.shape[4], dst3.dtype))


def _same_planes(form, wsrc, src5, dst5, add) -> int:
    """The vector width for :func:`_cf_same3` (and :func:`_cf_same3_weight`, ``wsrc`` None)
    where it computes this channels-first convolution, else 0: depthwise (one source plane
    per output), :func:`_same_along_rows` and the same from row to row (stride and
    dilation 1, one row of padding above and below), written, both arrays C-contiguous."""
    ok = (not add and (wsrc is None or wsrc.shape[1] == 1)
          and src5.shape[1] == dst5.shape[1] and _same_along_rows(form)
          and form.stride[1] == 1 and form.dilation[1] == 1 and form.before[1] == 1
          and form.size[1] == form.out[1]
          and src5.flags.c_contiguous and dst5.flags.c_contiguous)
    return row_lanes(dst5.dtype) if ok else 0


def _cf_convolve(form, src5, wsrc, dst5, per_group, add) -> None:
    lanes = _same_planes(form, wsrc, src5, dst5, add)
    if lanes:
        # (C, 9, lanes): each weight broadcast to a vector, the 3x3 window transposed.
        taps = wsrc.reshape(-1, 3, 3).transpose(0, 2, 1).reshape(-1, 9)
        wb = np.ascontiguousarray(np.broadcast_to(taps[:, :, None], taps.shape + (lanes,)))
        planes = dst5.shape[0] * dst5.shape[1] * dst5.shape[2]
        _cf_same3(_planes(src5), wb, _planes(dst5), form.out[1], form.out[2],
                  _chunks(planes), lanes)
        return
    n, o = dst5.shape[0], dst5.shape[1]
    rows = _row_split(form.out[1], n * o * form.out[0])
    chunks = _chunks(n * o * form.out[0] * -(-form.out[1] // rows))
    if _flat(form):
        _cf_flat_conv(_planes(src5), wsrc, _planes(dst5), per_group, add,
                      _column_mask(form), *form.args(), rows, chunks, _zero(dst5))
    else:
        _cf_conv(src5, wsrc, dst5, per_group, add, *form.args(), rows, chunks,
                 _zero(dst5))


def _zero_rows(a) -> None:
    zero_rows(a.reshape(a.shape[0], -1))


def _flat(form) -> bool:
    """Stride 1, nothing stuffed, output rows as wide as source rows: whole-plane runs."""
    return (form.stride[1:] == (1, 1) and form.stuff[1:] == (1, 1)
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
