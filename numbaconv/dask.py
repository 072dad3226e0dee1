"""Batch-sharded convolutions on Dask: the same calls, on dask arrays split along the batch.

Install the ``dask`` extra (``pip install "numbaconv[dask]"``: ``dask[array]`` and
``distributed``). ``import numbaconv`` never imports this module or Dask.

Every function here takes the arguments and keywords of the numbaconv function of the same
name, with ``x`` and ``dy`` (and the transposed convolution's ``x``) as dask arrays chunked
along the batch axis only (axis 0, in both layouts); weights and biases stay NumPy arrays and
are shipped once to every block's task. What comes back:

- forward outputs and data gradients (``conv``, ``conv_transpose``, ``conv_backward_data``,
  the ``dx`` of ``conv_backward``) are lazy dask arrays with one block per input block (the
  same batch chunks), computed by the numbaconv function on that block alone;
- weight and bias gradients are sums over the batch: one partial sum per block, combined by
  a tree reduction (``split_every`` blocks at a time, in a fixed order, so the same chunking
  gives bitwise the same result) and returned as NumPy arrays, computed at once with
  ``scheduler`` (a name such as ``"threads"``, or a ``distributed.Client``; by default the
  active client or Dask's default scheduler). With ``compute=False`` they stay dask arrays
  of one chunk.

The results equal the single-machine call on the concatenated batch up to rounding: the
batch sum runs in another order.

Recurrent networks: :func:`rnn_forward`, :func:`rnn_backward_data` and
:func:`rnn_backward_weights` take x and dy chunked along the batch axis (axis 1, or 0 with
``batch_first``) and states split along axis 1 like it. The training forward runs one task
per block and persists its results, so each block's reserve stays where it was computed (a
worker's memory, with a distributed client) inside an :class:`RNNDaskReserve`; backward data
runs on those reserves per block and persists the updated ones; backward weights sums the
per-block partial gradients by a tree reduction. Without dropout the results equal the
whole-batch call's; with it, each block draws its masks from a seed derived from
``dropout_seed`` and the block's index (reproducible, but not the whole-batch masks).

Chunking: an array split along any other axis is rejected with a ``ValueError`` naming it,
unless ``rechunk=True``, which merges those axes into one chunk (keeping the batch chunks).
``x`` and ``dy`` of one call must share their batch chunks (``rechunk=True`` rechunks ``dy``
to ``x``'s). A NumPy array given where a dask array is expected is taken as one block (or,
beside a dask array, chunked like it).

Each block runs the ordinary numbaconv call, so Dask's threads call numbaconv concurrently:
numbaconv's kernels are safe for that with Numba's ``omp`` and ``tbb`` threading layers (the
ones numbaconv runs on by default). For many threads per worker, also cap Numba's and BLAS's
own threads (``NUMBA_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``) so the cores are not
oversubscribed.
"""

from __future__ import annotations

import math
import operator

import dask
import dask.array as da
import numpy as np

import numbaconv as _nc
from . import problem as pb

__all__ = ["conv", "conv_backward_data", "conv_backward_weight", "conv_backward_bias",
           "conv_backward", "conv_transpose", "conv_transpose_backward", "rnn_forward",
           "rnn_backward_data", "rnn_backward_weights", "RNNDaskReserve"]


# --- arguments ---------------------------------------------------------------------------

def _batch_chunked(name, a, rechunk, like=None):
    """``a`` as a dask array chunked along axis 0 only (like ``like``'s batch chunks)."""
    if isinstance(a, np.ndarray):
        if a.ndim == 0:
            raise ValueError(f"{name}: expected 3 to 5 dimensions, got shape ()")
        chunks = like.chunks[0] if like is not None else a.shape[0]
        return da.from_array(a, chunks=(chunks,) + a.shape[1:])
    if not isinstance(a, da.Array):
        raise TypeError(f"{name}: expected a dask array (or a NumPy array), got "
                        f"{type(a).__name__}")
    if any(math.isnan(c) for c in a.chunks[0]):
        raise ValueError(f"{name}: expected known chunk sizes along the batch axis, got "
                         f"unknown ones (call {name}.compute_chunk_sizes() first)")
    split = [i for i in range(1, a.ndim) if len(a.chunks[i]) > 1]
    if split:
        if not rechunk:
            raise ValueError(f"{name}: expected chunks along the batch axis (axis 0) only, "
                             f"got {name} split along axis {split[0]} (chunks "
                             f"{a.chunks}); pass rechunk=True to merge the other axes "
                             f"into one chunk")
        a = a.rechunk({i: -1 for i in range(1, a.ndim)})
    if like is not None and a.chunks[0] != like.chunks[0]:
        if not rechunk:
            raise ValueError(f"{name}: expected the batch chunks of x {like.chunks[0]}, got "
                             f"{a.chunks[0]}; pass rechunk=True to rechunk {name} like x")
        a = a.rechunk({0: like.chunks[0]})
    return a


def _numpy(name, a):
    """Weights and biases: NumPy arrays, sent whole to every block's task."""
    if a is None or isinstance(a, np.ndarray):
        return a
    if isinstance(a, da.Array):
        raise TypeError(f"{name}: expected a NumPy array (weights are not sharded), got a "
                        f"dask array; call {name}.compute() first")
    raise TypeError(f"{name}: expected a NumPy array, got {type(a).__name__}")


def _meta(a):
    """A zero-byte NumPy stand-in of ``a``'s shape and dtype, so the whole-batch call is
    validated by numbaconv's own checks (same messages) before any graph is built."""
    if a is None or isinstance(a, np.ndarray):
        return a
    return np.broadcast_to(np.zeros((), a.dtype), a.shape)


def _meta_empty(ndim, dtype):
    return np.empty((0,) * ndim, dtype)


def _block_shape(shape, block):
    """A whole-batch shape with the batch of one block."""
    return (block.shape[0],) + tuple(shape[1:])


# --- per-block tasks (module-level so they pickle by reference) --------------------------

def _conv_block(x, w, bias, kwargs):
    return _nc.conv(x, w, bias, **kwargs)


def _conv_transpose_block(x, w, bias, kwargs):
    return _nc.conv_transpose(x, w, bias, **kwargs)


def _dgrad_block(dy, w, input_shape, kwargs):
    return _nc.conv_backward_data(dy, w, _block_shape(input_shape, dy), **kwargs)


def _wgrad_partial(x, dy, weight_shape, kwargs):
    return _nc.conv_backward_weight(x, dy, weight_shape, **kwargs)[None]


def _transpose_dgrad_block(dy, x_shape, w, kwargs):
    # Only x's shape is read: a zero-byte stand-in of the block's x.
    x = np.broadcast_to(np.zeros((), dy.dtype), _block_shape(x_shape, dy))
    return _nc.conv_transpose_backward(dy, x, w, needs=(True, False, False), **kwargs)[0]


def _transpose_wgrad_partial(dy, x, w, kwargs):
    dw = _nc.conv_transpose_backward(dy, x, w, needs=(False, True, False), **kwargs)[1]
    return dw[None]


def _bgrad_partial(dy, layout):
    return _nc.conv_backward_bias(dy, layout=layout)[None]


# --- graph building ----------------------------------------------------------------------

def _per_block(task, a, result_shape, dtype, token, *args):
    """Blocks of ``result_shape`` (the whole batch's), one per block of ``a``: each is
    ``task(block, *args)``."""
    chunks = (a.chunks[0],) + tuple((s,) for s in result_shape[1:])
    return da.map_blocks(task, a, *args, chunks=chunks, dtype=dtype,
                         meta=_meta_empty(len(result_shape), dtype), token=token)


def _batch_sum(task, arrays, result_shape, dtype, token, split_every, *args):
    """Sum over the batch of per-block partials ``task(*blocks, *args)`` of shape
    ``(1, *result_shape)``, by a tree reduction: a dask array of one chunk."""
    result_ind = tuple(f"r{i}" for i in range(len(result_shape)))
    pairs = []
    for j, a in enumerate(arrays):
        pairs += [a, ("n",) + tuple(f"a{j}_{i}" for i in range(1, a.ndim))]
    for value in args:
        pairs += [value, None]
    partials = da.blockwise(
        task, ("n",) + result_ind, *pairs, new_axes=dict(zip(result_ind, result_shape)),
        adjust_chunks={"n": 1}, concatenate=True, dtype=dtype,
        meta=_meta_empty(len(result_shape) + 1, dtype), token=f"{token}-partial")
    return partials.sum(axis=0, dtype=dtype, split_every=split_every)


def _finish(results, out, accumulate, compute, scheduler):
    """Compute the reductions together (sharing their inputs' tasks), or leave them lazy."""
    if not compute:
        return results
    results = dask.compute(*results, scheduler=scheduler)
    if out is None:
        return results
    if accumulate:
        out += results[0]
    else:
        out[...] = results[0]
    return (out,) + tuple(results[1:])


def _no_out_if_lazy(out, compute):
    if out is not None and not compute:
        raise ValueError("out: expected None with compute=False (a lazy result is not "
                         "written anywhere), got an array")


# --- public functions --------------------------------------------------------------------

def conv(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1,
         layout="channels_first", rechunk=False):
    """Forward convolution of a batch-chunked dask array (see :func:`numbaconv.conv`).

    Parameters
    ----------
    x : dask array, shape (N, C, *S) or (N, *S, C), chunked along N only
    w : NumPy array, shape (K, C // groups, *R)
    bias : NumPy array, shape (K,), optional
    stride, padding, dilation, groups, layout
        As for :func:`numbaconv.conv`.
    rechunk : bool
        Merge chunks along axes other than the batch instead of raising ``ValueError``.

    Returns
    -------
    y : dask array, shape (N, K, *P) or (N, *P, K)
        Lazy, with x's batch chunks: block i is ``numbaconv.conv`` of x's block i.
    """
    w, bias = _numpy("w", w), _numpy("bias", bias)
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
                  layout=layout)
    x = _batch_chunked("x", x, rechunk)
    problem = pb.conv_problem(_meta(x), w, bias, **kwargs)
    return _per_block(_conv_block, x, problem.y_shape, x.dtype, "numbaconv-conv", w, bias,
                      kwargs)


def conv_transpose(x, w, bias=None, *, stride=1, padding=0, output_padding=0, dilation=1,
                   groups=1, layout="channels_first", rechunk=False):
    """Transposed convolution of a batch-chunked dask array (see
    :func:`numbaconv.conv_transpose`).

    Parameters
    ----------
    x : dask array, shape (N, C_in, *S_in) or (N, *S_in, C_in), chunked along N only
    w : NumPy array, shape (C_in, C_out // groups, *R)
    bias : NumPy array, shape (C_out,), optional
    rechunk : bool
        Merge chunks along axes other than the batch instead of raising ``ValueError``.

    Returns
    -------
    y : dask array, shape (N, C_out, *S_out) or (N, *S_out, C_out), x's batch chunks
    """
    w, bias = _numpy("w", w), _numpy("bias", bias)
    kwargs = dict(stride=stride, padding=padding, output_padding=output_padding,
                  dilation=dilation, groups=groups, layout=layout)
    x = _batch_chunked("x", x, rechunk)
    problem = pb.conv_transpose_problem(_meta(x), w, bias, **kwargs)
    return _per_block(_conv_transpose_block, x, problem.x_shape, x.dtype,
                      "numbaconv-conv_transpose", w, bias, kwargs)


def conv_backward_data(dy, w, input_shape, *, stride=1, padding=0, dilation=1, groups=1,
                       layout="channels_first", rechunk=False):
    """Data gradient of :func:`conv` on a batch-chunked dy (see
    :func:`numbaconv.conv_backward_data`).

    Parameters
    ----------
    dy : dask array, shape (N, K, *P) or (N, *P, K), chunked along N only
    w : NumPy array, shape (K, C // groups, *R)
    input_shape : tuple of int
        Shape of the whole batch's x, in ``layout``.
    rechunk : bool
        Merge chunks along axes other than the batch instead of raising ``ValueError``.

    Returns
    -------
    dx : dask array, shape input_shape
        Lazy, with dy's batch chunks.
    """
    w = _numpy("w", w)
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
                  layout=layout)
    dy = _batch_chunked("dy", dy, rechunk)
    problem = pb.conv_backward_data_problem(_meta(dy), w, input_shape, **kwargs)
    return _per_block(_dgrad_block, dy, problem.x_shape, dy.dtype,
                      "numbaconv-conv_backward_data", w, problem.x_shape, kwargs)


def conv_backward_weight(x, dy, weight_shape, *, stride=1, padding=0, dilation=1, groups=1,
                         layout="channels_first", out=None, accumulate=False, rechunk=False,
                         compute=True, scheduler=None, split_every=None):
    """Weight gradient of :func:`conv` summed over a batch-chunked batch (see
    :func:`numbaconv.conv_backward_weight`).

    Parameters
    ----------
    x : dask array, shape (N, C, *S) or (N, *S, C), chunked along N only
    dy : dask array, shape (N, K, *P) or (N, *P, K), with x's batch chunks
    weight_shape : tuple of int
        ``(K, C // groups, *R)``.
    out : NumPy array, shape weight_shape, optional
        Written (or, with ``accumulate=True``, added to) once the sum is computed; only with
        ``compute=True``.
    rechunk : bool
        Merge chunks along axes other than the batch, and rechunk dy to x's batch chunks,
        instead of raising ``ValueError``.
    compute : bool
        Compute now and return NumPy (default), or return a lazy dask array of one chunk.
    scheduler : str or distributed.Client, optional
        Passed to ``dask.compute``.
    split_every : int, optional
        Partial sums combined per node of the reduction tree (Dask's default if None).

    Returns
    -------
    dw : NumPy array (or dask array with ``compute=False``), shape weight_shape
    """
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
                  layout=layout)
    x = _batch_chunked("x", x, rechunk)
    dy = _batch_chunked("dy", dy, rechunk, like=x)
    _no_out_if_lazy(out, compute)
    problem = pb.conv_backward_weight_problem(_meta(x), _meta(dy), weight_shape, out=out,
                                              accumulate=accumulate, **kwargs)
    dw = _batch_sum(_wgrad_partial, (x, dy), problem.w_shape, x.dtype,
                    "numbaconv-conv_backward_weight", split_every, problem.w_shape, kwargs)
    return _finish((dw,), out, accumulate, compute, scheduler)[0]


def conv_backward_bias(dy, *, layout="channels_first", out=None, accumulate=False,
                       rechunk=False, compute=True, scheduler=None, split_every=None):
    """Bias gradient summed over a batch-chunked dy (see :func:`numbaconv.conv_backward_bias`).

    Parameters
    ----------
    dy : dask array, shape (N, K, *P) or (N, *P, K), chunked along N only
    out, accumulate, rechunk, compute, scheduler, split_every
        As for :func:`conv_backward_weight`.

    Returns
    -------
    db : NumPy array (or dask array with ``compute=False``), shape (K,)
    """
    dy = _batch_chunked("dy", dy, rechunk)
    _no_out_if_lazy(out, compute)
    problem = pb.conv_backward_bias_problem(_meta(dy), layout=layout, out=out,
                                            accumulate=accumulate)
    db = _batch_sum(_bgrad_partial, (dy,), (problem.channels,), dy.dtype,
                    "numbaconv-conv_backward_bias", split_every, problem.layout)
    return _finish((db,), out, accumulate, compute, scheduler)[0]


def conv_backward(dy, x, w, *, stride=1, padding=0, dilation=1, groups=1,
                  layout="channels_first", needs=(True, True, True), rechunk=False,
                  compute=True, scheduler=None, split_every=None):
    """All gradients of :func:`conv` on a batch-chunked batch (see
    :func:`numbaconv.conv_backward`).

    Parameters
    ----------
    dy : dask array, shape of y, with x's batch chunks
    x : dask array, shape (N, C, *S) or (N, *S, C), chunked along N only
    w : NumPy array, shape (K, C // groups, *R)
    needs : tuple of 3 bools
        Which of (dx, dw, db) to compute.
    rechunk, compute, scheduler, split_every
        As for :func:`conv_backward_weight`; dw and db are computed together, reading each
        block of x and dy once.

    Returns
    -------
    (dx, dw, db) : tuple
        dx a lazy dask array with x's batch chunks; dw and db NumPy arrays (dask arrays with
        ``compute=False``); None where ``needs`` says it is not needed.
    """
    needs = pb.check_needs(needs)
    w = _numpy("w", w)
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
                  layout=layout)
    x = _batch_chunked("x", x, rechunk)
    dy = _batch_chunked("dy", dy, rechunk, like=x)
    problem = pb.conv_problem(_meta(x), w, **kwargs)
    pb.check_gradient(_meta(dy), problem.y_shape, problem.device, problem.dtype,
                      "the shape of y")
    dx = dw = db = None
    if needs[0]:
        dx = _per_block(_dgrad_block, dy, problem.x_shape, dy.dtype,
                        "numbaconv-conv_backward_data", w, problem.x_shape, kwargs)
    if needs[1]:
        dw = _batch_sum(_wgrad_partial, (x, dy), problem.w_shape, x.dtype,
                        "numbaconv-conv_backward_weight", split_every, problem.w_shape,
                        kwargs)
    if needs[2]:
        db = _batch_sum(_bgrad_partial, (dy,), (problem.out_channels,), dy.dtype,
                        "numbaconv-conv_backward_bias", split_every, problem.layout)
    dw, db = _compute_present((dw, db), compute, scheduler)
    return dx, dw, db


def conv_transpose_backward(dy, x, w, *, stride=1, padding=0, output_padding=0, dilation=1,
                            groups=1, layout="channels_first", needs=(True, True, True),
                            rechunk=False, compute=True, scheduler=None, split_every=None):
    """All gradients of :func:`conv_transpose` on a batch-chunked batch (see
    :func:`numbaconv.conv_transpose_backward`).

    Parameters
    ----------
    dy : dask array, shape of the transposed convolution's output, with x's batch chunks
    x : dask array, shape (N, C_in, *S_in) or (N, *S_in, C_in), chunked along N only
    w : NumPy array, shape (C_in, C_out // groups, *R)
    needs, rechunk, compute, scheduler, split_every
        As for :func:`conv_backward`.

    Returns
    -------
    (dx, dw, db) : tuple
        dx (x's shape) a lazy dask array; dw (w's shape) and db ``(C_out,)`` NumPy arrays
        (dask arrays with ``compute=False``); None where not needed.
    """
    needs = pb.check_needs(needs)
    w = _numpy("w", w)
    kwargs = dict(stride=stride, padding=padding, output_padding=output_padding,
                  dilation=dilation, groups=groups, layout=layout)
    x = _batch_chunked("x", x, rechunk)
    dy = _batch_chunked("dy", dy, rechunk, like=x)
    problem = pb.conv_transpose_problem(_meta(x), w, **kwargs)
    pb.check_gradient(_meta(dy), problem.x_shape, problem.device, problem.dtype,
                      "the shape of conv_transpose's output")
    dx = dw = db = None
    if needs[0]:
        dx = _per_block(_transpose_dgrad_block, dy, x.shape, dy.dtype,
                        "numbaconv-conv_transpose_backward_data", x.shape, w, kwargs)
    if needs[1]:
        dw = _batch_sum(_transpose_wgrad_partial, (dy, x), w.shape, x.dtype,
                        "numbaconv-conv_transpose_backward_weight", split_every, w, kwargs)
    if needs[2]:
        db = _batch_sum(_bgrad_partial, (dy,), (problem.in_channels,), dy.dtype,
                        "numbaconv-conv_backward_bias", split_every, problem.layout)
    dw, db = _compute_present((dw, db), compute, scheduler)
    return dx, dw, db


def _compute_present(results, compute, scheduler):
    """Compute the non-None lazy results together; keep the Nones in place."""
    present = [r for r in results if r is not None]
    if not compute or not present:
        return results
    done = iter(dask.compute(*present, scheduler=scheduler))
    return tuple(None if r is None else next(done) for r in results)



# --- recurrent networks ------------------------------------------------------------------
# One task per batch block runs the ordinary numbaconv call on it. The training forward's
# per-block results (y, hy, cy and the reserve) are persisted, so that they stay where they
# were computed (on the worker, with a distributed client) and the backward functions reuse
# them instead of recomputing the forward; rnn_backward_data returns each block's reserve
# as part of its result (it overwrites the gates), which rnn_backward_weights then reads.

class RNNDaskReserve:
    """The per-block reserves of a batch-sharded training forward (persisted dask objects).

    Attributes
    ----------
    config : RNNConfig
    batch_chunks : tuple of int
        Sequences per block.
    blocks : list of dask.delayed
        One numbaconv reserve per block, in batch order.
    state : str
        ``"forward"`` after :func:`rnn_forward`, ``"backward_data"`` after
        :func:`rnn_backward_data` (as the reserve's own header says).
    """

    def __init__(self, config, batch_chunks, blocks):
        self.config, self.batch_chunks, self.blocks = config, tuple(batch_chunks), blocks
        self.state = "forward"


def _rnn_forward_block(config, x, params, hx, cx, lengths, seed):
    y, hy, cy, reserve = _nc.rnn_forward(config, x, params, hx, cx, seq_lengths=lengths,
                                         training=True, dropout_seed=seed)
    return y, hy, cy, reserve


def _rnn_inference_block(config, x, params, hx, cx, lengths):
    return _nc.rnn_forward(config, x, params, hx, cx, seq_lengths=lengths)[:3]


def _rnn_backward_data_block(config, y, dy, params, reserve, hx, cx, dhy, dcy, lengths):
    dx, dhx, dcx = _nc.rnn_backward_data(config, y, dy, params, reserve, hx=hx, cx=cx,
                                         dhy=dhy, dcy=dcy, seq_lengths=lengths)
    return dx, dhx, dcx, reserve


def _rnn_weights_partial(config, x, params, reserve, hx, lengths):
    return _nc.rnn_backward_weights(config, x, params, reserve, hx=hx,
                                    seq_lengths=lengths)[None]


def _rnn_batch_axis(config):
    return 0 if config.batch_first else 1


def _rnn_blocks(name, a, config, axis, chunks, rechunk):
    """The per-block pieces of a sequence (axis = batch axis) or state (axis 1) array:
    delayed blocks of a dask array, slices of a NumPy array, or Nones."""
    if a is None:
        return [None] * len(chunks)
    if isinstance(a, np.ndarray):
        bounds = np.cumsum((0,) + tuple(chunks))
        return [a[(slice(None),) * axis + (slice(lo, hi),)] for lo, hi in
                zip(bounds[:-1], bounds[1:])]
    if not isinstance(a, da.Array):
        raise TypeError(f"{name}: expected a dask or NumPy array, got {type(a).__name__}")
    split = [i for i in range(a.ndim) if i != axis and len(a.chunks[i]) > 1]
    if split or a.chunks[axis] != tuple(chunks):
        if not rechunk:
            raise ValueError(f"{name}: expected chunks along the batch axis (axis {axis}) "
                             f"only, equal to x's {tuple(chunks)}, got chunks {a.chunks}; "
                             f"pass rechunk=True")
        a = a.rechunk({i: (tuple(chunks) if i == axis else -1) for i in range(a.ndim)})
    return list(a.to_delayed().ravel())


def _rnn_x_chunks(config, x, rechunk):
    """x's batch chunks, after checking (or making) x chunked along the batch only."""
    axis = _rnn_batch_axis(config)
    if not isinstance(x, da.Array):
        raise TypeError(f"x: expected a dask array chunked along the batch axis, got "
                        f"{type(x).__name__}")
    if x.ndim != 3:
        raise ValueError(f"x: expected 3 dimensions, got shape {x.shape}")
    if any(math.isnan(c) for c in x.chunks[axis]):
        raise ValueError("x: expected known chunk sizes along the batch axis, got unknown "
                         "ones (call x.compute_chunk_sizes() first)")
    if any(len(x.chunks[i]) > 1 for i in range(3) if i != axis):
        if not rechunk:
            raise ValueError(f"x: expected chunks along the batch axis (axis {axis}) only, "
                             f"got chunks {x.chunks}; pass rechunk=True to merge the other "
                             f"axes into one chunk")
        x = x.rechunk({i: -1 for i in range(3) if i != axis})
    return x, x.chunks[axis]


def _sequence_from_blocks(blocks, index, config, chunks, shape_of, dtype, axis):
    pieces = [da.from_delayed(dask.delayed(operator.getitem)(b, index), shape_of(n), dtype)
              for b, n in zip(blocks, chunks)]
    return da.concatenate(pieces, axis=axis)


def _block_seeds(seed, count):
    """One dropout seed per block, derived from the user's: blocks get different masks (so
    with dropout the result is not the whole-batch call's, whose masks are drawn at once)."""
    if seed is None:
        return [None] * count
    return [int(s.generate_state(1)[0]) for s in np.random.SeedSequence(seed).spawn(count)]


def rnn_forward(config, x, params, hx=None, cx=None, *, seq_lengths=None, training=False,
                dropout_seed=None, rechunk=False, scheduler=None):
    """:func:`numbaconv.rnn_forward` on a dask x chunked along the batch axis.

    Parameters
    ----------
    config, params, hx, cx, seq_lengths, training, dropout_seed
        As in :func:`numbaconv.rnn_forward`; params is a NumPy array; hx and cx NumPy or
        dask arrays (split along axis 1 like x's batch); dropout masks are drawn per block
        from seeds derived from ``dropout_seed``.
    x : dask array, shape (T, N, input_size) (or (N, T, input_size) with batch_first)
    rechunk : bool
        Rechunk arrays split along other axes (or differently from x) instead of raising.
    scheduler : optional
        What persists the training forward (a name or a ``distributed.Client``).

    Returns
    -------
    y : dask array, one block per block of x
    hy, cy : dask arrays (cy None unless LSTM), chunked along axis 1 like x's batch
    reserve : RNNDaskReserve or None
        With training: the per-block reserves, persisted where they were computed.
    """
    params = _numpy("params", params)
    x, chunks = _rnn_x_chunks(config, x, rechunk)
    axis = _rnn_batch_axis(config)
    # The whole-batch call's validation, on zero-byte stand-ins: the same messages.
    pb.rnn_forward_problem(config, _meta(x), params, _meta(hx), _meta(cx),
                           seq_lengths=seq_lengths, training=training,
                           dropout_seed=dropout_seed)
    xs = list(x.to_delayed().ravel())
    hxs = _rnn_blocks("hx", hx, config, 1, chunks, rechunk)
    cxs = _rnn_blocks("cx", cx, config, 1, chunks, rechunk)
    lengths = _rnn_blocks("seq_lengths", None if seq_lengths is None else
                          np.asarray(seq_lengths), config, 0, chunks, rechunk)
    if training:
        tasks = [dask.delayed(_rnn_forward_block, pure=False)(config, xb, params, h, c, n, s)
                 for xb, h, c, n, s in zip(xs, hxs, cxs, lengths,
                                           _block_seeds(dropout_seed, len(xs)))]
        tasks = list(dask.persist(*tasks, scheduler=scheduler))
    else:
        tasks = [dask.delayed(_rnn_inference_block)(config, xb, params, h, c, n)
                 for xb, h, c, n in zip(xs, hxs, cxs, lengths)]
    t_len = x.shape[1 - axis]
    d_out = config.num_directions * config.out_size
    states = config.num_layers * config.num_directions
    y = _sequence_from_blocks(tasks, 0, config, chunks,
                              lambda n: (n, t_len, d_out) if axis == 0 else (t_len, n, d_out),
                              x.dtype, axis)
    hy = _sequence_from_blocks(tasks, 1, config, chunks,
                               lambda n: (states, n, config.out_size), x.dtype, 1)
    cy = None if config.mode != "lstm" else _sequence_from_blocks(
        tasks, 2, config, chunks, lambda n: (states, n, config.hidden_size), x.dtype, 1)
    reserve = None
    if training:
        reserve = RNNDaskReserve(config, chunks, [dask.delayed(operator.getitem)(t, 3)
                                                  for t in tasks])
    return y, hy, cy, reserve


def _check_dask_reserve(reserve, config, state):
    if not isinstance(reserve, RNNDaskReserve):
        raise TypeError(f"reserve: expected the RNNDaskReserve of numbaconv.dask.rnn_forward"
                        f"(..., training=True), got {type(reserve).__name__}")
    if reserve.config != config:
        raise ValueError("reserve: filled by a training forward of another config")
    if reserve.state != state:
        raise ValueError("reserve: rnn_backward_data already ran on this reserve" if
                         state == "forward" else "reserve: expected rnn_backward_data to "
                         "have run on this reserve first")


def rnn_backward_data(config, y, dy, params, reserve, *, hx=None, cx=None, dhy=None,
                      dcy=None, seq_lengths=None, rechunk=False, scheduler=None):
    """:func:`numbaconv.rnn_backward_data` per batch block, on the reserve of
    :func:`rnn_forward`; returns ``(dx, dhx, dcx)`` as dask arrays (dx one block per block
    of dy). Each block's reserve (now holding the gate gradients) is persisted for
    :func:`rnn_backward_weights`."""
    params = _numpy("params", params)
    _check_dask_reserve(reserve, config, "forward")
    chunks, axis = reserve.batch_chunks, _rnn_batch_axis(config)
    ys = _rnn_blocks("y", y, config, axis, chunks, rechunk)
    dys = _rnn_blocks("dy", dy, config, axis, chunks, rechunk)
    pieces = [_rnn_blocks(name, a, config, 1, chunks, rechunk)
              for name, a in (("hx", hx), ("cx", cx), ("dhy", dhy), ("dcy", dcy))]
    lengths = _rnn_blocks("seq_lengths", None if seq_lengths is None else
                          np.asarray(seq_lengths), config, 0, chunks, rechunk)
    tasks = [dask.delayed(_rnn_backward_data_block, pure=False)(config, yb, dyb, params, r,
                                                                *states, n)
             for yb, dyb, r, n, *states in zip(ys, dys, reserve.blocks, lengths, *pieces)]
    tasks = list(dask.persist(*tasks, scheduler=scheduler))
    reserve.blocks = [dask.delayed(operator.getitem)(t, 3) for t in tasks]
    reserve.state = "backward_data"
    shape = dy.shape
    dtype = dy.dtype
    t_len = shape[1 - axis]
    states = config.num_layers * config.num_directions
    dx = _sequence_from_blocks(
        tasks, 0, config, chunks,
        lambda n: (n, t_len, config.input_size) if axis == 0 else (t_len, n, config.input_size),
        dtype, axis)
    dhx = _sequence_from_blocks(tasks, 1, config, chunks,
                                lambda n: (states, n, config.out_size), dtype, 1)
    dcx = None if config.mode != "lstm" else _sequence_from_blocks(
        tasks, 2, config, chunks, lambda n: (states, n, config.hidden_size), dtype, 1)
    return dx, dhx, dcx


def rnn_backward_weights(config, x, params, reserve, *, hx=None, seq_lengths=None,
                         out=None, accumulate=False, compute=True, scheduler=None,
                         split_every=None, rechunk=False):
    """:func:`numbaconv.rnn_backward_weights` as per-block partial gradients, tree-summed:
    a NumPy array (or, with ``compute=False``, a dask array of one chunk)."""
    params = _numpy("params", params)
    _no_out_if_lazy(out, compute)
    _check_dask_reserve(reserve, config, "backward_data")
    chunks, axis = reserve.batch_chunks, _rnn_batch_axis(config)
    xs = _rnn_blocks("x", x, config, axis, chunks, rechunk)
    hxs = _rnn_blocks("hx", hx, config, 1, chunks, rechunk)
    lengths = _rnn_blocks("seq_lengths", None if seq_lengths is None else
                          np.asarray(seq_lengths), config, 0, chunks, rechunk)
    dtype = params.dtype
    partials = [da.from_delayed(dask.delayed(_rnn_weights_partial)(config, xb, params, r, h,
                                                                    n),
                                (1, config.num_params), dtype)
                for xb, r, h, n in zip(xs, reserve.blocks, hxs, lengths)]
    total = da.concatenate(partials, axis=0).sum(axis=0, dtype=dtype,
                                                 split_every=split_every)
    return _finish((total,), out, accumulate, compute, scheduler)[0]
