"""The ``gemm`` algorithm's drivers: the convolution is a plain matrix product over x (1x1
kernels with stride 1 and no padding, or kernels exactly as large as the unpadded input). No
packing: BLAS products (:mod:`._tiles`), or for channels-last rows numbaconv's micro-kernel
reading them in place (:func:`rows_matmul`; the weight gradient's runs of
positions, :func:`._microkernel.gram_runs`), for the channels-first weight gradient dy's rows
(:func:`_pointwise_cf_in_place`), and for the channels-first data gradient and forward of
large images blocks of dy (or x) copied while the next are prefetched
(:func:`streamed_matmul`)."""

from __future__ import annotations

import numpy as np
from numba import prange

from .._kernel_geometry import Geom
from ..config import parallel_jit
from . import _heuristics, _tiles
from ._microkernel import (KC, NT_DEPTH, STREAM_COLUMNS, STREAM_TILE, RowPanels,
                           gram_runs, nt_rows, rows_gemm, stream_block, strided_shape,
                           tile_shape, vector_lanes)
from ._sliding import LINE, row_pitch
from ._tiles import interruptible_ranges, numba_threads


def forward(g: Geom, x, w, y) -> None:
    if _heuristics.pointwise_streamed(g, x.dtype):
        # y[n] (K, S) = W (K, C) @ x[n] (C, S), x's blocks prefetched.
        streamed_matmul(_tiles.weight_cf(g, w)[0], x.reshape(g.n, g.c, g.positions),
                        y.reshape(g.n, g.k, g.positions))
    elif g.pointwise and not g.channels_last:
        # y[n] (G, Kg, S) = W (G, Kg, Cg) @ x[n] (G, Cg, S), per image.
        _tiles.matmul(_tiles.weight_cf(g, w), x.reshape(g.n, g.groups, g.cg, g.positions),
                     y.reshape(g.n, g.groups, g.kg, g.positions))
    elif _heuristics.rows_in_place(g):
        # x's rows read in place; w^T (C, K) copied (small next to x).
        rows_matmul(x.reshape(-1, g.c), np.ascontiguousarray(w.reshape(g.k, g.c).T),
                    y.reshape(-1, g.k))
    elif g.pointwise:
        # Every position of every image is a row: one product per group.
        _tiles.grouped_matmul(x.reshape(-1, g.groups, g.cg),
                             _tiles.weight_cf(g, w).transpose(0, 2, 1),
                             y.reshape(-1, g.groups, g.kg))
    elif g.whole_input:
        # Every image is a row of (G, features): features in w's own order, (c, t) when
        # channels-first, (t, c) channels-last (then G == 1).
        wmat = _tiles.weight_cl(g, w) if g.channels_last else _tiles.weight_cf(g, w)
        _tiles.grouped_matmul(x.reshape(g.n, g.groups, -1), wmat.transpose(0, 2, 1),
                             y.reshape(g.n, g.groups, g.kg))
    else:
        raise ValueError("algorithm: 'gemm' needs a 1x1 or whole-input kernel")


def data_gradient(g: Geom, dy, w, dx, accumulate: bool) -> None:
    target = np.empty_like(dx) if accumulate else dx
    if _heuristics.pointwise_streamed(g, dy.dtype):
        # dx[n] (C, S) = W^T (C, K) @ dy[n] (K, S), dy's blocks prefetched.
        streamed_matmul(_tiles.weight_cf(g, w)[0].T, dy.reshape(g.n, g.k, g.positions),
                        target.reshape(g.n, g.c, g.positions))
    elif g.pointwise and not g.channels_last:
        _tiles.matmul(_tiles.weight_cf(g, w).transpose(0, 2, 1),
                     dy.reshape(g.n, g.groups, g.kg, g.positions),
                     target.reshape(g.n, g.groups, g.cg, g.positions))
    elif _heuristics.rows_in_place(g):
        rows_matmul(dy.reshape(-1, g.k), w.reshape(g.k, g.c), target.reshape(-1, g.c))
    elif g.pointwise:
        _tiles.grouped_matmul(dy.reshape(-1, g.groups, g.kg), _tiles.weight_cf(g, w),
                             target.reshape(-1, g.groups, g.cg))
    elif g.whole_input:
        wmat = _tiles.weight_cl(g, w) if g.channels_last else _tiles.weight_cf(g, w)
        _tiles.grouped_matmul(dy.reshape(g.n, g.groups, g.kg), wmat,
                              target.reshape(g.n, g.groups, -1))
    else:
        raise ValueError("algorithm: 'gemm' needs a 1x1 or whole-input kernel")
    if accumulate:
        dx += target


def weight_gradient(g: Geom, x, dy) -> np.ndarray:
    if _heuristics.pointwise_rows_in_place(g, x.dtype):
        return _pointwise_cf_in_place(g, x, dy)
    if g.pointwise and not g.channels_last:
        per_image = _tiles.matmul(
            dy.reshape(g.n, g.groups, g.kg, g.positions),
            x.reshape(g.n, g.groups, g.cg, g.positions).transpose(0, 1, 3, 2),
            np.empty((g.n, g.groups, g.kg, g.cg), x.dtype), fixed=True)
        return _tiles.sum_in_order(per_image)
    if g.pointwise and g.n * g.positions >= _heuristics.POSITION_SPLIT_FROM * max(g.kg, g.cg):
        return _pointwise_by_positions(g, x.reshape(-1, g.groups, g.cg),
                                       dy.reshape(-1, g.groups, g.kg))
    if g.pointwise:
        rows = dy.reshape(-1, g.groups, g.kg).transpose(1, 2, 0)      # (G, Kg, N * S)
        return _tiles.matmul(rows, x.reshape(-1, g.groups, g.cg).transpose(1, 0, 2),
                             np.empty((g.groups, g.kg, g.cg), x.dtype), fixed=True)
    if g.whole_input:
        features = x.reshape(g.n, g.groups, -1).transpose(1, 0, 2)     # (G, N, F)
        dw = _tiles.matmul(dy.reshape(g.n, g.groups, g.kg).transpose(1, 2, 0), features,
                           np.empty((g.groups, g.kg, features.shape[-1]), x.dtype),
                           fixed=True)
        return _tiles.weight_from_cl(g, dw) if g.channels_last else dw
    raise ValueError("algorithm: 'gemm' needs a 1x1 or whole-input kernel")


def _pointwise_by_positions(g: Geom, x, dy) -> np.ndarray:
    """dw (G, Kg, Cg) of a channels-last 1x1 convolution from x (M, G, Cg) and dy (M, G, Kg),
    M = N * S: SLOTS products over runs of positions (a split fixed by the shape), summed in
    order. One group whose channels fill the micro-kernel's tiles (:func:`_gram_fills_tiles`):
    numbaconv's micro-kernel reads both runs in place (:func:`._microkernel.gram_runs`), the
    wider side as its MR rows; otherwise BLAS, the wider side as its columns (OpenBLAS runs
    (64, 256) faster than (256, 64)). Figures at ``POSITION_SPLIT_FROM`` in
    docs/cpu-algorithms.md."""
    m = x.shape[0]
    step = -(-m // _tiles.SLOTS)
    in_place = _gram_fills_tiles(g, x.dtype)
    transposed = g.kg < g.cg if in_place else g.kg > g.cg
    # Each part is (G, rows, columns) = left (G, rows, M') @ right (G, M', columns).
    left, right = (x, dy) if transposed else (dy, x)
    starts = list(range(0, m, step))
    partials = np.empty((len(starts), g.groups, left.shape[2], right.shape[2]), x.dtype)
    if in_place:
        # Runs shared out in parallel regions (ranges of runs), so that Ctrl-C ends them.
        macs = m * left.shape[2] * right.shape[2]
        for first, last in interruptible_ranges(len(starts), macs,
                                                _heuristics.IMPLICIT_PIECE_MACS):
            rows = slice(first * step, last * step)
            gram_runs(left[rows, 0], right[rows, 0], partials[first:last, 0], step,
                      numba_threads())
    else:
        def part(index, pick):
            run = slice(starts[index], starts[index] + step)
            np.matmul(left[run].transpose(1, 2, 0), right[run].transpose(1, 0, 2),
                      out=partials[index])

        _tiles.run_tiles(part, list(range(len(starts))))
    return _tiles.summed(partials, transpose=transposed)


def _gram_fills_tiles(g: Geom, dtype) -> bool:
    """Whether :func:`._microkernel.gram` takes a one-group 1x1 weight gradient's products:
    the narrower channel count a multiple of the tiles' NR columns, the wider at least MR.
    Elsewhere most of the product would be gram's NumPy remainder, in the orientation
    OpenBLAS runs slowest (figures at ``POSITION_SPLIT_FROM`` in docs/cpu-algorithms.md)."""
    mr, nv = tile_shape(dtype)
    narrow, wide = sorted((g.kg, g.cg))
    return g.groups == 1 and narrow % (nv * vector_lanes(dtype)) == 0 and wide >= mr


def _pointwise_cf_in_place(g: Geom, x, dy) -> np.ndarray:
    """dw (1, K, C) of a one-group channels-first 1x1 convolution, dy's rows read in place.

    dw = the sum over images of dy[n] (K, S) @ x[n].T (S, C), each by
    :func:`._microkernel.nt_rows`: dy's rows read in place by the strided micro-kernel, x[n]
    transposed by chunks (at :func:`._sliding.row_pitch`). OpenBLAS packs both operands
    first, and its packing of dy, which comes from memory, stalls the products (figures in
    docs/cpu-algorithms.md, "`gemm`: the channels-first 1x1 weight gradient, dy read in
    place"). The images are dealt round-robin
    into ``_heuristics.pointwise_slots`` partial sums, each summed in image order, then
    added in slot order; jobs are (slot, block of dy's rows), so the bits depend on the
    shape alone. Calls of more than IMPLICIT_PIECE_MACS multiply-adds run as several
    parallel regions (ranges of images), so that Ctrl-C ends them soon."""
    dtype = x.dtype
    mr, nv = strided_shape(dtype)
    slots = _heuristics.pointwise_slots(g)
    # dy's rows in blocks of whole tiles, SLOTS jobs in all where the rows allow (whole tiles
    # a block can leave fewer blocks than asked for: 5 tiles in 4 blocks are 3 of 2).
    tiles = -(-g.k // mr)
    block_rows = -(-tiles // min(tiles, -(-_tiles.SLOTS // slots))) * mr
    blocks = -(-g.k // block_rows)
    parts = np.empty((slots, g.k, g.c), dtype)
    args = (np.ascontiguousarray(x).reshape(-1), np.ascontiguousarray(dy).reshape(-1),
            parts, g.c, g.k, g.positions, row_pitch(g.c, dtype), block_rows, blocks, mr,
            nv * vector_lanes(dtype), vector_lanes(dtype))
    macs = g.n * g.positions * g.k * g.c
    for first, last in interruptible_ranges(g.n, macs, _heuristics.IMPLICIT_PIECE_MACS, slots):
        _pointwise_cf_parts(*args, first, last)
    return _tiles.summed(parts)[np.newaxis]


@parallel_jit
def _pointwise_cf_parts(x, dy, parts, c, k, s, pitch, block_rows, blocks, mr, nr, lanes,
                        first_image, last_image):
    """parts[slot] (+)= dy[n] @ x[n].T for the slot's images n = slot, slot + slots, ... in
    [first_image, last_image) (written by the slot's first image, added to after it); x (N,
    C, S) and dy (N, K, S) flat; one job per (slot, block of ``block_rows`` of K)."""
    slots = parts.shape[0]
    for job in prange(slots * blocks):
        slot = job // blocks
        r0 = (job % blocks) * block_rows
        r1 = min(k, r0 + block_rows)
        bt = np.empty(NT_DEPTH * pitch, x.dtype)
        edge = np.zeros(mr * s if (r1 - r0) % mr else 1, x.dtype)
        edge_out = np.empty(mr * c if (r1 - r0) % mr else 1, x.dtype)
        part = parts[slot].reshape(-1)
        for n in range(first_image + (slot - first_image) % slots, last_image, slots):
            nt_rows(dy, n * k * s, s, x, n * c * s, s, part, 0, c, r0, r1, c, s, n != slot,
                    bt, edge, edge_out, pitch, mr, nr, lanes)


def rows_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[...] = a @ b`` (2D) by :func:`._microkernel.rows_gemm`, a's rows shared out
    among Numba's threads in a parallel region (every row gets the same bits whatever the
    split). Calls of more than IMPLICIT_PIECE_MACS multiply-adds run as several regions
    (ranges of micro-kernel bands), so that Ctrl-C ends them soon."""
    mr = strided_shape(out.dtype)[0]
    bands = -(-a.shape[0] // mr)
    macs = a.shape[0] * a.shape[1] * b.shape[1]
    for first, last in interruptible_ranges(bands, macs, _heuristics.IMPLICIT_PIECE_MACS):
        rows_gemm(a[first * mr:last * mr], b, out[first * mr:last * mr], numba_threads())
    return out


def streamed_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[n] (M, S) = a (M, P) @ b[n] (P, S) for each n, ``out`` C-contiguous: jobs of one
    image's STREAM_COLUMNS columns of b, each by blocks of KC rows, a block copied at an odd
    pitch of lines, then multiplied while its tiles prefetch the block STREAM_AHEAD after it
    (:func:`._microkernel.stream_block`); a (small next to b) packed once into tiles
    (:class:`._microkernel.RowPanels`). For a b that comes from memory, whose rows lie
    kilobytes apart (the channels-first 1x1 data gradient's dy), where OpenBLAS stalls on
    its packing of b (figures in docs/cpu-algorithms.md, "`gemm`: the channels-first 1x1
    data gradient, dy streamed").
    Every output is one job's, summed over the blocks in order: the bits depend on the
    shape alone. Calls of more than IMPLICIT_PIECE_MACS multiply-adds run as several
    parallel regions (ranges of images), so that Ctrl-C ends them soon."""
    dtype = b.dtype
    mr, nv = STREAM_TILE
    m, depth = a.shape
    images, _, s = b.shape
    packed = RowPanels(a, height=mr).panels
    args = (packed.reshape(-1), np.ascontiguousarray(b).reshape(-1), out.reshape(-1), m,
            depth, s, STREAM_COLUMNS, row_pitch(STREAM_COLUMNS, dtype),
            LINE // dtype.itemsize, mr, nv * vector_lanes(dtype))
    macs = images * m * depth * s
    for first, last in interruptible_ranges(images, macs, _heuristics.IMPLICIT_PIECE_MACS):
        _streamed_parts(*args, first, last, numba_threads())
    return out


#: Blocks between the one a worker multiplies and the one its tiles prefetch: further ahead,
#: a block's lines have more time to arrive before its copy, but hold more of L2 meanwhile.
STREAM_AHEAD = 2


@parallel_jit
def _streamed_parts(packed, b, out, m, depth, s, columns, pitch, line, mr, nr, first_image,
                    last_image, workers):
    """out[n] = A @ b[n] for the images n in [first_image, last_image) (A packed by
    :func:`streamed_matmul`; b (N, depth, s) and out (N, m, s) flat): jobs (image, run of
    ``columns`` columns) dealt in contiguous runs, one to each of ``workers``, each job by
    blocks of KC rows of b; each block's tiles prefetch the block STREAM_AHEAD after it in
    the worker's run."""
    panels = -(-s // columns)
    blocks = -(-depth // KC)
    jobs = (last_image - first_image) * panels
    share = -(-jobs // workers)
    for worker in prange(workers):
        panel = np.empty(KC * pitch, b.dtype)
        tmp = np.empty(mr * nr, b.dtype)
        end = min(jobs, (worker + 1) * share) * blocks
        for unit in range(worker * share * blocks, end):
            job = unit // blocks
            k0 = unit % blocks * KC
            n = first_image + job // panels
            j0 = job % panels * columns
            ahead = unit + STREAM_AHEAD
            f0, fkc, fwidth = -1, 0, 0
            if ahead < end:
                fjob = ahead // blocks
                fk0 = ahead % blocks * KC
                fj0 = fjob % panels * columns
                f0 = ((first_image + fjob // panels) * depth + fk0) * s + fj0
                fkc = min(KC, depth - fk0)
                fwidth = min(columns, s - fj0)
            stream_block(packed, k0 * mr, depth * mr, m, b, (n * depth + k0) * s + j0, s,
                         min(KC, depth - k0), min(columns, s - j0), out, n * m * s + j0, s,
                         1 if k0 > 0 else 0, panel, pitch, tmp, f0, fkc, fwidth, line, mr,
                         nr)
