"""Where compiled kernels are cached: a read-only install caches them under numbaconv's
cache directory, loads them in the next process, and never crashes when nothing is
writable.

Root ignores file modes, so besides taking the write bits away the read-only copy has a
plain file named ``__pycache__`` in each package directory, which no user can turn into
the directory Numba and Python would write.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest

import numbaconv
from numbaconv import config

PACKAGE = os.path.dirname(os.path.abspath(numbaconv.__file__))

#: One small op in a fresh process: where its kernels are cached and Numba's cache
#: statistics of every parallel kernel it ran.
SCRIPT = textwrap.dedent("""
    import json, time, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import numpy as np
        import numbaconv as nc
        from numbaconv import config
        start = time.perf_counter()
        db = nc.conv_backward_bias(np.ones((2, 3, 4, 4), np.float32))
        seconds = time.perf_counter() - start
    kernels = list(config._parallel_kernels) + config.serial_twins()
    print(json.dumps(dict(
        file=nc.__file__, where=config.kernel_cache_location(), seconds=seconds,
        ok=db.tolist() == [32.0, 32.0, 32.0],
        warnings=[str(w.message) for w in caught if "numbaconv" in str(w.message)],
        hits=sum(sum(k.stats.cache_hits.values()) for k in kernels),
        misses=sum(sum(k.stats.cache_misses.values()) for k in kernels))))
""")


def read_only_copy(root):
    """numbaconv's sources copied under ``root``, no directory of it writable."""
    target = os.path.join(root, "numbaconv")
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for folder, _, _ in os.walk(target):
        open(os.path.join(folder, "__pycache__"), "w").close()
    for folder, dirs, files in os.walk(target):
        for name in files:
            os.chmod(os.path.join(folder, name), 0o444)
        os.chmod(folder, 0o555)
    return target


def make_writable(path):
    for folder, _, _ in os.walk(path):
        os.chmod(folder, 0o755)


def snapshot(path):
    return sorted(os.path.relpath(os.path.join(d, f), path)
                  for d, _, files in os.walk(path) for f in files)


def run(env, cwd):
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def installed(tmp_path):
    """A read-only copy of the package and an environment importing it."""
    site = tmp_path / "site-packages"
    site.mkdir()
    copy = read_only_copy(str(site))
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_CACHE_DIR", "NUMBACONV_JIT_CACHE", "NUMBA_CACHE_LOCATOR_CLASSES")}
    env["PYTHONPATH"] = str(site)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    try:
        yield copy, env
    finally:
        make_writable(copy)


def test_read_only_install_caches_under_numbaconv_cache_dir(installed, tmp_path):
    copy, env = installed
    before = snapshot(copy)
    cache = tmp_path / "user-cache"
    env["NUMBACONV_CACHE_DIR"] = str(cache)
    first = run(env, str(tmp_path))
    assert first["file"].startswith(copy)
    assert first["ok"] and not first["warnings"]
    path, how = first["where"]
    assert path == str(cache / config.KERNEL_CACHE_SUBDIR)
    assert "read-only" in how
    assert first["misses"] >= 1 and first["hits"] == 0       # compiled, and saved
    assert any(name.endswith(".nbi") for name in snapshot(str(cache)))

    second = run(env, str(tmp_path))                           # a new process
    assert second["ok"] and not second["warnings"]
    assert second["hits"] >= 1 and second["misses"] == 0      # loaded, not compiled
    assert snapshot(copy) == before                            # nothing written inside


def test_read_only_install_without_numbaconv_cache_dir_uses_the_user_cache(installed,
                                                                          tmp_path):
    copy, env = installed
    env.pop("NUMBACONV_CACHE_DIR", None)
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    env["HOME"] = str(tmp_path / "home")
    if sys.platform in ("win32", "darwin"):
        pytest.skip("the user cache directory is not XDG's here")
    path, _ = run(env, str(tmp_path))["where"]
    assert path == str(tmp_path / "xdg" / "numbaconv" / config.KERNEL_CACHE_SUBDIR)


def test_nothing_writable_warns_and_runs_uncached(installed, tmp_path):
    copy, env = installed
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # Under a plain file no directory can be made, whoever asks.
    env.update(NUMBACONV_CACHE_DIR=str(blocker / "cache"), HOME=str(blocker / "home"),
               XDG_CACHE_HOME=str(blocker / "xdg"))
    result = run(env, str(tmp_path))
    assert result["ok"]
    assert result["where"][0] is None
    assert any("NUMBACONV_CACHE_DIR" in w for w in result["warnings"])
    assert result["hits"] == 0


def test_numba_cache_dir_wins(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    proc = subprocess.run([sys.executable, "-c", "from numbaconv import config; "
                           "print(config.describe_kernel_cache())"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(str(tmp_path / "numba")) and "NUMBA_CACHE_DIR" in proc.stdout


def test_the_locator_leaves_other_functions_to_numba(tmp_path):
    config._install_kernel_cache_locator()
    from numba.core import caching
    ours = [c for c in caching.CacheImpl._locator_classes if getattr(c, "numbaconv", False)]
    assert len(ours) == 1
    other = tmp_path / "user_module.py"
    other.write_text("def f():\n    pass\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ours[0].from_function(lambda: None, str(other)) is None


def test_a_change_beside_a_kernel_module_recompiles_its_kernels(tmp_path):
    """A kernel's cached compilation is filed under the stamp of every module beside its
    own (``config.sources_stamp``): the kernels inline helpers from their neighbours, so a
    change to ``cpu/_microkernel.py`` alone must not load a compilation made before it."""
    site = tmp_path / "site-packages"
    shutil.copytree(PACKAGE, site / "numbaconv",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_CACHE_DIR", "NUMBACONV_JIT_CACHE", "NUMBA_CACHE_LOCATOR_CLASSES")}
    env["PYTHONPATH"] = str(site)
    first = run(env, str(tmp_path))
    assert first["ok"] and "writable" in first["where"][1]
    assert first["misses"] >= 1 and first["hits"] == 0
    second = run(env, str(tmp_path))
    assert second["hits"] >= 1 and second["misses"] == 0      # loaded
    with open(site / "numbaconv" / "cpu" / "_microkernel.py", "a") as module:
        module.write("\n# a change beside the bias kernels' module\n")
    third = run(env, str(tmp_path))
    assert third["ok"] and third["misses"] >= 1 and third["hits"] == 0   # compiled anew


def test_sources_stamp_changes_with_any_module_of_the_folder(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not a module\n")
    before = config.sources_stamp(str(tmp_path))
    assert [entry[0] for entry in before] == ["a.py", "b.py"]
    (tmp_path / "notes.txt").write_text("still not a module, longer\n")
    assert config.sources_stamp(str(tmp_path)) == before
    (tmp_path / "b.py").write_text("y = 22\n")
    assert config.sources_stamp(str(tmp_path)) != before
