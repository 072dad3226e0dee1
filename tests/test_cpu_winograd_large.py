"""The ``winograd`` algorithm's larger tiles, F(4x4, 3x3) (``_winograd.forward_large``,
kernels in ``_winograd_f4``): the forward, the data gradient (over NaN, and accumulated) and
the transposed convolution against the reference on every case of test_cpu_winograd, in
both layouts (channels-first through channels-last copies) and both dtypes, with the
heuristic's thresholds lowered so that every case takes them; jobs that cut tile rows and
images; outputs that are not whole tiles (a larger copy cropped); non-finite values
(recomputed by im2col); the transformed weights; the float32 error at the deepest sum the
heuristic allows, against float64; the heuristic's choice; a NUMBA_BOUNDSCHECK=1 pass.
"""

import numpy as np
import pytest

from numbaconv import dispatch
from numbaconv import problem as pb
from numbaconv.testing import relative_error

import background
from test_cpu_winograd import (CASES, TOL, _arrays, _check_forward_forms,
                               test_non_finite_values_propagate_like_the_reference)


def force_large_tiles(monkeypatch):
    """Every channels-last 2D winograd forward form (channels-first ones through copies)
    takes F(4x4, 3x3); returns the list that records each run of it."""
    from numbaconv.cpu import _heuristics, _winograd
    for name, value in (("WINOGRAD_LARGE_MIN_CHANNELS", 1), ("WINOGRAD_LARGE_MIN_TILES", 1),
                        ("WINOGRAD_LARGE_MIN_SAVING", 0)):
        monkeypatch.setattr(_heuristics, name, value)
    monkeypatch.setattr(_heuristics, "winograd_via_copies", lambda c, k: True)
    runs = []
    real = _winograd.forward_large
    monkeypatch.setattr(_winograd, "forward_large", lambda *a: runs.append(1) or real(*a))
    return runs


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_large_tiles_match_the_reference(monkeypatch, case, layout, dtype):
    runs = force_large_tiles(monkeypatch)
    x, dy, w, bias, kw = _arrays(case, dtype, layout)
    _check_forward_forms(case[0], x, dy, w, bias, kw, dtype)
    assert len(runs) == 3        # forward, data gradient, transposed (accumulate: col2im)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("tiles", [1, 3, 5])
def test_large_tile_jobs_cut_tile_rows_and_images(monkeypatch, layout, tiles):
    from numbaconv.cpu import _winograd
    runs = force_large_tiles(monkeypatch)
    monkeypatch.setattr(_winograd, "LARGE_MIN_JOB_TILES", tiles)
    monkeypatch.setattr(_winograd, "JOB_BYTES", 1)
    # 3 x 4 tiles an image (9 x 13 outputs, partial tiles at both edges): jobs of 5 tiles
    # end inside tile rows and images.
    x, dy, w, bias, kw = _arrays(("jobs", (3, 4, 9, 13), 1, 5), "float64", layout)
    _check_forward_forms("jobs", x, dy, w, bias, kw, "float64")
    assert runs


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
            x, np.zeros((k, c, 3, 3), np.float32), padding=1, layout=layout)))

    assert large(8, 64, 56) and large(8, 128, 28) and large(128, 64, 8) and large(1, 64, 56)
    assert not large(8, 256, 14)           # 1.36 times fewer multiplications only
    assert not large(8, 512, 7)            # 32 tiles: V costs more than it saves
    assert not large(2, 128, 28)           # 98 tiles
    assert not large(8, 32, 56) and not large(8, 64, 56, k=32)     # narrow products
    assert not large(8, 1024, 28, k=64)    # the float32 error of a deeper sum
    assert not large(8, 64, 56, layout="channels_first")  # only through channels-last copies
    x3 = np.zeros((2, 8, 28, 28, 64), np.float32)
    assert not _heuristics.winograd_large_tiles(geom(pb.conv_problem(
        x3, np.zeros((64, 64, 3, 3, 3), np.float32), padding=1, layout="channels_last")))


BOUNDSCHECK = background.boundscheck(
    "winograd F(4x4, 3x3) kernels under NUMBA_BOUNDSCHECK",
    "import pytest\n"
    "from test_cpu_winograd import CASES, _arrays, _check_forward_forms\n"
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
    "                x, dy, w, bias, kw = _arrays(c, 'float64', layout)\n"
    "                _check_forward_forms(c[0], x, dy, w, bias, kw, 'float64')\n"
    "    assert runs\n")


@BOUNDSCHECK.mark
def test_large_tile_kernels_stay_in_bounds_under_numba_boundscheck():
    """Every case in both layouts, whole and in jobs of 3 tiles, compiled with
    NUMBA_BOUNDSCHECK=1."""
    BOUNDSCHECK.result().check()
