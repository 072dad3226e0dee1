"""RNN bad input: each rejected call raises ValueError/TypeError naming the argument, leaves
``out`` untouched and, for rnn_backward_data, leaves the reserve usable."""

import numpy as np
import pytest

import numbaconv as nc

T, N, INPUT, HIDDEN, PROJ = 5, 3, 4, 3, 2
LSTM = nc.RNNConfig("lstm", INPUT, HIDDEN, proj_size=PROJ, num_layers=2)   # hx (2, 3, 2)
GRU = nc.RNNConfig("gru", INPUT, HIDDEN)


@pytest.fixture(params=["reference", "cpu"])
def backend(request):
    with nc.use_backend(request.param):
        yield request.param


def arrays(cfg=LSTM, dtype="float32"):
    rng = np.random.default_rng(0)
    LD = cfg.num_layers * cfg.num_directions
    a = {"x": rng.standard_normal((T, N, INPUT)),
         "params": rng.uniform(-0.5, 0.5, cfg.num_params),
         "hx": rng.standard_normal((LD, N, cfg.out_size)),
         "cx": rng.standard_normal((LD, N, HIDDEN)) if cfg.mode == "lstm" else None,
         "dy": rng.standard_normal((T, N, cfg.num_directions * cfg.out_size)),
         "dhy": rng.standard_normal((LD, N, cfg.out_size)),
         "dcy": rng.standard_normal((LD, N, HIDDEN)) if cfg.mode == "lstm" else None}
    return {k: (None if v is None else v.astype(dtype)) for k, v in a.items()}


A = arrays()
G = arrays(GRU)


def trained(cfg=LSTM, a=A):
    """(y, reserve) of a training forward, ready for rnn_backward_data."""
    y, _, _, reserve = nc.rnn_forward(cfg, a["x"], a["params"], a["hx"], a["cx"],
                                      training=True)
    return y, reserve


def data_grad(cfg=LSTM, a=A, **changes):
    y, reserve = trained(cfg, a)
    kw = dict(y=y, dy=a["dy"], params=a["params"], reserve=reserve, hx=a["hx"], cx=a["cx"],
              dhy=a["dhy"], dcy=a["dcy"])
    kw.update(changes)
    return nc.rnn_backward_data(cfg, kw.pop("y"), kw.pop("dy"), kw.pop("params"),
                                kw.pop("reserve"), **kw)


def weight_grad(cfg=LSTM, a=A, **changes):
    y, reserve = trained(cfg, a)
    nc.rnn_backward_data(cfg, y, a["dy"], a["params"], reserve, hx=a["hx"], cx=a["cx"],
                         dhy=a["dhy"], dcy=a["dcy"])
    kw = dict(x=a["x"], params=a["params"], reserve=reserve, hx=a["hx"])
    kw.update(changes)
    return nc.rnn_backward_weights(cfg, kw.pop("x"), kw.pop("params"), kw.pop("reserve"), **kw)


def fwd(cfg=LSTM, a=A, **changes):
    kw = dict(x=a["x"], params=a["params"], hx=a["hx"], cx=a["cx"])
    kw.update(changes)
    return nc.rnn_forward(cfg, kw.pop("x"), kw.pop("params"), kw.pop("hx"), kw.pop("cx"), **kw)


def f64(v):
    return v.astype(np.float64)


ERR = (ValueError, TypeError)


def out_is_params():
    p = A["params"].copy()
    return weight_grad(params=p, out=p)


def overlapping_out():
    y, reserve = trained()
    nc.rnn_backward_data(LSTM, y, A["dy"], A["params"], reserve, hx=A["hx"], cx=A["cx"])
    return nc.rnn_backward_weights(LSTM, A["x"], A["params"], reserve, hx=A["hx"],
                                   out=reserve[-LSTM.num_params:])

# name -> (error type(s), pattern the message must contain, call)
BAD_CONFIGS = {
    "unknown mode": (ValueError, "mode", lambda: nc.RNNConfig("lstmx", 4, 3)),
    "mode not str": (ERR, "mode", lambda: nc.RNNConfig(3, 4, 3)),
    "input_size zero": (ValueError, "input_size", lambda: nc.RNNConfig("gru", 0, 3)),
    "input_size float": (ERR, "input_size", lambda: nc.RNNConfig("gru", 4.0, 3)),
    "hidden_size zero": (ValueError, "hidden_size", lambda: nc.RNNConfig("gru", 4, 0)),
    "hidden_size negative": (ValueError, "hidden_size", lambda: nc.RNNConfig("gru", 4, -3)),
    "num_layers zero": (ValueError, "num_layers", lambda: nc.RNNConfig(
        "gru", 4, 3, num_layers=0)),
    "num_layers float": (ERR, "num_layers", lambda: nc.RNNConfig("gru", 4, 3, num_layers=1.5)),
    "dropout negative": (ValueError, "dropout", lambda: nc.RNNConfig(
        "lstm", 4, 3, num_layers=2, dropout=-0.1)),
    "dropout above one": (ValueError, "dropout", lambda: nc.RNNConfig(
        "lstm", 4, 3, num_layers=2, dropout=1.5)),
    "dropout string": (ERR, "dropout", lambda: nc.RNNConfig(
        "lstm", 4, 3, num_layers=2, dropout="0.1")),
    "proj_size for gru": (ValueError, "proj_size", lambda: nc.RNNConfig(
        "gru", 4, 3, proj_size=2)),
    "proj_size for rnn": (ValueError, "proj_size", lambda: nc.RNNConfig(
        "rnn_tanh", 4, 3, proj_size=2)),
    "proj_size equal hidden": (ValueError, "proj_size", lambda: nc.RNNConfig(
        "lstm", 4, 3, proj_size=3)),
    "proj_size above hidden": (ValueError, "proj_size", lambda: nc.RNNConfig(
        "lstm", 4, 3, proj_size=5)),
    "proj_size negative": (ValueError, "proj_size", lambda: nc.RNNConfig(
        "lstm", 4, 3, proj_size=-1)),
}

BAD_CALLS = {
    # rnn_forward
    "x wrong ndim": (ValueError, r"\bx\b", lambda: fwd(x=A["x"][None])),
    "x wrong input size": (ValueError, r"\bx\b", lambda: fwd(x=A["x"][..., :3])),
    "x integer": (TypeError, r"\bx\b", lambda: fwd(x=A["x"].astype(np.int32),
                                              params=A["params"].astype(np.int32),
                                              hx=None, cx=None)),
    "x float16": (TypeError, r"\bx\b", lambda: fwd(x=A["x"].astype(np.float16),
                                              params=A["params"].astype(np.float16),
                                              hx=None, cx=None)),
    "x not an array": (TypeError, r"\bx\b", lambda: fwd(x=A["x"].tolist())),
    "params wrong length": (ValueError, "params", lambda: fwd(params=A["params"][:-1])),
    "params 2-D": (ValueError, "params", lambda: fwd(params=A["params"][None, :])),
    "params mixed dtype": (TypeError, "params", lambda: fwd(params=f64(A["params"]))),
    "hx wrong shape": (ValueError, "hx", lambda: fwd(hx=A["hx"][:1])),
    "hx hidden not proj": (ValueError, "hx", lambda: fwd(
        hx=np.zeros((2, N, HIDDEN), np.float32))),
    "hx wrong batch": (ValueError, "hx", lambda: fwd(hx=A["hx"][:, :2])),
    "hx mixed dtype": (TypeError, "hx", lambda: fwd(hx=f64(A["hx"]))),
    "cx wrong shape": (ValueError, "cx", lambda: fwd(cx=A["cx"][..., :2])),
    "cx mixed dtype": (TypeError, "cx", lambda: fwd(cx=f64(A["cx"]))),
    "cx for gru": (ValueError, "cx", lambda: fwd(GRU, G, cx=np.zeros((1, N, HIDDEN),
                                                                   np.float32))),
    "seq_lengths wrong count": (ValueError, "seq_lengths", lambda: fwd(
        seq_lengths=[5, 4])),
    "seq_lengths zero": (ValueError, "seq_lengths", lambda: fwd(seq_lengths=[5, 0, 2])),
    "seq_lengths negative": (ValueError, "seq_lengths", lambda: fwd(seq_lengths=[5, -1, 2])),
    "seq_lengths above T": (ValueError, "seq_lengths", lambda: fwd(seq_lengths=[6, 1, 2])),
    "seq_lengths fractional": (ERR, "seq_lengths", lambda: fwd(seq_lengths=[5, 2.5, 2])),
    "seq_lengths 2-D": (ValueError, "seq_lengths", lambda: fwd(seq_lengths=[[5, 1, 2]])),
    "reserve wrong dtype": (TypeError, "reserve", lambda: fwd(
        training=True, reserve=np.empty(nc.rnn_reserve_size(LSTM, T, N)))),
    "reserve too small": (ValueError, "reserve", lambda: fwd(
        training=True, reserve=np.empty(nc.rnn_reserve_size(LSTM, T, N) - 1, np.float32))),
    "reserve 2-D": (ValueError, "reserve", lambda: fwd(
        training=True, reserve=np.empty((1, nc.rnn_reserve_size(LSTM, T, N)), np.float32))),
    "reserve not an array": (TypeError, "reserve", lambda: fwd(
        training=True, reserve=[0.0] * nc.rnn_reserve_size(LSTM, T, N))),
    "reserve read-only": (ValueError, "reserve", lambda: fwd(
        training=True, reserve=np.broadcast_to(np.float32(0),
                                               (nc.rnn_reserve_size(LSTM, T, N),)))),
    # rnn_backward_data
    "dy wrong shape": (ValueError, "dy", lambda: data_grad(dy=A["dy"][..., :1])),
    "dy mixed dtype": (TypeError, "dy", lambda: data_grad(dy=f64(A["dy"]))),
    "y wrong shape": (ValueError, r"\by\b", lambda: data_grad(y=A["dy"][:, :2])),
    "dhy wrong shape": (ValueError, "dhy", lambda: data_grad(dhy=A["dhy"][:1])),
    "dhy mixed dtype": (TypeError, "dhy", lambda: data_grad(dhy=f64(A["dhy"]))),
    "dcy wrong shape": (ValueError, "dcy", lambda: data_grad(dcy=A["dcy"][..., :2])),
    "dcy mixed dtype": (TypeError, "dcy", lambda: data_grad(dcy=f64(A["dcy"]))),
    "dcy for gru": (ValueError, "dcy", lambda: data_grad(
        GRU, G, dcy=np.zeros((1, N, HIDDEN), np.float32))),
    "cx for gru backward": (ValueError, "cx", lambda: data_grad(
        GRU, G, cx=np.zeros((1, N, HIDDEN), np.float32))),
    "backward params wrong length": (ValueError, "params", lambda: data_grad(
        params=A["params"][:-2])),
    "backward seq_lengths above T": (ValueError, "seq_lengths", lambda: data_grad(
        seq_lengths=[9, 1, 1])),
    "backward reserve too small": (ValueError, "reserve", lambda: data_grad(
        reserve=np.zeros(4, np.float32))),
    "backward reserve wrong dtype": (TypeError, "reserve", lambda: data_grad(
        reserve=np.zeros(nc.rnn_reserve_size(LSTM, T, N)))),
    # rnn_backward_weights
    "weights x wrong shape": (ValueError, r"\bx\b", lambda: weight_grad(x=A["x"][..., :3])),
    "weights x mixed dtype": (TypeError, r"\bx\b", lambda: weight_grad(x=f64(A["x"]))),
    "weights hx wrong shape": (ValueError, "hx", lambda: weight_grad(hx=A["hx"][:1])),
    "out wrong shape": (ValueError, r"\bout\b", lambda: weight_grad(
        out=np.zeros(LSTM.num_params + 1, np.float32))),
    "out wrong dtype": (TypeError, r"\bout\b", lambda: weight_grad(
        out=np.zeros(LSTM.num_params))),
    "out read-only": (ValueError, r"\bout\b", lambda: weight_grad(
        out=np.broadcast_to(np.float32(0), (LSTM.num_params,)))),
    "out not an array": (TypeError, r"\bout\b", lambda: weight_grad(out=[0.0] * LSTM.num_params)),
    "out is params": (ValueError, r"\bout\b", lambda: out_is_params()),
    "out overlaps reserve": (ValueError, r"\bout\b", lambda: overlapping_out()),
    "accumulate without out": (ValueError, "accumulate", lambda: weight_grad(
        accumulate=True)),
    "accumulate not bool": (TypeError, "accumulate", lambda: weight_grad(
        out=np.zeros(LSTM.num_params, np.float32), accumulate=1)),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_raises_clear_error(name):
    error, pattern, call = BAD_CONFIGS[name]
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_call_raises_clear_error(backend, name):
    error, pattern, call = BAD_CALLS[name]
    with pytest.raises(error, match=pattern):
        call()


def test_good_configs_accepted():
    """The edges of what is valid, as in PyTorch."""
    nc.RNNConfig("lstm", 4, 3, proj_size=2)
    nc.RNNConfig("lstm", 4, 3, num_layers=2, dropout=0.99)
    nc.RNNConfig("gru", 1, 1, proj_size=0)
    for mode in ("rnn_tanh", "rnn_relu", "lstm", "gru"):
        assert nc.RNNConfig(mode, 4, 3).mode == mode


# Rejected calls that pass out=: each must leave the sentinel values in place.
REJECTED_WITH_OUT = {
    "out wrong shape": (LSTM.num_params + 1, "float32", {}),
    "out wrong dtype": (LSTM.num_params, "float64", {}),
    "x mixed dtype": (LSTM.num_params, "float32", {"x": f64(A["x"])}),
    "hx wrong shape": (LSTM.num_params, "float32", {"hx": A["hx"][:1]}),
    "params wrong length": (LSTM.num_params, "float32", {"params": A["params"][:-1]}),
    "seq_lengths zero": (LSTM.num_params, "float32", {"seq_lengths": [0, 1, 1]}),
}


@pytest.mark.parametrize("name", sorted(REJECTED_WITH_OUT))
@pytest.mark.parametrize("accumulate", [False, True])
def test_rejected_call_leaves_out_untouched(backend, name, accumulate):
    size, dtype, changes = REJECTED_WITH_OUT[name]
    out = np.full(size, 7.0, dtype)
    with pytest.raises(ERR):
        weight_grad(out=out, accumulate=accumulate, **changes)
    np.testing.assert_array_equal(out, 7.0)


def test_rejected_backward_data_leaves_reserve_usable(backend):
    """Validation happens before anything is written, the reserve included."""
    y, reserve = trained()
    kw = dict(hx=A["hx"], cx=A["cx"], dhy=A["dhy"], dcy=A["dcy"])
    with pytest.raises(ValueError, match="dy"):
        nc.rnn_backward_data(LSTM, y, A["dy"][..., :1], A["params"], reserve, **kw)
    with pytest.raises(TypeError, match="dhy"):
        nc.rnn_backward_data(LSTM, y, A["dy"], A["params"], reserve, **dict(
            kw, dhy=f64(A["dhy"])))
    dx, dhx, dcx = nc.rnn_backward_data(LSTM, y, A["dy"], A["params"], reserve, **kw)
    y2, reserve2 = trained()
    dx2, dhx2, dcx2 = nc.rnn_backward_data(LSTM, y2, A["dy"], A["params"], reserve2, **kw)
    np.testing.assert_array_equal(dx, dx2)
    np.testing.assert_array_equal(dhx, dhx2)
    np.testing.assert_array_equal(dcx, dcx2)


def test_rejected_forward_leaves_reserve_untouched(backend):
    reserve = np.full(nc.rnn_reserve_size(LSTM, T, N), 7.0, np.float32)
    with pytest.raises(ValueError, match="hx"):
        fwd(hx=A["hx"][:1], training=True, reserve=reserve)
    np.testing.assert_array_equal(reserve, 7.0)


def test_reserve_protocol_errors_name_reserve(backend):
    y, reserve = trained()
    kw = dict(hx=A["hx"], cx=A["cx"], dhy=A["dhy"], dcy=A["dcy"])
    with pytest.raises(ValueError, match="reserve"):
        nc.rnn_backward_weights(LSTM, A["x"], A["params"], reserve, hx=A["hx"])
    nc.rnn_backward_data(LSTM, y, A["dy"], A["params"], reserve, **kw)
    with pytest.raises(ValueError, match="reserve"):
        nc.rnn_backward_data(LSTM, y, A["dy"], A["params"], reserve, **kw)
    with pytest.raises(ValueError, match="reserve"):
        nc.rnn_backward_data(LSTM, y, A["dy"], A["params"], None, **kw)
    with pytest.raises(ValueError, match="reserve"):
        nc.rnn_backward_weights(LSTM, A["x"], A["params"], None, hx=A["hx"])
    # A reserve that never saw a training forward is not mistaken for one.
    blank = np.zeros(nc.rnn_reserve_size(LSTM, T, N), np.float32)
    with pytest.raises(ValueError, match="reserve"):
        nc.rnn_backward_data(LSTM, y, A["dy"], A["params"], blank, **kw)


def test_reserve_size_rejects_bad_sizes():
    with pytest.raises(ERR, match="seq_len"):
        nc.rnn_reserve_size(LSTM, 0, N)
    with pytest.raises(ERR, match="batch"):
        nc.rnn_reserve_size(LSTM, T, 0)


def test_backward_must_match_the_forward(backend):
    """The reserve records the forward's lengths and sizes; a backward that disagrees with
    them is an error, not a silently wrong gradient."""
    kw = dict(hx=A["hx"], cx=A["cx"], dhy=A["dhy"], dcy=A["dcy"])
    y, _, _, reserve = fwd(seq_lengths=[5, 2, 3], training=True)
    for lengths in ([5, 3, 2], None):
        with pytest.raises(ValueError, match="seq_lengths"):
            nc.rnn_backward_data(LSTM, y, A["dy"], A["params"], reserve, **kw,
                                 seq_lengths=lengths)
    nc.rnn_backward_data(LSTM, y, A["dy"], A["params"], reserve, **kw, seq_lengths=[5, 2, 3])
    with pytest.raises(ValueError, match="seq_lengths"):
        nc.rnn_backward_weights(LSTM, A["x"], A["params"], reserve, hx=A["hx"])
    # A shorter sequence than the forward saw (y, dy and x consistent with each other).
    y, reserve = trained()
    with pytest.raises(ValueError, match=r"reserve|\by\b|dy"):
        nc.rnn_backward_data(LSTM, y[:4], A["dy"][:4], A["params"], reserve, **kw)
