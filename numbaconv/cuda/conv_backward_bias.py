"""CUDA bias gradient: db[k] = sum of dy over batch and space, as a two-pass reduction
(:mod:`._bias`: a block per channels and chunk of rows, then the chunks' partials added in
order). The split depends only on the shape and the configured threads per block:
deterministic.
"""

from __future__ import annotations

from ..config import cuda_threads_per_block
from ._bias import bias_gradient


def run(problem, operands, out, algorithm):
    (dy,) = operands
    return bias_gradient(problem, dy, out, cuda_threads_per_block())
