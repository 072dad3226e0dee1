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
from dataclasses import dataclass, field
from importlib import metadata
from typing import Optional

from .problem import OPS

log = logging.getLogger("numbaconv.dispatch")

ENTRY_POINT_GROUP = "numbaconv.backends"


class NoBackendError(RuntimeError):
    """No backend among the candidates supports the problem; the message says why each declined."""


@dataclass(frozen=True)
class BackendInfo:
    """One registered backend as :func:`backends` reports it."""

    name: str
    device: Optional[str]
    priority: Optional[int]
    available: bool
    reason: str


@dataclass(frozen=True)
class Choice:
    """What the dispatcher picked for one call, and why the others were not picked."""

    backend: str
    algorithm: str
    reason: str
    rejected: dict = field(default_factory=dict)


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
    raw = os.environ.get("NUMBACONV_BACKEND", "")
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
    """Select a backend for ``op`` on ``problem`` and run it."""
    choice = select(op, problem)
    backend = _registry.entries()[choice.backend].backend
    return backend.run(op, problem, operands, out, choice.algorithm)


# --- autotuning ----------------------------------------------------------------------------

def default_cache_dir() -> str:
    """``NUMBACONV_CACHE_DIR``, else the platform's user cache directory + ``numbaconv``."""
    env = os.environ.get("NUMBACONV_CACHE_DIR")
    if env:
        return env
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or os.path.expanduser("~\\AppData\\Local")
    elif sys.platform == "darwin":
        base = os.path.expanduser("~/Library/Caches")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "numbaconv")


class _Autotuner:
    """Times every algorithm of the chosen backend once per problem; remembers the fastest."""

    FILE = "autotune-v1.json"

    def __init__(self):
        self._forced: Optional[bool] = None
        self._memory: dict = {}
        self._lock = threading.Lock()

    def enabled(self) -> bool:
        if self._forced is not None:
            return self._forced
        raw = os.environ.get("NUMBACONV_AUTOTUNE", "").strip()
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
        return os.path.join(default_cache_dir(), self.FILE)

    def _cache_key(self, backend, op, problem) -> str:
        return (f"{backend.name}@{getattr(backend, 'version', '0')}|{platform.machine()}"
                f"|{os.cpu_count()}|{problem.key()}")

    def _load(self) -> dict:
        try:
            with open(self.path(), encoding="utf-8") as f:
                data = json.load(f)
            return data.get("entries", {}) if isinstance(data, dict) else {}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable autotune cache %s: %s", self.path(), exc)
            return {}

    def _save(self, key: str, record: dict) -> None:
        path = self.path()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            entries = self._load()
            entries[key] = record
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": 1, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not write autotune cache %s: %s", path, exc)

    def tune(self, op: str, problem, choice: Choice) -> Choice:
        backend = _registry.entries()[choice.backend].backend
        algorithms = list(backend.algorithms(op, problem)) if hasattr(
            backend, "algorithms") else [choice.algorithm]
        if len(algorithms) < 2:
            return choice
        key = self._cache_key(backend, op, problem)
        with self._lock:
            record = self._memory.get(key)
            if record is None:
                record = self._load().get(key)
            if record is None or record.get("algorithm") not in algorithms:
                record = self._measure(backend, op, problem, algorithms)
                self._save(key, record)
            self._memory[key] = record
        times = ", ".join(f"{a} {t * 1e3:.3f} ms" for a, t in sorted(
            record["times"].items(), key=lambda kv: kv[1]))
        return Choice(choice.backend, record["algorithm"],
                      f"autotuned ({times}); heuristic said {choice.algorithm!r}",
                      choice.rejected)

    def _measure(self, backend, op, problem, algorithms) -> dict:
        from .testing import random_operands  # lazy: only autotuning needs it
        scratch = dataclasses.replace(problem, accumulate=False)  # never touch user's out
        operands = random_operands(op, scratch)
        times = {}
        for algorithm in algorithms:
            best = float("inf")
            for _ in range(2):  # the first run may include compilation
                start = time.perf_counter()
                backend.run(op, scratch, operands, None, algorithm)
                best = min(best, time.perf_counter() - start)
            times[algorithm] = best
        fastest = min(times, key=times.get)
        return {"algorithm": fastest, "times": times}


_autotune = _Autotuner()


def set_autotune(enabled: bool) -> None:
    """Time every candidate algorithm once per problem and remember the fastest.

    Results are kept in memory and in ``autotune-v1.json`` under ``NUMBACONV_CACHE_DIR``
    (default: the user cache directory). Overrides ``NUMBACONV_AUTOTUNE``. Timing runs use
    scratch arrays; the caller's ``out`` is never touched by them.
    """
    _autotune.set(enabled)
