"""Timing a call for the benchmarks: medians over samples after a warm-up, each sample
looping over a fast call until it rises above the clock's resolution (as :mod:`timeit`
does); the geometric mean of ratios; times printed with a readable unit."""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional


# --- timing ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Timing:
    """Per-call times of one measurement, in seconds.

    Attributes
    ----------
    median, best : float
        Median and minimum over the samples.
    repeat : int
        Number of samples.
    number : int
        Calls per sample (a sample's time is divided by it).
    """

    median: float
    best: float
    repeat: int
    number: int


def _autonumber(fn: Callable[[], object], min_sample: float) -> int:
    """Calls per sample for one sample to last at least ``min_sample`` seconds, as timeit."""
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_sample or number >= 1_000_000:
            return number
        # Jump straight to the estimate, with headroom, instead of doubling many times.
        number = max(number * 2, int(number * min_sample / max(elapsed, 1e-9) * 1.2))


@contextlib.contextmanager
def collector_off():
    """The garbage collector off while timing: it would charge one call for another's
    garbage (timeit turns it off too)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def per_call(fn: Callable[[], object], number: int) -> float:
    """Seconds per call of ``number`` calls of ``fn`` in a row (one sample)."""
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def time_call(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1,
              number: Optional[int] = None, min_sample: float = 2e-3,
              warmup_for: float = 0.0, warmup_most: int = 50) -> Timing:
    """Median per-call time of ``fn()``.

    Parameters
    ----------
    fn : callable
        Called without arguments; its result is discarded.
    repeat : int
        Number of samples (>= 1).
    warmup : int
        Untimed calls first (the first call of a Numba backend compiles).
    warmup_for : float
        Then more untimed calls, until they have lasted this many seconds or ``warmup_most``
        calls were made in all (see :data:`numbaconv.bench.ROW_WARMUP`).
    warmup_most : int
        The most warm-up calls in all.
    number : int, optional
        Calls per sample; by default enough for a sample to last ``min_sample`` seconds.
    min_sample : float
        Seconds one sample should at least last when ``number`` is not given.

    Returns
    -------
    Timing
    """
    if repeat < 1:
        raise ValueError(f"repeat: expected an int >= 1, got {repeat}")
    for _ in range(warmup):
        fn()
    made, start = warmup, time.perf_counter()
    while made < warmup_most and time.perf_counter() - start < warmup_for:
        fn()
        made += 1
    if number is None:
        number = _autonumber(fn, min_sample)
    with collector_off():
        samples = [per_call(fn, number) for _ in range(repeat)]
    return Timing(statistics.median(samples), min(samples), repeat, number)


def geometric_mean(values: Iterable[float]) -> Optional[float]:
    """The geometric mean of the positive finite ``values``; None when there are none."""
    logs = [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def format_seconds(seconds: Optional[float]) -> str:
    """A time with a unit that keeps three significant digits readable."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"
