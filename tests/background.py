"""Checks that run in a fresh interpreter beside the rest of the suite.

A few tests spend minutes in a subprocess of their own, compiling every kernel afresh
(NUMBA_BOUNDSCHECK, another vector width), simulating the CUDA kernels in pure Python or
compiling them for real GPUs, on one core, while the rest of the suite also runs on one core
most of the time: CI has two. So such a test declares its subprocess at import as a
:class:`Command` and carries its ``mark``; when the session has collected its tests,
conftest.py starts the collected tests' commands one after another on a thread of their own
(:func:`start`) and moves those tests to the end of the session, where each waits for its
command's result (or runs the command then, if its turn has not come: at most two at once).
The wall time of each is in the session's summary.

The rest of the suite then runs beside one busy process: conftest.py sets
``NUMBACONV_ADAPT_THREADS=0`` so that its calls keep their threads (tests of the busy-machine
adaptation set the variable themselves).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

#: Every command declared so far, by name (declaration order).
COMMANDS: dict = {}


@dataclass
class Done:
    """A finished command: its exit status (None: killed at its timeout) and output."""

    returncode: Optional[int]
    stdout: str
    stderr: str
    timeout: float
    seconds: float = 0.0

    def check(self, marker: str = "ok") -> None:
        """Assert that the command ended by itself, with status 0, having printed
        ``marker`` as its last line."""
        assert self.returncode is not None, \
            f"took more than {self.timeout:.0f} s; output: {self.stdout[-2000:]}"
        assert self.returncode == 0, self.stdout[-6000:] + self.stderr[-3000:]
        lines = self.stdout.strip().splitlines()
        assert lines and lines[-1].strip() == marker, self.stdout[-3000:] + self.stderr[-3000:]


class Command:
    """A subprocess check; ``mark`` puts it on the tests that wait for its :meth:`result`.

    ``argv`` after the interpreter; ``env`` updates the session's environment (read when
    the command starts); ``timeout`` in seconds; ``first``: started before the others (the
    longest runs, so that none is left alone at the end of the session); ``enabled`` False:
    never started in the background (its tests skip); ``replaces``: test files that the
    command runs (a pytest run of them), left out of a session that collects the tests
    waiting for it (run on their own, they run in the session)."""

    def __init__(self, name: str, argv: list, env: Optional[dict] = None,
                 timeout: float = 900, first: bool = False, enabled: bool = True,
                 replaces: tuple = ()):
        if name in COMMANDS:
            raise ValueError(f"a background command named {name!r} exists already")
        self.name, self.argv, self.env = name, list(argv), dict(env or {})
        self.timeout, self.first, self.enabled = timeout, first, enabled
        self.replaces = tuple(os.path.abspath(path) for path in replaces)
        self.mark = pytest.mark.background(name)
        self._lock = threading.Lock()
        self._claimed = False
        self._done = threading.Event()
        self._result: Optional[Done] = None
        self._process: Optional[subprocess.Popen] = None
        COMMANDS[name] = self

    def _claim(self) -> bool:
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def _run(self) -> None:
        env = dict(os.environ, **self.env)
        started = time.monotonic()
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            try:
                self._process = subprocess.Popen([sys.executable, *self.argv], env=env,
                                                 stdout=out, stderr=err)
                try:
                    returncode = self._process.wait(timeout=self.timeout)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
                    returncode = None
                out.seek(0)
                err.seek(0)
                self._result = Done(returncode, out.read(), err.read(), self.timeout,
                                    time.monotonic() - started)
            finally:
                self._done.set()

    def result(self) -> Done:
        """The command's result: waited for, or run now if it has not started."""
        if self._claim():
            self._run()
        self._done.wait()
        if self._result is None:
            pytest.fail(f"the background command {self.name!r} could not start")
        return self._result

    def kill(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()


def python_code(name: str, code: str, env: Optional[dict] = None, **options) -> Command:
    """A :class:`Command` running ``code`` with this folder importable; it should print
    ``ok`` last (see :meth:`Done.check`)."""
    script = f"import sys; sys.path.insert(0, {HERE!r})\n{code}"
    return Command(name, ["-c", script], env, **options)


def boundscheck(name: str, code: str, **options) -> Command:
    """``code`` in a fresh interpreter whose kernels are compiled with NUMBA_BOUNDSCHECK=1
    (the cpu kernels' out-of-bounds check; no disk cache, so that every kernel compiles so);
    it prints ``ok`` when ``code`` has run without error."""
    return python_code(name, code + "\nprint('ok')\n",
                       dict(NUMBA_BOUNDSCHECK="1", NUMBACONV_JIT_CACHE="0"), **options)


_stopping = threading.Event()


def start(names: list) -> None:
    """Run the commands ``names`` one after another on a daemon thread (``first`` ones
    first), each unless a test has claimed it meanwhile."""
    commands = sorted((COMMANDS[name] for name in names if COMMANDS[name].enabled),
                      key=lambda c: not c.first)

    def work():
        for command in commands:
            if _stopping.is_set():
                return
            if command._claim():
                command._run()

    threading.Thread(target=work, name="background checks", daemon=True).start()


def report() -> list:
    """A line for each command that has finished: its wall time and how it ended."""
    lines = []
    for command in COMMANDS.values():
        done = command._result
        if done is not None:
            ended = "timed out" if done.returncode is None else f"exit {done.returncode}"
            lines.append(f"{done.seconds:7.1f} s  {command.name} ({ended})")
    return lines


def stop() -> None:
    """Start no more commands, and kill the running ones (the session is over)."""
    _stopping.set()
    for command in COMMANDS.values():
        command.kill()
