"""Every available backend against the reference, through numbaconv.testing; and the
conformance helper itself must catch a wrong backend."""

import numpy as np
import pytest

import numbaconv as nc
from numbaconv.testing import CASES, assert_backend_conforms, check_backend
from plugin_fixtures import FakeBackend

CHECKED = [b.name for b in nc.backends()
           if b.available and b.device == "cpu" and b.name != "reference"]


@pytest.mark.parametrize("name", CHECKED or [pytest.param(None, marks=pytest.mark.skip(
    reason="no CPU backend other than the reference is installed"))])
def test_backend_conforms(name):
    results = assert_backend_conforms(name)
    assert sum(r.status == "pass" for r in results) > 0


class OffByOne(FakeBackend):
    def run(self, op, problem, operands, out, algorithm):
        result = super().run(op, problem, operands, out, algorithm)
        if op == "conv_backward_weight":
            result.flat[0] += 1.0
        return result


class IgnoresAccumulate(FakeBackend):
    def run(self, op, problem, operands, out, algorithm):
        from dataclasses import replace
        return super().run(op, replace(problem, accumulate=False), operands, out, algorithm)


@pytest.mark.parametrize("backend, expected", [
    (OffByOne("offbyone"), "conv_backward_weight"),
    (IgnoresAccumulate("noaccumulate"), "accumulate"),
])
def test_conformance_helper_catches_wrong_backends(backend, expected):
    nc.register_backend(backend.name, lambda: backend)
    try:
        with pytest.raises(AssertionError, match=expected):
            assert_backend_conforms(backend.name, cases=CASES[:3])
    finally:
        nc.unregister_backend(backend.name)


def test_declining_everything_is_not_conformance():
    backend = FakeBackend("lazy", decline=lambda op, p: True)
    nc.register_backend("lazy", lambda: backend)
    try:
        results = check_backend("lazy", cases=CASES[:1])
        assert {r.status for r in results} == {"skip"}
        with pytest.raises(AssertionError, match="supported none"):
            assert_backend_conforms("lazy", cases=CASES[:1])
    finally:
        nc.unregister_backend("lazy")


def test_relative_error_sees_nan():
    from numbaconv.testing import relative_error
    assert relative_error(np.array([np.nan]), np.array([1.0])) == float("inf")
    assert relative_error(np.ones(2), np.ones(3)) == float("inf")


def test_partial_support_passes_only_when_skips_are_allowed():
    backend = FakeBackend("partial", decline=lambda op, p: getattr(p, "channels_last", False))
    nc.register_backend("partial", lambda: backend)
    try:
        assert_backend_conforms("partial", cases=CASES[:1])
        with pytest.raises(AssertionError, match="skip"):
            assert_backend_conforms("partial", cases=CASES[:1], allow_skips=False)
    finally:
        nc.unregister_backend("partial")


class WritesToOperands(FakeBackend):
    def run(self, op, problem, operands, out, algorithm):
        operands[0].flat[0] = 0.0  # must fail: operands are read-only
        return super().run(op, problem, operands, out, algorithm)


def test_writing_to_an_operand_fails_conformance():
    nc.register_backend("writer", lambda: WritesToOperands("writer"))
    try:
        with pytest.raises(AssertionError, match="read-only"):
            assert_backend_conforms("writer", cases=CASES[:1])
    finally:
        nc.unregister_backend("writer")


def test_cpu_recurrent_ops_conform():
    from numbaconv.testing import RNN_CASES, check_rnn_backend
    results = check_rnn_backend("cpu")
    assert len(results) == len(RNN_CASES) * 2 * 5  # (3 ops plain + 2 weight modes) x dtypes
    assert all(r.status == "pass" for r in results), [r for r in results if r.status != "pass"]


def test_recurrent_check_catches_a_wrong_weight_gradient():
    from numbaconv import reference
    from numbaconv.testing import RNN_CASES, check_rnn_backend

    class WrongBias(reference.ReferenceBackend):
        name = "wrongbias"

        def run(self, op, problem, operands, out, algorithm):
            result = super().run(op, problem, operands, out, algorithm)
            if op == "rnn_backward_weights":
                result[-1] += 1.0
            return result

    nc.register_backend("wrongbias", WrongBias)
    try:
        results = check_rnn_backend("wrongbias", RNN_CASES[:1], dtypes=("float64",))
    finally:
        nc.unregister_backend("wrongbias")
    status = {(r.op, r.mode): r.status for r in results}
    assert status[("rnn_forward", "plain")] == "pass"
    assert {s for (op, _), s in status.items() if op == "rnn_backward_weights"} == {"FAIL"}


def test_algorithm_forced_runs_the_backends_ops_on_one_algorithm():
    """numbaconv.testing.algorithm_forced: the forced algorithm where the backend offers
    it (counted), the dispatcher's choice for other ops, a ValueError with ``strict`` where
    it is not offered, and the backend's own run back afterwards."""
    from numbaconv.cpu import CpuBackend
    from numbaconv.testing import algorithm_forced
    real = CpuBackend.run
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((1, 2, 5, 5)), rng.standard_normal((3, 2, 1, 1))
    with nc.use_backend("reference"):
        expected = nc.conv(x, w)
    with nc.use_backend("cpu"):
        with algorithm_forced(CpuBackend, ("conv",), "im2col") as forced:
            assert CpuBackend.run is not real
            np.testing.assert_allclose(nc.conv(x, w), expected, rtol=1e-12)
            nc.conv_backward_data(np.ones((1, 3, 5, 5)), w, x.shape)   # not forced
            assert forced["runs"] == 1
            forced["algorithm"] = None
            nc.conv(x, w)
            assert forced["runs"] == 1
        with algorithm_forced(CpuBackend, ("conv",), "winograd", strict=True):
            with pytest.raises(ValueError, match="does not offer 'winograd' for conv"):
                nc.conv(x, w)                       # a 1x1 kernel: no Winograd
        with algorithm_forced(CpuBackend, ("conv",), "winograd") as forced:
            nc.conv(x, w)                           # not offered: the chosen one runs
            assert forced["runs"] == 0
    assert CpuBackend.run is real
    for ops in ("conv", ("conv", "convolution")):
        with pytest.raises(ValueError, match="ops: expected a sequence of op names"):
            with algorithm_forced(CpuBackend, ops, "im2col"):
                pass
    assert CpuBackend.run is real
