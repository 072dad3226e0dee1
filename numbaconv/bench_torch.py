"""PyTorch called directly, the comparison column of the benchmark table: the same computation
as a :class:`numbaconv.bench_cases.Call` through ``torch.nn.functional`` and
``torch.ops.aten.convolution_backward``; and, for the recurrent benchmarks (CPU and GPU),
the ``torch.nn`` module of a :class:`numbaconv.bench_cases.RNNCase` with numbaconv's weights
loaded and its gradients read back in numbaconv's flat order, PyTorch's training step on it,
and the check both recurrent benchmarks make before they time a step: the relative errors of
y, dx and the weight gradients (:func:`rnn_step_errors`, :data:`RNN_TOLERANCE`). PyTorch is
optional."""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np

from .bench_cases import Call, RNNCase


def import_torch():
    """PyTorch, or None when it is not installed (or fails to import)."""
    try:
        import torch
    except Exception:  # an unusable install is as good as none for a comparison column
        return None
    return torch


def torch_version() -> Optional[str]:
    """PyTorch's installed version, found without importing it; None when not installed."""
    import importlib.metadata
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # importable, but not as a distribution
        return "(version unknown)"


def torch_callable(call: Call, torch) -> Optional[Callable[[], object]]:
    """The same computation as ``call`` in PyTorch, or None where PyTorch has no equivalent.

    Forward and transposed convolutions go through ``torch.nn.functional``; the data and
    weight gradients through ``torch.ops.aten.convolution_backward`` (the op PyTorch's
    autograd itself calls), asked for that one gradient; the bias gradient is a plain
    ``torch.sum``. Channels-last arrays become channels-last tensors (the same memory seen
    through a permuted view), so neither side pays for a layout change. Asymmetric padding
    has no direct PyTorch form: None.
    """
    p = call.problem
    pads = getattr(p, "padding", None)  # a BiasProblem has no geometry
    if pads is not None and any(before != after for before, after in pads):
        return None
    F = torch.nn.functional

    def tensor(a, activation=True):
        t = torch.from_numpy(a)
        return t.movedim(-1, 1) if activation and call.layout == "channels_last" else t

    if call.op == "conv_backward_bias":
        # What PyTorch's convolution_backward does for the bias, minus its bookkeeping: a
        # sum over every axis but the channels (the fair baseline for a standalone bgrad).
        dy = tensor(call.operands[0])
        dims = (0,) + tuple(range(2, dy.ndim))
        return lambda: torch.sum(dy, dim=dims)

    nd = p.ndim
    stride, padding, dilation = list(p.stride), list(p.padding_before), list(p.dilation)
    if call.op == "conv":
        fn = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
        x, w, b = tensor(call.operands[0]), tensor(call.operands[1], False), call.operands[2]
        b = None if b is None else tensor(b, False)
        return lambda: fn(x, w, b, stride, padding, dilation, p.groups)
    if call.op == "conv_transpose":
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
        x, w, b = tensor(call.operands[0]), tensor(call.operands[1], False), call.operands[2]
        b = None if b is None else tensor(b, False)
        opad = list(p.output_padding)
        return lambda: fn(x, w, b, stride, padding, opad, p.groups, dilation)
    # The gradients: convolution_backward wants the forward input and weight tensors.
    if call.op == "conv_backward_data":
        dy, w = tensor(call.operands[0]), tensor(call.operands[1], False)
        x = torch.empty(call.args[2], dtype=dy.dtype)
        if call.layout == "channels_last":
            x = x.movedim(-1, 1)
        mask = [True, False, False]
    else:  # conv_backward_weight
        x, dy = (tensor(a) for a in call.operands)
        w = torch.empty(call.args[2], dtype=dy.dtype)
        mask = [False, True, False]
    args = (dy, x, w, None, stride, padding, dilation, False, [0] * nd, p.groups, mask)
    return lambda: torch.ops.aten.convolution_backward(*args)


# --- recurrent networks ----------------------------------------------------------------------

def torch_rnn_module(case: RNNCase, torch, dtype: str = "float32"):
    """``torch.nn.LSTM``/``GRU``/``RNN`` of the network ``case`` describes (PyTorch's own
    initial weights; :func:`load_rnn_params` replaces them), in ``dtype``, training mode.
    Time-major (``batch_first=False``), as numbaconv's cases are."""
    kwargs = dict(num_layers=case.num_layers, bidirectional=case.bidirectional)
    if case.mode == "lstm":
        module = torch.nn.LSTM(case.input_size, case.hidden_size, proj_size=case.proj_size,
                               **kwargs)
    elif case.mode == "gru":
        module = torch.nn.GRU(case.input_size, case.hidden_size, **kwargs)
    else:
        module = torch.nn.RNN(case.input_size, case.hidden_size,
                              nonlinearity=case.mode[4:], **kwargs)
    return module.to(getattr(torch, dtype)).train()


def rnn_parameter_names(module, config) -> list:
    """The names of ``module``'s weights in the order of numbaconv's flat parameter vector
    (``numbaconv.rnn_param_views``, whose names are PyTorch's); ValueError if the two do not
    hold the same weights of the same shapes."""
    from .rnn import rnn_param_views
    views = rnn_param_views(config, np.zeros(config.num_params, np.float32))
    ours = {name: tuple(v.shape) for name, v in views.items()}
    theirs = {name: tuple(getattr(module, name).shape) for name in module._flat_weights_names}
    if ours != theirs:
        raise ValueError(f"numbaconv's parameters {ours} are not PyTorch's {theirs}")
    return list(views)


def load_rnn_params(module, config, flat) -> None:
    """Copy numbaconv's flat parameter vector ``flat`` (a NumPy array) into ``module``'s
    weights, wherever they live, through ``numbaconv.rnn_param_views``."""
    import torch

    from .rnn import rnn_param_views
    rnn_parameter_names(module, config)
    with torch.no_grad():
        for name, view in rnn_param_views(config, flat).items():
            weight = getattr(module, name)
            weight.copy_(torch.from_numpy(np.ascontiguousarray(view)).to(weight.device))
    if hasattr(module, "flatten_parameters"):
        module.flatten_parameters()  # cuDNN's single weight buffer (a no-op on the CPU)


def rnn_flat_gradients(module, config):
    """``module``'s weight gradients concatenated in the order of numbaconv's flat parameter
    vector: the tensor to compare with ``rnn_backward_weights``'s result."""
    import torch
    return torch.cat([getattr(module, name).grad.reshape(-1)
                      for name in rnn_parameter_names(module, config)])


#: Bound of the recurrent benchmarks' relative error (CPU and GPU suites), on y, dx and the
#: weight gradients: far above two float32 summation orders' differences, far below what a
#: wrong gate, step or index gives (figures: docs/gpu-benchmark.md).
RNN_TOLERANCE = 5e-4

#: The results of a training step that the check compares, in the order it reports them.
RNN_STEP_RESULTS = ("y", "dx", "dparams")


def torch_rnn_training_step(module, x, dy):
    """PyTorch's training step: ``module``'s forward on ``x`` (a leaf tensor that wants its
    gradient) and autograd's backward from ``dy`` into x's and the weights' gradients,
    which are dropped first (``set_to_none``: no accumulation kernel). Returns y."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    y = module(x)[0]
    y.backward(dy)
    return y


def torch_rnn_results(module, config, x, dy) -> dict:
    """PyTorch's ``{"y", "dx", "dparams"}`` of one :func:`torch_rnn_training_step` (the
    weight gradients in numbaconv's flat order): the reference of the check."""
    y = torch_rnn_training_step(module, x, dy).detach()
    return dict(y=y, dx=x.grad, dparams=rnn_flat_gradients(module, config))


def relative_error(ours, reference) -> float:
    """max |ours - reference| / max |reference| of two tensors on one device, in float64
    (inf on a shape mismatch; NaN anywhere in ``ours`` gives NaN, which no bound passes)."""
    if tuple(ours.shape) != tuple(reference.shape):
        return math.inf
    ours, reference = ours.double(), reference.double()
    scale = reference.abs().max().item()
    return (ours - reference).abs().max().item() / (scale if scale > 0 else 1.0)


def rnn_step_errors(ours: dict, reference: dict) -> dict:
    """The relative error (:func:`relative_error`) of each of y, dx and dparams: ``ours``
    and ``reference`` map those names to tensors (numbaconv's results wrapped, PyTorch's
    from :func:`torch_rnn_results`)."""
    return {name: relative_error(ours[name], reference[name]) for name in RNN_STEP_RESULTS}


def worst_error(errors: dict, tolerance: float) -> str:
    """The name of the error that decides the check: one above ``tolerance`` (NaN counts as
    above) before one within it, then the largest."""
    return max(errors, key=lambda name: (not errors[name] <= tolerance, errors[name]))
