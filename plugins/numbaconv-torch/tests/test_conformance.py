"""numbaconv-torch against numbaconv's reference backend, and the plugin-protocol promises.

Tests that compute need PyTorch and are skipped without it; the ones about staying cheap
(importing, creating and asking the backend imports no torch) run either way.
"""

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import numbaconv
import numbaconv_torch
from numbaconv.problem import conv_problem
from numbaconv.testing import assert_backend_conforms

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="PyTorch is not installed")


@pytest.fixture
def priority_order(monkeypatch):
    """Dispatch by priority: no NUMBACONV_BACKEND override from the caller's environment."""
    monkeypatch.delenv("NUMBACONV_BACKEND", raising=False)


def _run_python(code: str, *flags: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (sys.modules must start without torch)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBACONV_BACKEND"}
    return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, env=env, timeout=120)


@needs_torch
def test_conforms_to_reference():
    """Every op on every case, both layouts, float32/float64, plain, out= and accumulate."""
    # The backend supports the whole convolution API: it may decline nothing.
    results = assert_backend_conforms("torch", allow_skips=False)
    assert all(r.status == "pass" for r in results)


def test_import_and_dispatch_do_not_import_torch():
    """numbaconv creates every backend and asks supports() on first dispatch: no torch."""
    result = _run_python("""
        import sys
        import numpy as np
        import numbaconv, numbaconv_torch

        backend = numbaconv_torch.make_backend()
        backend.availability()
        numbaconv.backends()
        x = np.zeros((1, 2, 5), np.float32)
        w = np.zeros((3, 2, 3), np.float32)
        numbaconv.explain("conv", x, w)
        assert "torch" not in sys.modules, "torch was imported"
    """)
    assert result.returncode == 0, result.stderr


@needs_torch
def test_explain_prefers_torch_over_reference(priority_order):
    x = np.zeros((2, 3, 8, 8), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    infos = {b.name: b for b in numbaconv.backends()}
    assert infos["torch"].available, infos["torch"].reason
    assert (infos["torch"].device, infos["torch"].priority) == ("cpu", 10)
    choice = numbaconv.explain("conv", x, w, padding=1)
    # A backend ranked above torch (numbaconv's native "cpu", priority 100) may win once it
    # is installed; the reference must never be tried before torch either way.
    above = {name for name, b in infos.items()
             if b.available and b.device == "cpu" and b.priority > infos["torch"].priority}
    assert choice.backend in above | {"torch"}, choice
    assert "reference" not in choice.rejected
    assert "priority order" in choice.reason


def test_unavailable_without_torch(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "torch" else object())
    reason = numbaconv_torch.make_backend().availability()
    assert reason is not None and "torch" in reason


def test_declines_what_it_does_not_implement():
    backend = numbaconv_torch.make_backend()
    problem = conv_problem(np.zeros((1, 2, 5), np.float32), np.zeros((3, 2, 3), np.float32))
    assert backend.supports("conv", problem) is None
    assert backend.supports("rnn_forward", problem) is not None
    half = dataclasses.replace(problem, dtype="float16")
    assert "float16" in backend.supports("conv", half)
    assert backend.algorithms("conv", problem) == ("aten",)
    assert backend.choose("conv", problem)[0] == "aten"


@needs_torch
def test_read_only_operands_give_right_result_and_no_warning():
    """torch.from_numpy warns once per process about read-only arrays: a fresh process."""
    result = _run_python("""
        import numpy as np
        import numbaconv

        rng = np.random.default_rng(0)
        x = rng.standard_normal((2, 3, 9)).astype(np.float32)
        w = rng.standard_normal((4, 3, 3)).astype(np.float32)
        x.flags.writeable = w.flags.writeable = False
        with numbaconv.use_backend("torch"):
            got = numbaconv.conv(x, w, stride=2, padding=((2, 0),))
        with numbaconv.use_backend("reference"):
            expected = numbaconv.conv(x, w, stride=2, padding=((2, 0),))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    """, "-W", "error::UserWarning")
    assert result.returncode == 0, result.stderr
