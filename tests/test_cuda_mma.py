"""The TF32 tensor-core pieces that need neither a GPU nor the simulator: the rounding
(numbaconv/cuda/_mma.py) and the tiles the tensor-core step places its warps on
(numbaconv/cuda/_implicit_gemm_kernels.py). The kernels themselves run under the simulator
(tests/test_cuda_sim.py, ``tf32``) and are read from their machine code
(tests/test_cuda_machine_code.py)."""

import importlib.util
import os

import numpy as np
import pytest

if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed (the cuda extra)", allow_module_level=True)
if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
    pytest.skip("the simulator's own tests are in tests/test_cuda_sim.py",
                allow_module_level=True)

from numbaconv.cuda._implicit_gemm_kernels import (TILES, Tile, _tile_names,  # noqa: E402
                                                   mma_tile)
from numbaconv.cuda._mma import round_tf32  # noqa: E402


def test_round_tf32_rounds_to_nearest_ties_away():
    ulp = 2.0 ** -10                                  # TF32's unit in the last place at 1
    values = np.array([1.0, 1 + ulp / 2, 1 + ulp / 2 - 2.0 ** -23, 1 + 3 * ulp / 2,
                       -(1 + ulp / 2), 1 + ulp / 4, 2.0 ** 20 * (1 + ulp / 2), np.inf,
                       -np.inf, 0.0, -0.0], np.float32)
    want = np.array([1.0, 1 + ulp, 1.0, 1 + 2 * ulp, -(1 + ulp), 1.0,
                     2.0 ** 20 * (1 + ulp), np.inf, -np.inf, 0.0, -0.0], np.float32)
    got = round_tf32(values)
    assert got.dtype == np.float32
    assert np.array_equal(got, want)
    assert np.signbit(got[-1])
    assert np.isnan(round_tf32(np.float32(np.nan)))
    bits = round_tf32(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
    assert not (bits.view(np.uint32) & 0x1FFF).any()       # 13 low bits cleared


def test_tensor_core_tiles():
    """Every float32 tile the driver chooses from runs on tensor cores; the simulator
    suite's 8-row tile (narrower than an m16 product) and odd register tiles do not."""
    assert all(mma_tile(t) for t in TILES)
    from numbaconv.cuda._implicit_gemm import DEEP_TENSOR_CORE_TILES
    for tile, deep in DEEP_TENSOR_CORE_TILES.items():    # 16 deep: a usable tile, same warps
        assert mma_tile(deep.check()) and deep._replace(bk=tile.bk) == tile
    assert not mma_tile(Tile(8, 16, 8, 2, 2))
    assert not mma_tile(Tile(16, 16, 4, 2, 2))
    with pytest.raises(ValueError, match="tensor-core tile"):
        _tile_names(Tile(8, 16, 8, 2, 2), True, 1)


@pytest.mark.parametrize("tc", [False, True], ids=["ffma", "tensor_cores"])
@pytest.mark.parametrize("tile", TILES + (Tile(128, 128, 16, 8, 8), Tile(16, 16, 8, 2, 2),
                                          Tile(16, 16, 16, 2, 2), Tile(32, 16, 8, 2, 4),
                                          Tile(32, 16, 16, 2, 4), Tile(32, 16, 8, 4, 2)),
                         ids=str)
def test_results_cover_the_block_tile_once(tile, tc):
    """The result places the epilogue writes (each thread's first row and column, as the
    templates place it, plus ROWOFF x COLOFF) cover the block tile exactly once."""
    names = _tile_names(tile, tc, 1)
    seen = np.zeros((tile.bm, tile.bn), int)
    for tid in range(tile.threads):
        if tc:
            lane, warp = tid % 32, tid // 32
            row = warp // names["WARPS_N"] * names["WM"] + lane // 4
            col = warp % names["WARPS_N"] * names["WN"] + 2 * (lane % 4)
        else:
            row = tid // names["NTX"] * names["HM"]
            col = tid % names["NTX"] * names["HN"]
        for r in names["ROWOFF"]:
            for c in names["COLOFF"]:
                seen[row + r, col + c] += 1
    assert (seen == 1).all()
