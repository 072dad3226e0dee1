"""The strided data gradient's paired row taps against the same taps multiplied apart, in
one process (docs/cpu-algorithms.md, "`implicit`: the strided data gradient by stride
phases").

    python docs/benchmarks/strided_taps.py [CASE] [--rounds 8]

CASE is a bench shape (``numbaconv.bench_cases.SHAPES``), by default the 3D stride-2 layer,
timed channels-last. Each round times the call best of five with ``_implicit._row_taps`` as
it is, then with every group of taps split into single taps: the products the kernel made
before the taps were paired. Both forms give the same result up to rounding, which is
checked first. Run it with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from numbaconv import bench_cases
from numbaconv.cpu import _implicit
from numbaconv.testing import relative_error


def _split(paired):
    """``_row_taps`` with every group of taps cut into groups of one."""
    def row_taps(g):
        groups, order = paired(g)
        rows = [[rx, first + i, 1, shift + i]
                for rx, first, count, shift in groups.tolist() for i in range(count)]
        return np.array(rows, np.int64).reshape(-1, 4), order
    return row_taps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", nargs="?", default="conv3d_3x3x3s2_32c_16x56")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    case = {c.name: c for c in bench_cases.SHAPES}[args.case]
    call = bench_cases.make_call("conv_backward_data", case, "channels_last")
    paired, split = _implicit._row_taps, _split(_implicit._row_taps)
    try:
        first = call()
        _implicit._row_taps = split
        error = relative_error(call(), first)
        print(f"{args.case}, channels-last data gradient; paired against split taps: "
              f"relative difference {error:.1e}")

        def best_of_five():
            times = []
            for _ in range(5):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            return min(times)

        rounds = []
        for _ in range(args.rounds):
            _implicit._row_taps = paired
            a = best_of_five()
            _implicit._row_taps = split
            rounds.append((a, best_of_five()))
    finally:
        _implicit._row_taps = paired
    print(f"paired {statistics.median(a for a, _ in rounds) * 1e3:.2f} ms, split "
          f"{statistics.median(b for _, b in rounds) * 1e3:.2f} ms (medians of "
          f"{args.rounds} rounds); split / paired per round: "
          + ", ".join(f"{b / a:.2f}" for a, b in rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
