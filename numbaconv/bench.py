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
it; :func:`copy_floors` times a parallel copy of as many bytes as each memory-bound op must
move (:data:`MEMORY_BOUND_GROUPS`), the op's time being read as a fraction of the copy's;
:func:`first_call_latency` times the first call of each op (JIT compilation) in fresh
processes, cold and from Numba's on-disk cache. :func:`blas_info` and
:func:`openblas_coretype_warning` record which BLAS kernel the run used and whether
``OPENBLAS_CORETYPE`` forced an older one; :func:`plot_ratios` draws the ratios (matplotlib,
the ``plot`` extra).

:func:`run_benchmarks` times each engine (PyTorch, each numbaconv backend) in a fresh
process of its own (:mod:`numbaconv.bench_process`), so that no other library's OpenMP
runtime or thread pool runs beside it; ``in_process=True`` times them all in the caller's.
Times are medians over ``repeat`` samples after one warm-up call (which pays for any lazy
compilation) and more untimed calls for up to :data:`ROW_WARMUP` seconds. A sample of a
call faster than a couple of milliseconds loops over the call enough times to rise above
the clock's resolution and divides, as :mod:`timeit` does.

Examples
--------
>>> from numbaconv import bench
>>> rows = bench.run_benchmarks(bench.QUICK_SHAPES, ["reference"], repeat=3, layout="both")
>>> summary = bench.summarize(rows)      # per backend, group and op; ratios need torch=
>>> bench.dispatch_overhead(["conv"])[0]["overhead_us"]      # doctest: +SKIP
6.1
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from typing import Callable, Iterable, Optional, Sequence

from . import dispatch
from .bench_cases import (BIG_SHAPE_NAMES, DEFAULT_SETTLE, ENV_VARS, GROUP_TARGETS, GROUPS,
                          MEMORY_BOUND_GROUPS, PYTORCH, QUICK_SHAPES, SHAPES, TARGET_OPS, TINY,
                          BenchCase, Call, Row, cpu_backends, flops, group_of, make_call,
                          supports, traffic_bytes)
from .bench_latency import (FIRST_CALL_CASE, TRAINING_STEP, dispatch_callables,
                            dispatch_overhead, first_call_latency)
from .bench_machine import (ISA_NAMES, OPENBLAS_KERNEL_ISA, blas_info, blas_limits,
                            copy_seconds, cpu_isa_level, describe_threadpools, environment,
                            gemm_name, gemm_peak, openblas_coretype_warning,
                            openblas_natural_kernel, threadpools)
from .bench_plot import MATPLOTLIB_MISSING, plot_ratios, require_matplotlib
from .bench_process import ChildFailed, child_messages, print_message
from .bench_timing import Timing, format_seconds, geometric_mean, time_call
from .bench_torch import import_torch, torch_callable, torch_version
from .problem import CONV_OPS, LAYOUTS
from .testing import ConvCase, case_arrays

# The module's pieces live in bench_cases, bench_timing, bench_torch, bench_machine,
# bench_latency and bench_plot; this module runs the table and re-exports them all.
__all__ = ["PYTORCH", "GROUPS", "GROUP_TARGETS", "TARGET_OPS", "BenchCase", "group_of",
           "SHAPES", "QUICK_SHAPES", "TINY", "BIG_SHAPE_NAMES", "DEFAULT_SETTLE", "ENV_VARS",
           "MEMORY_BOUND_GROUPS", "traffic_bytes", "copy_seconds", "copy_floors",
           "DEFAULT_BLOCK_TIMEOUT", "Timing", "time_call", "Call", "make_call", "flops",
           "cpu_backends", "supports", "import_torch", "torch_callable", "torch_version", "Row",
           "resolve_layouts", "run_benchmarks", "gemm_name", "gemm_peak", "geometric_mean",
           "summarize", "dispatch_callables", "dispatch_overhead", "FIRST_CALL_CASE",
           "TRAINING_STEP", "first_call_latency", "threadpools", "blas_limits", "environment",
           "describe_threadpools", "blas_info", "OPENBLAS_KERNEL_ISA", "ISA_NAMES",
           "cpu_isa_level", "openblas_natural_kernel", "openblas_coretype_warning",
           "format_seconds", "MATPLOTLIB_MISSING", "require_matplotlib", "plot_ratios"]

#: Seconds an engine's own process may take over one shape and layout (every op, the first
#: block paying for the JIT compilation of each) before it is killed and its remaining rows
#: become errors: long enough for a slow machine's compilation, short enough that a hung
#: engine does not stall the run for good.
DEFAULT_BLOCK_TIMEOUT = 900.0

#: Seconds of untimed calls (at most 50) before each row is timed, for every engine: the
#: first calls on a shape's freshly made operands can run at half speed (on this project's
#: VMs, where memory not touched for a while is slow to touch again), and a row timed
#: right away measured that instead of the steady call a training loop repeats
#: (docs/usage.md#benchmarks). Costs at most this much per row.
ROW_WARMUP = 0.1


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
                   copies: Optional[dict] = None,
                   report: Optional[Callable[[Row], None]] = None,
                   progress: Optional[Callable[[int, int, str], None]] = None,
                   in_process: bool = False, threads: Optional[int] = None,
                   timeout: Optional[float] = DEFAULT_BLOCK_TIMEOUT,
                   processes: Optional[dict] = None, rounds: int = 1) -> list:
    """Time every op of every shape on each backend, and on PyTorch when ``torch`` is given.

    Backends are timed through the public functions inside ``use_backend(name)``: what a
    user's call costs, validation and dispatch included.

    By default each engine (PyTorch, then each backend) runs in a fresh interpreter of its
    own, which times all the shapes, layouts and ops on it and exits before the next one
    starts. The child of a numbaconv backend never imports PyTorch, and PyTorch's never runs
    Numba: each engine has the cores, and the OpenMP runtime, that its users' programs would
    give it. In one process, the other engine's runtime and its idle threads change the
    times (short calls most).

    With ``in_process``, everything runs in this process instead, each shape and layout
    measured in blocks, one per engine, with a pause of ``settle`` seconds between blocks.
    Thread pools spin for a while after their last job (see :data:`DEFAULT_SETTLE`); when
    the next library's pool starts while the previous one still spins, on a machine with
    few cores the two fight for them and calls can take a thousand times longer.
    Interleaving ops of different libraries would measure that fight rather than the
    libraries.

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
    torch : module or bool, optional
        PyTorch (or True), to time it directly as the baseline of the ``vs_pytorch``
        column. Its own process imports its own; ``in_process`` needs the module (True
        imports it here).
    skip_reference_on : iterable of str
        Shape names on which the ``reference`` backend is skipped (too slow).
    settle : float
        With ``in_process``: seconds to wait between engines so idle thread pools go to
        sleep (see above). Processes of their own need no pause: an exited process's
        threads are gone.
    peak_gflops : float, optional
        The GEMM peak of this run (:func:`gemm_peak`); rows get ``peak_fraction`` from it.
    copies : dict, optional
        :func:`copy_floors` of this run: the rows of its (shape, op) pairs get
        ``traffic_bytes`` and ``copy_fraction`` from it.
    report : callable, optional
        Called with each :class:`Row` once its shape and layout is done on every engine
        (progress for long runs).
    progress : callable, optional
        Called as ``progress(done, total, what)`` before each block (one engine on one
        shape and layout) with the number of blocks done, their total and a description of
        the block starting: for a progress display.
    in_process : bool
        Time every engine in this process (see above).
    threads : int, optional
        Threads for each engine: PyTorch's ``set_num_threads``, Numba's (after numbaconv's
        threading set-up) and BLAS's (threadpoolctl, when installed); None leaves each
        library's own setting. The processes inherit this one's environment
        (``OMP_NUM_THREADS``, ``NUMBA_NUM_THREADS``, ...).
    timeout : float, optional
        Seconds an engine's process may take over one shape and layout; past it the process
        is killed and the rest of its rows are errors. None waits for ever.
    processes : dict, optional
        Filled with engine -> what its process reported when done: ``modules`` (whether
        torch, numba and numbaconv were imported there), ``threads`` (PyTorch's and Numba's
        thread counts, where loaded) and ``threadpools`` (threadpoolctl's view of its BLAS
        and OpenMP libraries), or ``error``. Left empty ``in_process``.
    rounds : int
        Processes of their own only: every engine's process is run this many times, the
        engines taking turns (PyTorch, each backend, PyTorch again, ...), and each row
        keeps the round of its smallest median. A host whose speed drifts from one minute
        to the next (a shared cloud VM) then moves a ratio less: each engine's best round
        is compared, not whichever minute each happened to run in.

    Returns
    -------
    list of Row
        Ordered by shape, then layout, then op, then PyTorch before the backends in the
        given order. An engine whose process failed (crashed, or timed out) has ``"error"``
        rows from there on, saying why.
    """
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds: expected a positive int, got {rounds!r}")
    if rounds > 1 and in_process:
        raise ValueError("rounds: applies to engines timed in processes of their own, not "
                         "in_process")
    engines = ([PYTORCH] if torch is not None and torch is not False else []) + list(backends)
    blocks = [(case, lay) for case in shapes for lay in resolve_layouts(layout)]
    options = dict(ops=list(ops), repeat=repeat, dtype=dtype, threads=threads,
                   skip_reference_on=frozenset(skip_reference_on))
    if in_process:
        if torch is True:
            torch = import_torch()
            if torch is None:
                raise ImportError("run_benchmarks(torch=True, in_process=True): PyTorch "
                                  "does not import")
        measured = _measure_in_process(blocks, engines, torch=torch, settle=settle,
                                       progress=progress, **options)
    else:
        measured = _measure_in_processes(blocks, engines, timeout=timeout, progress=progress,
                                         processes=processes, rounds=rounds, **options)
    rows: list = []
    found: dict = {}  # block index -> {(op, engine): row}
    next_block = 0
    for index, engine, engine_rows in measured:
        found.setdefault(index, {}).update(((row.op, engine), row) for row in engine_rows)
        # Each block is reported once every engine has timed it.
        while next_block in found and len(found[next_block]) == len(set(ops)) * len(engines):
            rows += _compare(found.pop(next_block), ops, engines, peak_gflops, copies or {},
                             report)
            next_block += 1
    if progress is not None:
        total = len(blocks) * len(engines) * rounds     # rounds is 1 in_process
        progress(total, total, "done")
    return rows


def _compare(measured: dict, ops, engines, peak_gflops, copies, report) -> list:
    """One block's rows in the table's order, with PyTorch's time, the peak fraction and,
    on memory-bound rows, the copy fraction."""
    rows = []
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
            floor = copies.get((row.shape, op))
            if floor is not None:
                row.traffic_bytes = floor["traffic_bytes"]
                if row.median_s:
                    row.copy_fraction = floor["copy_s"] / row.median_s
            rows.append(row)
            if report is not None:
                report(row)
    return rows


def copy_floors(shapes: Sequence[ConvCase], ops: Sequence[str] = CONV_OPS, *,
                dtype: str = "float32", threads: Optional[int] = None,
                repeat: int = 5) -> dict:
    """The copy floor of each op on each shape of :data:`MEMORY_BOUND_GROUPS`: the bytes it
    must move (:func:`traffic_bytes`, the same in either layout) and the best time of a
    parallel copy of as many bytes (:func:`copy_seconds`, timed once per distinct size).

    Returns
    -------
    dict
        ``(shape name, op) -> {"traffic_bytes": int, "copy_s": float}``; empty when no
        shape is memory-bound.
    """
    floors: dict = {}
    timed: dict = {}  # bytes -> seconds
    for case in shapes:
        if group_of(case) not in MEMORY_BOUND_GROUPS:
            continue
        arrays = case_arrays(case, "channels_first", dtype)
        for op in dict.fromkeys(ops):
            moved = traffic_bytes(make_call(op, case, "channels_first", dtype, arrays))
            if moved not in timed:
                timed[moved] = copy_seconds(moved, threads=threads, repeat=repeat)
            floors[case.name, op] = dict(traffic_bytes=moved, copy_s=timed[moved])
        del arrays
    return floors


def _measure_in_process(blocks, engines, *, ops, repeat, dtype, threads, skip_reference_on,
                        torch, settle, progress):
    """Yield ``(block index, engine, rows)``, block after block, each engine in turn."""
    busy = False  # whether a block has run since the last pause
    done, total = 0, len(blocks) * len(engines)
    with _limit_threads(engines, threads, torch):
        for index, (case, layout) in enumerate(blocks):
            arrays = case_arrays(case, layout, dtype)
            calls = [make_call(op, case, layout, dtype, arrays) for op in ops]
            for engine in engines:
                if progress is not None:
                    progress(done, total, _block_name(case, layout, engine))
                done += 1
                if busy and settle > 0:
                    time.sleep(settle)
                rows = [_time_row(engine, call, repeat, torch, skip_reference_on)
                        for call in calls]
                busy = any(row.status != "skipped" for row in rows)
                yield index, engine, rows
            del calls, arrays


def _measure_in_processes(blocks, engines, *, ops, repeat, dtype, threads, skip_reference_on,
                          timeout, progress, processes, rounds=1):
    """Yield ``(block index, engine, rows)``, engine after engine, each in a fresh
    interpreter (:data:`_ENGINE_CHILD`) that times every block and exits; with ``rounds``,
    the engines take turns that many times and each op's row is the round of its smallest
    median (:func:`_fastest`), yielded in the last round."""
    if not blocks:
        return
    kept: dict = {}  # (block index, engine) -> its rows so far
    counter = [0, len(blocks) * len(engines) * rounds]  # blocks done, in all
    for round_ in range(rounds):
        for engine in engines:
            for index, rows in _engine_rows(blocks, engine, counter, ops=ops, repeat=repeat,
                                            dtype=dtype, threads=threads,
                                            skip_reference_on=skip_reference_on,
                                            timeout=timeout, progress=progress,
                                            processes=processes):
                rows = _fastest(kept.pop((index, engine), None), rows)
                if round_ == rounds - 1:
                    yield index, engine, rows
                else:
                    kept[index, engine] = rows


def _fastest(earlier: Optional[list], rows: list) -> list:
    """Per op, the row of ``earlier`` (the same block and engine in earlier rounds) or of
    ``rows`` with the smaller median; a timed row before one that failed or was skipped."""
    if earlier is None:
        return rows
    def key(row):
        return (row.median_s is None, row.median_s or 0.0)
    return [min(old, new, key=key) for old, new in zip(earlier, rows)]


def _engine_rows(blocks, engine, counter, *, ops, repeat, dtype, threads, skip_reference_on,
                 timeout, progress, processes):
    """Yield ``(block index, rows)`` of ``engine``'s fresh interpreter, every block in
    turn; ``counter`` is [blocks done, in all], for ``progress``."""
    spec = dict(engine=engine, ops=list(ops), repeat=repeat, dtype=dtype, threads=threads,
                blocks=[(_case_spec(case), layout) for case, layout in blocks],
                skip_reference_on=sorted(skip_reference_on))
    received = 0
    if progress is not None:
        progress(counter[0], counter[1], _block_name(*blocks[0], engine))
    try:
        for message in child_messages(_ENGINE_CHILD, spec, timeout=timeout):
            if "rows" in message:
                received += 1
                counter[0] += 1
                if progress is not None and received < len(blocks):
                    progress(counter[0], counter[1], _block_name(*blocks[received], engine))
                yield message["block"], [Row(**row) for row in message["rows"]]
            elif processes is not None and "modules" in message:
                processes[engine] = message
        if received < len(blocks):
            raise ChildFailed("it exited without timing every shape")
    except ChildFailed as exc:
        detail = f"{engine}'s process failed: {exc}"
        if processes is not None:
            processes.setdefault(engine, {})["error"] = str(exc)
        for index in range(received, len(blocks)):
            case, layout = blocks[index]
            counter[0] += 1
            yield index, [_failed_row(case, layout, op, engine, dtype, detail) for op in ops]


def _block_name(case: ConvCase, layout: str, engine: str) -> str:
    return f"{case.name} {layout} on {engine}"


def _case_spec(case: ConvCase) -> dict:
    return dict(dataclasses.asdict(case), group=group_of(case))


def _failed_row(case: ConvCase, layout: str, op: str, engine: str, dtype: str,
                detail: str) -> Row:
    return Row(case.name, op, engine, layout, dtype, "error", detail=detail,
               group=group_of(case))


#: What an engine's process runs (:func:`_time_engine`); a module attribute so that a test
#: can make it fail.
_ENGINE_CHILD = """
import json, sys
from numbaconv import bench
bench._time_engine(json.loads(sys.argv[1]))
"""


def _time_engine(spec: dict) -> None:
    """In an engine's own process: time each block of ``spec`` on its engine, printing each
    block's rows as they are done, then which libraries this process loaded."""
    engine, dtype, ops = spec["engine"], spec["dtype"], spec["ops"]
    skip_reference_on = frozenset(spec["skip_reference_on"])
    torch = None
    if engine == PYTORCH:
        torch = import_torch()
        if torch is None:
            raise ImportError("PyTorch does not import in this process")
    with _limit_threads([engine], spec["threads"], torch, own_process=True):
        for index, (fields, layout) in enumerate(spec["blocks"]):
            case = BenchCase(**{k: _tuples(v) for k, v in fields.items()})
            arrays = case_arrays(case, layout, dtype)
            rows = [_time_row(engine, make_call(op, case, layout, dtype, arrays),
                              spec["repeat"], torch, skip_reference_on) for op in ops]
            print_message(dict(block=index, rows=[row.as_dict() for row in rows]))
            del arrays
    threads = {name: sys.modules[name].get_num_threads() for name in ("torch", "numba")
               if name in sys.modules}
    print_message(dict(modules={name: name in sys.modules
                                for name in ("torch", "numba", "numbaconv")},
                       threads=threads, threadpools=threadpools()))


def _tuples(value):
    """JSON made the case's tuples lists."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _limit_threads(engines, threads: Optional[int], torch, own_process: bool = False):
    """Set the thread count of each of ``engines`` to ``threads`` (None: leave them); the
    context returned limits BLAS to it too. ``own_process``: this is the engine's own
    process, whose environment may be changed."""
    if not threads:
        return contextlib.nullcontext()
    if PYTORCH in engines:
        torch.set_num_threads(threads)
    if any(engine != PYTORCH for engine in engines):
        # Never more than numbaconv would give Numba by itself (a CPU quota may allow fewer
        # CPUs than the default count the caller read from Numba).
        if not own_process or "numba" in sys.modules:
            import numba

            # numbaconv's threading set-up first (OMP_WAIT_POLICY, the pool's size): setting
            # the count starts Numba's threads, too late for it afterwards.
            from .config import configure_threading
            configure_threading()
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        else:  # an engine's own process: read when (if) the engine imports Numba, or
            # PyTorch (a plugin backend), or another OpenMP library
            from .config import available_cpus
            os.environ["NUMBA_NUM_THREADS"] = str(min(threads, available_cpus()[0]))
            os.environ["OMP_NUM_THREADS"] = str(threads)
    return blas_limits(threads)


def _time_row(engine: str, call: Call, repeat: int, torch, skip_reference_on) -> Row:
    if engine == PYTORCH:
        return _time_pytorch(call, torch, repeat)
    if engine == "reference" and call.case.name in skip_reference_on:
        return _row(call, engine, "skipped",
                    detail="reference is too slow here (--include-reference)")
    why = supports(engine, call)
    if why is not None:
        return _row(call, engine, "skipped", detail=why)
    return _time_backend(engine, call, repeat)


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
        return _row(call, PYTORCH, "ok", time_call(fn, repeat=repeat, warmup_for=ROW_WARMUP))
    except Exception as exc:  # an old PyTorch lacking an op: report it, keep going
        return _row(call, PYTORCH, "error", detail=f"{type(exc).__name__}: {exc}")


def _time_backend(name: str, call: Call, repeat: int) -> Row:
    try:
        with dispatch.use_backend(name):
            timing = time_call(call, repeat=repeat, warmup_for=ROW_WARMUP)
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
