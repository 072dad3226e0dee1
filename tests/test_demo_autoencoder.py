"""``numbaconv demo autoencoder``: a few quick steps of the real thing (needs scikit-learn,
which the ``test`` extra installs)."""

import zlib

import numpy as np
import pytest

pytest.importorskip("sklearn")

from numbaconv.__main__ import main  # noqa: E402
from numbaconv.demos import autoencoder  # noqa: E402


def run_cli(capsys, *argv):
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def read_png_size(path):
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    return width, height


def test_digits_load_as_images_in_the_unit_interval():
    images, labels = autoencoder.load_digits_images()
    assert images.shape == (1797, 1, 8, 8) and images.dtype == np.float32
    assert images.min() == 0 and images.max() == 1
    assert set(labels.tolist()) == set(range(10))


def test_demo_runs_learns_and_saves_the_picture(capsys, tmp_path):
    png = tmp_path / "reconstructions.png"
    status, out, err = run_cli(capsys, "demo", "autoencoder", "--epochs", "2",
                               "--output", str(png))
    assert status == 0, out + err
    assert "gradient check" in out and ", ok" in out
    assert "epoch   0/2" in out and out.count("test loss") >= 3
    losses = [float(line.split("test loss")[1].split()[0])
              for line in out.splitlines() if line.startswith("epoch")]
    assert losses[-1] < 0.9 * losses[0], out
    assert read_png_size(png)[0] > 10 * 8 * 5  # ten digits a row, scaled up
    assert "[" not in err  # no progress bar when stderr is not a terminal


def test_the_defaults_are_what_the_readme_runs():
    assert autoencoder.DEFAULT_EPOCHS >= 10  # a clearly falling loss, in seconds


def test_training_a_few_steps_lowers_the_held_out_loss():
    result = autoencoder.train(epochs=1, max_steps=15, log=None, progress=False)
    assert len(result.history) == 1
    assert result.test_loss < result.initial_test_loss
    assert result.test_images.shape[1:] == (1, 8, 8)


def test_the_gradient_check_passes_and_catches_a_wrong_weight_gradient(monkeypatch):
    assert autoencoder.gradient_check(0, batch=4) < autoencoder.GRADIENT_TOLERANCE
    from numbaconv import nn
    real = nn.conv_backward_weight

    def off_by_ten_percent(*args, **kwargs):
        dw = real(*args, **kwargs)
        dw *= 1.1
        return dw

    monkeypatch.setattr(nn, "conv_backward_weight", off_by_ten_percent)
    assert autoencoder.gradient_check(0, batch=4) > 1e-3


def test_exit_status_is_1_when_the_loss_does_not_fall(monkeypatch, tmp_path):
    real = autoencoder.train
    monkeypatch.setattr(autoencoder, "train",
                        lambda *args, **kwargs: real(*args, lr=1e-9, **kwargs))
    lines = []
    status = autoencoder.run_demo(epochs=1, max_steps=2, output=None, log=lines.append)
    assert status == 1
    assert lines[-1].startswith("FAILED: the held-out loss fell by less than")


def test_exit_status_is_1_when_the_gradient_check_fails(monkeypatch):
    monkeypatch.setattr(autoencoder, "gradient_check", lambda *args, **kwargs: 0.5)
    lines = []
    status = autoencoder.run_demo(epochs=1, max_steps=2, output=None, log=lines.append)
    assert status == 1 and any("disagree with finite differences" in s for s in lines)


def test_the_reference_backend_trains_the_same_model(capsys, tmp_path):
    status, out, _ = run_cli(capsys, "demo", "autoencoder", "--epochs", "1", "--backend",
                             "reference", "--output", str(tmp_path / "r.png"))
    assert status == 0 and "backend 'reference'" in out


def test_the_picture_holds_originals_above_reconstructions(tmp_path):
    images, labels = autoencoder.load_digits_images()
    model = autoencoder.Autoencoder(0)
    picture = autoencoder.save_reconstructions(tmp_path / "p.png", model, images[:100],
                                               labels[:100], per_digit=1)
    assert read_png_size(tmp_path / "p.png") == (picture.shape[1], picture.shape[0])
    # Two rows of 8x8 digits at 5x: 2 * 40 pixels plus the gaps.
    assert 80 < picture.shape[0] < 100
    data = (tmp_path / "p.png").read_bytes()
    assert zlib.crc32(data[12:29]) == int.from_bytes(data[29:33], "big")  # IHDR's CRC
