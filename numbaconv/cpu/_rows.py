"""Kernels over rows that several algorithms share: zeroing, adding a bias along rows, and
the fixed-order sum of per-job partials (deterministic reductions; see
:func:`._tiles.add_partials`)."""

from __future__ import annotations

from numba import prange

from ..config import parallel_jit


@parallel_jit
def zero_rows(a):
    """a[...] = 0 in parallel over the first axis (np.zeros_like is single-threaded)."""
    flat = a.reshape(a.shape[0], -1)
    for i in prange(flat.shape[0]):
        flat[i, :] = 0


@parallel_jit
def add_row_vector(a, v, first):
    """a[i, :] += v for the rows of a (R, K) (a channels-last bias; ``first`` unused)."""
    for i in prange(a.shape[0]):
        for j in range(a.shape[1]):
            a[i, j] += v[j]


@parallel_jit
def add_row_scalars(a, v, first):
    """a[i, :] += v[(first + i) % len(v)] for the rows of a (R, P) (a channels-first bias:
    a's rows are planes from plane ``first`` of an (N * K, P) array)."""
    k = v.shape[0]
    for i in prange(a.shape[0]):
        value = v[(first + i) % k]
        for j in range(a.shape[1]):
            a[i, j] += value


@parallel_jit
def sum_partials(partial, total):
    """total[e] = partial[0, e] + partial[1, e] + ..., in that order (2D arrays)."""
    rows, width = partial.shape[0], partial.shape[1]
    block = 256
    for b in prange((width + block - 1) // block):
        lo = b * block
        hi = min(lo + block, width)
        dst = total[lo:hi]
        for m in range(hi - lo):
            dst[m] = partial[0, lo + m]
        for i in range(1, rows):
            part = partial[i, lo:hi]
            for m in range(hi - lo):
                dst[m] += part[m]
