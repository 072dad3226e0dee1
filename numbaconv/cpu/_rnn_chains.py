"""A chain's steps in Numba loops: each call runs a block of a chain's time steps, every step
its recurrent product on the weights packed once per call and its step kernel
(:mod:`._rnn_cells`, the serial compilations), with no Python between the steps.

The chains of a recurrence run on the tile workers, one thread each
(:func:`.rnn_forward.run_recurrences`). Stepping them from Python cost three compiled calls
a step, and the workers' threads passed the interpreter lock to each other at every one of
them, which where the steps are short took longer than the steps (docs/cpu-algorithms.md,
"Recurrent networks"). A block is one call; between blocks the chain stops if its call was
interrupted (Ctrl-C). The steps
are the same kernels in the same order, so the bits are those of the step-by-step loop,
which still runs a single chain on the calling thread (its products shared among the
workers at every step) and the LSTM with projections (a BLAS product a step).

The product's micro-kernel tile has the chain's panel height
(:func:`._microkernel.panel_rows`), fixed when it is compiled: each driver is compiled once
per height (:func:`driver`), as a twin of itself on a twin of :func:`_product`.
"""

from __future__ import annotations

import numpy as np

from ..config import serial_jit
from . import _rnn_cells as cells_k
from ._microkernel import (KC, _columns_by_panels, _columns_kernel, _panels_product,
                           _transpose_into, kernel_twin)

#: Time steps a call: Ctrl-C ends a chain between two blocks; the Python between blocks
#: is a 16th of what it was between steps.
STEP_BLOCK = 16

_step = cells_k.kernels(False)          # the step kernels' serial compilations
_lstm_forward_step = _step.lstm_forward_step
_gru_forward_step = _step.gru_forward_step
_rnn_forward_step = _step.rnn_forward_step
_lstm_backward_step = _step.lstm_backward_step
_gru_backward_step = _step.gru_backward_step
_rnn_backward_step = _step.rnn_backward_step


@serial_jit
def _product(src, by_columns, columns, wp, out, height, count, mr, nr, lanes):
    """One step's recurrent product of ``src`` (rows, depth), as
    :meth:`.rnn_forward.ChainProduct.load` and ``multiply`` make it: the states transposed
    into ``columns``, then with ``by_columns`` read there in ``count`` tiles of ``height``
    rows against the weights' NR-row panels ``wp``, else multiplied as the right operand of
    the weights' MR-row panels; into ``out``."""
    _transpose_into(src, columns, lanes)
    if by_columns:
        _columns_by_panels(columns, wp, out, 0, wp.shape[0], count, height, nr, KC)
    else:
        _panels_product(wp, columns, out, 0, wp.shape[0], mr, nr, KC)


@serial_jit
def _at_step(flat, step, t, rows, width):
    """Step t's (rows, width) block of a :func:`by_steps` array, C-contiguous: the step
    kernels' loops vectorise on those, not on strided views of the same values."""
    at = t * step
    return flat[at:at + rows * width].reshape((rows, width))


@serial_jit
def lstm_forward_chain(order, by_columns, scol, wp, out, height, count, mr, nr, lanes, xg, xs,
                       hg, bias, c, h, y, cells, cs, lengths, store, work):
    """The forward steps ``order`` of an LSTM chain without projection: per step t the
    product ``W_hh @ h.T`` into hg (a view of ``out``) and
    :func:`._rnn_cells.lstm_forward_step` on the gates' step t (``xg``, ``xs``: a
    :func:`by_steps` pair), the cells' step t receiving c with ``store``."""
    rows, hs = c.shape
    for t in order:
        _product(h, by_columns, scol, wp, out, height, count, mr, nr, lanes)
        kept = _at_step(cells, cs, t, rows, hs) if store else c
        _lstm_forward_step(_at_step(xg, xs, t, rows, 4 * hs), hg, bias, c, h, y[t], kept,
                           lengths, t, store, True, work)


@serial_jit
def gru_forward_chain(order, by_columns, scol, wp, out, height, count, mr, nr, lanes, xg, xs,
                      hg, b_ih, b_hh, h, y, lengths, store, one, work):
    """The forward steps ``order`` of a GRU chain: :func:`._rnn_cells.gru_forward_step`."""
    rows, hs = h.shape
    for t in order:
        _product(h, by_columns, scol, wp, out, height, count, mr, nr, lanes)
        _gru_forward_step(_at_step(xg, xs, t, rows, 4 * hs), hg, b_ih, b_hh, h, y[t],
                          lengths, t, store, one, work)


@serial_jit
def rnn_forward_chain(order, by_columns, scol, wp, out, height, count, mr, nr, lanes, xg, xs,
                      hg, bias, h, y, lengths, store, relu):
    """The forward steps ``order`` of a tanh or ReLU RNN chain:
    :func:`._rnn_cells.rnn_forward_step`."""
    rows, hs = h.shape
    for t in order:
        _product(h, by_columns, scol, wp, out, height, count, mr, nr, lanes)
        _rnn_forward_step(_at_step(xg, xs, t, rows, hs), hg, bias, h, y[t], lengths, t,
                          store, relu)


@serial_jit
def lstm_backward_chain(order, by_columns, scol, wp, out, height, count, mr, nr, lanes, t_len,
                        gates, gs, cells, cs, c0, dh, rec, dy, dm, dc, lengths, reverse, one,
                        work):
    """The backward steps ``order`` (reverse processing order) of an LSTM chain without
    projection: per step t :func:`._rnn_cells.lstm_backward_step`, the previous cell state
    the cells' step t - 1 (t + 1 with ``reverse``) or c0 at the sequence's start, then the
    product ``W_hh.T @ dgates.T`` into rec (a view of ``out``) for the next. ``gates``,
    ``gs`` and ``cells``, ``cs``: :func:`by_steps` pairs."""
    rows, hs = dc.shape
    for t in order:
        tp = t + 1 if reverse else t - 1
        g_t = _at_step(gates, gs, t, rows, 4 * hs)
        c_t = _at_step(cells, cs, t, rows, hs)
        if tp < 0 or tp >= t_len:
            _lstm_backward_step(g_t, c_t, c0, dh, rec, dy[t], dm, dc, lengths, t, False, one,
                                work)
        else:
            _lstm_backward_step(g_t, c_t, _at_step(cells, cs, tp, rows, hs), dh, rec, dy[t],
                                dm, dc, lengths, t, False, one, work)
        _product(g_t, by_columns, scol, wp, out, height, count, mr, nr, lanes)


@serial_jit
def gru_backward_chain(order, by_columns, scol, wp, out, height, count, mr, nr, lanes, gates,
                       gs, hidden_columns, outputs, h0, dh, rec, dy, lengths, reverse, one,
                       work):
    """The backward steps ``order`` of a GRU chain: :func:`._rnn_cells.gru_backward_step`
    (the previous output outputs[t - 1], outputs[t + 1] with ``reverse``, or h0 at the
    sequence's start), then the product of the hidden path's gate gradients (the first
    ``hidden_columns``). ``gates``, ``gs``: a :func:`by_steps` pair."""
    rows, hs = dh.shape
    t_len = outputs.shape[0]
    for t in order:
        tp = t + 1 if reverse else t - 1
        g_t = _at_step(gates, gs, t, rows, 4 * hs)
        if tp < 0 or tp >= t_len:
            _gru_backward_step(g_t, h0, h0, dh, rec, dy[t], lengths, t, reverse, one, work)
        else:
            _gru_backward_step(g_t, outputs[tp], h0, dh, rec, dy[t], lengths, t, reverse,
                               one, work)
        _product(g_t[:, :hidden_columns], by_columns, scol, wp, out, height, count,
                 mr, nr, lanes)


@serial_jit
def rnn_backward_chain(order, by_columns, scol, wp, out, height, count, mr, nr, lanes, gates,
                       gs, dh, rec, dy, lengths, relu, one):
    """The backward steps ``order`` of a tanh or ReLU RNN chain:
    :func:`._rnn_cells.rnn_backward_step`, then the product for the next. ``gates``,
    ``gs``: a :func:`by_steps` pair."""
    rows, hs = dh.shape
    for t in order:
        g_t = _at_step(gates, gs, t, rows, hs)
        _rnn_backward_step(g_t, dh, rec, dy[t], lengths, t, relu, one)
        _product(g_t, by_columns, scol, wp, out, height, count, mr, nr, lanes)


def by_steps(view: np.ndarray):
    """(flat, step) for a (T, rows, width) view whose steps are each one C-contiguous
    block (the reserve's gates and cells of a chain's rows): a 1D view of its memory from
    its first value to its last, and the values from one step's block to the next; None
    for any other view (those chains step from Python)."""
    steps, rows, width = view.shape
    item = view.itemsize
    if steps == 0 or view.strides[2] != item or (rows > 1 and view.strides[1] != width * item) \
            or view.strides[0] % item or view.strides[0] < 0:
        return None
    step = view.strides[0] // item
    flat = np.lib.stride_tricks.as_strided(view, ((steps - 1) * step + rows * width,),
                                           (item,), writeable=True)
    return flat, step


def driver(kernel, height: int, mr: int):
    """``kernel`` (one of the chain loops above) on product tiles of ``height`` rows: itself
    for MR (or the weights as the MR side), else its twin on a twin of :func:`_product`
    (compiled on first use, then cached on disk like the rest)."""
    if height == mr:
        return kernel
    product = kernel_twin(_product, f"rows{height}", serial_jit,
                          _columns_by_panels=_columns_kernel(height, mr))
    return kernel_twin(kernel, f"rows{height}", serial_jit, _product=product)


def blocks(order) -> list:
    """The steps ``order`` as int64 arrays of at most STEP_BLOCK, in order."""
    steps = np.asarray(list(order), np.int64)
    return [steps[i:i + STEP_BLOCK] for i in range(0, len(steps), STEP_BLOCK)]
