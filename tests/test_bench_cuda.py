"""``numbaconv bench --device cuda`` (numbaconv.bench_cuda) without a GPU.

The benchmark's correctness path runs under Numba's CUDA simulator in subprocesses (the
simulator must be switched on before Numba is first imported), on the tiniest simulator
cases: every row checked against PyTorch and "timed", the JSON record complete, and a wrong
implementation (handed in through ``run_rows(ours=...)``) reported as a failure and never
timed. The case table, the option checks and the table's formatting are tested in-process.
"""

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

import numbaconv
from numbaconv import bench_cuda
from numbaconv.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_simulator = pytest.mark.skipif(
    importlib.util.find_spec("numba_cuda") is None or importlib.util.find_spec("torch") is None,
    reason="needs numba-cuda (the cuda extra) and PyTorch")

#: The simulator with small blocks, as tests/test_cuda.py runs it, and this checkout first on
#: the path.
SIM_ENV = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", NUMBACONV_CUDA_TILE="4,8,4",
               NUMBACONV_CUDA_THREADS="32",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")]
                                                    if p]))


#: ``numbaconv bench --device cuda --sim``, as :func:`run_sim` takes it.
SIM_BENCH = ("-m", "numbaconv", "bench", "--device", "cuda", "--sim")


def run_sim(*argv):
    """``python *argv`` from the checkout under the simulator (:data:`SIM_ENV`), which must
    exit 0; the finished process."""
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=SIM_ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def run_cli(capsys, *argv):
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# --- under the simulator -------------------------------------------------------------------

@needs_simulator
def test_sim_run_checks_and_times_every_row(tmp_path):
    """Two cases (a 1x1 and a stride-2 3x3), both layouts, the three ops: each row matches
    PyTorch and carries the three timings; the JSON holds every row and the environment."""
    out = tmp_path / "gpu.json"
    proc = run_sim(*SIM_BENCH, "--case", "pointwise", "--case", "resnet3x3s2_2c", "--json",
                   str(out))
    assert "mean nothing" in proc.stdout
    assert "checking against PyTorch" in proc.stderr  # progress, on stderr
    record = json.loads(out.read_text())
    assert record["finished"] is True
    env = record["environment"]
    assert env["simulator"] is True and "simulator" in env["device"]
    for key in ("numbaconv", "numba", "numba_cuda", "torch", "torch_cuda", "python"):
        assert key in env, key
    assert record["settings"]["tolerance"] == bench_cuda.DEFAULT_TOLERANCE
    assert [c["name"] for c in record["cases"]] == ["resnet3x3s2_2c_5", "pointwise_2to4_5"]
    rows = record["rows"]
    assert {(r["case"], r["layout"], r["op"]) for r in rows} == {
        (c, lay, op) for c in ("resnet3x3s2_2c_5", "pointwise_2to4_5")
        for lay in bench_cuda.LAYOUTS for op in bench_cuda.OPS}
    assert len(rows) == 12
    for r in rows:
        assert r["status"] == "ok", r
        assert r["rel_err"] <= r["tolerance"], r
        assert r["algorithm"].startswith("cuda/"), r
        for key in ("ours_ms", "torch_ieee_ms", "torch_tf32_ms", "ours_tflops",
                    "torch_ieee_over_ours", "torch_tf32_over_ours"):
            assert r[key] is not None and r[key] > 0, (key, r)
        assert r["timings"]["ours"]["runs"] == 1
        assert r["gflop"] > 0
    assert "12 of 12 rows checked and timed" in proc.stdout


@needs_simulator
def test_sim_run_times_the_bias_gradient_when_asked(tmp_path):
    """``--op conv_backward_bias`` (not among the default ops): the bias rows are checked
    against PyTorch's convolution_backward and timed, their GFLOP one add a dy element."""
    out = tmp_path / "gpu.json"
    run_sim(*SIM_BENCH, "--case", "pointwise", "--op", "conv_backward_bias", "--json",
            str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layout"], r["op"], r["status"]) for r in rows] == [
        (lay, "conv_backward_bias", "ok") for lay in bench_cuda.LAYOUTS]
    case = bench_cuda.select_cases(sim=True, patterns=["pointwise"])[0]
    for r in rows:
        assert r["rel_err"] <= r["tolerance"] and r["algorithm"] == "cuda/reduce", r
        assert r["gflop"] == case.batch * case.out_channels * case.output_size ** 2 / 1e9


_WRONG = """
import json, sys
import numpy as np
from numba import cuda
from numbaconv import bench_cuda

calls = []

def ours(op, operands):
    # conv: all ones, of the right shape; conv_backward_data: raises; conv_backward_weight:
    # numbaconv's.
    calls.append(op)
    if op == "conv":
        return cuda.to_device(np.ones(operands.out[op].shape, np.float32))
    if op == "conv_backward_data":
        raise RuntimeError("deliberately broken")
    return bench_cuda.numbaconv_call(op, operands)

cases = bench_cuda.select_cases(sim=True, patterns=["pointwise"])
rows = bench_cuda.run_rows(cases, sim=True, layouts=("channels_first",), ours=ours)
late = bench_cuda.run_rows(cases, sim=True, ops=("conv",), time_limit=1e-9,
                           ours=lambda op, operands: calls.append("late"))
print(json.dumps(dict(rows=[r.as_dict() for r in rows], late=[r.as_dict() for r in late],
                      calls=calls, table=[bench_cuda.format_row(r, (20,) * 11)
                                          for r in rows])))
"""


@needs_simulator
def test_a_wrong_result_is_a_failure_and_is_not_timed():
    proc = run_sim("-c", textwrap.dedent(_WRONG))
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    wrong, broken, right = result["rows"]
    assert wrong["op"] == "conv" and wrong["status"] == "FAIL"
    assert wrong["rel_err"] > wrong["tolerance"] and "not timed" in wrong["detail"]
    assert broken["status"] == "error" and "deliberately broken" in broken["detail"]
    for r in (wrong, broken):
        assert r["timings"] == {} and r["ours_ms"] is None and r["torch_ieee_ms"] is None
    assert right["status"] == "ok" and right["ours_ms"] > 0  # the run went on
    # The wrong op ran once (the check), the right one twice (check, one simulated timing).
    assert result["calls"] == ["conv", "conv_backward_data", "conv_backward_weight",
                               "conv_backward_weight"]
    assert [r["status"] for r in result["late"]] == ["skipped", "skipped"]
    assert "FAIL" in result["table"][0] and "not timed" in result["table"][0]


@needs_simulator
def test_sim_rnn_rows_check_and_time_a_training_step(tmp_path):
    """``--suite rnn --quick``: the LSTM twin's training step matches PyTorch on y, dx and
    the weight gradients and carries the three timings and the product path (the GRU's
    check runs in the test below; the simulator takes about 5 s per step)."""
    out = tmp_path / "rnn.json"
    proc = run_sim(*SIM_BENCH, "--suite", "rnn", "--quick", "--json", str(out))
    assert "rnn_training_step: rnn_forward(training=True" in proc.stdout
    assert "recurrent products (numbaconv's cuda backend): the Numba gemm kernel" in \
        proc.stdout
    record = json.loads(out.read_text())
    assert record["finished"] is True and record["cases"] == []
    assert record["settings"]["suites"] == ["rnn"]
    assert record["settings"]["rnn_tolerance"] == bench_cuda.DEFAULT_RNN_TOLERANCE
    assert [c["name"] for c in record["rnn_cases"]] == ["lstm_T3_N2_4_5"]
    rows = record["rows"]
    assert [(r["case"], r["layout"], r["op"]) for r in rows] == [
        ("lstm_T3_N2_4_5", bench_cuda.RNN_LAYOUT, bench_cuda.RNN_OP)]
    for r in rows:
        assert r["status"] == "ok", r
        assert set(r["errors"]) == {"y", "dx", "dparams"}, r
        assert r["rel_err"] == max(r["errors"].values()) <= r["tolerance"], r
        assert r["algorithm"].startswith("cuda/fused; products: the Numba gemm kernel"), r
        for key in ("ours_ms", "torch_ieee_ms", "torch_tf32_ms", "torch_ieee_over_ours"):
            assert r[key] is not None and r[key] > 0, (key, r)
        assert r["gflop"] > 0
    assert "1 of 1 rows checked and timed" in proc.stdout


_WRONG_RNN = """
import json
from numba import cuda
from numbaconv import bench_cuda

calls = []

def ours(operands):
    # numbaconv's step, with one weight gradient off by 1 %: the check must see it.
    calls.append(operands.case.name)
    got = bench_cuda.numbaconv_rnn_step(operands)
    dparams = got["dparams"].copy_to_host()
    dparams[len(dparams) // 2] += 0.01 * abs(dparams).max()
    got["dparams"] = cuda.to_device(dparams)
    return got

cases = bench_cuda.select_rnn_cases(sim=True, patterns=["gru"])
rows = bench_cuda.run_rnn_rows(cases, sim=True, ours=ours)
late = bench_cuda.run_rnn_rows(cases, sim=True, time_limit=1e-9,
                               ours=lambda operands: calls.append("late"))
print(json.dumps(dict(rows=[r.as_dict() for r in rows], late=[r.as_dict() for r in late],
                      calls=calls)))
"""


@needs_simulator
def test_the_rnn_algorithms_script_compares_both_loops():
    """docs/benchmarks/gpu_rnn_algorithms.py (how the persistent loops get timed on a GPU)
    runs under the simulator: both algorithms on the LSTM twin and the projected one, and,
    on the Numba product path the simulator has, the same results to the bit; the
    persistent rows say how the products were split."""
    proc = run_sim(os.path.join("docs", "benchmarks", "gpu_rnn_algorithms.py"), "--sim",
                   "--case", "lstm_T3", "--case", "lstm_proj", "--reps", "1")
    for name in ("lstm_T3_N2_4_5", "lstm_proj_T3_N2_4_5_p3"):
        rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(name)]
        assert [r[1] for r in rows] == ["fused", "persistent"], proc.stdout
        assert all(float(r[4]) == 0.0 for r in rows), proc.stdout
        # the tiny twins' products are too shallow to split; the projected loops never do
        assert rows[1][5:] == (["-"] if "proj" in name else ["1/1"]), proc.stdout


@needs_simulator
def test_the_host_time_script_runs_both_launch_paths():
    """docs/benchmarks/gpu_host_time.py (how the short launch path gets timed on a GPU) runs
    under the simulator: a process per setting of NUMBACONV_CUDA_SHORT_LAUNCH, a row per
    layout and op, and the two settings' results compared bit for bit."""
    proc = run_sim(os.path.join("docs", "benchmarks", "gpu_host_time.py"), "--sim", "--case",
                   "pointwise_2to4", "--reps", "1")
    rows = [line for line in proc.stdout.splitlines() if line.startswith("pointwise_2to4_5")]
    assert len(rows) == 8, proc.stdout  # 2 layouts x 4 ops, the bias gradient included
    assert "results: the same bits in both settings" in proc.stdout


@needs_simulator
def test_a_wrong_training_step_is_a_failure_and_is_not_timed():
    proc = run_sim("-c", textwrap.dedent(_WRONG_RNN))
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    [wrong] = result["rows"]
    assert wrong["status"] == "FAIL" and "(dparams)" in wrong["detail"], wrong
    assert wrong["errors"]["dparams"] > wrong["tolerance"] > wrong["errors"]["y"], wrong
    assert wrong["timings"] == {} and wrong["ours_ms"] is None, wrong
    assert wrong["errors"]["dx"] <= wrong["tolerance"], wrong  # the GRU's y and dx match
    assert result["calls"] == ["gru_T3_N2_4_5"]  # the check only, not timed
    assert [r["status"] for r in result["late"]] == ["skipped"]


# --- in-process: cases, options, formatting ------------------------------------------------

def test_rnn_cases_are_the_issues_networks_and_their_tiny_twins():
    from numbaconv import bench_rnn
    assert len(bench_cuda.SIM_RNN_CASES) == len(bench_cuda.RNN_CASES)
    for big, tiny in zip(bench_cuda.RNN_CASES, bench_cuda.SIM_RNN_CASES):
        assert (big.mode, big.num_layers, big.bidirectional, big.proj_size) == (
            tiny.mode, tiny.num_layers, tiny.bidirectional, tiny.proj_size)
        assert big.name.split("_T")[0] == tiny.name.split("_T")[0]
        assert (tiny.seq_len, tiny.batch, tiny.input_size, tiny.hidden_size) == (3, 2, 4, 5)
        assert big.seq_len == 50
    lstm, gru, bi = bench_cuda.RNN_CASES
    # The issue's target, and the GRU at its size, as the CPU suite times them.
    cpu = {c.name: c for c in bench_rnn.RNN_SHAPES}
    assert lstm == cpu["lstm_T50_N64_512"] and gru == cpu["gru_T50_N64_512"]
    assert (bi.mode, bi.num_layers, bi.bidirectional) == ("lstm", 2, True)
    assert lstm.flops() == 3 * 50 * 2 * 64 * 4 * 512 * (512 + 512)
    assert bench_cuda.select_rnn_cases() == bench_cuda.RNN_CASES
    assert bench_cuda.select_rnn_cases(quick=True) == (lstm,)
    assert bench_cuda.select_rnn_cases(sim=True, quick=True) == bench_cuda.SIM_RNN_CASES[:1]
    assert bench_cuda.select_rnn_cases(patterns=["gru,bi_L2"]) == (gru, bi)
    assert bench_cuda.select_rnn_cases(patterns=["resnet"]) == ()


@pytest.mark.parametrize("case", bench_cuda.SIM_RNN_CASES, ids=lambda c: c.name)
def test_numbaconvs_weights_reach_pytorch_in_their_order(case):
    """load_rnn_params puts numbaconv's flat vector into the module by PyTorch's names, and
    rnn_flat_gradients reads the gradients back in numbaconv's order: loading a vector and
    reading the weights back in that order gives the vector itself."""
    torch = pytest.importorskip("torch")
    from numbaconv import bench_torch
    cfg = case.config()
    flat = numbaconv.rnn_init_params(cfg, seed=3, dtype="float32")
    module = bench_torch.torch_rnn_module(case, torch)
    bench_torch.load_rnn_params(module, cfg, flat)
    for name in bench_torch.rnn_parameter_names(module, cfg):
        weight = getattr(module, name)
        weight.grad = weight.detach().clone()
    assert torch.equal(bench_torch.rnn_flat_gradients(module, cfg), torch.from_numpy(flat))
    other = bench_torch.torch_rnn_module(dataclasses.replace(case, hidden_size=6), torch)
    with pytest.raises(ValueError, match="not PyTorch's"):
        bench_torch.load_rnn_params(other, cfg, flat)


def test_cases_are_the_issues_layers_and_their_tiny_twins():
    names = [c.name for c in bench_cuda.CASES]
    assert len(bench_cuda.SIM_CASES) == len(bench_cuda.CASES)
    for big, tiny in zip(bench_cuda.CASES, bench_cuda.SIM_CASES):
        assert big.name.split("_")[0] == tiny.name.split("_")[0]
        assert (big.kernel, big.stride, big.padding, big.quick) == (
            tiny.kernel, tiny.stride, tiny.padding, tiny.quick)
        assert (big.groups == big.in_channels) == (tiny.groups == tiny.in_channels)
        assert big.batch == 32 and tiny.batch == 2
    assert {(c.in_channels, c.out_channels, c.size, c.stride, c.groups)
            for c in bench_cuda.CASES} == {(64, 64, 56, 1, 1), (256, 256, 14, 1, 1),
                                           (64, 64, 56, 2, 1), (256, 256, 14, 2, 1),
                                           (64, 256, 56, 1, 1), (128, 128, 56, 1, 128),
                                           (128, 128, 28, 1, 32)}
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("layout", bench_cuda.LAYOUTS)
def test_case_shapes_and_flops_follow_numbaconv(layout):
    for c in bench_cuda.CASES + bench_cuda.SIM_CASES:
        y = numbaconv.conv_output_shape(c.input_shape(layout), c.weight_shape,
                                        **c.kwargs(layout))
        assert tuple(y) == c.output_shape(layout)
        p = c.output_size
        assert c.flops == 2 * c.batch * c.out_channels * (c.in_channels // c.groups) * (
            c.kernel ** 2) * p * p
    resnet = bench_cuda.CASES[0]
    assert resnet.flops == 2 * 32 * 64 * 64 * 9 * 56 * 56


def test_select_cases():
    assert bench_cuda.select_cases() == bench_cuda.CASES
    quick = bench_cuda.select_cases(quick=True)
    assert 0 < len(quick) < len(bench_cuda.CASES) and all(c.quick for c in quick)
    assert [c.name for c in bench_cuda.select_cases(patterns=["s2_256,depthwise"])] == [
        "resnet3x3s2_256c_14", "depthwise3x3_128c_56"]
    assert bench_cuda.select_cases(sim=True, patterns=["nothing"]) == ()


def test_usage_errors(capsys):
    for argv, says in ((("--sim",), "--sim applies to --device cuda only"),
                       (("--device", "cuda", "--op", "conv_transpose"), "not --op"),
                       (("--device", "cuda", "--backend", "cpu"), "does not take --backend"),
                       (("--device", "cuda", "--suite", "rnn", "--op", "conv"),
                        "--op applies to the conv rows, not to --suite rnn"),
                       (("--device", "cuda", "--suite", "rnn", "--layout", "channels_last"),
                        "--layout applies to the conv rows"),
                       (("--device", "cuda", "--dtype", "float64"), "float64"),
                       (("--device", "cuda", "--case", "nothing"), "matches none"),
                       (("--device", "cuda", "--tolerance", "0"), "--tolerance")):
        status, out, err = run_cli(capsys, "bench", *argv)
        assert status == 2, argv
        assert says in err, (argv, err)


def test_without_a_gpu_it_says_to_use_the_simulator(capsys, monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    status, out, err = run_cli(capsys, "bench", "--device", "cuda", "--quick")
    assert status == 1 and "--sim" in err and "no CUDA device" in err


def test_rows_format_and_summary():
    ok = bench_cuda.GpuRow("resnet3x3_64c_56", "channels_last", "conv_backward_data",
                           gflop=7.4, status="ok", rel_err=3e-7, tolerance=2e-4,
                           algorithm="cuda/implicit_gemm", ours_ms=2.0, torch_ieee_ms=3.0,
                           torch_tf32_ms=1.0)
    bad = bench_cuda.GpuRow("resnet3x3_64c_56", "channels_last", "conv", gflop=7.4,
                            status="FAIL", rel_err=math.inf, tolerance=2e-4,
                            detail="relative error inf above the tolerance 0.0002: not timed")
    assert ok.ours_tflops == pytest.approx(3.7)
    assert ok.torch_ieee_over_ours == pytest.approx(1.5)
    assert ok.torch_tf32_over_ours == pytest.approx(0.5)
    assert bad.ours_tflops is None and bad.torch_ieee_over_ours is None
    widths = bench_cuda.column_widths(bench_cuda.CASES, bench_cuda.LAYOUTS, bench_cuda.OPS)
    header = bench_cuda.format_header(widths)
    line = bench_cuda.format_row(ok, widths)
    assert len(header) == 2 and header[0].index("ours ms") < header[0].index("torch ieee")
    for text in ("2.000", "3.000", "1.50", "1.000", "0.50", "3.70", "cuda/implicit_gemm"):
        assert text in line, text
    assert "not timed" in bench_cuda.format_row(bad, widths)
    assert json.loads(json.dumps(bad.as_dict()))["rel_err"] == "inf"
    summary = bench_cuda.summary_lines([ok, bad])
    assert summary[0].startswith("1 of 2 rows checked and timed; 1 mismatched")
    assert any("torch ieee / ours, conv_backward_data: 1.50" in s for s in summary)


def test_importing_it_loads_neither_numba_nor_torch():
    code = ("import sys, numbaconv.bench_cuda; "
            "assert 'numba' not in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_an_uninstalled_tree_gets_the_cuda_backend_registered():
    """Run from the source tree with PYTHONPATH=. (no entry points), the GPU bench registers
    the cuda backend itself, through the entry point pyproject.toml declares."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        assert f'cuda = "{bench_cuda.CUDA_ENTRY_POINT}"' in f.read()
    code = textwrap.dedent("""
        import importlib.metadata
        importlib.metadata.entry_points = lambda **kwargs: []   # as if not installed
        import numbaconv
        from numbaconv import bench_cuda
        assert "cuda" not in [b.name for b in numbaconv.backends()]
        assert bench_cuda.CUDA_ENTRY_POINT in bench_cuda.ensure_cuda_backend()
        [info] = [b for b in numbaconv.backends() if b.name == "cuda"]
        assert info.device == "cuda", info
        assert bench_cuda.ensure_cuda_backend() is None
        """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
