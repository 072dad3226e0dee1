"""A matrix product of our own: a register-blocked micro-kernel in explicit LLVM vector IR,
driven by BLIS-style packing and cache blocking in Numba.

:func:`gram` (``a.T @ b`` reading both operands in place) is the channels-last im2col weight
gradient's product where dw is small (see ``conv_backward_weight``); :mod:`._implicit`
calls the micro-kernel on windows in the input itself; :class:`RowPanels` multiplies the
recurrent networks' weights, packed once per call, by each step's states;
:func:`planes_product` the Winograd products of few tiles and many channels; :func:`gemm`
(packed) is groundwork that no algorithm calls yet; :func:`nt_rows` multiplies two operands
whose rows run along the shared axis, the first read in place (the channels-first 1x1
weight gradient's dy); :func:`stream_block` copies blocks of an operand that comes from
memory while its tiles prefetch the next (the channels-first 1x1 data gradient's dy). The
GEMM-bound speed targets (1x1 convolutions,
the stem's weight gradient) need products faster than NumPy's OpenBLAS on skinny shapes,
and a product of our own can take its operands where the convolution's packing leaves them
(or pack windows straight into its panels), saving the copy BLAS makes of every operand.
LLVM does not register-block a loop nest written in Numba (a 12x32 accumulator block in a
local array compiled to gathers and scatters at 2.5 GFLOP/s), so the micro-kernel is
written as IR: MR x NV vector accumulators carried through the k loop as phi nodes, one
broadcast of A and NV loads of B per row and step, ``llvm.fma`` on whole vectors.

Measured on one core of an AMD EPYC (Zen 4, AVX-512), float32, one thread each
(``benchmarks/bench_gemm.py`` has the shapes): the micro-kernel alone on cache-resident
panels 115.6 GFLOP/s, above NumPy's OpenBLAS on a 2048^3 product (103.5); the whole product
92.8 there, but 54-80 on the skinny products of 1x1 layers and the stem's weight gradient,
where OpenBLAS runs 74-99. The packing is what loses: plain Numba loops, 40-65% of the time
on those shapes (the stem's 147 x 100,352 x 64: 22 of 38 ms). The way on is to pack the
convolution's windows straight into panels (their runs are contiguous in the input) rather
than to tune these general packing loops.

Layout (BLIS's): for each block of NC columns of B and KC rows of the shared dimension, B's
block is packed into panels of NR columns (k-major: ``panel[k, j]``), then for each block of
MC rows of A, A's block into panels of MR rows (``panel[k, i]``); the micro-kernel
multiplies one A panel by one B panel into an MR x NR tile of C. Panels are zero-padded at
the matrix edges, and edge tiles go through a scratch tile, so nothing outside C is written.
"""

from __future__ import annotations

import functools
import types as pytypes
from typing import Optional

import numpy as np
from llvmlite import ir
from numba import carray, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..config import inline_jit, parallel_jit, serial_jit

#: Rows of the shared dimension per packed block (panels of A and B stay in L1/L2).
KC = 256


@functools.lru_cache(maxsize=None)
def vector_lanes(dtype) -> int:
    """Lanes of the widest vector registers the host CPU has, for ``dtype``."""
    from llvmlite import binding
    features = binding.get_host_cpu_features()
    bits = 512 if features.get("avx512f") else 256 if features.get("avx") else 128
    return bits // (8 * np.dtype(dtype).itemsize)


@functools.lru_cache(maxsize=None)
def tile_shape(dtype) -> tuple:
    """(MR, NV): micro-kernel rows and vectors per row (NR = NV * lanes columns).

    MR * NV accumulators plus NV vectors of B and one broadcast must fit the register file:
    32 vector registers with AVX-512 (12 x 2: 24 accumulators), 16 otherwise (6 x 2)."""
    return (12, 2) if vector_lanes(dtype) * np.dtype(dtype).itemsize == 64 else (6, 2)


def _llvm_float(dtype):
    return ir.FloatType() if np.dtype(dtype) == np.float32 else ir.DoubleType()


def _tile_intrinsic(rows=None, vectors=None):
    """The micro-kernel (see :data:`_micro_tile`) as an intrinsic, on tiles of ``rows`` x
    ``vectors`` vectors (None: :func:`tile_shape`'s MR, NV)."""

    @intrinsic
    def micro_tile(typingctx, ap, bp, cp, kc, ldc, add, lda, ldb):
        if not (isinstance(ap, types.CPointer) and ap.dtype in (types.float32, types.float64)):
            return None
        dtype = np.dtype(str(ap.dtype))
        mr, nv = tile_shape(dtype)

        def codegen(context, builder, signature, args):
            ap, bp, cp, kc, ldc, add, lda, ldb = args
            _emit_tile(context, builder, dtype, ap, None, bp, cp, kc, ldc, add, lda, ldb,
                       (rows or mr, vectors or nv))
            return context.get_dummy_value()

        return types.void(ap, bp, cp, kc, ldc, add, lda, ldb), codegen

    return micro_tile


#: ``_micro_tile(ap, bp, cp, kc, ldc, add, lda, ldb)``: C[:MR, :NR] (= or +=) A (kc, MR) @
#: B (kc, NR), the rows of A, B and C lda, ldb and ldc elements apart (packed panels: MR and
#: NR; or rows of the operands themselves). ``ap``, ``bp``, ``cp`` are pointers
#: (:func:`_at`); ``add`` nonzero adds to C.
_micro_tile = _tile_intrinsic()


@functools.lru_cache(maxsize=None)
def micro_tile_rows(rows: int, vectors: Optional[int] = None):
    """:data:`_micro_tile` on tiles of ``rows`` x ``vectors`` vectors (None: NV; made once
    per shape): for operands whose MR-side dimension is a multiple of ``rows`` but not of MR
    (the 7x7 stem's windows have 21 features per tap row: 3 tiles of 7 rows, where 12-row
    tiles compute 24), or whose NR side is one vector wide (:func:`single_vector_rows`).
    ``rows`` * ``vectors`` + ``vectors`` + 1 vector registers must fit the register file."""
    return _tile_intrinsic(rows, vectors)


#: The tallest one-vector tile (:func:`single_vector_rows`), by vector bytes: its
#: accumulators, one B vector and one broadcast fill AVX-512's 32 vector registers less 2
#: (16 without AVX-512); shorter tiles load more B vectors per multiply-add.
SINGLE_VECTOR_MAX_ROWS = {64: 28, 32: 14, 16: 14}


def single_vector_rows(rows: int, columns: int, dtype) -> Optional[int]:
    """Rows per tile for a product of ``rows`` x ``columns`` outputs whose columns fit one
    vector (``columns`` at most the vector's lanes), or None where they do not: tiles of one
    vector, from PANEL_ACCUMULATORS rows (the FMA units' latency) up to
    SINGLE_VECTOR_MAX_ROWS, the height that pads ``rows`` least, the tallest of those (48
    features: 2 tiles of 24). :func:`tile_shape`'s NV vectors there would compute columns
    that are only padding (half of a 12 x 2 float32 tile for 16 columns)."""
    lanes = vector_lanes(dtype)
    if columns > lanes:
        return None
    high = SINGLE_VECTOR_MAX_ROWS[lanes * np.dtype(dtype).itemsize]
    low = min(PANEL_ACCUMULATORS, high)
    return min(range(low, high + 1), key=lambda h: (-(-max(rows, 1) // h) * h, -h))


@functools.lru_cache(maxsize=None)
def kernel_twin(kernel, suffix: str, jit, **tiles):
    """``kernel`` (a Numba dispatcher) compiled again by ``jit`` with the globals ``tiles``
    (micro-kernel intrinsics) in place of its own, under its name plus ``_suffix``: Numba's
    disk cache files compilations by qualified name and line, so a twin under the kernel's
    own name would load the kernel's compilation. Made once per kernel and tiles."""
    func = kernel.py_func
    twin = pytypes.FunctionType(func.__code__, dict(func.__globals__, **tiles),
                                f"{func.__name__}_{suffix}", func.__defaults__,
                                func.__closure__)
    twin.__qualname__ = twin.__name__
    return jit(twin)


#: Fewest accumulators a tile of :func:`panel_rows` keeps: lower tiles have fewer
#: independent sums than the FMA units' latency needs, and run below the full rate.
PANEL_ACCUMULATORS = 12


def panel_rows(rows: int, dtype) -> int:
    """Rows per tile of a left operand of ``rows`` rows (:func:`columns_product`): the
    height, from PANEL_ACCUMULATORS / NV up to MR, that pads ``rows`` to the fewest whole
    tiles' rows, the tallest of those (16 rows: two 8-row tiles rather than 24 rows of two
    12-row ones; a tile's time is its height's, padded rows included)."""
    mr, nv = tile_shape(dtype)
    low = min(mr, -(-PANEL_ACCUMULATORS // nv))
    return min(range(low, mr + 1), key=lambda h: (-(-max(rows, 1) // h) * h, -h))


@functools.lru_cache(maxsize=None)
def strided_shape(dtype) -> tuple:
    """(MR, NV) of :func:`_micro_tile_strided`: 6 x 4 vectors with AVX-512 (6 x 2 otherwise).

    Each of A's MR values needs its own offset register there, and 12 of them with the
    loop's pointers outgrow x86's 16 general registers: the 12 x 2 tile ran at 77.5 GFLOP/s
    strided (Zen 4, one core, cache-resident operands), 6 x 4 at 113.5 (8 x 3 and 4 x 4
    also ~114; 6 x 4 gives NR = 64, a divisor of the usual channel counts)."""
    return (6, 4) if vector_lanes(dtype) * np.dtype(dtype).itemsize == 64 else (6, 2)


@functools.lru_cache(maxsize=None)
def narrow_strided_shape(dtype) -> Optional[tuple]:
    """(MR, NV) of the narrow strided tile, half as wide as :func:`strided_shape`'s with
    AVX-512 (8 x 2 vectors: 32 float32 columns), for outputs of 32 channels that a 64-wide
    tile would compute half empty; None without AVX-512 (its tile is 16 wide already)."""
    return (8, 2) if vector_lanes(dtype) * np.dtype(dtype).itemsize == 64 else None


def narrow_tiles(outputs: int, dtype) -> bool:
    """Whether products into ``outputs`` channels take the narrow strided tiles: where those
    fill their columns and :func:`strided_shape`'s would not (32 float32 channels, or 32 past
    a multiple of 64, below 8 wide tiles)."""
    dtype = np.dtype(dtype)
    shape = narrow_strided_shape(dtype)
    if shape is None:
        return False
    narrow = shape[1] * vector_lanes(dtype)
    wide = strided_shape(dtype)[1] * vector_lanes(dtype)
    return outputs % wide != 0 and outputs % narrow == 0 and outputs < 8 * wide


def _strided_intrinsic(narrow: bool, rows: Optional[int] = None):
    """The strided micro-kernel (see :data:`_micro_tile_strided`) on tiles of
    :func:`strided_shape`, or with ``narrow`` of :func:`narrow_strided_shape`; ``rows``: only
    that many of their rows (:func:`strided_tile_rows`)."""

    @intrinsic
    def micro_tile_strided(typingctx, ap, ai, bp, cp, kc, ldc, add, lda, ldb):
        if not (isinstance(ap, types.CPointer) and ap.dtype in (types.float32, types.float64)):
            return None
        dtype = np.dtype(str(ap.dtype))
        shape = narrow_strided_shape(dtype) if narrow else strided_shape(dtype)
        if shape is None:
            return None
        shape = (rows or shape[0], shape[1])

        def codegen(context, builder, signature, args):
            ap, ai, bp, cp, kc, ldc, add, lda, ldb = args
            _emit_tile(context, builder, dtype, ap, ai, bp, cp, kc, ldc, add, lda, ldb, shape)
            return context.get_dummy_value()

        return types.void(ap, ai, bp, cp, kc, ldc, add, lda, ldb), codegen

    return micro_tile_strided


#: ``_micro_tile_strided(ap, ai, bp, cp, kc, ldc, add, lda, ldb)``: :data:`_micro_tile` with
#: A's MR values of one step ``ai`` elements apart instead of adjacent: A[k, i] at ``ap + k *
#: lda + i * ai`` (the forward convolution's windows, whose positions lie a pixel apart and
#: whose features are the depth), on a tile of :func:`strided_shape`;
#: ``_micro_tile_strided_narrow`` on one of :func:`narrow_strided_shape`.
_micro_tile_strided = _strided_intrinsic(False)
_micro_tile_strided_narrow = _strided_intrinsic(True)


@functools.lru_cache(maxsize=None)
def strided_tile_rows(rows: int, narrow: bool = False):
    """:data:`_micro_tile_strided` (``narrow``: its narrow twin) on tiles of ``rows`` rows
    (fewer than MR; made once per shape): a run's last few pixels, which a whole tile would
    compute with padding (a 28-pixel row: 4 tiles of 6 and one of 4 rather than 30)."""
    return _strided_intrinsic(narrow, rows)


#: (MR, NV) of :data:`_micro_tile_fetching` (:func:`stream_block`'s tiles), either dtype:
#: 8 rows divide the usual channel counts, which 12 do not (64 rows would be 72).
STREAM_TILE = (8, 2)


def _fetching_intrinsic(shape=None):
    """The fetching micro-kernel (see :data:`_micro_tile_fetching`) on tiles of ``shape``
    (None: :func:`tile_shape`'s)."""

    @intrinsic
    def micro_tile_fetching(typingctx, ap, bp, cp, kc, ldc, add, lda, ldb, fp, fs, shift):
        if not (isinstance(ap, types.CPointer) and ap.dtype in (types.float32, types.float64)):
            return None
        dtype = np.dtype(str(ap.dtype))

        def codegen(context, builder, signature, args):
            ap, bp, cp, kc, ldc, add, lda, ldb, fp, fs, shift = args
            _emit_tile(context, builder, dtype, ap, None, bp, cp, kc, ldc, add, lda, ldb,
                       shape or tile_shape(dtype), (fp, fs, shift))
            return context.get_dummy_value()

        return types.void(ap, bp, cp, kc, ldc, add, lda, ldb, fp, fs, shift), codegen

    return micro_tile_fetching


#: ``_micro_tile_fetching(ap, bp, cp, kc, ldc, add, lda, ldb, fp, fs, shift)``:
#: :data:`_micro_tile` on a tile of STREAM_TILE that at each step k also prefetches into L2
#: the line at ``fp + (k >> shift) * fs`` (a prefetch never faults and changes no result):
#: an operand's next block, fetched from memory while this one is multiplied;
#: ``_micro_tile_fetching_whole`` on a tile of :func:`tile_shape` (:func:`gram`'s).
_micro_tile_fetching = _fetching_intrinsic(STREAM_TILE)
_micro_tile_fetching_whole = _fetching_intrinsic()


def _emit_tile(context, builder, dtype, ap, ai, bp, cp, kc, ldc, add, lda, ldb, shape=None,
               fetch=None):
    """The IR of one micro-kernel tile (see :func:`_micro_tile`); ``ai`` None: unit.
    ``fetch`` (fp, fs, shift): each step k also prefetches the line at fp + (k >> shift) * fs
    into L2 (:data:`_micro_tile_fetching`)."""
    mr, nv = shape or tile_shape(dtype)
    lanes = vector_lanes(dtype)
    i64 = ir.IntType(64)
    vec = ir.VectorType(_llvm_float(dtype), lanes)
    fma = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vec, [vec, vec, vec]),
        f"llvm.fma.v{lanes}{'f32' if dtype == np.float32 else 'f64'}")
    zero = ir.Constant(vec, [0.0] * lanes)
    undef = ir.Constant(vec, ir.Undefined)
    splat = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)

    def wide(v):
        return builder.sext(v, i64) if v.type.width < 64 else v

    kc, ldc, lda, ldb = (wide(v) for v in (kc, ldc, lda, ldb))

    def const(v):
        return ir.Constant(i64, v)

    a_offsets = [const(i) for i in range(mr)] if ai is None else \
        [builder.mul(const(i), wide(ai)) for i in range(mr)]
    entry = builder.block
    loop = builder.append_basic_block("tile.k")
    store = builder.append_basic_block("tile.store")
    builder.cbranch(builder.icmp_signed(">", kc, const(0)), loop, store)

    builder.position_at_end(loop)
    k = builder.phi(i64)
    k.add_incoming(const(0), entry)
    acc = [[builder.phi(vec) for _ in range(nv)] for _ in range(mr)]
    if fetch is not None:
        fp, fs, shift = fetch
        # Locality 2: L2 and beyond, so that the current panel keeps L1.
        _emit_prefetch(builder, builder.gep(fp, [builder.mul(builder.ashr(k, wide(shift)),
                                                             wide(fs))]), 2)
    b_row = builder.gep(bp, [builder.mul(k, ldb)])
    b = [builder.load(builder.bitcast(builder.gep(b_row, [const(j * lanes)]),
                                      vec.as_pointer()), align=1) for j in range(nv)]
    a_row = builder.gep(ap, [builder.mul(k, lda)])
    summed = []
    for i in range(mr):
        a = builder.load(builder.gep(a_row, [a_offsets[i]]))
        a = builder.shuffle_vector(builder.insert_element(undef, a, ir.Constant(
            ir.IntType(32), 0)), undef, splat)
        summed.append([builder.call(fma, [a, b[j], acc[i][j]]) for j in range(nv)])
    k_next = builder.add(k, const(1))
    k.add_incoming(k_next, loop)
    for i in range(mr):
        for j in range(nv):
            acc[i][j].add_incoming(zero, entry)
            acc[i][j].add_incoming(summed[i][j], loop)
    builder.cbranch(builder.icmp_signed("<", k_next, kc), loop, store)

    builder.position_at_end(store)
    totals = [[builder.phi(vec) for _ in range(nv)] for _ in range(mr)]   # phis first
    adding = builder.icmp_signed("!=", add, ir.Constant(add.type, 0))
    for i in range(mr):
        c_row = builder.gep(cp, [builder.mul(const(i), ldc)])
        for j in range(nv):
            total = totals[i][j]
            total.add_incoming(zero, entry)
            total.add_incoming(summed[i][j], loop)
            where = builder.bitcast(builder.gep(c_row, [const(j * lanes)]), vec.as_pointer())
            old = builder.load(where, align=1)
            builder.store(builder.select(adding, builder.fadd(old, total), total), where,
                          align=1)


#: Positions per chunk of :func:`nt_rows`' products: the chunk of B transposed (depth x
#: columns) stays in L1/L2 while A's tiles pass over it; longer chunks load and store each
#: accumulator tile less often.
NT_DEPTH = 256


@inline_jit
def nt_rows(a, a0, lda, b, b0, ldb, out, o0, ldo, r0, r1, columns, length, add, bt, edge,
            edge_out, pitch, mr, nr, lanes):
    """out[o0 + i * ldo + j] (=, or with ``add`` +=) the sum over p < ``length`` of
    a[a0 + i * lda + p] * b[b0 + j * ldb + p], for A's rows i in [r0, r1) and columns j <
    ``columns`` (a multiple of NR): a product of two operands whose rows run along the
    shared axis (the channels-first 1x1 weight gradient's dy and x). A's rows are read in
    place, MR at a time by the strided micro-kernel (each a stream read front to back); B
    in chunks of NT_DEPTH positions transposed into ``bt`` (NT_DEPTH * pitch values,
    ``pitch`` a position; at a power-of-two pitch of a kilobyte or more a tile's B panel
    would fall into a few L1 sets: see ``_sliding.row_pitch``). Rows past the last whole MR
    tile go through ``edge`` (MR * length values, zero past the edge rows: nothing is read
    past A) and ``edge_out`` (MR * columns). a, b and out are flat; the order of the
    additions depends on the shape alone."""
    whole = r0 + (r1 - r0) // mr * mr
    edge_rows = r1 - whole
    for i in range(edge_rows):
        edge[i * length:(i + 1) * length] = a[a0 + (whole + i) * lda:
                                              a0 + (whole + i) * lda + length]
        if add:
            edge_out[i * columns:(i + 1) * columns] = out[o0 + (whole + i) * ldo:
                                                          o0 + (whole + i) * ldo + columns]
    for p0 in range(0, length, NT_DEPTH):
        kc = min(NT_DEPTH, length - p0)
        _transpose(b, b0 + p0, ldb, bt, 0, pitch, columns, kc, lanes)
        adding = 1 if add or p0 > 0 else 0
        for j0 in range(0, columns, nr):
            for i0 in range(r0, whole, mr):
                _micro_tile_strided(_at(a, a0 + i0 * lda + p0), lda, _at(bt, j0),
                                    _at(out, o0 + i0 * ldo + j0), kc, ldo, adding, 1, pitch)
            if edge_rows:
                _micro_tile_strided(_at(edge, p0), length, _at(bt, j0), _at(edge_out, j0), kc,
                                    columns, adding, 1, pitch)
    for i in range(edge_rows):
        out[o0 + (whole + i) * ldo:o0 + (whole + i) * ldo + columns] = \
            edge_out[i * columns:(i + 1) * columns]


#: Columns of B per block of :func:`stream_block` (a job's width): its copy (KC rows at an
#: odd pitch of lines) stays in L2 with the next block prefetched beside it; wider blocks
#: copy longer runs of each row, narrower ones leave more jobs to share out.
STREAM_COLUMNS = 128

#: Rows of A per pass of :func:`stream_block`'s tiles over B's block: STREAM_ROWS x KC of A
#: (256 KiB of float32) stays in L2 while B's tiles pass under it.
STREAM_ROWS = 256


@inline_jit
def stream_block(ap, a0, astep, rows, b, b0, ldb, kc, width, out, o0, ldo, add, panel, pitch,
                 tmp, f0, fkc, fwidth, line, mr, nr):
    """out[o0 + i * ldo + j] (=, or with ``add`` +=) the sum over q < ``kc`` of A[i, q] *
    b[b0 + q * ldb + j], for i < ``rows`` and j < ``width``: one block of a product whose
    right operand comes from memory (the channels-first 1x1 data gradient's dy).

    A lies packed in tiles of MR rows, A[t * MR + i, q] at ap[a0 + t * astep + q * MR + i],
    zero past ``rows``. B's block is copied into ``panel`` (``kc`` rows ``pitch`` apart, zero
    past ``width`` up to whole tiles), and while its tiles are multiplied
    (:data:`_micro_tile_fetching`) they prefetch into L2 a later block's ``fkc`` rows of
    ``fwidth`` values, b[f0 + q * ldb:...] (none where ``f0`` < 0): copied rows of B at
    strides of kilobytes are runs the hardware prefetchers do not follow, and reading them on
    demand stalled the copy (figures in docs/cpu-algorithms.md, "`gemm`: the channels-first
    1x1 data gradient, dy streamed"). Each tile fetches one line of a share of those rows,
    one row every 2**shift steps, so the fetches spread over the whole block. Edge tiles go
    through ``tmp`` (MR * NR values): nothing outside ``out``'s rows and columns is written.
    ``line``: values per cache line. The order of the additions depends on the shape alone."""
    wpad = -(-width // nr) * nr
    for q in range(kc):
        panel[q * pitch:q * pitch + width] = b[b0 + q * ldb:b0 + q * ldb + width]
        panel[q * pitch + width:q * pitch + wpad] = 0
    padded_rows = -(-rows // mr) * mr
    tiles = padded_rows // mr * (wpad // nr)
    lines = -(-fwidth // line)
    groups = 1
    while groups < 4 and 2 * groups * lines <= tiles and 2 * groups <= fkc:
        groups *= 2
    span = max(fkc // groups, 1)
    shift = 0
    while (kc - 1) >> shift >= span:
        shift += 1
    t = 0
    for i1 in range(0, padded_rows, STREAM_ROWS):
        for j0 in range(0, wpad, nr):
            for i0 in range(i1, min(i1 + STREAM_ROWS, padded_rows), mr):
                # Tile t: line t // groups of the later block's rows in share t % groups.
                fetched = t // groups
                if f0 >= 0 and fetched < lines:
                    fp = _at(b, f0 + (t % groups) * span * ldb + fetched * line)
                    fs = ldb
                else:
                    fp = _at(b, b0)
                    fs = 0
                t += 1
                a_tile = _at(ap, a0 + i0 // mr * astep)
                if i0 + mr <= rows and j0 + nr <= width:
                    _micro_tile_fetching(a_tile, _at(panel, j0), _at(out, o0 + i0 * ldo + j0),
                                         kc, ldo, add, mr, pitch, fp, fs, shift)
                    continue
                _micro_tile_fetching(a_tile, _at(panel, j0), _at(tmp, 0), kc, nr, 0, mr,
                                     pitch, fp, fs, shift)
                for i in range(min(mr, rows - i0)):
                    at = o0 + (i0 + i) * ldo + j0
                    for j in range(min(nr, width - j0)):
                        if add:
                            out[at + j] += tmp[i * nr + j]
                        else:
                            out[at + j] = tmp[i * nr + j]


def _square_transpose(width=None):
    """An intrinsic ``(src, lds, dst, ldd)``: dst[j * ldd + i] = src[i * lds + j] for i, j <
    L, L = ``width`` (a power of two; by default the vector lanes): L rows of L values loaded
    as vectors, transposed in registers by log2(L) rounds of interleaving (round: w[2i],
    w[2i + 1] = the low and high halves of v[i] and v[i + L/2] interleaved), stored as L
    vectors. ``src`` and ``dst`` are pointers (:func:`_at`)."""

    @intrinsic
    def tile(typingctx, src, lds, dst, ldd):
        if not (isinstance(src, types.CPointer) and src.dtype in (types.float32,
                                                                  types.float64)):
            return None
        dtype = np.dtype(str(src.dtype))
        lanes = width or vector_lanes(dtype)
        sig = types.void(src, lds, dst, ldd)

        def codegen(context, builder, signature, args):
            src, lds, dst, ldd = args
            i64 = ir.IntType(64)
            vec = ir.VectorType(_llvm_float(dtype), lanes)
            lds, ldd = (builder.sext(v, i64) if v.type.width < 64 else v for v in (lds, ldd))
            rows = [builder.load(builder.bitcast(builder.gep(src, [builder.mul(ir.Constant(
                i64, i), lds)]), vec.as_pointer()), align=1) for i in range(lanes)]
            half = lanes // 2
            mask_lo = ir.Constant(ir.VectorType(ir.IntType(32), lanes),
                                  [m // 2 + (lanes if m % 2 else 0) for m in range(lanes)])
            mask_hi = ir.Constant(ir.VectorType(ir.IntType(32), lanes),
                                  [half + m // 2 + (lanes if m % 2 else 0)
                                   for m in range(lanes)])
            for _ in range(lanes.bit_length() - 1):
                mixed = []
                for i in range(half):
                    mixed.append(builder.shuffle_vector(rows[i], rows[i + half], mask_lo))
                    mixed.append(builder.shuffle_vector(rows[i], rows[i + half], mask_hi))
                rows = mixed
            for j in range(lanes):
                where = builder.gep(dst, [builder.mul(ir.Constant(i64, j), ldd)])
                builder.store(rows[j], builder.bitcast(where, vec.as_pointer()), align=1)
            return context.get_dummy_value()

        return sig, codegen

    return tile


#: The vector-wide square transpose, and 8- and 4-wide ones for the edges of a transpose
#: (:func:`_transpose`).
_transpose_tile = _square_transpose()
_transpose_tile8, _transpose_tile4 = _square_transpose(8), _square_transpose(4)


def _lines_intrinsic(write: bool):
    """An intrinsic ``(pointer, nbytes)`` that prefetches every 64-byte line of [pointer,
    pointer + nbytes) into every cache level, for reading or (``write``) for writing."""

    def typer(typingctx, pointer, nbytes):
        if not isinstance(pointer, types.CPointer) or not isinstance(nbytes, types.Integer):
            return None
        sig = types.void(pointer, nbytes)

        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            base = builder.bitcast(args[0], ir.IntType(8).as_pointer())
            count = builder.sext(args[1], i64) if args[1].type.width < 64 else args[1]
            with cgutils.for_range_slice(builder, ir.Constant(i64, 0), count,
                                         ir.Constant(i64, 64)) as (offset, _):
                _emit_prefetch(builder, builder.gep(base, [offset]), 3, write)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


#: ``_prefetch(pointer, nbytes)``: LLVM's ``llvm.prefetch`` of those lines, for reading (it
#: never faults and changes no result). For loops whose next operands lie where the hardware
#: prefetchers do not look: a run of a few lines per step, each run far from the last
#: (``_winograd._weights``).
_prefetch = _lines_intrinsic(False)
#: ``_prefetch_for_writing(pointer, nbytes)``: the same for lines about to be written whole,
#: whose fetch (the store's read for ownership) would otherwise stall the stores.
_prefetch_for_writing = _lines_intrinsic(True)


def _emit_prefetch(builder, pointer, locality: int, write: bool = False) -> None:
    """IR: ``llvm.prefetch`` of the line at ``pointer``, for reading (or ``write``), of
    data, into the cache levels ``locality`` asks for (3 every level, 2 L2 and beyond)."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    prefetch = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
        "llvm.prefetch.p0i8")
    builder.call(prefetch, [builder.bitcast(pointer, i8p), ir.Constant(i32, int(write)),
                            ir.Constant(i32, locality), ir.Constant(i32, 1)])


@intrinsic
def _at(typingctx, array, offset):
    """A pointer to ``array``'s data plus ``offset`` elements (no bounds check)."""
    if not isinstance(array, types.Array):
        return None
    sig = types.CPointer(array.dtype)(array, offset)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.gep(data, [args[1]])

    return sig, codegen




@inline_jit
def _pack_rows(a, i0, rows, p0, kc, mr, out):
    """out[p, k, i] = a[i0 + p * mr + i, p0 + k], zero past ``rows``: A's panels."""
    for p in range((rows + mr - 1) // mr):
        base = p * kc * mr
        for i in range(mr):
            r = p * mr + i
            if r < rows:
                for k in range(kc):
                    out[base + k * mr + i] = a[i0 + r, p0 + k]
            else:
                for k in range(kc):
                    out[base + k * mr + i] = 0


@inline_jit
def _pack_columns(b, p0, kc, j0, columns, nr, out):
    """out[p, k, j] = b[p0 + k, j0 + p * nr + j], zero past ``columns``: B's panels."""
    for p in range((columns + nr - 1) // nr):
        base = p * kc * nr
        width = min(nr, columns - p * nr)
        for k in range(kc):
            row = out[base + k * nr:base + (k + 1) * nr]
            src = b[p0 + k, j0 + p * nr:j0 + p * nr + width]
            for j in range(width):
                row[j] = src[j]
            for j in range(width, nr):
                row[j] = 0


@serial_jit
def _gemm(a, b, c, mr, nr, mc, nc, kc_block):
    m, depth = a.shape
    n = b.shape[1]
    ldc = c.strides[0] // c.itemsize
    a_packed = np.empty(mc * kc_block, c.dtype)
    b_packed = np.empty(((nc + nr - 1) // nr) * nr * kc_block, c.dtype)
    tile = np.empty((mr, nr), c.dtype)
    if depth == 0:
        c[:, :] = 0
    for j0 in range(0, n, nc):
        columns = min(nc, n - j0)
        for p0 in range(0, depth, kc_block):
            kc = min(kc_block, depth - p0)
            add = 1 if p0 > 0 else 0
            _pack_columns(b, p0, kc, j0, columns, nr, b_packed)
            for i0 in range(0, m, mc):
                rows = min(mc, m - i0)
                _pack_rows(a, i0, rows, p0, kc, mr, a_packed)
                for jp in range((columns + nr - 1) // nr):
                    cj = j0 + jp * nr
                    width = min(nr, n - cj)
                    b_panel = _at(b_packed, jp * kc * nr)
                    for ip in range((rows + mr - 1) // mr):
                        ci = i0 + ip * mr
                        height = min(mr, m - ci)
                        a_panel = _at(a_packed, ip * kc * mr)
                        if height == mr and width == nr:
                            _micro_tile(a_panel, b_panel, _at(c, ci * ldc + cj), kc, ldc,
                                        add, mr, nr)
                            continue
                        # An edge tile: computed whole into the scratch tile, then its part
                        # inside C copied (C's neighbours are never touched).
                        _micro_tile(a_panel, b_panel, _at(tile, 0), kc, nr, 0, mr, nr)
                        for i in range(height):
                            for j in range(width):
                                if add:
                                    c[ci + i, cj + j] += tile[i, j]
                                else:
                                    c[ci + i, cj + j] = tile[i, j]


def gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[...] = a @ b`` on the calling thread alone.

    Parameters
    ----------
    a : ndarray, (M, K)
    b : ndarray, (K, N)
        Same dtype as ``a``, float32 or float64; any strides.
    out : ndarray, (M, N)
        Same dtype, unit stride along its rows (any row stride: a view into a larger array
        is fine, and nothing outside it is written).

    Returns
    -------
    out
    """
    dtype = _check("gemm", f"{a.shape} @ {b.shape}", a, b, out, (a.shape[0], b.shape[-1]),
                   a.shape[-1] == b.shape[0], {"out": out})
    mr, nv = tile_shape(dtype)
    nr = nv * vector_lanes(dtype)
    _gemm(a, b, out, mr, nr, 12 * mr, 64 * nr, KC)
    return out


@serial_jit
def _gram_tiles(a, b, out, add, mr, nr, kc, fetch, tall, short):
    """out[:F', :K'] (= or +=) a[:, :F'].T @ b[:, :K'] by whole tiles NR columns wide (K'
    the multiple of NR): ``tall`` rows of MR-row tiles, then ``short`` rows of STREAM_TILE's
    shorter ones (the same NR; F' = tall * MR + short * its rows), the micro-kernel reading
    a's and b's rows in place, chunks of ``kc`` rows; with ``fetch``, each chunk's tiles
    prefetch the next."""
    m = a.shape[0]
    lda = a.strides[0] // a.itemsize
    ldb = b.strides[0] // b.itemsize
    ldc = out.strides[0] // out.itemsize
    line = 64 // a.itemsize
    low = STREAM_TILE[0]
    tiles = (tall + short) * (b.shape[1] // nr)
    for p0 in range(0, m, kc):
        depth = min(kc, m - p0)
        adding = 1 if add or p0 > 0 else 0
        # The next chunk's rows of a, then of b (each a run of lines from its first row's
        # start to its last row's end), prefetched a share a tile, one line every 2**shift
        # steps: the chunks come from memory, in rows the hardware prefetchers start on late.
        ahead = min(kc, m - p0 - depth) if fetch else 0
        a_lines = -(-((ahead - 1) * lda + a.shape[1]) // line) if ahead > 0 else 0
        b_lines = -(-((ahead - 1) * ldb + b.shape[1]) // line) if ahead > 0 else 0
        share = -(-(a_lines + b_lines) // tiles)
        shift = 0               # the longest step between fetches that still covers a share
        # (a share of one line is covered by any step: stop once a step spans the chunk)
        while share > 0 and (depth - 1) >> shift > 0 and \
                ((depth - 1) >> (shift + 1)) + 1 >= share:
            shift += 1
        t = 0
        for row in range(tall + short):
            i = row * mr if row < tall else tall * mr + (row - tall) * low
            for j in range(0, b.shape[1] - nr + 1, nr):
                first = t * share
                fs = line if share and first < a_lines + b_lines else 0
                if fs and first < a_lines:
                    fp = _at(a, (p0 + depth) * lda + first * line)
                    left = a_lines - first
                elif fs:
                    fp = _at(b, (p0 + depth) * ldb + (first - a_lines) * line)
                    left = a_lines + b_lines - first
                else:
                    fp = _at(a, p0 * lda)
                    left = 1
                if fs and ((depth - 1) >> shift) >= left:
                    fs = 0          # a share that would run past its operand's chunk
                t += 1
                if row < tall:
                    _micro_tile_fetching_whole(_at(a, p0 * lda + i), _at(b, p0 * ldb + j),
                                               _at(out, i * ldc + j), depth, ldc, adding, lda,
                                               ldb, fp, fs, shift)
                else:
                    _micro_tile_fetching(_at(a, p0 * lda + i), _at(b, p0 * ldb + j),
                                         _at(out, i * ldc + j), depth, ldc, adding, lda, ldb,
                                         fp, fs, shift)


@serial_jit
def _band(src, at, lda, b, c, ci, ldc, depth, j0, j1, mr, nr, kc, tile, edge, rows):
    """C's rows ci .. ci + rows (rows <= MR) times b's columns j0 .. j1 (j1 - j0 a multiple
    of NR): A's band at ``src``'s element ``at`` (MR rows, ``lda`` apart), KC-deep chunks
    into the band's tiles, which stay in L1 from chunk to chunk. ``edge`` (rows < MR): each
    tile goes through the scratch ``tile`` and its first ``rows`` rows are copied out."""
    ldb = b.strides[0] // b.itemsize
    for p0 in range(0, depth, kc):
        chunk = min(kc, depth - p0)
        add = 1 if p0 > 0 else 0
        for j in range(j0, j1, nr):
            if edge:
                _micro_tile_strided(_at(src, at + p0), lda, _at(b, p0 * ldb + j),
                                    _at(tile, (j - j0) * mr), chunk, nr, add, 1, ldb)
            else:
                _micro_tile_strided(_at(src, at + p0), lda, _at(b, p0 * ldb + j),
                                    _at(c, ci * ldc + j), chunk, ldc, add, 1, ldb)
    if edge:
        for j in range(j0, j1, nr):
            for i in range(rows):
                for q in range(nr):
                    c[ci + i, j + q] = tile[(j - j0) * mr + i * nr + q]


@serial_jit
def _rows_product(a, b, bedge, c, mr, nr, kc, nc):
    """c = a @ b, every value through the micro-kernel: whole MR x NR tiles in place, the
    last N % NR columns from ``bedge`` (K x NR: those columns of b, zero-padded) and the last
    M % MR rows from a zero-padded copy, both through a scratch tile. Before each band of
    whole tiles, the lines of c's band ROWS_STORE_AHEAD bands on are fetched for writing."""
    m, depth = a.shape
    n = b.shape[1]
    lda = a.strides[0] // a.itemsize
    ldc = c.strides[0] // c.itemsize
    whole_rows, whole_cols = m - m % mr, n - n % nr
    rest = n - whole_cols
    tile = np.empty(max(nc, nr) * mr, c.dtype)
    last = np.zeros((mr, depth), c.dtype)
    for i in range(m - whole_rows):
        for p in range(depth):
            last[i, p] = a[whole_rows + i, p]
    for j0 in range(0, whole_cols, nc):
        j1 = min(whole_cols, j0 + nc)
        for i in range(0, whole_rows, mr):
            if i + (ROWS_STORE_AHEAD + 1) * mr <= whole_rows:
                for r in range(i + ROWS_STORE_AHEAD * mr, i + (ROWS_STORE_AHEAD + 1) * mr):
                    _prefetch_for_writing(_at(c, r * ldc + j0), (j1 - j0) * c.itemsize)
            _band(a, i * lda, lda, b, c, i, ldc, depth, j0, j1, mr, nr, kc, tile, False, mr)
        if whole_rows < m:
            _band(last, 0, depth, b, c, whole_rows, ldc, depth, j0, j1, mr, nr, kc, tile,
                  True, m - whole_rows)
    if rest:
        scratch = np.empty((m, nr), c.dtype)
        for i in range(0, whole_rows, mr):
            _band(a, i * lda, lda, bedge, scratch, i, nr, depth, 0, nr, mr, nr, kc, tile,
                  False, mr)
        if whole_rows < m:
            _band(last, 0, depth, bedge, scratch, whole_rows, nr, depth, 0, nr, mr, nr, kc,
                  tile, True, m - whole_rows)
        for i in range(m):
            for q in range(rest):
                c[i, whole_cols + q] = scratch[i, q]


@parallel_jit
def _rows_parts(a, b, bedge, c, mr, nr, kc, nc, workers):
    """c = a @ b by :func:`_rows_product`, a contiguous run of whole MR-row bands to each of
    ``workers`` threads (only the last run can end in a part band)."""
    bands = -(-a.shape[0] // mr)
    share = -(-bands // workers) * mr
    for worker in prange(workers):
        r0 = min(a.shape[0], worker * share)
        r1 = min(a.shape[0], r0 + share)
        if r1 > r0:
            _rows_product(a[r0:r1], b, bedge, c[r0:r1], mr, nr, kc, nc)


#: rows_gemm's depth chunks: KC of the shared dimension between a tile's loads and stores.
ROWS_KC = 256
#: The most bytes of b in one block of rows_gemm's columns (NC of them, whole tiles): every
#: band of rows reads the whole block, which stays in L2 beside the rows of a and c streaming
#: through; larger blocks spill from L2, smaller ones make a pass over a for each.
ROWS_B_BYTES = 512 * 1024
#: Bands between the one rows_gemm multiplies and the one whose output lines it fetches for
#: writing: the stores then find their lines in cache instead of waiting on memory; further
#: ahead holds the lines in L1 longer.
ROWS_STORE_AHEAD = 2


def rows_columns(depth: int, columns: int, dtype) -> int:
    """NC, the columns of one block of b (``depth`` x ``columns``) in rows_gemm: the fewest
    blocks of at most ROWS_B_BYTES, as even as whole NR-column tiles make them."""
    nr = strided_shape(dtype)[1] * vector_lanes(dtype)
    blocks = max(1, -(-depth * columns * np.dtype(dtype).itemsize // ROWS_B_BYTES))
    return max(nr, -(-(-(-columns // blocks)) // nr) * nr)


def rows_gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray, workers: int = 1) -> np.ndarray:
    """``out[...] = a @ b`` without packing either operand, on the calling thread or on
    ``workers`` threads.

    The channels-last 1x1 data gradient's product, dy's rows (M, K) times the weights
    (K, C): the strided micro-kernel (:func:`strided_shape`) reads MR rows of a where they
    lie, MR values of one step a row apart, and b's rows in place; the last M % MR rows and
    N % NR columns go through zero-padded copies and a scratch tile. Every value is one
    micro-kernel sum, so a row's result does not depend on which other rows share the call
    (rows may be shared out among threads in any runs: the same bits). BLAS packs a, each
    value of which is used only N times; where M is long and K, N short, reading it in
    place wins. Measured on two cores (Zen 3, AVX2, float32, rows split among the tile
    workers, medians of 25 alternating rounds), M x K x N against np.matmul: 25,086 x 256 x
    64 133 against 120 GFLOP/s, 25,086 x 64 x 256 156 against 102, 25,086 x 64 x 64 95
    against 60, 25,086 x 128 x 128 81 against 73, 6,270 x 128 x 512 155 against 144; but
    6,270 x 512 x 128 153 against 156, 6,270 x 256 x 128 78 against 82, 1,566 x 256 x 1,024
    89 against 135, 390 x 512 x 2,048 58 against 108 (few rows, each re-read for every
    block of columns).

    Parameters
    ----------
    a : ndarray, (M, K)
    b : ndarray, (K, N)
        float32 or float64, one dtype; unit stride along rows.
    out : ndarray, (M, N)
        Same dtype, unit stride along rows; nothing outside it is written.
    workers : int
        Threads that share the rows, in one parallel region (a contiguous run of whole
        micro-kernel bands each; no more threads than Numba's count run at once). The
        result is bitwise the same for any number.

    Returns
    -------
    out
    """
    dtype = _check("rows_gemm", f"{a.shape} @ {b.shape}", a, b, out,
                   (a.shape[0], b.shape[-1]), a.shape[-1] == b.shape[0],
                   {"a": a, "b": b, "out": out})
    if a.shape[1] == 0:
        out[...] = 0
        return out
    mr, nv = strided_shape(dtype)
    nr = nv * vector_lanes(dtype)
    columns = b.shape[1] - b.shape[1] % nr
    bedge = np.zeros((b.shape[0], nr), dtype)
    bedge[:, :b.shape[1] - columns] = b[:, columns:]
    workers = min(workers, -(-a.shape[0] // mr))
    nc = rows_columns(b.shape[0], b.shape[1], dtype)
    if out.size and workers > 1:
        _rows_parts(a, b, bedge, out, mr, nr, ROWS_KC, nc, workers)
    elif out.size:
        _rows_product(a, b, bedge, out, mr, nr, ROWS_KC, nc)
    return out


def _check(name: str, product: str, a, b, out, out_shape: tuple, shared: bool,
           rows: dict) -> np.dtype:
    """Validate a product's operands: 2D, one float dtype, matching shapes (``shared``: the
    shared dimension agrees), unit stride along the rows of the arrays in ``rows`` (by
    name). Returns the dtype."""
    dtype = out.dtype
    if dtype not in (np.float32, np.float64) or a.dtype != dtype or b.dtype != dtype:
        raise TypeError(f"{name}: expected float32 or float64 operands of one dtype, got "
                        f"{a.dtype}, {b.dtype}, {out.dtype}")
    if a.ndim != 2 or b.ndim != 2 or not shared or out.shape != out_shape:
        raise ValueError(f"{name}: shapes {product} -> {out.shape} do not match")
    for label, array in rows.items():
        if not _unit_rows(array):
            raise ValueError(f"{name}: {label} needs unit stride along its rows")
    return dtype


def _unit_rows(array) -> bool:
    return array.ndim == 2 and (array.size == 0 or array.shape[1] == 1
                                or array.strides[1] == array.itemsize)


#: Bytes of both operands' rows per chunk of :func:`gram_runs`: a chunk and the next,
#: prefetched while it is multiplied, stay in L2 together; longer chunks load and store each
#: accumulator tile less often.
GRAM_CHUNK_BYTES = 160 * 1024


def gram(a: np.ndarray, b: np.ndarray, out: np.ndarray, add: bool = False) -> np.ndarray:
    """``out (=|+=) a.T @ b`` for two operands that share their rows, without packing.

    The weight gradient's product: a's rows are packed windows (or x's pixels), b's rows
    dy's pixels, both with unit stride along the row. The micro-kernel reads them where they
    lie, MR columns of a and NR of b at a time (no copy into panels, where BLAS copies both),
    in chunks of rows whose part of b stays in L2; the few columns past the last whole tile
    go to NumPy. A fixed order of additions: the same inputs give bitwise the same result.

    Measured on one core (Zen 4), the 7x7 stem's weight gradient on one row tile of
    channels-last windows (7,056 positions x 147 features @ 64 outputs): 109 GFLOP/s on the
    whole tiles, against 80 for ``np.matmul(a.T, b)`` (OpenBLAS).

    Parameters
    ----------
    a : ndarray, (M, F)
    b : ndarray, (M, K)
        float32 or float64, one dtype; unit stride along rows.
    out : ndarray, (F, K)
        Same dtype, unit stride along rows.
    add : bool
        Add to ``out`` instead of overwriting it.

    Returns
    -------
    out
    """
    dtype = _check("gram", f"{a.shape}.T @ {b.shape}", a, b, out, (a.shape[-1], b.shape[-1]),
                   a.shape[0] == b.shape[0], {"a": a, "b": b, "out": out})
    mr, nv = tile_shape(dtype)
    nr = nv * vector_lanes(dtype)
    if a.shape[0] == 0:
        if not add:
            out[...] = 0
        return out
    if a.shape[1] >= mr and b.shape[1] >= nr:
        # Rows per chunk, 64..512: b's part about 128 KiB.
        depth = min(512, max(64, 2**17 // (b.shape[1] * b.itemsize)))
        _gram_tiles(a, b, out, add, mr, nr, depth, False, a.shape[1] // mr, 0)
    _gram_rest(a, b, out, add, mr, nr)
    return out


def gram_runs(a: np.ndarray, b: np.ndarray, out: np.ndarray, run: int,
              workers: int = 1) -> np.ndarray:
    """``out[r] = a[rows].T @ b[rows]`` for the runs of ``run`` rows (the last may be
    shorter), r = 0, 1, ...: :func:`gram` for operands that come from memory (the
    channels-last 1x1 weight gradient's x and dy, not windows just packed). Each run goes by
    chunks of both operands' rows of about GRAM_CHUNK_BYTES, each chunk's tiles prefetching
    the next; a's columns by tiles of MR and of STREAM_TILE's rows (:func:`gram_tile_rows`),
    the few past them through a zero-padded copy. The runs are shared out among ``workers``
    threads in one parallel region (a contiguous share each); only the columns of b past the
    last whole tile (or everything, where a has fewer than MR columns or b fewer than NR) go
    to NumPy, after it. Each run's sum is the same bits for any ``workers``.

    Parameters
    ----------
    a : ndarray, (M, F)
    b : ndarray, (M, K)
        float32 or float64, one dtype; unit stride along rows.
    out : ndarray, (R, F, K)
        R = ceil(M / run) (at least 1); same dtype, unit stride along rows.
    run : int
        Rows a run, >= 1.
    workers : int
        Threads that share the runs.

    Returns
    -------
    out
    """
    runs = max(1, -(-a.shape[0] // run))
    if out.ndim != 3 or out.shape[0] != runs:
        raise ValueError(f"gram_runs: out {out.shape} needs {runs} runs of "
                         f"{a.shape[0]} rows by {run}")
    # Every run's output has out[0]'s shape and strides: one check covers them all.
    _check("gram_runs", f"{a.shape}.T @ {b.shape}", a, b, out[0], (a.shape[-1], b.shape[-1]),
           a.shape[0] == b.shape[0], {"a": a, "b": b, "out": out[0]})
    mr, nv = tile_shape(out.dtype)
    nr = nv * vector_lanes(out.dtype)
    if a.shape[0] == 0:
        out[...] = 0
        return out
    columns = b.shape[1] - b.shape[1] % nr
    if a.shape[1] < mr or columns == 0:
        columns = 0
    else:
        depth = min(512, max(64, GRAM_CHUNK_BYTES // ((a.shape[1] + b.shape[1]) * b.itemsize)))
        _gram_runs(a, b[:, :columns], out[:, :, :columns], run, min(workers, runs), mr, nr,
                   depth, *gram_tile_rows(a.shape[1], out.dtype))
    if columns < b.shape[1]:
        for index in range(runs):
            rows = slice(index * run, (index + 1) * run)
            np.matmul(a[rows].T, b[rows, columns:], out=out[index, :, columns:])
    return out


def gram_tile_rows(rows: int, dtype) -> tuple:
    """(tall, short): how :func:`gram_runs` covers ``rows`` rows of tiles in place, ``tall``
    of :func:`tile_shape`'s MR rows then ``short`` of STREAM_TILE's (the same width), so that
    fewer rows than either tile's are left to a zero-padded copy: 256 rows as 20 x 12 + 2 x 8
    (a row of 12-row tiles over the last 4 rows would compute 8 of padding). Only MR-row
    tiles where STREAM_TILE's are not the shorter (256-bit vectors: 6 x 2)."""
    mr, low = tile_shape(dtype)[0], STREAM_TILE[0]
    if low >= mr:
        return rows // mr, 0
    tall, rest = divmod(rows, mr)
    short, rest = divmod(rest, low)
    if rest and tall and (rest + mr) % low == 0:
        tall, short = tall - 1, short + (rest + mr) // low
    return tall, short


@parallel_jit
def _gram_runs(a, b, out, run, workers, mr, nr, depth, tall, short):
    """The tiles of :func:`gram_runs` (b's columns a multiple of NR, a's at least MR): a
    contiguous share of the runs to each of ``workers`` threads, ``tall`` and ``short`` rows
    of tiles in place (:func:`_gram_tiles`); a's columns past them copied into a zero-padded
    MR-wide block, whose tiles go through a scratch output."""
    runs = out.shape[0]
    share = -(-runs // workers)
    whole = tall * mr + short * STREAM_TILE[0]
    for worker in prange(workers):
        edge = np.zeros((run if whole < a.shape[1] else 0, mr), a.dtype)
        scratch = np.empty((mr, b.shape[1]), a.dtype)
        for index in range(worker * share, min(runs, (worker + 1) * share)):
            first = index * run
            last = min(a.shape[0], first + run)
            _gram_tiles(a[first:last], b[first:last], out[index], False, mr, nr, depth, True,
                        tall, short)
            if whole < a.shape[1]:
                for p in range(last - first):
                    for i in range(a.shape[1] - whole):
                        edge[p, i] = a[first + p, whole + i]
                _gram_tiles(edge[:last - first], b[first:last], scratch, False, mr, nr, depth,
                            True, 1, 0)
                for i in range(a.shape[1] - whole):
                    for j in range(b.shape[1]):
                        out[index, whole + i, j] = scratch[i, j]


def _gram_rest(a, b, out, add, mr, nr) -> None:
    """The part of ``out (=|+=) a.T @ b`` past the whole MR x NR tiles, by NumPy."""
    rows, columns = a.shape[1] - a.shape[1] % mr, b.shape[1] - b.shape[1] % nr
    for part, lhs, rhs in ((out[rows:], a[:, rows:], b),
                           (out[:rows, columns:], a[:, :rows], b[:, columns:])):
        if part.size:
            if add:
                part += lhs.T @ rhs
            else:
                np.matmul(lhs.T, rhs, out=part)


class RowPanels:
    """A matrix packed once into panels of MR rows, for :meth:`multiply` to use many times:
    the recurrent networks' ``W_hh`` (and its transpose), multiplied by a new thin matrix
    (one step's states) at every step.

    ``panels[p, k, i]`` is row ``p * MR + i`` of the matrix at column ``k``, zero past its
    last row: the layout the micro-kernel reads A in. BLAS packs both operands on every
    call; with the weights packed once per call, only the thin operand is copied (into
    :meth:`columns`, transposed and zero-padded to whole NR-column tiles).

    Every value of the product is one micro-kernel sum in KC-deep chunks, added in order,
    however the panels are shared out (:meth:`multiply`'s ``start``, ``stop``): the bits do
    not depend on the thread count.
    """

    def __init__(self, a: np.ndarray, height: Optional[int] = None):
        if a.ndim != 2 or a.dtype not in (np.float32, np.float64):
            raise TypeError(f"RowPanels: expected a 2D float32 or float64 matrix, got "
                            f"{a.dtype} {a.shape}")
        self.dtype = a.dtype
        self.rows, self.depth = a.shape
        self.mr = tile_shape(a.dtype)[0]
        self.nr = self.tile_columns(a.dtype)
        #: Rows a panel: MR (the left operand of :meth:`multiply`) or NR (the right one of
        #: :func:`columns_product`).
        self.height = self.mr if height is None else height
        count = -(-self.rows // self.height)
        self.panels = np.zeros((count, self.depth, self.height), a.dtype)
        self.refill(a)

    def refill(self, a: np.ndarray) -> None:
        """Pack ``a``, of the shape and dtype the panels were made for, in their place."""
        if a.shape != (self.rows, self.depth) or a.dtype != self.dtype:
            raise ValueError(f"RowPanels.refill: {a.dtype} {a.shape} is not the "
                             f"{self.dtype} {(self.rows, self.depth)} the panels hold")
        item = a.itemsize
        if a.size == 0:
            return
        if a.strides[1] == item and a.strides[0] % item == 0 and a.strides[0] > 0:
            _pack_by_transposes(a, self.panels, self.rows, vector_lanes(self.dtype))
        elif a.strides[0] == item and a.strides[1] % item == 0 and a.strides[1] > 0:
            self._pack_transposed(a)
        else:
            _pack_panels(a, self.panels, self.rows)

    def _pack_transposed(self, a: np.ndarray) -> None:
        """:meth:`refill` for ``a`` with unit stride down its columns (W_hh.T, a view): a
        panel's ``height`` values for one k lie one after another in a's memory, runs that
        NumPy copies whole (from a's transpose cut into runs, one panel a run), faster than
        a Numba loop copying run after run (docs/cpu-algorithms.md, "Recurrent networks").
        The last panel's rows past a's are left as they are."""
        rows_of, height = a.T, self.height
        whole = self.rows // height
        self.panels[:whole] = rows_of[:, :whole * height].reshape(
            self.depth, whole, height).transpose(1, 0, 2)
        if self.rows % height:
            self.panels[whole, :, :self.rows % height] = rows_of[:, whole * height:]

    @staticmethod
    def tile_columns(dtype) -> int:
        """NR, the columns of a micro-kernel tile: :meth:`columns` pads to a multiple."""
        return tile_shape(dtype)[1] * vector_lanes(dtype)

    @property
    def count(self) -> int:
        """Panels (MR rows each)."""
        return self.panels.shape[0]

    def columns(self, width: int) -> np.ndarray:
        """A zeroed (depth, width rounded up to NR) right operand for :meth:`multiply`:
        fill its first ``width`` columns."""
        return np.zeros((self.depth, -(-width // self.nr) * self.nr), self.dtype)

    def load(self, src: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``b[:, :width] = src.T`` for ``src`` (width, depth) with unit stride along its
        rows, ``b`` from :meth:`columns`: vector-lane blocks transposed in registers."""
        if src.ndim != 2 or src.shape[1] != self.depth or src.dtype != self.dtype:
            raise ValueError(f"RowPanels.load: {src.dtype} {src.shape} does not fit "
                             f"{self.depth} rows of {b.shape[1]} columns")
        return load_columns(src, b)

    def output(self, width: int) -> np.ndarray:
        """An (MR * count, width rounded up to NR) product buffer; the product proper is
        ``[:rows, :width]``."""
        return np.empty((self.count * self.mr, -(-width // self.nr) * self.nr), self.dtype)

    def multiply(self, b: np.ndarray, out: np.ndarray, start: int = 0,
                 stop: Optional[int] = None) -> np.ndarray:
        """``out[start*MR:stop*MR] = (the matrix's rows in panels start..stop) @ b`` on the
        calling thread; ``b`` from :meth:`columns`, ``out`` from :meth:`output`."""
        stop = self.count if stop is None else stop
        if self.height != self.mr or not 0 <= start <= stop <= self.count \
                or b.shape != (self.depth, out.shape[1]) \
                or out.shape[0] != self.count * self.mr or out.shape[1] % self.nr \
                or not (b.flags.c_contiguous and out.flags.c_contiguous):
            raise ValueError(f"RowPanels.multiply: b {b.shape} and out {out.shape} do not "
                             f"match panels of {self.rows} x {self.depth}")
        _panels_product(self.panels, b, out, start, stop, self.mr, self.nr, KC)
        return out


@serial_jit
def _pack_panels(a, panels, rows):
    """panels[p, k, i] = a[p * height + i, k] for the ``rows`` rows of ``a`` (any strides);
    the last panel's rows past them are left as they are (zero)."""
    count, depth, height = panels.shape
    for p in range(count):
        first = p * height
        for k in range(depth):
            for i in range(min(height, rows - first)):
                panels[p, k, i] = a[first + i, k]


@serial_jit
def _pack_by_transposes(a, panels, rows, lanes):
    """:func:`_pack_panels` for ``a`` with unit stride along its rows (W_hh): each panel the
    transpose of ``height`` rows, in lanes x lanes register blocks (:func:`_transpose`);
    several times faster than NumPy's strided copy (docs/cpu-algorithms.md, "Recurrent
    networks")."""
    count, depth, height = panels.shape
    lds = a.strides[0] // a.itemsize
    flat_a = carray(_at(a, 0), (rows - 1) * lds + depth)
    flat_p = panels.reshape(-1)
    for p in range(count):
        first = p * height
        _transpose(flat_a, first * lds, lds, flat_p, p * depth * height, height,
                   min(height, rows - first), depth, lanes)


def state_columns(rows: int, depth: int, dtype) -> np.ndarray:
    """A zeroed (depth, pitch) buffer for the transposed left operand of
    :func:`columns_product` (``rows`` x ``depth``; fill it with :func:`load_columns`): the
    pitch holds whole tiles of :func:`panel_rows` rows, rounded up to whole vectors."""
    height = panel_rows(rows, dtype)
    lanes = vector_lanes(dtype)
    return np.zeros((depth, -(-(-(-rows // height) * height) // lanes) * lanes), dtype)


def load_columns(src: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """``columns[:, :rows] = src.T`` for ``src`` (rows, depth) with unit stride along its
    rows: vector-lane blocks transposed in registers (:meth:`RowPanels.load` too)."""
    if src.ndim != 2 or columns.ndim != 2 or src.shape[1] != columns.shape[0] \
            or src.shape[0] > columns.shape[1] or src.dtype != columns.dtype \
            or not _unit_rows(src) or not columns.flags.c_contiguous:
        raise ValueError(f"load_columns: {src.dtype} {src.shape} does not fit columns "
                         f"{columns.dtype} {columns.shape}")
    _transpose_into(src, columns, vector_lanes(src.dtype))
    return columns


def columns_product(columns: np.ndarray, rows: int, b: RowPanels, out: np.ndarray,
                    start: int = 0, stop: Optional[int] = None) -> np.ndarray:
    """``out[:, start*NR:stop*NR] = A @ B.T`` on the calling thread, for A (``rows`` x
    depth) given transposed in ``columns`` (:func:`state_columns`, :func:`load_columns`)
    and B packed in panels of NR rows (``RowPanels(b, height=NR)``): the micro-kernel reads
    A's tiles of :func:`panel_rows` rows where they lie in ``columns`` (one row of it a
    step), so A is never packed. out is (A's tiles x their height, B's panels x NR),
    C-contiguous, the product proper ``[:rows, :B rows]``. The recurrences' product the
    other way round from :meth:`RowPanels.multiply` (the states as A, transposed each step;
    the weights as B, packed once), which pads the states to NR columns where this pads
    them to whole tiles. A value's bits depend neither on ``start``, ``stop`` nor on the
    tiles' height (each is one fused multiply-add chain over the depth, in KC-deep chunks
    added in order)."""
    stop = b.count if stop is None else stop
    height = panel_rows(rows, b.dtype)
    count = -(-rows // height)
    if b.height != b.nr or columns.ndim != 2 or columns.shape[0] != b.depth \
            or columns.shape[1] < count * height or columns.dtype != b.dtype \
            or not columns.flags.c_contiguous or not 0 <= start <= stop <= b.count \
            or out.shape != (count * height, b.count * b.height) \
            or out.dtype != b.dtype or not out.flags.c_contiguous:
        raise ValueError(f"columns_product: {rows} rows in columns {columns.shape} and "
                         f"panels of {b.rows} x {b.depth} do not match out {out.shape}")
    _columns_kernel(height, b.mr)(columns, b.panels, out, start, stop, count, height, b.nr,
                                  KC)
    return out


def _columns_kernel(height: int, mr: int):
    """:func:`_columns_by_panels` on tiles of ``height`` rows: itself for MR, else its twin
    (compiled on first use, then cached on disk like the rest)."""
    if height == mr:
        return _columns_by_panels
    return kernel_twin(_columns_by_panels, f"rows{height}", serial_jit,
                       _micro_tile=micro_tile_rows(height))


@serial_jit
def _columns_by_panels(columns, bp, c, start, stop, count, height, nr, kc_block):
    """c[:, start*NR:stop*NR] = A @ B.T, A's ``count`` tiles of ``height`` rows read in
    place from ``columns`` (depth, pitch), A[i, k] = columns[k, i]."""
    depth, pitch = columns.shape
    ldc = c.shape[1]
    if depth == 0:
        c[:, start * nr:stop * nr] = 0
        return
    for jp in range(start, stop):
        for p0 in range(0, depth, kc_block):
            kc = min(kc_block, depth - p0)
            add = 1 if p0 > 0 else 0
            for ip in range(count):
                _micro_tile(_at(columns, p0 * pitch + ip * height),
                            _at(bp, (jp * depth + p0) * nr),
                            _at(c, ip * height * ldc + jp * nr), kc, ldc, add, pitch, nr)


def planes_product(columns: np.ndarray, step: int, pitch: int, rows: int, depth: int,
                   panels: np.ndarray, panel_step: int, out: np.ndarray, out_step: int,
                   planes: int, ldb: Optional[int] = None) -> None:
    """``out`` plane q (rows x NR, row-major) = A_q @ B_q on the calling thread, for the
    ``planes`` planes q, each A_q (``rows`` x ``depth``) read in place from ``columns``
    transposed, A_q[i, k] = columns[q * step + k * pitch + i], and B_q NR columns,
    B_q[k, j] = panels[q * panel_step + k * ldb + j] (``ldb`` NR: one packed panel; any
    other: NR columns of a matrix ``ldb`` wide read in place, those past its last computed
    from whatever lies there); out[q * out_step + i * NR + j].

    A is read in tiles of MR rows: out's planes hold whole tiles (``rows`` rounded up to
    MR), whose rows past ``rows`` are computed from whatever lies past A's (``columns``
    must reach that far: checked) and are not part of the product; B's NR columns likewise
    (``panels`` must hold them whole). The Winograd products of few tiles and many channels
    (``_winograd._forward_by_panels``: U transposed once, V's panels made as needed;
    ``_winograd._weight_gradient_by_panels``: U and D read where they lie). A value's bits
    depend only on ``depth`` (one fused multiply-add chain over it, in KC-deep chunks added
    in order)."""
    mr = tile_shape(columns.dtype)[0]
    nr = RowPanels.tile_columns(columns.dtype)
    ldb = nr if ldb is None else ldb
    count = -(-rows // mr)
    flat = (columns, panels, out)
    if any(a.ndim != 1 or a.dtype != columns.dtype or not a.flags.c_contiguous for a in flat) \
            or planes < 1 or depth < 1 or rows < 1 or pitch < rows or ldb < 1 \
            or min(step, panel_step, out_step) < 0 \
            or (planes - 1) * step + (depth - 1) * pitch + count * mr > columns.size \
            or (planes - 1) * panel_step + (depth - 1) * ldb + nr > panels.size \
            or (planes - 1) * out_step + count * mr * nr > out.size \
            or out_step < count * mr * nr and planes > 1:
        raise ValueError(f"planes_product: {planes} planes of {rows} x {depth} do not fit "
                         f"columns {columns.size}, panels {panels.size}, out {out.size}")
    _planes_by_panels(columns, step, pitch, depth, count, panels, panel_step, ldb, out,
                      out_step, planes, mr, nr, KC)


@serial_jit
def _planes_by_panels(columns, step, pitch, depth, count, panels, panel_step, ldb, out,
                      out_step, planes, mr, nr, kc_block):
    for q in range(planes):
        for p0 in range(0, depth, kc_block):
            kc = min(kc_block, depth - p0)
            add = 1 if p0 > 0 else 0
            b = _at(panels, q * panel_step + p0 * ldb)
            for ip in range(count):
                _micro_tile(_at(columns, q * step + p0 * pitch + ip * mr), b,
                            _at(out, q * out_step + ip * mr * nr), kc, nr, add, pitch, ldb)


@serial_jit
def _panels_product(panels, b, c, start, stop, mr, nr, kc_block):
    depth = panels.shape[1]
    n = b.shape[1]
    if depth == 0:
        c[start * mr:stop * mr, :] = 0
        return
    for ip in range(start, stop):
        for p0 in range(0, depth, kc_block):
            kc = min(kc_block, depth - p0)
            add = 1 if p0 > 0 else 0
            for j in range(0, n, nr):
                _micro_tile(_at(panels, (ip * depth + p0) * mr), _at(b, p0 * n + j),
                            _at(c, ip * mr * n + j), kc, n, add, mr, n)


@serial_jit
def _transpose(src, s0, lds, dst, d0, ldd, rows, columns, lanes):
    """dst[d0 + j * ldd + i] = src[s0 + i * lds + j] for i < rows, j < columns: whole
    lanes x lanes blocks in registers (_transpose_tile), the columns past them in 8 x 8 and
    4 x 4 blocks where the lanes are wider, the rest value by value (a plain loop ran at
    1.25 ns a value, 1 ms per stem image of dy; the edge blocks: docs/cpu-algorithms.md, the
    `implicit` weight gradient)."""
    whole_rows, whole_columns = rows - rows % lanes, columns - columns % lanes
    for i0 in range(0, whole_rows, lanes):
        for j0 in range(0, whole_columns, lanes):
            _transpose_tile(_at(src, s0 + i0 * lds + j0), lds, _at(dst, d0 + j0 * ldd + i0),
                            ldd)
        j0 = whole_columns
        if lanes > 8 and columns - j0 >= 8:
            for i in range(i0, i0 + lanes, 8):
                _transpose_tile8(_at(src, s0 + i * lds + j0), lds, _at(dst, d0 + j0 * ldd + i),
                                 ldd)
            j0 += 8
        if lanes > 4 and columns - j0 >= 4:
            for i in range(i0, i0 + lanes, 4):
                _transpose_tile4(_at(src, s0 + i * lds + j0), lds, _at(dst, d0 + j0 * ldd + i),
                                 ldd)
            j0 += 4
        for i in range(i0, i0 + lanes):
            for j in range(j0, columns):
                dst[d0 + j * ldd + i] = src[s0 + i * lds + j]
    for i in range(whole_rows, rows):
        for j in range(columns):
            dst[d0 + j * ldd + i] = src[s0 + i * lds + j]


#: The blocks of :func:`images_transposed`'s tasks, rows x columns of the source: a block
#: (16 KiB of float32) and its transpose stay in L1 while the register transpose moves it.
TRANSPOSE_BLOCK = (64, 64)


@parallel_jit
def images_transposed(src, dst, images, rows, columns, lanes):
    """dst[n, j, i] = src[n, i, j] for ``images`` row-major (rows x columns) matrices one
    after another in the flat arrays: a channels-first batch into channels-last (rows the
    channels) or back (columns the channels), by blocks shared among the threads, each moved
    by the register transpose (:func:`_transpose`)."""
    block_rows, block_columns = TRANSPOSE_BLOCK
    down = (rows + block_rows - 1) // block_rows
    across = (columns + block_columns - 1) // block_columns
    size = rows * columns
    for task in prange(images * down * across):
        n = task // (down * across)
        i0 = (task // across - n * down) * block_rows
        j0 = (task % across) * block_columns
        _transpose(src, n * size + i0 * columns + j0, columns, dst, n * size + j0 * rows + i0,
                   rows, min(block_rows, rows - i0), min(block_columns, columns - j0), lanes)


@serial_jit
def _transpose_into(src, dst, lanes):
    """dst[j, i] = src[i, j] for 2D arrays with unit stride along their rows: :func:`_transpose`
    on flat views of their memory."""
    rows, columns = src.shape
    lds = src.strides[0] // src.itemsize
    ldd = dst.strides[0] // dst.itemsize
    if rows == 0 or columns == 0:
        return
    flat_src = carray(_at(src, 0), (rows - 1) * lds + columns)
    flat_dst = carray(_at(dst, 0), (columns - 1) * ldd + rows)
    _transpose(flat_src, 0, lds, flat_dst, 0, ldd, rows, columns, lanes)
