"""The cpu backend's heuristics: which algorithm runs a problem, and which path inside an
algorithm, with the thresholds they compare against.

Every threshold says in a line or two what it trades off; the measurements behind it (machine,
command, date) are in docs/cpu-algorithms.md, "Thresholds". Pure Python: importing this module
imports neither Numba nor a kernel.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

from ..backend import DIRECT_MAX_CHANNELS_PER_GROUP

# Every threshold's measurements (machine, timing, date): docs/cpu-algorithms.md, "Thresholds".

# --- implicit ------------------------------------------------------------------------------
#: ``implicit`` needs output rows (y's, dx's; for the weight gradient, its products' depth) of
#: at least this many pixels: shorter products lose to im2col + BLAS.
IMPLICIT_MIN_WIDTH = 16
#: ...except a weight gradient whose input and output channels are all at most this many:
#: BLAS multiplies matrices that thin more slowly still (at 128 they tie).
IMPLICIT_NARROW_MAX_CHANNELS = 64
#: Channels-last weight gradients with a stride along the rows take ``implicit`` for windows
#: of at most this many values per tap row (KW * C), whatever their channels...
IMPLICIT_MAX_RUN = 32
#: Channels-last strided weight gradients with longer runs take ``implicit`` from this many
#: input channels...
IMPLICIT_STRIDED_MIN_CHANNELS = 16
#: ...and with AVX-512 up to this many input and output channels (at 512 im2col wins).
IMPLICIT_STRIDED_MAX_CHANNELS = 256
#: The channels-first ``implicit`` forward and data gradient need this many input channels
#: (fewer leave the micro-kernel's register transposes to a scalar loop); 1D ones run on
#: channels-last copies of their input and output (:func:`implicit_through_copies`: in
#: place, 1D rows lost to im2col's products).
IMPLICIT_MIN_CHANNELS_FIRST = 16
#: Their output channels fill micro-kernel tiles this wide (float32, AVX-512): a multiple of
#: it, or at least 8 times it (at most 1/9 of the tiles' columns wasted), or a multiple of
#: half of it (the narrow tiles, ``_microkernel.narrow_tiles``).
IMPLICIT_OUTPUT_BLOCK = 64
#: The channels-last strided data gradient runs by stride phases for dy of at most this many
#: channels (short depths are slow in BLAS, and col2im then moves the most), dx of at least
#: IMPLICIT_PHASED_MIN_OUTPUTS channels (a micro-kernel tile is 16 wide with AVX2; with
#: AVX-512, dx's channels fill IMPLICIT_OUTPUT_BLOCK-wide tiles, as the forward's, or the
#: narrow tiles half as wide) and at least IMPLICIT_PHASED_MIN_PIXELS pixels over the batch.
IMPLICIT_PHASED_MAX_DEPTH = 64
#: With AVX-512, channels-last, up to this many channels of dy: the weight panels of a
#: 128-channel 3x3 layer (0.6 MB) stay in L2 through a row's products, and the phases
#: beat im2col there; at 256 channels (2.4 MB of panels) they do not
#: (docs/cpu-algorithms.md, "the strided data gradient's operands").
IMPLICIT_PHASED_MAX_DEPTH_CL = 128
IMPLICIT_PHASED_MIN_OUTPUTS = 16
IMPLICIT_PHASED_MIN_PIXELS = 2**14
#: Channels-first, the same through channels-last copies of dy and dx, for kernels of at
#: least this many taps (2D 3x3 and larger, 3D): the copies cost as much as a short
#: product (1D kernels of 3, 5 and 9 taps lost or tied against col2im).
IMPLICIT_PHASED_CF_MIN_TAPS = 9
#: Without AVX-512, a float32 stride-1 data gradient or forward into exactly this many
#: channels (one column of the micro-kernel's 16-wide tiles) from at most
#: IMPLICIT_THIN_MAX_DEPTH runs ``implicit``, before ``winograd``: winograd's and im2col's
#: BLAS products are that thin, and slower (into 8 channels, or from 64, winograd wins).
IMPLICIT_THIN_OUTPUTS = 16
IMPLICIT_THIN_MAX_DEPTH = 32

# --- winograd ------------------------------------------------------------------------------
#: ``winograd`` (forward and data gradient) needs this many input and output channels (of the
#: forward form) and WINOGRAD_MIN_TILES 2x2 output tiles: fewer, and the transforms dominate.
WINOGRAD_MIN_CHANNELS = 16
WINOGRAD_MIN_TILES = 128
#: With AVX-512, channels-first forwards and data gradients of at most this many channels
#: run on channels-last copies of their input and output: the channels-last transforms
#: vectorise over channels, and the copies cost less than the difference (at 512, more).
WINOGRAD_COPIES_MAX_CHANNELS = 256
#: Channels-last forwards, data and weight gradients, 2D and 3D (channels-first ones through
#: channels-last copies), take F(4x4, 3x3) (docs/cpu-algorithms.md, "`winograd`: larger
#: tiles"): from this many channels on either side,
WINOGRAD_LARGE_MIN_CHANNELS = 64
#: up to this many summed (input) channels (F(4x4, 3x3)'s float32 error grows with them; up
#: to here it stays within the tests' 2e-5),
WINOGRAD_LARGE_MAX_DEPTH = 512
#: with this many 4x4 tiles in the call at least (on fewer, V's 36 values per weight cost
#: more than the products save),
WINOGRAD_LARGE_MIN_TILES = 192
#: and where it does this many times fewer multiplications than F(2x2, 3x3) at least, the
#: partial tiles at the edges counted (their wasted outputs against the smaller products).
WINOGRAD_LARGE_MIN_SAVING = 1.5
#: 3D: at least this many 4x4 tiles a depth slice (a job's products are one slice's tiles
#: at most: fewer make products too thin for BLAS).
WINOGRAD_LARGE_3D_MIN_SLICE_TILES = 42
#: F(2x2, 3x3) by blocks of output channels where the 2x2 tiles are at most the output
#: channels times this: V is then never written whole, but each block's products pack U
#: again (docs/cpu-algorithms.md, "`winograd`: few tiles, many channels").
WINOGRAD_BY_OUTPUTS_TILES = 1
#: ...and by panels of output channels, V made a panel at a time and used while in L2,
#: where they are at most the output channels times this: each panel's products read all
#: of U from L3, which costs more than V's traffic saves on more tiles.
WINOGRAD_BY_PANELS_TILES = 0.4
#: The weight gradient by panels, where the tiles are at most the output channels times
#: this: its alternatives (partial sums of dV per slot, or im2col) cost more there;
WINOGRAD_WGRAD_BY_PANELS_TILES = 1
#: but at least this many (on fewer, the transforms of dV outweigh the products: im2col).
WINOGRAD_WGRAD_BY_PANELS_MIN_TILES = 32
#: A 3D job is one depth slice's tiles at most: slices of fewer tiles than this are left to
#: the other algorithms.
WINOGRAD_3D_MIN_SLICE_TILES = 16
#: The weight gradient by ``winograd`` adds into a 16/9 dw-sized sum per job: it pays from
#: this many channels and tiles (below, ``implicit`` or im2col win).
WINOGRAD_WGRAD_MIN_CHANNELS = 64
WINOGRAD_WGRAD_MIN_TILES = 256
#: ...but with AVX-512, 2D channels-first ones with output rows of at least
#: WINOGRAD_WGRAD_CF_WIDE_ROWS pixels from this many channels, unless they take F(4x4, 3x3):
#: ``implicit`` reads such rows in place faster than F(2x2, 3x3) (at 64 channels; on
#: narrower rows winograd wins).
WINOGRAD_WGRAD_CF_MIN_CHANNELS = 96
WINOGRAD_WGRAD_CF_WIDE_ROWS = 28


def implicit_applies(op, problem) -> bool:
    """The ``implicit`` algorithms: one group (a window's features are then runs of one
    input row, channels-last), and stride 1 for the forward; the data gradient (and the
    transposed convolution) with any stride (by stride phases; channels-first through
    channels-last copies)."""
    if problem.groups != 1:
        return False
    if op in ("conv_backward_weight", "conv_backward_data", "conv_transpose"):
        return True
    return op == "conv" and all(s == 1 for s in problem.stride)


def winograd_applies(op, problem) -> bool:
    """The ``winograd`` algorithm: a 2D 3x3 or 3D 3x3x3 kernel, stride and dilation 1, one
    group, for the forward, the data gradient (a forward convolution of dy) and the weight
    gradient (any padding); unless ``NUMBACONV_WINOGRAD=0``."""
    from ..config import winograd_enabled
    shape = tuple(problem.kernel_size) in ((3, 3), (3, 3, 3))
    return (op in ("conv", "conv_backward_data", "conv_transpose", "conv_backward_weight")
            and winograd_enabled() and shape and problem.groups == 1
            and all(s == 1 for s in problem.stride) and all(d == 1 for d in problem.dilation))


def winograd_via_copies(in_channels: int, out_channels: int) -> bool:
    """Whether a channels-first ``winograd`` forward (or data gradient, in its forward form)
    of these channels runs on channels-last copies of its input and output: with AVX-512,
    up to WINOGRAD_COPIES_MAX_CHANNELS."""
    return (wide_registers() and
            max(in_channels, out_channels) <= WINOGRAD_COPIES_MAX_CHANNELS)


def winograd_large_tiles(g, itemsize: int, copies: int = 1) -> bool:
    """Whether the channels-last ``winograd`` forward form ``g`` (of a forward, a data
    gradient or, with ``copies`` 2 * SLOTS, a weight gradient; 2D, or 3D per depth slice)
    runs F(4x4, 3x3)."""
    three = g.r == (3, 3, 3)
    largest = itemsize * g.n * max(g.c * math.prod(g.s), g.k * math.prod(g.p))
    taps = 3 if three else 1
    return (g.channels_last and (three or g.r == (1, 3, 3) and g.s[0] == 1)
            and large_tiles_pay(g.n * g.p[0], g.c, g.k, g.p[1:], taps)
            and large_tiles_fit(taps * g.c, g.k, itemsize, largest, copies))


def winograd_by_outputs(g, itemsize: int) -> bool:
    """Whether the channels-last 2D F(2x2, 3x3) forward form ``g`` runs by blocks of output
    channels (``_winograd._forward_by_outputs``): V (16 values per weight) larger than U
    (16 per tile and input channel), and U of every tile within the workspace bound."""
    return g.channels_last and _few_tiles(g, itemsize, WINOGRAD_BY_OUTPUTS_TILES)


def winograd_by_panels(g, itemsize: int) -> bool:
    """Whether the 2D F(2x2, 3x3) forward form ``g`` (either layout) runs by panels of
    output channels (``_winograd._forward_by_panels``): V many times larger than U, and U
    within the workspace bound."""
    return _few_tiles(g, itemsize, WINOGRAD_BY_PANELS_TILES)


def winograd_wgrad_by_panels(g, itemsize: int) -> bool:
    """Whether the weight gradient of the 2D F(2x2, 3x3) geometry ``g`` (either layout)
    runs by panels of output channels (``_winograd._weight_gradient_by_panels``)."""
    tiles = g.n * -(-g.p[1] // 2) * -(-g.p[2] // 2)
    return (tiles >= WINOGRAD_WGRAD_BY_PANELS_MIN_TILES
            and _few_tiles(g, itemsize, WINOGRAD_WGRAD_BY_PANELS_TILES))


def _few_tiles(g, itemsize: int, per_output: float) -> bool:
    from ._tiles import WORKSPACE_BYTES
    tiles = g.n * -(-g.p[1] // 2) * -(-g.p[2] // 2)
    return (g.r == (1, 3, 3) and g.s[0] == 1 and tiles <= per_output * g.k
            and 16 * tiles * g.c * itemsize <= WORKSPACE_BYTES)


def large_tiles_fit(depth: int, outputs: int, itemsize: int, largest: int,
                    copies: int) -> bool:
    """Whether F(4x4, 3x3)'s V (36 values per pair of channels), ``copies`` of it (the
    weight gradient's partial sums, counted as :func:`winograd_reason` counts F(2x2, 3x3)'s),
    stays within the workspace bound, max(WORKSPACE_BYTES, ``largest`` operand)."""
    from ._tiles import WORKSPACE_BYTES
    return 36 * depth * outputs * itemsize * copies <= max(WORKSPACE_BYTES, largest)


def large_tiles_pay(images: int, depth: int, outputs: int, size, taps: int = 1) -> bool:
    """Whether F(4x4, 3x3) pays on a forward form of ``images`` 2D images (3D: depth
    slices, summed over ``taps`` depth taps), ``depth`` input and ``outputs`` output channels
    and an output of ``size`` (rows, columns)."""
    if not (min(depth, outputs) >= WINOGRAD_LARGE_MIN_CHANNELS
            and taps * depth <= WINOGRAD_LARGE_MAX_DEPTH):
        return False
    small = -(-size[0] // 2) * -(-size[1] // 2)
    large = -(-size[0] // 4) * -(-size[1] // 4)
    return (images * large >= WINOGRAD_LARGE_MIN_TILES
            and (taps == 1 or large >= WINOGRAD_LARGE_3D_MIN_SLICE_TILES)
            and 16 * small >= WINOGRAD_LARGE_MIN_SAVING * 36 * large)


def direct_applies(problem) -> bool:
    """The ``direct`` algorithms: grouped, with few input channels per group."""
    return problem.groups > 1 and \
        problem.in_channels // problem.groups <= DIRECT_MAX_CHANNELS_PER_GROUP


def thin_products(op, problem) -> bool:
    """A stride-1 forward or data gradient (or transposed convolution) into
    IMPLICIT_THIN_OUTPUTS float32 channels (y's, dx's) from at most IMPLICIT_THIN_MAX_DEPTH
    (x's, dy's), without AVX-512: ``implicit``'s, whatever the rows' width."""
    if op == "conv":
        depth, outputs = problem.in_channels, problem.out_channels
    elif op in ("conv_backward_data", "conv_transpose"):
        depth, outputs = problem.out_channels, problem.in_channels
    else:
        return False
    return (problem.groups == 1 and problem.dtype == "float32"
            and all(s == 1 for s in problem.stride) and outputs == IMPLICIT_THIN_OUTPUTS
            and depth <= IMPLICIT_THIN_MAX_DEPTH
            and (problem.channels_last or depth >= IMPLICIT_MIN_CHANNELS_FIRST)
            and not wide_registers())


def winograd_reason(op, problem) -> Optional[str]:
    """Why ``winograd`` is the choice for this problem, or None where it is not."""
    if not winograd_applies(op, problem) or thin_products(op, problem):
        return None
    sizes = problem.input_size if op in ("conv_backward_data", "conv_transpose") \
        else problem.output_size
    per_slice = math.prod(-(-size // 2) for size in sizes[-2:])
    tiles = problem.batch * math.prod(sizes[:-2]) * per_slice     # 3D: every depth slice
    if len(sizes) == 3 and per_slice < WINOGRAD_3D_MIN_SLICE_TILES:
        return None
    channels = min(problem.in_channels, problem.out_channels)
    itemsize = problem.numpy_dtype.itemsize
    largest = itemsize * problem.batch * max(
        problem.in_channels * math.prod(problem.input_size),
        problem.out_channels * math.prod(problem.output_size))
    # F(4x4, 3x3): 2D, channels-last or through channels-last copies (forward form: C in, K
    # out over the output; the data gradient's is the other way round, over the input).
    forward_form = ((problem.out_channels, problem.in_channels, problem.input_size)
                    if op in ("conv_backward_data", "conv_transpose") else
                    (problem.in_channels, problem.out_channels, problem.output_size))
    from ._tiles import SLOTS, WORKSPACE_BYTES
    copies = 2 * SLOTS if op == "conv_backward_weight" else 1
    taps = 3 if problem.ndim == 3 else 1
    large = ((problem.channels_last or winograd_via_copies(
        problem.in_channels, problem.out_channels)) and large_tiles_pay(
            problem.batch * math.prod(forward_form[2][:-2]), forward_form[0],
            forward_form[1], forward_form[2][-2:], taps)
        and large_tiles_fit(taps * forward_form[0], forward_form[1], itemsize, largest,
                            copies))
    if op == "conv_backward_weight":
        flat = problem.ndim == 2
        # F(4x4, 3x3) (through copies of x and dy) outruns implicit on wide rows too.
        wide_rows = (flat and not problem.channels_last and wide_registers() and not large
                     and problem.output_size[-1] >= WINOGRAD_WGRAD_CF_WIDE_ROWS)
        least = WINOGRAD_WGRAD_CF_MIN_CHANNELS if wide_rows else WINOGRAD_WGRAD_MIN_CHANNELS
        # By panels of output channels (few tiles): no partial sums of dV to hold.
        from .._kernel_geometry import geom
        panels = flat and not large and winograd_wgrad_by_panels(geom(problem), itemsize)
        if channels < least or (tiles < WINOGRAD_WGRAD_MIN_TILES and not panels):
            return None
        if panels:
            return (f"2D 3x3, stride 1, one group, {channels}+ channels, {tiles} 2x2 output "
                    f"tiles, at most {WINOGRAD_WGRAD_BY_PANELS_TILES} per output channel: "
                    f"Winograd F(2x2, 3x3) by panels of output channels, 2.25 times fewer "
                    f"multiplications than a direct product")
    elif channels < WINOGRAD_MIN_CHANNELS or tiles < WINOGRAD_MIN_TILES:
        return None
    # The transformed weights (16 values for 9) count against the workspace bound: once,
    # or for the weight gradient once per partial sum and once per worker's buffer, as many
    # workers as partial sums at most: counted so, the choice does not depend on the thread
    # count (which would change the weight gradient's bits).
    weights = problem.in_channels * problem.out_channels * math.prod(problem.kernel_size) \
        * itemsize
    largest = max(weights, largest)
    if weights * 16 // 9 * copies > max(WORKSPACE_BYTES, largest):
        return None
    shape = "2D 3x3" if problem.ndim == 2 else "3D 3x3x3 (summed over the depth taps)"
    copies = ("; channels-first through channels-last copies of its input and output"
              if (op != "conv_backward_weight" or large) and not problem.channels_last and
              winograd_via_copies(problem.in_channels, problem.out_channels) else "")
    if large:
        tiles = problem.batch * math.prod(forward_form[2][:-2]) * math.prod(
            -(-s // 4) for s in forward_form[2][-2:])
        return (f"{shape}, stride 1, one group, {channels}+ channels, {tiles} "
                f"4x4 output tiles: Winograd F(4x4, 3x3), 4 times fewer multiplications "
                f"than a direct product, in 36 BLAS products per job of tiles{copies}")
    return (f"{shape}, stride 1, one group, {channels}+ channels, {tiles} 2x2 output tiles: "
            f"Winograd F(2x2, 3x3), 2.25 times fewer multiplications than a direct "
            f"product, in 16 BLAS products per job of tiles{copies}")


def wide_registers() -> bool:
    """Whether this CPU's float32 vectors are 512 bits wide (AVX-512, 32 vector registers):
    the micro-kernel's tiles for the implicit forward and data gradient need them."""
    import numpy as np

    from ._microkernel import vector_lanes
    return vector_lanes(np.float32) == 16


def implicit_reason(op, problem) -> Optional[str]:
    """Why ``implicit`` is the choice for this problem, or None where it is not."""
    if not implicit_applies(op, problem):
        return None
    if op == "conv_backward_weight":
        width = problem.output_size[-1]           # the products' depth
        run = problem.kernel_size[-1] * problem.in_channels
        if width < IMPLICIT_MIN_WIDTH:
            channels = max(problem.in_channels, problem.out_channels)
            if channels > IMPLICIT_NARROW_MAX_CHANNELS:
                return None
            return (f"one group, output rows of {width} pixels and at most {channels} "
                    f"channels: windows read in place by numbaconv's micro-kernel, no "
                    f"im2col matrix (BLAS is slow on matrices this thin)")
        if not problem.channels_last:
            why = "channels-first"
        elif problem.stride[-1] == 1:
            why = "channels-last with stride 1 along the rows"
        elif run <= IMPLICIT_MAX_RUN:
            why = f"channels-last with windows of {run} values per tap row"
        elif problem.in_channels >= IMPLICIT_STRIDED_MIN_CHANNELS and (
                not wide_registers() or max(problem.in_channels, problem.out_channels)
                <= IMPLICIT_STRIDED_MAX_CHANNELS):
            why = f"channels-last with {problem.in_channels} input channels"
        else:
            return None
        return (f"one group, output rows of {width} pixels, {why}: windows read in place "
                f"by numbaconv's micro-kernel, no im2col matrix")
    if any(s != 1 for s in problem.stride):       # the data gradient by stride phases
        depth, outputs = problem.out_channels, problem.in_channels
        pixels = problem.batch * math.prod(problem.input_size)
        taps = math.prod(problem.kernel_size)
        least = 2 if problem.channels_last else IMPLICIT_PHASED_CF_MIN_TAPS
        deepest = IMPLICIT_PHASED_MAX_DEPTH_CL if problem.channels_last and \
            wide_registers() else IMPLICIT_PHASED_MAX_DEPTH
        if depth > deepest or outputs < IMPLICIT_PHASED_MIN_OUTPUTS or \
                pixels < IMPLICIT_PHASED_MIN_PIXELS or taps < least or \
                (wide_registers() and not _fills_output_tiles(outputs)):
            return None
        layout = ("channels-last" if problem.channels_last else
                  f"channels-first ({taps} taps; through channels-last copies of dy and dx)")
        return (f"one group, {layout}, stride {tuple(problem.stride)}, {depth} channels "
                f"of dy: by stride phases, dy's rows read in place by numbaconv's "
                f"micro-kernel, no col2im")
    if thin_products(op, problem):
        return (f"stride 1, one group, {IMPLICIT_THIN_OUTPUTS} float32 output channels (one "
                f"column of micro-kernel tiles; BLAS is slow on products that thin): windows "
                f"read in place by numbaconv's micro-kernel, no im2col matrix")
    # The forward form's output rows and input channels: y's and x's, or for the data
    # gradient dx's and dy's.
    width, channels, outputs = \
        (problem.output_size[-1], problem.in_channels, problem.out_channels) if op == "conv" \
        else (problem.input_size[-1], problem.out_channels, problem.in_channels)
    if width < IMPLICIT_MIN_WIDTH or (not problem.channels_last and
                                      channels < IMPLICIT_MIN_CHANNELS_FIRST):
        return None
    if not _fills_output_tiles(outputs):
        return None
    if not wide_registers():
        return None
    from .._kernel_geometry import geom
    layout = f"channels-last rows of {width} pixels" if problem.channels_last else \
        "channels-first 1D, through channels-last copies of its input and output" \
        if implicit_through_copies(geom(problem)) else "channels-first"
    return (f"stride 1, one group, {layout}: windows read in place by numbaconv's "
            f"micro-kernel, no im2col matrix")


def implicit_through_copies(g) -> bool:
    """Whether a stride-1 ``implicit`` forward form (forward, data gradient) of the geometry
    ``g`` runs on channels-last copies of its input and output: channels-first 1D problems
    (outer sizes and kernel 1), whose rows are one image's whole length (the copies cost
    less than interleaving the windows' channels in place; docs/cpu-algorithms.md,
    "channels-first 1D through copies")."""
    return not g.channels_last and g.s[:2] == (1, 1) and g.r[:2] == (1, 1)


def _fills_output_tiles(outputs: int) -> bool:
    """Whether ``outputs`` channels fill the micro-kernel's IMPLICIT_OUTPUT_BLOCK-wide tiles
    (AVX-512): a multiple of the block, or at least 8 blocks; or its narrow tiles, half as
    wide (``_microkernel.narrow_tiles``): a multiple of half the block."""
    return outputs % (IMPLICIT_OUTPUT_BLOCK // 2) == 0 or outputs >= 8 * IMPLICIT_OUTPUT_BLOCK


def gemm_reason(problem) -> Optional[str]:
    """Why ``gemm`` applies to this problem, or None where it does not."""
    from .._kernel_geometry import geom
    g = geom(problem)
    if g.pointwise:
        return "1x1 kernel, stride 1, no padding: a plain matrix product"
    if g.whole_input:
        return "the kernel covers the whole input: a matrix product over images"
    return None


# --- Ctrl-C --------------------------------------------------------------------------------
#: ``implicit`` and ``direct`` run a call as Numba parallel regions launched from the calling
#: thread, and Python sees Ctrl-C only between them: a call of more multiply-adds than this
#: is a loop of regions of about this many each (ranges of its jobs, at least one job per
#: thread), so that KeyboardInterrupt comes within a region's time (about 0.1 s on 2 AVX2
#: cores). Smaller regions answer sooner but each pays a launch and a closing barrier.
IMPLICIT_PIECE_MACS = 2**31
#: The same for ``direct``, whose loops multiply 3-8 times more slowly (depthwise layers
#: move more bytes per multiply-add).
DIRECT_PIECE_MACS = 2**28

# --- paths inside the algorithms ----------------------------------------------------------
#: Channels-last 1x1 products (one group) with at least this many rows (N * S) per channel
#: (of the larger count) run through the micro-kernel reading the rows in place; fewer, BLAS.
ROWS_GEMM_FROM = 16


def rows_in_place(g) -> bool:
    """Whether the channels-last 1x1 product of ``g`` goes to :func:`._tiles.rows_matmul`."""
    return (g.pointwise and g.channels_last and g.groups == 1
            and g.n * g.positions >= ROWS_GEMM_FROM * max(g.c, g.k))


#: Channels-first tiles of several images with fewer output positions per image than this
#: are one product over all their positions: per-image products that narrow run slowly.
BATCH_COLUMNS_BELOW = 512


def batch_columns(g, nb: int) -> bool:
    return nb > 1 and g.positions < BATCH_COLUMNS_BELOW


def pointwise_rows_in_place(g, dtype) -> bool:
    """Whether a channels-first 1x1 weight gradient of the geometry ``g`` reads dy's rows
    in place (``_gemm._pointwise_cf_in_place``, on ``_microkernel.nt_rows``): one group,
    AVX-512 (where the strided tile was measured), x's channels a multiple of the tiles'
    columns (64 float32) and dy's at least their rows."""
    import numpy as np

    from ._microkernel import strided_shape, vector_lanes
    mr, nv = strided_shape(dtype)
    return (g.pointwise and not g.channels_last and g.groups == 1 and wide_registers()
            and np.dtype(dtype) in (np.float32, np.float64)
            and g.c % (nv * vector_lanes(dtype)) == 0 and g.k >= mr)


def pointwise_streamed(g, dtype) -> bool:
    """Whether a channels-first 1x1 data gradient (or forward) of the geometry ``g`` runs
    through ``_gemm.streamed_matmul`` (dy's, or x's, blocks copied while prefetched) rather
    than OpenBLAS: one group, AVX-512 (the tiles' 8 x 2 vectors need its 32 registers) and
    at least STREAMED_POSITIONS positions an image."""
    import numpy as np
    return (g.pointwise and not g.channels_last and g.groups == 1 and wide_registers()
            and np.dtype(dtype) in (np.float32, np.float64)
            and g.positions >= STREAMED_POSITIONS)


#: Fewest positions an image for ``pointwise_streamed``: an image's few jobs then each pass
#: the whole weight (from L3 where it is large) under a narrow block of dy, and OpenBLAS,
#: which keeps a block of the weight in L2 across the columns, runs faster.
STREAMED_POSITIONS = 1024


#: Positions (of all images) per partial sum of the channels-first 1x1 weight gradient read
#: in place: each partial (K x C values) is written and added once, so fewer positions
#: than this per partial cost more in sums than they save in parallel work; the row
#: blocks of dy share the work out where there are fewer partials.
POINTWISE_SLOT_POSITIONS = 256


def pointwise_slots(g) -> int:
    """Partial sums of ``_gemm._pointwise_cf_in_place`` (a function of the shape alone):
    the most, up to SLOTS, that share the images evenly with POINTWISE_SLOT_POSITIONS
    positions each at least (jobs of unequal slots would leave a thread idle)."""
    from ._tiles import SLOTS
    most = max(1, min(SLOTS, g.n, g.n * g.positions // POINTWISE_SLOT_POSITIONS))
    return max(d for d in range(1, most + 1) if g.n % d == 0)


#: A channels-last 1x1 weight gradient with at least this many positions per channel (of the
#: larger count) is SLOTS products over runs of positions; fewer, one product, rows shared.
POSITION_SPLIT_FROM = 16


#: dw (G, Kg, features) is computed transposed below this many output channels per group
#: (channels-last windows; channels-first ones below TRANSPOSED_BELOW_CF): BLAS runs that
#: product faster for small Kg; wide layers would pay for the transpose back.
TRANSPOSED_BELOW = 256
TRANSPOSED_BELOW_CF = 512


#: Channels-first weight gradients of one group in tiles of whole images of fewer than
#: BATCH_COLUMNS_BELOW output positions (several images a product) go by pieces of input
#: channels (``_im2col._weight_gradient_by_features``) of FEATURE_PIECE_ROWS packed rows
#: (channels times taps): larger pieces make faster products (OpenBLAS packs dy's columns
#: once a piece), but bound the workers a call can use, so on a machine with more cores
#: than that makes pieces, as many pieces as cores, down to FEATURE_PIECE_MIN_ROWS rows a
#: piece; at most FEATURE_PIECES, and only where that makes two or more. Fixed by the shape
#: and the machine's CPU count, never by the threads, so the bits do not depend on them.
FEATURE_PIECE_ROWS = 1152
FEATURE_PIECE_MIN_ROWS = 576
FEATURE_PIECES = 8


@functools.lru_cache(maxsize=None)
def machine_cores() -> int:
    """The machine's logical CPUs (``os.cpu_count()``, read once: it costs tens of
    microseconds): what the pieces above follow, not the thread settings
    (NUMBA_NUM_THREADS, ``numba.set_num_threads``, the BLAS's)."""
    return os.cpu_count() or 1


def feature_pieces(g, tiles: list, cores: Optional[int] = None) -> int:
    """How many pieces of input channels im2col's weight gradient goes by (above), on a
    machine of ``cores`` logical CPUs (None: this one's); 0: by slots of tiles."""
    whole = g.p[0] * g.p[1]
    if g.channels_last or g.groups != 1 or len(tiles) < 2 \
            or g.positions >= BATCH_COLUMNS_BELOW \
            or any(q1 - q0 != whole for _, _, q0, q1 in tiles):
        return 0
    features = g.c * g.taps
    cores = machine_cores() if cores is None else cores
    pieces = features // FEATURE_PIECE_ROWS
    if pieces < cores:
        pieces = max(pieces, min(cores, features // FEATURE_PIECE_MIN_ROWS))
    pieces = min(FEATURE_PIECES, pieces, g.c)
    return pieces if pieces >= 2 else 0


#: Channels-last, one group: dw of at most this many values is multiplied by the micro-kernel
#: reading windows and dy in place (``_microkernel.gram``); a larger dw is faster by BLAS.
IN_PLACE_DW_UP_TO = 2**18


#: Channels-first depthwise ``same`` 3x3 weight gradients take the column strips of
#: :func:`._direct_cf_plane._cf_same3_weight` on rows of at least this many pixels.
SAME_WEIGHT_MIN_WIDTH = 8

#: Channels-last depthwise ``same`` 3x3 weight gradients walk 4 output rows at a time
#: (:func:`._direct_cl._same3_weight_rows`) where x and dy together take at least
#: SAME_WEIGHT_ROWS_MIN_BYTES and their rows at least SAME_WEIGHT_ROWS_MIN_WIDTH pixels:
#: operands that stay in cache from call to call run as fast or faster one row at a time
#: (docs/cpu-algorithms.md).
SAME_WEIGHT_ROWS_MIN_BYTES = 16 * 2**20
SAME_WEIGHT_ROWS_MIN_WIDTH = 24
