"""Stand-ins for the GPU under the cuda backend's convolution drivers (and the recurrent
ops' element-wise kernels), so that their GPU path
(not the simulator's: device pointers and integers, the short launch path's arguments) runs
without a GPU: device arrays that are only a shape, strides and an address; allocation,
table copies and the device query; the compiled kernels (a name and a key) and their
launches, recorded instead of run.

Used by tests/test_cuda_drivers.py (what each launch is handed) and by
docs/benchmarks/cuda_host_path.py (numbaconv's own host time per call). Nothing here runs a
kernel or reads memory: what it checks or times is the drivers' Python.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import threading
import types

import numpy as np

#: Addresses handed out to stand-in device arrays: far above any small integer argument, so
#: that a pointer in a launch's arguments is recognisable.
BASE_ADDRESS = 1 << 40
_addresses = itertools.count()


class DeviceArray:
    """A device array as the drivers read one: ``__cuda_ndarray__``, shape, byte strides,
    dtype, ``device_ctypes_pointer`` and ``__cuda_array_interface__`` (built at each read,
    as Numba builds it). ``strides`` None: C-contiguous."""

    __cuda_ndarray__ = True

    def __init__(self, shape, dtype, strides=None, address=None):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        if strides is None:
            found, step = [], self.dtype.itemsize
            for n in reversed(self.shape):
                found.append(step)
                step *= n
            strides = tuple(reversed(found))
        self.strides = tuple(strides)
        self.size = int(np.prod(self.shape))
        span = max(1, self.size) * self.dtype.itemsize
        self.address = address if address is not None else \
            BASE_ADDRESS + next(_addresses) * (1 << 32)
        assert span < 1 << 32, "a stand-in array spans at most 4 GiB"
        self.stream = 0

    @property
    def device_ctypes_pointer(self):
        return ctypes.c_void_p(self.address)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "strides": self.strides, "data": (self.address, False),
                "typestr": self.dtype.str, "stream": None, "version": 3}

    def is_c_contiguous(self) -> bool:
        return self.strides == DeviceArray(self.shape, self.dtype, address=0).strides


class Kernel:
    """A compiled kernel: the name and key the drivers asked for."""

    def __init__(self, name: str, key: tuple):
        self.name, self.key = name, key

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, {self.key!r})"


class Launch:
    """One recorded launch."""

    def __init__(self, kernel: Kernel, grid, block, args: tuple):
        self.kernel, self.grid, self.block, self.args = kernel, grid, block, args

    def normalized(self, addresses: dict) -> tuple:
        """The launch with each address replaced by its order of first appearance."""
        args = tuple(("address", addresses.setdefault(a, len(addresses)))
                     if is_address(a) else a for a in self.args)
        return repr(self.kernel), self.grid, self.block, args


def is_address(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= BASE_ADDRESS


@contextlib.contextmanager
def standing_in(patch):
    """The GPU stood in while the block runs: ``patch(target, name, value)`` sets an
    attribute until the end (pytest's ``monkeypatch.setattr``, or :func:`setting`).
    Yields the list the launches are recorded in. The drivers' remembered setups (which
    hold stand-in kernels) are dropped before and after, and their device memory (tables,
    workspaces) is their own while the block runs."""
    from numba import cuda

    from numbaconv import _device
    from numbaconv.cuda import _bias, _depthwise, _implicit_gemm, _rnn_elementwise

    launches = []

    def launch(kernel, grid, block, *args):
        launches.append(Launch(kernel, grid, block, args))

    device = types.SimpleNamespace(id=0, compute_capability=(9, 0))
    patch(_device, "_SIMULATED", False)
    patch(cuda, "get_current_device", lambda: device)
    patch(cuda, "device_array",
          lambda shape, dtype=np.float64, **_: DeviceArray(
              shape if isinstance(shape, tuple) else (shape,), dtype))
    patch(cuda, "to_device", lambda a, **_: DeviceArray(np.shape(a), np.asarray(a).dtype))
    for module in (_implicit_gemm, _depthwise):
        patch(module, "kernel", functools.lru_cache(maxsize=None)(
            lambda name, *key: Kernel(name, key)))
        patch(module, "launch", launch)
    patch(_bias, "kernel", functools.lru_cache(maxsize=None)(
        lambda *key: Kernel("bias_sums", key)))
    patch(_bias, "launch", launch)
    patch(_rnn_elementwise, "kernel", functools.lru_cache(maxsize=None)(
        lambda name, *key: Kernel(f"rnn {name}", key)))
    patch(_rnn_elementwise, "launch", launch)
    patch(_implicit_gemm, "_TABLES", {})
    patch(_implicit_gemm, "_WORKSPACES", threading.local())
    _implicit_gemm.forget_setups()
    _implicit_gemm._has_mma.cache_clear()
    try:
        yield launches
    finally:
        _implicit_gemm.forget_setups()
        _implicit_gemm._has_mma.cache_clear()


@contextlib.contextmanager
def setting():
    """A ``patch`` for :func:`standing_in` outside pytest: every attribute set is restored
    at the end."""
    saved = []

    def patch(target, name, value):
        saved.append((target, name, getattr(target, name)))
        setattr(target, name, value)
    try:
        yield patch
    finally:
        for target, name, value in reversed(saved):
            setattr(target, name, value)
