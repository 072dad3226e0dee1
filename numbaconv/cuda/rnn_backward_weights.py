"""cuda ``rnn_backward_weights``: after the recurrent loop of rnn_backward_data, every weight
gradient is one GEMM over all T*N rows (gate gradients from the reserve, transposed,
against the layer's inputs and the previous states, rebuilt on the device), each output
summing its rows in a fixed order; the bias gradients are column sums of the gate gradients
by the convolution bias gradient's two passes (:func:`._bias.column_sums`: chunks of rows
fixed by the shape, their partials added in order); with proj_size,
``dW_hr = dproj.T @ m`` (both from the reserve). Layers 1.. read the previous
layer's output times the dropout masks, as the forward did. No atomics: the same inputs
give bitwise the same dparams. Twin of :mod:`numbaconv.cpu.rnn_backward_weights`."""

from __future__ import annotations

from ..config import cuda_threads_per_block
from ..problem import layer_params
from ._layout import as_device, device_array
from ._blas import product
from ._bias import column_sums
from ._rnn_elementwise import apply, previous_states
from .rnn_forward import (contiguous_params, device_lengths, layer_input, masked_scratch,
                          rows, scratch)


def run(problem, operands, out, algorithm):
    x, params, reserve, hx, lengths = operands
    cfg = problem.config
    dt = problem.dtype
    t_len, n = problem.seq_len, problem.batch
    d_num, p, hs = cfg.num_directions, cfg.out_size, cfg.hidden_size
    gru = cfg.mode == "gru"
    gh = cfg.gates * hs
    gw = 4 * hs if gru else gh
    n_rows = t_len * n
    reserve, hx = as_device(reserve), as_device(hx)
    lens = device_lengths(lengths, t_len, n)
    layout = problem.reserve_layout
    acc = bool(problem.accumulate)
    threads = cuda_threads_per_block()
    dparams = as_device(out) if out is not None else device_array((cfg.num_params,), dt)
    target = contiguous_params(dparams, dt) if acc else (
        dparams if dparams.is_c_contiguous() else device_array(dparams.shape, dt))
    prev = scratch("previous states", (t_len, n, p), dt)
    prev2 = prev.reshape(n_rows, p)
    x_rows = rows(x, dt)
    masked = masked_scratch(problem, dt)
    for layer in range(cfg.num_layers):
        inp = layer_input(layout, reserve, layer, x_rows, masked, dt)
        outputs = layout.outputs(reserve, layer)
        for d in range(d_num):
            dw_ih, dw_hh, db_ih, db_hh, dw_hr = layer_params(cfg, target, layer, d)
            ld = layer * d_num + d
            g2 = layout.gates(reserve, layer, d).reshape(n_rows, gw)
            previous_states(outputs[:, :, d * p:(d + 1) * p], hx[ld], prev, lens, d == 1)
            if gru:  # columns: dr, dz, r * dn (hidden path), dn (input path)
                product(g2[:, :2 * hs], inp, dw_ih[:2 * hs], dt, ta=True, accumulate=acc)
                product(g2[:, 3 * hs:], inp, dw_ih[2 * hs:], dt, ta=True, accumulate=acc)
                product(g2[:, :3 * hs], prev2, dw_hh, dt, ta=True, accumulate=acc)
            else:
                product(g2, inp, dw_ih, dt, ta=True, accumulate=acc)
                product(g2, prev2, dw_hh, dt, ta=True, accumulate=acc)
            if cfg.bias:  # column sums: hidden path 0:G*H; input path 0:2H, 3H:4H for GRU
                column_sums(g2 if not gru else g2[:, :gh], db_hh, dt, acc, threads)
                # the input path's sums over the same columns are the same numbers: copied
                # unless each adds into its own previous value
                shared = 2 * hs if gru else gh
                if acc:
                    column_sums(g2[:, :shared], db_ih[:shared], dt, acc, threads)
                else:
                    apply("copy", db_ih[:shared], db_hh[:shared])
                if gru:
                    column_sums(g2[:, 3 * hs:], db_ih[2 * hs:], dt, acc, threads)
            if dw_hr is not None:  # dproj (rows, P) against m = o * tanh(c) (rows, H)
                product(layout.dproj(reserve, layer, d).reshape(n_rows, p),
                     layout.cells(reserve, layer, d).reshape(n_rows, hs), dw_hr, dt,
                     ta=True, accumulate=acc)
    if target is not dparams:
        apply("copy", dparams, target)
    return dparams
