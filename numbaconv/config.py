"""Compiler options for every Numba kernel, in one place, and the table of numbaconv's
environment variables (``numbaconv info`` lists every variable named in it, through
:func:`documented_variables`).

Read by the dispatcher on every call (see :mod:`numbaconv.dispatch`):

``NUMBACONV_BACKEND``
    Comma-separated backend names: only these, in this order (as ``use_backend``).
``NUMBACONV_AUTOTUNE``
    ``1`` times every algorithm once per problem and remembers the fastest (as
    ``set_autotune(True)``); ``0`` (default) takes the heuristic's choice.
``NUMBACONV_CACHE_DIR``
    numbaconv's cache directory (default: the user cache directory, ``$XDG_CACHE_HOME`` or
    ``~/.cache`` + ``numbaconv`` on Linux): the autotune cache, and the compiled kernels
    when the package directory is read-only (see :func:`kernel_cache_dir`).

Read once, at first use, from the environment:

``NUMBACONV_JIT_CACHE``
    ``1`` (default) stores compiled kernels in Numba's on-disk cache (``__pycache__`` next to
    the modules when that is writable, else under ``NUMBACONV_CACHE_DIR``; ``NUMBA_CACHE_DIR``
    overrides both), cutting first-call latency in later processes;
    ``0`` disables it. Known pitfalls of Numba's cache: stale entries after editing a module
    that a cached kernel inlines from another file, and races between processes compiling
    the same kernel at once; switch it off if you hit them. The CUDA convolution GEMMs are
    generated per tile and layout; their sources and compiled kernels go to ``cuda/`` under
    :func:`user_cache_dir` (``NUMBACONV_CACHE_DIR``, else the user cache directory).
``NUMBACONV_OMP_PASSIVE``
    ``1`` (default): unless ``OMP_WAIT_POLICY`` is already set, set it to ``PASSIVE`` before
    Numba starts its OpenMP thread pool, so that Numba's idle threads sleep instead of
    spinning. On small machines spinning OpenMP threads steal the cores from NumPy's BLAS
    threads that run between two of our kernels; measured on 2 cores, the channels-last
    3x3 convolution of ResNet's 56x56 64-channel layer took 15.6 ms spinning and 11.3 ms
    passive. This sets a process-wide variable (read by any OpenMP runtime loaded later);
    ``0`` leaves the environment alone. It comes too late for a runtime that another
    library loaded first: after ``import torch`` (whose GNU OpenMP then also served
    Numba's parallel regions), a parallel kernel launched just before the tile workers left
    a thread spinning beside them (ResNet's stride-2 128-channel 56x56 data gradient,
    channels-last: 15.8 ms, against 10.9 ms without torch or with ``OMP_WAIT_POLICY=PASSIVE``
    set before Python started). So the GEMM-based algorithms launch their kernels from the
    tile workers only; set the variable yourself to keep such a runtime from spinning.
``NUMBACONV_ADAPT_THREADS``
    ``1`` (default): on Linux, each ``cpu`` call reads how busy other processes kept this
    process's CPUs over the last quarter of a second (``/proc/stat``) and runs on fewer
    threads while they leave fewer cores free than Numba's thread count (a parallel region
    waits for its slowest thread, and a descheduled one costs a time slice). Weight and bias
    gradients and the recurrent ops give the same bits either way; a forward or data
    gradient may change in its last bits. ``0`` keeps the thread count. Read on every call.
``NUMBACONV_CUDA_THREADS``, ``NUMBACONV_CUDA_TILE``
    Override :data:`CUDA_THREADS_PER_BLOCK` (a power of two) and :data:`CUDA_TILE`
    (``"rows,columns,step"``, the RNN products' tile). The simulator tests set them small,
    so that last blocks are partly filled; results do not depend on them beyond rounding.
``NUMBACONV_CUDA_GEMM_TILE``
    ``"bm,bn,bk,tm,tn"``: the tile of every CUDA convolution GEMM (block ``bm x bn``, step
    ``bk``, ``tm x tn`` outputs a thread) instead of the one chosen per shape; the simulator
    tests force tiny ones. The weight gradient's split follows the tile, so its bits do too.
``NUMBACONV_CUDA_CUBLAS``
    ``1`` (default): the ``cuda`` backend's recurrent ops run their matrix products through
    cuBLAS where it loads (nvmath-python's bindings, else CuPy's; see docs/cuda.md), else
    through numbaconv's Numba ``gemm`` kernel; ``0`` always takes the Numba kernel. Read at
    the first product.
``NUMBACONV_CUDA_TF32``
    ``0`` (default): float32 products on a GPU use IEEE float32 arithmetic (cuBLAS's default
    math mode, which never rounds operands to TF32, and FFMA in numbaconv's own kernels);
    ``1`` allows TF32 tensor-core math on Ampere and later, like PyTorch's ``allow_tf32``:
    cuBLAS's ``CUBLAS_TF32_TENSOR_OP_MATH`` for the recurrent ops, and ``mma.sync`` TF32
    products in the ``implicit_gemm`` convolution kernels (forward, data and weight
    gradients), with operands rounded to 10 mantissa bits (errors of 1e-4 to 1e-3 relative
    to the largest output; docs/cuda.md). Read on every product and every convolution call.
``NUMBACONV_CUDA_SHORT_LAUNCH``
    ``1`` (default): the ``cuda`` backend launches its convolution GEMM and depthwise kernels
    and its recurrent step kernels by handing cuda.core the arguments Numba would build,
    without Numba's per-launch dispatch and conversions (numbaconv/cuda/_launch.py); ``0``
    launches them all through ``kernel[grid, block]``. Read at each kernel's (or step loop's)
    first launch.
``NUMBACONV_FASTMATH``
    ``1`` (default) lets LLVM reassociate and contract (FMA) floating-point arithmetic, which
    vectorises reductions. NaN and infinity semantics are kept (no ``nnan``/``ninf``): a NaN
    in the input propagates to the gradients exactly as in the reference.
``NUMBACONV_LLVM_OPT``
    LLVM's optimisation level for numbaconv's CPU kernels, ``0`` to ``3``; default ``2``
    (Numba's own default is 3, which took half as long again to compile the largest
    kernels, for no measured speed). Where ``NUMBA_OPT`` is set, Numba's setting applies.
``NUMBACONV_WINOGRAD``
    ``1`` (default): the cpu backend offers, and chooses for the layers it suits, its
    ``winograd`` algorithm (2D 3x3 convolutions of stride 1: the forward and the data and
    weight gradients, 1.3-2.2x faster on ResNet's layers, float32 errors of the same order
    as im2col's); ``0`` takes it off the table, for results summed as the reference sums.
    Read when an algorithm is chosen for a new problem shape (choices are remembered per
    shape).
"""

from __future__ import annotations

import functools
import math
import os
import sys
import warnings
import weakref
from typing import Optional

#: LLVM fast-math flags: everything but the ones that assume no NaN or infinity.
FASTMATH_FLAGS = frozenset({"nsz", "arcp", "contract", "afn", "reassoc"})

#: CUDA threads per block for element-wise kernels (a multiple of the warp size).
CUDA_THREADS_PER_BLOCK = 256

#: CUDA implicit-GEMM tile: (output rows, output columns, reduction step) per block; the
#: block has rows x columns threads, one output each.
CUDA_TILE = (16, 16, 16)


def documented_variables() -> tuple:
    """The environment variables this module's docstring documents, in its order: the one
    list that ``numbaconv info`` prints (a test keeps the README's table the same)."""
    import re
    doc = __doc__
    if doc is None:  # python -OO strips docstrings: read it from the source
        import ast
        with open(__file__, encoding="utf-8") as source:
            doc = ast.get_docstring(ast.parse(source.read())) or ""
    names = re.findall(r"^``(NUMBACONV_\w+)``((?:, ``NUMBACONV_\w+``)*)$", doc, re.M)
    found = []
    for first, rest in names:
        found.append(first)
        found += re.findall(r"``(NUMBACONV_\w+)``", rest)
    return tuple(dict.fromkeys(found))


def _flag(name: str, default: bool) -> bool:
    raw = environ_value(name).strip()  # read per call by some (NUMBACONV_CUDA_TF32)
    if raw == "":
        return default
    if raw in ("0", "1"):
        return raw == "1"
    raise ValueError(f"{name}: expected '0' or '1', got {raw!r}")


def winograd_enabled() -> bool:
    """``NUMBACONV_WINOGRAD`` (default 1): whether the cpu backend offers and chooses its
    ``winograd`` algorithm, read when an algorithm is chosen for a new problem."""
    return _flag("NUMBACONV_WINOGRAD", True)


def _environ_reader():
    """A function giving an environment variable's value, or "" where it is unset."""
    data, encode, decode = (getattr(os.environ, a, None)
                            for a in ("_data", "encodekey", "decodevalue"))
    if not isinstance(data, dict) or encode is None or decode is None:
        return lambda name: os.environ.get(name, "")
    keys: dict = {}

    def read(name: str) -> str:
        key = keys.get(name)
        if key is None:
            key = keys[name] = encode(name)
        value = data.get(key)
        return "" if value is None else decode(value)

    return read


#: ``environ_value(name)``: ``os.environ.get(name, "")`` without the key's encoding and the
#: KeyError of an unset variable on every read (1.2 -> 0.2 us): the dispatcher reads two
#: variables on every call. It reads ``os.environ``'s own mapping, which assignments to
#: ``os.environ`` (and pytest's ``monkeypatch.setenv``) keep current, as ``os.environ.get``
#: does; plain ``os.environ.get`` where that mapping is not CPython's.
environ_value = _environ_reader()


def _cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup",
                      root: str = "/sys/fs/cgroup") -> Optional[float]:
    """The CPU quota of this process's cgroups in CPUs (quota / period, the smallest along
    the hierarchy, v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), or None where there is none
    or it cannot be read (not Linux, no cgroup file system)."""
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":                          # v2: cpu.max in the unified tree
            candidates = [(os.path.join(root, "unified"), "v2"), (root, "v2")]
        elif "cpu" in controllers.split(","):
            names = dict.fromkeys((controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"))
            candidates = [(os.path.join(root, name), "v1") for name in names]
        else:
            continue
        for base, version in candidates:
            directory = os.path.join(base, path.lstrip("/"))
            while directory.startswith(base) and os.path.isdir(directory):
                limit = _cgroup_dir_limit(directory, version)
                if limit is not None:
                    limits.append(limit)
                if directory == base:
                    break
                directory = os.path.dirname(directory)
    return min(limits) if limits else None


def _cgroup_dir_limit(directory: str, version: str) -> Optional[float]:
    try:
        if version == "v2":
            with open(os.path.join(directory, "cpu.max"), encoding="utf-8") as f:
                quota, period = (f.read().split() + ["100000"])[:2]
        else:
            with open(os.path.join(directory, "cpu.cfs_quota_us"), encoding="utf-8") as f:
                quota = f.read().strip()
            with open(os.path.join(directory, "cpu.cfs_period_us"), encoding="utf-8") as f:
                period = f.read().strip()
        if quota in ("max", "-1") or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def available_cpus() -> tuple:
    """(CPUs this process may use, why): the CPUs of its affinity mask (``taskset``,
    ``os.sched_setaffinity``), fewer where a cgroup CPU quota (a container's ``--cpus``, a
    pod's CPU limit) allows less, rounded up."""
    try:
        count = len(os.sched_getaffinity(0))
        why = f"{count} CPUs in this process's affinity mask"
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
        why = f"{count} CPUs (os.cpu_count)"
    quota = _cgroup_cpu_limit()
    if quota is not None and math.ceil(quota) < count:
        count = max(1, math.ceil(quota))
        why += f", cut to {count} by a cgroup CPU quota of {quota:g} CPUs"
    return count, why


#: What :func:`configure_threading` decided about Numba's thread count, for ``numbaconv info``.
thread_decision = ""


def configure_threading() -> None:
    """Apply ``NUMBACONV_OMP_PASSIVE`` (see the module docstring), and fit Numba's thread
    count to :func:`available_cpus` unless ``NUMBA_NUM_THREADS`` is set; idempotent.

    Warns when it comes too late: Numba's OpenMP pool was already started (by the program's
    own parallel Numba code) with active waiting. Measured here, that makes numbaconv's
    GEMM-based kernels up to 20 times slower on 2 cores.
    """
    _fit_numba_threads()
    if not _flag("NUMBACONV_OMP_PASSIVE", True) or "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    from numba.np.ufunc import parallel
    if getattr(parallel, "_is_initialized", False) and parallel._threading_layer == "omp":
        warnings.warn("numbaconv: Numba's OpenMP threads were started before numbaconv could "
                      "set OMP_WAIT_POLICY=PASSIVE; their spinning competes with BLAS "
                      "threads and can slow convolutions many times over. Set "
                      "OMP_WAIT_POLICY=PASSIVE in the environment (or use another Numba "
                      "threading layer).", RuntimeWarning, stacklevel=3)


def _fit_numba_threads() -> None:
    """Numba sizes its thread pool by the affinity mask, not by a cgroup CPU quota: in a
    container limited to 2 CPUs on a 64-core host it would start 64 threads a parallel
    region. Lowered here, before the pool starts, unless the user set NUMBA_NUM_THREADS."""
    global thread_decision
    if thread_decision:
        return
    import numba
    from numba.np.ufunc import parallel
    if "NUMBA_NUM_THREADS" in os.environ:
        thread_decision = f"{numba.config.NUMBA_NUM_THREADS} (NUMBA_NUM_THREADS is set)"
        return
    count, why = available_cpus()
    if count < numba.config.NUMBA_NUM_THREADS and not getattr(parallel, "_is_initialized",
                                                              False):
        # The environment variable survives Numba's config reloads; the pool's size and
        # set_num_threads' bound were read from the config when Numba was imported.
        os.environ["NUMBA_NUM_THREADS"] = str(count)
        numba.config.NUMBA_NUM_THREADS = count
        if hasattr(parallel, "NUM_THREADS") and hasattr(parallel, "gen_snt_check"):
            parallel.NUM_THREADS = count
            parallel.snt_check = parallel.gen_snt_check()
    thread_decision = f"{numba.config.NUMBA_NUM_THREADS} ({why})"


def jit_cache() -> bool:
    """Whether compiled kernels go to Numba's on-disk cache (NUMBACONV_JIT_CACHE)."""
    return _flag("NUMBACONV_JIT_CACHE", True)


@functools.lru_cache(maxsize=None)
def jit_options(parallel: bool = True) -> dict:
    """Keyword arguments for ``numba.njit`` used by every CPU kernel.

    Kernel modules call this at import, before any kernel runs, which is also when the
    threading configuration is applied and numbaconv's kernel cache locator installed
    (:func:`kernel_cache_location`).
    """
    configure_threading()
    fastmath = set(FASTMATH_FLAGS) if _flag("NUMBACONV_FASTMATH", True) else False
    return dict(parallel=parallel, cache=_kernel_cache_enabled(),
                fastmath=fastmath, nogil=True, error_model="numpy")


# --- where compiled kernels are cached -------------------------------------------------------
#
# Numba files a ``cache=True`` function's compilations with the first of its cache locators
# that finds a writable directory: ``NUMBA_CACHE_DIR``, then ``__pycache__`` next to the
# source, then ``~/.cache/numba``. In a read-only install (site-packages owned by root, a
# Docker image run as another user) the second fails, and the third may too (no home
# directory), which makes Numba raise at decoration, that is at a kernel module's import. So
# numbaconv adds, for its own source files only, a locator between the second and the third:
# ``kernels`` under numbaconv's cache directory (``NUMBACONV_CACHE_DIR``, else the user cache
# directory), and turns caching off, with a warning, where no locator finds a directory.

#: Under :func:`user_cache_dir`, where kernels go when the package directory is read-only.
KERNEL_CACHE_SUBDIR = "kernels"

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def user_cache_dir() -> str:
    """``NUMBACONV_CACHE_DIR``, else the platform's user cache directory + ``numbaconv``.

    ``$XDG_CACHE_HOME/numbaconv`` or ``~/.cache/numbaconv`` on Linux and other POSIX
    systems, ``~/Library/Caches/numbaconv`` on macOS, ``%LOCALAPPDATA%\\numbaconv`` on
    Windows. ``~`` in ``NUMBACONV_CACHE_DIR`` is expanded.
    """
    env = os.environ.get("NUMBACONV_CACHE_DIR", "").strip()
    if env:
        return os.path.expanduser(env)
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or os.path.expanduser("~\\AppData\\Local")
    elif sys.platform == "darwin":
        base = os.path.expanduser("~/Library/Caches")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "numbaconv")


def kernel_cache_dir() -> str:
    """Where numbaconv's kernels are cached when neither ``NUMBA_CACHE_DIR`` is set nor the
    package directory is writable: ``kernels`` under :func:`user_cache_dir`."""
    return os.path.join(user_cache_dir(), KERNEL_CACHE_SUBDIR)


def sources_stamp(folder: str) -> tuple:
    """(name, modification time, size) of every ``.py`` file in ``folder``, in name order.

    Part of the stamp a cached kernel is filed under (see :func:`_install_kernel_cache_locator`):
    a kernel inlines helpers and micro-kernel intrinsics from its neighbour modules
    (``cpu/_microkernel.py``'s ``stream_block`` into ``cpu/_gemm.py``'s kernel), and Numba's
    own stamp, of the kernel's file alone, would load a compilation made before a neighbour
    changed (after a ``git pull`` or a branch switch in an editable install: the old code,
    silently)."""
    entries = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            st = os.stat(os.path.join(folder, name))
            entries.append((name, st.st_mtime, st.st_size))
    return tuple(entries)


def _install_kernel_cache_locator():
    """Add numbaconv's locators to Numba's list (once); returns the one for read-only
    installs, or None where this Numba lacks the classes they build on (Numba's own locators
    then decide alone).

    Both file numbaconv's kernels with a stamp of every module beside the kernel's
    (:func:`sources_stamp`) as well as Numba's: the in-tree one, before Numba's in-tree
    locator, caches next to the modules as Numba's does; the other, after it, under
    :func:`kernel_cache_dir`. ``NUMBA_CACHE_DIR`` and Numba's user-wide locator keep
    Numba's stamp of the kernel's file alone."""
    from numba.core import caching
    classes = caching.CacheImpl._locator_classes
    for cls in classes:
        if getattr(cls, "numbaconv", False):
            return cls
    base = getattr(caching, "_CacheLocator", None)
    mixin = getattr(caching, "_SourceFileBackedLocatorMixin", None)
    if base is None or mixin is None:
        return None

    def ours(py_file) -> bool:
        path = os.path.abspath(py_file)
        return os.path.commonpath([path, _PACKAGE_DIR]) == _PACKAGE_DIR

    class StampsNeighbours:
        def get_source_stamp(self):
            return (super().get_source_stamp(),
                    sources_stamp(os.path.dirname(os.path.abspath(self._py_file))))

    class NumbaconvCacheLocator(StampsNeighbours, mixin, base):
        """numbaconv's own kernels, cached under :func:`kernel_cache_dir`."""

        numbaconv = True

        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = os.path.join(kernel_cache_dir(),
                                            self.get_suitable_cache_subpath(py_file))

        def get_cache_path(self):
            return self._cache_path

        @classmethod
        def from_function(cls, py_func, py_file):
            if not ours(py_file):
                return None  # somebody else's function: Numba's locators decide
            return super().from_function(py_func, py_file)

    in_tree = [i for i, cls in enumerate(classes) if cls.__name__.lstrip("_") in
               ("InTreeCacheLocator", "InTreeCacheLocatorFsAgnostic")]
    if in_tree:
        class InTreeCacheLocatorNumbaconv(StampsNeighbours, classes[in_tree[0]]):
            """numbaconv's own kernels next to their modules, as Numba's in-tree locator
            files them, under the stamp of their neighbours too."""

            numbaconv_in_tree = True

            @classmethod
            def from_function(cls, py_func, py_file):
                if not ours(py_file):
                    return None
                return super().from_function(py_func, py_file)

        classes.insert(in_tree[0], InTreeCacheLocatorNumbaconv)
        in_tree = [i + 1 for i in in_tree]
    classes.insert(in_tree[0] + 1 if in_tree else len(classes), NumbaconvCacheLocator)
    return NumbaconvCacheLocator


def _sample_kernel():  # a function of this package, to ask the locators about
    pass


#: A kernel module's file: the locators are asked about it (its directory is the kernels').
_KERNEL_SOURCE = os.path.join(_PACKAGE_DIR, "cpu", "__init__.py")


def kernel_cache_location() -> tuple:
    """``(directory, how)``: where Numba caches numbaconv's kernels in this process, and
    which rule put them there; directory None when they are not cached (``how`` says why).

    Asks Numba's locators, numbaconv's included, in Numba's order, about a file of the
    package: what a kernel's ``cache=True`` will find.
    """
    if not _flag("NUMBACONV_JIT_CACHE", True):
        return None, "disabled (NUMBACONV_JIT_CACHE=0): kernels compile in every process"
    import numba
    from numba.core import caching
    ours = _install_kernel_cache_locator()
    if numba.config.CACHE_LOCATOR_CLASSES:
        return "", "chosen by NUMBA_CACHE_LOCATOR_CLASSES"
    for cls in caching.CacheImpl._locator_classes:
        try:
            locator = cls.from_function(_sample_kernel, _KERNEL_SOURCE)
        except Exception:  # an odd locator must not stop the search
            locator = None
        if locator is None:
            continue
        name = cls.__name__.lstrip("_")
        if cls is ours:
            how = ("NUMBACONV_CACHE_DIR" if os.environ.get("NUMBACONV_CACHE_DIR", "").strip()
                   else "the user cache directory") + ": the package directory is read-only"
        elif name.startswith("UserProvided"):
            how = "NUMBA_CACHE_DIR"
        elif name.startswith("InTree"):
            how = "next to the kernels' modules: the package directory is writable"
        elif name.startswith("UserWide"):
            how = "Numba's user-wide cache directory"
        else:
            how = f"Numba's {name}"
        path = locator.get_cache_path()
        if not name.startswith("InTree"):
            path = os.path.dirname(path)  # the cache root; each source directory has a child
        return path, how
    return None, ("no writable directory (tried NUMBA_CACHE_DIR, the package directory, "
                  f"{kernel_cache_dir()} and Numba's user cache): kernels compile in every "
                  "process; set NUMBACONV_CACHE_DIR to a writable directory")


def describe_kernel_cache() -> str:
    """One line for ``numbaconv info`` and ``warmup``: where the kernels are cached."""
    path, how = kernel_cache_location()
    return how if path is None else f"{path} ({how})" if path else how


def _kernel_cache_enabled() -> bool:
    """``NUMBACONV_JIT_CACHE``, and a directory to cache in (else a warning, not Numba's
    RuntimeError at a kernel module's import)."""
    if not _flag("NUMBACONV_JIT_CACHE", True):
        return False
    path, how = kernel_cache_location()
    if path is None:
        warnings.warn(f"numbaconv: Numba's kernel cache has {how}", RuntimeWarning,
                      stacklevel=4)
        return False
    return True


def parallel_jit(func):
    """``numba.njit(**jit_options())(func)``: a kernel with ``prange`` threads, registered so
    that a forked child runs its serial twin instead (see :func:`_after_fork_in_child`).

    Every parallel kernel is made here; a test checks that none is made otherwise, and that
    no compiled function calls one (a caller compiled in the parent would launch its threads
    in the child).
    """
    import numba
    kernel = _at_opt_level(numba.njit(**jit_options())(func))
    _parallel_kernels.add(kernel)
    if _serial_after_fork:
        _run_serially(kernel)
    return kernel


def serial_jit(func):
    """``numba.njit(**jit_options(parallel=False))(func)``: a kernel or helper without
    ``prange`` threads (called from other kernels, or run on one thread)."""
    import numba
    return _at_opt_level(numba.njit(**jit_options(parallel=False))(func))


def inline_jit(func):
    """:func:`serial_jit`, inlined into its callers at the Numba IR level
    (``inline="always"``)."""
    import numba
    return _at_opt_level(numba.njit(**jit_options(parallel=False), inline="always")(func))


#: LLVM's optimisation pipeline for numbaconv's kernels (Numba's default is 3): level 3
#: compiles the micro-kernel loops half as long again for no measured speed (figures in
#: docs/configuration.md, "What a first call costs").
LLVM_OPT_LEVEL = 2


def llvm_opt_level() -> Optional[int]:
    """The LLVM optimisation level numbaconv's kernels compile at: ``NUMBACONV_LLVM_OPT``,
    else :data:`LLVM_OPT_LEVEL`; None where ``NUMBA_OPT`` is set (Numba's own setting then
    applies to every kernel)."""
    if os.environ.get("NUMBA_OPT", "").strip():
        return None
    raw = os.environ.get("NUMBACONV_LLVM_OPT", "").strip()
    if raw == "":
        return LLVM_OPT_LEVEL
    if raw not in ("0", "1", "2", "3"):
        raise ValueError(f"NUMBACONV_LLVM_OPT: expected 0, 1, 2 or 3, got {raw!r}")
    return int(raw)


def _at_opt_level(dispatcher):
    """``dispatcher`` compiling at :func:`llvm_opt_level` (Numba's ``config.OPT``, which its
    pass pipelines read at each compilation, set for the compilation only, under Numba's
    compiler lock so that no other compilation sees it). Kernels a compilation pulls in
    (callees typed on the way) compile at the same level."""
    level = llvm_opt_level()
    if level is None:
        return dispatcher
    compile_ = dispatcher.compile

    @functools.wraps(compile_)
    def compile(sig):
        from numba.core import config as numba_config
        from numba.core.compiler_lock import global_compiler_lock
        with global_compiler_lock:
            saved = numba_config.OPT
            make = getattr(numba_config, "_OptLevel", int)
            numba_config.OPT = make(level)
            try:
                return compile_(sig)
            finally:
                numba_config.OPT = saved

    dispatcher.compile = compile
    return dispatcher


@functools.lru_cache(maxsize=None)
def serial_version(kernel):
    """The one-thread compilation of the parallel kernel ``kernel`` (a Numba dispatcher),
    made once, compiled on its first call."""
    return serial_twin(kernel.py_func)


def serial_twin(func):
    """``func`` (a plain Python kernel function) compiled without ``prange`` threads.

    The twin is a copy of the function under the name ``<name>_serial``, so that Numba's
    disk cache, which files compilations by function name, keeps it apart from the
    parallel compilation of the same code.
    """
    import types

    twin = types.FunctionType(func.__code__, func.__globals__, func.__name__ + "_serial",
                              func.__defaults__, func.__closure__)
    twin.__qualname__ = twin.__name__
    compiled = serial_jit(twin)
    _serial_twins.add(compiled)
    return compiled


#: The serial twins made so far (see :func:`serial_twin`): not module attributes, so the
#: kernel cache's statistics (``numbaconv warmup``, ``bench --first-call``) find them here.
_serial_twins: "weakref.WeakSet" = weakref.WeakSet()


def serial_twins() -> list:
    """The Numba dispatchers of the serial twins made so far."""
    return list(_serial_twins)


# --- forked children -----------------------------------------------------------------------
#
# GNU OpenMP is not fork-safe: in a child forked after the parent ran a parallel region, the
# next one hangs, and Numba's omp layer terminates the child instead ("Terminating: fork()
# called from a process already using GNU OpenMP"), so a multiprocessing Pool waits forever.
# A child forked from a process whose Numba threads may be OpenMP's therefore runs every
# kernel serially: each parallel kernel forgets its compilations and sends its calls to its
# serial twin (compiled there on first use, or read from Numba's disk cache). The parent pays
# nothing: the handler runs only in the child. TBB (``pip install tbb``, then Numba picks it)
# and the workqueue layer are fork-safe: children of a process that started either keep
# their threads.

#: The parallel kernels made so far (see :func:`parallel_jit`).
_parallel_kernels: "weakref.WeakSet" = weakref.WeakSet()

#: True in a forked child whose kernels run serially.
_serial_after_fork = False


def _run_serially(kernel) -> None:
    """Send every later call of the parallel ``kernel`` to its serial twin.

    Numba's dispatcher calls ``_compile_for_args`` when no compilation matches the
    arguments, and calls what it returns with them: with the compilations cleared, that is
    every call (about 1.5 us each, in the child only).
    """
    kernel._clear()
    kernel._compile_for_args = lambda *args, **kwargs: serial_version(kernel)


def _fork_safe_threads() -> bool:
    """Whether a child forked now may run parallel regions: only if Numba's threading layer
    is started and is TBB or workqueue (an unstarted one might yet be OpenMP, and the child
    may have inherited a GNU OpenMP that another library used)."""
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    return bool(parallel is not None and getattr(parallel, "_is_initialized", False)
                and getattr(parallel, "_threading_layer", None) in ("tbb", "workqueue"))


def serial_after_fork() -> bool:
    """Whether this process is a forked child running its kernels serially."""
    return _serial_after_fork


def _after_fork_in_child() -> None:
    global _serial_after_fork
    if _serial_after_fork or _fork_safe_threads():
        return
    _serial_after_fork = True
    for kernel in list(_parallel_kernels):
        _run_serially(kernel)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _ints(name: str, default: tuple) -> tuple:
    raw = os.environ.get(name, "").strip()
    if raw == "":
        return default
    try:
        values = tuple(int(v) for v in raw.split(","))
    except ValueError:
        values = ()
    if len(values) != len(default) or any(v < 1 for v in values):
        raise ValueError(f"{name}: expected {len(default)} positive comma-separated ints, "
                         f"got {raw!r}")
    return values


@functools.lru_cache(maxsize=None)
def cuda_threads_per_block() -> int:
    """Threads per block of the CUDA element-wise and reduction kernels (a power of two)."""
    (threads,) = _ints("NUMBACONV_CUDA_THREADS", (CUDA_THREADS_PER_BLOCK,))
    if threads & (threads - 1):
        raise ValueError(f"NUMBACONV_CUDA_THREADS: expected a power of two, got {threads}")
    return threads


def cuda_gemm_tile():
    """The ``(bm, bn, bk, tm, tn)`` that NUMBACONV_CUDA_GEMM_TILE forces, or None."""
    if not os.environ.get("NUMBACONV_CUDA_GEMM_TILE", "").strip():
        return None
    return _ints("NUMBACONV_CUDA_GEMM_TILE", (0,) * 5)


def cuda_cublas() -> bool:
    """``NUMBACONV_CUDA_CUBLAS`` (default 1): whether the recurrent ops' products may use
    cuBLAS."""
    return _flag("NUMBACONV_CUDA_CUBLAS", True)


def cuda_short_launch() -> bool:
    """``NUMBACONV_CUDA_SHORT_LAUNCH`` (default 1): whether the cuda backend may launch
    kernels by its short path (numbaconv/cuda/_launch.py)."""
    return _flag("NUMBACONV_CUDA_SHORT_LAUNCH", True)


def cuda_tf32() -> bool:
    """``NUMBACONV_CUDA_TF32`` (default 0): whether float32 products on a GPU (cuBLAS's, the
    implicit-GEMM convolutions') may use TF32 tensor cores."""
    return _flag("NUMBACONV_CUDA_TF32", False)


@functools.lru_cache(maxsize=None)
def cuda_tile() -> tuple:
    """(rows, columns, step) of the CUDA implicit-GEMM tiles."""
    return _ints("NUMBACONV_CUDA_TILE", CUDA_TILE)
