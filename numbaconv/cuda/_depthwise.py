"""The ``depthwise`` algorithm of the cuda backend: one channel per group, one output
channel per input channel (``groups == C == K``), where a GEMM tile would be almost empty;
its forward kernel also serves ``direct`` (groups of a few channels).

``dw_conv`` (forward, data gradient, transposed convolution)
    Each thread computes ``V`` outputs along the last spatial dimension of one (image,
    channel, row), decoding its position once; the taps run in loops, the weights of its
    channel read once a tap, once for each source channel of its group (one when
    depthwise). Memory-bound: every input element is read by up to ``taps``
    neighbouring outputs, mostly from L1. Channels-last: neighbouring threads take
    neighbouring channels (coalesced); channels-first: neighbouring runs of a row. The data
    gradient of stride 1 is the same gather with the taps mirrored; with a stride, a tap
    reaches an input only where ``i + before - tap*dilation`` divides by it (checked).
``dw_weight`` + ``sum_chunks`` (weight gradient)
    A block per (channels, chunk of (image, position) pairs): ``CB`` channels by ``PL``
    position lanes (channels-last: 32 x 8, channels-first: 1 x 256); each thread sums
    ``dy * x`` for every tap over its positions of the chunk, the lanes are added by a fixed
    shared-memory tree, and each chunk writes its partial, added in chunk order by
    :func:`._implicit_gemm.sum_chunks_function`'s kernel. The chunks depend on the shape
    only: deterministic.

Indices are 32-bit where every operand spans fewer than 2**31 elements; operands are device
pointers (flat arrays under the simulator) with element strides, as for the GEMMs.
"""

from __future__ import annotations

import functools
import math


from . import _implicit_gemm as ig
from ._launch import launch
from ._layout import device_array, geom
from ._templates import compile_source, scalar_types

#: Outputs a thread computes along the last spatial dimension (more: fewer position
#: decodes per output, fewer threads for short rows).
V = 4
#: Threads per block of both kernels.
THREADS = 256
#: Static shared memory a block may use: the weight gradient's per-tap lane sums
#: (``taps x THREADS`` accumulators) must fit, else the GEMM takes the layer.
SHARED_BYTES = 48 * 1024
#: Blocks to aim for when cutting the weight gradient's positions into chunks (fixed, so
#: the bits of dw do not depend on the GPU).
WEIGHT_TARGET_BLOCKS = 1024


def applies(problem) -> bool:
    """Depthwise with one output channel per input channel."""
    return (problem.groups == problem.in_channels == problem.out_channels
            and problem.groups > 1)


def weight_applies(problem) -> bool:
    accumulator = 8 if problem.dtype == "float64" else 4
    return applies(problem) and \
        math.prod(problem.kernel_size) * THREADS * accumulator <= SHARED_BYTES


DW_CONV = """
def dw_conv(src, w, out, bias, n_images, C, S0, S1, S2, P0, P1, P2,
            sN, sC, s0, s1, s2, oN, oC, o0, o1, o2, R0, R1, R2, wK, w0, w1, w2,
            st0, st1, st2, dl0, dl1, dl2, bf0, bf1, bf2, GO, M, wCi):
    f = I(cuda.blockIdx.x * THREADS + cuda.threadIdx.x)
    Q2 = I((P2 + V - 1) // V)
    rows = I(P0 * P1)
    if f >= n_images * C * rows * Q2:
        return
#if cl
    c = I(U(f) % U(C))
    rest = I(U(f) // U(C))
    q2 = I(U(rest) % U(Q2))
    rest = I(U(rest) // U(Q2))
    r01 = I(U(rest) % U(rows))
    n = I(U(rest) // U(rows))
#else
    q2 = I(U(f) % U(Q2))
    rest = I(U(f) // U(Q2))
    r01 = I(U(rest) % U(rows))
    rest = I(U(rest) // U(rows))
    c = I(U(rest) % U(C))
    n = I(U(rest) // U(C))
#end
    p0 = I(U(r01) // U(P1))
    p1 = I(r01 - p0 * P1)
    pb = I(q2 * V)
#if GROUPED
    # output channel c of group g sums the group's M source channels
    g = I(U(c) // U(GO))
    sgroup = I(n * sN + g * M * sC)
#if forward
    wgroup = I(c * wK)
    wstep = I(wCi)
#else
    wgroup = I(g * M * wK + (c - g * GO) * wCi)
    wstep = I(wK)
#end
    summed = I(M)
#else
    sgroup = I(n * sN + c * sC)
    wgroup = I(c * wK)
    wstep = I(0)
    summed = I(1)
#end
#unroll v V
    acc_{v} = acc(0)
#end
    for m in range(summed):
        sbase = I(sgroup + m * sC)
        wbase = I(wgroup + m * wstep)
        for t0 in range(R0):
#if forward
            i0 = I(p0 * st0 - bf0 + t0 * dl0)
            ok0 = U(i0) < U(S0)
#elif stride1
            i0 = I(p0 + bf0 - t0 * dl0)
            ok0 = U(i0) < U(S0)
#else
            m0 = I(p0 + bf0 - t0 * dl0)
            i0 = I(U(m0) // U(st0))
            ok0 = (m0 >= 0) & (m0 - i0 * st0 == 0) & (i0 < S0)
#end
            if ok0:
                for t1 in range(R1):
#if forward
                    i1 = I(p1 * st1 - bf1 + t1 * dl1)
                    ok1 = U(i1) < U(S1)
#elif stride1
                    i1 = I(p1 + bf1 - t1 * dl1)
                    ok1 = U(i1) < U(S1)
#else
                    m1 = I(p1 + bf1 - t1 * dl1)
                    i1 = I(U(m1) // U(st1))
                    ok1 = (m1 >= 0) & (m1 - i1 * st1 == 0) & (i1 < S1)
#end
                    if ok1:
                        row = I(sbase + i0 * s0 + i1 * s1)
                        for t2 in range(R2):
                            wv = acc(w[U(wbase + t0 * w0 + t1 * w1 + t2 * w2)])
#unroll v V
#if forward
                            i2 = I((pb + {v}) * st2 - bf2 + t2 * dl2)
                            if U(i2) < U(S2):
                                acc_{v} += wv * acc(src[U(row + i2 * s2)])
#elif stride1
                            i2 = I(pb + {v} + bf2 - t2 * dl2)
                            if U(i2) < U(S2):
                                acc_{v} += wv * acc(src[U(row + i2 * s2)])
#else
                            m2 = I(pb + {v} + bf2 - t2 * dl2)
                            i2 = I(U(m2) // U(st2))
                            if (m2 >= 0) & (m2 - i2 * st2 == 0) & (i2 < S2):
                                acc_{v} += wv * acc(src[U(row + i2 * s2)])
#end
#end
    obase = I(n * oN + c * oC + p0 * o0 + p1 * o1)
#unroll v V
    if pb + {v} < P2:
        at = U(obase + (pb + {v}) * o2)
#if BIAS and ACCUM
        out[at] = acc_{v} + acc(bias[U(c)]) + acc(out[at])
#elif BIAS
        out[at] = acc_{v} + acc(bias[U(c)])
#elif ACCUM
        out[at] = acc_{v} + acc(out[at])
#else
        out[at] = acc_{v}
#end
#end
"""


def dw_conv_function(dtype: str, channels_last: bool, mode: str, stride1: bool, wide: bool,
                     has_bias: bool, accumulate: bool, grouped: bool = False):
    """The Python function of the forward / data-gradient kernel of few channels a group.

    Launch: ``THREADS`` threads a block, one thread per ``V`` outputs of a row. ``S`` are
    the gathered operand's sizes, ``P`` the output's; for "data" the roles of stride,
    dilation and padding are those of the forward convolution whose gradient it is.
    ``grouped``: ``GO`` output channels a group, each summing ``M`` source channels (else
    depthwise: one and one, known when compiled).
    """
    acc, I, U = scalar_types(dtype, wide)
    names = dict(V=V, THREADS=THREADS, cl=channels_last, forward=mode == "forward",
                 stride1=stride1, BIAS=has_bias, ACCUM=accumulate, GROUPED=grouped,
                 KEY=f"{dtype} cl={channels_last} {mode} stride1={stride1} wide={wide} "
                     f"grouped={grouped}")
    return compile_source("dw_conv", DW_CONV, names, dict(acc=acc, I=I, U=U))


DW_WEIGHT = """
def dw_weight(x, dy, partial, n_images, C, S0, S1, S2, P0, P1, P2,
              xN, xC, x0, x1, x2, yN, yC, y0, y1, y2,
              st0, st1, st2, dl0, dl1, dl2, bf0, bf1, bf2, chunk_len):
    red = cuda.shared.array((T, THREADS), acc)
    tid = I(cuda.threadIdx.x)
    lane = I(U(tid) // U(CB))
    c = I(cuda.blockIdx.x * CB + tid % CB)
    chunk = I(cuda.blockIdx.y)
    P12 = I(P1 * P2)
    PP = I(P0 * P12)
    total = I(n_images * PP)
    j_stop = min(I(chunk * chunk_len + chunk_len), total)
    cc = min(c, C - 1)
    ybase = I(cc * yC)
    xbase = I(cc * xC)
#unroll t T
    s_{t} = acc(0)
#end
    j = I(chunk * chunk_len + lane)
    while (j < j_stop) & (c < C):
        n = I(U(j) // U(PP))
        r = I(j - n * PP)
        p0 = I(U(r) // U(P12))
        rr = I(r - p0 * P12)
        p1 = I(U(rr) // U(P2))
        p2 = I(rr - p1 * P2)
        g = acc(dy[U(ybase + n * yN + p0 * y0 + p1 * y1 + p2 * y2)])
        i0 = I(p0 * st0 - bf0)
        i1 = I(p1 * st1 - bf1)
        i2 = I(p2 * st2 - bf2)
        xb = I(xbase + n * xN)
#unroll t T
        k0 = I(i0 + {t // (R1C * R2C)} * dl0)
        k1 = I(i1 + {t // R2C % R1C} * dl1)
        k2 = I(i2 + {t % R2C} * dl2)
        if (U(k0) < U(S0)) & (U(k1) < U(S1)) & (U(k2) < U(S2)):
            s_{t} += g * acc(x[U(xb + k0 * x0 + k1 * x1 + k2 * x2)])
#end
        j = I(j + PL)
#unroll t T
    red[{t}, tid] = s_{t}
#end
    cuda.syncthreads()
    half = PL // 2
    while half > 0:
        if lane < half:
#unroll t T
            red[{t}, tid] += red[{t}, tid + half * CB]
#end
        cuda.syncthreads()
        half //= 2
    if (lane == 0) & (c < C):
        base = I(I(chunk * C + c) * T)
#unroll t T
        partial[U(base + {t})] = red[{t}, tid]
#end
"""


def dw_weight_function(dtype: str, channels_last: bool, taps: tuple, wide: bool):
    """The Python function of the depthwise weight-gradient kernel (``taps`` = R0, R1, R2,
    compile-time: the per-tap sums are registers).

    Launch: ``THREADS`` threads; grid ``(channel blocks, chunks)``. Writes ``partial[chunk,
    c, tap]``.
    """
    acc, I, U = scalar_types(dtype, wide)
    cb = 32 if channels_last else 1
    names = dict(THREADS=THREADS, CB=cb, PL=THREADS // cb, T=math.prod(taps),
                 R1C=taps[1], R2C=taps[2],
                 KEY=f"{dtype} cl={channels_last} taps={taps} wide={wide}")
    return compile_source("dw_weight", DW_WEIGHT, names, dict(acc=acc, I=I, U=U))


_FUNCTIONS = {"dw_conv": dw_conv_function, "dw_weight": dw_weight_function}


@functools.lru_cache(maxsize=None)
def kernel(name: str, *key):
    """The kernel ``name`` for ``key`` (see :func:`._implicit_gemm.jit_kernel`)."""
    return ig.jit_kernel(_FUNCTIONS[name](*key), _launch_types(name, key))


def _launch_types(name: str, key: tuple) -> tuple:
    from numba import types
    data, accs = ig.pointer_types(key[0])
    if name == "dw_conv":
        return (data, data, data, data) + (types.int64,) * 37
    return (data, data, accs) + (types.int64,) * 28


def convolution(mode: str, problem, src, w, bias, out, result_shape):
    """``out = [out +] conv(src, w) [+ bias]`` ("forward") or its data gradient / transposed
    convolution ("data") by ``dw_conv``: depthwise, or any grouping (each output sums its
    group's source channels one after another; the ``direct`` algorithm, chosen for groups
    of a few channels)."""
    g = geom(problem)
    dtype = problem.dtype
    cl = problem.channels_last
    result = out if out is not None else device_array(result_shape, dtype)
    if math.prod(result_shape) == 0:
        return result
    forward = mode == "forward"
    s = ig.operand(src, cl, g)
    target, o = ig._writable(result, result_shape, g, cl, problem.accumulate)
    wo = ig.operand(w, None, g)
    src_size, out_size = (g.s, g.p) if forward else (g.p, g.s)
    stride1 = g.stride == (1, 1, 1)
    wide = max(s.span, o.span, wo.span) > ig.INDEX32_LIMIT
    has_bias = bias is not None
    bias_ref = ig.bias_operand(bias, dtype)
    run = kernel("dw_conv", dtype, cl, mode, stride1, wide, has_bias,
                 bool(problem.accumulate), not applies(problem))
    channels, per_group, summed = (g.k, g.kg, g.cg) if forward else (g.c, g.cg, g.kg)
    threads = g.n * channels * out_size[0] * out_size[1] * -(-out_size[2] // V)
    launch(run, -(-threads // THREADS), THREADS,
           s.ref, wo.ref, o.ref, bias_ref, g.n, channels, *src_size, *out_size, *s.strides,
           *o.strides, *g.r, wo.strides[0], *wo.strides[2:], *g.stride, *g.dilation,
           *g.before, per_group, summed, wo.strides[1])
    ig._written(target, result, g, cl)
    return result


def weight_gradient(problem, x, dy, out):
    """Depthwise ``dw = [dw +] sum over images and positions of dy x`` by chunks."""
    g = geom(problem)
    dtype = problem.dtype
    cl = problem.channels_last
    result = out if out is not None else device_array(problem.w_shape, dtype)
    if math.prod(problem.w_shape) == 0:
        return result
    xo = ig.operand(x, cl, g)
    yo = ig.operand(dy, cl, g)
    target, wo = ig._writable(result, problem.w_shape, g, None, problem.accumulate)
    cb = 32 if cl else 1
    channel_blocks = -(-g.c // cb)
    lanes = THREADS // cb
    total = g.n * g.positions
    chunks, chunk_len = ig.row_chunks(total, channel_blocks, lanes, WEIGHT_TARGET_BLOCKS)
    count = g.c * g.taps
    partial = ig.workspace("partials", chunks * count, ig._acc(dtype))
    wide = max(xo.span, yo.span, chunks * count) > ig.INDEX32_LIMIT
    run = kernel("dw_weight", dtype, cl, tuple(g.r), wide)
    launch(run, (channel_blocks, chunks), THREADS,
           xo.ref, yo.ref, ig._ref(partial), g.n, g.c, *g.s, *g.p, *xo.strides, *yo.strides,
           *g.stride, *g.dilation, *g.before, chunk_len)
    launch(ig.kernel("sum_chunks", dtype), -(-count // 256), 256,
           ig._ref(partial), wo.ref, count, chunks, 1, g.taps, g.r[1], g.r[2],
           bool(problem.accumulate), *wo.strides)
    ig._written(target, result, g, None)
    return result
