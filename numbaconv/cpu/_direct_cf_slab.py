"""The ``direct`` algorithm's channels-first kernels for any geometry (see :mod:`._direct`): a
padded slab of rows, split by stride phase, so that every tap is one contiguous shift of a
flat array.
"""

from __future__ import annotations

import numpy as np
from numba import prange, uint64

from ..config import inline_jit, parallel_jit


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
def _cf_fill(buf, src, n, ch, a0, row0, nrows, size, spread, before, s1, s2, zero):
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
    b1, u1, n1 = before[1], spread[1], size[1]
    b2, u2, n2 = before[2], spread[2], size[2]
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
def _cf_conv(src, wsrc, dst, per_group, add, out, size, spread, before, stride, dil, r,
             rows, chunks, zero, first_job, last_job):
    """Channels-first forward-form convolution, plane by plane.

    src (N, Cs, A0, A1, A2); wsrc (O, J, taps); dst (N, O, O0, O1, O2). Output plane o sums
    its J source planes (o // per_group) * J + j, each with kernel wsrc[o, j]. ``add``
    adds into dst (the data gradient with accumulation); otherwise dst is overwritten.
    The jobs (image, output plane, depth, block of ``rows`` rows) [first_job, last_job) run,
    dealt in runs to ``chunks`` parallel jobs, each allocating its buffers once.
    """
    o_total = dst.shape[1]
    jn = wsrc.shape[1]
    out_depth, out_height, out_width = out[0], out[1], out[2]
    s1, s2 = stride[1], stride[2]
    m2 = ((out_width - 1) * s2 + (r[2] - 1) * dil[2] + s2) // s2
    m1 = ((rows - 1) * s1 + (r[1] - 1) * dil[1] + s1) // s1
    blocks = (out_height + rows - 1) // rows
    jobs = last_job - first_job
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
        start = first_job + chunk * jobs // chunks
        # (n, o, o0, blk) of the chunk's first job, then counted up like an odometer.
        blk = start % blocks
        rest = start // blocks
        o0 = rest % out_depth
        rest //= out_depth
        o = rest % o_total
        n = rest // o_total
        for _ in range(start, first_job + (chunk + 1) * jobs // chunks):
            pa = blk * rows
            nr = min(rows, out_height - pa)
            q = (nr - 1) * m2 + out_width
            hb = (nr - 1) * s1 + (r[1] - 1) * dil[1] + 1
            first = True
            for j in range(jn):
                for t0 in range(r[0]):
                    num0 = o0 * stride[0] + t0 * dil[0] - before[0]
                    a0 = num0
                    if spread[0] != 1:
                        a0 = num0 // spread[0]
                    if num0 < 0 or num0 - a0 * spread[0] != 0 or a0 >= size[0]:
                        continue  # a plane of zeros: the weights are finite
                    _cf_fill(buf, src, n, (o // per_group) * jn + j, a0, pa * s1, hb,
                             size, spread, before, s1, s2, zero)
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
                        for m in range(out_width):
                            dst[n, o, o0, pa + i, m] = 0
            elif add:
                for i in range(nr):
                    for m in range(out_width):
                        dst[n, o, o0, pa + i, m] += yb[i, m]
            else:
                for i in range(nr):
                    for m in range(out_width):
                        dst[n, o, o0, pa + i, m] = yb[i, m]
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
def _cf_weight_partials(x, dy, partial, per_group, out, size, before, stride, dil, r, rows,
                        chunks, zero, first_job, last_job):
    """partial[job, j, t]: weight gradient of one job (image, output plane, rows), CF.

    x (N, C, S0, S1, S2); dy (N, K, P0, P1, P2); output plane k pairs with the J source planes
    (k // per_group) * J + j. dy is copied into the slab's pitch, spare columns zero; a plane
    whose values are not all finite is summed row by row instead, without the spare columns,
    so that nothing is multiplied that the reference does not multiply. Jobs [first_job,
    last_job) run, as in :func:`_cf_conv`.
    """
    o_total = dy.shape[1]
    jn, taps = partial.shape[1], partial.shape[2]
    out_depth, out_height, out_width = out[0], out[1], out[2]
    s1, s2 = stride[1], stride[2]
    m2 = ((out_width - 1) * s2 + (r[2] - 1) * dil[2] + s2) // s2
    m1 = ((rows - 1) * s1 + (r[1] - 1) * dil[1] + s1) // s1
    blocks = (out_height + rows - 1) // rows
    jobs = last_job - first_job
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
        start = first_job + chunk * jobs // chunks
        blk = start % blocks
        rest = start // blocks
        o0 = rest % out_depth
        rest //= out_depth
        o = rest % o_total
        n = rest // o_total
        for job in range(start, first_job + (chunk + 1) * jobs // chunks):
            pa = blk * rows
            nr = min(rows, out_height - pa)
            q = (nr - 1) * m2 + out_width
            hb = (nr - 1) * s1 + (r[1] - 1) * dil[1] + 1
            for i in range(nr):
                for m in range(out_width):
                    dyb[i, m] = dy[n, o, o0, pa + i, m]
                for m in range(m2 - out_width):
                    dyb[i, out_width + m] = 0
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
                                a = flat[plane[i],
                                         offset[i] + p1 * m2:offset[i] + p1 * m2 + out_width]
                                for m in range(out_width):
                                    total += d[m] * a[m]
                            acc[t0 * t12 + i] = total
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
