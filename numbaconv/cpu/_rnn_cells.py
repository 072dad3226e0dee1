"""Numba kernels for one time step of the recurrent cells: the gate nonlinearities of the
forward pass, fused with the state update, and their derivatives for the backward pass.

Everything that is a matrix product (input projections of all steps, the recurrent product
of one step, the projection of an LSTM with proj_size) stays in BLAS; these kernels do the
element-wise rest in one pass over the gates, parallel over the batch. A row n is inside its
sequence at step t when ``t < lengths[n]``; outside, the state is carried unchanged, the
output is zero and the stored gates (or their gradients) are zero, as the reserve's layout
(:class:`numbaconv.problem.RNNReserveLayout`) specifies.

Gate order is PyTorch's: LSTM (i, f, g, o), GRU (r, z, n) plus the GRU's hidden-path product
``hn = W_hn h + b_hn`` stored as a fourth block.

The recurrent products arrive as (G*H, N) views: ``hg = W_hh @ h.T`` in the forward and
``rec`` (P, N), the transpose of ``dgates @ W_hh``, in the backward. Where the micro-kernel
takes the states as its MR side (:func:`.rnn_forward.weights_as_columns`: every chain with
AVX-512) the view is the transpose of an (N, G*H) buffer and a row's values lie in one run;
with the weights as its MR side they lie a column apart, which the kernels read with a
stride (docs/cpu-algorithms.md, "Recurrent networks").
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
from numba import prange, types
from numba.extending import overload

from ..config import parallel_jit, serial_twin


#: Elements per step (N times the gate width) from which the step kernels run in parallel.
#: Below it, waking the thread pool costs more than the step (and, on a busy machine, a
#: parallel region can wait milliseconds for a core).
PARALLEL_MIN_ELEMENTS = 1 << 14


def fast_tanh(x):
    """tanh; in float32 kernels a rational approximation that vectorises (see below)."""
    return math.tanh(x)


@overload(fast_tanh)
def _fast_tanh(x):
    if x == types.float32:
        # float32 has no vectorised libm here (Numba's SVML support needs a patched LLVM),
        # and a scalar tanh per gate costs more than the recurrent product. An odd/even
        # rational minimax fit on [-7.9, 7.9] (the form Eigen's fast tanh uses): at most
        # 4e-7 absolute and relative error against float64 tanh, about 3 ulp.
        def impl(x):
            bound = np.float32(7.90531110763549805)
            xc = x if x < bound else bound
            xc = xc if xc > -bound else -bound
            x2 = xc * xc
            p = np.float32(-2.76076847742355e-16)
            p = p * x2 + np.float32(2.00018790482477e-13)
            p = p * x2 + np.float32(-8.60467152213735e-11)
            p = p * x2 + np.float32(5.12229709037114e-08)
            p = p * x2 + np.float32(1.48572235717979e-05)
            p = p * x2 + np.float32(6.37261928875436e-04)
            p = p * x2 + np.float32(4.89352455891786e-03)
            q = np.float32(1.19825839466702e-06)
            q = q * x2 + np.float32(1.18534705686654e-04)
            q = q * x2 + np.float32(2.26843463243900e-03)
            q = q * x2 + np.float32(4.89352518554385e-03)
            r = xc * p / q
            r = x if abs(x) < np.float32(0.0004) else r
            return r if x == x else x  # NaN in, NaN out
        return impl
    return lambda x: math.tanh(x)


def fast_sigmoid(x):
    """The logistic function; in float32 kernels through :func:`fast_tanh`."""
    return 1.0 / (1.0 + math.exp(-x))


@overload(fast_sigmoid)
def _fast_sigmoid(x):
    if x == types.float32:
        def impl(x):
            half = np.float32(0.5)
            return half + half * fast_tanh(half * x)
        return impl
    return lambda x: 1.0 / (1.0 + math.exp(-x))


# --- forward -------------------------------------------------------------------------------

def lstm_forward_step(xg, hg, bias, c, hout, y, cells, lengths, t, store, write_y,
                      work):
    """i, f, g, o from ``xg + hg.T + bias`` (xg: N, 4H; hg: 4H, N); c (N, H) updated in place; ``o * tanh(c)``
    written to hout (N, H) and, with write_y, to y (N, H); the new c to cells; with store,
    xg is overwritten with the activations. work: scratch (N, 5H)."""
    n_rows, hs = c.shape
    for n in prange(n_rows):
        if t >= lengths[n]:
            for j in range(hs):
                cells[n, j] = c[n, j]
                if write_y:
                    y[n, j] = 0.0
            if store:
                for j in range(4 * hs):
                    xg[n, j] = 0.0
            continue
        # Phases of simple loops over one row, each touching few arrays and indexing views
        # from 0 (an index like ``hs + j`` may be negative as far as LLVM knows, and
        # Numba's wraparound check on it stops vectorisation), so that every loop
        # vectorises; one fused loop over the four gates ran 3 times slower.
        a = work[n, :4 * hs]
        tc = work[n, 4 * hs:]
        xr, hr, cr = xg[n], hg[:, n], c[n]
        for j in range(4 * hs):
            a[j] = xr[j] + hr[j] + bias[j]
        i_f, i, f = a[:2 * hs], a[:hs], a[hs:2 * hs]
        g, o = a[2 * hs:3 * hs], a[3 * hs:]
        for j in range(2 * hs):
            i_f[j] = fast_sigmoid(i_f[j])
        for j in range(hs):
            g[j] = fast_tanh(g[j])
        for j in range(hs):
            o[j] = fast_sigmoid(o[j])
        for j in range(hs):
            cr[j] = f[j] * cr[j] + i[j] * g[j]
        for j in range(hs):
            tc[j] = o[j] * fast_tanh(cr[j])
        cells[n, :] = cr
        hout[n, :] = tc
        if write_y:
            y[n, :] = tc
        if store:
            xr[:] = a


def commit_projection(hp, h, y, lengths, t):
    """The projected state hp (N, P) becomes h and y where the row is inside its sequence;
    y is zero elsewhere and h keeps its value."""
    n_rows, p = hp.shape
    for n in prange(n_rows):
        inside = t < lengths[n]
        for j in range(p):
            if inside:
                h[n, j] = hp[n, j]
                y[n, j] = hp[n, j]
            else:
                y[n, j] = 0.0


def gru_forward_step(xg, hg, b_ih, b_hh, h, y, lengths, t, store, one, work):
    """r, z, n of PyTorch's GRU from xg (N, >= 3H: the input projection) and hg (3H, N: the
    hidden product, transposed); h (N, H) updated in place and written to y; with store, xg (N, 4H)
    receives r, z, n and ``hn = W_hn h + b_hn``. work: scratch (N, 4H)."""
    n_rows, hs = h.shape
    for n in prange(n_rows):
        if t >= lengths[n]:
            for j in range(hs):
                y[n, j] = 0.0
            if store:
                for j in range(4 * hs):
                    xg[n, j] = 0.0
            continue
        # Row views indexed from 0, one simple loop each: see lstm_forward_step.
        xr, hr, hrow = xg[n], hg[:, n], h[n]
        a = work[n]
        rz, r, z, nv, hn = a[:2 * hs], a[:hs], a[hs:2 * hs], a[2 * hs:3 * hs], a[3 * hs:]
        x_rz, h_rz, bi_rz, bh_rz = xr[:2 * hs], hr[:2 * hs], b_ih[:2 * hs], b_hh[:2 * hs]
        x_n, h_n, bi_n, bh_n = xr[2 * hs:3 * hs], hr[2 * hs:3 * hs], b_ih[2 * hs:], b_hh[2 * hs:]
        for j in range(2 * hs):
            rz[j] = fast_sigmoid(x_rz[j] + bi_rz[j] + h_rz[j] + bh_rz[j])
        for j in range(hs):
            hn[j] = h_n[j] + bh_n[j]
        for j in range(hs):
            nv[j] = fast_tanh(x_n[j] + bi_n[j] + r[j] * hn[j])
        for j in range(hs):
            hrow[j] = (one - z[j]) * nv[j] + z[j] * hrow[j]
        y[n, :] = hrow
        if store:
            xr[:4 * hs] = a


def rnn_forward_step(xg, hg, bias, h, y, lengths, t, store, relu):
    """``h = act(xg + hg.T + bias)`` (tanh, or ReLU with relu), written to y; with store, xg
    receives h."""
    n_rows, hs = h.shape
    for n in prange(n_rows):
        if t >= lengths[n]:
            for j in range(hs):
                y[n, j] = 0.0
                if store:
                    xg[n, j] = 0.0
            continue
        for j in range(hs):
            pre = xg[n, j] + hg[j, n] + bias[j]
            if relu:
                a = pre if (pre > 0.0 or pre != pre) else 0.0  # NaN stays, like np.maximum
            else:
                a = fast_tanh(pre)
            h[n, j] = a
            y[n, j] = a
            if store:
                xg[n, j] = a


# --- backward ------------------------------------------------------------------------------
# dh holds the direct part of the state gradient carried from the previous backward step and
# rec the recurrent part (dgates @ W_hh, as its transpose (P, N)); their sum is the gradient of the state after step
# t. Inside the sequence, dy_t is added and the step's gates differentiated; outside, the sum
# passes through unchanged.

def gradient_of_output(dh, rec, dy, dproj, lengths, t):
    """LSTM with projection: ``dproj = dh + rec + dy`` inside the sequence (zero outside,
    where dh becomes dh + rec); dh is zeroed inside (the cell adds no direct part)."""
    n_rows, p = dh.shape
    for n in prange(n_rows):
        inside = t < lengths[n]
        for j in range(p):
            g = dh[n, j] + rec[j, n]
            if inside:
                dproj[n, j] = g + dy[n, j]
                dh[n, j] = 0.0
            else:
                dproj[n, j] = 0.0
                dh[n, j] = g


def lstm_backward_step(gates, cells, c_prev, dh, rec, dy, dm, dc, lengths, t, projected, one,
                       work):
    """Overwrite gates (N, 4H) with the gradients of their pre-activations; dc (N, H) becomes
    the gradient of the previous cell state. Without projection the gradient of h is
    ``dh + rec + dy`` (dh then holds zero inside the sequence, the sum outside); with it, dm
    (N, H) is that gradient already multiplied by W_hr, and cells receives ``o * tanh(c)``
    (the projection's input, for the weight gradient). work: scratch (N, 3H)."""
    n_rows, hs = dc.shape
    for n in prange(n_rows):
        if t >= lengths[n]:
            for j in range(4 * hs):
                gates[n, j] = 0.0
            if projected:
                for j in range(hs):
                    cells[n, j] = 0.0
            else:
                for j in range(hs):
                    dh[n, j] += rec[j, n]
            continue
        # Row views indexed from 0, one simple loop each: see lstm_forward_step.
        gr, cr, cp, dcr = gates[n], cells[n], c_prev[n], dc[n]
        i, f, g, o = gr[:hs], gr[hs:2 * hs], gr[2 * hs:3 * hs], gr[3 * hs:]
        w = work[n]
        tc, gh, dcn = w[:hs], w[hs:2 * hs], w[2 * hs:]
        for j in range(hs):
            tc[j] = fast_tanh(cr[j])
        if projected:
            gh[:] = dm[n]
            for j in range(hs):
                cr[j] = o[j] * tc[j]
        else:
            dhr, rr, dyr = dh[n], rec[:, n], dy[n]
            for j in range(hs):
                gh[j] = dhr[j] + rr[j] + dyr[j]
            dhr[:] = 0.0
        for j in range(hs):
            dcn[j] = dcr[j] + gh[j] * o[j] * (one - tc[j] * tc[j])
        for j in range(hs):
            o[j] = gh[j] * tc[j] * o[j] * (one - o[j])
        for j in range(hs):
            dcr[j] = dcn[j] * f[j]
        for j in range(hs):
            f[j] = dcn[j] * cp[j] * f[j] * (one - f[j])
        for j in range(hs):
            ii, gg = i[j], g[j]
            i[j] = dcn[j] * gg * ii * (one - ii)
            g[j] = dcn[j] * ii * (one - gg * gg)


def gru_backward_step(gates, h_prev, hx, dh, rec, dy, lengths, t, reverse, one, work):
    """Overwrite gates (N, 4H: r, z, n, hn) with dr, dz, ``r * dn`` (the hidden path's n
    gradient) and dn (the input path's), so that the hidden path's three blocks are
    contiguous for the recurrent product; dh receives the direct part ``dh_t * z``. h_prev
    is the previous step's output, replaced by hx where that step is outside the sequence
    (reverse direction). work: scratch (N, 2H)."""
    n_rows, hs = dh.shape
    for n in prange(n_rows):
        if t >= lengths[n]:
            for j in range(4 * hs):
                gates[n, j] = 0.0
            for j in range(hs):
                dh[n, j] += rec[j, n]
            continue
        # Row views indexed from 0, one simple loop each: see lstm_forward_step.
        gr, dhr, rr, dyr = gates[n], dh[n], rec[:, n], dy[n]
        hp = hx[n] if reverse and t + 1 >= lengths[n] else h_prev[n]
        r, z, nn, hn = gr[:hs], gr[hs:2 * hs], gr[2 * hs:3 * hs], gr[3 * hs:]
        w = work[n]
        gh, dn = w[:hs], w[hs:2 * hs]
        for j in range(hs):
            gh[j] = dhr[j] + rr[j] + dyr[j]
        for j in range(hs):
            dn[j] = gh[j] * (one - z[j]) * (one - nn[j] * nn[j])
        for j in range(hs):
            dhr[j] = gh[j] * z[j]
        for j in range(hs):
            z[j] = gh[j] * (hp[j] - nn[j]) * z[j] * (one - z[j])
        for j in range(hs):
            rj = r[j]
            r[j] = dn[j] * hn[j] * rj * (one - rj)
            nn[j] = dn[j] * rj
        # A loop, not ``hn[:] = dn``: inside a prange body Numba makes that slice copy a
        # parfor of its own, and the parallel compilation then wrote other rows' values
        # (the GRU's gradients were wrong from PARALLEL_MIN_ELEMENTS on).
        for j in range(hs):
            hn[j] = dn[j]


def rnn_backward_step(gates, dh, rec, dy, lengths, t, relu, one):
    """Overwrite gates (N, H: the activations h) with the pre-activation gradient."""
    n_rows, hs = dh.shape
    for n in prange(n_rows):
        if t >= lengths[n]:
            for j in range(hs):
                gates[n, j] = 0.0
                dh[n, j] += rec[j, n]
            continue
        for j in range(hs):
            g_h = dh[n, j] + rec[j, n] + dy[n, j]
            a = gates[n, j]
            if relu:
                gates[n, j] = g_h if a > 0.0 else 0.0 * g_h
            else:
                gates[n, j] = g_h * (one - a * a)
            dh[n, j] = 0.0


@parallel_jit
def column_sums(a, out, accumulate):
    """out[j] (+)= the sum of column j of a (rows, cols): partial sums over a fixed split of
    the rows, added in order, so the result does not depend on the thread count."""
    rows, cols = a.shape
    blocks = min(rows, 32)
    per = -(-rows // blocks)
    partial = np.zeros((blocks, cols), a.dtype)
    for b in prange(blocks):
        for r in range(b * per, min(rows, (b + 1) * per)):
            for j in range(cols):
                partial[b, j] += a[r, j]
    for j in prange(cols):
        total = partial[0, j]
        for b in range(1, blocks):
            total += partial[b, j]
        out[j] = out[j] + total if accumulate else total


STEP_KERNELS = ("lstm_forward_step", "commit_projection", "gru_forward_step",
                "rnn_forward_step", "gradient_of_output", "lstm_backward_step",
                "gru_backward_step", "rnn_backward_step")


@functools.lru_cache(maxsize=2)
def kernels(parallel: bool) -> SimpleNamespace:
    """The step kernels, compiled (lazily, on first call) with or without ``prange``
    threads. The serial twins are copies of the functions under another name, so that
    Numba's disk cache keeps the two compilations apart."""
    compiled = {}
    for name in STEP_KERNELS:
        func = globals()[name]
        compiled[name] = parallel_jit(func) if parallel else serial_twin(func)
    return SimpleNamespace(**compiled)


def kernels_for(batch: int, gate_width: int) -> SimpleNamespace:
    """Parallel kernels when a step has enough elements, else the serial ones."""
    return kernels(batch * gate_width >= PARALLEL_MIN_ELEMENTS)
