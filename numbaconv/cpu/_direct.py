"""Direct (loop) kernels for grouped convolutions with few channels per group: depthwise above
all, where a GEMM has one-column matrices and packing costs more than the arithmetic.

Channels-first kernels run one job per row of the written tensor and vectorise along the
last spatial dim; channels-last kernels run one job per spatial row and vectorise along
channels. Weight gradients are deterministic: per-job partial sums over a fixed number of
chunks (independent of the thread count), added in order.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..config import jit_options
from ._im2col import _valid

_njit = numba.njit(**jit_options())

#: Chunks of the batch-and-rows reduction in channels-last weight gradients. Fixed, so the
#: summation order and hence the bits of the result do not depend on the thread count.
REDUCTION_CHUNKS = 32


@_njit
def _forward_cf(x, w, y, groups, s, r, p, stride, dil, before):
    n_total, k_total = y.shape[0], y.shape[1]
    kg = k_total // groups
    cg = w.shape[1]
    for job in prange(n_total * k_total * p[0] * p[1]):
        p1 = job % p[1]
        rest = job // p[1]
        p0 = rest % p[0]
        rest //= p[0]
        k = rest % k_total
        n = rest // k_total
        c0 = (k // kg) * cg
        for p2 in range(p[2]):
            y[n, k, p0, p1, p2] = 0
        for c in range(cg):
            for t0 in range(r[0]):
                i0 = p0 * stride[0] - before[0] + t0 * dil[0]
                if i0 < 0 or i0 >= s[0]:
                    continue
                for t1 in range(r[1]):
                    i1 = p1 * stride[1] - before[1] + t1 * dil[1]
                    if i1 < 0 or i1 >= s[1]:
                        continue
                    for t2 in range(r[2]):
                        lo, hi = _valid(s[2], stride[2], dil[2], before[2], t2, p[2])
                        offset = t2 * dil[2] - before[2]
                        wv = w[k, c, t0, t1, t2]
                        for p2 in range(lo, hi):
                            y[n, k, p0, p1, p2] += wv * x[n, c0 + c, i0, i1,
                                                         p2 * stride[2] + offset]


@_njit
def _forward_cl(x, wt, y, groups, s, r, p, stride, dil, before):
    """wt: (taps, Cg, K)."""
    n_total, k_total = y.shape[0], y.shape[4]
    kg = k_total // groups
    cg = wt.shape[1]
    for job in prange(n_total * p[0] * p[1]):
        p1 = job % p[1]
        rest = job // p[1]
        p0 = rest % p[0]
        n = rest // p[0]
        for p2 in range(p[2]):
            for k in range(k_total):
                y[n, p0, p1, p2, k] = 0
            t = 0
            for t0 in range(r[0]):
                i0 = p0 * stride[0] - before[0] + t0 * dil[0]
                for t1 in range(r[1]):
                    i1 = p1 * stride[1] - before[1] + t1 * dil[1]
                    for t2 in range(r[2]):
                        i2 = p2 * stride[2] - before[2] + t2 * dil[2]
                        if 0 <= i0 < s[0] and 0 <= i1 < s[1] and 0 <= i2 < s[2]:
                            for c in range(cg):
                                for k in range(k_total):
                                    y[n, p0, p1, p2, k] += wt[t, c, k] * x[
                                        n, i0, i1, i2, (k // kg) * cg + c]
                        t += 1


@_njit
def _dgrad_cf(dy, w, dx, groups, s, r, p, stride, dil, before):
    n_total, c_total = dx.shape[0], dx.shape[1]
    k_total = dy.shape[1]
    kg = k_total // groups
    cg = c_total // groups
    for job in prange(n_total * c_total * s[0] * s[1]):
        i1 = job % s[1]
        rest = job // s[1]
        i0 = rest % s[0]
        rest //= s[0]
        c = rest % c_total
        n = rest // c_total
        grp = c // cg
        cc = c - grp * cg
        for t0 in range(r[0]):
            num0 = i0 + before[0] - t0 * dil[0]
            if num0 < 0 or num0 % stride[0] != 0 or num0 // stride[0] >= p[0]:
                continue
            p0 = num0 // stride[0]
            for t1 in range(r[1]):
                num1 = i1 + before[1] - t1 * dil[1]
                if num1 < 0 or num1 % stride[1] != 0 or num1 // stride[1] >= p[1]:
                    continue
                p1 = num1 // stride[1]
                for t2 in range(r[2]):
                    lo, hi = _valid(s[2], stride[2], dil[2], before[2], t2, p[2])
                    offset = t2 * dil[2] - before[2]
                    for kk in range(kg):
                        k = grp * kg + kk
                        wv = w[k, cc, t0, t1, t2]
                        for p2 in range(lo, hi):
                            dx[n, c, i0, i1, p2 * stride[2] + offset] += wv * dy[
                                n, k, p0, p1, p2]


@_njit
def _dgrad_cl(dy, wt, dx, groups, s, r, p, stride, dil, before):
    """wt: (taps, Kg, C): wt[t, kk, c] = w[group(c) * Kg + kk, c % Cg, t]."""
    n_total, c_total = dx.shape[0], dx.shape[4]
    k_total = dy.shape[4]
    kg = k_total // groups
    cg = c_total // groups
    for job in prange(n_total * s[0] * s[1]):
        i1 = job % s[1]
        rest = job // s[1]
        i0 = rest % s[0]
        n = rest // s[0]
        for t0 in range(r[0]):
            num0 = i0 + before[0] - t0 * dil[0]
            if num0 < 0 or num0 % stride[0] != 0 or num0 // stride[0] >= p[0]:
                continue
            p0 = num0 // stride[0]
            for t1 in range(r[1]):
                num1 = i1 + before[1] - t1 * dil[1]
                if num1 < 0 or num1 % stride[1] != 0 or num1 // stride[1] >= p[1]:
                    continue
                p1 = num1 // stride[1]
                for t2 in range(r[2]):
                    t = (t0 * r[1] + t1) * r[2] + t2
                    lo, hi = _valid(s[2], stride[2], dil[2], before[2], t2, p[2])
                    offset = t2 * dil[2] - before[2]
                    for p2 in range(lo, hi):
                        i2 = p2 * stride[2] + offset
                        for kk in range(kg):
                            for c in range(c_total):
                                dx[n, i0, i1, i2, c] += wt[t, kk, c] * dy[
                                    n, p0, p1, p2, (c // cg) * kg + kk]


@_njit
def _wgrad_cf(x, dy, dw, groups, s, r, p, stride, dil, before):
    """dw: (K, Cg, R0, R1, R2); one job per (k, c) pair sums over batch and positions."""
    n_total, k_total = dy.shape[0], dy.shape[1]
    kg = k_total // groups
    cg = dw.shape[1]
    for job in prange(k_total * cg):
        k = job // cg
        c = job - k * cg
        ci = (k // kg) * cg + c
        for t0 in range(r[0]):
            for t1 in range(r[1]):
                for t2 in range(r[2]):
                    lo, hi = _valid(s[2], stride[2], dil[2], before[2], t2, p[2])
                    offset = t2 * dil[2] - before[2]
                    acc = 0.0
                    for n in range(n_total):
                        for p0 in range(p[0]):
                            i0 = p0 * stride[0] - before[0] + t0 * dil[0]
                            if i0 < 0 or i0 >= s[0]:
                                continue
                            for p1 in range(p[1]):
                                i1 = p1 * stride[1] - before[1] + t1 * dil[1]
                                if i1 < 0 or i1 >= s[1]:
                                    continue
                                for p2 in range(lo, hi):
                                    acc += dy[n, k, p0, p1, p2] * x[n, ci, i0, i1,
                                                                  p2 * stride[2] + offset]
                    dw[k, c, t0, t1, t2] = acc


@_njit
def _wgrad_cl_partials(x, dy, partial, groups, s, r, p, stride, dil, before):
    """partial[chunk, t, c, k] over a fixed split of the (n, p0, p1) rows."""
    n_total, k_total = dy.shape[0], dy.shape[4]
    kg = k_total // groups
    cg = partial.shape[2]
    rows = n_total * p[0] * p[1]
    chunks = partial.shape[0]
    for chunk in prange(chunks):
        partial[chunk] = 0
        for row in range(chunk * rows // chunks, (chunk + 1) * rows // chunks):
            p1 = row % p[1]
            rest = row // p[1]
            p0 = rest % p[0]
            n = rest // p[0]
            for p2 in range(p[2]):
                t = 0
                for t0 in range(r[0]):
                    i0 = p0 * stride[0] - before[0] + t0 * dil[0]
                    for t1 in range(r[1]):
                        i1 = p1 * stride[1] - before[1] + t1 * dil[1]
                        for t2 in range(r[2]):
                            i2 = p2 * stride[2] - before[2] + t2 * dil[2]
                            if 0 <= i0 < s[0] and 0 <= i1 < s[1] and 0 <= i2 < s[2]:
                                for c in range(cg):
                                    for k in range(k_total):
                                        partial[chunk, t, c, k] += dy[n, p0, p1, p2, k] * x[
                                            n, i0, i1, i2, (k // kg) * cg + c]
                            t += 1


def forward(g, x, w, y) -> None:
    args = g.geometry_args()
    w5 = w.reshape((g.k, g.cg) + g.r)
    if g.channels_last:
        wt = np.ascontiguousarray(w.reshape(g.k, g.cg, g.taps).transpose(2, 1, 0))
        _forward_cl(g.x5(x), wt, g.y5(y), g.g, *args)
    else:
        _forward_cf(g.x5(x), w5, g.y5(y), g.g, *args)


def data_gradient(g, dy, w, dx) -> None:
    """dx += the data gradient (the caller zeroes dx unless accumulating)."""
    args = g.geometry_args()
    if g.channels_last:
        # wt[t, kk, c] = w[group(c) * Kg + kk, c % Cg, t]
        w4 = w.reshape(g.g, g.kg, g.cg, g.taps)
        wt = np.ascontiguousarray(w4.transpose(3, 1, 0, 2).reshape(g.taps, g.kg, g.c))
        _dgrad_cl(g.y5(dy), wt, g.x5(dx), g.g, *args)
    else:
        _dgrad_cf(g.y5(dy), w.reshape((g.k, g.cg) + g.r), g.x5(dx), g.g, *args)


def weight_gradient(g, x, dy) -> np.ndarray:
    args = g.geometry_args()
    if g.channels_last:
        chunks = min(REDUCTION_CHUNKS, g.n * g.p[0] * g.p[1])
        partial = np.empty((chunks, g.taps, g.cg, g.k), dy.dtype)
        _wgrad_cl_partials(g.x5(x), g.y5(dy), partial, g.g, *args)
        total = partial[0].copy()
        for i in range(1, chunks):
            total += partial[i]
        return np.ascontiguousarray(total.transpose(2, 1, 0))   # (K, Cg, taps)
    dw = np.empty((g.k, g.cg) + g.r, dy.dtype)
    _wgrad_cf(g.x5(x), g.y5(dy), dw, g.g, *args)
    return dw
