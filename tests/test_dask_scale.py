"""numbaconv.dask beyond one batch in memory: a weight gradient streamed from a memory-mapped
.npy with bounded memory, and a worker killed in the middle of a reduction."""

import os
import threading
import time
import tracemalloc

import numpy as np
import pytest

dask = pytest.importorskip("dask", reason="the dask extra is not installed")
da = pytest.importorskip("dask.array", reason="the dask extra is not installed")

import numbaconv as nc  # noqa: E402
import numbaconv.dask as ncd  # noqa: E402

KW = dict(stride=1, padding=1)


def test_weight_gradient_streams_a_memory_mapped_batch_with_bounded_memory(tmp_path):
    """24 MiB of x and dy on disk, 256 KiB blocks: NumPy allocations (tracemalloc) peak at a
    small fraction of the input, and the result equals the in-memory call."""
    n, c, k, s = 384, 8, 8, 32
    rng = np.random.default_rng(0)
    x_path, dy_path = tmp_path / "x.npy", tmp_path / "dy.npy"
    xm = np.lib.format.open_memmap(x_path, "w+", np.float32, (n, c, s, s))
    dym = np.lib.format.open_memmap(dy_path, "w+", np.float32, (n, k, s, s))
    for lo in range(0, n, 64):  # written in pieces, never whole in memory
        xm[lo:lo + 64] = rng.standard_normal((64, c, s, s), np.float32)
        dym[lo:lo + 64] = rng.standard_normal((64, k, s, s), np.float32)
    xm.flush(), dym.flush()
    del xm, dym
    input_bytes = 2 * n * c * s * s * 4

    x = da.from_array(np.load(x_path, mmap_mode="r"), chunks=(8, c, s, s))
    dy = da.from_array(np.load(dy_path, mmap_mode="r"), chunks=(8, k, s, s))
    # Compile (or load) the kernels first: that allocates Python objects, not batch data.
    ncd.conv_backward_weight(x[:16], dy[:16], (k, c, 3, 3), scheduler="threads", **KW)
    tracemalloc.start()
    try:
        dw = ncd.conv_backward_weight(x, dy, (k, c, 3, 3), scheduler="threads",
                                      split_every=4, **KW)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"peak traced {peak / 2**20:.1f} MiB for {input_bytes / 2**20:.1f} MiB of input")
    assert peak < 0.25 * input_bytes, (peak, input_bytes)
    want = nc.conv_backward_weight(np.load(x_path), np.load(dy_path), (k, c, 3, 3), **KW)
    np.testing.assert_allclose(dw, want, rtol=1e-4, atol=1e-3)


def _slow_block(block, delay):
    time.sleep(delay)  # stands for reading the block from storage
    return block


def test_a_worker_killed_mid_reduction_is_retried(local_cluster):
    distributed = pytest.importorskip("distributed")
    rng = np.random.default_rng(1)
    xn = rng.standard_normal((16, 4, 10, 10))
    dyn = rng.standard_normal((16, 6, 10, 10))
    # Slow blocks, so that the kill lands while partial sums are being made.
    x = da.from_array(xn, chunks=(2, 4, 10, 10)).map_blocks(_slow_block, 0.4, dtype=xn.dtype)
    dy = da.from_array(dyn, chunks=(2, 6, 10, 10))
    with distributed.Client(local_cluster) as client:
        lazy = ncd.conv_backward_weight(x, dy, (6, 4, 3, 3), compute=False, split_every=2,
                                        **KW)
        future = client.compute(lazy)
        time.sleep(1.0)
        victim = next(iter(client.scheduler_info()["workers"]))
        killer = threading.Thread(target=lambda: _kill(client, victim), daemon=True)
        killer.start()
        dw = future.result(timeout=120)
        killer.join(timeout=30)
        assert victim not in client.scheduler_info()["workers"] or _restarted(client)
    want = nc.conv_backward_weight(xn, dyn, (6, 4, 3, 3), **KW)
    np.testing.assert_allclose(dw, want, rtol=1e-12, atol=1e-12)


def _kill(client, address):
    try:
        client.run(os._exit, 1, workers=[address])
    except Exception:  # the worker died before answering: that is the point
        pass


def _restarted(client):
    return True  # the nanny may restart a worker under the same address; the result decides


def test_bench_dask_overhead_runs():
    from numbaconv import bench_dask
    rows = bench_dask.overhead(batch=16, chunks=(8,), repeat=1)
    assert len(rows) == 1 and rows[0][0] == 8 and rows[0][1] > 0 and rows[0][2] > 0
