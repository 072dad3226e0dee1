"""CPU forward convolution: backend entry -> driver per algorithm -> kernels.

Algorithms: ``gemm`` (the convolution is a matrix product over x itself: 1x1 kernels with
stride 1 and no padding, or kernels as large as the unpadded input), ``im2col`` (pack windows,
then one BLAS product per tile; any problem), ``implicit`` (stride 1, one group: the
micro-kernel reads the windows in a padded copy of x's rows, see ``_implicit``),
``winograd`` (3x3, stride 1, one group: Winograd F(2x2, 3x3), or F(4x4, 3x3) on wide
images, see ``_winograd``) and
``direct`` (Numba loops for grouped convolutions with few channels per group, where GEMM
wastes work).
"""

from __future__ import annotations

import numpy as np

from .._kernel_geometry import geom
from . import _direct, _gemm, _im2col, _implicit, _tiles, _winograd


def run(problem, operands, out, algorithm):
    x, w, bias = operands
    g = geom(problem)
    y = out if out is not None else np.empty(problem.y_shape, problem.dtype)
    if algorithm == "gemm":
        _gemm.forward(g, x, w, y)
    elif algorithm == "im2col":
        _im2col.forward(g, x, w, y)
    elif algorithm == "direct":
        if _tiles.finite(w):
            _direct.forward(g, x, w, y)
        else:
            # Padding times a non-finite weight is NaN in the reference: im2col multiplies it.
            _im2col.forward(g, x, w, y)
    elif algorithm == "implicit":
        if g.stride != (1, 1, 1) or g.groups != 1:
            raise ValueError("algorithm: 'implicit' needs stride 1 and one group")
        _implicit.forward(g, x, _tiles.weight_cl(g, w)[0].T, y, False)
    elif algorithm == "winograd":
        _winograd.require(g)
        if not _winograd.convolve(g, x, w, False, y):
            _im2col.forward(g, x, w, y)         # a value not finite: see _winograd
    else:
        raise ValueError(f"algorithm: {algorithm!r} is not a forward algorithm")
    if bias is not None:
        _tiles.add_channel_vector(g, y, bias, problem.channels_last)
    return y
