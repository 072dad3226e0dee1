"""Kernels over rows that several algorithms share: zeroing, zero-padded copies of rows
(:func:`padded_rows`), adding a bias along rows, and the fixed-order sums of per-job or
per-slot partials, plain or laid out as a weight (deterministic reductions; see
:func:`._tiles.add_partials`, :func:`._tiles.summed`); and the runs the packing kernels
zero and copy inside theirs and the weight gradients sum inside theirs (:func:`zero_run`,
:func:`copy_run`, :func:`slot_sums`)."""

from __future__ import annotations

import numpy as np
from numba import prange, uint64

from ..config import inline_jit, parallel_jit, serial_jit
from ._microkernel import TRANSPOSE_BLOCK, _transpose


@serial_jit
def zero_run(a, start, count):
    """a[start:start + count] = 0 (a flat; nothing where count <= 0). Indices are uint64:
    with signed ones Numba checks each for a negative value, and LLVM no longer vectorises
    the loop (docs/cpu-algorithms.md, ``IMPLICIT_STRIDED_MAX_CHANNELS``)."""
    f = uint64(start)
    for k in range(uint64(max(count, 0))):
        a[f + k] = 0


@inline_jit
def copy_run(src, start, dst, to, count):
    """dst[to:to + count] = src[start:start + count] (both flat; nothing where count <= 0),
    uint64 indices (see :func:`zero_run`); inlined into its callers, as im2col's row copy
    was (through a call it measured slower)."""
    s, d = uint64(start), uint64(to)
    for k in range(uint64(max(count, 0))):
        dst[d + k] = src[s + k]


@inline_jit
def slot_sums(parts, src, stack, slots, dst, to, count):
    """dst[to + m] = parts[src + m] + parts[src + stack + m] + ... over ``slots`` stacks
    ``stack`` values apart, in that order (the bits of NumPy's sums one after another), for
    m < count: a run of the sums of slot partials, flat, with uint64 indices (see
    :func:`zero_run`)."""
    s, d, step = uint64(src), uint64(to), uint64(stack)
    for m in range(uint64(max(count, 0))):
        dst[d + m] = parts[s + m]
    for q in range(1, slots):
        part = s + uint64(q) * step
        for m in range(uint64(max(count, 0))):
            dst[d + m] += parts[part + m]


@parallel_jit
def zero_rows(a):
    """a[...] = 0 in parallel over the first axis (np.zeros_like is single-threaded)."""
    flat = a.reshape(a.shape[0], -1)
    for i in prange(flat.shape[0]):
        flat[i, :] = 0


@parallel_jit
def padded_rows(src, dst, rows, length, pitch, left):
    """dst's row r (``pitch`` values from r * pitch) = ``left`` zeros, src's row r
    (``length`` values from r * length), zeros to the row's end, for r < ``rows``; both
    flat. In parallel over the rows: NumPy's zeros and slice copy run on one thread."""
    for r in prange(rows):
        zero_run(dst, r * pitch, left)
        copy_run(src, r * length, dst, r * pitch + left, length)
        zero_run(dst, r * pitch + left + length, pitch - left - length)


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


@parallel_jit
def sum_taps_last(parts, dst, slots, rows, taps, channels):
    """dst[k, c, t] = parts[0, k, t, c] + parts[1, k, t, c] + ..., in that order (flat
    arrays of ``slots`` stacks of (rows, taps, channels)): channels-last weight-gradient sums
    into the weight's layout in one pass. Each task sums a block of channels of one row, all
    taps, in a scratch block, then writes it out tap-minor (contiguous)."""
    block = 64
    across = (channels + block - 1) // block
    stack = rows * taps * channels
    for task in prange(rows * across):
        k = task // across
        c0 = (task - k * across) * block
        width = min(block, channels - c0)
        acc = np.empty(taps * block, dst.dtype)
        for t in range(taps):
            slot_sums(parts, (k * taps + t) * channels + c0, stack, slots, acc, t * block,
                      width)
        out = uint64((k * channels + c0) * taps)
        for j in range(uint64(width)):
            for t in range(uint64(taps)):
                dst[out + j * uint64(taps) + t] = acc[t * uint64(block) + j]


@parallel_jit
def transposed_sum(parts, dst, slots, images, rows, columns, lanes):
    """dst[n, j, i] = parts[0, n, i, j] + parts[1, n, i, j] + ... over ``slots`` stacks of
    ``images`` (rows x columns) matrices, flat (the order of NumPy's sums one after
    another, so the same bits): each task sums one block of them in a scratch block, then
    moves it by the register transpose (:func:`._microkernel._transpose`), where NumPy's
    copy of a swapped view reads one value per cache line (figures: docs/cpu-algorithms.md,
    "`im2col`: transposed weight-gradient products")."""
    block_rows, block_columns = TRANSPOSE_BLOCK
    down = (rows + block_rows - 1) // block_rows
    across = (columns + block_columns - 1) // block_columns
    size = rows * columns
    stack = images * size
    for task in prange(images * down * across):
        n = task // (down * across)
        i0 = (task // across - n * down) * block_rows
        j0 = (task % across) * block_columns
        height = min(block_rows, rows - i0)
        width = min(block_columns, columns - j0)
        block = np.empty(height * width, dst.dtype)
        for i in range(height):
            slot_sums(parts, n * size + (i0 + i) * columns + j0, stack, slots, block,
                      i * width, width)
        _transpose(block, 0, width, dst, n * size + j0 * rows + i0, rows, height, width,
                   lanes)
