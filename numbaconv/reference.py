"""The reference backend: every op in plain NumPy, slow and obviously right.

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
from .problem import CONV_OPS, RNN_OPS, layer_params, shifted_in_time


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


# --- recurrent networks --------------------------------------------------------------------
# One step at a time, as the equations read (PyTorch's nn.RNN/LSTM/GRU). Steps past a
# sequence's end keep the state and write zeros, so the reserve's layout
# (numbaconv.problem.RNNReserveLayout) is the same as the cpu backend's.

def _sigmoid(v):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-v))


def _steps(seq_len: int, direction: int):
    """Time steps in processing order: forwards, or backwards for direction 1."""
    return range(seq_len) if direction == 0 else range(seq_len - 1, -1, -1)


def _valid(lengths, seq_len: int):
    """(T, N, 1) booleans: step t is inside sequence n; None when every sequence is full."""
    if lengths is None:
        return None
    return (np.arange(seq_len)[:, None] < lengths[None, :])[:, :, None]


def _cell_forward(mode, xg, h, c, w_hh, b_hh, w_hr):
    """One step from ``xg = x_t @ w_ih.T + b_ih``: (stored activations, new h, new c)."""
    hg = h @ w_hh.T
    if b_hh is not None:
        hg = hg + b_hh
    if mode == "lstm":
        hs = c.shape[1]
        a = xg + hg
        i, f = _sigmoid(a[:, :hs]), _sigmoid(a[:, hs:2 * hs])
        g, o = np.tanh(a[:, 2 * hs:3 * hs]), _sigmoid(a[:, 3 * hs:])
        c = f * c + i * g
        h = o * np.tanh(c)
        if w_hr is not None:
            h = h @ w_hr.T
        return np.concatenate([i, f, g, o], axis=1), h, c
    if mode == "gru":
        hs = h.shape[1]
        r = _sigmoid(xg[:, :hs] + hg[:, :hs])
        z = _sigmoid(xg[:, hs:2 * hs] + hg[:, hs:2 * hs])
        hn = hg[:, 2 * hs:]
        n = np.tanh(xg[:, 2 * hs:] + r * hn)
        return np.concatenate([r, z, n, hn], axis=1), (1 - z) * n + z * h, None
    pre = xg + hg
    h = np.tanh(pre) if mode == "rnn_tanh" else np.maximum(pre, 0)
    return h, h, None


def _cell_backward(mode, act, c, c_prev, h_prev, dh, dc, w_hh, w_hr):
    """One step back: (pre-activation gradients as stored, dh_prev, dc_prev, o * tanh(c))."""
    if mode == "lstm":
        hs = c.shape[1]
        i, f, g, o = (act[:, k * hs:(k + 1) * hs] for k in range(4))
        dm = dh @ w_hr if w_hr is not None else dh
        tc = np.tanh(c)
        dc = dc + dm * o * (1 - tc * tc)
        dgates = np.concatenate([dc * g * i * (1 - i), dc * c_prev * f * (1 - f),
                                 dc * i * (1 - g * g), dm * tc * o * (1 - o)], axis=1)
        return dgates, dgates @ w_hh, dc * f, o * tc
    if mode == "gru":
        hs = h_prev.shape[1]
        r, z, n, hn = (act[:, k * hs:(k + 1) * hs] for k in range(4))
        dn = dh * (1 - z) * (1 - n * n)
        dr = dn * hn * r * (1 - r)
        dz = dh * (h_prev - n) * z * (1 - z)
        dgates = np.concatenate([dr, dz, dn * r, dn], axis=1)  # hidden path first
        dh_prev = dh * z + dgates[:, :3 * hs] @ w_hh
        return dgates, dh_prev, None, None
    dpre = dh * (1 - act * act) if mode == "rnn_tanh" else dh * (act > 0)
    return dpre, dpre @ w_hh, None, None


def rnn_forward(problem, x, params, hx, cx, lengths, reserve):
    """(y, hy, cy); with ``problem.training`` also fills the reserve."""
    cfg = problem.config
    t_len, n = problem.seq_len, problem.batch
    d_num, p = cfg.num_directions, cfg.out_size
    lstm = cfg.mode == "lstm"
    layout = problem.reserve_layout if problem.training else None
    valid = _valid(lengths, t_len)
    hy = np.empty_like(hx)
    cy = np.empty_like(cx) if lstm else None
    inp = x
    for layer in range(cfg.num_layers):
        if layout is not None and layer > 0:
            inp = layout.layer_input(reserve, layer, x)
        out = np.zeros((t_len, n, d_num * p), x.dtype)
        for d in range(d_num):
            w_ih, w_hh, b_ih, b_hh, w_hr = layer_params(cfg, params, layer, d)
            ld, cols = layer * d_num + d, slice(d * p, (d + 1) * p)
            h, c = hx[ld], (cx[ld] if lstm else None)
            for t in _steps(t_len, d):
                xg = inp[t] @ w_ih.T
                if b_ih is not None:
                    xg = xg + b_ih
                act, h_new, c_new = _cell_forward(cfg.mode, xg, h, c, w_hh, b_hh, w_hr)
                if valid is not None:
                    act = np.where(valid[t], act, 0)
                    h_new = np.where(valid[t], h_new, h)
                    c_new = np.where(valid[t], c_new, c) if lstm else None
                    out[t, :, cols] = np.where(valid[t], h_new, 0)
                else:
                    out[t, :, cols] = h_new
                h, c = h_new, c_new
                if layout is not None:
                    layout.gates(reserve, layer, d)[t] = act
                    if lstm:
                        layout.cells(reserve, layer, d)[t] = c
            hy[ld] = h
            if lstm:
                cy[ld] = c
        if layout is not None:
            layout.outputs(reserve, layer)[...] = out
        inp = out
    return out, hy, cy


def rnn_backward_data(problem, y, dy, params, reserve, hx, cx, dhy, dcy, lengths):
    """(dx, dhx, dcx); overwrites the reserve's gates with their gradients."""
    cfg = problem.config
    t_len, n = problem.seq_len, problem.batch
    d_num, p, hs = cfg.num_directions, cfg.out_size, cfg.hidden_size
    lstm = cfg.mode == "lstm"
    layout = problem.reserve_layout
    valid = _valid(lengths, t_len)
    dout = dy if valid is None else np.where(valid, dy, 0)
    dhx = np.empty_like(hx)
    dcx = np.empty_like(cx) if lstm else None
    for layer in reversed(range(cfg.num_layers)):
        din = np.zeros((t_len, n, cfg.layer_input_size(layer)), dy.dtype)
        for d in range(d_num):
            w_ih, w_hh, b_ih, b_hh, w_hr = layer_params(cfg, params, layer, d)
            ld, cols = layer * d_num + d, slice(d * p, (d + 1) * p)
            gates = layout.gates(reserve, layer, d)
            cells = layout.cells(reserve, layer, d) if lstm else None
            h_prev = layout.previous_states(reserve, layer, d, hx[ld], lengths)
            c_prev = shifted_in_time(cells, cx[ld], d) if lstm else None
            dh, dc = dhy[ld], (dcy[ld] if lstm else None)
            for t in reversed(_steps(t_len, d)):
                dh_t = dh + dout[t, :, cols]
                dgates, dh_new, dc_new, m = _cell_backward(
                    cfg.mode, gates[t], cells[t] if lstm else None,
                    c_prev[t] if lstm else None, h_prev[t], dh_t, dc, w_hh, w_hr)
                if valid is not None:
                    dgates = np.where(valid[t], dgates, 0)
                    dh_new = np.where(valid[t], dh_new, dh)
                    dc_new = np.where(valid[t], dc_new, dc) if lstm else None
                gates[t] = dgates
                if w_hr is not None:
                    layout.dproj(reserve, layer, d)[t] = \
                        dh_t if valid is None else np.where(valid[t], dh_t, 0)
                    cells[t] = m if valid is None else np.where(valid[t], m, 0)
                ih = (np.concatenate([dgates[:, :2 * hs], dgates[:, 3 * hs:]], axis=1)
                      if cfg.mode == "gru" else dgates)
                din[t] += ih @ w_ih
                dh, dc = dh_new, dc_new
            dhx[ld] = dh
            if lstm:
                dcx[ld] = dc
        masks = layout.masks(reserve, layer)
        dout = din * masks if masks is not None else din
    return dout, dhx, dcx


def rnn_backward_weights(problem, x, params, reserve, hx, lengths):
    """Flat dparams from the gate gradients rnn_backward_data left in the reserve."""
    cfg = problem.config
    t_len, n = problem.seq_len, problem.batch
    d_num, p, hs = cfg.num_directions, cfg.out_size, cfg.hidden_size
    layout = problem.reserve_layout
    rows = t_len * n
    dparams = np.zeros(cfg.num_params, x.dtype)
    for layer in range(cfg.num_layers):
        inp = layout.layer_input(reserve, layer, x).reshape(rows, -1)
        for d in range(d_num):
            dw_ih, dw_hh, db_ih, db_hh, dw_hr = layer_params(cfg, dparams, layer, d)
            ld = layer * d_num + d
            dgates = layout.gates(reserve, layer, d).reshape(rows, -1)
            if cfg.mode == "gru":
                d_ih = np.concatenate([dgates[:, :2 * hs], dgates[:, 3 * hs:]], axis=1)
                d_hh = dgates[:, :3 * hs]
            else:
                d_ih = d_hh = dgates
            h_prev = layout.previous_states(reserve, layer, d, hx[ld], lengths)
            dw_ih[...] = d_ih.T @ inp
            dw_hh[...] = d_hh.T @ h_prev.reshape(rows, p)
            if cfg.bias:
                db_ih[...] = d_ih.sum(axis=0)
                db_hh[...] = d_hh.sum(axis=0)
            if dw_hr is not None:
                dproj = layout.dproj(reserve, layer, d).reshape(rows, p)
                m = layout.cells(reserve, layer, d).reshape(rows, hs)
                dw_hr[...] = dproj.T @ m
    return dparams


class ReferenceBackend(Backend):
    """Plain NumPy; supports every convolution and recurrent problem on the CPU in float32
    and float64."""

    name = "reference"
    device = "cpu"
    priority = 0
    version = "1"
    ops = frozenset(CONV_OPS + RNN_OPS)

    def choose(self, op, problem):
        if op in RNN_OPS:
            return "numpy", "the only algorithm (one step at a time)"
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
        elif op == "rnn_forward":
            return rnn_forward(problem, *operands)
        elif op == "rnn_backward_data":
            return rnn_backward_data(problem, *operands)
        elif op == "rnn_backward_weights":
            result = rnn_backward_weights(problem, *operands)
        else:
            raise ValueError(f"op: {op!r} is not an op of this backend")
        return store(result, out, problem.accumulate)


def make_backend() -> ReferenceBackend:
    """Entry point of the built-in ``reference`` backend."""
    return ReferenceBackend()
