"""CPU weight gradient: entry -> driver per algorithm -> kernels.

Deterministic: tiles are dealt to slots by the shape alone, each slot adds its tiles' products
in tile order and the slots are summed in slot order, products are cut into slices fixed by
the shape, and BLAS runs on one thread (:func:`._tiles.blas_single_threaded`), so the same
inputs give bitwise the same dw on every run, whatever the thread count (Numba's or the
BLAS's).
"""

from __future__ import annotations

from numbaconv.backend import store

from .._kernel_geometry import geom
from . import _direct, _gemm, _im2col, _implicit, _tiles, _winograd
from ._heuristics import implicit_applies


#: The algorithms whose products go to BLAS (the others are Numba kernels alone, which skip
#: the few microseconds of holding BLAS to one thread).
BLAS_ALGORITHMS = ("gemm", "im2col", "winograd")


def run(problem, operands, out, algorithm):
    if algorithm in BLAS_ALGORITHMS:
        with _tiles.blas_single_threaded():
            dw = _weight_gradient(problem, operands, algorithm)
    else:
        dw = _weight_gradient(problem, operands, algorithm)
    return store(dw.reshape(problem.w_shape), out, problem.accumulate)


def _weight_gradient(problem, operands, algorithm):
    x, dy = operands
    g = geom(problem)
    if algorithm == "gemm":
        dw = _gemm.weight_gradient(g, x, dy)
    elif algorithm == "im2col":
        dw = _im2col.weight_gradient(g, x, dy)
    elif algorithm == "direct":
        dw = _direct.weight_gradient(g, x, dy)
    elif algorithm == "implicit":
        if not implicit_applies(problem.op, problem):
            raise ValueError("algorithm: 'implicit' needs one group")
        dw = _implicit.weight_gradient(g, x, dy)
    elif algorithm == "winograd":
        _winograd.require(g)
        dw = _winograd.weight_gradient(g, x, dy, _tiles.SLOTS)
        if dw is None:                          # a value not finite: see _winograd
            dw = _im2col.weight_gradient(g, x, dy)
    else:
        raise ValueError(f"algorithm: {algorithm!r} is not a weight-gradient algorithm")
    return dw
