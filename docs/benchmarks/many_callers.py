"""Many callers: 64 mixed numbaconv calls (a forward and weight gradient, a data gradient, a
small weight gradient, an LSTM training step) from 8 Python threads at once, against the same
calls one after another: the time ratio and how many results differ (issue 25's target:
within 1.5x, none differing).

    python docs/benchmarks/many_callers.py
"""

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import numbaconv as nc

CALLS = 64
THREADS = 8


def digest(a) -> str:
    return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()


def workload():
    """call(i) -> the digest of call i's result: four kinds of call, in turn."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64, 28, 28), dtype=np.float32)
    w = rng.standard_normal((64, 64, 3, 3), dtype=np.float32)
    xs = rng.standard_normal((4, 16, 14, 14), dtype=np.float32)
    ws = rng.standard_normal((16, 16, 3, 3), dtype=np.float32)
    cfg = nc.RNNConfig("lstm", 64, 128)
    params = nc.rnn_init_params(cfg, seed=0)
    xr = rng.standard_normal((10, 16, 64), dtype=np.float32)

    def call(i):
        kind = i % 4
        if kind == 0:
            y = nc.conv(x, w, padding=1)
            return digest(nc.conv_backward_weight(x, y, w.shape, padding=1))
        if kind == 1:
            y = nc.conv(xs, ws, padding=1)
            return digest(nc.conv_backward_data(y, ws, xs.shape, padding=1))
        if kind == 2:
            y = nc.conv(xs, ws, padding=1)
            return digest(nc.conv_backward_weight(xs, y, ws.shape, padding=1))
        y, _, _, reserve = nc.rnn_forward(cfg, xr, params, training=True)
        nc.rnn_backward_data(cfg, y, y, params, reserve)
        return digest(nc.rnn_backward_weights(cfg, xr, params, reserve))

    return call


def main() -> None:
    call = workload()
    for i in range(4):          # compile, or load from the cache, every kernel first
        call(i)
    for _ in range(3):
        start = time.perf_counter()
        serial = [call(i) for i in range(CALLS)]
        serial_s = time.perf_counter() - start
        with ThreadPoolExecutor(THREADS) as pool:
            start = time.perf_counter()
            concurrent = list(pool.map(call, range(CALLS)))
            concurrent_s = time.perf_counter() - start
        differ = sum(a != b for a, b in zip(serial, concurrent))
        print(f"serial {serial_s:.2f} s, {THREADS} threads {concurrent_s:.2f} s, ratio "
              f"{concurrent_s / serial_s:.2f}, differing results {differ}/{CALLS}")


if __name__ == "__main__":
    main()
