"""cpu ``rnn_backward_weights``: after the recurrent loop of rnn_backward_data, every weight
gradient is one large BLAS product over all steps (gate gradients from the reserve against
the layer's inputs and previous states) and the bias gradients are deterministic column
sums."""

from __future__ import annotations

import numpy as np

from ..problem import layer_params
from . import _tiles
from . import _rnn_cells as cells_k


def _product(dst, a, b, accumulate):
    """dst (+)= a @ b, straight into dst when overwriting; in slices fixed by the shape
    (see _tiles.matmul)."""
    if accumulate:
        dst += _tiles.matmul(a, b, np.empty(dst.shape, dst.dtype), fixed=True)
    else:
        _tiles.matmul(a, b, dst, fixed=True)


# One BLAS thread, products over all steps cut into slices fixed by the shape: the parameter
# gradients' bits then do not depend on the thread count (see _tiles.blas_single_threaded).
@_tiles.on_one_blas_thread
def run(problem, operands, out, algorithm):
    x, params, reserve, hx, lengths = operands
    cfg = problem.config
    t_len, n = problem.seq_len, problem.batch
    d_num, p, hs = cfg.num_directions, cfg.out_size, cfg.hidden_size
    dtype = problem.numpy_dtype
    gru = cfg.mode == "gru"
    gw = 4 * hs if gru else cfg.gates * hs
    rows = t_len * n
    layout = problem.reserve_layout
    acc = problem.accumulate
    dparams = out if out is not None else np.empty(cfg.num_params, dtype)
    sums = np.empty(gw, dtype)
    for layer in range(cfg.num_layers):
        inp = layout.layer_input(reserve, layer, x).reshape(rows, -1)
        for d in range(d_num):
            dw_ih, dw_hh, db_ih, db_hh, dw_hr = layer_params(cfg, dparams, layer, d)
            g2 = layout.gates(reserve, layer, d).reshape(rows, gw)
            h_prev = layout.previous_states(reserve, layer, d, hx[layer * d_num + d],
                                            lengths).reshape(rows, p)
            if gru:  # columns: dr, dz, r * dn (hidden path), dn (input path)
                _product(dw_ih[:2 * hs], g2[:, :2 * hs].T, inp, acc)
                _product(dw_ih[2 * hs:], g2[:, 3 * hs:].T, inp, acc)
                _product(dw_hh, g2[:, :3 * hs].T, h_prev, acc)
            else:
                _product(dw_ih, g2.T, inp, acc)
                _product(dw_hh, g2.T, h_prev, acc)
            if cfg.bias:
                cells_k.column_sums(g2, sums, False)
                ih = np.concatenate([sums[:2 * hs], sums[3 * hs:]]) if gru else sums
                hh = sums[:3 * hs] if gru else sums
                if acc:
                    db_ih += ih
                    db_hh += hh
                else:
                    db_ih[...] = ih
                    db_hh[...] = hh
            if dw_hr is not None:
                dproj = layout.dproj(reserve, layer, d).reshape(rows, p)
                m = layout.cells(reserve, layer, d).reshape(rows, hs)
                _product(dw_hr, dproj.T, m, acc)
    return dparams
