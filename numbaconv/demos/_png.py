"""Writing greyscale images as PNG files with nothing but NumPy and zlib.

The autoencoder demo saves one picture; matplotlib or Pillow for that would be tens of
megabytes of dependencies and a second of import time. A PNG is a signature and three
chunks (IHDR, IDAT, IEND), each a length, a type, data and a CRC-32; the pixels are rows of
bytes, each preceded by a filter byte (0, none), compressed with zlib.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def encode_png(image: np.ndarray) -> bytes:
    """A greyscale image as the bytes of a PNG file.

    Parameters
    ----------
    image : ndarray of uint8, shape (height, width)
        0 is black, 255 white.

    Returns
    -------
    bytes
    """
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 2 or 0 in image.shape:
        raise ValueError(f"image: expected a non-empty 2-D uint8 array, got {image.dtype} "
                         f"of shape {image.shape}")
    height, width = image.shape
    # IHDR: width, height, bit depth 8, colour type 0 (greyscale), default compression,
    # filter method and no interlacing.
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    rows = np.hstack([np.zeros((height, 1), np.uint8), image])  # filter byte 0 per row
    return (PNG_SIGNATURE + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)) + _chunk(b"IEND", b""))


def write_png(path, image: np.ndarray) -> None:
    """Write ``image`` (see :func:`encode_png`) to ``path``."""
    data = encode_png(image)
    with open(path, "wb") as f:
        f.write(data)


def image_grid(images: np.ndarray, columns: int, *, scale: int = 4, gap: int = 2,
               row_gaps: tuple = ()) -> np.ndarray:
    """Tile images into one greyscale picture, ink dark on white.

    Parameters
    ----------
    images : ndarray, shape (n, h, w)
        Intensities in [0, 1] (clipped), 1 meaning ink; filled row by row.
    columns : int
        Images per row; the last row is padded with blanks.
    scale : int
        Each pixel becomes a ``scale`` x ``scale`` block (8x8 digits are too small to see).
    gap : int
        White pixels between images.
    row_gaps : tuple of int
        Rows after which to leave a wider gap (``4 * gap``), to group rows visually.

    Returns
    -------
    ndarray of uint8, shape (height, width)
    """
    images = np.clip(np.asarray(images, dtype=np.float64), 0.0, 1.0)
    n, h, w = images.shape
    rows = -(-n // columns)
    cell_h, cell_w = h * scale, w * scale
    gaps = [gap * (4 if r in row_gaps else 1) for r in range(rows)]
    canvas = np.full((gap + sum(cell_h + g for g in gaps), gap + columns * (cell_w + gap)),
                     255, np.uint8)
    top = gap
    for r in range(rows):
        for c in range(columns):
            i = r * columns + c
            if i >= n:
                break
            tile = np.kron(images[i], np.ones((scale, scale)))
            left = gap + c * (cell_w + gap)
            canvas[top:top + cell_h, left:left + cell_w] = np.round(255 * (1 - tile))
        top += cell_h + gaps[r]
    return canvas
