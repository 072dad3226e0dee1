"""``numbaconv demo lstm``: a few quick epochs of the real thing, and its pieces."""

import sys

import numpy as np
import pytest

import numbaconv as nc
from numbaconv import nn
from numbaconv.__main__ import main
from numbaconv.demos import lstm


def run_cli(capsys, *argv):
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def text_losses(out):
    """The 'text loss' of every epoch line, the one before training first."""
    return [float(line.split("text loss")[1].split()[0])
            for line in out.splitlines() if line.startswith("epoch")]


def test_demo_runs_and_the_loss_falls(capsys):
    status, out, err = run_cli(capsys, "demo", "lstm", "--epochs", "3")
    assert status == 0, out + err
    assert "gradient check" in out and ", ok" in out
    assert "backend 'cpu'" in out
    losses = text_losses(out)
    assert len(losses) == 4 and "epoch   0/3" in out
    assert losses[0] == pytest.approx(np.log(45), rel=0.05)  # a uniform guess, untrained
    assert losses[-1] < (1 - lstm.MIN_LOSS_FALL) * losses[0], out
    samples = [line for line in out.splitlines() if line.startswith("sample")]
    assert len(samples) == len(lstm.PRIMES)
    assert "[" not in err  # no progress bar when stderr is not a terminal


def test_the_reference_backend_trains_the_same_model():
    def first_epoch():
        result = lstm.train(1, 3, hidden_size=32, max_steps=4, log=None, progress=False)
        return result.history[0]

    with nc.use_backend("reference"):
        reference = first_epoch()
    cpu = first_epoch()
    assert reference["loss"] == pytest.approx(cpu["loss"], rel=1e-4)
    assert reference["text_loss"] == pytest.approx(cpu["text_loss"], rel=1e-4)


def test_backend_option_reaches_the_recurrent_ops(capsys, monkeypatch):
    real = lstm.train
    monkeypatch.setattr(lstm, "train", lambda *args, **kwargs: real(*args, **dict(
        kwargs, max_steps=2)))
    _, out, _ = run_cli(capsys, "demo", "lstm", "--epochs", "1", "--backend", "reference")
    assert "recurrent ops run on backend 'reference'" in out
    assert "gradient check" in out and ", ok" in out


def test_the_text_is_the_zen_of_python_read_without_printing(capsys, monkeypatch):
    monkeypatch.delitem(sys.modules, "this", raising=False)
    text = lstm.zen_of_python()
    assert text.startswith("The Zen of Python, by Tim Peters")
    assert "Beautiful is better than ugly." in text and len(text) > 800
    assert capsys.readouterr().out == ""


def test_windows_continue_each_stream_cyclically():
    data = np.arange(20)
    inputs, targets = lstm.windows(data, streams=3, window=4, offset=7)
    assert inputs.shape == targets.shape == (5, 4, 3)
    np.testing.assert_array_equal(targets, (inputs + 1) % 20)  # the next character
    stream = inputs[:, :, 1].ravel()  # stream 1 starts at 7 + 20 // 3 and wraps around
    np.testing.assert_array_equal(stream, (13 + np.arange(20)) % 20)


def test_cross_entropy_and_its_gradient(rng):
    logits = rng.standard_normal((3, 2, 5))
    targets = rng.integers(0, 5, (3, 2))
    loss, dlogits = lstm.cross_entropy(logits, targets)
    p = lstm.softmax(logits)
    expected = -np.mean(np.log(np.take_along_axis(p, targets[..., None], -1)))
    assert loss == pytest.approx(expected, rel=1e-12)
    v, h = rng.standard_normal(logits.shape), 1e-6
    numeric = (lstm.cross_entropy(logits + h * v, targets)[0]
               - lstm.cross_entropy(logits - h * v, targets)[0]) / (2 * h)
    assert numeric == pytest.approx(np.vdot(dlogits, v), rel=1e-7)


def test_the_gradient_check_passes_and_catches_a_wrong_weight_gradient(monkeypatch):
    assert lstm.gradient_check(0) < lstm.GRADIENT_TOLERANCE
    real = nn.rnn_backward_weights

    def off_by_ten_percent(*args, **kwargs):
        dw = real(*args, **kwargs)
        dw *= 1.1
        return dw

    monkeypatch.setattr(nn, "rnn_backward_weights", off_by_ten_percent)
    assert lstm.gradient_check(0) > 1e-3


def test_training_reuses_one_reserve(monkeypatch):
    reserves = set()
    real = nn.rnn_forward

    def recording(*args, **kwargs):
        if kwargs.get("training"):
            reserves.add(id(kwargs["reserve"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(nn, "rnn_forward", recording)
    result = lstm.train(2, 0, max_steps=5, log=None, progress=False)
    assert len(reserves) == 1 and result.model.lstm.reserve is not None


def test_exit_status_is_1_when_the_loss_does_not_fall(monkeypatch):
    real = lstm.train
    monkeypatch.setattr(lstm, "train", lambda *args, **kwargs: real(*args, lr=1e-9, **kwargs))
    lines = []
    assert lstm.run_demo(epochs=1, max_steps=2, log=lines.append) == 1
    assert lines[-1].startswith("FAILED: the loss fell by less than")


def test_exit_status_is_1_when_the_gradient_check_fails(monkeypatch):
    monkeypatch.setattr(lstm, "gradient_check", lambda *args, **kwargs: 0.5)
    lines = []
    assert lstm.run_demo(epochs=1, max_steps=2, log=lines.append) == 1
    assert any("disagree with finite differences" in s for s in lines)


def test_sampling_rejects_characters_the_text_lacks():
    vocab = lstm.Vocabulary("ab\n")
    model = lstm.CharLSTM(len(vocab), 4, rng=0)
    with pytest.raises(ValueError, match="prime"):
        lstm.sample_line(model, vocab, np.random.default_rng(0), "abc")
    line = lstm.sample_line(model, vocab, np.random.default_rng(0), "ab", max_length=5)
    assert set(line) <= {"a", "b"} and len(line) <= 5


def test_blas_runs_on_one_thread_during_the_demo(monkeypatch):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    seen = []
    real = lstm.train

    def recording(*args, **kwargs):
        seen.extend(pool["num_threads"] for pool in threadpoolctl.threadpool_info()
                    if pool["user_api"] == "blas")
        return real(*args, **kwargs)

    monkeypatch.setattr(lstm, "train", recording)
    lines = []
    lstm.run_demo(epochs=1, max_steps=1, log=lines.append)
    assert seen and set(seen) == {1}
    assert "BLAS limited to one thread" in lines[2]


def test_without_threadpoolctl_blas_is_left_as_it_is(monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # importing it raises ImportError
    context, note = lstm.one_blas_thread()
    assert "pip install threadpoolctl" in note
    with context:
        pass
