"""``numbaconv warmup`` / ``numbaconv.warmup``: after a warm-up into a fresh cache directory,
a new process's first call of a warmed op loads its kernels instead of compiling them."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import numbaconv
from numbaconv import _warmup
from numbaconv.__main__ import main

#: A new process's first calls of two warmed ops on shapes of their own (not the warm-up's),
#: with Numba's cache statistics and the time of each first call.
FIRST_CALLS = textwrap.dedent("""
    import json, time
    import numpy as np
    import numbaconv as nc
    from numbaconv._warmup import kernel_cache_stats
    import numba
    # Not the kernels' part of a first call: backend discovery, and Numba's one-off set-up
    # of its CPU target (its NumPy registries, 0.5-1.5 s here), which any jitted function
    # pays first.
    nc.backends()
    numba.njit(lambda: 1)()
    x = np.random.rand(8, 48, 28, 28).astype(np.float32)
    w = np.random.rand(96, 48, 1, 1).astype(np.float32)
    b = np.random.rand(96).astype(np.float32)
    seconds = {}
    start = time.perf_counter()
    y = nc.conv(x, w, b, stride=2)
    seconds["conv"] = time.perf_counter() - start
    start = time.perf_counter()
    nc.conv_backward_bias(y)
    seconds["conv_backward_bias"] = time.perf_counter() - start
    hits, misses = kernel_cache_stats()
    print(json.dumps(dict(seconds=seconds, hits=hits, misses=misses,
                          algorithm=nc.explain("conv", x, w, b, stride=2).algorithm)))
""")


def fresh_env(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBACONV_JIT_CACHE", "NUMBACONV_BACKEND", "NUMBACONV_AUTOTUNE")}
    # The numbaconv under test, whatever the working directory.
    root = os.path.dirname(os.path.dirname(os.path.abspath(numbaconv.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"),
               NUMBACONV_CACHE_DIR=str(tmp_path / "numbaconv-cache"))
    return env


def test_warmup_then_a_new_process_loads_instead_of_compiling(tmp_path):
    env = fresh_env(tmp_path)
    warm = subprocess.run([sys.executable, "-m", "numbaconv", "warmup", "--op", "conv",
                           "--op", "conv_backward_bias", "--layer", "1x1s2", "--no-progress"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    assert "kernels cached in: " + str(tmp_path / "numba-cache") in warm.stdout
    assert "NUMBA_CACHE_DIR" in warm.stdout
    compiled = int(warm.stdout.split(" kernel compilation(s) now")[0].split()[-1])
    assert compiled >= 2                                   # the cache was empty
    assert any(f.endswith(".nbi") for _, _, files in os.walk(tmp_path / "numba-cache")
               for f in files)

    proc = subprocess.run([sys.executable, "-c", FIRST_CALLS], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print("first calls after the warm-up:", result)
    assert result["algorithm"] == "im2col"                 # what the warm-up forced
    assert result["misses"] == 0, result                   # nothing compiled...
    assert result["hits"] >= 2, result                     # ...everything loaded
    # Compiling these kernels took 20-30 s here (2 busy cores); loading them a fraction of
    # a second.
    assert all(s < 1.0 for s in result["seconds"].values()), result


def test_plan_defaults_to_a_float32_2d_channels_first_training_step():
    combos = _warmup.plan()
    assert {c[0] for c in combos} == set(_warmup.DEFAULT_OPS)
    assert {c[1:4] for c in combos} == {("float32", "channels_first", 2)}
    assert {c[4] for c in combos} == set(_warmup.DEFAULT_LAYERS)
    both = _warmup.plan("conv", dtypes="both", layouts="both", ndims=(1, 3), layers="all")
    assert {c[1] for c in both} == {"float32", "float64"}
    assert {c[2] for c in both} == {"channels_first", "channels_last"}
    assert {c[3] for c in both} == {1, 3}
    assert {c[4] for c in both} == set(_warmup.LAYERS)


@pytest.mark.parametrize("kwargs", [dict(ops="convolve"), dict(dtypes="float16"),
                                    dict(layouts="NCHW"), dict(ndims=4), dict(layers="5x5")])
def test_plan_rejects_unknown_values(kwargs):
    with pytest.raises(ValueError):
        _warmup.plan(**kwargs)


def test_warmup_is_exported_and_documented_as_an_addition():
    assert numbaconv.warmup is _warmup.warmup
    assert "addition" in numbaconv.warmup.__doc__


def test_warmup_runs_every_offered_algorithm_and_reports(capsys):
    # The bias gradient: one algorithm, one small kernel (already compiled in most runs).
    report = numbaconv.warmup("conv_backward_bias", layers="1x1")
    runs = [(e.op, e.algorithm, e.error) for e in report.entries
            if e.op != "threading-layer probe"]
    assert runs == [("conv_backward_bias", "reduce", None)]
    lines = report.summary()
    assert lines[-1].startswith("kernels cached in: ")
    assert main(["warmup", "--op", "conv_backward_bias", "--layer", "1x1",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "conv_backward_bias" in out and "kernels cached in" in out


def test_cli_usage_errors(capsys):
    assert main(["warmup", "--layer", "9x9"]) == 2
    assert "layers: expected some of" in capsys.readouterr().err



def test_shares_keep_an_algorithms_runs_together():
    work = [("conv", "float32", "channels_first", 2, layer, algorithm)
            for layer in ("3x3", "1x1") for algorithm in ("im2col", "winograd", "direct")]
    work += [("conv_backward_bias", "float32", "channels_first", 2, "3x3", "reduce")]
    shares = _warmup._shares(work, 2)
    assert len(shares) == 2 and sorted(map(len, shares)) == [3, 4]
    assert sorted(spec for share in shares for spec in share) == sorted(work)
    for algorithm in ("im2col", "winograd", "direct"):
        assert sum(any(s[5] == algorithm for s in share) for share in shares) == 1
    assert [sorted(share) for share in _warmup._shares(work, 1)] == [sorted(work)]
    assert len(_warmup._shares(work, 64)) == 4                 # one per (algorithm, dtype)
    with pytest.raises(ValueError, match="jobs"):
        numbaconv.warmup("conv_backward_bias", jobs=0)


def test_warmup_in_several_processes_reports_every_run():
    # Two (algorithm, dtype) groups, so two worker interpreters; the bias kernels are small.
    report = numbaconv.warmup("conv_backward_bias", dtypes="both", layers="1x1", jobs=2)
    runs = [(e.dtype, e.algorithm, e.error) for e in report.entries
            if e.op != "threading-layer probe"]
    assert runs == [("float32", "reduce", None), ("float64", "reduce", None)]
    # Each worker compiled its kernel or loaded it from the cache: either way it ran it.
    assert all(e.compiled + e.loaded >= 1 for e in report.entries)


def test_the_deep_layer_warms_the_winograd_paths_by_panels(monkeypatch):
    """ResNet's last stage (few pixels, many channels) runs the Winograd forward forms and
    weight gradient by panels of output channels: ``3x3deep`` compiles their kernels."""
    from numbaconv.cpu import _winograd
    runs = []
    for name in ("_forward_by_panels", "_weight_gradient_by_panels"):
        real = getattr(_winograd, name)
        monkeypatch.setattr(_winograd, name,
                            lambda *a, _name=name, _real=real: runs.append(_name) or _real(*a))
    report = numbaconv.warmup(["conv_backward_data", "conv_backward_weight"],
                              layers="3x3deep")
    assert not report.errors
    assert set(runs) == {"_forward_by_panels", "_weight_gradient_by_panels"}


def test_the_bias_gradient_warms_both_its_versions():
    """The default layers give the bias gradient a dy on each side of its parallel threshold
    in every dimensionality, so that warm-up compiles its one-thread and parallel kernels."""
    import numpy as np
    from numbaconv.cpu.conv_backward_bias import PARALLEL_FROM
    for ndim in (1, 2, 3):
        sides = {_warmup._operands("conv_backward_bias", layer, "float32", "channels_first",
                                   ndim, np.random.default_rng(0))[0][0].size >= PARALLEL_FROM
                 for layer in _warmup.DEFAULT_LAYERS}
        assert sides == {True, False}, ndim
