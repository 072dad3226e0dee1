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

import time
from typing import Callable, Iterable, Optional, Sequence

from . import dispatch
from .bench_cases import (BIG_SHAPE_NAMES, DEFAULT_SETTLE, ENV_VARS, GROUP_TARGETS, GROUPS,
                          PYTORCH, QUICK_SHAPES, SHAPES, TARGET_OPS, TINY, BenchCase, Call, Row,
                          cpu_backends, flops, group_of, make_call, supports)
from .bench_latency import (FIRST_CALL_CASE, TRAINING_STEP, dispatch_callables,
                            dispatch_overhead, first_call_latency)
from .bench_machine import (ISA_NAMES, OPENBLAS_KERNEL_ISA, blas_info, cpu_isa_level,
                            describe_threadpools, environment, gemm_name, gemm_peak,
                            openblas_coretype_warning, openblas_natural_kernel, threadpools)
from .bench_plot import MATPLOTLIB_MISSING, plot_ratios, require_matplotlib
from .bench_timing import Timing, format_seconds, geometric_mean, time_call
from .bench_torch import import_torch, torch_callable
from .problem import CONV_OPS, LAYOUTS
from .testing import ConvCase, case_arrays

# The module's pieces live in bench_cases, bench_timing, bench_torch, bench_machine,
# bench_latency and bench_plot; this module runs the table and re-exports them all.
__all__ = ["PYTORCH", "GROUPS", "GROUP_TARGETS", "TARGET_OPS", "BenchCase", "group_of",
           "SHAPES", "QUICK_SHAPES", "TINY", "BIG_SHAPE_NAMES", "DEFAULT_SETTLE", "ENV_VARS",
           "Timing", "time_call", "Call", "make_call", "flops", "cpu_backends", "supports",
           "import_torch", "torch_callable", "Row", "resolve_layouts", "run_benchmarks",
           "gemm_name", "gemm_peak", "geometric_mean", "summarize", "dispatch_callables",
           "dispatch_overhead", "FIRST_CALL_CASE", "TRAINING_STEP", "first_call_latency", "threadpools",
           "environment", "describe_threadpools", "blas_info", "OPENBLAS_KERNEL_ISA",
           "ISA_NAMES", "cpu_isa_level", "openblas_natural_kernel",
           "openblas_coretype_warning", "format_seconds", "MATPLOTLIB_MISSING",
           "require_matplotlib", "plot_ratios"]


# --- the benchmark table -----------------------------------------------------------------

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


# --- the per-group summary ---------------------------------------------------------------

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
