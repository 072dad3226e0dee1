"""The ``im2col`` algorithm's drivers: windows packed into a matrix by the kernels of
:mod:`._im2col_kernels`, one BLAS product per tile of images, run on the tile workers
(:func:`._tiles.run_tiles`). The data gradient is the mirror image: one product per tile gives
the packed gradient of every window (``W^T @ dy``), which col2im adds back into dx."""

from __future__ import annotations

import functools

import numpy as np

from .._kernel_geometry import Geom
from . import _heuristics, _tiles
from ._im2col_kernels import col2im_cf, col2im_cl, im2col_cf, im2col_cf_phased, im2col_cl
from ._microkernel import _transpose, gram, vector_lanes
from ._rows import zero_rows

def forward(g: Geom, x, w, y, wmat=None) -> None:
    """y = conv(x, w) by packed tiles; ``wmat``, when given, is w already in the layout of
    the product (see below), and w is not read."""
    args = g.geometry_args()
    x5 = g.x5(x)
    per_position = _tiles.packed_bytes_per_position(g, x.itemsize)
    tiles = list(_tiles.tiles(g, per_position, _tiles.largest_operand(x, y)))
    if not g.channels_last:
        if wmat is None:
            wmat = _tiles.weight_cf(g, w)                  # (G, Kg, Cg * taps)

        def tile(job, pick):
            n0, nb, q0, q1 = job
            one_product = _heuristics.batch_columns(g, nb)
            col = packed_cf(g, x5, args, job, pick, one_product)
            if one_product:
                # One product for the tile, then y's tile copied out image by image.
                prod = _tiles.workspace((g.groups, g.kg, col.shape[-1]), x.dtype, "rows")
                np.matmul(wmat, col, out=prod)
                y.reshape(g.n, g.k, -1)[n0:n0 + nb] = \
                    prod.reshape(g.k, nb, -1).transpose(1, 0, 2)
            else:
                np.matmul(wmat, col, out=_tiles.output_columns(g, y, n0, nb, q0, q1))
    else:
        if wmat is None:
            wmat = _tiles.weight_cl(g, w).transpose(0, 2, 1)  # (G, taps * Cg, Kg)

        def tile(job, pick):
            n0, nb, q0, q1 = job
            _tiles.grouped_matmul(packed_cl(g, x5, args, job, pick), wmat,
                                 _tiles.output_rows(g, y, n0, nb, q0, q1))
    _tiles.run_tiles(tile, tiles)


def data_gradient(g: Geom, dy, w, dx, accumulate: bool) -> None:
    args = g.geometry_args()
    dx5 = g.x5(dx)
    images = dx.reshape(g.n, -1)
    per_position = _tiles.packed_bytes_per_position(g, dx.itemsize)
    # col2im adds each tile into the input rows its windows read, which neighbouring row
    # tiles of one image share: a job is one run of whole images, or all tiles of one image.
    jobs = []
    for tile in _tiles.tiles(g, per_position, _tiles.largest_operand(dx, dy)):
        if jobs and jobs[-1][-1][0] == tile[0]:
            jobs[-1].append(tile)
        else:
            jobs.append([tile])

    def clear(job, pick):
        # Each job zeroes its own images, on its worker: a parallel kernel launched from
        # this thread before the jobs would leave an OpenMP thread spinning while they run
        # (see numbaconv.config on OMP_WAIT_POLICY and runtimes loaded before numbaconv).
        if not accumulate:
            n0 = job[0][0]
            pick(zero_rows)(images[n0:n0 + job[0][1]])

    if not g.channels_last:
        wmat = _tiles.weight_cf(g, w).transpose(0, 2, 1)       # (G, Cg * taps, Kg)

        def image_tiles(job, pick):
            clear(job, pick)
            for n0, nb, q0, q1 in job:
                columns = _tiles.positions_in(q0, q1, g)
                dcol = _tiles.workspace((nb, g.groups, g.cg * g.taps, columns), dx.dtype)
                np.matmul(wmat, _tiles.output_columns(g, dy, n0, nb, q0, q1), out=dcol)
                pick(col2im_cf)(dcol.reshape(nb, g.c * g.taps, -1), dx5, n0, q0, q1, *args)
    else:
        wmat = _tiles.weight_cl(g, w)                          # (G, Kg, taps * Cg)

        def image_tiles(job, pick):
            clear(job, pick)
            for n0, nb, q0, q1 in job:
                m = nb * _tiles.positions_in(q0, q1, g)
                dcol = _tiles.workspace((m, g.groups, g.taps * g.cg), dx.dtype)
                _tiles.grouped_matmul(_tiles.output_rows(g, dy, n0, nb, q0, q1), wmat, dcol)
                pick(col2im_cl)(dcol.reshape(m, g.groups, g.taps, g.cg), dx5, n0, q0, q1, g.groups,
                                *args)
    _tiles.run_tiles(image_tiles, jobs)


def weight_gradient(g: Geom, x, dy) -> np.ndarray:
    args = g.geometry_args()
    x5 = g.x5(x)
    per_position = _tiles.packed_bytes_per_position(g, x.itemsize)
    tiles = list(_tiles.tiles(g, per_position, _tiles.largest_operand(x, dy)))
    slots = min(_tiles.SLOTS, len(tiles))
    transposed = g.kg < (_heuristics.TRANSPOSED_BELOW if g.channels_last else
                         _heuristics.TRANSPOSED_BELOW_CF)
    in_place = (g.channels_last and g.groups == 1
                and g.cg * g.taps * g.kg <= _heuristics.IN_PLACE_DW_UP_TO)
    pieces = _heuristics.feature_pieces(g, tiles)
    if pieces:
        return _weight_gradient_by_features(g, x5, dy, args, tiles, transposed, pieces)

    # Each slot's sum goes to its own (G, Kg, F) or (G, F, Kg) part of ``partials``.
    shape = (g.groups,) + ((g.cg * g.taps, g.kg) if transposed else (g.kg, g.cg * g.taps))
    partials = np.empty((slots,) + shape, x.dtype)
    if not g.channels_last:
        def product(tile, pick, out):
            n0, nb, q0, q1 = tile
            one_product = _heuristics.batch_columns(g, nb)
            col = packed_cf(g, x5, args, tile, pick, one_product)
            if one_product:
                # dy's tile copied to (G, Kg, image, position), the columns' order.
                rows = _tiles.workspace((g.k, nb, col.shape[-1] // nb), x.dtype, "rows")
                rows[...] = dy.reshape(g.n, g.k, -1)[n0:n0 + nb].transpose(1, 0, 2)
                _dot(col, rows.reshape(g.groups, g.kg, -1), out, transposed)
            elif nb == 1:
                _dot(col[0], _tiles.output_columns(g, dy, n0, nb, q0, q1)[0], out,
                     transposed)
            else:
                out[...] = _tiles.sum_in_order(
                    _dot(col, _tiles.output_columns(g, dy, n0, nb, q0, q1), None,
                         transposed))
    elif in_place:
        # The windows (M, F) and dy's rows (M, K) are the operands of _microkernel.gram as
        # they lie; later tiles add straight into their slot's sum (``add``).
        def product(tile, pick, out, add=False):
            n0, nb, q0, q1 = tile
            features = packed_cl(g, x5, args, tile, pick)[:, 0]
            grads = _tiles.output_rows(g, dy, n0, nb, q0, q1)[:, 0]
            a, b = (features, grads) if transposed else (grads, features)
            gram(a, b, out[0], add=add)
    else:
        def product(tile, pick, out):
            n0, nb, q0, q1 = tile
            _dot(packed_cl(g, x5, args, tile, pick).transpose(1, 2, 0),
                 _tiles.output_rows(g, dy, n0, nb, q0, q1).transpose(1, 2, 0), out, transposed)

    def slot(first, pick):
        total = partials[first]
        product(tiles[first], pick, total)
        for tile in tiles[first + slots::slots]:
            _tiles.stop_if_interrupted()
            if in_place:
                product(tile, pick, total, add=True)
            else:
                # Later tiles' products go to a reused buffer (a fresh dw-sized array per
                # tile costs a page fault per 4 KiB), then into the slot's sum.
                part = _tiles.workspace(total.shape, total.dtype, "product")
                product(tile, pick, part)
                total += part

    _tiles.run_tiles(slot, list(range(slots)))
    if not g.channels_last:
        return _tiles.summed(partials, transpose=transposed)
    # Channels-last features are (t, c): summed straight into the weight's (c, t) order.
    if transposed:
        partials = _tiles.summed(partials, transpose=True)[None]
    return _tiles.summed_taps_last(partials.reshape(-1, g.k, g.taps, g.cg)).reshape(
        (g.k, g.cg) + g.r)


def _dot(features, grads, out, transposed: bool):
    """Over the last axis: features (..., F, L) and grads (..., Kg, L) give dw's part,
    (..., Kg, F), or with ``transposed`` its transpose, into ``out`` (None: a new array)."""
    if transposed:
        return np.matmul(features, np.swapaxes(grads, -1, -2), out=out)
    return np.matmul(grads, np.swapaxes(features, -1, -2), out=out)


def _weight_gradient_by_features(g: Geom, x5, dy, args, tiles: list, transposed: bool,
                                 pieces: int) -> np.ndarray:
    """The channels-first weight gradient of one group by ``pieces`` pieces of input channels
    (:func:`._heuristics.feature_pieces`: fixed by the shape and the machine's CPU count,
    not by the threads) instead of by slots of tiles: a piece packs its channels' windows
    of every tile (whole images), multiplies them by dy's columns, adds the tiles' products
    in its own (features, K) part (a few hundred KiB) and moves that into its columns of dw
    on the tile worker. No slot partials, no final pass over them. Piece j takes the tiles
    from tile j on (a rotated order, fixed by the shape), so that the pieces running at
    once start on different tiles, and each tile's dy columns, copied to (K, images *
    positions) by the first piece that needs them, are copied on the workers side by side
    rather than all before they start (figures: docs/cpu-algorithms.md, "`im2col`: the
    channels-first weight gradient by pieces of channels")."""
    dtype = x5.dtype
    features = g.c * g.taps
    positions = g.positions
    dw = np.empty((g.k, features), dtype)
    dwf = dw.reshape(-1)
    lanes = vector_lanes(dtype)
    # dy as (K, N, positions): each tile's columns a view, (K, images * positions).
    grads_all = np.empty((g.k, g.n, positions), dtype)
    grads_of = _tiles.made_once([
        functools.partial(_tile_grads, dy, grads_all, tile[0], tile[1]) for tile in tiles])

    def piece(job, pick):
        j, (c0, c1) = job
        rows = (c1 - c0) * g.taps
        shape = (rows, g.k) if transposed else (g.k, rows)
        total = np.empty(shape, dtype)
        for step in range(len(tiles)):
            _tiles.stop_if_interrupted()
            i = (j + step) % len(tiles)
            col = packed_cf(g, x5, args, tiles[i], pick, True, (c0, c1))[0]
            out = total if step == 0 else _tiles.workspace(shape, dtype, "product")
            _dot(col, grads_of(i), out, transposed)
            if step:
                total += out
        if transposed:
            _transpose(total.reshape(-1), 0, g.k, dwf, c0 * g.taps, features, rows, g.k,
                       lanes)
        else:
            dw[:, c0 * g.taps:c1 * g.taps] = total

    _tiles.run_tiles(piece, list(enumerate(_tiles.fixed_ranges(g.c, pieces))))
    return dw


def _tile_grads(dy, grads_all, n0: int, nb: int) -> np.ndarray:
    """Images [n0, n0 + nb) of channels-first dy copied into their columns of ``grads_all``
    (K, N, positions): the tile's columns for the weight gradient's product, (K, nb *
    positions)."""
    k, _, positions = grads_all.shape
    grads = grads_all[:, n0:n0 + nb]
    np.copyto(grads, dy[n0:n0 + nb].reshape(nb, k, positions).transpose(1, 0, 2))
    return grads.reshape(k, nb * positions)


def packed_cf(g: Geom, x5, args, job, pick, one_product: bool,
              channels: tuple = None) -> np.ndarray:
    """A channels-first tile's windows, packed into the workspace: (G, Cg * taps, nb * L),
    columns ordered (image, position), with ``one_product`` (see
    :func:`._heuristics.batch_columns`); else (nb, G, Cg * taps, L). ``channels``: only the
    input channels [c0, c1) (one group, ``one_product``): (1, (c1 - c0) * taps, nb * L)."""
    n0, nb, q0, q1 = job
    c0, c1 = channels or (0, g.c)
    rows = (c1 - c0) * g.taps
    columns = _tiles.positions_in(q0, q1, g)
    shape = (rows, nb, columns) if one_product else (nb, rows, columns)
    col = _tiles.workspace(shape, x5.dtype)
    # A stride above 1 along rows: phase-split rows, then contiguous runs (each tile splits
    # only the input rows its windows read).
    kernel = im2col_cf_phased if g.stride[2] > 1 else im2col_cf
    pick(kernel)(x5, col, one_product, n0, c0, q0, q1, *args)
    if one_product:
        return col.reshape(g.groups, rows // g.groups, nb * columns)
    return col.reshape(nb, g.groups, rows // g.groups, columns)


def packed_cl(g: Geom, x5, args, job, pick) -> np.ndarray:
    """A channels-last tile's windows, packed into the workspace: (M, G, taps * Cg)."""
    n0, nb, q0, q1 = job
    m = nb * _tiles.positions_in(q0, q1, g)
    col = _tiles.workspace((m, g.groups, g.taps, g.cg), x5.dtype)
    pick(im2col_cl)(x5, col, n0, q0, q1, g.groups, *args)
    return col.reshape(m, g.groups, g.taps * g.cg)
