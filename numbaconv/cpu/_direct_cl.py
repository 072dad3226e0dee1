"""The ``direct`` algorithm's channels-last kernels (see :mod:`._direct`): each job copies the
source rows it reads into a ring of zero-padded rows (pixels x channels); the bodies vectorise
over the contiguous channels and keep four output pixels in registers, or run the sliding row
kernels of :mod:`._sliding`. Depthwise ``same`` 3x3 rows need no ring (:func:`_cl_same3`,
:func:`_cl_same3_weight`).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..config import inline_jit, parallel_jit, serial_jit
from ._microkernel import _at
from ._sliding import (conv3_row, conv3_same1, conv3_same2, conv3_same4, conv3_same8, grad3_row,
                       grad3_rows4x1, grad3_rows4x2, grad3_same, grad3_same1, grad3_same2,
                       grad3_same4, grad3_same8)

#: Row-level helpers of the channels-last kernels are called (``serial_jit``), not inlined:
#: inlined into _cl_conv's parallel loop they compile far slower and run no faster
#: (docs/cpu-algorithms.md, "Compile times").


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
        taps = wk.shape[1]
        wbase = (c * taps + t) * kk
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
def _cl_fill(buf, slot, src, n, a0, a1, before, spread, size, width, cmap, c, identity, kk):
    """buf[slot] <- source row (n, a0, a1), its pixels at columns before + a*spread.

    The other columns of a slot are never written, so they keep the zeros of allocation.
    """
    for a2 in range(size):
        col = before + a2 * spread
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
def _cl_rows(rowslot, tag, buf, src, n, o0, p1, out, size, spread, before, stride, dil, r,
             span, width, cmap, c, identity, kk):
    """Make sure the source rows of output row (o0, p1) are in the ring; rowslot[t0, t1] is
    the slot of each (the last slot is all zeros: padding, stuffing)."""
    zero = tag.shape[0]
    for t0 in range(r[0]):
        num0 = o0 * stride[0] + t0 * dil[0] - before[0]
        a0 = num0 // spread[0]
        plane = num0 >= 0 and num0 - a0 * spread[0] == 0 and a0 < size[0]
        for t1 in range(r[1]):
            j1 = p1 * stride[1] + t1 * dil[1]
            num1 = j1 - before[1]
            a1 = num1 // spread[1]
            if plane and num1 >= 0 and num1 - a1 * spread[1] == 0 and a1 < size[1]:
                slot = t0 * span + j1 % span
                if tag[slot] != j1:
                    _cl_fill(buf, slot, src, n, a0, a1, before[2], spread[2], size[2], width,
                             cmap, c, identity, kk)
                    tag[slot] = j1
                rowslot[t0, t1] = slot
            else:
                rowslot[t0, t1] = zero


@parallel_jit
def _cl_conv(src, wk, dst3, dst2, cmap, identity, transposed, cg, kg, out, size, spread, before,
             stride, dil, r, rows, overwrite, pitch, vec, first_job, last_job):
    """Channels-last forward-form convolution, K channels wide.

    src (N, A0, A1, A2, Cs); wk (passes, taps, K): the weights of each pass, K-space;
    dst3 (N * O0 * O1, O2, Cd), and dst2 the same array as (N * O0 * O1, O2 * Cd). Forward
    (``transposed`` False): y channel k gathers source channel cmap[pass, k]; passes add up.
    Data gradient: the source is dy (K channels) and pass c adds, for every group, the sum
    over its kg outputs into dx channel g*cg + c; ``overwrite`` (depthwise, one fused 3x3
    body per row) writes dx instead, like the forward. Source rows are copied into buffers
    ``pitch`` (>= K) elements a pixel; ``vec`` nonzero (K in whole vectors of that many)
    runs fused 3x3 rows of stride 1 as :func:`._sliding.conv3_row`. Jobs (image, output
    plane, block of ``rows`` rows) [first_job, last_job) run.
    """
    passes, kk = wk.shape[0], wk.shape[2]
    out_depth, out_height, out_width = out[0], out[1], out[2]
    blocks = (out_height + rows - 1) // rows
    p2r = (out_width + 3) // 4 * 4
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
    if pitch < kk or width < out_width + 2:
        vec = 0        # the row kernel's reach (out_width + 2 pixels of vec channels) is not there
    for i in prange(last_job - first_job):
        job = first_job + i
        blk = job % blocks
        rest = job // blocks
        o0 = rest % out_depth
        n = rest // out_depth
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
            for p1 in range(blk * rows, min(blk * rows + rows, out_height)):
                _cl_rows(rowslot, tag, buf, src, n, o0, p1, out, size, spread, before, stride,
                         dil, r, span, width, cmap, c, identity, kk)
                drow = (n * out_depth + o0) * out_height + p1
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
                        _cl_row9(out3, orow, buf, ra, rb, rc, step, wk, c, t, kk, out_width, vec,
                                 slide)
                        if count > 0:
                            for e in range(out_width * kk):
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
                width_out = out_width * kk
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
                    for p2 in range(out_width):
                        for grp in range(groups):
                            total = rowbuf[0, p2, grp * kg]
                            for kq in range(1, kg):
                                total += rowbuf[0, p2, grp * kg + kq]
                            dst3[drow, p2, grp * cg + c] += total


@inline_jit
def _same_source_rows(plane, a, step, height, row_values):
    """The flat offsets of source rows a, a + step, a + 2 * step of the plane starting at row
    ``plane`` (rows of ``row_values`` values), -1 for a row outside the source (padding)."""
    ra = (plane + a) * row_values if 0 <= a < height else -1
    rb = (plane + a + step) * row_values if 0 <= a + step < height else -1
    rc = (plane + a + 2 * step) * row_values if 0 <= a + 2 * step < height else -1
    return ra, rb, rc


@inline_jit
def _row_pointers(src, zero, ra, rb, rc, k0):
    """Pointers to channel k0 of the three source rows at offsets ra, rb, rc in src, or into
    the row of zeros where an offset is -1."""
    pa = _at(src, ra + k0) if ra >= 0 else _at(zero, k0)
    pb = _at(src, rb + k0) if rb >= 0 else _at(zero, k0)
    pc = _at(src, rc + k0) if rc >= 0 else _at(zero, k0)
    return pa, pb, pc


@parallel_jit
def _cl_same3(src, wk, dst3, zero, out, before, stride, dil, lanes, units, first_row, last_row):
    """Depthwise 3x3 rows of ``same`` padding and stride 1 along them, channels-last, read
    from src and written into dst3 where they lie (no row buffers): one output row a job,
    each call of the :mod:`._sliding` ``same`` rows ``units`` vectors of ``lanes`` channels
    (fewer for the last channels).

    src (N, A0, A1, A2, K) C-contiguous; wk (1, 9, K); dst3 (N * O0 * O1, O2, K)
    C-contiguous, O2 == A2, written; zero: A2 * K zeros, the rows above and below the
    source. Output rows (image, plane, row) [first_row, last_row) are written. The callers
    check the geometry (:func:`._direct._same_rows`).
    """
    _, src_depth, src_height, src_width, kk = src.shape
    out_depth, out_height = out[0], out[1]
    for i in prange(last_row - first_row):
        job = first_row + i
        p1 = job % out_height
        rest = job // out_height
        o0 = rest % out_depth
        n = rest // out_depth
        plane = (n * src_depth + o0) * src_height
        base = job * src_width * kk
        ra, rb, rc = _same_source_rows(plane, p1 * stride[1] - before[1], dil[1], src_height,
                                       src_width * kk)
        k0 = 0
        while k0 < kk:
            pa, pb, pc = _row_pointers(src, zero, ra, rb, rc, k0)
            pw, pd = _at(wk, k0), _at(dst3, base + k0)
            left = kk - k0
            if units >= 8 and left >= 8 * lanes:
                conv3_same8(pa, pb, pc, kk, pw, kk, pd, kk, src_width)
                k0 += 8 * lanes
            elif units >= 4 and left >= 4 * lanes:
                conv3_same4(pa, pb, pc, kk, pw, kk, pd, kk, src_width)
                k0 += 4 * lanes
            elif units >= 2 and left >= 2 * lanes:
                conv3_same2(pa, pb, pc, kk, pw, kk, pd, kk, src_width)
                k0 += 2 * lanes
            else:
                conv3_same1(pa, pb, pc, kk, pw, kk, pd, kk, src_width)
                k0 += lanes


@parallel_jit
def _cl_same3_weight(src, dy3, partial, zero, scratch, out, before, stride, dil, lanes, head,
                     four, first_whole_tail, narrow, rows, first_job, last_job):
    """partial[job, 0, t, k]: the depthwise 3x3 weight gradient of one job's output rows
    (image, plane, block of ``rows`` rows), ``same`` padding and stride 1 along the rows,
    channels-last, x's rows read where they lie (no row buffers).

    With ``four``, where the rows are one apart (stride and dilation 1 across them),
    :func:`_same3_weight_rows` takes the job's output rows 4 at a time where all their tap
    rows lie in x, each source pixel fetched once for the 4. The other rows (those that read
    the padding above or below x, the job's last few, any row of other strides) go through
    :func:`._sliding.grad3_same`, one vector of channels a call: vectors of ``lanes`` from
    channel ``first_whole_tail[0]`` to ``first_whole_tail[1]`` channels before the last, the
    ``narrow[i]`` (first channel, lanes) around them on narrower vectors
    (:func:`._sliding.channel_pieces`).

    src (N, S0, S1, S2, K) C-contiguous; dy3 (N * P0 * P1, P2, K) C-contiguous, P2 == S2 >=
    2; partial (jobs, 1, 9, K) C-contiguous; zero: S2 * K zeros, the rows above and below
    x (multiplied, as the reference's padding); scratch (jobs, 9 * lanes); ``head``: where
    pixels start ``head`` channels before a cache line (x and dy alike, a vector a line), 0
    elsewhere (:func:`_same3_weight_rows`). Jobs [first_job, last_job) run. The callers
    check the geometry (:func:`._direct._same_weight_rows`).
    """
    _, src_depth, src_height, src_width, kk = src.shape
    out_depth, out_height = out[0], out[1]
    blocks = (out_height + rows - 1) // rows
    first_whole, narrow_tail = first_whole_tail
    row_values = src_width * kk
    blocked = four and stride[1] == 1 and dil[1] == 1
    for i in prange(last_job - first_job):
        job = first_job + i
        blk = job % blocks
        rest = job // blocks
        o0 = rest % out_depth
        n = rest // out_depth
        plane = (n * src_depth + o0) * src_height
        sums = job * 9 * kk
        for t in range(9):
            for k in range(kk):
                partial[job, 0, t, k] = 0
        start = blk * rows
        end = min(start + rows, out_height)
        # Output rows [b0, b1) go 4 at a time: those whose tap rows all lie in x.
        b0 = max(start, before[1])
        b1 = b0 + 4 * max(0, min(end - b0, src_height - 2 + before[1] - b0) // 4)
        if not blocked:
            b1 = b0
        for p1 in range(b0, b1, 4):
            _same3_weight_rows(src, dy3, partial, scratch, job,
                               (plane + p1 - before[1]) * row_values,
                               ((n * out_depth + o0) * out_height + p1) * row_values,
                               row_values, src_width, lanes, head)
        for p1 in range(start, end):
            if b0 <= p1 < b1:
                continue
            a = p1 * stride[1] - before[1]         # the source row of tap row 0
            drow = ((n * out_depth + o0) * out_height + p1) * row_values
            ra, rb, rc = _same_source_rows(plane, a, dil[1], src_height, row_values)
            for k0 in range(first_whole, kk - narrow_tail, lanes):
                pa, pb, pc = _row_pointers(src, zero, ra, rb, rc, k0)
                grad3_same(pa, pb, pc, kk, _at(dy3, drow + k0), kk, _at(partial, sums + k0),
                           kk, src_width)
            for piece in range(narrow.shape[0]):
                k0, width = narrow[piece, 0], narrow[piece, 1]
                pa, pb, pc = _row_pointers(src, zero, ra, rb, rc, k0)
                pd, ps = _at(dy3, drow + k0), _at(partial, sums + k0)
                if width == 8:
                    grad3_same8(pa, pb, pc, kk, pd, kk, ps, kk, src_width)
                elif width == 4:
                    grad3_same4(pa, pb, pc, kk, pd, kk, ps, kk, src_width)
                elif width == 2:
                    grad3_same2(pa, pb, pc, kk, pd, kk, ps, kk, src_width)
                else:
                    grad3_same1(pa, pb, pc, kk, pd, kk, ps, kk, src_width)


@serial_jit
def _same3_weight_rows(src, dy3, partial, scratch, job, srow, drow, row_values, width, lanes,
                       head):
    """partial[job] += the weight gradient of 4 adjacent output rows, dy's first at flat
    offset ``drow``, their first tap row at ``srow`` in src, by
    :func:`._sliding.grad3_rows4x2` (:func:`._sliding.grad3_rows4x1` for a last odd
    vector): vectors of channels from ``head`` on, on whole cache lines. With ``head`` > 0
    (pixels start that many channels before a line), the last channels of each pixel and
    the first ``head`` of the next share a line: one wrapping walk takes them together, its
    sums gathered from partial into ``scratch[job]`` and put back (each lane adds what a
    walk of its channel alone would).
    """
    kk = src.shape[4]
    stop = kk - lanes + head if head else kk
    k0 = head
    while k0 < stop or (head and k0 == stop):
        wrap = k0 == stop
        units = 2 if k0 + 2 * lanes <= stop else 1
        if wrap:
            for t in range(9):
                for lane in range(lanes):
                    scratch[job, t * lanes + lane] = partial[job, 0, t, (k0 + lane) % kk]
            pacc, at, split = _at(scratch, job * 9 * lanes), lanes, lanes - head
        else:
            pacc, at, split = _at(partial, job * 9 * kk + k0), kk, lanes
        px, pd = _at(src, srow + k0), _at(dy3, drow + k0)
        if units == 2:
            grad3_rows4x2(px, row_values, kk, pd, row_values, kk, pacc, at, width, split)
        else:
            grad3_rows4x1(px, row_values, kk, pd, row_values, kk, pacc, at, width, split)
        if wrap:
            for t in range(9):
                for lane in range(lanes):
                    partial[job, 0, t, (k0 + lane) % kk] = scratch[job, t * lanes + lane]
        k0 += units * lanes


@parallel_jit
def _cl_weight_partials(src, dy3, partial, cmap, identity, out, size, before, stride, dil, r,
                        rows, pitch, vec, first_job, last_job):
    """partial[job, c, t, k]: the weight gradient of one job's output rows, channels-last.

    src is x (N, S0, S1, S2, C); dy3 is dy as (N * P0 * P1, P2, K); pass c gathers x channel
    cmap[c, k] for output channel k. Padding rows are read as zeros and multiplied, as the
    reference does, so a non-finite dy next to the border poisons dw exactly like there.
    Source rows are copied into buffers ``pitch`` (>= K) elements a pixel; ``vec`` nonzero
    (K in whole vectors of that many) runs 3x3 tap rows of stride 1 as
    :func:`._sliding.grad3_row`. Jobs (image, output plane, block of ``rows`` rows)
    [first_job, last_job) run.
    """
    kk = partial.shape[3]
    passes = partial.shape[1]
    out_depth, out_height, out_width = out[0], out[1], out[2]
    blocks = (out_height + rows - 1) // rows
    width = (out_width - 1) * stride[2] + (r[2] - 1) * dil[2] + 1
    span = (r[1] - 1) * dil[1] + 1
    slots = r[0] * span
    step = stride[2] if dil[2] == 1 and stride[2] <= 2 else 0    # as in _cl_conv
    body = out_width - out_width % 4
    ones = np.ones(3, np.int64)
    sliding = vec != 0 and step == 1 and r[1] == 3 and r[2] == 3 and pitch >= kk and \
        width >= out_width + 2 and dy3.shape[1] >= out_width and dy3.shape[2] == kk
    for i in prange(last_job - first_job):
        job = first_job + i
        blk = job % blocks
        rest = job // blocks
        o0 = rest % out_depth
        n = rest // out_depth
        buf = np.zeros((slots + 1, width, pitch), partial.dtype)
        tag = np.empty(slots, np.int64)
        rowslot = np.empty((r[0], r[1]), np.int64)
        acc = np.empty((partial.shape[2], kk), partial.dtype)
        for c in range(passes):
            acc[:] = 0
            tag[:] = -1
            for p1 in range(blk * rows, min(blk * rows + rows, out_height)):
                _cl_rows(rowslot, tag, buf, src, n, o0, p1, out, size, ones, before, stride,
                         dil, r, span, width, cmap, c, identity, kk)
                drow = (n * out_depth + o0) * out_height + p1
                for t0 in range(r[0]):
                    if sliding:
                        ra, rb, rc = rowslot[t0, 0], rowslot[t0, 1], rowslot[t0, 2]
                        for k0 in range(0, kk, vec):
                            grad3_row(_at(buf, ra * width * pitch + k0),
                                      _at(buf, rb * width * pitch + k0),
                                      _at(buf, rc * width * pitch + k0), pitch,
                                      _at(dy3, drow * dy3.shape[1] * kk + k0), kk,
                                      _at(acc, t0 * 9 * kk + k0), kk, out_width)
                        continue
                    for t1 in range(r[1]):
                        row = rowslot[t0, t1]
                        t2 = 0
                        while t2 < r[2]:
                            t = (t0 * r[1] + t1) * r[2] + t2
                            m = 3 if r[2] - t2 >= 3 and step != 0 else 1
                            for p2 in range(0, out_width - 3, 4):    # plain bound: _cl_row9
                                col = p2 * stride[2] + t2 * dil[2]
                                if m == 1:
                                    _cl_grad1(acc, t, dy3, drow, p2, buf, row, col, stride[2],
                                              kk)
                                elif step == 1:
                                    _cl_grad3(acc, t, dy3, drow, p2, buf, row, col, 1, 1, kk)
                                else:
                                    _cl_grad3(acc, t, dy3, drow, p2, buf, row, col, 2, 1, kk)
                            p2 = body
                            if m == 3 and p2 + 2 <= out_width:
                                col = p2 * stride[2] + t2
                                if step == 1:
                                    _cl_grad3_pair(acc, t, dy3, drow, p2, buf, row, col, 1, kk)
                                else:
                                    _cl_grad3_pair(acc, t, dy3, drow, p2, buf, row, col, 2, kk)
                                p2 += 2
                            for p in range(p2, out_width):
                                _cl_grad_pixel(acc, t, m, dy3, drow, p, buf, row,
                                               p * stride[2] + t2 * dil[2], dil[2], kk)
                            t2 += m
            for t in range(acc.shape[0]):
                for k in range(kk):
                    partial[job, c, t, k] = acc[t, k]
