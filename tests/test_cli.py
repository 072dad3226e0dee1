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
from numbaconv.__main__ import main
from numbaconv.backend import Backend
from numbaconv.problem import CONV_OPS
from numbaconv.reference import ReferenceBackend
from numbaconv.testing import relative_error

COMMANDS = ("info", "check", "bench", "demo")


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
    assert {d["op"] for d in record["dispatch_overhead"]} == set(CONV_OPS)
    assert all(np.isfinite(d["overhead_us"]) for d in record["dispatch_overhead"])


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
    status, out, _ = run_cli(capsys, "demo", "--epochs", "3", "--backend", "reference")
    assert status == 0, out
    assert "backend 'reference'" in out
    assert "gradient check" in out and ", ok" in out
    assert out.count("epoch ") == 3
    accuracy = float(out.split("final test accuracy:")[1].split()[0])
    assert accuracy > 0.6
