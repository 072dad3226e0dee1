"""cuda ``rnn_backward_data``: per step (in reverse processing order) one fused kernel for the
gate derivatives, written over the reserve's activations, and the recurrent product
``dgates @ W_hh`` (GEMM); after the loop, the input gradient of all steps as one GEMM per
layer and direction, times the layer's dropout masks. With proj_size, each step first
writes the gradient of h to the reserve's dproj (``gradient_of_output``) and the GEMM
``dproj @ W_hr`` gives the cell kernel its input. The ``persistent`` algorithm runs all
steps of a layer and direction in one cooperative launch of ``backward_sequence`` (or
``backward_projected_sequence``) instead. Twin of :mod:`numbaconv.cpu.rnn_backward_data`."""

from __future__ import annotations

from ..problem import layer_params
from ._layout import as_device, device_array
from ._blas import Prepared, product
from ._rnn_elementwise import apply
from .rnn_forward import (bound, contiguous_params, copy, device_lengths,
                          persistent_launch, scratch, steps)


def run(problem, operands, out, algorithm):
    y, dy, params, reserve, hx, cx, dhy, dcy, lengths = operands
    cfg = problem.config
    dt = problem.dtype
    t_len, n = problem.seq_len, problem.batch
    d_num, p, hs = cfg.num_directions, cfg.out_size, cfg.hidden_size
    mode = cfg.mode
    lstm, gru = mode == "lstm", mode == "gru"
    gw = 4 * hs if gru else cfg.gates * hs
    rows = t_len * n
    params = contiguous_params(params, dt)
    dy, reserve, hx, cx, dhy, dcy = (as_device(a) for a in (dy, reserve, hx, cx, dhy, dcy))
    lens = device_lengths(lengths, t_len, n)
    layout = problem.reserve_layout
    dhx = device_array(hx.shape, dt)
    dcx = device_array(cx.shape, dt) if lstm else None
    rec = scratch("backward rec", (n, p), dt)
    dh = scratch("backward dh", (n, p), dt)
    dc = scratch("backward dc", (n, hs), dt) if lstm else dh
    proj = bool(cfg.proj_size)
    dm = scratch("backward dm", (n, hs), dt) if proj else None  # dproj @ W_hr
    dout = dy
    for layer in reversed(range(cfg.num_layers)):
        din = device_array((t_len, n, cfg.layer_input_size(layer)), dt)
        d2 = din.reshape(rows, cfg.layer_input_size(layer))
        outputs = layout.outputs(reserve, layer)
        for d in range(d_num):
            w_ih, w_hh, _, _, w_hr = layer_params(cfg, params, layer, d)
            ld = layer * d_num + d
            gates = layout.gates(reserve, layer, d)
            dy_d = dout[:, :, d * p:(d + 1) * p]
            # Whole (T, N, F) arrays and the step to every launch, no per-step slices; a
            # kernel that does not read an array gets gates (or dh) in its place. The state
            # before a step: LSTM's cell state, GRU's output, or the initial one.
            if lstm:
                cells = states = layout.cells(reserve, layer, d)
                init = cx[ld]
            elif gru:
                cells, states, init = gates, outputs[:, :, d * p:(d + 1) * p], hx[ld]
            else:
                cells, states, init = gates, gates, dh
            copy(dhy[ld], dh)
            if lstm:
                copy(dcy[ld], dc)
            apply("zero", rec)
            if algorithm == "persistent" and proj:  # every step in one launch
                persistent_launch("backward_projected_sequence", mode, dt,
                                  (gates, cells, init, w_hh, w_hr, dh, rec, dy_d,
                                   layout.dproj(reserve, layer, d), dm, dc, lens, d == 1),
                                  rows=n, units=hs, out_size=p, reduce_len=w_hh.shape[0])
            elif algorithm == "persistent":
                persistent_launch("backward_sequence", mode, dt,
                                  (gates, cells, states, init, w_hh, dh, rec, dy_d, dc, lens,
                                   d == 1), rows=n, units=hs, reduce_len=w_hh.shape[0])
            else:
                # planned once; each step moves it to its own step of the reserve
                recurrent = Prepared(gates[0][:, :3 * hs] if gru else gates[0], w_hh, rec,
                                     dt, steps=gates)
                # with a projection the cell kernel reads dm = dproj @ W_hr, not dh, rec, dy
                cell_dh, cell_rec, cell_dy = (dm, dm, gates) if proj else (dh, rec, dy_d)
                step = bound("backward_step", (mode, dt, proj), n * hs,
                             (gates, cells, states, init, cell_dh, cell_rec, cell_dy, dc, lens,
                              0, d == 1), at=9)
                if proj:
                    dproj = layout.dproj(reserve, layer, d)
                    projection = Prepared(dproj[0], w_hr, dm, dt, steps=dproj)
                    output_gradient = bound("gradient_of_output", (dt,), n * p,
                                            (dh, rec, dy_d, dproj, lens, 0), at=5)
                for t in reversed(steps(t_len, d)):
                    if proj:
                        output_gradient(t)
                        projection(t)
                    step(t)
                    recurrent(t)
            copy(dh, dhx[ld], add=rec)
            if lstm:
                copy(dc, dcx[ld])
            # The input gradient of every step at once: dgates (T*N, G*H) @ W_ih.
            g2 = gates.reshape(rows, gw)
            if gru:  # input-path gradients are dr, dz and dn (columns 0:2H, 3H:4H)
                product(g2[:, :2 * hs], w_ih[:2 * hs], d2, dt, accumulate=d > 0)
                product(g2[:, 3 * hs:], w_ih[2 * hs:], d2, dt, accumulate=True)
            else:
                product(g2, w_ih, d2, dt, accumulate=d > 0)
        masks = layout.masks(reserve, layer)
        if masks is not None:  # the gradient of the previous layer's output
            f = masks.shape[2]
            apply("mul", d2, d2, masks.reshape(rows, f))
        dout = din
    return dout, dhx, dcx
