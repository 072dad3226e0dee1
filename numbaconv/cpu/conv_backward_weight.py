"""CPU weight gradient: entry -> driver per algorithm -> kernels.

Deterministic: tiles are dealt to slots by the shape alone, each slot adds its tiles' products
in tile order and the slots are summed in slot order, so the same inputs give bitwise the
same dw on every run, whatever the thread count.
"""

from __future__ import annotations

import numpy as np

from numbaconv.backend import store

from . import _direct, _gemm, _implicit, _winograd
from . import implicit_applies
from ._layout import Geom, geom
from ._microkernel import gram


def run(problem, operands, out, algorithm):
    x, dy = operands
    g = geom(problem)
    if algorithm == "gemm":
        dw = _gemm_wgrad(g, x, dy)
    elif algorithm == "im2col":
        dw = _im2col_wgrad(g, x, dy)
    elif algorithm == "direct":
        dw = _direct.weight_gradient(g, x, dy)
    elif algorithm == "implicit":
        if not implicit_applies(problem.op, problem):
            raise ValueError("algorithm: 'implicit' needs one group")
        dw = _implicit.weight_gradient(g, x, dy)
    elif algorithm == "winograd":
        _winograd.require(g, weight_gradient=True)
        dw = _winograd.weight_gradient(g, x, dy, SLOTS)
        if dw is None:                          # a value not finite: see _winograd
            dw = _im2col_wgrad(g, x, dy)
    else:
        raise ValueError(f"algorithm: {algorithm!r} is not a weight-gradient algorithm")
    return store(dw.reshape(problem.w_shape), out, problem.accumulate)


def _gemm_wgrad(g: Geom, x, dy) -> np.ndarray:
    if g.pointwise and not g.channels_last:
        per_image = _gemm.matmul(
            dy.reshape(g.n, g.g, g.kg, g.positions),
            x.reshape(g.n, g.g, g.cg, g.positions).transpose(0, 1, 3, 2),
            np.empty((g.n, g.g, g.kg, g.cg), x.dtype))
        return _gemm.sum_in_order(per_image)
    if g.pointwise and g.n * g.positions >= POSITION_SPLIT_FROM * max(g.kg, g.cg):
        return _pointwise_by_positions(g, x.reshape(-1, g.g, g.cg), dy.reshape(-1, g.g, g.kg))
    if g.pointwise:
        rows = dy.reshape(-1, g.g, g.kg).transpose(1, 2, 0)      # (G, Kg, N * S)
        return _gemm.matmul(rows, x.reshape(-1, g.g, g.cg).transpose(1, 0, 2),
                            np.empty((g.g, g.kg, g.cg), x.dtype))
    if g.whole_input:
        features = x.reshape(g.n, g.g, -1).transpose(1, 0, 2)     # (G, N, F)
        dw = _gemm.matmul(dy.reshape(g.n, g.g, g.kg).transpose(1, 2, 0), features,
                          np.empty((g.g, g.kg, features.shape[-1]), x.dtype))
        return _gemm.weight_from_cl(g, dw) if g.channels_last else dw
    raise ValueError("algorithm: 'gemm' needs a 1x1 or whole-input kernel")


#: The weight gradient's tiles are dealt round-robin into this many partial sums (fewer
#: when there are fewer tiles), each summed in tile order, then added in slot order: a fixed
#: order that depends on the shape alone, not on how many threads run the slots.
SLOTS = 8


#: A channels-last 1x1 weight gradient whose positions (N * S, the products' shared axis)
#: number at least this many times its larger channel count is summed over SLOTS runs of
#: positions, each one BLAS product into a partial of dw, added in slot order; below, it is
#: one product over all positions, dw's rows shared out (every worker then reads all of x).
#: Measured on Zen 3 (AVX2, 2 cores, float32, one process, medians of 20 alternating
#: rounds), positions x K x C against the one product: 25,088 x 256 x 64 124 against 111
#: GFLOP/s, 25,088 x 64 x 256 122 against 115, 25,088 x 64 x 64 66 against 54, 6,272 x
#: 128 x 128 70 against 65; but 6,272 x 512 x 128 136 against 139, 1,568 x 256 x 1,024 135
#: against 156, 392 x 512 x 2,048 82 against 150.
POSITION_SPLIT_FROM = 16


def _pointwise_by_positions(g: Geom, x, dy) -> np.ndarray:
    """dw (G, Kg, Cg) of a channels-last 1x1 convolution from x (M, G, Cg) and dy (M, G, Kg),
    M = N * S: SLOTS products over runs of positions (a split fixed by the shape), each
    with the wider side as its columns (OpenBLAS runs (64, 256) faster than (256, 64)),
    summed in order."""
    m = x.shape[0]
    step = -(-m // SLOTS)
    transposed = g.kg > g.cg
    # Each part is (G, rows, columns) = left (G, rows, M') @ right (G, M', columns).
    left, right = (x, dy) if transposed else (dy, x)

    def part(start, pick):
        run = slice(start, start + step)
        return np.matmul(left[run].transpose(1, 2, 0), right[run].transpose(1, 0, 2),
                         out=np.empty((g.g, left.shape[2], right.shape[2]), x.dtype))

    total = _gemm.sum_in_order(_gemm.run_tiles(part, list(range(0, m, step))))
    return np.ascontiguousarray(total.transpose(0, 2, 1)) if transposed else total


#: dw (G, Kg, features) is computed transposed, (G, features, Kg), below this many output
#: channels per group: OpenBLAS runs that product faster for small Kg (64: 191 against 136
#: GFLOP/s on one thread, 512: 217 against 211), and wide layers would pay for transposing
#: the dw-sized result back (ResNet's 512-channel 7x7 layer: 9.4 MB).
TRANSPOSED_BELOW = 256


#: Channels-last, one group: dw's product runs through numbaconv's own micro-kernel, reading
#: the packed windows and dy in place (_microkernel.gram), for dw of at most this many values;
#: a larger dw, re-read and re-written per chunk of positions, ran slower there than BLAS.
#: One thread, one tile (Zen 4): the 7x7 stem 102 against 91 GFLOP/s, ResNet's 64-channel
#: 3x3 111 against 98, the 1D k5 128-channel layer 114 against 102; 256 channels at 14x14
#: (590k values) 104 both, 512 at 7x7 (2.4M) 79 against 100.
IN_PLACE_DW_UP_TO = 2**18


def _im2col_wgrad(g: Geom, x, dy) -> np.ndarray:
    args = g.geometry_args()
    x5 = g.x5(x)
    per_position = _gemm.packed_bytes_per_position(g, x.itemsize)
    tiles = list(_gemm.tiles(g, per_position, _gemm.largest_operand(x, dy)))
    slots = min(SLOTS, len(tiles))
    transposed = g.kg < TRANSPOSED_BELOW
    in_place = g.channels_last and g.g == 1 and g.cg * g.taps * g.kg <= IN_PLACE_DW_UP_TO

    def dot(features, grads, out=None):
        """Over the last axis: features (..., F, L) and grads (..., Kg, L) give dw's part,
        (..., Kg, F), or its transpose, in ``out`` when given."""
        if transposed:
            return np.matmul(features, np.swapaxes(grads, -1, -2), out=out)
        return np.matmul(grads, np.swapaxes(features, -1, -2), out=out)

    if not g.channels_last:
        def product(tile, pick, out):
            n0, nb, q0, q1 = tile
            one_product = _gemm.batch_columns(g, nb)
            col = _gemm.packed_cf(g, x5, args, tile, pick, one_product)
            if one_product:
                # dy's tile copied to (G, Kg, image, position), the columns' order.
                rows = _gemm.workspace((g.k, nb, col.shape[-1] // nb), x.dtype, "rows")
                rows[...] = dy.reshape(g.n, g.k, -1)[n0:n0 + nb].transpose(1, 0, 2)
                return dot(col, rows.reshape(g.g, g.kg, -1), out)
            if nb == 1:
                return dot(col[0], _gemm.output_columns(g, dy, n0, nb, q0, q1)[0], out)
            return _gemm.sum_in_order(
                dot(col, _gemm.output_columns(g, dy, n0, nb, q0, q1)))
    elif in_place:
        # The windows (M, F) and dy's rows (M, K) are the operands of _microkernel.gram as
        # they lie; later tiles add straight into their slot's sum (``out``).
        def product(tile, pick, out):
            n0, nb, q0, q1 = tile
            features = _gemm.packed_cl(g, x5, args, tile, pick)[:, 0]
            grads = _gemm.output_rows(g, dy, n0, nb, q0, q1)[:, 0]
            a, b = (features, grads) if transposed else (grads, features)
            first = out is None
            if first:
                out = np.empty((1, a.shape[1], b.shape[1]), x.dtype)
            gram(a, b, out[0], add=not first)
            return out
    else:
        def product(tile, pick, out):
            n0, nb, q0, q1 = tile
            return dot(_gemm.packed_cl(g, x5, args, tile, pick).transpose(1, 2, 0),
                       _gemm.output_rows(g, dy, n0, nb, q0, q1).transpose(1, 2, 0), out)

    def slot(first, pick):
        total = product(tiles[first], pick, None)
        for tile in tiles[first + slots::slots]:
            if in_place:
                product(tile, pick, total)
            else:
                # Later tiles' products go to a reused buffer (a fresh dw-sized array per
                # tile costs a page fault per 4 KiB), then into the slot's sum.
                total += product(tile, pick,
                                 _gemm.workspace(total.shape, total.dtype, "product"))
        return total

    total = _gemm.sum_in_order(_gemm.run_tiles(slot, list(range(slots))))
    if transposed:
        total = total.transpose(0, 2, 1)
    return _gemm.weight_from_cl(g, total) if g.channels_last else \
        np.ascontiguousarray(total)
