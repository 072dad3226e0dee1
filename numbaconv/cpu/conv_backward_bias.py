"""CPU bias gradient: db[k] = sum of dy over batch and space, in parallel, deterministic.

Channels-first sums one channel per job; channels-last splits the rows into a fixed number of
chunks (independent of the thread count), sums each into its own partial vector, and adds the
partials in order. A small dy is summed by the same kernels compiled for one thread, which
add in the same order: the bits are the same either way.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from numbaconv.backend import store

from ..config import parallel_jit, serial_version


#: Fixed split of the channels-last rows; see the module docstring.
REDUCTION_CHUNKS = 32

#: dy of fewer values is summed on one thread: waking the other threads costs more than they
#: save (on 2 cores the crossover lies between 2**18 and 2**19 values; docs/cpu-algorithms.md,
#: "Thresholds"), and on a busy machine a parallel region waits for a descheduled thread.
PARALLEL_FROM = 2**18


@parallel_jit
def _bias_cf(dy, db):
    n_total, k_total, positions = dy.shape
    for k in prange(k_total):
        acc = 0.0
        for n in range(n_total):
            for i in range(positions):
                acc += dy[n, k, i]
        db[k] = acc


@parallel_jit
def _bias_cl_partials(dy, partial):
    rows = dy.shape[0]
    chunks = partial.shape[0]
    # Loops over zero-based row views: slice updates (a view made per row) were 3 times
    # slower than PyTorch's sum.
    for chunk in prange(chunks):
        acc = partial[chunk]
        for k in range(acc.shape[0]):
            acc[k] = 0
        lo = chunk * rows // chunks
        hi = (chunk + 1) * rows // chunks
        row = lo
        while row + 4 <= hi:        # four rows per pass over acc
            v0 = dy[row]
            v1 = dy[row + 1]
            v2 = dy[row + 2]
            v3 = dy[row + 3]
            for k in range(acc.shape[0]):
                acc[k] += (np.float64(v0[k]) + np.float64(v1[k])) + \
                    (np.float64(v2[k]) + np.float64(v3[k]))
            row += 4
        for r in range(row, hi):
            values = dy[r]
            for k in range(acc.shape[0]):
                acc[k] += values[k]


def run(problem, operands, out, algorithm):
    (dy,) = operands
    db = channel_sums(dy, problem.channels, problem.channels_last,
                      parallel=runs_in_parallel(dy))
    return store(db, out, problem.accumulate)


def runs_in_parallel(dy: np.ndarray) -> bool:
    """Whether ``dy``'s bias gradient runs the parallel kernels (else their serial twins)."""
    return dy.size >= PARALLEL_FROM


def channel_sums(dy: np.ndarray, channels: int, channels_last: bool,
                 parallel: bool) -> np.ndarray:
    """db (dy's dtype) of the C-contiguous ``dy`` (batch first), by the parallel kernels or
    their one-thread twins: the same additions in the same order either way."""
    if channels_last:
        rows = dy.reshape(-1, channels)
        partial = np.empty((min(REDUCTION_CHUNKS, rows.shape[0]), channels), np.float64)
        (_bias_cl_partials if parallel else serial_version(_bias_cl_partials))(rows, partial)
        return _ordered_sum(partial).astype(dy.dtype)
    db = np.empty(channels, dy.dtype)
    (_bias_cf if parallel else serial_version(_bias_cf))(
        dy.reshape(dy.shape[0], channels, -1), db)
    return db


def _ordered_sum(partial):
    total = partial[0].copy()
    for i in range(1, partial.shape[0]):
        total += partial[i]
    return total
