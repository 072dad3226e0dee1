"""numbaconv in any process, and errors that say where they come from (issue 25).

Children of every multiprocessing start method run the cpu backend's parallel kernels after
the parent ran them; a broken plugin's failure names the backend; a corrupt autotune cache
never raises.
"""

import importlib
import multiprocessing
import os
import pkgutil
import select
import signal
import subprocess
import sys
import time
import traceback
import types

import numpy as np
import pytest

import numbaconv as nc
from numbaconv import config
from reliability_child import LONG_CALLS, send_workload, workload

#: Seconds a child may take: its first run compiles the serial twins of every kernel it
#: calls (about a minute on 2 cores, cold), later runs read them from Numba's disk cache.
CHILD_TIMEOUT = 600


def _run_child(method: str) -> dict:
    """The workload's errors, computed in a child started with ``method``; fails (instead
    of hanging) when the child dies, raises or takes longer than CHILD_TIMEOUT."""
    ctx = multiprocessing.get_context(method)
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=send_workload, args=(send,))
    child.start()
    send.close()
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT
        while not receive.poll(0.2):
            if not child.is_alive() and not receive.poll(0):
                pytest.fail(f"the {method} child died (exit code {child.exitcode}) without "
                            f"an answer")
            if time.monotonic() > deadline:
                pytest.fail(f"the {method} child hung: no answer in {CHILD_TIMEOUT} s")
        status, answer = receive.recv()
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)
    assert status == "ok", f"the {method} child raised {answer}"
    return answer


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_child_process_runs_every_parallel_kernel(method):
    """After the parent ran every algorithm's parallel kernels, a child started with each
    method runs them too, with results matching the reference (a forked child of a GNU
    OpenMP parent used to be terminated at its first parallel region)."""
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {method} start method here")
    in_parent = workload()
    assert max(in_parent.values()) < 2e-5, in_parent
    in_child = _run_child(method)
    assert in_child.keys() == in_parent.keys()
    assert max(in_child.values()) < 2e-5, in_child


def _cpu_kernel_modules():
    import numbaconv.cpu as cpu
    return [importlib.import_module(f"numbaconv.cpu.{m.name}")
            for m in pkgutil.iter_modules(cpu.__path__)]


def _names_used(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_used(const)
    return names


def test_every_parallel_kernel_can_run_serially_after_fork():
    """What the fork handler relies on: every parallel kernel is made by
    config.parallel_jit (so it is registered), and no compiled function calls one (a caller
    compiled in the parent would launch the callee's threads in the child)."""
    from numba.core.registry import CPUDispatcher
    from numbaconv.cpu import _rnn_cells
    _rnn_cells.kernels(True)        # made on first use
    kernels = {}
    for module in _cpu_kernel_modules():
        for name, value in vars(module).items():
            if isinstance(value, CPUDispatcher):
                kernels[id(value)] = (f"{module.__name__}.{name}", value)
    kernels.update((id(k), (k.py_func.__name__, k)) for k in config._parallel_kernels)
    parallel = {key for key, (_, k) in kernels.items() if k.targetoptions.get("parallel")}
    assert len(parallel) > 20
    unregistered = [kernels[key][0] for key in parallel
                    if kernels[key][1] not in config._parallel_kernels]
    assert not unregistered, f"parallel kernels not made by parallel_jit: {unregistered}"
    callers = []
    for where, kernel in kernels.values():
        scope = kernel.py_func.__globals__
        for name in _names_used(kernel.py_func.__code__):
            if id(scope.get(name)) in parallel:
                callers.append(f"{where} calls {name}")
    for name in _rnn_cells.STEP_KERNELS:
        scope = getattr(_rnn_cells, name).__globals__
        for used in _names_used(getattr(_rnn_cells, name).__code__):
            if id(scope.get(used)) in parallel:
                callers.append(f"_rnn_cells.{name} calls {used}")
    assert not callers, callers


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_handler_leaves_the_parent_alone():
    """The child's kernels turn serial (under OpenMP); the parent's stay parallel and
    compiled."""
    nc.conv_backward_bias(np.ones((2, 3, 4, 4)))
    compiled = {k: len(k.overloads) for k in config._parallel_kernels}
    assert any(compiled.values())
    serial_in_child = not config._fork_safe_threads()
    pid = os.fork()
    if pid == 0:  # the child: exit at once, whatever happens
        os._exit(0 if config.serial_after_fork() == serial_in_child else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not config.serial_after_fork()
    assert compiled == {k: len(k.overloads) for k in config._parallel_kernels}
    assert not any("_compile_for_args" in vars(k) for k in config._parallel_kernels)


# --- a backend failing inside run ----------------------------------------------------------

class PluginBug(Exception):
    """An exception type numbaconv knows nothing of."""


@pytest.fixture
def failing_plugin():
    """Register a FailingBackend (above the built-ins) for one test; yields a factory."""
    from plugin_fixtures import FailingBackend
    names = []

    def make(error, name="failing"):
        backend = FailingBackend(name, error)
        nc.register_backend(name, lambda: backend)
        names.append(name)
        return backend

    yield make
    for name in names:
        nc.unregister_backend(name)


X = np.random.default_rng(0).standard_normal((2, 3, 6, 6))
W = np.random.default_rng(1).standard_normal((4, 3, 3, 3))


@pytest.mark.parametrize("error", [PluginBug("kernel exploded"), ValueError("bad stride"),
                                   MemoryError()], ids=["own", "ValueError", "MemoryError"])
def test_failing_plugin_is_named_and_its_exception_kept(failing_plugin, error):
    """The plugin's exception arrives as itself (catchable as before, its traceback intact)
    with a note naming the backend, the algorithm and the op; no other backend runs."""
    failing_plugin(error)
    with pytest.raises(type(error)) as raised:
        nc.conv(X, W)
    assert raised.value is error
    notes = getattr(raised.value, "__notes__", [])
    assert len(notes) == 1
    assert "backend 'failing'" in notes[0] and "algorithm 'numpy'" in notes[0]
    assert "running conv on conv:N2:C3:K4" in notes[0] and "no other backend" in notes[0]
    frames = traceback.extract_tb(raised.value.__traceback__)
    assert frames[-1].name == "run" and frames[-1].filename.endswith("plugin_fixtures.py")


def test_failing_plugin_does_not_fall_back(failing_plugin):
    """A failure inside run is not a refusal: the next backend in the order is not tried,
    under use_backend as in priority order; after it, other calls still work."""
    from plugin_fixtures import FakeBackend
    failing_plugin(PluginBug("no"))
    second = FakeBackend("second", priority=400)
    nc.register_backend("second", lambda: second)
    try:
        with pytest.raises(PluginBug):
            nc.conv(X, W)
        with nc.use_backend("failing", "second"), pytest.raises(PluginBug):
            nc.conv(X, W)
        assert second.runs == []
        with nc.use_backend("second"):
            nc.conv(X, W)
        assert second.runs == [("conv", "numpy")]
    finally:
        nc.unregister_backend("second")


def test_failing_plugin_note_says_out_may_be_partly_written(failing_plugin):
    """out= is documented as undefined after a failure inside run (here: partly written)."""
    failing_plugin(PluginBug("half way"))
    out = np.zeros((2, 4, 4, 4))
    with pytest.raises(PluginBug) as raised:
        nc.conv(X, W, out=out)
    assert "out= may be partly written" in raised.value.__notes__[0]
    assert out.reshape(-1)[0] == 123.0


def test_failing_plugin_in_a_recurrent_op_is_named(failing_plugin):
    from numbaconv.problem import RNNConfig
    failing_plugin(PluginBug("rnn"))
    cfg = RNNConfig("gru", 3, 4)
    params = nc.rnn_init_params(cfg, seed=0)
    with pytest.raises(PluginBug) as raised:
        nc.rnn_forward(cfg, np.zeros((2, 1, 3), params.dtype), params)
    assert "backend 'failing'" in raised.value.__notes__[0]
    assert "running rnn_forward" in raised.value.__notes__[0]


def test_keyboard_interrupt_in_a_plugin_passes_unannotated(failing_plugin):
    failing_plugin(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt) as raised:
        nc.conv(X, W)
    assert not getattr(raised.value, "__notes__", None)


def test_note_without_add_note():
    """Before Python 3.11 (no add_note) the note goes into __notes__ and the message."""
    from numbaconv.dispatch import _add_note

    class OldError(ValueError):
        @property
        def add_note(self):
            raise AttributeError("add_note")

    error = OldError("bad value")
    _add_note(error, "numbaconv: raised by backend 'x'")
    assert error.__notes__ == ["numbaconv: raised by backend 'x'"]
    assert str(error) == "bad value\nnumbaconv: raised by backend 'x'"
    error = OldError(2, "two args")  # args that are not one message stay as they are
    _add_note(error, "note")
    assert error.args == (2, "two args") and error.__notes__ == ["note"]


# --- Ctrl-C ----------------------------------------------------------------------------------

#: Seconds from SIGINT to KeyboardInterrupt in the caller, and to the child's exit: generous
#: for 2 busy cores, yet well below a long call's length (figures: docs/configuration.md,
#: "Ctrl-C").
INTERRUPTED_WITHIN = 1.5
EXITED_WITHIN = 3.0


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name != "posix",
                    reason="needs POSIX signals")
@pytest.mark.parametrize("name", list(LONG_CALLS))
def test_ctrl_c_interrupts_a_long_call_within_a_second(name):
    """SIGINT during a long call (several seconds on 2 threads) reaches the caller as
    KeyboardInterrupt within about a second, and the process then exits at once: im2col's
    running tiles end, its queued ones are dropped and its weight gradient's partial sums
    stop at their next tile; implicit and direct run a long call as many parallel regions,
    and Python sees the signal between two of them; a recurrence's chains stop between two
    steps."""
    env = dict(os.environ, NUMBA_NUM_THREADS="2")
    here = os.path.dirname(__file__)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(nc.__file__)), here, env.get("PYTHONPATH", "")])
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, reliability_child as c; "
                               "c.interrupted_call(sys.argv[1])", name],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "start", child.stderr.read()
        time.sleep(0.5)
        child.send_signal(signal.SIGINT)
        sent = time.monotonic()
        select.select([child.stdout], [], [], CHILD_TIMEOUT)
        answer = child.stdout.readline().split()
        interrupted = time.monotonic() - sent
        out, err = child.communicate(timeout=CHILD_TIMEOUT)
        exited = time.monotonic() - sent
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    assert answer == ["interrupted"], f"the call finished first ({answer}): make it longer"
    assert interrupted < INTERRUPTED_WITHIN, f"KeyboardInterrupt {interrupted:.1f} s after SIGINT"
    assert exited < EXITED_WITHIN, f"the process exited {exited:.1f} s after SIGINT"


#: Problems that reach every kernel of implicit and direct, for the pieces test: algorithm,
#: layout, x shape (channels-first), w shape, groups, stride, padding.
PIECED = (
    ("implicit", "channels_last", (3, 16, 12, 20), (32, 16, 3, 3), 1, 1, 1),
    ("implicit", "channels_first", (3, 16, 12, 20), (32, 16, 3, 3), 1, 1, 1),
    ("implicit", "channels_last", (3, 16, 13, 24), (32, 16, 3, 3), 1, 2, 1),
    ("direct", "channels_last", (3, 32, 12, 20), (32, 1, 3, 3), 32, 1, 1),
    ("direct", "channels_first", (3, 32, 12, 20), (32, 1, 3, 3), 32, 1, 1),
    ("direct", "channels_last", (3, 32, 12, 20), (32, 4, 3, 3), 8, 1, 1),
    ("direct", "channels_first", (3, 32, 12, 20), (32, 4, 3, 3), 8, 1, 1),
    ("direct", "channels_first", (3, 16, 13, 15), (16, 1, 5, 5), 16, 2, 2),
    # The channels-first 1x1 weight gradient reading dy in place (AVX-512; BLAS otherwise).
    ("gemm", "channels_first", (3, 64, 5, 7), (13, 64, 1, 1), 1, 1, 0),
)


@pytest.mark.parametrize("case", PIECED, ids=lambda c: f"{c[0]}-{c[1]}-s{c[5]}-g{c[4]}")
def test_pieces_change_no_bit(case, monkeypatch):
    """A call split into the smallest pieces (one parallel region per job or round of jobs,
    as a long call is split for Ctrl-C) gives bitwise the results of one region."""
    from numbaconv import dispatch
    from numbaconv import problem as pb
    from numbaconv._kernel_geometry import geom
    from numbaconv.cpu import _direct, _gemm, _heuristics, _implicit, _tiles
    algorithm, layout, x_shape, w_shape, groups, stride, padding = case
    rng = np.random.default_rng(5)
    x = rng.standard_normal(x_shape).astype(np.float32)
    if layout == "channels_last":
        x = np.ascontiguousarray(np.moveaxis(x, 1, -1))
    w = rng.standard_normal(w_shape).astype(np.float32)
    kw = dict(padding=padding, groups=groups, layout=layout, stride=stride)
    cpu = dispatch.get_backend("cpu")
    forward = pb.conv_problem(x, w, None, **kw)
    dy = rng.standard_normal(forward.y_shape).astype(np.float32)
    calls = [("conv_backward_weight", pb.conv_backward_weight_problem(x, dy, w_shape, **kw),
              (x, dy))]
    if stride == 1 or algorithm == "direct":
        calls.append(("conv", forward, (x, w, None)))
    calls.append(("conv_backward_data", pb.conv_backward_data_problem(dy, w, x.shape, **kw),
                  (dy, w)))

    def run_all():
        return [cpu.run(op, problem, operands, None, algorithm).tobytes()
                for op, problem, operands in calls]

    whole = run_all()
    pieces = []

    def finest(size, work, piece_work, multiple=0):
        """One job a region (rounds of slots too are cut)."""
        pieces.append(_tiles.interruptible_ranges(size, work, piece_work, 1))
        return pieces[-1]

    monkeypatch.setattr(_direct, "interruptible_ranges", finest)
    monkeypatch.setattr(_implicit, "interruptible_ranges", finest)
    monkeypatch.setattr(_gemm, "interruptible_ranges", finest)
    monkeypatch.setattr(_heuristics, "IMPLICIT_PIECE_MACS", 1)
    monkeypatch.setattr(_heuristics, "DIRECT_PIECE_MACS", 1)
    assert run_all() == whole
    if algorithm == "gemm":                     # its weight gradient only; BLAS otherwise
        if not _heuristics.pointwise_rows_in_place(
                geom(calls[0][1]), np.dtype(np.float32)):
            pytest.skip("no AVX-512: the 1x1 weight gradient is BLAS's")
        assert len(pieces) == 1 and len(pieces[0]) == 3, pieces
        return
    assert len(pieces) >= len(calls) and min(len(p) for p in pieces) > 1, pieces
