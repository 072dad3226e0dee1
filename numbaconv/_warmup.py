"""Compile and cache the ``cpu`` kernels on purpose: :func:`warmup`, ``numbaconv warmup``.

The ``cpu`` backend compiles its Numba kernels on first use, a few seconds per op, dtype,
layout and dimensionality, and Numba's disk cache makes that a one-off per installation
(see docs/configuration.md, "Where compiled kernels go"). Warming up pays it before a long
job, while building a Docker image or in a CI step whose cache directory is kept: every
algorithm the dispatcher could choose for the typical layers asked for runs once, on small problems
whose sizes clear the size thresholds that switch a kernel on (so the kernels a real layer
runs are the ones compiled), and its compilations land in the cache.

This module sits above the public functions, beside ``cli`` and ``testing``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from .problem import CONV_OPS

#: What a float32 2D training step with biases runs (``conv_transpose`` shares its kernels
#: with ``conv_backward_data``, and is left to be asked for).
DEFAULT_OPS = ("conv", "conv_backward_data", "conv_backward_weight", "conv_backward_bias")

#: Typical layers: name -> (kernel size, stride, padding, groups or "depthwise"). The default
#: set is ResNet's: 3x3 (stride 1 and 2), 1x1 (stride 1 and the stride-2 shortcut).
LAYERS = {
    "3x3": (3, 1, 1, 1),
    "3x3s2": (3, 2, 1, 1),
    "3x3deep": (3, 1, 1, 1),
    "1x1": (1, 1, 0, 1),
    "1x1s2": (1, 2, 0, 1),
    "depthwise": (3, 1, 1, "depthwise"),
    "stem": (7, 2, 3, 1),
}
DEFAULT_LAYERS = ("3x3", "3x3s2", "3x3deep", "1x1", "1x1s2")

#: Batch, channels and spatial sizes of the warm-up problems: small (a warm run takes
#: milliseconds) but above the thresholds at which the cpu backend switches a kernel on,
#: for stride 2 too (the parallel bias pass from 2**16 outputs, the row products from 16
#: rows a channel). The bias gradient runs its parallel kernels from 2**18 values of dy: a
#: stride-1 layer's dy here reaches that, a stride-2 layer's does not (both versions compile).
BATCH, CHANNELS = 4, 32
SPATIAL = {1: (2048,), 2: (48, 48), 3: (8, 24, 24)}
#: ``3x3deep``, a layer of ResNet's last stage (few pixels, many channels: the 2D Winograd
#: paths by panels of output channels): its batch, channels and spatial sizes.
DEEP = (1, 128, {1: (48,), 2: (12, 12), 3: (4, 6, 6)})


@dataclass
class Entry:
    """One algorithm of one op, run once."""

    op: str
    dtype: str
    layout: str
    ndim: int
    layer: str
    algorithm: str
    seconds: float
    compiled: int      # kernels compiled now (Numba cache misses)
    loaded: int        # kernels loaded from the disk cache (Numba cache hits)
    error: Optional[str] = None


@dataclass
class WarmupReport:
    """What :func:`warmup` ran, compiled and loaded, and where the kernels are cached."""

    entries: list = field(default_factory=list)
    cache: str = ""
    seconds: float = 0.0

    @property
    def compiled(self) -> int:
        return sum(e.compiled for e in self.entries)

    @property
    def loaded(self) -> int:
        return sum(e.loaded for e in self.entries)

    @property
    def errors(self) -> list:
        return [e for e in self.entries if e.error]

    def summary(self) -> list:
        """Lines: one per (op, dtype, layout, ndim) with its algorithms, then totals."""
        groups: dict = {}
        for e in self.entries:
            g = groups.setdefault((e.op, e.dtype, e.layout, e.ndim), [set(), 0, 0, 0.0])
            g[0].add(e.algorithm)
            g[1] += e.compiled
            g[2] += e.loaded
            g[3] += e.seconds
        rows = [(op, dtype, layout, f"{ndim}D" if ndim else "-", ", ".join(sorted(algos)), compiled, loaded,
                 f"{seconds:.1f}")
                for (op, dtype, layout, ndim), (algos, compiled, loaded, seconds)
                in groups.items()]
        headers = ("op", "dtype", "layout", "dims", "algorithms", "compiled", "loaded", "s")
        cells = [headers] + [tuple(str(v) for v in r) for r in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
        right = {5, 6, 7}
        lines = ["  ".join(v.rjust(w) if i in right else v.ljust(w)
                           for i, (v, w) in enumerate(zip(r, widths))).rstrip()
                 for r in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(f"{len(self.entries)} runs in {self.seconds:.1f} s: {self.compiled} "
                     f"kernel compilation(s) now, {self.loaded} loaded from the cache")
        lines.append(f"kernels cached in: {self.cache}")
        for e in self.errors:
            lines.append(f"FAILED {e.op} {e.dtype} {e.layout} {e.ndim}D {e.layer} "
                         f"{e.algorithm}: {e.error}")
        return lines


def kernel_cache_stats() -> tuple:
    """``(hits, misses)`` of Numba's disk cache summed over every compiled function of the
    loaded ``numbaconv.cpu`` modules and every serial twin of one: loads from the cache, and
    compilations."""
    counts = compiled_kernels()
    return counts["hits"], counts["misses"]


def compiled_kernels(prefix: str = "numbaconv.cpu") -> dict:
    """What Numba holds of numbaconv's kernels in this process: ``signatures`` (compiled or
    loaded from the disk cache), and the cache's ``hits`` and ``misses``, summed over the
    Numba dispatchers among the attributes of the loaded modules named ``prefix...`` and
    over the serial twins made so far (:func:`numbaconv.config.serial_twins`: no module
    holds them). Zeros where Numba is not loaded. Shared by warm-up (the cache's counts)
    and ``bench --first-call`` (kernels per call), so that both count the same kernels."""
    dispatcher_type = getattr(sys.modules.get("numba.core.dispatcher"), "Dispatcher", None)
    counts = dict(signatures=0, hits=0, misses=0)
    if dispatcher_type is None:
        return counts
    functions = [value for name, module in list(sys.modules.items())
                 if name.startswith(prefix) and module is not None
                 for value in list(vars(module).values())]
    config = sys.modules.get("numbaconv.config")
    if config is not None:
        functions += config.serial_twins()
    seen = set()
    for value in functions:
        if not isinstance(value, dispatcher_type) or id(value) in seen:
            continue
        seen.add(id(value))
        counts["signatures"] += len(value.signatures)
        try:    # a dispatcher without Numba's cache statistics (numba-cuda's) counts none
            hits, misses = value.stats.cache_hits, value.stats.cache_misses
        except AttributeError:
            continue
        counts["hits"] += sum(hits.values())
        counts["misses"] += sum(misses.values())
    return counts


def _as_tuple(value, allowed: Sequence, name: str, every: Optional[tuple] = None) -> tuple:
    if value is None:
        return tuple(allowed) if every is None else every
    values = (value,) if isinstance(value, (str, int)) else tuple(value)
    if "both" in values or "all" in values:
        values = tuple(allowed)
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ValueError(f"{name}: expected some of {list(allowed)}, got {value!r}")
    return tuple(dict.fromkeys(values))


def _operands(op, layer, dtype, layout, ndim, rng):
    """(public call's arguments, keyword arguments) of ``op`` on ``layer``."""
    size, stride, padding, groups = LAYERS[layer]
    batch, channels, spatial = DEEP if layer == "3x3deep" else (BATCH, CHANNELS, SPATIAL)
    groups = channels if groups == "depthwise" else groups
    spatial = spatial[ndim]
    w = rng.standard_normal((channels, channels // groups) + (size,) * ndim).astype(dtype)
    kw = dict(stride=stride, padding=padding, groups=groups, layout=layout)

    def act(shape):
        full = (batch, channels) + shape
        if layout == "channels_last":
            full = (batch,) + shape + (channels,)
        return rng.standard_normal(full).astype(dtype)

    from .conv import conv_output_shape
    x = act(spatial)
    y_shape = conv_output_shape(x.shape, w.shape, **kw)
    dy = rng.standard_normal(y_shape).astype(dtype)
    if op == "conv":
        return (x, w, rng.standard_normal(channels).astype(dtype)), kw
    if op == "conv_backward_data":
        return (dy, w, x.shape), kw
    if op == "conv_backward_weight":
        return (x, dy, w.shape), kw
    if op == "conv_transpose":
        return (dy, w, rng.standard_normal(channels).astype(dtype)), kw
    return (dy,), dict(layout=layout)                      # conv_backward_bias


def plan(ops=None, dtypes=None, layouts=None, ndims=None, layers=None) -> list:
    """The ``(op, dtype, layout, ndim, layer)`` combinations :func:`warmup` would run, each
    for every algorithm the cpu backend offers on it (see :func:`warmup` for arguments)."""
    ops = _as_tuple(ops, CONV_OPS, "ops", DEFAULT_OPS)
    dtypes = _as_tuple(dtypes, ("float32", "float64"), "dtypes", ("float32",))
    layouts = _as_tuple(layouts, ("channels_first", "channels_last"), "layouts",
                        ("channels_first",))
    ndims = _as_tuple(ndims, (1, 2, 3), "ndims", (2,))
    layers = _as_tuple(layers, tuple(LAYERS), "layers", DEFAULT_LAYERS)
    combos = []
    for dtype in dtypes:
        for layout in layouts:
            for ndim in ndims:
                for op in ops:
                    for layer in layers:
                        combos.append((op, dtype, layout, ndim, layer))
    return combos


def warmup(ops=None, *, dtypes=None, layouts=None, ndims=None, layers=None, jobs: int = 1,
           progress: Optional[Callable[[int, int, str], None]] = None) -> WarmupReport:
    """Compile the ``cpu`` backend's kernels now and store them in Numba's disk cache.

    Runs each op once per algorithm the cpu backend offers (the ones ``explain`` and
    autotuning choose among, each forced in turn) on a small problem of each typical layer,
    so that a later process loads the kernels instead of compiling them. An addition to the
    API contract (``API.md`` does not name it).

    Parameters
    ----------
    ops : str or sequence of str, optional
        Op names (see ``numbaconv.problem.CONV_OPS``); default ``DEFAULT_OPS``: ``conv``
        (with a bias), ``conv_backward_data``, ``conv_backward_weight``,
        ``conv_backward_bias``. ``"all"`` adds ``conv_transpose``.
    dtypes : str or sequence, optional
        ``"float32"`` (default), ``"float64"``, or ``"both"``.
    layouts : str or sequence, optional
        ``"channels_first"`` (default, numbaconv's default layout), ``"channels_last"``, or
        ``"both"``.
    ndims : int or sequence of int, optional
        Spatial dimensionalities among 1, 2 (default) and 3.
    layers : str or sequence of str, optional
        Names in ``LAYERS``; default ResNet's ``3x3``, ``3x3s2``, ``3x3deep`` (its last
        stage: few pixels, many channels), ``1x1``, ``1x1s2``;
        ``"depthwise"`` and ``"stem"`` (7x7 stride 2) on request, ``"all"`` for every one.
    jobs : int
        Processes compiling at once (default 1: this process alone). With more, the runs
        are shared out by algorithm and dtype, whose kernels they share, among that many
        new interpreters (``spawn``), each writing to the same disk cache; Numba's compiler
        runs one compilation at a time per process, so this is the way to use more cores.
        Each interpreter imports Numba (about a second) and holds its own compiled code.
    progress : callable, optional
        Called as ``progress(done, total, what)`` before each run (with ``jobs`` > 1: as
        each share finishes) and once at the end.

    Returns
    -------
    WarmupReport
        Each run with its algorithm, seconds and Numba's cache statistics (compiled now or
        loaded), and where the kernels are cached; ``summary()`` gives printable lines.
        A run that raises is recorded with its error, and the others go on.
    """
    from . import conv as public
    from . import dispatch
    from .config import describe_kernel_cache

    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs: expected a positive integer, got {jobs!r}")
    combos = plan(ops, dtypes, layouts, ndims, layers)
    backend = dispatch.get_backend("cpu")
    why = backend.availability() if hasattr(backend, "availability") else None
    if why:
        raise RuntimeError(f"numbaconv warmup: the cpu backend is not available: {why}")
    report = WarmupReport(cache=describe_kernel_cache())
    start = time.perf_counter()
    before = kernel_cache_stats()
    # The first call that shares tiles among the tile workers launches a tiny kernel to pick
    # Numba's threading layer; small problems may never share tiles, so it is made here.
    if hasattr(backend, "start_threads"):  # optional in the protocol
        backend.start_threads()
    hits, misses = kernel_cache_stats()
    if hits + misses > sum(before):
        report.entries.append(Entry("threading-layer probe", "float64", "-", 0, "-", "-",
                                    time.perf_counter() - start, misses - before[1],
                                    hits - before[0]))
    work = [(op, dtype, layout, ndim, layer, algorithm)
            for op, dtype, layout, ndim, layer in combos
            for algorithm in backend.algorithms(op, _problem(op, dtype, layout, ndim, layer))]
    shares = _shares(work, jobs)
    if len(shares) > 1:
        report.entries += _run_in_processes(shares, work, progress)
    else:
        for done, spec in enumerate(work):
            if progress is not None:
                progress(done, len(work), _describe(spec))
            report.entries.append(_run(backend, spec))
    if progress is not None:
        progress(len(work), len(work), "done")
    report.seconds = time.perf_counter() - start
    del public  # imported so that the public functions' modules are loaded as in real use
    return report


def _describe(spec) -> str:
    op, dtype, layout, ndim, layer, algorithm = spec
    return f"{op} {dtype} {layout} {ndim}D {layer}: {algorithm}"


def _problem(op, dtype, layout, ndim, layer):
    from . import problem as pb
    args, kw = _operands(op, layer, dtype, layout, ndim, np.random.default_rng(0))
    return pb.PROBLEM_BUILDERS[op](*args, **kw)


def _run(backend, spec) -> Entry:
    """Run one (op, dtype, layout, ndim, layer, algorithm) of the plan, with Numba's cache
    statistics of what it compiled or loaded."""
    from . import problem as pb
    op, dtype, layout, ndim, layer, algorithm = spec
    args, kw = _operands(op, layer, dtype, layout, ndim, np.random.default_rng(0))
    problem = pb.PROBLEM_BUILDERS[op](*args, **kw)
    operands = tuple(a for a in args if isinstance(a, np.ndarray))
    if op in ("conv", "conv_transpose"):
        operands = args                                       # with the bias
    before = kernel_cache_stats()
    began = time.perf_counter()
    error = None
    try:
        backend.run(op, problem, operands, None, algorithm)
    except Exception as exc:  # recorded; the other kernels still get compiled
        error = f"{type(exc).__name__}: {exc}"
    hits, misses = kernel_cache_stats()
    return Entry(op, dtype, layout, ndim, layer, algorithm, time.perf_counter() - began,
                 misses - before[1], hits - before[0], error)


def _shares(work: list, jobs: int) -> list:
    """``work`` dealt into at most ``jobs`` lists: runs of one (algorithm, dtype) together
    (they compile the same kernels), the largest groups first, each to the lightest share."""
    groups: dict = {}
    for spec in work:
        groups.setdefault((spec[5], spec[1]), []).append(spec)
    shares: list = [[] for _ in range(min(jobs, len(groups)))]
    for group in sorted(groups.values(), key=len, reverse=True):
        min(shares, key=len).extend(group)
    return [share for share in shares if share]


def _run_share(share: list) -> list:
    """In a worker interpreter: run ``share``'s specs one after another."""
    from . import dispatch
    backend = dispatch.get_backend("cpu")
    if hasattr(backend, "start_threads"):
        backend.start_threads()
    return [_run(backend, spec) for spec in share]


def _run_in_processes(shares: list, work: list, progress) -> list:
    """Each share in its own worker interpreter; the entries in ``work``'s order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    entries: list = []
    done, total = 0, len(work)
    if progress is not None:
        progress(0, total, f"compiling in {len(shares)} processes")
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=len(shares), mp_context=context) as pool:
        futures = {pool.submit(_run_share, share): share for share in shares}
        for future in as_completed(futures):
            share = futures[future]
            try:
                entries += future.result()
            except Exception as exc:  # the worker died: its runs are recorded as failed
                entries += [Entry(*spec, 0.0, 0, 0, f"{type(exc).__name__}: {exc}")
                            for spec in share]
            done += len(share)
            if progress is not None:
                progress(done, total, f"finished {_describe(share[-1])}")
    order = {spec: i for i, spec in enumerate(work)}
    return sorted(entries, key=lambda e: order[(e.op, e.dtype, e.layout, e.ndim, e.layer,
                                                 e.algorithm)])
