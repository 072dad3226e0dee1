"""The reserve layout is shared by every backend: a reserve filled by one backend's training
forward is differentiated by another's backward functions, with the same results."""

import itertools

import numpy as np
import pytest

import numbaconv as nc
from numbaconv import problem as pb
from numbaconv import rnn_problem

CONFIGS = [
    nc.RNNConfig("lstm", 3, 4, num_layers=2, bidirectional=True, proj_size=2, dropout=0.3),
    nc.RNNConfig("gru", 3, 4, num_layers=2, bidirectional=True, dropout=0.3),
    nc.RNNConfig("rnn_relu", 3, 4, bidirectional=True),
]


def _step(cfg, backends, lengths):
    rng = np.random.default_rng(1)
    t, n = 5, 3
    x = rng.standard_normal((t, n, cfg.input_size))
    params = nc.rnn_init_params(cfg, seed=2, dtype=np.float64)
    hx = rng.standard_normal((cfg.num_layers * cfg.num_directions, n, cfg.out_size))
    with nc.use_backend(backends[0]):
        y, hy, cy, reserve = nc.rnn_forward(cfg, x, params, hx, training=True,
                                            dropout_seed=7, seq_lengths=lengths)
    dy = rng.standard_normal(y.shape)
    with nc.use_backend(backends[1]):
        dx, dhx, dcx = nc.rnn_backward_data(cfg, y, dy, params, reserve, hx=hx,
                                            seq_lengths=lengths)
    with nc.use_backend(backends[2]):
        dparams = nc.rnn_backward_weights(cfg, x, params, reserve, hx=hx, seq_lengths=lengths)
    return y, dx, dhx, dparams


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.mode)
@pytest.mark.parametrize("lengths", [None, [5, 2, 4]], ids=["full", "lengths"])
def test_a_reserve_moves_between_backends(cfg, lengths):
    expected = _step(cfg, ("cpu", "cpu", "cpu"), lengths)
    for combo in itertools.product(("reference", "cpu"), repeat=3):
        if combo == ("cpu", "cpu", "cpu"):
            continue
        for got, want in zip(_step(cfg, combo, lengths), expected):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=str(combo))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_the_reserve_header_is_exact_in_every_dtype(dtype):
    """T, N and the tags are stored as base-1024 digits, which float16 (the cuda backend's
    half-precision reserves) holds exactly: a whole value would round or overflow to inf."""
    config = nc.RNNConfig("lstm", 7, 5, num_layers=2, proj_size=3)
    lengths = np.array([3000, 17, 2999], dtype=np.int64)
    header = pb.reserve_header(config, 3001, 70000, lengths, pb.RESERVE_FORWARD)
    stored = np.array(header, dtype=dtype)
    assert np.array_equal(stored.astype(np.float64), np.array(header))
    other = pb.reserve_header(config, 3001, 70000, lengths[::-1].copy(), pb.RESERVE_FORWARD)
    assert not np.array_equal(np.array(other, dtype=dtype), stored)
    assert rnn_problem._from_digits(stored[2:5]) == 3001 and rnn_problem._from_digits(stored[5:8]) == 70000


class _DeviceArray:
    """A stand-in device array: a pointer in ``__cuda_array_interface__`` and a header
    that counts its reads."""

    def __init__(self, pointer, header):
        self.pointer, self.header, self.reads = pointer, np.asarray(header), 0

    @property
    def __cuda_array_interface__(self):
        return {"data": (self.pointer, False)}

    def __getitem__(self, index):
        return self

    def copy_to_host(self):
        self.reads += 1
        return self.header.copy()


def test_a_device_header_record_lasts_while_its_array_and_memory_do():
    """``record_header`` notes what numbaconv wrote to a device reserve: checks then read
    the note, not the device, while the same array object holds the same memory; a partial
    write starts no note, and a dead array's note goes with it."""
    on_device = np.full(pb.RESERVE_HEADER, 9.0, np.float32)
    a = _DeviceArray(4096, on_device)
    pb.record_header(a, 1, [2.0], "float32")             # a header not seen whole
    np.testing.assert_array_equal(rnn_problem._device_header(a), on_device)
    assert a.reads == 1
    written = np.arange(pb.RESERVE_HEADER, dtype=np.float32)
    pb.record_header(a, 0, written, "float32")
    pb.record_header(a, 1, [5.0], "float32")
    noted = rnn_problem._device_header(a)
    assert a.reads == 1 and noted[1] == 5 and noted[2] == 2
    a.pointer = 8192                                      # its memory changed under it
    np.testing.assert_array_equal(rnn_problem._device_header(a), on_device)
    assert a.reads == 2
    b = _DeviceArray(4096, on_device)
    pb.record_header(b, 0, written, "float32")
    key = id(b)
    assert key in rnn_problem._DEVICE_HEADERS
    del b
    assert key not in rnn_problem._DEVICE_HEADERS
