"""Host time of the cuda backend's calls with and without its short launch path.

Each setting of ``NUMBACONV_CUDA_SHORT_LAUNCH`` (``0``: every kernel through Numba's
``kernel[grid, block]``; ``1``: numbaconv/cuda/_launch.py) runs in its own process, on the
GPU benchmark's cases (numbaconv.bench_cuda: the convolution ops and the bias gradient in
both layouts, and the recurrent training step). Per case and op, after warm-up calls:

- ``issue us``: host time per call while issuing ``--reps`` calls back to back without
  waiting for the GPU (the median of 5 such rounds), what a host-bound call costs;
- ``call us``: the median of ``--reps`` calls each followed by a synchronize.

The parent process then checks that both settings gave the same bits (the same kernels on
the same arguments) and prints the two side by side. From the repository root, on a machine
with a GPU::

    PYTHONPATH=. python3 docs/benchmarks/gpu_host_time.py --reps 50

``--sim`` runs the simulator's tiny twins (the bit check and the plumbing only; the times
mean nothing there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def measure(args) -> dict:
    """This process's figures: {row: {"issue_us", "call_us"}}, results saved to args.save."""
    from numbaconv import bench_cuda as b
    if args.sim:
        b.enable_simulator()
    b.ensure_cuda_backend()
    import numpy as np
    from numba import cuda

    import numbaconv

    reps = 1 if args.sim else args.reps
    figures, results = {}, {}

    def timed(name, fn):
        for _ in range(1 if args.sim else 5):  # warm-up: compile, load, plan
            out = fn()
        cuda.synchronize()
        rounds = []
        for _ in range(1 if args.sim else 5):
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            rounds.append((time.perf_counter() - start) / reps)
            cuda.synchronize()
        calls = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            cuda.synchronize()
            calls.append(time.perf_counter() - start)
        figures[name] = dict(issue_us=1e6 * statistics.median(rounds),
                             call_us=1e6 * statistics.median(calls))
        for key, value in (out.items() if isinstance(out, dict) else [("out", out)]):
            results[f"{name} {key}"] = value.copy_to_host()

    with numbaconv.use_backend("cuda"):
        for case in b.select_cases(sim=args.sim, patterns=args.case):
            for layout in ("channels_first", "channels_last"):
                operands = b.Operands(case, layout, sim=args.sim)
                for op in b.ALL_OPS:
                    timed(f"{case.name} {layout} {op}",
                          lambda: b.numbaconv_call(op, operands))
        for case in b.select_rnn_cases(sim=args.sim, patterns=args.case):
            operands = b.RNNOperands(case, sim=args.sim)
            timed(f"{case.name} step", lambda: b.numbaconv_rnn_step(operands))
    np.savez(args.save, **results)
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sim", action="store_true", help="tiny twins under the simulator")
    parser.add_argument("--reps", type=int, default=50, help="calls per round")
    parser.add_argument("--case", action="append", default=[], help="only cases naming this")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return 0

    import numpy as np
    figures, saved = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for setting in ("0", "1"):
            saved[setting] = os.path.join(tmp, f"short{setting}.npz")
            command = [sys.executable, __file__, "--child", "1", "--save", saved[setting],
                       "--reps", str(args.reps)] + (["--sim"] if args.sim else [])
            for pattern in args.case:
                command += ["--case", pattern]
            env = dict(os.environ, NUMBACONV_CUDA_SHORT_LAUNCH=setting)
            done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            figures[setting] = json.loads(done.stdout.strip().splitlines()[-1])
        with np.load(saved["0"]) as numba_path, np.load(saved["1"]) as short_path:
            differing = [k for k in numba_path.files
                         if not np.array_equal(numba_path[k], short_path[k])]
    print(f"{'row':52s} {'issue us (Numba / short)':>25s} {'call us (Numba / short)':>24s}")
    for row, before in figures["0"].items():
        after = figures["1"][row]
        print(f"{row:52s} {before['issue_us']:11.1f} / {after['issue_us']:9.1f}   "
              f"{before['call_us']:10.1f} / {after['call_us']:9.1f}")
    print("results: " + ("the same bits in both settings" if not differing else
                         f"DIFFERENT in {len(differing)}: {', '.join(differing[:6])}"))
    if args.sim:
        print("(simulator: the times mean nothing)")
    return 1 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
