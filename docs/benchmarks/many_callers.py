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

rng = np.random.default_rng(0)
x = rng.standard_normal((8, 64, 28, 28), dtype=np.float32)
w = rng.standard_normal((64, 64, 3, 3), dtype=np.float32)
xs = rng.standard_normal((4, 16, 14, 14), dtype=np.float32)
ws = rng.standard_normal((16, 16, 3, 3), dtype=np.float32)
cfg = nc.RNNConfig("lstm", 64, 128)
params = nc.rnn_init_params(cfg, seed=0)
xr = rng.standard_normal((10, 16, 64), dtype=np.float32)
def H(a): return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()[:8]
def job(i):
    k = i % 4
    if k == 0:
        y = nc.conv(x, w, padding=1); return H(nc.conv_backward_weight(x, y, w.shape, padding=1))
    if k == 1:
        y = nc.conv(xs, ws, padding=1); return H(nc.conv_backward_data(y, ws, xs.shape, padding=1))
    if k == 2:
        return H(nc.conv_backward_weight(xs, nc.conv(xs, ws, padding=1), ws.shape, padding=1))
    y, _, _, res = nc.rnn_forward(cfg, xr, params, training=True)
    nc.rnn_backward_data(cfg, y, y, params, res)
    return H(nc.rnn_backward_weights(cfg, xr, params, res))
jobs = list(range(64))
for i in range(4): job(i)
best = {}
for rep in range(3):
    t0 = time.perf_counter(); serial = [job(i) for i in jobs]; ts = time.perf_counter() - t0
    with ThreadPoolExecutor(8) as pool:
        t0 = time.perf_counter(); conc = list(pool.map(job, jobs)); tc = time.perf_counter() - t0
    diff = sum(a != b for a, b in zip(serial, conc))
    print(f"serial {ts:.2f} s, 8 threads {tc:.2f} s, ratio {tc/ts:.2f}, differing results {diff}/{len(jobs)}")
