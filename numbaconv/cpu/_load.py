"""How many of this process's cores other processes are using: on a busy machine the cpu
backend runs a call on fewer threads (see :func:`threads_for_call`).

A Numba parallel region, like a tile batch, ends at a barrier: when another process keeps a
core busy, the operating system deschedules one of our threads now and then, and the whole
region waits for it for a time slice (milliseconds), which on a call of 100 us costs tens
of times the call (figures: docs/configuration.md, "Busy machines"). So each call reads how
busy the process's CPUs were over the last fraction of a second (Linux's ``/proc/stat``, less this process's own CPU time) and runs
on as many threads as the cores the others leave free.

Elsewhere (no ``/proc/stat``), under a cgroup CPU quota (the quota, not the other
processes, then bounds the process), or with ``NUMBACONV_ADAPT_THREADS=0``, the thread count
is left alone.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Optional

from ..config import environ_value

#: Seconds between two readings of ``/proc/stat``: the kernel counts CPU time in ticks
#: (usually 100 a second per CPU), so a much shorter window cannot tell one busy core from
#: noise; a longer one follows a change of load later.
WINDOW_SECONDS = 0.25

#: The cores the others must leave free for each thread we keep, less this margin: a
#: thread is dropped only when at least half a core is missing for it (a neighbour's
#: occasional burst does not halve a call's threads).
MARGIN = 0.5


def adapting() -> bool:
    """``NUMBACONV_ADAPT_THREADS`` (default 1), read on every call (through
    :data:`numbaconv.config.environ_value`, cheaper than ``os.environ.get``)."""
    raw = environ_value("NUMBACONV_ADAPT_THREADS")
    if raw == "1" or not raw:
        return True
    raw = raw.strip()
    if raw in ("", "1"):
        return True
    if raw == "0":
        return False
    raise ValueError(f"NUMBACONV_ADAPT_THREADS: expected '0' or '1', got {raw!r}")


def _read_busy_seconds(cpus: frozenset) -> Optional[float]:
    """CPU seconds the CPUs ``cpus`` have spent busy since boot (every process), from
    ``/proc/stat``: user, nice, system, irq, softirq and steal (time the hypervisor gave
    to other machines is not ours either)."""
    try:
        with open("/proc/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    ticks = 0
    for line in text.split(b"\n"):
        if not line.startswith(b"cpu") or line[3:4] == b" ":
            continue
        name, *fields = line.split()
        if int(name[3:]) not in cpus or len(fields) < 8:
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
        ticks += user + nice + system + irq + softirq + steal
    return ticks / _TICKS_PER_SECOND


def _own_seconds() -> float:
    """CPU seconds this process has used (all its threads)."""
    times = os.times()
    return times.user + times.system


try:
    _TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
except (AttributeError, OSError, ValueError):
    _TICKS_PER_SECOND = 100


class LoadMonitor:
    """The CPU others have been using on this process's CPUs, in cores, over the last
    window of at least :data:`WINDOW_SECONDS` (read again when a call comes after it)."""

    def __init__(self, cpus: frozenset,
                 read_busy: Callable[[frozenset], Optional[float]] = _read_busy_seconds,
                 read_own: Callable[[], float] = _own_seconds,
                 clock: Callable[[], float] = time.monotonic):
        self.cpus = cpus
        self._read_busy, self._read_own, self._clock = read_busy, read_own, clock
        self._lock = threading.Lock()
        self._last = None          # (time, busy seconds, own seconds) of the last reading
        self.others = 0.0          # cores the others used in the last full window
        self.works = True

    def others_busy(self) -> float:
        now = self._clock()
        last = self._last
        if last is not None and now - last[0] < WINDOW_SECONDS:
            return self.others
        with self._lock:
            last = self._last
            if last is not None and now - last[0] < WINDOW_SECONDS:
                return self.others          # another thread read it meanwhile
            busy = self._read_busy(self.cpus)
            if busy is None:
                self.works = False
                return 0.0
            own = self._read_own()
            if last is not None:
                others = ((busy - last[1]) - (own - last[2])) / (now - last[0])
                self.others = min(float(len(self.cpus)), max(0.0, others))
            self._last = (now, busy, own)
        return self.others


def threads_for(threads: int, cores: int, others: float) -> int:
    """Threads to run a call on: ``threads`` (Numba's count for the calling thread) while
    the others leave enough of the ``cores``, else as many as they leave (at least 1)."""
    free = cores - others
    if free >= threads - MARGIN:
        return threads
    return max(1, min(threads, int(free + MARGIN)))


_monitor: Optional[LoadMonitor] = None
_monitor_lock = threading.Lock()


def _the_monitor() -> Optional[LoadMonitor]:
    """The process's monitor, made on first use; None where it cannot work (no affinity
    mask or ``/proc/stat``, or a cgroup quota below the mask)."""
    global _monitor
    if _monitor is None:
        with _monitor_lock:
            if _monitor is None:
                from ..config import available_cpus
                try:
                    cpus = frozenset(os.sched_getaffinity(0))
                except (AttributeError, OSError):
                    cpus = frozenset()
                monitor = LoadMonitor(cpus)
                if not cpus or available_cpus()[0] < len(cpus):
                    monitor.works = False
                _monitor = monitor
    return _monitor if _monitor.works else None


def threads_for_call(current: Callable[[], int]) -> Optional[int]:
    """Fewer threads than ``current()`` (the calling thread's count, asked only on a busy
    machine) for the call about to run, when other processes are keeping this process's
    CPUs busy (see the module docstring); None to leave the count alone."""
    if not adapting():
        return None
    monitor = _the_monitor()
    if monitor is None:
        return None
    others = monitor.others_busy()
    if others < MARGIN:
        return None
    threads = current()
    wanted = threads_for(threads, len(monitor.cpus), others)
    return wanted if wanted < threads else None


def _after_fork_in_child() -> None:
    """A forked child starts its own readings (the parent's last one holds its own CPU
    time, not the child's)."""
    global _monitor
    _monitor = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
