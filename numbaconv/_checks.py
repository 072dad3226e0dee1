"""The checks every problem builder shares, convolution and recurrent alike: what an operand
is (:class:`ArrayInfo`: device, dtype, shape), one device and one dtype across the operands,
and ``out=`` / ``accumulate``. Messages name the argument, what was expected and what was
given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_CPU_DTYPES = ("float32", "float64")
_CUDA_DTYPES = ("float16", "float32", "float64")


@dataclass(frozen=True)
class ArrayInfo:
    """What validation learned about one operand: its device, dtype and shape."""

    name: str
    device: str
    dtype: str
    shape: tuple
    array: object = field(repr=False, compare=False)


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype) -> str:
    # np.dtype.name is computed in Python on every access; this runs on every call.
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        name = _DTYPE_NAMES[dtype] = np.dtype(dtype).name
        return name


def inspect_array(name: str, value) -> ArrayInfo:
    """Device, dtype and shape of a NumPy array or a ``__cuda_array_interface__`` object."""
    if isinstance(value, np.ndarray):
        return ArrayInfo(name, "cpu", _dtype_name(value.dtype), value.shape, value)
    cai = getattr(value, "__cuda_array_interface__", None)
    if cai is not None:
        return ArrayInfo(name, "cuda", _dtype_name(cai["typestr"]), tuple(cai["shape"]),
                         value)
    if getattr(value, "__cuda_ndarray__", False):
        # Numba's device arrays under its simulator (NUMBA_ENABLE_CUDASIM=1) carry this
        # marker but no __cuda_array_interface__; the CUDA tests run on them.
        return ArrayInfo(name, "cuda", _dtype_name(value.dtype), tuple(value.shape), value)
    raise TypeError(f"{name}: expected a NumPy array or a CUDA array "
                    f"(__cuda_array_interface__), got {type(value).__name__}")


def check_operands(*infos: ArrayInfo) -> tuple[str, str]:
    """One device and one float dtype shared by every operand; returns (device, dtype)."""
    first = infos[0]
    for info in infos:
        if info.device != first.device:
            raise ValueError(f"{info.name}: expected an array on the same device as "
                             f"{first.name} ({first.device}), got one on {info.device}")
    allowed = _CPU_DTYPES if first.device == "cpu" else _CUDA_DTYPES
    for info in infos:
        if info.dtype not in allowed:
            raise TypeError(f"{info.name}: expected dtype {' or '.join(allowed)} on "
                            f"{info.device}, got {info.dtype}")
        if info.dtype != first.dtype:
            raise TypeError(f"{info.name}: expected dtype {first.dtype} like {first.name} "
                            f"(mixed dtypes are not cast), got {info.dtype}")
    return first.device, first.dtype


def check_out(out, expected_shape: tuple, device: str, dtype: str, accumulate,
              inputs: tuple) -> None:
    """``out`` has the exact shape, dtype and device, is writable and overlaps no input."""
    if not isinstance(accumulate, (bool, np.bool_)):
        raise TypeError(f"accumulate: expected True or False, got {accumulate!r}")
    if out is None:
        if accumulate:
            raise ValueError("accumulate: expected out= to accumulate into, got out=None")
        return
    info = inspect_array("out", out)
    if info.device != device:
        raise ValueError(f"out: expected an array on {device}, got one on {info.device}")
    if info.dtype != dtype:
        raise TypeError(f"out: expected dtype {dtype}, got {info.dtype}")
    if info.shape != tuple(expected_shape):
        raise ValueError(f"out: expected shape {tuple(expected_shape)}, got {info.shape}")
    if device == "cpu":
        if not out.flags.writeable:
            raise ValueError("out: expected a writable array, got a read-only one")
        for arr in inputs:
            if arr is not None and isinstance(arr, np.ndarray) and \
                    np.may_share_memory(out, arr):
                raise ValueError("out: expected memory separate from the inputs, got an "
                                 "array that overlaps one of them")
