"""The reference backend against PyTorch (every case, op and layout) and finite differences."""

import numpy as np
import pytest

import numbaconv as nc
from numbaconv.testing import case_arrays, relative_error, run_op

torch_oracle = pytest.importorskip("torch_oracle")


@pytest.fixture(autouse=True)
def _reference_only():
    with nc.use_backend("reference"):
        yield


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_conv_and_gradients_match_pytorch(conv_case, layout, dtype):
    a = case_arrays(conv_case, layout, dtype)
    y, dx, dw, db = torch_oracle.conv_and_grads(conv_case, layout, a)
    tol = 1e-12 if dtype == "float64" else 1e-5
    assert relative_error(run_op("conv", conv_case, layout, a), y) < tol
    assert relative_error(run_op("conv_backward_data", conv_case, layout, a), dx) < tol
    assert relative_error(run_op("conv_backward_weight", conv_case, layout, a), dw) < tol
    assert relative_error(run_op("conv_backward_bias", conv_case, layout, a), db) < tol
    got = nc.conv_backward(a["dy"], a["x"], a["w"], layout=layout, **conv_case.kwargs)
    for mine, theirs in zip(got, (dx, dw, db)):
        assert relative_error(mine, theirs) < tol


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_conv_transpose_and_gradients_match_pytorch(conv_case, layout, dtype):
    a = case_arrays(conv_case, layout, dtype)
    y, dx, dw, db = torch_oracle.conv_transpose_and_grads(conv_case, layout, a)
    tol = 1e-12 if dtype == "float64" else 1e-5
    assert relative_error(run_op("conv_transpose", conv_case, layout, a), y) < tol
    got = nc.conv_transpose_backward(a["dyt"], a["xt"], a["w"], layout=layout,
                                     output_padding=conv_case.output_padding,
                                     **conv_case.kwargs)
    for mine, theirs in zip(got, (dx, dw, db)):
        assert relative_error(mine, theirs) < tol


def _directional_check(loss, grad, value, rng, h=1e-6):
    """<grad, v> against the central difference of loss along random directions v."""
    for _ in range(3):
        v = rng.standard_normal(value.shape)
        value += h * v
        plus = loss()
        value -= 2 * h * v
        minus = loss()
        value += h * v
        numeric = (plus - minus) / (2 * h)
        analytic = float(np.sum(grad * v))
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (numeric, analytic)


def test_gradients_match_finite_differences(conv_case, layout, rng):
    a = case_arrays(conv_case, layout, "float64")
    g = a["dy"]
    kw = dict(conv_case.kwargs, layout=layout)

    def loss():
        return float(np.sum(nc.conv(a["x"], a["w"], a["bias"], **kw) * g))

    dx, dw, db = nc.conv_backward(g, a["x"], a["w"], **kw)
    _directional_check(loss, dx, a["x"], rng)
    _directional_check(loss, dw, a["w"], rng)
    _directional_check(loss, db, a["bias"], rng)


def test_transpose_gradients_match_finite_differences(conv_case, layout, rng):
    a = case_arrays(conv_case, layout, "float64")
    g = a["dyt"]
    kw = dict(conv_case.kwargs, layout=layout, output_padding=conv_case.output_padding)

    def loss():
        return float(np.sum(nc.conv_transpose(a["xt"], a["w"], a["bias_t"], **kw) * g))

    dx, dw, db = nc.conv_transpose_backward(g, a["xt"], a["w"], **kw)
    _directional_check(loss, dx, a["xt"], rng)
    _directional_check(loss, dw, a["w"], rng)
    _directional_check(loss, db, a["bias_t"], rng)


def test_data_gradient_is_the_adjoint_of_conv(conv_case, layout):
    a = case_arrays(conv_case, layout, "float64")
    kw = dict(conv_case.kwargs, layout=layout)
    lhs = np.sum(nc.conv(a["x"], a["w"], **kw) * a["dy"])
    rhs = np.sum(a["x"] * nc.conv_backward_data(a["dy"], a["w"], a["x"].shape, **kw))
    assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs))
