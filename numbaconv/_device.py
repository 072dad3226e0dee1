"""Device arrays without a backend: Numba's CUDA module, imported only when called, viewing
any ``__cuda_array_interface__`` object as a Numba device array.

Shared by the public functions (which allocate and fill device reserves) and the ``cuda``
backend, so neither reaches into the other. Nothing here imports numba.cuda at import time.
"""

from __future__ import annotations

import numpy as np


def _cuda():
    from numba import cuda
    return cuda


def simulated() -> bool:
    """Whether Numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1 before import). Fixed
    once numba.cuda is imported (it chooses the simulator or the driver then), so it is
    worked out once: the drivers ask several times a call."""
    global _SIMULATED
    if _SIMULATED is None:
        cuda = _cuda()
        _SIMULATED = bool(getattr(cuda, "simulator_enabled", False)
                          or getattr(getattr(cuda, "config", None), "ENABLE_CUDASIM", 0))
    return _SIMULATED


_SIMULATED = None


def as_device(a):
    """A Numba device array sharing ``a``'s memory (no copy)."""
    if a is None or getattr(a, "__cuda_ndarray__", False):
        return a
    return _cuda().as_cuda_array(a)


def device_array(shape, dtype):
    return _cuda().device_array(tuple(shape), np.dtype(dtype))
