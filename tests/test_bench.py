"""numbaconv.bench and ``numbaconv bench`` beyond the table: the shared shape tables, the
progress display, the PyTorch column, the BLAS record, the OPENBLAS_CORETYPE warning and
``--plot``.

The OpenBLAS environment variables are never changed here; the warning is tested on the
functions that decide it, with their inputs given.
"""

import io
import json
import subprocess
import sys

import numpy as np
import pytest

import numbaconv
from numbaconv import bench, bench_rnn, cli
from numbaconv.bench_rnn import QUICK_RNN_SHAPES
from numbaconv.__main__ import main
from numbaconv.problem import CONV_OPS
from numbaconv.testing import check_backend


def run_cli(capsys, *argv):
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def other_cpu_backends():
    return [b.name for b in numbaconv.backends()
            if b.available and b.device == "cpu" and b.name != "reference"]


# --- the shape tables ----------------------------------------------------------------------

def test_tables_cover_1d_2d_and_3d_in_every_group():
    for table in (bench.SHAPES, bench.QUICK_SHAPES):
        assert {len(c.x_shape) - 2 for c in table} == {1, 2, 3}
        assert {c.group for c in table} == set(bench.GROUPS)
    assert {c.group for c in bench.QUICK_SHAPES if len(c.x_shape) == 3} == {"conv1d"}
    assert {c.group for c in bench.QUICK_SHAPES if len(c.x_shape) == 5} == {"conv3d"}
    assert set(bench.GROUP_TARGETS) == set(bench.GROUPS)
    assert all(t is None or t > 0 for t in bench.GROUP_TARGETS.values())


def test_rnn_quick_shapes_train_alike_on_cpu_and_reference():
    """The RNN shapes the quick benchmark times give the same training step on both."""
    from numbaconv import bench_rnn
    for case in QUICK_RNN_SHAPES:
        grads = []
        for backend in ("reference", "cpu"):
            step = bench_rnn.TrainingStep(case, backend, dtype="float64")
            step()
            grads.append(step.dparams.copy())
        np.testing.assert_allclose(grads[1], grads[0], rtol=1e-9, atol=1e-12,
                                   err_msg=case.name)


def test_bench_rnn_suite_quick(tmp_path):
    """``numbaconv bench --suite rnn --quick``: each engine in a subprocess, a table, JSON."""
    out = tmp_path / "rnn.json"
    proc = subprocess.run([sys.executable, "-m", "numbaconv", "bench", "--suite", "rnn",
                           "--quick", "--repeat", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert [r["case"] for r in record["rows"]] == [c.name for c in QUICK_RNN_SHAPES]
    row = record["rows"][0]
    assert row["cpu_s"] > 0 and row["cpu_reserve_bytes"] > 0 and row["cpu_alloc_bytes"] > 0
    if "pytorch_s" in row:
        assert "geometric mean of torch/cpu" in proc.stdout
        assert "checked first against PyTorch" in proc.stdout
        assert record["check"]["failed"] == 0
        for r in record["rows"]:
            assert r["cpu_status"] == "ok" and max(r["cpu_check"]["errors"].values()) < 1e-5
    else:
        assert "check against PyTorch: skipped" in proc.stdout


# --- the recurrent suite's check against PyTorch -------------------------------------------

#: A GRU small enough to check in a second (the check's PyTorch side runs in this process).
TINY_GRU = bench_rnn.RNNCase("gru_T3_N2_4_5", "gru", 3, 2, 4, 5)


@pytest.fixture
def fake_timing(monkeypatch):
    """The recurrent suite without subprocesses: the check in this process, each timing
    recorded and answered at once."""
    timed = []

    def measure(case, engine, **kwargs):
        timed.append((case.name, engine))
        return dict(median_s=1e-3, reserve_bytes=1024, alloc_bytes=2048)
    monkeypatch.setattr(bench_rnn, "measure_in_subprocess", measure)
    monkeypatch.setattr(bench_rnn, "check_in_subprocess", bench_rnn.check_case)
    monkeypatch.setattr(bench_rnn, "QUICK_RNN_SHAPES", (TINY_GRU,))
    return timed


def wrong_weight_gradients(monkeypatch, backend="cpu"):
    """``backend``'s training step with its weight gradients 1 % too large."""
    step = bench_rnn.TrainingStep.__call__

    def perturbed(self):
        got = step(self)
        if self.backend == backend:
            got["dparams"] = got["dparams"] * 1.01
        return got
    monkeypatch.setattr(bench_rnn.TrainingStep, "__call__", perturbed)


def test_rnn_check_passes_a_right_step():
    pytest.importorskip("torch")
    [check] = bench_rnn.check_case(TINY_GRU, ["cpu"]).values()
    assert check["status"] == "ok" and check["detail"] == ""
    assert set(check["errors"]) == {"y", "dx", "dparams"}
    assert max(check["errors"].values()) < 1e-5


def test_a_wrong_rnn_step_fails_and_is_not_timed(monkeypatch, fake_timing):
    pytest.importorskip("torch")
    wrong_weight_gradients(monkeypatch, "cpu")
    rows = bench_rnn.run_rnn_benchmarks([TINY_GRU], backends=("cpu", "reference"))
    [row] = rows
    check = row["cpu_check"]
    assert row["cpu_status"] == "FAIL" and check["worst"] == "dparams"
    assert check["errors"]["dparams"] > 5e-3 and check["errors"]["y"] < 1e-5
    assert "cpu_s" not in row and "cpu_ratio" not in row
    assert row["reference_status"] == "ok" and row["reference_s"] == 1e-3
    assert fake_timing == [(TINY_GRU.name, "pytorch"), (TINY_GRU.name, "reference")]
    table = bench_rnn.format_rnn_table(rows, ("cpu", "reference"))
    assert "FAIL" in table and "(dparams) above the tolerance 0.0005: not timed" in table
    assert bench_rnn.failed_checks(rows, ("cpu", "reference")) == [
        (TINY_GRU.name, "cpu", check["detail"])]


def test_bench_rnn_cli_fails_on_a_wrong_step(monkeypatch, capsys, tmp_path, fake_timing):
    pytest.importorskip("torch")
    wrong_weight_gradients(monkeypatch, "cpu")
    out = tmp_path / "rnn.json"
    status, stdout, _ = run_cli(capsys, "bench", "--suite", "rnn", "--quick", "--backend",
                                "cpu", "--json", str(out))
    assert status == 1
    assert fake_timing == []  # nothing passed: neither numbaconv nor PyTorch is timed
    assert "1 check(s) against PyTorch failed: gru_T3_N2_4_5 on cpu" in stdout
    [line] = [text for text in stdout.splitlines() if text.startswith(TINY_GRU.name)]
    assert "FAIL" in line and "(dparams)" in line
    record = json.loads(out.read_text())
    assert record["check"]["failed"] == 1 and record["check"]["tolerance"] == 5e-4
    assert record["rows"][0]["cpu_check"]["errors"]["dparams"] > 5e-3


def test_bench_rnn_without_torch_says_nothing_was_checked(capsys, fake_timing):
    status, stdout, _ = run_cli(capsys, "bench", "--suite", "rnn", "--quick", "--backend",
                                "cpu", "--no-torch")
    assert status == 0
    assert "check against PyTorch: skipped (--no-torch)" in stdout
    assert fake_timing == [(TINY_GRU.name, "cpu")]


@pytest.mark.parametrize("backend", other_cpu_backends())
def test_benchmark_shapes_are_checked_against_the_reference(backend):
    """The table the benchmarks time is the table the tests check (the small one)."""
    results = check_backend(backend, cases=bench.QUICK_SHAPES)
    failures = [(r.case, r.op, r.layout, r.dtype, r.mode, r.detail) for r in results
                if r.status == "FAIL"]
    assert not failures
    assert any(r.status == "pass" for r in results)


# --- run_benchmarks: progress and the PyTorch column --------------------------------------

def test_run_benchmarks_reports_progress_and_pytorch_time():
    torch = pytest.importorskip("torch")
    case = next(c for c in bench.QUICK_SHAPES if c.group == "conv1d")
    seen = []
    rows = bench.run_benchmarks([case], ["reference"], ops=["conv", "conv_backward_bias"],
                                repeat=1, torch=torch, settle=0,
                                progress=lambda done, total, what: seen.append(
                                    (done, total, what)))
    assert [(d, t) for d, t, _ in seen] == [(0, 2), (1, 2), (2, 2)]
    assert seen[0][2] == f"{case.name} channels_first on {bench.PYTORCH}"
    assert seen[-1][2] == "done"
    by = {(r.op, r.backend): r for r in rows}
    for op in ("conv", "conv_backward_bias"):
        mine, theirs = by[op, "reference"], by[op, bench.PYTORCH]
        assert mine.pytorch_s == theirs.median_s
        assert mine.vs_pytorch == pytest.approx(theirs.median_s / mine.median_s)
        assert theirs.pytorch_s is None  # the baseline's own row has no baseline column


# --- memory-bound rows: the copy floor ----------------------------------------------------

def test_time_call_warms_up_for_a_time_or_a_number_of_calls():
    """time_call's untimed calls: ``warmup`` of them, then more until ``warmup_for`` seconds
    have passed or ``warmup_most`` calls were made; the bench's rows take ROW_WARMUP."""
    from numbaconv.bench_timing import time_call
    calls = []
    time_call(lambda: calls.append(1), repeat=1, number=1, warmup=2)
    assert len(calls) == 2 + 1
    calls.clear()
    time_call(lambda: calls.append(1), repeat=1, number=1, warmup=2, warmup_for=60.0,
              warmup_most=7)
    assert len(calls) == 7 + 1
    calls.clear()
    time_call(lambda: calls.append(1), repeat=2, number=1, warmup_for=0.02)
    assert 1 + 2 < len(calls) <= 50 + 2
    assert 0 < bench.ROW_WARMUP <= 0.5


def test_traffic_bytes_are_the_operands_and_the_result():
    case = next(c for c in bench.QUICK_SHAPES if c.group == "depthwise")
    arrays = numbaconv.testing.case_arrays(case, "channels_last", "float32")
    data = bench.make_call("conv_backward_data", case, "channels_last", arrays=arrays)
    assert bench.traffic_bytes(data) == (arrays["dy"].nbytes + arrays["w"].nbytes
                                         + arrays["x"].nbytes)
    weight = bench.make_call("conv_backward_weight", case, "channels_last", arrays=arrays)
    assert bench.traffic_bytes(weight) == (arrays["x"].nbytes + arrays["dy"].nbytes
                                           + arrays["w"].nbytes)
    forward = bench.make_call("conv", case, "channels_first")
    assert bench.traffic_bytes(forward) == sum(
        a.nbytes for a in forward.operands if a is not None) + 4 * int(
            np.prod(forward.problem.y_shape))


def test_copy_seconds_times_a_copy_and_refuses_nothing_to_move():
    small, large = bench.copy_seconds(2**16, repeat=2), bench.copy_seconds(2**25, repeat=2)
    assert 0 < small < large
    assert bench.copy_seconds(2**16, threads=1, repeat=1) > 0
    with pytest.raises(ValueError, match="nbytes"):
        bench.copy_seconds(1)


def test_copy_floors_cover_the_memory_bound_shapes_only():
    shapes = [c for c in bench.QUICK_SHAPES if c.group in ("depthwise", "conv1d")]
    floors = bench.copy_floors(shapes, ["conv_backward_data", "conv_backward_weight"],
                               repeat=1)
    depthwise = [c.name for c in shapes if c.group in bench.MEMORY_BOUND_GROUPS]
    assert depthwise and set(floors) == {(name, op) for name in depthwise
                                         for op in ("conv_backward_data",
                                                    "conv_backward_weight")}
    for (name, op), floor in floors.items():
        case = next(c for c in shapes if c.name == name)
        assert floor["traffic_bytes"] == bench.traffic_bytes(bench.make_call(op, case))
        assert floor["copy_s"] > 0


def test_memory_bound_rows_get_their_copy_fraction():
    shapes = [next(c for c in bench.QUICK_SHAPES if c.group == g)
              for g in ("depthwise", "conv1d")]
    copies = {(shapes[0].name, "conv_backward_data"): dict(traffic_bytes=1000, copy_s=1e-6)}
    rows = bench.run_benchmarks(shapes, ["reference"], ops=["conv_backward_data", "conv"],
                                repeat=1, settle=0, in_process=True, copies=copies)
    for row in rows:
        if (row.shape, row.op) in copies:
            assert row.traffic_bytes == 1000
            assert row.copy_fraction == pytest.approx(1e-6 / row.median_s)
        else:
            assert row.traffic_bytes is None and row.copy_fraction is None


def test_bench_prints_and_records_the_copy_fractions(capsys, tmp_path):
    record_path = tmp_path / "bench.json"
    status, out, _ = run_cli(capsys, "bench", "--quick", "--no-torch", "--backend",
                             "reference", "--group", "depthwise", "--group", "conv1d",
                             "--op", "conv_backward_data", "--repeat", "1", "--settle", "0",
                             "--json", str(record_path))
    assert status == 0, out
    record = json.loads(record_path.read_text())
    bound = [r for r in record["results"] if r["copy_fraction"] is not None]
    assert bound and {r["group"] for r in bound} == {"depthwise"}
    assert all(r["copy_fraction"] is None for r in record["results"]
               if r["group"] != "depthwise")
    assert {(c["shape"], c["op"]) for c in record["copies"]} == {
        (r["shape"], r["op"]) for r in bound}
    from numbaconv.cli_bench import _percent
    table = out[out.index("memory-bound rows (depthwise)"):]
    for r in bound:
        assert _percent(r["copy_fraction"]) in table and r["shape"] in table


# --- run_benchmarks: each engine in its own process -----------------------------------------

#: Two shapes, two ops: each engine's process times them in about a second.
PROCESS_SHAPES = bench.QUICK_SHAPES[:2]
PROCESS_OPS = ["conv", "conv_backward_bias"]


def without_times(rows):
    """What a row says apart from the times, which vary from run to run."""
    return [(r.shape, r.op, r.backend, r.layout, r.dtype, r.status, r.detail, r.group,
             r.median_s is None, r.gflops is None, r.vs_pytorch is None,
             r.peak_fraction is None) for r in rows]


def test_processes_give_the_rows_of_one_process():
    common = dict(ops=PROCESS_OPS, repeat=1, settle=0, peak_gflops=100.0,
                  skip_reference_on=[PROCESS_SHAPES[1].name])
    processes, reported = {}, []
    rows = bench.run_benchmarks(PROCESS_SHAPES, ["reference"], processes=processes,
                                report=reported.append, **common)
    assert without_times(rows) == without_times(
        bench.run_benchmarks(PROCESS_SHAPES, ["reference"], in_process=True, **common))
    assert [r.status for r in rows] == ["ok", "ok", "skipped", "skipped"]
    assert all(isinstance(r, bench.Row) and r.peak_fraction > 0 for r in rows[:2])
    assert reported == rows
    # The numbaconv engine's process loaded neither PyTorch nor, for the NumPy-only
    # reference, Numba.
    assert processes["reference"]["modules"] == dict(torch=False, numba=False, numbaconv=True)


def test_rounds_take_turns_and_keep_each_rows_fastest_round(monkeypatch):
    """With rounds, PyTorch's and the backend's processes alternate, and each row is the
    round of its smallest median (a timed one before a failed one); the ratio compares
    those rows."""
    order = []
    medians = iter([[4.0, None], [2.0, 3.0],      # round 1: pytorch, reference
                    [1.0, 5.0], [6.0, None]])     # round 2
    case = PROCESS_SHAPES[0]

    def engine_rows(blocks, engine, counter, **options):
        order.append(engine)
        times = next(medians)
        yield 0, [bench.Row(case.name, op, engine, "channels_first", "float32",
                            "ok" if t else "error", median_s=t)
                  for op, t in zip(PROCESS_OPS, times)]

    monkeypatch.setattr(bench, "_engine_rows", engine_rows)
    rows = bench.run_benchmarks(PROCESS_SHAPES[:1], ["reference"], ops=PROCESS_OPS,
                                torch=True, rounds=2)
    assert order == [bench.PYTORCH, "reference", bench.PYTORCH, "reference"]
    assert [(r.backend, r.median_s) for r in rows] == [
        (bench.PYTORCH, 1.0), ("reference", 2.0), (bench.PYTORCH, 5.0), ("reference", 3.0)]
    assert rows[1].vs_pytorch == 0.5 and rows[3].vs_pytorch == 5.0 / 3.0
    with pytest.raises(ValueError, match="rounds"):
        bench.run_benchmarks(PROCESS_SHAPES[:1], ["reference"], rounds=2, in_process=True)


def test_bench_rounds_is_for_the_convolutions_processes(capsys):
    assert main(["bench", "--suite", "rnn", "--rounds", "2"]) == 2
    assert "--rounds applies" in capsys.readouterr().err


def test_pytorchs_process_loads_no_numba_and_sets_its_threads():
    pytest.importorskip("torch")
    processes = {}
    rows = bench.run_benchmarks(PROCESS_SHAPES[:1], ["reference"], ops=["conv"], repeat=1,
                                torch=True, threads=1, processes=processes)
    assert [(r.backend, r.status) for r in rows] == [(bench.PYTORCH, "ok"), ("reference", "ok")]
    assert rows[1].vs_pytorch == pytest.approx(rows[0].median_s / rows[1].median_s)
    assert processes[bench.PYTORCH]["modules"]["torch"]
    assert not processes[bench.PYTORCH]["modules"]["numba"]
    assert processes[bench.PYTORCH]["threads"] == {"torch": 1}
    assert not processes["reference"]["modules"]["torch"]


@pytest.mark.parametrize("child, timeout, why", [
    ("import os; os._exit(3)", None, "exit status 3"),
    ("import time; time.sleep(60)", 1, "no answer within 1 s"),
], ids=["crash", "timeout"])
def test_a_failed_process_gives_error_rows(monkeypatch, child, timeout, why):
    monkeypatch.setattr(bench, "_ENGINE_CHILD", child)
    processes = {}
    rows = bench.run_benchmarks(PROCESS_SHAPES, ["reference"], ops=PROCESS_OPS, repeat=1,
                                timeout=timeout, processes=processes)
    assert [(r.shape, r.op) for r in rows] == [(c.name, op) for c in PROCESS_SHAPES
                                               for op in PROCESS_OPS]
    assert {r.status for r in rows} == {"error"}
    assert all(r.detail.startswith("reference's process failed: " + why) for r in rows)
    assert processes["reference"]["error"].startswith(why)


def test_a_process_that_stops_early_gives_error_rows_for_the_rest(monkeypatch):
    """The blocks timed before the crash keep their rows; the others are errors."""
    monkeypatch.setattr(bench, "_ENGINE_CHILD", bench._ENGINE_CHILD.replace(
        "bench._time_engine(", "bench.print_message = lambda m, p=bench.print_message: "
        "p(m) if m.get('block') == 0 else sys.exit('stopped here'); bench._time_engine("))
    rows = bench.run_benchmarks(PROCESS_SHAPES, ["reference"], ops=PROCESS_OPS, repeat=1)
    assert [r.status for r in rows] == ["ok", "ok", "error", "error"]
    assert rows[2].detail.endswith("stopped here")


def test_progress_line_draws_only_when_enabled():
    stream = io.StringIO()
    progress = cli._Progress(True, stream)
    progress.update(1, 4, "resnet on cpu")
    assert stream.getvalue().startswith("\r\x1b[K[#####...............] 1/4 ")
    assert stream.getvalue().endswith("resnet on cpu")
    progress.clear()
    assert stream.getvalue().endswith("\r\x1b[K")
    quiet = io.StringIO()
    progress = cli._Progress(False, quiet)
    progress.update(1, 4, "x")
    progress.clear()
    assert quiet.getvalue() == ""


def test_bench_progress_goes_to_stderr_only_when_asked(capsys):
    args = ("bench", "--quick", "--no-torch", "--backend", "reference", "--op",
            "conv_backward_bias", "--repeat", "1", "--settle", "0")
    status, out, err = run_cli(capsys, *args)  # captured stderr is no terminal: quiet
    assert status == 0 and "\x1b[K" not in err and "\x1b[K" not in out
    status, out, err = run_cli(capsys, *args, "--progress")
    assert status == 0
    assert f"/{len(bench.QUICK_SHAPES)} " in err and "dispatch overhead" in err
    assert "\x1b[K" not in out


# --- BLAS and OPENBLAS_CORETYPE ------------------------------------------------------------

def test_blas_info_prefers_numpys_library():
    torch_blas = dict(user_api="blas", internal_api="mkl", version="2024", num_threads=2,
                      filepath="/site-packages/torch/lib/libmkl_rt.so")
    numpy_blas = dict(user_api="blas", internal_api="openblas", version="0.3.31",
                      num_threads=2, architecture="SkylakeX", threading_layer="pthreads",
                      filepath="/site-packages/numpy.libs/libscipy_openblas64_.so")
    omp = dict(user_api="openmp", internal_api="openmp", num_threads=2, filepath="/libgomp")
    info = bench.blas_info([omp, torch_blas, numpy_blas])
    assert (info["library"], info["kernel"], info["threads"]) == ("openblas", "SkylakeX", 2)
    assert bench.blas_info([omp]) is None
    assert bench.blas_info([]) is None


def test_blas_info_of_this_process():
    pytest.importorskip("threadpoolctl")
    info = bench.blas_info()
    assert info is not None and info["library"] and info["threads"] >= 1
    assert bench.environment()["blas"] == info


def test_cpu_isa_level():
    assert bench.cpu_isa_level(["sse2", "avx", "avx2", "fma", "avx512f", "avx512bw",
                                "avx512vl"]) == 3
    assert bench.cpu_isa_level(["sse2", "avx", "avx2", "fma", "avx512f"]) == 2
    assert bench.cpu_isa_level(["sse2", "avx"]) == 1
    assert bench.cpu_isa_level(["sse2"]) == 0
    assert bench.cpu_isa_level(["neon", "asimd"]) is None


def test_openblas_coretype_warning():
    warn = bench.openblas_coretype_warning
    text = warn("Haswell", "Haswell", natural="SkylakeX")
    assert text.startswith("OPENBLAS_CORETYPE=Haswell forces OpenBLAS's Haswell kernel (AVX2)")
    assert "SkylakeX kernel (AVX-512)" in text and "env -u OPENBLAS_CORETYPE" in text
    assert warn("Haswell", "Haswell", natural="Haswell") is None  # what it would pick anyway
    assert warn("Haswell", "Haswell", natural="Zen") is None      # same instruction set
    assert warn("SkylakeX", natural="Haswell") is None            # newer is not "old"
    assert warn(None, "SkylakeX", natural="SkylakeX") is None     # not set
    assert warn("", natural="SkylakeX") is None
    assert warn("ARMV8", natural="NeoverseN1") is None            # not an x86 name we know
    # Without the natural kernel, the CPU's instruction set decides.
    assert "what this CPU supports (AVX-512)" in warn("nehalem", cpu_level=3)
    assert warn("Haswell", cpu_level=2) is None
    assert warn("Haswell") is None


def test_cli_warns_about_a_forced_old_kernel(monkeypatch):
    monkeypatch.setattr(bench, "openblas_natural_kernel", lambda: "SkylakeX")
    blas = dict(library="openblas", kernel="Haswell")
    (text,) = cli._openblas_warnings(bench, {"OPENBLAS_CORETYPE": "Haswell"}, blas)
    assert "forces OpenBLAS's Haswell kernel" in text
    assert cli._openblas_warnings(bench, {}, blas) == []
    monkeypatch.setattr(bench, "openblas_natural_kernel", lambda: "Haswell")
    assert cli._openblas_warnings(bench, {"OPENBLAS_CORETYPE": "Haswell"}, blas) == []
    (text,) = cli._openblas_warnings(bench, {"OPENBLAS_L2_SIZE": "512"}, blas)
    assert text.startswith("OPENBLAS_L2_SIZE=512 overrides")


# --- --plot --------------------------------------------------------------------------------

def fake_rows(ratios=True):
    rows = []
    for i, case in enumerate(bench.QUICK_SHAPES):
        for op in ("conv", "conv_backward_data"):
            rows.append(bench.Row(case.name, op, bench.PYTORCH, "channels_first", "float32",
                                  "ok", median_s=1e-3, gflops=1.0, vs_pytorch=1.0))
            for backend, scale in (("cpu", 1.0), ("torch", 0.5)):
                rows.append(bench.Row(case.name, op, backend, "channels_first", "float32",
                                      "ok", median_s=1e-3, gflops=1.0,
                                      vs_pytorch=(0.5 + i) * scale if ratios else None,
                                      peak_fraction=0.1 * (i + 1)))
    rows.append(bench.Row("x", "conv", "cpu", "channels_first", "float32", "skipped"))
    return rows


@pytest.mark.parametrize("ratios", [True, False], ids=["ratios", "peak-fractions"])
def test_plot_ratios_writes_a_png(tmp_path, ratios):
    pytest.importorskip("matplotlib")
    path = tmp_path / "ratios.png"
    metric = bench.plot_ratios(fake_rows(ratios), str(path))
    assert metric == ("vs_pytorch" if ratios else "peak_fraction")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_ratios_needs_something_to_draw(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="rows: nothing to plot"):
        bench.plot_ratios([r for r in fake_rows() if r.backend == bench.PYTORCH],
                          str(tmp_path / "x.png"))


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(ImportError, match=r"pip install 'numbaconv\[plot\]'"):
        bench.plot_ratios(fake_rows(), str(tmp_path / "x.png"))
    status, out, err = run_cli(capsys, "bench", "--quick", "--no-torch", "--plot",
                               str(tmp_path / "x.png"))
    assert status == 1
    assert "--plot" in err and "numbaconv[plot]" in err
    assert "SGEMM peak" not in out  # refused before measuring anything
    assert not (tmp_path / "x.png").exists()


def test_bench_plot_and_json_record_blas_and_warnings(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png, record_path = tmp_path / "bench.png", tmp_path / "bench.json"
    status, out, _ = run_cli(capsys, "bench", "--quick", "--no-torch", "--backend",
                             "reference", "--op", "conv", "--op", "conv_backward_data",
                             "--repeat", "1", "--settle", "0", "--plot", str(png),
                             "--json", str(record_path))
    assert status == 0, out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert f"written to {png}" in out
    header = next(line for line in out.splitlines() if line.startswith("shape"))
    assert header.split()[-3:] == ["pytorch", "vs", "pytorch"]
    record = json.loads(record_path.read_text())
    assert record["plot"] == str(png)
    assert isinstance(record["warnings"], list)
    assert all(f"WARNING: {w}" in out for w in record["warnings"])
    if record["environment"]["threadpoolctl"]:
        assert record["blas"]["library"] and "BLAS (NumPy's):" in out
    assert {r["op"] for r in record["results"]} == {"conv", "conv_backward_data"}
    assert all("pytorch_s" in r for r in record["results"])
    assert set(CONV_OPS) >= {r["op"] for r in record["results"]}
