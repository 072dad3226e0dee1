"""The ``numbaconv`` command line: ``info``, ``check``, ``bench``, ``demo`` and ``warmup``.

``numbaconv <command> --help`` describes each. :func:`main` takes the arguments as a list and
returns the exit status instead of exiting, so tests and notebooks can call it in-process.
Heavy imports (Numba, PyTorch) happen inside the commands that need them, so ``--help`` stays
quick.

Exit status: 0 on success; 1 when ``check`` finds a mismatch (or cannot check a backend it
was asked to), when ``demo`` fails to learn, or when a command fails; 2 for usage errors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Optional, Sequence

#: Cases of ``numbaconv.testing.CASES`` that ``check --quick`` runs: every dimensionality and
#: the features most likely to go wrong (stride, dilation, groups, depthwise, "same" and
#: asymmetric padding, output_padding of the transposed convolution).
QUICK_CHECK_CASES = ("1d_stride_dilation_groups", "2d_pad1", "2d_stride2", "2d_asymmetric",
                     "2d_same_stride2", "2d_depthwise", "3d_everything")

USAGE_ERROR = 2

#: OpenBLAS variables that override what it detects about the CPU; the issue's comparison
#: with PyTorch is to run with both unset, and ``bench`` says so when they are not.
OPENBLAS_TUNING_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def _print(*args, **kwargs) -> None:
    print(*args, **kwargs, flush=True)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]],
           right: Sequence[int] = ()) -> list:
    """Lines of a plain-text table; columns listed in ``right`` are right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(v.rjust(w) if i in right else v.ljust(w)
                         for i, (v, w) in enumerate(zip(r, widths))).rstrip()

    return [line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]]


def _one_line(text: str, limit: int = 160) -> str:
    """``text`` on one line, at most ``limit`` characters, shortened at a word boundary."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    cut = text[:limit - 3]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space].rstrip(",;:")
    return cut + "..."


def _wrapped_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                   right: Sequence[int] = (), width: Optional[int] = None) -> list:
    """:func:`_table` whose last column (free text, such as a reason) is wrapped at word
    boundaries to fit ``width`` (default: the terminal's, at least 100), never cut."""
    import shutil
    import textwrap
    if width is None:
        width = max(100, shutil.get_terminal_size().columns - 1)
    cells = [[str(h) for h in headers[:-1]]] + [[str(v) for v in row[:-1]] for row in rows]
    start = sum(max(len(r[i]) for r in cells) + 2 for i in range(len(headers) - 1))
    room = max(30, width - start)
    firsts, rests = [], []
    for row in rows:
        lines = textwrap.wrap(" ".join(str(row[-1]).split()), room,
                              break_long_words=False, break_on_hyphens=False) or [""]
        firsts.append(tuple(row[:-1]) + (lines[0],))
        rests.append(lines[1:])
    table = _table(headers, firsts, right)
    out = table[:2]
    for line, more in zip(table[2:], rests):
        out += [line] + [" " * start + extra for extra in more]
    return out


# --- info ----------------------------------------------------------------------------------

def cuda_status() -> tuple:
    """``(available, description)`` of CUDA as Numba sees it; never raises.

    Importing ``numba.cuda`` can fail (numba-cuda missing or broken) and the driver may be
    absent; both are reported, not raised, since ``info`` exists to diagnose such setups.
    """
    try:
        import warnings

        import numba
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecation notices are not the question here
            from numba import cuda
        simulator = bool(getattr(numba.config, "ENABLE_CUDASIM", 0))
        if not cuda.is_available():
            why = "is_available() is False"
            try:
                from numba.cuda.cudadrv.driver import driver
                why = _one_line(getattr(driver, "initialization_error", None) or why)
            except Exception:
                pass
            return False, f"not available ({why})"
        if simulator:
            return True, "available: the CUDA simulator (NUMBA_ENABLE_CUDASIM=1), no GPU used"
        names = []
        for gpu in cuda.gpus:
            with gpu:
                dev = cuda.get_current_device()
                cc = ".".join(str(v) for v in dev.compute_capability)
                names.append(f"{dev.name.decode() if isinstance(dev.name, bytes) else dev.name}"
                             f" (compute capability {cc})")
        return True, "available: " + ("; ".join(names) or "a device")
    except Exception as exc:
        return False, f"not available ({type(exc).__name__}: {_one_line(exc)})"


def _threading_layers() -> list:
    """Numba threading layers whose libraries load here ("default" picks the first of them).

    Loading one (TBB, or the system's OpenMP runtime) starts no thread; it runs after the
    BLAS/OpenMP report is taken, which lists only what numbaconv's own use loaded.
    """
    import importlib
    found = []
    for layer, module in (("tbb", "tbbpool"), ("omp", "omppool"), ("workqueue", "workqueue")):
        try:
            importlib.import_module(f"numba.np.ufunc.{module}")
        except Exception:  # ImportError, or OSError for a missing shared library
            continue
        found.append(layer)
    return found


def _package_version(name: str) -> Optional[str]:
    """Installed version of a distribution without importing it (PyTorch takes a second)."""
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cmd_info(args) -> int:
    import numbaconv
    from numbaconv import bench

    env = bench.environment()
    _print(f"numbaconv {env['numbaconv']}")
    _print(f"  Python        {env['python']} ({env['python_executable']})")
    _print(f"  platform      {env['platform']}")
    _print(f"  CPU           {env['processor']}; {env['cpu_count']} CPUs, "
           f"{env['usable_cpus']} usable by this process")
    _print(f"  NumPy         {env['numpy']}")
    _print(f"  Numba         {env['numba']}")
    _print(f"  llvmlite      {env['llvmlite']}")
    for name in ("numba-cuda", "threadpoolctl", "torch", "asv"):
        version = _package_version(name)
        _print(f"  {name:<13} {version or 'not installed'}")
    launched = env["numba_threading_layer_launched"] or "none yet (no parallel kernel has run)"
    _print("Numba threading")
    _print(f"  layer         configured {env['numba_threading_layer']!r}, launched: {launched}")
    _print(f"  importable    {', '.join(_threading_layers()) or 'none'}")
    _print(f"  threads       NUMBA_NUM_THREADS = {env['numba_num_threads']}")
    title = "BLAS and OpenMP (threadpoolctl)" if env["threadpoolctl"] else "BLAS"
    _print(title)
    for line in bench.describe_threadpools(env["threadpools"]):
        _print(f"  {line}")
    set_vars = {k: v for k, v in env["env"].items() if v is not None}
    for text in _openblas_warnings(bench, set_vars, env["blas"]):
        _print(f"  WARNING: {text}")
    _print("environment")
    from numbaconv import config
    names = [n for n in env["env"] if not n.startswith("NUMBACONV_")]
    names += ["NUMBA_CACHE_DIR"] + list(config.documented_variables())
    width = max(len(n) for n in names)
    for name in names:
        value = os.environ.get(name)
        _print(f"  {name:<{width}} {'not set' if value is None else repr(value)}")
    _print("kernel cache")
    _print(f"  {config.describe_kernel_cache()}")
    _, text = cuda_status()
    _print("CUDA")
    _print(f"  {text}")
    _print("backends")
    rows = []
    for b in numbaconv.backends():
        rows.append((b.name, b.device or "?", "?" if b.priority is None else b.priority,
                     "yes" if b.available else "no", b.reason))
    if not rows:
        _print("  none registered: is numbaconv installed (pip install -e .)?")
    for line in _wrapped_table(("name", "device", "priority", "available", "reason"), rows,
                               (2,)):
        _print(f"  {line}")
    return 0


# --- check ---------------------------------------------------------------------------------

def cmd_check(args) -> int:
    import numbaconv
    from numbaconv import testing

    infos = {b.name: b for b in numbaconv.backends()}
    names = _backends_to_check(args.backend, infos)
    if names is None:
        return USAGE_ERROR
    if not names:
        _print("no backend other than the reference is available: nothing to check")
        return 0
    if args.case:
        try:
            cases = tuple(testing.case(n) for n in args.case)
        except KeyError as exc:
            _print(f"numbaconv check: error: unknown case {exc}; known: "
                   f"{[c.name for c in testing.CASES]}", file=sys.stderr)
            return USAGE_ERROR
    else:
        cases = tuple(testing.case(n) for n in QUICK_CHECK_CASES) if args.quick \
            else testing.CASES
    _print(f"checking {', '.join(names)} against the reference: {len(cases)} convolution "
           f"case(s) x 2 layouts x (float32, float64) x (plain, out=, accumulate=)"
           + ("" if args.case else f", and {2 if args.quick else len(testing.RNN_CASES)} "
              f"recurrent training step(s) x (float32, float64)") + "; relative error "
           f"tolerance {testing.TOLERANCE['float32']:g} (float32), "
           f"{testing.TOLERANCE['float64']:g} (float64)")

    results, problems = [], []
    progress = _Progress(sys.stderr.isatty() if args.progress is None else args.progress)
    for name in names:
        info = infos[name]
        if not info.available:
            problems.append(f"{name}: not available: {_one_line(info.reason, 200)}")
        elif info.device != "cpu":
            problems.append(f"{name}: not checked: it runs on {info.device}, and check "
                            f"compares NumPy (CPU) backends only")
        else:
            start = time.perf_counter()
            rnn_cases = () if args.case else \
                (testing.RNN_CASES[:2] if args.quick else testing.RNN_CASES)
            # One (case, layout) at a time, so that the progress line moves (the first
            # calls compile, for minutes); the same comparisons in the same order.
            units = [(c, layout) for c in cases for layout in testing.LAYOUTS]
            total = len(units) + len(rnn_cases)
            progress.start = time.perf_counter()
            try:
                mine, mine_rnn = [], []
                for done, (c, layout) in enumerate(units):
                    progress.update(done, total, f"{name}: {c.name} {layout}")
                    mine += testing.check_backend(name, cases=(c,), layouts=(layout,))
                for done, c in enumerate(rnn_cases, len(units)):
                    progress.update(done, total, f"{name}: recurrent {c.name}")
                    mine_rnn += testing.check_rnn_backend(name, (c,))
            except Exception as exc:  # the check itself broke: report, check the others
                progress.clear()
                problems.append(f"{name}: check failed to run: {type(exc).__name__}: "
                                f"{_one_line(exc, 200)}")
                continue
            progress.clear()
            _print(f"  {name}: {len(mine) + len(mine_rnn)} comparisons in "
                   f"{time.perf_counter() - start:.1f} s")
            if not any(r.status == "pass" for r in mine + mine_rnn):
                problems.append(f"{name}: supported none of the {len(mine) + len(mine_rnn)} "
                                f"problems")
            results += mine + mine_rnn

    if results:
        _print()
        for line in _check_table(names, results, testing.CONV_OPS + testing.RNN_OPS):
            _print(line)
    failures = [r for r in results if r.status == "FAIL"]
    if failures:
        shown = failures[:args.max_failures]
        _print(f"\nfailures ({len(shown)} of {len(failures)} shown):")
        for r in shown:
            _print(f"  {r.backend} {r.op} case={r.case} {r.layout} {r.dtype} mode={r.mode}: "
                   f"{_one_line(r.detail, 200)}")
    if args.verbose:
        _print_skip_reasons(results)
    if problems:
        _print("\nproblems:")
        for p in problems:
            _print(f"  {p}")
    compared = sum(r.status != "skip" for r in results)
    if failures or problems:
        _print(f"\nFAILED: {len(failures)} of {compared} comparisons failed"
               + (f", {len(problems)} backend problem(s)" if problems else ""))
        return 1
    _print(f"\nOK: all {compared} comparisons passed "
           f"({len(results) - compared} skipped; -v lists why)")
    return 0


def _backends_to_check(requested, infos) -> Optional[list]:
    """Names of the backends for ``check`` to run, or None after a usage error.

    Those requested, else every available CPU backend but the reference; the others are
    printed with the reason they are left out.
    """
    if requested:
        unknown = [n for n in requested if n not in infos]
        if unknown:
            _print(f"numbaconv check: error: unknown backend(s) {unknown}; registered: "
                   f"{sorted(infos)}", file=sys.stderr)
            return None
        return list(dict.fromkeys(requested))
    names = []
    for b in infos.values():
        if b.name == "reference":
            continue
        if b.available and b.device == "cpu":
            names.append(b.name)
        else:
            why = (f"runs on {b.device}; check compares CPU backends" if b.available
                   else _one_line(b.reason, 120))
            _print(f"skipping {b.name}: {why}")
    return names


def _check_table(names, results, ops) -> list:
    """Per backend and op: passed, failed and skipped counts and the worst error per dtype.

    One column per dtype: a float32 rounding error would hide float64 trouble in a shared
    column, since their tolerances differ by six orders of magnitude.
    """
    dtypes = sorted({r.dtype for r in results})
    rows = []
    for name in names:
        for op in ops:
            mine = [r for r in results if r.backend == name and r.op == op]
            if not mine:
                continue
            worst = []
            for dtype in dtypes:
                errors = [r.error for r in mine if r.status != "skip" and r.dtype == dtype]
                worst.append(f"{max(errors):.2e}" if errors else "-")
            rows.append((name, op, sum(r.status == "pass" for r in mine),
                         sum(r.status == "FAIL" for r in mine),
                         sum(r.status == "skip" for r in mine), *worst))
    headers = ("backend", "op", "passed", "failed", "skipped") + tuple(
        f"worst {d}" for d in dtypes)
    return _table(headers, rows, range(2, len(headers)))


def _print_skip_reasons(results) -> None:
    counts = {}
    for r in results:
        if r.status == "skip":
            key = (r.backend, r.op, _one_line(r.detail, 200))
            counts[key] = counts.get(key, 0) + 1
    if counts:
        _print("\nskipped (backend, op: reason x count):")
        for (backend, op, why), n in sorted(counts.items()):
            _print(f"  {backend}, {op}: {why} x {n}")


# --- bench ---------------------------------------------------------------------------------

def _print_blas_and_environment(bench, env: dict, *, threadpools: bool) -> list:
    """The bench header's BLAS line (with its threads and every thread pool when
    ``threadpools``), the relevant environment variables and the OPENBLAS warnings, which it
    returns."""
    blas = env["blas"]
    if blas is not None:
        _print(f"BLAS (NumPy's): {blas['library']} {blas['version'] or ''}, kernel "
               f"{blas['kernel'] or 'not reported'}"
               + (f", {blas['threads']} thread(s)" if threadpools else ""))
    if threadpools:
        for line in bench.describe_threadpools(env["threadpools"]):
            _print(f"  {line}")
    set_vars = {k: v for k, v in env["env"].items() if v is not None}
    _print("environment: " + (", ".join(f"{k}={v}" for k, v in set_vars.items())
                              or "no relevant variable set"))
    warnings = _openblas_warnings(bench, set_vars, blas)
    for text in warnings:
        _print(f"WARNING: {text}")
    return warnings


def _bench_rnn(args, bench, names) -> int:
    """``bench --suite rnn``: training steps of the RNN shapes, side by side with PyTorch."""
    import numba

    from numbaconv import bench_rnn

    threads = args.threads or numba.config.NUMBA_NUM_THREADS
    torch = not args.no_torch and bench.import_torch() is not None
    env = bench.environment()
    _print(f"numbaconv {env['numbaconv']} bench --suite rnn: NumPy {env['numpy']}, Numba "
           f"{env['numba']}, {threads} thread(s) for Numba, BLAS and PyTorch; {args.dtype}")
    _print_blas_and_environment(bench, env, threadpools=False)
    cases = bench_rnn.QUICK_RNN_SHAPES if args.quick else bench_rnn.RNN_SHAPES
    repeat = args.repeat or (3 if args.quick else 7)
    _print(f"training step = rnn_forward(training=True, reserve=preallocated) + "
           f"rnn_backward_data + rnn_backward_weights(out=); PyTorch: forward + backward; "
           f"median of {repeat}, each engine in a fresh process")
    progress = _Progress(sys.stderr.isatty() if args.progress is None else args.progress)
    try:
        rows = bench_rnn.run_rnn_benchmarks(
            cases, backends=names, repeat=repeat, torch=torch, dtype=args.dtype,
            threads=threads, progress=lambda what: progress.update(0, 0, what))
    finally:
        progress.clear()
    _print(bench_rnn.format_rnn_table(rows, names))
    if args.json:
        record = dict(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), suite="rnn",
                      quick=args.quick, repeat=repeat, threads=threads, dtype=args.dtype,
                      environment=env, rows=rows)
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=1, default=str)
        _print(f"results written to {args.json}")
    return 0


#: ``bench`` options that only ``--device cuda`` reads (each defaults to None or False).
CUDA_BENCH_OPTIONS = ("sim", "case", "tolerance", "budget", "warmup", "no_flush", "no_tf32",
                      "time_limit")

#: ``bench`` options that ``--device cuda`` does not read.
CPU_BENCH_OPTIONS = ("backend", "include_reference", "threads", "no_torch", "first_call",
                     "plot")


def cmd_bench(args) -> int:
    if args.device == "cuda":
        return _bench_cuda(args)
    given = [name for name in CUDA_BENCH_OPTIONS if _given(getattr(args, name))]
    if given:
        _print(f"numbaconv bench: error: {', '.join(_option(n) for n in given)} "
               f"{'applies' if len(given) == 1 else 'apply'} to --device cuda only",
               file=sys.stderr)
        return USAGE_ERROR

    from numbaconv import bench, dispatch
    from numbaconv.problem import CONV_OPS

    import numba

    infos = {b.name: b for b in dispatch.backends()}
    if args.backend:
        unknown = [n for n in args.backend if n not in infos]
        if unknown:
            _print(f"numbaconv bench: error: unknown backend(s) {unknown}; registered: "
                   f"{sorted(infos)}", file=sys.stderr)
            return USAGE_ERROR
        names = list(dict.fromkeys(args.backend))
    else:
        names = bench.cpu_backends()
    if args.first_call:
        return _first_call(args, bench, names if args.backend else ["cpu"])
    if args.suite == "rnn":
        rnn_names = [n for n in names if "rnn_forward" in getattr(
            dispatch.get_backend(n), "ops", ()) and (n != "reference" or args.backend)]
        return _bench_rnn(args, bench, rnn_names)
    if args.plot:
        try:  # before measuring, not after minutes of it
            bench.require_matplotlib()
        except ImportError as exc:
            _print(f"numbaconv bench: error: --plot: {exc}", file=sys.stderr)
            return 1
    shapes = bench.QUICK_SHAPES if args.quick else bench.SHAPES
    repeat = args.repeat or (3 if args.quick else 7)
    layout = args.layout or ("channels_first" if args.quick else "both")
    layouts = bench.resolve_layouts(layout)
    ops = args.op or CONV_OPS
    skip_reference = () if (args.quick or args.include_reference) else bench.BIG_SHAPE_NAMES

    threads = args.threads or numba.config.NUMBA_NUM_THREADS
    if threads > numba.config.NUMBA_NUM_THREADS:
        _print(f"numbaconv bench: error: --threads {threads} exceeds NUMBA_NUM_THREADS = "
               f"{numba.config.NUMBA_NUM_THREADS}", file=sys.stderr)
        return USAGE_ERROR
    torch = None if args.no_torch else bench.import_torch()
    if torch is not None:
        torch.set_num_threads(threads)  # the same number of threads on both sides
    if args.threads:
        numba.set_num_threads(threads)
    limiter = _blas_limits(threads)

    env = bench.environment()  # after importing PyTorch, so its OpenMP runtime is listed
    _print(f"numbaconv {env['numbaconv']} bench: NumPy {env['numpy']}, Numba {env['numba']} "
           f"(threading layer {env['numba_threading_layer']}), Python {env['python']}")
    _print(f"CPU: {env['processor']}, {env['usable_cpus']} usable CPUs; threads: {threads} for "
           f"Numba, BLAS{' and PyTorch' if torch is not None else ''}")
    blas = env["blas"]
    warnings = _print_blas_and_environment(bench, env, threadpools=True)
    if torch is not None:
        _print(f"PyTorch {torch.__version__}: timed directly as the baseline of 'vs pytorch' "
               f"(> 1: the backend is faster)")
    else:
        _print("PyTorch: " + ("not used (--no-torch)" if args.no_torch
                              else "not installed, no comparison"))
    _print(f"backends: {', '.join(names) or 'none'}; {args.dtype}, {', '.join(layouts)}; "
           f"median of {repeat} after a warm-up call"
           + ("; reference skipped on the big shapes (--include-reference)"
              if skip_reference and "reference" in names else ""))

    progress = _Progress(sys.stderr.isatty() if args.progress is None else args.progress)
    peak_size = 512 if args.quick else 2048
    with limiter:
        progress.update(0, 0, f"{bench.gemm_name(args.dtype)} peak")
        peak = bench.gemm_peak(peak_size, args.dtype, repeat=repeat)
        progress.clear()
    _print(f"{peak['name']} peak: {peak['gflops']:.1f} GFLOP/s (np.matmul, {peak_size}x"
           f"{peak_size} {peak['dtype']}, {threads} BLAS thread(s), best of {peak['repeat']}: "
           f"{bench.format_seconds(peak['best_s'])}); 'of peak' = GFLOP/s / this")
    _print()

    headers = ("shape", "layout", "op", "backend", "median", "GFLOP/s", "of peak",
               "pytorch", "vs pytorch")
    widths = (max(len(s.name) for s in shapes), max(len(lay) for lay in layouts),
              max(len(o) for o in ops),
              max([len(bench.PYTORCH)] + [len(n) for n in names]), 10, 8, 7, 10, 10)

    def fmt(values):
        return "  ".join(str(v).rjust(w) if i >= 4 else str(v).ljust(w)
                         for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    _print(fmt(headers))
    _print(fmt(["-" * w for w in widths]))

    def report(row):
        if row.backend == "reference" and row.shape in skip_reference:
            return  # the header says so once; the JSON keeps these rows
        progress.clear()
        if row.status == "ok":
            ratio = f"{row.vs_pytorch:.2f}" if row.vs_pytorch is not None else "-"
            baseline = "" if row.backend == bench.PYTORCH else bench.format_seconds(
                row.pytorch_s)
            _print(fmt((row.shape, row.layout, row.op, row.backend,
                        bench.format_seconds(row.median_s), f"{row.gflops:.2f}",
                        _percent(row.peak_fraction), baseline, ratio)))
        else:
            _print(fmt((row.shape, row.layout, row.op, row.backend, row.status, "", "", "",
                        "")) + f"  {_one_line(row.detail, 100)}")

    with limiter:
        if args.settle > 0:
            time.sleep(args.settle)  # BLAS's threads, busy with the peak, go idle first
        try:
            rows = bench.run_benchmarks(shapes, names, ops=ops, repeat=repeat,
                                        layout=layouts, dtype=args.dtype, torch=torch,
                                        skip_reference_on=skip_reference,
                                        settle=args.settle, peak_gflops=peak["gflops"],
                                        report=report, progress=progress.update)
            progress.update(0, 0, "dispatch overhead")
            overhead = bench.dispatch_overhead(dtype=args.dtype, layout=layouts[0],
                                               repeat=max(11, 2 * repeat + 1),
                                               settle=args.settle)
        finally:
            progress.clear()

    _print()
    _print("dispatch overhead (tiny problem: public call minus the backend's run() on "
           "pre-validated operands):")
    for line in _table(("op", "backend", "public", "run()", "overhead"),
                       [(d["op"], d["backend"], f"{d['public_us']:.1f} us",
                         f"{d['direct_us']:.1f} us", f"{d['overhead_us']:.1f} us")
                        for d in overhead], (2, 3, 4)):
        _print(f"  {line}")
    conv_overhead = next(d for d in overhead if d["op"] == "conv")
    worst = max(overhead, key=lambda d: d["overhead_us"])
    verdict = "within" if worst["overhead_us"] < 20 else "ABOVE"
    _print(f"dispatch overhead: {conv_overhead['overhead_us']:.1f} us for conv, at most "
           f"{worst['overhead_us']:.1f} us ({worst['op']}); {verdict} the 20 us target")

    summary = bench.summarize(rows)
    _print()
    _print_summary(summary, peak, torch is not None)

    status = 0
    plotted = None
    if args.plot:
        try:
            plotted = bench.plot_ratios(rows, args.plot, peak_name=peak["name"])
        except (ValueError, OSError) as exc:  # nothing to draw, or an unwritable path
            _print(f"numbaconv bench: error: --plot {args.plot}: {exc}", file=sys.stderr)
            status = 1
        else:
            what = ("ratios to PyTorch" if plotted == "vs_pytorch"
                    else f"fractions of the {peak['name']} peak (no PyTorch ratios)")
            _print(f"plot of the {what} written to {args.plot}")
    for text in warnings:  # repeated last, where the eye lands after a long run
        _print(f"WARNING: {text}")

    errors = [r for r in rows if r.status == "error"]
    if args.json:
        record = dict(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), quick=args.quick,
                      repeat=repeat, threads=threads, dtype=args.dtype,
                      layout=layout, layouts=list(layouts),
                      torch=None if torch is None else torch.__version__, environment=env,
                      blas=blas, warnings=warnings, plot=args.plot if plotted else None,
                      gemm_peak=peak, shapes=[_case_dict(c) for c in shapes],
                      results=[r.as_dict() for r in rows], dispatch_overhead=overhead,
                      summary=summary, targets=dict(groups=bench.GROUP_TARGETS,
                                                    ops=list(bench.TARGET_OPS)))
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, default=_json_default)
        _print(f"results written to {args.json}")
    if errors:
        _print(f"{len(errors)} measurement(s) failed; see the 'error' rows")
        return 1
    return status


def _given(value) -> bool:
    """Whether an option was given: its value is not its default (None or False)."""
    return value is not None and value is not False


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _bench_cuda(args) -> int:
    """``bench --device cuda``: numbaconv's ``cuda`` backend against PyTorch on one GPU
    (numbaconv.bench_cuda), or its correctness path under Numba's simulator (``--sim``)."""
    from numbaconv import bench_cuda

    given = [name for name in CPU_BENCH_OPTIONS if _given(getattr(args, name))]
    if args.suite != "conv":
        given.insert(0, "suite")
    if given:
        _print(f"numbaconv bench: error: --device cuda does not take "
               f"{', '.join(_option(n) for n in given)}", file=sys.stderr)
        return USAGE_ERROR
    ops = tuple(dict.fromkeys(args.op)) if args.op else bench_cuda.OPS
    wrong = [op for op in ops if op not in bench_cuda.OPS]
    if wrong or args.dtype != "float32":
        what = f"--op {', '.join(wrong)}" if wrong else f"--dtype {args.dtype}"
        _print(f"numbaconv bench: error: --device cuda times float32 {', '.join(bench_cuda.OPS)}"
               f" only, not {what}", file=sys.stderr)
        return USAGE_ERROR
    for name in ("tolerance", "budget", "time_limit"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            _print(f"numbaconv bench: error: {_option(name)}: expected a positive number, got "
                   f"{value}", file=sys.stderr)
            return USAGE_ERROR
    sim = bool(args.sim) or bench_cuda.simulator_requested()
    cases = bench_cuda.select_cases(sim=sim, quick=args.quick, patterns=args.case or ())
    if not cases:
        names = [c.name for c in bench_cuda.select_cases(sim=sim, quick=args.quick)]
        _print(f"numbaconv bench: error: --case {args.case} matches none of {names}",
               file=sys.stderr)
        return USAGE_ERROR
    layouts = bench_cuda.LAYOUTS if args.layout in (None, "both") else (args.layout,)
    if sim:
        try:
            bench_cuda.enable_simulator()  # before numbaconv imports numba.cuda
        except RuntimeError as exc:
            _print(f"numbaconv bench: error: {exc}", file=sys.stderr)
            return 1
    try:
        import torch
    except ImportError:
        _print("numbaconv bench: error: --device cuda needs PyTorch (a CUDA build on a GPU): "
               "it is the oracle and the baseline", file=sys.stderr)
        return 1
    if not sim and not torch.cuda.is_available():
        _print("numbaconv bench: error: no CUDA device visible to PyTorch (a CUDA build of "
               "torch and a GPU are needed); --sim runs the correctness path on tiny shapes "
               "under Numba's CUDA simulator", file=sys.stderr)
        return 1
    import numbaconv
    registered = bench_cuda.ensure_cuda_backend()
    info = {b.name: b for b in numbaconv.backends()}.get("cuda")
    if info is None or not info.available:
        _print(f"numbaconv bench: error: numbaconv's cuda backend is not available: "
               f"{info.reason if info else 'not registered'}", file=sys.stderr)
        return 1

    reps = args.repeat or (bench_cuda.QUICK_REPS if args.quick else bench_cuda.DEFAULT_REPS)
    budget = args.budget or (bench_cuda.QUICK_BUDGET if args.quick
                             else bench_cuda.DEFAULT_BUDGET)
    warmup = bench_cuda.DEFAULT_WARMUP if args.warmup is None else args.warmup
    tolerance = args.tolerance or bench_cuda.DEFAULT_TOLERANCE
    flush = not (args.no_flush or sim)
    if sim:  # one wall-clock call per timing
        warmup, reps, budget = 0, 1, None
    settings = dict(sim=sim, quick=args.quick, ops=list(ops), layouts=list(layouts),
                    tolerance=tolerance, warmup=warmup, reps=reps, budget_s=budget,
                    flush_bytes=bench_cuda.FLUSH_BYTES if flush else 0,
                    tf32=not args.no_tf32, time_limit_s=args.time_limit,
                    argv=sys.argv[1:])
    stream_problem = None
    if not sim:
        torch.backends.cudnn.benchmark = True
        torch.cuda.init()
        stream_problem = bench_cuda.legacy_stream_problem()
    env = bench_cuda.environment(sim=sim)
    env.update(stream_problem=stream_problem, cuda_backend_registered_here=bool(registered))

    _print(f"numbaconv {env['numbaconv']} GPU bench: {env['device']}")
    _print(f"versions: numba {env['numba']}, numba-cuda {env['numba_cuda']}, torch "
           f"{env['torch']} (CUDA {env['torch_cuda']}"
           + ("" if sim else f", cuDNN {env['cudnn']}") + f"), Python {env['python']}"
           + ("" if sim else f"; NVIDIA driver {env['nvidia_driver']}, CUDA driver API "
                             f"{env['cuda_driver_api']}, compute capability "
                             f"{env['compute_capability']}, {env['multiprocessors']} SMs"))
    if sim:
        _print("SIMULATOR: tiny shapes, PyTorch on the CPU as the oracle, one wall-clock call "
               "per timing: the times below mean nothing, only the checks do")
    else:
        _print(f"timing: CUDA events, {warmup} warm-up call(s), then the median of up to "
               f"{reps} runs within {budget:g} s"
               + (f", {bench_cuda.FLUSH_BYTES >> 20} MiB written between runs (L2 flush)"
                  if flush else ", no L2 flush between runs"))
    _print(f"checked first against PyTorch in IEEE float32 (TF32 off): relative error (max "
           f"abs error / max abs reference) <= {tolerance:g}, else the row fails and is not "
           f"timed; 'ieee/ours' and 'tf32/ours' are PyTorch's time over numbaconv's (> 1: "
           f"numbaconv is faster); TFLOP/s counts 2*N*K*(C/groups)*R*S*P*Q per op")
    if registered:
        _print(f"note: {registered}")
    if stream_problem:
        _print(f"WARNING: {stream_problem}; the times may be wrong")
    _print()
    widths = bench_cuda.column_widths(cases, layouts, ops)
    for line in bench_cuda.format_header(widths):
        _print(line)

    rows = []

    def save(finished):
        if args.json:
            bench_cuda.write_json(args.json, environment=env, settings=settings, cases=cases,
                                  rows=rows, finished=finished)

    def report(row):
        rows.append(row)
        _print(bench_cuda.format_row(row, widths))
        save(False)

    def progress(text):
        _print(text, file=sys.stderr)

    timer = bench_cuda.Timer(sim=sim, warmup=warmup, reps=reps,
                             budget=budget or bench_cuda.DEFAULT_BUDGET, flush=flush)
    bench_cuda.run_rows(cases, sim=sim, ops=ops, layouts=layouts, tolerance=tolerance,
                        timer=timer, tf32=not args.no_tf32, time_limit=args.time_limit,
                        report=report,
                        progress=progress if args.progress is not False else None)
    _print()
    for line in bench_cuda.summary_lines(rows):
        _print(line)
    if sim:
        _print("(simulator: the times mean nothing)")
    save(True)
    if args.json:
        _print(f"results written to {args.json}")
    return 1 if any(r.status in ("FAIL", "error") for r in rows) else 0


class _Progress:
    """One self-overwriting status line on stderr while ``bench`` measures.

    Drawn only when enabled (by default when stderr is a terminal), so that piped or
    captured output holds the table alone. :meth:`clear` wipes the line before anything
    else is printed, so that it never ends up inside the table.
    """

    def __init__(self, enabled: bool, stream=None):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()
        self.shown = False

    def update(self, done: int, total: int, what: str) -> None:
        """Show ``what`` and, when ``total`` is known, a bar of ``done`` out of ``total``."""
        if not self.enabled:
            return
        import shutil

        elapsed = time.perf_counter() - self.start
        if total:
            filled = round(20 * done / total)
            text = f"[{'#' * filled}{'.' * (20 - filled)}] {done}/{total} {elapsed:.0f} s: {what}"
        else:
            text = f"{elapsed:.0f} s: {what}"
        width = max(20, shutil.get_terminal_size().columns - 1)
        self.stream.write("\r\033[K" + text[:width])  # back to column 0, erase the line
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


def _openblas_warnings(bench, set_vars: dict, blas: Optional[dict]) -> list:
    """Warnings about OpenBLAS settings that make this run's figures unrepresentative.

    ``OPENBLAS_CORETYPE`` forcing an older kernel than OpenBLAS would pick is found out by
    asking a fresh interpreter without it (a fraction of a second, only when it is set);
    ``OPENBLAS_L2_SIZE`` overrides a detected cache size, which no interpreter reveals, so
    it is reported whenever set.
    """
    found = []
    coretype = set_vars.get("OPENBLAS_CORETYPE")
    if coretype and (blas is None or blas["library"] == "openblas"):
        natural = bench.openblas_natural_kernel()
        text = bench.openblas_coretype_warning(
            coretype, blas["kernel"] if blas else None, natural,
            bench.cpu_isa_level() if natural is None else None)
        if text:
            found.append(text)
    if set_vars.get("OPENBLAS_L2_SIZE"):
        found.append(f"OPENBLAS_L2_SIZE={set_vars['OPENBLAS_L2_SIZE']} overrides the L2 size "
                     f"OpenBLAS detects, which sizes its blocking; the comparison with "
                     f"PyTorch wants {' and '.join(OPENBLAS_TUNING_VARS)} unset")
    return found


def _percent(fraction) -> str:
    if fraction is None:
        return "-"
    return f"{fraction * 100:.1f}%" if fraction < 0.1 else f"{fraction * 100:.0f}%"


def _print_summary(summary: list, peak: dict, compared: bool) -> None:
    """The per-group table of :func:`numbaconv.bench.summarize`, with the targets' verdicts."""
    from numbaconv import bench

    _print("summary per backend, group and op: geometric means over the group's shapes and "
           "layouts; 'vs pytorch' is PyTorch's time over the backend's (> 1: faster)")
    if not compared:
        _print("  no PyTorch baseline in this run: no ratios, targets not judged")
    if not summary:
        _print("  nothing measured")
        return
    rows = []
    for s in summary:
        if s["target"] is None:
            target = verdict = ""
        else:
            target = f">= {s['target']:.1f}"
            verdict = {True: "met", False: "not met", None: "-"}[s["met"]]
        rows.append((s["backend"], s["group"], s["op"], f"{s['compared']}/{s['measured']}",
                     "-" if s["gflops"] is None else f"{s['gflops']:.2f}",
                     _percent(s["peak_fraction"]),
                     "-" if s["vs_pytorch"] is None else f"{s['vs_pytorch']:.2f}",
                     "-" if s.get("at_peak") is None else f"{s['at_peak']:.2f}",
                     target, verdict))
    for line in _table(("backend", "group", "op", "ratios", "GFLOP/s", "of peak",
                        "vs pytorch", "at peak", "target", "verdict"), rows, (3, 4, 5, 6, 7)):
        _print(f"  {line}")
    _print(f"  ratios: rows with a PyTorch ratio / rows timed; of peak: of the "
           f"{peak['name']} peak, {peak['gflops']:.1f} GFLOP/s; at peak: the ratio at that "
           f"peak (PyTorch's time over the FLOPs at np.matmul's rate), the ceiling of an "
           f"algorithm bound by this BLAS")
    judged = [s for s in summary if s["met"] is not None]
    for backend in dict.fromkeys(s["backend"] for s in judged):
        mine = [s for s in judged if s["backend"] == backend]
        met = [f"{s['group']} {s['op']}" for s in mine if s["met"]]
        missed = [f"{s['group']} {s['op']}" for s in mine if not s["met"]]
        _print(f"targets for {backend}: {len(met)} of {len(mine)} met"
               + (f"; not met: {', '.join(missed)}" if missed else ""))


def _first_call(args, bench, backends) -> int:
    """``bench --first-call``: each op's first call in fresh processes, cold and cached."""
    ops = args.op or _conv_ops()
    layouts = bench.resolve_layouts(args.layout or "channels_first")
    case = bench.FIRST_CALL_CASE
    from numbaconv import __version__
    _print(f"numbaconv {__version__} first-call latency: {', '.join(backends)}; {args.dtype}, "
           f"{', '.join(layouts)}; problem {case.name} (x {case.x_shape}, w {case.w_shape}, "
           f"padding {case.padding})")
    _print("each op in two fresh interpreters sharing a new, empty NUMBA_CACHE_DIR, with "
           "NUMBACONV_JIT_CACHE=1 and NUMBACONV_AUTOTUNE=0: 'cold' compiles (and writes the "
           "cache), 'cached' loads the first one's kernels from disk. Numba is imported just "
           "before and timed apart: a user's first call pays 'Numba import' on top (importing "
           "numbaconv does not load Numba).")
    _print()
    headers = ("backend", "layout", "op", "algorithm", "cold", "cached", "Numba import",
               "2nd call", "kernels", "from cache")
    widths = [max([len(h)] + [len(v) for v in values]) for h, values in zip(
        headers, (backends, layouts, ops, ("im2col",), (), (), (), (), (), ()))]
    widths = [max(w, 10) if i in (4, 5, 6, 7) else w for i, w in enumerate(widths)]

    def fmt(values):
        return "  ".join(str(v).rjust(w) if i >= 4 else str(v).ljust(w)
                         for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    _print(fmt(headers))
    _print(fmt(["-" * w for w in widths]))
    results = []
    for backend in backends:
        for layout in layouts:
            for r in bench.first_call_latency(ops, backend, layout=layout, dtype=args.dtype,
                                              threads=args.threads):
                results.append(r)
                cold, cached = r["cold"], r["cached"]
                failed = cold.get("error") or cached.get("error")
                if failed:
                    _print(fmt((backend, layout, r["op"], "error", "", "", "", "", "", ""))
                           + f"  {_one_line(failed, 100)}")
                    continue
                _print(fmt((backend, layout, r["op"], cold["algorithm"],
                            bench.format_seconds(cold["call_s"]),
                            bench.format_seconds(cached["call_s"]),
                            bench.format_seconds(cached["numba_import_s"]),
                            bench.format_seconds(cached["second_s"]), cold["kernels"],
                            f"{cached['cache_hits']}/{cached['kernels']}")))
    reports = [r[k] for r in results for k in ("cold", "cached") if "error" not in r[k]]
    if reports:
        imports = sorted(p["import_s"] for p in reports)
        loaded = [p for p in reports if p["numba_at_import"]]
        _print(f"import numbaconv: {bench.format_seconds(imports[len(imports) // 2])} (median "
               f"of {len(imports)} fresh interpreters); Numba loaded by the import: "
               + (f"yes, in {len(loaded)}" if loaded else "no, so importing compiles nothing"))
    errors = [r for r in results if "error" in r["cold"] or "error" in r["cached"]]
    if args.json:
        record = dict(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), dtype=args.dtype,
                      case=_case_dict(case), first_call=results)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, default=_json_default)
        _print(f"results written to {args.json}")
    if errors:
        _print(f"{len(errors)} first-call measurement(s) failed")
        return 1
    return 0


def _blas_limits(threads: int):
    """A context limiting BLAS to ``threads`` (a no-op without threadpoolctl)."""
    import contextlib
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=threads, user_api="blas")


def _case_dict(c) -> dict:
    return dict(name=c.name, group=getattr(c, "group", None), x_shape=c.x_shape,
                w_shape=c.w_shape, stride=c.stride, padding=c.padding, dilation=c.dilation,
                groups=c.groups, output_padding=c.output_padding)


def _json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


# --- demo ----------------------------------------------------------------------------------

def cmd_demo(args) -> int:
    import contextlib

    import numbaconv
    from numbaconv import demos

    name = args.model
    if name is None:
        name, note = demos.default_demo()
        if note:
            _print(f"numbaconv demo: {note}", file=sys.stderr)
    if args.epochs is not None and args.epochs < 1:
        _print("numbaconv demo: error: --epochs must be >= 1", file=sys.stderr)
        return USAGE_ERROR
    options = dict(epochs=args.epochs, seed=args.seed, log=_print)
    if args.output is not None:
        if name != "autoencoder":
            _print(f"numbaconv demo: error: --output applies to the autoencoder demo, not "
                   f"{name}", file=sys.stderr)
            return USAGE_ERROR
        options["output"] = args.output
    try:
        module = demos.load(name)
    except demos.DemoUnavailable as exc:
        _print(f"numbaconv demo: error: {exc}", file=sys.stderr)
        return 1
    with contextlib.ExitStack() as stack:
        if args.backend:
            try:
                stack.enter_context(numbaconv.use_backend(*args.backend))
            except ValueError as exc:  # an unknown backend name
                _print(f"numbaconv demo: error: {exc}", file=sys.stderr)
                return USAGE_ERROR
        try:
            return module.run_demo(**options)
        except numbaconv.NoBackendError as exc:
            _print(f"numbaconv demo: {exc}", file=sys.stderr)
            return 1


# --- warmup --------------------------------------------------------------------------------

def cmd_warmup(args) -> int:
    from numbaconv import _warmup

    try:
        combos = _warmup.plan(args.op, args.dtype, args.layout, args.ndim, args.layer)
    except ValueError as exc:
        _print(f"numbaconv warmup: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    from numbaconv.config import describe_kernel_cache
    _print(f"compiling the cpu kernels of {len(combos)} op/dtype/layout/layer "
           f"combination(s), every algorithm each; kernels cache in "
           f"{describe_kernel_cache()}")
    progress = _Progress(sys.stderr.isatty() if args.progress is None else args.progress)
    try:
        report = _warmup.warmup(args.op, dtypes=args.dtype, layouts=args.layout,
                                ndims=args.ndim, layers=args.layer, progress=progress.update)
    finally:
        progress.clear()
    for line in report.summary():
        _print(line)
    return 1 if report.errors else 0


def _dims(text: str) -> int:
    if text not in ("1", "2", "3"):
        raise argparse.ArgumentTypeError(f"expected 1, 2 or 3, got {text!r}")
    return int(text)


# --- parser --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``numbaconv`` command."""
    parser = argparse.ArgumentParser(
        prog="numbaconv",
        description="Numba convolution backward-pass kernels for NumPy: diagnostics, "
                    "conformance checks, benchmarks and a demo.")
    parser.add_argument("--version", action="version", version=f"numbaconv {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="command")

    p = sub.add_parser(
        "info", help="versions, threading, BLAS, CUDA and backends",
        description="Print numbaconv, Python, NumPy, Numba and llvmlite versions, the Numba "
                    "threading layer and thread count, the BLAS in use (via threadpoolctl, "
                    "with a warning when OPENBLAS_CORETYPE forces an older kernel), the "
                    "threading- and BLAS-related environment variables and every variable "
                    "numbaconv documents, where compiled kernels are cached, CUDA "
                    "availability and every registered backend with its device, priority, "
                    "availability and reason.")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "check", help="compare backends with the reference; exit 1 on a mismatch",
        description="Run every available CPU backend other than the reference (or those "
                    "named by --backend) on numbaconv.testing's table of problems, both "
                    "layouts, float32 and float64, plain/out=/accumulate=, and compare with "
                    "the reference backend. Prints a pass/fail table per backend and op and "
                    "the failures. Exit status 1 on any mismatch, or when a backend named "
                    "with --backend cannot be checked.")
    p.add_argument("--backend", action="append", metavar="NAME",
                   help="check this backend (repeatable); default: every available CPU "
                        "backend except the reference")
    p.add_argument("--quick", action="store_true",
                   help=f"check {len(QUICK_CHECK_CASES)} representative cases instead of all")
    p.add_argument("--case", action="append", metavar="NAME",
                   help="check only this case of numbaconv.testing.CASES (repeatable)")
    p.add_argument("--max-failures", type=int, default=20, metavar="N",
                   help="failures to print in detail (default 20)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also list why comparisons were skipped")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress line per backend on stderr (default: when stderr "
                        "is a terminal)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser(
        "bench", help="time the ops on standard shapes, against PyTorch",
        description="Time conv, conv_backward_data, conv_backward_weight, "
                    "conv_backward_bias and conv_transpose on standard CNN layer shapes "
                    "(ResNet 3x3, 1x1, depthwise 3x3, 7x7 stride-2 stem, 1D and 3D) for "
                    "each available CPU backend, and PyTorch directly when it is installed, "
                    "in both layouts, "
                    "printing median time, GFLOP/s, the fraction of the machine's GEMM peak "
                    "(np.matmul, measured in the same run) and PyTorch's time over the "
                    "backend's. Then the dispatch overhead of a tiny call, and a summary per "
                    "group of shapes (resnet3x3, pointwise, depthwise, stem, conv1d, conv3d): "
                    "geometric means of the ratio, judged against the targets for the data "
                    "and weight gradients. The header records NumPy's BLAS and the kernel it "
                    "runs (threadpoolctl) and warns when OPENBLAS_CORETYPE forces an older "
                    "kernel than OpenBLAS would pick. With --first-call, instead: each op's "
                    "first-call latency (JIT compilation) in fresh processes, cold and from "
                    "Numba's disk cache.")
    p.add_argument("--suite", choices=("conv", "rnn"), default="conv",
                   help="conv (default): the convolution ops; rnn: an RNN/LSTM/GRU training "
                        "step (training forward, backward data, backward weights with a "
                        "preallocated reserve) against PyTorch's forward plus autograd "
                        "backward, each engine in its own process, with the bytes one steady "
                        "step allocates; honours --quick, --repeat, --backend, --dtype, "
                        "--threads, --no-torch, --json")
    p.add_argument("--quick", action="store_true",
                   help="small shapes and few repeats (seconds; the reference included)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default): the CPU backends, as described above; cuda: "
                        "numbaconv's cuda backend against PyTorch (cuDNN) on one GPU, "
                        "float32 conv and both gradients on ResNet 3x3 (stride 1 and 2), 1x1 "
                        "and depthwise layers at N=32, each result checked against PyTorch "
                        "in IEEE float32 before it is timed with CUDA events, PyTorch timed "
                        "in IEEE float32 and with TF32 (docs/gpu-benchmark.md); honours "
                        "--quick, --op, --layout, --repeat, --json, --progress")
    p.add_argument("--repeat", "--reps", type=_positive_int, metavar="N",
                   help="timed samples per measurement (default 7, 3 with --quick; with "
                        "--device cuda: at most N runs within --budget, default "
                        "25, 10 with --quick)")
    p.add_argument("--backend", action="append", metavar="NAME",
                   help="time this backend (repeatable); default: every available CPU backend")
    p.add_argument("--include-reference", action="store_true",
                   help="also time the slow reference backend on the big shapes")
    p.add_argument("--op", action="append", choices=_conv_ops(), metavar="OP",
                   help="time only this op (repeatable)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--layout", choices=("channels_first", "channels_last", "both"),
                   help="layout(s) to time (default: both; channels_first with --quick or "
                        "--first-call)")
    p.add_argument("--threads", type=_positive_int, metavar="N",
                   help="threads for Numba, BLAS and PyTorch (default NUMBA_NUM_THREADS)")
    p.add_argument("--no-torch", action="store_true", help="do not time PyTorch")
    p.add_argument("--settle", type=float, default=_default_settle(), metavar="SECONDS",
                   help="pause between engines so idle thread pools stop spinning "
                        "(default %(default)s)")
    p.add_argument("--first-call", action="store_true",
                   help="measure each op's first call (JIT compilation) on a small problem in "
                        "fresh processes, cold and with Numba's on-disk cache, for the cpu "
                        "backend (or --backend); honours --op, --dtype, --layout, --threads")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw a bar chart of the ratios to PyTorch (fractions of the "
                        "GEMM peak without PyTorch) into FILE.png; needs matplotlib "
                        "(pip install 'numbaconv[plot]')")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress line on stderr (default: when stderr is a "
                        "terminal; with --device cuda: a line per step unless --no-progress)")
    cuda = p.add_argument_group("--device cuda only")
    cuda.add_argument("--sim", action="store_true", default=None,
                      help="no GPU: tiny shapes under Numba's CUDA simulator, PyTorch on the "
                           "CPU as the oracle, one wall-clock call per timing (meaningless; "
                           "the checks are the point). Implied by NUMBA_ENABLE_CUDASIM=1")
    cuda.add_argument("--case", "--only", action="append", metavar="TEXT",
                      help="only the cases whose name contains TEXT (repeatable, or "
                           "comma-separated)")
    cuda.add_argument("--tolerance", type=float, metavar="REL",
                      help="largest relative error (max abs error / max abs PyTorch) "
                           "that passes (default 2e-4)")
    cuda.add_argument("--warmup", type=_non_negative_int, metavar="N",
                      help="untimed calls before each measurement (default 3)")
    cuda.add_argument("--budget", type=float, metavar="SECONDS",
                      help="no new timed run after this many seconds of one measurement, "
                           "once 3 are done (default 5, 2 with --quick)")
    cuda.add_argument("--no-flush", action="store_true", default=None,
                      help="do not write 256 MiB between timed runs (keeps the L2 warm)")
    cuda.add_argument("--no-tf32", action="store_true", default=None,
                      help="do not time PyTorch with TF32 allowed")
    cuda.add_argument("--time-limit", type=float, metavar="SECONDS",
                      help="start no row after this many seconds; the rest are reported as "
                           "skipped")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "warmup", help="compile and cache the cpu kernels now (Docker images, CI caches)",
        description="Compile the cpu backend's Numba kernels and store them in Numba's disk "
                    "cache, so that later processes load them (about 0.3 s) instead of "
                    "compiling (seconds per op): every algorithm the backend offers, each "
                    "forced in turn, for each op on a small problem of each typical layer. "
                    "Default: a float32 2D training step, channels-first: conv (with a "
                    "bias), conv_backward_data, conv_backward_weight, conv_backward_bias on "
                    "ResNet's 3x3, 3x3 stride 2, 1x1 and 1x1 stride 2 layers. Prints what "
                    "was compiled or loaded and where the kernels are cached (see "
                    "docs/configuration.md: NUMBA_CACHE_DIR, NUMBACONV_CACHE_DIR). Exit "
                    "status 1 if a run failed.")
    p.add_argument("--op", action="append", choices=_conv_ops() + ("all",), metavar="OP",
                   help="warm up this op (repeatable; 'all' for every one); default: conv, "
                        "conv_backward_data, conv_backward_weight, conv_backward_bias")
    p.add_argument("--dtype", action="append", choices=("float32", "float64", "both"),
                   help="dtype (repeatable; default float32)")
    p.add_argument("--layout", action="append",
                   choices=("channels_first", "channels_last", "both"),
                   help="layout (repeatable; default channels_first)")
    p.add_argument("--ndim", action="append", type=_dims, metavar="{1,2,3}",
                   help="spatial dimensions (repeatable; default 2)")
    p.add_argument("--layer", action="append", metavar="NAME",
                   help="typical layer (repeatable): 3x3, 3x3s2, 1x1, 1x1s2, depthwise, stem "
                        "(7x7 stride 2) or all; default 3x3, 3x3s2, 1x1, 1x1s2")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress line on stderr (default: when stderr is a "
                        "terminal)")
    p.set_defaults(func=cmd_warmup)

    from numbaconv.demos import DEFAULT_DEMO, DEMOS, FALLBACK_DEMO, INSTALL_HINT
    p = sub.add_parser(
        "demo", help="train a small model in NumPy on numbaconv's gradients",
        description="Check a model's gradients against finite differences in float64, then "
                    "train it in plain NumPy on numbaconv's kernels, printing the loss per "
                    "epoch. Exit status 1 if the gradient check fails or the model did not "
                    "learn (autoencoder: the held-out loss fell by less than 10%; cnn: the "
                    "test accuracy stayed below the pass mark; lstm: the loss on the text fell "
                    "by less than 25%).")
    p.add_argument("model", nargs="?", choices=tuple(DEMOS), metavar="model",
                   help="; ".join(f"{n}: {info.summary}" for n, info in DEMOS.items())
                        + f". Default: {DEFAULT_DEMO} when its packages are installed "
                          f"({INSTALL_HINT}), else {FALLBACK_DEMO}.")
    p.add_argument("--epochs", type=int, metavar="N",
                   help="passes over the data (default: the model's own, "
                        "autoencoder 25, cnn 8, lstm 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of data and weights (default 0)")
    p.add_argument("--backend", action="append", metavar="NAME",
                   help="run the convolutions (lstm: the recurrent ops) on this backend "
                        "(repeatable, as use_backend)")
    p.add_argument("--output", metavar="PNG",
                   help="autoencoder: where to save the picture of digits and their "
                        "reconstructions (default numbaconv-autoencoder.png)")
    p.set_defaults(func=cmd_demo)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value


def _conv_ops() -> tuple:
    from numbaconv.problem import CONV_OPS
    return CONV_OPS


def _default_settle() -> float:
    from numbaconv.bench import DEFAULT_SETTLE
    return DEFAULT_SETTLE


def _version() -> str:
    from numbaconv import __version__
    return __version__


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``numbaconv`` command line.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments after the program name; ``sys.argv[1:]`` if omitted.

    Returns
    -------
    int
        The exit status (``--help`` and ``--version`` return 0, usage errors 2).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and errors; callers want a status
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if args.command is None:
        parser.print_help()
        return USAGE_ERROR
    try:
        return args.func(args)
    except KeyboardInterrupt:
        _print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `numbaconv info | head`: the reader left; say nothing more and do not traceback.
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 1
