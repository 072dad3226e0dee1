"""Running a measurement in a fresh interpreter: the child runs a short script with a JSON
spec as its argument and prints JSON objects, one a line, which the parent reads as they come.

An engine timed in a process of its own loads only its own libraries, as its users' programs
do: no other library's thread pool spins beside it. The convolution table
(:func:`numbaconv.bench.run_benchmarks`) and the recurrent suite (:mod:`numbaconv.bench_rnn`)
both run their engines through :func:`child_messages`.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from typing import Iterator, Optional


class ChildFailed(RuntimeError):
    """The child exited with an error, or printed nothing for longer than its timeout."""


def child_environment(env: Optional[dict] = None) -> dict:
    """``env`` (this process's environment by default) with the directory this numbaconv was
    imported from first on ``PYTHONPATH``, so that the child imports the same numbaconv."""
    env = dict(os.environ if env is None else env)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def child_messages(script: str, spec: dict, *, timeout: Optional[float] = None,
                   env: Optional[dict] = None) -> Iterator[dict]:
    """Run ``python -c script json.dumps(spec)`` and yield each JSON object the child prints
    on a line of its own, as soon as it is printed (other lines are ignored).

    Parameters
    ----------
    script : str
        Python code; it reads the spec from ``sys.argv[1]`` and prints one JSON object per
        line, flushing each.
    spec : dict
        JSON-serialisable.
    timeout : float, optional
        Seconds the child may go without printing an object; None waits for ever.
    env : dict, optional
        The child's environment (:func:`child_environment` of it); this process's by default.

    Raises
    ------
    ChildFailed
        When the child exits with a non-zero status (the message ends with its stderr) or
        prints nothing for ``timeout`` seconds (it is killed). The objects printed before
        have been yielded.
    """
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", script, json.dumps(spec)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env=child_environment(env))
        lines: queue.Queue = queue.Queue()

        def read():  # a thread, so that the wait for a line can time out
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            while True:
                try:
                    line = lines.get(timeout=timeout)
                except queue.Empty:
                    raise ChildFailed(f"no answer within {timeout:g} s") from None
                if line is None:
                    break
                message = _json_object(line)
                if message is not None:
                    yield message
            status = proc.wait()
            if status != 0:
                stderr.seek(0)
                tail = stderr.read().strip()[-2000:]
                raise ChildFailed(f"exit status {status}" + (f": {tail}" if tail else ""))
        finally:  # also when the caller stops reading early
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            reader.join(timeout=5)
            if not reader.is_alive():
                proc.stdout.close()


def print_message(message: dict) -> None:
    """In the child: print ``message`` for :func:`child_messages`, at once."""
    print(json.dumps(message), flush=True)


def _json_object(line: str) -> Optional[dict]:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None
