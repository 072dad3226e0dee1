"""CUDA data gradient and transposed convolution: the forward driver in ``"data"`` mode.

Every dx element is summed by the thread that owns it over the (output channel, tap) pairs
whose window covers it (:mod:`._implicit_gemm` by stride phases, :mod:`._depthwise`), so
nothing is scattered and no atomics are needed.
"""

from __future__ import annotations

from .conv import convolution


def run(problem, operands, out, algorithm):
    dy, w = operands
    return convolution("data", problem, dy, w, None, out, algorithm, problem.x_shape)


def run_transpose(problem, operands, out, algorithm):
    x, w, bias = operands
    return convolution("data", problem, x, w, bias, out, algorithm, problem.x_shape)
