"""PyTorch as an independent oracle for the RNN functions, and the shared problem table.

The oracle loads numbaconv's flat parameter vector into ``torch.nn.RNN`` / ``LSTM`` / ``GRU``
by walking ``_flat_weights_names`` itself (so the layout is checked, not assumed), runs
variable-length batches through ``pack_padded_sequence(enforce_sorted=False)`` and
``pad_packed_sequence(total_length=T)``, and takes every gradient from autograd on the loss
``sum(y * dy) + sum(hy * dhy) + sum(cy * dcy)``.
"""

import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest

torch = pytest.importorskip("torch")

torch.set_num_threads(1)
warnings.filterwarnings("ignore", "LSTM with projections is not supported with oneDNN")

# Tiny sizes keep both backends fast; N = 3 with unsorted lengths covering 1 and T.
T, N, INPUT, HIDDEN, PROJ = 5, 3, 4, 3, 2
LENGTHS = (3, 5, 1)


@dataclass(frozen=True)
class Spec:
    """One RNN problem: mode, RNNConfig keyword arguments, and how the call is made."""

    name: str
    mode: str
    kwargs: dict = field(default_factory=dict)
    lengths: bool = False          # pass seq_lengths=LENGTHS
    initial_state: bool = True     # pass hx (and cx); otherwise None (= zeros)

    @property
    def is_lstm(self):
        return self.mode == "lstm"

    def config(self):
        import numbaconv as nc
        return nc.RNNConfig(self.mode, INPUT, HIDDEN, **self.kwargs)

    @property
    def num_directions(self):
        return 2 if self.kwargs.get("bidirectional", False) else 1

    @property
    def out_size(self):
        return self.kwargs.get("proj_size", 0) or HIDDEN

    @property
    def batch_first(self):
        return self.kwargs.get("batch_first", False)


MODES = {
    "rnn_tanh": ("rnn_tanh", {}),
    "rnn_relu": ("rnn_relu", {}),
    "lstm": ("lstm", {}),
    "lstm_proj": ("lstm", {"proj_size": PROJ}),
    "gru": ("gru", {}),
}

# name -> (RNNConfig kwargs, lengths, initial_state)
FEATURES = {
    "one_layer": ({}, False, True),
    "two_layers": ({"num_layers": 2}, False, True),
    "bidirectional": ({"bidirectional": True}, False, True),
    "no_bias": ({"bias": False}, False, True),
    "batch_first_no_hx": ({"batch_first": True}, False, False),
    "lengths": ({}, True, True),
    "everything": ({"num_layers": 2, "bidirectional": True, "batch_first": True}, True, True),
    "everything_no_bias": ({"num_layers": 2, "bidirectional": True, "bias": False}, True, True),
}

# Finite differences also cover dropout (deterministic given dropout_seed).
FD_FEATURES = {
    "one_layer": ({}, False, True),
    "two_layers_dropout": ({"num_layers": 2, "dropout": 0.4}, False, True),
    "bidirectional": ({"bidirectional": True}, False, True),
    "lengths": ({}, True, True),
    "no_bias": ({"bias": False}, False, True),
    "batch_first": ({"batch_first": True}, False, True),
    "everything_dropout": ({"num_layers": 2, "bidirectional": True, "batch_first": True,
                            "dropout": 0.3}, True, True),
}


def make_spec(mode_name, feature_name, table=FEATURES):
    mode, mode_kw = MODES[mode_name]
    kw, lengths, initial_state = table[feature_name]
    return Spec(f"{mode_name}-{feature_name}", mode, {**mode_kw, **kw}, lengths, initial_state)


def make_arrays(spec, num_params, dtype, seed=0):
    """Random x, params, hx, cx, dy, dhy, dcy (cx/dcy None unless lstm; hx/cx None when the
    spec passes no initial state) in numbaconv's layout."""
    rng = np.random.default_rng(seed)
    D, L = spec.num_directions, spec.kwargs.get("num_layers", 1)
    xs = (N, T, INPUT) if spec.batch_first else (T, N, INPUT)
    ys = (N, T, D * spec.out_size) if spec.batch_first else (T, N, D * spec.out_size)
    a = {
        "x": rng.standard_normal(xs),
        "params": rng.uniform(-0.6, 0.6, num_params),
        "hx": rng.standard_normal((L * D, N, spec.out_size)) * 0.5,
        "cx": rng.standard_normal((L * D, N, HIDDEN)) * 0.5 if spec.is_lstm else None,
        "dy": rng.standard_normal(ys),
        "dhy": rng.standard_normal((L * D, N, spec.out_size)),
        "dcy": rng.standard_normal((L * D, N, HIDDEN)) if spec.is_lstm else None,
    }
    a = {k: (None if v is None else v.astype(dtype)) for k, v in a.items()}
    if not spec.initial_state:
        a["hx"] = a["cx"] = None
    a["lengths"] = np.array(LENGTHS) if spec.lengths else None
    return a


def torch_module(mode, kwargs, dtype):
    common = dict(num_layers=kwargs.get("num_layers", 1), bias=kwargs.get("bias", True),
                  batch_first=kwargs.get("batch_first", False),
                  dropout=kwargs.get("dropout", 0.0),
                  bidirectional=kwargs.get("bidirectional", False))
    if mode in ("rnn_tanh", "rnn_relu"):
        m = torch.nn.RNN(INPUT, HIDDEN, nonlinearity=mode[4:], **common)
    elif mode == "lstm":
        m = torch.nn.LSTM(INPUT, HIDDEN, proj_size=kwargs.get("proj_size", 0), **common)
    elif mode == "gru":
        m = torch.nn.GRU(INPUT, HIDDEN, **common)
    else:
        raise ValueError(mode)
    return m.to(getattr(torch, np.dtype(dtype).name))


def torch_param_count(mode, kwargs):
    return sum(p.numel() for p in torch_module(mode, kwargs, np.float64).parameters())


def torch_param_shapes(mode, kwargs):
    """[(name, shape)] in PyTorch's flat order."""
    m = torch_module(mode, kwargs, np.float64)
    return [(n, tuple(getattr(m, n).shape)) for n in m._flat_weights_names]


def load_flat(m, flat):
    offset = 0
    with torch.no_grad():
        for name in m._flat_weights_names:
            p = getattr(m, name)
            p.copy_(torch.from_numpy(np.ascontiguousarray(
                flat[offset:offset + p.numel()]).reshape(p.shape)))
            offset += p.numel()
    assert offset == flat.size, (offset, flat.size)


def _leaf(a):
    return torch.from_numpy(np.array(a, copy=True)).requires_grad_(True)


def torch_forward_backward(spec, a, dtype):
    """{"y", "hy", "cy", "dx", "dhx", "dcx", "grads": {torch name: gradient}} by autograd.

    hx/cx None are zeros (whose gradient is still reported, like cuDNN's dhx); dhy/dcy None
    are zeros."""
    m = torch_module(spec.mode, spec.kwargs, dtype)
    load_flat(m, a["params"])
    m.eval()  # no dropout in torch: its masks come from another RNG
    bf = spec.batch_first
    L, D = spec.kwargs.get("num_layers", 1), spec.num_directions
    x = _leaf(a["x"])
    hx = _leaf(a["hx"] if a["hx"] is not None else np.zeros((L * D, N, spec.out_size), dtype))
    if spec.is_lstm:
        cx = _leaf(a["cx"] if a["cx"] is not None else np.zeros((L * D, N, HIDDEN), dtype))
        state = (hx, cx)
    else:
        state = hx
    inp = x
    if a["lengths"] is not None:
        inp = torch.nn.utils.rnn.pack_padded_sequence(
            x, torch.as_tensor(np.asarray(a["lengths"]), dtype=torch.int64), batch_first=bf,
            enforce_sorted=False)
    out, hn = m(inp, state)
    if a["lengths"] is not None:
        out, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=bf, total_length=T)
    hy, cy = hn if spec.is_lstm else (hn, None)
    loss = (out * torch.from_numpy(a["dy"])).sum()
    if a["dhy"] is not None:
        loss = loss + (hy * torch.from_numpy(a["dhy"])).sum()
    if cy is not None and a["dcy"] is not None:
        loss = loss + (cy * torch.from_numpy(a["dcy"])).sum()
    loss.backward()

    def npy(t):
        return None if t is None else t.detach().numpy().copy()

    return {
        "y": npy(out), "hy": npy(hy), "cy": npy(cy), "dx": npy(x.grad), "dhx": npy(hx.grad),
        "dcx": npy(cx.grad) if spec.is_lstm else None,
        "grads": {n: npy(getattr(m, n).grad) for n in m._flat_weights_names},
    }
