"""Timing the convolution ops: standard shapes, PyTorch comparison, dispatch overhead.

This module is the one place that knows how numbaconv is benchmarked; ``numbaconv bench``,
the asv suite in ``benchmarks/`` and the tests all build on it. Nothing here is imported by
``import numbaconv``, and PyTorch and threadpoolctl are optional: without them the comparison
column and the BLAS report say so instead of failing.

Times are medians over ``repeat`` samples after one warm-up call (which pays for any lazy
compilation). A sample of a call faster than a couple of milliseconds loops over the call
enough times to rise above the clock's resolution and divides, as :mod:`timeit` does.

Examples
--------
>>> from numbaconv import bench
>>> rows = bench.run_benchmarks(bench.QUICK_SHAPES, ["reference"], repeat=3)
>>> bench.dispatch_overhead(["conv"])[0]["overhead_us"]      # doctest: +SKIP
6.1
"""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from . import dispatch
from . import problem as pb
from .conv import (conv, conv_backward_bias, conv_backward_data, conv_backward_weight,
                   conv_transpose)
from .problem import CONV_OPS
from .testing import ConvCase, case_arrays

#: Label of PyTorch called directly (not through a numbaconv backend) in tables and JSON. It
#: is deliberately not "torch", which is the name of a numbaconv plugin backend.
PYTORCH = "pytorch"

#: Layers of common CNNs at a realistic batch size (channels-first logical shapes).
#: The stem's ``output_padding=1`` makes its transposed convolution map 112 back to 224.
SHAPES = (
    ConvCase("resnet3x3_64c_56", (8, 64, 56, 56), (64, 64, 3, 3), padding=1),
    ConvCase("pointwise_64to256_56", (8, 64, 56, 56), (256, 64, 1, 1)),
    ConvCase("depthwise3x3_128c_56", (8, 128, 56, 56), (128, 1, 3, 3), padding=1,
             groups=128),
    ConvCase("stem7x7s2_3c_224", (8, 3, 224, 224), (64, 3, 7, 7), stride=2, padding=3,
             output_padding=1),
)

#: The same four kinds of layer shrunk so that every op on every backend, the slow reference
#: included, finishes in milliseconds.
QUICK_SHAPES = (
    ConvCase("resnet3x3_16c_14", (2, 16, 14, 14), (16, 16, 3, 3), padding=1),
    ConvCase("pointwise_16to64_14", (2, 16, 14, 14), (64, 16, 1, 1)),
    ConvCase("depthwise3x3_32c_14", (2, 32, 14, 14), (32, 1, 3, 3), padding=1, groups=32),
    ConvCase("stem7x7s2_3c_32", (2, 3, 32, 32), (16, 3, 7, 7), stride=2, padding=3,
             output_padding=1),
)

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
ENV_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
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

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def run_benchmarks(shapes: Sequence[ConvCase], backends: Sequence[str], *,
                   ops: Sequence[str] = CONV_OPS, repeat: int = 5,
                   layout: str = "channels_first", dtype: str = "float32",
                   torch=None, skip_reference_on: Iterable[str] = (),
                   settle: float = DEFAULT_SETTLE,
                   report: Optional[Callable[[Row], None]] = None) -> list:
    """Time every op of every shape on each backend, and on PyTorch when ``torch`` is given.

    Backends are timed through the public functions inside ``use_backend(name)``: what a
    user's call costs, validation and dispatch included.

    Each shape is measured in blocks, one per engine (PyTorch, then each backend), with a
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
    layout, dtype : str
    torch : module, optional
        PyTorch, to time it directly as the baseline of the ``vs_pytorch`` column.
    skip_reference_on : iterable of str
        Shape names on which the ``reference`` backend is skipped (too slow).
    settle : float
        Seconds to wait between engines so idle thread pools go to sleep (see above).
    report : callable, optional
        Called with each :class:`Row` once its shape is done (progress for long runs).

    Returns
    -------
    list of Row
        Ordered by shape, then op, then PyTorch before the backends in the given order.
    """
    skip_reference_on = frozenset(skip_reference_on)
    engines = ([PYTORCH] if torch is not None else []) + list(backends)
    rows = []
    busy = False  # whether a block has run since the last pause
    for case in shapes:
        arrays = case_arrays(case, layout, dtype)
        calls = [make_call(op, case, layout, dtype, arrays) for op in ops]
        measured = {}
        for engine in engines:
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
                if baseline is not None and baseline.median_s and row.median_s:
                    row.vs_pytorch = baseline.median_s / row.median_s
                rows.append(row)
                if report is not None:
                    report(row)
        del calls, arrays
    return rows


def _row(call: Call, engine: str, status: str, timing: Optional[Timing] = None,
         detail: str = "") -> Row:
    row = Row(call.case.name, call.op, engine, call.layout, call.problem.dtype, status,
              detail=detail)
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
        ``numba_threading_layer_launched`` is None until a parallel kernel has run.
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
    return dict(
        numbaconv=__version__,
        python=platform.python_version(),
        python_executable=sys.executable,
        platform=platform.platform(),
        machine=platform.machine(),
        processor=_cpu_model(),
        cpu_count=os.cpu_count(),
        usable_cpus=usable_cpus,
        numpy=np.__version__,
        numba=numba.__version__,
        llvmlite=llvmlite.__version__,
        numba_threading_layer=numba.config.THREADING_LAYER,
        numba_threading_layer_launched=launched,
        numba_num_threads=numba.config.NUMBA_NUM_THREADS,
        threadpoolctl=tpc_version,
        threadpools=threadpools(),
        env={name: os.environ.get(name) for name in ENV_VARS},
    )


def _cpu_model() -> str:
    """The CPU's marketing name where the OS tells it cheaply (platform.processor is often '')."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def format_seconds(seconds: Optional[float]) -> str:
    """A time with a unit that keeps three significant digits readable."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"
