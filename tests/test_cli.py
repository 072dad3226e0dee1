"""The ``numbaconv`` command line (numbaconv.cli), called in-process through main(argv).

Fast on purpose: the slow parts (check on every case, bench on the big shapes) are only run
in their --quick or single-case forms. Backends are discovered, never assumed, apart from the
reference, so these tests pass whichever plugins are installed.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

import numbaconv
from numbaconv import bench
from numbaconv import problem as pb
from numbaconv.__main__ import main
from numbaconv.backend import Backend
from numbaconv.problem import CONV_OPS
from numbaconv.reference import ReferenceBackend
from numbaconv.testing import relative_error

COMMANDS = ("info", "check", "bench", "demo", "warmup")


def run_cli(capsys, *argv):
    """main(argv) -> (exit status, stdout, stderr)."""
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


class WrongConv(Backend):
    """The reference with a deliberate bug: conv adds 1 to every output."""

    name = "deliberately_wrong"
    device = "cpu"
    priority = -100  # never chosen by ordinary dispatch, should unregistering fail
    ops = frozenset(CONV_OPS)

    def __init__(self):
        self._reference = ReferenceBackend()

    def run(self, op, problem, operands, out, algorithm):
        result = self._reference.run(op, problem, operands, out, "numpy")
        if op == "conv":
            result += 1.0
        return result


@pytest.fixture
def wrong_backend():
    numbaconv.register_backend(WrongConv.name, WrongConv)
    try:
        yield WrongConv.name
    finally:
        numbaconv.unregister_backend(WrongConv.name)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_subcommand_has_help(capsys, command):
    status, out, _ = run_cli(capsys, command, "--help")
    assert status == 0
    assert out.startswith(f"usage: numbaconv {command}")


def test_top_level_help_and_missing_command(capsys):
    status, out, _ = run_cli(capsys, "--help")
    assert status == 0
    assert all(command in out for command in COMMANDS)
    status, out, _ = run_cli(capsys)
    assert status == 2
    assert "usage: numbaconv" in out


def test_usage_errors_return_2(capsys):
    assert run_cli(capsys, "no-such-command")[0] == 2
    assert run_cli(capsys, "bench", "--repeat", "0")[0] == 2
    status, _, err = run_cli(capsys, "check", "--backend", "no_such_backend")
    assert status == 2
    assert "no_such_backend" in err


def test_python_dash_m_runs_main():
    proc = subprocess.run([sys.executable, "-m", "numbaconv", "info", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: numbaconv info" in proc.stdout


def test_info_reports_versions_blas_cuda_and_backends(capsys):
    status, out, _ = run_cli(capsys, "info")
    assert status == 0
    for expected in ("numbaconv " + numbaconv.__version__, "NumPy", "Numba", "llvmlite",
                     "NUMBA_NUM_THREADS", "OPENBLAS_CORETYPE", "CUDA", "backends"):
        assert expected in out
    # Every registered backend is listed, the reference among them, with its availability.
    for info in numbaconv.backends():
        assert info.name in out
    assert "reference" in out


def test_check_quick_passes(capsys):
    status, out, _ = run_cli(capsys, "check", "--quick")
    assert status == 0, out
    others = [b for b in numbaconv.backends()
              if b.available and b.device == "cpu" and b.name != "reference"]
    if others:
        assert "OK: all" in out
    else:
        assert "no backend other than the reference is available" in out


def test_check_fails_on_a_wrong_backend(capsys, wrong_backend):
    # Discovered like any other backend (no --backend), on one case to stay fast.
    status, out, _ = run_cli(capsys, "check", "--case", "2d_pad1")
    assert status == 1
    assert "FAILED" in out
    rows = {tuple(line.split()[:2]): line.split() for line in out.splitlines()
            if line.startswith(wrong_backend)}
    assert int(rows[wrong_backend, "conv"][3]) > 0               # failed column
    assert int(rows[wrong_backend, "conv_backward_data"][3]) == 0
    assert f"{wrong_backend} conv case=2d_pad1" in out           # failure details


def test_check_without_other_backends_says_so(capsys, monkeypatch):
    only_reference = [b for b in numbaconv.backends() if b.name == "reference"]
    monkeypatch.setattr(numbaconv, "backends", lambda: only_reference)
    status, out, _ = run_cli(capsys, "check", "--quick")
    assert status == 0
    assert "no backend other than the reference is available" in out


def test_bench_quick_prints_table_overhead_and_json(capsys, tmp_path):
    path = tmp_path / "bench.json"
    status, out, _ = run_cli(capsys, "bench", "--quick", "--repeat", "1", "--settle", "0",
                             "--json", str(path))
    assert status == 0, out
    assert "GFLOP/s" in out and "vs pytorch" in out
    assert "dispatch overhead:" in out
    record = json.loads(path.read_text())
    rows = record["results"]
    assert {r["op"] for r in rows} == set(CONV_OPS)
    assert any(r["backend"] == "reference" and r["status"] == "ok" for r in rows)
    assert {r["layout"] for r in rows} == {"channels_first"}  # --quick's default layout
    assert {d["op"] for d in record["dispatch_overhead"]} == set(CONV_OPS)
    assert all(np.isfinite(d["overhead_us"]) for d in record["dispatch_overhead"])
    if record["torch"] is not None:  # ratios, so the dgrad/wgrad targets are judged
        judged = [s for s in record["summary"] if s["met"] is not None]
        assert {(s["group"], s["op"]) for s in judged} == {
            (g, op) for g, target in bench.GROUP_TARGETS.items() if target is not None
            for op in bench.TARGET_OPS}
        assert "targets for " in out and "met" in out


def test_bench_layout_both_prints_peak_and_grouped_summary(capsys, tmp_path):
    path = tmp_path / "bench.json"
    status, out, _ = run_cli(capsys, "bench", "--quick", "--no-torch", "--layout", "both",
                             "--backend", "reference", "--op", "conv",
                             "--op", "conv_backward_data", "--op", "conv_backward_weight",
                             "--repeat", "1", "--settle", "0", "--json", str(path))
    assert status == 0, out
    assert "SGEMM peak:" in out and "of peak" in out
    assert "summary per backend, group and op" in out
    summary_lines = out.split("summary per backend, group and op")[1].splitlines()
    for group in bench.GROUPS:
        assert any(line.split()[:2] == ["reference", group] for line in summary_lines)
    record = json.loads(path.read_text())
    assert record["layouts"] == ["channels_first", "channels_last"]
    peak = record["gemm_peak"]
    assert peak["name"] == "SGEMM" and peak["gflops"] > 0
    rows = record["results"]
    for case in bench.QUICK_SHAPES:  # every shape in both layouts
        assert {r["layout"] for r in rows if r["shape"] == case.name} == {
            "channels_first", "channels_last"}
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and all(r["group"] in bench.GROUPS for r in ok)
    assert all(r["peak_fraction"] == pytest.approx(r["gflops"] / peak["gflops"]) for r in ok)
    summary = {(s["group"], s["op"]): s for s in record["summary"]}
    assert set(summary) == {(g, op) for g in bench.GROUPS for op in
                            ("conv", "conv_backward_data", "conv_backward_weight")}
    # Two ResNet shapes in two layouts; no PyTorch, so nothing is judged.
    assert summary["resnet3x3", "conv"]["measured"] == 4
    assert summary["stem", "conv_backward_data"]["target"] == bench.GROUP_TARGETS["stem"]
    assert summary["stem", "conv"]["target"] is None
    assert all(s["vs_pytorch"] is None and s["met"] is None for s in summary.values())
    assert "no PyTorch baseline" in out


def test_bench_single_layout_channels_last(capsys, tmp_path):
    path = tmp_path / "bench.json"
    status, out, _ = run_cli(capsys, "bench", "--quick", "--no-torch", "--layout",
                             "channels_last", "--backend", "reference", "--op",
                             "conv_backward_bias", "--repeat", "1", "--settle", "0",
                             "--json", str(path))
    assert status == 0, out
    record = json.loads(path.read_text())
    assert record["layouts"] == ["channels_last"]
    assert {r["layout"] for r in record["results"]} == {"channels_last"}


def test_bench_times_only_the_groups_asked_for(capsys, tmp_path):
    path = tmp_path / "bench.json"
    status, out, _ = run_cli(capsys, "bench", "--quick", "--no-torch", "--group", "small",
                             "--group", "conv1d", "--backend", "reference", "--op",
                             "conv_backward_bias", "--repeat", "1", "--settle", "0",
                             "--json", str(path))
    assert status == 0, out
    record = json.loads(path.read_text())
    assert record["groups"] == ["small", "conv1d"]
    assert {s["group"] for s in record["shapes"]} == {"small", "conv1d"}
    assert {r["group"] for r in record["results"]} == {"small", "conv1d"}
    status, _, err = run_cli(capsys, "bench", "--group", "resnet")
    assert status == 2 and "unknown group(s) ['resnet']" in err
    status, _, err = run_cli(capsys, "bench", "--suite", "rnn", "--group", "small")
    assert status == 2 and "--group applies" in err


def test_summarize_geometric_means_and_targets():
    def row(shape, group, op, backend, ratio, layout="channels_first"):
        return bench.Row(shape, op, backend, layout, "float32", "ok", median_s=1.0,
                         best_s=1.0, gflops=2.0, vs_pytorch=ratio, group=group,
                         peak_fraction=0.5)

    rows = [row("a", "resnet3x3", "conv_backward_data", bench.PYTORCH, 1.0),
            row("a", "resnet3x3", "conv_backward_data", "cpu", 0.5),
            row("a", "resnet3x3", "conv_backward_data", "cpu", 4.5, "channels_last"),
            row("b", "pointwise", "conv_backward_weight", "cpu", 0.9),
            row("b", "pointwise", "conv", "cpu", 9.0),
            bench.Row("c", "conv_backward_data", "cpu", "channels_first", "float32",
                      "skipped", group="pointwise")]
    summary = {(s["backend"], s["group"], s["op"]): s for s in bench.summarize(rows)}
    assert set(summary) == {("cpu", "resnet3x3", "conv_backward_data"),
                            ("cpu", "pointwise", "conv_backward_weight"),
                            ("cpu", "pointwise", "conv"),
                            ("cpu", "pointwise", "conv_backward_data")}
    dgrad = summary["cpu", "resnet3x3", "conv_backward_data"]
    assert dgrad["vs_pytorch"] == pytest.approx(1.5)  # sqrt(0.5 * 4.5)
    assert (dgrad["measured"], dgrad["compared"], dgrad["target"], dgrad["met"]) == (
        2, 2, bench.GROUP_TARGETS["resnet3x3"], True)
    assert dgrad["peak_fraction"] == pytest.approx(0.5)
    assert dgrad["at_peak"] == pytest.approx(3.0)     # sqrt(0.5 / 0.5 * 4.5 / 0.5)
    # 0.9 < 1.0
    assert summary["cpu", "pointwise", "conv_backward_weight"]["met"] is False
    assert summary["cpu", "pointwise", "conv"]["target"] is None
    assert summary["cpu", "pointwise", "conv"]["met"] is None
    skipped = summary["cpu", "pointwise", "conv_backward_data"]
    assert (skipped["measured"], skipped["vs_pytorch"], skipped["met"]) == (0, None, None)


def test_shape_tables_are_grouped_and_consistent():
    assert set(bench.GROUP_TARGETS) == set(bench.GROUPS)
    for table in (bench.SHAPES, bench.QUICK_SHAPES):
        assert len({c.name for c in table}) == len(table)
        assert {c.group for c in table} == set(bench.GROUPS)
        for case in table:
            # The transposed convolution of each shape maps its output back to its input.
            z = lambda shape: np.broadcast_to(np.float32(0), shape)  # noqa: E731
            p = pb.conv_transpose_problem(
                z(case.y_shape("channels_first")), z(case.w_shape), stride=case.stride,
                padding=case.padding, dilation=case.dilation, groups=case.groups,
                output_padding=case.output_padding)
            assert p.result_shape == tuple(case.x_shape), case.name
    assert bench.resolve_layouts("both") == ("channels_first", "channels_last")
    assert bench.resolve_layouts("channels_last") == ("channels_last",)
    with pytest.raises(ValueError):
        bench.resolve_layouts("nhwc")


def test_bench_first_call_reports_cold_and_cached(capsys, tmp_path):
    info = {b.name: b for b in numbaconv.backends()}
    if "cpu" not in info or not info["cpu"].available:
        pytest.skip("the cpu backend is not available")
    path = tmp_path / "first_call.json"
    # The bias gradient: one small kernel, so the two fresh processes take about a second.
    status, out, _ = run_cli(capsys, "bench", "--first-call", "--op", "conv_backward_bias",
                             "--json", str(path))
    assert status == 0, out
    header = next(line for line in out.splitlines() if line.startswith("backend"))
    assert header.split()[:6] == ["backend", "layout", "op", "algorithm", "cold", "cached"]
    assert any(line.split()[:3] == ["cpu", "channels_first", "conv_backward_bias"]
               for line in out.splitlines())
    assert "import numbaconv:" in out and "importing compiles nothing" in out
    (result,) = json.loads(path.read_text())["first_call"]
    cold, cached = result["cold"], result["cached"]
    assert result["op"] == "conv_backward_bias" and cold["backend"] == "cpu"
    assert not cold["numba_at_import"] and not cached["numba_at_import"]
    assert cold["kernels"] >= 1 and cold["cache_hits"] == 0
    # The second process found the first one's kernels on disk instead of compiling.
    assert cached["cache_hits"] == cached["kernels"] == cold["kernels"]
    assert cached["cache_misses"] == 0


def test_first_call_of_several_ops_in_one_process():
    """A "+"-joined entry (a training step) runs its ops one after another in the same two
    interpreters; the progress callback hears of each interpreter as it starts."""
    info = {b.name: b for b in numbaconv.backends()}
    if "cpu" not in info or not info["cpu"].available:
        pytest.skip("the cpu backend is not available")
    assert bench.TRAINING_STEP.split("+") == list(CONV_OPS)
    heard = []
    (result,) = bench.first_call_latency(["conv_backward_bias+conv_backward_bias"],
                                         progress=heard.append)
    cold, cached = result["cold"], result["cached"]
    assert cold["algorithm"] == "reduce+reduce" and cold["backend"] == "cpu"
    assert cached["cache_hits"] == cached["kernels"] == cold["kernels"] >= 1
    assert heard == ["conv_backward_bias+conv_backward_bias: cold (compiling)",
                     "conv_backward_bias+conv_backward_bias: cached (loading)"]


def test_bench_first_call_rejects_unknown_backend(capsys):
    status, _, err = run_cli(capsys, "bench", "--first-call", "--backend", "no_such_backend")
    assert status == 2
    assert "no_such_backend" in err


def test_bench_pytorch_baseline_computes_the_same_thing():
    """A wrong baseline would make every 'vs pytorch' ratio meaningless."""
    torch = pytest.importorskip("torch")
    for layout in ("channels_first", "channels_last"):
        for case in bench.QUICK_SHAPES:
            for op in CONV_OPS:
                call = bench.make_call(op, case, layout, "float64")
                with numbaconv.use_backend("reference"):
                    expected = call()
                got = bench.torch_callable(call, torch)()
                if isinstance(got, tuple):  # convolution_backward: (dx, dw, db)
                    got = got[("conv_backward_data", "conv_backward_weight").index(op)]
                if layout == "channels_last" and op not in ("conv_backward_weight",
                                                            "conv_backward_bias"):
                    got = got.movedim(1, -1)  # PyTorch's logical NCHW to numbaconv's NHWC
                assert relative_error(got.numpy(), expected) < 1e-12, (layout, case.name, op)


def test_demo_learns_with_the_reference_backend(capsys):
    status, out, _ = run_cli(capsys, "demo", "cnn", "--epochs", "3", "--backend", "reference")
    assert status == 0, out
    assert "backend 'reference'" in out
    assert "gradient check" in out and ", ok" in out
    assert out.count("epoch ") == 3
    accuracy = float(out.split("final test accuracy:")[1].split()[0])
    assert accuracy > 0.6


def test_check_progress_line_and_unchanged_results(capsys):
    # --progress draws on stderr; the table on stdout is the same as without it.
    status, = (main(["check", "--case", "2d_pad1", "--backend", "reference",
                     "--progress"]),)
    captured = capsys.readouterr()
    assert status == 0, captured.out
    assert "reference: 2d_pad1 channels_first" in captured.err
    assert "[" in captured.err and "\r" in captured.err
    assert main(["check", "--case", "2d_pad1", "--backend", "reference",
                 "--no-progress"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == ""
    table = [line for line in captured.out.splitlines() if line.startswith("reference ")]
    assert table == [line for line in quiet.out.splitlines()
                     if line.startswith("reference ")]
