"""cuda ``rnn_forward``: the input projections of all steps as one tiled GEMM per layer and
direction (written straight into the reserve's gate region), then per step the recurrent
product ``h @ W_hh.T`` (GEMM) and one fused kernel for the gates and the state update. Twin
of :mod:`numbaconv.cpu.rnn_forward`; the reserve is the same layout, on the device.

Also the drivers' shared helpers (GEMM and element-wise launches, device lengths)."""

from __future__ import annotations

import numpy as np

from ..config import cuda_threads_per_block, cuda_tile
from ..problem import layer_params
from . import _rnn_kernels
from ._layout import as_device, device_array


def blocks(count: int, per_block: int) -> int:
    return max(1, -(-count // per_block))


def gemm(a, b, c, dtype, *, ta=False, tb=False, accumulate=False):
    """``c (+)= op(a) @ op(b)`` on the device (2-D arrays, any strides)."""
    tile = cuda_tile()
    tm, tq, _ = tile
    kernel = _rnn_kernels.kernel("gemm", bool(ta), bool(tb), dtype, tile)
    kernel[(blocks(c.shape[1], tq), blocks(c.shape[0], tm)), (tq, tm)](
        a, b, c, bool(accumulate))


def launch(name, key, count, *args):
    """An element-wise kernel over ``count`` threads."""
    threads = cuda_threads_per_block()
    _rnn_kernels.kernel(name, *key)[blocks(count, threads), threads](*args)


def copy2(src, dst, dtype, add=None):
    """``dst = src [+ add]`` (2-D device arrays, any strides)."""
    launch("add2", (dtype,), dst.shape[0] * dst.shape[1], src,
           src if add is None else add, dst, add is not None)


def zeros(shape, dtype):
    out = device_array(shape, dtype)
    flat = out.reshape(1, int(np.prod(shape)))
    launch("zero2", (dtype,), flat.shape[1], flat)
    return out


def device_lengths(lengths, seq_len, batch):
    """The sequence lengths as an int64 device array (one small host-to-device copy: the
    frontend hands them over as a NumPy array)."""
    from numba import cuda
    host = lengths if lengths is not None else np.full(batch, seq_len, np.int64)
    return cuda.to_device(np.ascontiguousarray(host, dtype=np.int64))


def rows(a, dtype):
    """A (T, N, F) device array as (T*N, F): a view when contiguous, else a device copy."""
    a = as_device(a)
    t_len, n, f = a.shape
    if not a.is_c_contiguous():
        dense = device_array((t_len, n, f), dtype)
        for t in range(t_len):
            copy2(a[t], dense[t], dtype)
        a = dense
    return a.reshape(t_len * n, f)


def contiguous_params(params, dtype):
    params = as_device(params)
    if params.is_c_contiguous():
        return params
    dense = device_array(params.shape, dtype)
    launch("copy1", (dtype,), params.shape[0], params, dense)
    return dense


def steps(seq_len, direction):
    """Time steps in processing order."""
    return range(seq_len) if direction == 0 else range(seq_len - 1, -1, -1)


def run(problem, operands, out, algorithm):
    x, params, hx, cx, lengths, reserve = operands
    cfg = problem.config
    dt = problem.dtype
    t_len, n = problem.seq_len, problem.batch
    d_num, p, hs = cfg.num_directions, cfg.out_size, cfg.hidden_size
    lstm, training = cfg.mode == "lstm", problem.training
    gh = cfg.gates * hs
    gw = 4 * hs if cfg.mode == "gru" else gh
    params = contiguous_params(params, dt)
    hx, cx, reserve = as_device(hx), as_device(cx), as_device(reserve)
    lens = device_lengths(lengths, t_len, n)
    layout = problem.reserve_layout if training else None
    hy = device_array(hx.shape, dt)
    cy = device_array(cx.shape, dt) if lstm else None
    scratch_gates = None if training else device_array((t_len, n, gw), dt)
    hg = device_array((n, gh), dt)
    h = device_array((n, p), dt)
    c = device_array((n, hs), dt) if lstm else h
    zero_bias = zeros((gh,), dt) if not cfg.bias else None
    inp = rows(x, dt)
    out_l = None
    for layer in range(cfg.num_layers):
        out_l = layout.outputs(reserve, layer) if training else \
            device_array((t_len, n, d_num * p), dt)
        for d in range(d_num):
            w_ih, w_hh, b_ih, b_hh, _ = layer_params(cfg, params, layer, d)
            if b_ih is None:
                b_ih = b_hh = zero_bias
            ld = layer * d_num + d
            gates = layout.gates(reserve, layer, d) if training else scratch_gates
            gemm(inp, w_ih, gates.reshape(t_len * n, gw)[:, :gh], dt, tb=True)
            y_d = out_l[:, :, d * p:(d + 1) * p]
            copy2(hx[ld], h, dt)
            if lstm:
                copy2(cx[ld], c, dt)
            cells = layout.cells(reserve, layer, d) if training and lstm else None
            for t in steps(t_len, d):
                gemm(h, w_hh, hg, dt, tb=True)
                launch("forward_step", (cfg.mode, dt), n * hs, gates[t], hg, b_ih, b_hh, h,
                       c, y_d[t], cells[t] if cells is not None else c, lens, t, training)
            copy2(h, hy[ld], dt)
            if lstm:
                copy2(c, cy[ld], dt)
        inp = out_l.reshape(t_len * n, d_num * p)
    if training:  # the last layer's output lives in the reserve; the caller gets a copy
        y = device_array(out_l.shape, dt)
        copy2(inp, y.reshape(t_len * n, d_num * p), dt)
    else:
        y = out_l
    return y, hy, cy
