"""The dispatcher: discovery, selection, use_backend, NUMBACONV_BACKEND, broken plugins,
logging, explain and autotuning."""

import json
import logging
import os
import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest

import numbaconv as nc
from numbaconv import dispatch
from plugin_fixtures import FakeBackend

X = np.random.default_rng(0).standard_normal((2, 3, 6, 6)).astype(np.float32)
W = np.random.default_rng(1).standard_normal((4, 3, 3, 3)).astype(np.float32)


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch, tmp_path):
    """Every test starts from the real entry points, no env overrides, no autotune."""
    monkeypatch.delenv("NUMBACONV_BACKEND", raising=False)
    monkeypatch.delenv("NUMBACONV_AUTOTUNE", raising=False)
    monkeypatch.setenv("NUMBACONV_CACHE_DIR", str(tmp_path / "cache"))
    nc.reload_backends()
    dispatch._autotune._forced = None
    dispatch._autotune._memory.clear()
    yield
    dispatch._autotune._forced = None
    dispatch._autotune._memory.clear()
    nc.reload_backends()


def register(backend):
    nc.register_backend(backend.name, lambda: backend)
    return backend


def test_reference_is_registered_through_its_entry_point():
    names = {ep.name: ep.value for ep in metadata.entry_points(group="numbaconv.backends")}
    assert names["reference"] == "numbaconv.reference:make_backend"
    info = {b.name: b for b in nc.backends()}["reference"]
    assert (info.device, info.priority, info.available, info.reason) == ("cpu", 0, True, "ok")


def test_highest_priority_supporting_backend_wins():
    register(FakeBackend("high", priority=500))
    register(FakeBackend("middle", priority=400))
    choice = nc.explain("conv", X, W)
    assert choice.backend == "high"
    assert choice.algorithm == "numpy"
    assert "priority order" in choice.reason


def test_declining_backend_is_skipped_with_its_reason():
    register(FakeBackend("picky", priority=500, decline=lambda op, p: p.stride != (1, 1)))
    assert nc.explain("conv", X, W).backend == "picky"
    choice = nc.explain("conv", X, W, stride=2)
    assert choice.backend != "picky"
    assert choice.rejected["picky"] == "picky declines this one"


def test_unavailable_backend_is_listed_and_skipped():
    register(FakeBackend("absent", priority=500, unavailable="needs hardware X"))
    info = {b.name: b for b in nc.backends()}["absent"]
    assert not info.available and info.reason == "needs hardware X"
    choice = nc.explain("conv", X, W)
    assert choice.backend != "absent" and choice.rejected["absent"] == "needs hardware X"


def test_use_backend_restricts_and_orders():
    low = register(FakeBackend("low", priority=-5))
    register(FakeBackend("high", priority=500))
    with nc.use_backend("low", "high"):
        assert nc.explain("conv", X, W).backend == "low"
        y = nc.conv(X, W)
        with nc.use_backend("reference"):  # nests
            assert nc.explain("conv", X, W).backend == "reference"
        assert nc.explain("conv", X, W).backend == "low"
    assert low.runs == [("conv", "numpy")]
    with nc.use_backend("reference"):
        np.testing.assert_array_equal(nc.conv(X, W), y)
    assert nc.explain("conv", X, W).backend == "high"


def test_use_backend_without_support_raises_with_every_reason():
    register(FakeBackend("never", decline=lambda op, p: True))
    with nc.use_backend("never"):
        with pytest.raises(nc.NoBackendError, match="never: never declines this one"):
            nc.conv(X, W)


def test_use_backend_unknown_name():
    with pytest.raises(ValueError, match="use_backend: unknown backend 'nope'"):
        with nc.use_backend("nope"):
            pass
    with pytest.raises(ValueError, match="names: expected at least one"):
        with nc.use_backend():
            pass


def test_environment_variable(monkeypatch):
    register(FakeBackend("high", priority=500))
    monkeypatch.setenv("NUMBACONV_BACKEND", " reference ")
    assert nc.explain("conv", X, W).backend == "reference"
    monkeypatch.setenv("NUMBACONV_BACKEND", "high,reference")
    assert nc.explain("conv", X, W).backend == "high"
    with nc.use_backend("reference"):  # the context manager wins over the environment
        assert nc.explain("conv", X, W).backend == "reference"
    monkeypatch.setenv("NUMBACONV_BACKEND", "reference,typo")
    with pytest.raises(ValueError, match="NUMBACONV_BACKEND: unknown backend 'typo'"):
        nc.conv(X, W)
    monkeypatch.setenv("NUMBACONV_BACKEND", "reference,,high")
    with pytest.raises(ValueError, match="NUMBACONV_BACKEND: .*empty name"):
        nc.conv(X, W)
    monkeypatch.setenv("NUMBACONV_BACKEND", "")
    assert nc.explain("conv", X, W).backend == "high"


def test_environment_reads_follow_os_environ(monkeypatch):
    """The dispatcher's fast reads of its variables see every change made through
    os.environ, as os.environ.get does."""
    from numbaconv.config import environ_value
    name = "NUMBACONV_TEST_VARIABLE_\u00e9"
    monkeypatch.delenv(name, raising=False)
    assert environ_value(name) == "" == os.environ.get(name, "")
    for value in ("1", " reference ", "caf\u00e9", ""):
        monkeypatch.setenv(name, value)
        assert environ_value(name) == value == os.environ[name]
    del os.environ[name]
    assert environ_value(name) == ""


def test_broken_plugins_are_reported_and_skipped(monkeypatch):
    group = dispatch.ENTRY_POINT_GROUP
    real = list(metadata.entry_points(group=group))
    fake = [metadata.EntryPoint("broken_import", "broken_plugin:make_backend", group),
            metadata.EntryPoint("broken_init", "plugin_fixtures:failing_factory", group),
            metadata.EntryPoint("not_a_backend", "plugin_fixtures:not_a_backend", group),
            metadata.EntryPoint("missing_module", "no_such_module_xyz:make", group)]
    monkeypatch.setattr(dispatch, "_entry_points", lambda: fake + real)
    nc.reload_backends()
    infos = {b.name: b for b in nc.backends()}
    assert not infos["broken_import"].available
    assert "ImportError: this plugin needs a library" in infos["broken_import"].reason
    assert "RuntimeError: device initialisation failed" in infos["broken_init"].reason
    assert "has no attribute 'name'" in infos["not_a_backend"].reason
    assert "ModuleNotFoundError" in infos["missing_module"].reason
    assert infos["reference"].available
    choice = nc.explain("conv", X, W)
    assert choice.backend != "broken_import"
    np.testing.assert_allclose(nc.conv(X, W), nc.conv(X, W))
    with nc.use_backend("broken_init", "reference"):
        choice = nc.explain("conv", X, W)
    assert choice.backend == "reference"
    assert "device initialisation failed" in choice.rejected["broken_init"]


def test_backend_name_must_match_entry_point():
    nc.register_backend("alias", lambda: FakeBackend("other"))
    info = {b.name: b for b in nc.backends()}["alias"]
    assert not info.available and "registered as 'alias'" in info.reason


def test_register_twice_is_an_error():
    register(FakeBackend("twice"))
    with pytest.raises(ValueError, match="already registered"):
        register(FakeBackend("twice"))
    nc.register_backend("twice", lambda: FakeBackend("twice"), replace=True)


def test_gpu_arrays_never_go_to_cpu_backends():
    from test_validation import FakeCudaArray
    xg, wg = FakeCudaArray(X.shape), FakeCudaArray(W.shape)
    with pytest.raises(nc.NoBackendError, match="reference: runs on cpu, the arrays are on "
                                                "cuda"):
        nc.conv(xg, wg)


def test_debug_log_names_every_choice(caplog):
    register(FakeBackend("high", priority=500, decline=lambda op, p: op == "conv"))
    with caplog.at_level(logging.DEBUG, logger="numbaconv.dispatch"), \
            nc.use_backend("high", "reference"):
        nc.conv(X, W)
        nc.conv(X, W)
    first, second = (r.getMessage() for r in caplog.records[-2:])
    assert "conv conv:N2:C3:K4" in first and "backend 'reference'" in first
    assert "high declines" in first
    assert "backend 'reference'" in second and "cached choice" in second


def test_choices_are_cached_per_problem():
    backend = register(FakeBackend("counted", priority=500))
    calls = []
    original = backend.supports
    backend.supports = lambda op, p: calls.append(op) or original(op, p)
    for _ in range(3):
        nc.conv(X, W)
    nc.conv(X, W, stride=2)
    assert calls == ["conv", "conv"]


def test_unknown_op_for_explain():
    with pytest.raises(ValueError, match="op: expected one of"):
        nc.explain("convolve", X, W)
    with pytest.raises(TypeError, match="config"):
        nc.explain("rnn_forward", "lstm", X, W)


def test_autotune_times_each_algorithm_and_caches_on_disk(tmp_path, monkeypatch):
    backend = register(FakeBackend("tuned", priority=500, algorithms=("fast", "slow"),
                                   slow=("slow",)))
    assert nc.explain("conv", X, W).algorithm == "slow"  # the heuristic's pick
    nc.set_autotune(True)
    choice = nc.explain("conv", X, W)
    assert choice.algorithm == "fast" and "autotuned" in choice.reason
    assert {a for _, a in backend.runs} == {"fast", "slow"}
    cache = json.loads((tmp_path / "cache" / "autotune-v1.json").read_text())
    (record,) = cache["entries"].values()
    assert record["algorithm"] == "fast"
    # A fresh process (simulated: empty memory) reads the disk and times nothing.
    dispatch._autotune._memory.clear()
    dispatch._registry.choices.clear()
    backend.runs.clear()
    out = np.full((2, 4, 4, 4), 5.0, np.float32)
    nc.conv(X, W, out=out)
    assert backend.runs == [("conv", "fast")]
    nc.set_autotune(False)
    assert nc.explain("conv", X, W).algorithm == "slow"


def test_autotune_environment(monkeypatch):
    monkeypatch.setenv("NUMBACONV_AUTOTUNE", "yes")
    with pytest.raises(ValueError, match="NUMBACONV_AUTOTUNE: expected '0' or '1'"):
        nc.conv(X, W)
    monkeypatch.setenv("NUMBACONV_AUTOTUNE", "1")
    backend = register(FakeBackend("tuned", priority=500, algorithms=("a", "b")))
    nc.conv(X, W)
    assert {a for _, a in backend.runs} == {"a", "b"}
    with pytest.raises(TypeError, match="enabled: expected True or False"):
        nc.set_autotune("on")


def test_autotune_never_touches_out_when_accumulating():
    register(FakeBackend("tuned", priority=500, algorithms=("a", "b")))
    nc.set_autotune(True)
    dy = np.ones((2, 4, 4, 4), np.float32)
    out = np.ones(W.shape, np.float32)
    expected = 1 + nc.conv_backward_weight(X, dy, W.shape)
    nc.reload_backends()
    register(FakeBackend("tuned", priority=500, algorithms=("a", "b")))
    nc.conv_backward_weight(X, dy, W.shape, out=out, accumulate=True)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_import_is_cheap_and_touches_no_gpu():
    code = ("import sys, numpy as np, numbaconv as nc\n"
            "assert 'numba.cuda' not in sys.modules, 'numba.cuda imported'\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'numba' not in sys.modules, 'numba imported at import time'\n"
            "nc.backends()\n"
            "with nc.use_backend('reference'):\n"
            "    nc.conv(np.ones((1, 1, 3, 3)), np.ones((1, 1, 2, 2)))\n"
            "assert 'numba.cuda' not in sys.modules, 'numba.cuda imported by a CPU call'\n"
            "assert 'torch' not in sys.modules, 'torch imported by discovery'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
