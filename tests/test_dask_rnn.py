"""numbaconv.dask's recurrent functions: per-block training forward with persisted reserves,
backward data and backward weights, equal to the whole-batch call on the concatenated
batch, on the threaded scheduler and on a two-process LocalCluster."""

import numpy as np
import pytest

dask = pytest.importorskip("dask", reason="the dask extra is not installed")
da = pytest.importorskip("dask.array", reason="the dask extra is not installed")

import numbaconv as nc  # noqa: E402
import numbaconv.dask as ncd  # noqa: E402

T, N = 5, 7
CONFIGS = {
    "lstm_proj_bi_2l": nc.RNNConfig("lstm", 3, 4, num_layers=2, bidirectional=True,
                                    proj_size=2),
    "gru_batch_first": nc.RNNConfig("gru", 3, 4, batch_first=True),
    "rnn_tanh_2l": nc.RNNConfig("rnn_tanh", 3, 5, num_layers=2),
}


def operands(cfg, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    x_shape = (N, T, cfg.input_size) if cfg.batch_first else (T, N, cfg.input_size)
    states = cfg.num_layers * cfg.num_directions
    a = dict(x=rng.standard_normal(x_shape).astype(dtype),
             params=nc.rnn_init_params(cfg, seed=seed, dtype=dtype),
             hx=rng.standard_normal((states, N, cfg.out_size)).astype(dtype),
             dy=rng.standard_normal(x_shape[:2] + (cfg.num_directions * cfg.out_size,)
                                    ).astype(dtype),
             dhy=rng.standard_normal((states, N, cfg.out_size)).astype(dtype))
    if cfg.mode == "lstm":
        a["cx"] = rng.standard_normal((states, N, cfg.hidden_size)).astype(dtype)
        a["dcy"] = rng.standard_normal((states, N, cfg.hidden_size)).astype(dtype)
    return a


def whole_batch(cfg, a, lengths):
    y, hy, cy, r = nc.rnn_forward(cfg, a["x"], a["params"], a["hx"], a.get("cx"),
                                  seq_lengths=lengths, training=True)
    dx, dhx, dcx = nc.rnn_backward_data(cfg, y, a["dy"], a["params"], r, hx=a["hx"],
                                        cx=a.get("cx"), dhy=a["dhy"], dcy=a.get("dcy"),
                                        seq_lengths=lengths)
    dp = nc.rnn_backward_weights(cfg, a["x"], a["params"], r, hx=a["hx"],
                                 seq_lengths=lengths)
    return dict(y=y, hy=hy, cy=cy, dx=dx, dhx=dhx, dcx=dcx, dparams=dp)


def sharded(cfg, a, lengths, chunks, scheduler="threads", **extra):
    axis = 0 if cfg.batch_first else 1
    x = da.from_array(a["x"], chunks={axis: chunks})
    dy = da.from_array(a["dy"], chunks={axis: chunks})
    y, hy, cy, r = ncd.rnn_forward(cfg, x, a["params"], a["hx"], a.get("cx"),
                                   seq_lengths=lengths, training=True, scheduler=scheduler)
    dx, dhx, dcx = ncd.rnn_backward_data(cfg, y, dy, a["params"], r, hx=a["hx"],
                                         cx=a.get("cx"), dhy=a["dhy"], dcy=a.get("dcy"),
                                         seq_lengths=lengths, scheduler=scheduler)
    dp = ncd.rnn_backward_weights(cfg, x, a["params"], r, hx=a["hx"], seq_lengths=lengths,
                                  scheduler=scheduler, **extra)
    lazy = dict(y=y, hy=hy, cy=cy, dx=dx, dhx=dhx, dcx=dcx)
    assert y.chunks[axis] == tuple(chunks) and dx.chunks[axis] == tuple(chunks)
    computed = dict(zip(lazy, dask.compute(*lazy.values(), scheduler=scheduler)))
    return dict(computed, dparams=dp), r


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("chunks", [(7,), (3, 3, 1), (1,) * 7])
@pytest.mark.parametrize("lengths", [None, [5, 2, 4, 1, 3, 5, 5]], ids=["full", "lengths"])
def test_sharded_training_step_equals_the_whole_batch(name, chunks, lengths):
    cfg = CONFIGS[name]
    a = operands(cfg)
    want = whole_batch(cfg, a, lengths)
    got, reserve = sharded(cfg, a, lengths, chunks)
    assert reserve.state == "backward_data" and len(reserve.blocks) == len(chunks)
    for key, value in want.items():
        if value is None:
            assert got[key] is None, key
        else:
            np.testing.assert_allclose(got[key], value, rtol=1e-12, atol=1e-12, err_msg=key)


def test_float32_and_lazy_weight_gradient_with_out():
    cfg = CONFIGS["lstm_proj_bi_2l"]
    a = operands(cfg, np.float32)
    want = whole_batch(cfg, a, None)["dparams"]
    axis = 1
    x = da.from_array(a["x"], chunks={axis: (4, 3)})
    dy = da.from_array(a["dy"], chunks={axis: (4, 3)})
    y, _, _, r = ncd.rnn_forward(cfg, x, a["params"], a["hx"], a["cx"], training=True)
    ncd.rnn_backward_data(cfg, y, dy, a["params"], r, hx=a["hx"], cx=a["cx"], dhy=a["dhy"],
                          dcy=a["dcy"])
    lazy = ncd.rnn_backward_weights(cfg, x, a["params"], r, hx=a["hx"], compute=False)
    assert isinstance(lazy, da.Array) and lazy.shape == (cfg.num_params,)
    np.testing.assert_allclose(lazy.compute(), want, rtol=2e-5, atol=2e-5)
    out = np.ones_like(want)
    got = ncd.rnn_backward_weights(cfg, x, a["params"], r, hx=a["hx"], out=out,
                                   accumulate=True)
    assert got is out
    np.testing.assert_allclose(out, want + 1, rtol=2e-5, atol=2e-5)


def test_reserve_protocol_and_chunking_errors():
    cfg = CONFIGS["rnn_tanh_2l"]
    a = operands(cfg)
    x = da.from_array(a["x"], chunks={1: (3, 4)})
    dy = da.from_array(a["dy"], chunks={1: (3, 4)})
    y, _, _, r = ncd.rnn_forward(cfg, x, a["params"], training=True)
    with pytest.raises(ValueError, match="reserve: expected rnn_backward_data"):
        ncd.rnn_backward_weights(cfg, x, a["params"], r)
    ncd.rnn_backward_data(cfg, y, dy, a["params"], r)
    with pytest.raises(ValueError, match="reserve: rnn_backward_data already ran"):
        ncd.rnn_backward_data(cfg, y, dy, a["params"], r)
    with pytest.raises(TypeError, match="reserve"):
        ncd.rnn_backward_data(cfg, y, dy, a["params"], np.zeros(10))
    with pytest.raises(ValueError, match="x: expected chunks along the batch axis"):
        ncd.rnn_forward(cfg, da.from_array(a["x"], chunks=(2, 3, 3)), a["params"])
    y2 = ncd.rnn_forward(cfg, da.from_array(a["x"], chunks=(2, 3, 3)), a["params"],
                         rechunk=True)[0]
    np.testing.assert_allclose(y2.compute(), nc.rnn_forward(cfg, a["x"], a["params"])[0],
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="input_size|x"):  # the whole-batch validation
        ncd.rnn_forward(cfg, da.zeros((T, N, 9), chunks=(T, 3, 9)), a["params"])


def test_dropout_masks_per_block_are_reproducible():
    cfg = nc.RNNConfig("lstm", 3, 4, num_layers=2, dropout=0.5)
    a = operands(cfg)
    x = da.from_array(a["x"], chunks={1: (3, 4)})

    def forward(seed):
        return ncd.rnn_forward(cfg, x, a["params"], training=True, dropout_seed=seed)[0]

    first, again, other = (forward(s).compute() for s in (11, 11, 12))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_local_cluster_training_step(local_cluster):
    distributed = pytest.importorskip("distributed")
    cfg = CONFIGS["lstm_proj_bi_2l"]
    a = operands(cfg)
    lengths = [5, 2, 4, 1, 3, 5, 5]
    with distributed.Client(local_cluster) as client:
        got, _ = sharded(cfg, a, lengths, (4, 3), scheduler=client)
    want = whole_batch(cfg, a, lengths)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-12, atol=1e-12, err_msg=key)
