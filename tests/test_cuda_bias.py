"""The cuda bias gradient's host-side arithmetic (numbaconv/cuda/_bias.py) without a GPU or
the simulator: the walk a lane takes through dy's rows, run here step for step as the
``bias_sums`` kernel runs it, must visit exactly the offsets of its rows, for contiguous,
channels-last, strided, broadcast (stride 0) and windowed layouts; and the split of the
rows into chunks. The kernel itself runs under the simulator (tests/test_cuda_sim.py)."""

import itertools
import random

import pytest

pytest.importorskip("numba_cuda")

from numbaconv.cuda._bias import TARGET_BLOCKS, walk  # noqa: E402
from numbaconv.cuda._implicit_gemm import row_chunks  # noqa: E402


def walked(w, start: int, count: int) -> list:
    """The offsets (without the channel's) a lane starting at row ``start`` reads, by the
    kernel's arithmetic: decode once, then add the step and carry digit by digit."""
    digits = [0, 0, 0]
    rest = start
    for i in (2, 1, 0)[:w.dims]:
        digits[i], rest = rest % w.sizes[i], rest // w.sizes[i]
    off = rest * w.outer_stride + sum(d * s for d, s in zip(digits, w.strides))
    found = []
    for _ in range(count):
        found.append(off)
        off += w.step
        for i in (2, 1, 0)[:w.dims]:
            digits[i] += w.digits[i]
            if digits[i] >= w.sizes[i]:
                digits[i] -= w.sizes[i]
                off += w.carries[i]
                if i > 3 - w.dims:
                    digits[i - 1] += 1
    return found


def layouts(rng):
    """(images, sizes, strides, image stride) of many dy layouts, channels apart."""
    for _ in range(400):
        n = rng.choice([1, 2, 3])
        sizes = tuple(rng.choice([1, 1, 2, 3, 5, 7]) for _ in range(3))
        k = rng.choice([1, 4])
        kind = rng.choice(["first", "last", "window", "any"])
        if kind == "first":
            yield n, sizes, (sizes[1] * sizes[2], sizes[2], 1), k * sizes[0] * sizes[1] * sizes[2]
        elif kind == "last":
            yield n, sizes, (sizes[1] * sizes[2] * k, sizes[2] * k, k), \
                sizes[0] * sizes[1] * sizes[2] * k
        elif kind == "window":  # a crop of a larger contiguous array
            big = [s + rng.choice([0, 2]) for s in sizes]
            yield n, sizes, (big[1] * big[2], big[2], 1), k * big[0] * big[1] * big[2]
        else:
            yield n, sizes, tuple(rng.choice([0, 1, 2, 5, 40]) for _ in range(3)), \
                rng.choice([0, 1, 7, 300])


def test_a_lane_walks_exactly_its_rows():
    rng = random.Random(5)
    dims_seen = set()
    for n, sizes, strides, image_stride in layouts(rng):
        rows = n * sizes[0] * sizes[1] * sizes[2]
        every = [i * image_stride + a * strides[0] + b * strides[1] + c * strides[2]
                 for i, a, b, c in itertools.product(range(n), *map(range, sizes))]
        for lanes in (1, 2, 8, 32, 256):
            w = walk(sizes, strides, image_stride, lanes)
            dims_seen.add(w.dims)
            assert all(0 <= d < s for d, s in zip(w.digits, w.sizes)), w
            for start in range(min(lanes, rows)):
                want = every[start::lanes]
                assert walked(w, start, len(want)) == want, (sizes, strides, image_stride,
                                                             lanes, start, w)
    assert dims_seen == {0, 1, 2, 3}


def test_contiguous_layouts_need_at_most_one_digit():
    """Channels-last images merge with their positions (no carry at all), channels-first
    positions into one digit under the image."""
    assert walk((4, 5, 6), (5 * 6 * 8, 6 * 8, 8), 4 * 5 * 6 * 8, 32).dims == 0
    assert walk((4, 5, 6), (30, 6, 1), 8 * 120, 32).dims == 1
    assert walk((1, 1, 9), (0, 0, 1), 3 * 9, 256).dims == 1


@pytest.mark.parametrize("rows", [0, 1, 7, 256, 10_000, 3_211_264, 10 ** 10])
@pytest.mark.parametrize("channel_blocks", [1, 8, 256, 5000])
def test_chunks_cover_the_rows_within_the_grid(rows, channel_blocks):
    chunks, chunk_len = row_chunks(rows, channel_blocks, 8, TARGET_BLOCKS)
    assert 1 <= chunks <= 65535 and chunk_len >= 1
    assert (chunks - 1) * chunk_len < max(rows, 1) <= chunks * chunk_len
    assert chunks <= max(1, -(-TARGET_BLOCKS // channel_blocks))
