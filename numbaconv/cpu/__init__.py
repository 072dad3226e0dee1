"""The ``cpu`` backend: Numba CPU kernels (``@njit(parallel=True)``) plus NumPy's BLAS.

Importing this package imports neither Numba nor a kernel module: the backend object is
created on numbaconv's first dispatch, and each op's module (and its kernels, compiled for
the dtype at hand) loads on that op's first run.

Algorithms, per op (``numbaconv.explain`` says which one runs and why):

``gemm``
    The convolution is a plain matrix product over x: 1x1 kernels with stride 1 and no
    padding, or kernels exactly as large as the unpadded input. No packing at all: BLAS,
    or, for channels-last 1x1 forwards and data gradients with many rows per channel,
    numbaconv's micro-kernel reading the rows in place (``_microkernel.rows_gemm``).
``im2col``
    Any problem: windows packed by a Numba kernel into a matrix (col2im for the strided data
    gradient; a stride-1 data gradient is the forward convolution of dy with the flipped
    kernel), one BLAS product per tile of images. The packed workspace is at most
    max(64 MiB, the largest operand); a single image too large for that is split by rows.
    Tiles are shared among threads, each packing and multiplying on one core
    (:func:`._tiles.run_tiles`).
``implicit``
    One group, no im2col matrix: numbaconv's own micro-kernel (:mod:`._microkernel`) reads
    the windows in a padded channels-last copy of the input rows (:mod:`._implicit`). The
    weight gradient (any stride) multiplies them by dy's rows, one output row deep; the
    forward and the stride-1 data gradient multiply them by the weights, one tap row of
    window features deep. Chosen for rows of at least ``IMPLICIT_MIN_WIDTH`` pixels, with
    the conditions given there (:mod:`._heuristics`), and for the products too thin for
    BLAS of small layers (``IMPLICIT_NARROW_MAX_CHANNELS``; without AVX-512 also
    ``IMPLICIT_THIN_OUTPUTS``). The data gradient with a stride runs by stride phases: each
    tap's product of dy's pixels (read in place) by its weights is written straight into the
    dx pixels of its phase, no col2im (``_heuristics.IMPLICIT_PHASED_MAX_DEPTH``,
    ``IMPLICIT_PHASED_MAX_DEPTH_CL``);
    channels-first through channels-last copies of dy and dx.
``winograd``
    2D 3x3 kernels with stride and dilation 1, one group: the forward, the data gradient and
    the weight gradient by Winograd F(2x2, 3x3) (:mod:`._winograd`): per 2x2 output tile,
    16 products over channels of transformed 4x4 input patches and transformed weights (or
    transformed dy, for the weight gradient), BLAS products over jobs of tiles shared among
    the tile workers; 2.25 times fewer multiplications. 3D 3x3x3 kernels likewise, per depth
    slice, the three depth taps side by side in the products.
``direct``
    Numba loops without packing, for grouped convolutions with few channels per group
    (depthwise above all), where a GEMM would multiply one-column matrices.
``reduce``
    The bias gradient.

Modules, imports going down: this entry (its choices and thresholds in :mod:`._heuristics`)
-> one module per op (``conv``, ``conv_backward_data``, ``conv_backward_weight``, ...), which
maps each algorithm to its driver -> one module per algorithm, owning its drivers (``_gemm``,
``_im2col``, ``_implicit``, ``_winograd``, ``_direct``) and kernels (``_im2col_kernels``,
``_direct_cl``, ``_direct_cf_plane``, ``_direct_cf_slab``) -> the shared pieces: ``_tiles``
(tile workers, workspaces, BLAS products, weight matrices, fixed-order sums), ``_rows`` (row
kernels), ``_microkernel`` and ``_sliding`` (kernels written in LLVM IR). The geometry the
kernels see is :mod:`numbaconv._kernel_geometry`, shared with the cuda backend.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from ..backend import Backend, kept_module, run_op
from ..problem import CONV_OPS, RNN_OPS
from . import _load
from ._heuristics import (direct_applies, gemm_reason, implicit_applies, implicit_reason,
                          winograd_applies, winograd_reason)

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
        if gemm_reason(problem):
            found.append("gemm")
        if direct_applies(problem):
            found.append("direct")
        if implicit_applies(op, problem):
            found.append("implicit")
        if winograd_applies(op, problem):
            found.append("winograd")
        found.append("im2col")
        return tuple(found)

    def choose(self, op, problem):
        if op in RNN_OPS:
            return "fused", ("input projections and weight gradients as BLAS products over "
                             "all steps; per step, in chains of batch rows on the tile "
                             "workers, a recurrent product on weights packed once and "
                             "fused Numba gates")
        if op == "conv_backward_bias":
            return "reduce", "the only algorithm (parallel, fixed-order sums)"
        why = gemm_reason(problem)
        if why:
            return "gemm", why
        if "direct" in self.algorithms(op, problem):
            return "direct", (f"grouped with {problem.in_channels // problem.groups} "
                              f"channels per group: packing would cost more than it saves")
        why = winograd_reason(op, problem)
        if why:
            return "winograd", why
        why = implicit_reason(op, problem)
        if why:
            return "implicit", why
        return "im2col", "general case: packed windows and a BLAS product per tile"

    def start_threads(self) -> None:
        """Pick Numba's threading layer now: the first call that shares tiles among the tile
        workers would (small problems may never share tiles), with a tiny kernel."""
        from . import _tiles
        _tiles._parallel_kernels_in_workers()

    def run(self, op, problem, operands, out, algorithm):
        if op in CONV_OPS:
            # The CPU contract is C-contiguous operands, which the public calls always hand
            # over; run() called directly (plugins, tests) may get strided ones, which the
            # kernels' flat indexing would misread: copied once here instead.
            operands = tuple(_c_contiguous(a) for a in operands)
            if out is not None and not out.flags.c_contiguous:
                raise ValueError("out: expected a C-contiguous array (the cpu backend "
                                 "writes it in place)")
        return _run_on_fitting_threads(op, problem, operands, out, algorithm)


def _run_on_fitting_threads(op, problem, operands, out, algorithm):
    """``run_op``, on fewer threads while other processes keep this process's CPUs busy
    (:mod:`._load`): Numba's count for this calling thread, and NumPy's BLAS on one thread
    when one is left. The results the README promises to be independent of the thread count
    stay the same; a forward or data gradient may change in its last bits. A bias gradient
    small enough to run on one thread anyway is left alone (the switch would cost more than
    the call)."""
    if op == "conv_backward_bias":
        from .conv_backward_bias import runs_in_parallel
        if not runs_in_parallel(operands[0]):
            return run_op(__name__, op, problem, operands, out, algorithm)
    _tiles = kept_module(_TILES)
    threads = _load.threads_for_call(_tiles.numba_threads)
    if threads is None:
        return run_op(__name__, op, problem, operands, out, algorithm)
    with _tiles.on_threads(threads, blas=algorithm not in WITHOUT_BLAS):
        return run_op(__name__, op, problem, operands, out, algorithm)


_TILES = f"{__name__}._tiles"   # imports Numba: on the first call, not with the package

#: The algorithms that call no NumPy BLAS product (numbaconv's own kernels only): on a busy
#: machine their calls leave BLAS's thread count alone, which saves setting it twice.
WITHOUT_BLAS = frozenset({"implicit", "direct", "reduce"})


def _c_contiguous(a):
    import numpy as np
    if isinstance(a, np.ndarray) and not a.flags.c_contiguous:
        return np.ascontiguousarray(a)
    return a


def make_backend() -> CpuBackend:
    """Entry point of the built-in ``cpu`` backend."""
    return CpuBackend()
