"""numbaconv on a busy machine: each row with the default thread count against the same row
on one thread, both beside one busy-looping process (issue 25's target: no row slower).

    python docs/benchmarks/busy_machine.py [--runs 3] [--blocks 16] [--json FILE]

The rows are ``numbaconv bench --quick``'s conv calls (every op, both layouts) and recurrent
training steps (forward with reserve, data and weight gradients): the quick suite's and the
issue's LSTM (T=50, N=16, H=256). Each row is timed in four settings, in one process:

- ``default``: numbaconv as it comes (it reads the load and picks the threads per call);
- ``one``: Numba's threads and NumPy's BLAS set to one, as ``bench --threads 1`` does;
- ``again``: the same as ``one``, the control;
- ``fixed``: the default threads kept whatever the load (``NUMBACONV_ADAPT_THREADS=0``):
  what adapting saves.

The settings take turns in blocks of a few calls, their order rotated from block to block,
and each row's time in a setting is the median of all its calls. Timing the settings in
separate processes minutes apart (as this script did first) could not tell a 10 % effect
from the host's drift, which moved the same setting timed twice by 16-27 % on average;
taking turns every few milliseconds puts the drift into every setting alike. ``again``
against ``one`` shows what is left of the noise.

Run it with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, as every comparison of speeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

#: Calls per setting in a block: about a millisecond of work on the quick rows, short beside
#: the host's drift (seconds to minutes), long beside switching the setting (microseconds).
CALLS = 7

#: Ratios up to this are counted apart as noise.
NOISE = 1.1

SETTINGS = ("default", "one", "again", "fixed")


def _rows():
    """[(name, callable)]: the quick conv calls and the recurrent training steps."""
    from numbaconv import bench_cases
    from numbaconv.bench_cases import QUICK_SHAPES, RNNCase
    from numbaconv.bench_rnn import QUICK_RNN_SHAPES, TrainingStep
    from numbaconv.problem import CONV_OPS
    rows = []
    for case in QUICK_SHAPES:
        for layout in ("channels_first", "channels_last"):
            for op in CONV_OPS:
                call = bench_cases.make_call(op, case, layout)
                rows.append((f"{case.name} {op} {layout}", call))
    issue_case = RNNCase("lstm_T50_N16_256", "lstm", 50, 16, 256, 256)
    for case in QUICK_RNN_SHAPES + (issue_case,):
        rows.append((f"{case.name} training step", TrainingStep(case)))
    return rows


class _Setting:
    """Entering it gives the calling thread the setting's threads; leaving restores them."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        import numba
        from numbaconv.bench_machine import blas_limits
        self.threads = numba.get_num_threads()
        self.limits = None
        self.adapt = os.environ.get("NUMBACONV_ADAPT_THREADS")
        if self.name == "fixed":
            os.environ["NUMBACONV_ADAPT_THREADS"] = "0"
        elif self.name != "default":
            numba.set_num_threads(1)
            self.limits = blas_limits(1)
            self.limits.__enter__()
        return self

    def __exit__(self, *exc_info):
        import numba
        if self.limits is not None:
            self.limits.__exit__(*exc_info)
        numba.set_num_threads(self.threads)
        if self.adapt is None:
            os.environ.pop("NUMBACONV_ADAPT_THREADS", None)
        else:
            os.environ["NUMBACONV_ADAPT_THREADS"] = self.adapt


def time_row(call, blocks: int) -> dict:
    """{setting: median seconds of a call}, the settings taking turns in ``blocks`` blocks of
    :data:`CALLS` calls."""
    times = {name: [] for name in SETTINGS}
    for name in SETTINGS:                       # compiled, caches and workspaces warm
        with _Setting(name):
            call()
    for block in range(blocks):
        shift = block % len(SETTINGS)
        for name in SETTINGS[shift:] + SETTINGS[:shift]:
            with _Setting(name):
                for _ in range(CALLS):
                    start = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def one_run(rows, blocks: int) -> dict:
    """{row: {setting: seconds}} beside a busy-looping process."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1)       # the load monitor sees the spinner from its next reading
        return {name: time_row(call, blocks) for name, call in rows}
    finally:
        spinner.kill()
        spinner.wait()


def _summary(ratios: dict) -> str:
    """Counts and geometric mean of {row: ratio}."""
    slower = sum(ratio > 1 for ratio in ratios.values())
    beyond = sum(ratio > NOISE for ratio in ratios.values())
    mean = math.exp(sum(math.log(ratio) for ratio in ratios.values()) / len(ratios))
    return (f"{slower} slower, {beyond} by more than {NOISE:g}x, geometric mean "
            f"{mean:.3f}, worst {max(ratios.values()):.2f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=16,
                        help="blocks per row and setting (default 16)")
    parser.add_argument("--json", help="write every run's rows here: {setting: seconds}")
    args = parser.parse_args(argv)
    from numbaconv.config import jit_options
    jit_options()           # numbaconv's threading set-up before anything starts Numba's threads
    from numbaconv.bench_machine import environment
    env = environment()
    print(f"{env.get('processor') or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{time.strftime('%Y-%m-%d %H:%M')}; one busy-looping process beside each run; "
          f"{CALLS} calls x {args.blocks} blocks per row and setting")
    rows = _rows()
    runs = []
    for run in range(args.runs):
        timed = one_run(rows, args.blocks)
        runs.append(timed)
        one = {row: math.sqrt(t["one"] * t["again"]) for row, t in timed.items()}
        default = {row: t["default"] / one[row] for row, t in timed.items()}
        control = {row: t["again"] / t["one"] for row, t in timed.items()}
        fixed = {row: t["fixed"] / one[row] for row, t in timed.items()}
        print(f"run {run + 1}, {len(timed)} rows:\n"
              f"  default / one thread (geometric mean of one and again): "
              f"{_summary(default)}\n"
              f"  control, again / one: {_summary(control)}\n"
              f"  fixed threads / one thread: {_summary(fixed)}")
        for row, ratio in sorted(default.items(), key=lambda item: -item[1])[:8]:
            if ratio > 1:
                t = timed[row]
                print(f"    {ratio:5.2f}x  {row}: {t['default'] * 1e3:.3f} ms against "
                      f"{t['one'] * 1e3:.3f} and {t['again'] * 1e3:.3f} ms (fixed "
                      f"{t['fixed'] * 1e3:.3f} ms)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"environment": env, "calls": CALLS, "blocks": args.blocks,
                       "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
