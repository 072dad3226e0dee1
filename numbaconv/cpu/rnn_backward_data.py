"""cpu ``rnn_backward_data``: per step (in reverse processing order) one fused Numba kernel
for the gate derivatives, written over the reserve's activations, and the recurrent product
``dgates @ W_hh`` (BLAS); after the loop, the input gradient of all steps as one BLAS product
per layer and direction."""

from __future__ import annotations

import numpy as np

from ..problem import layer_params
from . import _tiles
from . import _rnn_cells as cells_k
from .rnn_forward import lengths_or_full, steps


def product(a, b):
    """a @ b, a new array, in slices fixed by the shape (see _tiles.matmul)."""
    return _tiles.matmul(a, b, np.empty((a.shape[0], b.shape[1]), a.dtype), fixed=True)


# One BLAS thread, products over all steps cut into slices fixed by the shape: the parameter
# gradients' bits then do not depend on the thread count (see _tiles.blas_single_threaded).
@_tiles.on_one_blas_thread
def run(problem, operands, out, algorithm):
    y, dy, params, reserve, hx, cx, dhy, dcy, lengths = operands
    cfg = problem.config
    t_len, n = problem.seq_len, problem.batch
    d_num, p, hs = cfg.num_directions, cfg.out_size, cfg.hidden_size
    dtype = problem.numpy_dtype
    mode = cfg.mode
    gw = 4 * hs if mode == "gru" else cfg.gates * hs
    rows = t_len * n
    lens = lengths_or_full(lengths, t_len, n)
    layout = problem.reserve_layout
    dhx = np.empty_like(hx)
    dcx = np.empty_like(cx) if mode == "lstm" else None
    rec = np.empty((p, n), dtype)  # W_hh.T @ dgates.T: see _rnn_cells on why transposed
    dm = np.empty((n, hs), dtype) if cfg.proj_size else np.empty((1, 1), dtype)
    dout = dy
    one = dtype.type(1)  # keeps float32 kernels in float32
    k = cells_k.kernels_for(n, gw)
    work = np.empty((n, 3 * hs), dtype)
    for layer in reversed(range(cfg.num_layers)):
        din = np.empty((t_len, n, cfg.layer_input_size(layer)), dtype)
        outputs = layout.outputs(reserve, layer)
        for d in range(d_num):
            w_ih, w_hh, _, _, w_hr = layer_params(cfg, params, layer, d)
            ld = layer * d_num + d
            gates = layout.gates(reserve, layer, d)
            dy_d = dout[:, :, d * p:(d + 1) * p]
            dh = dhy[ld].copy()
            rec[...] = 0
            backwards = reversed(steps(t_len, d))
            if mode == "lstm":
                cells = layout.cells(reserve, layer, d)
                dc = dcy[ld].copy()
                dproj = layout.dproj(reserve, layer, d) if cfg.proj_size else None
                for t in backwards:
                    tp = t - 1 if d == 0 else t + 1
                    c_prev = cx[ld] if tp < 0 or tp >= t_len else cells[tp]
                    if cfg.proj_size:
                        k.gradient_of_output(dh, rec, dy_d[t], dproj[t], lens, t)
                        np.matmul(dproj[t], w_hr, out=dm)
                    k.lstm_backward_step(gates[t], cells[t], c_prev, dh, rec, dy_d[t], dm,
                                         dc, lens, t, bool(cfg.proj_size), one, work)
                    np.matmul(w_hh.T, gates[t].T, out=rec)
                dcx[ld] = dc
            elif mode == "gru":
                hid = slice(d * p, (d + 1) * p)
                for t in backwards:
                    tp = t - 1 if d == 0 else t + 1
                    h_prev = hx[ld] if tp < 0 or tp >= t_len else outputs[tp, :, hid]
                    k.gru_backward_step(gates[t], h_prev, hx[ld], dh, rec, dy_d[t], lens,
                                        t, d == 1, one, work)
                    np.matmul(w_hh.T, gates[t][:, :3 * hs].T, out=rec)
            else:
                relu = mode == "rnn_relu"
                for t in backwards:
                    k.rnn_backward_step(gates[t], dh, rec, dy_d[t], lens, t, relu, one)
                    np.matmul(w_hh.T, gates[t].T, out=rec)
            dhx[ld] = dh + rec.T
            # The input gradient of every step at once: dgates (T*N, G*H) @ W_ih.
            g2 = gates.reshape(rows, gw)
            d2 = din.reshape(rows, -1)
            if mode == "gru":  # input-path gradients are dr, dz and dn (columns 0:2H, 3H:4H)
                part = product(g2[:, :2 * hs], w_ih[:2 * hs])
                part += product(g2[:, 3 * hs:], w_ih[2 * hs:])
            else:
                part = None if d == 0 else product(g2, w_ih)
                if d == 0:
                    _tiles.matmul(g2, w_ih, d2, fixed=True)
            if part is not None:
                if d == 0:
                    d2[...] = part
                else:
                    d2 += part
        masks = layout.masks(reserve, layer)
        dout = din * masks if masks is not None else din
    return dout, dhx, dcx
