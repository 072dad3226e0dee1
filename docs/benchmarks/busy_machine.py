"""numbaconv on a busy machine: each row with the default thread count against the same row
on one thread, both beside one busy-looping process (issue 25's target: no row slower).

    python docs/benchmarks/busy_machine.py [--runs 3] [--json FILE]

Each run starts a process that spins on one core, then times ``numbaconv bench --quick
--backend cpu --no-torch`` (the conv rows) and ``numbaconv bench --suite rnn --quick
--no-torch`` (the training steps) three times: with ``--threads 1``, with the default
threads, and with ``--threads 1`` again. It prints per run the rows where the default was
slower than the faster of the two one-thread benches, and the worst ratio; and, as the
control, the same count for the two one-thread benches against each other: what the host's
noise alone makes of the same configuration timed twice. Run it with OPENBLAS_CORETYPE and
OPENBLAS_L2_SIZE unset, as every comparison of speeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

#: The quick rows, each a median of REPEAT calls: calls of 0.1-1 ms beside a busy-looping
#: process have tails of milliseconds (a time slice), which the quick bench's median of
#: three calls often picks up.
REPEAT = 21
BENCHES = {
    "conv": ["--quick", "--repeat", str(REPEAT), "--backend", "cpu", "--no-torch"],
    "rnn": ["--suite", "rnn", "--quick", "--repeat", str(REPEAT), "--no-torch"],
}

#: Ratios up to this are counted apart as noise (medians on a machine that a busy-looping
#: process shares).
NOISE = 1.2

#: Fields that name a conv row (the rest are its measurements).
NAME_FIELDS = ("shape", "op", "layout", "dtype")


def _rows(record: dict) -> dict:
    timed = {}
    for row in record.get("results") or []:             # conv: a row per backend
        if row.get("median_s") is not None and row.get("backend") == "cpu":
            timed[" ".join(str(row[f]) for f in NAME_FIELDS if f in row)] = row["median_s"]
    for row in record.get("rows") or []:                # rnn: a column per engine
        if row.get("cpu_s") is not None:
            timed[row["case"]] = row["cpu_s"]
    return timed


def _bench(arguments: list) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "bench.json")
        subprocess.run([sys.executable, "-m", "numbaconv", "bench", *arguments,
                        "--no-progress", "--json", path], check=True,
                       stdout=subprocess.DEVNULL)
        with open(path, encoding="utf-8") as f:
            return _rows(json.load(f))


def one_run() -> dict:
    """{row: (default seconds, one-thread seconds, one-thread seconds again)} beside a
    busy-looping process."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1)
        result = {}
        for name, arguments in BENCHES.items():
            single = _bench(arguments + ["--threads", "1"])
            default = _bench(arguments)
            again = _bench(arguments + ["--threads", "1"])
            for row in default.keys() & single.keys() & again.keys():
                result[f"{name}: {row}"] = (default[row], single[row], again[row])
        return result
    finally:
        spinner.kill()
        spinner.wait()


def _summary(ratios: dict) -> str:
    """Counts and geometric mean of {row: ratio}."""
    slower = sum(ratio > 1 for ratio in ratios.values())
    beyond = sum(ratio > NOISE for ratio in ratios.values())
    mean = math.exp(sum(math.log(ratio) for ratio in ratios.values()) / len(ratios))
    return (f"{slower} slower, {beyond} by more than {NOISE:g}x, geometric mean "
            f"{mean:.2f}, worst {max(ratios.values()):.2f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="write every run's rows here: [default, one thread, "
                        "one thread again] seconds")
    args = parser.parse_args(argv)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{time.strftime('%Y-%m-%d %H:%M')}; one busy-looping process beside each bench")
    runs = []
    for run in range(args.runs):
        rows = one_run()
        runs.append(rows)
        default = {row: d / min(s, a) for row, (d, s, a) in rows.items()}
        control = {row: max(s, a) / min(s, a) for row, (d, s, a) in rows.items()}
        print(f"run {run + 1}, {len(rows)} rows:\n"
              f"  default threads / the faster one-thread bench: {_summary(default)}\n"
              f"  control, the slower one-thread bench / the faster: {_summary(control)}")
        for row, ratio in sorted(default.items(), key=lambda item: -item[1])[:10]:
            if ratio > 1:
                d, s, a = rows[row]
                print(f"    {ratio:5.2f}x  {row}: {d * 1e3:.3f} ms against {s * 1e3:.3f} "
                      f"and {a * 1e3:.3f} ms")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([{row: list(times) for row, times in rows.items()} for rows in runs],
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
