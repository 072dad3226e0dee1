"""Shared pieces of the cpu algorithms: the tile workers and their workspaces, BLAS products,
weight matrices, tiles of images and positions, fixed-order sums.

Matrix products go to NumPy's ``matmul`` (its BLAS: OpenBLAS in NumPy's wheels), which
multiplies strided operands and writes strided outputs without copies as long as each 2D
slice has a unit inner stride. Packing (im2col/col2im) is Numba; see :mod:`._im2col`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numba
import numpy as np

from ..config import available_cpus, serial_after_fork, serial_version
from .._kernel_geometry import Geom
from ._microkernel import images_transposed, vector_lanes
from ._rows import (add_row_scalars, add_row_vector, sum_partials, sum_taps_last,
                    transposed_sum, zero_rows)

#: Workspace for packed (im2col) buffers is bounded by max(this, the largest operand).
WORKSPACE_BYTES = 64 * 2**20
#: Packed bytes per tile that the tiling aims at (cache-sized; see :func:`tiles`).
TILE_BYTES = 4 * 2**20


def weight_cf(g: Geom, w: np.ndarray) -> np.ndarray:
    """w as (G, K/G, Cg * taps), features ordered (c, t): a view."""
    return w.reshape(g.groups, g.kg, g.cg * g.taps)


def weight_cl(g: Geom, w: np.ndarray) -> np.ndarray:
    """w as (G, K/G, taps * Cg), features ordered (t, c) like channels-last windows: a copy."""
    return relayout(w.reshape(g.groups, g.kg, g.cg, g.taps).transpose(0, 1, 3, 2), 1).reshape(
        g.groups, g.kg, g.taps * g.cg)


def weight_from_cl(g: Geom, dw: np.ndarray) -> np.ndarray:
    """(G, K/G, taps * Cg) back to the (K, Cg, *R) weight layout (a copy)."""
    return relayout(dw.reshape(g.groups, g.kg, g.taps, g.cg).transpose(0, 1, 3, 2), 1).reshape(
        (g.k, g.cg) + g.r)


#: Weight re-layouts of more bytes than this are shared out among the tile workers.
SHARED_RELAYOUT_ABOVE = 4 * 2**20


def relayout(view: np.ndarray, axis: int) -> np.ndarray:
    """A C-contiguous copy of a strided view (a transposed weight), copied in pieces along
    ``axis`` by the tile workers when it is large (NumPy's copy releases the GIL; in a tile
    worker, by that worker alone). ResNet's 512-channel 3x3 weight (9.4 MB),
    flipped and transposed for the data gradient on 2 cores: 1.6 -> 1.0 ms; at 256
    channels (2.4 MB) two threads gained nothing."""
    out = np.empty(view.shape, view.dtype)
    spans = worker_ranges(view.shape[axis], view.nbytes > SHARED_RELAYOUT_ABOVE)
    if len(spans) <= 1:
        out[...] = view
        return out

    def copy(span, pick):
        _along(out, axis, span)[...] = _along(view, axis, span)

    run_tiles(copy, spans)
    return out


def _along(array: np.ndarray, axis, span: tuple) -> np.ndarray:
    """``array[..., start:stop, ...]`` on ``axis`` for ``span`` (start, stop); the whole
    array when ``axis`` is None or the array has length 1 there (broadcast)."""
    if axis is None or array.shape[axis] == 1:
        return array
    index = [slice(None)] * array.ndim
    index[axis] = slice(*span)
    return array[tuple(index)]


def grouped_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out[m, g, :] = a[m, g, :] @ b[g] for a (M, G, F), b (G, F, J), out (M, G, J), shared
    out among the tile workers (see :func:`matmul`)."""
    matmul(a.transpose(1, 0, 2), b, out.transpose(1, 0, 2))


#: Products of fewer multiply-adds than this run as one np.matmul on the calling thread.
SHARED_PRODUCT_ABOVE = 2**20


#: Slices of a shared 2D product whose bits must not depend on the thread count (see
#: :func:`fixed_parts`): work for up to this many workers, two slices from twice
#: FIXED_PART_MIN rows or columns (thinner slices ran BLAS measurably slower), more only
#: while each keeps FIXED_PART_ROWS: every slice packs the other operand again, so more
#: slices than workers cost time (docs/cpu-algorithms.md, "Recurrent networks").
FIXED_PARTS = 8
FIXED_PART_MIN = 256
FIXED_PART_ROWS = 1024


def fixed_parts(size: int) -> int:
    """Slices of a shared 2D product of ``size`` rows (or columns) along its cut: 1, 2, 4 or
    8 (a power of two shares out evenly among 2 or 4 workers), by the size alone."""
    if size < 2 * FIXED_PART_MIN:
        return 1
    parts = 2
    while parts < FIXED_PARTS and size >= 2 * parts * FIXED_PART_ROWS:
        parts *= 2
    return parts


#: A stack of products is shared out in whole products (not slices of each) when the
#: busiest worker then has at most this much more than an even share: whole products
#: multiply faster, but leave a worker idle when they divide badly (docs/cpu-algorithms.md).
WHOLE_PRODUCTS_IMBALANCE = 1.25


def _whole_products_balance(shape: tuple, shared: bool) -> bool:
    """Whether the products of an out of ``shape`` share out evenly enough (see
    :data:`WHOLE_PRODUCTS_IMBALANCE`) along its longest batch axis."""
    if len(shape) < 3 or not shared:
        return False
    size = max(shape[:-2])
    workers = tile_workers(size)
    return workers > 1 and -(-size // workers) * workers <= WHOLE_PRODUCTS_IMBALANCE * size


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray, fixed: bool = False) -> np.ndarray:
    """``np.matmul(a, b, out=out)``, shared out among the tile workers (one BLAS thread each)
    in slices of out's longest batch axis where its products divide evenly among them, else
    of out's longest axis, so that numbaconv never runs OpenBLAS's own thread
    pool: its threads spin for about 0.1 s after each product, taking a core from the tile
    workers of whatever runs next (measured on 2 cores: a channels-last 3x3 data gradient
    right after a two-thread product took 24-26 ms instead of 14-19 ms). ``a`` may have
    fewer batch axes than out (broadcast).

    OpenBLAS's bits depend on the shape of each product it is given (a slice of rows or
    columns rounds differently from the whole), so a result that must not depend on the
    thread count passes ``fixed`` (and runs under :func:`blas_single_threaded`): a stack of
    products is then shared out along its longest batch axis, which leaves each product
    whole, and a single product is cut into slices fixed by its shape
    (:func:`fixed_ranges`), whatever the number of workers."""
    shared = out.size * a.shape[-1] > SHARED_PRODUCT_ABOVE
    if not fixed and not _whole_products_balance(out.shape, shared):
        axis = int(np.argmax(out.shape))
        spans = worker_ranges(out.shape[axis], shared)
    elif out.ndim > 2 and max(out.shape[:-2]) > 1:
        axis = int(np.argmax(out.shape[:-2]))
        spans = worker_ranges(out.shape[axis], shared)
    else:
        axis = out.ndim - 2 + int(np.argmax(out.shape[-2:]))
        spans = fixed_ranges(out.shape[axis], fixed_parts(out.shape[axis]) if shared else 1)
    if len(spans) <= 1:
        return np.matmul(a, b, out=out)
    a = a[(None,) * (out.ndim - a.ndim)]
    b = b[(None,) * (out.ndim - b.ndim)]
    rows, columns = out.ndim - 2, out.ndim - 1
    a_axis = None if axis == columns else axis
    b_axis = None if axis == rows else axis

    def product(span, pick):
        np.matmul(_along(a, a_axis, span), _along(b, b_axis, span),
                  out=_along(out, axis, span))

    run_tiles(product, spans)
    return out


def tiles(g: Geom, per_position_bytes: int, largest_operand_bytes: int):
    """(n0, nb, q0, q1) tiles: several whole images, or one image's run of output rows
    (q = p0 * P1 + p1, each P2 positions).

    Tiles aim at TILE_BYTES of packed data, so that packing writes and the product's reads
    hit the cache rather than memory: measured on ResNet's 3x3 64-channel 56x56 layer,
    4 MiB tiles took 6 ms where 64 MiB tiles took 11 ms (channels-last forward). The packed
    workspace never exceeds max(WORKSPACE_BYTES, the largest operand), except that a single
    output row (the last spatial dimension) is never split.
    """
    limit = min(TILE_BYTES, max(WORKSPACE_BYTES, largest_operand_bytes))
    rows = g.p[0] * g.p[1]
    per_image = per_position_bytes * g.positions
    if per_image <= limit:
        nb = min(g.n, limit // max(per_image, 1))
        for n0 in range(0, g.n, nb):
            yield n0, min(nb, g.n - n0), 0, rows
        return
    chunk = max(1, limit // max(per_position_bytes * g.p[2], 1))
    for n0 in range(g.n):
        for q0 in range(0, rows, chunk):
            yield n0, 1, q0, min(rows, q0 + chunk)


_local = threading.local()


@contextlib.contextmanager
def packing_threads():
    """Run the packing kernels of a GEMM-based algorithm on the calling thread alone.

    Packing alternates with BLAS products tile after tile. Numba's parallel regions end at
    a barrier, so a Numba thread descheduled in favour of a BLAS thread (which yield-spins
    for a while after each product) stalls the whole region for a time slice: measured on
    2 cores with both pools at 2 threads, ResNet's 3x3 64-channel layer took 130 ms instead
    of 9 ms whenever Numba's OpenMP pool waited actively (as when PyTorch loaded the OpenMP
    runtime first). One Numba thread gives the cores to BLAS and was also faster with
    passive waiting (channels-first forward 14.5 -> 9 ms, channels-last 7.8 -> 6.5 ms).
    """
    previous = numba_threads()
    set_numba_threads(1)
    try:
        yield
    finally:
        set_numba_threads(previous)


def numba_threads() -> int:
    """``numba.get_num_threads()``: Numba's thread count for the calling thread."""
    return _numba_counts()[0]()


def set_numba_threads(threads: int) -> None:
    """``numba.set_num_threads(threads)`` for the calling thread; ``threads`` from 1 to
    Numba's count at start-up (the callers pass a count they read, or fewer)."""
    _numba_counts()[1](threads)


@functools.lru_cache(maxsize=1)
def _numba_counts() -> tuple:
    """Numba's getter and setter of the calling thread's count. Once numbaconv's threading
    set-up has run and Numba's threads are up, the threading layer's own functions, which
    ``numba.get_num_threads`` and ``set_num_threads`` wrap in checks of that set-up and of
    the argument on every call: several times cheaper, and every call on a busy machine
    sets the count twice (docs/configuration.md, "Busy machines"). Numba's public
    functions where the private ones are missing (another Numba version)."""
    from ..config import jit_options
    jit_options()           # the threading set-up first: asking Numba starts its threads
    numba.get_num_threads()
    from numba.np.ufunc import parallel
    get = getattr(parallel, "_get_num_threads", None)
    set_ = getattr(parallel, "_set_num_threads", None)
    if not (callable(get) and callable(set_)):
        return numba.get_num_threads, numba.set_num_threads
    return get, set_


class on_threads:
    """Numba's thread count for the calling thread (its parallel regions, and how many tile
    workers its calls use) set to ``threads`` meanwhile, and NumPy's BLAS held to one thread
    when ``threads`` is 1 (see :func:`blas_single_threaded`), unless ``blas`` is False: the
    call runs no BLAS product. Holding it costs the pair of OpenBLAS thread-count changes,
    several microseconds in a call (docs/configuration.md, "Busy machines").

    A plain class rather than a generator-based manager, which costs more to enter and
    leave: every call on a busy machine passes through it, the smallest ones included.
    """

    __slots__ = ("threads", "previous", "blas")

    def __init__(self, threads: int, blas: bool = True):
        self.threads, self.previous, self.blas = threads, 0, blas

    def __enter__(self):
        self.previous = numba_threads()
        set_numba_threads(self.threads)
        self.blas = self.blas and self.threads == 1 and _hold_blas()
        return self

    def __exit__(self, *exc_info):
        try:
            if self.blas:
                _release_blas()
        finally:
            set_numba_threads(self.previous)


@functools.lru_cache(maxsize=1)
def _blas():
    """The thread count of NumPy's OpenBLAS (:class:`_BlasThreads`), or None when NumPy's
    BLAS is another library or threadpoolctl is missing."""
    try:
        from threadpoolctl import ThreadpoolController
        libraries = ThreadpoolController().select(internal_api="openblas").lib_controllers
    except Exception:   # threadpoolctl missing, or failing on an unusual platform
        return None
    # NumPy's wheels bundle their own OpenBLAS (numpy.libs), SciPy's another: use NumPy's,
    # or the only one loaded (a NumPy built against a system OpenBLAS).
    ours = [lib for lib in libraries if "numpy" in lib.filepath] or \
        (libraries if len(libraries) == 1 else [])
    if not ours:
        return None
    blas = _BlasThreads(ours[0])
    _fit_to_available_cpus(blas)
    return blas


def _fit_to_available_cpus(blas) -> None:
    """OpenBLAS sizes its pool by the affinity mask, not by a cgroup CPU quota: lowered to
    :func:`numbaconv.config.available_cpus` (the quota, rounded up) unless the user set
    OPENBLAS_NUM_THREADS (or OMP_NUM_THREADS, which OpenBLAS also reads)."""
    if "OPENBLAS_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in os.environ:
        return
    count, _ = available_cpus()
    if count < blas.get_num_threads():
        blas.set_num_threads(count)


class _BlasThreads:
    """Gets and sets the thread count of the OpenBLAS that threadpoolctl's ``controller``
    found, from any Python thread.

    threadpoolctl (3.8) lets only the first Python thread that sets a pthreads OpenBLAS's
    thread count set it again, and silently ignores the others: a numbaconv call from any
    other thread then ran its products on OpenBLAS's threads (whose bits differ). So the
    library's own functions are called here, found under the symbol names that NumPy's
    wheels (``scipy_openblas..64_``) or a plain build give them; an OpenMP build's count is
    per thread already, and goes through threadpoolctl.
    """

    def __init__(self, controller):
        self.controller = controller
        self._get = self._set = None
        if getattr(controller, "threading_layer", None) != "openmp":
            self._get = self._symbol(controller, "openblas_get_num_threads")
            self._set = self._symbol(controller, "openblas_set_num_threads")

    @staticmethod
    def _symbol(controller, name):
        library = getattr(controller, "dynlib", None)
        for prefix in ("", "scipy_"):
            for suffix in ("", "64_"):
                function = getattr(library, f"{prefix}{name}{suffix}", None)
                if function is not None:
                    return function
        return None

    def get_num_threads(self) -> int:
        return self._get() if self._get is not None else self.controller.get_num_threads()

    def set_num_threads(self, threads: int) -> None:
        if self._set is not None:
            self._set(threads)
        else:
            self.controller.set_num_threads(threads)


_blas_lock = threading.Lock()
_blas_users = 0
_blas_threads = None


@contextlib.contextmanager
def blas_single_threaded():
    """NumPy's BLAS on one thread while tile workers run, or for a whole call whose result
    must not depend on the thread count (weight gradients, recurrent ops: OpenBLAS's bits
    depend on its thread count, each thread multiplying a slice of the product), restored
    when the last of them (any number of concurrent numbaconv calls) is done.

    OpenBLAS's thread count is process-wide: ``openblas_set_num_threads_local`` changes it
    for every thread in NumPy's pthreads build (measured: the main thread's products ran on
    one thread after a worker called it). So other threads of the program also get a
    one-thread BLAS while a GEMM-based numbaconv algorithm runs. Setting it costs about
    1 us. Without control over NumPy's BLAS (not OpenBLAS, or threadpoolctl missing) this
    does nothing, and the products' bits may depend on that library's thread count.
    """
    held = _hold_blas()
    try:
        yield
    finally:
        if held:
            _release_blas()


def _hold_blas() -> bool:
    """One more user of the one-thread BLAS (see :func:`blas_single_threaded`); False
    where NumPy's BLAS is out of reach (nothing to release)."""
    global _blas_users, _blas_threads
    blas = _blas()
    if blas is None:
        return False
    with _blas_lock:
        if _blas_users == 0:
            _blas_threads = blas.get_num_threads()
            blas.set_num_threads(1)
        _blas_users += 1
    return True


def _release_blas() -> None:
    """One user fewer (after :func:`_hold_blas` returned True); the last restores the
    count."""
    global _blas_users
    with _blas_lock:
        _blas_users -= 1
        if _blas_users == 0:
            _blas().set_num_threads(_blas_threads)


def on_one_blas_thread(function):
    """``function`` run under :func:`blas_single_threaded` (a decorator)."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        with blas_single_threaded():
            return function(*args, **kwargs)
    return run


_pools: dict = {}
_pools_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child starts with none of the parent's threads: fresh locks (one held by a
    parent thread at the fork would never be released), no BLAS users, no pools. (Its
    kernels run serially where the parent's threads were OpenMP's: see
    :mod:`numbaconv.config`.)"""
    global _blas_lock, _blas_users, _pools_lock
    _blas_lock = threading.Lock()
    _pools_lock = threading.Lock()
    _blas_users = 0
    _pools.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _pool(workers: int):
    """A thread pool of ``workers`` threads, each with one Numba thread, made once per
    process (a forked child makes its own: the parent's threads do not exist there)."""
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ThreadPoolExecutor(
                workers, thread_name_prefix="numbaconv-tile", initializer=_start_worker)
        return pool


def _start_worker() -> None:
    numba.set_num_threads(1)
    _local.worker = True


def in_tile_worker() -> bool:
    """Whether this thread is a tile worker (whose products run on it, one BLAS thread)."""
    return getattr(_local, "worker", False)


@functools.lru_cache(maxsize=1)
def _parallel_kernels_in_workers() -> bool:
    """Whether the tile workers may call the parallel packing kernels (on one Numba thread
    each): Numba's omp and tbb threading layers take launches from several threads at
    once, its workqueue layer does not. Those kernels ran 2.2 times as fast as their
    serial twins on one thread (Numba's parfor lowering optimises the loop body better)."""
    zero_rows(np.zeros((1, 1)))         # a first parallel launch picks the threading layer
    return numba.threading_layer() in ("omp", "tbb")


def tile_workers(jobs: int) -> int:
    """How many tile jobs run at once: Numba's thread count (``numba.set_num_threads``),
    when NumPy's BLAS is an OpenBLAS whose thread count numbaconv can set; else 1, and 1 in
    a tile worker (its jobs run there, see :func:`run_tiles`)."""
    workers = min(numba_threads(), jobs)
    if workers < 2 or _blas() is None or in_tile_worker():
        return 1
    return workers


def worker_ranges(size: int, share: bool = True) -> list:
    """[(start, stop), ...]: [0, size) cut into one range per tile worker (a single range
    unless ``share``), the jobs of a kernel shared out by :func:`run_tiles`."""
    step = max(1, -(-size // (tile_workers(size) if share else 1)))
    return [(start, min(size, start + step)) for start in range(0, size, step)]


def fixed_ranges(size: int, parts: int) -> list:
    """[(start, stop), ...]: [0, size) cut into at most ``parts`` ranges, fixed by the
    arguments alone (not by the number of workers that run them)."""
    step = max(1, -(-size // max(parts, 1)))
    return [(start, min(size, start + step)) for start in range(0, size, step)]


def interruptible_ranges(size: int, work: float, piece_work: float, multiple: int = 0) -> list:
    """[(start, stop), ...]: [0, size) cut into ranges of about ``piece_work`` each, where
    the whole is ``work``; one range, today's single parallel region, when the whole is no
    more. The algorithms that launch their parallel kernels from the calling thread run one
    region per range, so that Ctrl-C (which Python sees only between regions) ends a long
    call within about one range's time.

    Each range but the last holds a multiple of ``multiple`` units, by default of Numba's
    thread count, so that no thread of a region idles for want of a job: where one job is
    more than ``piece_work``, a range is one job per thread. The ranges only group jobs
    into regions, and every job computes the same in any region: no result depends on them,
    bit for bit (tests/test_reliability.py splits calls into the smallest pieces).
    """
    multiple = multiple or numba_threads()
    count = min(-(-size // multiple), math.ceil(work / piece_work))
    if count <= 1:
        return [(0, size)]
    step = -(-(-(-size // count)) // multiple) * multiple
    return [(start, min(size, start + step)) for start in range(0, size, step)]


def serial(kernel):
    """The one-thread compilation of a parallel kernel (made once, on first use): for the
    tile workers under Numba's workqueue threading layer (which cannot launch parallel
    regions from two threads at once), and for work too small to be worth waking the
    OpenMP threads (the direct weight gradient's partial sums); and in a forked child, for
    every kernel (see :mod:`numbaconv.config`)."""
    return serial_version(kernel)


def _same(kernel):
    return kernel


def _worker_pick():
    """The variant of the packing kernels that tile workers call (see :func:`serial`)."""
    return _same if not serial_after_fork() and _parallel_kernels_in_workers() else serial


def made_once(makers: list):
    """``get(i)``: ``makers[i]()``, made by the first tile job that asks for it (the others
    that ask meanwhile wait for it) and kept: a value that several jobs share, made on the
    workers side by side instead of on the calling thread before they start."""
    values = [None] * len(makers)
    locks = [threading.Lock() for _ in makers]

    def get(i: int):
        if values[i] is None:
            with locks[i]:
                if values[i] is None:
                    values[i] = makers[i]()
        return values[i]

    return get


def run_tiles(work, jobs: list) -> list:
    """``[work(job, pick) for job in jobs]``, the jobs shared out among the tile workers.

    Each worker packs its tile on one thread and multiplies it with a one-thread BLAS, so
    both run on every core. ``pick(kernel)`` gives the variant of a packing kernel to call.
    When the jobs run one after another instead (one worker, or no control over BLAS's
    threads), packing runs on one thread and the products on BLAS's threads.

    Measured on 2 cores (ResNet's 3x3 layer, 64 channels at 56x56, channels-last forward,
    16 tiles): 15.5 ms one after another (packing 2.3 ms of one core, products at about
    330 GFLOP/s on two), 7 ms shared out. Jobs must write disjoint outputs. Called from a
    tile worker (a job that shares out work of its own), the jobs run there, in order: a
    worker waiting on the pool could wait for itself. Ctrl-C ends the call after the tiles
    that are running (the outputs are then partly written); a job that runs many tiles
    itself (a weight gradient's slot) stops at the next :func:`stop_if_interrupted`.
    """
    if in_tile_worker():
        pick = _worker_pick()
        return [work(job, pick) for job in jobs]
    workers = tile_workers(len(jobs))
    if workers == 1:
        with packing_threads():
            return [work(job, _same) for job in jobs]
    pick = _worker_pick()
    interrupted = threading.Event()
    with blas_single_threaded():
        futures = [_pool(workers).submit(_job, work, job, pick, interrupted) for job in jobs]
        try:
            wait(futures)
        except BaseException:
            # Ctrl-C (KeyboardInterrupt arrives in this thread, in wait): drop the queued
            # tiles, which the pool would otherwise run to the end, even at interpreter
            # exit, and stop the running jobs that run many tiles at their next one; the
            # running ones (one per worker) end first, so that no tile writes after the
            # call has returned.
            interrupted.set()
            for future in futures:
                future.cancel()
            wait(futures)
            raise
    return [future.result() for future in futures]


class _Interrupted(Exception):
    """Raised in a tile worker whose call was interrupted (never seen by the caller, who
    gets the KeyboardInterrupt)."""


def _job(work, job, pick, interrupted):
    """``work(job, pick)`` on a tile worker, with the call's ``interrupted`` event at hand
    for :func:`stop_if_interrupted`."""
    _local.interrupted = interrupted
    try:
        return work(job, pick)
    finally:
        _local.interrupted = None


def stop_if_interrupted() -> None:
    """In a tile worker's job that runs many tiles (a weight gradient's slot): end it now
    if its call was interrupted (Ctrl-C in the calling thread). On the calling thread the
    signal's KeyboardInterrupt comes by itself between two tiles."""
    interrupted = getattr(_local, "interrupted", None)
    if interrupted is not None and interrupted.is_set():
        raise _Interrupted


#: Whole-call scratch (:func:`scratch`) kept per slot and thread up to this size: larger
#: buffers would hold that much memory for the thread's life, and are their call's own.
KEEP_SCRATCH_BYTES = 32 * 2**20


def workspace(shape: tuple, dtype, slot: str = "packed") -> np.ndarray:
    """A C-contiguous scratch array, reused across tiles and calls: ``slot`` "packed" for
    packed windows, "rows" for a tile's copy of y or dy (a fraction of that size),
    "product" for a tile's part of the weight gradient (dw's size); and the slots of
    :func:`scratch`.

    One buffer per slot and thread (so concurrent calls from several threads never share
    one), grown on demand and kept: fresh multi-megabyte allocations cost a page fault per
    4 KiB on first touch, which measured as much as the packing itself. The tile slots hold
    at most one tile (about TILE_BYTES) and, once a weight gradient summed several tiles in
    one slot, one dw per thread that has called a GEMM-based algorithm.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buffers = _local.__dict__.setdefault("buffers", {})
    buffer = buffers.get(slot)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = buffers[slot] = np.empty(max(nbytes, 1), np.uint8)
    return buffer[:nbytes].view(dtype).reshape(shape)


def scratch(shape: tuple, dtype, slot: str) -> np.ndarray:
    """A C-contiguous array for one call's scratch as large as an operand, on the calling
    thread: the :func:`workspace` ``slot`` up to KEEP_SCRATCH_BYTES, a fresh array above.
    The slots: "layout_x", "layout_y", "layout_dy" (channels-last copies of channels-first
    operands), "padded" (a zero-padded copy of the input), "weights_v" (Winograd's
    transformed weights), "slot_sums" (the weight gradient's slot partials), "planes_u",
    "planes_d" (Winograd's transformed tiles). A slot serves one array at a time: each name
    has one use in a call. Kept, it costs no page faults where the C library had returned
    freed memory to the system (docs/cpu-algorithms.md, "Scratch kept from call to
    call")."""
    if math.prod(shape) * np.dtype(dtype).itemsize > KEEP_SCRATCH_BYTES:
        return np.empty(shape, dtype)
    return workspace(shape, dtype, slot)


def channels_last_copy(a: np.ndarray, channels: int, slot: str) -> np.ndarray:
    """A channels-last copy (flat) of the channels-first batch ``a`` (N, channels, ...), in
    the :func:`scratch` ``slot``, by register transposes
    (:func:`._microkernel.images_transposed`)."""
    images = a.shape[0]
    copy = scratch((a.size,), a.dtype, slot)
    images_transposed(np.ascontiguousarray(a).reshape(-1), copy, images, channels,
                      a.size // (images * channels), vector_lanes(a.dtype))
    return copy


def channels_first_into(src: np.ndarray, dst: np.ndarray, channels: int) -> None:
    """dst (N, channels, ..., C-contiguous) = the channels-last values ``src`` (flat, as
    :func:`channels_last_copy` makes them), laid out channels-first."""
    images = dst.shape[0]
    images_transposed(src, dst.reshape(-1), images, dst.size // (images * channels),
                      channels, vector_lanes(dst.dtype))


def via_channels_last(run, g: Geom, src: np.ndarray, src_channels: int, src_slot: str,
                      dst: np.ndarray, dst_channels: int, dst_slot: str,
                      accumulate: bool = False):
    """``run(g_cl, src_cl, dst_cl)`` for a channels-first problem on channels-last copies
    (flat, :func:`channels_last_copy`) of its input ``src`` and of its output ``dst`` (of
    dst's values first when ``accumulate``, else uninitialised), in the calling thread's
    :func:`scratch` slots; dst gets the result back, channels-first, unless run returns
    False (it gave up: dst untouched). Returns run's result."""
    src_cl = channels_last_copy(src, src_channels, src_slot)
    dst_cl = (channels_last_copy(dst, dst_channels, dst_slot) if accumulate
              else scratch((dst.size,), dst.dtype, dst_slot))
    done = run(g._replace(channels_last=True), src_cl, dst_cl)
    if done is not False:
        channels_first_into(dst_cl, dst, dst_channels)
    return done


def largest_operand(*arrays) -> int:
    return max(a.nbytes for a in arrays if a is not None)


def packed_bytes_per_position(g: Geom, itemsize: int) -> int:
    return g.c * g.taps * itemsize


def output_rows(g: Geom, a: np.ndarray, n0: int, nb: int, q0: int, q1: int) -> np.ndarray:
    """Channels-last y/dy rows of a tile as (nb * L, G, K/G): a view."""
    flat = a.reshape(g.n, g.positions, g.groups, g.kg)[n0:n0 + nb, q0 * g.p[2]:q1 * g.p[2]]
    return flat.reshape(-1, g.groups, g.kg)


def output_columns(g: Geom, a: np.ndarray, n0: int, nb: int, q0: int, q1: int) -> np.ndarray:
    """Channels-first y/dy of a tile as (nb, G, K/G, L): a view, strided when q is split."""
    return a.reshape(g.n, g.groups, g.kg, g.positions)[n0:n0 + nb, :, :, q0 * g.p[2]:q1 * g.p[2]]


def positions_in(q0: int, q1: int, g: Geom) -> int:
    return (q1 - q0) * g.p[2]


def sum_in_order(parts) -> np.ndarray:
    """Sum over the first axis, or of a list, one part after another (a fixed order): a
    list's parts are the caller's own fresh arrays, summed into the first; an array's
    slices into a new array (a view would keep the whole array alive), the first two
    added into it in one pass."""
    if isinstance(parts, list):
        total, first = parts[0], 1
    elif len(parts) > 1:
        total, first = np.add(parts[0], parts[1]), 2
    else:
        total, first = parts[0].copy(), 1
    for i in range(first, len(parts)):
        total += parts[i]
    return total


#: The weight gradient's tiles are dealt round-robin into this many partial sums (fewer
#: when there are fewer tiles), each summed in tile order, then added in slot order: a fixed
#: order that depends on the shape alone, not on how many threads run the slots.
SLOTS = 8


def finite(w) -> bool:
    """Whether every weight is finite (0.19 ms for 2.4M float32 values; one np.sum 0.38)."""
    return bool(np.isfinite(w).all())


def flipped_matrix(g: Geom, w: np.ndarray, channels_last=None) -> np.ndarray:
    """The weight matrix of that convolution, whose kernel is w with each group's (Kg, Cg)
    block transposed and every tap flipped, in one copy: channels-first (G, Cg, Kg * taps),
    channels-last (G, taps * Kg, Cg), as :func:`._im2col.forward` multiplies them (and
    :func:`._implicit.forward`, with ``channels_last`` True, in either layout)."""
    flipped = w.reshape((g.groups, g.kg, g.cg, g.taps))[..., ::-1]
    if g.channels_last if channels_last is None else channels_last:
        return relayout(flipped.transpose(0, 3, 1, 2), 2).reshape(g.groups, -1, g.cg)
    return relayout(flipped.transpose(0, 2, 1, 3), 1).reshape(g.groups, g.cg, -1)


#: Partials of at most this many values are summed on the calling thread: waking the
#: OpenMP threads costs more than such a sum (docs/cpu-algorithms.md, "Thresholds").
PARALLEL_SUM_ABOVE = 2**18


def sums_kernel(kernel, values: int):
    """``kernel`` (a parallel kernel summing partials) for partials of ``values`` values in
    all, or its one-thread twin up to PARALLEL_SUM_ABOVE of them."""
    return kernel if values > PARALLEL_SUM_ABOVE else serial_version(kernel)


def add_partials(partial, total) -> None:
    """total = partial[0] + partial[1] + ... (the same order on one thread or several)."""
    sums_kernel(sum_partials, partial.size)(partial, total)


def summed_taps_last(partials: np.ndarray) -> np.ndarray:
    """``partials[0] + partials[1] + ...`` (S, K, taps, Cg) in that order (as
    :func:`add_partials`), as a new (K, Cg, taps) array: channels-last weight-gradient sums
    added and laid out as the weight in one pass, in place of NumPy's sum and relayout
    (figures: docs/cpu-algorithms.md, "`im2col`: transposed weight-gradient products")."""
    slots, rows, taps, channels = partials.shape
    partials = np.ascontiguousarray(partials)
    total = np.empty((rows, channels, taps), partials.dtype)
    if total.size:
        sums_kernel(sum_taps_last, partials.size)(partials.reshape(-1), total.reshape(-1),
                                                  slots, rows, taps, channels)
    return total


def summed(partials: np.ndarray, transpose: bool = False) -> np.ndarray:
    """``partials[0] + partials[1] + ...`` in that order (as :func:`add_partials`), its last
    two axes swapped when ``transpose`` (a weight gradient multiplied transposed), in one
    pass; a new C-contiguous array, or ``partials[0]`` itself when there is nothing to add
    or swap."""
    from ._microkernel import vector_lanes
    slots = partials.shape[0]
    if not transpose:
        # NumPy's add on this thread: a parallel region woken here cost more than it saved
        # (docs/cpu-algorithms.md, "`im2col`: transposed weight-gradient products").
        return partials[0] if slots == 1 else sum_in_order(partials)
    partials = np.ascontiguousarray(partials)
    *batch, rows, columns = partials.shape[1:]
    total = np.empty((*batch, columns, rows), partials.dtype)
    if total.size:
        sums_kernel(transposed_sum, partials.size)(
            partials.reshape(-1), total.reshape(-1), slots, total.size // (rows * columns),
            rows, columns, vector_lanes(partials.dtype))
    return total


#: Outputs of at least this many values get their bias in a Numba pass on the tile workers
#: (NumPy's add is one thread; a parallel region would leave OpenMP threads spinning);
#: measurements in docs/cpu-algorithms.md, "Thresholds".
PARALLEL_BIAS_FROM = 2**16


def add_channel_vector(g: Geom, a: np.ndarray, v: np.ndarray, channels_last: bool) -> None:
    """a += v along the channel axis (bias); a C-contiguous (the backend's outputs are)."""
    channels = v.shape[0]
    if a.size < PARALLEL_BIAS_FROM:
        if channels_last:
            a.reshape(-1, channels)[...] += v
        else:
            a.reshape(a.shape[0], channels, -1)[...] += v[:, None]
        return
    # Channels-last rows are pixels (+= v); channels-first rows are planes (+= v[plane % K]).
    rows, kernel = ((a.reshape(-1, channels), add_row_vector) if channels_last else
                    (a.reshape(a.shape[0] * channels, -1), add_row_scalars))

    def add(span, pick):
        pick(kernel)(rows[span[0]:span[1]], v, span[0])

    run_tiles(add, worker_ranges(rows.shape[0]))
