"""The machine a benchmark ran on: its GEMM peak (each row's GFLOP/s is read as a fraction
of it), its copy rate (a memory-bound row's time is read as a fraction of a copy's), the
environment record (versions, CPU, thread pools, the variables that change what is
measured), which BLAS kernel ran and whether ``OPENBLAS_CORETYPE`` forced an older one."""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
from typing import Iterable, Optional

import numpy as np

from . import dispatch
from .bench_cases import ENV_VARS
from .bench_timing import time_call


def gemm_name(dtype: str) -> str:
    """``"SGEMM"`` for float32, ``"DGEMM"`` for float64 (what :func:`gemm_peak` measures)."""
    return {"float32": "SGEMM", "float64": "DGEMM"}.get(str(dtype), f"GEMM ({dtype})")


def gemm_peak(size: int = 2048, dtype: str = "float32", *, repeat: int = 5) -> dict:
    """The GFLOP/s of NumPy's BLAS on a square matrix product: the machine's practical peak.

    Times ``np.matmul(a, b, out=c)`` on ``size x size`` matrices (an output buffer, so that
    no allocation is timed), under whatever thread limits are in force: call it where the
    benchmarks run, with the same BLAS threads, so that each row's fraction of this peak
    means something.

    Parameters
    ----------
    size : int
        Rows and columns of both matrices.
    dtype : str
    repeat : int
        Samples. The peak is the best of them: noise only ever slows a product down, and
        the median was not robust to it (a run here measured a median of 163 ms, half its
        samples slowed, where the best was 84 ms and other runs' medians 86-88 ms).

    Returns
    -------
    dict
        ``name`` (``"SGEMM"``...), ``size``, ``dtype``, ``flops`` (``2 * size**3``),
        ``median_s``, ``best_s``, ``gflops`` (from the best), ``repeat``, ``number``.
    """
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size)).astype(dtype)
    b = rng.standard_normal((size, size)).astype(dtype)
    c = np.empty((size, size), dtype)
    timing = time_call(lambda: np.matmul(a, b, out=c), repeat=repeat)
    work = 2 * size ** 3
    return dict(name=gemm_name(dtype), size=size, dtype=str(np.dtype(dtype)), flops=work,
                median_s=timing.median, best_s=timing.best,
                gflops=work / timing.best / 1e9, repeat=timing.repeat,
                number=timing.number)


@functools.lru_cache(maxsize=None)
def _copy_kernel():
    """The parallel copy of :func:`copy_seconds`, compiled on first use (so that importing
    the bench loads no Numba: the ``reference`` engine's process runs without it)."""
    from numba import prange

    from .config import parallel_jit

    @parallel_jit
    def copy_runs(src, dst, runs):
        """dst[:] = src[:] in ``runs`` contiguous runs, one per prange iteration."""
        size = src.size
        for i in prange(runs):
            lo, hi = size * i // runs, size * (i + 1) // runs
            dst[lo:hi] = src[lo:hi]

    return copy_runs


def copy_seconds(nbytes: int, *, threads: Optional[int] = None, repeat: int = 5) -> float:
    """The best time of a parallel copy that moves ``nbytes``: ``nbytes / 2`` read from one
    buffer and written into another, in one contiguous run per thread (Numba's threads,
    ``threads`` of them when given). The floor of an op that must move that many bytes,
    measured at its own size (a copy that fits in the last-level cache runs several times
    faster than one that does not).

    Parameters
    ----------
    nbytes : int
        Bytes moved (read and written together), at least 2.
    threads : int, optional
        Numba threads for the copy; by default Numba's setting.
    repeat : int
        Samples; the best is kept, as :func:`gemm_peak` keeps its best.

    Returns
    -------
    float
        Seconds.
    """
    import numba
    if nbytes < 2:
        raise ValueError(f"nbytes: expected at least 2, got {nbytes}")
    src = np.ones(nbytes // 2, np.uint8)
    dst = np.empty_like(src)
    before = numba.get_num_threads()
    runs = min(threads, numba.config.NUMBA_NUM_THREADS) if threads else before
    numba.set_num_threads(runs)
    try:
        kernel = _copy_kernel()
        return time_call(lambda: kernel(src, dst, runs), repeat=repeat).best
    finally:
        numba.set_num_threads(before)


# --- environment -------------------------------------------------------------------------

def threadpools() -> Optional[list]:
    """threadpoolctl's view of the loaded BLAS and OpenMP libraries, or None without it.

    Only libraries already loaded appear: NumPy's BLAS always (numbaconv imports NumPy),
    PyTorch's only once it has been imported.
    """
    try:
        import threadpoolctl
    except ImportError:
        return None
    return threadpoolctl.threadpool_info()


def blas_limits(threads: int):
    """A context limiting BLAS to ``threads`` (a no-op without threadpoolctl)."""
    import contextlib
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=threads, user_api="blas")


def environment() -> dict:
    """Versions, threading and BLAS configuration: what a benchmark result depends on.

    Returns
    -------
    dict
        JSON-serialisable. ``threadpools`` is None when threadpoolctl is not installed;
        ``numba_threading_layer_launched`` is None until a parallel kernel has run;
        ``blas`` is :func:`blas_info` (NumPy's BLAS library and kernel).
    """
    import llvmlite
    import numba

    from . import __version__
    try:
        launched = numba.threading_layer()
    except ValueError:  # raised until the first parallel region starts the thread pool
        launched = None
    try:
        import threadpoolctl
        tpc_version = threadpoolctl.__version__
    except ImportError:
        tpc_version = None
    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable_cpus = os.cpu_count()
    pools = threadpools()
    return dict(
        numbaconv=__version__,
        python=platform.python_version(),
        python_executable=sys.executable,
        platform=platform.platform(),
        machine=platform.machine(),
        processor=dispatch.cpu_model(),
        cpu_count=os.cpu_count(),
        usable_cpus=usable_cpus,
        numpy=np.__version__,
        numba=numba.__version__,
        llvmlite=llvmlite.__version__,
        numba_threading_layer=numba.config.THREADING_LAYER,
        numba_threading_layer_launched=launched,
        numba_num_threads=numba.config.NUMBA_NUM_THREADS,
        threadpoolctl=tpc_version,
        threadpools=pools,
        blas=blas_info(pools),
        env={name: os.environ.get(name) for name in ENV_VARS},
    )


def describe_threadpools(pools: Optional[list]) -> list:
    """One human-readable line per threadpoolctl entry (or one saying it is missing)."""
    if pools is None:
        return ["threadpoolctl is not installed: BLAS unknown (pip install threadpoolctl)"]
    if not pools:
        return ["no BLAS or OpenMP library found by threadpoolctl"]
    lines = []
    for p in pools:
        arch = p.get("architecture") or p.get("corename")
        extra = f", architecture {arch}" if arch else ""
        layer = p.get("threading_layer")
        extra += f", threading {layer}" if layer else ""
        version = f" {p['version']}" if p.get("version") else ""
        lines.append(f"{p.get('user_api')}: {p.get('internal_api')}{version}{extra}, "
                     f"{p.get('num_threads')} threads ({p.get('filepath')})")
    return lines


def blas_info(pools: Optional[list] = None) -> Optional[dict]:
    """NumPy's BLAS as threadpoolctl reports it: library, version, kernel and threads.

    Parameters
    ----------
    pools : list, optional
        ``threadpoolctl.threadpool_info()``; taken now when omitted.

    Returns
    -------
    dict or None
        ``library`` (threadpoolctl's ``internal_api``: ``"openblas"``, ``"mkl"``...),
        ``version``, ``kernel`` (the CPU-specific code path in use: OpenBLAS's
        ``architecture``, such as ``"Haswell"`` or ``"SkylakeX"``; None where the library does
        not say), ``threads``, ``threading_layer`` and ``filepath``. None without
        threadpoolctl or when no BLAS is loaded.
    """
    if pools is None:
        pools = threadpools()
    blas = [p for p in pools or () if p.get("user_api") == "blas"]
    if not blas:
        return None

    def folder(p):
        return os.path.normcase(os.path.dirname(p.get("filepath") or ""))

    # Several BLAS libraries may be loaded (PyTorch brings its own); NumPy's wheels keep
    # theirs in numpy.libs or numpy/.libs, and anything else beats a library of PyTorch's.
    chosen = (next((p for p in blas if "numpy" in folder(p)), None)
              or next((p for p in blas if "torch" not in folder(p)), None) or blas[0])
    return dict(library=chosen.get("internal_api"), version=chosen.get("version"),
                kernel=chosen.get("architecture") or chosen.get("corename"),
                threads=chosen.get("num_threads"),
                threading_layer=chosen.get("threading_layer"),
                filepath=chosen.get("filepath"))


#: OpenBLAS's x86-64 kernels (the names ``OPENBLAS_CORETYPE`` takes and threadpoolctl
#: reports, lower-cased) by the newest instruction set they use: :data:`ISA_NAMES` indices.
OPENBLAS_KERNEL_ISA = {
    **dict.fromkeys(("prescott", "core2", "penryn", "dunnington", "nehalem", "atom",
                     "opteron", "opteron_sse3", "barcelona", "bobcat", "nano"), 0),
    **dict.fromkeys(("sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"),
                    1),
    **dict.fromkeys(("haswell", "zen"), 2),
    **dict.fromkeys(("skylakex", "cooperlake", "sapphirerapids"), 3),
}

#: Instruction-set levels of :data:`OPENBLAS_KERNEL_ISA` and :func:`cpu_isa_level`.
ISA_NAMES = ("SSE", "AVX", "AVX2", "AVX-512")


def cpu_isa_level(flags: Optional[Iterable[str]] = None) -> Optional[int]:
    """The newest x86 vector instruction set of this CPU, as an index of :data:`ISA_NAMES`.

    Parameters
    ----------
    flags : iterable of str, optional
        CPU feature flags as Linux's ``/proc/cpuinfo`` names them; read from there when
        omitted.

    Returns
    -------
    int or None
        None where the flags cannot be read (not Linux) or name no x86 vector set.
    """
    if flags is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                line = next((ln for ln in f if ln.startswith("flags")), "")
        except OSError:
            return None
        flags = line.partition(":")[2].split()
    flags = set(flags)
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:  # what OpenBLAS's SkylakeX kernel needs
        return 3
    if {"avx2", "fma"} <= flags:
        return 2
    if "avx" in flags:
        return 1
    return 0 if "sse2" in flags else None


def openblas_natural_kernel(timeout: float = 60.0) -> Optional[str]:
    """The kernel NumPy's OpenBLAS picks on this CPU by itself, with OPENBLAS_CORETYPE unset.

    Asks a fresh interpreter (``sys.executable``, with ``OPENBLAS_CORETYPE`` removed from
    its environment), since OpenBLAS reads the variable once, when it loads. None when that
    cannot tell (no threadpoolctl, no OpenBLAS, the interpreter failed).
    """
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    code = ("import json, numpy, threadpoolctl; "
            "print(json.dumps(threadpoolctl.threadpool_info()))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=timeout)
        info = blas_info(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    if info is None or info["library"] != "openblas":
        return None
    return info["kernel"]


def openblas_coretype_warning(coretype: Optional[str], in_use: Optional[str] = None,
                              natural: Optional[str] = None,
                              cpu_level: Optional[int] = None) -> Optional[str]:
    """A warning when ``OPENBLAS_CORETYPE`` makes OpenBLAS run an older kernel than it would.

    Old OpenBLAS releases misdetected some CPUs, and ``OPENBLAS_CORETYPE`` (often
    ``Haswell``) was the workaround; a current OpenBLAS forced that way runs without, say,
    its AVX-512 kernels, at as little as half the speed, so every BLAS-bound timing and the
    SGEMM peak would understate the machine.

    Parameters
    ----------
    coretype : str or None
        The variable's value (None or empty: not set, no warning).
    in_use : str, optional
        The kernel OpenBLAS runs now (:func:`blas_info`'s ``kernel``); ``coretype`` if
        omitted.
    natural : str, optional
        The kernel OpenBLAS picks without the variable (:func:`openblas_natural_kernel`).
    cpu_level : int, optional
        :func:`cpu_isa_level`, the fallback when ``natural`` is unknown.

    Returns
    -------
    str or None
        The warning, or None when the forced kernel is not older than the CPU allows (or
        that cannot be told).
    """
    if not coretype or not coretype.strip():
        return None
    forced = (in_use or coretype).strip()
    forced_level = OPENBLAS_KERNEL_ISA.get(forced.lower())
    if forced_level is None:
        return None  # not an x86 kernel name we know: no grounds to call it old
    if natural is not None:
        natural_level = OPENBLAS_KERNEL_ISA.get(natural.lower())
        if natural_level is None or natural_level <= forced_level:
            return None
        better = f"the {natural} kernel ({ISA_NAMES[natural_level]}) it picks for this CPU " \
                 f"by itself"
    elif cpu_level is not None and cpu_level > forced_level:
        better = f"what this CPU supports ({ISA_NAMES[cpu_level]})"
    else:
        return None
    return (f"OPENBLAS_CORETYPE={coretype} forces OpenBLAS's {forced} kernel "
            f"({ISA_NAMES[forced_level]}), older than {better}: BLAS-bound timings and the "
            f"SGEMM peak understate this machine. For figures worth comparing, unset it for "
            f"this command: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE numbaconv bench ...")
