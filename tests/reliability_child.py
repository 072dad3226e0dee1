"""Work run in child processes by test_reliability (importable by spawn/forkserver children)."""

import time

import numpy as np

import numbaconv as nc
from numbaconv import dispatch
from numbaconv import problem as pb
from numbaconv.problem import RNNConfig
from numbaconv.testing import RNNCase, _rnn_arrays, _rnn_step, relative_error

#: Weight gradients that, between them, reach every cpu algorithm's parallel kernels:
#: (name, x shape, w shape, groups, layout).
WEIGHT_GRADIENTS = (
    ("3x3_64c", (2, 64, 18, 18), (64, 64, 3, 3), 1, "channels_first"),
    ("3x3_64c_cl", (2, 18, 18, 64), (64, 64, 3, 3), 1, "channels_last"),
    ("depthwise", (2, 32, 17, 17), (32, 1, 3, 3), 32, "channels_first"),
    ("1x1", (2, 32, 9, 9), (16, 32, 1, 1), 1, "channels_first"),
)

#: An LSTM step wide enough (N * 4H = 2**14) for the parallel gate kernels.
LSTM = RNNCase("lstm_parallel", RNNConfig("lstm", 32, 256), 3, 16)


def workload() -> dict:
    """{what: relative error against the reference backend}: every algorithm the cpu
    backend offers for each weight gradient, the forward and bias gradient of the first,
    and an LSTM training step."""
    rng = np.random.default_rng(0)
    cpu = dispatch.get_backend("cpu")
    errors = {}
    for name, x_shape, w_shape, groups, layout in WEIGHT_GRADIENTS:
        x = rng.uniform(-1, 1, x_shape).astype(np.float32)
        w = rng.uniform(-1, 1, w_shape).astype(np.float32)
        kw = dict(padding=(w_shape[2] - 1) // 2, groups=groups, layout=layout)
        with nc.use_backend("reference"):
            dy = nc.conv(x, w, **kw)
            expected = nc.conv_backward_weight(x, dy, w_shape, **kw)
            expected_bias = nc.conv_backward_bias(dy, layout=layout)
        problem = pb.conv_backward_weight_problem(x, dy, w_shape, **kw)
        for algorithm in cpu.algorithms("conv_backward_weight", problem):
            got = cpu.run("conv_backward_weight", problem, (x, dy), None, algorithm)
            errors[f"{name} {algorithm}"] = relative_error(got, expected)
        with nc.use_backend("cpu"):
            errors[f"{name} conv"] = relative_error(nc.conv(x, w, **kw), dy)
            errors[f"{name} bias"] = relative_error(nc.conv_backward_bias(dy, layout=layout),
                                                    expected_bias)
    arrays = _rnn_arrays(LSTM, "float32")
    with nc.use_backend("reference"):
        expected = _rnn_step(LSTM, arrays)
    with nc.use_backend("cpu"):
        got = _rnn_step(LSTM, arrays)
    for op, results in expected.items():
        errors[op] = max(relative_error(g, e) for g, e in zip(got[op], results)
                         if e is not None)
    return errors


def send_workload(conn) -> None:
    """A child's main: the workload's errors (or the exception's text) through ``conn``."""
    try:
        conn.send(("ok", workload()))
    except BaseException as exc:  # reported to the parent, which fails the test
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


#: Calls of several seconds on two threads, for the Ctrl-C test: op, algorithm, x shape
#: (channels-first), w shape, groups, padding, layout. Each runs as many parallel regions:
#: tiles among the tile workers (the weight gradient's partial sums each run many), or
#: pieces of the algorithms that launch their kernels from the calling thread. Each takes
#: 2.2 s or more on 2 Zen 5 cores, so that the signal, sent 0.5 s in, arrives mid-call on
#: any CI machine (a 1.0 s call once finished first there); an interrupted call costs the
#: suite only its first 0.5 s.
LONG_CALLS = {
    "im2col forward": ("conv", "im2col", (48, 128, 56, 56), (256, 128, 7, 7), 1, 3,
                       "channels_first"),
    "im2col weight gradient": ("conv_backward_weight", "im2col", (48, 128, 56, 56),
                               (256, 128, 7, 7), 1, 3, "channels_first"),
    "implicit forward": ("conv", "implicit", (48, 256, 56, 56), (256, 256, 7, 7), 1, 3,
                         "channels_last"),
    "implicit weight gradient": ("conv_backward_weight", "implicit", (48, 256, 56, 56),
                                 (256, 256, 7, 7), 1, 3, "channels_last"),
    "direct forward": ("conv", "direct", (48, 256, 56, 56), (256, 16, 15, 15), 16, 7,
                       "channels_last"),
    "direct weight gradient": ("conv_backward_weight", "direct", (48, 256, 56, 56),
                               (256, 16, 15, 15), 16, 7, "channels_first"),
    # (T, N, input size, hidden size): batch chains (four with AVX2's tiles, two with
    # AVX-512's), each stepping through time on a tile worker.
    "lstm training forward": ("rnn_forward", "fused", (300, 64, 16), 2048),
}


def long_call(name: str, small: bool = False) -> tuple:
    """(op, problem, operands, algorithm) of LONG_CALLS[name], or with ``small`` the same
    layer on one 16x16 image (its kernels, compiled for the same types)."""
    if LONG_CALLS[name][0] == "rnn_forward":
        return long_rnn_call(name, small)
    op, algorithm, x_shape, w_shape, groups, padding, layout = LONG_CALLS[name]
    if small:
        x_shape = (1, x_shape[1], 16, 16)
    if layout == "channels_last":
        x_shape = (x_shape[0],) + x_shape[2:] + (x_shape[1],)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape, dtype=np.float32)
    w = rng.standard_normal(w_shape, dtype=np.float32)
    kw = dict(padding=padding, groups=groups, layout=layout)
    forward = pb.conv_problem(x, w, None, **kw)
    if op == "conv":
        return op, forward, (x, w, None), algorithm
    dy = rng.standard_normal(forward.y_shape, dtype=np.float32)
    return op, pb.conv_backward_weight_problem(x, dy, w_shape, **kw), (x, dy), algorithm


def long_rnn_call(name: str, small: bool = False) -> tuple:
    """:func:`long_call` for a recurrent op (``small``: two steps), its reserve written once
    already (so that the call spends its time stepping, not touching fresh pages)."""
    op, algorithm, (t_len, n, features), hidden = LONG_CALLS[name]
    t_len = 2 if small else t_len
    cfg = RNNConfig("lstm", features, hidden)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((t_len, n, features), dtype=np.float32)
    params = nc.rnn_init_params(cfg, seed=0)
    zeros = np.zeros((1, n, hidden), np.float32)
    reserve = np.empty(nc.rnn_reserve_size(cfg, t_len, n), np.float32)
    reserve.fill(0)
    problem, lengths = pb.rnn_forward_problem(cfg, x, params, zeros, zeros, training=True,
                                              reserve=reserve)
    return op, problem, (x, params, zeros, zeros, lengths, reserve), algorithm


def interrupted_call(name: str) -> None:
    """A child's main for the Ctrl-C test: the long call ``name`` after a small one (which
    loads its kernels); "start" before it, then "interrupted" when Ctrl-C's
    KeyboardInterrupt ended it, or "done" and its seconds when it finished first."""
    import signal
    # A child inherits an ignored SIGINT (Python then installs no KeyboardInterrupt
    # handler), and a suite started in the background by a shell without job control
    # (``pytest &`` in a script, as CI may do) runs with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cpu = dispatch.get_backend("cpu")
    op, problem, operands, algorithm = long_call(name, small=True)
    cpu.run(op, problem, operands, None, algorithm)
    op, problem, operands, algorithm = long_call(name)
    print("start", flush=True)
    start = time.monotonic()
    try:
        cpu.run(op, problem, operands, None, algorithm)
        print("done", f"{time.monotonic() - start:.1f}", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
