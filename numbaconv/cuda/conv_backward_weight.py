"""CUDA weight gradient: a register-tiled implicit GEMM over (image, output position), cut
in chunks whose partials are added in order (:func:`._implicit_gemm.weight_gradient`), or
for depthwise layers per-channel sums by chunks (:func:`._depthwise.weight_gradient`):
deterministic, no atomics.

The split depends on the problem's shape and the tile only (never on the device), so the
same inputs give bitwise the same dw on every run and every GPU of one architecture.
"""

from __future__ import annotations

from . import _depthwise, _implicit_gemm


def run(problem, operands, out, algorithm):
    x, dy = operands
    if algorithm == "depthwise":
        return _depthwise.weight_gradient(problem, x, dy, out)
    return _implicit_gemm.weight_gradient(problem, x, dy, out)
