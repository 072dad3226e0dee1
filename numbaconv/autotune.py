"""The autotuner and its on-disk cache: times every algorithm of the chosen backend once per
problem and remembers the fastest, in memory and in one JSON file shared by the user's
processes.

The dispatcher (:mod:`numbaconv.dispatch`) asks :data:`_autotune` whether tuning is on and
hands it each new choice; :func:`numbaconv.set_autotune` is the public switch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import platform
import sys
import tempfile
import threading
import time
from typing import Optional

from ._operands import random_operands
from .backend import Choice
from .config import environ_value

# The dispatcher's logger: tuning is part of what it reports on each choice.
log = logging.getLogger("numbaconv.dispatch")

# The cache is one JSON file, ``{"format": ..., "version": 1, "entries": {key: record}}``,
# shared by every process of the user. Writers take an exclusive lock on a sidecar
# ``.lock`` file, re-read the file under it, add their entry and replace the file atomically
# (a temporary file renamed over it), so concurrent processes lose no entry and readers,
# which take no lock, never see a half-written file. Anything unreadable is ignored with a
# warning and replaced on the next write: a cache may cost time, never an exception.

try:  # POSIX advisory locks; Windows has msvcrt's byte-range locks instead
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - not on POSIX
    _fcntl = None
try:
    import msvcrt as _msvcrt
except ImportError:
    _msvcrt = None

#: Bumped whenever the key's fields or the records' meaning change, so that an older or
#: newer numbaconv sharing the cache directory never reads the other's entries as its own.
AUTOTUNE_KEY_VERSION = 2

#: The ``format`` field of the cache file: tells it apart from any other JSON file.
AUTOTUNE_FORMAT = "numbaconv autotune cache"


def default_cache_dir() -> str:
    """``NUMBACONV_CACHE_DIR``, else the platform's user cache directory + ``numbaconv``.

    Returns
    -------
    str
        ``$XDG_CACHE_HOME/numbaconv`` or ``~/.cache/numbaconv`` on Linux and other POSIX
        systems, ``~/Library/Caches/numbaconv`` on macOS, ``%LOCALAPPDATA%\\numbaconv`` on
        Windows. ``~`` in ``NUMBACONV_CACHE_DIR`` is expanded.
    """
    from .config import user_cache_dir
    return user_cache_dir()


def cpu_model() -> str:
    """The CPU's name where the OS tells it cheaply (platform.processor() is often empty)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@contextlib.contextmanager
def _file_lock(path: str, timeout: float):
    """Hold an exclusive lock on the file ``path`` (created if missing) for a ``with`` block.

    Polls a non-blocking lock so that a process stuck while holding it costs the others
    ``timeout`` seconds, not a hang; then raises TimeoutError. Without fcntl or msvcrt the
    block runs unlocked (atomic replacement still keeps the file whole).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if _fcntl is not None:
                    _fcntl.flock(fd, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
                elif _msvcrt is not None:  # pragma: no cover - Windows
                    _msvcrt.locking(fd, _msvcrt.LK_NBLCK, 1)
                break
            except OSError:  # BlockingIOError on POSIX, PermissionError on Windows
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"another process has held {path} for over "
                                       f"{timeout:g} s") from None
                time.sleep(0.005)
        try:
            yield
        finally:
            if _fcntl is not None:
                _fcntl.flock(fd, _fcntl.LOCK_UN)
            elif _msvcrt is not None:  # pragma: no cover - Windows
                os.lseek(fd, 0, os.SEEK_SET)
                _msvcrt.locking(fd, _msvcrt.LK_UNLCK, 1)
    finally:
        os.close(fd)


def _write_atomically(path: str, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file renamed over it.

    Readers see the old file or the new one, never a partial write; the temporary file is
    removed if anything fails.
    """
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())  # the rename must not reach the disk before the data
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class _Autotuner:
    """Times every algorithm of the chosen backend once per problem; remembers the fastest.

    Each candidate runs once untimed (compilation, first touch of workspaces), then is timed
    up to :attr:`REPEAT` times (its best counts). The heuristic's choice is replaced only
    when another algorithm beats it by more than :attr:`MARGIN`, so that timing noise does
    not swap a sound choice for an equal one. Results are kept in memory and in the cache
    file :attr:`FILE` under :func:`default_cache_dir`, keyed by :meth:`cache_key`.
    """

    FILE = "autotune-v1.json"
    #: Relative lead another algorithm needs over the heuristic's choice to replace it.
    MARGIN = 0.05
    #: Timed runs per algorithm, after the warm-up run.
    REPEAT = 3
    #: Seconds of timed runs per algorithm after which no further run is made.
    BUDGET = 0.25
    #: Seconds a writer waits for another process's lock on the cache file before giving up.
    LOCK_TIMEOUT = 10.0

    def __init__(self):
        self._forced: Optional[bool] = None
        self._memory: dict = {}
        self._lock = threading.RLock()
        self._warned: set = set()  # (path, file state) already reported as unreadable

    def enabled(self) -> bool:
        if self._forced is not None:
            return self._forced
        raw = environ_value("NUMBACONV_AUTOTUNE").strip()
        if raw in ("", "0"):
            return False
        if raw == "1":
            return True
        raise ValueError(f"NUMBACONV_AUTOTUNE: expected '0' or '1', got {raw!r}")

    def set(self, enabled: bool) -> None:
        """Override ``NUMBACONV_AUTOTUNE``; the dispatcher forgets its cached choices."""
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled: expected True or False, got {enabled!r}")
        self._forced = enabled

    def path(self) -> str:
        """Where the cache file is (honours ``NUMBACONV_CACHE_DIR`` at each call)."""
        return os.path.join(default_cache_dir(), self.FILE)

    # --- the key -------------------------------------------------------------------------

    def cache_key(self, backend, op: str, problem) -> str:
        """The cache key of ``op`` on ``problem`` run by ``backend`` in this process.

        ``k<AUTOTUNE_KEY_VERSION>|<backend>@<its version>|<device>|threads=<n>|<op>|<problem
        key>``: a timing holds only for the same code, on the same hardware, with as many
        threads. The op is spelled out apart from the problem's own key, whose format belongs
        to the problem classes.
        """
        return (f"k{AUTOTUNE_KEY_VERSION}|{backend.name}@{getattr(backend, 'version', '0')}"
                f"|{self._device(backend)}|threads={self._threads(backend)}|{op}"
                f"|{problem.key()}")

    @staticmethod
    def _device(backend) -> str:
        """The hardware a backend runs on: its own description, else what we can tell."""
        describe = getattr(backend, "device_description", None)
        if callable(describe):
            try:
                return str(describe())
            except Exception:  # a plugin's description failing must not break tuning
                pass
        if backend.device == "cpu":
            return f"cpu:{platform.machine()}:{cpu_model()}"
        cuda = sys.modules.get("numba.cuda")  # imported by then: a CUDA call is running
        if cuda is not None:
            try:
                name = cuda.get_current_device().name
                return f"cuda:{name.decode() if isinstance(name, bytes) else name}"
            except Exception:
                pass
        return str(backend.device)

    @staticmethod
    def _threads(backend) -> int:
        """Threads the backend computes with: its own count, else Numba's, else the CPUs."""
        count = getattr(backend, "num_threads", None)
        if callable(count):
            try:
                return int(count())
            except Exception:
                pass
        numba = sys.modules.get("numba")
        if numba is not None:
            # get_num_threads() would start Numba's thread pool, before numbaconv's kernel
            # modules set OMP_WAIT_POLICY; until the pool runs, the configured count holds.
            parallel = sys.modules.get("numba.np.ufunc.parallel")
            if parallel is not None and getattr(parallel, "_is_initialized", False):
                return int(numba.get_num_threads())
            return int(numba.config.NUMBA_NUM_THREADS)
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            return os.cpu_count() or 1

    # --- the file ------------------------------------------------------------------------

    def _warn_unreadable(self, path: str, why: str) -> None:
        try:
            st = os.stat(path)
            state = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            state = None
        if (path, state) in self._warned:  # the same bad file, seen again before a rewrite
            return
        self._warned.add((path, state))
        log.warning("numbaconv: ignoring the autotune cache %s (%s); it will be rewritten",
                    path, why)

    def _load(self, path: Optional[str] = None) -> dict:
        """The entries of the cache file; ``{}`` (with a warning) if it is unusable."""
        path = path or self.path()
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            # RecursionError: nesting deeper than the JSON decoder's recursion limit.
            self._warn_unreadable(path, f"not readable as JSON: {type(exc).__name__}: {exc}")
            return {}
        if not isinstance(data, dict) or data.get("format", AUTOTUNE_FORMAT) != \
                AUTOTUNE_FORMAT or data.get("version") != 1 or \
                not isinstance(data.get("entries"), dict):
            self._warn_unreadable(path, "not a numbaconv autotune cache of version 1")
            return {}
        entries = data["entries"]
        bad = [k for k, record in entries.items() if not _valid_record(record)]
        if bad:
            self._warn_unreadable(path, f"{len(bad)} malformed entr"
                                        f"{'y' if len(bad) == 1 else 'ies'}")
            entries = {k: v for k, v in entries.items() if k not in bad}
        return entries

    def _save(self, key: str, record: dict) -> bool:
        """Add one entry to the cache file; False (with a warning) if it cannot be written.

        Under the lock, the file is read again, so that entries other processes wrote since
        this one last read it are kept.
        """
        path = self.path()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with _file_lock(path + ".lock", self.LOCK_TIMEOUT):
                entries = self._load(path)
                entries[key] = record
                _write_atomically(path, {"format": AUTOTUNE_FORMAT, "version": 1,
                                         "entries": entries})
        except (OSError, TimeoutError) as exc:
            log.warning("numbaconv: could not write the autotune cache %s (%s); the result "
                        "is kept in memory for this process", path, exc)
            return False
        return True

    # --- tuning --------------------------------------------------------------------------

    def tune(self, op: str, problem, choice: Choice, backend) -> Choice:
        """``choice`` with the algorithm autotuning picks (from memory, disk or timing now);
        ``backend`` is the backend object ``choice`` names."""
        try:
            algorithms = list(backend.algorithms(op, problem)) if hasattr(
                backend, "algorithms") else [choice.algorithm]
        except Exception as exc:  # a plugin bug costs the tuning, not the call
            log.warning("numbaconv: not autotuning %s on %r: algorithms() raised %s: %s", op,
                        choice.backend, type(exc).__name__, exc)
            return choice
        if len(algorithms) < 2:
            return choice
        key = self.cache_key(backend, op, problem)
        with self._lock:
            record, source = self._memory.get(key), "remembered in this process"
            if record is None:
                record, source = self._load().get(key), f"read from {self.path()}"
            if record is None or record["algorithm"] not in algorithms:
                record = self._measure(backend, op, problem, algorithms, choice.algorithm)
                if record is None:
                    return choice
                saved = self._save(key, record)
                source = "timed now" + ("" if saved else "; the cache file could not be "
                                                         "written")
            self._memory[key] = record
        return Choice(choice.backend, record["algorithm"],
                      f"autotuned ({source}): {_verdict(record)}; the heuristic's reason "
                      f"for {choice.algorithm!r}: {choice.reason}", choice.rejected)

    def _measure(self, backend, op, problem, algorithms, heuristic) -> Optional[dict]:
        """Time each algorithm and pick one; None when the problem cannot be timed here."""
        try:
            # Accumulating into scratch output would be wasted work; the user's out is never
            # touched either way (timing runs get out=None).
            scratch = dataclasses.replace(problem, accumulate=False) if any(
                f.name == "accumulate" for f in dataclasses.fields(problem)) else problem
            operands = random_operands(op, scratch)
        except Exception as exc:  # an op or problem the tuner cannot feed: the heuristic
            log.warning("numbaconv: not autotuning %s: cannot make operands: %s: %s", op,
                        type(exc).__name__, exc)
            return None
        sync = _synchronizer(problem)
        times, errors = {}, {}
        for algorithm in algorithms:
            try:
                times[algorithm] = self._time(backend, op, scratch, operands, algorithm, sync)
            except Exception as exc:  # a broken candidate is skipped, not fatal
                errors[algorithm] = f"{type(exc).__name__}: {exc}"
                log.warning("numbaconv: autotuning %s: algorithm %r of %r failed: %s", op,
                            algorithm, backend.name, errors[algorithm])
        if not times:
            return None
        fastest = min(times, key=times.get)
        chosen = fastest
        if heuristic in times and times[fastest] > times[heuristic] * (1 - self.MARGIN):
            chosen = heuristic  # within the noise: the heuristic's reasons stand
        return {"algorithm": chosen, "times": times, "heuristic": heuristic,
                "margin": self.MARGIN, "errors": errors,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def _time(self, backend, op, problem, operands, algorithm, sync) -> float:
        """Best of up to REPEAT timed runs of one algorithm, after one untimed run."""
        backend.run(op, problem, operands, None, algorithm)  # warm-up: compiles, not timed
        sync()
        best, spent = float("inf"), 0.0
        for _ in range(self.REPEAT):
            start = time.perf_counter()
            backend.run(op, problem, operands, None, algorithm)
            sync()
            elapsed = time.perf_counter() - start
            best, spent = min(best, elapsed), spent + elapsed
            if spent >= self.BUDGET:  # slow problems: one or two samples are plenty
                break
        return best


def _valid_record(record) -> bool:
    """Whether a cache entry has the shape :meth:`_Autotuner.tune` relies on."""
    if not isinstance(record, dict) or not isinstance(record.get("algorithm"), str):
        return False
    times = record.get("times")
    return isinstance(times, dict) and all(
        isinstance(t, (int, float)) and not isinstance(t, bool) for t in times.values())


def _verdict(record: dict) -> str:
    times = ", ".join(f"{a} {t * 1e3:.3f} ms" for a, t in sorted(
        record["times"].items(), key=lambda kv: kv[1]))
    chosen, heuristic = record["algorithm"], record.get("heuristic")
    fastest = min(record["times"], key=record["times"].get) if record["times"] else chosen
    if heuristic is None or chosen != heuristic:
        what = f"{chosen!r} was fastest"
    elif fastest != chosen:
        what = (f"kept the heuristic's {chosen!r}: {fastest!r} was faster by less than the "
                f"{record.get('margin', _Autotuner.MARGIN):.0%} noise margin")
    else:
        what = f"the heuristic's {chosen!r} was fastest"
    return f"{what} ({times})"


def _synchronizer(problem):
    """A callable waiting for the device's queued work, so that GPU timings are complete."""
    if getattr(problem, "device", "cpu") == "cuda":
        from numba import cuda
        return cuda.synchronize
    return lambda: None


_autotune = _Autotuner()
