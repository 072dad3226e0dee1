"""CUDA bias gradient: db[k] = sum of dy over batch and space, as a two-pass reduction.

Pass one: a block per (channel, chunk of rows), each thread summing a fixed strided set of
rows, then a fixed shared-memory tree. Pass two adds the chunks' partials in order. The
split depends only on the shape and the configured threads per block: deterministic.
"""

from __future__ import annotations

import math

from ..config import cuda_threads_per_block
from . import _kernels
from ._layout import device_array, view5

#: Chunks to aim for over all channels (fixed, so the split never depends on the device).
TARGET_BLOCKS = 1024


def run(problem, operands, out, algorithm):
    (dy,) = operands
    threads = cuda_threads_per_block()
    k = problem.channels
    rows = problem.batch
    for d in problem.output_size:
        rows *= d
    chunks = min(_blocks(rows, threads), _blocks(TARGET_BLOCKS, k), 65535)
    chunk_len = _blocks(rows, chunks)
    chunks = _blocks(rows, chunk_len)
    partial = device_array((chunks, k, 1), _kernels.acc_dtype(problem.dtype))
    dy5 = view5(dy, 1 if problem.channels_last else 2)
    kernel = _kernels.kernel("bias_partials", problem.channels_last, problem.dtype, threads)
    kernel[(k, chunks), threads](dy5, partial, chunk_len)
    result = out if out is not None else device_array((k,), problem.dtype)
    sum_partials(partial, view5(result, 1), problem.dtype, problem.accumulate)
    return result


def sum_partials(partial, out5, dtype, accumulate):
    """out5 = [out5 +] partial summed over its first axis, in order."""
    threads = cuda_threads_per_block()
    elements = math.prod(partial.shape[1:])
    _kernels.kernel("sum_partials", dtype)[_blocks(elements, threads), threads](
        partial, out5, bool(accumulate))


def _blocks(count: int, per_block: int) -> int:
    return max(1, -(-count // per_block))
