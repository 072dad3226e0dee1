"""Recurrent-network benchmarks: a training step (training forward, backward data, backward
weights) timed side by side with PyTorch's ``nn.LSTM``/``nn.GRU``/``nn.RNN`` (forward plus
autograd backward), and the memory a steady training loop allocates per step.

Used by ``numbaconv bench --suite rnn`` and the asv suite (``benchmarks/bench_rnn.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import tracemalloc
from typing import Optional, Sequence

import numpy as np

from .bench_cases import RNNCase
from .bench_timing import geometric_mean, time_call
from .bench_torch import torch_rnn_module


#: The shapes of the RNN speed target (issue: LSTM/GRU/RNN training at PyTorch's speed).
RNN_SHAPES = (
    RNNCase("lstm_T50_N64_512", "lstm", 50, 64, 512, 512),
    RNNCase("lstm_T100_N32_256_L2", "lstm", 100, 32, 256, 256, num_layers=2),
    RNNCase("lstm_T35_N20_650_L2", "lstm", 35, 20, 650, 650, num_layers=2),
    RNNCase("lstm_bi_T50_N32_256", "lstm", 50, 32, 256, 256, bidirectional=True),
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

    def __call__(self):
        nc = self.nc
        with nc.use_backend(self.backend):
            y, _, _, reserve = nc.rnn_forward(self.cfg, self.x, self.params, training=True,
                                              reserve=self.reserve)
            nc.rnn_backward_data(self.cfg, y, self.dy, self.params, reserve)
            nc.rnn_backward_weights(self.cfg, self.x, self.params, reserve, out=self.dparams)


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


_CHILD = """
import json, sys
from numbaconv import bench_rnn
spec = json.loads(sys.argv[1])
case = bench_rnn.RNNCase(**spec.pop("case"))
print(json.dumps(bench_rnn.measure(case, **spec)))
"""


def measure_in_subprocess(case: RNNCase, engine: str, *, timeout: float = 900, **kwargs):
    """:func:`measure` in a fresh interpreter. Thread pools keep spinning after their work
    (PyTorch's OpenMP, NumPy's BLAS, Numba's OpenMP unless passive); in one process they
    steal the cores from the next engine (measured on 2 cores: 1.4 s per PyTorch LSTM step
    right after numbaconv's, 0.12 s alone; PyTorch's GRU 0.31 s with a started Numba pool
    beside it, 0.16 s without), so each engine runs alone, one after the other, in the
    same command."""
    spec = dict(case=dataclasses.asdict(case), engine=engine, **kwargs)
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} on {case.name} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_rnn_benchmarks(cases: Sequence[RNNCase], *, backends: Sequence[str] = ("cpu",),
                       repeat: int = 5, torch: bool = True, dtype: str = "float32",
                       threads: Optional[int] = None, progress=None) -> list:
    """Time each case's training step with PyTorch (if ``torch``) and each backend, every
    engine in its own subprocess; rows of dicts, ratio = PyTorch time / backend time."""
    rows = []
    for case in cases:
        row = dict(case=case.name, mode=case.mode, T=case.seq_len, N=case.batch,
                   input_size=case.input_size, hidden_size=case.hidden_size,
                   layers=case.num_layers, bidirectional=case.bidirectional,
                   proj_size=case.proj_size, gflop=case.flops() / 1e9)
        options = dict(repeat=repeat, dtype=dtype, threads=threads)
        if torch:
            if progress:
                progress(f"{case.name}: pytorch")
            row["pytorch_s"] = measure_in_subprocess(case, "pytorch", **options)["median_s"]
        for name in backends:
            if progress:
                progress(f"{case.name}: {name}")
            result = measure_in_subprocess(case, name, **options)
            row[f"{name}_s"] = result["median_s"]
            row[f"{name}_gflops"] = case.flops() / result["median_s"] / 1e9
            row[f"{name}_reserve_bytes"] = result["reserve_bytes"]
            row[f"{name}_alloc_bytes"] = result["alloc_bytes"]
            if torch:
                row[f"{name}_ratio"] = row["pytorch_s"] / result["median_s"]
        rows.append(row)
    return rows


def format_rnn_table(rows: Sequence[dict], backends: Sequence[str] = ("cpu",)) -> str:
    """A plain-text table of the rows and the geometric mean of each ratio."""
    lines = []
    head = f"{'case':28s} {'GFLOP':>6s} {'torch ms':>9s}"
    for name in backends:
        head += f" {name + ' ms':>9s} {'GF/s':>6s} {'ratio':>6s} {'reserve':>8s} {'alloc':>8s}"
    lines.append(head)
    for row in rows:
        torch_ms = row.get("pytorch_s")
        line = f"{row['case']:28s} {row['gflop']:6.2f} " + (
            f"{torch_ms * 1e3:9.2f}" if torch_ms else f"{'-':>9s}")
        for name in backends:
            ratio = row.get(f"{name}_ratio")
            line += (f" {row[f'{name}_s'] * 1e3:9.2f} {row[f'{name}_gflops']:6.1f} "
                     + (f"{ratio:6.2f}" if ratio else f"{'-':>6s}")
                     + f" {_mib(row[f'{name}_reserve_bytes']):>8s}"
                     + f" {_mib(row[f'{name}_alloc_bytes']):>8s}")
        lines.append(line)
    for name in backends:
        mean: Optional[float] = geometric_mean(
            r[f"{name}_ratio"] for r in rows if r.get(f"{name}_ratio"))
        if mean is not None:
            lines.append(f"geometric mean of torch/{name}: {mean:.2f} (target >= 1.0)")
    lines.append("reserve: the preallocated reserve; alloc: peak bytes allocated within one "
                 "steady training step (y, dx, temporaries)")
    return "\n".join(lines)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}M" if nbytes >= 2**20 else f"{math.ceil(nbytes / 1024)}K"
