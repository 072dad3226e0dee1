"""CUDA data gradient and transposed convolution: the forward driver in ``"data"`` mode.

Each thread owns one dx element and sums the (output channel, tap) pairs whose window covers
it, so nothing is scattered and no atomics are needed (see ``_kernels.implicit_gemm``).
"""

from __future__ import annotations

from .conv import convolution


def run(problem, operands, out, algorithm):
    dy, w = operands
    return convolution("data", problem, dy, w, None, out, algorithm, problem.x_shape)


def run_transpose(problem, operands, out, algorithm):
    x, w, bias = operands
    return convolution("data", problem, x, w, bias, out, algorithm, problem.x_shape)
