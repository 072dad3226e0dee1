"""Prints, as JSON, a digest of weight, bias and recurrent parameter gradients computed by
every cpu algorithm that applies (run by tests/test_determinism.py under several thread
counts; the digests must agree bitwise)."""

import hashlib
import json
import sys

import numpy as np

import numbaconv as nc
from numbaconv import dispatch
from numbaconv import problem as pb
from numbaconv.cpu import conv_backward_bias as bias_gradient

#: (name, x shape, w shape, groups, layout): between them every weight-gradient algorithm,
#: products large enough to be shared out, several tiles and slots.
WEIGHT_GRADIENTS = (
    ("3x3_64c_28", (8, 64, 28, 28), (64, 64, 3, 3), 1, "channels_first"),
    ("3x3_64c_28_cl", (8, 28, 28, 64), (64, 64, 3, 3), 1, "channels_last"),
    ("1x1_cf", (8, 64, 28, 28), (256, 64, 1, 1), 1, "channels_first"),
    ("1x1_cl", (4, 14, 14, 256), (128, 256, 1, 1), 1, "channels_last"),
    ("depthwise_cl", (4, 17, 17, 32), (32, 1, 3, 3), 32, "channels_last"),
    # 21 MB of x and dy: the four-row walk (_heuristics.SAME_WEIGHT_ROWS_MIN_BYTES).
    ("depthwise_cl_four_rows", (8, 72, 72, 64), (64, 1, 3, 3), 64, "channels_last"),
    ("grouped", (4, 32, 15, 15), (32, 8, 3, 3), 4, "channels_first"),
    # im2col by pieces of channels (_heuristics.feature_pieces): two tiles, two pieces.
    ("3x3_128c_14_pieces", (8, 128, 14, 14), (128, 128, 3, 3), 1, "channels_first"),
)

#: Weight gradients only asked which algorithm they would run (explain computes nothing):
#: shapes whose choice once depended on the thread count (the transformed weights' copies).
CHOICES = (
    ("resnet_256c_14x14_n32", (32, 256, 14, 14), (256, 256, 3, 3)),
    ("resnet_512c_7x7_n64", (64, 512, 7, 7), (512, 512, 3, 3)),
)

#: (mode, input size, hidden size, layers, bidirectional, T, N): wide enough (N * gates * H
#: >= 2**14) for the parallel gate kernels, and products shared out.
RNNS = (
    ("lstm", 64, 256, 1, False, 12, 16),
    ("gru", 48, 128, 2, True, 8, 32),
)


def digest(*arrays) -> str:
    return hashlib.sha1(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
                        ).hexdigest()


def gradients() -> dict:
    rng = np.random.default_rng(0)
    cpu = dispatch.get_backend("cpu")
    result = {}
    for name, x_shape, w_shape, groups, layout in WEIGHT_GRADIENTS:
        x = rng.standard_normal(x_shape, dtype=np.float32)
        kw = dict(padding=(w_shape[2] - 1) // 2, groups=groups, layout=layout)
        y_shape = nc.conv_output_shape(x_shape, w_shape, **kw)
        dy = rng.standard_normal(y_shape, dtype=np.float32)
        problem = pb.conv_backward_weight_problem(x, dy, w_shape, **kw)
        choice = nc.explain("conv_backward_weight", x, dy, w_shape, **kw)
        db = nc.conv_backward_bias(dy, layout=layout)
        result[f"{name} bias"] = digest(db)
        # The parallel kernels also where this dy would be summed on one thread.
        result[f"{name} bias, parallel"] = digest(bias_gradient.channel_sums(
            dy, w_shape[0], layout == "channels_last", parallel=True))
        for algorithm in cpu.algorithms("conv_backward_weight", problem):
            dw = cpu.run("conv_backward_weight", problem, (x, dy), None, algorithm)
            result[f"{name} {algorithm}"] = digest(dw)
        result[f"{name} chosen"] = f"{choice.backend}/{choice.algorithm}"
    for name, x_shape, w_shape in CHOICES:
        x = np.zeros(x_shape, np.float32)
        choice = nc.explain("conv_backward_weight", x, x, w_shape, padding=1)
        result[f"{name} chosen"] = f"{choice.backend}/{choice.algorithm}"
    for mode, size, hidden, layers, bidirectional, t_len, batch in RNNS:
        cfg = nc.RNNConfig(mode, size, hidden, num_layers=layers, bidirectional=bidirectional)
        params = nc.rnn_init_params(cfg, seed=1)
        x = rng.standard_normal((t_len, batch, size), dtype=np.float32)
        y, _, _, reserve = nc.rnn_forward(cfg, x, params, training=True)
        dy = rng.standard_normal(y.shape, dtype=np.float32)
        dx, _, _ = nc.rnn_backward_data(cfg, y, dy, params, reserve)
        dparams = nc.rnn_backward_weights(cfg, x, params, reserve)
        result[f"{mode} parameters"] = digest(dparams)
    return result


if __name__ == "__main__":
    if "--set-num-threads-1" in sys.argv:
        import numba
        numba.set_num_threads(1)
    json.dump(gradients(), sys.stdout)
