"""CUDA kernels, built on first use by factories keyed on everything that is a compile-time
constant (mode, layout, accumulator type, tile sizes), so kernels read no module globals.

Every array is 5D: activations ``(N, C, S0, S1, S2)`` channels-first or ``(N, S0, S1, S2, C)``
channels-last, weights ``(K, C/groups, R0, R1, R2)``, 1D and 2D problems with leading unit
dimensions. Geometry arrives as ``UniTuple(int64, 3)`` arguments, so every index is 64-bit.

Kernels (see docs/cuda.md for their performance model; the implicit GEMMs are in
:mod:`._implicit_gemm`):

``direct(mode, ...)``
    One thread per output element summing its window: for grouped convolutions with few
    channels per group (depthwise), where a GEMM tile would be mostly empty.

The bias gradient's reduction is in :mod:`._bias`.
"""

from __future__ import annotations

import functools

import numpy as np
# Kernels name `cuda` as a module global: the simulator swaps it for its fake module there.
from numba import cuda

MODES = ("forward", "data")


@functools.lru_cache(maxsize=None)
def _helpers():

    @cuda.jit(device=True, inline=True)
    def split3(index, d1, d2):
        """(i0, i1, i2) of a flat index over (d0, d1, d2)."""
        i2 = index % d2
        rest = index // d2
        return rest // d1, rest % d1, i2

    @cuda.jit(device=True, inline=True)
    def load5(a, channels_last, n, c, i0, i1, i2):
        if channels_last:
            return a[n, i0, i1, i2, c]
        return a[n, c, i0, i1, i2]

    @cuda.jit(device=True, inline=True)
    def tap_source(o, t, stride, dilation, before, size):
        """Forward read: input index of output o and tap t, or -1 in the zero frame."""
        i = o * stride - before + t * dilation
        return i if 0 <= i < size else -1

    @cuda.jit(device=True, inline=True)
    def tap_target(i, t, stride, dilation, before, size):
        """Data-gradient read: output index whose window puts tap t on input i, or -1."""
        num = i + before - t * dilation
        if num < 0 or num % stride != 0:
            return -1
        o = num // stride
        return o if o < size else -1

    return split3, load5, tap_source, tap_target


def _acc_type(dtype: str):
    import numba
    return numba.float64 if dtype == "float64" else numba.float32


def acc_dtype(dtype: str) -> np.dtype:
    """Accumulator dtype: float32 for float16 storage, else the dtype itself."""
    return np.dtype(np.float64 if dtype == "float64" else np.float32)


# --- direct --------------------------------------------------------------------------------

def direct_function(mode: str, channels_last: bool, dtype: str):
    """One thread per output element (flat, in memory order), summing its window.

    Launch: 1D, any block size, enough threads for ``out``'s elements.
    Arguments: ``src, w, bias, out, has_bias, accumulate, groups, s, r, p, st, dl, bf``.
    """
    split3, load5, tap_source, tap_target = _helpers()
    acc = _acc_type(dtype)
    cl = channels_last
    forward = mode == "forward"
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")

    def direct(src, w, bias, out, has_bias, accumulate, groups, s, r, p, st, dl, bf):
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        channels = out.shape[4] if cl else out.shape[1]
        if cl:
            q0s, q1s, q2s = out.shape[1], out.shape[2], out.shape[3]
        else:
            q0s, q1s, q2s = out.shape[2], out.shape[3], out.shape[4]
        total_elems = out.shape[0] * channels * q0s * q1s * q2s
        if e >= total_elems:
            return
        if cl:
            ch = e % channels
            rest = e // channels
            o0, o1, o2 = split3(rest % (q0s * q1s * q2s), q1s, q2s)
            n = rest // (q0s * q1s * q2s)
        else:
            o0, o1, o2 = split3(e % (q0s * q1s * q2s), q1s, q2s)
            rest = e // (q0s * q1s * q2s)
            ch = rest % channels
            n = rest // channels
        kg = w.shape[0] // groups
        cg = w.shape[1]
        total = acc(0)
        if forward:
            g = ch // kg
            for t0 in range(w.shape[2]):
                i0 = tap_source(o0, t0, st[0], dl[0], bf[0], s[0])
                if i0 < 0:
                    continue
                for t1 in range(w.shape[3]):
                    i1 = tap_source(o1, t1, st[1], dl[1], bf[1], s[1])
                    if i1 < 0:
                        continue
                    for t2 in range(w.shape[4]):
                        i2 = tap_source(o2, t2, st[2], dl[2], bf[2], s[2])
                        if i2 < 0:
                            continue
                        for c in range(cg):
                            total += acc(w[ch, c, t0, t1, t2]) * acc(
                                load5(src, cl, n, g * cg + c, i0, i1, i2))
        else:
            g = ch // cg
            c = ch % cg
            for t0 in range(w.shape[2]):
                i0 = tap_target(o0, t0, st[0], dl[0], bf[0], p[0])
                if i0 < 0:
                    continue
                for t1 in range(w.shape[3]):
                    i1 = tap_target(o1, t1, st[1], dl[1], bf[1], p[1])
                    if i1 < 0:
                        continue
                    for t2 in range(w.shape[4]):
                        i2 = tap_target(o2, t2, st[2], dl[2], bf[2], p[2])
                        if i2 < 0:
                            continue
                        for k in range(kg):
                            total += acc(w[g * kg + k, c, t0, t1, t2]) * acc(
                                load5(src, cl, n, g * kg + k, i0, i1, i2))
        if has_bias:
            total += acc(bias[ch])
        if cl:
            if accumulate:
                total += acc(out[n, o0, o1, o2, ch])
            out[n, o0, o1, o2, ch] = total
        else:
            if accumulate:
                total += acc(out[n, ch, o0, o1, o2])
            out[n, ch, o0, o1, o2] = total

    return direct


# --- compiled kernels ----------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def kernel(name: str, *key):
    """The ``cuda.jit`` kernel ``name`` built from ``key`` (compiled lazily, per signature)."""
    return cuda.jit(FUNCTIONS[name](*key))


FUNCTIONS = {
    "direct": direct_function,
}


def signatures(dtype: str, channels_last: bool):
    """Every kernel of one (dtype, layout) as ``(label, python function, signature)``:
    what the compile tests hand to ``numba.cuda.compile_ptx``."""
    from numba import types
    elem = {"float16": types.float16, "float32": types.float32,
            "float64": types.float64}[dtype]
    a5 = types.Array(elem, 5, "A")
    a1 = types.Array(elem, 1, "A")
    i3 = types.UniTuple(types.int64, 3)
    geometry = (types.int64,) + (i3,) * 6
    conv_sig = (a5, a5, a1, a5, types.boolean, types.boolean) + geometry
    layout = "cl" if channels_last else "cf"
    found = []
    for mode in MODES:
        found.append((f"direct_{mode}_{layout}_{dtype}",
                      direct_function(mode, channels_last, dtype), conv_sig))
    return found
