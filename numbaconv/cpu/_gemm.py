"""Shared pieces of the GEMM-based algorithms: weight matrices, grouped products, tiles.

Matrix products go to NumPy's ``matmul`` (its BLAS: OpenBLAS in NumPy's wheels), which
multiplies strided operands and writes strided outputs without copies as long as each 2D
slice has a unit inner stride. Packing (im2col/col2im) is Numba; see :mod:`._im2col`.
"""

from __future__ import annotations

import contextlib
import threading

import numba
import numpy as np

from ._layout import Geom

#: Workspace for packed (im2col) buffers is bounded by max(this, the largest operand).
WORKSPACE_BYTES = 64 * 2**20
#: Packed bytes per tile that the tiling aims at (cache-sized; see :func:`tiles`).
TILE_BYTES = 4 * 2**20


def weight_cf(g: Geom, w: np.ndarray) -> np.ndarray:
    """w as (G, K/G, Cg * taps), features ordered (c, t): a view."""
    return w.reshape(g.g, g.kg, g.cg * g.taps)


def weight_cl(g: Geom, w: np.ndarray) -> np.ndarray:
    """w as (G, K/G, taps * Cg), features ordered (t, c) like channels-last windows: a copy."""
    return np.ascontiguousarray(
        w.reshape(g.g, g.kg, g.cg, g.taps).transpose(0, 1, 3, 2)).reshape(
        g.g, g.kg, g.taps * g.cg)


def weight_from_cl(g: Geom, dw: np.ndarray) -> np.ndarray:
    """(G, K/G, taps * Cg) back to the (K, Cg, *R) weight layout (a copy)."""
    return np.ascontiguousarray(
        dw.reshape(g.g, g.kg, g.taps, g.cg).transpose(0, 1, 3, 2)).reshape(
        (g.k, g.cg) + g.r)


def grouped_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out[m, g, :] = a[m, g, :] @ b[g] for a (M, G, F), b (G, F, J), out (M, G, J)."""
    np.matmul(a.transpose(1, 0, 2), b, out=out.transpose(1, 0, 2))


def tiles(g: Geom, per_position_bytes: int, largest_operand_bytes: int):
    """(n0, nb, q0, q1) tiles: several whole images, or one image's run of output rows
    (q = p0 * P1 + p1, each P2 positions).

    Tiles aim at TILE_BYTES of packed data, so that packing writes and the product's reads
    hit the cache rather than memory: measured on ResNet's 3x3 64-channel 56x56 layer,
    4 MiB tiles took 6 ms where 64 MiB tiles took 11 ms (channels-last forward). The packed
    workspace never exceeds max(WORKSPACE_BYTES, the largest operand), except that a single
    output row (the last spatial dimension) is never split.
    """
    limit = min(TILE_BYTES, max(WORKSPACE_BYTES, largest_operand_bytes))
    rows = g.p[0] * g.p[1]
    per_image = per_position_bytes * g.positions
    if per_image <= limit:
        nb = min(g.n, limit // max(per_image, 1))
        for n0 in range(0, g.n, nb):
            yield n0, min(nb, g.n - n0), 0, rows
        return
    chunk = max(1, limit // max(per_position_bytes * g.p[2], 1))
    for n0 in range(g.n):
        for q0 in range(0, rows, chunk):
            yield n0, 1, q0, min(rows, q0 + chunk)


_local = threading.local()


@contextlib.contextmanager
def packing_threads():
    """Run the packing kernels of a GEMM-based algorithm on the calling thread alone.

    Packing alternates with BLAS products tile after tile. Numba's parallel regions end at
    a barrier, so a Numba thread descheduled in favour of a BLAS thread (which yield-spins
    for a while after each product) stalls the whole region for a time slice: measured on
    2 cores with both pools at 2 threads, ResNet's 3x3 64-channel layer took 130 ms instead
    of 9 ms whenever Numba's OpenMP pool waited actively (as when PyTorch loaded the OpenMP
    runtime first). One Numba thread gives the cores to BLAS and was also faster with
    passive waiting (channels-first forward 14.5 -> 9 ms, channels-last 7.8 -> 6.5 ms).
    """
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(previous)


def workspace(shape: tuple, dtype) -> np.ndarray:
    """A C-contiguous scratch array for packed data, reused across tiles and calls.

    One buffer per thread (so concurrent calls from several threads never share one), grown
    on demand and kept: fresh multi-megabyte allocations cost a page fault per 4 KiB on first
    touch, which measured as much as the packing itself. The buffer holds at most one tile
    (about TILE_BYTES) per thread that has called a GEMM-based algorithm.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buffer = getattr(_local, "buffer", None)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = _local.buffer = np.empty(max(nbytes, 1), np.uint8)
    return buffer[:nbytes].view(dtype).reshape(shape)


def largest_operand(*arrays) -> int:
    return max(a.nbytes for a in arrays if a is not None)


def packed_bytes_per_position(g: Geom, itemsize: int) -> int:
    return g.c * g.taps * itemsize


def output_rows(g: Geom, a: np.ndarray, n0: int, nb: int, q0: int, q1: int) -> np.ndarray:
    """Channels-last y/dy rows of a tile as (nb * L, G, K/G): a view."""
    flat = a.reshape(g.n, g.positions, g.g, g.kg)[n0:n0 + nb, q0 * g.p[2]:q1 * g.p[2]]
    return flat.reshape(-1, g.g, g.kg)


def output_columns(g: Geom, a: np.ndarray, n0: int, nb: int, q0: int, q1: int) -> np.ndarray:
    """Channels-first y/dy of a tile as (nb, G, K/G, L): a view, strided when q is split."""
    return a.reshape(g.n, g.g, g.kg, g.positions)[n0:n0 + nb, :, :, q0 * g.p[2]:q1 * g.p[2]]


def positions_in(q0: int, q1: int, g: Geom) -> int:
    return (q1 - q0) * g.p[2]

