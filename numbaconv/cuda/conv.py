"""CUDA forward convolution: backend entry -> driver -> kernels.

Algorithms: ``implicit_gemm`` (shared-memory tiles of the weights and of input windows
gathered on the fly; any problem) and ``direct`` (one thread per output element; grouped
convolutions with few channels per group). The data gradient and the transposed convolution
run the same driver in ``"data"`` mode (see :mod:`.conv_backward_data`).
"""

from __future__ import annotations

from ..config import cuda_threads_per_block, cuda_tile
from . import _kernels
from ._layout import activation5, as_device, device_array, geom, geometry_args, weight5


def run(problem, operands, out, algorithm):
    x, w, bias = operands
    return convolution("forward", problem, x, w, bias, out, algorithm, problem.y_shape)


def convolution(mode, problem, src, w, bias, out, algorithm, result_shape):
    """``out = [out +] conv(src, w) [+ bias]``, in ``mode`` "forward" or "data"."""
    g = geom(problem)
    result = out if out is not None else device_array(result_shape, problem.dtype)
    out5 = activation5(g, result)
    src5 = activation5(g, src)
    has_bias = bias is not None
    bias = as_device(bias) if has_bias else _dummy(problem.dtype)
    args = (src5, weight5(w), bias, out5, has_bias, bool(problem.accumulate)) + \
        geometry_args(g)
    cl = problem.channels_last
    if algorithm == "implicit_gemm":
        tile = cuda_tile()
        tm, tq, _ = tile
        rows, cols = (g.kg, g.positions) if mode == "forward" else (g.cg, g.pixels)
        grid = (_blocks(cols, tq) * g.n * g.g, _blocks(rows, tm))
        kernel = _kernels.kernel("implicit_gemm", mode, cl, problem.dtype, tile)
        kernel[grid, (tq, tm)](*args)
    elif algorithm == "direct":
        threads = cuda_threads_per_block()
        elements = 1
        for d in result_shape:
            elements *= d
        kernel = _kernels.kernel("direct", mode, cl, problem.dtype)
        kernel[_blocks(elements, threads), threads](*args)
    else:
        raise ValueError(f"algorithm: {algorithm!r} is not a convolution algorithm here")
    return result


def _blocks(count: int, per_block: int) -> int:
    return max(1, -(-count // per_block))


_DUMMIES = {}


def _dummy(dtype):
    """A one-element stand-in for an absent bias (kernel arguments cannot be None)."""
    if dtype not in _DUMMIES:
        _DUMMIES[dtype] = device_array((1,), dtype)
    return _DUMMIES[dtype]
