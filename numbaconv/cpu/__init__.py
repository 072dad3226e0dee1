"""The ``cpu`` backend: Numba CPU kernels (``@njit(parallel=True)``) plus NumPy's BLAS.

Importing this package imports neither Numba nor a kernel module: the backend object is
created on numbaconv's first dispatch, and each op's module (and its kernels, compiled for
the dtype at hand) loads on that op's first run.

Algorithms, per op (``numbaconv.explain`` says which one runs and why):

``gemm``
    The convolution is a plain matrix product over x: 1x1 kernels with stride 1 and no
    padding, or kernels exactly as large as the unpadded input. No packing at all.
``im2col``
    Any problem: windows packed by a Numba kernel into a matrix (col2im for the strided data
    gradient; a stride-1 data gradient is the forward convolution of dy with the flipped
    kernel), one BLAS product per tile of images. The packed workspace is at most
    max(64 MiB, the largest operand); a single image too large for that is split by rows.
    Tiles are shared among threads, each packing and multiplying on one core
    (:func:`._gemm.run_tiles`).
``implicit``
    The weight gradient of one group without an im2col matrix: numbaconv's own
    micro-kernel (:mod:`._microkernel`) reads the windows in a padded channels-last copy of
    the input rows, and dy where it lies (channels-last) or from a transposed copy of its
    rows (:mod:`._implicit`). Chosen for output rows of at least ``IMPLICIT_MIN_WIDTH``
    pixels (see there); each product's depth is one output row.
``direct``
    Numba loops without packing, for grouped convolutions with few channels per group
    (depthwise above all), where a GEMM would multiply one-column matrices.
``reduce``
    The bias gradient.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Optional

from ..backend import Backend
from ..problem import CONV_OPS, RNN_OPS

_MODULES = {
    "conv": ("conv", "run"),
    "conv_backward_data": ("conv_backward_data", "run"),
    "conv_backward_weight": ("conv_backward_weight", "run"),
    "conv_backward_bias": ("conv_backward_bias", "run"),
    "conv_transpose": ("conv_backward_data", "run_transpose"),
    "rnn_forward": ("rnn_forward", "run"),
    "rnn_backward_data": ("rnn_backward_data", "run"),
    "rnn_backward_weights": ("rnn_backward_weights", "run"),
}

#: The weight gradient of one group runs ``implicit`` for output rows of at least this many
#: pixels; channels-last only with stride 1 along them or windows of at most
#: ``IMPLICIT_MAX_RUN`` values per tap row (KW * C). Measured on one core (Zen 4), float32,
#: N = 8, min of 7, implicit against im2col. Channels-last: the 7x7 stride-2 stem (runs of
#: 21) 21.3 against 29.3 ms; stride 1 with rows of 56, 28 and 1024 pixels (ResNet 64c
#: 56x56, 128c 28x28, 1D k5 128c) 1.00-1.03x; 14 pixels (256c 14x14) 0.87x, 7 (512c 7x7)
#: 0.41x; stride 2 with long runs (128c and 256c ResNet, 1D 256c k3, 3D 32c) 0.70-0.96x.
#: Channels-first, where im2col packs more slowly: 1.11-1.61x on every shape with rows of
#: 28 pixels or more, strides 1 and 2 (stem 23.2 against 27.1 ms), 0.90-0.96x at 14.
IMPLICIT_MIN_WIDTH = 16
IMPLICIT_MAX_RUN = 32

#: Channels per group up to which the direct kernels are offered (and chosen when grouped).
DIRECT_MAX_CHANNELS_PER_GROUP = 16


def implicit_applies(op, problem) -> bool:
    """The ``implicit`` weight gradient: one group (every window's features are then runs
    of one input row, channels-last)."""
    return op == "conv_backward_weight" and problem.groups == 1


def _gemm_applies(problem) -> Optional[str]:
    from ._layout import geom
    g = geom(problem)
    if g.pointwise:
        return "1x1 kernel, stride 1, no padding: a plain matrix product"
    if g.whole_input:
        return "the kernel covers the whole input: a matrix product over images"
    return None


class CpuBackend(Backend):
    """Numba CPU kernels for every convolution op (float32 and float64, both layouts) and the
    recurrent ops."""

    name = "cpu"
    device = "cpu"
    priority = 100
    version = "1"
    ops = frozenset(CONV_OPS + RNN_OPS)

    def availability(self) -> Optional[str]:
        if importlib.util.find_spec("numba") is None:
            return "Numba is not installed"
        return None

    def algorithms(self, op, problem):
        if op in RNN_OPS:
            return ("fused",)
        if op == "conv_backward_bias":
            return ("reduce",)
        found = []
        if _gemm_applies(problem):
            found.append("gemm")
        if problem.groups > 1 and \
                problem.in_channels // problem.groups <= DIRECT_MAX_CHANNELS_PER_GROUP:
            found.append("direct")
        if implicit_applies(op, problem):
            found.append("implicit")
        found.append("im2col")
        return tuple(found)

    def choose(self, op, problem):
        if op in RNN_OPS:
            return "fused", ("input projections and weight gradients as BLAS products over "
                             "all steps; per step a BLAS recurrent product and fused Numba gates")
        if op == "conv_backward_bias":
            return "reduce", "the only algorithm (parallel, fixed-order sums)"
        why = _gemm_applies(problem)
        if why:
            return "gemm", why
        if "direct" in self.algorithms(op, problem):
            return "direct", (f"grouped with {problem.in_channels // problem.groups} "
                              f"channels per group: packing would cost more than it saves")
        if implicit_applies(op, problem) and problem.output_size[-1] >= IMPLICIT_MIN_WIDTH:
            run = problem.kernel_size[-1] * problem.in_channels
            if not problem.channels_last:
                why = "channels-first"
            elif problem.stride[-1] == 1:
                why = "channels-last with stride 1 along the rows"
            elif run <= IMPLICIT_MAX_RUN:
                why = f"channels-last with windows of {run} values per tap row"
            else:
                why = None
            if why:
                return "implicit", (
                    f"one group, output rows of {problem.output_size[-1]} pixels, {why}: "
                    f"windows read in place by numbaconv's micro-kernel, no im2col matrix")
        return "im2col", "general case: packed windows and a BLAS product per tile"

    def run(self, op, problem, operands, out, algorithm):
        module_name, function = _MODULES[op]
        module = importlib.import_module(f"{__name__}.{module_name}")
        return getattr(module, function)(problem, operands, out, algorithm)


def make_backend() -> CpuBackend:
    """Entry point of the built-in ``cpu`` backend."""
    return CpuBackend()
