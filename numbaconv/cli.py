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
import os
import sys
import time
from typing import Optional, Sequence

from ._cli_output import (OPENBLAS_TUNING_VARS, USAGE_ERROR, _conv_ops, _one_line,
                          _openblas_warnings, _print, _Progress, _table, _wrapped_table)
from .cli_bench import CPU_BENCH_OPTIONS, CUDA_BENCH_OPTIONS, cmd_bench

# The bench command lives in cli_bench, what the commands share in _cli_output.
__all__ = ["main", "build_parser", "cmd_info", "cmd_check", "cmd_bench", "cmd_demo",
           "cmd_warmup", "cuda_status", "QUICK_CHECK_CASES", "USAGE_ERROR",
           "OPENBLAS_TUNING_VARS", "CPU_BENCH_OPTIONS", "CUDA_BENCH_OPTIONS"]

#: Cases of ``numbaconv.testing.CASES`` that ``check --quick`` runs: every dimensionality and
#: the features most likely to go wrong (stride, dilation, groups, depthwise, "same" and
#: asymmetric padding, output_padding of the transposed convolution).
QUICK_CHECK_CASES = ("1d_stride_dilation_groups", "2d_pad1", "2d_stride2", "2d_asymmetric",
                     "2d_same_stride2", "2d_depthwise", "3d_everything")


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


def _rnn_products() -> str:
    """What the cuda backend's recurrent ops multiply with (cuBLAS or the Numba kernel), as
    the backend says without loading anything; never raises."""
    try:
        from numbaconv import dispatch
        describe = getattr(dispatch.get_backend("cuda"), "product_path", None)
        return describe() if describe is not None else "not reported by this cuda backend"
    except Exception as exc:
        return f"unknown ({type(exc).__name__}: {_one_line(exc)})"


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

    from numbaconv import config
    config.configure_threading()        # fits Numba's thread count to the usable CPUs
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
    _print(f"  threads       NUMBA_NUM_THREADS = {config.thread_decision}")
    title = "BLAS and OpenMP (threadpoolctl)" if env["threadpoolctl"] else "BLAS"
    _print(title)
    for line in bench.describe_threadpools(env["threadpools"]):
        _print(f"  {line}")
    set_vars = {k: v for k, v in env["env"].items() if v is not None}
    for text in _openblas_warnings(bench, set_vars, env["blas"]):
        _print(f"  WARNING: {text}")
    _print("environment")
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
    _print(f"  RNN products  {_rnn_products()}")
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
    from numbaconv.config import available_cpus, describe_kernel_cache
    jobs = args.jobs if args.jobs is not None else available_cpus()[0]
    _print(f"compiling the cpu kernels of {len(combos)} op/dtype/layout/layer "
           f"combination(s), every algorithm each, in up to {jobs} process(es); kernels "
           f"cache in {describe_kernel_cache()}")
    progress = _Progress(sys.stderr.isatty() if args.progress is None else args.progress)
    try:
        report = _warmup.warmup(args.op, dtypes=args.dtype, layouts=args.layout,
                                ndims=args.ndim, layers=args.layer, jobs=jobs,
                                progress=progress.update)
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
                    "(ResNet 3x3, 1x1, depthwise 3x3, 7x7 stride-2 stem, 1D, 3D and the "
                    "layers of small networks: CIFAR's ResNet-20, an MNIST CNN) for "
                    "each available CPU backend, and PyTorch directly when it is installed, "
                    "in both layouts, each engine (PyTorch, each backend) timed in a fresh "
                    "process of its own, as its users' programs run it (--in-process: all "
                    "in one), "
                    "printing median time, GFLOP/s, the fraction of the machine's GEMM peak "
                    "(np.matmul, measured in the same run) and PyTorch's time over the "
                    "backend's. Then the dispatch overhead of a tiny call, and a summary per "
                    "group of shapes (resnet3x3, pointwise, depthwise, stem, conv1d, conv3d, "
                    "small): geometric means of the ratio, judged against the targets for the "
                    "data and weight gradients (small has none yet). The header records "
                    "NumPy's BLAS and the kernel it "
                    "runs (threadpoolctl) and warns when OPENBLAS_CORETYPE forces an older "
                    "kernel than OpenBLAS would pick. With --first-call, instead: each op's "
                    "first-call latency (JIT compilation) in fresh processes, cold and from "
                    "Numba's disk cache.")
    p.add_argument("--suite", choices=("conv", "rnn"),
                   help="conv (default on the CPU): the convolution ops; rnn: an "
                        "RNN/LSTM/GRU training step (training forward, backward data, "
                        "backward weights with a preallocated reserve) against PyTorch's "
                        "forward plus autograd backward, each engine in its own process, "
                        "with the bytes one steady step allocates, each case checked "
                        "first against PyTorch (y, dx, weight gradients; a FAIL is not "
                        "timed, exit 1); honours --quick, --repeat, "
                        "--backend, --dtype, --threads, --no-torch, --json. With --device "
                        "cuda, which runs both (the conv rows, then the recurrent rows): only "
                        "that one")
    p.add_argument("--quick", action="store_true",
                   help="small shapes and few repeats (seconds; the reference included)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default): the CPU backends, as described above; cuda: "
                        "numbaconv's cuda backend against PyTorch (cuDNN) on one GPU, "
                        "float32 conv and both gradients on ResNet 3x3 (stride 1 and 2), 1x1 "
                        "and depthwise layers at N=32, then a training step of an LSTM and a "
                        "GRU (T=50, N=64, I=H=512) and a 2-layer bidirectional LSTM, each "
                        "result checked against PyTorch in IEEE float32 before it is timed "
                        "with CUDA events, PyTorch timed in IEEE float32 and with TF32 "
                        "(docs/gpu-benchmark.md); honours --suite, --quick, --op and "
                        "--layout (the conv rows; --op: only those), --repeat, --json, "
                        "--progress")
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
    p.add_argument("--group", action="append", metavar="GROUP",
                   help="time only this group of shapes (repeatable): resnet3x3, pointwise, "
                        "depthwise, stem, conv1d, conv3d or small; the convolutions on the "
                        "CPU")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--layout", choices=("channels_first", "channels_last", "both"),
                   help="layout(s) to time (default: both; channels_first with --quick or "
                        "--first-call)")
    p.add_argument("--threads", type=_positive_int, metavar="N",
                   help="threads for Numba, BLAS and PyTorch (default NUMBA_NUM_THREADS)")
    p.add_argument("--no-torch", action="store_true",
                   help="do not time PyTorch (nor, with --suite rnn, check against it)")
    p.add_argument("--in-process", action="store_true",
                   help="time every engine in this one process, block by block, instead of "
                        "each in a process of its own: PyTorch's and Numba's OpenMP "
                        "runtimes then share it (and the cores), which changes the times of "
                        "short calls")
    p.add_argument("--rounds", type=_positive_int, metavar="N",
                   help="time each engine's process N times, the engines taking turns, and "
                        "keep each row's round of smallest median (default 1): on a host "
                        "whose speed drifts from minute to minute, each engine's best "
                        "round is compared; the convolutions' engines in their own "
                        "processes only")
    p.add_argument("--settle", type=float, default=_default_settle(), metavar="SECONDS",
                   help="pause between engines so idle thread pools stop spinning: with "
                        "--in-process, and after the GEMM peak (default %(default)s)")
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
                           "that passes (default 2e-4 for the conv rows, 5e-4 for the "
                           "recurrent rows)")
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
                   help="typical layer (repeatable): 3x3, 3x3s2, 3x3deep (ResNet's last "
                        "stage), 1x1, 1x1s2, depthwise, stem (7x7 stride 2) or all; default "
                        "3x3, 3x3s2, 3x3deep, 1x1, 1x1s2")
    p.add_argument("--jobs", "-j", type=_positive_int, metavar="N",
                   help="compile in up to N processes at once (default: the CPUs this "
                        "process may use; 1: in this process alone)")
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
