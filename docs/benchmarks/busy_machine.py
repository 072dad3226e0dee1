"""numbaconv on a busy machine: each row with the default thread count against the same row
on one thread, both beside one busy-looping process (issue 25's target: no row slower).

    python docs/benchmarks/busy_machine.py [--runs 3] [--json FILE]

Each run starts a process that spins on one core, then times ``numbaconv bench --quick
--backend cpu --no-torch`` (the conv rows) and ``numbaconv bench --suite rnn --quick
--no-torch`` (the training steps) twice, with the default threads and with ``--threads 1``,
and prints per run the rows where the default was slower, and the worst ratio. Run it with
OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, as every comparison of speeds.
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
    """{row: (default seconds, one-thread seconds)} beside a busy-looping process."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1)
        result = {}
        for name, arguments in BENCHES.items():
            default = _bench(arguments)
            single = _bench(arguments + ["--threads", "1"])
            for row in default.keys() & single.keys():
                result[f"{name}: {row}"] = (default[row], single[row])
        return result
    finally:
        spinner.kill()
        spinner.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="write every run's rows here")
    args = parser.parse_args(argv)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{time.strftime('%Y-%m-%d %H:%M')}; one busy-looping process beside each bench")
    runs = []
    for run in range(args.runs):
        rows = one_run()
        runs.append(rows)
        slower = {row: d / s for row, (d, s) in rows.items() if d > s}
        beyond = [row for row, ratio in slower.items() if ratio > NOISE]
        worst = max(rows.items(), key=lambda item: item[1][0] / item[1][1])
        mean = math.exp(sum(math.log(d / s) for d, s in rows.values()) / len(rows))
        print(f"run {run + 1}: {len(rows)} rows, {len(slower)} slower with the default "
              f"threads than with one, {len(beyond)} by more than {NOISE:g}x; geometric mean "
              f"default/one {mean:.2f}; worst {worst[0]}: {worst[1][0] * 1e3:.2f} ms "
              f"against {worst[1][1] * 1e3:.2f} ms ({worst[1][0] / worst[1][1]:.2f}x)")
        for row, ratio in sorted(slower.items(), key=lambda item: -item[1])[:10]:
            print(f"    {ratio:5.2f}x  {row}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([{row: list(times) for row, times in rows.items()} for rows in runs],
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
