"""Kernel launches that skip Numba's per-launch work.

``kernel[grid, block](*args)`` costs Numba, at every launch: a launch-configuration object,
the dispatch on the arguments' types, and each argument's conversion to a ctypes value by
``_Kernel._prepare_args`` (an isinstance chain, a formatted type name and a ctypes object
per argument): the largest part of a convolution call's host time in the GPU profiles of
docs/cuda.md ("Host time of a launch"). Both paths here end in the call Numba itself
makes, cuda.core's ``launch(stream, config, kernel, *arguments)``, with arguments that give
the same bytes:

:func:`launch`
    For a kernel compiled for one signature of device pointers, 64-bit integers and flags
    (the GEMM, depthwise and bias kernels, :func:`._implicit_gemm.jit_kernel`): the
    arguments go as Python ints, which cuda.core passes as 8-byte integers, the bytes of
    Numba's ``c_int64`` for an integer and of the int it passes for a pointer or a flag.
:class:`Bound`
    A step loop's launch: every argument converted once, by Numba's own ``_prepare_args``,
    then at each step only the step index replaced (in the ctypes type Numba chose for it).

Each kernel's first launch goes through Numba (which compiles and loads it and raises its
own errors); later ones take the short path. Under the simulator, with
``NUMBACONV_CUDA_SHORT_LAUNCH=0``, and wherever the kernel or numba-cuda is not what this
module reads (checked once per kernel), every launch goes through ``kernel[grid, block]``.
"""

from __future__ import annotations

import numbers

import numpy as np

from .._device import simulated
from ..config import cuda_short_launch

#: What a launch plan holds per kernel: {dispatcher: _Plan, or None for Numba's launch}.
_PLANS: dict = {}
#: Launch configurations a plan keeps (one per grid and block); cleared when full.
MAX_CONFIGS = 256


def launch(kernel, grid, block, *args) -> None:
    """``kernel[grid, block](*args)`` for a kernel compiled for one signature."""
    plan = _PLANS.get(kernel, _UNSEEN)
    if plan is None:
        kernel[grid, block](*args)
    elif plan is _UNSEEN:
        kernel[grid, block](*args)
        _PLANS[kernel] = _plan(kernel) if _wanted() else None
    else:
        plan(grid, block, args)


_UNSEEN = object()


def _wanted() -> bool:
    """Whether the short path may be tried: a GPU (not the simulator), and
    ``NUMBACONV_CUDA_SHORT_LAUNCH`` not 0."""
    return not simulated() and cuda_short_launch()


class _Plan:
    """A kernel's one overload, ready to launch with integer arguments; ``last`` keeps the
    function loaded on the device of the last launch, with cuda.core's kernel and the
    default stream for it (building a stream object is a sizeable part of Numba's launch:
    docs/cuda.md)."""

    __slots__ = ("overload", "count", "configs", "core", "last")

    def __init__(self, overload, count, core):
        self.overload, self.count, self.core = overload, count, core
        self.configs = {}
        self.last = (None, None, None)

    def __call__(self, grid, block, args) -> None:
        if len(args) != self.count:
            raise TypeError(f"kernel {self.overload.entry_name}: {len(args)} arguments, "
                            f"expected {self.count}")
        config = self.configs.get((grid, block))
        if config is None:
            if len(self.configs) >= MAX_CONFIGS:
                self.configs.clear()
            config = self.configs[grid, block] = self.core.config(grid, block)
        values = [a if type(a) is int else integer(a) for a in args]
        cufunc = self.overload._codelibrary.get_cufunc()  # the current device's
        last, function, stream = self.last
        if cufunc is not last:
            function, stream = cufunc.kernel, self.core.stream(0)
            self.last = (cufunc, function, stream)
        self.core.launch(stream, config, function, *values)


def integer(value) -> int:
    """``value`` (a bool or an integer of any type) as a Python int; anything else is an
    error, as Numba's typing would make it."""
    if isinstance(value, (numbers.Integral, np.bool_)):
        return int(value)
    raise TypeError(f"kernel argument {value!r}: expected an integer, a pointer or a flag")


def _plan(kernel):
    """The short path for ``kernel``, or None where it does not apply: more than one
    overload, an argument type other than a pointer, a 64-bit integer or a flag, or a kernel
    Numba launches specially (cooperative, debug, extensions, launch-config sensitive)."""
    core = _core()
    overloads = list(getattr(kernel, "overloads", {}).values())
    if core is None or len(overloads) != 1 or getattr(kernel, "_launch_config_sensitive", 1):
        return None
    overload = overloads[0]
    if not _plain(overload) or not integer_types(overload.argument_types):
        return None
    return _Plan(overload, len(overload.argument_types), core)


def integer_types(argument_types) -> bool:
    """Whether every one of ``argument_types`` (Numba types) is a pointer, a 64-bit integer
    or a flag: the arguments :func:`launch` passes as Python ints."""
    from numba import types
    return all(isinstance(ty, (types.CPointer, types.Boolean))
               or (isinstance(ty, types.Integer) and ty.bitwidth == 64)
               for ty in argument_types)


def _plain(overload) -> bool:
    """Whether Numba launches ``overload`` the plain way (what this module repeats)."""
    return (getattr(overload, "cooperative", True) is False
            and getattr(overload, "debug", True) is False
            and not list(getattr(overload, "extensions", [1]))
            and not getattr(overload, "launch_config_sensitive", False)
            and hasattr(overload, "_codelibrary") and hasattr(overload, "_prepare_args"))


class _Core:
    """What numba-cuda's own launch calls: cuda.core's ``launch``, its ``LaunchConfig`` and
    numba-cuda's conversions of a stream and of launch dimensions."""

    __slots__ = ("launch", "launch_config", "stream", "dims", "cooperative_key")

    def __init__(self, launch, launch_config, stream, dims, cooperative_key):
        self.launch, self.launch_config, self.stream = launch, launch_config, stream
        self.dims, self.cooperative_key = dims, cooperative_key

    def config(self, grid, block):
        """The launch configuration numba-cuda builds for ``grid`` and ``block``."""
        grid, block = self.dims(grid, block)
        return self.launch_config(grid=grid, block=block, shmem_size=0,
                                  **{self.cooperative_key: False})


#: Names numba-cuda's ``_Kernel.launch`` uses when it launches as this module does.
LAUNCH_NAMES = frozenset({"get_cufunc", "_prepare_args", "LaunchConfig", "kernel", "launch"})


def _core():
    """numba-cuda's launch pieces, or None where they are not where this module looks (or
    its ``_Kernel.launch`` no longer names them)."""
    try:
        from numba.cuda import dispatcher as nd
        from numba.cuda.cudadrv.driver import _to_core_stream
        from numba.cuda.dispatcher import normalize_kernel_dimensions
        if not LAUNCH_NAMES <= set(nd._Kernel.launch.__code__.co_names):
            return None
        key = "is_cooperative" if getattr(nd, "CUDA_CORE_GE_1_0") else "cooperative_launch"
        return _Core(nd.launch, nd.LaunchConfig, _to_core_stream,
                     normalize_kernel_dimensions, key)
    except (ImportError, AttributeError):
        return None


class Bound:
    """``kernel[grid, block](*args)`` set up once to run many times with argument ``at`` (an
    integer, the step index of a step loop) changed: ``bound(t)``.

    The first call launches through Numba; from the second on, Numba's own conversions of
    the arguments from that first call are reused with only slot ``at`` replaced. The arrays
    in ``args`` are held, so their memory outlives the loop."""

    __slots__ = ("kernel", "grid", "block", "args", "at", "prepared")

    def __init__(self, kernel, grid, block, args, at: int):
        self.kernel, self.grid, self.block = kernel, grid, block
        self.args, self.at = list(args), at
        self.prepared = _UNSEEN

    def __call__(self, value) -> None:
        prepared = self.prepared
        if prepared is None or prepared is _UNSEEN:
            args = self.args
            args[self.at] = value
            self.kernel[self.grid, self.block](*args)
            if prepared is _UNSEEN:
                self.prepared = self._prepare() if _wanted() else None
            return
        launch, stream, config, function, kernelargs, slot, cast = prepared
        kernelargs[slot] = cast(value)
        launch(stream, config, function, *kernelargs)

    def _prepare(self):
        """Numba's converted arguments and where ``at`` went in them, or None (launch
        through Numba every time) where the overload used cannot be told or is special,
        an argument had to be copied to the device, or ``at`` is not one integer slot."""
        import ctypes

        from numba import types
        core = _core()
        kernel = self.kernel
        if core is None or getattr(kernel, "_launch_config_sensitive", 1):
            return None
        sig = tuple(kernel.typeof_pyval(a) for a in self.args)
        overloads = getattr(kernel, "overloads", {})
        overload = overloads.get(sig)
        if overload is None and len(overloads) == 1:
            overload = next(iter(overloads.values()))
        if overload is None or not _plain(overload):
            return None
        stream = core.stream(0)
        kernelargs, kept = [], []
        slot = None
        for i, (ty, value) in enumerate(zip(overload.argument_types, self.args)):
            start = len(kernelargs)
            overload._prepare_args(ty, value, stream, kept, kernelargs)
            if i == self.at:
                if not isinstance(ty, types.Integer) or len(kernelargs) != start + 1:
                    return None
                slot = start
        if kept or slot is None or len(overload.argument_types) != len(self.args):
            return None  # a host array was copied over: that copy must be made each launch
        cast = type(kernelargs[slot])
        if not issubclass(cast, ctypes._SimpleCData):
            return None
        # one loop, one device: the function and stream objects are kept for its steps
        function = overload._codelibrary.get_cufunc().kernel
        return (core.launch, stream, core.config(self.grid, self.block), function,
                kernelargs, slot, cast)
