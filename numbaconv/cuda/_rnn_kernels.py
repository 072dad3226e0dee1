"""CUDA kernels of the recurrent ops (twin of :mod:`numbaconv.cpu._rnn_cells`), built on first
use by factories keyed on their compile-time constants (mode, dtype, tile, transposes).

``gemm(ta, tb, dtype, tile)``
    ``c (+)= op(a) @ op(b)`` on 2-D arrays of any strides (``op`` transposes with ``ta``/``tb``),
    shared-memory steps, :data:`MICRO` outputs a thread in registers, accumulation in float32
    for float16 storage (float64 for float64).
    Every output element is one thread's sum over the whole reduction in a fixed order: the
    input projections of all steps, each step's recurrent product, the input gradient and
    the weight gradients over all T*N rows are all deterministic, without atomics.
``forward_step(mode, dtype, projected)`` / ``backward_step(mode, dtype, projected)``
    One thread per (row n, hidden unit j) of one time step: the gate nonlinearities fused
    with the state update, and their derivatives. They read and write the reserve in
    :class:`numbaconv.problem.RNNReserveLayout`, exactly as the cpu kernels do (activations,
    then gradients of the pre-activations; zeros past a sequence's end), so reserves are
    interchangeable between backends. Each thread owns its (n, j) of every state array.
    The per-step arrays (gates, cells, y, dy, dproj, the previous states) are passed whole,
    (T, N, F), with the step t: a step loop hands the same array objects to every launch
    and slices nothing, which keeps its host time per step to the launch itself.
``forward_sequence(mode, dtype, tile)`` / ``backward_sequence(mode, dtype, tile)``
    The ``persistent`` forward and data gradient: all steps of a layer and direction in one
    cooperative launch, each block computing tiles of the recurrent product in shared
    memory and then the cells of those tiles, one grid-wide barrier a step, so that a
    sequence costs one launch instead of a product and a kernel a step. Their ``split``
    twins cut each step's product along its reduction where a layer has few tiles
    (:func:`reduction_split`): partial sums, a barrier, the cells adding them, a barrier.
``commit_projection``, ``gradient_of_output``
    LSTM with projection (one thread per (n, j < P)): the projected state ``m @ W_hr.T``
    (a GEMM) becomes h and y inside the sequence; backwards, the gradient of h goes to the
    reserve's dproj (the GEMM ``dproj @ W_hr`` then gives the cell kernel its input).

The element-wise kernels outside the step loops (state copies, dropout masks, the
time/batch swap, the previous states and the bias gradients) are
:mod:`numbaconv.cuda._rnn_elementwise`'s.
"""

from __future__ import annotations

import functools
import math

# Kernels name `cuda` as a module global: the simulator swaps it for its fake module there.
from numba import cuda

from ._templates import compile_source, indent

MODES = ("rnn_tanh", "rnn_relu", "lstm", "gru")


def _acc_type(dtype: str):
    import numba
    return numba.float64 if dtype == "float64" else numba.float32


# --- GEMM ----------------------------------------------------------------------------------

#: Outputs a thread of the product computes, rows x columns: a block of ``tile[1] x
#: tile[0]`` threads covers ``tile[0] * 2`` rows by ``tile[1] * 2`` columns. Larger micro
#: tiles issue fewer shared loads a multiply-add but make fewer blocks; the persistent
#: loops' recurrent product (N rows) needs blocks on every SM.
MICRO = (2, 2)

#: A step's operand values read into registers (``va{e}``, ``vb{e}``) at reduction offset
#: ``lk``, zero outside the operands.
_FILL = """
#unroll e LOADS_A
    va{e} = acc(0)
    if (m0 + ma{e} < rows) & (lk + la{e} < reduce_len):
#if TA
        va{e} = acc(a[lk + la{e}, m0 + ma{e}])
#else
        va{e} = acc(a[m0 + ma{e}, lk + la{e}])
#end
#end
#unroll e LOADS_B
    vb{e} = acc(0)
#if GATES
    if (lk + lb{e} < reduce_len) & okb{e}:
        vb{e} = acc(b[rb{e}, lk + lb{e}])
#else
    if (lk + lb{e} < reduce_len) & (q0 + qb{e} < cols):
#if TB
        vb{e} = acc(b[q0 + qb{e}, lk + lb{e}])
#else
        vb{e} = acc(b[lk + lb{e}, q0 + qb{e}])
#end
#end
#end
"""


OUTPUT_TILE = """
def output_tile(a, b, c, accumulate, sa, sb, m0_, q0_):
    tx = U(cuda.threadIdx.x)
    ty = U(cuda.threadIdx.y)
    tid = ty * U(TQ) + tx
    m0 = U(m0_)
    q0 = U(q0_)
    rows = U(c.shape[0])
    cols = U(c.shape[1])
#if TA
    reduce_len = U(a.shape[0])
#else
    reduce_len = U(a.shape[1])
#end
    # each thread's places in the shared tiles' fills, worked out once (a place past the
    # tile, in a last partial round of threads, is read but never stored)
#unroll e LOADS_A
    xa{e} = tid + U({e} * THREADS)
#if TA
    ma{e} = xa{e} % U(BM)
    la{e} = xa{e} // U(BM)
#else
    ma{e} = xa{e} // U(TL)
    la{e} = xa{e} % U(TL)
#end
#end
#unroll e LOADS_B
    xb{e} = tid + U({e} * THREADS)
#if TB
    qb{e} = xb{e} // U(TL)
    lb{e} = xb{e} % U(TL)
#else
    qb{e} = xb{e} % U(BQ)
    lb{e} = xb{e} // U(BQ)
#end
#end
#if GATES
    # gate-interleaved columns: the tile's column g * UNITS + u is gate g of unit q0 + u,
    # row g * units + q0 + u of b (G*H, H)
    units = cols // U(GATES)
#unroll e LOADS_B
    gb{e} = qb{e} // U(UNITS)
    ub{e} = q0 + qb{e} - gb{e} * U(UNITS)
    okb{e} = (gb{e} < U(GATES)) & (ub{e} < units)
    rb{e} = gb{e} * units + ub{e}
#end
#end
#unroll i RM
#unroll j RQ
    t{i}_{j} = acc(0)
#end
#end
    lk = U(0)
FILL4
    l0 = U(0)
    while l0 < reduce_len:
#unroll e LOADS_A
#if (e + 1) * THREADS <= BM * TL
        sa[ma{e}, la{e}] = va{e}
#else
        if xa{e} < U(BM * TL):
            sa[ma{e}, la{e}] = va{e}
#end
#end
#unroll e LOADS_B
#if (e + 1) * THREADS <= TL * BQ
        sb[lb{e}, qb{e}] = vb{e}
#else
        if xb{e} < U(TL * BQ):
            sb[lb{e}, qb{e}] = vb{e}
#end
#end
        cuda.syncthreads()
        # the next step's values, read while this step multiplies
        lk = l0 + U(TL)
FILL8
#unroll li TL
#unroll i RM
        a{i} = sa[ty + U({i} * TM), U({li})]
#end
#unroll j RQ
        b{j} = sb[U({li}), tx + U({j} * TQ)]
#end
#unroll i RM
#unroll j RQ
        t{i}_{j} += a{i} * b{j}
#end
#end
#end
        cuda.syncthreads()
        l0 = lk
#unroll i RM
#unroll j RQ
    m = m0 + ty + U({i} * TM)
#if GATES
    g = (tx + U({j} * TQ)) // U(UNITS)
    u = q0 + tx + U({j} * TQ) - g * U(UNITS)
    q = g * units + u
    if (m < rows) & (g < U(GATES)) & (u < units):
#else
    q = q0 + tx + U({j} * TQ)
    if (m < rows) & (q < cols):
#end
        v = t{i}_{j}
        if accumulate:
            v += acc(c[m, q])
        c[m, q] = v
#end
#end
""".replace("FILL4", indent(_FILL, 4)).replace("FILL8", indent(_FILL, 8))


def block_tile(tile: tuple) -> tuple:
    """``(rows, columns)`` of the product's output a block of ``tile`` computes."""
    return tile[0] * MICRO[0], tile[1] * MICRO[1]


def shared_shapes(tile: tuple) -> tuple:
    """The shapes of the product's two shared tiles for ``tile``: ``op(a)``'s ``(rows,
    step + 1)`` and ``op(b)``'s ``(step, columns + 1)`` (one element of padding a row, so
    that fills along either axis do not conflict on banks)."""
    bm, bq = block_tile(tile)
    return (bm, tile[2] + 1), (tile[2], bq + 1)


@functools.lru_cache(maxsize=None)
def _output_tile(dtype: str, tile: tuple, ta: bool, tb: bool, gates: int = 0):
    """The device function every thread of a block calls for one block tile
    (:func:`block_tile`) of ``c (+)= op(a) @ op(b)`` (``op`` transposes with ``ta``/``tb``):
    ``output_tile(a, b, c, accumulate, sa, sb, m0, q0)`` for the tile at row m0, column q0,
    ``sa``/``sb`` the block's shared tiles (:func:`shared_shapes`). Each thread computes
    :data:`MICRO` outputs (rows ``ty + i * tile[0]``, columns ``tx + j * tile[1]``) in
    registers, each output one sum over the reduction in order, steps of ``tile[2]``
    through shared memory (a fill reads along ``op``'s contiguous axis of a row-major
    operand). It synchronises the block.

    ``gates`` G > 1 (with ``tb``; ``c`` (M, G*H), ``b`` (G*H, K)): the tile's columns are
    the G gates of :func:`tile_units` consecutive units from unit ``q0`` (its column
    ``g * units + u`` is ``c``'s column ``g * H + q0 + u``), so that one block computes
    every gate of the cells it then updates."""
    import numba
    if gates > 1 and not tb:
        raise ValueError("gates: gate-interleaved tiles read b as (G*H, K), expected tb")
    tm, tq, tl = tile
    bm, bq = block_tile(tile)
    threads = tm * tq
    names = dict(TM=tm, TQ=tq, TL=tl, RM=MICRO[0], RQ=MICRO[1], BM=bm, BQ=bq,
                 THREADS=threads, TA=bool(ta), TB=bool(tb),
                 LOADS_A=-(-bm * tl // threads), LOADS_B=-(-tl * bq // threads),
                 GATES=gates if gates > 1 else 0, UNITS=tile_units(tile, gates),
                 KEY=f"{dtype} {tile} ta={ta} tb={tb} gates={gates}")
    function = compile_source("output_tile", OUTPUT_TILE, names,
                              dict(acc=_acc_type(dtype), U=numba.uint64))
    return cuda.jit(device=True, inline=True)(function)


def tile_units(tile: tuple, gates: int) -> int:
    """Units a gate-interleaved block tile covers (all ``gates`` of each; 1 gate: the
    tile's columns)."""
    return block_tile(tile)[1] // max(gates, 1)


def gemm_function(ta: bool, tb: bool, dtype: str, tile: tuple):
    """``c[m, q] (+)= sum_l A[m, l] * B[l, q]`` with ``A = a.T if ta else a`` and
    ``B = b.T if tb else b``.

    Launch: block ``(tile_q, tile_m)``; grid ``(m_tiles, q_tiles)`` of the block tiles
    (:func:`block_tile`), each at most the hardware's limit
    (:func:`numbaconv.cuda._blas.gemm_launch`): a block loops over the row tiles
    ``blockIdx.x + i * gridDim.x`` and column tiles likewise, so any output fits.
    Arguments: ``a, b, c, accumulate``.
    """
    acc = _acc_type(dtype)
    bm, bq = block_tile(tile)
    sa_shape, sb_shape = shared_shapes(tile)
    output_tile = _output_tile(dtype, tile, ta, tb)

    def gemm(a, b, c, accumulate):
        sa = cuda.shared.array(sa_shape, acc)
        sb = cuda.shared.array(sb_shape, acc)
        # while loops: a range with the grid's step would divide by it (a 64-bit call)
        row = cuda.blockIdx.x * bm
        while row < c.shape[0]:
            col = cuda.blockIdx.y * bq
            while col < c.shape[1]:
                output_tile(a, b, c, accumulate, sa, sb, row, col)
                col += cuda.gridDim.y * bq
            row += cuda.gridDim.x * bm

    return gemm


# --- cells ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _math(dtype: str):
    acc = _acc_type(dtype)

    @cuda.jit(device=True, inline=True)
    def sigmoid(v):
        return acc(1) / (acc(1) + math.exp(-v))

    return sigmoid


def _check_cell(mode: str, projected: bool) -> None:
    """The step and sequence kernels' factories: a known mode, and a projection only for an
    LSTM."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if projected and mode != "lstm":
        raise ValueError(f"projected: expected False for mode {mode!r} (projections are "
                         f"LSTM only), got True")


@functools.lru_cache(maxsize=None)
def _forward_cell(mode: str, dtype: str, projected: bool, separate: bool = False):
    """The device function ``forward_step`` runs for one (n, j): ``cell(args, n, j)``,
    ``args`` its arguments (a tuple), with the state read from ``h`` and written to
    ``h_out`` (the same array for ``forward_step``; ``separate``: another one, which
    receives ``h`` past a sequence's end)."""
    acc = _acc_type(dtype)
    sigmoid = _math(dtype)
    lstm, gru, relu = mode == "lstm", mode == "gru", mode == "rnn_relu"

    # inline=True: inlined into each kernel at Numba's IR level (typed with the kernel, as
    # compile_ptx needs without a GPU; a separately compiled device function asks the GPU).
    @cuda.jit(device=True, inline=True)
    def cell(args, n, j):
        xg, hg, b_ih, b_hh, h, h_out, c, y, cells, lengths, t, store = args
        hs = h.shape[1]
        if t >= lengths[n]:
            if separate:
                h_out[n, j] = h[n, j]
            if not projected:
                y[t, n, j] = 0
            if store:
                if lstm:
                    cells[t, n, j] = c[n, j]
                    for k in range(4):
                        xg[t, n, k * hs + j] = 0
                elif gru:
                    for k in range(4):
                        xg[t, n, k * hs + j] = 0
                else:
                    xg[t, n, j] = 0
            return
        if lstm:
            pre_i = acc(xg[t, n, j]) + acc(hg[n, j]) + acc(b_ih[j]) + acc(b_hh[j])
            pre_f = (acc(xg[t, n, hs + j]) + acc(hg[n, hs + j]) + acc(b_ih[hs + j])
                     + acc(b_hh[hs + j]))
            pre_g = (acc(xg[t, n, 2 * hs + j]) + acc(hg[n, 2 * hs + j])
                     + acc(b_ih[2 * hs + j]) + acc(b_hh[2 * hs + j]))
            pre_o = (acc(xg[t, n, 3 * hs + j]) + acc(hg[n, 3 * hs + j])
                     + acc(b_ih[3 * hs + j]) + acc(b_hh[3 * hs + j]))
            gi = sigmoid(pre_i)
            gf = sigmoid(pre_f)
            gg = math.tanh(pre_g)
            go = sigmoid(pre_o)
            cn = gf * acc(c[n, j]) + gi * gg
            hn = go * math.tanh(cn)
            c[n, j] = cn
            h_out[n, j] = hn
            if not projected:
                y[t, n, j] = hn
            if store:
                cells[t, n, j] = cn
                xg[t, n, j] = gi
                xg[t, n, hs + j] = gf
                xg[t, n, 2 * hs + j] = gg
                xg[t, n, 3 * hs + j] = go
        elif gru:
            r = sigmoid(acc(xg[t, n, j]) + acc(b_ih[j]) + acc(hg[n, j]) + acc(b_hh[j]))
            z = sigmoid(acc(xg[t, n, hs + j]) + acc(b_ih[hs + j]) + acc(hg[n, hs + j])
                        + acc(b_hh[hs + j]))
            hn = acc(hg[n, 2 * hs + j]) + acc(b_hh[2 * hs + j])
            nv = math.tanh(acc(xg[t, n, 2 * hs + j]) + acc(b_ih[2 * hs + j]) + r * hn)
            hnew = (acc(1) - z) * nv + z * acc(h[n, j])
            h_out[n, j] = hnew
            y[t, n, j] = hnew
            if store:
                xg[t, n, j] = r
                xg[t, n, hs + j] = z
                xg[t, n, 2 * hs + j] = nv
                xg[t, n, 3 * hs + j] = hn
        else:
            pre = acc(xg[t, n, j]) + acc(hg[n, j]) + acc(b_ih[j]) + acc(b_hh[j])
            if relu:
                a = pre if (pre > 0 or pre != pre) else acc(0)
            else:
                a = math.tanh(pre)
            h_out[n, j] = a
            y[t, n, j] = a
            if store:
                xg[t, n, j] = a

    return cell


def forward_step_function(mode: str, dtype: str, projected: bool = False):
    """Step t of the forward for rows n and hidden units j (one thread each).

    ``xg`` (T, N, Gw): the input projections (no bias); step t's are overwritten with the
    activations when ``store``; ``hg`` (N, G*H): ``h @ W_hh.T``; ``h`` (N, H) and ``c``
    (N, H, LSTM; a dummy otherwise) updated in place; ``y`` (T, N, H): step t receives h
    (zero past a sequence's end); ``cells`` (T, N, H, LSTM with store): step t receives the
    new cell state. Arrays a mode or ``store`` does not use are dummies (any array of their
    rank and dtype).

    ``projected`` (LSTM with proj_size): ``h`` is ``m = o * tanh(c)`` (N, H), the
    projection's input, left unchanged past a sequence's end; ``y`` is not written
    (``commit_projection`` writes y from the projection).

    Launch: 1D, enough threads for N*H. Arguments:
    ``xg, hg, b_ih, b_hh, h, c, y, cells, lengths, t, store``.
    """
    _check_cell(mode, projected)
    cell = _forward_cell(mode, dtype, projected)

    def forward_step(xg, hg, b_ih, b_hh, h, c, y, cells, lengths, t, store):
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        hs = h.shape[1]
        if e < h.shape[0] * hs:
            cell((xg, hg, b_ih, b_hh, h, h, c, y, cells, lengths, t, store), e // hs, e % hs)

    return forward_step


# The persistent loops visit the same tiles at every step: a block's tiles (row tile,
# column tile) are walked by adding the grid's stride in that radix, one carry a tile, the
# divisions made once before the steps. A tile's cells are updated by the block that
# computed the tile, so a step needs one grid-wide barrier.

#: Gates each unit's cell reads, per mode: the forward's tiles interleave them.
GATES = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3}


@cuda.jit(device=True, inline=True)
def _tile_walk(rows, cols, bm, bq):
    """This block's first (row tile, column tile) of a rows x cols product, the grid's
    stride in those digits, the row and column tiles, and rows and cols."""
    col_tiles = (cols + bq - 1) // bq
    return ((cuda.blockIdx.x // col_tiles, cuda.blockIdx.x % col_tiles),
            (cuda.gridDim.x // col_tiles, cuda.gridDim.x % col_tiles),
            (rows + bm - 1) // bm, col_tiles, rows, cols)


@cuda.jit(device=True, inline=True)
def _next(major, minor, step, radix):
    """``(major, minor)`` (minor < radix) advanced by ``step`` = (major, minor) digits."""
    major += step[0]
    minor += step[1]
    if minor >= radix:
        minor -= radix
        major += 1
    return major, minor


def _tile_pass(output_tile, update, tile: tuple, bq: int):
    """The device function a persistent loop runs for one product of a step and the cells
    it feeds: ``tile_pass(walk, a, b, c, sa, sb, multiply, cells, args)`` walks this
    block's tiles (``walk`` from :func:`_tile_walk` with columns of ``bq``); per tile,
    ``output_tile(a, b, c, ...)`` when ``multiply``, a block barrier, then when ``cells``
    ``update(args, n, j)`` for each of the tile's (n, j) inside (rows, cols), the block's
    threads taking them in turn (the same thread each step)."""
    tm, tq, _ = tile
    threads = tm * tq
    bm = block_tile(tile)[0]
    tile_cells = bm * bq

    @cuda.jit(device=True, inline=True)
    def tile_pass(walk, a, b, c, sa, sb, multiply, cells, args):
        tile0, tile_step, row_tiles, col_tiles, rows, cols = walk
        tid = cuda.threadIdx.y * tq + cuda.threadIdx.x
        r, q = tile0
        while r < row_tiles:
            if multiply:
                output_tile(a, b, c, False, sa, sb, r * bm, q * bq)
                cuda.syncthreads()  # the tile's outputs, for its cells
            e = tid
            while cells and e < tile_cells:
                n = r * bm + e // bq
                j = q * bq + e % bq
                if n < rows and j < cols:
                    update(args, n, j)
                e += threads
            r, q = _next(r, q, tile_step, col_tiles)

    return tile_pass


@cuda.jit(device=True, inline=True)
def _split_walk(rows, cols, splits, bm, bq):
    """This block's first (row tile, split, column tile) of a rows x cols product whose
    reduction is cut in ``splits``, the grid's stride in those digits, and their radices."""
    col_tiles = (cols + bq - 1) // bq
    inner = splits * col_tiles
    b = cuda.blockIdx.x
    g = cuda.gridDim.x
    return ((b // inner, (b % inner) // col_tiles, b % col_tiles),
            (g // inner, (g % inner) // col_tiles, g % col_tiles),
            ((rows + bm - 1) // bm, splits, col_tiles))


@cuda.jit(device=True, inline=True)
def _next_split(position, step, radices):
    """``(row tile, split, column tile)`` advanced by ``step`` (each digit below its
    radix): one carry a digit at most."""
    r, s, q = position
    q += step[2]
    if q >= radices[2]:
        q -= radices[2]
        s += 1
    s += step[1]
    if s >= radices[1]:
        s -= radices[1]
        r += 1
    return r + step[0], s, q


def _split_pass(output_tile, tile: tuple, tb: bool):
    """The device function a split persistent loop runs for a step's recurrent product:
    ``split_pass(walk, a, b, part, sa, sb, chunk)`` walks this block's (row tile, split,
    column tile) (``walk`` from :func:`_split_walk`) and writes each tile of ``part[s] =
    op(a)[:, k0:k1] @ op(b)[k0:k1, :]``, ``k0 = s * chunk`` (``op`` transposes ``b`` with
    ``tb``)."""
    bm, bq = block_tile(tile)

    @cuda.jit(device=True, inline=True)
    def split_pass(walk, a, b, part, sa, sb, chunk):
        position, step, radices = walk
        reduce_len = a.shape[1]
        r, s, q = position
        while r < radices[0]:
            k0 = s * chunk
            k1 = min(k0 + chunk, reduce_len)
            if tb:
                output_tile(a[:, k0:k1], b[:, k0:k1], part[s], False, sa, sb, r * bm, q * bq)
            else:
                output_tile(a[:, k0:k1], b[k0:k1], part[s], False, sa, sb, r * bm, q * bq)
            r, s, q = _next_split((r, s, q), step, radices)

    return split_pass


@functools.lru_cache(maxsize=None)
def _summed_cell(cell, dtype: str, at: int, gates: int = 1):
    """``cell`` of a split loop: ``summed(args, n, j)`` with ``args = (part, add, run,
    inner)`` first writes, when ``add``, each of the ``gates`` product outputs (n, g * H +
    j) the cell reads as the sum of the splits' partial sums ``part[0] + part[1] + ...``
    in that order, then when ``run`` calls ``cell(inner, n, j)``; the product output is
    the cell's argument ``inner[at]`` (hg, rec or hp)."""
    acc = _acc_type(dtype)
    count = gates

    @cuda.jit(device=True, inline=True)
    def summed(args, n, j):
        part, add, run, inner = args
        out = inner[at]
        if add:
            width = out.shape[1] // count
            for g in range(count):
                col = g * width + j
                v = acc(part[0, n, col])
                for s in range(1, part.shape[0]):
                    v += acc(part[s, n, col])
                out[n, col] = v
        if run:
            cell(inner, n, j)

    return summed


#: Blocks a step's product is split to keep busy, about one an SM of an H100 or H200
#: (132): a split adds a write and a read of its partial sums and one more grid barrier a
#: step, which pays where the unsplit product leaves half the SMs or more idle.
SPLIT_TARGET_BLOCKS = 128

#: The least reduction a split takes, in product steps of ``tile[2]``: shorter ones spend
#: more of a tile on its fill and its write than on multiply-adds.
SPLIT_MIN_STEPS = 8


def reduction_split(name: str, mode: str, tile: tuple, rows: int, units: int,
                    reduce_len: int, out_size: int = 0) -> tuple:
    """``(splits, chunk)`` of the product a persistent loop ``name`` splits, over ``rows``
    x ``units`` cells, reducing ``reduce_len``: ``forward_sequence``'s and
    ``backward_sequence``'s recurrent product, or with ``out_size`` P the projected
    twins' product of N x P outputs (the forward's projection, the data gradient's
    ``rec``). Split in ``splits`` reductions of ``chunk`` (a multiple of
    ``tile[2]``; the last may be shorter) when the unsplit loop has at most half
    :data:`SPLIT_TARGET_BLOCKS` tiles; ``(1, reduce_len)`` otherwise. A function of
    the shape and tile alone, so the sums' order (and their bits) do not depend on the
    device."""
    if out_size:
        bm, bq = block_tile(tile)
        tiles = -(-rows // bm) * -(-out_size // bq)
    else:
        tiles = sequence_tiles(name, mode, tile, rows, units)
    most = max(1, reduce_len // (SPLIT_MIN_STEPS * tile[2]))
    splits = min(most, SPLIT_TARGET_BLOCKS // tiles)
    if splits <= 1:
        return 1, reduce_len
    per_split = -(-reduce_len // splits)
    chunk = -(-per_split // tile[2]) * tile[2]
    return -(-reduce_len // chunk), chunk


def sequence_tiles(name: str, mode: str, tile: tuple, rows: int, units: int,
                   out_size: int = 0, splits: int = 1) -> int:
    """The block tiles of a persistent loop over ``rows`` x ``units`` cells (and ``rows``
    x ``out_size`` projected ones; a split loop's product: ``splits`` of each of its
    tiles): the most blocks any of its passes can keep busy."""
    bm, bq = block_tile(tile)
    forward = name.startswith("forward")
    bu = tile_units(tile, GATES[mode]) if forward else bq
    found = -(-rows // bm) * -(-units // bu)
    if out_size or "split" in name:   # the split (or projected) product's plain tiles
        columns = split_columns(name, mode, units, out_size)
        found = max(found, splits * -(-rows // bm) * -(-columns // bq))
    return found


def split_columns(name: str, mode: str, units: int, out_size: int = 0) -> int:
    """Output columns of the product a persistent loop ``name`` may split (the width of
    its partial sums): P with a projection, else G*H (forward) or H (data gradient)."""
    if out_size:
        return out_size
    return units * GATES[mode] if name.startswith("forward") else units


def forward_sequence_function(mode: str, dtype: str, tile: tuple):
    """Every step of one layer and direction's forward in one cooperative launch (the
    ``persistent`` algorithm). Per step, each block computes ``hg = h @ W_hh.T`` for its
    tiles, each tile every gate of :func:`tile_units` units (gate-interleaved columns), by
    shared-memory steps as ``gemm`` computes them (each output one thread's sum over H in a
    fixed order); then the cells of the tile's (n, j) as ``forward_step`` computes them;
    then one grid-wide barrier. The state alternates between the two of ``hh`` (2, N, H):
    step s reads ``hh[s % 2]`` (the initial state ``hh[0]``) while blocks past their
    product write ``hh[1 - s % 2]``; the last state is ``hh[T % 2]``. Without projection;
    the arguments are ``forward_step``'s, with ``hh`` instead of ``h``, ``w`` (G*H, H)
    W_hh instead of the step, and ``reverse``: ``xg, w, b_ih, b_hh, hh, hg, c, y, cells,
    lengths, store, reverse``.

    Launch: block ``(tile_q, tile_m)``, a 1-D grid of at most as many blocks as can be
    resident at once (``max_cooperative_grid_blocks``); blocks loop over the tiles beyond
    the grid (:func:`sequence_tiles`).
    """
    _check_cell(mode, False)
    acc = _acc_type(dtype)
    gates = GATES[mode]
    bm, _ = block_tile(tile)
    bu = tile_units(tile, gates)
    gates_pass = _tile_pass(_output_tile(dtype, tile, False, True, gates),
                            _forward_cell(mode, dtype, False, True), tile, bu)
    sa_shape, sb_shape = shared_shapes(tile)

    def forward_sequence(xg, w, b_ih, b_hh, hh, hg, c, y, cells, lengths, store, reverse):
        sa = cuda.shared.array(sa_shape, acc)
        sb = cuda.shared.array(sb_shape, acc)
        grid = cuda.cg.this_grid()
        walk = _tile_walk(hh.shape[1], hh.shape[2], bm, bu)
        seq = xg.shape[0]
        for s in range(seq):
            t = seq - 1 - s if reverse else s
            h_in = hh[s & 1]
            h_out = hh[(s & 1) ^ 1]
            gates_pass(walk, h_in, w, hg, sa, sb, True, True,       # hg = h @ W_hh.T
                       (xg, hg, b_ih, b_hh, h_in, h_out, c, y, cells, lengths, t, store))
            grid.sync()

    return forward_sequence


def forward_split_sequence_function(mode: str, dtype: str, tile: tuple):
    """``forward_sequence`` with each step's recurrent product split along its reduction
    (:func:`reduction_split`), for layers with too few tiles to keep the GPU busy: per
    step, the tiles of every split's partial product ``part[s] = h[:, k0:k1] @ W_hh[:,
    k0:k1].T`` (N x G*H), a grid-wide barrier, the cells (each sums its gates' partial
    sums in split order into hg, then updates as ``forward_step``), a barrier. The state
    alternates as in ``forward_sequence``. Arguments: ``forward_sequence``'s, then ``part``
    (S, N, G*H) and ``chunk``. Launch: as ``forward_sequence``."""
    _check_cell(mode, False)
    acc = _acc_type(dtype)
    bm, bq = block_tile(tile)
    product_pass = _split_pass(_output_tile(dtype, tile, False, True), tile, True)
    cells_pass = _tile_pass(_output_tile(dtype, tile, False, True),
                            _summed_cell(_forward_cell(mode, dtype, False, True), dtype, 1,
                                         GATES[mode]), tile, bq)
    sa_shape, sb_shape = shared_shapes(tile)

    def forward_split_sequence(xg, w, b_ih, b_hh, hh, hg, c, y, cells, lengths, store,
                               reverse, part, chunk):
        sa = cuda.shared.array(sa_shape, acc)
        sb = cuda.shared.array(sb_shape, acc)
        grid = cuda.cg.this_grid()
        product_walk = _split_walk(hh.shape[1], w.shape[0], part.shape[0], bm, bq)
        cell_walk = _tile_walk(hh.shape[1], hh.shape[2], bm, bq)
        seq = xg.shape[0]
        for s in range(seq):
            t = seq - 1 - s if reverse else s
            h_in = hh[s & 1]
            h_out = hh[(s & 1) ^ 1]
            product_pass(product_walk, h_in, w, part, sa, sb, chunk)
            grid.sync()
            cells_pass(cell_walk, h_in, w, hg, sa, sb, False, True,
                       (part, True, True, (xg, hg, b_ih, b_hh, h_in, h_out, c, y, cells,
                                           lengths, t, store)))
            grid.sync()

    return forward_split_sequence


def forward_projected_sequence_function(mode: str, dtype: str, tile: tuple):
    """``forward_sequence`` for an LSTM with projection: per step, ``hg = h @ W_hh.T`` by
    gate-interleaved tiles and the cells of each tile (they write ``m = o * tanh(c)``), a
    grid-wide barrier, ``hp = m @ W_hr.T`` by tiles and ``commit_projection`` of each
    tile's (n, j < P) (h and y[t]), a barrier. Arguments: ``xg, w, w_hr, b_ih, b_hh, h,
    m, hg, hp, c, y, cells, lengths, store, reverse`` (``h``, ``hp`` (N, P); ``m`` (N,
    H)). Launch: as ``forward_sequence``."""
    _check_cell(mode, True)
    acc = _acc_type(dtype)
    bm, bq = block_tile(tile)
    bu = tile_units(tile, GATES[mode])
    gates_pass = _tile_pass(_output_tile(dtype, tile, False, True, GATES[mode]),
                            _forward_cell(mode, dtype, True), tile, bu)
    projection_pass = _tile_pass(_output_tile(dtype, tile, False, True), _commit, tile, bq)
    sa_shape, sb_shape = shared_shapes(tile)

    def forward_projected_sequence(xg, w, w_hr, b_ih, b_hh, h, m, hg, hp, c, y, cells,
                                   lengths, store, reverse):
        sa = cuda.shared.array(sa_shape, acc)
        sb = cuda.shared.array(sb_shape, acc)
        grid = cuda.cg.this_grid()
        cell_walk = _tile_walk(m.shape[0], m.shape[1], bm, bu)
        projection_walk = _tile_walk(h.shape[0], h.shape[1], bm, bq)
        seq = xg.shape[0]
        for s in range(seq):
            t = seq - 1 - s if reverse else s
            gates_pass(cell_walk, h, w, hg, sa, sb, True, True,      # hg = h @ W_hh.T
                       (xg, hg, b_ih, b_hh, m, m, c, y, cells, lengths, t, store))
            grid.sync()
            projection_pass(projection_walk, m, w_hr, hp, sa, sb, True, True,
                            (hp, h, y, lengths, t))                  # hp = m @ W_hr.T
            grid.sync()

    return forward_projected_sequence


def forward_projected_split_sequence_function(mode: str, dtype: str, tile: tuple):
    """``forward_projected_sequence`` with each step's projection ``hp = m @ W_hr.T`` (N x
    P, H deep) split along its reduction (:func:`reduction_split`): the gate tiles and
    their cells, a barrier, every split's partial projection ``part[s]`` by tiles, a
    barrier, ``commit_projection`` of each (n, j < P) after summing its partial sums in
    split order into hp, a barrier. Arguments: ``forward_projected_sequence``'s, then
    ``part`` (S, N, P) and ``chunk``. Launch: as ``forward_sequence``."""
    _check_cell(mode, True)
    acc = _acc_type(dtype)
    bm, bq = block_tile(tile)
    bu = tile_units(tile, GATES[mode])
    plain = _output_tile(dtype, tile, False, True)
    gates_pass = _tile_pass(_output_tile(dtype, tile, False, True, GATES[mode]),
                            _forward_cell(mode, dtype, True), tile, bu)
    projection_pass = _split_pass(plain, tile, True)
    commit_pass = _tile_pass(plain, _summed_cell(_commit, dtype, 0), tile, bq)
    sa_shape, sb_shape = shared_shapes(tile)

    def forward_projected_split_sequence(xg, w, w_hr, b_ih, b_hh, h, m, hg, hp, c, y,
                                         cells, lengths, store, reverse, part, chunk):
        sa = cuda.shared.array(sa_shape, acc)
        sb = cuda.shared.array(sb_shape, acc)
        grid = cuda.cg.this_grid()
        cell_walk = _tile_walk(m.shape[0], m.shape[1], bm, bu)
        projection_walk = _split_walk(h.shape[0], h.shape[1], part.shape[0], bm, bq)
        commit_walk = _tile_walk(h.shape[0], h.shape[1], bm, bq)
        seq = xg.shape[0]
        for s in range(seq):
            t = seq - 1 - s if reverse else s
            gates_pass(cell_walk, h, w, hg, sa, sb, True, True,      # hg = h @ W_hh.T
                       (xg, hg, b_ih, b_hh, m, m, c, y, cells, lengths, t, store))
            grid.sync()
            projection_pass(projection_walk, m, w_hr, part, sa, sb, chunk)  # m @ W_hr.T
            grid.sync()
            commit_pass(commit_walk, m, w_hr, hp, sa, sb, False, True,
                        (part, True, True, (hp, h, y, lengths, t)))
            grid.sync()

    return forward_projected_split_sequence


def backward_step_function(mode: str, dtype: str, projected: bool = False):
    """Step t of the data gradient for rows n and hidden units j (one thread each).

    ``gates`` (T, N, Gw): the activations, step t's overwritten with the gradients of the
    pre-activations (GRU: dr, dz, r * dn, dn); ``dh`` (N, H): the direct part of the state
    gradient (see :mod:`numbaconv.cpu._rnn_cells`), ``rec`` (N, H): ``dgates_prev @ W_hh``;
    ``dy`` (T, N, H); LSTM: ``cells`` (T, N, H) the cell states, ``dc`` (N, H) the cell
    gradient, updated. The state before step t (LSTM: the cell state, GRU: the output) is
    ``states[tp]`` (T, N, H), tp the step processed before t (t - 1, or t + 1 with
    ``reverse``), or ``init`` (N, H) where there is none (the first processed step, and for
    a reverse GRU a sequence's last step). Arrays a mode does not read are dummies (any
    array of their rank and dtype).

    ``projected`` (LSTM with proj_size): ``dh`` (N, H) is ``dm = dproj @ W_hr``, the gradient
    of ``o * tanh(c)``, read only (``gradient_of_output`` already folded rec and dy into
    dproj; ``rec`` and ``dy`` are not read); ``cells[t]`` receives ``o * tanh(c)`` (zero
    past the sequence's end), the projection's input for the weight gradient, as on cpu.

    Launch: 1D, enough threads for N*H. Arguments:
    ``gates, cells, states, init, dh, rec, dy, dc, lengths, t, reverse``.
    """
    _check_cell(mode, projected)
    cell = _backward_cell(mode, dtype, projected)

    def backward_step(gates, cells, states, init, dh, rec, dy, dc, lengths, t, reverse):
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        hs = dh.shape[1]
        if e < dh.shape[0] * hs:
            cell((gates, cells, states, init, dh, rec, dy, dc, lengths, t, reverse), e // hs,
                 e % hs)

    return backward_step


@functools.lru_cache(maxsize=None)
def _backward_cell(mode: str, dtype: str, projected: bool):
    """The device function ``backward_step`` runs for one (n, j): ``cell(args, n, j)``,
    ``args`` its arguments (a tuple)."""
    acc = _acc_type(dtype)
    lstm, gru, relu = mode == "lstm", mode == "gru", mode == "rnn_relu"
    one = acc(1)

    @cuda.jit(device=True, inline=True)
    def cell(args, n, j):
        gates, cells, states, init, dh, rec, dy, dc, lengths, t, reverse = args
        hs = dh.shape[1]
        if t >= lengths[n]:
            if lstm or gru:
                for k in range(4):
                    gates[t, n, k * hs + j] = 0
            else:
                gates[t, n, j] = 0
            if projected:
                cells[t, n, j] = 0
            else:
                dh[n, j] = acc(dh[n, j]) + acc(rec[n, j])
            return
        if projected:
            gh = acc(dh[n, j])
        else:
            gh = acc(dh[n, j]) + acc(rec[n, j]) + acc(dy[t, n, j])
        tp = t + 1 if reverse else t - 1
        first = tp < 0 or tp >= gates.shape[0]
        if lstm:
            gi = acc(gates[t, n, j])
            gf = acc(gates[t, n, hs + j])
            gg = acc(gates[t, n, 2 * hs + j])
            go = acc(gates[t, n, 3 * hs + j])
            tc = math.tanh(acc(cells[t, n, j]))
            cp = acc(init[n, j]) if first else acc(states[tp, n, j])
            dcn = acc(dc[n, j]) + gh * go * (one - tc * tc)
            if projected:
                cells[t, n, j] = go * tc
            else:
                dh[n, j] = 0
            gates[t, n, 3 * hs + j] = gh * tc * go * (one - go)
            dc[n, j] = dcn * gf
            gates[t, n, hs + j] = dcn * cp * gf * (one - gf)
            gates[t, n, j] = dcn * gg * gi * (one - gi)
            gates[t, n, 2 * hs + j] = dcn * gi * (one - gg * gg)
        elif gru:
            r = acc(gates[t, n, j])
            z = acc(gates[t, n, hs + j])
            nn = acc(gates[t, n, 2 * hs + j])
            hn = acc(gates[t, n, 3 * hs + j])
            if first or (reverse and t + 1 >= lengths[n]):
                hp = acc(init[n, j])
            else:
                hp = acc(states[tp, n, j])
            dn = gh * (one - z) * (one - nn * nn)
            dh[n, j] = gh * z
            gates[t, n, hs + j] = gh * (hp - nn) * z * (one - z)
            gates[t, n, j] = dn * hn * r * (one - r)
            gates[t, n, 2 * hs + j] = dn * r
            gates[t, n, 3 * hs + j] = dn
        else:
            a = acc(gates[t, n, j])
            if relu:
                gates[t, n, j] = gh if a > 0 else acc(0) * gh
            else:
                gates[t, n, j] = gh * (one - a * a)
            dh[n, j] = 0

    return cell


def backward_sequence_function(mode: str, dtype: str, tile: tuple):
    """Every step of one layer and direction's data gradient in one cooperative launch
    (the ``persistent`` algorithm), in the step loop's order. Per step, each block
    computes ``rec = dgates @ W_hh`` for its tiles by shared-memory steps as ``gemm``
    computes it (dgates: the gate gradients of the step processed before, GRU's first 3H
    columns; none before the first step, whose ``rec`` the caller zeroes), then the cells
    of each tile's (n, j) as ``backward_step`` computes them; then one grid-wide barrier.
    After the last step, the blocks' tiles of its ``rec``. Without projection. Arguments:
    ``backward_step``'s with ``w`` (G*H, H) W_hh instead of the step: ``gates, cells,
    states, init, w, dh, rec, dy, dc, lengths, reverse`` (``reverse``: the layer's reverse
    direction, whose data gradient runs t = 0 .. T-1).

    Launch: as ``forward_sequence``.
    """
    _check_cell(mode, False)
    acc = _acc_type(dtype)
    bm, bq = block_tile(tile)
    cells_pass = _tile_pass(_output_tile(dtype, tile, False, False),
                            _backward_cell(mode, dtype, False), tile, bq)
    sa_shape, sb_shape = shared_shapes(tile)

    def backward_sequence(gates, cells, states, init, w, dh, rec, dy, dc, lengths, reverse):
        sa = cuda.shared.array(sa_shape, acc)
        sb = cuda.shared.array(sb_shape, acc)
        grid = cuda.cg.this_grid()
        walk = _tile_walk(dh.shape[0], dh.shape[1], bm, bq)
        seq = gates.shape[0]
        for s in range(seq + 1):  # s = seq: the last step's product alone
            t = s if reverse else seq - 1 - s
            before = t - 1 if reverse else t + 1  # the step processed before t
            # rec = dgates @ W_hh (GRU: dr, dz, r * dn, not dn), then the cells of step t
            cells_pass(walk, gates[before if s > 0 else t, :, :w.shape[0]], w, rec, sa, sb,
                       s > 0, s < seq,
                       (gates, cells, states, init, dh, rec, dy, dc, lengths, t, reverse))
            if s < seq:
                grid.sync()

    return backward_sequence


def backward_split_sequence_function(mode: str, dtype: str, tile: tuple):
    """``backward_sequence`` with each step's recurrent product split along its reduction
    (:func:`reduction_split`): per step, the tiles of every split's partial product
    ``part[s] = dgates[:, k0:k1] @ W_hh[k0:k1]`` (N x H; none before the first step), a
    grid-wide barrier, the cells (each sums its partial sums in split order into rec,
    then updates as ``backward_step``), a barrier; after the last step, its product and
    sums alone (``rec`` for dhx). Arguments: ``backward_sequence``'s, then ``part`` (S, N,
    H) and ``chunk``. Launch: as ``forward_sequence``."""
    _check_cell(mode, False)
    acc = _acc_type(dtype)
    bm, bq = block_tile(tile)
    product_pass = _split_pass(_output_tile(dtype, tile, False, False), tile, False)
    cells_pass = _tile_pass(_output_tile(dtype, tile, False, False),
                            _summed_cell(_backward_cell(mode, dtype, False), dtype, 5),
                            tile, bq)
    sa_shape, sb_shape = shared_shapes(tile)

    def backward_split_sequence(gates, cells, states, init, w, dh, rec, dy, dc, lengths,
                                reverse, part, chunk):
        sa = cuda.shared.array(sa_shape, acc)
        sb = cuda.shared.array(sb_shape, acc)
        grid = cuda.cg.this_grid()
        product_walk = _split_walk(dh.shape[0], dh.shape[1], part.shape[0], bm, bq)
        cell_walk = _tile_walk(dh.shape[0], dh.shape[1], bm, bq)
        seq = gates.shape[0]
        for s in range(seq + 1):  # s = seq: the last step's product alone
            t = s if reverse else seq - 1 - s
            before = t - 1 if reverse else t + 1  # the step processed before t
            if s > 0:  # rec = dgates @ W_hh (GRU: dr, dz, r * dn, not dn), by splits
                product_pass(product_walk, gates[before, :, :w.shape[0]], w, part, sa, sb,
                             chunk)
                grid.sync()
            cells_pass(cell_walk, dh, w, rec, sa, sb, False, True,
                       (part, s > 0, s < seq, (gates, cells, states, init, dh, rec, dy, dc,
                                               lengths, t, reverse)))
            if s < seq:
                grid.sync()

    return backward_split_sequence


def backward_projected_sequence_function(mode: str, dtype: str, tile: tuple):
    """``backward_sequence`` for an LSTM with projection, in the step loop's order: per
    step, ``rec = dgates @ W_hh`` (N, P) by tiles (none before the first step) and
    ``gradient_of_output`` of each tile's (n, j < P) (``dproj[t]``, dh), a grid-wide
    barrier, ``dm = dproj[t] @ W_hr`` (N, H) by tiles and the cells of each tile, a
    barrier; after the last step, its ``rec``. Arguments: ``gates, cells, init, w, w_hr,
    dh, rec, dy, dproj, dm, dc, lengths, reverse`` (``dh``, ``rec`` (N, P); ``dy``,
    ``dproj`` (T, N, P); ``dm``, ``dc`` (N, H)). Launch: as ``forward_sequence``."""
    _check_cell(mode, True)
    acc = _acc_type(dtype)
    bm, bq = block_tile(tile)
    plain = _output_tile(dtype, tile, False, False)
    output_pass = _tile_pass(plain, _output_gradient(dtype), tile, bq)
    cells_pass = _tile_pass(plain, _backward_cell(mode, dtype, True), tile, bq)
    sa_shape, sb_shape = shared_shapes(tile)

    def backward_projected_sequence(gates, cells, init, w, w_hr, dh, rec, dy, dproj, dm, dc,
                                    lengths, reverse):
        sa = cuda.shared.array(sa_shape, acc)
        sb = cuda.shared.array(sb_shape, acc)
        grid = cuda.cg.this_grid()
        output_walk = _tile_walk(dh.shape[0], dh.shape[1], bm, bq)
        cell_walk = _tile_walk(dm.shape[0], dm.shape[1], bm, bq)
        seq = gates.shape[0]
        for s in range(seq + 1):  # s = seq: the last step's product alone
            t = s if reverse else seq - 1 - s
            before = t - 1 if reverse else t + 1
            output_pass(output_walk, gates[before if s > 0 else t], w, rec, sa, sb, s > 0,
                        s < seq, (dh, rec, dy, dproj, lengths, t))   # rec = dgates @ W_hh
            if s < seq:
                grid.sync()
                cells_pass(cell_walk, dproj[t], w_hr, dm, sa, sb, True, True,  # dproj @ W_hr
                           (gates, cells, cells, init, dm, dm, gates, dc, lengths, t,
                            reverse))
                grid.sync()

    return backward_projected_sequence


def backward_projected_split_sequence_function(mode: str, dtype: str, tile: tuple):
    """``backward_projected_sequence`` with each step's ``rec = dgates @ W_hh`` (N x P, G*H
    deep) split along its reduction (:func:`reduction_split`): every split's partial
    ``part[s]`` by tiles (none before the first step), a barrier, ``gradient_of_output``
    of each (n, j < P) after summing its partial sums in split order into rec, a barrier,
    ``dm = dproj @ W_hr`` by tiles and the cells, a barrier; after the last step, its
    product and sums alone. Arguments: ``backward_projected_sequence``'s, then ``part``
    (S, N, P) and ``chunk``. Launch: as ``forward_sequence``."""
    _check_cell(mode, True)
    acc = _acc_type(dtype)
    bm, bq = block_tile(tile)
    plain = _output_tile(dtype, tile, False, False)
    product_pass = _split_pass(plain, tile, False)
    output_pass = _tile_pass(plain, _summed_cell(_output_gradient(dtype), dtype, 1), tile,
                             bq)
    cells_pass = _tile_pass(plain, _backward_cell(mode, dtype, True), tile, bq)
    sa_shape, sb_shape = shared_shapes(tile)

    def backward_projected_split_sequence(gates, cells, init, w, w_hr, dh, rec, dy, dproj,
                                          dm, dc, lengths, reverse, part, chunk):
        sa = cuda.shared.array(sa_shape, acc)
        sb = cuda.shared.array(sb_shape, acc)
        grid = cuda.cg.this_grid()
        product_walk = _split_walk(dh.shape[0], dh.shape[1], part.shape[0], bm, bq)
        output_walk = _tile_walk(dh.shape[0], dh.shape[1], bm, bq)
        cell_walk = _tile_walk(dm.shape[0], dm.shape[1], bm, bq)
        seq = gates.shape[0]
        for s in range(seq + 1):  # s = seq: the last step's product alone
            t = s if reverse else seq - 1 - s
            before = t - 1 if reverse else t + 1
            if s > 0:  # rec = dgates @ W_hh, by splits
                product_pass(product_walk, gates[before], w, part, sa, sb, chunk)
                grid.sync()
            output_pass(output_walk, dh, w, rec, sa, sb, False, True,
                        (part, s > 0, s < seq, (dh, rec, dy, dproj, lengths, t)))
            if s < seq:
                grid.sync()
                cells_pass(cell_walk, dproj[t], w_hr, dm, sa, sb, True, True,  # dproj @ W_hr
                           (gates, cells, cells, init, dm, dm, gates, dc, lengths, t,
                            reverse))
                grid.sync()

    return backward_projected_split_sequence


# --- projection (LSTM with proj_size) -------------------------------------------------------

@cuda.jit(device=True, inline=True)
def _commit(args, n, j):
    """``commit_projection`` of one (n, j); ``args``: its arguments."""
    hp, h, y, lengths, t = args
    if t < lengths[n]:
        v = hp[n, j]
        h[n, j] = v
        y[t, n, j] = v
    else:
        y[t, n, j] = 0


def commit_projection_function(dtype: str):
    """The projected state ``hp = m @ W_hr.T`` (N, P) becomes ``h`` (N, P) and step t of ``y``
    (T, N, P) where row n is inside its sequence at step t; ``y[t]`` is zero elsewhere and
    ``h`` keeps its value (twin of the cpu ``commit_projection``).

    Launch: 1D, enough threads for N*P. Arguments: ``hp, h, y, lengths, t``.
    """

    def commit_projection(hp, h, y, lengths, t):
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        p = hp.shape[1]
        if e < hp.shape[0] * p:
            _commit((hp, h, y, lengths, t), e // p, e % p)

    return commit_projection


@functools.lru_cache(maxsize=None)
def _output_gradient(dtype: str):
    """``gradient_of_output`` of one (n, j); ``args``: its arguments."""
    acc = _acc_type(dtype)

    @cuda.jit(device=True, inline=True)
    def output_gradient(args, n, j):
        dh, rec, dy, dproj, lengths, t = args
        g = acc(dh[n, j]) + acc(rec[n, j])
        if t < lengths[n]:
            dproj[t, n, j] = g + acc(dy[t, n, j])
            dh[n, j] = 0
        else:
            dproj[t, n, j] = 0
            dh[n, j] = g

    return output_gradient


def gradient_of_output_function(dtype: str):
    """LSTM with projection, backward step t: ``dproj[t] = dh + rec + dy[t]`` (N, P; dy and
    dproj (T, N, P)) inside the sequence, where dh becomes zero (the cell adds no direct
    part); outside, ``dproj[t] = 0`` and dh becomes ``dh + rec`` (twin of the cpu
    ``gradient_of_output``).

    Launch: 1D, enough threads for N*P. Arguments: ``dh, rec, dy, dproj, lengths, t``.
    """
    output_gradient = _output_gradient(dtype)

    def gradient_of_output(dh, rec, dy, dproj, lengths, t):
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        p = dh.shape[1]
        if e < dh.shape[0] * p:
            output_gradient((dh, rec, dy, dproj, lengths, t), e // p, e % p)

    return gradient_of_output


# --- compiled kernels ----------------------------------------------------------------------

#: Blocks of the persistent loops an SM holds at once: their registers are capped for it
#: (a bigger cooperative grid to hide latencies, for a few bytes spilled around the grid
#: barrier where the cap binds: the projected forward's two products).
PERSISTENT_BLOCKS_PER_SM = 2

#: The same for the split loops, whose splits aim at about one block an SM
#: (:data:`SPLIT_TARGET_BLOCKS`): registers for one block, so that the split walk and the
#: cells' walk live in registers beside the product's (a cap of two spills them).
SPLIT_BLOCKS_PER_SM = 1


def launch_bounds(name: str, key: tuple):
    """``cuda.jit``'s ``launch_bounds`` for kernel ``name`` of ``key``: (threads a block,
    :data:`PERSISTENT_BLOCKS_PER_SM` or, split, :data:`SPLIT_BLOCKS_PER_SM`) for the
    persistent loops, else None."""
    if not name.endswith("sequence"):
        return None
    tm, tq, _ = key[2]
    return (tm * tq, SPLIT_BLOCKS_PER_SM if "split" in name else PERSISTENT_BLOCKS_PER_SM)


@functools.lru_cache(maxsize=None)
def kernel(name: str, *key):
    """The ``cuda.jit`` kernel ``name`` built from ``key`` (compiled lazily, per signature)."""
    from ._layout import simulated
    bounds = launch_bounds(name, key)
    if bounds is None or simulated():   # the simulator takes no launch bounds
        return cuda.jit(FUNCTIONS[name](*key))
    return cuda.jit(FUNCTIONS[name](*key), launch_bounds=bounds)


FUNCTIONS = {
    "gemm": gemm_function,
    "forward_step": forward_step_function,
    "forward_sequence": forward_sequence_function,
    "backward_sequence": backward_sequence_function,
    "forward_split_sequence": forward_split_sequence_function,
    "backward_split_sequence": backward_split_sequence_function,
    "forward_projected_split_sequence": forward_projected_split_sequence_function,
    "backward_projected_split_sequence": backward_projected_split_sequence_function,
    "forward_projected_sequence": forward_projected_sequence_function,
    "backward_projected_sequence": backward_projected_sequence_function,
    "backward_step": backward_step_function,
    "commit_projection": commit_projection_function,
    "gradient_of_output": gradient_of_output_function,
}


def signatures(dtype: str, tile: tuple):
    """Every RNN kernel of one dtype as ``(label, python function, signature)``, with the
    array layouts the drivers pass for the common case: what the compile tests hand to
    ``numba.cuda.compile_ptx``. Not ``forward_sequence`` and ``backward_sequence``:
    numba-cuda (0.30.4) compiles a grid-wide barrier for the current device's compute
    capability (its ``cg.this_grid`` asks the device), and ptxas leaves the barrier's
    runtime calls to the linker; tests/test_cuda_machine_code.py stands in for both."""
    from numba import types
    elem = {"float16": types.float16, "float32": types.float32,
            "float64": types.float64}[dtype]
    a1 = types.Array(elem, 1, "C")
    a2 = types.Array(elem, 2, "A")
    a3 = types.Array(elem, 3, "A")
    lens = types.Array(types.int64, 1, "C")
    found = []
    for ta, tb in ((False, True), (False, False), (True, False)):
        found.append((f"rnn_gemm_{'T' if ta else 'N'}{'T' if tb else 'N'}_{dtype}",
                      gemm_function(ta, tb, dtype, tile), (a2, a2, a2, types.boolean)))
    forward = (a3, a2, a1, a1, a2, a2, a3, a3, lens, types.int64, types.boolean)
    backward = (a3, a3, a3, a2, a2, a2, a3, a2, lens, types.int64, types.boolean)
    for mode in MODES:
        found.append((f"rnn_forward_step_{mode}_{dtype}", forward_step_function(mode, dtype),
                      forward))
        found.append((f"rnn_backward_step_{mode}_{dtype}",
                      backward_step_function(mode, dtype), backward))
    found.append((f"rnn_forward_step_lstm_proj_{dtype}",
                  forward_step_function("lstm", dtype, True), forward))
    found.append((f"rnn_backward_step_lstm_proj_{dtype}",
                  backward_step_function("lstm", dtype, True), backward))
    found.append((f"rnn_commit_projection_{dtype}", commit_projection_function(dtype),
                  (a2, a2, a3, lens, types.int64)))
    found.append((f"rnn_gradient_of_output_{dtype}", gradient_of_output_function(dtype),
                  (a2, a2, a3, a3, lens, types.int64)))
    return found
