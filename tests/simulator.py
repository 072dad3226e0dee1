"""Numba's CUDA simulator as the tests run it (tests/conftest.py calls :func:`prepare` in a
process started with ``NUMBA_ENABLE_CUDASIM=1``).

The simulator runs each thread of a block as a Python thread. ``cuda.shared.array`` finds
the block's array by the line that asks for it and creates it on the first ask, a lookup and
an insertion that are not atomic (numba-cuda 0.30.4, ``FakeCUDAShared.array`` in
``simulator/kernelapi.py``): two threads that both miss create two arrays, one of them is
kept, and the other thread's writes go to an array no other thread reads; they read
``np.empty``'s garbage in their place. Python's 5 ms switch interval makes that rare, not
impossible; a shorter one, which runs the simulator faster, makes it common (docs/cuda.md,
"How it is tested", has the counts). :func:`prepare` puts the lookup and the insertion under
a lock, then shortens the interval.
"""

from __future__ import annotations

import functools
import sys
import threading

#: The GIL switch interval under the simulator: a block's threads wait for the GIL at every
#: barrier, less long with a shorter interval; a thread computing alone switches more often.
SWITCH_INTERVAL_S = 5e-4


def prepare() -> None:
    """Make the simulator's shared arrays safe to create from several threads, then shorten
    the switch interval. Idempotent."""
    from numba.cuda.simulator import kernelapi

    shared = kernelapi.FakeCUDAShared
    if getattr(shared.array, "__numbaconv_locked__", False):
        return
    if not isinstance(getattr(shared(0), "_allocations", None), dict):
        return      # another simulator than the one read here: left as it is
    shared.array = _locked(shared.array, kernelapi)
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def _locked(array, kernelapi):
    """``FakeCUDAShared.array`` with its lookup and insertion under one lock. It names a
    block's array by the file and line that ask for it (one frame up); a wrapper calling the
    original would be that frame for every array, so the named arrays are looked up here,
    by ``sys._getframe`` (the original takes the whole stack, with its source lines, a call).
    The dynamic array (shape 0) and alignment (unsupported) are the original's; a Numba
    dtype is converted by the simulator's own functions (``kernelapi``'s)."""
    import numpy as np
    types, numpy_support = kernelapi.types, kernelapi.numpy_support
    lock = threading.Lock()

    @functools.wraps(array)
    def locked(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:
            return array(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            found = self._allocations.get(key)
            if found is None:
                found = self._allocations[key] = np.empty(shape, dtype)
        return found

    locked.__numbaconv_locked__ = True
    return locked
