"""CUDA kernels, built on first use by factories keyed on everything that is a compile-time
constant (mode, layout, accumulator type, tile sizes), so kernels read no module globals.

Every array is 5D: activations ``(N, C, S0, S1, S2)`` channels-first or ``(N, S0, S1, S2, C)``
channels-last, weights ``(K, C/groups, R0, R1, R2)``, 1D and 2D problems with leading unit
dimensions. Geometry arrives as ``UniTuple(int64, 3)`` arguments, so every index is 64-bit.

Kernels (see README.md in this folder for their performance model):

``implicit_gemm(mode, ...)``
    ``out[n, g, m, q] = sum_l A[g, m, l] * B[n, g, l, q]`` with shared-memory tiles of A (the
    weights) and of B (input windows gathered on the fly: no im2col in memory). ``mode``
    "forward": m = output channel in the group, l = (input channel, tap), q = output position.
    ``mode`` "data" (data gradient and transposed convolution): m = input channel in the
    group, l = (output channel, tap), q = input position; B reads dy where ``(i + before -
    t*dilation)`` is a non-negative multiple of the stride inside the output. No atomics.
``direct(mode, ...)``
    One thread per output element summing its window: for grouped convolutions with few
    channels per group (depthwise), where a GEMM tile would be mostly empty.
``weight_partials``
    The weight gradient as an implicit GEMM ``dw[g, m, col] = sum_j dy[j, g, m] * x[j, g,
    col]`` over j = (image, output position), split in a fixed number of chunks (from the
    problem shape only); each chunk writes its own partial.
``bias_partials``
    One block per (channel, chunk): each thread sums a strided set of rows in order, then a
    fixed shared-memory tree.
``sum_partials``
    Adds the partials of a split reduction in chunk order and writes (or accumulates) the
    result: the second pass that makes the reductions deterministic.
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


# --- implicit GEMM ------------------------------------------------------------------------

def implicit_gemm_function(mode: str, channels_last: bool, dtype: str, tile: tuple):
    """The Python function of the implicit-GEMM kernel (compile with ``cuda.jit``).

    Launch: block ``(tile_q, tile_m)``; grid ``(q_tiles * N * groups, m_tiles)``.
    Arguments: ``src, w, bias, out, has_bias, accumulate, groups, s, r, p, st, dl, bf``.
    """
    split3, load5, tap_source, tap_target = _helpers()
    acc = _acc_type(dtype)
    tm, tq, tl = tile
    threads = tm * tq
    cl = channels_last
    forward = mode == "forward"
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")

    def implicit_gemm(src, w, bias, out, has_bias, accumulate, groups, s, r, p, st, dl, bf):
        sa = cuda.shared.array((tm, tl), acc)
        sb = cuda.shared.array((tl, tq), acc)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * tq + tx
        kg = w.shape[0] // groups
        cg = w.shape[1]
        taps = w.shape[2] * w.shape[3] * w.shape[4]
        if forward:
            rows = kg
            reduce_len = cg * taps
            q0s, q1s, q2s = p[0], p[1], p[2]
        else:
            rows = cg
            reduce_len = kg * taps
            q0s, q1s, q2s = s[0], s[1], s[2]
        cols = q0s * q1s * q2s
        q_tiles = (cols + tq - 1) // tq
        block = cuda.blockIdx.x
        qt = block % q_tiles
        ng = block // q_tiles
        n = ng // groups
        g = ng % groups
        m0 = cuda.blockIdx.y * tm
        col0 = qt * tq
        total = acc(0)
        for l0 in range(0, reduce_len, tl):
            # A tile: weights, (m, l) in row-major order.
            for e in range(tid, tm * tl, threads):
                mi = e // tl
                li = e % tl
                m = m0 + mi
                l = l0 + li
                v = acc(0)
                if m < rows and l < reduce_len:
                    ch = l // taps
                    t0, t1, t2 = split3(l % taps, w.shape[3], w.shape[4])
                    if forward:
                        v = acc(w[g * kg + m, ch, t0, t1, t2])
                    else:
                        v = acc(w[g * kg + ch, m, t0, t1, t2])
                sa[mi, li] = v
            # B tile: the gathered source, (l, q) with q fastest.
            for e in range(tid, tl * tq, threads):
                li = e // tq
                qi = e % tq
                l = l0 + li
                q = col0 + qi
                v = acc(0)
                if l < reduce_len and q < cols:
                    ch = l // taps
                    t0, t1, t2 = split3(l % taps, w.shape[3], w.shape[4])
                    o0, o1, o2 = split3(q, q1s, q2s)
                    if forward:
                        i0 = tap_source(o0, t0, st[0], dl[0], bf[0], s[0])
                        i1 = tap_source(o1, t1, st[1], dl[1], bf[1], s[1])
                        i2 = tap_source(o2, t2, st[2], dl[2], bf[2], s[2])
                        if i0 >= 0 and i1 >= 0 and i2 >= 0:
                            v = acc(load5(src, cl, n, g * cg + ch, i0, i1, i2))
                    else:
                        i0 = tap_target(o0, t0, st[0], dl[0], bf[0], p[0])
                        i1 = tap_target(o1, t1, st[1], dl[1], bf[1], p[1])
                        i2 = tap_target(o2, t2, st[2], dl[2], bf[2], p[2])
                        if i0 >= 0 and i1 >= 0 and i2 >= 0:
                            v = acc(load5(src, cl, n, g * kg + ch, i0, i1, i2))
                sb[li, qi] = v
            cuda.syncthreads()
            for li in range(tl):
                total += sa[ty, li] * sb[li, tx]
            cuda.syncthreads()
        m = m0 + ty
        q = col0 + tx
        if m < rows and q < cols:
            o0, o1, o2 = split3(q, q1s, q2s)
            ch = g * rows + m
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

    return implicit_gemm


# --- direct --------------------------------------------------------------------------------

def direct_function(mode: str, channels_last: bool, dtype: str):
    """One thread per output element (flat, in memory order), summing its window.

    Launch: 1D, any block size, enough threads for ``out``'s elements.
    Arguments as for the implicit GEMM.
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


# --- reductions ----------------------------------------------------------------------------

def weight_partials_function(channels_last: bool, dtype: str, tile: tuple):
    """Per-chunk weight gradients: ``partial[chunk, k, (c, tap)]``.

    Launch: block ``(tile_q, tile_m)``; grid ``(col_tiles * groups, m_tiles, chunks)``.
    Arguments: ``x, dy, partial, chunk_len, groups, s, r, p, st, dl, bf``; ``chunk_len`` is a
    multiple of the tile step.
    """
    split3, load5, tap_source, _ = _helpers()
    acc = _acc_type(dtype)
    tm, tq, tl = tile
    threads = tm * tq
    cl = channels_last

    def weight_partials(x, dy, partial, chunk_len, groups, s, r, p, st, dl, bf):
        sa = cuda.shared.array((tm, tl), acc)
        sb = cuda.shared.array((tl, tq), acc)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * tq + tx
        kg = partial.shape[1] // groups
        cg = x.shape[4] // groups if cl else x.shape[1] // groups
        taps = r[0] * r[1] * r[2]
        cols = cg * taps
        positions = p[0] * p[1] * p[2]
        reduce_total = dy.shape[0] * positions
        col_tiles = (cols + tq - 1) // tq
        g = cuda.blockIdx.x // col_tiles
        col0 = (cuda.blockIdx.x % col_tiles) * tq
        m0 = cuda.blockIdx.y * tm
        j_start = cuda.blockIdx.z * chunk_len
        j_stop = min(j_start + chunk_len, reduce_total)
        total = acc(0)
        for j0 in range(j_start, j_stop, tl):
            for e in range(tid, tm * tl, threads):
                mi = e // tl
                ji = e % tl
                m = m0 + mi
                j = j0 + ji
                v = acc(0)
                if m < kg and j < j_stop:
                    o0, o1, o2 = split3(j % positions, p[1], p[2])
                    v = acc(load5(dy, cl, j // positions, g * kg + m, o0, o1, o2))
                sa[mi, ji] = v
            for e in range(tid, tl * tq, threads):
                ji = e // tq
                qi = e % tq
                j = j0 + ji
                col = col0 + qi
                v = acc(0)
                if j < j_stop and col < cols:
                    o0, o1, o2 = split3(j % positions, p[1], p[2])
                    t0, t1, t2 = split3(col % taps, r[1], r[2])
                    i0 = tap_source(o0, t0, st[0], dl[0], bf[0], s[0])
                    i1 = tap_source(o1, t1, st[1], dl[1], bf[1], s[1])
                    i2 = tap_source(o2, t2, st[2], dl[2], bf[2], s[2])
                    if i0 >= 0 and i1 >= 0 and i2 >= 0:
                        v = acc(load5(x, cl, j // positions, g * cg + col // taps,
                                      i0, i1, i2))
                sb[ji, qi] = v
            cuda.syncthreads()
            for ji in range(tl):
                total += sa[ty, ji] * sb[ji, tx]
            cuda.syncthreads()
        m = m0 + ty
        col = col0 + tx
        if m < kg and col < cols:
            partial[cuda.blockIdx.z, g * kg + m, col] = total

    return weight_partials


def bias_partials_function(channels_last: bool, dtype: str, threads: int):
    """Per-chunk bias gradients: ``partial[chunk, k, 0]``.

    Launch: block ``threads`` (a power of two); grid ``(K, chunks)``.
    Arguments: ``dy, partial, chunk_len``; rows are (image, position) pairs.
    """
    split3, load5, _, _ = _helpers()
    acc = _acc_type(dtype)
    cl = channels_last

    def bias_partials(dy, partial, chunk_len):
        buf = cuda.shared.array(threads, acc)
        tid = cuda.threadIdx.x
        k = cuda.blockIdx.x
        if cl:
            p0, p1, p2 = dy.shape[1], dy.shape[2], dy.shape[3]
        else:
            p0, p1, p2 = dy.shape[2], dy.shape[3], dy.shape[4]
        positions = p0 * p1 * p2
        rows = dy.shape[0] * positions
        start = cuda.blockIdx.y * chunk_len
        stop = min(start + chunk_len, rows)
        total = acc(0)
        for j in range(start + tid, stop, threads):
            o0, o1, o2 = split3(j % positions, p1, p2)
            total += acc(load5(dy, cl, j // positions, k, o0, o1, o2))
        buf[tid] = total
        cuda.syncthreads()
        half = threads // 2
        while half > 0:
            if tid < half:
                buf[tid] += buf[tid + half]
            cuda.syncthreads()
            half //= 2
        if tid == 0:
            partial[cuda.blockIdx.y, k, 0] = buf[0]

    return bias_partials


def sum_partials_function(dtype: str):
    """``out = [out +] sum over chunks of partial[chunk]``, chunks added in order.

    Launch: 1D, one thread per element of ``out`` (5D, C order of the partial's columns).
    Arguments: ``partial (chunks, rows, cols), out, accumulate``.
    """
    split3, _, _, _ = _helpers()
    acc = _acc_type(dtype)

    def sum_partials(partial, out, accumulate):
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        cols = partial.shape[2]
        if e >= partial.shape[1] * cols:
            return
        row = e // cols
        col = e % cols
        total = partial[0, row, col]
        for chunk in range(1, partial.shape[0]):
            total += partial[chunk, row, col]
        d1 = out.shape[1]
        rest = col // (out.shape[2] * out.shape[3] * out.shape[4])
        i1 = rest % d1
        i2, i3, i4 = split3(col % (out.shape[2] * out.shape[3] * out.shape[4]),
                            out.shape[3], out.shape[4])
        if accumulate:
            total += acc(out[row, i1, i2, i3, i4])
        out[row, i1, i2, i3, i4] = total

    return sum_partials


# --- compiled kernels ----------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def kernel(name: str, *key):
    """The ``cuda.jit`` kernel ``name`` built from ``key`` (compiled lazily, per signature)."""
    return cuda.jit(FUNCTIONS[name](*key))


FUNCTIONS = {
    "implicit_gemm": implicit_gemm_function,
    "direct": direct_function,
    "weight_partials": weight_partials_function,
    "bias_partials": bias_partials_function,
    "sum_partials": sum_partials_function,
}


def signatures(dtype: str, channels_last: bool, tile: tuple, threads: int):
    """Every kernel of one (dtype, layout) as ``(label, python function, signature)``:
    what the compile tests hand to ``numba.cuda.compile_ptx``."""
    from numba import types
    elem = {"float16": types.float16, "float32": types.float32,
            "float64": types.float64}[dtype]
    acc = types.float64 if dtype == "float64" else types.float32
    a5 = types.Array(elem, 5, "A")
    a1 = types.Array(elem, 1, "A")
    i3 = types.UniTuple(types.int64, 3)
    geometry = (types.int64,) + (i3,) * 6
    conv_sig = (a5, a5, a1, a5, types.boolean, types.boolean) + geometry
    layout = "cl" if channels_last else "cf"
    found = []
    for mode in MODES:
        found.append((f"implicit_gemm_{mode}_{layout}_{dtype}",
                      implicit_gemm_function(mode, channels_last, dtype, tile), conv_sig))
        found.append((f"direct_{mode}_{layout}_{dtype}",
                      direct_function(mode, channels_last, dtype), conv_sig))
    part3 = types.Array(acc, 3, "C")
    found.append((f"weight_partials_{layout}_{dtype}",
                  weight_partials_function(channels_last, dtype, tile),
                  (a5, a5, part3, types.int64) + geometry))
    found.append((f"bias_partials_{layout}_{dtype}",
                  bias_partials_function(channels_last, dtype, threads),
                  (a5, part3, types.int64)))
    if not channels_last:
        found.append((f"sum_partials_{dtype}", sum_partials_function(dtype),
                      (part3, a5, types.boolean)))
    return found
