"""Backend registry, entry-point discovery, per-call selection, explain and autotuning.

Discovery is lazy: the entry points of the group ``numbaconv.backends`` are read on the first
call that needs a backend (never at import), each factory is called once, and a backend whose
import or factory fails is remembered with its reason and skipped. Choices are cached per
(op, problem, active backend list), so repeated calls on the same shapes cost a dict lookup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import contextvars
import json
import logging
import os
import platform
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Optional

from .backend import Choice, NoBackendError
from .config import environ_value

log = logging.getLogger("numbaconv.dispatch")

ENTRY_POINT_GROUP = "numbaconv.backends"


@dataclass(frozen=True)
class BackendInfo:
    """One registered backend as :func:`backends` reports it."""

    name: str
    device: Optional[str]
    priority: Optional[int]
    available: bool
    reason: str


@dataclass
class _Entry:
    name: str
    source: str                      # "entry point <value>" or "registered in-process"
    load: object                     # zero-argument callable returning the backend
    backend: object = None
    error: Optional[str] = None      # import/initialisation failure
    unavailable: Optional[str] = None
    checked: bool = False            # availability() called

    def get(self):
        """The backend object, or None with ``error`` set (loads once)."""
        if self.backend is None and self.error is None:
            try:
                factory = self.load()
                backend = factory()
                for attr in ("name", "device", "priority", "supports", "run"):
                    if not hasattr(backend, attr):
                        raise TypeError(f"backend object has no attribute {attr!r}")
                if backend.name != self.name:
                    raise ValueError(f"backend calls itself {backend.name!r} but is "
                                     f"registered as {self.name!r}")
                if backend.device not in ("cpu", "cuda"):
                    raise ValueError(f"device must be 'cpu' or 'cuda', not "
                                     f"{backend.device!r}")
                self.backend = backend
            except Exception as exc:  # a broken plugin must never break numbaconv
                self.error = f"failed to load ({self.source}): {type(exc).__name__}: {exc}"
                log.warning("numbaconv backend %r skipped: %s", self.name, self.error)
        return self.backend

    def usable(self) -> Optional[str]:
        """None if the backend can run calls, else why not."""
        backend = self.get()
        if backend is None:
            return self.error
        if not self.checked:
            try:
                self.unavailable = backend.availability() if hasattr(
                    backend, "availability") else None
            except Exception as exc:
                self.unavailable = f"availability check failed: {type(exc).__name__}: {exc}"
            self.checked = True
        return self.unavailable


class _Registry:
    def __init__(self):
        self._lock = threading.RLock()
        self._entries: Optional[dict] = None
        self._extra: dict = {}
        self.choices: dict = {}

    def entries(self) -> dict:
        if self._entries is None:
            with self._lock:
                if self._entries is None:
                    self._entries = self._discover()
        return self._entries

    def _discover(self) -> dict:
        found = {}
        for ep in _entry_points():
            if ep.name in found:
                log.warning("numbaconv backend %r registered twice (%s and %s); keeping "
                            "the first", ep.name, found[ep.name].source, ep.value)
                continue
            found[ep.name] = _Entry(ep.name, f"entry point {ep.value}", ep.load)
        found.update(self._extra)
        return found

    def register(self, name: str, factory, replace: bool = False) -> None:
        with self._lock:
            entries = self.entries()
            if name in entries and not replace:
                raise ValueError(f"name: a backend called {name!r} is already registered")
            entry = _Entry(name, "registered in-process", lambda: factory)
            self._extra[name] = entry
            entries[name] = entry
            self.choices.clear()

    def unregister(self, name: str) -> None:
        with self._lock:
            self._extra.pop(name, None)
            self.entries().pop(name, None)
            self.choices.clear()

    def reset(self) -> None:
        """Forget everything discovered (tests; after installing a plugin at run time)."""
        with self._lock:
            self._entries = None
            self._extra.clear()
            self.choices.clear()


def _entry_points():
    return metadata.entry_points(group=ENTRY_POINT_GROUP)


_registry = _Registry()
_active: contextvars.ContextVar = contextvars.ContextVar("numbaconv_backends", default=None)
_env_cache: dict = {}


def register_backend(name: str, factory, *, replace: bool = False) -> None:
    """Register a backend in this process without an entry point (tests, notebooks).

    ``factory`` is a zero-argument callable returning the backend object.
    """
    _registry.register(name, factory, replace)


def unregister_backend(name: str) -> None:
    """Remove a backend registered with :func:`register_backend` (or discovered)."""
    _registry.unregister(name)


def reload_backends() -> None:
    """Discover the entry points again (after installing a plugin into a running process)."""
    _registry.reset()


def backends() -> list:
    """Every registered backend with its device, priority and availability.

    Returns
    -------
    list of BackendInfo
        Sorted by device, then descending priority. ``reason`` says why a backend is not
        available (import or initialisation failure, missing hardware) or ``"ok"``.
    """
    infos = []
    for entry in _registry.entries().values():
        why = entry.usable()
        backend = entry.backend
        infos.append(BackendInfo(
            entry.name,
            getattr(backend, "device", None),
            getattr(backend, "priority", None),
            why is None,
            why or "ok"))
    return sorted(infos, key=lambda i: (i.device or "~", -(i.priority or 0), i.name))


def get_backend(name: str):
    """The backend object registered as ``name`` (ValueError if unknown or broken)."""
    entries = _registry.entries()
    if name not in entries:
        raise ValueError(f"backend: expected one of {sorted(entries)}, got {name!r}")
    backend = entries[name].get()
    if backend is None:
        raise ValueError(f"backend: {name!r} is registered but {entries[name].error}")
    return backend


def _check_names(names, source: str) -> tuple:
    entries = _registry.entries()
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{source}: expected backend names (non-empty strings), got "
                            f"{name!r}")
        if name not in entries:
            raise ValueError(f"{source}: unknown backend {name!r}; expected one of "
                             f"{sorted(entries)}")
    return tuple(names)


@contextlib.contextmanager
def use_backend(*names: str):
    """Restrict dispatch to these backends, tried in this order, inside a ``with`` block.

    A problem none of them supports raises :class:`NoBackendError` saying why each declined;
    there is no silent fallback. Overrides ``NUMBACONV_BACKEND``. Nests; thread- and
    asyncio-safe (a context variable).

    Examples
    --------
    >>> with numbaconv.use_backend("reference"):
    ...     dx = numbaconv.conv_backward_data(dy, w, x.shape)
    """
    if not names:
        raise ValueError("names: expected at least one backend name, got none")
    token = _active.set(_check_names(names, "use_backend"))
    try:
        yield
    finally:
        _active.reset(token)


def _active_names() -> Optional[tuple]:
    names = _active.get()
    if names is not None:
        return names
    raw = environ_value("NUMBACONV_BACKEND")
    if not raw.strip():
        return None
    if raw not in _env_cache:
        parts = [p.strip() for p in raw.split(",")]
        if any(not p for p in parts):
            raise ValueError(f"NUMBACONV_BACKEND: expected comma-separated backend names, "
                             f"got {raw!r} (an empty name)")
        _env_cache.clear()
        _env_cache[raw] = _check_names(parts, "NUMBACONV_BACKEND")
    return _env_cache[raw]


def select(op: str, problem) -> Choice:
    """The backend and algorithm that will run ``op`` on ``problem`` (cached)."""
    active = _active_names()
    autotune = _autotune.enabled()
    key = (op, problem, active, autotune)
    choice = _registry.choices.get(key)
    cached = choice is not None
    if not cached:
        choice = _select(op, problem, active)
        if autotune:
            choice = _autotune.tune(op, problem, choice)
        _registry.choices[key] = choice
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s %s -> backend %r, algorithm %r (%s%s); rejected: %s", op,
                  problem.key(), choice.backend, choice.algorithm, choice.reason,
                  "; cached choice" if cached else "", choice.rejected or "none")
    return choice


def _select(op: str, problem, active: Optional[tuple]) -> Choice:
    entries = _registry.entries()
    if active is None:
        order = sorted(entries.values(), key=lambda e: (
            -(getattr(e.get(), "priority", 0) or 0), e.name))
    else:
        order = [entries[name] for name in active]
    rejected = {}
    for entry in order:
        backend = entry.get()
        if backend is None:
            rejected[entry.name] = entry.error
            continue
        if backend.device != problem.device:
            rejected[entry.name] = (f"runs on {backend.device}, the arrays are on "
                                    f"{problem.device}")
            continue
        why = entry.usable()
        if why is None:
            try:
                why = backend.supports(op, problem)
            except Exception as exc:
                why = f"supports() raised {type(exc).__name__}: {exc}"
        if why is not None:
            rejected[entry.name] = why
            continue
        try:
            algorithm, why_algo = backend.choose(op, problem) if hasattr(
                backend, "choose") else ("default", "the backend names no algorithms")
        except Exception as exc:
            rejected[entry.name] = f"choose() raised {type(exc).__name__}: {exc}"
            continue
        how = ("first supporting backend in " + ("use_backend/NUMBACONV_BACKEND order"
                                                  if active else "priority order"))
        return Choice(entry.name, algorithm, f"{how}; algorithm: {why_algo}", rejected)
    if not entries:
        raise NoBackendError("no numbaconv backends are registered: is numbaconv installed "
                             "(pip install -e .)? Entry points come from its metadata.")
    details = "; ".join(f"{name}: {why}" for name, why in rejected.items())
    scope = f"the backends {list(active)}" if active else "any registered backend"
    raise NoBackendError(f"{op}: no backend among {scope} supports {problem.key()} "
                         f"({details})")


def run(op: str, problem, operands: tuple, out=None):
    """Select a backend for ``op`` on ``problem`` and run it.

    An exception raised by the backend's ``run`` propagates as it is (same type, same
    traceback) with a note naming the backend, the algorithm and the problem; no other
    backend is tried, and ``out`` is left undefined (possibly partly written).
    """
    choice = select(op, problem)
    backend = _registry.entries()[choice.backend].backend
    try:
        return backend.run(op, problem, operands, out, choice.algorithm)
    except Exception as exc:  # not KeyboardInterrupt/SystemExit: those say nothing of ours
        _add_note(exc, f"numbaconv: raised by backend {choice.backend!r} (algorithm "
                       f"{choice.algorithm!r}) running {op} on {problem.key()}; no other "
                       f"backend was tried{'' if out is None else '; out= may be partly written'}")
        raise


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``; before Python 3.11, the note in ``__notes__`` (read by the
    exceptiongroup backport's traceback) and, where the exception's one argument is its
    message, appended to that message, so that the traceback shows it."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    try:
        notes = exc.__notes__ = list(getattr(exc, "__notes__", None) or ()) + [note]
        if len(exc.args) == 1 and isinstance(exc.args[0], str) and str(exc) == exc.args[0]:
            exc.args = (f"{exc.args[0]}\n{notes[-1]}",)
    except Exception:  # an exception type that refuses new attributes keeps its message
        pass


# --- autotuning ----------------------------------------------------------------------------
#
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
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled: expected True or False, got {enabled!r}")
        self._forced = enabled
        _registry.choices.clear()

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

    def tune(self, op: str, problem, choice: Choice) -> Choice:
        """``choice`` with the algorithm autotuning picks (from memory, disk or timing now)."""
        backend = _registry.entries()[choice.backend].backend
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
        from .testing import random_operands  # lazy: only autotuning needs it
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


def set_autotune(enabled: bool) -> None:
    """Time every candidate algorithm once per problem and remember the fastest.

    For each new problem, every algorithm the chosen backend offers runs once untimed (a
    warm-up, which pays for compilation) and is then timed; the heuristic's algorithm is
    replaced only by one faster by more than a 5% noise margin. The winner is kept in memory
    and in ``autotune-v1.json`` under ``NUMBACONV_CACHE_DIR`` (default: the user cache
    directory), keyed by a versioned key made of the problem, the backend and its version,
    the device and the thread count, so later processes reuse it without timing. Writes are
    atomic and locked, so concurrent processes lose no entry; an unreadable or foreign cache
    file is ignored with a warning and rewritten. :func:`explain` says when a choice came
    from the tuner. Timing runs use scratch arrays; the caller's ``out`` is never touched.

    Parameters
    ----------
    enabled : bool
        Overrides ``NUMBACONV_AUTOTUNE`` (``"1"`` turns autotuning on) for this process.

    Raises
    ------
    TypeError
        If ``enabled`` is not a bool.
    """
    _autotune.set(enabled)
