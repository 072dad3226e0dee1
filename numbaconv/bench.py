"""Timing the convolution ops: standard shapes, PyTorch comparison, dispatch overhead.

This module is the one place that knows how numbaconv is benchmarked; ``numbaconv bench``,
the asv suite in ``benchmarks/`` and the tests all build on it. Nothing here is imported by
``import numbaconv``, and PyTorch and threadpoolctl are optional: without them the comparison
column and the BLAS report say so instead of failing.

The standard shapes fall into groups (:data:`GROUPS`: ResNet 3x3, pointwise 1x1, depthwise
3x3, the 7x7 stem, 1D and 3D convolutions); :func:`summarize` takes the geometric mean of
PyTorch's time over a backend's per group and op and judges it against
:data:`GROUP_TARGETS`. :func:`gemm_peak`
measures the machine's matrix-product peak, each row's GFLOP/s being read as a fraction of
it; :func:`first_call_latency` times the first call of each op (JIT compilation) in fresh
processes, cold and from Numba's on-disk cache. :func:`blas_info` and
:func:`openblas_coretype_warning` record which BLAS kernel the run used and whether
``OPENBLAS_CORETYPE`` forced an older one; :func:`plot_ratios` draws the ratios (matplotlib,
the ``plot`` extra).

Times are medians over ``repeat`` samples after one warm-up call (which pays for any lazy
compilation). A sample of a call faster than a couple of milliseconds loops over the call
enough times to rise above the clock's resolution and divides, as :mod:`timeit` does.

Examples
--------
>>> from numbaconv import bench
>>> rows = bench.run_benchmarks(bench.QUICK_SHAPES, ["reference"], repeat=3, layout="both")
>>> summary = bench.summarize(rows)      # per backend, group and op; ratios need torch=
>>> bench.dispatch_overhead(["conv"])[0]["overhead_us"]      # doctest: +SKIP
6.1
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from . import dispatch
from . import problem as pb
from .conv import (conv, conv_backward_bias, conv_backward_data, conv_backward_weight,
                   conv_transpose)
from .problem import CONV_OPS, LAYOUTS
from .testing import ConvCase, case_arrays

#: Label of PyTorch called directly (not through a numbaconv backend) in tables and JSON. It
#: is deliberately not "torch", which is the name of a numbaconv plugin backend.
PYTORCH = "pytorch"

#: The groups of :data:`SHAPES`, in the order the summary lists them.
GROUPS = ("resnet3x3", "pointwise", "depthwise", "stem", "conv1d", "conv3d")

#: The issue's targets per group: the geometric mean, over the group's shapes and both
#: layouts, of PyTorch's time over numbaconv's, for each op of :data:`TARGET_OPS`. None: the
#: group is measured and summarised but has no target (1D and 3D).
GROUP_TARGETS = {"resnet3x3": 0.8, "pointwise": 1.5, "depthwise": 1.5, "stem": 1.0,
                 "conv1d": None, "conv3d": None}

#: The ops the targets apply to (the data and weight gradients).
TARGET_OPS = ("conv_backward_data", "conv_backward_weight")


@dataclass(frozen=True)
class BenchCase(ConvCase):
    """A benchmark shape: a :class:`~numbaconv.testing.ConvCase` and its summary group.

    Attributes
    ----------
    group : str
        One of :data:`GROUPS` for the standard shapes; rows of a shape are summarised
        (:func:`summarize`) with the other shapes of its group.
    """

    group: str = "other"


def group_of(case: ConvCase) -> str:
    """The summary group of ``case`` (``"other"`` for a plain ConvCase)."""
    return getattr(case, "group", "other")


#: Layers of common CNNs at a realistic batch size (channels-first logical shapes), grouped
#: as the issue's targets are. ``output_padding=1`` on the stride-2 shapes makes their
#: transposed convolutions map the output back to the input's size (28 to 56, 112 to 224).
SHAPES = (
    BenchCase("resnet3x3_64c_56", (8, 64, 56, 56), (64, 64, 3, 3), padding=1,
              group="resnet3x3"),
    BenchCase("resnet3x3_128c_28", (8, 128, 28, 28), (128, 128, 3, 3), padding=1,
              group="resnet3x3"),
    BenchCase("resnet3x3_256c_14", (8, 256, 14, 14), (256, 256, 3, 3), padding=1,
              group="resnet3x3"),
    BenchCase("resnet3x3_512c_7", (8, 512, 7, 7), (512, 512, 3, 3), padding=1,
              group="resnet3x3"),
    BenchCase("resnet3x3s2_128c_56", (8, 128, 56, 56), (128, 128, 3, 3), stride=2,
              padding=1, output_padding=1, group="resnet3x3"),
    BenchCase("resnet3x3s2_256c_28", (8, 256, 28, 28), (256, 256, 3, 3), stride=2,
              padding=1, output_padding=1, group="resnet3x3"),
    BenchCase("pointwise_64to256_56", (8, 64, 56, 56), (256, 64, 1, 1), group="pointwise"),
    BenchCase("pointwise_1024to256_14", (8, 1024, 14, 14), (256, 1024, 1, 1),
              group="pointwise"),
    BenchCase("depthwise3x3_128c_56", (8, 128, 56, 56), (128, 1, 3, 3), padding=1,
              groups=128, group="depthwise"),
    BenchCase("depthwise3x3_512c_14", (8, 512, 14, 14), (512, 1, 3, 3), padding=1,
              groups=512, group="depthwise"),
    BenchCase("stem7x7s2_3c_224", (8, 3, 224, 224), (64, 3, 7, 7), stride=2, padding=3,
              output_padding=1, group="stem"),
    # Sequence models (audio, text): a kernel-5 layer and a stride-2 downsampling one.
    BenchCase("conv1d_k5_128c_1024", (8, 128, 1024), (128, 128, 5), padding=2,
              group="conv1d"),
    BenchCase("conv1d_k3s2_256c_512", (8, 256, 512), (256, 256, 3), stride=2, padding=1,
              output_padding=1, group="conv1d"),
    # Video and volumetric models (C3D, 3D U-Net): 3x3x3, plain and stride 2.
    BenchCase("conv3d_3x3x3_64c_8x28", (2, 64, 8, 28, 28), (64, 64, 3, 3, 3), padding=1,
              group="conv3d"),
    BenchCase("conv3d_3x3x3s2_32c_16x56", (2, 32, 16, 56, 56), (32, 32, 3, 3, 3), stride=2,
              padding=1, output_padding=1, group="conv3d"),
)

#: The same kinds of layer shrunk so that every op on every backend, the slow reference
#: included, finishes in milliseconds; two in the ResNet group, so that its summary is a
#: mean over shapes.
QUICK_SHAPES = (
    BenchCase("resnet3x3_16c_14", (2, 16, 14, 14), (16, 16, 3, 3), padding=1,
              group="resnet3x3"),
    BenchCase("resnet3x3s2_16c_14", (2, 16, 14, 14), (16, 16, 3, 3), stride=2, padding=1,
              output_padding=1, group="resnet3x3"),
    BenchCase("pointwise_16to64_14", (2, 16, 14, 14), (64, 16, 1, 1), group="pointwise"),
    BenchCase("depthwise3x3_32c_14", (2, 32, 14, 14), (32, 1, 3, 3), padding=1, groups=32,
              group="depthwise"),
    BenchCase("stem7x7s2_3c_32", (2, 3, 32, 32), (16, 3, 7, 7), stride=2, padding=3,
              output_padding=1, group="stem"),
    BenchCase("conv1d_k5_16c_64", (2, 16, 64), (16, 16, 5), padding=2, group="conv1d"),
    BenchCase("conv3d_3x3x3_8c_6x8", (2, 8, 6, 8, 8), (8, 8, 3, 3, 3), padding=1,
              group="conv3d"),
)

# The RNN training-step shapes live in numbaconv.bench_rnn (RNN_SHAPES, QUICK_RNN_SHAPES).

#: The problem whose public call is timed against the backend's ``run`` to measure what
#: validation and dispatch add: small enough that the arithmetic is negligible.
TINY = ConvCase("tiny", (1, 2, 6, 6), (2, 2, 3, 3), padding=1)

#: Shapes on which the plain-NumPy reference is too slow to time by default.
BIG_SHAPE_NAMES = frozenset(c.name for c in SHAPES)

#: Seconds between measuring two engines, for their idle thread pools to stop spinning (seen
#: here: about 0.1 s for NumPy's OpenBLAS, 0.25 s for PyTorch's OpenMP; see
#: :func:`run_benchmarks`).
DEFAULT_SETTLE = 0.3

#: Environment variables that change what a benchmark measures; ``environment`` reports them.
ENV_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
            "OPENBLAS_THREAD_TIMEOUT", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER", "NUMBA_OPT",
            "OMP_WAIT_POLICY", "NUMBACONV_BACKEND", "NUMBACONV_AUTOTUNE",
            "NUMBACONV_JIT_CACHE", "NUMBACONV_FASTMATH", "NUMBACONV_OMP_PASSIVE")


# --- timing ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Timing:
    """Per-call times of one measurement, in seconds.

    Attributes
    ----------
    median, best : float
        Median and minimum over the samples.
    repeat : int
        Number of samples.
    number : int
        Calls per sample (a sample's time is divided by it).
    """

    median: float
    best: float
    repeat: int
    number: int


def _autonumber(fn: Callable[[], object], min_sample: float) -> int:
    """Calls per sample for one sample to last at least ``min_sample`` seconds, as timeit."""
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_sample or number >= 1_000_000:
            return number
        # Jump straight to the estimate, with headroom, instead of doubling many times.
        number = max(number * 2, int(number * min_sample / max(elapsed, 1e-9) * 1.2))


def time_call(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1,
              number: Optional[int] = None, min_sample: float = 2e-3) -> Timing:
    """Median per-call time of ``fn()``.

    Parameters
    ----------
    fn : callable
        Called without arguments; its result is discarded.
    repeat : int
        Number of samples (>= 1).
    warmup : int
        Untimed calls first (the first call of a Numba backend compiles).
    number : int, optional
        Calls per sample; by default enough for a sample to last ``min_sample`` seconds.
    min_sample : float
        Seconds one sample should at least last when ``number`` is not given.

    Returns
    -------
    Timing
    """
    if repeat < 1:
        raise ValueError(f"repeat: expected an int >= 1, got {repeat}")
    for _ in range(warmup):
        fn()
    if number is None:
        number = _autonumber(fn, min_sample)
    samples = []
    # The collector would charge one call for another's garbage; timeit turns it off too.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            start = time.perf_counter()
            for _ in range(number):
                fn()
            samples.append((time.perf_counter() - start) / number)
    finally:
        if gc_was_enabled:
            gc.enable()
    return Timing(statistics.median(samples), min(samples), repeat, number)


# --- problems and calls ------------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    """One op on one case, ready to run through the public API or a backend directly.

    Attributes
    ----------
    op : str
    case : ConvCase
    layout : str
    problem : ConvProblem or BiasProblem
        What validation makes of the public call's arguments.
    public : callable
        The numbaconv public function for ``op``.
    args : tuple
    kwargs : dict
        ``public(*args, **kwargs)`` is the user's call.
    operands : tuple
        What the backend's ``run`` receives for this op (see :mod:`numbaconv.backend`).
    """

    op: str
    case: ConvCase
    layout: str
    problem: object
    public: Callable
    args: tuple
    kwargs: dict
    operands: tuple

    def __call__(self):
        """Run the public call (validation, dispatch, backend)."""
        return self.public(*self.args, **self.kwargs)


def make_call(op: str, case: ConvCase, layout: str = "channels_first",
              dtype: str = "float32", arrays: Optional[dict] = None, seed: int = 0) -> Call:
    """Build the public call of ``op`` on ``case``, and its validated problem and operands.

    Parameters
    ----------
    op : str
        One of :data:`numbaconv.problem.CONV_OPS`.
    case : ConvCase
    layout : str
    dtype : str
    arrays : dict, optional
        :func:`numbaconv.testing.case_arrays` of this case, layout and dtype (reused across
        ops to save memory and time); made here if omitted.
    seed : int
        Seed of the random arrays when they are made here.

    Returns
    -------
    Call
    """
    a = arrays if arrays is not None else case_arrays(case, layout, dtype, seed)
    kw = dict(case.kwargs, layout=layout)
    if op == "conv":
        public, builder = conv, pb.conv_problem
        args = operands = (a["x"], a["w"], a["bias"])
    elif op == "conv_backward_data":
        public, builder = conv_backward_data, pb.conv_backward_data_problem
        args, operands = (a["dy"], a["w"], a["x"].shape), (a["dy"], a["w"])
    elif op == "conv_backward_weight":
        public, builder = conv_backward_weight, pb.conv_backward_weight_problem
        args, operands = (a["x"], a["dy"], a["w"].shape), (a["x"], a["dy"])
    elif op == "conv_backward_bias":
        public, builder = conv_backward_bias, pb.conv_backward_bias_problem
        args = operands = (a["dy"],)
        kw = dict(layout=layout)
    elif op == "conv_transpose":
        public, builder = conv_transpose, pb.conv_transpose_problem
        args = operands = (a["xt"], a["w"], a["bias_t"])
        kw["output_padding"] = case.output_padding
    else:
        raise ValueError(f"op: expected one of {CONV_OPS}, got {op!r}")
    # The problem builders take exactly the public functions' arguments.
    return Call(op, case, layout, builder(*args, **kw), public, args, kw, operands)


def flops(call: Call) -> int:
    """Floating-point operations of the call's main contraction (``problem.flops``)."""
    return int(call.problem.flops)


def cpu_backends(include_reference: bool = True) -> list:
    """Names of the available CPU backends, by descending priority (discovered, never assumed).

    Parameters
    ----------
    include_reference : bool
        Whether to list the plain-NumPy ``reference`` backend.

    Returns
    -------
    list of str
    """
    return [b.name for b in dispatch.backends() if b.available and b.device == "cpu"
            and (include_reference or b.name != "reference")]


def supports(backend: str, call: Call) -> Optional[str]:
    """``None`` if ``backend`` can run ``call`` here, else why it cannot."""
    info = next((b for b in dispatch.backends() if b.name == backend), None)
    if info is None:
        return f"no backend called {backend!r} is registered"
    if not info.available:
        return f"not available: {info.reason}"
    obj = dispatch.get_backend(backend)
    if obj.device != call.problem.device:
        return f"runs on {obj.device}, the arrays are on {call.problem.device}"
    try:
        return obj.supports(call.op, call.problem)
    except Exception as exc:  # a plugin's bug must not end the whole benchmark run
        return f"supports() raised {type(exc).__name__}: {exc}"


# --- PyTorch, called directly ------------------------------------------------------------

def import_torch():
    """PyTorch, or None when it is not installed (or fails to import)."""
    try:
        import torch
    except Exception:  # an unusable install is as good as none for a comparison column
        return None
    return torch


def torch_callable(call: Call, torch) -> Optional[Callable[[], object]]:
    """The same computation as ``call`` in PyTorch, or None where PyTorch has no equivalent.

    Forward and transposed convolutions go through ``torch.nn.functional``; the data and
    weight gradients through ``torch.ops.aten.convolution_backward`` (the op PyTorch's
    autograd itself calls), asked for that one gradient; the bias gradient is a plain
    ``torch.sum``. Channels-last arrays become channels-last tensors (the same memory seen
    through a permuted view), so neither side pays for a layout change. Asymmetric padding
    has no direct PyTorch form: None.
    """
    p = call.problem
    pads = getattr(p, "padding", None)  # a BiasProblem has no geometry
    if pads is not None and any(before != after for before, after in pads):
        return None
    F = torch.nn.functional

    def tensor(a, activation=True):
        t = torch.from_numpy(a)
        return t.movedim(-1, 1) if activation and call.layout == "channels_last" else t

    if call.op == "conv_backward_bias":
        # What PyTorch's convolution_backward does for the bias, minus its bookkeeping: a
        # sum over every axis but the channels (the fair baseline for a standalone bgrad).
        dy = tensor(call.operands[0])
        dims = (0,) + tuple(range(2, dy.ndim))
        return lambda: torch.sum(dy, dim=dims)

    nd = p.ndim
    stride, padding, dilation = list(p.stride), list(p.padding_before), list(p.dilation)
    if call.op == "conv":
        fn = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
        x, w, b = tensor(call.operands[0]), tensor(call.operands[1], False), call.operands[2]
        b = None if b is None else tensor(b, False)
        return lambda: fn(x, w, b, stride, padding, dilation, p.groups)
    if call.op == "conv_transpose":
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
        x, w, b = tensor(call.operands[0]), tensor(call.operands[1], False), call.operands[2]
        b = None if b is None else tensor(b, False)
        opad = list(p.output_padding)
        return lambda: fn(x, w, b, stride, padding, opad, p.groups, dilation)
    # The gradients: convolution_backward wants the forward input and weight tensors.
    if call.op == "conv_backward_data":
        dy, w = tensor(call.operands[0]), tensor(call.operands[1], False)
        x = torch.empty(call.args[2], dtype=dy.dtype)
        if call.layout == "channels_last":
            x = x.movedim(-1, 1)
        mask = [True, False, False]
    else:  # conv_backward_weight
        x, dy = (tensor(a) for a in call.operands)
        w = torch.empty(call.args[2], dtype=dy.dtype)
        mask = [False, True, False]
    args = (dy, x, w, None, stride, padding, dilation, False, [0] * nd, p.groups, mask)
    return lambda: torch.ops.aten.convolution_backward(*args)


# --- the benchmark table -----------------------------------------------------------------

@dataclass
class Row:
    """One line of the benchmark table.

    Attributes
    ----------
    shape, op, backend : str
        ``backend`` is a numbaconv backend name or :data:`PYTORCH`.
    layout, dtype : str
    status : str
        ``"ok"``, ``"skipped"`` (with the reason in ``detail``) or ``"error"``.
    median_s, best_s : float or None
        Per-call times in seconds.
    gflops : float or None
        ``flops / median_s / 1e9``.
    vs_pytorch : float or None
        PyTorch's median time over this row's: above 1 means this row is faster.
    detail : str
    group : str
        The shape's summary group (:func:`group_of`).
    peak_fraction : float or None
        ``gflops`` over the GEMM peak measured in the same run (:func:`gemm_peak`), when
        one was given to :func:`run_benchmarks`.
    pytorch_s : float or None
        PyTorch's median time on the same op, shape and layout (the baseline of
        ``vs_pytorch``), on the backends' rows.
    """

    shape: str
    op: str
    backend: str
    layout: str
    dtype: str
    status: str
    median_s: Optional[float] = None
    best_s: Optional[float] = None
    gflops: Optional[float] = None
    vs_pytorch: Optional[float] = None
    detail: str = ""
    group: str = "other"
    peak_fraction: Optional[float] = None
    pytorch_s: Optional[float] = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def resolve_layouts(layout) -> tuple:
    """The layouts named by ``layout``: one of ``LAYOUTS``, ``"both"``, or a sequence of them.

    Returns
    -------
    tuple of str
    """
    names = LAYOUTS if layout == "both" else (layout,) if isinstance(layout, str) else layout
    names = tuple(dict.fromkeys(names))
    bad = [n for n in names if n not in LAYOUTS]
    if bad or not names:
        raise ValueError(f"layout: expected one of {LAYOUTS} or 'both', got {layout!r}")
    return names


def run_benchmarks(shapes: Sequence[ConvCase], backends: Sequence[str], *,
                   ops: Sequence[str] = CONV_OPS, repeat: int = 5,
                   layout="channels_first", dtype: str = "float32",
                   torch=None, skip_reference_on: Iterable[str] = (),
                   settle: float = DEFAULT_SETTLE, peak_gflops: Optional[float] = None,
                   report: Optional[Callable[[Row], None]] = None,
                   progress: Optional[Callable[[int, int, str], None]] = None) -> list:
    """Time every op of every shape on each backend, and on PyTorch when ``torch`` is given.

    Backends are timed through the public functions inside ``use_backend(name)``: what a
    user's call costs, validation and dispatch included.

    Each shape and layout is measured in blocks, one per engine (PyTorch, then each backend), with a
    pause of ``settle`` seconds between blocks. Thread pools spin for a while after their
    last job (see :data:`DEFAULT_SETTLE`); when the next
    library's pool starts while the previous one still spins, on a machine with few cores
    the two fight for them and calls can take a thousand times longer. Interleaving ops of
    different libraries would measure that fight rather than the libraries.

    Parameters
    ----------
    shapes : sequence of ConvCase
    backends : sequence of str
        numbaconv backend names.
    ops : sequence of str
    repeat : int
        Samples per measurement.
    layout : str or sequence of str
        A layout, ``"both"`` (channels-first then channels-last), or a sequence of layouts.
    dtype : str
    torch : module, optional
        PyTorch, to time it directly as the baseline of the ``vs_pytorch`` column.
    skip_reference_on : iterable of str
        Shape names on which the ``reference`` backend is skipped (too slow).
    settle : float
        Seconds to wait between engines so idle thread pools go to sleep (see above).
    peak_gflops : float, optional
        The GEMM peak of this run (:func:`gemm_peak`); rows get ``peak_fraction`` from it.
    report : callable, optional
        Called with each :class:`Row` once its shape is done (progress for long runs).
    progress : callable, optional
        Called as ``progress(done, total, what)`` before each block (one engine on one
        shape and layout) with the number of blocks done, their total and a description of
        the block starting: for a progress display.

    Returns
    -------
    list of Row
        Ordered by shape, then layout, then op, then PyTorch before the backends in the
        given order.
    """
    skip_reference_on = frozenset(skip_reference_on)
    engines = ([PYTORCH] if torch is not None else []) + list(backends)
    blocks = [(case, lay) for case in shapes for lay in resolve_layouts(layout)]
    rows = []
    busy = False  # whether a block has run since the last pause
    done, total = 0, len(blocks) * len(engines)
    for case, layout in blocks:
        arrays = case_arrays(case, layout, dtype)
        calls = [make_call(op, case, layout, dtype, arrays) for op in ops]
        measured = {}
        for engine in engines:
            if progress is not None:
                progress(done, total, f"{case.name} {layout} on {engine}")
            done += 1
            if busy and settle > 0:
                time.sleep(settle)
            busy = False
            for call in calls:
                if engine == PYTORCH:
                    row = _time_pytorch(call, torch, repeat)
                elif engine == "reference" and case.name in skip_reference_on:
                    row = _row(call, engine, "skipped",
                               detail="reference is too slow here (--include-reference)")
                else:
                    why = supports(engine, call)
                    row = (_row(call, engine, "skipped", detail=why) if why is not None
                           else _time_backend(engine, call, repeat))
                busy = busy or row.status != "skipped"
                measured[call.op, engine] = row
        for op in ops:
            baseline = measured.get((op, PYTORCH))
            for engine in engines:
                row = measured[op, engine]
                if baseline is not None and baseline.median_s:
                    if engine != PYTORCH:
                        row.pytorch_s = baseline.median_s
                    if row.median_s:
                        row.vs_pytorch = baseline.median_s / row.median_s
                if peak_gflops and row.gflops is not None:
                    row.peak_fraction = row.gflops / peak_gflops
                rows.append(row)
                if report is not None:
                    report(row)
        del calls, arrays
    if progress is not None:
        progress(total, total, "done")
    return rows


def _row(call: Call, engine: str, status: str, timing: Optional[Timing] = None,
         detail: str = "") -> Row:
    row = Row(call.case.name, call.op, engine, call.layout, call.problem.dtype, status,
              detail=detail, group=group_of(call.case))
    if timing is not None:
        row.median_s, row.best_s = timing.median, timing.best
        row.gflops = flops(call) / timing.median / 1e9
    return row


def _time_pytorch(call: Call, torch, repeat: int) -> Row:
    fn = torch_callable(call, torch)
    if fn is None:
        return _row(call, PYTORCH, "skipped",
                    detail="no PyTorch equivalent (asymmetric padding)")
    try:
        return _row(call, PYTORCH, "ok", time_call(fn, repeat=repeat))
    except Exception as exc:  # an old PyTorch lacking an op: report it, keep going
        return _row(call, PYTORCH, "error", detail=f"{type(exc).__name__}: {exc}")


def _time_backend(name: str, call: Call, repeat: int) -> Row:
    try:
        with dispatch.use_backend(name):
            timing = time_call(call, repeat=repeat)
    except Exception as exc:  # report the broken backend and keep timing the others
        return _row(call, name, "error", detail=f"{type(exc).__name__}: {exc}")
    return _row(call, name, "ok", timing)


# --- the machine's GEMM peak and the per-group summary -----------------------------------

def gemm_name(dtype: str) -> str:
    """``"SGEMM"`` for float32, ``"DGEMM"`` for float64 (what :func:`gemm_peak` measures)."""
    return {"float32": "SGEMM", "float64": "DGEMM"}.get(str(dtype), f"GEMM ({dtype})")


def gemm_peak(size: int = 2048, dtype: str = "float32", *, repeat: int = 5) -> dict:
    """The GFLOP/s of NumPy's BLAS on a square matrix product: the machine's practical peak.

    Times ``np.matmul(a, b, out=c)`` on ``size x size`` matrices (an output buffer, so that
    no allocation is timed), under whatever thread limits are in force: call it where the
    benchmarks run, with the same BLAS threads, so that each row's fraction of this peak
    means something.

    Parameters
    ----------
    size : int
        Rows and columns of both matrices.
    dtype : str
    repeat : int
        Samples. The peak is the best of them: noise only ever slows a product down, and
        the median was not robust to it (a run here measured a median of 163 ms, half its
        samples slowed, where the best was 84 ms and other runs' medians 86-88 ms).

    Returns
    -------
    dict
        ``name`` (``"SGEMM"``...), ``size``, ``dtype``, ``flops`` (``2 * size**3``),
        ``median_s``, ``best_s``, ``gflops`` (from the best), ``repeat``, ``number``.
    """
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size)).astype(dtype)
    b = rng.standard_normal((size, size)).astype(dtype)
    c = np.empty((size, size), dtype)
    timing = time_call(lambda: np.matmul(a, b, out=c), repeat=repeat)
    work = 2 * size ** 3
    return dict(name=gemm_name(dtype), size=size, dtype=str(np.dtype(dtype)), flops=work,
                median_s=timing.median, best_s=timing.best,
                gflops=work / timing.best / 1e9, repeat=timing.repeat,
                number=timing.number)


def geometric_mean(values: Iterable[float]) -> Optional[float]:
    """The geometric mean of the positive finite ``values``; None when there are none."""
    logs = [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def summarize(rows: Sequence[Row], *, targets: Optional[dict] = None,
              target_ops: Sequence[str] = TARGET_OPS) -> list:
    """Per backend, group and op: geometric means over the group's shapes and layouts.

    PyTorch's own rows are the baseline and get no entry.

    Parameters
    ----------
    rows : sequence of Row
        From :func:`run_benchmarks`.
    targets : dict, optional
        Group -> the least acceptable geometric mean of ``vs_pytorch`` for the ops of
        ``target_ops``; :data:`GROUP_TARGETS` by default.
    target_ops : sequence of str

    Returns
    -------
    list of dict
        One per (backend, group, op), by backend, then group and op, each in the order
        they first appear in ``rows``:
        ``backend``, ``group``, ``op``, ``measured`` (rows timed), ``compared`` (rows with a
        ratio), ``vs_pytorch`` (geometric mean of the ratios, None without any),
        ``gflops`` and ``peak_fraction`` (geometric means; None when not measured),
        ``at_peak`` (the geometric mean of the ratio each op would have at the machine's
        GEMM peak, ``vs_pytorch / peak_fraction``: PyTorch's time over the op's FLOPs at
        np.matmul's rate, the ceiling of an algorithm bound by that GEMM; None without
        both), ``target`` (None where none applies) and ``met`` (None without a target or
        a ratio).
    """
    targets = GROUP_TARGETS if targets is None else targets
    found: dict = {}
    for row in rows:
        if row.backend == PYTORCH:
            continue
        found.setdefault((row.backend, row.group, row.op), []).append(row)
    order = list(dict.fromkeys(backend for backend, _, _ in found))
    summary = []
    for (backend, group, op), members in sorted(found.items(),
                                                key=lambda item: order.index(item[0][0])):
        timed = [r for r in members if r.status == "ok"]
        ratios = [r.vs_pytorch for r in timed if r.vs_pytorch is not None]
        ratio = geometric_mean(ratios)
        target = targets.get(group) if op in target_ops else None
        summary.append(dict(
            backend=backend, group=group, op=op, measured=len(timed), compared=len(ratios),
            vs_pytorch=ratio, gflops=geometric_mean(r.gflops for r in timed),
            peak_fraction=geometric_mean(r.peak_fraction for r in timed),
            at_peak=geometric_mean(r.vs_pytorch / r.peak_fraction for r in timed
                                   if r.vs_pytorch is not None and r.peak_fraction),
            target=target, met=None if target is None or ratio is None else ratio >= target))
    return summary


# --- dispatch overhead -------------------------------------------------------------------

def dispatch_callables(op: str, *, case: ConvCase = TINY, layout: str = "channels_first",
                       dtype: str = "float32"):
    """The public call of ``op`` on a tiny problem and the selected backend's direct ``run``.

    The direct call gets exactly what the dispatcher would hand the backend (the validated
    problem, C-contiguous operands, the chosen algorithm), so the difference between the
    two is validation, normalisation and selection alone.

    Returns
    -------
    public : Call
        Calling it makes the public call.
    direct : callable
        Calls the backend's ``run`` without validation or dispatch.
    choice : Choice
        The dispatcher's choice for this problem (honours ``use_backend`` and
        ``NUMBACONV_BACKEND``).
    """
    call = make_call(op, case, layout, dtype)
    choice = dispatch.select(op, call.problem)
    backend = dispatch.get_backend(choice.backend)
    run, problem, operands, algorithm = backend.run, call.problem, call.operands, \
        choice.algorithm

    def direct():
        return run(op, problem, operands, None, algorithm)

    return call, direct, choice


def dispatch_overhead(ops: Sequence[str] = CONV_OPS, *, repeat: int = 31,
                      min_sample: float = 2e-3, layout: str = "channels_first",
                      dtype: str = "float32", settle: float = 0.0) -> list:
    """What validation and dispatch add to a call, in microseconds, per op.

    For the :data:`TINY` problem, the median time of the public function minus the median
    time of the selected backend's ``run`` with pre-validated operands. Samples of the two
    alternate so that frequency scaling and noisy neighbours hit both alike.

    Parameters
    ----------
    ops : sequence of str
    repeat : int
        Samples of each (the medians are taken over them).
    min_sample : float
        Seconds one sample lasts at least (many calls per sample).
    layout, dtype : str
    settle : float
        Seconds to wait first, for thread pools of earlier work to go idle (see
        :data:`DEFAULT_SETTLE`).

    Returns
    -------
    list of dict
        Per op: ``op``, ``backend``, ``algorithm``, ``public_us``, ``direct_us``,
        ``overhead_us``, ``number`` (calls per sample) and ``repeat``.
    """
    if settle > 0:
        time.sleep(settle)
    results = []
    for op in ops:
        public, direct, choice = dispatch_callables(op, layout=layout, dtype=dtype)
        public()
        direct()  # warm both: compilation, caches, the dispatcher's choice
        number = max(_autonumber(public, min_sample), _autonumber(direct, min_sample))
        t_public, t_direct = [], []
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(repeat):
                for fn, samples in ((public, t_public), (direct, t_direct)):
                    start = time.perf_counter()
                    for _ in range(number):
                        fn()
                    samples.append((time.perf_counter() - start) / number)
        finally:
            if gc_was_enabled:
                gc.enable()
        public_us = statistics.median(t_public) * 1e6
        direct_us = statistics.median(t_direct) * 1e6
        results.append(dict(op=op, backend=choice.backend, algorithm=choice.algorithm,
                            public_us=public_us, direct_us=direct_us,
                            overhead_us=public_us - direct_us, number=number,
                            repeat=repeat))
    return results


# --- first-call latency ------------------------------------------------------------------

#: The problem of :func:`first_call_latency`: small, so that its first call measures
#: compilation (or loading from Numba's cache), not arithmetic, and shaped like a ResNet
#: layer, so that the cpu backend picks the algorithms it picks there (``winograd`` for the
#: forward and the data gradient: 64 channels, 128 tiles; ``implicit`` for the weight
#: gradient: rows of 16 pixels).
FIRST_CALL_CASE = BenchCase("first_call_3x3_64c_16", (2, 64, 16, 16), (64, 64, 3, 3),
                            padding=1, group="resnet3x3")

#: Run by each fresh interpreter of :func:`first_call_latency`; argv[1] is a JSON spec. It
#: prints one JSON line. Kernels are counted on the module-level Numba dispatchers of the
#: loaded numbaconv modules; cache hits are Numba's own statistics.
_FIRST_CALL_SCRIPT = r"""
import json, sys, time
start = time.perf_counter()
import numbaconv
import_s = time.perf_counter() - start
numba_at_import = "numba" in sys.modules
spec = json.loads(sys.argv[1])
from numbaconv import bench, dispatch
def as_tuple(value):  # JSON made the case's tuples lists
    return tuple(map(as_tuple, value)) if isinstance(value, list) else value
case = bench.BenchCase(**{k: as_tuple(v) for k, v in spec["case"].items()})
call = bench.make_call(spec["op"], case, spec["layout"], spec["dtype"])
# The first call would import Numba itself (the kernel modules do); importing it just
# before costs the same and tells that fixed part apart from compiling or loading kernels.
start = time.perf_counter()
try:
    import numba
except ImportError:  # a backend without Numba
    pass
numba_import_s = time.perf_counter() - start
with numbaconv.use_backend(spec["backend"]):
    start = time.perf_counter()
    call()
    call_s = time.perf_counter() - start
    start = time.perf_counter()
    call()
    second_s = time.perf_counter() - start
    choice = dispatch.select(spec["op"], call.problem)
kernels = hits = misses = 0
try:
    from numba.core.dispatcher import Dispatcher
except ImportError:
    Dispatcher = None
for name, module in list(sys.modules.items()):
    if Dispatcher is None or not name.startswith("numbaconv"):
        continue
    for value in list(vars(module).values()):
        if isinstance(value, Dispatcher) and value.signatures:
            kernels += len(value.signatures)
            try:
                stats = value.stats
                hits += sum(stats.cache_hits.values())
                misses += sum(stats.cache_misses.values())
            except Exception:
                pass
print(json.dumps(dict(import_s=import_s, numba_at_import=numba_at_import,
                      numba_import_s=numba_import_s, call_s=call_s,
                      first_s=numba_import_s + call_s, second_s=second_s,
                      backend=choice.backend, algorithm=choice.algorithm,
                      kernels=kernels, cache_hits=hits, cache_misses=misses)))
"""


def first_call_latency(ops: Sequence[str] = CONV_OPS, backend: str = "cpu", *,
                       case: ConvCase = FIRST_CALL_CASE, layout: str = "channels_first",
                       dtype: str = "float32", threads: Optional[int] = None,
                       timeout: float = 600.0) -> list:
    """Time of each op's first call in a fresh process, cold and from Numba's disk cache.

    For each op, a new temporary directory becomes ``NUMBA_CACHE_DIR`` of two fresh
    interpreters (``sys.executable``), run one after the other. Each imports numbaconv and
    times the op's first call on ``case`` inside ``use_backend(backend)``, then a second
    call. Numba is imported just before the first call and timed apart: the call would
    otherwise import it, and that part costs the same cold or cached. The first interpreter
    finds the cache empty: its first call compiles (and writes the cache). The second finds
    the first one's kernels on disk: its first call loads them.

    ``NUMBACONV_JIT_CACHE=1`` is set in both interpreters' environment, whatever this
    process has: with it off the kernels would never reach the disk and the "cached" call
    would compile again. ``NUMBACONV_AUTOTUNE=0`` keeps the first call to the one algorithm
    the dispatcher picks, and ``NUMBACONV_CACHE_DIR`` points into the temporary directory
    too, so that nothing is read from or written to the user's caches.

    Parameters
    ----------
    ops : sequence of str
    backend : str
        A numbaconv backend name.
    case : ConvCase
        The problem (channels-first logical shapes).
    layout, dtype : str
    threads : int, optional
        ``NUMBA_NUM_THREADS`` of the interpreters (inherited when omitted).
    timeout : float
        Seconds each interpreter may take.

    Returns
    -------
    list of dict
        One per op: ``op``, ``backend``, ``layout``, ``dtype``, ``case`` (its name),
        ``cold`` and ``cached``. Each of the last two is the interpreter's report:
        ``import_s`` (``import numbaconv``), ``numba_at_import`` (whether that import
        loaded Numba), ``numba_import_s``, ``call_s`` (the first call without importing
        Numba), ``first_s`` (the two together: the first call as a user sees it),
        ``second_s``, the ``backend`` and ``algorithm`` that ran,
        ``kernels`` (compiled signatures of numbaconv's Numba kernels after the calls),
        ``cache_hits`` and ``cache_misses`` (Numba's statistics); or ``{"error": text}``.
    """
    import numbaconv
    case_spec = {f.name: getattr(case, f.name) for f in dataclasses.fields(BenchCase)
                 if hasattr(case, f.name)}
    # The interpreters must import this very numbaconv, installed or not.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(numbaconv.__file__)))
    results = []
    for op in ops:
        spec = json.dumps(dict(op=op, backend=backend, layout=layout, dtype=dtype,
                               case=case_spec))
        with tempfile.TemporaryDirectory(prefix="numbaconv-first-call-") as cache_dir:
            env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, NUMBACONV_JIT_CACHE="1",
                       NUMBACONV_AUTOTUNE="0",
                       NUMBACONV_CACHE_DIR=os.path.join(cache_dir, "numbaconv"))
            env["PYTHONPATH"] = os.pathsep.join(
                [package_root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
            if threads is not None:
                env["NUMBA_NUM_THREADS"] = str(threads)
            cold = _first_call_process(spec, env, timeout)
            cached = _first_call_process(spec, env, timeout)
        results.append(dict(op=op, backend=backend, layout=layout, dtype=dtype,
                            case=case.name, cold=cold, cached=cached))
    return results


def _first_call_process(spec: str, env: dict, timeout: float) -> dict:
    try:
        proc = subprocess.run([sys.executable, "-c", _FIRST_CALL_SCRIPT, spec], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(error=f"no answer within {timeout:g} s")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return dict(error=tail)
    try:
        return json.loads(lines[-1])
    except ValueError:
        return dict(error=f"unreadable report: {lines[-1][:200]}")


# --- environment -------------------------------------------------------------------------

def threadpools() -> Optional[list]:
    """threadpoolctl's view of the loaded BLAS and OpenMP libraries, or None without it.

    Only libraries already loaded appear: NumPy's BLAS always (numbaconv imports NumPy),
    PyTorch's only once it has been imported.
    """
    try:
        import threadpoolctl
    except ImportError:
        return None
    return threadpoolctl.threadpool_info()


def environment() -> dict:
    """Versions, threading and BLAS configuration: what a benchmark result depends on.

    Returns
    -------
    dict
        JSON-serialisable. ``threadpools`` is None when threadpoolctl is not installed;
        ``numba_threading_layer_launched`` is None until a parallel kernel has run;
        ``blas`` is :func:`blas_info` (NumPy's BLAS library and kernel).
    """
    import llvmlite
    import numba

    from . import __version__
    try:
        launched = numba.threading_layer()
    except ValueError:  # raised until the first parallel region starts the thread pool
        launched = None
    try:
        import threadpoolctl
        tpc_version = threadpoolctl.__version__
    except ImportError:
        tpc_version = None
    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable_cpus = os.cpu_count()
    pools = threadpools()
    return dict(
        numbaconv=__version__,
        python=platform.python_version(),
        python_executable=sys.executable,
        platform=platform.platform(),
        machine=platform.machine(),
        processor=dispatch.cpu_model(),
        cpu_count=os.cpu_count(),
        usable_cpus=usable_cpus,
        numpy=np.__version__,
        numba=numba.__version__,
        llvmlite=llvmlite.__version__,
        numba_threading_layer=numba.config.THREADING_LAYER,
        numba_threading_layer_launched=launched,
        numba_num_threads=numba.config.NUMBA_NUM_THREADS,
        threadpoolctl=tpc_version,
        threadpools=pools,
        blas=blas_info(pools),
        env={name: os.environ.get(name) for name in ENV_VARS},
    )


def describe_threadpools(pools: Optional[list]) -> list:
    """One human-readable line per threadpoolctl entry (or one saying it is missing)."""
    if pools is None:
        return ["threadpoolctl is not installed: BLAS unknown (pip install threadpoolctl)"]
    if not pools:
        return ["no BLAS or OpenMP library found by threadpoolctl"]
    lines = []
    for p in pools:
        arch = p.get("architecture") or p.get("corename")
        extra = f", architecture {arch}" if arch else ""
        layer = p.get("threading_layer")
        extra += f", threading {layer}" if layer else ""
        version = f" {p['version']}" if p.get("version") else ""
        lines.append(f"{p.get('user_api')}: {p.get('internal_api')}{version}{extra}, "
                     f"{p.get('num_threads')} threads ({p.get('filepath')})")
    return lines


def blas_info(pools: Optional[list] = None) -> Optional[dict]:
    """NumPy's BLAS as threadpoolctl reports it: library, version, kernel and threads.

    Parameters
    ----------
    pools : list, optional
        ``threadpoolctl.threadpool_info()``; taken now when omitted.

    Returns
    -------
    dict or None
        ``library`` (threadpoolctl's ``internal_api``: ``"openblas"``, ``"mkl"``...),
        ``version``, ``kernel`` (the CPU-specific code path in use: OpenBLAS's
        ``architecture``, such as ``"Haswell"`` or ``"SkylakeX"``; None where the library does
        not say), ``threads``, ``threading_layer`` and ``filepath``. None without
        threadpoolctl or when no BLAS is loaded.
    """
    if pools is None:
        pools = threadpools()
    blas = [p for p in pools or () if p.get("user_api") == "blas"]
    if not blas:
        return None

    def folder(p):
        return os.path.normcase(os.path.dirname(p.get("filepath") or ""))

    # Several BLAS libraries may be loaded (PyTorch brings its own); NumPy's wheels keep
    # theirs in numpy.libs or numpy/.libs, and anything else beats a library of PyTorch's.
    chosen = (next((p for p in blas if "numpy" in folder(p)), None)
              or next((p for p in blas if "torch" not in folder(p)), None) or blas[0])
    return dict(library=chosen.get("internal_api"), version=chosen.get("version"),
                kernel=chosen.get("architecture") or chosen.get("corename"),
                threads=chosen.get("num_threads"),
                threading_layer=chosen.get("threading_layer"),
                filepath=chosen.get("filepath"))


#: OpenBLAS's x86-64 kernels (the names ``OPENBLAS_CORETYPE`` takes and threadpoolctl
#: reports, lower-cased) by the newest instruction set they use: :data:`ISA_NAMES` indices.
OPENBLAS_KERNEL_ISA = {
    **dict.fromkeys(("prescott", "core2", "penryn", "dunnington", "nehalem", "atom",
                     "opteron", "opteron_sse3", "barcelona", "bobcat", "nano"), 0),
    **dict.fromkeys(("sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"),
                    1),
    **dict.fromkeys(("haswell", "zen"), 2),
    **dict.fromkeys(("skylakex", "cooperlake", "sapphirerapids"), 3),
}

#: Instruction-set levels of :data:`OPENBLAS_KERNEL_ISA` and :func:`cpu_isa_level`.
ISA_NAMES = ("SSE", "AVX", "AVX2", "AVX-512")


def cpu_isa_level(flags: Optional[Iterable[str]] = None) -> Optional[int]:
    """The newest x86 vector instruction set of this CPU, as an index of :data:`ISA_NAMES`.

    Parameters
    ----------
    flags : iterable of str, optional
        CPU feature flags as Linux's ``/proc/cpuinfo`` names them; read from there when
        omitted.

    Returns
    -------
    int or None
        None where the flags cannot be read (not Linux) or name no x86 vector set.
    """
    if flags is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                line = next((ln for ln in f if ln.startswith("flags")), "")
        except OSError:
            return None
        flags = line.partition(":")[2].split()
    flags = set(flags)
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:  # what OpenBLAS's SkylakeX kernel needs
        return 3
    if {"avx2", "fma"} <= flags:
        return 2
    if "avx" in flags:
        return 1
    return 0 if "sse2" in flags else None


def openblas_natural_kernel(timeout: float = 60.0) -> Optional[str]:
    """The kernel NumPy's OpenBLAS picks on this CPU by itself, with OPENBLAS_CORETYPE unset.

    Asks a fresh interpreter (``sys.executable``, with ``OPENBLAS_CORETYPE`` removed from
    its environment), since OpenBLAS reads the variable once, when it loads. None when that
    cannot tell (no threadpoolctl, no OpenBLAS, the interpreter failed).
    """
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    code = ("import json, numpy, threadpoolctl; "
            "print(json.dumps(threadpoolctl.threadpool_info()))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=timeout)
        info = blas_info(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    if info is None or info["library"] != "openblas":
        return None
    return info["kernel"]


def openblas_coretype_warning(coretype: Optional[str], in_use: Optional[str] = None,
                              natural: Optional[str] = None,
                              cpu_level: Optional[int] = None) -> Optional[str]:
    """A warning when ``OPENBLAS_CORETYPE`` makes OpenBLAS run an older kernel than it would.

    Old OpenBLAS releases misdetected some CPUs, and ``OPENBLAS_CORETYPE`` (often
    ``Haswell``) was the workaround; a current OpenBLAS forced that way runs without, say,
    its AVX-512 kernels, at as little as half the speed, so every BLAS-bound timing and the
    SGEMM peak would understate the machine.

    Parameters
    ----------
    coretype : str or None
        The variable's value (None or empty: not set, no warning).
    in_use : str, optional
        The kernel OpenBLAS runs now (:func:`blas_info`'s ``kernel``); ``coretype`` if
        omitted.
    natural : str, optional
        The kernel OpenBLAS picks without the variable (:func:`openblas_natural_kernel`).
    cpu_level : int, optional
        :func:`cpu_isa_level`, the fallback when ``natural`` is unknown.

    Returns
    -------
    str or None
        The warning, or None when the forced kernel is not older than the CPU allows (or
        that cannot be told).
    """
    if not coretype or not coretype.strip():
        return None
    forced = (in_use or coretype).strip()
    forced_level = OPENBLAS_KERNEL_ISA.get(forced.lower())
    if forced_level is None:
        return None  # not an x86 kernel name we know: no grounds to call it old
    if natural is not None:
        natural_level = OPENBLAS_KERNEL_ISA.get(natural.lower())
        if natural_level is None or natural_level <= forced_level:
            return None
        better = f"the {natural} kernel ({ISA_NAMES[natural_level]}) it picks for this CPU " \
                 f"by itself"
    elif cpu_level is not None and cpu_level > forced_level:
        better = f"what this CPU supports ({ISA_NAMES[cpu_level]})"
    else:
        return None
    return (f"OPENBLAS_CORETYPE={coretype} forces OpenBLAS's {forced} kernel "
            f"({ISA_NAMES[forced_level]}), older than {better}: BLAS-bound timings and the "
            f"SGEMM peak understate this machine. For figures worth comparing, unset it for "
            f"this command: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE numbaconv bench ...")


def format_seconds(seconds: Optional[float]) -> str:
    """A time with a unit that keeps three significant digits readable."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


# --- plot --------------------------------------------------------------------------------

#: What :func:`plot_ratios` raises without matplotlib.
MATPLOTLIB_MISSING = ("plotting needs matplotlib, which is not installed: "
                      "pip install 'numbaconv[plot]' (or pip install matplotlib)")


def require_matplotlib() -> None:
    """Raise ImportError with :data:`MATPLOTLIB_MISSING` when matplotlib cannot be imported.

    ``numbaconv bench --plot`` calls it before measuring, not after minutes of timing.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(MATPLOTLIB_MISSING) from exc


def plot_ratios(rows: Sequence[Row], path: str, *, title: Optional[str] = None,
                peak_name: str = "SGEMM") -> str:
    """Save a bar chart of each backend's ratio to PyTorch, one panel per op.

    Each panel has a bar per shape and layout for each backend, on a log scale with a line
    at 1 (left of it PyTorch is faster, right of it the backend is). Without any ratio (no
    PyTorch in the run) it shows each row's fraction of the GEMM peak instead. Drawn on
    matplotlib's Agg canvas, without pyplot, so it needs no display and leaves no global
    figure behind.

    Parameters
    ----------
    rows : sequence of Row
        From :func:`run_benchmarks`; PyTorch's own rows and rows without a value are left
        out.
    path : str
        The image file; its extension picks the format (``.png``, ``.svg``, ``.pdf``...).
    title : str, optional
        The figure's title.
    peak_name : str
        What the GEMM peak is called on the axis, when fractions of it are drawn.

    Returns
    -------
    str
        What was drawn: ``"vs_pytorch"`` or ``"peak_fraction"``.

    Raises
    ------
    ImportError
        Without matplotlib (:data:`MATPLOTLIB_MISSING`).
    ValueError
        When no row has a value to draw.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    mine = [r for r in rows if r.backend != PYTORCH and r.status == "ok"]
    metric = "vs_pytorch" if any(r.vs_pytorch is not None for r in mine) else "peak_fraction"
    mine = [r for r in mine if getattr(r, metric) is not None]
    if not mine:
        raise ValueError("rows: nothing to plot (no row has a ratio to PyTorch or a fraction "
                         "of the GEMM peak)")
    ops = list(dict.fromkeys(r.op for r in mine))
    backends = list(dict.fromkeys(r.backend for r in mine))
    layouts = set(r.layout for r in mine)
    short = {"channels_first": "NC..", "channels_last": "N..C"}

    def label(r):
        return r.shape if len(layouts) == 1 else f"{r.shape} {short.get(r.layout, r.layout)}"

    labels = list(dict.fromkeys(label(r) for r in mine))
    values = {(r.op, label(r), r.backend): getattr(r, metric) for r in mine}

    bar = 0.8 / len(backends)
    height = max(3.0, 0.6 + len(labels) * (0.16 * len(backends) + 0.12))
    fig = Figure(figsize=(3.2 * len(ops) + 2.5, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(ops), sharey=True, squeeze=False)[0]
    colours = [f"C{i}" for i in range(len(backends))]
    ratio = metric == "vs_pytorch"
    if ratio:  # one log axis for every panel, with 1 inside and round ticks
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter
        low = min(1.0, min(values.values())) / 1.25
        high = max(1.0, max(values.values())) * 1.25
        ticks = [m * 10.0 ** e for e in range(-4, 5) for m in (1, 2, 5)
                 if low <= m * 10.0 ** e <= high]
    for ax, op in zip(axes, ops):
        for i, backend in enumerate(backends):
            ys, xs = [], []
            for j, lab in enumerate(labels):
                value = values.get((op, lab, backend))
                if value is not None:
                    ys.append(j + (i - (len(backends) - 1) / 2) * bar)
                    xs.append(value if ratio else value * 100)
            if ratio:  # bars grow from 1: left slower than PyTorch, right faster
                ax.barh(ys, [x - 1 for x in xs], left=1, height=bar, color=colours[i],
                        label=backend)
            else:
                ax.barh(ys, xs, height=bar, color=colours[i], label=backend)
        ax.set_title(op, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(labelsize=7)
        if ratio:
            ax.set_xscale("log")
            ax.set_xlim(low, high)
            ax.xaxis.set_major_locator(FixedLocator(ticks))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.axvline(1.0, color="black", linewidth=0.8)
            ax.set_xlabel("PyTorch time / backend time", fontsize=8)
        else:
            ax.set_xlabel(f"% of {peak_name} peak", fontsize=8)
    axes[0].set_yticks(range(len(labels)), labels)
    axes[0].invert_yaxis()
    if len(backends) > 1 or ratio:  # beside the panels, where it hides no bar
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, fontsize=7, loc="outside right upper")
    if title is None:
        title = ("numbaconv vs PyTorch (> 1: numbaconv faster)" if metric == "vs_pytorch"
                 else f"numbaconv: fraction of the {peak_name} peak (no PyTorch baseline)")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=100)
    return metric
