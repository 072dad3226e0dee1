"""CUDA forward convolution: backend entry -> driver -> kernels.

Algorithms: ``implicit_gemm`` (register-tiled implicit GEMM, :mod:`._implicit_gemm`; any
problem), ``depthwise`` (:mod:`._depthwise`; one channel per group and per output channel)
and ``direct`` (one thread per output element; grouped convolutions with few channels per
group). The data gradient and the transposed convolution run the same drivers
in ``"data"`` mode (see :mod:`.conv_backward_data`).
"""

from __future__ import annotations

from ..config import cuda_threads_per_block
from . import _depthwise, _implicit_gemm, _kernels
from ._layout import activation5, as_device, device_array, geom, geometry_args, weight5


def run(problem, operands, out, algorithm):
    x, w, bias = operands
    return convolution("forward", problem, x, w, bias, out, algorithm, problem.y_shape)


def convolution(mode, problem, src, w, bias, out, algorithm, result_shape):
    """``out = [out +] conv(src, w) [+ bias]``, in ``mode`` "forward" or "data"."""
    if algorithm == "implicit_gemm":
        return _implicit_gemm.convolution(mode, problem, src, w, bias, out, result_shape)
    if algorithm == "depthwise":
        return _depthwise.convolution(mode, problem, src, w, bias, out, result_shape)
    if algorithm != "direct":
        raise ValueError(f"algorithm: {algorithm!r} is not a convolution algorithm here")
    g = geom(problem)
    result = out if out is not None else device_array(result_shape, problem.dtype)
    out5 = activation5(g, result)
    src5 = activation5(g, src)
    has_bias = bias is not None
    bias = as_device(bias) if has_bias else _dummy(problem.dtype)
    args = (src5, weight5(w), bias, out5, has_bias, bool(problem.accumulate)) + \
        geometry_args(g)
    threads = cuda_threads_per_block()
    elements = 1
    for d in result_shape:
        elements *= d
    kernel = _kernels.kernel("direct", mode, problem.channels_last, problem.dtype)
    kernel[_blocks(elements, threads), threads](*args)
    return result


def _blocks(count: int, per_block: int) -> int:
    return max(1, -(-count // per_block))


_DUMMIES = {}


def _dummy(dtype):
    """A one-element stand-in for an absent bias (kernel arguments cannot be None)."""
    if dtype not in _DUMMIES:
        _DUMMIES[dtype] = device_array((1,), dtype)
    return _DUMMIES[dtype]
