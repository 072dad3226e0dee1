"""The reference backend: every convolution op in plain NumPy, slow and obviously right.

It is the oracle of the test suite and the last-resort backend. Each op is a loop over the
kernel's taps; each tap is one batched matrix product over (batch, group) between a strided
window of the (zero-padded) input and one slice of the weight, exactly as the convention in
:mod:`numbaconv._geometry` reads::

    y[n, k, p] += w[k, c, r] * xpad[n, c, r * dilation + p * stride]

The data gradient scatters the same products back into a padded buffer and crops it; the weight
gradient contracts the same windows with dy. Channels-last arrays are viewed channels-first.
"""

from __future__ import annotations

import math

import numpy as np

from .backend import Backend, store
from .problem import CONV_OPS


def _channels_first(a: np.ndarray, problem) -> np.ndarray:
    return np.moveaxis(a, -1, 1) if problem.channels_last else a


def _physical(a: np.ndarray, problem) -> np.ndarray:
    return np.ascontiguousarray(np.moveaxis(a, 1, -1) if problem.channels_last else a)


def _padded_length(problem) -> tuple:
    """Length of the zero-padded input buffer along each spatial dim."""
    return tuple(b + s + max(t, 0) for b, s, t in
                 zip(problem.padding_before, problem.input_size, problem.trailing_padding))


def _taps(problem):
    """For each kernel tap r: (r, the window of padded positions r*d + p*s for p < P)."""
    for r in np.ndindex(*problem.kernel_size):
        window = tuple(slice(r[i] * problem.dilation[i],
                             r[i] * problem.dilation[i]
                             + (problem.output_size[i] - 1) * problem.stride[i] + 1,
                             problem.stride[i]) for i in range(problem.ndim))
        yield r, window


def _grouped_input(x: np.ndarray, problem) -> np.ndarray:
    """x zero-padded, viewed as (N, G, C/G, *padded)."""
    n, c, g = problem.batch, problem.in_channels, problem.groups
    xpad = np.zeros((n, c) + _padded_length(problem), dtype=x.dtype)
    inner = tuple(slice(b, b + s) for b, s in zip(problem.padding_before, problem.input_size))
    xpad[(slice(None), slice(None)) + inner] = _channels_first(x, problem)
    return xpad.reshape((n, g, c // g) + xpad.shape[2:])


def _grouped_weight(w: np.ndarray, problem) -> np.ndarray:
    """w viewed as (G, K/G, C/G, *R)."""
    g, k = problem.groups, problem.out_channels
    return w.reshape((g, k // g) + w.shape[1:])


def _grouped_output(dy: np.ndarray, problem) -> np.ndarray:
    """dy (or y) channels-first as (N, G, K/G, prod(P))."""
    n, k, g = problem.batch, problem.out_channels, problem.groups
    dy = _channels_first(dy, problem)
    return dy.reshape(n, g, k // g, math.prod(problem.output_size))


def conv_forward(x, w, bias, problem) -> np.ndarray:
    """y = conv(x, w) + bias, in the problem's layout."""
    n, g, k = problem.batch, problem.groups, problem.out_channels
    xg = _grouped_input(x, problem)
    wg = _grouped_weight(w, problem)
    y = np.zeros((n, g, k // g, math.prod(problem.output_size)), dtype=x.dtype)
    for r, window in _taps(problem):
        xs = xg[(Ellipsis,) + window].reshape(n, g, xg.shape[2], -1)   # (N, G, C/G, P)
        y += wg[(Ellipsis,) + r] @ xs                                  # (G, K/G, C/G) @ ...
    y = y.reshape((n, k) + problem.output_size)
    if bias is not None:
        y += bias.reshape((1, k) + (1,) * problem.ndim)
    return _physical(y, problem)


def conv_backward_data(dy, w, problem) -> np.ndarray:
    """dx: each tap's products scattered back into a padded buffer, then cropped."""
    n, g, c = problem.batch, problem.groups, problem.in_channels
    dyg = _grouped_output(dy, problem)
    wg = _grouped_weight(w, problem)
    dxpad = np.zeros((n, g, c // g) + _padded_length(problem), dtype=dy.dtype)
    for r, window in _taps(problem):
        contribution = np.swapaxes(wg[(Ellipsis,) + r], -1, -2) @ dyg  # (N, G, C/G, P)
        dxpad[(Ellipsis,) + window] += contribution.reshape(
            (n, g, c // g) + problem.output_size)
    inner = tuple(slice(b, b + s) for b, s in zip(problem.padding_before, problem.input_size))
    dx = dxpad.reshape((n, c) + dxpad.shape[3:])[(slice(None), slice(None)) + inner]
    return _physical(dx, problem)


def conv_backward_weight(x, dy, problem) -> np.ndarray:
    """dw[k, c, r] = sum over n, p of dy[n, k, p] * xpad[n, c, r*d + p*s]."""
    n, g = problem.batch, problem.groups
    xg = _grouped_input(x, problem)
    # dy as (G, K/G, N * P): batch and space are the contraction.
    dyg = _grouped_output(dy, problem).transpose(1, 2, 0, 3).reshape(g, -1, n * math.prod(
        problem.output_size))
    dw = np.zeros((g, problem.out_channels // g) + problem.w_shape[1:], dtype=dy.dtype)
    for r, window in _taps(problem):
        xs = xg[(Ellipsis,) + window].reshape(n, g, xg.shape[2], -1)   # (N, G, C/G, P)
        xs = xs.transpose(1, 0, 3, 2).reshape(g, -1, xg.shape[2])      # (G, N * P, C/G)
        dw[(Ellipsis,) + r] = dyg @ xs
    return dw.reshape(problem.w_shape)


def conv_backward_bias(dy, problem) -> np.ndarray:
    """db[k] = sum of dy over every axis but the channel axis."""
    axis = -1 if problem.channels_last else 1
    return dy.sum(axis=tuple(i for i in range(dy.ndim) if i != axis % dy.ndim))


def conv_transpose(x, w, bias, problem) -> np.ndarray:
    """The transposed convolution is the forward convolution's data gradient, plus bias."""
    y = conv_backward_data(x, w, problem)
    if bias is not None:
        axis = -1 if problem.channels_last else 1
        shape = [1] * y.ndim
        shape[axis] = problem.in_channels
        y += bias.reshape(shape)
    return y


class ReferenceBackend(Backend):
    """Plain NumPy; supports every convolution problem on the CPU in float32 and float64."""

    name = "reference"
    device = "cpu"
    priority = 0
    version = "1"
    ops = frozenset(CONV_OPS)

    def choose(self, op, problem):
        return "numpy", "the only algorithm (per-tap batched matmul)"

    def algorithms(self, op, problem):
        return ("numpy",)

    def run(self, op, problem, operands, out, algorithm):
        if op == "conv":
            result = conv_forward(*operands, problem)
        elif op == "conv_backward_data":
            result = conv_backward_data(*operands, problem)
        elif op == "conv_backward_weight":
            result = conv_backward_weight(*operands, problem)
        elif op == "conv_backward_bias":
            result = conv_backward_bias(*operands, problem)
        elif op == "conv_transpose":
            result = conv_transpose(*operands, problem)
        else:
            raise ValueError(f"op: {op!r} is not a convolution op")
        return store(result, out, problem.accumulate)


def make_backend() -> ReferenceBackend:
    """Entry point of the built-in ``reference`` backend."""
    return ReferenceBackend()
