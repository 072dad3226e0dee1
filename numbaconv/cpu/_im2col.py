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

import numba
import numpy as np
from numba import prange

from ..config import jit_options

_njit = numba.njit(**jit_options())
_inline = numba.njit(**jit_options(parallel=False), inline="always")


@_inline
def _valid(size, stride, dilation, before, tap, positions):
    """Output positions p in [lo, hi) whose input index p*stride - before + tap*dilation
    lies in [0, size)."""
    offset = tap * dilation - before
    # p*stride + offset >= 0  <=>  p >= ceil(-offset / stride)
    lo = -(offset // stride) if offset <= 0 else 0
    hi = (size - 1 - offset) // stride + 1 if size - 1 - offset >= 0 else 0
    return max(lo, 0), min(max(hi, 0), positions)


@_njit
def im2col_cf(x, col, n0, q0, q1, s, r, p, stride, dil, before):
    nb = col.shape[0]
    c_total = x.shape[1]
    taps = r[0] * r[1] * r[2]
    rows = c_total * taps
    for job in prange(nb * rows):
        b = job // rows
        row = job - b * rows
        c = row // taps
        t = row - c * taps
        t0 = t // (r[1] * r[2])
        t1 = (t // r[2]) % r[1]
        t2 = t % r[2]
        lo2, hi2 = _valid(s[2], stride[2], dil[2], before[2], t2, p[2])
        n = n0 + b
        for q in range(q0, q1):
            p0 = q // p[1]
            p1 = q - p0 * p[1]
            base = (q - q0) * p[2]
            i0 = p0 * stride[0] - before[0] + t0 * dil[0]
            i1 = p1 * stride[1] - before[1] + t1 * dil[1]
            if i0 < 0 or i0 >= s[0] or i1 < 0 or i1 >= s[1]:
                for p2 in range(p[2]):
                    col[b, row, base + p2] = 0
                continue
            col[b, row, base:base + lo2] = 0
            offset = t2 * dil[2] - before[2]
            if stride[2] == 1:  # a contiguous run: a slice copy vectorises
                col[b, row, base + lo2:base + hi2] = x[n, c, i0, i1, lo2 + offset:hi2 + offset]
            else:
                for p2 in range(lo2, hi2):
                    col[b, row, base + p2] = x[n, c, i0, i1, p2 * stride[2] + offset]
            col[b, row, base + hi2:base + p[2]] = 0


@_njit
def im2col_cl(x, col, n0, q0, q1, groups, s, r, p, stride, dil, before):
    """col: (nb * (q1 - q0) * P2, G, taps, Cg)."""
    c_total = x.shape[4]
    cg = c_total // groups
    nrows = q1 - q0
    nb = col.shape[0] // (nrows * p[2])
    for job in prange(nb * nrows):
        b = job // nrows
        q = q0 + job - b * nrows
        p0 = q // p[1]
        p1 = q - p0 * p[1]
        n = n0 + b
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


@_njit
def col2im_cf(dcol, dx, n0, q0, q1, s, r, p, stride, dil, before):
    """dx[n, c, i0, i1, :] += every packed value whose window reads it (dcol as im2col_cf).

    Parallel over input rows (n, c, i0, i1); each job writes only its own row.
    """
    nb = dcol.shape[0]
    c_total = dx.shape[1]
    taps = r[0] * r[1] * r[2]
    jobs = nb * c_total * s[0] * s[1]
    for job in prange(jobs):
        i1 = job % s[1]
        rest = job // s[1]
        i0 = rest % s[0]
        rest //= s[0]
        c = rest % c_total
        b = rest // c_total
        n = n0 + b
        for t0 in range(r[0]):
            num0 = i0 + before[0] - t0 * dil[0]
            if num0 < 0 or num0 % stride[0] != 0:
                continue
            p0 = num0 // stride[0]
            if p0 >= p[0]:
                continue
            for t1 in range(r[1]):
                num1 = i1 + before[1] - t1 * dil[1]
                if num1 < 0 or num1 % stride[1] != 0:
                    continue
                p1 = num1 // stride[1]
                if p1 >= p[1]:
                    continue
                q = p0 * p[1] + p1
                if q < q0 or q >= q1:
                    continue
                base = (q - q0) * p[2]
                for t2 in range(r[2]):
                    row = c * taps + (t0 * r[1] + t1) * r[2] + t2
                    lo2, hi2 = _valid(s[2], stride[2], dil[2], before[2], t2, p[2])
                    offset = t2 * dil[2] - before[2]
                    if stride[2] == 1:  # contiguous: a slice add vectorises
                        dx[n, c, i0, i1, lo2 + offset:hi2 + offset] += \
                            dcol[b, row, base + lo2:base + hi2]
                    else:
                        for p2 in range(lo2, hi2):
                            dx[n, c, i0, i1, p2 * stride[2] + offset] += dcol[b, row,
                                                                               base + p2]


@_njit
def col2im_cl(dcol, dx, n0, q0, q1, groups, s, r, p, stride, dil, before):
    """dx[n, i0, i1, :, :] += packed values (dcol as im2col_cl); parallel over input rows."""
    c_total = dx.shape[4]
    cg = c_total // groups
    nrows = q1 - q0
    nb = dcol.shape[0] // (nrows * p[2])
    for job in prange(nb * s[0] * s[1]):
        i1 = job % s[1]
        rest = job // s[1]
        i0 = rest % s[0]
        b = rest // s[0]
        n = n0 + b
        for t0 in range(r[0]):
            num0 = i0 + before[0] - t0 * dil[0]
            if num0 < 0 or num0 % stride[0] != 0:
                continue
            p0 = num0 // stride[0]
            if p0 >= p[0]:
                continue
            for t1 in range(r[1]):
                num1 = i1 + before[1] - t1 * dil[1]
                if num1 < 0 or num1 % stride[1] != 0:
                    continue
                p1 = num1 // stride[1]
                if p1 >= p[1]:
                    continue
                q = p0 * p[1] + p1
                if q < q0 or q >= q1:
                    continue
                mrow = (b * nrows + q - q0) * p[2]
                for t2 in range(r[2]):
                    t = (t0 * r[1] + t1) * r[2] + t2
                    lo2, hi2 = _valid(s[2], stride[2], dil[2], before[2], t2, p[2])
                    offset = t2 * dil[2] - before[2]
                    for p2 in range(lo2, hi2):
                        i2 = p2 * stride[2] + offset
                        for g in range(groups):
                            for c in range(cg):
                                dx[n, i0, i1, i2, g * cg + c] += dcol[mrow + p2, g, t, c]


@_njit
def zero_rows(a):
    """a[...] = 0 in parallel over the first axis (np.zeros_like is single-threaded)."""
    flat = a.reshape(a.shape[0], -1)
    for i in prange(flat.shape[0]):
        flat[i, :] = 0
