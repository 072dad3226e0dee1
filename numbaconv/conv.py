"""Public convolution functions: validate once, normalise once, dispatch. No kernels here.

Shapes (channels-first, the default ``layout="channels_first"``): x ``(N, C, *S)``, y and dy
``(N, K, *P)``; channels-last (``layout="channels_last"``): x ``(N, *S, C)``, y and dy
``(N, *P, K)``. Weights are always ``(K, C // groups, *R)``; a transposed convolution's weight
is ``(C_in, C_out // groups, *R)`` as in PyTorch's ``ConvTranspose``. One, two or three spatial
dimensions, taken from ``w.ndim - 2``.

Common keyword arguments (keyword-only): ``stride`` and ``dilation`` (an int or one per
spatial dim, >= 1); ``padding`` (an int, one int per dim, one ``(before, after)`` pair per dim,
or ``"same"``/``"valid"`` with TensorFlow's rules, the odd extra pad going after); ``groups``
(divides C and K; ``groups == C`` is depthwise); ``layout``.

Semantics equal PyTorch's ``conv{1,2,3}d``, ``conv_transpose{1,2,3}d`` and
``torch.ops.aten.convolution_backward``, extended with asymmetric and same/valid padding.
"""

from __future__ import annotations

import numpy as np

from . import _arrays as arrays
from . import dispatch
from . import problem as pb

_DEFAULTS = dict(stride=1, padding=0, dilation=1, groups=1, layout="channels_first")

#: The keyword arguments the public functions share, documented once and written into each
#: function's docstring (where ``help()`` shows them) by :func:`_keywords`.
_KEYWORD_DOCS = {
    "stride": """\
stride : int or tuple of int, default 1
    Step of the kernel over the input: one int for all spatial dims, or one per dim
    (each >= 1).""",
    "padding": """\
padding : int, tuple or str, default 0
    Zeros around the input: an int; one int per spatial dim; one ``(before, after)`` pair
    per dim (asymmetric, TensorFlow's EXPLICIT); or ``"same"`` / ``"valid"``
    (case-insensitive, TensorFlow's rules: ``"same"`` gives ``ceil(S / stride)`` outputs,
    the odd extra pad going after).""",
    "dilation": """\
dilation : int or tuple of int, default 1
    Spacing between kernel taps: one int, or one per spatial dim (>= 1).""",
    "groups": """\
groups : int, default 1
    Divides C and K: each of ``groups`` groups of ``C // groups`` input channels feeds its
    ``K // groups`` outputs; ``groups == C`` is depthwise.""",
    "layout": """\
layout : {"channels_first", "channels_last"}, default "channels_first"
    Activations are ``(N, C, *S)`` channels-first and ``(N, *S, C)`` channels-last; weights
    are ``(K, C // groups, *R)`` in both.""",
}


def _keywords(*names):
    """Replace the line ``{keywords}`` of a function's docstring with the shared entries of
    ``names`` (keyword-only, as every public function takes them)."""
    text = "\n".join(_KEYWORD_DOCS[n] for n in names)
    block = "".join(f"    {line}\n" if line else "\n" for line in text.splitlines())

    def decorate(func):
        if func.__doc__:  # None under python -OO
            func.__doc__ = func.__doc__.replace("    {keywords}\n", block)
        return func
    return decorate


_ALL = ("stride", "padding", "dilation", "groups", "layout")


def _run(op, problem, operands, out):
    """Hand CPU backends C-contiguous native arrays; route a strided ``out`` via a copy."""
    if problem.device != "cpu":
        return dispatch.run(op, problem, operands, out)
    if not all(a is None or arrays.ready(a) for a in operands):
        operands = tuple(map(arrays.contiguous, operands))
    if out is None:  # the usual call: nothing to route, one function call fewer
        return dispatch.run(op, problem, operands, None)
    return arrays.run(op, problem, operands, out)


@_keywords(*_ALL)
def conv(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1,
         layout="channels_first", out=None):
    """Forward convolution (cross-correlation, like PyTorch's ``conv{1,2,3}d``).

    Parameters
    ----------
    x : array, shape (N, C, *S) or (N, *S, C) for channels_last
    w : array, shape (K, C // groups, *R)
    bias : array, shape (K,), optional
    {keywords}
    out : array, shape of y, optional
        Written in place and returned.

    Returns
    -------
    y : array, shape (N, K, *P) or (N, *P, K)
        ``P = floor((S + before + after - dilation * (R - 1) - 1) / stride) + 1``.
    """
    problem = pb.conv_problem(x, w, bias, stride=stride, padding=padding, dilation=dilation,
                              groups=groups, layout=layout, out=out)
    return _run("conv", problem, (x, w, bias), out)


@_keywords(*_ALL)
def conv_backward_data(dy, w, input_shape, *, stride=1, padding=0, dilation=1, groups=1,
                       layout="channels_first", out=None, accumulate=False):
    """Data gradient (dgrad) of :func:`conv`: dx = dL/dx given dy = dL/dy.

    Parameters
    ----------
    dy : array, shape (N, K, *P) or (N, *P, K)
    w : array, shape (K, C // groups, *R)
    input_shape : tuple of int
        Shape of x (in ``layout``); it resolves which S produced P when stride > 1.
    {keywords}
    out : array, shape input_shape, optional
    accumulate : bool
        Add into ``out`` (cuDNN beta = 1); requires ``out``.

    Returns
    -------
    dx : array, shape input_shape
    """
    problem = pb.conv_backward_data_problem(dy, w, input_shape, stride=stride,
                                            padding=padding, dilation=dilation,
                                            groups=groups, layout=layout, out=out,
                                            accumulate=accumulate)
    return _run("conv_backward_data", problem, (dy, w), out)


@_keywords(*_ALL)
def conv_backward_weight(x, dy, weight_shape, *, stride=1, padding=0, dilation=1, groups=1,
                         layout="channels_first", out=None, accumulate=False):
    """Weight gradient (wgrad) of :func:`conv`: dw = dL/dw given x and dy.

    Note the argument order: ``conv_backward_weight(x, dy, ...)`` takes the forward input
    first, while ``conv_backward(dy, x, w)`` takes dy first. When x and dy have the same
    shape (same channels and size: stride 1, "same" padding) a swap cannot be detected and
    silently gives a wrong gradient; pass them in the order shown here.

    Parameters
    ----------
    x : array, shape (N, C, *S) or (N, *S, C)
    dy : array, shape (N, K, *P) or (N, *P, K)
    weight_shape : tuple of int
        ``(K, C // groups, *R)``.
    {keywords}
    out : array, shape weight_shape, optional
    accumulate : bool
        Add into ``out`` (gradient accumulation across micro-batches); requires ``out``.

    Returns
    -------
    dw : array, shape weight_shape
    """
    problem = pb.conv_backward_weight_problem(x, dy, weight_shape, stride=stride,
                                              padding=padding, dilation=dilation,
                                              groups=groups, layout=layout, out=out,
                                              accumulate=accumulate)
    return _run("conv_backward_weight", problem, (x, dy), out)


@_keywords("layout")
def conv_backward_bias(dy, *, layout="channels_first", out=None, accumulate=False):
    """Bias gradient (bgrad): db[k] = sum of dy over batch and space.

    Parameters
    ----------
    dy : array, shape (N, K, *P) or (N, *P, K)
    {keywords}
    out : array, shape (K,), optional
    accumulate : bool
        Add into ``out``; requires ``out``.

    Returns
    -------
    db : array, shape (K,)
    """
    problem = pb.conv_backward_bias_problem(dy, layout=layout, out=out, accumulate=accumulate)
    return _run("conv_backward_bias", problem, (dy,), out)


@_keywords(*_ALL)
def conv_backward(dy, x, w, *, stride=1, padding=0, dilation=1, groups=1,
                  layout="channels_first", needs=(True, True, True)):
    """All gradients of :func:`conv` at once, validated together.

    Note the argument order, dy first: ``conv_backward(dy, x, w)``, unlike
    :func:`conv_backward_weight`'s ``(x, dy, weight_shape)``.

    Parameters
    ----------
    dy : array, shape of y
    x : array, shape (N, C, *S) or (N, *S, C)
    w : array, shape (K, C // groups, *R)
    {keywords}
    needs : tuple of 3 bools
        Which of (dx, dw, db) to compute.

    Returns
    -------
    (dx, dw, db) : tuple
        Each array, or None where ``needs`` says it is not needed.
    """
    needs = pb.check_needs(needs)
    problem = pb.conv_problem(x, w, stride=stride, padding=padding, dilation=dilation,
                              groups=groups, layout=layout)
    pb.check_gradient(dy, problem.y_shape, problem.device, problem.dtype, "the shape of y")
    return _backward(problem, needs, dy, x, w)


@_keywords("stride", "dilation", "groups", "layout")
def conv_transpose(x, w, bias=None, *, stride=1, padding=0, output_padding=0, dilation=1,
                   groups=1, layout="channels_first", out=None):
    """Transposed convolution (PyTorch's ``conv_transpose{1,2,3}d``), the adjoint of conv.

    Parameters
    ----------
    x : array, shape (N, C_in, *S_in) or (N, *S_in, C_in)
    w : array, shape (C_in, C_out // groups, *R)
    bias : array, shape (C_out,), optional
    output_padding : int or tuple of int
        Extra size added after the output, each < max(stride, dilation) (PyTorch's rule);
        it picks one of the input sizes a strided convolution maps to the same output size.
    padding
        As for :func:`conv`, naming the padding of the forward convolution this is the
        adjoint of. ``"same"`` gives ``S_out = S_in * stride`` (``output_padding`` must be 0);
        ``"valid"`` gives ``(S_in - 1) * stride + dilation * (R - 1) + 1 + output_padding``.
    {keywords}
    out : array, shape of the result, optional

    Returns
    -------
    y : array, shape (N, C_out, *S_out) or (N, *S_out, C_out)
        ``S_out = (S_in - 1) * stride - before - after + dilation * (R - 1) + 1 +
        output_padding``.
    """
    problem = pb.conv_transpose_problem(x, w, bias, stride=stride, padding=padding,
                                        output_padding=output_padding, dilation=dilation,
                                        groups=groups, layout=layout, out=out)
    return _run("conv_transpose", problem, (x, w, bias), out)


@_keywords(*_ALL)
def conv_transpose_backward(dy, x, w, *, stride=1, padding=0, output_padding=0, dilation=1,
                            groups=1, layout="channels_first", needs=(True, True, True)):
    """All gradients of :func:`conv_transpose`.

    Parameters
    ----------
    dy : array, shape of the transposed convolution's output
    x : array, shape (N, C_in, *S_in) or (N, *S_in, C_in)
    w : array, shape (C_in, C_out // groups, *R)
    {keywords}
    needs : tuple of 3 bools
        Which of (dx, dw, db) to compute.

    Returns
    -------
    (dx, dw, db) : tuple
        dx has x's shape (it is ``conv(dy, w)``), dw w's, db ``(C_out,)``; None where not
        needed.
    """
    needs = pb.check_needs(needs)
    problem = pb.conv_transpose_problem(x, w, stride=stride, padding=padding,
                                        output_padding=output_padding, dilation=dilation,
                                        groups=groups, layout=layout)
    pb.check_gradient(dy, problem.x_shape, problem.device, problem.dtype,
                      "the shape of conv_transpose's output")
    dx = dw = db = None
    if needs[0]:
        dx = _run("conv", problem.with_op("conv"), (dy, w, None), None)
    if needs[1]:
        dw = _run("conv_backward_weight", problem.with_op("conv_backward_weight"), (dy, x),
                  None)
    if needs[2]:
        db = conv_backward_bias(dy, layout=problem.layout)
    return dx, dw, db


def _backward(problem, needs, dy, x, w):
    dx = dw = db = None
    if needs[0]:
        dx = _run("conv_backward_data", problem.with_op("conv_backward_data"), (dy, w), None)
    if needs[1]:
        dw = _run("conv_backward_weight", problem.with_op("conv_backward_weight"), (x, dy),
                  None)
    if needs[2]:
        db = conv_backward_bias(dy, layout=problem.layout)
    return dx, dw, db


@_keywords(*_ALL)
def conv_output_shape(input_shape, weight_shape, *, stride=1, padding=0, dilation=1,
                      groups=1, layout="channels_first", transposed=False,
                      output_padding=0) -> tuple:
    """Shape of :func:`conv`'s (or, with ``transposed=True``, :func:`conv_transpose`'s)
    result, with the same validation and no computation.

    Parameters
    ----------
    input_shape : tuple of int
        Shape of x in ``layout``.
    weight_shape : tuple of int
        Shape of w (``(K, C // groups, *R)``, or ``(C_in, C_out // groups, *R)`` transposed).
    {keywords}

    Returns
    -------
    tuple of int
    """
    x = _shape_only("input_shape", input_shape)
    w = _shape_only("weight_shape", weight_shape)
    if transposed:
        return pb.conv_transpose_problem(x, w, stride=stride, padding=padding,
                                         output_padding=output_padding, dilation=dilation,
                                         groups=groups, layout=layout).x_shape
    if output_padding not in (0, None):
        raise ValueError(f"output_padding: expected 0 unless transposed=True, got "
                         f"{output_padding!r}")
    return pb.conv_problem(x, w, stride=stride, padding=padding, dilation=dilation,
                           groups=groups, layout=layout).y_shape


def _shape_only(name, shape):
    """A zero-byte float32 array of ``shape`` so shape math reuses the one validation path."""
    if not isinstance(shape, (tuple, list)) or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in shape):
        raise TypeError(f"{name}: expected a tuple of ints, got {shape!r}")
    if any(v < 0 for v in shape):
        raise ValueError(f"{name}: expected non-negative sizes, got {tuple(shape)}")
    return np.broadcast_to(np.zeros((), np.float32), tuple(int(v) for v in shape))


def explain(op, *args, **kwargs):
    """Which backend and algorithm would run ``op`` with these arguments, and why.

    Takes the op's name and exactly the arguments of the corresponding function; validates
    them like the call would, computes nothing.

    Returns
    -------
    Choice
        ``backend``, ``algorithm``, ``reason`` and ``rejected`` ({name: why} for every backend
        tried before the chosen one or not eligible).
    """
    if op not in pb.PROBLEM_BUILDERS:
        raise ValueError(f"op: expected one of {sorted(pb.OPS)}, got {op!r}")
    return dispatch.select(op, pb.PROBLEM_BUILDERS[op](*args, **kwargs))
