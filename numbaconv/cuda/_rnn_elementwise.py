"""The recurrent ops' element-wise kernels outside the step loops, on device pointers: the
states copied in and out, ``dh + rec`` into dhx, zero fills, dropout masks, the time/batch
swap and the states each step read (for the weight gradient). The step kernels and the
products are :mod:`._rnn_kernels` and :mod:`._blas`; the bias gradients are
:func:`._bias.column_sums`.

``map3`` (:func:`apply`)
    ``out[i, k, f] = a[i, k, f]`` (copy), ``a + b`` (add), ``a * b`` (mul) or ``0`` (zero),
    one thread an element, f fastest (coalesced writes). Every operand is a base offset and
    three element strides from the lowest element it reaches, so any strides work, negative
    ones too; 1-D and 2-D arrays are 3-D with unit axes in front, and the time/batch swap is
    ``a``'s first two strides swapped. ``out`` may be ``a`` (each thread reads its element
    before writing it).
``put`` (:func:`put`)
    A few integers into a 1-D array: a reserve's header, written by one launch instead of
    a host copy (which would wait for the device).
``previous_states`` (:func:`previous_states`)
    ``out[t, n] = outputs[t -+ 1, n]``, the state the step at t read, or ``h0[n]`` at a
    sequence's first step (t = 0 forwards; t + 1 >= length backwards); ``out`` contiguous.

They take device pointers and int64 sizes, strides and flags, are compiled once for those
types (:func:`._implicit_gemm.jit_kernel`) and launch by the short path
(:func:`._launch.launch`), as the convolution kernels do: no Numba typing or argument
conversion of arrays at each launch. Indices are 32-bit where every offset fits below
:data:`._implicit_gemm.INDEX32_LIMIT` (a ``wide`` variant otherwise). Under the simulator
they take flat views of the operands' memory.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from ..config import cuda_threads_per_block
from . import _implicit_gemm as ig
from ._blas import elementwise_launch
from ._launch import launch
from ._layout import as_device, simulated
from ._templates import compile_source, scalar_types

OPS = ("copy", "add", "mul", "zero")


def _element(middle: str, inner: str, digits: str) -> str:
    """Template lines: this thread's element ``e`` (none past ``count``) as three digits
    ``digits`` (outer, middle, inner), the middle and inner of sizes ``middle``,
    ``inner``."""
    d0, d1, d2 = digits.split()
    return f"""
    e = I(I(cuda.blockIdx.x) * I(cuda.blockDim.x) + I(cuda.threadIdx.x))
    if e >= count:
        return
    q = I(U(e) // U({inner}))
    {d2} = I(e - I(q * {inner}))
    {d0} = I(U(q) // U({middle}))
    {d1} = I(q - I({d0} * {middle}))"""


MAP3 = """
def map3(a, b, out, count_, s1_, s2_, ab_, a0_, a1_, a2_, bb_, b0_, b1_, b2_,
         ob_, o0_, o1_, o2_):
    count, s1, s2 = I(count_), I(s1_), I(s2_)""" + _element("s1", "s2", "i k f") + """
    o = I(I(ob_) + I(i * I(o0_)) + I(k * I(o1_)) + I(f * I(o2_)))
#if OP == "zero"
    out[U(o)] = acc(0)
#else
    v = acc(a[U(I(I(ab_) + I(i * I(a0_)) + I(k * I(a1_)) + I(f * I(a2_))))])
#if OP == "add"
    v += acc(b[U(I(I(bb_) + I(i * I(b0_)) + I(k * I(b1_)) + I(f * I(b2_))))])
#elif OP == "mul"
    v *= acc(b[U(I(I(bb_) + I(i * I(b0_)) + I(k * I(b1_)) + I(f * I(b2_))))])
#end
    out[U(o)] = v
#end
"""

PREVIOUS_STATES = """
def previous_states(outputs, h0, out, lengths, count_, rows_, p_, yb_, y0_, y1_, y2_,
                    hb_, h0_, h1_, reverse):
    count, rows, p = I(count_), I(rows_), I(p_)""" + _element("rows", "p", "t n j") + """
    if reverse:
        first = t + 1 >= lengths[n]
        tp = I(t + 1)
    else:
        first = t == 0
        tp = I(t - 1)
    if first:
        out[U(e)] = h0[U(I(I(hb_) + I(n * I(h0_)) + I(j * I(h1_))))]
    else:
        out[U(e)] = outputs[U(I(I(yb_) + I(tp * I(y0_)) + I(n * I(y1_)) + I(j * I(y2_))))]
"""

#: Values :func:`put` writes in one launch at most (a reserve's header).
PUT_VALUES = 16

PUT = """
def put(a, base_, step_, count_, {values}):
    e = cuda.threadIdx.x
    if e < count_:
        v = acc(0)
#unroll i PUT_VALUES
        if e == {i}:
            v = acc(v{i})
#end
        a[U(I(base_) + I(e) * I(step_))] = v
"""

TEMPLATES = {"map3": MAP3, "previous_states": PREVIOUS_STATES,
             "put": PUT.replace("{values}", ", ".join(f"v{i}" for i in range(PUT_VALUES)))}


def function(name: str, dtype: str, wide: bool, variant=None):
    """The Python function of kernel ``name`` (``variant``: map3's op), to compile with
    cuda.jit. Launch: 1-D, a thread an element."""
    acc, I, U = scalar_types(dtype, wide)
    names = dict(OP=variant, PUT_VALUES=PUT_VALUES, KEY=f"{name} {variant} {dtype} wide={wide}")
    return compile_source(name, TEMPLATES[name], names, dict(acc=acc, I=I, U=U))


def launch_types(name: str, dtype: str) -> tuple:
    """The argument types every launch of ``name`` passes: device pointers, int64 sizes,
    offsets and strides, and flags."""
    from numba import types
    data, _ = ig.pointer_types(dtype)
    i, flag = types.int64, types.boolean
    if name == "map3":
        return (data,) * 3 + (i,) * 15
    if name == "previous_states":
        return (data,) * 3 + (types.CPointer(types.int64),) + (i,) * 10 + (flag,)
    if name == "put":
        return (data,) + (i,) * (3 + PUT_VALUES)
    raise KeyError(name)


@functools.lru_cache(maxsize=None)
def kernel(name: str, dtype: str, wide: bool, variant=None):
    """Kernel ``name`` for ``dtype`` and index width, compiled for :func:`launch_types`."""
    return ig.jit_kernel(function(name, dtype, wide, variant), launch_types(name, dtype))


def signatures(dtype: str):
    """Every kernel here as ``(label, python function, signature)``, for the compile
    tests."""
    found = []
    for wide in (False, True):
        width = "wide" if wide else "32"
        for op in OPS:
            found.append((f"rnn_map3_{op}_{dtype}_{width}", function("map3", dtype, wide, op),
                          launch_types("map3", dtype)))
        found.append((f"rnn_previous_states_{dtype}_{width}",
                      function("previous_states", dtype, wide),
                      launch_types("previous_states", dtype)))
        found.append((f"rnn_put_{dtype}_{width}", function("put", dtype, wide),
                      launch_types("put", dtype)))
    return found


# --- operands ----------------------------------------------------------------------------------

class Flat(NamedTuple):
    """A device array as these kernels take it: ``ref`` (the device pointer of the lowest
    element it reaches, or under the simulator a flat view of its memory from there), the
    first element's offset from it, the shape and element strides padded in front to
    ``ndim`` dimensions, the elements spanned and the dtype."""
    ref: object
    base: int
    shape: tuple
    strides: tuple
    span: int
    dtype: np.dtype


def flat(a, ndim: int = 3) -> Flat:
    """``a`` (any ``__cuda_array_interface__`` object of at most ``ndim`` dimensions) for
    these kernels."""
    raw_shape, raw_strides, itemsize = ig._raw(a)
    base, shape, strides, span = _arranged(raw_shape, raw_strides, itemsize, ndim)
    if simulated():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        host = as_device(a)._ary
        if span:  # from the lowest element on
            host = host[tuple(slice(n - 1, n) if s < 0 else slice(0, 1)
                              for n, s in zip(host.shape, host.strides))]
        ref = FakeCUDAArray(np.lib.stride_tricks.as_strided(host, (span,), (itemsize,)))
        dtype = host.dtype
    else:
        ref = ig._pointer(a) - base * itemsize
        dtype = a.dtype if getattr(a, "__cuda_ndarray__", False) else \
            np.dtype(a.__cuda_array_interface__["typestr"])
    return Flat(ref, base, shape, strides, span, dtype)


@functools.lru_cache(maxsize=4096)
def _arranged(shape: tuple, strides, itemsize: int, ndim: int) -> tuple:
    """``(base, shape, element strides, span)`` of :class:`Flat` for an array's shape and
    byte strides (None: C-contiguous); remembered, as the same few recur call after call."""
    strides = ig._element_strides(shape, strides, itemsize)
    pad = ndim - len(shape)
    if pad < 0:
        raise ValueError(f"a {len(shape)}-D array where at most {ndim} dimensions are taken")
    empty = 0 in shape
    base = 0 if empty else sum((n - 1) * -s for n, s in zip(shape, strides) if s < 0)
    span = 0 if empty else 1 + sum((n - 1) * abs(s) for n, s in zip(shape, strides))
    return base, (1,) * pad + tuple(shape), (0,) * pad + tuple(strides), span


#: The dtypes' names, the kernels' keys (read from a dict: ``dtype.name`` is slow).
_NAMES = {np.dtype(name): name for name in ("float16", "float32", "float64")}


def _checked(name: str, got: Flat, shape: tuple, dtype) -> None:
    """An internal check that keeps a wrong call from reading or writing out of bounds."""
    if got.shape != shape or got.dtype != dtype:
        raise ValueError(f"{name}: shape {got.shape} and {got.dtype} where {shape} and "
                         f"{dtype} are needed")


def _wide(count: int, *operands: Flat) -> bool:
    return max([count + cuda_threads_per_block()] + [o.span for o in operands]) > \
        ig.INDEX32_LIMIT


def apply(op: str, out, a=None, b=None, *, swap: bool = False) -> None:
    """``out = a`` (op "copy"), ``a + b`` ("add"), ``a * b`` ("mul") or ``0`` ("zero"),
    element-wise over arrays of one shape and dtype (1-D to 3-D, any strides); ``swap``:
    ``a`` has ``out``'s first two axes swapped, ``out[i, k] = a[k, i]``."""
    o = flat(out)
    count = math.prod(o.shape)
    fa = o if a is None else flat(a)
    fb = o if b is None else flat(b)
    if swap:
        fa = fa._replace(shape=(fa.shape[1], fa.shape[0], fa.shape[2]),
                         strides=(fa.strides[1], fa.strides[0], fa.strides[2]))
    _checked("a", fa, o.shape, o.dtype)
    _checked("b", fb, o.shape, o.dtype)
    if count == 0:
        return
    grid, block = elementwise_launch(count, cuda_threads_per_block())
    launch(kernel("map3", _NAMES[o.dtype], _wide(count, o, fa, fb), op), grid, block,
           fa.ref, fb.ref, o.ref, count, o.shape[1], o.shape[2], fa.base, *fa.strides,
           fb.base, *fb.strides, o.base, *o.strides)


def previous_states(outputs, h0, out, lengths, reverse: bool) -> None:
    """``out`` (T, N, P), contiguous: the state each step read, from the layer's
    ``outputs`` (T, N, P) of this direction and ``h0`` (N, P); ``lengths`` (N,) int64."""
    o, y, h = flat(out), flat(outputs), flat(h0, 2)
    lens = flat(lengths, 1)
    t_len, n, p = o.shape
    _checked("outputs", y, o.shape, o.dtype)
    _checked("h0", h, (n, p), o.dtype)
    _checked("lengths", lens, (n,), np.dtype(np.int64))
    if o.strides != (n * p, p, 1) or o.base:
        raise ValueError("previous_states: out must be C-contiguous")
    count = t_len * n * p
    if count == 0:
        return
    grid, block = elementwise_launch(count, cuda_threads_per_block())
    launch(kernel("previous_states", _NAMES[o.dtype], _wide(count, o, y, h)), grid, block,
           y.ref, h.ref, o.ref, lens.ref, count, n, p, y.base, *y.strides, h.base,
           *h.strides, bool(reverse))


def put(a, start: int, values) -> None:
    """``a[start:start + len(values)] = values`` for a 1-D device array ``a`` and at most
    :data:`PUT_VALUES` integers (exact in every float dtype: a reserve's header), by one
    kernel on the stream the kernels use: no host copy, so nothing waits for the device."""
    values = [int(v) for v in values]
    if len(values) > PUT_VALUES or any(abs(v) >= 2048 for v in values):
        raise ValueError(f"put: at most {PUT_VALUES} integers below 2048 in magnitude, got "
                         f"{values}")
    f = flat(a, 1)
    if start < 0 or start + len(values) > f.shape[0]:
        raise ValueError(f"put: {len(values)} values at {start} of {f.shape[0]} elements")
    if not values:
        return
    padded = values + [0] * (PUT_VALUES - len(values))
    launch(kernel("put", _NAMES[f.dtype], f.span > ig.INDEX32_LIMIT), 1, PUT_VALUES,
           f.ref, f.base + start * f.strides[0], f.strides[0], len(values), *padded)
