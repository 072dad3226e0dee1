"""On a busy machine the cpu backend runs a call on fewer threads (numbaconv/cpu/_load.py):
the reading of other processes' CPU time, the decision, and the call's thread count. The
speed it buys is measured by docs/benchmarks/busy_machine.py, not here."""

import os
import threading

import numba
import numpy as np
import pytest

import numbaconv as nc
from numbaconv.cpu import _load, _tiles


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def monitor(cores, busy, own, clock):
    """A LoadMonitor over ``cores`` CPUs whose readings come from the lists' last values."""
    return _load.LoadMonitor(frozenset(range(cores)), read_busy=lambda cpus: busy[-1],
                             read_own=lambda: own[-1], clock=clock)


def test_others_busy_is_busy_time_less_our_own_over_the_window():
    clock, busy, own = Clock(), [1000.0], [50.0]
    m = monitor(2, busy, own, clock)
    assert m.others_busy() == 0.0                      # the first reading: no window yet
    clock.now += 0.5
    busy.append(1000.0 + 0.9)                          # 1.8 cores busy, 0.4 of them ours
    own.append(50.0 + 0.2)
    assert m.others_busy() == pytest.approx(1.4)
    # Inside the window the last figure stands, whatever the counters say.
    busy.append(1000.9 + 0.5)
    clock.now += 0.1
    assert m.others_busy() == pytest.approx(1.4)
    # Next window: idle neighbours; our own time beyond the busy time reads as 0, not less.
    clock.now += _load.WINDOW_SECONDS
    busy[-1] = 1000.9 + 0.1
    own.append(own[-1] + 0.3)
    assert m.others_busy() == 0.0
    # Never more than the CPUs watched.
    clock.now += 1.0
    busy.append(busy[-1] + 50.0)
    assert m.others_busy() == 2.0


def test_a_monitor_without_proc_stat_gives_up():
    m = _load.LoadMonitor(frozenset({0, 1}), read_busy=lambda cpus: None,
                          read_own=lambda: 0.0, clock=Clock())
    assert m.others_busy() == 0.0 and not m.works


@pytest.mark.parametrize("threads, cores, others, expected", [
    (2, 2, 0.0, 2), (2, 2, 0.4, 2), (2, 2, 0.6, 1), (2, 2, 1.0, 1), (2, 2, 2.0, 1),
    (16, 16, 0.0, 16), (16, 16, 8.0, 8), (16, 16, 7.6, 8), (16, 16, 15.9, 1),
    (4, 16, 10.0, 4), (4, 16, 13.0, 3), (1, 2, 2.0, 1),
])
def test_threads_for(threads, cores, others, expected):
    assert _load.threads_for(threads, cores, others) == expected


def test_reads_this_machines_proc_stat():
    if not os.path.exists("/proc/stat") or not hasattr(os, "sched_getaffinity"):
        pytest.skip("no /proc/stat")
    cpus = frozenset(os.sched_getaffinity(0))
    first = _load._read_busy_seconds(cpus)
    assert first is not None and first > 0
    # Our own CPU time is part of the machine's busy time.
    x = np.random.rand(400, 400)
    for _ in range(20):
        x = np.tanh(x @ x.T / 400)
    assert _load._read_busy_seconds(cpus) >= first
    assert _load._read_busy_seconds(frozenset()) == 0.0


def test_variable(monkeypatch):
    monkeypatch.delenv("NUMBACONV_ADAPT_THREADS", raising=False)
    assert _load.adapting()
    monkeypatch.setenv("NUMBACONV_ADAPT_THREADS", "0")
    assert not _load.adapting() and _load.threads_for_call(lambda: 8) is None
    monkeypatch.setenv("NUMBACONV_ADAPT_THREADS", "yes")
    with pytest.raises(ValueError, match="NUMBACONV_ADAPT_THREADS"):
        _load.adapting()


def test_a_call_on_a_busy_machine_runs_on_fewer_threads(monkeypatch):
    """With the others reading as busy, a call's kernels see one Numba thread and a
    one-thread BLAS, the caller's count is back afterwards, and the weight gradient is the
    same bits as on the full count."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread: nothing to take away")
    monkeypatch.delenv("NUMBACONV_ADAPT_THREADS", raising=False)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 12, 12)).astype(np.float32)
    dy = rng.standard_normal((2, 8, 12, 12)).astype(np.float32)
    monkeypatch.setattr(_load, "threads_for_call", lambda current: None)
    with nc.use_backend("cpu"):
        idle = nc.conv_backward_weight(x, dy, (8, 8, 3, 3), padding=1)
    seen = _spy_on_threads(monkeypatch)
    monkeypatch.setattr(_load, "threads_for_call", lambda current: 1)
    before = numba.get_num_threads()
    with nc.use_backend("cpu"):
        busy = nc.conv_backward_weight(x, dy, (8, 8, 3, 3), padding=1)
    assert seen == [1] and numba.get_num_threads() == before
    assert np.array_equal(busy, idle)


def _spy_on_threads(monkeypatch, blas: list = None) -> list:
    """The thread counts the calls made from now on switch to (``_tiles.on_threads``), and
    in ``blas`` whether each may hold NumPy's BLAS."""
    seen = []
    original = _tiles.on_threads

    def spy(threads, **kwargs):
        seen.append(threads)
        if blas is not None:
            blas.append(kwargs.get("blas", True))
        return original(threads, **kwargs)

    monkeypatch.setattr(_tiles, "on_threads", spy)
    return seen


def test_on_threads_sets_the_calling_threads_count_only():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread")
    before = numba.get_num_threads()
    other = []
    with _tiles.on_threads(1):
        assert numba.get_num_threads() == 1
        t = threading.Thread(target=lambda: other.append(numba.get_num_threads()))
        t.start()
        t.join()
    assert numba.get_num_threads() == before
    assert other == [numba.config.NUMBA_NUM_THREADS]


def test_the_fast_thread_count_functions_are_numbas():
    """_tiles' getter and setter (the threading layer's own functions) read and set what
    numba.get_num_threads and set_num_threads do, per thread."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread")
    before = numba.get_num_threads()
    assert _tiles.numba_threads() == before
    try:
        _tiles.set_numba_threads(1)
        assert numba.get_num_threads() == 1 == _tiles.numba_threads()
        other = []
        t = threading.Thread(target=lambda: other.append(_tiles.numba_threads()))
        t.start()
        t.join()
        assert other == [numba.config.NUMBA_NUM_THREADS]
        numba.set_num_threads(2)
        assert _tiles.numba_threads() == 2
    finally:
        numba.set_num_threads(before)


def test_the_thread_count_is_asked_only_on_a_busy_machine(monkeypatch):
    """On an idle machine a call costs the monitor's clock reading, not Numba's count."""
    monkeypatch.delenv("NUMBACONV_ADAPT_THREADS", raising=False)
    clock, busy, own = Clock(), [10.0], [1.0]
    m = monitor(4, busy, own, clock)
    monkeypatch.setattr(_load, "_the_monitor", lambda: m)
    asked = []

    def current():
        asked.append(1)
        return 4

    assert _load.threads_for_call(current) is None and asked == []
    clock.now += 1.0
    busy.append(10.0 + 2.2)                            # 2.2 cores busy, none of it ours
    assert _load.threads_for_call(current) == 2 and asked == [1]


def test_a_small_bias_gradient_skips_the_switch(monkeypatch):
    """A bias gradient below its parallel threshold runs on one thread anyway: on a busy
    machine it is not switched to fewer threads (the switch cost more than the call); a
    larger one is, and holds the BLAS to one thread meanwhile, released afterwards."""
    from numbaconv.cpu import conv_backward_bias as bias_gradient
    monkeypatch.delenv("NUMBACONV_ADAPT_THREADS", raising=False)
    monkeypatch.setattr(_load, "threads_for_call", lambda current: 1)
    seen = _spy_on_threads(monkeypatch)
    dy = np.random.default_rng(1).standard_normal((2, 4, 8, 8)).astype(np.float32)
    with nc.use_backend("cpu"):
        small = nc.conv_backward_bias(dy)
        assert seen == []
        monkeypatch.setattr(bias_gradient, "PARALLEL_FROM", 0)
        assert np.array_equal(nc.conv_backward_bias(dy), small)
    assert seen == [1] and _tiles._blas_users == 0


@pytest.mark.parametrize("op", ["conv", "conv_backward_data", "conv_backward_weight",
                                "conv_transpose"])
def test_on_a_busy_machine_only_blas_algorithms_hold_the_blas(monkeypatch, op):
    """The algorithms of ``cpu.WITHOUT_BLAS`` reach no NumPy product (every one of
    numbaconv's goes through ``np.matmul``, made to fail here), so a busy call of theirs
    leaves BLAS's thread count alone; im2col holds it."""
    from numbaconv import bench_cases, cpu
    from numbaconv.cpu import _microkernel
    monkeypatch.delenv("NUMBACONV_ADAPT_THREADS", raising=False)
    monkeypatch.setattr(_load, "threads_for_call", lambda current: 1)
    backend = cpu.CpuBackend()
    cases = [("plain", (2, 8, 10, 10), (8, 8, 3, 3), dict(padding=1)),
             ("strided", (2, 8, 11, 11), (8, 8, 3, 3), dict(stride=2, padding=1,
                                                           output_padding=0)),
             ("depthwise", (2, 8, 10, 10), (8, 1, 3, 3), dict(padding=1, groups=8))]
    ran = set()
    for layout in ("channels_first", "channels_last"):
        for name, x_shape, w_shape, kwargs in cases:
            case = bench_cases.BenchCase(name, x_shape, w_shape, **kwargs)
            call = bench_cases.make_call(op, case, layout)
            for algorithm in backend.algorithms(op, call.problem):
                holds = []
                _spy_on_threads(monkeypatch, holds)
                if algorithm in cpu.WITHOUT_BLAS:
                    def no_blas(*args, **kwargs):
                        raise AssertionError(f"{algorithm} called np.matmul")
                    monkeypatch.setattr(np, "matmul", no_blas)
                    monkeypatch.setattr(_microkernel, "gram", no_blas)
                backend.run(op, call.problem, call.operands, None, algorithm)
                monkeypatch.undo()
                monkeypatch.setattr(_load, "threads_for_call", lambda current: 1)
                assert holds == [algorithm not in cpu.WITHOUT_BLAS], algorithm
                ran.add(algorithm)
    assert {"implicit", "direct", "im2col"} <= ran
