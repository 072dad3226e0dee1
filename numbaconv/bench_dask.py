"""What the Dask path costs and gains: ``python -m numbaconv.bench_dask``.

1. Overhead: the weight gradient of a large batch through :mod:`numbaconv.dask` (batch
   chunks of 32 and 64, Dask's threaded scheduler with one thread, so that numbaconv's own
   threads do the work as in the plain call) against the plain call on the whole batch.
2. Scaling: the same weight gradient on a ``distributed.LocalCluster`` with 1 and 2 worker
   processes of one thread each (Numba and BLAS limited to one thread per worker, so that
   the workers are the only parallelism).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from .testing import random_array

#: A ResNet-style layer: 3x3, 64 channels, 28x28.
SHAPE = dict(c=64, k=64, s=28)


def _batch(n, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    c, k, s = SHAPE["c"], SHAPE["k"], SHAPE["s"]
    return random_array((n, c, s, s), dtype, rng), random_array((n, k, s, s), dtype, rng)


def _median_time(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def overhead(batch: int = 256, chunks=(32, 64), repeat: int = 5) -> list:
    """Rows (chunk, plain seconds, dask seconds, overhead fraction)."""
    import dask.array as da

    import numbaconv as nc
    import numbaconv.dask as ncd
    x, dy = _batch(batch)
    w_shape = (SHAPE["k"], SHAPE["c"], 3, 3)
    plain = _median_time(lambda: nc.conv_backward_weight(x, dy, w_shape, padding=1), repeat)
    rows = []
    for chunk in chunks:
        # Persisted: the blocks are arrays in the graph, as after loading them with Dask
        # (a fresh from_array would copy each block out of x on every compute).
        xd = da.from_array(x, chunks=(chunk,) + x.shape[1:]).persist(scheduler="sync")
        dyd = da.from_array(dy, chunks=(chunk,) + dy.shape[1:]).persist(scheduler="sync")
        sharded = _median_time(lambda: ncd.conv_backward_weight(
            xd, dyd, w_shape, padding=1, scheduler="sync"), repeat)
        rows.append((chunk, plain, sharded, sharded / plain - 1))
    return rows


def _limit_threads():
    os.environ["NUMBA_NUM_THREADS"] = "1"
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"


def scaling(batch: int = 256, chunk: int = 32, workers=(1, 2), repeat: int = 3) -> list:
    """Rows (workers, seconds) of the sharded weight gradient on a LocalCluster."""
    import dask.array as da
    import distributed

    import numbaconv.dask as ncd
    x, dy = _batch(batch)
    w_shape = (SHAPE["k"], SHAPE["c"], 3, 3)
    rows = []
    for count in workers:
        with distributed.LocalCluster(n_workers=count, processes=True, threads_per_worker=1,
                                      host="127.0.0.1", dashboard_address=None,
                                      silence_logs=50, env=dict(
                                          NUMBA_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                                          OMP_NUM_THREADS="1")) as cluster, \
                distributed.Client(cluster) as client:
            xd = client.persist(da.from_array(x, chunks=(chunk,) + x.shape[1:]))
            dyd = client.persist(da.from_array(dy, chunks=(chunk,) + dy.shape[1:]))
            seconds = _median_time(lambda: ncd.conv_backward_weight(
                xd, dyd, w_shape, padding=1, scheduler=client), repeat)
            rows.append((count, seconds))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m numbaconv.bench_dask",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"weight gradient, 3x3, {SHAPE['c']}->{SHAPE['k']} channels at "
          f"{SHAPE['s']}x{SHAPE['s']}, batch {args.batch}, float32")
    for chunk, plain, sharded, extra in overhead(args.batch, repeat=args.repeat):
        print(f"  chunks of {chunk:3d}: plain {plain * 1e3:7.1f} ms, dask {sharded * 1e3:7.1f} "
              f"ms, overhead {extra * 100:+.1f}% (target < 15%)")
    base = None
    for count, seconds in scaling(args.batch, repeat=max(3, args.repeat // 2)):
        base = base or seconds
        print(f"  LocalCluster, {count} worker process(es) x 1 thread: {seconds * 1e3:7.1f} ms "
              f"(speed-up {base / seconds:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
