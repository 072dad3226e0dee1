"""Backend registry, entry-point discovery and per-call selection (with the choices of the
autotuner, :mod:`numbaconv.autotune`, when autotuning is on).

Discovery is lazy: the entry points of the group ``numbaconv.backends`` are read on the first
call that needs a backend (never at import), each factory is called once, and a backend whose
import or factory fails is remembered with its reason and skipped. Choices are cached per
(op, problem, active backend list), so repeated calls on the same shapes cost a dict lookup.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from dataclasses import dataclass
from importlib import metadata
from typing import Optional

from .autotune import (AUTOTUNE_FORMAT, AUTOTUNE_KEY_VERSION, _autotune, cpu_model,
                       default_cache_dir)
from .backend import Choice, NoBackendError
from .config import environ_value

__all__ = ["ENTRY_POINT_GROUP", "BackendInfo", "Choice", "NoBackendError", "register_backend",
           "unregister_backend", "reload_backends", "backends", "get_backend", "use_backend",
           "select", "run", "set_autotune",
           # the autotuner's, re-exported from numbaconv.autotune
           "AUTOTUNE_FORMAT", "AUTOTUNE_KEY_VERSION", "cpu_model", "default_cache_dir"]

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
            choice = _autotune.tune(op, problem, choice,
                                    _registry.entries()[choice.backend].backend)
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
    _registry.choices.clear()
