"""``numbaconv bench``: the convolution table on the CPU backends against PyTorch, the
recurrent table (``--rnn``), the first-call latency (``--first-call``) and the CUDA table
(``--cuda``); their summaries and JSON records."""

from __future__ import annotations

import json
import math
import os
import sys
import time

from ._cli_output import (USAGE_ERROR, _conv_ops, _one_line, _openblas_warnings, _print,
                          _Progress, _table)
from .config import cuda_tf32


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
    torch_module = None if args.no_torch else bench.import_torch()
    torch = torch_module is not None
    env = bench.environment()
    _print(f"numbaconv {env['numbaconv']} bench --suite rnn: NumPy {env['numpy']}, Numba "
           f"{env['numba']}, {threads} thread(s) for Numba, BLAS and PyTorch; {args.dtype}")
    _print_blas_and_environment(bench, env, threadpools=False)
    cases = bench_rnn.QUICK_RNN_SHAPES if args.quick else bench_rnn.RNN_SHAPES
    repeat = args.repeat or (3 if args.quick else 7)
    tolerance = bench_rnn.RNN_TOLERANCE
    _print(f"training step = rnn_forward(training=True, reserve=preallocated) + "
           f"rnn_backward_data + rnn_backward_weights(out=); PyTorch: forward + backward; "
           f"median of {repeat}, each engine in a fresh process")
    if torch:
        _print(f"checked first against PyTorch {torch_module.__version__} (same weights, x "
               f"and dy; {args.dtype}, in a process of its own): relative error (max |ours - "
               f"torch| / max |torch|) of y, dx and the weight gradients at most "
               f"{tolerance:g}, else the case fails for that backend and is not timed")
    else:
        _print("check against PyTorch: skipped ("
               + ("--no-torch" if args.no_torch else "PyTorch is not installed")
               + "): the times below are of unchecked results")
    progress = _Progress(sys.stderr.isatty() if args.progress is None else args.progress)
    try:
        rows = bench_rnn.run_rnn_benchmarks(
            cases, backends=names, repeat=repeat, torch=torch, dtype=args.dtype,
            threads=threads, tolerance=tolerance,
            progress=lambda what: progress.update(0, 0, what))
    finally:
        progress.clear()
    _print(bench_rnn.format_rnn_table(rows, names))
    failed = bench_rnn.failed_checks(rows, names)
    if args.json:
        record = dict(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), suite="rnn",
                      quick=args.quick, repeat=repeat, threads=threads, dtype=args.dtype,
                      check=dict(against=f"pytorch {torch_module.__version__}",
                                 tolerance=tolerance, failed=len(failed)) if torch else None,
                      environment=env, rows=rows)
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=1, default=str)
        _print(f"results written to {args.json}")
    if failed:
        _print(f"{len(failed)} check(s) against PyTorch failed: "
               + "; ".join(f"{case} on {name}" for case, name, _ in failed))
        return 1
    return 0


#: ``bench`` options that only ``--device cuda`` reads (each defaults to None or False).
CUDA_BENCH_OPTIONS = ("sim", "case", "tolerance", "budget", "warmup", "no_flush", "no_tf32",
                      "time_limit")

#: ``bench`` options that ``--device cuda`` does not read.
CPU_BENCH_OPTIONS = ("backend", "include_reference", "threads", "no_torch", "first_call",
                     "plot", "in_process", "rounds", "group")


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
    if args.rounds is not None and (args.first_call or args.suite == "rnn" or
                                    args.in_process):
        _print("numbaconv bench: error: --rounds applies to the convolutions' engines in "
               "processes of their own (not --first-call, --suite rnn or --in-process)",
               file=sys.stderr)
        return USAGE_ERROR
    rounds = args.rounds or 1
    if args.group and (args.first_call or args.suite == "rnn"):
        _print("numbaconv bench: error: --group applies to the convolutions' shapes (not "
               "--first-call or --suite rnn)", file=sys.stderr)
        return USAGE_ERROR
    unknown = sorted(set(args.group or ()) - set(bench.GROUPS))
    if unknown:
        _print(f"numbaconv bench: error: --group: unknown group(s) {unknown}; the groups: "
               f"{', '.join(bench.GROUPS)}", file=sys.stderr)
        return USAGE_ERROR
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
    if args.group:
        shapes = tuple(c for c in shapes if bench.group_of(c) in args.group)
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
    if args.in_process:
        torch = None if args.no_torch else bench.import_torch()
        torch_version = None if torch is None else torch.__version__
        if torch is not None:
            torch.set_num_threads(threads)  # the same number of threads on both sides
        if args.threads:
            # numbaconv's threading set-up first (OMP_WAIT_POLICY, the pool's size): setting
            # the count starts Numba's threads, too late for it afterwards.
            from numbaconv.config import configure_threading
            configure_threading()
            numba.set_num_threads(threads)
    else:
        # Each engine's own process imports PyTorch, or sets Numba's threads; this one
        # neither, so that its environment (OMP_WAIT_POLICY) reaches PyTorch's unchanged.
        torch_version = None if args.no_torch else bench.torch_version()
        torch = True if torch_version is not None else None
    limiter = bench.blas_limits(threads)

    env = bench.environment()  # after importing PyTorch, so its OpenMP runtime is listed
    _print(f"numbaconv {env['numbaconv']} bench: NumPy {env['numpy']}, Numba {env['numba']} "
           f"(threading layer {env['numba_threading_layer']}), Python {env['python']}")
    _print(f"CPU: {env['processor']}, {env['usable_cpus']} usable CPUs; threads: {threads} for "
           f"Numba, BLAS{' and PyTorch' if torch_version is not None else ''}")
    blas = env["blas"]
    warnings = _print_blas_and_environment(bench, env, threadpools=True)
    if torch_version is not None:
        _print(f"PyTorch {torch_version}: timed directly as the baseline of 'vs pytorch' "
               f"(> 1: the backend is faster)")
    else:
        _print("PyTorch: " + ("not used (--no-torch)" if args.no_torch
                              else "not installed, no comparison"))
    if args.in_process:
        _print(f"engines: all timed in this process (--in-process), one after another on "
               f"each shape with a {args.settle:g} s pause between them (--settle)")
    else:
        _print("engines: each timed in a process of its own, one after another (PyTorch's "
               "loads no Numba; a backend's no PyTorch unless built on it); --in-process "
               "times them all in this one"
               + (f"; {rounds} rounds, the engines taking turns, each row from the round "
                  f"of its smallest median (--rounds)" if rounds > 1 else ""))
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
    progress.update(0, 0, "copy floors")
    copies = bench.copy_floors(shapes, ops, dtype=args.dtype, threads=args.threads,
                               repeat=repeat)
    progress.clear()
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

    processes: dict = {}  # engine -> what its own process loaded
    with limiter:
        if args.settle > 0:
            time.sleep(args.settle)  # BLAS's threads, busy with the peak, go idle first
        try:
            rows = bench.run_benchmarks(shapes, names, ops=ops, repeat=repeat,
                                        layout=layouts, dtype=args.dtype, torch=torch,
                                        skip_reference_on=skip_reference,
                                        settle=args.settle, peak_gflops=peak["gflops"],
                                        copies=copies, report=report,
                                        progress=progress.update,
                                        in_process=args.in_process, threads=threads,
                                        processes=processes, rounds=rounds)
            progress.update(0, 0, "dispatch overhead")
            overhead = bench.dispatch_overhead(dtype=args.dtype, layout=layouts[0],
                                               repeat=max(11, 2 * repeat + 1),
                                               settle=args.settle)
        finally:
            progress.clear()

    _print_copy_fractions(rows, threads)
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

    if processes:
        _print()
        _print("each engine's process loaded:")
        for engine, info in processes.items():
            _print(f"  {engine}: {_process_line(info)}")

    summary = bench.summarize(rows)
    _print()
    _print_summary(summary, peak, torch_version is not None)

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
                      repeat=repeat, row_warmup=bench.ROW_WARMUP, threads=threads,
                      dtype=args.dtype, layout=layout, layouts=list(layouts),
                      torch=torch_version, environment=env,
                      engines="in-process" if args.in_process else "processes",
                      rounds=rounds, groups=list(dict.fromkeys(args.group or ())) or None,
                      processes=processes or None,
                      blas=blas, warnings=warnings, plot=args.plot if plotted else None,
                      gemm_peak=peak, copies=[dict(shape=shape, op=op, **floor)
                                              for (shape, op), floor in copies.items()],
                      shapes=[_case_dict(c) for c in shapes],
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
    if given:
        _print(f"numbaconv bench: error: --device cuda does not take "
               f"{', '.join(_option(n) for n in given)}", file=sys.stderr)
        return USAGE_ERROR
    # The conv rows, then the recurrent rows; --suite picks one, and --op (conv ops) the first.
    suites = (args.suite,) if args.suite else ("conv",) if args.op else ("conv", "rnn")
    conv_only = [_option(n) for n in ("op", "layout") if _given(getattr(args, n))]
    if suites == ("rnn",) and conv_only:
        _print(f"numbaconv bench: error: {', '.join(conv_only)} "
               f"{'applies' if len(conv_only) == 1 else 'apply'} to the conv rows, not to "
               f"--suite rnn", file=sys.stderr)
        return USAGE_ERROR
    ops = tuple(dict.fromkeys(args.op)) if args.op else bench_cuda.OPS
    wrong = [op for op in ops if op not in bench_cuda.ALL_OPS]
    if wrong or args.dtype != "float32":
        what = f"--op {', '.join(wrong)}" if wrong else f"--dtype {args.dtype}"
        _print(f"numbaconv bench: error: --device cuda times float32 "
               f"{', '.join(bench_cuda.ALL_OPS)} only, not {what}", file=sys.stderr)
        return USAGE_ERROR
    for name in ("tolerance", "budget", "time_limit"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            _print(f"numbaconv bench: error: {_option(name)}: expected a positive number, got "
                   f"{value}", file=sys.stderr)
            return USAGE_ERROR
    sim = bool(args.sim) or bench_cuda.simulator_requested()
    selectors = dict(conv=bench_cuda.select_cases, rnn=bench_cuda.select_rnn_cases)
    cases, rnn_cases = (selectors[suite](sim=sim, quick=args.quick, patterns=args.case or ())
                        if suite in suites else () for suite in ("conv", "rnn"))
    if not cases and not rnn_cases:
        names = [c.name for suite in suites
                 for c in selectors[suite](sim=sim, quick=args.quick)]
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
    ours_tf32 = cuda_tf32()
    tolerance = args.tolerance or (bench_cuda.TF32_TOLERANCE if ours_tf32
                                   else bench_cuda.DEFAULT_TOLERANCE)
    rnn_tolerance = args.tolerance or (bench_cuda.TF32_TOLERANCE if ours_tf32
                                       else bench_cuda.DEFAULT_RNN_TOLERANCE)
    flush = not (args.no_flush or sim)
    if sim:  # one wall-clock call per timing
        warmup, reps, budget = 0, 1, None
    settings = dict(sim=sim, quick=args.quick, suites=list(suites),
                    ops=list(ops) if cases else [], layouts=list(layouts) if cases else [],
                    tolerance=tolerance,
                    rnn_tolerance=rnn_tolerance, warmup=warmup, reps=reps, budget_s=budget,
                    flush_bytes=bench_cuda.FLUSH_BYTES if flush else 0,
                    tf32=not args.no_tf32, numbaconv_tf32=ours_tf32,
                    time_limit_s=args.time_limit,
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
    _print("checked first against PyTorch in IEEE float32 (TF32 off): relative error (max "
           "abs error / max abs reference) <= "
           + (f"{tolerance:g}" if not rnn_cases else f"{rnn_tolerance:g}" if not cases
              else f"{tolerance:g} (conv), {rnn_tolerance:g} (rnn)")
           + ", else the row fails and is not timed; 'ieee/ours' and 'tf32/ours' are "
           "PyTorch's time over numbaconv's (> 1: numbaconv is faster)"
           + ("; TFLOP/s counts 2*N*K*(C/groups)*R*S*P*Q per op" if cases else "")
           + (" (conv_backward_bias: N*K*P*Q, one add a dy element)"
              if cases and "conv_backward_bias" in ops else ""))
    if ours_tf32:
        _print("NUMBACONV_CUDA_TF32=1: numbaconv's float32 products run on TF32 tensor cores "
               "(10-bit mantissas), hence the looser tolerance; compare its times with "
               "'tf32/ours'")
    if rnn_cases:
        _print(f"{bench_cuda.RNN_OP}: rnn_forward(training=True, reserve=preallocated) + "
               f"rnn_backward_data + rnn_backward_weights(out=) on device arrays, checked on "
               f"y, dx and the weight gradients against torch.nn.LSTM/GRU with the same "
               f"weights (forward + autograd backward: cuDNN on a GPU), then timed against it;"
               f" TFLOP/s counts the step's matrix products (3x the forward's)")
    if registered:
        _print(f"note: {registered}")
    if stream_problem:
        _print(f"WARNING: {stream_problem}; the times may be wrong")
    _print()
    widths = bench_cuda.column_widths(
        tuple(cases) + tuple(rnn_cases),
        (layouts if cases else ()) + ((bench_cuda.RNN_LAYOUT,) if rnn_cases else ()),
        (ops if cases else ()) + ((bench_cuda.RNN_OP,) if rnn_cases else ()))
    for line in bench_cuda.format_header(widths):
        _print(line)

    rows = []

    def save(finished):
        if args.json:
            bench_cuda.write_json(args.json, environment=env, settings=settings, cases=cases,
                                  rnn_cases=rnn_cases, rows=rows, finished=finished)

    def report(row):
        rows.append(row)
        _print(bench_cuda.format_row(row, widths))
        save(False)

    def progress(text):
        _print(text, file=sys.stderr)

    timer = bench_cuda.Timer(sim=sim, warmup=warmup, reps=reps,
                             budget=budget or bench_cuda.DEFAULT_BUDGET, flush=flush)
    common = dict(sim=sim, timer=timer, tf32=not args.no_tf32, time_limit=args.time_limit,
                  started=time.perf_counter(), report=report,
                  progress=progress if args.progress is not False else None)
    if cases:
        bench_cuda.run_rows(cases, ops=ops, layouts=layouts, tolerance=tolerance, **common)
    if rnn_cases:
        bench_cuda.run_rnn_rows(rnn_cases, tolerance=rnn_tolerance, **common)
    _print()
    for line in bench_cuda.summary_lines(rows):
        _print(line)
    if rnn_cases:
        _print(f"recurrent products (numbaconv's cuda backend): {bench_cuda.product_path()}")
    if sim:
        _print("(simulator: the times mean nothing)")
    save(True)
    if args.json:
        _print(f"results written to {args.json}")
    return 1 if any(r.status in ("FAIL", "error") for r in rows) else 0


def _process_line(info: dict) -> str:
    """What an engine's process reported (:func:`numbaconv.bench.run_benchmarks`'s
    ``processes``): the libraries it imported, their threads, its BLAS and OpenMP."""
    if "modules" not in info:
        return f"unknown, the process failed: {_one_line(info.get('error', ''), 100)}"
    threads = info.get("threads") or {}
    parts = [f"{name} ({threads[name]} threads)" if name in threads else name
             for name, loaded in info["modules"].items() if loaded]
    parts += [f"no {name}" for name, loaded in info["modules"].items() if not loaded]
    pools = info.get("threadpools")
    if pools is not None:
        parts.append("thread pools: " + (", ".join(
            f"{p.get('internal_api')} ({os.path.basename(p.get('filepath', ''))})"
            for p in pools) or "none"))
    return "; ".join(parts)


def _percent(fraction) -> str:
    if fraction is None:
        return "-"
    return f"{fraction * 100:.1f}%" if fraction < 0.1 else f"{fraction * 100:.0f}%"


def _print_copy_fractions(rows: list, threads) -> None:
    """The memory-bound rows (those with a copy fraction) as bandwidth: the bytes each op
    must move, its GB/s, a copy's GB/s at that size, and the fraction."""
    from numbaconv import bench
    bound = [r for r in rows if r.copy_fraction is not None]
    if not bound:
        return
    _print()
    _print(f"memory-bound rows ({', '.join(bench.MEMORY_BOUND_GROUPS)}): the bytes each op "
           f"must move (operands read once, result written once), its rate, and the "
           f"fraction of a parallel copy's rate at that size ({threads} thread(s), best of "
           f"its samples, this run):")
    table = []
    for r in bound:
        rate = r.traffic_bytes / r.median_s / 1e9
        table.append((r.shape, r.layout, r.op, r.backend, f"{r.traffic_bytes / 1e6:.1f} MB",
                      f"{rate:.1f}", f"{rate / r.copy_fraction:.1f}",
                      _percent(r.copy_fraction)))
    for line in _table(("shape", "layout", "op", "backend", "moves", "GB/s", "copy GB/s",
                        "of copy"), table, (4, 5, 6, 7)):
        _print(f"  {line}")


def _print_summary(summary: list, peak: dict, compared: bool) -> None:
    """The per-group table of :func:`numbaconv.bench.summarize`, with the targets' verdicts."""

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
    ops = list(args.op or _conv_ops())
    if not args.op:  # and the five ops one after another, as a training step runs them
        ops.append(bench.TRAINING_STEP)
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
           "numbaconv does not load Numba). 'training step': the five ops one after "
           "another in the same interpreters.")
    _print()
    headers = ("backend", "layout", "op", "algorithm", "cold", "cached", "Numba import",
               "2nd call", "kernels", "from cache")
    def label(op):
        return "training step" if op == bench.TRAINING_STEP else op

    widths = [max([len(h)] + [len(v) for v in values]) for h, values in zip(
        headers, (backends, layouts, [label(op) for op in ops], ("im2col",), (), (), (), (),
                  (), ()))]
    widths = [max(w, 10) if i in (4, 5, 6, 7) else w for i, w in enumerate(widths)]

    def fmt(values):
        return "  ".join(str(v).rjust(w) if i >= 4 else str(v).ljust(w)
                         for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    _print(fmt(headers))
    _print(fmt(["-" * w for w in widths]))
    results = []
    progress = _Progress(sys.stderr.isatty() if args.progress is None else args.progress)
    for backend in backends:
        for layout in layouts:
            for op in ops:
                try:
                    r, = bench.first_call_latency(
                        [op], backend, layout=layout, dtype=args.dtype, threads=args.threads,
                        progress=lambda what: progress.update(
                            0, 0, f"{backend} {layout} {what.replace(op, label(op), 1)}"))
                finally:
                    progress.clear()
                results.append(r)
                cold, cached = r["cold"], r["cached"]
                failed = cold.get("error") or cached.get("error")
                if failed:
                    _print(fmt((backend, layout, label(op), "error", "", "", "", "", "", ""))
                           + f"  {_one_line(failed, 100)}")
                    continue
                algorithm = cold["algorithm"]
                if op == bench.TRAINING_STEP:
                    algorithm = f"({op.count('+') + 1} ops)"
                _print(fmt((backend, layout, label(op), algorithm,
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


def _case_dict(c) -> dict:
    return dict(name=c.name, group=getattr(c, "group", None), x_shape=c.x_shape,
                w_shape=c.w_shape, stride=c.stride, padding=c.padding, dilation=c.dilation,
                groups=c.groups, output_padding=c.output_padding)


def _json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)
