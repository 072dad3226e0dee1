"""Bad input raises a clear error naming the argument, and leaves ``out`` untouched.

Also the accepted-but-unusual inputs: strided and byte-swapped arrays, strided ``out``.
"""

import numpy as np
import pytest

import numbaconv as nc


class FakeCudaArray:
    """Just enough of __cuda_array_interface__ to look like a GPU array to validation."""

    def __init__(self, shape, typestr="<f4"):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (0, False), "version": 3, "strides": None}


@pytest.fixture(autouse=True)
def _reference_only():
    with nc.use_backend("reference"):
        yield


def arrays(dtype="float32"):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 7, 7)).astype(dtype)
    w = rng.standard_normal((6, 2, 3, 3)).astype(dtype)
    dy = rng.standard_normal((2, 6, 5, 5)).astype(dtype)
    return x, w, dy


X, W, DY = arrays()
KW = dict(groups=2)


def overlapping_dgrad(storage):
    """dgrad whose out shares memory with dy (both views of one buffer)."""
    dy = storage[:300].reshape(2, 6, 5, 5)
    out = storage[200:592].reshape(2, 4, 7, 7)
    return nc.conv_backward_data(dy, W, X.shape, **KW, out=out)


def sentinel(shape, dtype="float32"):
    return np.full(shape, 7.0, dtype=dtype)


# Each row: (error type, pattern the message must contain, call).
BAD_CALLS = {
    "mixed dtypes": (TypeError, "w: expected dtype float32", lambda: nc.conv(
        X, W.astype(np.float64), **KW, out=sentinel((2, 6, 5, 5)))),
    "integer dtype": (TypeError, "x: expected dtype float32 or float64", lambda: nc.conv(
        X.astype(np.int32), W.astype(np.int32), **KW)),
    "float16 on cpu": (TypeError, "dy: expected dtype float32 or float64", lambda:
                       nc.conv_backward_bias(DY.astype(np.float16))),
    "not an array": (TypeError, "x: expected a NumPy array", lambda: nc.conv(
        X.tolist(), W, **KW)),
    "channel mismatch": (ValueError, "w: expected dim 1 = in_channels / groups", lambda:
                         nc.conv(X, W, groups=1, out=sentinel((2, 6, 5, 5)))),
    "groups not dividing K": (ValueError, "groups: expected a divisor of out_channels",
                              lambda: nc.conv(X, W, groups=4)),
    "groups not dividing C": (ValueError, "groups: expected a divisor of in_channels",
                              lambda: nc.conv(X[:, :3], W[:4, :1], groups=2)),
    "groups zero": (ValueError, "groups: expected an int >= 1", lambda: nc.conv(
        X, W, groups=0)),
    "groups float": (TypeError, "groups: expected an int", lambda: nc.conv(X, W, groups=2.0)),
    "zero stride": (ValueError, "stride: expected every value >= 1", lambda: nc.conv(
        X, W, stride=0, **KW)),
    "negative dilation": (ValueError, "dilation: expected every value >= 1", lambda:
                          nc.conv(X, W, dilation=(1, -1), **KW)),
    "negative padding": (ValueError, "padding: expected non-negative", lambda: nc.conv(
        X, W, padding=-1, **KW)),
    "stride wrong length": (ValueError, "stride: expected an int or 2 ints", lambda:
                            nc.conv(X, W, stride=(1, 1, 1), **KW)),
    "unknown padding mode": (ValueError, "padding: expected 'same', 'valid'", lambda:
                             nc.conv(X, W, padding="full", **KW)),
    "empty output": (ValueError, "x: the convolution output would be empty", lambda:
                     nc.conv(X, W, dilation=4, **KW)),
    "empty batch": (ValueError, "x: expected every size >= 1", lambda: nc.conv(
        X[:0], W, **KW)),
    "wrong ndim": (ValueError, "x: expected 4 dimensions", lambda: nc.conv(X[0], W, **KW)),
    "weight ndim": (ValueError, "w: expected 3 to 5 dimensions", lambda: nc.conv(
        X, W[..., 0, 0], **KW)),
    "bad layout": (ValueError, "layout: expected 'channels_first' or 'channels_last'",
                   lambda: nc.conv(X, W, layout="NCHW", **KW)),
    "bias shape": (ValueError, r"bias: expected shape \(6,\)", lambda: nc.conv(
        X, W, np.zeros(4, np.float32), **KW)),
    "bias dtype": (TypeError, "bias: expected dtype float32", lambda: nc.conv(
        X, W, np.zeros(6), **KW)),
    "out wrong shape": (ValueError, r"out: expected shape \(2, 6, 5, 5\)", lambda: nc.conv(
        X, W, **KW, out=sentinel((2, 6, 5, 4)))),
    "out wrong dtype": (TypeError, "out: expected dtype float32", lambda: nc.conv(
        X, W, **KW, out=sentinel((2, 6, 5, 5), "float64"))),
    "out not an array": (TypeError, "out: expected a NumPy array", lambda: nc.conv(
        X, W, **KW, out=[0.0])),
    "out read-only": (ValueError, "out: expected a writable array", lambda: nc.conv(
        X, W, **KW, out=np.broadcast_to(np.float32(0), (2, 6, 5, 5)))),
    "out overlaps input": (ValueError, "out: expected memory separate from the inputs",
                           lambda: overlapping_dgrad(np.zeros(600, np.float32))),
    "out on another device": (ValueError, "out: expected an array on cpu", lambda:
                              nc.conv(X, W, **KW, out=FakeCudaArray((2, 6, 5, 5)))),
    "accumulate without out": (ValueError, "accumulate: expected out=", lambda:
                               nc.conv_backward_weight(X, DY, W.shape, **KW,
                                                       accumulate=True)),
    "accumulate not bool": (TypeError, "accumulate: expected True or False", lambda:
                            nc.conv_backward_bias(DY, out=sentinel((6,)), accumulate=1)),
    "input_shape batch": (ValueError, "input_shape: expected batch size 2", lambda:
                          nc.conv_backward_data(DY, W, (3, 4, 7, 7), **KW,
                                                out=sentinel((3, 4, 7, 7)))),
    "input_shape inconsistent": (ValueError, r"dy: expected spatial size \(6, 5\)", lambda:
                                 nc.conv_backward_data(DY, W, (2, 4, 8, 7), **KW)),
    "input_shape not ints": (TypeError, "input_shape: expected a tuple of 4 ints", lambda:
                             nc.conv_backward_data(DY, W, (2, 4, 7.0, 7), **KW)),
    "input_shape channels": (ValueError, "w: expected dim 1", lambda:
                             nc.conv_backward_data(DY, W, (2, 6, 7, 7), **KW)),
    "dy channels": (ValueError, r"dy: expected 6 channels", lambda: nc.conv_backward_data(
        DY[:, :4], W, X.shape, **KW)),
    "weight_shape inconsistent": (ValueError, r"dy: expected spatial size \(3, 3\)", lambda:
                                  nc.conv_backward_weight(X, DY, (6, 2, 5, 5), **KW,
                                                          out=sentinel((6, 2, 5, 5)))),
    "weight_shape length": (ValueError, "weight_shape: expected 4 dimensions", lambda:
                            nc.conv_backward_weight(X, DY, (6, 2, 3), **KW)),
    "dy batch": (ValueError, "dy: expected batch size 2", lambda: nc.conv_backward_weight(
        X, DY[:1], W.shape, **KW)),
    "mixed devices": (ValueError, "w: expected an array on the same device as x", lambda:
                      nc.conv(X, FakeCudaArray(W.shape), **KW)),
    "output_padding too large": (ValueError, "output_padding: expected each value < max",
                                 lambda: nc.conv_transpose(DY, W, stride=2, **KW,
                                                           output_padding=2)),
    "output_padding with same": (ValueError, "output_padding: expected 0 with padding='same'",
                                 lambda: nc.conv_transpose(DY, W, stride=2, padding="same",
                                                           output_padding=1, **KW)),
    "transpose channels": (ValueError, "x: expected 6 channels", lambda: nc.conv_transpose(
        X, W, **KW)),
    "needs malformed": (TypeError, "needs: expected a tuple of 3 bools", lambda:
                        nc.conv_backward(DY, X, W, **KW, needs=(True, False))),
    "backward dy shape": (ValueError, r"dy: expected shape \(2, 6, 5, 5\)", lambda:
                          nc.conv_backward(DY[..., :4], X, W, **KW)),
    "backward dy dtype": (TypeError, "dy: expected dtype float32", lambda:
                          nc.conv_backward(DY.astype(np.float64), X, W, **KW)),
    "transpose backward dy shape": (ValueError, r"dy: expected shape \(2, 4, 7, 7\)", lambda:
                                    nc.conv_transpose_backward(X[..., :6], DY, W, **KW)),
    "output shape negative": (ValueError, "input_shape: expected non-negative", lambda:
                              nc.conv_output_shape((2, 4, -1, 7), W.shape, **KW)),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_input_raises_clear_error(name):
    error, pattern, call = BAD_CALLS[name]
    with pytest.raises(error, match=pattern):
        call()


# Rejected calls that pass out=: each must leave the sentinel values in place.
REJECTED_WITH_OUT = {
    "mixed dtypes": ((2, 6, 5, 5), lambda out: nc.conv(X, W.astype(np.float64), **KW,
                                                       out=out)),
    "channel mismatch": ((2, 6, 5, 5), lambda out: nc.conv(X, W, out=out)),
    "out wrong shape": ((2, 6, 5, 4), lambda out: nc.conv(X, W, **KW, out=out)),
    "bad stride": ((2, 6, 5, 5), lambda out: nc.conv(X, W, **KW, stride=0, out=out)),
    "weight_shape inconsistent": ((6, 2, 5, 5), lambda out: nc.conv_backward_weight(
        X, DY, (6, 2, 5, 5), **KW, out=out, accumulate=True)),
    "input_shape batch": ((3, 4, 7, 7), lambda out: nc.conv_backward_data(
        DY, W, (3, 4, 7, 7), **KW, out=out)),
    "overlap": ((600,), lambda storage: overlapping_dgrad(storage)),
    "bias grad layout": ((6,), lambda out: nc.conv_backward_bias(DY, layout="NHWC",
                                                                out=out)),
}


@pytest.mark.parametrize("name", sorted(REJECTED_WITH_OUT))
def test_rejected_call_leaves_out_untouched(name):
    shape, call = REJECTED_WITH_OUT[name]
    out = sentinel(shape)
    with pytest.raises((ValueError, TypeError)):
        call(out)
    np.testing.assert_array_equal(out, 7.0)


def test_out_is_written_and_returned():
    out = sentinel((2, 6, 5, 5))
    y = nc.conv(X, W, **KW, out=out)
    assert y is out
    np.testing.assert_allclose(out, nc.conv(X, W, **KW), rtol=1e-6)


def test_accumulate_adds_into_out():
    dw = nc.conv_backward_weight(X, DY, W.shape, **KW)
    out = np.ones_like(dw)
    result = nc.conv_backward_weight(X, DY, W.shape, **KW, out=out, accumulate=True)
    assert result is out
    np.testing.assert_allclose(out, dw + 1, rtol=1e-6)
    db = nc.conv_backward_bias(DY)
    out = np.full(6, 2.0, np.float32)
    nc.conv_backward_bias(DY, out=out, accumulate=True)
    np.testing.assert_allclose(out, db + 2, rtol=1e-6)


def test_strided_and_byteswapped_inputs_are_read_correctly():
    expected = nc.conv(X, W, **KW)
    big = np.zeros((2, 8, 7, 14), np.float32)
    big[:, ::2, :, ::2] = X
    strided = big[:, ::2, :, ::2]
    assert not strided.flags.c_contiguous
    np.testing.assert_allclose(nc.conv(strided, W, **KW), expected, rtol=1e-6)
    swapped = X.astype(X.dtype.newbyteorder(">"))
    np.testing.assert_allclose(nc.conv(swapped, W, **KW), expected, rtol=1e-6)
    fortran = np.asfortranarray(W)
    np.testing.assert_allclose(nc.conv(X, fortran, **KW), expected, rtol=1e-6)


def test_strided_out_is_written_in_place():
    expected = nc.conv_backward_data(DY, W, X.shape, **KW)
    storage = np.full((2, 4, 7, 14), 3.0, np.float32)
    out = storage[..., ::2]
    result = nc.conv_backward_data(DY, W, X.shape, **KW, out=out, accumulate=True)
    assert result is out
    np.testing.assert_allclose(storage[..., ::2], expected + 3, rtol=1e-6)
    np.testing.assert_array_equal(storage[..., 1::2], 3.0)  # gaps untouched


def test_conv_output_shape():
    assert nc.conv_output_shape((2, 4, 7, 7), (6, 2, 3, 3), groups=2) == (2, 6, 5, 5)
    assert nc.conv_output_shape((2, 7, 7, 4), (6, 2, 3, 3), groups=2,
                                layout="channels_last", stride=2, padding="same") == (
        2, 4, 4, 6)
    assert nc.conv_output_shape((2, 6, 5, 5), (6, 2, 3, 3), groups=2, transposed=True,
                                stride=2, output_padding=1) == (2, 4, 12, 12)


def test_problem_is_hashable_and_keyed():
    from numbaconv.problem import conv_problem
    p1 = conv_problem(X, W, **KW)
    p2 = conv_problem(X.copy(), W.copy(), stride=(1, 1), padding=((0, 0), (0, 0)), **KW)
    assert p1 == p2 and hash(p1) == hash(p2) and p1.key() == p2.key()
    assert p1.with_op("conv_backward_data") != p1
    assert "N2:C4:K6:g2" in p1.key()


def test_remembered_validation_still_rejects_what_it_should():
    """Validation results are cached by shape; the cache must never let bad input through."""
    nc.conv(X, W, **KW, stride=1)                       # remembered
    with pytest.raises(TypeError, match="stride"):
        nc.conv(X, W, **KW, stride=True)                # True is not 1
    with pytest.raises(TypeError, match="w: expected dtype float32"):
        nc.conv(X, W.astype(np.float64), **KW)          # same shapes, another dtype
    out = sentinel((2, 6, 5, 5))
    with pytest.raises(ValueError, match="out: expected a writable array"):
        out.flags.writeable = False
        nc.conv(X, W, **KW, out=out)                    # out is checked on every call
    with pytest.raises(ValueError, match="accumulate: expected out="):
        nc.conv_backward_weight(X, DY, W.shape, **KW)
        nc.conv_backward_weight(X, DY, W.shape, **KW, accumulate=True)
    with pytest.raises(TypeError, match="accumulate: expected True or False"):
        nc.conv_backward_bias(DY, out=sentinel((6,)), accumulate=1)
    swapped = X.astype(X.dtype.newbyteorder(">"))       # dtype differs in byte order only
    np.testing.assert_allclose(nc.conv(swapped, W, **KW), nc.conv(X, W, **KW), rtol=1e-6)
