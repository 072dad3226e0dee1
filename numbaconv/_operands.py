"""Random operands for an op on a problem: what the autotuner times, and what the
conformance tests (:mod:`numbaconv.testing`, which re-exports both functions) and the
benchmarks feed."""

from __future__ import annotations

import numpy as np

from .problem import CONV_OPS


def random_array(shape, dtype, rng) -> np.ndarray:
    """Uniform draws in [-1, 1) of ``shape`` and ``dtype`` from the generator ``rng``."""
    return rng.uniform(-1.0, 1.0, size=shape).astype(dtype)


def random_operands(op: str, problem, seed: int = 0) -> tuple:
    """Random operands for ``op`` on ``problem`` (autotuning and benchmarks)."""
    rng = np.random.default_rng(seed)
    dtype = problem.dtype
    if op == "conv_backward_bias":
        operands = (random_array(problem.y_shape, dtype, rng),)
    elif op == "conv":
        bias = random_array((problem.out_channels,), dtype, rng) if problem.has_bias else None
        operands = (random_array(problem.x_shape, dtype, rng),
                    random_array(problem.w_shape, dtype, rng), bias)
    elif op == "conv_backward_data":
        operands = (random_array(problem.y_shape, dtype, rng),
                    random_array(problem.w_shape, dtype, rng))
    elif op == "conv_backward_weight":
        operands = (random_array(problem.x_shape, dtype, rng),
                    random_array(problem.y_shape, dtype, rng))
    elif op == "conv_transpose":
        bias = random_array((problem.in_channels,), dtype, rng) if problem.has_bias else None
        operands = (random_array(problem.y_shape, dtype, rng),
                    random_array(problem.w_shape, dtype, rng), bias)
    else:
        raise ValueError(f"op: expected one of {CONV_OPS}, got {op!r}")
    if problem.device == "cuda":
        from numba import cuda
        operands = tuple(None if a is None else cuda.to_device(a) for a in operands)
    return operands
