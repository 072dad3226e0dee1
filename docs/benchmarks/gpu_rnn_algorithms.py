"""The cuda backend's two algorithms for ``rnn_forward`` and ``rnn_backward_data`` on the GPU
benchmark's recurrent cases and an LSTM with projection (:data:`PROJECTED`, whose
persistent loops have two grid barriers a step).

``fused`` (the default) issues a cuBLAS product and a kernel per step; ``persistent`` runs
every step of a layer and direction in one cooperative launch. For each case: one training
step on each (warm-up and compilation), their outputs compared (y, dx, the weight
gradients: the largest relative difference; the two sum the recurrent products in
different orders on cuBLAS, so differences near 1e-6 are expected, not more), then the
median over ``--reps`` of the forward alone and of the whole training step, each timed on
the host around a synchronised call (the step loops are host-bound: docs/cuda.md, "Host
time of a step").

On a machine with a GPU, from the repository root::

    PYTHONPATH=. python3 docs/benchmarks/gpu_rnn_algorithms.py --reps 20

``--sim`` runs the tiny twins under Numba's CUDA simulator: the comparison only (the
times mean nothing there).
"""

from __future__ import annotations

import argparse
import statistics
import time


def projected_cases(sim: bool) -> tuple:
    """The LSTM with projection this script adds to the benchmark's cases (the simulator's
    tiny twin with ``sim``)."""
    from numbaconv.bench_cases import RNNCase
    if sim:
        return (RNNCase("lstm_proj_T3_N2_4_5_p3", "lstm", 3, 2, 4, 5, proj_size=3),)
    return (RNNCase("lstm_proj_T50_N64_512_p256", "lstm", 50, 64, 512, 512, proj_size=256),)


def splits(case) -> str:
    """How the persistent loops split each step's recurrent product in ``case``
    (forward/data gradient; ``-`` for the projected loops, which do not split)."""
    from numbaconv.config import cuda_tile
    from numbaconv.cuda._rnn_kernels import GATES, reduction_split
    cfg = case.config()
    if cfg.proj_size:
        return "-"
    h = cfg.hidden_size
    return "/".join(str(reduction_split(name, cfg.mode, cuda_tile(), case.batch, h, k)[0])
                    for name, k in (("forward_sequence", h),
                                    ("backward_sequence", GATES[cfg.mode] * h)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sim", action="store_true", help="tiny twins under the simulator")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per median")
    parser.add_argument("--case", action="append", default=[], help="only cases naming this")
    args = parser.parse_args(argv)

    from numbaconv import bench_cuda as b
    if args.sim or b.simulator_requested():
        args.sim = True
        b.enable_simulator()
    b.ensure_cuda_backend()
    import numpy as np
    from numba import cuda

    import numbaconv
    from numbaconv.cuda import CudaBackend
    from numbaconv.testing import algorithm_forced

    def median_ms(fn):
        times = []
        for _ in range(1 if args.sim else args.reps):
            cuda.synchronize()
            start = time.perf_counter()
            fn()
            cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)

    print(f"{'case':24s} {'algorithm':10s} {'forward ms':>10s} {'step ms':>9s} "
          f"{'max rel diff':>12s}  splits (forward/data gradient)")
    cases = b.select_rnn_cases(sim=args.sim, patterns=args.case) + tuple(
        c for c in projected_cases(args.sim)
        if not args.case or any(p in c.name for p in args.case))
    for case in cases:
        operands = b.RNNOperands(case, sim=args.sim)
        a = operands.arrays

        def forward():
            numbaconv.rnn_forward(operands.config, a["x"], a["params"], training=True,
                                  reserve=operands.reserve)

        results = {}
        for algorithm in ("fused", "persistent"):
            with numbaconv.use_backend("cuda"), algorithm_forced(
                    CudaBackend, ("rnn_forward", "rnn_backward_data"), algorithm, strict=True):
                step = b.numbaconv_rnn_step(operands)
                results[algorithm] = {k: v.copy_to_host() for k, v in step.items()}
                forward_ms = median_ms(forward)
                step_ms = median_ms(lambda: b.numbaconv_rnn_step(operands))
            diff = max(float(np.max(np.abs(results[algorithm][k] - results["fused"][k]))
                             / max(float(np.max(np.abs(results["fused"][k]))), 1e-30))
                       for k in results["fused"])
            print(f"{case.name:24s} {algorithm:10s} {forward_ms:10.3f} {step_ms:9.3f} "
                  f"{diff:12.1e}  {splits(case) if algorithm == 'persistent' else ''}")
    if args.sim:
        print("(simulator: the times mean nothing)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
