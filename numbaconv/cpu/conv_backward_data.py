"""CPU data gradient (and transposed convolution): entry -> driver per algorithm -> kernels.

``im2col`` here is its mirror image: one BLAS product per tile gives the packed gradient of
every window (``W^T @ dy``), which col2im adds back into dx; ``gemm`` writes the product
straight into dx when the packing would be the identity; ``implicit`` and ``winograd`` (and
``im2col`` with stride 1) compute the stride-1 data gradient as the forward convolution of
dy with the flipped, transposed kernel.
"""

from __future__ import annotations

import numpy as np

from .._kernel_geometry import Geom, data_gradient_as_forward, geom
from . import _direct, _gemm, _im2col, _implicit, _tiles, _winograd


def run(problem, operands, out, algorithm):
    dy, w = operands
    g = geom(problem)
    dx = out if out is not None else np.empty(problem.x_shape, problem.dtype)
    data_gradient(g, dy, w, dx, problem.accumulate and out is not None, algorithm)
    return dx


def run_transpose(problem, operands, out, algorithm):
    """conv_transpose: the data gradient of the forward geometry, plus bias over C."""
    x, w, bias = operands
    g = geom(problem)
    y = out if out is not None else np.empty(problem.x_shape, problem.dtype)
    data_gradient(g, x, w, y, False, algorithm)
    if bias is not None:
        _tiles.add_channel_vector(g, y, bias, problem.channels_last)
    return y


def data_gradient(g: Geom, dy, w, dx, accumulate: bool, algorithm: str) -> None:
    if algorithm == "gemm":
        _gemm.data_gradient(g, dy, w, dx, accumulate)
        return
    if algorithm == "im2col":
        if g.stride == (1, 1, 1) and not accumulate and _tiles.finite(w):
            # A forward convolution of dy with the flipped, transposed kernel: dx is written
            # once, with no zeroing and no col2im read-modify-write of every window. It
            # multiplies the weights by dy's padding, which the reference never does: a
            # non-finite weight would give NaN where the reference has a number.
            _im2col.forward(data_gradient_as_forward(g), dy, None, dx,
                            _tiles.flipped_matrix(g, w))
            return
        _im2col.data_gradient(g, dy, w, dx, accumulate)
    elif algorithm == "direct":
        if _tiles.finite(w):
            _direct.data_gradient(g, dy, w, dx, accumulate)
        else:
            # The reference never multiplies a weight by padding here; im2col does not either
            # (and zeroes dx itself unless accumulating).
            _im2col.data_gradient(g, dy, w, dx, accumulate)
    elif algorithm == "implicit":
        if g.groups != 1:
            raise ValueError("algorithm: 'implicit' needs one group")
        if not _tiles.finite(w):                  # see im2col above
            _im2col.data_gradient(g, dy, w, dx, accumulate)
        elif g.stride != (1, 1, 1):
            # By stride phases, dy read in place: dy's zero columns multiply the weights too.
            # Channels-first through channels-last copies of dy and dx.
            strided = (_implicit.strided_data_gradient if g.channels_last
                       else _implicit.strided_data_gradient_cf)
            strided(g, dy, w, dx, accumulate)
        else:
            _implicit.forward(data_gradient_as_forward(g), dy,
                              _tiles.flipped_matrix(g, w, True)[0], dx, accumulate)
    elif algorithm == "winograd":
        _winograd.require(g)
        forward = data_gradient_as_forward(g)
        # With accumulate, or where a value is not finite (see _winograd), col2im.
        if accumulate or not _winograd.convolve(forward, dy, w, True, dx):
            _im2col.data_gradient(g, dy, w, dx, accumulate)
    else:
        raise ValueError(f"algorithm: {algorithm!r} is not a data-gradient algorithm")
