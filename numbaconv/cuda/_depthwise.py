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
    # 32-bit copies of the arguments (Numba computes int32 products in 64 bits: each
    # product in the loops below is cut back to I).
    s0_, s1_, s2_ = I(s0), I(s1), I(s2)
    w0_, w1_, w2_ = I(w0), I(w1), I(w2)
    st0_, st1_, st2_ = I(st0), I(st1), I(st2)
    dl0_, dl1_, dl2_ = I(dl0), I(dl1), I(dl2)
    bf0_, bf1_, bf2_ = I(bf0), I(bf1), I(bf2)
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
        sbase = I(sgroup + I(m * sC))
        wbase = I(wgroup + I(m * wstep))
        for t0 in range(R0):
#if forward
            i0 = I(I(I(p0 * st0_) - bf0_) + I(t0 * dl0_))
            ok0 = U(i0) < U(S0)
#elif stride1
            i0 = I(I(p0 + bf0_) - I(t0 * dl0_))
            ok0 = U(i0) < U(S0)
#else
            m0 = I(I(p0 + bf0_) - I(t0 * dl0_))
            i0 = I(U(m0) // U(st0_))
            ok0 = (m0 >= 0) & (I(m0 - I(i0 * st0_)) == 0) & (i0 < S0)
#end
            if ok0:
                for t1 in range(R1):
#if forward
                    i1 = I(I(I(p1 * st1_) - bf1_) + I(t1 * dl1_))
                    ok1 = U(i1) < U(S1)
#elif stride1
                    i1 = I(I(p1 + bf1_) - I(t1 * dl1_))
                    ok1 = U(i1) < U(S1)
#else
                    m1 = I(I(p1 + bf1_) - I(t1 * dl1_))
                    i1 = I(U(m1) // U(st1_))
                    ok1 = (m1 >= 0) & (I(m1 - I(i1 * st1_)) == 0) & (i1 < S1)
#end
                    if ok1:
                        row = I(sbase + I(I(i0 * s0_) + I(i1 * s1_)))
                        wrow = I(wbase + I(I(t0 * w0_) + I(t1 * w1_)))
                        for t2 in range(R2):
                            wv = acc(w[U(I(wrow + I(t2 * w2_)))])
#if forward
                            b2 = I(I(t2 * dl2_) - bf2_)
#else
                            b2 = I(bf2_ - I(t2 * dl2_))
#end
#unroll v V
#if forward
                            i2 = I(I(I(pb + {v}) * st2_) + b2)
                            if U(i2) < U(S2):
                                acc_{v} += wv * acc(src[U(I(row + I(i2 * s2_)))])
#elif stride1
                            i2 = I(I(pb + {v}) + b2)
                            if U(i2) < U(S2):
                                acc_{v} += wv * acc(src[U(I(row + I(i2 * s2_)))])
#else
                            m2 = I(I(pb + {v}) + b2)
                            i2 = I(U(m2) // U(st2_))
                            if (m2 >= 0) & (I(m2 - I(i2 * st2_)) == 0) & (i2 < S2):
                                acc_{v} += wv * acc(src[U(I(row + I(i2 * s2_)))])
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
#unroll t T
    s_{t} = acc(0)
#end
    p_2 = I(P2)
    p_1 = I(P1)
    p_0 = I(P0)
    P12 = I(p_1 * p_2)
    PP = I(p_0 * P12)
    j = I(chunk * chunk_len + lane)
    j_stop = min(I(chunk * chunk_len + chunk_len), I(n_images * PP))
    if (j < j_stop) & (c < C):
        # The lane's first row, decoded once; then each step adds PL in the rows' mixed
        # radix (images, P0, P1, P2): a digit each, one carry each.
        n = I(U(j) // U(PP))
        r = I(j - n * PP)
        q0 = I(U(r) // U(P12))
        rr = I(r - q0 * P12)
        q1 = I(U(rr) // U(p_2))
        q2 = I(rr - q1 * p_2)
        d2 = I(U(PL) % U(p_2))
        d1 = I(U(PL) // U(p_2) % U(p_1))
        d0 = I(U(PL) // U(P12) % U(p_0))
        dn = I(U(PL) // U(PP))
        # 32-bit copies of the arguments (Numba computes int32 products in 64 bits: each
        # product and sum below is cut back to I).
        yN_, y0_, y1_, y2_ = I(yN), I(y0), I(y1), I(y2)
        xN_, x0_, x1_, x2_ = I(xN), I(x0), I(x1), I(x2)
        st0_, st1_, st2_ = I(st0), I(st1), I(st2)
        bf0_, bf1_, bf2_ = I(bf0), I(bf1), I(bf2)
        dl0_, dl1_, dl2_ = I(dl0), I(dl1), I(dl2)
        yb = I(c * I(yC))
        xb = I(c * I(xC))
        e0 = I(dl0_ * x0_)
        e1 = I(dl1_ * x1_)
        e2 = I(dl2_ * x2_)
        while True:
            ya = I(I(yb + I(n * yN_)) + I(I(q0 * y0_) + I(I(q1 * y1_) + I(q2 * y2_))))
            g = acc(dy[U(ya)])
            i0 = I(I(q0 * st0_) - bf0_)
            i1 = I(I(q1 * st1_) - bf1_)
            i2 = I(I(q2 * st2_) - bf2_)
            xr = I(I(xb + I(n * xN_)) + I(I(i0 * x0_) + I(I(i1 * x1_) + I(i2 * x2_))))
#unroll t T
            if ((U(I(i0 + I({t // (R1C * R2C)} * dl0_))) < U(S0))
                    & (U(I(i1 + I({t // R2C % R1C} * dl1_))) < U(S1))
                    & (U(I(i2 + I({t % R2C} * dl2_))) < U(S2))):
                s_{t} += g * acc(x[U(I(xr + I(I({t // (R1C * R2C)} * e0)
                                               + I(I({t // R2C % R1C} * e1)
                                                   + I({t % R2C} * e2)))))])
#end
            j = I(j + PL)
            if j >= j_stop:
                break
            q2 = I(q2 + d2)
            q1 = I(q1 + d1)
            if q2 >= p_2:
                q2 = I(q2 - p_2)
                q1 = I(q1 + 1)
            q0 = I(q0 + d0)
            if q1 >= p_1:
                q1 = I(q1 - p_1)
                q0 = I(q0 + 1)
            n = I(n + dn)
            if q0 >= p_0:
                q0 = I(q0 - p_0)
                n = I(n + 1)
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


class _ConvSetup:
    """A ``dw_conv`` launch of one problem (see :func:`convolution`): its grid, the kernel's
    key but for the index width, and the arguments after the operands' strides."""

    def __init__(self, problem, forward: bool):
        g = self.g = geom(problem)
        src_size, out_size = (g.s, g.p) if forward else (g.p, g.s)
        channels, per_group, summed = (g.k, g.kg, g.cg) if forward else (g.c, g.cg, g.kg)
        threads = g.n * channels * out_size[0] * out_size[1] * -(-out_size[2] // V)
        self.grid = -(-threads // THREADS)
        self.key = (problem.dtype, problem.channels_last, "forward" if forward else "data",
                    g.stride == (1, 1, 1))
        self.flags = (bool(problem.accumulate), not applies(problem))
        self.sizes = (g.n, channels, *src_size, *out_size)
        self.taps = g.r
        self.after = (*g.stride, *g.dilation, *g.before, per_group, summed)

    def kernel(self, wide: bool, has_bias: bool):
        return kernel("dw_conv", *self.key, wide, has_bias, *self.flags)


_conv_setup = ig.remembered_setup(_ConvSetup)


def convolution(mode: str, problem, src, w, bias, out, result_shape):
    """``out = [out +] conv(src, w) [+ bias]`` ("forward") or its data gradient / transposed
    convolution ("data") by ``dw_conv``: depthwise, or any grouping (each output sums its
    group's source channels one after another; the ``direct`` algorithm, chosen for groups
    of a few channels)."""
    result = out if out is not None else device_array(result_shape, problem.dtype)
    if math.prod(result_shape) == 0:
        return result
    at = _conv_setup(problem, mode == "forward")
    g, cl = at.g, problem.channels_last
    s = ig.operand(src, cl, g)
    target, o = ig._writable(result, result_shape, g, cl, problem.accumulate)
    wo = ig.operand(w, None, g)
    wide = max(s.span, o.span, wo.span) > ig.INDEX32_LIMIT
    launch(at.kernel(wide, bias is not None), at.grid, THREADS,
           s.ref, wo.ref, o.ref, ig.bias_operand(bias, problem.dtype), *at.sizes, *s.strides,
           *o.strides, *at.taps, wo.strides[0], *wo.strides[2:], *at.after, wo.strides[1])
    ig._written(target, result, g, cl)
    return result


class _WeightSetup:
    """The depthwise weight gradient's launches of one problem (see
    :func:`weight_gradient`): grids, split and the arguments that do not come from the
    operands."""

    def __init__(self, problem):
        g = self.g = geom(problem)
        dtype = problem.dtype
        cb = 32 if problem.channels_last else 1
        channel_blocks = -(-g.c // cb)
        lanes = THREADS // cb
        chunks, chunk_len = ig.row_chunks(g.n * g.positions, channel_blocks, lanes,
                                          WEIGHT_TARGET_BLOCKS)
        self.chunks, self.count = chunks, g.c * g.taps
        self.acc = ig._acc(dtype)
        self.key = (dtype, problem.channels_last, tuple(g.r))
        self.grid = (channel_blocks, chunks)
        self.sizes = (g.n, g.c, *g.s, *g.p)
        self.after = (*g.stride, *g.dilation, *g.before, chunk_len)
        self.sum = ig.kernel("sum_chunks", dtype)
        self.sum_grid = -(-self.count // 256)
        self.sum_args = (self.count, chunks, 1, g.taps, g.r[1], g.r[2],
                         bool(problem.accumulate))


_weight_setup = ig.remembered_setup(_WeightSetup)


def weight_gradient(problem, x, dy, out):
    """Depthwise ``dw = [dw +] sum over images and positions of dy x`` by chunks."""
    result = out if out is not None else device_array(problem.w_shape, problem.dtype)
    if math.prod(problem.w_shape) == 0:
        return result
    device = ig._device_id()
    at = _weight_setup(problem)
    g, cl = at.g, problem.channels_last
    xo = ig.operand(x, cl, g)
    yo = ig.operand(dy, cl, g)
    target, wo = ig._writable(result, problem.w_shape, g, None, problem.accumulate)
    partial = ig._ref(ig.workspace("partials", at.chunks * at.count, at.acc, device))
    wide = max(xo.span, yo.span, at.chunks * at.count) > ig.INDEX32_LIMIT
    launch(kernel("dw_weight", *at.key, wide), at.grid, THREADS,
           xo.ref, yo.ref, partial, *at.sizes, *xo.strides, *yo.strides, *at.after)
    launch(at.sum, at.sum_grid, 256, partial, wo.ref, *at.sum_args, *wo.strides)
    ig._written(target, result, g, None)
    return result
