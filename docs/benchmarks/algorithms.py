"""The cpu backend's algorithms for one problem, each forced, in one process, alternating
(how the thresholds in numbaconv/cpu/_heuristics.py are chosen; docs/cpu-algorithms.md).

    python docs/benchmarks/algorithms.py OP X_SHAPE W_SHAPE [--stride S] [--padding P]
        [--groups G] [--layout channels_last] [--dtype float32] [--rounds 5]
        [--set NAME=VALUE ...]

X_SHAPE and W_SHAPE are channels-first logical shapes written as 8,64,56,56 and 64,64,3,3;
the layout says how the arrays lie. Every algorithm that can compute the problem is timed,
whichever the backend would choose. ``--set`` changes a threshold of ``_heuristics`` first,
for the ones that choose a path inside an algorithm (``--set ROWS_GEMM_FROM=1``). Each round
times every algorithm best of three, one after another; the medians over the rounds, the
algorithm the backend chooses and,
with two algorithms, the second's time over the first's in each round are printed. Run it
with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from numbaconv import dispatch
from numbaconv.bench_cases import BenchCase, make_call
from numbaconv.cpu import _heuristics


def _shape(text: str) -> tuple:
    return tuple(int(v) for v in text.split(","))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op")
    parser.add_argument("x_shape", type=_shape)
    parser.add_argument("w_shape", type=_shape)
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--padding", type=int, default=0)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--layout", default="channels_last")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args(argv)
    for setting in args.set:
        name, value = setting.split("=")
        if not hasattr(_heuristics, name):
            parser.error(f"--set: _heuristics has no {name}")
        setattr(_heuristics, name, int(value))
    case = BenchCase("problem", args.x_shape, args.w_shape, stride=args.stride,
                     padding=args.padding, output_padding=args.stride - 1,
                     groups=args.groups)
    call = make_call(args.op, case, args.layout, args.dtype)
    backend = dispatch.get_backend("cpu")
    algorithms = backend.algorithms(args.op, call.problem)

    def run(algorithm):
        return backend.run(args.op, call.problem, call.operands, None, algorithm)

    for algorithm in algorithms:
        run(algorithm)          # compiles, or loads from Numba's cache
    times = {algorithm: [] for algorithm in algorithms}
    for _ in range(args.rounds):
        for algorithm in algorithms:
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                run(algorithm)
                best = min(best, time.perf_counter() - start)
            times[algorithm].append(best)
    print(f"{args.op} x {args.x_shape} w {args.w_shape} stride {args.stride} padding "
          f"{args.padding} {args.layout}: "
          + ", ".join(f"{a} {statistics.median(t) * 1e3:.2f} ms" for a, t in times.items())
          + f" (chosen: {backend.choose(args.op, call.problem)[0]})")
    if len(algorithms) == 2:
        first, second = (times[a] for a in algorithms)
        print(f"{algorithms[1]} / {algorithms[0]} per round: "
              + ", ".join(f"{b / a:.2f}" for a, b in zip(first, second)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
