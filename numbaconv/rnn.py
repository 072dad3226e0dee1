"""Public recurrent-network functions (RNN tanh/relu, LSTM with projection, GRU), split as
cuDNN splits them: a training forward that fills a reserve, then the data gradient, then the
weight gradient on the same reserve. Validate once, normalise once, dispatch. No kernels here.

Shapes: x ``(T, N, input_size)`` (``(N, T, input_size)`` with ``batch_first``), y and dy
``(T, N, D * out_size)`` with D = 2 if bidirectional and ``out_size = proj_size or
hidden_size``; hx, hy, dhy, dhx ``(num_layers * D, N, out_size)``; cx, cy, dcy, dcx
``(num_layers * D, N, hidden_size)``, LSTM only (None otherwise). Parameters are one flat
vector in PyTorch's order (:func:`rnn_param_views` names its pieces).

A training step::

    y, hy, cy, reserve = rnn_forward(cfg, x, params, training=True, reserve=reserve)
    dx, dhx, dcx = rnn_backward_data(cfg, y, dy, params, reserve)
    rnn_backward_weights(cfg, x, params, reserve, out=dparams)

``rnn_backward_data`` overwrites the reserve's gate activations with their gradients (which
``rnn_backward_weights`` reads), so each training forward allows one data gradient, and the
weight gradient after it. Passing the same preallocated reserve every step (its size from
:func:`rnn_reserve_size`) keeps a training loop free of reserve-sized allocations.
"""

from __future__ import annotations

import numpy as np

from . import dispatch
from . import problem as pb
from ._arrays import contiguous as _contiguous
from ._arrays import run as _run
from ._device import as_device
from .problem import RNNConfig, rnn_param_views
from .rnn_problem import _positive_int

__all__ = ["RNNConfig", "rnn_init_params", "rnn_param_views", "rnn_reserve_size",
           "rnn_forward", "rnn_backward_data", "rnn_backward_weights"]


def rnn_init_params(config, seed=None, dtype=np.float32) -> np.ndarray:
    """A flat parameter vector drawn uniformly from +-1/sqrt(hidden_size), like PyTorch.

    Parameters
    ----------
    config : RNNConfig
    seed : int or None
        Seed of NumPy's default generator; the same seed gives the same parameters.
    dtype : float32 or float64

    Returns
    -------
    ndarray, shape (config.num_params,)
    """
    config = pb.check_config(config)
    dtype = np.dtype(dtype)
    if dtype.name not in ("float32", "float64"):
        raise TypeError(f"dtype: expected float32 or float64, got {dtype.name}")
    bound = 1.0 / np.sqrt(config.hidden_size)
    rng = np.random.default_rng(seed)
    return rng.uniform(-bound, bound, config.num_params).astype(dtype)


def rnn_reserve_size(config, seq_len, batch) -> int:
    """Elements (of x's dtype) the training forward's reserve needs for T steps and N
    sequences; the layout is :class:`numbaconv.problem.RNNReserveLayout`."""
    config = pb.check_config(config)
    seq_len = _positive_int(seq_len, "seq_len")
    batch = _positive_int(batch, "batch")
    return pb.rnn_reserve_layout(config, seq_len, batch).size


# --- normalisation: what backends see ----------------------------------------------------

def _time_major(a, config):
    if a is None:
        return a
    if not isinstance(a, np.ndarray):  # device arrays: any strides, unless transposed
        return _device_swapped(a) if config.batch_first else a
    if config.batch_first:
        a = a.swapaxes(0, 1)
    return _contiguous(a)


def _user_order(a, config):
    if not config.batch_first:
        return a
    return a.swapaxes(0, 1) if isinstance(a, np.ndarray) else _device_swapped(a)


def _device_swapped(a):
    """A device array's (T, N, F) <-> (N, T, F) as a new contiguous device array, swapped
    on the device (Numba device arrays have no 3-D swapaxes view; one copy kernel)."""
    return dispatch.get_backend("cuda").swap_time_batch(a)


def _zeros_if_none(a, shape, dtype, device="cpu"):
    if a is None:
        return np.zeros(shape, dtype) if device == "cpu" else _device_array(shape, dtype, True)
    return _contiguous(a)


def _device_array(shape, dtype, zero=False):
    """A Numba device array (cuda problems): zero-filled on the device with ``zero`` (a
    kernel, not a host copy: a copy from the host would wait for the device)."""
    if zero:
        return dispatch.get_backend("cuda").zeros(shape, dtype)
    from numba import cuda
    return cuda.device_array(shape, dtype)


def _write_header(reserve, start, values, device, dtype):
    """``reserve[start:start + len(values)] = values`` (header slots: small integers); on a
    GPU by a kernel on the stream the ops use, so that the host does not wait for the
    device as a host-to-device copy would, and noted on the host for the backward
    functions' checks (:func:`numbaconv.problem.record_header`), which then read nothing
    from the device."""
    if device == "cpu":
        reserve[start:start + len(values)] = values
    else:
        dispatch.get_backend("cuda").put(reserve, start, values)
        pb.record_header(reserve, start, values, dtype)


def _states(config, batch):
    ld = config.num_layers * config.num_directions
    return (ld, batch, config.out_size), (ld, batch, config.hidden_size)


def _fill_masks(problem, reserve, seed) -> None:
    """Dropout scales (0 or 1 / (1 - p)) for the inputs of layers 1.., from one generator:
    the same seed gives the same masks on every backend.

    Device reserves get the very draws a NumPy reserve of their dtype gets, made on the host
    (float16 draws float32, which NumPy's generator has, and rounds the scales), copied to
    the device in one transfer and from there into each layer's masks region."""
    config = problem.config
    if config.dropout == 0 or config.num_layers == 1:
        return
    rng = np.random.default_rng(seed)
    layout = problem.reserve_layout
    layers = range(1, config.num_layers)
    if problem.device == "cpu":
        for layer in layers:
            _draw_masks(rng, layout.masks(reserve, layer), config.dropout)
        return
    from numba import cuda
    dtype = problem.numpy_dtype
    shape = (len(layers), problem.seq_len, problem.batch,
             config.num_directions * config.out_size)  # the masks region of each layer
    host = np.empty(shape, np.float32 if dtype == np.float16 else dtype)
    for i in range(len(layers)):
        _draw_masks(rng, host[i], config.dropout)
    masks = cuda.to_device(host.astype(dtype, copy=False))
    reserve = as_device(reserve)
    for i, layer in enumerate(layers):
        layout.masks(reserve, layer).copy_to_device(masks[i])


def _draw_masks(rng, masks, dropout) -> None:
    """Fill one layer's (T, N, F) masks from ``rng``."""
    keep_scale = 1.0 / (1.0 - dropout)
    for step in masks:  # one step at a time keeps the boolean temporary small
        rng.random(dtype=step.dtype, out=step)
        np.multiply(step >= dropout, keep_scale, out=step)


# --- public functions ----------------------------------------------------------------------

def rnn_forward(config, x, params, hx=None, cx=None, *, seq_lengths=None, training=False,
                dropout_seed=None, reserve=None):
    """Run a recurrent network over a batch of sequences.

    Parameters
    ----------
    config : RNNConfig
    x : array, shape (T, N, input_size), or (N, T, input_size) with batch_first
    params : array, shape (config.num_params,)
        The flat parameters (:func:`rnn_init_params`, :func:`rnn_param_views`).
    hx : array, shape (num_layers * D, N, out_size), optional
        Initial hidden states (zeros when None).
    cx : array, shape (num_layers * D, N, hidden_size), optional
        Initial cell states, LSTM only (zeros when None).
    seq_lengths : sequence of N ints in 1..T, optional
        Packed-sequence semantics (any order; no sorting needed): sequence n is its first
        ``seq_lengths[n]`` steps; y is zero past its end, hy/cy are its states at its last
        step, and the reverse direction starts at its own end.
    training : bool
        Fill a reserve for the backward functions and apply dropout between layers.
    dropout_seed : int, optional
        Seed of the dropout masks (same seed, same masks); None draws fresh ones.
    reserve : 1-D array of at least ``rnn_reserve_size(config, T, N)`` elements, optional
        Training only: filled in place and returned (allocated when None).

    Returns
    -------
    y : ndarray, shape (T, N, D * out_size) (batch-first with batch_first: a view of NumPy
        results, a transposed copy of device ones)
    hy : ndarray, shape (num_layers * D, N, out_size)
    cy : ndarray, shape (num_layers * D, N, hidden_size), or None unless LSTM
    reserve : ndarray or None
        The filled reserve with ``training=True``, else None.
    """
    problem, lengths = pb.rnn_forward_problem(
        config, x, params, hx, cx, seq_lengths=seq_lengths, training=training,
        dropout_seed=dropout_seed, reserve=reserve)
    config = problem.config
    dtype = problem.numpy_dtype
    hshape, cshape = _states(config, problem.batch)
    device = problem.device
    hx = _zeros_if_none(hx, hshape, dtype, device)
    cx = _zeros_if_none(cx, cshape, dtype, device) if config.mode == "lstm" else None
    dispatch.select("rnn_forward", problem)  # no backend: fail before touching reserve
    if problem.training:
        layout = problem.reserve_layout
        if reserve is None:
            reserve = np.empty(layout.size, dtype) if device == "cpu" else \
                _device_array(layout.size, dtype)
        _write_header(reserve, 0, [0] * pb.RESERVE_HEADER, device, dtype)  # invalid until done
        _fill_masks(problem, reserve, dropout_seed)
    operands = (_time_major(x, config), _contiguous(params), hx, cx, lengths,
                reserve if problem.training else None)
    y, hy, cy = dispatch.run("rnn_forward", problem, operands)
    if problem.training:
        header = pb.reserve_header(config, problem.seq_len, problem.batch, lengths,
                                   pb.RESERVE_FORWARD)
        _write_header(reserve, 0, header, device, dtype)
    return _user_order(y, config), hy, cy, (reserve if problem.training else None)


def rnn_backward_data(config, y, dy, params, reserve, *, hx=None, cx=None, dhy=None,
                      dcy=None, seq_lengths=None):
    """Gradients of the inputs and initial states (backprop through time, data part).

    Runs once per training forward, before :func:`rnn_backward_weights`: it overwrites the
    reserve's gate activations with the gate gradients.

    Parameters
    ----------
    config : RNNConfig
    y : array, shape (T, N, D * out_size) (batch-first with batch_first)
        The training forward's output (checked for shape; the reserve holds the values).
    dy : array, shape of y
        Gradient of the loss with respect to y (entries past a sequence's end are ignored).
    params : array, shape (config.num_params,)
    reserve : 1-D array
        The training forward's reserve.
    hx, cx : arrays, optional
        The initial states the forward used (zeros when None).
    dhy, dcy : arrays, optional
        Gradients with respect to hy and cy (zeros when None; dcy LSTM only).
    seq_lengths : sequence of N ints, optional
        As in the forward (checked against what the reserve recorded).

    Returns
    -------
    dx : ndarray, shape of x
    dhx : ndarray, shape (num_layers * D, N, out_size)
    dcx : ndarray, shape (num_layers * D, N, hidden_size), or None unless LSTM
    """
    problem, lengths = pb.rnn_backward_data_problem(
        config, y, dy, params, reserve, hx=hx, cx=cx, dhy=dhy, dcy=dcy,
        seq_lengths=seq_lengths)
    config = problem.config
    dtype = problem.numpy_dtype
    hshape, cshape = _states(config, problem.batch)
    lstm = config.mode == "lstm"
    device = problem.device
    operands = (_time_major(y, config), _time_major(dy, config), _contiguous(params), reserve,
                _zeros_if_none(hx, hshape, dtype, device),
                _zeros_if_none(cx, cshape, dtype, device) if lstm else None,
                _zeros_if_none(dhy, hshape, dtype, device),
                _zeros_if_none(dcy, cshape, dtype, device) if lstm else None, lengths)
    dispatch.select("rnn_backward_data", problem)
    _write_header(reserve, 1, [0], device, dtype)  # a failure half-way: an unusable reserve
    dx, dhx, dcx = dispatch.run("rnn_backward_data", problem, operands)
    _write_header(reserve, 1, [pb.RESERVE_BACKWARD_DATA], device, dtype)
    return _user_order(dx, config), dhx, dcx


def rnn_backward_weights(config, x, params, reserve, *, hx=None, seq_lengths=None, out=None,
                         accumulate=False):
    """Gradient of every parameter, after :func:`rnn_backward_data` ran on the reserve.

    Parameters
    ----------
    config : RNNConfig
    x : array, shape (T, N, input_size) (batch-first with batch_first)
        The training forward's input.
    params : array, shape (config.num_params,)
    reserve : 1-D array
        The reserve, after rnn_backward_data.
    hx : array, optional
        The initial hidden states the forward used (zeros when None).
    seq_lengths : sequence of N ints, optional
        As in the forward.
    out : array, shape (config.num_params,), optional
        Written in place (added into with ``accumulate=True``) and returned.
    accumulate : bool

    Returns
    -------
    dparams : ndarray, shape (config.num_params,)
        Flat, in the layout of params (:func:`rnn_param_views` names its pieces).
    """
    problem, lengths = pb.rnn_backward_weights_problem(
        config, x, params, reserve, hx=hx, seq_lengths=seq_lengths, out=out,
        accumulate=accumulate)
    config = problem.config
    hshape, _ = _states(config, problem.batch)
    operands = (_time_major(x, config), _contiguous(params), reserve,
                _zeros_if_none(hx, hshape, problem.numpy_dtype, problem.device), lengths)
    return _run("rnn_backward_weights", problem, operands, out)

