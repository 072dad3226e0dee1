"""The weight gradient's in-place product (``_microkernel.gram``, ``a.T @ b`` over shared
rows) against NumPy's BLAS, by the number of shared rows: where both operands fit in cache
and where they stream from memory (docs/cpu-algorithms.md, "`gemm`: channels-last 1x1
weight gradient split by positions").

    python docs/benchmarks/gram_rates.py [--columns 256,64] [--rows 512,2048,8192,25088]

For each row count P, a (P, F) by b (P, K) float32 product into (F, K), the rows cut into 8
runs like the 1x1 weight gradient's slots: on one thread, then on the tile workers (one run
each at a time). Each figure is the median of 20 calls, in GFLOP/s (gram's whole tiles only
where F is not a multiple of its MR rows). Results are checked against float64 first. Run
it with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from numbaconv.cpu import _microkernel, _tiles


def _rate(function, flops: float, calls: int = 20) -> float:
    function()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return flops / statistics.median(times) / 1e9


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--columns", default="256,64", help="F,K (default 256,64)")
    parser.add_argument("--rows", default="512,2048,4096,8192,25088")
    args = parser.parse_args(argv)
    f, k = (int(v) for v in args.columns.split(","))
    rng = np.random.default_rng(0)
    print(f"a (P, {f}).T @ b (P, {k}), float32, 8 runs of rows; GFLOP/s, medians of 20")
    print(f"{'P':>7} {'gram 1 thread':>14} {'BLAS 1 thread':>14} {'gram workers':>13} "
          f"{'BLAS workers':>13}")
    for rows in (int(v) for v in args.rows.split(",")):
        a = rng.standard_normal((rows, f), dtype=np.float32)
        b = rng.standard_normal((rows, k), dtype=np.float32)
        runs = [slice(start, start + -(-rows // 8)) for start in range(0, rows, -(-rows // 8))]
        parts = np.empty((len(runs), f, k), np.float32)
        expected = a.astype(np.float64).T @ b.astype(np.float64)

        def gram(index, pick=None):
            _microkernel.gram(a[runs[index]], b[runs[index]], parts[index])

        def blas(index, pick=None):
            np.matmul(a[runs[index]].T, b[runs[index]], out=parts[index])

        rates = []
        for product in (gram, blas):
            parts[...] = np.nan
            _tiles.run_tiles(product, list(range(len(runs))))
            error = np.abs(parts.sum(0) - expected).max() / np.abs(expected).max()
            if not error < 1e-5:
                print(f"{product.__name__}: wrong result (relative error {error:.1e})")
                return 1
        flops = 2.0 * rows * f * k
        with _tiles.blas_single_threaded():
            for product in (gram, blas):
                rates.append(_rate(lambda: [product(i) for i in range(len(runs))], flops))
        for product in (gram, blas):
            rates.append(_rate(lambda: _tiles.run_tiles(product, list(range(len(runs)))),
                               flops))
        print(f"{rows:>7} {rates[0]:>14.0f} {rates[1]:>14.0f} {rates[2]:>13.0f} "
              f"{rates[3]:>13.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
