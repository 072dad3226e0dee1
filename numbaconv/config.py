"""Compiler options for every Numba kernel, in one place.

Read once, at first use, from the environment:

``NUMBACONV_JIT_CACHE``
    ``1`` (default) stores compiled kernels in Numba's on-disk cache (``__pycache__`` next to
    the modules, or ``NUMBA_CACHE_DIR``), cutting first-call latency in later processes;
    ``0`` disables it. Known pitfalls of Numba's cache: stale entries after editing a module
    that a cached kernel inlines from another file, and races between processes compiling
    the same kernel at once; switch it off if you hit them.
``NUMBACONV_FASTMATH``
    ``1`` (default) lets LLVM reassociate and contract (FMA) floating-point arithmetic, which
    vectorises reductions. NaN and infinity semantics are kept (no ``nnan``/``ninf``): a NaN
    in the input propagates to the gradients exactly as in the reference.
"""

from __future__ import annotations

import functools
import os

#: LLVM fast-math flags: everything but the ones that assume no NaN or infinity.
FASTMATH_FLAGS = frozenset({"nsz", "arcp", "contract", "afn", "reassoc"})

#: CUDA threads per block for element-wise kernels (a multiple of the warp size).
CUDA_THREADS_PER_BLOCK = 256


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip()
    if raw == "":
        return default
    if raw in ("0", "1"):
        return raw == "1"
    raise ValueError(f"{name}: expected '0' or '1', got {raw!r}")


@functools.lru_cache(maxsize=None)
def jit_options(parallel: bool = True) -> dict:
    """Keyword arguments for ``numba.njit`` used by every CPU kernel."""
    fastmath = set(FASTMATH_FLAGS) if _flag("NUMBACONV_FASTMATH", True) else False
    return dict(parallel=parallel, cache=_flag("NUMBACONV_JIT_CACHE", True),
                fastmath=fastmath, nogil=True, error_model="numpy")
