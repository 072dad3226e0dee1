"""The ``direct`` algorithm's channels-first kernels for stride 1 with output rows as wide as
the source's (see :mod:`._direct`): whole planes as flat runs over a guarded copy of the
source plane, and for depthwise ``same`` 3x3 planes vertical strips of adjacent columns
(:func:`_cf_same3`, :func:`_cf_same3_weight`).
"""

from __future__ import annotations

import numpy as np
from numba import prange, uint64

from ..config import inline_jit, parallel_jit
from ._microkernel import _at
from ._sliding import (conv3_lanes1, conv3_lanes2, conv3_lanes4, conv3_lanes8, conv3_lanes16,
                       grad3_lanes1, grad3_lanes2, grad3_lanes4, grad3_lanes8, grad3_lanes16)


@parallel_jit
def _cf_same3(src4, wb, dst4, height, width, chunks, lanes, first_plane, last_plane):
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
    window transposed (tap column major), each broadcast to a vector. The planes (image,
    channel, depth) [first_plane, last_plane) are dealt to ``chunks`` jobs, each allocating
    its buffer once. The callers check the geometry (:func:`._direct._same_planes`).
    """
    c_total, depth = src4.shape[1], src4.shape[2]
    pitch = width + 2
    per_chunk = (last_plane - first_plane + chunks - 1) // chunks
    for chunk in prange(chunks):
        buf = np.zeros((height, pitch), dst4.dtype)
        first = first_plane + chunk * per_chunk
        for plane in range(first, min(last_plane, first + per_chunk)):
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
def _cf_same3_weight(x4, dy4, dw, height, width, chunks, lanes, first_channel, last_channel):
    """dw[c, t]: the weight gradient of a depthwise 3x3 layer of ``same`` padding and stride
    1, channels-first, the taps in w's order: strips of adjacent columns walk down each
    plane (:func:`._sliding.grad3_row` turned on its side, as in :func:`_cf_same3`),
    ``lanes`` columns at a time, then 2 ** k fewer up to the row's end, each column's nine
    tap sums carried in a vector through all planes of a channel (images, then depth),
    then summed across the lanes: a fixed order, whatever the thread count.

    x4 and dy4 (N, C, P, height * width), C-contiguous; dw (C, 9), its rows [first_channel,
    last_channel) written, dealt to ``chunks`` jobs. Padding is multiplied (zeros around a
    copy of each plane), as the reference multiplies it.
    """
    n_total, c_total, depth = x4.shape[0], x4.shape[1], x4.shape[2]
    pitch = width + 2
    per_chunk = (last_channel - first_channel + chunks - 1) // chunks
    for chunk in prange(chunks):
        buf = np.zeros((height + 2, pitch), dw.dtype)
        acc = np.empty((9, lanes), dw.dtype)
        first = first_channel + chunk * per_chunk
        for c in range(first, min(last_channel, first + per_chunk)):
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
def _cf_flat_conv(src4, wsrc, dst4, per_group, add, mask, out, size, spread, before,
                  stride, dil, r, rows, chunks, zero, first_job, last_job):
    """Channels-first convolution, stride 1, output rows as wide as the source rows.

    src4 (N, Cs, A0, A1 * W); dst4 (N, O, O0, O1 * W); wsrc (O, J, taps); mask (r2, O1 * W):
    column q % W of tap column t2 reads inside the row. See _cf_conv for the rest.
    """
    o_total = dst4.shape[1]
    jn = wsrc.shape[1]
    out_depth, out_height = out[0], out[1]
    src_height, width = size[1], size[2]
    t12 = r[1] * r[2]
    guard = max(before[1] * width + before[2], 0)
    reach = max(((r[1] - 1) * dil[1] - before[1]) * width + (r[2] - 1) * dil[2] - before[2], 0)
    length = guard + max(out_height, src_height) * width + reach + width
    blocks = (out_height + rows - 1) // rows
    jobs = last_job - first_job
    for chunk in prange(chunks):
        xg = np.zeros(length, dst4.dtype)
        fo = np.empty(t12, np.int64)
        mo = np.empty(t12, np.int64)
        size9 = np.empty(t12, np.int64)
        w = np.empty(t12, dst4.dtype)
        _flat_plan(r, dil, before, width, fo, mo, size9)
        for i in range(t12):
            fo[i] += guard
        start = first_job + chunk * jobs // chunks
        blk = start % blocks
        rest = start // blocks
        o0 = rest % out_depth
        rest //= out_depth
        o = rest % o_total
        n = rest // o_total
        for _ in range(start, first_job + (chunk + 1) * jobs // chunks):
            pa = blk * rows
            pb = min(pa + rows, out_height)
            q0 = pa * width
            q = (pb - pa) * width
            # Source rows these output rows read (rows outside the plane stay guard zeros).
            lo = min(max(pa - before[1], 0), src_height)
            hi = min(max(pb - 1 - before[1] + (r[1] - 1) * dil[1] + 1, lo), src_height)
            first = True
            for j in range(jn):
                for t0 in range(r[0]):
                    num0 = o0 * stride[0] + t0 * dil[0] - before[0]
                    a0 = num0
                    if spread[0] != 1:
                        a0 = num0 // spread[0]
                    if num0 < 0 or num0 - a0 * spread[0] != 0 or a0 >= size[0]:
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
                if o0 == out_depth:
                    o0 = 0
                    o += 1
                    if o == o_total:
                        o = 0
                        n += 1


@parallel_jit
def _cf_flat_weight(x4, dy4, partial, per_group, mask, out, size, before, stride, dil, r, rows,
                    chunks, zero, first_job, last_job):
    """partial[job, j, t] for stride 1 and output rows as wide as x rows (see _cf_flat_conv).

    Padding is read as zeros and multiplied (rows from the guard, columns by the mask), as
    the reference multiplies it.
    """
    o_total = dy4.shape[1]
    jn, taps = partial.shape[1], partial.shape[2]
    out_depth, out_height = out[0], out[1]
    src_height, width = size[1], size[2]
    t12 = r[1] * r[2]
    guard = max(before[1] * width + before[2], 0)
    reach = max(((r[1] - 1) * dil[1] - before[1]) * width + (r[2] - 1) * dil[2] - before[2], 0)
    length = guard + max(out_height, src_height) * width + reach + width
    blocks = (out_height + rows - 1) // rows
    jobs = last_job - first_job
    for chunk in prange(chunks):
        xg = np.zeros(length, partial.dtype)
        fo = np.empty(t12, np.int64)
        mo = np.empty(t12, np.int64)
        size9 = np.empty(t12, np.int64)
        acc = np.empty(taps, partial.dtype)
        _flat_plan(r, dil, before, width, fo, mo, size9)
        for i in range(t12):
            fo[i] += guard
        start = first_job + chunk * jobs // chunks
        blk = start % blocks
        rest = start // blocks
        o0 = rest % out_depth
        rest //= out_depth
        o = rest % o_total
        n = rest // o_total
        for job in range(start, first_job + (chunk + 1) * jobs // chunks):
            pa = blk * rows
            pb = min(pa + rows, out_height)
            q0 = pa * width
            q = (pb - pa) * width
            lo = min(max(pa - before[1], 0), src_height)
            hi = min(max(pb - 1 - before[1] + (r[1] - 1) * dil[1] + 1, lo), src_height)
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
                if o0 == out_depth:
                    o0 = 0
                    o += 1
                    if o == o_total:
                        o = 0
                        n += 1
