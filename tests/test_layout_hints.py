"""Channel counts that match only under the other layout: the error names the fix."""

import numpy as np
import pytest

import numbaconv as nc

F32 = np.float32


@pytest.fixture(autouse=True)
def _reference_only():
    with nc.use_backend("reference"):
        yield


def zeros(*shape):
    return np.zeros(shape, F32)


# Channels-last data (N, H, W, C) passed with the default layout.
X_LAST, DY_LAST = zeros(2, 9, 9, 6), zeros(2, 7, 7, 4)
W = zeros(4, 6, 3, 3)               # (K, C, R, S)
W_T = zeros(4, 6, 3, 3)             # transposed: (C_in = 4, C_out = 6, R, S)

TO_LAST = {
    "conv": lambda: nc.conv(X_LAST, W),
    "conv grouped": lambda: nc.conv(X_LAST, zeros(4, 3, 3, 3), groups=2),
    "conv_backward_data": lambda: nc.conv_backward_data(DY_LAST, W, X_LAST.shape),
    "conv_backward_weight": lambda: nc.conv_backward_weight(X_LAST, DY_LAST, W.shape),
    "conv_transpose": lambda: nc.conv_transpose(DY_LAST, W_T),
    "conv_backward": lambda: nc.conv_backward(DY_LAST, X_LAST, W),
}


@pytest.mark.parametrize("name", TO_LAST)
def test_channels_last_data_with_the_default_layout_names_channels_last(name):
    with pytest.raises(ValueError, match="pass layout='channels_last'") as info:
        TO_LAST[name]()
    message = str(info.value)
    assert "with layout='channels_first'" in message
    assert "(N, *S, C)" in message


def test_following_the_hint_works():
    y = nc.conv(X_LAST, W, layout="channels_last")
    assert y.shape == (2, 7, 7, 4)
    nc.conv_backward_data(DY_LAST, W, X_LAST.shape, layout="channels_last")
    nc.conv_backward_weight(X_LAST, DY_LAST, W.shape, layout="channels_last")
    nc.conv_transpose(DY_LAST, W_T, layout="channels_last")


@pytest.mark.parametrize("op", ["conv", "conv_backward_data", "conv_backward_weight",
                                "conv_transpose"])
def test_channels_first_data_with_channels_last_names_channels_first(op):
    x, dy = zeros(2, 6, 9, 9), zeros(2, 4, 7, 7)
    call = {
        "conv": lambda: nc.conv(x, W, layout="channels_last"),
        "conv_backward_data": lambda: nc.conv_backward_data(dy, W, x.shape,
                                                            layout="channels_last"),
        "conv_backward_weight": lambda: nc.conv_backward_weight(x, dy, W.shape,
                                                                layout="channels_last"),
        "conv_transpose": lambda: nc.conv_transpose(dy, W_T, layout="channels_last"),
    }[op]
    with pytest.raises(ValueError, match="pass layout='channels_first'") as info:
        call()
    assert "(N, C, *S)" in str(info.value)


def test_the_hint_names_the_argument_and_both_counts():
    with pytest.raises(ValueError) as info:
        nc.conv(X_LAST, W)
    message = str(info.value)
    assert message.startswith("x (2, 9, 9, 6): ")
    assert "axis 1 (9), expected 6" in message
    assert "the last axis (6) matches" in message


NO_HINT = {
    # neither layout matches
    "conv": lambda: nc.conv(zeros(2, 5, 9, 9), W),
    # the last axis matches w but groups does not divide K: the layout is not the fix
    "groups": lambda: nc.conv(zeros(2, 9, 9, 6), zeros(5, 6, 3, 3), groups=3),
    # dy matches under the other layout but input_shape does not
    "dgrad half": lambda: nc.conv_backward_data(DY_LAST, W, (2, 9, 9, 5)),
    "wgrad half": lambda: nc.conv_backward_weight(zeros(2, 9, 9, 5), DY_LAST, W.shape),
}


@pytest.mark.parametrize("name", NO_HINT)
def test_no_hint_where_the_other_layout_would_not_fix_it(name):
    with pytest.raises(ValueError) as info:
        NO_HINT[name]()
    assert "pass layout=" not in str(info.value)


def test_argument_order_is_documented():
    assert "conv_backward(dy, x, w)" in nc.conv_backward_weight.__doc__
    assert "conv_backward_weight" in nc.conv_backward.__doc__
