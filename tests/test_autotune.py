"""The autotuner: warm-up and noise margin, the versioned key, the on-disk cache (restart,
corrupt and foreign files, unwritable directories, concurrent writers) and explain().

Backends are the reference under other names (plugin_fixtures.FakeBackend), so nothing here
compiles a kernel; tests that need another process start a fresh interpreter.
"""

import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import numbaconv as nc
from numbaconv import autotune, dispatch
from plugin_fixtures import FakeBackend

X = np.random.default_rng(0).standard_normal((2, 3, 6, 6)).astype(np.float32)
W = np.random.default_rng(1).standard_normal((4, 3, 3, 3)).astype(np.float32)
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def clean_state(monkeypatch, tmp_path):
    """Real entry points, a private cache directory, autotuning off and nothing remembered."""
    monkeypatch.delenv("NUMBACONV_BACKEND", raising=False)
    monkeypatch.delenv("NUMBACONV_AUTOTUNE", raising=False)
    monkeypatch.setenv("NUMBACONV_CACHE_DIR", str(tmp_path / "cache"))
    nc.reload_backends()
    dispatch._autotune._forced = None
    dispatch._autotune._memory.clear()
    dispatch._autotune._warned.clear()
    yield
    dispatch._autotune._forced = None
    dispatch._autotune._memory.clear()
    dispatch._autotune._warned.clear()
    nc.reload_backends()


def register(backend):
    nc.register_backend(backend.name, lambda: backend)
    return backend


def cache_file(tmp_path):
    return tmp_path / "cache" / autotune._Autotuner.FILE


def read_cache(tmp_path) -> dict:
    return json.loads(cache_file(tmp_path).read_text())


def tuned_backend():
    """'fast' and 'slow' algorithms; the heuristic picks 'slow'."""
    return register(FakeBackend("tuned", priority=500, algorithms=("fast", "slow"),
                                slow=("slow",)))


def fixed_times(monkeypatch, times):
    """Make the tuner measure ``times`` ({algorithm: seconds}) instead of timing."""
    monkeypatch.setattr(autotune._Autotuner, "_time",
                        lambda self, backend, op, problem, operands, algorithm, sync:
                        times[algorithm])


def test_key_is_versioned_and_names_backend_version_device_and_threads():
    backend = tuned_backend()
    problem = nc.problem.conv_problem(X, W, None)
    key = dispatch._autotune.cache_key(backend, "conv", problem)
    version, name, device, threads, op, problem_key = key.split("|")
    assert version == f"k{dispatch.AUTOTUNE_KEY_VERSION}"
    assert name == f"tuned@{backend.version}"
    assert device.startswith("cpu:")
    assert threads.startswith("threads=") and int(threads.split("=")[1]) >= 1
    assert (op, problem_key) == ("conv", problem.key())
    # A new backend version is another key: its timings may differ.
    backend.version = "2"
    assert dispatch._autotune.cache_key(backend, "conv", problem) != key


def test_warm_up_run_is_not_timed(monkeypatch):
    class CompilesFirst(FakeBackend):
        """'jit' takes 50 ms on its first run (compiling), then nothing; 'numpy' 10 ms."""

        def run(self, op, problem, operands, out, algorithm):
            first = algorithm not in {a for _, a in self.runs}
            result = super().run(op, problem, operands, out, algorithm)
            if algorithm == "jit" and first:
                time.sleep(0.05)
            elif algorithm == "numpy":
                time.sleep(0.01)
            return result

    # One timed run each: were the first run timed, 'jit' would lose.
    monkeypatch.setattr(autotune._Autotuner, "REPEAT", 1)
    backend = register(CompilesFirst("tuned", priority=500, algorithms=("jit", "numpy")))
    nc.set_autotune(True)
    choice = nc.explain("conv", X, W)
    assert choice.algorithm == "jit", choice.reason
    assert [a for _, a in backend.runs] == ["jit", "jit", "numpy", "numpy"]


def test_noise_margin_keeps_the_heuristic(monkeypatch, tmp_path):
    tuned_backend()  # heuristic: 'slow'
    nc.set_autotune(True)
    fixed_times(monkeypatch, {"fast": 0.98e-3, "slow": 1.0e-3})  # 2% apart: noise
    choice = nc.explain("conv", X, W)
    assert choice.algorithm == "slow"
    assert "autotuned (timed now)" in choice.reason
    assert "kept the heuristic's 'slow'" in choice.reason and "noise margin" in choice.reason
    (record,) = read_cache(tmp_path)["entries"].values()
    assert (record["algorithm"], record["heuristic"]) == ("slow", "slow")
    # A clear lead replaces the heuristic's choice (a new process: empty memory and file).
    dispatch._autotune._memory.clear()
    cache_file(tmp_path).unlink()
    nc.set_autotune(True)
    fixed_times(monkeypatch, {"fast": 0.5e-3, "slow": 1.0e-3})
    choice = nc.explain("conv", X, W)
    assert choice.algorithm == "fast" and "'fast' was fastest" in choice.reason


def test_explain_says_where_the_choice_came_from(tmp_path):
    tuned_backend()
    heuristic = nc.explain("conv", X, W)
    assert "autotuned" not in heuristic.reason
    nc.set_autotune(True)
    first = nc.explain("conv", X, W)
    assert first.reason.startswith("autotuned (timed now)")
    assert "test heuristic picks the last" in first.reason  # the heuristic's own reason
    dispatch._registry.choices.clear()
    assert nc.explain("conv", X, W).reason.startswith("autotuned (remembered in this process)")
    dispatch._registry.choices.clear()
    dispatch._autotune._memory.clear()
    again = nc.explain("conv", X, W)
    assert again.reason.startswith(f"autotuned (read from {cache_file(tmp_path)})")
    assert again.algorithm == first.algorithm == "fast"


def test_single_algorithm_is_not_tuned(tmp_path):
    register(FakeBackend("single", priority=500, algorithms=("only",)))
    nc.set_autotune(True)
    choice = nc.explain("conv", X, W)
    assert choice.algorithm == "only" and "autotuned" not in choice.reason
    assert not cache_file(tmp_path).exists()


def test_cache_survives_a_restart(tmp_path):
    """A fresh interpreter reads the first one's result and times nothing."""
    script = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, sys.argv[1])
        import numpy as np, numbaconv as nc
        from plugin_fixtures import FakeBackend
        backend = FakeBackend("tuned", priority=500, algorithms=("fast", "slow"),
                              slow=("slow",))
        nc.register_backend("tuned", lambda: backend)
        x, w = np.ones((1, 2, 5, 5), np.float32), np.ones((3, 2, 3, 3), np.float32)
        choice = nc.explain("conv", x, w)
        print(json.dumps(dict(algorithm=choice.algorithm, reason=choice.reason,
                              runs=backend.runs)))
    """)
    env = dict(os.environ, NUMBACONV_AUTOTUNE="1",
               NUMBACONV_CACHE_DIR=str(tmp_path / "cache"))

    def fresh_process():
        proc = subprocess.run([sys.executable, "-c", script, TESTS_DIR], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = fresh_process()
    assert first["algorithm"] == "fast" and "timed now" in first["reason"]
    assert {a for _, a in first["runs"]} == {"fast", "slow"}
    second = fresh_process()
    assert second["algorithm"] == "fast"
    assert "read from" in second["reason"] and second["runs"] == []


@pytest.mark.parametrize("content", [
    "{not json",                                          # corrupt
    "\x00\xff\xfe garbage",                               # binary junk
    "[1, 2, 3]",                                          # JSON, but not ours
    '{"format": "someone else", "version": 1, "entries": {}}',
    '{"version": 99, "entries": {}}',                     # a future format
    '{"version": 1, "entries": []}',
    "[" * 100_000 + "]" * 100_000,                        # deeper than the decoder goes
    '{"version": 1, "entries": {"k": ' + '{"a": ' * 100_000 + "1" + "}" * 100_002,
], ids=["truncated", "binary", "list", "other-format", "future-version", "bad-entries",
        "deeply-nested", "deeply-nested-entry"])
def test_corrupt_or_foreign_file_is_ignored_with_a_warning_and_rewritten(
        tmp_path, caplog, content):
    path = cache_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    tuned_backend()
    nc.set_autotune(True)
    with caplog.at_level(logging.WARNING, logger="numbaconv.dispatch"):
        choice = nc.explain("conv", X, W)
    assert choice.algorithm == "fast" and "timed now" in choice.reason
    warnings = [r.getMessage() for r in caplog.records if "ignoring the autotune cache" in
                r.getMessage()]
    assert len(warnings) == 1, warnings  # once, though the file is read twice
    assert str(path) in warnings[0] and "rewritten" in warnings[0]
    data = read_cache(tmp_path)  # rewritten whole and valid
    assert data["format"] == dispatch.AUTOTUNE_FORMAT and data["version"] == 1
    assert [r["algorithm"] for r in data["entries"].values()] == ["fast"]


def test_malformed_entries_are_dropped_and_the_rest_kept(tmp_path, caplog):
    backend = tuned_backend()
    key = dispatch._autotune.cache_key(backend, "conv", nc.problem.conv_problem(X, W, None))
    good = {"algorithm": "direct", "times": {"direct": 1e-3}}
    path = cache_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 1, "entries": {
        key: {"algorithm": 3, "times": "fast"}, "someone else's": good}}))
    nc.set_autotune(True)
    with caplog.at_level(logging.WARNING, logger="numbaconv.dispatch"):
        assert nc.explain("conv", X, W).algorithm == "fast"
    assert "1 malformed entry" in caplog.text
    entries = read_cache(tmp_path)["entries"]
    assert entries["someone else's"] == good and entries[key]["algorithm"] == "fast"


def test_stale_algorithm_in_the_cache_is_timed_again(tmp_path):
    backend = tuned_backend()
    key = dispatch._autotune.cache_key(backend, "conv", nc.problem.conv_problem(X, W, None))
    path = cache_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 1, "entries": {
        key: {"algorithm": "retired", "times": {"retired": 1e-6}}}}))
    nc.set_autotune(True)
    choice = nc.explain("conv", X, W)
    assert choice.algorithm == "fast" and "timed now" in choice.reason


def test_unwritable_cache_directory_warns_and_still_tunes(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("NUMBACONV_CACHE_DIR", str(blocker / "cache"))
    tuned_backend()
    nc.set_autotune(True)
    with caplog.at_level(logging.WARNING, logger="numbaconv.dispatch"):
        choice = nc.explain("conv", X, W)
    assert choice.algorithm == "fast"
    assert "could not be written" in choice.reason
    assert "could not write the autotune cache" in caplog.text


def test_failing_algorithm_is_skipped():
    class Broken(FakeBackend):
        def run(self, op, problem, operands, out, algorithm):
            if algorithm == "broken":
                raise RuntimeError("kernel exploded")
            return super().run(op, problem, operands, out, algorithm)

    register(Broken("tuned", priority=500, algorithms=("broken", "numpy")))
    nc.set_autotune(True)
    choice = nc.explain("conv", X, W)
    assert choice.algorithm == "numpy"


def test_writes_are_atomic_and_leave_no_temporary_files(tmp_path, monkeypatch):
    tuned_backend()
    nc.set_autotune(True)
    nc.explain("conv", X, W)
    before = cache_file(tmp_path).read_text()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    # A write failing half-way leaves the previous file whole and no temporary behind.
    monkeypatch.setattr(autotune.json, "dump", fail)
    assert dispatch._autotune._save("another key", {"algorithm": "a", "times": {"a": 1.0}}) \
        is False
    assert cache_file(tmp_path).read_text() == before
    names = sorted(p.name for p in cache_file(tmp_path).parent.iterdir())
    assert names == [autotune._Autotuner.FILE, autotune._Autotuner.FILE + ".lock"]


def test_concurrent_processes_lose_no_entry(tmp_path):
    """Three interpreters add 40 entries each at the same time; all 120 survive."""
    script = textwrap.dedent("""
        import sys
        from numbaconv import dispatch
        worker, count = sys.argv[1], int(sys.argv[2])
        print("ready", flush=True)
        sys.stdin.readline()  # start together
        for i in range(count):
            ok = dispatch._autotune._save(f"{worker}-{i}",
                                          {"algorithm": "a", "times": {"a": float(i)}})
            assert ok, "write failed"
    """)
    env = dict(os.environ, NUMBACONV_CACHE_DIR=str(tmp_path / "cache"))
    workers, count = ("w0", "w1", "w2"), 40
    procs = [subprocess.Popen([sys.executable, "-c", script, w, str(count)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for w in workers]
    for p in procs:  # every interpreter has imported numbaconv before any of them writes
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    entries = read_cache(tmp_path)["entries"]
    assert set(entries) == {f"{w}-{i}" for w in workers for i in range(count)}
    assert [p.name for p in cache_file(tmp_path).parent.iterdir()
            if p.name.endswith(".tmp")] == []


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBACONV_CACHE_DIR", str(tmp_path / "here"))
    assert dispatch.default_cache_dir() == str(tmp_path / "here")
    monkeypatch.setenv("NUMBACONV_CACHE_DIR", "~/somewhere")
    assert dispatch.default_cache_dir() == os.path.expanduser("~/somewhere")
    monkeypatch.delenv("NUMBACONV_CACHE_DIR")
    if sys.platform.startswith("linux"):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert dispatch.default_cache_dir() == str(tmp_path / "xdg" / "numbaconv")
        monkeypatch.delenv("XDG_CACHE_HOME")
        assert dispatch.default_cache_dir() == os.path.expanduser("~/.cache/numbaconv")


def test_problem_the_tuner_cannot_feed_keeps_the_heuristic(monkeypatch, caplog, tmp_path):
    def refuse(op, problem, seed=0):
        raise ValueError(f"op: no random operands for {op!r}")

    monkeypatch.setattr(autotune, "random_operands", refuse)
    tuned_backend()
    nc.set_autotune(True)
    with caplog.at_level(logging.WARNING, logger="numbaconv.dispatch"):
        choice = nc.explain("conv", X, W)
    assert choice.algorithm == "slow" and "autotuned" not in choice.reason
    assert "not autotuning conv" in caplog.text
    assert not cache_file(tmp_path).exists()
