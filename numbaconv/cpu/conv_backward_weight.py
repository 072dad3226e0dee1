"""CPU weight gradient: entry -> driver per algorithm -> kernels.

Deterministic: every tile's product lands in its own buffer and tiles are summed in a fixed
order, so the same inputs give bitwise the same dw on every run.
"""

from __future__ import annotations

import numpy as np

from numbaconv.backend import store

from . import _direct, _gemm
from ._im2col import im2col_cf, im2col_cl
from ._layout import Geom, geom


def run(problem, operands, out, algorithm):
    x, dy = operands
    g = geom(problem)
    if algorithm == "gemm":
        dw = _gemm_wgrad(g, x, dy)
    elif algorithm == "im2col":
        with _gemm.packing_threads():
            dw = _im2col_wgrad(g, x, dy)
    elif algorithm == "direct":
        dw = _direct.weight_gradient(g, x, dy)
    else:
        raise ValueError(f"algorithm: {algorithm!r} is not a weight-gradient algorithm")
    return store(dw.reshape(problem.w_shape), out, problem.accumulate)


def _gemm_wgrad(g: Geom, x, dy) -> np.ndarray:
    if g.pointwise and not g.channels_last:
        per_image = np.matmul(dy.reshape(g.n, g.g, g.kg, g.positions),
                              x.reshape(g.n, g.g, g.cg, g.positions).transpose(0, 1, 3, 2))
        return _sum_in_order(per_image)
    if g.pointwise:
        rows = dy.reshape(-1, g.g, g.kg).transpose(1, 2, 0)      # (G, Kg, N * S)
        return np.matmul(rows, x.reshape(-1, g.g, g.cg).transpose(1, 0, 2))
    if g.whole_input:
        dw = np.matmul(dy.reshape(g.n, g.g, g.kg).transpose(1, 2, 0),
                       x.reshape(g.n, g.g, -1).transpose(1, 0, 2))
        return _gemm.weight_from_cl(g, dw) if g.channels_last else dw
    raise ValueError("algorithm: 'gemm' needs a 1x1 or whole-input kernel")


def _im2col_wgrad(g: Geom, x, dy) -> np.ndarray:
    args = g.geometry_args()
    x5 = g.x5(x)
    per_position = _gemm.packed_bytes_per_position(g, x.itemsize)
    total = None
    if not g.channels_last:
        for n0, nb, q0, q1 in _gemm.tiles(g, per_position, _gemm.largest_operand(x, dy)):
            col = _gemm.workspace((nb, g.c * g.taps, _gemm.positions_in(q0, q1, g)),
                                  x.dtype)
            im2col_cf(x5, col, n0, q0, q1, *args)
            part = _sum_in_order(np.matmul(
                _gemm.output_columns(g, dy, n0, nb, q0, q1),
                col.reshape(nb, g.g, g.cg * g.taps, -1).transpose(0, 1, 3, 2)))
            total = part if total is None else total + part
        return total
    for n0, nb, q0, q1 in _gemm.tiles(g, per_position, _gemm.largest_operand(x, dy)):
        m = nb * _gemm.positions_in(q0, q1, g)
        col = _gemm.workspace((m, g.g, g.taps, g.cg), x.dtype)
        im2col_cl(x5, col, n0, q0, q1, g.g, *args)
        part = np.matmul(_gemm.output_rows(g, dy, n0, nb, q0, q1).transpose(1, 2, 0),
                         col.reshape(m, g.g, -1).transpose(1, 0, 2))
        total = part if total is None else total + part
    return _gemm.weight_from_cl(g, total)


def _sum_in_order(parts: np.ndarray) -> np.ndarray:
    """Sum over the first axis, one slice after another (a fixed order)."""
    total = parts[0].copy()
    for i in range(1, parts.shape[0]):
        total += parts[i]
    return total
