"""cpu ``rnn_forward``: the input projections of all steps as one BLAS product per layer and
direction (written straight into the reserve's gate region), then per step the recurrent
product (BLAS) and one fused Numba kernel for the gates and the state update."""

from __future__ import annotations

import numpy as np

from ..problem import layer_params
from . import _tiles
from . import _rnn_cells as cells_k


def lengths_or_full(lengths, seq_len, batch):
    return lengths if lengths is not None else np.full(batch, seq_len, np.int64)


def steps(seq_len, direction):
    """Time steps in processing order."""
    return range(seq_len) if direction == 0 else range(seq_len - 1, -1, -1)


def combined_bias(b_ih, b_hh, size, dtype):
    if b_ih is None:
        return np.zeros(size, dtype)
    return b_ih + b_hh


# One BLAS thread, products over all steps cut into slices fixed by the shape: the parameter
# gradients' bits then do not depend on the thread count (see _tiles.blas_single_threaded).
@_tiles.on_one_blas_thread
def run(problem, operands, out, algorithm):
    x, params, hx, cx, lengths, reserve = operands
    cfg = problem.config
    t_len, n = problem.seq_len, problem.batch
    d_num, p, hs = cfg.num_directions, cfg.out_size, cfg.hidden_size
    dtype = problem.numpy_dtype
    mode, training = cfg.mode, problem.training
    gh = cfg.gates * hs
    gw = 4 * hs if mode == "gru" else gh
    lens = lengths_or_full(lengths, t_len, n)
    layout = problem.reserve_layout if training else None
    hy = np.empty_like(hx)
    cy = np.empty_like(cx) if mode == "lstm" else None
    scratch_gates = None if training else np.empty((t_len, n, gw), dtype)
    hg = np.empty((gh, n), dtype)  # W_hh @ h.T: see _rnn_cells on why transposed
    m = np.empty((n, hs), dtype) if cfg.proj_size else None
    hp = np.empty((n, p), dtype) if cfg.proj_size else None
    zeros = np.zeros(gh, dtype)
    one = dtype.type(1)  # keeps float32 kernels in float32
    work = np.empty((n, (5 if mode == "lstm" else 4) * hs), dtype)
    k = cells_k.kernels_for(n, gw)
    inp = x
    for layer in range(cfg.num_layers):
        if training:
            inp = layout.layer_input(reserve, layer, x)  # with its dropout masks applied
            out_l = layout.outputs(reserve, layer)
        else:
            out_l = np.empty((t_len, n, d_num * p), dtype)
        for d in range(d_num):
            w_ih, w_hh, b_ih, b_hh, w_hr = layer_params(cfg, params, layer, d)
            ld = layer * d_num + d
            gates = layout.gates(reserve, layer, d) if training else scratch_gates
            _tiles.matmul(inp.reshape(t_len * n, -1), w_ih.T,
                          gates.reshape(t_len * n, gw)[:, :gh], fixed=True)
            y_d = out_l[:, :, d * p:(d + 1) * p]
            h = hx[ld].copy()
            if mode == "lstm":
                c = cx[ld].copy()
                bias = combined_bias(b_ih, b_hh, gh, dtype)
                cells = layout.cells(reserve, layer, d) if training else None
                hout = m if cfg.proj_size else h
                for t in steps(t_len, d):
                    np.matmul(w_hh, h.T, out=hg)
                    k.lstm_forward_step(gates[t], hg, bias, c, hout, y_d[t],
                                        cells[t] if training else c, lens, t, training,
                                        not cfg.proj_size, work)
                    if cfg.proj_size:
                        np.matmul(m, w_hr.T, out=hp)
                        k.commit_projection(hp, h, y_d[t], lens, t)
                cy[ld] = c
            elif mode == "gru":
                bi = zeros if b_ih is None else b_ih
                bh = zeros if b_hh is None else b_hh
                for t in steps(t_len, d):
                    np.matmul(w_hh, h.T, out=hg)
                    k.gru_forward_step(gates[t], hg, bi, bh, h, y_d[t], lens, t, training,
                                       one, work)
            else:
                bias = combined_bias(b_ih, b_hh, gh, dtype)
                relu = mode == "rnn_relu"
                for t in steps(t_len, d):
                    np.matmul(w_hh, h.T, out=hg)
                    k.rnn_forward_step(gates[t], hg, bias, h, y_d[t], lens, t, training,
                                       relu)
            hy[ld] = h
        inp = out_l
    # In training the last layer's output lives in the reserve; the caller gets its own copy.
    y = inp.copy() if training else inp
    return y, hy, cy
