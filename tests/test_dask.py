"""numbaconv.dask: batch-chunked dask arrays give the single-machine call's results on the
concatenated batch, on Dask's threaded scheduler and on a two-process LocalCluster."""

import subprocess
import sys

import numpy as np
import pytest

dask = pytest.importorskip("dask", reason="the dask extra is not installed")
da = pytest.importorskip("dask.array", reason="the dask extra is not installed")

import numbaconv as nc  # noqa: E402
import numbaconv.dask as ncd  # noqa: E402
from numbaconv import conv_output_shape  # noqa: E402
from numbaconv.testing import case, random_array  # noqa: E402

LAYOUTS = ("channels_first", "channels_last")
TOLERANCE = {np.float64: 1e-12, np.float32: 2e-5}
#: Batch chunkings of a batch of 7: one block, equal blocks with an uneven last one, single
#: samples, an uneven first block.
CHUNKINGS = ((7,), (3, 3, 1), (1,) * 7, (5, 2))
#: Geometries from numbaconv.testing.CASES: 1D with groups, 2D strided "same", depthwise, 3D.
CASE_NAMES = ("1d_stride_dilation_groups", "2d_same_stride2", "2d_depthwise", "3d_everything")
BATCH = 7


def physical(shape, layout):
    return shape[:1] + shape[2:] + shape[1:2] if layout == "channels_last" else shape


def arrays(name, layout, dtype, seed=0):
    """x, w, bias, dy (forward) and xt, dyt, bias_t (transposed) with a batch of 7."""
    c = case(name)
    rng = np.random.default_rng(seed)
    xs = physical((BATCH,) + c.x_shape[1:], layout)
    ys = conv_output_shape(xs, c.w_shape, layout=layout, **c.kwargs)
    yt = conv_output_shape(ys, c.w_shape, layout=layout, transposed=True,
                           output_padding=c.output_padding, **c.kwargs)
    cin = c.w_shape[1] * c.groups
    return c, dict(x=random_array(xs, dtype, rng), w=random_array(c.w_shape, dtype, rng),
                   bias=random_array((c.w_shape[0],), dtype, rng),
                   dy=random_array(ys, dtype, rng), xt=random_array(ys, dtype, rng),
                   dyt=random_array(yt, dtype, rng), bias_t=random_array((cin,), dtype, rng))


def chunked(a, batch_chunks):
    return da.from_array(a, chunks=(batch_chunks,) + a.shape[1:])


def assert_close(actual, expected, dtype):
    assert isinstance(actual, np.ndarray) and actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    scale = max(float(np.abs(expected).max()), 1e-30)
    assert float(np.abs(actual - expected).max()) / scale <= TOLERANCE[dtype]


def assert_lazy_like(result, batch_chunks, expected):
    """A dask array with one block per input block, right metadata, right values."""
    assert isinstance(result, da.Array)
    assert result.shape == expected.shape and result.dtype == expected.dtype
    assert result.chunks == ((batch_chunks,) + tuple((s,) for s in expected.shape[1:]))
    assert isinstance(result._meta, np.ndarray)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_every_op_equals_the_whole_batch_call(name, layout, dtype):
    c, a = arrays(name, layout, dtype)
    kw = dict(c.kwargs, layout=layout)
    tkw = dict(kw, output_padding=c.output_padding)
    expected = dict(
        y=nc.conv(a["x"], a["w"], a["bias"], **kw),
        dx=nc.conv_backward_data(a["dy"], a["w"], a["x"].shape, **kw),
        dw=nc.conv_backward_weight(a["x"], a["dy"], a["w"].shape, **kw),
        db=nc.conv_backward_bias(a["dy"], layout=layout),
        yt=nc.conv_transpose(a["xt"], a["w"], a["bias_t"], **tkw),
        transposed=nc.conv_transpose_backward(a["dyt"], a["xt"], a["w"], **tkw))
    for chunks in CHUNKINGS:
        x, dy = chunked(a["x"], chunks), chunked(a["dy"], chunks)
        xt, dyt = chunked(a["xt"], chunks), chunked(a["dyt"], chunks)
        with dask.config.set(scheduler="threads"):
            y = ncd.conv(x, a["w"], a["bias"], **kw)
            assert_lazy_like(y, chunks, expected["y"])
            assert_close(y.compute(), expected["y"], dtype)

            dx = ncd.conv_backward_data(dy, a["w"], a["x"].shape, **kw)
            assert_lazy_like(dx, chunks, expected["dx"])
            assert_close(dx.compute(), expected["dx"], dtype)

            dw = ncd.conv_backward_weight(x, dy, a["w"].shape, **kw)
            assert_close(dw, expected["dw"], dtype)
            assert_close(ncd.conv_backward_bias(dy, layout=layout), expected["db"], dtype)

            dx, dw, db = ncd.conv_backward(dy, x, a["w"], **kw)
            assert_lazy_like(dx, chunks, expected["dx"])
            assert_close(dx.compute(), expected["dx"], dtype)
            assert_close(dw, expected["dw"], dtype)
            assert_close(db, expected["db"], dtype)

            yt = ncd.conv_transpose(xt, a["w"], a["bias_t"], **tkw)
            assert_lazy_like(yt, chunks, expected["yt"])
            assert_close(yt.compute(), expected["yt"], dtype)

            dxt, dwt, dbt = ncd.conv_transpose_backward(dyt, xt, a["w"], **tkw)
            assert_lazy_like(dxt, chunks, expected["transposed"][0])
            assert_close(dxt.compute(), expected["transposed"][0], dtype)
            assert_close(dwt, expected["transposed"][1], dtype)
            assert_close(dbt, expected["transposed"][2], dtype)


def test_weight_gradient_is_a_tree_reduction_and_deterministic():
    c, a = arrays("2d_same_stride2", "channels_first", np.float64)
    x, dy = chunked(a["x"], (1,) * 7), chunked(a["dy"], (1,) * 7)
    lazy = ncd.conv_backward_weight(x, dy, a["w"].shape, compute=False, split_every=2,
                                    **c.kwargs)
    assert isinstance(lazy, da.Array) and lazy.numblocks == (1, 1, 1, 1)
    # 7 partials, 2 at a time: more than one level of combining.
    layers = [k for k in lazy.dask.layers if "sum" in k]
    assert len(layers) >= 3, layers
    first = lazy.compute(scheduler="threads")
    for _ in range(3):
        again = ncd.conv_backward_weight(x, dy, a["w"].shape, split_every=2,
                                         scheduler="threads", **c.kwargs)
        assert np.array_equal(again, first)
    assert_close(first, nc.conv_backward_weight(a["x"], a["dy"], a["w"].shape, **c.kwargs),
                 np.float64)


def test_compute_false_leaves_gradients_lazy():
    c, a = arrays("2d_depthwise", "channels_last", np.float32)
    kw = dict(c.kwargs, layout="channels_last")
    x, dy = chunked(a["x"], (4, 3)), chunked(a["dy"], (4, 3))
    dx, dw, db = ncd.conv_backward(dy, x, a["w"], compute=False, **kw)
    assert all(isinstance(r, da.Array) for r in (dx, dw, db))
    assert dw.shape == a["w"].shape and db.shape == (a["w"].shape[0],)
    assert dw.dtype == db.dtype == np.float32
    expected = nc.conv_backward(a["dy"], a["x"], a["w"], **kw)
    for got, want in zip(dask.compute(dx, dw, db, scheduler="threads"), expected):
        assert_close(got, want, np.float32)
    assert ncd.conv_backward_bias(dy, layout="channels_last", compute=False).shape == db.shape


def test_needs_out_and_accumulate():
    c, a = arrays("2d_same_stride2", "channels_first", np.float64)
    x, dy = chunked(a["x"], (3, 3, 1)), chunked(a["dy"], (3, 3, 1))
    dx, dw, db = ncd.conv_backward(dy, x, a["w"], needs=(False, True, False), **c.kwargs)
    assert dx is None and db is None and isinstance(dw, np.ndarray)
    expected = nc.conv_backward_weight(a["x"], a["dy"], a["w"].shape, **c.kwargs)
    out = np.ones_like(expected)
    got = ncd.conv_backward_weight(x, dy, a["w"].shape, out=out, accumulate=True, **c.kwargs)
    assert got is out
    assert_close(out, expected + 1, np.float64)
    with pytest.raises(ValueError, match="out: expected None with compute=False"):
        ncd.conv_backward_weight(x, dy, a["w"].shape, out=out, compute=False, **c.kwargs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunks_along_another_axis_are_rejected_or_rechunked(layout):
    c, a = arrays("2d_same_stride2", layout, np.float64)
    kw = dict(c.kwargs, layout=layout)
    channel_axis = 1 if layout == "channels_first" else a["x"].ndim - 1
    x = chunked(a["x"], (4, 3)).rechunk({channel_axis: 1})
    dy = chunked(a["dy"], (4, 3)).rechunk({2: 2})
    with pytest.raises(ValueError, match=rf"x: expected chunks along the batch axis \(axis 0\)"
                                         rf" only, got x split along axis {channel_axis}"):
        ncd.conv(x, a["w"], **kw)
    with pytest.raises(ValueError, match="dy: expected chunks along the batch axis"):
        ncd.conv_backward_data(dy, a["w"], a["x"].shape, **kw)
    with pytest.raises(ValueError, match="rechunk=True"):
        ncd.conv_backward(chunked(a["dy"], (4, 3)), x, a["w"], **kw)

    y = ncd.conv(x, a["w"], rechunk=True, **kw)
    assert y.chunks[0] == (4, 3) and all(len(ch) == 1 for ch in y.chunks[1:])
    assert_close(y.compute(scheduler="threads"), nc.conv(a["x"], a["w"], **kw), np.float64)
    dx, dw, db = ncd.conv_backward(dy, x, a["w"], rechunk=True, scheduler="threads", **kw)
    expected = nc.conv_backward(a["dy"], a["x"], a["w"], **kw)
    assert_close(dx.compute(scheduler="threads"), expected[0], np.float64)
    assert_close(dw, expected[1], np.float64)
    assert_close(db, expected[2], np.float64)


def test_batch_chunks_of_x_and_dy_must_match_unless_rechunked():
    c, a = arrays("1d_stride_dilation_groups", "channels_first", np.float64)
    x, dy = chunked(a["x"], (4, 3)), chunked(a["dy"], (2, 5))
    with pytest.raises(ValueError, match=r"dy: expected the batch chunks of x \(4, 3\), got "
                                         r"\(2, 5\)"):
        ncd.conv_backward_weight(x, dy, a["w"].shape, **c.kwargs)
    got = ncd.conv_backward_weight(x, dy, a["w"].shape, rechunk=True, scheduler="threads",
                                   **c.kwargs)
    assert_close(got, nc.conv_backward_weight(a["x"], a["dy"], a["w"].shape, **c.kwargs),
                 np.float64)


def test_bad_arguments_name_the_argument():
    c, a = arrays("2d_same_stride2", "channels_first", np.float64)
    x = chunked(a["x"], (4, 3))
    with pytest.raises(TypeError, match="w: expected a NumPy array"):
        ncd.conv(x, chunked(a["w"], (4,)), **c.kwargs)
    with pytest.raises(TypeError, match="x: expected a dask array"):
        ncd.conv(a["x"].tolist(), a["w"], **c.kwargs)
    # numbaconv's own validation runs on the whole batch's shapes before any graph is built.
    with pytest.raises(TypeError, match="w: expected dtype float64 like x"):
        ncd.conv(x, a["w"].astype(np.float32), **c.kwargs)
    with pytest.raises(ValueError, match="dy: expected shape"):
        ncd.conv_backward(chunked(a["x"], (4, 3)), x, a["w"], **c.kwargs)
    with pytest.raises(ValueError, match="input_shape: expected batch size 7"):
        ncd.conv_backward_data(chunked(a["dy"], (4, 3)), a["w"], (8,) + a["x"].shape[1:],
                               **c.kwargs)
    # A NumPy array is accepted as one block (or chunked like the dask operand).
    dw = ncd.conv_backward_weight(x, a["dy"], a["w"].shape, scheduler="threads", **c.kwargs)
    assert_close(dw, nc.conv_backward_weight(a["x"], a["dy"], a["w"].shape, **c.kwargs),
                 np.float64)


def test_importing_numbaconv_does_not_import_dask():
    code = "import sys, numbaconv; print('dask' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_local_cluster_with_two_worker_processes(local_cluster):
    distributed = pytest.importorskip("distributed")
    with distributed.Client(local_cluster) as client:
        c, a = arrays("2d_same_stride2", "channels_last", np.float64)
        kw = dict(c.kwargs, layout="channels_last")
        x, dy = chunked(a["x"], (3, 3, 1)), chunked(a["dy"], (3, 3, 1))
        dx, dw, db = ncd.conv_backward(dy, x, a["w"], scheduler=client, **kw)
        y = ncd.conv(x, a["w"], a["bias"], **kw).compute(scheduler=client)
        dx = dx.compute(scheduler=client)
        # The blocks ran in both worker processes.
        assert len(client.scheduler_info()["workers"]) == 2
    expected = nc.conv_backward(a["dy"], a["x"], a["w"], **kw)
    assert_close(y, nc.conv(a["x"], a["w"], a["bias"], **kw), np.float64)
    for got, want in zip((dx, dw, db), expected):
        assert_close(got, want, np.float64)


def test_the_documented_dask_switch_runs():
    import pathlib
    import re
    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "dask.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    [snippet] = [block for block in blocks if "import numbaconv.dask" in block]
    with dask.config.set(scheduler="threads"):
        exec(compile(snippet, "docs/dask.md (dask switch)", "exec"), {})
