"""Pure-Python shape and index arithmetic for convolutions.

Everything here works on one spatial dimension at a time (the functions take plain ints) or on
tuples of them. No NumPy, no Numba: these are the few lines of arithmetic that every backend and
the validation path share, written once and property-tested.

The one convention all of numbaconv uses: a convolution with input size ``S``, kernel size
``R``, stride ``s``, dilation ``d``, padding ``before`` and output size ``P`` computes, for every
output position ``p`` in ``range(P)``::

    y[p] = sum(w[r] * x[p * s - before + r * d] for r in range(R))

where reads outside ``[0, S)`` see zeros. Padding *after* only enters through ``P``: the
trailing pad actually read is :func:`trailing_padding` (possibly less than asked for, or
negative when the tail of the input is never read).
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple


def effective_kernel_size(kernel: int, dilation: int) -> int:
    """Extent of a dilated kernel: ``dilation * (kernel - 1) + 1``."""
    return dilation * (kernel - 1) + 1


def conv_output_size(size: int, kernel: int, stride: int, dilation: int,
                     before: int, after: int) -> int:
    """Output length of a convolution (may be zero or negative for an empty result)."""
    span = size + before + after - effective_kernel_size(kernel, dilation)
    # Floor division of a negative span must still mean "no complete window".
    return span // stride + 1 if span >= 0 else 0


def same_padding(size: int, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """TensorFlow's ``"SAME"`` padding: output ``ceil(size / stride)``, extra pad after."""
    out = -(-size // stride)
    total = max((out - 1) * stride + effective_kernel_size(kernel, dilation) - size, 0)
    return total // 2, total - total // 2


def transposed_output_size(size: int, kernel: int, stride: int, dilation: int,
                           before: int, after: int, output_padding: int) -> int:
    """Output length of a transposed convolution (PyTorch's ``ConvTranspose`` formula).

    ``size`` is the transposed convolution's input length, which is the output length ``P``
    of the forward convolution it is the adjoint of.
    """
    return ((size - 1) * stride - before - after
            + effective_kernel_size(kernel, dilation) + output_padding)


def trailing_padding(size: int, out_size: int, kernel: int, stride: int, dilation: int,
                     before: int) -> int:
    """Zero padding after the input that the last output window actually reads.

    Negative when the last ``-result`` input positions are never read (a stride remainder,
    or a transposed convolution's ``output_padding``).
    """
    return (out_size - 1) * stride + effective_kernel_size(kernel, dilation) - before - size


class ConvAsConv(NamedTuple):
    """A gradient expressed as a plain (correlation-style) convolution along one dimension.

    Apply it as: insert ``input_dilation - 1`` zeros between the elements of the operand
    (TensorFlow/XLA "lhs dilation"), pad it by ``padding`` (negative means crop), then run a
    convolution with ``stride`` and ``dilation``, flipping the kernel when ``flip`` is set.
    The result has exactly ``out_size`` elements.
    """

    input_dilation: int
    padding: tuple[int, int]
    stride: int
    dilation: int
    flip: bool
    out_size: int


def dgrad_as_conv(size: int, out_size: int, kernel: int, stride: int, dilation: int,
                  before: int) -> ConvAsConv:
    """Data gradient as a convolution of ``dy`` (length ``out_size``) with the flipped kernel.

    dx[i] = sum_r w[r] * dy[(i + before - r*d) / s]   (where the division is exact)

    Dilate dy by ``stride`` (length ``(P-1)*s+1``), pad by ``eff-1-before`` before and by
    whatever brings the output to ``size`` after, then convolve with the flipped kernel at
    dilation ``d`` and stride 1: stride and input dilation trade places.
    """
    eff = effective_kernel_size(kernel, dilation)
    pad_before = eff - 1 - before
    dilated = (out_size - 1) * stride + 1
    # Output length of the stride-1 conv must be `size`: dilated + b + a - eff + 1 = size.
    pad_after = size - dilated - pad_before + eff - 1
    return ConvAsConv(stride, (pad_before, pad_after), 1, dilation, True, size)


def wgrad_as_conv(size: int, out_size: int, kernel: int, stride: int, dilation: int,
                  before: int) -> ConvAsConv:
    """Weight gradient as a convolution of ``x`` with ``dy`` as the kernel.

    dw[r] = sum_p dy[p] * x[r*d + p*s - before]

    So the "kernel" is dy (length ``out_size``) at dilation ``s``, the "stride" is ``d`` and the
    output has ``kernel`` elements: stride and dilation trade places. Padding before stays;
    padding after is what the last tap reads (possibly negative: crop).
    """
    pad_after = (kernel - 1) * dilation + (out_size - 1) * stride - before - size + 1
    return ConvAsConv(1, (before, pad_after), dilation, stride, False, kernel)


def transpose_as_conv(size: int, out_size: int, kernel: int, stride: int, dilation: int,
                      before: int) -> ConvAsConv:
    """A transposed convolution is the data gradient of its forward convolution.

    ``size`` is the transposed output length (the forward input ``S``), ``out_size`` the
    transposed input length (the forward output ``P``).
    """
    return dgrad_as_conv(size, out_size, kernel, stride, dilation, before)


class StridePhase(NamedTuple):
    """The input positions ``first, first + stride, ...`` (``count`` of them) of a data
    gradient whose ``i + before`` has one residue modulo the stride, and the taps that reach
    them: ``(tap, delta)`` pairs, position ``first + stride*j`` reading dy at ``j + delta``."""
    first: int
    count: int
    taps: tuple


def stride_phases(size: int, out_size: int, kernel: int, stride: int, dilation: int,
                  before: int) -> tuple:
    """The data gradient of one dimension split by stride phases.

    ``dx[i] = sum(w[t] * dy[o] for t if (i + before - t*dilation) == o*stride, 0 <= o <
    out_size)``: for the positions of one phase only the taps with ``t*dilation`` congruent
    to ``i + before`` take part, and ``o = j + delta`` is a stride-1 convolution over the
    phase's ``j``. Phases without positions are left out; a phase may have no taps (its dx
    is zero). ``delta`` may reach outside ``[0, out_size)``: readers check the bounds.
    """
    phases = []
    for residue in range(stride):
        first = (residue - before) % stride
        count = len(range(first, size, stride))
        if count == 0:
            continue
        taps = tuple((t, (first + before - t * dilation) // stride) for t in range(kernel)
                     if (first + before - t * dilation) % stride == 0)
        phases.append(StridePhase(first, count, taps))
    return tuple(phases)


def normalize_int_tuple(value, ndim: int, name: str, minimum: int) -> tuple[int, ...]:
    """An int or one int per spatial dim, each ``>= minimum``, as a tuple."""
    if _is_int(value):
        values = (int(value),) * ndim
    elif isinstance(value, (tuple, list)) and all(_is_int(v) for v in value):
        if len(value) != ndim:
            raise ValueError(f"{name}: expected an int or {ndim} ints (one per spatial "
                             f"dimension), got {len(value)} values {tuple(value)!r}")
        values = tuple(int(v) for v in value)
    else:
        raise TypeError(f"{name}: expected an int or a tuple of {ndim} ints, "
                        f"got {value!r} of type {type(value).__name__}")
    bad = [v for v in values if v < minimum]
    if bad:
        raise ValueError(f"{name}: expected every value >= {minimum}, got {values!r}")
    return values


def normalize_padding(padding, ndim: int, size, kernel, stride, dilation,
                      name: str = "padding") -> tuple[tuple[int, int], ...]:
    """Every padding form as one ``(before, after)`` pair per spatial dim.

    Accepted: an int; one int per dim; one ``(before, after)`` pair per dim; ``"same"`` or
    ``"valid"`` (case-insensitive, TensorFlow rules, the extra pad of an odd total goes after).
    """
    if isinstance(padding, str):
        mode = padding.lower()
        if mode == "valid":
            return ((0, 0),) * ndim
        if mode == "same":
            return tuple(same_padding(size[i], kernel[i], stride[i], dilation[i])
                         for i in range(ndim))
        raise ValueError(f"{name}: expected 'same', 'valid', an int, ints or (before, after) "
                         f"pairs, got the string {padding!r}")
    if _is_int(padding):
        pairs = ((int(padding), int(padding)),) * ndim
    elif isinstance(padding, (tuple, list)):
        if len(padding) != ndim:
            raise ValueError(f"{name}: expected {ndim} entries (one per spatial dimension), "
                             f"got {len(padding)} in {padding!r}")
        pairs = []
        for p in padding:
            if _is_int(p):
                pairs.append((int(p), int(p)))
            elif (isinstance(p, (tuple, list)) and len(p) == 2
                  and _is_int(p[0]) and _is_int(p[1])):
                pairs.append((int(p[0]), int(p[1])))
            else:
                raise TypeError(f"{name}: expected each entry to be an int or a "
                                f"(before, after) pair of ints, got {p!r} in {padding!r}")
        pairs = tuple(pairs)
    else:
        raise TypeError(f"{name}: expected an int, a tuple of ints or pairs, 'same' or "
                        f"'valid', got {padding!r} of type {type(padding).__name__}")
    if any(b < 0 or a < 0 for b, a in pairs):
        raise ValueError(f"{name}: expected non-negative padding, got {pairs!r}")
    return pairs


def output_shape(size, kernel, stride, dilation, padding) -> tuple[int, ...]:
    """Output spatial shape for per-dim tuples (padding as pairs)."""
    return tuple(conv_output_size(size[i], kernel[i], stride[i], dilation[i], *padding[i])
                 for i in range(len(size)))


def flops(batch: int, in_channels: int, out_channels: int, groups: int,
          output_size, kernel) -> int:
    """Multiply-adds times two of a forward convolution (the same for dgrad and wgrad)."""
    return (2 * batch * out_channels * (in_channels // groups)
            * math.prod(output_size) * math.prod(kernel))


def _is_int(value) -> bool:
    # bool is an int subclass but never a meaningful stride or padding; numpy ints are fine.
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return not hasattr(value, "dtype") or getattr(value, "ndim", 0) == 0
