"""The demos' helpers: the zlib PNG writer, the progress bar and the gradient check."""

import io
import struct
import zlib

import numpy as np
import pytest

from numbaconv.demos._gradcheck import directional_gradient_error
from numbaconv.demos._png import encode_png, image_grid, write_png
from numbaconv.demos._progress import ProgressBar


def decode_png(data):
    """Greyscale 8-bit PNG -> (image, chunk types); checks every CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, kinds, idat = 8, [], b""
    while pos < len(data):
        length = struct.unpack(">I", data[pos:pos + 4])[0]
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        crc = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc, kind
        kinds.append(kind)
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert (depth, colour) == (8, 0)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, width + 1)
    assert np.all(raw[:, 0] == 0)  # filter type "none" on every row
    return raw[:, 1:], kinds


def test_png_round_trips(tmp_path):
    image = np.random.default_rng(0).integers(0, 256, (7, 13), dtype=np.uint8)
    write_png(tmp_path / "a.png", image)
    decoded, kinds = decode_png((tmp_path / "a.png").read_bytes())
    assert kinds == [b"IHDR", b"IDAT", b"IEND"]
    np.testing.assert_array_equal(decoded, image)


@pytest.mark.parametrize("bad", [np.zeros((2, 2)), np.zeros((2, 2, 3), np.uint8),
                                 np.zeros((0, 4), np.uint8)])
def test_png_rejects_what_it_cannot_write(bad):
    with pytest.raises(ValueError, match="image"):
        encode_png(bad)


def test_image_grid_lays_out_ink_dark_on_white():
    images = np.zeros((3, 2, 2))
    images[1] = 1.0
    grid = image_grid(images, 2, scale=3, gap=1)
    assert grid.shape == (1 + 2 * (6 + 1), 1 + 2 * (6 + 1))
    assert grid[1:7, 1:7].min() == 255            # blank image: white
    assert grid[1:7, 8:14].max() == 0             # full ink: black
    assert grid[8:14, 8:14].min() == 255          # padding cell of the last row: white
    # Two rows of 8-pixel cells (default scale 4), a 4 * gap wide gap after the first.
    assert image_grid(images, 2, gap=2, row_gaps=(0,)).shape[0] == 2 + (8 + 8) + (8 + 2)


def test_progress_bar_draws_only_on_a_terminal():
    quiet = io.StringIO()
    with ProgressBar(10, stream=quiet) as bar:
        bar.update(5, "half")
    assert quiet.getvalue() == ""
    shown = io.StringIO()
    with ProgressBar(4, stream=shown, enabled=True, width=4) as bar:
        for _ in range(4):
            bar.update(status="loss 1.0")
    text = shown.getvalue()
    assert "[####] 4/4  loss 1.0" in text
    assert text.endswith("\r")  # erased, so the next line starts clean


def test_gradient_error_is_small_for_the_right_gradient_only():
    rng = np.random.default_rng(0)
    p = rng.standard_normal(5)
    loss = lambda: float(np.sum(np.sin(p)))  # noqa: E731
    assert directional_gradient_error(loss, [p], [np.cos(p)], rng) < 1e-7
    assert directional_gradient_error(loss, [p], [1.1 * np.cos(p)], rng) > 1e-2
    with pytest.raises(TypeError, match="float64"):
        directional_gradient_error(loss, [p.astype(np.float32)], [p], rng)
