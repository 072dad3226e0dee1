"""Smoke test of the asv suite: ``asv run --python=same --quick`` on a few benchmarks.

asv discovers the whole suite (importing every module of ``benchmarks/``), then runs one
parameter combination of a timing, a peak-memory and a dispatch benchmark, 1D and 3D among
them, once each. It runs on a copy of ``asv.conf.json`` whose output folders are in a
temporary directory, and with ``HOME`` there too (asv keeps its machine description in
``~/.asv-machine.json``), so it leaves nothing in the work tree or the user's home. asv
needs the repository to be a git repository, nothing committed beyond that. About 15 s.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: One combination each of: a time_* on a 1D shape and every backend, a peakmem_* on a 3D
#: shape and the reference, the dispatch overhead, and the cold first call of the bias
#: gradient, which compiles one small kernel. asv matches these against
#: ``name(param, ...)`` with the parameters' reprs.
SMOKE_BENCHMARKS = (
    r"ConvBackwardData\.time_conv_backward_data\('conv1d_k5_16c_64', ",
    r"ConvBackwardWeight\.peakmem_conv_backward_weight\('conv3d_3x3x3_8c_6x8', 'reference'\)",
    r"DispatchOverhead\.time_public_call\('conv'\)",
    r"TrainingStep\.time_training_step\('lstm_T10_N8_32', 'cpu'\)",
    r"FirstCall\.track_cold_s\('conv_backward_bias'\)",
)


@pytest.mark.asv
def test_asv_quick_run_passes(tmp_path):
    pytest.importorskip("asv")
    from asv import util
    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("asv benchmarks a git repository; this checkout is not one")
    conf = util.load_json(os.path.join(ROOT, "asv.conf.json"), js_comments=True)
    conf.update(repo=ROOT, benchmark_dir=os.path.join(ROOT, conf["benchmark_dir"]),
                env_dir=str(tmp_path / "env"), results_dir=str(tmp_path / "results"),
                html_dir=str(tmp_path / "html"))
    conf_path = tmp_path / "asv.conf.json"
    util.write_json(str(conf_path), conf)
    env = dict(os.environ, HOME=str(tmp_path / "home"), PYTHONDONTWRITEBYTECODE="1",
               NUMBACONV_CACHE_DIR=str(tmp_path / "numbaconv-cache"))
    env.pop("NUMBACONV_BACKEND", None)
    (tmp_path / "home").mkdir()

    def asv(*args, timeout=300):
        return subprocess.run([sys.executable, "-m", "asv", *args, "--config",
                               str(conf_path)], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=timeout)

    machine = asv("machine", "--yes")
    assert machine.returncode == 0, machine.stdout + machine.stderr
    bench_args = [arg for regex in SMOKE_BENCHMARKS for arg in ("--bench", regex)]
    proc = asv("run", "--python=same", "--quick", "--show-stderr", *bench_args)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for name in ("time_conv_backward_data", "peakmem_conv_backward_weight",
                 "time_public_call", "time_training_step", "track_cold_s"):
        assert any(name in line and line.rstrip().endswith("ok")
                   for line in output.splitlines()), (name, output)
    assert "failed" not in output, output
    # Discovery saw the whole suite, every op with its time_ and peakmem_ benchmark.
    names = util.load_json(str(tmp_path / "results" / "benchmarks.json"))
    for op in ("conv", "conv_backward_data", "conv_backward_weight", "conv_backward_bias",
               "conv_transpose"):
        assert any(n.endswith(f".time_{op}") for n in names), op
        assert any(n.endswith(f".peakmem_{op}") for n in names), op
    assert any(n.endswith("DispatchOverhead.track_overhead_us") for n in names)
    for name in ("TrainingStep.track_allocated_bytes_per_step", "Ops.time_forward",
                 "Ops.time_backward_weights", "FirstCall.track_cold_s",
                 "FirstCall.track_cached_s"):
        assert any(n.endswith(name) for n in names), name
