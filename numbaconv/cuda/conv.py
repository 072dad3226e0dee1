"""CUDA forward convolution: backend entry -> driver -> kernels.

Algorithms: ``implicit_gemm`` (register-tiled implicit GEMM, :mod:`._implicit_gemm`; any
problem), ``depthwise`` (:mod:`._depthwise`; one channel per group and per output channel)
and ``direct`` (the same kernel as ``depthwise``, each output summing its group's channels
one after another: grouped convolutions with few channels per group, where GEMM tiles would
be mostly empty). The data gradient and the transposed convolution run the same drivers in
``"data"`` mode (see :mod:`.conv_backward_data`).
"""

from __future__ import annotations

from . import _depthwise, _implicit_gemm


def run(problem, operands, out, algorithm):
    x, w, bias = operands
    return convolution("forward", problem, x, w, bias, out, algorithm, problem.y_shape)


def convolution(mode, problem, src, w, bias, out, algorithm, result_shape):
    """``out = [out +] conv(src, w) [+ bias]``, in ``mode`` "forward" or "data"."""
    if algorithm == "implicit_gemm":
        return _implicit_gemm.convolution(mode, problem, src, w, bias, out, result_shape)
    if algorithm in ("depthwise", "direct"):
        return _depthwise.convolution(mode, problem, src, w, bias, out, result_shape)
    raise ValueError(f"algorithm: {algorithm!r} is not a convolution algorithm here")
