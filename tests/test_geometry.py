"""Property tests for the shape and index arithmetic of numbaconv._geometry.

Each derivation is checked against brute-force loops written from the definition
``y[p] = sum_r w[r] * x[p*s - before + r*d]`` in one dimension.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numbaconv import _geometry as geo

sizes = st.integers(1, 24)
kernels = st.integers(1, 6)
steps = st.integers(1, 4)
pads = st.integers(0, 6)


def direct_forward(x, w, s, d, before, out_size):
    y = np.zeros(out_size)
    for p in range(out_size):
        for r in range(len(w)):
            i = p * s - before + r * d
            if 0 <= i < len(x):
                y[p] += w[r] * x[i]
    return y


def direct_dgrad(dy, w, s, d, before, size):
    dx = np.zeros(size)
    for p in range(len(dy)):
        for r in range(len(w)):
            i = p * s - before + r * d
            if 0 <= i < size:
                dx[i] += w[r] * dy[p]
    return dx


def direct_wgrad(x, dy, s, d, before, kernel):
    dw = np.zeros(kernel)
    for p in range(len(dy)):
        for r in range(kernel):
            i = p * s - before + r * d
            if 0 <= i < len(x):
                dw[r] += x[i] * dy[p]
    return dw


def apply(spec: geo.ConvAsConv, operand, kernel):
    """Apply a derived ConvAsConv literally: dilate, pad or crop, convolve."""
    dilated = np.zeros((len(operand) - 1) * spec.input_dilation + 1)
    dilated[::spec.input_dilation] = operand
    before, after = spec.padding
    if before < 0:
        dilated = dilated[-before:]
        before = 0
    if after < 0:
        dilated = dilated[:len(dilated) + after]
        after = 0
    padded = np.concatenate([np.zeros(before), dilated, np.zeros(after)])
    k = kernel[::-1] if spec.flip else kernel
    out = np.zeros(spec.out_size)
    for o in range(spec.out_size):
        for r in range(len(k)):
            i = o * spec.stride + r * spec.dilation
            if 0 <= i < len(padded):
                out[o] += k[r] * padded[i]
    return out


@given(sizes, kernels, steps, steps, pads, pads)
def test_output_size_counts_complete_windows(size, kernel, stride, dilation, before, after):
    eff = geo.effective_kernel_size(kernel, dilation)
    brute = sum(1 for p in range(size + before + after + 1)
                if p * stride + eff <= size + before + after)
    assert geo.conv_output_size(size, kernel, stride, dilation, before, after) == brute


@given(sizes, kernels, steps, steps)
def test_same_padding_follows_tensorflow(size, kernel, stride, dilation):
    before, after = geo.same_padding(size, kernel, stride, dilation)
    assert 0 <= before <= after <= before + 1
    out = geo.conv_output_size(size, kernel, stride, dilation, before, after)
    assert out == -(-size // stride)
    # Minimal: one less total padding would lose an output (unless no padding at all).
    if before + after > 0:
        assert geo.conv_output_size(size, kernel, stride, dilation, before,
                                    after - 1) < out or after == 0


@given(sizes, kernels, steps, steps, pads, pads, st.integers(0, 3))
def test_transposed_size_inverts_forward_size(out_size, kernel, stride, dilation, before,
                                              after, output_padding):
    size = geo.transposed_output_size(out_size, kernel, stride, dilation, before, after,
                                      output_padding)
    if size < 1:
        return
    forward = geo.conv_output_size(size, kernel, stride, dilation, before, after)
    assert forward == out_size + output_padding // stride


@given(sizes, kernels, steps, steps, pads, pads)
def test_trailing_padding_is_what_the_last_window_reads(size, kernel, stride, dilation,
                                                        before, after):
    out = geo.conv_output_size(size, kernel, stride, dilation, before, after)
    if out < 1:
        return
    trailing = geo.trailing_padding(size, out, kernel, stride, dilation, before)
    assert trailing <= after
    last_read = (out - 1) * stride + (kernel - 1) * dilation  # in padded coordinates
    assert last_read == before + size + trailing - 1


@settings(max_examples=60)
@given(sizes, kernels, steps, steps, pads, pads, st.randoms(use_true_random=False))
def test_dgrad_and_wgrad_are_plain_convolutions(size, kernel, stride, dilation, before,
                                                after, rnd):
    out = geo.conv_output_size(size, kernel, stride, dilation, before, after)
    if out < 1:
        return
    rng = np.random.default_rng(rnd.randint(0, 2**31))
    x, w, dy = rng.standard_normal(size), rng.standard_normal(kernel), rng.standard_normal(out)
    np.testing.assert_allclose(
        apply(geo.dgrad_as_conv(size, out, kernel, stride, dilation, before), dy, w),
        direct_dgrad(dy, w, stride, dilation, before, size), atol=1e-12)
    np.testing.assert_allclose(
        apply(geo.wgrad_as_conv(size, out, kernel, stride, dilation, before), x, dy),
        direct_wgrad(x, dy, stride, dilation, before, kernel), atol=1e-12)
    # The forward convolution itself, for completeness of the convention.
    plain = geo.ConvAsConv(1, (before, after), stride, dilation, False, out)
    np.testing.assert_allclose(apply(plain, x, w),
                               direct_forward(x, w, stride, dilation, before, out), atol=1e-12)


@settings(max_examples=40)
@given(sizes, kernels, steps, steps, pads, st.integers(0, 3), st.randoms(use_true_random=False))
def test_transpose_is_the_adjoint(out_size, kernel, stride, dilation, before, output_padding,
                                  rnd):
    size = geo.transposed_output_size(out_size, kernel, stride, dilation, before, before,
                                      output_padding)
    if size < 1:
        return
    rng = np.random.default_rng(rnd.randint(0, 2**31))
    xt, w, y = rng.standard_normal(out_size), rng.standard_normal(kernel), rng.standard_normal(
        size)
    spec = geo.transpose_as_conv(size, out_size, kernel, stride, dilation, before)
    lhs = np.dot(apply(spec, xt, w), y)
    rhs = np.dot(xt, direct_forward(y, w, stride, dilation, before, out_size))
    assert abs(lhs - rhs) <= 1e-9 * max(1.0, abs(lhs))


@pytest.mark.parametrize("padding, expected", [
    (2, ((2, 2), (2, 2))),
    ((1, 3), ((1, 1), (3, 3))),
    (((0, 1), (2, 3)), ((0, 1), (2, 3))),
    ([[0, 1], 4], ((0, 1), (4, 4))),
    ("VALID", ((0, 0), (0, 0))),
    ("Same", ((1, 1), (0, 1))),
    (np.int64(1), ((1, 1), (1, 1))),
])
def test_padding_forms(padding, expected):
    assert geo.normalize_padding(padding, 2, (5, 6), (3, 2), (1, 1), (1, 1)) == expected


@pytest.mark.parametrize("padding, error", [
    (-1, ValueError), ((1, -2), ValueError), ("full", ValueError), ((1, 2, 3), ValueError),
    (1.5, TypeError), (True, TypeError), (((1, 2, 3), 0), TypeError), (None, TypeError),
])
def test_bad_padding(padding, error):
    with pytest.raises(error, match="padding"):
        geo.normalize_padding(padding, 2, (5, 6), (3, 2), (1, 1), (1, 1))


@pytest.mark.parametrize("value, error", [
    (0, ValueError), (-2, ValueError), ((1,), ValueError), ((1, 0), ValueError),
    (1.0, TypeError), (False, TypeError), ("2", TypeError), (np.array([1, 2]), TypeError),
])
def test_bad_stride(value, error):
    with pytest.raises(error, match="stride"):
        geo.normalize_int_tuple(value, 2, "stride", 1)


def test_int_tuple_forms():
    assert geo.normalize_int_tuple(2, 3, "stride", 1) == (2, 2, 2)
    assert geo.normalize_int_tuple([1, np.int32(2)], 2, "stride", 1) == (1, 2)
    assert geo.normalize_int_tuple(np.int64(0), 1, "output_padding", 0) == (0,)
