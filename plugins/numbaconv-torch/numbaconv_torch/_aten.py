"""numbaconv problems translated into PyTorch ATen calls. Importing this module imports torch.

Three ATen operators cover the five ops, all on the *forward* geometry of the problem:

=========================  ==============================================================
op                         ATen call
=========================  ==============================================================
``conv``                   ``convolution(x, w, bias)``
``conv_backward_data``     ``convolution(dy, w, transposed=True)``, then cropped
``conv_backward_weight``   ``convolution_backward(dy, x, ·, output_mask=(0, 1, 0))``
``conv_backward_bias``     ``dy.sum`` over every axis but the channels
``conv_transpose``         the data gradient plus a bias over the C channels
=========================  ==============================================================

Padding. PyTorch pads symmetrically; numbaconv's padding is a ``(before, after)`` pair per
dim, and ``problem.output_size`` is authoritative: it may be shorter than the usual formula
gives (a transposed convolution with ``output_padding >= stride``), so the padding *after* that
matters is :attr:`numbaconv.problem.ConvProblem.trailing_padding`, what the last window reads,
which is negative when the tail of the input is never read. Along each dim the input is framed
as ``before`` zeros, the input, then ``trailing`` zeros (or a crop of ``-trailing`` elements),
a length of exactly ``(P - 1) * stride + dilation * (R - 1) + 1``, so a convolution without
padding gives exactly P outputs and a transposed one, without ``output_padding``, gives back
exactly that length. PyTorch applies the symmetric part ``min(before, trailing)`` itself (no
copy); :func:`torch.nn.functional.pad` applies the rest, its negative amounts cropping:

- forward and weight gradient pad (or crop) x by the rest before convolving;
- the data gradient is computed over the framed length and the rest is cropped off it (or,
  for a negative trailing pad, zeros are appended: the unread tail gets no gradient).

Layouts. Channels-last operands are viewed channels-first (a permutation, no copy); PyTorch
keeps channels-last strides through its 2D and 3D convolutions, so the permutation back to
the problem's layout is usually contiguous already.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F

_aten = torch.ops.aten


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (numbaconv hands over C-contiguous native arrays)."""
    if a.flags.writeable:
        return torch.from_numpy(a)
    # torch.from_numpy warns about read-only arrays because a tensor could write through them.
    # Nothing here writes to an operand, and copying to silence the warning would cost a pass
    # over the data, so the warning is silenced instead (catch_warnings swaps process-wide
    # state before Python 3.14, but only for read-only operands and only this one message).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                                category=UserWarning)
        return torch.from_numpy(a)


def _channels_first(a: np.ndarray, problem) -> torch.Tensor:
    """An activation (x, y, dx or dy) as a channels-first tensor view."""
    t = _tensor(a)
    return t.movedim(-1, 1) if problem.channels_last else t


def _physical(t: torch.Tensor, problem) -> torch.Tensor:
    """A channels-first activation back in the problem's layout (a view)."""
    return t.movedim(1, -1) if problem.channels_last else t


def _padding(problem) -> tuple[list, list]:
    """Split the framing padding into PyTorch's symmetric part and the rest.

    Returns
    -------
    symmetric : list of int
        Per dim, ``max(0, min(before, trailing))``: PyTorch's ``padding`` argument.
    rest : list of int
        ``F.pad``'s argument for the remainder: ``(before - symmetric, trailing - symmetric)``
        pairs, last dim first, as ``F.pad`` lists them. All zeros when PyTorch's padding alone
        frames the input.
    """
    symmetric, rest = [], []
    for before, trailing in zip(problem.padding_before, problem.trailing_padding):
        both = max(0, min(before, trailing))
        symmetric.append(both)
        rest = [before - both, trailing - both] + rest
    return symmetric, rest


def _framed_input(x: np.ndarray, problem, rest: list) -> torch.Tensor:
    """x channels-first, padded or cropped by ``rest`` (a view when nothing is left to do)."""
    xt = _channels_first(x, problem)
    return F.pad(xt, rest) if any(rest) else xt


def conv(problem, x, w, bias) -> torch.Tensor:
    """y = conv(x, w) + bias, ``problem.y_shape``."""
    symmetric, rest = _padding(problem)
    y = _aten.convolution(_framed_input(x, problem, rest), _tensor(w),
                          None if bias is None else _tensor(bias), list(problem.stride),
                          symmetric, list(problem.dilation), False, [0] * problem.ndim,
                          problem.groups)
    return _physical(y, problem)


def conv_backward_data(problem, dy, w, bias=None) -> torch.Tensor:
    """dx of ``problem.x_shape``; with ``bias`` (C,), the transposed convolution instead."""
    symmetric, rest = _padding(problem)
    # A negative trailing pad appends zeros to dx below; those positions must get the bias
    # too, so it is added after the crop rather than fused into the convolution.
    appends = any(t < 0 for t in problem.trailing_padding)
    fused_bias = _tensor(bias) if bias is not None and not appends else None
    # The transposed convolution of the forward geometry is its data gradient, and its
    # weight is w as it is, (K, C/groups, *R). output_padding is 0: over the framed length the
    # output size is exact, and the crop below takes care of the rest.
    dx = _aten.convolution(_channels_first(dy, problem), _tensor(w), fused_bias,
                           list(problem.stride), symmetric, list(problem.dilation), True,
                           [0] * problem.ndim, problem.groups)
    if any(rest):
        dx = F.pad(dx, [-r for r in rest])
    if bias is not None and fused_bias is None:
        dx.add_(_tensor(bias).view((1, -1) + (1,) * problem.ndim))  # dx is ours: F.pad's
    return _physical(dx, problem)


def conv_backward_weight(problem, x, dy) -> torch.Tensor:
    """dw of ``problem.w_shape``, C-contiguous."""
    symmetric, rest = _padding(problem)
    dyt = _channels_first(dy, problem)
    # convolution_backward reads only the weight's shape when its gradient alone is asked
    # for; a zero-stride placeholder avoids allocating one (torch.nn.grad.conv2d_weight does
    # the same).
    placeholder = dyt.new_empty(1).expand(problem.w_shape)
    _, dw, _ = _aten.convolution_backward(
        dyt, _framed_input(x, problem, rest), placeholder, None, list(problem.stride),
        symmetric, list(problem.dilation), False, [0] * problem.ndim, problem.groups,
        [False, True, False])
    # oneDNN may hand back a channels-last weight for channels-last activations.
    return dw.contiguous()


def conv_backward_bias(problem, dy) -> torch.Tensor:
    """db of shape ``(problem.channels,)``: dy summed over batch and space."""
    dyt = _tensor(dy)
    channel_axis = dyt.dim() - 1 if problem.channels_last else 1
    return dyt.sum(dim=[i for i in range(dyt.dim()) if i != channel_axis])


def conv_transpose(problem, x, w, bias) -> torch.Tensor:
    """The forward geometry's data gradient of x (``problem.y_shape``), plus bias over C."""
    return conv_backward_data(problem, x, w, bias)


#: Each op's function, called as ``OPS[op](problem, *operands)``.
OPS = {
    "conv": conv,
    "conv_backward_data": conv_backward_data,
    "conv_backward_weight": conv_backward_weight,
    "conv_backward_bias": conv_backward_bias,
    "conv_transpose": conv_transpose,
}
