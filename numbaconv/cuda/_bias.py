"""The cuda backend's bias gradient: ``db[k] = [db +] sum of dy[n, k, *p]`` in two passes.

``bias_sums``
    A block per (channels, chunk of (image, position) rows): ``CB`` channels by ``PL`` row
    lanes (channels-last: 32 channels a warp reads side by side, channels-first: one channel,
    a warp reading 32 neighbouring rows). Each thread decodes its first row once (unsigned
    divisions, outside the loop) and then steps ``PL`` rows at a time by adding ``PL``'s
    digits in the radix of (images, P0, P1, P2) with one carry a digit: no division in the
    loop, one load and one add a row. The lanes are added by a fixed shared-memory tree and
    each chunk writes its partial, ``partial[chunk * K + k]``.
``sum_chunks`` (:func:`._implicit_gemm.sum_chunks_function`)
    Adds the partials in chunk order and writes (or accumulates) db.

The recurrent ops' bias gradients, column sums of the gate gradients over T*N rows, take
the same two passes (:func:`column_sums`).

The chunks depend on the shape and the threads per block only: deterministic, no atomics.
Indices are 32-bit where dy spans fewer than about 2**31 elements, as in the GEMMs; operands
are device pointers (flat arrays under the simulator) with element strides.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from . import _implicit_gemm as ig
from ._launch import launch
from ._layout import device_array
from ._templates import compile_source, scalar_types

#: Blocks to aim for over all channel blocks: enough to fill a large GPU several times,
#: few enough that the partials (chunks x K) stay small. Fixed: the split (and the bits of
#: db) never depend on the device.
TARGET_BLOCKS = 1024

BIAS_SUMS = """
def bias_sums(dy, partial, K_, rows_, P0_, P1_, P2_, yN_, yK_, y0_, y1_, y2_, chunk_len_,
              d0_, d1_, d2_, step_, c0_, c1_, c2_):
    # every size, stride and digit in the index type, so that no step widens to 64 bits
    K, rows, P0, P1, P2 = I(K_), I(rows_), I(P0_), I(P1_), I(P2_)
    yN, yK, y0, y1, y2 = I(yN_), I(yK_), I(y0_), I(y1_), I(y2_)
    chunk_len, d0, d1, d2 = I(chunk_len_), I(d0_), I(d1_), I(d2_)
    step, c0, c1, c2 = I(step_), I(c0_), I(c1_), I(c2_)
    red = cuda.shared.array(THREADS, acc)
    tid = I(cuda.threadIdx.x)
    lane = I(U(tid) // U(CB))
    k = I(cuda.blockIdx.x * CB + tid % CB)
    start = I(I(cuda.blockIdx.y) * chunk_len)
    stop = I(start + min(chunk_len, I(rows - start)))
    j = I(start + lane)
    # the first row's digits, innermost first (DIMS of them), the rest counted by n
    r = j
    p0 = I(0)
    p1 = I(0)
    p2 = I(0)
    if DIMS >= 1:
        q = I(U(r) // U(P2))
        p2 = I(r - q * P2)
        r = q
    if DIMS >= 2:
        q = I(U(r) // U(P1))
        p1 = I(r - q * P1)
        r = q
    if DIMS >= 3:
        q = I(U(r) // U(P0))
        p0 = I(r - q * P0)
        r = q
    off = I(min(k, K - 1) * yK + r * yN + p0 * y0 + p1 * y1 + p2 * y2)
    s = acc(0)
    while (j < stop) & (k < K):
        s += acc(dy[U(off)])
        j = I(j + PL)
        off = I(off + step)
        if DIMS >= 1:
            p2 = I(p2 + d2)
            if p2 >= P2:
                p2 = I(p2 - P2)
                off = I(off + c2)
                if DIMS >= 2:
                    p1 = I(p1 + 1)
        if DIMS >= 2:
            p1 = I(p1 + d1)
            if p1 >= P1:
                p1 = I(p1 - P1)
                off = I(off + c1)
                if DIMS >= 3:
                    p0 = I(p0 + 1)
        if DIMS >= 3:
            p0 = I(p0 + d0)
            if p0 >= P0:
                p0 = I(p0 - P0)
                off = I(off + c0)
    red[tid] = s
    cuda.syncthreads()
    half = PL // 2
    while half > 0:
        if lane < half:
            red[tid] += red[tid + half * CB]
        cuda.syncthreads()
        half //= 2
    if (lane == 0) & (k < K):
        partial[U(I(cuda.blockIdx.y) * K + k)] = red[tid]
"""


def bias_sums_function(dtype: str, channels_last: bool, dims: int, wide: bool,
                       threads: int):
    """The Python function of the first pass (compile with cuda.jit; ``threads`` a power of
    two, ``dims`` the digits of a row below the images that need carries, 0 to 3: see
    :func:`walk`). Launch: ``threads`` threads; grid ``(ceil(K / CB), chunks)``."""
    acc, I, U = scalar_types(dtype, wide)
    cb = min(32, threads) if channels_last else 1
    names = dict(THREADS=threads, CB=cb, PL=threads // cb, DIMS=dims,
                 KEY=f"{dtype} cl={channels_last} dims={dims} wide={wide} threads={threads}")
    return compile_source("bias_sums", BIAS_SUMS, names, dict(acc=acc, I=I, U=U))


@functools.lru_cache(maxsize=None)
def kernel(*key):
    """``bias_sums`` for ``key`` = (dtype, channels_last, dims, wide, threads), compiled for
    the types every launch passes (see :func:`._implicit_gemm.jit_kernel`)."""
    return ig.jit_kernel(bias_sums_function(*key), launch_types(key[0]))


def launch_types(dtype: str) -> tuple:
    from numba import types
    data, accs = ig.pointer_types(dtype)
    return (data, accs) + (types.int64,) * 18


class Walk(NamedTuple):
    """How a lane walks dy's rows (image, position) ``lanes`` rows at a time: the digits of
    a row that need carries (innermost last, padded to 3 with unit digits in front), their
    element strides, the stride of what is left (the image, merged with the outer spatial
    digits where the strides allow), ``lanes``' digits, the offset of a step before carries
    and each digit's carry correction."""
    dims: int
    sizes: tuple
    strides: tuple
    outer_stride: int
    digits: tuple
    step: int
    carries: tuple


@functools.lru_cache(maxsize=1024)
def walk(sizes: tuple, strides: tuple, image_stride: int, lanes: int) -> Walk:
    """The :class:`Walk` of rows of positions ``sizes`` (P0, P1, P2) with element ``strides``
    under images of ``image_stride``: unit dimensions dropped, a dimension merged into the
    one inside it where its stride is that one's extent (so contiguous positions need one
    digit, and channels-last images none), then ``lanes`` written in that radix."""
    merged = []  # innermost first: [size, stride]
    for size, stride in reversed(list(zip(sizes, strides))):
        if size == 1:
            continue
        if merged and stride == merged[-1][0] * merged[-1][1]:
            merged[-1][0] *= size
        else:
            merged.append([size, stride])
    outer = image_stride
    if merged and image_stride == merged[-1][0] * merged[-1][1]:
        outer = merged.pop()[1]  # images and the outermost digit count together
    dims = len(merged)
    digits, rest = [], lanes
    for size, _ in merged:
        digits.append(rest % size)
        rest //= size
    step = rest * outer + sum(d * st for d, (_, st) in zip(digits, merged))
    above = [st for _, st in merged[1:]] + [outer]
    carries = [nxt - size * st for (size, st), nxt in zip(merged, above)]
    pad = 3 - dims
    return Walk(dims, (1,) * pad + tuple(size for size, _ in reversed(merged)),
                (0,) * pad + tuple(st for _, st in reversed(merged)), outer,
                (0,) * pad + tuple(reversed(digits)), step,
                (0,) * pad + tuple(reversed(carries)))


class _Setup:
    """The bias gradient's launches of one problem at ``threads`` threads a block (see
    :func:`bias_gradient`): grids, split and the arguments that do not come from dy."""

    def __init__(self, problem, threads: int):
        cl = problem.channels_last
        k = self.k = problem.channels
        self.sizes = (1,) * (3 - len(problem.output_size)) + tuple(problem.output_size)
        self.rows = rows = problem.batch * math.prod(self.sizes)  # >= 1: no empty arrays
        cb = min(32, threads) if cl else 1
        self.lanes = threads // cb
        channel_blocks = -(-k // cb)
        chunks, self.chunk_len = ig.row_chunks(rows, channel_blocks, self.lanes,
                                               TARGET_BLOCKS)
        self.partials = chunks * k
        self.acc = ig._acc(problem.dtype)
        self.grid = (channel_blocks, chunks)
        self.sum = ig.kernel("sum_chunks", problem.dtype)
        self.sum_grid = -(-k // 256)
        self.sum_args = (k, chunks, 1, 1, 1, 1, bool(problem.accumulate))


_setup = ig.remembered_setup(_Setup)


class Columns(NamedTuple):
    """The column sums of a (rows, K) matrix posed as a bias gradient: rows as images of
    one position, K channels, channels-last (what :class:`_Setup` and :func:`bias_gradient`
    read of a convolution problem)."""
    batch: int
    channels: int
    dtype: str
    accumulate: bool
    channels_last: bool = True
    output_size: tuple = ()


def column_sums(a, out, dtype: str, accumulate: bool, threads: int):
    """``out (+)= a.sum(axis=0)`` for a 2-D device array ``a`` of ``dtype`` (rows, K), by
    the two passes of :func:`bias_gradient`: the recurrent ops' bias gradients (the gate
    gradients summed over T*N rows)."""
    rows, k = (int(v) for v in a.shape)
    return bias_gradient(Columns(rows, k, dtype, bool(accumulate)), a, out, threads)


def bias_gradient(problem, dy, out, threads: int):
    """``db = [db +] sum of dy over images and positions`` (see the module's docstring)."""
    cl = problem.channels_last
    dtype = problem.dtype
    device = ig._device_id()
    at = _setup(problem, threads)
    k = at.k
    result = out if out is not None else device_array((k,), dtype)
    yo = ig.operand(dy, cl, problem)  # the problem's layout, should dy need a copy
    target, wo = ig._writable(result, (k,), None, None, problem.accumulate)
    partial = ig._ref(ig.workspace("bias partials", at.partials, at.acc, device))
    ys = yo.strides
    w = walk(at.sizes, ys[2:], ys[0], at.lanes)
    # 32-bit where every offset a lane forms, before its carries too, stays below the limit
    reach = yo.span + abs(w.step) + sum(abs(c) for c in w.carries)
    wide = max(reach, at.rows + at.lanes, at.partials) > ig.INDEX32_LIMIT
    launch(kernel(dtype, cl, w.dims, wide, threads), at.grid, threads,
           yo.ref, partial, k, at.rows, *w.sizes, w.outer_stride, ys[1], *w.strides,
           at.chunk_len, *w.digits, w.step, *w.carries)
    launch(at.sum, at.sum_grid, 256, partial, wo.ref, *at.sum_args, *wo.strides)
    ig._written(target, result, None, None)
    return result
