"""cpu ``rnn_backward_data``: per step (in reverse processing order), in the forward's chains
of batch rows, one fused Numba kernel for the gate derivatives, written over the reserve's
activations, and the recurrent product ``W_hh.T @ dgates.T`` on weights packed once per call;
after the loop, the input gradient of all steps as one BLAS product per layer and
direction."""

from __future__ import annotations

import numpy as np

from ..problem import layer_params
from . import _tiles
from . import _rnn_chains as chains_k
from .rnn_forward import (OneThread, StepWeights, batch_chains, each_step, lengths_or_full,
                          run_recurrences, steps)


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
    dout = dy
    one = dtype.type(1)  # keeps float32 kernels in float32
    chains = [(d, part) for d in range(d_num) for part in batch_chains(n, dtype, d_num)]
    for layer in reversed(range(cfg.num_layers)):
        din = np.empty((t_len, n, cfg.layer_input_size(layer)), dtype)
        outputs = layout.outputs(reserve, layer)

        # W_hh.T (the GRU's hidden-path columns of it) packed once: see StepWeights.
        panels = [StepWeights(layer_params(cfg, params, layer, d)[1].T, chains)
                  for d in range(d_num)]

        def recurrence(d, part, k, products, layer=layer, outputs=outputs, dout=dout,
                       panels=panels):
            w_hr = layer_params(cfg, params, layer, d)[4]
            ld = layer * d_num + d
            sl = slice(*part)
            m_rows = part[1] - part[0]
            gates = layout.gates(reserve, layer, d)[:, sl]
            dy_d = dout[:, sl, d * p:(d + 1) * p]
            lens_c = lens[sl]
            dh = dhy[ld, sl].copy()
            step = panels[d].chain(m_rows)  # rec = W_hh.T @ dgates.T: see _rnn_cells
            rec = step.result                # zero before the first step
            hidden = step.packed.depth       # the gate columns of the recurrent product
            work = np.empty((m_rows, 3 * hs), dtype)
            backwards = reversed(steps(t_len, d))
            if mode == "lstm":
                cells = layout.cells(reserve, layer, d)[:, sl]
                c0 = cx[ld, sl]
                dc = dcy[ld, sl].copy()
                proj = bool(cfg.proj_size)
                dproj = layout.dproj(reserve, layer, d)[:, sl] if proj else None
                dm = np.empty((m_rows, hs) if proj else (1, 1), dtype)
                flat = chains_k.by_steps(gates) if products is OneThread else None
                kept = chains_k.by_steps(cells)
                if flat and kept and not proj:
                    step.run_steps(chains_k.lstm_backward_chain, backwards, t_len, *flat,
                                   *kept, c0, dh, rec, dy_d, dm, dc, lens_c, d == 1, one, work)
                else:
                    for t in each_step(backwards):
                        tp = t - 1 if d == 0 else t + 1
                        c_prev = c0 if tp < 0 or tp >= t_len else cells[tp]
                        if proj:
                            k.gradient_of_output(dh, rec, dy_d[t], dproj[t], lens_c, t)
                            products.dense(dproj[t], w_hr, dm)
                        k.lstm_backward_step(gates[t], cells[t], c_prev, dh, rec, dy_d[t],
                                             dm, dc, lens_c, t, proj, one, work)
                        step.load(gates[t])
                        step.multiply(products)
                dcx[ld, sl] = dc
            elif mode == "gru":
                h0 = hx[ld, sl]
                hid = outputs[:, sl, d * p:(d + 1) * p]
                flat = chains_k.by_steps(gates) if products is OneThread else None
                if flat:
                    step.run_steps(chains_k.gru_backward_chain, backwards, *flat, hidden, hid,
                                   h0, dh, rec, dy_d, lens_c, d == 1, one, work)
                else:
                    for t in each_step(backwards):
                        tp = t - 1 if d == 0 else t + 1
                        h_prev = h0 if tp < 0 or tp >= t_len else hid[tp]
                        k.gru_backward_step(gates[t], h_prev, h0, dh, rec, dy_d[t], lens_c,
                                            t, d == 1, one, work)
                        step.load(gates[t][:, :hidden])
                        step.multiply(products)
            else:
                relu = mode == "rnn_relu"
                flat = chains_k.by_steps(gates) if products is OneThread else None
                if flat:
                    step.run_steps(chains_k.rnn_backward_chain, backwards, *flat, dh, rec,
                                   dy_d, lens_c, relu, one)
                else:
                    for t in each_step(backwards):
                        k.rnn_backward_step(gates[t], dh, rec, dy_d[t], lens_c, t, relu, one)
                        step.load(gates[t])
                        step.multiply(products)
            dhx[ld, sl] = dh + rec.T

        run_recurrences(chains, recurrence, n, gw)
        for d in range(d_num):
            w_ih = layer_params(cfg, params, layer, d)[0]
            # The input gradient of every step at once: dgates (T*N, G*H) @ W_ih.
            g2 = layout.gates(reserve, layer, d).reshape(rows, gw)
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
