"""Host time of a recurrent op's element-wise launch outside the step loops, without a GPU:
the Numba array kernels these were (``kernel[grid, block](arrays...)``) against the pointer
kernels of numbaconv/cuda/_rnn_elementwise.py, which launch by the short path.

For each launch of a one-layer LSTM training step (T=50, N=64, H=512, float32), times:

- Numba's pieces for the old kernel's arguments: each argument through
  ``_Kernel._prepare_args`` (device arrays that are an address and a layout, made without
  a GPU), then cuda.core's ``ParamHolder`` and ``_to_core_stream(0)``; the dispatch on the
  arrays' types and the configuration object, which need a GPU, are not in it;
- the new launch's: numbaconv's Python (``apply``, ``previous_states``, with the GPU
  stood in by tests/gpu_standin.py, launches recorded) and its integers through
  ``ParamHolder``.

From the repository root::

    python docs/benchmarks/rnn_elementwise_launch.py [--reps 20000]

Prints microseconds a launch, the best of 7 rounds of ``--reps`` calls.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import sys
import time
import timeit

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
sys.path.insert(0, HERE)

T, N, H = 50, 64, 512


class _Memory:
    """Device memory as a Numba device array reads it: an address."""

    def __init__(self, address):
        self.device_ctypes_pointer = ctypes.c_void_p(address)
        self.handle = self.device_ctypes_pointer


def numba_array(shape, dtype="float32", address=1 << 40):
    """A Numba device array at ``address``, made without a GPU (nothing reads its memory)."""
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    strides = np.empty(shape, dtype).strides
    return DeviceNDArray(shape, strides, np.dtype(dtype), gpu_data=_Memory(address))


def cases():
    """``[(launch, old argument types, old arguments, new call)]``: new calls take the
    stand-in arrays and module."""
    from numba import types
    a1i = types.Array(types.int64, 1, "C")
    a2, a3 = types.Array(types.float32, 2, "A"), types.Array(types.float32, 3, "A")
    flag = types.boolean
    state = numba_array((N, H))
    seq = numba_array((T, N, H))
    lens = numba_array((N,), "int64")
    return [
        ("copy (a state in or out)", (a2, a2, a2, flag), (state, state, state, False),
         lambda ew, s: ew.apply("copy", s["state"], s["state2"])),
        ("add (dh + rec into dhx)", (a2, a2, a2, flag), (state, state, state, True),
         lambda ew, s: ew.apply("add", s["state"], s["state2"], s["state3"])),
        ("zero (rec)", (a2,), (state,), lambda ew, s: ew.apply("zero", s["state"])),
        ("previous_states", (a3, a2, a3, a1i, flag), (seq, state, seq, lens, False),
         lambda ew, s: ew.previous_states(s["seq"], s["state"], s["seq2"], s["lens"],
                                          False)),
    ]


def measure(reps: int):
    """``[(launch, old us, new us, (old conversion, holder, stream), (new Python,
    holder))]``."""
    from cuda.core._kernel_arg_handler import ParamHolder
    from numba.cuda.cudadrv.driver import _to_core_stream
    from numba.cuda.dispatcher import _Kernel

    import gpu_standin
    from numbaconv.cuda import _rnn_elementwise as ew

    class Overload:
        extensions = []

    def best(function) -> float:
        return min(timeit.repeat(function, number=reps, repeat=7)) / reps * 1e6

    found = []
    with gpu_standin.setting() as patch, gpu_standin.standing_in(patch) as launches:
        array = gpu_standin.DeviceArray
        stand = dict(state=array((N, H), "float32"), state2=array((N, H), "float32"),
                     state3=array((N, H), "float32"), seq=array((T, N, H), "float32"),
                     seq2=array((T, N, H), "float32"), lens=array((N,), "int64"))
        for name, types_, values, call in cases():
            def convert(types_=types_, values=values):
                out, kept = [], []
                for ty, value in zip(types_, values):
                    _Kernel._prepare_args(Overload(), ty, value, 0, kept, out)
                return out
            converted = convert()
            old = (best(convert), best(lambda: ParamHolder(converted)),
                   best(lambda: _to_core_stream(0)))

            def new_call(call=call):
                call(ew, stand)
                del launches[:]
            call(ew, stand)
            ints = [int(v) for v in launches[0].args]
            del launches[:]
            new = (best(new_call), best(lambda: ParamHolder(ints)))
            found.append((name, sum(old), sum(new), old, new))
    return found


def main(argv=None) -> int:
    from cuda_host_path import _cpu
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20000)
    args = parser.parse_args(argv)
    rows = measure(args.reps)
    print(f"element-wise launch host time, no GPU: {_cpu()}, Python "
          f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}")
    print(f"{'launch':28s} {'Numba: conversion + holder + stream':>38s} "
          f"{'short: numbaconv + holder':>28s}")
    for name, old, new, (conv, holder, stream), (python, ints) in rows:
        print(f"{name:28s} {conv:9.2f} + {holder:5.2f} + {stream:5.2f} = {old:6.2f} us "
              f"{python:9.2f} + {ints:5.2f} = {new:6.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
