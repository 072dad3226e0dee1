"""CUDA weight gradient: an implicit GEMM over (image, output position), split in chunks
whose partials are added in order by a second kernel: deterministic, no atomics.

The split depends on the problem's shape and the tile only (never on the device), so the
same inputs give bitwise the same dw on every run and every GPU.
"""

from __future__ import annotations

import math

from ..config import cuda_threads_per_block, cuda_tile
from . import _kernels
from ._layout import activation5, device_array, geom, geometry_args, weight5

#: Blocks to aim for when choosing the split (fixed, see the module docstring).
TARGET_BLOCKS = 1024
#: Largest partial buffer, in elements (64 MiB of float32).
MAX_PARTIAL_ELEMENTS = 1 << 24


def run(problem, operands, out, algorithm):
    x, dy = operands
    g = geom(problem)
    tile = cuda_tile()
    tm, tq, tl = tile
    cols = g.cg * g.taps
    reduce_total = g.n * g.positions
    base = _blocks(cols, tq) * g.g * _blocks(g.kg, tm)
    steps = _blocks(reduce_total, tl)
    chunks = min(steps, _blocks(TARGET_BLOCKS, base), 65535,
                 max(1, MAX_PARTIAL_ELEMENTS // (g.k * cols)))
    chunk_len = _blocks(steps, chunks) * tl
    chunks = _blocks(reduce_total, chunk_len)
    partial = device_array((chunks, g.k, cols), _kernels.acc_dtype(problem.dtype))
    kernel = _kernels.kernel("weight_partials", problem.channels_last, problem.dtype, tile)
    kernel[(_blocks(cols, tq) * g.g, _blocks(g.kg, tm), chunks), (tq, tm)](
        activation5(g, x), activation5(g, dy), partial, chunk_len, *geometry_args(g))
    result = out if out is not None else device_array(problem.w_shape, problem.dtype)
    sum_partials(partial, weight5(result), problem.dtype, problem.accumulate)
    return result


def sum_partials(partial, out5, dtype, accumulate):
    """out5 = [out5 +] partial summed over its first axis, in order."""
    threads = cuda_threads_per_block()
    elements = math.prod(partial.shape[1:])
    _kernels.kernel("sum_partials", dtype)[_blocks(elements, threads), threads](
        partial, out5, bool(accumulate))


def _blocks(count: int, per_block: int) -> int:
    return max(1, -(-count // per_block))
