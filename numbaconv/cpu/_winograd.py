"""Winograd F(2x2, 3x3): 2D 3x3 and 3D 3x3x3 convolutions with stride and dilation 1, one
group: the forward, the data gradient and the weight gradient (3D: F(2x2, 3x3) on each depth
slice, summed over the three depth taps in one product, see :func:`_forward3`). Wide enough
images take larger tiles, F(4x4, 3x3), in all three ops, 2D and 3D (:func:`forward_large`,
:func:`weight_gradient_large`, kernels in :mod:`._winograd_f4`;
``_heuristics.winograd_large_tiles`` decides); a forward form with fewer 2x2 tiles than
output channels runs by blocks of output channels (:func:`_forward_by_outputs`), with far
fewer by panels of them on the micro-kernel (:func:`_forward_by_panels`; the weight
gradient too, :func:`_weight_gradient_by_panels`).

Each 2x2 block of output pixels (a *tile*) needs the 4x4 input patch above it. With the
transforms of Lavin & Gray (2015), U = B^T d B of the patch and V = G g G^T of each 3x3
kernel, the tile is Y = A^T (sum over input channels of U ⊙ V) A: for each of the 16
positions xi of the transformed 4x4, one matrix product over channels,

    M[xi] (tiles x K) = U[xi] (tiles x C) @ V[xi] (C x K)          (channels-last)
    M[xi] (K x tiles) = V[xi] (K x C) @ U[xi] (C x tiles)          (channels-first)

16 products of 16 * tiles * C * K multiply-adds in all, where im2col's one product has
36 * tiles * C * K (4 pixels of 9 taps per tile): 2.25 times fewer. The transforms are
additions only (B, A) or done once per call (G, on the weights).

The tiles of the problem (over images, tile rows, tile columns) are cut into jobs of
consecutive tiles, shared out among the tile workers like im2col's tiles
(:func:`._tiles.run_tiles`): each job transforms its input patches into U, multiplies, and
transforms M into its output pixels, all in per-worker workspaces of a few MiB (U is 16/4
times the job's input pixels, M 16/4 times its output pixels), so that they stay in cache.
Patches that overlap the padding read clamped indices and multiply the values by zero
there; the others read x as it lies.

The stride-1 data gradient is the forward convolution of dy with the flipped, transposed
kernel (see :mod:`.conv_backward_data`); the weight transform flips and transposes as it
goes. The weight gradient runs the same jobs backwards (:func:`weight_gradient`): U of x,
dy's tiles transformed by A, 16 products per job summed over tiles, G^T on the sum.

Accuracy: the transforms add and subtract up to 16 values before the products and 9 after
them; measured in float32 against float64 results (ResNet 64c 56x56, 256c 14x14, 512c 7x7,
channels-last, the largest difference over the largest value), the data gradient 3.1-6.1e-7
and the weight gradient 4.5-5.8e-7, where im2col's are 3.5-4.1e-7 and 3.9-5.2e-7: the
same order (3D, 64c 8x28x28, both layouts: forward and data gradient 5.0-6.3e-7 against
4.1-5.1e-7). The transforms also combine non-finite values differently from the
reference's products (inf - inf is NaN where the reference may keep inf), so a job's output
transform reports whether any output it wrote is not finite, and the caller then computes
the problem again by im2col, which multiplies as the reference does.
"""

from __future__ import annotations

import numpy as np
from numba import prange, uint64

from ..config import parallel_jit, serial_jit
from .._kernel_geometry import Geom
from . import _heuristics, _tiles
from . import _winograd_f4 as f4
from ._microkernel import (TRANSPOSE_BLOCK, RowPanels, _at, _prefetch, _transpose,
                           planes_product, tile_shape, vector_lanes)
from ._winograd_f4 import _out, _tile

#: The transforms are parallel kernels (called on one thread in a tile worker, see
#: :func:`._tiles.run_tiles`): Numba marks the arrays of a ``prange`` body's function
#: ``noalias``, which lets LLVM vectorise their inner loops over channels or tiles.
#: Their helpers are compiled apart (``serial_jit``) and inlined by LLVM, not by Numba
#: (``inline_jit`` re-types every call site's copy: slower to compile, no faster; see
#: docs/cpu-algorithms.md, "Compile times").
#: Flat indices are uint64 throughout the transforms, so that Numba adds no negative-index
#: wraparound (which keeps LLVM from vectorising): mixed with a signed int, even a literal,
#: Numba's arithmetic is signed again, hence these constants.
_0, _1, _2, _3 = np.uint64(0), np.uint64(1), np.uint64(2), np.uint64(3)
_4, _8 = np.uint64(4), np.uint64(8)

#: U's bytes per job (16 transformed values per tile and input channel) that the jobs aim
#: at, so that a job's U and M stay in the L2/L3 caches between transform and product.
JOB_BYTES = 2 * 2**20
#: But at least this many tiles per job (the products' rows).
MIN_JOB_TILES = 64
#: F(4x4, 3x3)'s jobs: at least this many tiles, as each product packs a plane of V, 36 a
#: job (larger jobs: fewer packings, larger U and M in the caches).
LARGE_MIN_JOB_TILES = 128


def applies(g: Geom) -> bool:
    """Whether the forward-form geometry ``g`` is a 2D 3x3 convolution, or a 3D 3x3x3 one
    (see :func:`_forward3`), with stride and dilation 1 and one group (any padding)."""
    return (g.groups == 1 and g.stride == (1, 1, 1) and g.dilation == (1, 1, 1)
            and (g.r == (1, 3, 3) and g.s[0] == 1 and g.p[0] == 1 or g.r == (3, 3, 3)))


def require(g: Geom) -> None:
    """The ValueError of ``winograd`` forced on a geometry where it does not apply (the
    data gradient's geometry applies exactly where its forward form over dy does)."""
    if not applies(g):
        raise ValueError("algorithm: 'winograd' needs a 2D 3x3 or 3D 3x3x3 kernel, stride "
                         "and dilation 1 and one group")


def tile_grid(g: Geom, size: int = 2) -> tuple:
    """Tile rows and tile columns of one image: ceil(output size / ``size``) each."""
    return -(-g.p[1] // size), -(-g.p[2] // size)


def job_tiles(g: Geom, itemsize: int, size: int = 2) -> int:
    """Tiles per job: JOB_BYTES of U (or of M, whichever is larger), at least MIN_JOB_TILES
    (of ``size`` x ``size`` outputs: (size + 2)^2 values per tile and channel)."""
    per_tile = (size + 2) ** 2 * max(g.c, g.k) * itemsize
    least = MIN_JOB_TILES if size == 2 else LARGE_MIN_JOB_TILES
    return max(least, JOB_BYTES // per_tile)


def transformed_weights(g: Geom, w: np.ndarray, flipped: bool) -> np.ndarray:
    """V for the forward-form geometry ``g``: channels-last (16, C, K), channels-first
    (16, K, C). ``w`` is the forward weight (K, C, 3, 3) of ``g``, or, with ``flipped``, the
    data gradient's (C, K, 3, 3) weight (whose output channels are g's input channels), each
    tap flipped and each (K, C) block transposed on the fly. A 3D geometry's V is the three
    depth taps' V side by side, (16, 3 * C, K) or (16, K, 3 * C) (depth tap kd's channels
    kd * C to (kd + 1) * C; with ``flipped``, from w's depth tap 2 - kd). A 2D V lies in
    the calling thread's workspace ("weights_v"): valid until its next transform."""
    if g.r[0] == 3:
        v3 = np.empty((16, 3 * g.c, g.k) if g.channels_last else (16, g.k, 3 * g.c), w.dtype)
        for kd in range(3):
            plane = np.ascontiguousarray(w[:, :, 2 - kd if flipped else kd])
            v = transformed_weights(g._replace(r=(1, 3, 3)), plane, flipped)
            taps = slice(kd * g.c, (kd + 1) * g.c)
            if g.channels_last:
                v3[:, taps] = v
            else:
                v3[:, :, taps] = v
        return v3
    v = _tiles.scratch((16, g.c, g.k) if g.channels_last else (16, g.k, g.c), w.dtype,
                       "weights_v")
    # V's (middle, last) index is w's (first, second), or (second, first) with ``swap``.
    swap = g.channels_last != flipped

    def part(span, pick):
        pick(_weights)(w.reshape(-1), v.reshape(-1), np.uint64(v[0].size), *span, v.shape[1],
                       v.shape[2], swap, flipped, w.dtype.type(0.5), 0, v.shape[2])

    _tiles.run_tiles(part, _tiles.worker_ranges(
        v.shape[1], w.nbytes > _tiles.SHARED_RELAYOUT_ABOVE))
    return v


#: How many rows of w ahead :func:`_weights` fetches a block's runs: far enough to hide
#: the memory's latency behind a few rows' transforms, near enough to stay in L1
#: (docs/cpu-algorithms.md, "winograd: the weight transform's reads").
WEIGHT_RUNS_AHEAD = 4


@parallel_jit
def _weights(wf, vf, plane, first, last, rows, width, swap, flipped, half, b0, columns):
    """V[xi, a, b] = (G g G^T)[xi] for a in [first, last), b < width, where g is w[a, b0 +
    b] (w[b0 + b, a] with ``swap``; w's index a runs to ``rows``, the other to ``columns``;
    each tap flipped with ``flipped``), G = [[1, 0, 0], [1/2, 1/2, 1/2], [1/2, -1/2, 1/2],
    [0, 0, 1]]; V's planes ``plane`` values apart, its rows ``width``: a block of V's
    columns where b0 > 0 or width < columns (:func:`_forward_by_outputs`,
    :func:`_forward_by_panels`)."""
    height = uint64(rows)
    ws = uint64(width)
    first_b, cs = uint64(b0), uint64(columns)
    for a in prange(first, last):
        out = uint64(a) * ws
        # A block of V's columns (without ``swap``) reads a run of 9 * width values of w
        # for each a, a whole row of w from the last: the hardware prefetchers do not
        # follow, so the run WEIGHT_RUNS_AHEAD rows on is fetched now.
        if not swap and width < columns and a + WEIGHT_RUNS_AHEAD < last:
            _prefetch(_at(wf, (uint64(a + WEIGHT_RUNS_AHEAD) * cs + first_b) * uint64(9)),
                      width * 9 * wf.itemsize)
        for b in range(ws):
            at = ((first_b + b) * height + uint64(a) if swap
                  else uint64(a) * cs + first_b + b) * uint64(9)
            g00, g01, g02 = wf[at], wf[at + _1], wf[at + _2]
            g10, g11, g12 = wf[at + _3], wf[at + _4], wf[at + uint64(5)]
            g20, g21, g22 = wf[at + uint64(6)], wf[at + uint64(7)], wf[at + _8]
            if flipped:
                g00, g01, g02, g10, g12, g20, g21, g22 = g22, g21, g20, g12, g10, g02, g01, g00
            # G g: along the kernel's columns, then (G g) G^T: along each row of that.
            t0 = _g3(g00, g10, g20, half)
            t1 = _g3(g01, g11, g21, half)
            t2 = _g3(g02, g12, g22, half)
            o = out + b
            o = _store4(vf, o, plane, _g3(t0[0], t1[0], t2[0], half))
            o = _store4(vf, o, plane, _g3(t0[1], t1[1], t2[1], half))
            o = _store4(vf, o, plane, _g3(t0[2], t1[2], t2[2], half))
            _store4(vf, o, plane, _g3(t0[3], t1[3], t2[3], half))


@serial_jit
def _store4(vf, o, step, values):
    """vf[o + i * step] = values[i]; returns o + 4 * step."""
    vf[o] = values[0]
    o += step
    vf[o] = values[1]
    o += step
    vf[o] = values[2]
    o += step
    vf[o] = values[3]
    return o + step


@serial_jit
def _g3(a, b, c, half):
    """G applied to three values (``half``: 0.5 in their type)."""
    return a, (a + b + c) * half, (a - b + c) * half, c


def convolve(g: Geom, x: np.ndarray, w: np.ndarray, flipped: bool, y: np.ndarray) -> bool:
    """:func:`forward` with the weights ``w`` (as :func:`transformed_weights` takes them):
    by panels of output channels where ``_heuristics.winograd_by_panels`` says so
    (:func:`_forward_by_panels`, either layout). Otherwise a channels-first problem that
    runs faster channels-last (``_heuristics.winograd_via_copies``) runs on channels-last
    copies of x and y in the calling thread's scratch arrays
    (:func:`._tiles.via_channels_last`)."""
    copies = not g.channels_last and _heuristics.winograd_via_copies(g.c, g.k)
    if _heuristics.winograd_by_panels(g, x.itemsize) and not _heuristics.winograd_large_tiles(
            g._replace(channels_last=g.channels_last or copies), x.itemsize):
        return _forward_by_panels(g, x, w, flipped, y)
    if not copies:
        return _convolve(g, x, w, flipped, y)
    return _tiles.via_channels_last(lambda gl, x_cl, y_cl: _convolve(gl, x_cl, w, flipped, y_cl),
                                    g, x, g.c, "layout_x", y, g.k, "layout_y")


def _convolve(g: Geom, x: np.ndarray, w: np.ndarray, flipped: bool, y: np.ndarray) -> bool:
    """:func:`convolve` in ``g``'s own layout: F(4x4, 3x3) where
    ``_heuristics.winograd_large_tiles`` says so (:func:`forward_large`), else F(2x2, 3x3),
    by blocks of output channels where ``_heuristics.winograd_by_outputs`` says so
    (:func:`_forward_by_outputs`)."""
    if _heuristics.winograd_large_tiles(g, x.itemsize):
        return forward_large(g, x, large_weights(g, w, flipped), y)
    if _heuristics.winograd_by_outputs(g, x.itemsize):
        return _forward_by_outputs(g, x, w, flipped, y)
    return forward(g, x, transformed_weights(g, w, flipped), y)


#: Output channels per job of :func:`_forward_by_outputs`: each job's products pack all of U
#: again, so few large blocks, at the cost of V's block leaving L2.
OUTPUT_BLOCK = 256


def _forward_by_outputs(g: Geom, x: np.ndarray, w: np.ndarray, flipped: bool,
                        y: np.ndarray) -> bool:
    """:func:`forward` for a channels-last 2D geometry of few tiles and many channels, where
    V (16 values per weight) outweighs U: U of every tile once (jobs of tiles, into one
    array fresh for the call), then jobs of OUTPUT_BLOCK output channels, each transforming
    its block of the weights, multiplying U by it and writing its channels of y, so that V
    is never written whole and read back."""
    th, tw = tile_grid(g)
    total = g.n * th * tw
    big = np.finfo(x.dtype).max
    xf, yf = x.reshape(-1), y.reshape(-1)
    args = _input_args(g, th, tw, x.dtype)
    step = _plane_step(total * g.c, x.itemsize)
    uf = _tiles.scratch((16 * step,), x.dtype, "planes_u")
    u = np.lib.stride_tricks.as_strided(uf, (16, total, g.c), (step * x.itemsize,
                                                              g.c * x.itemsize, x.itemsize))

    def transform(span, pick):
        t0, t1 = span
        pick(_input_cl)(xf, uf[t0 * g.c:], np.uint64(step), t0, t1, *args, g.c)

    _tiles.run_tiles(transform, _tiles.worker_ranges(total, True))
    swap = not flipped

    def job(k0, pick):
        kb = min(OUTPUT_BLOCK, g.k - k0)
        v = _tiles.workspace((16, g.c, kb), x.dtype, "product")
        pick(_weights)(w.reshape(-1), v.reshape(-1), np.uint64(g.c * kb), 0, g.c, g.c, kb,
                       swap, flipped, x.dtype.type(0.5), k0, g.k)
        m, mf, mstep = _planes((total, kb), x.dtype, "rows")
        np.matmul(u, v, out=m)
        return pick(_output_cl)(mf, mstep, yf[k0:], 0, total, th, tw, g.p[1], g.p[2], kb,
                                big, g.k)

    return sum(_tiles.run_tiles(job, list(range(0, g.k, OUTPUT_BLOCK)))) == 0


#: Blocks of output channels (of one micro-kernel panel, NR, each) per job of
#: :func:`_forward_by_panels`: several jobs per worker even out a slower core, each job
#: costs a hand-over to a worker.
BLOCKS_PER_JOB = 2


def _panel_jobs(outputs: int, nr: int) -> list:
    """The jobs of the paths by panels: (first, stop) runs of BLOCKS_PER_JOB of the
    ``outputs`` channels' blocks of ``nr``."""
    blocks = -(-outputs // nr)
    return [(b, min(blocks, b + BLOCKS_PER_JOB)) for b in range(0, blocks, BLOCKS_PER_JOB)]


def _forward_by_panels(g: Geom, x: np.ndarray, w: np.ndarray, flipped: bool,
                       y: np.ndarray) -> bool:
    """:func:`forward` for a 2D geometry of very few tiles and many channels, where V (16
    values per weight) outweighs U so far that, written whole and read back, it would cost
    more memory traffic than the products take: U of every tile once, (16, tiles, C) by the
    channels-last transform (from a channels-last copy of a channels-first x), transposed
    to (16, C, tiles); then jobs of blocks of NR output channels (one micro-kernel panel),
    each block's V (16 planes of C x NR, a few hundred KiB) made by the weight transform
    and, while it is in the L2 cache, multiplied by U where U lies
    (:func:`._microkernel.planes_product`), then that block's channels of y (channels-last;
    a channels-first y through a channels-last copy). A value's bits do not depend on how
    the blocks are shared out."""
    th, tw = tile_grid(g)
    total = g.n * th * tw
    dtype = x.dtype
    mr, nr = tile_shape(dtype)[0], RowPanels.tile_columns(dtype)
    lanes = vector_lanes(dtype)
    xf = x.reshape(-1) if g.channels_last else _tiles.channels_last_copy(x, g.c, "layout_x")
    cl = g._replace(channels_last=True)
    # U (16, tiles, C) by the channels-last transform, then transposed: planes (C, tiles)
    # PLANE_SKEW bytes past a multiple of 4 KiB apart; the products read the last tile of
    # MR rows whole, up to MR - 1 values past a plane's rows: slack after the last.
    _, u_flat, u_step = _planes((total, g.c), dtype, "packed")
    step = int(u_step)
    uf = _tiles.scratch((16 * step + mr,), dtype, "planes_u")
    uf[16 * step:] = 0
    args = _input_args(cl, th, tw, dtype)

    def transform(span, pick):
        t0, t1 = span
        pick(_input_cl)(xf, u_flat[t0 * g.c:], u_step, t0, t1, *args, g.c)

    _tiles.run_tiles(transform, _tiles.worker_ranges(total, True))
    _tiles.run_tiles(lambda span, pick: pick(_planes_transposed)(
        u_flat, uf, step, total, g.c, lanes), [None])
    y_cl = y.reshape(-1) if g.channels_last else _tiles.scratch((y.size,), dtype, "layout_y")
    big, half = np.finfo(dtype).max, dtype.type(0.5)
    wf, swap, count = w.reshape(-1), not flipped, -(-total // mr)

    def job(span, pick):
        v3, v, vstep = _planes((g.c, nr), dtype, "product")
        m, mf, mstep = _planes((count * mr, nr), dtype, "rows")
        bad = 0
        for block in range(*span):
            k0 = block * nr
            width = min(nr, g.k - k0)
            if width == nr:
                pick(_weights)(wf, v, vstep, 0, g.c, g.c, nr, swap, flipped, half, k0, g.k)
            else:                           # the last block, zero-padded to a whole panel
                part = np.empty((16, g.c, width), dtype)
                pick(_weights)(wf, part.reshape(-1), np.uint64(g.c * width), 0, g.c, g.c,
                               width, swap, flipped, half, k0, g.k)
                v3[:, :, :width] = part
                v3[:, :, width:] = 0
            planes_product(uf, step, total, total, g.c, v, int(vstep), mf, int(mstep), 16)
            if width < nr:                  # M's planes (tiles, width) for the transform
                m_part, mf, m_step = _planes((total, width), dtype, "packed")
                m_part[...] = m[:, :total, :width]
            else:
                m_step = mstep
            bad += pick(_output_cl)(mf, m_step, y_cl[k0:], 0, total, th, tw, g.p[1], g.p[2],
                                    width, big, g.k)
        return bad

    if sum(_tiles.run_tiles(job, _panel_jobs(g.k, nr))):
        return False
    if not g.channels_last:
        _tiles.channels_first_into(y_cl, y, g.k)
    return True


@parallel_jit
def _planes_transposed(src, dst, step, rows, columns, lanes):
    """dst[q * step + j * rows + i] = src[q * step + i * columns + j] for the 16 planes q:
    each (rows x columns) plane transposed in place of its own, by blocks shared among the
    threads, each moved by the register transpose."""
    block_rows, block_columns = TRANSPOSE_BLOCK
    down = (rows + block_rows - 1) // block_rows
    across = (columns + block_columns - 1) // block_columns
    for task in prange(16 * down * across):
        q = task // (down * across)
        i0 = (task // across - q * down) * block_rows
        j0 = (task % across) * block_columns
        _transpose(src, q * step + i0 * columns + j0, columns, dst, q * step + j0 * rows + i0,
                   rows, min(block_rows, rows - i0), min(block_columns, columns - j0), lanes)


def large_weights(g: Geom, w: np.ndarray, flipped: bool) -> np.ndarray:
    """V (36, C, K) of F(4x4, 3x3) for the channels-last geometry ``g`` (``w`` and
    ``flipped`` as :func:`transformed_weights` takes them); 3D: the three depth taps' V
    side by side, (36, 3 * C, K), as there. A 2D V lies in the calling thread's workspace
    ("weights_v"): valid until its next transform."""
    if g.r[0] == 3:
        v3 = np.empty((36, 3 * g.c, g.k), w.dtype)
        for kd in range(3):
            plane = np.ascontiguousarray(w[:, :, 2 - kd if flipped else kd])
            v3[:, kd * g.c:(kd + 1) * g.c] = large_weights(g._replace(r=(1, 3, 3)), plane,
                                                           flipped)
        return v3
    v = _tiles.scratch((36, g.c, g.k), w.dtype, "weights_v")

    def part(span, pick):
        pick(f4._weights)(w.reshape(-1), v.reshape(-1), *span, g.k, not flipped, flipped,
                          f4.weight_constants(w.dtype))

    _tiles.run_tiles(part, _tiles.worker_ranges(g.c, w.nbytes > _tiles.SHARED_RELAYOUT_ABOVE))
    return v


def forward_large(g: Geom, x: np.ndarray, v: np.ndarray, y: np.ndarray) -> bool:
    """:func:`forward` by F(4x4, 3x3) (:mod:`._winograd_f4`) for a channels-last geometry,
    V from :func:`large_weights`: per job, U (36, tiles, C) of its 4x4 tiles' 6x6 patches,
    36 products U @ V, the output transform of M (36, tiles, K); 3D as :func:`_forward3`
    (each depth tap's U in its third of (36, tiles, 3 * C)). The patches are read from a
    zero-padded copy of x, and y is written through a copy of whole tiles where its size is
    not a multiple of 4 (fresh arrays for the length of the call), so that the transforms
    need no bounds or masks and vectorise. Returns False, as :func:`forward`, when some
    output is not finite."""
    three = g.r[0] == 3
    th, tw, jobs = _jobs3(g, x.itemsize, 4) if three else _jobs(g, x.itemsize, 4)
    big = np.finfo(x.dtype).max
    consts = f4.constants(x.dtype)
    pf, ph, pw = _padded_input(g, x, th, tw)
    images = g.n * g.p[0]                       # y's 2D images (3D: its depth slices)
    exact = g.p[1] == 4 * th and g.p[2] == 4 * tw
    yf = y.reshape(-1)
    tf = yf if exact else np.empty(images * 16 * th * tw * g.k, x.dtype)

    def job(span, pick):
        t0, t1 = span[-2:]
        m, mf, mstep = _planes((t1 - t0, g.k), x.dtype, "rows", 36)
        u, lo, hi = _large_input(g, pf, span, th, tw, ph, pw, consts, pick)
        if lo >= hi:                                    # every depth tap in the padding
            m[...] = 0
        else:
            taps = slice(lo * g.c, hi * g.c)
            np.matmul(u[:, :, taps], v[:, taps], out=m)
        return pick(f4._output_cl)(mf, mstep, tf, t0, t1, th, tw, g.k, big, consts)

    bad = sum(_tiles.run_tiles(job, jobs))
    if not exact:
        bad = f4._cropped_cl(tf, yf, images, th, tw, g.p[1], g.p[2], g.k, big)
    return bad == 0


def _padded_input(g: Geom, x: np.ndarray, th: int, tw: int) -> tuple:
    """A zero-padded channels-last copy of x (flat; 3D: its depth slices as images) with
    rows and columns enough for every 4x4 tile's 6x6 patch, and its rows and columns."""
    ph, pw = 4 * th + 2, 4 * tw + 2
    pf = _tiles.scratch((g.n * g.s[0] * ph * pw * g.c,), x.dtype, "padded")
    f4._padded_cl(x.reshape(-1), pf, g.n * g.s[0], g.s[1], g.s[2], g.c, g.before[1],
                  g.before[2], ph, pw)
    return pf, ph, pw


def _large_input(g: Geom, pf: np.ndarray, span: tuple, th: int, tw: int, ph: int, pw: int,
                 consts: np.ndarray, pick) -> tuple:
    """U of a job's 4x4 tiles from the padded copy ``pf`` (:func:`_padded_input`), in the
    "packed" workspace, and the depth taps [lo, hi) it holds: 2D (36, tiles, C), taps [0,
    1); 3D (36, tiles, 3 * C), each tap inside x in its third (:func:`_transformed_slices`'s
    arrangement)."""
    t0, t1 = span[-2:]
    if g.r[0] != 3:
        u, uf, ustep = _planes((t1 - t0, g.c), pf.dtype, "packed", 36)
        pick(f4._input_cl)(pf, uf, ustep, t0, t1, th, tw, ph, pw, g.c, g.c, consts)
        return u, 0, 1
    s = span[0]
    depth, out_depth, pad = g.s[0], g.p[0], g.before[0]
    n, od = divmod(s, out_depth)
    lo, hi = max(0, pad - od), min(3, depth + pad - od)
    u, uf, ustep = _planes((t1 - t0, 3 * g.c), pf.dtype, "packed", 36)
    per_slice = th * tw
    for kd in range(lo, hi):
        shift = (n * depth + od + kd - pad - s) * per_slice
        pick(f4._input_cl)(pf, uf[kd * g.c:], ustep, t0 + shift, t1 + shift, th, tw, ph, pw,
                           g.c, 3 * g.c, consts)
    return u, lo, hi


def forward(g: Geom, x: np.ndarray, v: np.ndarray, y: np.ndarray) -> bool:
    """y = conv(x, w) for the geometry ``g`` (see :func:`applies`), V the transformed
    weights (:func:`transformed_weights`). Returns False, with y partly written, when some
    output is not finite (then recompute it another way; see the module's docstring)."""
    if g.r[0] == 3:
        return _forward3(g, x, v, y)
    th, tw, jobs = _jobs(g, x.itemsize)
    big = np.finfo(x.dtype).max
    xf, yf = x.reshape(-1), y.reshape(-1)

    def job(span, pick):
        t0, t1 = span
        u = _transformed_input(g, xf, span, th, tw, pick)
        args = (t0, t1, th, tw, g.p[1], g.p[2], g.k, big)
        if g.channels_last:
            m, mf, mstep = _planes((t1 - t0, g.k), x.dtype, "rows")
            np.matmul(u, v, out=m)
            return pick(_output_cl)(mf, mstep, yf, *args, g.k)
        m, mf, mstep = _planes((g.k, t1 - t0), x.dtype, "rows")
        np.matmul(v, u, out=m)
        return pick(_output_cf)(mf, mstep, yf, *args, 1)

    return sum(_tiles.run_tiles(job, jobs)) == 0


def _jobs(g: Geom, itemsize: int, size: int = 2) -> tuple:
    """Tile rows and columns of an image, and the jobs: (t0, t1) runs of consecutive tiles
    over the batch, as few as hold :func:`job_tiles` each at most, an even number of them
    where they stay MIN_JOB_TILES long, all as long as each other but the last (the split
    depends on the shape alone: the weight gradient's sums follow it)."""
    th, tw = tile_grid(g, size)
    total = g.n * th * tw
    count = -(-total // job_tiles(g, itemsize, size))
    # Two tile workers on this machine kind: jobs of 128, 128, 128 and 8 tiles keep one
    # busy for 256 tiles and the other for 136 (docs/cpu-algorithms.md, "Winograd jobs").
    if count % 2 and count > 1 and total // (count + 1) >= MIN_JOB_TILES:
        count += 1
    per_job = -(-total // count)
    return th, tw, [(t0, min(total, t0 + per_job)) for t0 in range(0, total, per_job)]


def _forward3(g: Geom, x: np.ndarray, v: np.ndarray, y: np.ndarray) -> bool:
    """:func:`forward` of a 3D 3x3x3 geometry: F(2x2, 3x3) on each output depth slice,
    summed over the three depth taps. x's depth slices are read as N * D 2D images (and
    y's written as N * Do); a job is a run of tiles of one output slice (n, od), whose
    depth taps kd read input slice od + kd - pad (those inside x: the others are the depth
    padding and add nothing). Each tap's U goes into its third of one buffer, channels-last
    (16, tiles, 3 * C), channels-first (16, 3 * C, tiles), so the products are one per job
    and position over the taps inside x: U (tiles, 3C) @ V (3C, K), or V (K, 3C) @ U (3C,
    tiles)."""
    th, tw, jobs = _jobs3(g, x.itemsize)
    big = np.finfo(x.dtype).max
    yf = y.reshape(-1)
    c = g.c

    def job(span, pick):
        s, t0, t1 = span
        tiles = t1 - t0
        shape = (tiles, g.k) if g.channels_last else (g.k, tiles)
        m, mf, mstep = _planes(shape, x.dtype, "rows")
        u, lo, hi = _transformed_slices(g, x, span, th, tw, pick)
        if lo >= hi:                                    # every depth tap in the padding
            m[...] = 0
        else:
            taps = slice(lo * c, hi * c)
            if g.channels_last:
                np.matmul(u[:, :, taps], v[:, taps], out=m)
            else:
                np.matmul(v[:, :, taps], u[:, taps], out=m)
        out = (mf, mstep, yf, t0, t1, th, tw, g.p[1], g.p[2], g.k, big)
        if g.channels_last:
            return pick(_output_cl)(*out, g.k)
        return pick(_output_cf)(*out, g.p[0])

    return sum(_tiles.run_tiles(job, jobs)) == 0


def _jobs3(g: Geom, itemsize: int, size: int = 2) -> tuple:
    """:func:`_jobs` of a 3D geometry: (s, t0, t1), a run [t0, t1) of the tiles of output
    depth slice s (n * Do + od; tiles numbered over the N * Do slices), the slice's tiles
    cut into runs as long as each other, of :func:`job_tiles` at most (counted for the
    three depth taps' channels, as U holds them)."""
    th, tw = tile_grid(g, size)
    per_slice = th * tw
    parts = -(-per_slice // job_tiles(g._replace(c=3 * g.c), itemsize, size))
    step = -(-per_slice // parts)
    return th, tw, [(s, s * per_slice + a, s * per_slice + min(per_slice, a + step))
                    for s in range(g.n * g.p[0]) for a in range(0, per_slice, step)]


def _transformed_slices(g: Geom, x: np.ndarray, span: tuple, th: int, tw: int, pick):
    """U of a 3D job's tiles (:func:`_jobs3`) for each depth tap kd in [lo, hi), the taps
    whose input slice od + kd - pad lies in x, in its third of the "packed" workspace:
    channels-last (16, tiles, 3 * C), channels-first (16, 3 * C, tiles); and lo, hi."""
    s, t0, t1 = span
    tiles, c = t1 - t0, g.c
    depth, out_depth, pad = g.s[0], g.p[0], g.before[0]
    n, od = divmod(s, out_depth)
    lo, hi = max(0, pad - od), min(3, depth + pad - od)
    shape = (tiles, 3 * c) if g.channels_last else (3 * c, tiles)
    u, uf, ustep = _planes(shape, x.dtype, "packed")
    xf = x.reshape(-1)
    args = _input_args(g, th, tw, x.dtype)
    per_slice = th * tw
    for kd in range(lo, hi):
        shift = (n * depth + od + kd - pad - s) * per_slice
        if g.channels_last:
            pick(_input_cl)(xf, uf[kd * c:], ustep, t0 + shift, t1 + shift, *args, 3 * c)
        else:
            pick(_input_cf)(xf, uf[kd * c * tiles:], ustep, t0 + shift, t1 + shift, *args,
                            depth)
    return u, lo, hi


def _input_args(g: Geom, th: int, tw: int, dtype) -> tuple:
    """The input transforms' arguments from ``th`` on (:func:`_input_cl`, :func:`_input_cf`;
    each takes one more, U's pitch or x's depth)."""
    return (th, tw, g.before[1], g.before[2], g.s[1], g.s[2], g.c, dtype.type(1),
            dtype.type(0))


def _transformed_input(g: Geom, xf: np.ndarray, span: tuple, th: int, tw: int, pick):
    """U of a job's tiles from x (flat), in the "packed" workspace: channels-last
    (16, tiles, C), channels-first (16, C, tiles)."""
    t0, t1 = span
    args = _input_args(g, th, tw, xf.dtype)
    if g.channels_last:
        u, uf, step = _planes((t1 - t0, g.c), xf.dtype, "packed")
        pick(_input_cl)(xf, uf, step, t0, t1, *args, g.c)
    else:
        u, uf, step = _planes((g.c, t1 - t0), xf.dtype, "packed")
        pick(_input_cf)(xf, uf, step, t0, t1, *args, 1)
    return u


#: U's and M's 16 planes lie this many bytes past a multiple of 4 KiB apart: the transforms
#: read or write all 16 at once, and at a power-of-two distance (a job's planes are often
#: 128 KiB) they would all fall into the same L1 cache sets, evicting each other on every
#: access. Measured on Zen 3, one thread, 64 channels at 56x56, 8 images, jobs of 512
#: tiles: the channels-first output transform 5.9 ms with planes 128 KiB apart, 3.2 ms
#: with this skew; the input transform 6.2 and 4.4 ms.
PLANE_SKEW = 64


def _plane_step(size: int, itemsize: int) -> int:
    """Elements from one plane of ``size`` values to the next: PLANE_SKEW bytes past a
    multiple of 4 KiB."""
    return (-(-size * itemsize // 4096) * 4096 + PLANE_SKEW) // itemsize


def _planes(shape: tuple, dtype, slot: str, count: int = 16) -> tuple:
    """A (count, *shape) array from the workspace ``slot``, its planes PLANE_SKEW bytes past
    a multiple of 4 KiB apart, with its flat view and its plane stride (in elements)."""
    itemsize = np.dtype(dtype).itemsize
    step = _plane_step(shape[0] * shape[1], itemsize)
    flat = _tiles.workspace((count * step,), dtype, slot)
    planes = np.lib.stride_tricks.as_strided(flat, (count,) + shape,
                                             (step * itemsize, shape[1] * itemsize, itemsize))
    return planes, flat, np.uint64(step)


@serial_jit
def _segment(j, t1, th, tw):
    """The image n, tile row ty and tile columns [tx0, tx1) of the run of tiles from
    global tile j (at most to t1) that stays in one tile row."""
    n, ty, tx0 = _tile(j, th, tw)
    return n, ty, tx0, min(tw, tx0 + t1 - j)


@serial_jit
def _clamped(start, size, one, zero):
    """Of the four indices start + 0..3: each clamped into [0, size), and a factor, ``one``
    where it was inside, else ``zero``, that the value read there is multiplied by (a
    branch or select per value kept LLVM from vectorising the loops)."""
    return (min(max(start, 0), size - 1), min(max(start + 1, 0), size - 1),
            min(max(start + 2, 0), size - 1), min(max(start + 3, 0), size - 1),
            one if 0 <= start < size else zero, one if 0 <= start + 1 < size else zero,
            one if 0 <= start + 2 < size else zero, one if 0 <= start + 3 < size else zero)


@serial_jit
def _columns(d0, d1, d2, d3):
    """B^T applied to four values, B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0],
    [0, 1, 0, -1]]."""
    return d0 - d2, d1 + d2, d2 - d1, d1 - d3


@serial_jit
def _patch_row(xf, base, q0, q1, q2, q3):
    """B^T along one row of a patch: its four values at xf[base + q*]."""
    return _columns(xf[base + q0], xf[base + q1], xf[base + q2], xf[base + q3])


@serial_jit
def _masked_row(xf, base, q0, q1, q2, q3, f0, f1, f2, f3):
    """:func:`_patch_row` of the values times the factors f* (zero for padding; a
    non-finite value read in its place makes NaN, and the problem is recomputed)."""
    return _columns(xf[base + q0] * f0, xf[base + q1] * f1, xf[base + q2] * f2,
                    xf[base + q3] * f3)


@serial_jit
def _store_u(uf, at, step, a, b, c, d):
    """U's 16 values of one patch at uf[at + xi * step], from its rows' B^T transforms a,
    b, c, d (B^T again, across the rows)."""
    r0 = _columns(a[0], b[0], c[0], d[0])
    r1 = _columns(a[1], b[1], c[1], d[1])
    r2 = _columns(a[2], b[2], c[2], d[2])
    r3 = _columns(a[3], b[3], c[3], d[3])
    at = _store4(uf, at, step, (r0[0], r1[0], r2[0], r3[0]))
    at = _store4(uf, at, step, (r0[1], r1[1], r2[1], r3[1]))
    at = _store4(uf, at, step, (r0[2], r1[2], r2[2], r3[2]))
    _store4(uf, at, step, (r0[3], r1[3], r2[3], r3[3]))


@parallel_jit
def _input_cl(xf, uf, step, t0, t1, th, tw, b1, b2, h, w, channels, one, zero, pitch):
    """U (16, tiles, C) of the tiles [t0, t1), channels-last x (N, H, W, C), both flat; U's
    tiles ``pitch`` (>= C) values apart."""
    tiles = t1 - t0
    cs = uint64(channels)
    for at in prange(tiles):
        n, ty, tx = _tile(t0 + at, th, tw)
        i0, i1, i2, i3, r0, r1, r2, r3 = _clamped(2 * ty - b1, h, one, zero)
        j0, j1, j2, j3, f0, f1, f2, f3 = _clamped(2 * tx - b2, w, one, zero)
        q0, q1, q2, q3 = uint64(j0) * cs, uint64(j1) * cs, uint64(j2) * cs, uint64(j3) * cs
        row0 = uint64((n * h + i0) * w) * cs
        row1 = uint64((n * h + i1) * w) * cs
        row2 = uint64((n * h + i2) * w) * cs
        row3 = uint64((n * h + i3) * w) * cs
        out = uint64(at) * uint64(pitch)
        if r0 * r3 * f0 * f3 == one:                # the whole patch lies in x
            for c in range(cs):
                _store_u(uf, out + c, step, _patch_row(xf, row0 + c, q0, q1, q2, q3),
                         _patch_row(xf, row1 + c, q0, q1, q2, q3),
                         _patch_row(xf, row2 + c, q0, q1, q2, q3),
                         _patch_row(xf, row3 + c, q0, q1, q2, q3))
        else:
            for c in range(cs):
                _store_u(uf, out + c, step,
                         _masked_row(xf, row0 + c, q0, q1, q2, q3, r0 * f0, r0 * f1, r0 * f2,
                                     r0 * f3),
                         _masked_row(xf, row1 + c, q0, q1, q2, q3, r1 * f0, r1 * f1, r1 * f2,
                                     r1 * f3),
                         _masked_row(xf, row2 + c, q0, q1, q2, q3, r2 * f0, r2 * f1, r2 * f2,
                                     r2 * f3),
                         _masked_row(xf, row3 + c, q0, q1, q2, q3, r3 * f0, r3 * f1, r3 * f2,
                                     r3 * f3))


@parallel_jit
def _input_cf(xf, uf, step, t0, t1, th, tw, b1, b2, h, w, channels, one, zero, depth):
    """U (16, C, tiles) of the tiles [t0, t1), channels-first x (N, C, H, W), both flat; or
    x (N, C, depth, H, W), its depth slices the images (tiles n * depth + d)."""
    tiles = t1 - t0
    # Tile columns whose four input columns 2 tx - b2 + 0..3 all lie in x.
    inner_lo = (b2 + 1) // 2 if b2 > 0 else 0
    inner_hi = (w - 4 + b2) // 2 + 1
    for c in prange(channels):
        j = t0
        while j < t1:
            n, ty, tx0, tx1 = _segment(j, t1, th, tw)
            i0, i1, i2, i3, r0, r1, r2, r3 = _clamped(2 * ty - b1, h, one, zero)
            plane = ((n // depth * channels + c) * depth + n % depth) * h
            row0 = uint64((plane + i0) * w)
            row1 = uint64((plane + i1) * w)
            row2 = uint64((plane + i2) * w)
            row3 = uint64((plane + i3) * w)
            out = uint64(c * tiles + j - t0 - tx0)      # U's column of tile column 0
            lo = min(max(tx0, inner_lo), tx1)
            hi = max(min(tx1, inner_hi), lo)
            # The inner tile columns: no clamping, loads in stride-2 runs.
            col = uint64(2 * lo - b2) if hi > lo else _0
            if r0 * r3 == one:
                for tx in range(uint64(lo), uint64(hi)):
                    _store_u(uf, out + tx, step, _patch_row(xf, row0 + col, _0, _1, _2, _3),
                             _patch_row(xf, row1 + col, _0, _1, _2, _3),
                             _patch_row(xf, row2 + col, _0, _1, _2, _3),
                             _patch_row(xf, row3 + col, _0, _1, _2, _3))
                    col += _2
            else:
                for tx in range(uint64(lo), uint64(hi)):
                    _store_u(uf, out + tx, step,
                             _masked_row(xf, row0 + col, _0, _1, _2, _3, r0, r0, r0, r0),
                             _masked_row(xf, row1 + col, _0, _1, _2, _3, r1, r1, r1, r1),
                             _masked_row(xf, row2 + col, _0, _1, _2, _3, r2, r2, r2, r2),
                             _masked_row(xf, row3 + col, _0, _1, _2, _3, r3, r3, r3, r3))
                    col += _2
            for tx in range(tx0, tx1):                  # the clamped tile columns
                if lo <= tx < hi:
                    continue
                j0, j1, j2, j3, f0, f1, f2, f3 = _clamped(2 * tx - b2, w, one, zero)
                q0, q1, q2, q3 = uint64(j0), uint64(j1), uint64(j2), uint64(j3)
                _store_u(uf, out + uint64(tx), step,
                         _masked_row(xf, row0, q0, q1, q2, q3, r0 * f0, r0 * f1, r0 * f2,
                                     r0 * f3),
                         _masked_row(xf, row1, q0, q1, q2, q3, r1 * f0, r1 * f1, r1 * f2,
                                     r1 * f3),
                         _masked_row(xf, row2, q0, q1, q2, q3, r2 * f0, r2 * f1, r2 * f2,
                                     r2 * f3),
                         _masked_row(xf, row3, q0, q1, q2, q3, r3 * f0, r3 * f1, r3 * f2,
                                     r3 * f3))
            j += tx1 - tx0


@serial_jit
def _load4(mf, at, step):
    """mf[at + i * step] for i < 4, and at + 4 * step."""
    a = mf[at]
    at += step
    b = mf[at]
    at += step
    c = mf[at]
    at += step
    return a, b, c, mf[at], at + step


@serial_jit
def _output_tile(mf, at, step):
    """A^T M A of one tile's 16 values mf[at + xi * step], A^T = [[1, 1, 1, 0],
    [0, 1, -1, -1]]: (y00, y01, y10, y11)."""
    m0, m1, m2, m3, at = _load4(mf, at, step)
    m4, m5, m6, m7, at = _load4(mf, at, step)
    m8, m9, m10, m11, at = _load4(mf, at, step)
    m12, m13, m14, m15, _ = _load4(mf, at, step)
    s0, s1, s2, s3 = m0 + m4 + m8, m1 + m5 + m9, m2 + m6 + m10, m3 + m7 + m11
    e0, e1, e2, e3 = m4 - m8 - m12, m5 - m9 - m13, m6 - m10 - m14, m7 - m11 - m15
    return s0 + s1 + s2, s1 - s2 - s3, e0 + e1 + e2, e1 - e2 - e3


@parallel_jit
def _output_cl(mf, step, yf, t0, t1, th, tw, ph, pw, channels, big, pitch):
    """y's tiles [t0, t1) from M (16, tiles, K), channels-last y (N, P1, P2, ``pitch``),
    both flat, its K channels from yf[0] on (a block of y's channels where K < pitch);
    returns how many of the values written are not finite (``big``: the dtype's largest
    finite value; a comparison, which fast-math's reassociation leaves alone, where a sum
    of v - v was folded to 0)."""
    tiles = t1 - t0
    ks = uint64(channels)
    ps = uint64(pitch)
    bad = 0
    for at in prange(tiles):
        n, ty, tx = _tile(t0 + at, th, tw)
        r, col = 2 * ty, 2 * tx
        two_rows, two_cols = r + 1 < ph, col + 1 < pw
        top = uint64((n * ph + r) * pw + col) * ps
        bottom = top + uint64(pw) * ps
        src = uint64(at) * ks
        part = 0
        if two_rows and two_cols:
            for k in range(ks):
                y00, y01, y10, y11 = _output_tile(mf, src + k, step)
                yf[top + k] = y00
                yf[top + ps + k] = y01
                yf[bottom + k] = y10
                yf[bottom + ps + k] = y11
                part += (_out(y00, big) + _out(y01, big) + _out(y10, big)
                         + _out(y11, big))
        else:
            for k in range(ks):
                y00, y01, y10, y11 = _output_tile(mf, src + k, step)
                yf[top + k] = y00
                part += _out(y00, big)
                if two_cols:
                    yf[top + ps + k] = y01
                    part += _out(y01, big)
                if two_rows:
                    yf[bottom + k] = y10
                    part += _out(y10, big)
        bad += part
    return bad


@parallel_jit
def _output_cf(mf, step, yf, t0, t1, th, tw, ph, pw, channels, big, depth):
    """y's tiles [t0, t1) from M (16, K, tiles), channels-first y (N, K, P1, P2), both flat,
    or y (N, K, depth, P1, P2) (see :func:`_input_cf`; and :func:`_output_cl`)."""
    tiles = t1 - t0
    full_columns = pw // 2                          # tile columns with both columns in y
    bad = 0
    for k in prange(channels):
        part = 0
        j = t0
        while j < t1:
            n, ty, tx0, tx1 = _segment(j, t1, th, tw)
            r = 2 * ty
            top = uint64((((n // depth * channels + k) * depth + n % depth) * ph + r) * pw)
            bottom = top + uint64(pw)
            src = uint64(k * tiles + j - t0 - tx0)
            full = max(min(tx1, full_columns), tx0)
            if r + 1 < ph:
                for tx in range(uint64(tx0), uint64(full)):
                    y00, y01, y10, y11 = _output_tile(mf, src + tx, step)
                    yf[top + tx + tx] = y00
                    yf[top + tx + tx + _1] = y01
                    yf[bottom + tx + tx] = y10
                    yf[bottom + tx + tx + _1] = y11
                    part += (_out(y00, big) + _out(y01, big) + _out(y10, big)
                         + _out(y11, big))
            else:
                for tx in range(uint64(tx0), uint64(full)):
                    y00, y01, y10, y11 = _output_tile(mf, src + tx, step)
                    yf[top + tx + tx] = y00
                    yf[top + tx + tx + _1] = y01
                    part += _out(y00, big) + _out(y01, big)
            if full < tx1:                          # the last column of an odd width
                y00, y01, y10, y11 = _output_tile(mf, src + uint64(full), step)
                yf[top + uint64(2 * full)] = y00
                part += _out(y00, big)
                if r + 1 < ph:
                    yf[bottom + uint64(2 * full)] = y10
                    part += _out(y10, big)
            j += tx1 - tx0
        bad += part
    return bad


# --- the weight gradient -----------------------------------------------------------------

def weight_gradient(g: Geom, x: np.ndarray, dy: np.ndarray, slots: int):
    """dw (K, C, 3, 3), or (K, C, 3, 3, 3), of the geometry ``g`` (see :func:`applies`), or
    None where some value of it is not finite (then compute it another way; see the
    module's docstring).

    By the chain rule through Y = A^T (U ⊙ V) A and V = G g G^T: each tile's dy (2x2) is
    transformed into A dy A^T (4x4, D), the 16 products dV[xi] = sum over tiles of
    U[xi]^T D[xi] (C x K) are BLAS products per job, and dw = G^T dV G. A 3D geometry's
    jobs are :func:`_forward3`'s: dV of depth tap kd sums U of input slice od + kd - pad
    against D of output slice od, the three taps side by side in one product per job (as
    V's are there), and G^T dV G is taken per tap. Jobs are dealt round-robin into
    ``slots`` partial sums (fewer when there are fewer jobs), each summed in job order,
    then added in slot order: the same dw, bit for bit, on every run.
    """
    cl = g._replace(channels_last=True)
    large = _heuristics.winograd_large_tiles(cl, x.itemsize, 2 * _tiles.SLOTS)
    if not large and _heuristics.winograd_wgrad_by_panels(g, x.itemsize):
        return _weight_gradient_by_panels(g, x, dy)
    if large and g.channels_last:
        return weight_gradient_large(g, x, dy, slots)
    if large and _heuristics.winograd_via_copies(g.c, g.k):
        # Channels-first through channels-last copies of x and dy, as the forward's.
        return weight_gradient_large(cl, _tiles.channels_last_copy(x, g.c, "layout_x"),
                                     _tiles.channels_last_copy(dy, g.k, "layout_dy"), slots)
    three = g.r[0] == 3
    th, tw, jobs = _jobs3(g, x.itemsize) if three else _jobs(g, x.itemsize)
    slots = min(slots, len(jobs))
    one, zero = x.dtype.type(1), x.dtype.type(0)
    # Channels-first, x's transforms run on a channels-last copy where the forward's do
    # (``_heuristics.winograd_via_copies``); dy's (4 values read per 16 written) on dy.
    gx = g
    if not g.channels_last and _heuristics.winograd_via_copies(g.c, g.k):
        gx, x = g._replace(channels_last=True), _tiles.channels_last_copy(x, g.c, "layout_x")
    xf, dyf = x.reshape(-1), dy.reshape(-1)
    c = 3 * g.c if three else g.c               # 3D: the three depth taps' channels
    # dV as channels-last (16, C, K), channels-first (16, K, C): V's layouts (dy's).
    shape = (16, c, g.k) if g.channels_last else (16, g.k, c)

    def job(span, pick, out):
        t0, t1 = span[-2:]
        if three:
            u, lo, hi = _transformed_slices(gx, x, span, th, tw, pick)
        else:
            u, lo, hi = _transformed_input(gx, xf, span, th, tw, pick), 0, 1
        if lo >= hi:                            # every depth tap in the padding
            out[...] = 0
            return out
        taps = slice(lo * g.c, hi * g.c)
        if g.channels_last:
            d, df, dstep = _planes((t1 - t0, g.k), x.dtype, "rows")
            pick(_grad_cl)(dyf, df, dstep, t0, t1, th, tw, g.p[1], g.p[2], g.k, one, zero)
            np.matmul(u[:, :, taps].transpose(0, 2, 1), d, out=out[:, taps])
            out[:, :taps.start] = 0
            out[:, taps.stop:] = 0
            return out
        d, df, dstep = _planes((g.k, t1 - t0), x.dtype, "rows")
        pick(_grad_cf)(dyf, df, dstep, t0, t1, th, tw, g.p[1], g.p[2], g.k, one, zero,
                       g.p[0] if three else 1)
        # U (16, tiles, C) from the copy, else (16, C, tiles).
        u = u[:, :, taps] if gx.channels_last else u[:, taps].transpose(0, 2, 1)
        np.matmul(d, u, out=out[:, :, taps])
        out[:, :, :taps.start] = 0
        out[:, :, taps.stop:] = 0
        return out

    dv = _slot_sums(job, jobs, slots, shape, x.dtype)
    dw = np.empty((g.k, c, 3, 3), x.dtype)      # 3D: (K, 3 (kd), C, 3, 3)
    # Through the tile workers like every other kernel here (shared out only when large):
    # launched from this thread as a parallel region, it left an OpenMP thread spinning
    # beside the next call's workers wherever that runtime spins (PyTorch's, loaded
    # first): ResNet 64c 56x56, 10.8 -> 15.9 ms channels-first (Zen 4, 2 cores).
    def part(span, pick):
        pick(_weights_back)(dv.reshape(-1), dw.reshape(-1), *span, g.k, c, g.channels_last,
                            x.dtype.type(0.5))

    _tiles.run_tiles(part, _tiles.worker_ranges(g.k, dv.nbytes > _tiles.SHARED_RELAYOUT_ABOVE))
    return _finished(g, dw)


def _weight_gradient_by_panels(g: Geom, x: np.ndarray, dy: np.ndarray):
    """:func:`weight_gradient` for a 2D geometry of few tiles and many channels
    (``_heuristics.winograd_wgrad_by_panels``), where dV (16 values per weight) outweighs U
    and D: U (16, tiles, C) and D (16, tiles, K) of every tile once, by the channels-last
    transforms (a channels-first x and dy through channels-last copies); then jobs of
    blocks of NR output channels, each block's dV (16 planes of C x NR) summed over every
    tile by the micro-kernel reading U and D where they lie
    (:func:`._microkernel.planes_product`) and, while in the L2 cache, transformed into
    the block's rows of dw. Each value of dV is one fused multiply-add chain over the tiles
    (in KC-deep chunks added in order): the same bits however the blocks are shared out,
    and no partial sums."""
    th, tw = tile_grid(g)
    total = g.n * th * tw
    dtype = x.dtype
    mr, nr = tile_shape(dtype)[0], RowPanels.tile_columns(dtype)
    cl = g._replace(channels_last=True)
    xf = x.reshape(-1) if g.channels_last else _tiles.channels_last_copy(x, g.c, "layout_x")
    dyf = dy.reshape(-1) if g.channels_last else \
        _tiles.channels_last_copy(dy, g.k, "layout_dy")
    # U's and D's planes PLANE_SKEW bytes past a multiple of 4 KiB apart; the products read
    # whole tiles of MR channels of U and NR of D, up to MR - 1 and NR - 1 values past a
    # row: slack after the last plane.
    u_step, d_step = _plane_step(total * g.c, x.itemsize), _plane_step(total * g.k, x.itemsize)
    uf = _tiles.scratch((16 * u_step + mr,), dtype, "planes_u")
    df = _tiles.scratch((16 * d_step + nr,), dtype, "planes_d")
    uf[16 * u_step:], df[16 * d_step:] = 0, 0
    args = _input_args(cl, th, tw, dtype)
    one, zero = dtype.type(1), dtype.type(0)

    def transform(span, pick):
        t0, t1 = span
        pick(_input_cl)(xf, uf[t0 * g.c:], np.uint64(u_step), t0, t1, *args, g.c)
        pick(_grad_cl)(dyf, df[t0 * g.k:], np.uint64(d_step), t0, t1, th, tw, g.p[1], g.p[2],
                       g.k, one, zero)

    _tiles.run_tiles(transform, _tiles.worker_ranges(total, True))
    dw = np.empty((g.k, g.c, 3, 3), dtype)
    dwf, half, count = dw.reshape(-1), dtype.type(0.5), -(-g.c // mr)

    def job(span, pick):
        m, mf, mstep = _planes((count * mr, nr), dtype, "rows")
        for block in range(*span):
            k0 = block * nr
            planes_product(uf, u_step, g.c, g.c, total, df[k0:], d_step, mf, int(mstep), 16,
                           g.k)
            pick(_panel_back)(mf, mstep, dwf[k0 * g.c * 9:], min(nr, g.k - k0), g.c, nr, half)

    _tiles.run_tiles(job, _panel_jobs(g.k, nr))
    return _finished(g, dw)


@parallel_jit
def _panel_back(mf, step, wf, kernels, channels, pitch, half):
    """wf[(k * channels + c) * 9:][:9] = G^T dV[:, c, k] G for k < ``kernels``, c <
    ``channels``, dV's 16 planes ``step`` apart in ``mf``, its rows ``pitch`` apart (a
    panel of :func:`_weight_gradient_by_panels`; see :func:`_weights_back`)."""
    ps = uint64(pitch)
    for c in prange(channels):
        for k in range(kernels):
            _back_one(mf, uint64(c) * ps + uint64(k), step, wf,
                      uint64((k * channels + c) * 9), half)


def _slot_sums(job, jobs: list, slots: int, shape: tuple, dtype) -> np.ndarray:
    """The sum of ``job(span, pick, out)`` (which writes its part into ``out`` and returns
    it) over ``jobs``, dealt round-robin into ``slots`` partial sums, each summed in job
    order on a tile worker, then added in slot order: the same bits on every run. The
    partials, and so the sum, lie in the calling thread's workspace ("slot_sums"): valid
    until its next weight gradient."""
    partials = _tiles.scratch((slots,) + tuple(shape), dtype, "slot_sums")

    def slot(first, pick):
        part = job(jobs[first], pick, partials[first])
        for span in jobs[first + slots::slots]:
            _tiles.stop_if_interrupted()
            # A reused buffer (a fresh array per job costs page faults), then the sum.
            part += job(span, pick, _tiles.workspace(shape, dtype, "product"))
        return part

    return _tiles.sum_in_order(_tiles.run_tiles(slot, list(range(slots))))


def _finished(g: Geom, dw: np.ndarray):
    """dw from the back transform's (K, C', 3, 3): 3D's (K, 3 (kd), C, 3, 3) moved to
    (K, C, 3, 3, 3); None where some value is not finite."""
    if g.r[0] == 3:
        dw = np.ascontiguousarray(dw.reshape(g.k, 3, g.c, 3, 3).transpose(0, 2, 1, 3, 4))
    return dw if np.isfinite(dw).all() else None


def weight_gradient_large(g: Geom, x: np.ndarray, dy: np.ndarray, slots: int):
    """:func:`weight_gradient` by F(4x4, 3x3) for a channels-last geometry: U of x's 6x6
    patches (as :func:`forward_large`'s), D = A dy A^T of dy's 4x4 tiles (6x6; from a
    zero-padded copy where dy's size is not a multiple of 4), the 36 products dV[xi] =
    U[xi]^T D[xi] per job, summed in slots as there, dw = G^T dV G; 3D per depth tap, as
    :func:`weight_gradient`'s."""
    three = g.r[0] == 3
    th, tw, jobs = _jobs3(g, x.itemsize, 4) if three else _jobs(g, x.itemsize, 4)
    slots = min(slots, len(jobs))
    consts = f4.constants(x.dtype)
    pf, ph, pw = _padded_input(g, x, th, tw)
    images = g.n * g.p[0]
    if g.p[1] == 4 * th and g.p[2] == 4 * tw:
        dyf = dy.reshape(-1)
    else:
        dyf = np.empty(images * 16 * th * tw * g.k, x.dtype)
        f4._padded_cl(dy.reshape(-1), dyf, images, g.p[1], g.p[2], g.k, 0, 0, 4 * th, 4 * tw)
    c = 3 * g.c if three else g.c
    shape = (36, c, g.k)

    def job(span, pick, out):
        t0, t1 = span[-2:]
        u, lo, hi = _large_input(g, pf, span, th, tw, ph, pw, consts, pick)
        if lo >= hi:                            # every depth tap in the padding
            out[...] = 0
            return out
        taps = slice(lo * g.c, hi * g.c)
        d, df, dstep = _planes((t1 - t0, g.k), x.dtype, "rows", 36)
        pick(f4._grad_cl)(dyf, df, dstep, t0, t1, th, tw, g.k, consts)
        np.matmul(u[:, :, taps].transpose(0, 2, 1), d, out=out[:, taps])
        out[:, :taps.start] = 0
        out[:, taps.stop:] = 0
        return out

    dv = _slot_sums(job, jobs, slots, shape, x.dtype)
    dw = np.empty((g.k, c, 3, 3), x.dtype)      # 3D: (K, 3 (kd), C, 3, 3)
    wk = f4.weight_constants(x.dtype)

    def part(span, pick):
        pick(f4._weights_back)(dv.reshape(-1), dw.reshape(-1), *span, g.k, c, wk)

    _tiles.run_tiles(part, _tiles.worker_ranges(g.k, dv.nbytes > _tiles.SHARED_RELAYOUT_ABOVE))
    return _finished(g, dw)


@serial_jit
def _clamped2(start, size, one, zero):
    """:func:`_clamped` for the two indices start + 0..1."""
    return (min(start, size - 1), min(start + 1, size - 1),
            one if start < size else zero, one if start + 1 < size else zero)


@serial_jit
def _a2(a, b):
    """A applied to two values, A = [[1, 0], [1, 1], [1, -1], [0, -1]]."""
    return a, a + b, a - b, -b


@serial_jit
def _store_d(df, at, step, d00, d01, d10, d11):
    """D = A d A^T of one tile's 2x2 d at df[at + xi * step]: A along d's rows, then each
    row of that (two values) along its columns."""
    at = _store4(df, at, step, _a2(d00, d01))
    at = _store4(df, at, step, _a2(d00 + d10, d01 + d11))
    at = _store4(df, at, step, _a2(d00 - d10, d01 - d11))
    _store4(df, at, step, _a2(-d10, -d11))



@parallel_jit
def _grad_cl(dyf, df, step, t0, t1, th, tw, ph, pw, channels, one, zero):
    """D (16, tiles, K) of the tiles [t0, t1), channels-last dy (N, P1, P2, K), both flat;
    dy's values past its edge read as zero."""
    tiles = t1 - t0
    ks = uint64(channels)
    for at in prange(tiles):
        n, ty, tx = _tile(t0 + at, th, tw)
        i0, i1, r0, r1 = _clamped2(2 * ty, ph, one, zero)
        j0, j1, f0, f1 = _clamped2(2 * tx, pw, one, zero)
        a00 = uint64((n * ph + i0) * pw + j0) * ks
        a01 = uint64((n * ph + i0) * pw + j1) * ks
        a10 = uint64((n * ph + i1) * pw + j0) * ks
        a11 = uint64((n * ph + i1) * pw + j1) * ks
        out = uint64(at) * ks
        if r1 * f1 == one:
            for k in range(ks):
                _store_d(df, out + k, step, dyf[a00 + k], dyf[a01 + k], dyf[a10 + k],
                         dyf[a11 + k])
        else:
            for k in range(ks):
                _store_d(df, out + k, step, dyf[a00 + k] * (r0 * f0),
                         dyf[a01 + k] * (r0 * f1), dyf[a10 + k] * (r1 * f0),
                         dyf[a11 + k] * (r1 * f1))


@parallel_jit
def _grad_cf(dyf, df, step, t0, t1, th, tw, ph, pw, channels, one, zero, depth):
    """D (16, K, tiles) of the tiles [t0, t1), channels-first dy (N, K, P1, P2), both flat,
    or dy (N, K, depth, P1, P2) (see :func:`_input_cf`)."""
    tiles = t1 - t0
    full_columns = pw // 2                          # tile columns with both columns in dy
    for k in prange(channels):
        j = t0
        while j < t1:
            n, ty, tx0, tx1 = _segment(j, t1, th, tw)
            i0, i1, r0, r1 = _clamped2(2 * ty, ph, one, zero)
            plane = ((n // depth * channels + k) * depth + n % depth) * ph
            top = uint64((plane + i0) * pw)
            bottom = uint64((plane + i1) * pw)
            out = uint64(k * tiles + j - t0 - tx0)
            full = max(min(tx1, full_columns), tx0)
            for tx in range(uint64(tx0), uint64(full)):
                _store_d(df, out + tx, step, dyf[top + tx + tx], dyf[top + tx + tx + _1],
                         dyf[bottom + tx + tx] * r1, dyf[bottom + tx + tx + _1] * r1)
            if full < tx1:                          # the last column of an odd width
                c = uint64(2 * full)
                _store_d(df, out + uint64(full), step, dyf[top + c], zero,
                         dyf[bottom + c] * r1, zero)
            j += tx1 - tx0


@parallel_jit
def _weights_back(vf, wf, first, last, kernels, channels, channels_last, half):
    """dw[k, c] = G^T dV[:, k, c] G for k in [first, last) (dV channels-last: (16, C, K);
    else (16, K, C)), with G^T = [[1, 1/2, 1/2, 0], [0, 1/2, -1/2, 0], [0, 1/2, 1/2, 1]].
    dV is read along its rows (channels-last k innermost, else c), each plane in order."""
    plane = uint64(kernels * channels)
    if channels_last:
        for c in prange(channels):
            for k in range(first, last):
                _back_one(vf, uint64(c * kernels + k), plane, wf,
                          uint64((k * channels + c) * 9), half)
    else:
        for k in prange(first, last):
            for c in range(channels):
                at = uint64(k * channels + c)
                _back_one(vf, at, plane, wf, at * uint64(9), half)


@serial_jit
def _back_one(vf, at, plane, wf, o, half):
    """wf[o:o + 9] = G^T dV G of the 16 values vf[at + xi * plane]."""
    # G^T along dV's rows (i), for each of its columns j, then along the columns.
    t = _gt_at(vf, at, _4 * plane, half)
    u = _gt_at(vf, at + plane, _4 * plane, half)
    v = _gt_at(vf, at + _2 * plane, _4 * plane, half)
    z = _gt_at(vf, at + _3 * plane, _4 * plane, half)
    r = _gt(t[0], u[0], v[0], z[0], half)
    wf[o], wf[o + _1], wf[o + _2] = r[0], r[1], r[2]
    r = _gt(t[1], u[1], v[1], z[1], half)
    wf[o + _3], wf[o + _4], wf[o + uint64(5)] = r[0], r[1], r[2]
    r = _gt(t[2], u[2], v[2], z[2], half)
    wf[o + uint64(6)], wf[o + uint64(7)], wf[o + _8] = r[0], r[1], r[2]


@serial_jit
def _gt_at(vf, at, step, half):
    """G^T applied to the four values vf[at + i * step]."""
    v0, v1, v2, v3, _ = _load4(vf, at, step)
    return _gt(v0, v1, v2, v3, half)


@serial_jit
def _gt(v0, v1, v2, v3, half):
    """G^T applied to four values."""
    return v0 + (v1 + v2) * half, (v1 - v2) * half, (v1 + v2) * half + v3
