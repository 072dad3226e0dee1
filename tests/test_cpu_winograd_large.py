"""The ``winograd`` algorithm's larger tiles, F(4x4, 3x3) (``_winograd.forward_large`` and
``weight_gradient_large``, kernels in ``_winograd_f4``): the forward, the data gradient
(over NaN, and accumulated), the transposed convolution and the weight gradient (and
accumulated) against the reference on every case of test_cpu_winograd, in both layouts
(channels-first through channels-last copies) and both dtypes, with the heuristic's
thresholds lowered so that every case takes them; jobs that cut tile rows and images;
outputs that are not whole tiles (a larger copy cropped, a zero-padded copy of dy);
non-finite values (recomputed by im2col); the transformed weights; the float32 error at the
deepest sum the heuristic allows, and on a long sum of tiles, against float64; the weight
gradient bit for bit the same on one thread or two; the heuristic's choice; a
NUMBA_BOUNDSCHECK=1 pass.
"""

import numpy as np
import pytest

from numbaconv import dispatch
from numbaconv import problem as pb
from numbaconv.testing import relative_error

import background
from test_cpu_winograd import (CASES, CASES_3D, TOL, _check_3d, _check_all_ops,
                               test_non_finite_values_propagate_like_the_reference)


def force_large_tiles(monkeypatch):
    """Every channels-last 2D winograd forward form (channels-first ones through copies)
    takes F(4x4, 3x3); returns the list that records each run of it."""
    from numbaconv.cpu import _heuristics, _winograd
    for name, value in (("WINOGRAD_LARGE_MIN_CHANNELS", 1), ("WINOGRAD_LARGE_MIN_TILES", 1),
                        ("WINOGRAD_LARGE_MIN_SAVING", 0),
                        ("WINOGRAD_LARGE_3D_MIN_SLICE_TILES", 1)):
        monkeypatch.setattr(_heuristics, name, value)
    monkeypatch.setattr(_heuristics, "winograd_via_copies", lambda c, k: True)
    runs = []
    for name in ("forward_large", "weight_gradient_large"):
        real = getattr(_winograd, name)
        monkeypatch.setattr(_winograd, name,
                            lambda *a, real=real, name=name: runs.append(name) or real(*a))
    return runs


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_large_tiles_match_the_reference(monkeypatch, case, layout, dtype):
    runs = force_large_tiles(monkeypatch)
    _check_all_ops(case, dtype, layout)
    # Forward, data gradient, transposed (accumulated: col2im); weight gradient, twice.
    assert runs == ["forward_large"] * 3 + ["weight_gradient_large"] * 2


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("case", CASES_3D, ids=[c[0] for c in CASES_3D])
def test_3d_large_tiles_match_the_reference(monkeypatch, case, layout, dtype):
    """3x3x3 kernels, F(4x4, 3x3) on each depth slice, summed over the depth taps inside x
    (padding slices on either side, or every tap in the padding)."""
    runs = force_large_tiles(monkeypatch)
    _check_3d(case, dtype, layout)
    assert runs == ["forward_large"] * 3 + ["weight_gradient_large"] * 2


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("tiles", [1, 3])
def test_3d_large_tile_jobs_split_each_depth_slice(monkeypatch, layout, tiles):
    """Jobs of 1 and 3 tiles (of 2 x 3 tiles a slice) with their workspaces filled with
    garbage first."""
    from numbaconv.cpu import _tiles, _winograd
    runs = force_large_tiles(monkeypatch)
    monkeypatch.setattr(_winograd, "LARGE_MIN_JOB_TILES", tiles)
    monkeypatch.setattr(_winograd, "JOB_BYTES", 1)
    real = _tiles.workspace

    def garbage(shape, dtype, slot="packed"):
        buffer = real(shape, dtype, slot)
        buffer[...] = np.nan
        return buffer

    monkeypatch.setattr(_tiles, "workspace", garbage)
    _check_3d(("3d-jobs", (2, 3, 4, 7, 10), ((2, 0), (1, 1), (1, 1)), 4), "float64", layout)
    assert "forward_large" in runs and "weight_gradient_large" in runs


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("tiles", [1, 3, 5])
def test_large_tile_jobs_cut_tile_rows_and_images(monkeypatch, layout, tiles):
    from numbaconv.cpu import _winograd
    runs = force_large_tiles(monkeypatch)
    monkeypatch.setattr(_winograd, "LARGE_MIN_JOB_TILES", tiles)
    monkeypatch.setattr(_winograd, "JOB_BYTES", 1)
    # 3 x 4 tiles an image (9 x 13 outputs, partial tiles at both edges): jobs of 5 tiles
    # end inside tile rows and images.
    _check_all_ops(("jobs", (3, 4, 9, 13), 1, 5), "float64", layout)
    assert "weight_gradient_large" in runs and "forward_large" in runs


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_large_tiles_non_finite_values_propagate_like_the_reference(monkeypatch, layout):
    runs = force_large_tiles(monkeypatch)
    test_non_finite_values_propagate_like_the_reference(layout)
    assert runs


def test_the_large_transformed_weights_are_g_w_g_transposed():
    from numbaconv.cpu import _winograd
    from numbaconv._kernel_geometry import geom
    rng = np.random.default_rng(4)
    w = rng.standard_normal((5, 3, 3, 3))
    g = geom(pb.conv_problem(np.zeros((1, 4, 4, 3)), w, layout="channels_last"))
    G = np.array([[1, 0, 0], [-1 / 3, -1 / 3, -1 / 3], [1 / 3, -1 / 3, 1 / 3],
                  [1 / 15, 2 / 15, 4 / 15], [-16 / 15, 8 / 15, -4 / 15], [0, 0, 1]])
    expected = np.einsum("ai,kcij,bj->abck", G, w, G).reshape(36, 3, 5)
    np.testing.assert_allclose(_winograd.large_weights(g, w, False), expected, rtol=1e-14,
                               atol=1e-14)
    # Flipped: the data gradient's weight for the forward form over dy (w's K channels in).
    flipped = np.einsum("ai,kcij,bj->abkc", G, w[..., ::-1, ::-1], G).reshape(36, 5, 3)
    np.testing.assert_allclose(_winograd.large_weights(g._replace(c=5, k=3), w, True),
                               flipped, rtol=1e-14, atol=1e-14)


def test_weight_gradient_float32_error_over_many_tiles(monkeypatch):
    """The weight gradient sums U ⊙ D over every tile (here 2 x 16 x 16 4x4 tiles) before
    G^T dV G: its float32 error against float64 stays within the tests' tolerance."""
    runs = force_large_tiles(monkeypatch)
    rng = np.random.default_rng(6)
    x, dy = rng.standard_normal((2, 64, 64, 8)), rng.standard_normal((2, 64, 64, 8))
    kw = dict(padding=1, layout="channels_last")
    backend = dispatch.get_backend("cpu")
    exact = backend.run("conv_backward_weight", pb.conv_backward_weight_problem(
        x, dy, (8, 8, 3, 3), **kw), (x, dy), None, "im2col")
    x32, dy32 = x.astype(np.float32), dy.astype(np.float32)
    got = backend.run("conv_backward_weight", pb.conv_backward_weight_problem(
        x32, dy32, (8, 8, 3, 3), **kw), (x32, dy32), None, "winograd")
    assert runs == ["weight_gradient_large"]
    assert relative_error(got, exact) < TOL["float32"]


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_the_large_weight_gradient_is_the_same_bit_for_bit_on_one_thread_or_two(layout):
    """The partial sums follow the shape, not the thread count (run in two interpreters,
    NUMBA_NUM_THREADS 1 and 2, so that both the Numba and the tile-worker counts change)."""
    import json
    import os
    import subprocess
    import sys
    code = ("import json, sys, numpy as np, pytest\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "from test_cpu_winograd_large import force_large_tiles\n"
            "from numbaconv import dispatch, problem as pb\n"
            "rng = np.random.default_rng(7)\n"
            "layout = sys.argv[2]\n"
            "shape = (4, 14, 18, 6) if layout == 'channels_last' else (4, 6, 14, 18)\n"
            "x = rng.standard_normal(shape).astype(np.float32)\n"
            "dy = rng.standard_normal(shape[:-1] + (10,) if layout == 'channels_last' else "
            "(4, 10) + shape[2:]).astype(np.float32)\n"
            "with pytest.MonkeyPatch.context() as mp:\n"
            "    runs = force_large_tiles(mp)\n"
            "    from numbaconv.cpu import _winograd\n"
            "    mp.setattr(_winograd, 'LARGE_MIN_JOB_TILES', 2)\n"
            "    mp.setattr(_winograd, 'JOB_BYTES', 1)\n"
            "    p = pb.conv_backward_weight_problem(x, dy, (10, 6, 3, 3), padding=1, "
            "layout=layout)\n"
            "    dw = dispatch.get_backend('cpu').run('conv_backward_weight', p, (x, dy), "
            "None, 'winograd')\n"
            "    assert runs == ['weight_gradient_large'], runs\n"
            "print(json.dumps(dw.ravel().view(np.uint32).tolist()))\n")
    here = os.path.dirname(os.path.abspath(__file__))
    bits = []
    for threads in ("1", "2"):
        env = dict(os.environ, NUMBA_NUM_THREADS=threads)
        out = subprocess.run([sys.executable, "-c", code, here, layout], env=env,
                             capture_output=True, text=True, check=True, timeout=600)
        bits.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert bits[0] == bits[1]


@pytest.mark.parametrize("op", ["conv", "conv_backward_data"])
def test_float32_error_at_the_deepest_sum_allowed(monkeypatch, op):
    """Summed over WINOGRAD_LARGE_MAX_DEPTH channels in float32, F(4x4, 3x3)'s largest
    difference from the float64 result, over the largest value, stays within the tests'
    tolerance (and within 15 times im2col's)."""
    from numbaconv.cpu import _heuristics
    runs = force_large_tiles(monkeypatch)
    depth = _heuristics.WINOGRAD_LARGE_MAX_DEPTH
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 8, 8, depth))
    w = rng.standard_normal((16, depth, 3, 3)) if op == "conv" else \
        rng.standard_normal((depth, 16, 3, 3))
    kw = dict(padding=1, layout="channels_last")
    backend = dispatch.get_backend("cpu")
    if op == "conv":
        exact = backend.run("conv", pb.conv_problem(x, w, **kw), (x, w, None), None, "im2col")
    else:
        dy = x
        shape = (2, 8, 8, 16)
        exact = backend.run("conv_backward_data", pb.conv_backward_data_problem(
            dy, w, shape, **kw), (dy, w), None, "im2col")
    errors = {}
    for algorithm in ("winograd", "im2col"):
        x32, w32 = x.astype(np.float32), w.astype(np.float32)
        if op == "conv":
            got = backend.run("conv", pb.conv_problem(x32, w32, **kw), (x32, w32, None), None,
                              algorithm)
        else:
            got = backend.run("conv_backward_data", pb.conv_backward_data_problem(
                x32, w32, shape, **kw), (x32, w32), None, algorithm)
        errors[algorithm] = relative_error(got, exact)
    assert runs
    assert errors["winograd"] < TOL["float32"], errors
    assert errors["winograd"] < 15 * errors["im2col"], errors


def test_the_heuristic_takes_large_tiles_on_wide_images_only():
    from numbaconv.cpu import _heuristics
    from numbaconv._kernel_geometry import geom

    def large(n, c, size, k=None, layout="channels_last"):
        k = k or c
        x = np.zeros((n, size, size, c) if layout == "channels_last" else (n, c, size, size),
                     np.float32)
        return _heuristics.winograd_large_tiles(geom(pb.conv_problem(
            x, np.zeros((k, c, 3, 3), np.float32), padding=1, layout=layout)), 4)

    assert large(8, 64, 56) and large(8, 128, 28) and large(128, 64, 8) and large(1, 64, 56)
    assert not large(8, 256, 14)           # 1.36 times fewer multiplications only
    assert not large(8, 512, 7)            # 32 tiles: V costs more than it saves
    assert not large(2, 128, 28)           # 98 tiles
    assert not large(8, 32, 56) and not large(8, 64, 56, k=32)     # narrow products
    assert not large(8, 1024, 28, k=64)    # the float32 error of a deeper sum
    assert not large(8, 64, 56, layout="channels_first")  # only through channels-last copies
    def large3(c, size):
        x3 = np.zeros((2, 8, size, size, c), np.float32)
        return _heuristics.winograd_large_tiles(geom(pb.conv_problem(
            x3, np.zeros((c, c, 3, 3, 3), np.float32), padding=1, layout="channels_last")), 4)

    assert large3(64, 28) and large3(128, 28)
    assert not large3(64, 24)              # 36 tiles a depth slice: thin products
    assert not large3(256, 28)             # 768 summed channels
    # The weight gradient's 16 partial sums of 36 values per pair of channels count against
    # the workspace bound (64 MiB here): 128 x 128 fits, 192 x 192 does not.
    g = geom(pb.conv_problem(np.zeros((8, 28, 28, 128), np.float32),
                             np.zeros((128, 128, 3, 3), np.float32), padding=1,
                             layout="channels_last"))
    assert _heuristics.winograd_large_tiles(g, 4, 16)
    assert not _heuristics.winograd_large_tiles(g._replace(c=192, k=192), 4, 16)
    assert _heuristics.winograd_large_tiles(g._replace(c=192, k=192), 4)


BOUNDSCHECK = background.boundscheck(
    "winograd F(4x4, 3x3) kernels under NUMBA_BOUNDSCHECK",
    "import pytest\n"
    "from test_cpu_winograd import CASES, CASES_3D, _check_3d, _check_all_ops\n"
    "from test_cpu_winograd_large import force_large_tiles\n"
    "from numbaconv.cpu import _winograd\n"
    "with pytest.MonkeyPatch.context() as monkeypatch:\n"
    "    runs = force_large_tiles(monkeypatch)\n"
    "    for tiles in (None, 3):\n"
    "        if tiles:\n"
    "            monkeypatch.setattr(_winograd, 'LARGE_MIN_JOB_TILES', tiles)\n"
    "            monkeypatch.setattr(_winograd, 'JOB_BYTES', 1)\n"
    "        for c in CASES:\n"
    "            for layout in ('channels_first', 'channels_last'):\n"
    "                _check_all_ops(c, 'float64', layout)\n"
    "        for c in CASES_3D:\n"
    "            for layout in ('channels_first', 'channels_last'):\n"
    "                _check_3d(c, 'float64', layout)\n"
    "    assert runs\n")


@BOUNDSCHECK.mark
def test_large_tile_kernels_stay_in_bounds_under_numba_boundscheck():
    """Every case in both layouts, whole and in jobs of 3 tiles, compiled with
    NUMBA_BOUNDSCHECK=1."""
    BOUNDSCHECK.result().check()


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_whole_call_scratch_comes_from_the_workspace(monkeypatch, layout):
    """The scratch arrays as large as an operand (channels-last copies of a channels-first
    x, dy and y, the padded input, the transformed weights, the weight gradient's slot
    partials, U's and D's planes) come from the calling thread's workspace, kept from call
    to call (a fresh one faults in a page at a time): filled with finite garbage when handed
    out, every form still matches the reference (each buffer is written whole before it is
    read), and a second call is handed the same buffers."""
    from numbaconv.cpu import _heuristics, _tiles
    real = _tiles.workspace
    handed = {}

    def poisoned(shape, dtype, slot="packed"):
        buffer = real(shape, dtype, slot)
        buffer[...] = 7
        handed.setdefault(slot, set()).add(
            buffer.__array_interface__["data"][0] if buffer.size else 0)
        return buffer

    monkeypatch.setattr(_tiles, "workspace", poisoned)
    force_large_tiles(monkeypatch)
    for case in CASES[:2]:
        _check_all_ops(case, "float64", layout)
    monkeypatch.setattr(_heuristics, "winograd_large_tiles", lambda *a, **k: False)
    monkeypatch.setattr(_heuristics, "WINOGRAD_BY_PANELS_TILES", 10**9)
    monkeypatch.setattr(_heuristics, "WINOGRAD_WGRAD_BY_PANELS_TILES", 10**9)
    monkeypatch.setattr(_heuristics, "WINOGRAD_WGRAD_BY_PANELS_MIN_TILES", 0)
    for case in CASES[:2]:
        _check_all_ops(case, "float64", layout)
    want = {"padded", "weights_v", "slot_sums", "planes_u", "planes_d"}
    if layout == "channels_first":
        want |= {"layout_x", "layout_y", "layout_dy"}
    assert want <= set(handed), sorted(handed)
    before = {slot: real((1,), np.float64, slot).__array_interface__["data"][0]
              for slot in want}
    _check_all_ops(CASES[0], "float64", layout)
    assert before == {slot: real((1,), np.float64, slot).__array_interface__["data"][0]
                      for slot in want}


def test_whole_call_scratch_above_the_keep_limit_is_the_calls_own(monkeypatch):
    from numbaconv.cpu import _tiles
    monkeypatch.setattr(_tiles, "KEEP_SCRATCH_BYTES", 64)
    small = _tiles.scratch((8,), np.float64, "padded")
    assert np.shares_memory(small, _tiles.scratch((8,), np.float64, "padded"))
    large = _tiles.scratch((9,), np.float64, "padded")
    assert not np.shares_memory(large, _tiles.scratch((9,), np.float64, "padded"))
    assert not np.shares_memory(large, small)
    packed = _tiles.workspace((9,), np.float64, "packed")          # a tile slot: kept
    assert np.shares_memory(packed, _tiles.workspace((9,), np.float64, "packed"))
