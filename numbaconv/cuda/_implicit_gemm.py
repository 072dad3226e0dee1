"""The ``implicit_gemm`` algorithm of the cuda backend: register-tiled implicit GEMMs.

Every convolution op that is a matrix product runs one of two kernels here:

``conv_gemm`` (forward, data gradient, transposed convolution)
    ``out[n, g*M + m, pos] = sum over (tap, r) of A[g, tap, r, m] * src[n, g*R + r, at(pos,
    tap)]``. Forward: m = output channel, r = input channel, ``at = pos*stride - before +
    tap*dilation``. Data gradient and transposed convolution: m = input channel, r = output
    channel, and the input positions are split into **stride phases** (positions whose
    ``i + before`` has one residue per dimension): in a phase only the taps that land on a
    multiple of the stride take part, so no multiply-add meets a zero of the dilated dy. A
    phase is a plain convolution with stride 1 over the phase's positions; the phases run
    in one launch (grid z). The weights are first packed once per call into ``A[g, tap, r,
    m]`` (r padded to the step, m fastest), so the main loop reads A at a pointer advanced
    by a constant.
``weight_gemm`` (weight gradient)
    ``dw[g*Kg + m, c, tap] = sum over j = (image, output position) of dy[j, m] * x[j, c at
    tap]``, the j range cut in chunks fixed by the shape (never by the device), each chunk
    writing its own partial, which ``sum_chunks`` adds in chunk order: deterministic, no
    atomics.

Both are tiled CUTLASS-style: a block computes a ``BM x BN`` tile, each thread a ``TM x
TN`` register tile (split in two halves of rows and of columns so that neighbouring threads
read neighbouring shared words), the reduction advances ``BK`` at a time through two
shared-memory buffers (the next step's global loads are issued before the current step's
multiply-adds). Gathers use offsets computed once per thread and per tap and advanced by
constants: the main loop has no division, and the few outside it are unsigned 32-bit.
With ``NUMBACONV_CUDA_TF32=1`` (float32, compute capability 8.0 or more) each warp multiplies
its part of the block tile by ``mma.sync`` m16n8k8 TF32 products instead
(:mod:`._mma`; the operands rounded to TF32 as they enter shared memory), on the same tiles,
gathers and epilogue; its results are as deterministic.
Indices are 32-bit when every operand spans fewer than about 2**31 elements (``wide=False``),
else 64-bit. Operands are passed as device pointers with element strides (:func:`operand`;
flat 1D arrays under the simulator), so any non-negative strides work and channels-first
and channels-last differ only in which threads load which elements (channels-last: a warp
reads consecutive channels). docs/cuda.md gives the machine code and the measurements.

This module chooses tiles, builds the operands and launches; the kernel templates are in
:mod:`._implicit_gemm_kernels`, expanded by :mod:`._templates`.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import threading
from typing import NamedTuple

import numpy as np
from numba import cuda  # the simulator swaps this module global for its fake module

from .._geometry import stride_phases
from ..config import cuda_gemm_tile, cuda_tf32
from ._implicit_gemm_kernels import (TILES, TILES64, Tile, conv_gemm_function, copy5_function,
                                     mma_tile, pack_weights_function, sum_chunks_function,
                                     weight_gemm_function)
from ._launch import launch
from ._layout import activation5, as_device, device_array, geom, simulated, view5, weight5

#: Largest element offset the 32-bit kernels handle (below 2**31 with room for the padding
#: reads whose offsets are formed before their bounds check).
INDEX32_LIMIT = 2 ** 31 - 2 ** 24
#: Blocks that fill a 132-SM GPU at two blocks per SM: tiles giving fewer score lower.
FULL_GRID = 264
#: The GPU the weight gradient's split is sized for (H100 SXM / H200: 132 SMs, each holding
#: 512 threads of the GEMMs' 128 registers); fixed, so the split (and the bits of dw) never
#: depend on the device that runs it.
SPLIT_SMS = 132
SPLIT_THREADS_PER_SM = 512
#: What writing and reading back one partial element costs, in reduction steps of a full
#: wave of blocks (8 bytes at about 3 TB/s against a wave-step of 69 MFLOP at about 30
#: TFLOP/s): trades partial traffic against wave quantization (docs/cuda.md, "Weight
#: gradient split-K").
PARTIAL_ELEMENT_COST = 1.2e-6
#: Waves of blocks the split considers at most (beyond, a wave's quantization is small).
SPLIT_MAX_WAVES = 64
#: Largest weight-gradient partial buffer, in accumulator elements (64 MiB of float32).
MAX_PARTIAL_ELEMENTS = 1 << 24


def forced_tile():
    """The tile NUMBACONV_CUDA_GEMM_TILE forces (tests use tiny ones), or None."""
    values = cuda_gemm_tile()
    return None if values is None else Tile(*values).check()


def choose_tile(rows: int, cols: int, blocks_per_tile: int, dtype: str) -> Tile:
    """The largest tile that wastes little of ``rows x cols`` and still gives about two
    blocks per SM of a 132-SM GPU (fewer, larger tiles read less per multiply-add)."""
    forced = forced_tile()
    if forced is not None:
        return forced
    tiles = TILES64 if dtype == "float64" else TILES

    def score(t):
        used = rows * cols / (_ceil(rows, t.bm) * t.bm * _ceil(cols, t.bn) * t.bn)
        blocks = _ceil(rows, t.bm) * _ceil(cols, t.bn) * blocks_per_tile
        fill = min(1.0, blocks / FULL_GRID)
        return used * fill * (1.0 + 0.25 * (t.bm * t.bn) / (128 * 128))
    return max(tiles, key=score)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def tensor_cores(dtype: str, tile: Tile) -> bool:
    """Whether a float32 GEMM of ``tile`` multiplies on TF32 tensor cores: asked for
    (``NUMBACONV_CUDA_TF32=1``), a tile the warps' m16n8k8 products cover, and a device of
    compute capability 8.0 or more (any under the simulator)."""
    return dtype == "float32" and cuda_tf32() and mma_tile(tile) and _has_mma(_device_id())


@functools.lru_cache(maxsize=None)
def _has_mma(device: int) -> bool:
    if simulated():
        return True
    from ._mma import MIN_COMPUTE_CAPABILITY
    return tuple(cuda.get_current_device().compute_capability) >= MIN_COMPUTE_CAPABILITY


_FUNCTIONS = {"conv_gemm": conv_gemm_function, "weight_gemm": weight_gemm_function,
              "pack_weights": pack_weights_function, "sum_chunks": sum_chunks_function}


@functools.lru_cache(maxsize=None)
def kernel(name: str, *key):
    """The kernel ``name`` built from ``key`` (see :func:`jit_kernel`)."""
    tile = {"conv_gemm": 4, "weight_gemm": 3}.get(name)
    return jit_kernel(_FUNCTIONS[name](*key), _launch_types(name, key),
                      None if tile is None else key[tile])


def jit_kernel(function, types: tuple, tile: Tile = None):
    """``function`` as a kernel. On a GPU it is compiled at once for ``types`` (device
    pointers and int64 scalars: what every launch passes), which keeps Numba's per-launch
    typing and array wrapping off the hot path, and kept in Numba's disk cache where its
    source is a file; a tiled GEMM gets launch bounds of two blocks per SM (at most 128
    registers at 256 threads). Under the simulator it takes arrays."""
    if simulated():
        return cuda.jit(function)
    options = dict(cache=not function.__code__.co_filename.startswith("<"))
    if tile is not None:
        options["launch_bounds"] = (tile.threads, 2)
    return cuda.jit(types, **options)(function)


@functools.lru_cache(maxsize=None)
def _copy5_kernel(dtype: str):
    return cuda.jit(copy5_function(dtype))


# --- operands ---------------------------------------------------------------------------------

class Operand(NamedTuple):
    """A device array as the kernels take it: ``ref`` (the device pointer on a GPU, a flat
    1D view under the simulator), element strides in the kernels' order (activations
    ``(N, C, S0, S1, S2)``, weights ``(K, C, R0, R1, R2)``, missing spatial dimensions
    with stride 0) and the elements reached from the first one."""
    ref: object
    strides: tuple
    span: int


def operand(a, channels_last=None, g=None) -> Operand:
    """``a`` (any ``__cuda_array_interface__`` object) for the kernels; ``channels_last``
    None for weights and biases (kept in their own order). An operand with a negative stride
    is first copied (contiguous), which needs the problem's geometry ``g``."""
    shape, strides, itemsize = _raw(a)
    arranged = _arranged(shape, strides, itemsize, channels_last)
    if arranged is None:  # a negative stride
        a = _copy5(_five(a, g, channels_last))
        shape, strides, itemsize = _raw(a)
        arranged = _arranged(shape, strides, itemsize, channels_last)
    return _operand(a, arranged, itemsize)


def _operand(a, arranged, itemsize) -> Operand:
    kernel_strides, span = arranged
    if simulated():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        view = np.lib.stride_tricks.as_strided(as_device(a)._ary, (span,), (itemsize,))
        return Operand(FakeCUDAArray(view), kernel_strides, span)
    return Operand(_pointer(a), kernel_strides, span)


def _raw(a):
    """Shape, byte strides (None: C-contiguous) and item size of a device array (numba's,
    or any ``__cuda_array_interface__`` object), read without wrapping it."""
    if getattr(a, "__cuda_ndarray__", False) or simulated():
        a = as_device(a)
        return tuple(a.shape), tuple(a.strides), a.dtype.itemsize
    face = a.__cuda_array_interface__
    strides = face.get("strides")
    return (tuple(face["shape"]), None if strides is None else tuple(strides),
            np.dtype(face["typestr"]).itemsize)


@functools.lru_cache(maxsize=4096)
def _element_strides(shape: tuple, strides, itemsize: int) -> tuple:
    """Byte strides (None: C-contiguous) as element strides."""
    if strides is None:
        found, step = [], 1
        for n in reversed(shape):
            found.append(step)
            step *= n
        return tuple(reversed(found))
    return tuple(int(st) // itemsize for st in strides)


@functools.lru_cache(maxsize=4096)
def _arranged(shape: tuple, strides, itemsize: int, channels_last):
    """An operand's element strides in the kernels' order (five of them) and the elements
    it spans, or None where a stride is negative (remembered: the same few arrangements
    recur call after call)."""
    strides = _element_strides(shape, strides, itemsize)
    if any(st < 0 for st in strides):
        return None
    if channels_last:
        shape = (shape[0], shape[-1]) + tuple(shape[1:-1])
        strides = (strides[0], strides[-1]) + tuple(strides[1:-1])
    pad = 5 - len(shape)
    shape = shape[:2] + (1,) * pad + tuple(shape[2:])
    strides = strides[:2] + (0,) * pad + tuple(strides[2:])
    span = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    return strides, span


def _shape_strides(a):
    """Shape, element strides and item size of a device array."""
    shape, strides, itemsize = _raw(a)
    return shape, _element_strides(shape, strides, itemsize), itemsize


def _pointer(a) -> int:
    """The device pointer of ``a``'s first element; a producer's own stream (the interface's
    ``stream``, other than the legacy and per-thread default streams) is synchronised
    first, as the protocol asks of consumers."""
    if getattr(a, "__cuda_ndarray__", False):
        return a.device_ctypes_pointer.value or 0
    face = a.__cuda_array_interface__
    stream = face.get("stream")
    if stream not in (None, 1, 2):
        cuda.external_stream(stream).synchronize()
    return face["data"][0] or 0


def _ref(devary):
    """A device array of ours (workspace, table) as a kernel argument."""
    return devary if simulated() else (devary.device_ctypes_pointer.value or 0)


def _writable(result, shape, g, channels_last, accumulate):
    """Where a kernel writes ``result``: itself, or (negative strides) a contiguous stand-in
    holding its values when accumulating; and that target as an operand."""
    raw_shape, strides, itemsize = _raw(result)
    arranged = _arranged(raw_shape, strides, itemsize, channels_last)
    if arranged is not None:
        return result, _operand(result, arranged, itemsize)
    target = device_array(shape, result.dtype)
    if accumulate:
        _copy5(_five(result, g, channels_last), into=_five(target, g, channels_last))
    return target, operand(target, channels_last)


def _written(target, result, g, channels_last) -> None:
    """Copy a stand-in target back into ``result``."""
    if target is not result:
        _copy5(_five(target, g, channels_last), into=_five(result, g, channels_last))


def _five(a, g, channels_last):
    return weight5(a) if channels_last is None else activation5(g, a)


def _copy5(src, into=None):
    """A contiguous copy of the 5D device array ``src`` (or ``src`` copied into ``into``)."""
    dst = into if into is not None else device_array(src.shape, src.dtype)
    count = math.prod(dst.shape)
    if count:
        _copy5_kernel(str(src.dtype))[_ceil(count, 256), 256](src, dst)
    return dst


# --- drivers ---------------------------------------------------------------------------------

#: Launch setups kept per builder: what a call's launches take that depends only on the
#: problem, the device and the settings read (kernels, grids, tables, sizes), worked out
#: by the first call of a problem; later calls add their operands' pointers and strides
#: (a call spent most of its host time recomputing these).
MAX_SETUPS = 1024
_SETUP_CACHES: list = []


def remembered_setup(build):
    """``build(*key)`` remembered per key (the key holds what the setup depends on: the
    problem, the device, the settings it reads), up to :data:`MAX_SETUPS` of them."""
    setup = functools.lru_cache(maxsize=MAX_SETUPS)(build)
    _SETUP_CACHES.append(setup)
    return setup


def forget_setups() -> None:
    """Drop every remembered setup and tile choice: for tests that change a choice's inputs
    (forced tiles, the TF32 setting, the split functions) within one process."""
    for setup in _SETUP_CACHES:
        setup.cache_clear()
    _conv_tile.cache_clear()
    _weight_tile.cache_clear()


class _ConvSetup:
    """A forward or data-gradient launch pair of one problem on one device (see
    :func:`convolution`): ``pack_weights`` with its grid and arguments after the two
    pointers and before the weights' strides, and ``conv_gemm``'s grid, threads and the
    arguments between and after the operands' strides; its 32- and 64-bit kernels with
    their tables built when first needed. ``tf32``: NUMBACONV_CUDA_TF32 as read by the call;
    ``device``: the current device's id (its tables and compute capability are used)."""

    def __init__(self, problem, forward: bool, tf32: bool, device: int):
        g = self.g = geom(problem)
        dtype = problem.dtype
        rows, reduce = (g.kg, g.cg) if forward else (g.cg, g.kg)
        plan = self.plan = _conv_plan(g, forward)
        tile, most_cols = _conv_tile(problem, forward, tf32)
        rp = _ceil(reduce, tile.bk) * tile.bk
        tc = tf32 and tensor_cores(dtype, tile)
        self.packed = count = g.groups * plan.taps * rp * rows
        self.acc = _acc(dtype)
        self.pack = kernel("pack_weights", dtype, tc)
        self.pack_grid = _ceil(count, 256)
        wtaps = _device_table(plan.wtaps, np.int64)
        self.pack_args = (wtaps[1], count, plan.taps, rows, reduce, rp, g.kg, forward)
        self.gemm_key = (dtype, problem.channels_last, problem.ndim, tile,
                         bool(problem.accumulate), tc)
        self.grid = (_ceil(most_cols, tile.bn), _ceil(rows, tile.bm),
                     g.groups * len(plan.phases))
        self.threads = tile.threads
        self.sizes = (len(plan.phases), g.n, rows, reduce, rp, plan.taps)
        self.columns = plan.src_size + plan.col_stride + plan.col_offset
        self.keep = [wtaps]          # the tables' device arrays, alive while we are
        self.by_width = {}  # {(wide, has_bias): (kernel, tables)}

    def gemm(self, wide: bool, has_bias: bool) -> tuple:
        """``conv_gemm`` with ``wide`` (64-bit) indices and a bias or not, and its two table
        arguments."""
        found = self.by_width.get((wide, has_bias))
        if found is None:
            dtype, cl, nd, tile, accumulate, tc = self.gemm_key
            index = np.int64 if wide else np.int32
            deltas = _device_table(self.plan.deltas, index)
            phases = _device_table(self.plan.phases, index)
            self.keep += [deltas, phases]
            found = self.by_width[(wide, has_bias)] = (
                kernel("conv_gemm", dtype, cl, nd, wide, tile, has_bias, accumulate, tc),
                (deltas[1], phases[1]))
        return found


_conv_setup = remembered_setup(_ConvSetup)


def convolution(mode: str, problem, src, w, bias, out, result_shape):
    """``out = [out +] conv(src, w) [+ bias]``: ``mode`` "forward" (conv) or "data" (data
    gradient, transposed convolution)."""
    dtype = problem.dtype
    result = out if out is not None else device_array(result_shape, dtype)
    if math.prod(result_shape) == 0:
        return result
    device = _device_id()
    at = _conv_setup(problem, mode == "forward", cuda_tf32(), device)
    g, cl = at.g, problem.channels_last
    s = operand(src, cl, g)
    target, o = _writable(result, result_shape, g, cl, problem.accumulate)
    wo = operand(w, None, g)
    wp = _ref(workspace("weights", at.packed, at.acc, device))
    launch(at.pack, at.pack_grid, 256, wo.ref, wp, *at.pack_args, *wo.strides)
    run, tables = at.gemm(max(s.span, o.span, at.packed) > INDEX32_LIMIT, bias is not None)
    launch(run, at.grid, at.threads, s.ref, wp, o.ref, bias_operand(bias, dtype), *tables,
           *at.sizes, *s.strides, *at.columns, *o.strides, *at.plan.out_step)
    _written(target, result, g, cl)
    return result


class _WeightSetup:
    """The weight gradient's launches of one problem on one device (see
    :func:`weight_gradient`): ``weight_gemm``'s grid, split and arguments after the
    pointers and between the operands' strides, ``sum_chunks``' likewise (``tf32`` and
    ``device`` as for :class:`_ConvSetup`)."""

    def __init__(self, problem, tf32: bool, device: int):
        g = self.g = geom(problem)
        dtype = problem.dtype
        cols = g.taps * g.cg
        reduce_total = g.n * g.positions
        tile = _weight_tile(problem)
        row_tiles = _ceil(g.kg, tile.bm)
        base = _ceil(cols, tile.bn) * row_tiles * g.groups
        steps = _ceil(reduce_total, tile.bk)
        chunks = weight_chunks(base, steps, g.k * cols, tile.threads)
        chunk_len = _ceil(steps, chunks) * tile.bk
        chunks = self.chunks = max(1, _ceil(reduce_total, chunk_len))
        self.count = count = g.k * cols
        self.acc = _acc(dtype)
        self.gemm_key = (dtype, problem.ndim, tile, tf32 and tensor_cores(dtype, tile))
        self.grid = (_ceil(cols, tile.bn), row_tiles * g.groups, chunks)
        self.threads = tile.threads
        self.sizes = (g.n, g.groups, g.kg, g.cg, cols, row_tiles, chunk_len)
        self.middle = g.s
        self.after = (*g.p, g.r[1], g.r[2], *g.stride, *g.dilation, *g.before)
        self.sum = kernel("sum_chunks", dtype)
        self.sum_grid = _ceil(count, 256)
        self.sum_args = (count, chunks, g.cg, g.taps, g.r[1], g.r[2], bool(problem.accumulate))

    def gemm(self, wide: bool):
        dtype, nd, tile, tc = self.gemm_key
        return kernel("weight_gemm", dtype, nd, wide, tile, tc)


_weight_setup = remembered_setup(_WeightSetup)


def weight_gradient(problem, x, dy, out):
    """``dw = [dw +] sum over images and positions of dy x``, split in chunks fixed by the
    shape, the partials added in chunk order."""
    result = out if out is not None else device_array(problem.w_shape, problem.dtype)
    if math.prod(problem.w_shape) == 0:
        return result
    device = _device_id()
    at = _weight_setup(problem, cuda_tf32(), device)
    g, cl = at.g, problem.channels_last
    xo = operand(x, cl, g)
    yo = operand(dy, cl, g)
    target, wo = _writable(result, problem.w_shape, g, None, problem.accumulate)
    partial = _ref(workspace("partials", at.chunks * at.count, at.acc, device))
    wide = max(xo.span, yo.span, at.chunks * at.count) > INDEX32_LIMIT
    launch(at.gemm(wide), at.grid, at.threads, xo.ref, yo.ref, partial, *at.sizes,
           *xo.strides, *at.middle, *yo.strides, *at.after)
    launch(at.sum, at.sum_grid, 256, partial, wo.ref, *at.sum_args, *wo.strides)
    _written(target, result, g, None)
    return result


#: Rows a lane sums at least per chunk in the per-channel reductions (fewer chunks, less
#: partial traffic, for small operands).
MIN_ROWS_PER_LANE = 4


def row_chunks(rows: int, channel_blocks: int, lanes: int, target_blocks: int) -> tuple:
    """``(chunks, chunk_len)`` of a per-channel reduction over ``rows`` rows (the depthwise
    weight gradient's, the bias gradient's) by ``channel_blocks`` blocks of ``lanes`` row
    lanes: about ``target_blocks`` blocks in all, each lane summing at least
    :data:`MIN_ROWS_PER_LANE` rows, at most 65,535 chunks (the grid's y limit). Depends on
    the shape only."""
    chunks = max(1, min(-(-target_blocks // channel_blocks),
                        -(-rows // (lanes * MIN_ROWS_PER_LANE)), 65535))
    chunk_len = max(1, -(-rows // chunks))
    return max(1, -(-rows // chunk_len)), chunk_len


@functools.lru_cache(maxsize=1024)
def weight_chunks(tiles: int, steps: int, partial_elements: int, threads: int) -> int:
    """How many chunks the weight gradient cuts its reduction of ``steps`` steps into, for
    ``tiles`` output tiles of ``threads`` threads and ``partial_elements`` elements of dw
    (one partial each a chunk): the count the model puts fastest.

    Model (docs/cuda.md, "Weight gradient split-K"): the GPU holds ``slots`` blocks at once
    (132 SMs of 512 threads); a block's step takes the same time in every full or partial
    wave, so ``chunks`` chunks cost ``ceil(tiles * chunks / slots) * ceil(steps / chunks)``
    wave-steps, plus the partials' traffic, ``chunks * partial_elements *
    PARTIAL_ELEMENT_COST``. For each wave count the most chunks that fit that many waves are
    tried (then as few chunks as give the same chunk length); the cheapest wins, ties to
    fewer waves. Depends on the shape only.
    """
    slots = SPLIT_SMS * max(1, SPLIT_THREADS_PER_SM // threads)
    steps = max(1, steps)
    most = max(1, min(steps, 65535, MAX_PARTIAL_ELEMENTS // max(1, partial_elements)))
    best = None
    for waves in range(_ceil(tiles, slots), _ceil(tiles, slots) + SPLIT_MAX_WAVES):
        chunks = min(most, waves * slots // tiles)
        if chunks < 1:
            continue
        length = _ceil(steps, chunks)
        chunks = _ceil(steps, length)
        cost = (_ceil(tiles * chunks, slots) * length
                + chunks * partial_elements * PARTIAL_ELEMENT_COST)
        if best is None or cost < best[0]:
            best = (cost, chunks)
        if chunks >= most:
            break
    return best[1] if best is not None else 1


@functools.lru_cache(maxsize=1024)
def _conv_tile(problem, forward: bool, tf32: bool = False):
    """The tile of a forward or data-gradient launch, and its most columns of a phase;
    ``tf32``: NUMBACONV_CUDA_TF32 as read by the call (a tensor-core tile may step
    deeper: :func:`tensor_core_tile`)."""
    g = geom(problem)
    plan = _conv_plan(g, forward)
    rows = g.kg if forward else g.cg
    most_cols = max(g.n * math.prod(ph[:3]) for ph in plan.phases)
    tile = choose_tile(rows, most_cols, g.groups * len(plan.phases), problem.dtype)
    if tf32 and forced_tile() is None and tensor_cores(problem.dtype, tile):
        tile = tensor_core_tile(tile)
    return tile, most_cols


#: Tensor-core tiles whose forward and data-gradient step is 16 deep: half the barriers and
#: step overhead a HMMA in the same 128 registers. The weight gradient would spill there;
#: the smaller tiles would hold more registers, so fewer blocks an SM (docs/cuda.md, "TF32
#: tensor cores", has the machine code).
DEEP_TENSOR_CORE_TILES = {TILES[0]: TILES[0]._replace(bk=16)}


def tensor_core_tile(tile: Tile) -> Tile:
    """The tile a tensor-core ``conv_gemm`` runs in place of the FFMA kernels' ``tile``."""
    return DEEP_TENSOR_CORE_TILES.get(tile, tile)


@functools.lru_cache(maxsize=1024)
def _weight_tile(problem) -> Tile:
    """The weight gradient's tile: chunks of the reduction give the blocks, so only waste
    and size count."""
    g = geom(problem)
    return choose_tile(g.kg, g.taps * g.cg, FULL_GRID, problem.dtype)


def kernel_keys(problem) -> list:
    """The ``kernel(name, *key)`` calls that ``problem`` (a convolution op run by this
    algorithm) launches with 32-bit indices: what :func:`precompile` compiles ahead."""
    dtype, op = problem.dtype, problem.op
    if op == "conv_backward_weight":
        tile = _weight_tile(problem)
        return [("weight_gemm", (dtype, problem.ndim, False, tile, tensor_cores(dtype, tile))),
                ("sum_chunks", (dtype,))]
    if op == "conv_backward_bias":
        return []
    forward = op == "conv"
    tile, _ = _conv_tile(problem, forward, cuda_tf32())
    tc = tensor_cores(dtype, tile)
    return [("pack_weights", (dtype, tc)),
            ("conv_gemm", (dtype, problem.channels_last, problem.ndim, False, tile,
                           bool(problem.has_bias), bool(problem.accumulate), tc))]


def precompile(problems, processes: int = 0) -> list:
    """Compile (into Numba's disk cache) every GEMM kernel that ``problems`` (run by this
    algorithm) launch, in up to ``processes`` Python processes at once (0: one per CPU, at
    most 16). Returns the keys; later processes load each kernel from the cache.
    :meth:`numbaconv.cuda.CudaBackend.precompile` picks the problems."""
    keys = sorted({key for p in problems for key in kernel_keys(p)}, key=repr)
    workers = processes or min(16, os.cpu_count() or 1)
    if workers <= 1 or len(keys) <= 1 or simulated():
        for name, key in keys:
            kernel(name, *key)
        return keys
    import subprocess
    import sys
    code = ("import sys; from numbaconv.cuda._implicit_gemm import Tile, kernel; "
            "[kernel(name, *key) for name, key in eval(sys.argv[1])]")
    batches = [keys[i::workers] for i in range(workers)]
    running = [subprocess.Popen([sys.executable, "-c", code, repr(batch)])
               for batch in batches if batch]
    failed = [p.args for p in running if p.wait() != 0]
    if failed:
        raise RuntimeError(f"precompile: {len(failed)} worker(s) failed")
    return keys


def pointer_types(dtype: str) -> tuple:
    """Numba types of a pointer to ``dtype`` elements and to their accumulators."""
    from numba import types
    elem = {"float16": types.float16, "float32": types.float32,
            "float64": types.float64}[dtype]
    acc = types.float64 if dtype == "float64" else types.float32
    return types.CPointer(elem), types.CPointer(acc)


def _launch_types(name: str, key: tuple) -> tuple:
    """The argument types of a launch: device pointers and int64 scalars (a boolean where
    the kernel takes a flag)."""
    from numba import types
    data, accs = pointer_types(key[0])
    i, flag = types.int64, types.boolean
    if name == "conv_gemm":
        table = types.CPointer(types.int64 if key[3] else types.int32)
        return (data, accs, data, data, table, table) + (i,) * 28
    if name == "weight_gemm":
        return (data, data, accs) + (i,) * 34
    if name == "pack_weights":
        return (data, accs, types.CPointer(types.int64)) + (i,) * 6 + (flag,) + (i,) * 5
    if name == "sum_chunks":
        return (accs, data) + (i,) * 6 + (flag,) + (i,) * 5
    raise ValueError(f"name: no launch types for {name!r}")


class ConvPlan(NamedTuple):
    """Tables and column geometry of one forward or data-gradient launch."""
    phases: tuple       # (J0, J1, J2, first0, first1, first2, tap start, tap count) each
    deltas: tuple       # (d0, d1, d2) per tap, phases after one another
    wtaps: tuple        # the weight tap (t0, t1, t2) of each
    taps: int
    src_size: tuple     # bounds of the gathered operand
    col_stride: tuple
    col_offset: tuple
    out_step: tuple


@functools.lru_cache(maxsize=256)
def _conv_plan(g, forward: bool) -> ConvPlan:
    if forward:
        per_dim = [[(0, g.p[d], tuple((t, t * g.dilation[d]) for t in range(g.r[d])))]
                   for d in range(3)]
        col_stride, col_offset = g.stride, tuple(-b for b in g.before)
        src_size, out_step = g.s, (1, 1, 1)
    else:
        per_dim = [stride_phases(g.s[d], g.p[d], g.r[d], g.stride[d], g.dilation[d],
                                 g.before[d]) for d in range(3)]
        col_stride, col_offset = (1, 1, 1), (0, 0, 0)
        src_size, out_step = g.p, g.stride
    phases, deltas, wtaps = [], [], []
    for a, b, c in itertools.product(*per_dim):
        start = len(deltas)
        for (t0, d0), (t1, d1), (t2, d2) in itertools.product(a[2], b[2], c[2]):
            deltas.append((d0, d1, d2))
            wtaps.append((t0, t1, t2))
        phases.append((a[1], b[1], c[1], a[0], b[0], c[0], start, len(deltas) - start))
    if not deltas:                      # every phase without taps: dx is zero (or bias)
        deltas.append((0, 0, 0))
        wtaps.append((0, 0, 0))
    return ConvPlan(tuple(phases), tuple(deltas), tuple(wtaps), len(deltas), tuple(src_size),
                    tuple(col_stride), tuple(col_offset), tuple(out_step))


def _acc(dtype: str) -> np.dtype:
    return np.dtype(np.float64 if dtype == "float64" else np.float32)


_TABLES: dict = {}


def _device_table(rows: tuple, dtype) -> tuple:
    """``rows`` flattened into a device array of ``dtype`` (copied to the current device
    once per ``rows``), and that array as a kernel argument: ``(array, argument)``. Whoever
    keeps the argument keeps the array."""
    key = (rows, np.dtype(dtype).str, _device_id())
    found = _TABLES.get(key)
    if found is None:
        if len(_TABLES) > 512:
            _TABLES.clear()
        array = cuda.to_device(np.array(rows, dtype=dtype).reshape(-1))
        found = _TABLES[key] = (array, _ref(array))
    return found


def _device_id() -> int:
    """The current device: device memory (tables, workspaces) is kept per device."""
    return 0 if simulated() else cuda.get_current_device().id


_WORKSPACES = threading.local()


def workspace(kind: str, elements: int, dtype, device: int = None):
    """A buffer on the current device (``device``: its id, when the caller has it) of at
    least ``elements`` of ``dtype`` for ``kind`` (packed weights, weight-gradient partials),
    reused by later calls of this host thread on that device: the kernels run in order on
    one stream, so a later call's writes wait for an earlier call's reads. Grows by powers
    of two."""
    cache = getattr(_WORKSPACES, "buffers", None)
    if cache is None:
        cache = _WORKSPACES.buffers = {}
    key = (kind, np.dtype(dtype).str, _device_id() if device is None else device)
    buffer = cache.get(key)
    if buffer is None or buffer.shape[0] < elements:
        buffer = device_array((1 << max(10, (elements - 1).bit_length()),), dtype)
        cache[key] = buffer
    return buffer


def bias_operand(bias, dtype: str):
    """The bias as a kernel argument: its elements one after another (a strided bias is
    copied), or a stand-in never read when there is none."""
    if bias is None:
        return _no_bias(dtype)
    if _shape_strides(bias)[1][0] != 1:
        bias = _copy5(view5(bias, 1))
    return operand(bias).ref


_NO_BIAS: dict = {}


def _no_bias(dtype: str):
    """The bias argument of a kernel compiled without one (never read): a null pointer, or a
    one-element array under the simulator."""
    if not simulated():
        return 0
    if dtype not in _NO_BIAS:
        _NO_BIAS[dtype] = device_array((1,), dtype)
    return _NO_BIAS[dtype]


def signatures(dtype: str, channels_last: bool, nd: int = 2, tile: Tile = None,
               wide: bool = False, tc: bool = False):
    """The main kernels of one (dtype, layout) as ``(label, python function, signature,
    tile)`` for ``numba.cuda.compile_ptx``: the types every launch passes (``tc``: their
    TF32 tensor-core variants, on the tile they run in place of ``tile``'s when it is not
    given)."""
    chosen = tile is None
    if chosen:
        tile = (TILES64 if dtype == "float64" else TILES)[0]
    conv_tile = tensor_core_tile(tile) if tc and chosen else tile
    layout = "cl" if channels_last else "cf"
    suffix = "_tf32" if tc else ""
    found = []
    for mode, bias in (("forward", True), ("data", False)):
        key = (dtype, channels_last, nd, wide, conv_tile, bias, False, tc)
        found.append((f"conv_gemm_{mode}_{layout}_{dtype}{suffix}", conv_gemm_function(*key),
                      _launch_types("conv_gemm", key), conv_tile))
    key = (dtype, nd, wide, tile, tc)
    found.append((f"weight_gemm_{dtype}{suffix}", weight_gemm_function(*key),
                  _launch_types("weight_gemm", key), tile))
    return found
