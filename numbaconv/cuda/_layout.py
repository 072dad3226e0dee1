"""Problem geometry and device arrays as the CUDA kernels see them: always 5D.

The geometry is both backends' (:func:`numbaconv._kernel_geometry.geom`, pure Python: three
spatial dimensions, leading unit ones for 1D and 2D). Arrays are handed over as the user
passed them (any ``__cuda_array_interface__`` object, any strides) and viewed, never copied,
as 5D Numba device arrays by inserting unit axes, which works whatever the strides.
"""

from __future__ import annotations

import numpy as np

from .._device import as_device, device_array, simulated
from .._kernel_geometry import Geom, geom

__all__ = ["Geom", "geom", "device_array", "view5", "as_device",
           "simulated"]


def view5(a, at: int):
    """``a`` with unit axes inserted at ``at`` (at most after its last axis: a bias's or
    1-D weight's ``(K,)`` becomes ``(K, 1, 1, 1, 1)``) until it has 5 dimensions (a
    view)."""
    a = as_device(a)
    count = 5 - len(a.shape)
    if count == 0:
        return a
    at = min(at, len(a.shape))
    if simulated():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(np.expand_dims(a._ary, tuple(range(at, at + count))))
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    shape = tuple(a.shape[:at]) + (1,) * count + tuple(a.shape[at:])
    strides = tuple(a.strides[:at]) + (a.dtype.itemsize,) * count + tuple(a.strides[at:])
    return DeviceNDArray(shape, strides, a.dtype, stream=a.stream, gpu_data=a.gpu_data)


def activation5(g: Geom, a):
    """x, y or their gradients as 5D: unit axes before the spatial ones."""
    ndim = len(a.shape) - 2
    return view5(a, 1 if g.channels_last else 2) if ndim < 3 else as_device(a)


def weight5(a):
    return view5(a, 2)
