"""The cpu backend's heuristics: which algorithm runs a problem, and which path inside an
algorithm, with the thresholds they compare against.

Every threshold says in a line or two what it trades off; the measurements behind it (machine,
command, date) are in docs/cpu-algorithms.md, "Thresholds". Pure Python: importing this module
imports neither Numba nor a kernel.
"""

from __future__ import annotations

import math
from typing import Optional

from ..backend import DIRECT_MAX_CHANNELS_PER_GROUP

#: The weight gradient of one group runs ``implicit`` for output rows of at least this many
#: pixels (the depth of its products); channels-last only with stride 1 along them or
#: windows of at most ``IMPLICIT_MAX_RUN`` values per tap row (KW * C). Measured on one core
#: (Zen 4), float32, N = 8, min of 7, implicit against im2col. Channels-last: the 7x7
#: stride-2 stem (runs of 21) 21.3 against 29.3 ms; stride 1 with rows of 56, 28 and 1024
#: pixels (ResNet 64c 56x56, 128c 28x28, 1D k5 128c) 1.00-1.03x; 14 pixels (256c 14x14)
#: 0.87x, 7 (512c 7x7) 0.41x; stride 2 with long runs (128c and 256c ResNet, 1D 256c k3,
#: 3D 32c) 0.70-0.96x. Channels-first, where im2col packs more slowly: 1.11-1.61x on every
#: shape with rows of 28 pixels or more, strides 1 and 2 (stem 23.2 against 27.1 ms),
#: 0.90-0.96x at 14.
#:
#: The forward and the stride-1 data gradient (a forward convolution of dy) run
#: ``implicit`` for output rows (y's, dx's) of at least this many pixels, channels-first
#: only with at least ``IMPLICIT_MIN_CHANNELS_FIRST`` input channels (dy's for the data
#: gradient; fewer leave its register transposes to a scalar loop). Measured the same way,
#: data gradient: ResNet 64c 56x56 1.30x channels-first, 1.13x channels-last; 128c 28x28
#: 1.09x, 1.07x; 256c 14x14 1.08x, 1.01x; 512c 7x7 1.03x, 0.85x; 3D 64c 8x28x28 1.25x,
#: 1.11x; 1D k5 128c 0.97x, 1.09x. Forward, channels-first: 64c 56x56 1.19x, 512c 7x7
#: 0.78x, 8 and 3 input channels at 56x56 0.84x and 0.56x; channels-last 1.13x, 0.72x,
#: 1.29x, 1.51x.
#:
#: Their output channels (the forward's K, the data gradient's C) fill micro-kernel tiles
#: IMPLICIT_OUTPUT_BLOCK wide (float32 with AVX-512), so they must be a multiple of it, or
#: at least 8 times it (at most 1/9 of the tiles' columns wasted). Data gradients of 64
#: output channels at 56x56 into 3, 16 and 32 channels: 0.35-0.42x, 0.46-0.57x, 0.67-0.79x.
#:
#: The forward and the data gradient run it only with AVX-512 (:func:`wide_registers`): with
#: 16 vector registers their micro-kernel tile shrinks to 6 x 2 vectors (16 columns, see
#: ``_microkernel.strided_shape``) and loses to im2col. Measured on Zen 3 (AVX2, 2 cores,
#: float32, N = 8, medians of 3 alternating rounds in one process), data gradient, implicit
#: against im2col: ResNet 64c 56x56 0.75x channels-first, 0.78x channels-last; 128c 28x28
#: 0.65x, 0.58x; 256c 14x14 0.60x, 0.73x; mixed elsewhere (3D 64c 8x28x28 1.24x, 0.75x; 1D
#: k5 128c 0.85x, 1.08x). Its weight gradient still wins there (64c 56x56 1.33x, 1.38x; 128c 28x28
#: 1.00x, 1.25x), and more often: channels-last with stride 2 and long runs, where it lost
#: with AVX-512, it wins there with at least ``IMPLICIT_STRIDED_MIN_CHANNELS`` input
#: channels (ResNet 128c 56x56 1.37x, 1D k3 256c 1.20x; 3D 32c 0.79x).
IMPLICIT_MIN_WIDTH = 16


IMPLICIT_MAX_RUN = 32


#: The strided data gradient (channels-last, one group, a kernel of several taps) runs
#: ``implicit`` by stride phases (``_implicit.strided_data_gradient``) where dy has at
#: most IMPLICIT_PHASED_MAX_DEPTH channels (its products' depth: BLAS multiplies short
#: depths slowly, and im2col's col2im then moves taps * C values per dy pixel), dx at least
#: IMPLICIT_PHASED_MIN_OUTPUTS (the micro-kernel's tiles are 16 channels wide with AVX2) and
#: IMPLICIT_PHASED_MIN_PIXELS pixels over the batch. Measured on Zen 3 (AVX2, 2 cores,
#: float32, medians of 11 alternating rounds), stride 2, against im2col: dy channels -> dx
#: channels, 3x3 at 112x112, N = 8: 32 -> 32 7.9 against 10.4 ms, 32 -> 64 10.9 against
#: 15.4; 56x56: 32 -> 32 1.7 against 2.6, 16 -> 16 1.14 against 1.32, 64 -> 64 6.5 against
#: 6.7, 128 -> 128 22.9 against 19.3; 256 -> 256 at 28x28 29.4 against 18.1; 32 -> 32 at
#: 28x28 0.69 against 0.62; 3D 3x3x3 N = 2, 32 -> 32 at 16x56x56 9.2 against 11.4, 16 -> 16
#: 3.1 against 6.1; 1D k3 32 -> 32 at 2048 1.00 against 1.22, 256 -> 256 at 512 9.4 against
#: 9.0; but a 1x1 kernel of stride 2 (a strided 1x1 product) 1.00 against 0.53.
IMPLICIT_PHASED_MAX_DEPTH = 32


IMPLICIT_PHASED_MIN_OUTPUTS = 16


IMPLICIT_PHASED_MIN_PIXELS = 2**14


IMPLICIT_STRIDED_MIN_CHANNELS = 64


IMPLICIT_MIN_CHANNELS_FIRST = 16


IMPLICIT_OUTPUT_BLOCK = 64


#: ``winograd`` (2D 3x3, stride and dilation 1, one group) is chosen for the forward and the
#: data gradient with at least this many input and output channels (of the forward form:
#: dy's and dx's for the data gradient) and WINOGRAD_MIN_TILES 2x2 output tiles over the
#: batch. Measured on Zen 3 (AVX2, 2 cores, float32, N = 8, medians of 7 alternating
#: rounds in one process), data gradient, winograd against im2col, channels-first /
#: channels-last: ResNet 64c 56x56 1.44x / 1.80x, 128c 28x28 1.52x / 1.67x, 256c 14x14
#: 1.69x / 1.36x, 512c 7x7 1.56x / 1.41x; 32c 56x56 1.20x / 1.54x, 16c 112x112 1.05x /
#: 1.56x; N = 2, 64c 9x9 (50 tiles) 0.95x / 0.95x. Not measured with AVX-512, where it is
#: also chosen over ``implicit`` (its products are BLAS's, 2.25 times fewer multiply-adds).
#: Nor is it chosen where its transformed weights (16/9 of w) would pass the workspace
#: bound, max(64 MiB, the largest operand) (``_tiles.WORKSPACE_BYTES``).
#: 3D 3x3x3 layers (forward and data gradient, per depth slice, tiles counted over every
#: slice) follow the same rule. Measured the same way (medians of 9), winograd against
#: im2col, channels-first / channels-last, data gradient and forward: N = 2, 64c 8x28x28
#: 16.6 / 14.4 against 25.6 / 24.4 ms and 14.7 / 15.1 against 25.2 / 29.9; 32c 16x56x56
#: 43.8 / 47.2 against 64.6 / 98.3 and 45.0 / 26.7 against 67.8 / 48.9; 128c 8x14x14 13.0 /
#: 11.3 against 21.6 / 20.4; N = 4, 64c 4x14x14 7.5 / 6.1 against 9.7 / 9.2; N = 1, 16c
#: 16x32x32 4.3 / 3.7 against 4.5 / 4.6 (forward 5.3 / 3.8 against 5.2 / 4.9). But a job
#: is one slice's tiles at most, so slices of fewer than WINOGRAD_3D_MIN_SLICE_TILES tiles
#: are left to the others: N = 8, 64c 4x6x6 (9 tiles a slice) 7.5 / 7.6 against 6.1 / 4.0
#: ms; at 16 tiles a slice, N = 4, 128c 8x8x8 15.6 / 13.9 against 18.8 / 18.7, N = 8, 256c
#: 4x7x7 60.4 / 47.9 against 58.1 / 53.9.
WINOGRAD_MIN_CHANNELS = 16


WINOGRAD_MIN_TILES = 128


WINOGRAD_3D_MIN_SLICE_TILES = 16


#: The weight gradient by ``winograd`` is chosen from these: its products are one job of
#: tiles deep and add into a 16/9 dw-sized sum per job. Measured the same way (another run,
#: beside a CI job), winograd against implicit and im2col, channels-first / channels-last:
#: ResNet 64c 56x56 18.7 / 16.5 ms against 24.0 / 22.6 and 28.3 / 31.6; 128c 28x28 11.7 /
#: 15.5 against 25.9 / 24.9 and 22.1 / 39.8; 256c 14x14 18.8 / 17.9 against 33.4 / 33.9
#: and 27.5 / 26.7; but 512c 7x7 (128 tiles) 27.6 / 47.8 against im2col's 29.2 / 28.4,
#: and implicit wins below 64 channels (32c 56x56 6.5 / 4.1 against 7.6 / 9.3 ms).
WINOGRAD_WGRAD_MIN_CHANNELS = 64


WINOGRAD_WGRAD_MIN_TILES = 256


def implicit_applies(op, problem) -> bool:
    """The ``implicit`` algorithms: one group (a window's features are then runs of one
    input row, channels-last), and stride 1 for the forward; the data gradient (and the
    transposed convolution) with stride 1, or channels-last with any stride."""
    if problem.groups != 1:
        return False
    if op == "conv_backward_weight":
        return True
    stride_1 = all(s == 1 for s in problem.stride)
    if op == "conv":
        return stride_1
    return op in ("conv_backward_data", "conv_transpose") and \
        (stride_1 or problem.channels_last)


def winograd_applies(op, problem) -> bool:
    """The ``winograd`` algorithm: a 2D 3x3 kernel, stride and dilation 1, one group, for the
    forward, the data gradient (a forward convolution of dy) and the weight gradient (any
    padding); and a 3D 3x3x3 kernel likewise, for the forward and the data gradient; unless
    ``NUMBACONV_WINOGRAD=0``."""
    from ..config import winograd_enabled
    kernel = tuple(problem.kernel_size)
    shape = kernel == (3, 3) or (kernel == (3, 3, 3) and op != "conv_backward_weight")
    return (op in ("conv", "conv_backward_data", "conv_transpose", "conv_backward_weight")
            and winograd_enabled() and shape and problem.groups == 1
            and all(s == 1 for s in problem.stride) and all(d == 1 for d in problem.dilation))


def direct_applies(problem) -> bool:
    """The ``direct`` algorithms: grouped, with few input channels per group."""
    return problem.groups > 1 and \
        problem.in_channels // problem.groups <= DIRECT_MAX_CHANNELS_PER_GROUP


def winograd_reason(op, problem) -> Optional[str]:
    """Why ``winograd`` is the choice for this problem, or None where it is not."""
    if not winograd_applies(op, problem):
        return None
    sizes = problem.input_size if op in ("conv_backward_data", "conv_transpose") \
        else problem.output_size
    per_slice = math.prod(-(-size // 2) for size in sizes[-2:])
    tiles = problem.batch * math.prod(sizes[:-2]) * per_slice     # 3D: every depth slice
    if len(sizes) == 3 and per_slice < WINOGRAD_3D_MIN_SLICE_TILES:
        return None
    channels = min(problem.in_channels, problem.out_channels)
    if op == "conv_backward_weight":
        if channels < WINOGRAD_WGRAD_MIN_CHANNELS or tiles < WINOGRAD_WGRAD_MIN_TILES:
            return None
    elif channels < WINOGRAD_MIN_CHANNELS or tiles < WINOGRAD_MIN_TILES:
        return None
    # The transformed weights (16 values for 9) count against the workspace bound: once,
    # or for the weight gradient once per partial sum and once per worker's buffer.
    import numba

    from ._tiles import SLOTS, WORKSPACE_BYTES
    itemsize = problem.numpy_dtype.itemsize
    weights = problem.in_channels * problem.out_channels * math.prod(problem.kernel_size) \
        * itemsize
    largest = max(weights, itemsize * problem.batch * max(
        problem.in_channels * math.prod(problem.input_size),
        problem.out_channels * math.prod(problem.output_size)))
    copies = SLOTS + numba.get_num_threads() if op == "conv_backward_weight" else 1
    if weights * 16 // 9 * copies > max(WORKSPACE_BYTES, largest):
        return None
    shape = "2D 3x3" if problem.ndim == 2 else "3D 3x3x3 (summed over the depth taps)"
    return (f"{shape}, stride 1, one group, {channels}+ channels, {tiles} 2x2 output tiles: "
            f"Winograd F(2x2, 3x3), 2.25 times fewer multiplications than a direct "
            f"product, in 16 BLAS products per job of tiles")


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
            return None
        if not problem.channels_last:
            why = "channels-first"
        elif problem.stride[-1] == 1:
            why = "channels-last with stride 1 along the rows"
        elif run <= IMPLICIT_MAX_RUN:
            why = f"channels-last with windows of {run} values per tap row"
        elif not wide_registers() and problem.in_channels >= IMPLICIT_STRIDED_MIN_CHANNELS:
            why = f"channels-last with {problem.in_channels} input channels (no AVX-512)"
        else:
            return None
        return (f"one group, output rows of {width} pixels, {why}: windows read in place "
                f"by numbaconv's micro-kernel, no im2col matrix")
    if any(s != 1 for s in problem.stride):       # the data gradient by stride phases
        depth, outputs = problem.out_channels, problem.in_channels
        pixels = problem.batch * math.prod(problem.input_size)
        if depth > IMPLICIT_PHASED_MAX_DEPTH or outputs < IMPLICIT_PHASED_MIN_OUTPUTS or \
                pixels < IMPLICIT_PHASED_MIN_PIXELS or math.prod(problem.kernel_size) == 1:
            return None
        return (f"one group, channels-last, stride {tuple(problem.stride)}, {depth} channels "
                f"of dy: by stride phases, dy's rows read in place by numbaconv's "
                f"micro-kernel, no col2im")
    # The forward form's output rows and input channels: y's and x's, or for the data
    # gradient dx's and dy's.
    width, channels, outputs = \
        (problem.output_size[-1], problem.in_channels, problem.out_channels) if op == "conv" \
        else (problem.input_size[-1], problem.out_channels, problem.in_channels)
    if width < IMPLICIT_MIN_WIDTH or (not problem.channels_last and
                                      channels < IMPLICIT_MIN_CHANNELS_FIRST):
        return None
    if outputs % IMPLICIT_OUTPUT_BLOCK and outputs < 8 * IMPLICIT_OUTPUT_BLOCK:
        return None
    if not wide_registers():
        return None
    layout = f"channels-last rows of {width} pixels" if problem.channels_last else \
        "channels-first"
    return (f"stride 1, one group, {layout}: windows read in place by numbaconv's "
            f"micro-kernel, no im2col matrix")


def gemm_reason(problem) -> Optional[str]:
    """Why ``gemm`` applies to this problem, or None where it does not."""
    from .._kernel_geometry import geom
    g = geom(problem)
    if g.pointwise:
        return "1x1 kernel, stride 1, no padding: a plain matrix product"
    if g.whole_input:
        return "the kernel covers the whole input: a matrix product over images"
    return None


#: One-group channels-last 1x1 forward and data-gradient products whose rows (N * S) number
#: at least this many times the larger channel count run through
#: :func:`._microkernel.rows_gemm` (:func:`rows_matmul`), which reads the activations' rows
#: in place; fewer, longer rows go to BLAS (figures at rows_gemm).
ROWS_GEMM_FROM = 16


def rows_in_place(g) -> bool:
    """Whether the channels-last 1x1 product of ``g`` goes to :func:`rows_matmul`."""
    return (g.pointwise and g.channels_last and g.groups == 1
            and g.n * g.positions >= ROWS_GEMM_FROM * max(g.c, g.k))


#: Channels-first tiles of several images with fewer output positions per image than this
#: are multiplied as one product over all their positions (columns ordered image by image)
#: instead of one product per image: at 7x7 (49 columns) the per-image products ran at half
#: speed and the weight gradient wrote a whole dw per image.
BATCH_COLUMNS_BELOW = 512


def batch_columns(g, nb: int) -> bool:
    return nb > 1 and g.positions < BATCH_COLUMNS_BELOW


#: A channels-last 1x1 weight gradient whose positions (N * S, the products' shared axis)
#: number at least this many times its larger channel count is summed over SLOTS runs of
#: positions, each one BLAS product into a partial of dw, added in slot order; below, it is
#: one product over all positions, dw's rows shared out (every worker then reads all of x).
#: Measured on Zen 3 (AVX2, 2 cores, float32, one process, medians of 20 alternating
#: rounds), positions x K x C against the one product: 25,088 x 256 x 64 124 against 111
#: GFLOP/s, 25,088 x 64 x 256 122 against 115, 25,088 x 64 x 64 66 against 54, 6,272 x
#: 128 x 128 70 against 65; but 6,272 x 512 x 128 136 against 139, 1,568 x 256 x 1,024 135
#: against 156, 392 x 512 x 2,048 82 against 150.
POSITION_SPLIT_FROM = 16


#: dw (G, Kg, features) is computed transposed, (G, features, Kg), below this many output
#: channels per group: OpenBLAS runs that product faster for small Kg (64: 191 against 136
#: GFLOP/s on one thread, 512: 217 against 211), and wide layers would pay for transposing
#: the dw-sized result back (ResNet's 512-channel 7x7 layer: 9.4 MB).
TRANSPOSED_BELOW = 256


#: Channels-last, one group: dw's product runs through numbaconv's own micro-kernel, reading
#: the packed windows and dy in place (_microkernel.gram), for dw of at most this many values;
#: a larger dw, re-read and re-written per chunk of positions, ran slower there than BLAS.
#: One thread, one tile (Zen 4): the 7x7 stem 102 against 91 GFLOP/s, ResNet's 64-channel
#: 3x3 111 against 98, the 1D k5 128-channel layer 114 against 102; 256 channels at 14x14
#: (590k values) 104 both, 512 at 7x7 (2.4M) 79 against 100.
IN_PLACE_DW_UP_TO = 2**18


#: Channels-first depthwise weight gradients of ``same`` 3x3 windows take the column strips
#: of :func:`_cf_same3_weight` on rows of at least this many pixels: narrower rows are
#: strips of 4, 2 and 1 columns, which do a whole vector's work for fewer columns. Against
#: the flat kernel (Zen 3, 2 cores, N = 8, float32, alternating in one process, best of 90):
#: 1024 channels at 7x7 0.91x, 512 at 14x14 1.36x, 256 at 28x28 1.80x, 128 at 56x56 1.74x,
#: 32 at 112x112 1.55x.
SAME_WEIGHT_MIN_WIDTH = 8
