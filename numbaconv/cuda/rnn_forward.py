"""cuda ``rnn_forward``: the input projections of all steps as one GEMM per layer and
direction (written straight into the reserve's gate region), then per step the recurrent
product ``h @ W_hh.T`` (GEMM) and one fused kernel for the gates and the state update; with
proj_size, the projection ``m @ W_hr.T`` (GEMM) and a kernel committing it to h and y.
The ``persistent`` algorithm runs all steps of a layer and direction in one cooperative
launch of ``forward_sequence`` (or ``forward_projected_sequence``) instead. In
training, layers 1.. read the previous layer's output times the dropout masks the frontend
wrote into the reserve. Twin of :mod:`numbaconv.cpu.rnn_forward`; the reserve is the same
layout, on the device.

Every GEMM is :func:`numbaconv.cuda._blas.product` (cuBLAS where it loads, else the Numba
``gemm`` kernel); the element-wise work outside the step loops is
:mod:`numbaconv.cuda._rnn_elementwise`'s. Also the drivers' shared helpers (state copies,
scratch, device lengths, layer inputs, the time/batch axis swap the frontend uses for
batch_first device arrays)."""

from __future__ import annotations

import threading

import numpy as np

from ..config import cuda_threads_per_block, cuda_tile
from ..problem import layer_params
from . import _rnn_kernels
from ._blas import Prepared, elementwise_launch, product
from ._launch import Bound
from ._layout import as_device, device_array
from ._rnn_elementwise import apply


def bound(name, key, count, args, at: int) -> Bound:
    """The element-wise kernel ``name`` over ``count`` threads with ``args`` set up once, to
    be run every step with argument ``at`` (the step index) set: ``bound(...)(t)``."""
    grid, block = elementwise_launch(count, cuda_threads_per_block())
    return Bound(_rnn_kernels.kernel(name, *key), grid, block, args, at)


def copy(src, dst, add=None):
    """``dst = src [+ add]`` (device arrays of one shape, any strides)."""
    apply("copy" if add is None else "add", dst, src, add)


#: Blocks a cooperative launch may have, per (kernel, argument types, threads, device).
_COOPERATIVE_BLOCKS: dict = {}


def cooperative_blocks(kernel, args, threads) -> int:
    """How many blocks of ``threads`` threads of ``kernel`` (which synchronises its grid)
    can be resident at once for these arguments: the most a cooperative launch may have.
    Compiles the kernel for them first (once); the simulator allows one block."""
    from .._device import simulated
    if simulated():
        return kernel.overloads[None].max_cooperative_grid_blocks(threads)
    from ._blas import _device_id
    sig = tuple(kernel.typeof_pyval(a) for a in args)
    key = (id(kernel), sig, threads, _device_id())
    found = _COOPERATIVE_BLOCKS.get(key)
    if found is None:
        kernel.compile(sig)
        found = _COOPERATIVE_BLOCKS[key] = int(
            kernel.overloads[sig].max_cooperative_grid_blocks(threads))
    return found


def persistent_launch(name, mode, dtype, args, *, rows, units, out_size=0, reduce_len=0):
    """One cooperative launch of a persistent loop (``forward_sequence``,
    ``backward_sequence`` or their ``projected`` twins) on ``args``: a block for each of
    its tiles of ``rows x units`` cells (or of ``rows x out_size`` projected ones, if
    more), at most as many as can be resident at once. ``reduce_len``: the reduction of
    the product the loop may split (the recurrent product; with a projection, the
    forward's projection or the data gradient's ``rec``): the loop runs as its ``split``
    twin (with partial sums from the workspace) where
    :func:`numbaconv.cuda._rnn_kernels.reduction_split` splits it."""
    tile = cuda_tile()
    tm, tq, _ = tile
    splits = 1
    if reduce_len:
        splits, chunk = _rnn_kernels.reduction_split(name, mode, tile, rows, units,
                                                     reduce_len, out_size)
    if splits > 1:
        name = name.replace("_sequence", "_split_sequence")
        columns = _rnn_kernels.split_columns(name, mode, units, out_size)
        args = args + (scratch("persistent partial sums", (splits, rows, columns), dtype),
                       chunk)
    kernel = _rnn_kernels.kernel(name, mode, dtype, tile)
    wanted = _rnn_kernels.sequence_tiles(name, mode, tile, rows, units, out_size, splits)
    grid = min(wanted, cooperative_blocks(kernel, args, tm * tq))
    if grid < 1:
        raise RuntimeError(f"{name}: no block of {tm * tq} threads fits on the device for a "
                           f"cooperative launch")
    kernel[grid, (tq, tm)](*args)


#: Each host thread's scratch: {(device, name): device array}. Per thread, because every
#: thread's kernels go to the same default stream, where two threads' steps would
#: interleave on one buffer; within a thread, the stream orders one call's use of a buffer
#: after the previous call's.
_workspace = threading.local()

#: Full-length sequence lengths kept on the device, per (device, T, N); at most this many.
_FULL_LENGTHS_KEPT = 16

#: Scratch larger than this is allocated per call, not kept: an inference forward's gates
#: for T=1000, N=64, H=1024 are 1 GiB, too much to hold between calls unasked, and at that
#: size an allocation costs little next to the work that fills it.
WORKSPACE_MAX_BYTES = 64 * 2**20


def scratch(name, shape, dtype, zero=False):
    """A device array for a driver's own use, never handed to the caller: kept between
    calls, one per (host thread, device, name), replaced when the shape or dtype changes.
    So a steady training step allocates only its results (arrays over
    :data:`WORKSPACE_MAX_BYTES` are made per call). ``zero``: zero-filled when made (for
    arrays that are only read, such as the zero bias)."""
    from ._blas import _device_id
    arrays = _workspace.__dict__
    key = (_device_id(), name)
    found = arrays.get(key)
    if found is None or tuple(found.shape) != tuple(shape) or \
            found.dtype != np.dtype(dtype):
        found = device_array(shape, dtype)
        if int(np.prod(shape)) * np.dtype(dtype).itemsize <= WORKSPACE_MAX_BYTES:
            arrays[key] = found
        else:
            arrays.pop(key, None)
        if zero:
            apply("zero", found)
    return found


def device_lengths(lengths, seq_len, batch):
    """The sequence lengths as an int64 device array: one small host-to-device copy when
    the frontend hands them over (a NumPy array); without them, full lengths copied once
    per (device, T, N) and kept."""
    from numba import cuda
    if lengths is not None:
        return cuda.to_device(np.ascontiguousarray(lengths, dtype=np.int64))
    from ._blas import _device_id
    kept = _workspace.__dict__.setdefault("full_lengths", {})
    key = (_device_id(), int(seq_len), int(batch))
    found = kept.get(key)
    if found is None:
        if len(kept) >= _FULL_LENGTHS_KEPT:
            kept.clear()
        found = kept[key] = cuda.to_device(np.full(batch, seq_len, np.int64))
    return found


def copy3(src, dtype, swap):
    """A new C-contiguous device array holding the 3-D ``src`` (any strides), with its first
    two axes swapped when ``swap``: one kernel, no host round trip."""
    src = as_device(src)
    a, b, f = src.shape
    dst = device_array((b, a, f) if swap else (a, b, f), dtype)
    apply("copy", dst, src, swap=swap)
    return dst


def swap_time_batch(a):
    """``(T, N, F) <-> (N, T, F)`` of a device array, as a new C-contiguous Numba device
    array: how the frontend undoes (and redoes) batch_first for device arrays."""
    a = as_device(a)
    return copy3(a, np.dtype(a.dtype).name, True)


def rows(a, dtype):
    """A (T, N, F) device array as (T*N, F): a view when contiguous, else a device copy."""
    a = as_device(a)
    t_len, n, f = a.shape
    if not a.is_c_contiguous():
        a = copy3(a, dtype, False)
    return a.reshape(t_len * n, f)


def masked_scratch(problem, dtype):
    """A (T*N, D*P) device array for layer inputs times their dropout masks, or None when
    the reserve has no masks."""
    cfg = problem.config
    if cfg.dropout == 0 or cfg.num_layers == 1:
        return None
    return scratch("masked inputs", (problem.seq_len * problem.batch,
                                     cfg.num_directions * cfg.out_size), dtype)


def layer_input(layout, reserve, layer, x_rows, scratch, dtype):
    """What ``layer`` read in the training forward, as (T*N, features) rows: x for layer 0,
    else the previous layer's outputs, times this layer's dropout masks (into ``scratch``)
    when the reserve has them; the device twin of ``RNNReserveLayout.layer_input``."""
    if layer == 0:
        return x_rows
    outputs = layout.outputs(reserve, layer - 1)
    inp = outputs.reshape(outputs.shape[0] * outputs.shape[1], outputs.shape[2])
    masks = layout.masks(reserve, layer)
    if masks is None:
        return inp
    apply("mul", scratch, inp, masks.reshape(scratch.shape[0], scratch.shape[1]))
    return scratch


def contiguous_params(params, dtype):
    params = as_device(params)
    if params.is_c_contiguous():
        return params
    dense = device_array(params.shape, dtype)
    apply("copy", dense, params)
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
    scratch_gates = None if training else scratch("forward gates", (t_len, n, gw), dt)
    hg = scratch("forward hg", (n, gh), dt)
    proj = bool(cfg.proj_size)
    # the persistent loop alternates between two states (one with a projection, which
    # the grid barrier between its passes separates), the step loops update one
    hh = scratch("forward hh", (2, n, p), dt) if algorithm == "persistent" and not proj \
        else None
    h = scratch("forward h", (n, p), dt) if hh is None else hh[0]
    c = scratch("forward c", (n, hs), dt) if lstm else h
    m = scratch("forward m", (n, hs), dt) if proj else None  # o * tanh(c), W_hr's input
    hp = scratch("forward hp", (n, p), dt) if proj else None  # m @ W_hr.T
    zero_bias = scratch("zero bias", (gh,), dt, zero=True) if not cfg.bias else None
    x_rows = rows(x, dt)
    masked = masked_scratch(problem, dt) if training else None
    inp = x_rows
    out_l = None
    for layer in range(cfg.num_layers):
        if training:  # with its dropout masks applied
            inp = layer_input(layout, reserve, layer, x_rows, masked, dt)
            out_l = layout.outputs(reserve, layer)
        else:
            out_l = device_array((t_len, n, d_num * p), dt)
        for d in range(d_num):
            w_ih, w_hh, b_ih, b_hh, w_hr = layer_params(cfg, params, layer, d)
            if b_ih is None:
                b_ih = b_hh = zero_bias
            ld = layer * d_num + d
            gates = layout.gates(reserve, layer, d) if training else scratch_gates
            product(inp, w_ih, gates.reshape(t_len * n, gw)[:, :gh], dt, tb=True)
            y_d = out_l[:, :, d * p:(d + 1) * p]
            copy(hx[ld], h)
            if lstm:
                copy(cx[ld], c)
            # Whole (T, N, F) arrays and the step to every launch, no per-step slices; a
            # kernel that does not use an array gets gates in its place.
            cells = layout.cells(reserve, layer, d) if training and lstm else gates
            if algorithm == "persistent" and proj:  # every step in one launch
                persistent_launch("forward_projected_sequence", cfg.mode, dt,
                                  (gates, w_hh, w_hr, b_ih, b_hh, h, m, hg, hp, c, y_d,
                                   cells, lens, training, d == 1), rows=n, units=hs,
                                  out_size=p, reduce_len=hs)
            elif algorithm == "persistent":
                persistent_launch("forward_sequence", cfg.mode, dt,
                                  (gates, w_hh, b_ih, b_hh, hh, hg, c, y_d, cells, lens,
                                   training, d == 1), rows=n, units=hs, reduce_len=hs)
            else:
                # planned once, run every step: the same arrays each time
                recurrent = Prepared(h, w_hh, hg, dt, tb=True)
                # with a projection the cell writes m, and h and y come from the projection
                cell_h, cell_y = (m, gates) if proj else (h, y_d)
                step = bound("forward_step", (cfg.mode, dt, proj), n * hs,
                             (gates, hg, b_ih, b_hh, cell_h, c, cell_y, cells, lens, 0,
                              training), at=9)
                if proj:
                    projection = Prepared(m, w_hr, hp, dt, tb=True)
                    commit = bound("commit_projection", (dt,), n * p, (hp, h, y_d, lens, 0),
                                   at=4)
                for t in steps(t_len, d):
                    recurrent()
                    step(t)
                    if proj:
                        projection()
                        commit(t)
            copy(h if hh is None else hh[t_len % 2], hy[ld])
            if lstm:
                copy(c, cy[ld])
        inp = out_l.reshape(t_len * n, d_num * p)
    if training:  # the last layer's output lives in the reserve; the caller gets a copy
        y = device_array(out_l.shape, dt)
        copy(out_l, y)
    else:
        y = out_l
    return y, hy, cy
