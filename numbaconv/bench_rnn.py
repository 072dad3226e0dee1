"""Recurrent-network benchmarks: a training step (training forward, backward data, backward
weights) timed side by side with PyTorch's ``nn.LSTM``/``nn.GRU``/``nn.RNN`` (forward plus
autograd backward), and the memory a steady training loop allocates per step.

Before a case is timed, each backend's training step is checked against PyTorch's on the
same weights and data (:func:`check_case`, in a process of its own): y, dx and the weight
gradients within :data:`numbaconv.bench_torch.RNN_TOLERANCE`, the bound the GPU benchmark
uses, else the backend's row is a failure and is not timed. Without PyTorch nothing is
checked (and nothing compared).

Used by ``numbaconv bench --suite rnn`` and the asv suite (``benchmarks/bench_rnn.py``).
"""

from __future__ import annotations

import dataclasses
import math
import tracemalloc
from typing import Optional, Sequence

import numpy as np

from .bench_cases import RNNCase
from .bench_process import ChildFailed, child_messages
from .bench_timing import geometric_mean, time_call
from .bench_torch import RNN_TOLERANCE, torch_rnn_module


#: The shapes of the RNN speed targets (issues: LSTM/GRU/RNN training at PyTorch's speed;
#: CPU speed, second round: its four LSTM cases are the first three and lstm_bi_T50_N16_128_L2).
RNN_SHAPES = (
    RNNCase("lstm_T50_N64_512", "lstm", 50, 64, 512, 512),
    RNNCase("lstm_T100_N32_256_L2", "lstm", 100, 32, 256, 256, num_layers=2),
    RNNCase("lstm_T35_N20_650_L2", "lstm", 35, 20, 650, 650, num_layers=2),
    RNNCase("lstm_bi_T50_N32_256", "lstm", 50, 32, 256, 256, bidirectional=True),
    RNNCase("lstm_bi_T50_N16_128_L2", "lstm", 50, 16, 128, 128, num_layers=2,
            bidirectional=True),
    RNNCase("lstm_proj_T50_N32_512_p256", "lstm", 50, 32, 512, 512, proj_size=256),
    RNNCase("gru_T50_N64_512", "gru", 50, 64, 512, 512),
    RNNCase("rnn_tanh_T50_N64_512", "rnn_tanh", 50, 64, 512, 512),
)

QUICK_RNN_SHAPES = (
    RNNCase("lstm_T10_N8_32", "lstm", 10, 8, 32, 32),
    RNNCase("gru_T10_N8_32_bi", "gru", 10, 8, 32, 32, bidirectional=True),
    RNNCase("lstm_proj_T10_N8_32_p16_L2", "lstm", 10, 8, 32, 32, num_layers=2, proj_size=16),
)


class TrainingStep:
    """A numbaconv training step on one case with a preallocated reserve and ``out=``:
    what a steady training loop runs (random data, fixed across calls)."""

    def __init__(self, case: RNNCase, backend: str = "cpu", dtype: str = "float32",
                 seed: int = 0):
        import numbaconv as nc
        self.nc, self.backend = nc, backend
        self.cfg = cfg = case.config()
        rng = np.random.default_rng(seed)
        d = cfg.num_directions
        self.x = rng.standard_normal((case.seq_len, case.batch, case.input_size)).astype(dtype)
        self.dy = rng.standard_normal((case.seq_len, case.batch, d * cfg.out_size)
                                      ).astype(dtype)
        self.params = nc.rnn_init_params(cfg, seed=seed, dtype=dtype)
        self.dparams = np.empty_like(self.params)
        self.reserve = np.empty(nc.rnn_reserve_size(cfg, case.seq_len, case.batch), dtype)

    def __call__(self) -> dict:
        """One step; returns ``{"y", "dx", "dparams"}`` (dparams is ``self.dparams``)."""
        nc = self.nc
        with nc.use_backend(self.backend):
            y, _, _, reserve = nc.rnn_forward(self.cfg, self.x, self.params, training=True,
                                              reserve=self.reserve)
            dx, _, _ = nc.rnn_backward_data(self.cfg, y, self.dy, self.params, reserve)
            nc.rnn_backward_weights(self.cfg, self.x, self.params, reserve, out=self.dparams)
        return dict(y=y, dx=dx, dparams=self.dparams)


def torch_training_step(case: RNNCase, torch, dtype: str = "float32", seed: int = 0):
    """PyTorch's forward plus autograd backward of the same network and gradients."""
    torch.manual_seed(seed)
    module = torch_rnn_module(case, torch, dtype)
    out_size = case.proj_size or case.hidden_size
    d = 2 if case.bidirectional else 1
    x = torch.randn(case.seq_len, case.batch, case.input_size, dtype=getattr(torch, dtype),
                    requires_grad=True)
    dy = torch.randn(case.seq_len, case.batch, d * out_size, dtype=getattr(torch, dtype))

    def step():
        module.zero_grad(set_to_none=False)
        x.grad = None
        y = module(x)[0]
        y.backward(dy)
    return step


def per_step_allocations(step, steps: int = 3) -> int:
    """Peak bytes traced by tracemalloc during one call of ``step`` (after warm-up calls):
    what a steady loop allocates per step (NumPy reports its buffers to tracemalloc)."""
    step()
    step()
    tracemalloc.start()
    try:
        peak = 0
        for _ in range(steps):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            step()
            peak = max(peak, tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
    return peak


def measure(case: RNNCase, engine: str, *, repeat: int = 5, dtype: str = "float32",
            threads: Optional[int] = None) -> dict:
    """Time one engine's training step on one case in this process: ``engine`` is a
    numbaconv backend name or ``"pytorch"``. Returns median seconds (and, for numbaconv,
    the reserve's size and the bytes one steady step allocates)."""
    if engine == "pytorch":  # Numba untouched: its started pool would spin against torch's
        import torch
        if threads:
            torch.set_num_threads(threads)
        step = torch_training_step(case, torch, dtype)
        return dict(median_s=time_call(step, repeat=repeat, warmup=2, number=1).median)
    import numba

    # Before set_num_threads starts Numba's OpenMP pool: its threads must be passive
    # (numbaconv.config), or they spin against BLAS's and a step takes 10 times longer.
    from .config import configure_threading
    configure_threading()
    if threads:
        numba.set_num_threads(threads)
    step = TrainingStep(case, engine, dtype)
    result = dict(median_s=time_call(step, repeat=repeat, warmup=2, number=1).median,
                  reserve_bytes=step.reserve.nbytes)
    result["alloc_bytes"] = per_step_allocations(step, steps=2)
    return result


def check_case(case: RNNCase, backends: Sequence[str] = ("cpu",), *,
               dtype: str = "float32", threads: Optional[int] = None,
               tolerance: float = RNN_TOLERANCE) -> dict:
    """Check each backend's training step on ``case`` against PyTorch's, in this process.

    The step is the one :func:`measure` times (:class:`TrainingStep`: the same seed, so the
    same weights, x and dy), run once; PyTorch's (:func:`numbaconv.bench_torch
    .torch_rnn_results`: forward plus autograd backward) runs on those weights
    (``load_rnn_params``) and arrays. Never call it in a process that times afterwards:
    PyTorch's thread pool would compete with the timed engine.

    Returns
    -------
    dict
        backend -> ``{"status", "errors", "worst", "detail"}``: status ``"ok"`` (every
        relative error max |ours - torch| / max |torch| of y, dx and dparams within
        ``tolerance``), ``"FAIL"`` (one above it, or NaN: ``worst`` names it) or
        ``"error"`` (the step raised: ``detail`` says what); ``errors`` maps y, dx and
        dparams to their relative errors (None with ``"error"``).
    """
    from . import bench_torch
    from .config import configure_threading
    configure_threading()  # passive Numba threads, as in measure(): they idle beside torch's
    if threads:
        import numba
        numba.set_num_threads(threads)
    step = TrainingStep(case, dtype=dtype)  # the arrays measure() times; one backend at a time
    ours = {}
    for name in backends:
        step.backend = name
        try:
            ours[name] = {k: np.array(v, copy=True) for k, v in step().items()}
        except Exception as exc:  # report the broken backend, check the others
            ours[name] = f"{type(exc).__name__}: {exc}"
    torch = bench_torch.import_torch()
    if torch is None:
        raise RuntimeError("the check against PyTorch needs PyTorch")
    if threads:
        torch.set_num_threads(threads)
    module = torch_rnn_module(case, torch, dtype)
    bench_torch.load_rnn_params(module, step.cfg, step.params)
    reference = bench_torch.torch_rnn_results(
        module, step.cfg, torch.from_numpy(step.x.copy()).requires_grad_(True),
        torch.from_numpy(step.dy))
    results = {}
    for name, got in ours.items():
        if isinstance(got, str):
            results[name] = dict(status="error", errors=None, worst=None,
                                 detail=" ".join(got.split())[:300])
            continue
        errors = bench_torch.rnn_step_errors(
            {k: torch.from_numpy(v) for k, v in got.items()}, reference)
        worst = bench_torch.worst_error(errors, tolerance)
        failed = not errors[worst] <= tolerance  # NaN fails too
        results[name] = dict(
            status="FAIL" if failed else "ok", errors=errors, worst=worst,
            detail=(f"relative error {errors[worst]:.2e} ({worst}) above the tolerance "
                    f"{tolerance:g}: not timed") if failed else "")
    return results


_CHILD = """
import json, sys
from numbaconv import bench_process, bench_rnn
spec = json.loads(sys.argv[1])
case = bench_rnn.RNNCase(**spec.pop("case"))
run = bench_rnn.check_case if spec.pop("check", False) else bench_rnn.measure
bench_process.print_message(run(case, **spec))
"""


def _run_child(spec: dict, what: str, timeout: float) -> dict:
    try:
        messages = list(child_messages(_CHILD, spec, timeout=timeout))
    except ChildFailed as exc:
        raise RuntimeError(f"{what} failed: {exc}") from None
    if not messages:
        raise RuntimeError(f"{what} failed: it printed no result")
    return messages[-1]


def measure_in_subprocess(case: RNNCase, engine: str, *, timeout: float = 900, **kwargs):
    """:func:`measure` in a fresh interpreter. Thread pools keep spinning after their work
    (PyTorch's OpenMP, NumPy's BLAS, Numba's OpenMP unless passive); in one process they
    steal the cores from the next engine (measured on 2 cores: 1.4 s per PyTorch LSTM step
    right after numbaconv's, 0.12 s alone; PyTorch's GRU 0.31 s with a started Numba pool
    beside it, 0.16 s without), so each engine runs alone, one after the other, in the
    same command."""
    spec = dict(case=dataclasses.asdict(case), engine=engine, **kwargs)
    return _run_child(spec, f"{engine} on {case.name}", timeout)


def check_in_subprocess(case: RNNCase, backends: Sequence[str], *, timeout: float = 900,
                        **kwargs) -> dict:
    """:func:`check_case` in a fresh interpreter, which exits before anything is timed (see
    :func:`measure_in_subprocess` for why: PyTorch and Numba both run there)."""
    spec = dict(case=dataclasses.asdict(case), backends=list(backends), check=True, **kwargs)
    return _run_child(spec, f"the check of {case.name}", timeout)


def run_rnn_benchmarks(cases: Sequence[RNNCase], *, backends: Sequence[str] = ("cpu",),
                       repeat: int = 5, torch: bool = True, dtype: str = "float32",
                       threads: Optional[int] = None, tolerance: float = RNN_TOLERANCE,
                       progress=None) -> list:
    """Check, then time, each case's training step with PyTorch (if ``torch``) and each
    backend, every engine in its own subprocess; rows of dicts, ratio = PyTorch time /
    backend time.

    With ``torch``, each case is first checked (:func:`check_in_subprocess`): a backend
    whose y, dx or weight gradients differ from PyTorch's by more than ``tolerance`` gets
    ``{name}_status = "FAIL"`` (``"error"`` if its step raised) and no time; the check's
    result is ``{name}_check`` either way, and ``{name}_status`` is ``"ok"`` once timed.
    PyTorch is timed only if some backend passed. Without ``torch``, nothing is checked:
    ``{name}_status`` is ``"unchecked"``."""
    rows = []
    for case in cases:
        row = dict(case=case.name, mode=case.mode, T=case.seq_len, N=case.batch,
                   input_size=case.input_size, hidden_size=case.hidden_size,
                   layers=case.num_layers, bidirectional=case.bidirectional,
                   proj_size=case.proj_size, gflop=case.flops() / 1e9)
        options = dict(repeat=repeat, dtype=dtype, threads=threads)
        timed = list(backends)
        if torch:
            if progress:
                progress(f"{case.name}: checking against pytorch")
            checks = check_in_subprocess(case, backends, dtype=dtype, threads=threads,
                                         tolerance=tolerance)
            for name in backends:
                row[f"{name}_check"] = checks[name]
                row[f"{name}_status"] = checks[name]["status"]
            timed = [name for name in backends if checks[name]["status"] == "ok"]
            if timed:
                if progress:
                    progress(f"{case.name}: pytorch")
                row["pytorch_s"] = measure_in_subprocess(case, "pytorch", **options)["median_s"]
        for name in timed:
            if progress:
                progress(f"{case.name}: {name}")
            result = measure_in_subprocess(case, name, **options)
            row[f"{name}_status"] = "ok" if torch else "unchecked"
            row[f"{name}_s"] = result["median_s"]
            row[f"{name}_gflops"] = case.flops() / result["median_s"] / 1e9
            row[f"{name}_reserve_bytes"] = result["reserve_bytes"]
            row[f"{name}_alloc_bytes"] = result["alloc_bytes"]
            if torch:
                row[f"{name}_ratio"] = row["pytorch_s"] / result["median_s"]
        rows.append(row)
    return rows


def failed_checks(rows: Sequence[dict], backends: Sequence[str] = ("cpu",)) -> list:
    """``(case, backend, detail)`` of each backend whose check failed (or raised)."""
    return [(row["case"], name, row[f"{name}_check"]["detail"]) for row in rows
            for name in backends if row.get(f"{name}_status") in ("FAIL", "error")]


def format_rnn_table(rows: Sequence[dict], backends: Sequence[str] = ("cpu",)) -> str:
    """A plain-text table of the rows and the geometric mean of each ratio. 'max err' is a
    backend's largest relative error in the check ('-' unchecked); a backend that failed
    it shows FAIL (or ERROR) and, after the line, why."""
    lines = []
    head = f"{'case':28s} {'GFLOP':>6s} {'torch ms':>9s}"
    for name in backends:
        head += (f" {name + ' ms':>9s} {'GF/s':>6s} {'ratio':>6s} {'max err':>7s}"
                 f" {'reserve':>8s} {'alloc':>8s}")
    lines.append(head)
    for row in rows:
        torch_ms = row.get("pytorch_s")
        line = f"{row['case']:28s} {row['gflop']:6.2f} " + (
            f"{torch_ms * 1e3:9.2f}" if torch_ms else f"{'-':>9s}")
        why = []
        for name in backends:
            check = row.get(f"{name}_check")
            err = (f"{check['errors'][check['worst']]:7.1e}"
                   if check and check.get("errors") else f"{'-':>7s}")
            if f"{name}_s" not in row:  # not timed: the check failed
                status = row.get(f"{name}_status", "error")
                line += (f" {'ERROR' if status == 'error' else status:>9s} {'-':>6s} "
                         f"{'-':>6s} {err} {'-':>8s} {'-':>8s}")
                why.append(f"{name}: {check['detail'] if check else status}")
                continue
            ratio = row.get(f"{name}_ratio")
            line += (f" {row[f'{name}_s'] * 1e3:9.2f} {row[f'{name}_gflops']:6.1f} "
                     + (f"{ratio:6.2f}" if ratio else f"{'-':>6s}") + f" {err}"
                     + f" {_mib(row[f'{name}_reserve_bytes']):>8s}"
                     + f" {_mib(row[f'{name}_alloc_bytes']):>8s}")
        lines.append(line + "".join(f"  {text}" for text in why))
    for name in backends:
        mean: Optional[float] = geometric_mean(
            r[f"{name}_ratio"] for r in rows if r.get(f"{name}_ratio"))
        failed = sum(r.get(f"{name}_status") in ("FAIL", "error") for r in rows)
        if mean is not None:
            lines.append(f"geometric mean of torch/{name}: {mean:.2f} (target >= 1.0)"
                         + (f"; {failed} failed case(s) left out" if failed else ""))
    lines.append("max err: the largest relative error of y, dx and the weight gradients "
                 "against PyTorch, checked before timing; reserve: the preallocated reserve; "
                 "alloc: peak bytes allocated within one steady training step (y, dx, "
                 "temporaries)")
    return "\n".join(lines)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}M" if nbytes >= 2**20 else f"{math.ceil(nbytes / 1024)}K"
