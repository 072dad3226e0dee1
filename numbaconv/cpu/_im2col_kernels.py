"""Packing kernels: im2col (gather windows into a matrix) and col2im (scatter them back).

A tile is ``nb`` consecutive images starting at ``n0``, restricted to output rows ``q`` in
``[q0, q1)``, where an output row is one ``(p0, p1)`` pair (``q = p0 * P1 + p1``) holding ``P2``
positions. Packed layouts, by data layout:

- channels-first: ``col[b, c * taps + t, (q - q0) * P2 + p2]``; a (C * taps, positions)
  matrix per image, the right operand of ``W (K, C * taps) @ col``.
- channels-last: ``col[(b * rows + q - q0) * P2 + p2, g, t, c]``: a (positions, G * taps * Cg)
  matrix for the whole tile, the left operand of ``col @ W'``.

Geometry arguments are int64 arrays of three: size s, kernel r, output p, stride, dilation,
padding before. Index arithmetic is int64 throughout.
"""

from __future__ import annotations

import numpy as np
from numba import prange, uint64

from ..config import inline_jit, parallel_jit, serial_jit
from ._rows import copy_run, zero_run

#: Job- and row-level helpers are called (``serial_jit``), not inlined: inlined into the
#: kernels' parallel loops they compile slower and run no faster (docs/cpu-algorithms.md,
#: "Compile times").


@inline_jit
def _valid(size, stride, dilation, before, tap, positions):
    """Output positions p in [lo, hi) whose input index p*stride - before + tap*dilation
    lies in [0, size)."""
    offset = tap * dilation - before
    # p*stride + offset >= 0  <=>  p >= ceil(-offset / stride)
    lo = -(offset // stride) if offset <= 0 else 0
    hi = (size - 1 - offset) // stride + 1 if size - 1 - offset >= 0 else 0
    # 0 <= lo <= hi <= positions even when no position is valid: callers slice and loop
    # with these bounds (lo > hi once made a slice of x wrap around to the row's end).
    lo = min(max(lo, 0), positions)
    return lo, min(max(hi, lo), positions)


@inline_jit
def _copy_row_runs(xf, plane, cf, line, q0, q1, t0, t1, t2, lo2, hi2, s, p, dil, before,
                   stride0):
    """cf[line + (q - q0) * P2 + p2] = x[plane + (i0, p1 + off1, p2 + off2)] (zero outside),
    for stride 1 in dimensions 1 and 2 and P2 == S2, x and the packed rows flat (``plane``:
    x's offset of the image and channel): per run of rows q sharing p0 (one input plane
    i0), one contiguous copy, then the fringe columns zeroed. Unsigned indices (so that the
    loops vectorise) and no slices (each one touches the array's reference count, which
    cost as much as the copy on 7x7 planes)."""
    off1 = t1 * dil[1] - before[1]
    off2 = t2 * dil[2] - before[2]
    width = p[2]
    area = s[1] * s[2]
    q = q0
    while q < q1:
        p0 = q // p[1]
        pa = q - p0 * p[1]
        pb = min(p[1], pa + q1 - q)            # rows [pa, pb) of output plane p0
        out = line + (q - q0) * width
        size = (pb - pa) * width
        i0 = p0 * stride0 - before[0] + t0 * dil[0]
        va = max(pa, -off1)
        vb = max(va, min(pb, s[1] - off1))     # rows whose input row exists
        if i0 < 0 or i0 >= s[0] or va >= vb:
            zero_run(cf, out, size)
        else:
            zero_run(cf, out, (va - pa) * width)
            zero_run(cf, out + (vb - pa) * width, size - (vb - pa) * width)
            rows = out + (va - pa) * width
            # From the input plane i0, the first copied element at (va + off1, off2).
            _clipped_copy(cf, rows, xf, plane + i0 * area, (va + off1) * width + off2,
                          (vb - va) * width, area)
            _zero_fringes(cf, rows, vb - va, width, lo2, hi2)
        q += pb - pa


@inline_jit
def _clipped_copy(cf, out, src, base, first, count, limit):
    """cf[out + k] = src[base + first + k] for k < count where 0 <= first + k < limit: a
    run of whole rows shifted by a tap, whose ends, outside the source, are fringe columns
    that the caller zeroes (:func:`_zero_fringes`)."""
    lo = max(0, -first)
    hi = max(lo, min(count, limit - first))
    copy_run(src, base + first + lo, cf, out + lo, hi - lo)


@inline_jit
def _zero_fringes(cf, out, rows, width, lo2, hi2):
    """Zero columns [0, lo2) and [hi2, width) of ``rows`` packed rows from ``out`` (the
    columns whose tap falls outside the input)."""
    for v in range(rows):
        zero_run(cf, out + v * width, lo2)
        zero_run(cf, out + v * width + hi2, width - hi2)


@inline_jit
def _split_row(ph, at, pitch, xf, fs, size, step):
    """ph[at + a * pitch + j] = xf[fs + a + step * j] for the stride phases a < step of one
    input row of ``size`` values (its j < ceil((size - a) / step))."""
    for a in range(step):
        fd = uint64(at + a * pitch)
        for j in range(uint64((size - a + step - 1) // step)):
            ph[fd + j] = xf[uint64(fs + a) + uint64(step) * j]


@inline_jit
def _packed_at(row, b, nb, rows, rows_first, length):
    """Offset of packed row ``row`` of tile image ``b`` in the flat col of im2col_cf:
    (nb, rows, length), or (rows, nb, length) when ``rows_first``."""
    return ((row * nb + b) if rows_first else (b * rows + row)) * length


@parallel_jit
def im2col_cf(x, col, rows_first, n0, c0, q0, q1, s, r, p, stride, dil, before):
    """col: (nb, C' * taps, positions), or (C' * taps, nb, positions) when ``rows_first``,
    for the C' channels from ``c0`` (C' from col's shape)."""
    nb = col.shape[1] if rows_first else col.shape[0]
    c_total = x.shape[1]
    taps = r[0] * r[1] * r[2]
    rows = col.shape[0] if rows_first else col.shape[1]
    cc = rows // taps
    # Stride 1 along the last two dimensions and output rows as long as input rows: each
    # tap's rows are one contiguous run of the input plane (then the fringe columns are
    # zeroed); otherwise row by row. A job per image and channel: the index arithmetic of
    # a job per packed row (eight integer divisions) cost as much as a 7x7 row's copy. (One
    # parallel loop: each costs seconds of compilation.)
    runs = stride[1] == 1 and stride[2] == 1 and p[2] == s[2]
    xf = x.reshape(-1)
    cf = col.reshape(-1)
    length = col.shape[2]
    volume = s[0] * s[1] * s[2]
    for job in prange(nb * cc):
        b = job // cc
        c = job - b * cc
        plane = ((n0 + b) * c_total + c0 + c) * volume
        t = 0
        for t0 in range(r[0]):
            for t1 in range(r[1]):
                for t2 in range(r[2]):
                    lo2, hi2 = _valid(s[2], stride[2], dil[2], before[2], t2, p[2])
                    at = _packed_at(c * taps + t, b, nb, rows, rows_first, length)
                    if runs:
                        _copy_row_runs(xf, plane, cf, at, q0, q1, t0, t1, t2, lo2, hi2, s,
                                       p, dil, before, stride[0])
                    else:
                        first = lo2 * stride[2] + t2 * dil[2] - before[2]  # input of lo2
                        _fill_rows(cf, at, xf, plane + first, s[2], 0, stride[2], q0, q1,
                                   t0, t1, lo2, hi2, s, p, stride, dil, before)
                    t += 1


@inline_jit
def _fill_rows(cf, line, src, start, pitch, row0, step, q0, q1, t0, t1, lo2, hi2, s, p,
               stride, dil, before):
    """One packed row of im2col_cf, flat at ``cf[line:]``, output rows q0..q1 of tap (t0, t1,
    t2): output p2 in [lo2, hi2) reads src[start + (i0 * S1 + i1 - row0) * pitch + (p2 - lo2)
    * step], zero elsewhere and where (i0, i1) falls outside the input. Unsigned indices and
    no slices or per-row divisions (see _copy_row_runs)."""
    width = p[2]
    count = hi2 - lo2
    p0a = q0 // p[1]
    for p0 in range(p0a, (q1 - 1) // p[1] + 1):
        i0 = p0 * stride[0] - before[0] + t0 * dil[0]
        for p1 in range(max(q0 - p0 * p[1], 0), min(q1 - p0 * p[1], p[1])):
            out = line + (p0 * p[1] + p1 - q0) * width
            i1 = p1 * stride[1] - before[1] + t1 * dil[1]
            if i0 < 0 or i0 >= s[0] or i1 < 0 or i1 >= s[1] or count <= 0:
                zero_run(cf, out, width)
                continue
            zero_run(cf, out, lo2)
            fd = uint64(out + lo2)
            fs = uint64(start + (i0 * s[1] + i1 - row0) * pitch)
            if step == 1:   # a contiguous run (the phased kernel's rows): it vectorises
                for k in range(uint64(count)):
                    cf[fd + k] = src[fs + k]
            else:
                for k in range(uint64(count)):
                    cf[fd + k] = src[fs + k * uint64(step)]
            zero_run(cf, out + hi2, width - hi2)


@parallel_jit
def im2col_cf_phased(x, col, rows_first, n0, c0, q0, q1, s, r, p, stride, dil, before):
    """im2col_cf for a stride above 1 in the last dimension: each job, one (image, channel),
    first splits the input rows that the tile's windows read by stride phase along that
    dimension (ph[a, i0 * S1 + i1 - lo, j] = x[..., i0, i1, a + stride * j]), so that every
    tap's output row is one contiguous run of a phase row instead of a strided gather (one
    thread: the 7x7 stem's half-image row tiles pack in 0.28 ms instead of 0.82). The
    channels from ``c0``, as many as col holds rows for."""
    nb = col.shape[1] if rows_first else col.shape[0]
    c_total = x.shape[1]
    cc = (col.shape[0] if rows_first else col.shape[1]) // (r[0] * r[1] * r[2])
    step = stride[2]
    width = p[2]
    w2 = (s[2] + step - 1) // step
    lo, hi = _input_rows(q0, q1, s, r, p, stride, dil, before)
    xf = x.reshape(-1)
    cf = col.reshape(-1)
    length = col.shape[2]
    # 2D planes whose output rows are as wide as a column phase: _phase_planes (one parallel
    # loop for both kinds of job: each loop costs seconds of compilation).
    planes = s[0] == 1 and r[0] == 1 and p[0] == 1 and before[0] == 0 and width == w2
    span = max(hi - lo, 1) * w2                 # one phase's rows
    taps = _plane_taps(planes, q0, q1, lo, s, r, p, stride, dil, before)
    for job in prange(nb * cc):
        if planes:
            _phase_planes(xf, cf, rows_first, nb, c_total, c0, cc, length, n0, job, q0, q1,
                          lo, hi, s, r, stride, taps)
        else:
            _phase_rows(xf, cf, rows_first, nb, c_total, c0, cc, length, n0, job, q0, q1, lo,
                        hi, span, s, r, p, stride, dil, before)


@serial_jit
def _phase_rows(xf, cf, rows_first, nb, c_total, c0, cc, length, n0, job, q0, q1, lo, hi,
                span, s, r, p, stride, dil, before):
    """im2col_cf_phased's job (image, channel) in general: its input rows [lo, hi) split by
    column phase, then each tap's output rows copied one by one from them."""
    taps = r[0] * r[1] * r[2]
    step = stride[2]
    width = p[2]
    w2 = (s[2] + step - 1) // step
    b = job // cc
    c = job - b * cc
    plane = ((n0 + b) * c_total + c0 + c) * s[0] * s[1] * s[2]
    ph = np.empty(step * span, cf.dtype)
    for i01 in range(lo, hi):
        _split_row(ph, (i01 - lo) * w2, span, xf, plane + i01 * s[2], s[2], step)
    t = 0
    for t0 in range(r[0]):
        for t1 in range(r[1]):
            for t2 in range(r[2]):
                lo2, hi2 = _valid(s[2], step, dil[2], before[2], t2, width)
                off2 = t2 * dil[2] - before[2]
                a2 = off2 % step
                first = lo2 + (off2 - a2) // step       # phase index of output lo2
                at = _packed_at(c * taps + t, b, nb, cc * taps, rows_first, length)
                _fill_rows(cf, at, ph, a2 * span + first, w2, lo, 1, q0, q1, t0, t1, lo2,
                           hi2, s, p, stride, dil, before)
                t += 1


@serial_jit
def _plane_taps(planes, q0, q1, lo, s, r, p, stride, dil, before):
    """What _phase_planes' jobs need of each tap t, the same for every job of a call (their
    divisions, made once, cost as much as the copies on ResNet's stride-2 layers):
    taps[t] = (va, vb, lo2, hi2, start), output rows [va, vb) inside the input, columns
    [lo2, hi2), phase-plane value ``start`` copied to output (va, 0)."""
    taps = np.zeros((r[1] * r[2] if planes else 0, 5), np.int64)
    if not planes:
        return taps
    st1, st2 = stride[1], stride[2]
    w2 = p[2]
    j1lo = lo // st1
    h1 = max((_input_rows(q0, q1, s, r, p, stride, dil, before)[1] + st1 - 1) // st1 - j1lo,
             1)
    area = h1 * w2                                    # one phase plane
    for t in range(taps.shape[0]):
        t1 = t // r[2]
        t2 = t - t1 * r[2]
        lo1, hi1 = _valid(s[1], st1, dil[1], before[1], t1, p[1])
        lo2, hi2 = _valid(s[2], st2, dil[2], before[2], t2, w2)
        off1 = t1 * dil[1] - before[1]
        off2 = t2 * dil[2] - before[2]
        a1 = off1 % st1
        a2 = off2 % st2
        e1 = (off1 - a1) // st1                   # output (p1, p2) reads phase pixel
        e2 = (off2 - a2) // st2                   # (p1 + e1, p2 + e2)
        va, vb = max(q0, lo1), min(q1, hi1)
        if va >= vb or lo2 >= hi2:
            va, vb = q1, q1
        taps[t, 0] = va
        taps[t, 1] = vb
        taps[t, 2] = lo2
        taps[t, 3] = hi2
        taps[t, 4] = (a1 * st2 + a2) * area + (va + e1 - j1lo) * w2 + e2
    return taps


@serial_jit
def _phase_planes(xf, cf, rows_first, nb, c_total, c0, cc, length, n0, job, q0, q1, lo, hi,
                  s, r, stride, taps):
    """im2col_cf_phased's job (image, channel) for 2D planes whose output rows are as wide
    as a column phase (ResNet's stride-2 layers, the stem): it splits its input rows [lo,
    hi) by both phases, ``ph[a1, a2, j1, j2] = x[..., a1 + stride1 * j1, a2 + stride2 *
    j2]``. Output pixel (p1, p2) of a tap then reads phase pixel (p1 + e1, p2 + e2) of one
    phase plane, a fixed shift of its own index: the tile's rows are one contiguous copy per
    tap (``taps``, from :func:`_plane_taps`), the few columns and rows that fall outside the
    input zeroed after it (14-pixel rows copied one by one cost four times as much). No
    division in the job's loops."""
    st1, st2 = stride[1], stride[2]
    w2 = (s[2] + st2 - 1) // st2
    j1lo = lo // st1                                  # phase rows kept: [j1lo, j1lo + h1)
    h1 = max((hi + st1 - 1) // st1 - j1lo, 1)
    area = h1 * w2                                    # one phase plane
    size = st1 * st2 * area
    b = job // cc
    c = job - b * cc
    plane = ((n0 + b) * c_total + c0 + c) * s[1] * s[2]
    ph = np.empty(size, cf.dtype)
    full = s[2] - (w2 - 1) * st2                      # column phases a2 < full hold w2
    a1 = lo % st1                                     # input row lo's phase and phase row
    j1 = lo // st1 - j1lo
    for i1 in range(lo, hi):
        at = (a1 * st2 * h1 + j1) * w2
        src = plane + i1 * s[2]
        for a2 in range(st2):
            fd = uint64(at + a2 * area)
            fs = uint64(src + a2)
            for j in range(uint64(w2 if a2 < full else w2 - 1)):
                ph[fd + j] = xf[fs + uint64(st2) * j]
        a1 += 1
        if a1 == st1:
            a1 = 0
            j1 += 1
    count = taps.shape[0]
    for t in range(count):
        va, vb, lo2, hi2 = taps[t, 0], taps[t, 1], taps[t, 2], taps[t, 3]
        out = _packed_at(c * count + t, b, nb, cc * count, rows_first, length)
        zero_run(cf, out, (va - q0) * w2)
        zero_run(cf, out + (vb - q0) * w2, (q1 - vb) * w2)
        # One copy of rows [va, vb) from their phase plane, then their fringe columns.
        rows = out + (va - q0) * w2
        _clipped_copy(cf, rows, ph, 0, taps[t, 4], (vb - va) * w2, size)
        _zero_fringes(cf, rows, vb - va, w2, lo2, hi2)


@inline_jit
def _input_rows(q0, q1, s, r, p, stride, dil, before):
    """[lo, hi): the input rows i0 * S1 + i1 (clipped to the input) that output rows q0..q1
    read, a superset when the tile spans several p0 (then every i1)."""
    p0a = q0 // p[1]
    p0b = (q1 - 1) // p[1]
    i0a = max(p0a * stride[0] - before[0], 0)
    i0b = min(p0b * stride[0] - before[0] + (r[0] - 1) * dil[0], s[0] - 1)
    if p0a == p0b:
        i1a = max((q0 - p0a * p[1]) * stride[1] - before[1], 0)
        i1b = min((q1 - 1 - p0a * p[1]) * stride[1] - before[1] + (r[1] - 1) * dil[1],
                  s[1] - 1)
    else:
        i1a = 0
        i1b = s[1] - 1
    if i0a > i0b or i1a > i1b:
        return 0, 0
    return i0a * s[1] + i1a, i0b * s[1] + i1b + 1


@inline_jit
def _copy_window_runs(xflat, cflat, n, p0, p1, m0, row_length, c_total, s0, s1, s2, r0, r1,
                      r2, width, st0, st1, st2, d0, d1, b0, b1, b2):
    """im2col_cl's undilated single-group case for one output row (p0, p1): each (t0, t1)
    copies one run of r2 * C values. Scalars, not the geometry arrays, and loops over
    zero-based views: with slice assignment, or loops indexing the flat arrays at offsets,
    the stem's runs of 21 values took 5 times as long."""
    run = r2 * c_total
    for p2 in range(width):
        m = m0 + p2
        first = p2 * st2 - b2                   # i2 of tap t2 = 0
        lo = max(0, -first)
        hi = max(lo, min(r2, s2 - first))
        for t0 in range(r0):
            i0 = p0 * st0 - b0 + t0 * d0
            for t1 in range(r1):
                i1 = p1 * st1 - b1 + t1 * d1
                d = m * row_length + (t0 * r1 + t1) * run
                dst = cflat[d:d + run]
                if i0 < 0 or i0 >= s0 or i1 < 0 or i1 >= s1 or lo >= hi:
                    for k in range(run):
                        dst[k] = 0
                    continue
                src = (((n * s0 + i0) * s1 + i1) * s2 + first) * c_total
                for k in range(lo * c_total):
                    dst[k] = 0
                inner = dst[lo * c_total:hi * c_total]
                values = xflat[src + lo * c_total:src + hi * c_total]
                for k in range(inner.shape[0]):
                    inner[k] = values[k]
                for k in range(hi * c_total, run):
                    dst[k] = 0


@parallel_jit
def im2col_cl(x, col, n0, q0, q1, groups, s, r, p, stride, dil, before):
    """col: (nb * (q1 - q0) * P2, G, taps, Cg)."""
    c_total = x.shape[4]
    cg = c_total // groups
    nrows = q1 - q0
    nb = col.shape[0] // (nrows * p[2])
    # One group, undilated last dimension: the taps t2 of one (t0, t1) read a contiguous
    # run of r2 * C values of x and fill a contiguous run of col (ResNet's 3x3: 192 values
    # per copy for 64 channels, the stem's 7x7 on 3 channels: 21 instead of 7 copies of 3).
    runs = groups == 1 and dil[2] == 1
    row_length = groups * r[0] * r[1] * r[2] * cg
    cflat = col.reshape(-1)
    xflat = x.reshape(-1)
    for job in prange(nb * nrows):
        b = job // nrows
        q = q0 + job - b * nrows
        p0 = q // p[1]
        p1 = q - p0 * p[1]
        n = n0 + b
        if runs:
            _copy_window_runs(xflat, cflat, n, p0, p1, job * p[2], row_length, c_total,
                              s[0], s[1], s[2], r[0], r[1], r[2], p[2], stride[0],
                              stride[1], stride[2], dil[0], dil[1], before[0], before[1],
                              before[2])
            continue
        for p2 in range(p[2]):
            m = job * p[2] + p2
            t = 0
            for t0 in range(r[0]):
                i0 = p0 * stride[0] - before[0] + t0 * dil[0]
                for t1 in range(r[1]):
                    i1 = p1 * stride[1] - before[1] + t1 * dil[1]
                    for t2 in range(r[2]):
                        i2 = p2 * stride[2] - before[2] + t2 * dil[2]
                        inside = (0 <= i0 < s[0]) and (0 <= i1 < s[1]) and (0 <= i2 < s[2])
                        for g in range(groups):
                            if inside:
                                for c in range(cg):
                                    col[m, g, t, c] = x[n, i0, i1, i2, g * cg + c]
                            else:
                                for c in range(cg):
                                    col[m, g, t, c] = 0
                        t += 1


@serial_jit
def _window_rows(size, taps, stride, dil, before, positions):
    """which[i, t]: the output index whose tap t reads input index i, or -1 (a table, so
    that the integer divisions are not redone for every row)."""
    which = np.full((size, taps), -1, np.int64)
    for i in range(size):
        for t in range(taps):
            num = i + before - t * dil
            if num >= 0 and num % stride == 0 and num // stride < positions:
                which[i, t] = num // stride
    return which


@parallel_jit
def col2im_cf(dcol, dx, n0, q0, q1, s, r, p, stride, dil, before):
    """dx[n, c, i0, i1, :] += every packed value whose window reads it (dcol as im2col_cf).

    Parallel over input rows (n, c, i0); each job writes only its own rows. With a stride
    above 1 along rows, a row's sums are gathered by stride phase first (``ph[a, j]`` for
    column ``a + stride * j``), where each tap adds a contiguous run, then added into the
    row in one pass. The rows' geometry comes from tables made once (integer divisions for
    every row and tap took most of the time), the loops use flat indices and no slices (dx
    is shared by the tile workers, and a slice of it touches its reference count: see
    ``_direct``).
    """
    nb = dcol.shape[0]
    c_total = dx.shape[1]
    taps = r[0] * r[1] * r[2]
    length = dcol.shape[2]
    step = stride[2]
    w2 = (s[2] + step - 1) // step
    src = dcol.reshape(-1)
    dst = dx.reshape(-1)
    p0_of = _window_rows(s[0], r[0], stride[0], dil[0], before[0], p[0])
    p1_of = _window_rows(s[1], r[1], stride[1], dil[1], before[1], p[1])
    # Per tap t2: the first output lo2 it reaches, how many, and where they add (in the row,
    # or in its phase buffer).
    lo2s = np.empty(r[2], np.int64)
    counts = np.empty(r[2], np.int64)
    targets = np.empty(r[2], np.int64)
    for t2 in range(r[2]):
        lo2, hi2 = _valid(s[2], step, dil[2], before[2], t2, p[2])
        first = lo2 * step + t2 * dil[2] - before[2]          # dx index of lo2
        lo2s[t2], counts[t2] = lo2, hi2 - lo2
        targets[t2] = first if step == 1 else (first % step) * w2 + first // step
    for job in prange(nb * c_total * s[0]):
        i0 = job % s[0]
        rest = job // s[0]
        c = rest % c_total
        b = rest // c_total
        n = n0 + b
        ph = np.empty(step * w2 if step > 1 else 1, dx.dtype)
        for i1 in range(s[1]):
            line = (((n * c_total + c) * s[0] + i0) * s[1] + i1) * s[2]
            touched = False
            for t0 in range(r[0]):
                p0 = p0_of[i0, t0]
                if p0 < 0:
                    continue
                for t1 in range(r[1]):
                    p1 = p1_of[i1, t1]
                    q = p0 * p[1] + p1
                    if p1 < 0 or q < q0 or q >= q1:
                        continue
                    if step > 1 and not touched:
                        for e in range(step * w2):
                            ph[e] = 0
                    touched = True
                    row = c * taps + (t0 * r[1] + t1) * r[2]
                    for t2 in range(r[2]):
                        # Unsigned indices: no negative-index wraparound, so the loops
                        # vectorise.
                        fa = uint64((b * dcol.shape[1] + row + t2) * length
                                    + (q - q0) * p[2] + lo2s[t2])
                        if step == 1:
                            fd = uint64(line + targets[t2])
                            for k in range(uint64(counts[t2])):
                                dst[fd + k] += src[fa + k]
                        else:
                            fd = uint64(targets[t2])
                            for k in range(uint64(counts[t2])):
                                ph[fd + k] += src[fa + k]
            if step > 1 and touched:
                for a in range(step):
                    fd, fp = uint64(line + a), uint64(a * w2)
                    for j in range(uint64((s[2] - a + step - 1) // step)):
                        dst[fd + j * uint64(step)] += ph[fp + j]


@parallel_jit
def col2im_cl(dcol, dx, n0, q0, q1, groups, s, r, p, stride, dil, before):
    """dx[n, i0, i1, :, :] += packed values (dcol as im2col_cl); parallel over input rows.

    A packed row holds its window's taps (g, t, c): with one group and no dilation along
    rows, the r2 taps of one (t0, t1) are r2 * C adjacent values, and they add into r2
    adjacent pixels of dx, one contiguous run per window (clipped at the row's ends);
    otherwise a run of Cg values per tap. Flat unsigned indices and tables of the rows'
    geometry, as col2im_cf: per-value 5D indexing left few channels (the stem's 3) to a
    scalar loop (figures: docs/cpu-algorithms.md, ``im2col``)."""
    c_total = dx.shape[4]
    cg = c_total // groups
    nrows = q1 - q0
    nb = dcol.shape[0] // (nrows * p[2])
    taps = r[0] * r[1] * r[2]
    width = groups * taps * cg                  # a packed row
    src = dcol.reshape(-1)
    dst = dx.reshape(-1)
    p0_of = _window_rows(s[0], r[0], stride[0], dil[0], before[0], p[0])
    p1_of = _window_rows(s[1], r[1], stride[1], dil[1], before[1], p[1])
    lo2s = np.empty(r[2], np.int64)
    hi2s = np.empty(r[2], np.int64)
    for t2 in range(r[2]):
        lo2s[t2], hi2s[t2] = _valid(s[2], stride[2], dil[2], before[2], t2, p[2])
    runs = groups == 1 and dil[2] == 1
    for job in prange(nb * s[0] * s[1]):
        i1 = job % s[1]
        rest = job // s[1]
        i0 = rest % s[0]
        b = rest // s[0]
        line = (((n0 + b) * s[0] + i0) * s[1] + i1) * s[2] * c_total
        for t0 in range(r[0]):
            p0 = p0_of[i0, t0]
            if p0 < 0:
                continue
            for t1 in range(r[1]):
                p1 = p1_of[i1, t1]
                q = p0 * p[1] + p1
                if p1 < 0 or q < q0 or q >= q1:
                    continue
                mrow = (b * nrows + q - q0) * p[2]
                tap_row = (t0 * r[1] + t1) * r[2]
                if runs:
                    for p2 in range(p[2]):
                        first = p2 * stride[2] - before[2]          # the pixel of tap 0
                        ta = max(0, -first)
                        tb = min(r[2], s[2] - first)
                        if ta >= tb:
                            continue
                        fs = uint64((mrow + p2) * width + (tap_row + ta) * cg)
                        fd = uint64(line + (first + ta) * c_total)
                        for k in range(uint64((tb - ta) * c_total)):
                            dst[fd + k] += src[fs + k]
                    continue
                for t2 in range(r[2]):
                    offset = t2 * dil[2] - before[2]
                    for p2 in range(lo2s[t2], hi2s[t2]):
                        i2 = p2 * stride[2] + offset
                        for g in range(groups):
                            fs = uint64((mrow + p2) * width + (g * taps + tap_row + t2) * cg)
                            fd = uint64(line + i2 * c_total + g * cg)
                            for c in range(uint64(cg)):
                                dst[fd + c] += src[fs + c]
