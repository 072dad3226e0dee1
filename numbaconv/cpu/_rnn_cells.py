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
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from ..config import jit_options

_jit = numba.njit(**jit_options())


@numba.njit(inline="always", **jit_options(parallel=False))
def _sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


# --- forward -------------------------------------------------------------------------------

@_jit
def lstm_forward_step(xg, hg, bias, c, hout, y, cells, lengths, t, store, write_y):
    """i, f, g, o from ``xg + hg + bias`` (N, 4H); c (N, H) updated in place; ``o * tanh(c)``
    written to hout (N, H) and, with write_y, to y (N, H); the new c to cells; with store,
    xg is overwritten with the activations."""
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
        for j in range(hs):
            i = _sigmoid(xg[n, j] + hg[n, j] + bias[j])
            f = _sigmoid(xg[n, hs + j] + hg[n, hs + j] + bias[hs + j])
            g = math.tanh(xg[n, 2 * hs + j] + hg[n, 2 * hs + j] + bias[2 * hs + j])
            o = _sigmoid(xg[n, 3 * hs + j] + hg[n, 3 * hs + j] + bias[3 * hs + j])
            cn = f * c[n, j] + i * g
            h = o * math.tanh(cn)
            c[n, j] = cn
            cells[n, j] = cn
            hout[n, j] = h
            if write_y:
                y[n, j] = h
            if store:
                xg[n, j] = i
                xg[n, hs + j] = f
                xg[n, 2 * hs + j] = g
                xg[n, 3 * hs + j] = o


@_jit
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


@_jit
def gru_forward_step(xg, hg, b_ih, b_hh, h, y, lengths, t, store):
    """r, z, n of PyTorch's GRU from xg (N, >= 3H: the input projection) and hg (N, 3H: the
    hidden product); h (N, H) updated in place and written to y; with store, xg (N, 4H)
    receives r, z, n and ``hn = W_hn h + b_hn``."""
    n_rows, hs = h.shape
    for n in prange(n_rows):
        if t >= lengths[n]:
            for j in range(hs):
                y[n, j] = 0.0
            if store:
                for j in range(4 * hs):
                    xg[n, j] = 0.0
            continue
        for j in range(hs):
            r = _sigmoid(xg[n, j] + b_ih[j] + hg[n, j] + b_hh[j])
            z = _sigmoid(xg[n, hs + j] + b_ih[hs + j] + hg[n, hs + j] + b_hh[hs + j])
            hn = hg[n, 2 * hs + j] + b_hh[2 * hs + j]
            nn = math.tanh(xg[n, 2 * hs + j] + b_ih[2 * hs + j] + r * hn)
            hnew = (1.0 - z) * nn + z * h[n, j]
            h[n, j] = hnew
            y[n, j] = hnew
            if store:
                xg[n, j] = r
                xg[n, hs + j] = z
                xg[n, 2 * hs + j] = nn
                xg[n, 3 * hs + j] = hn


@_jit
def rnn_forward_step(xg, hg, bias, h, y, lengths, t, store, relu):
    """``h = act(xg + hg + bias)`` (tanh, or ReLU with relu), written to y; with store, xg
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
            pre = xg[n, j] + hg[n, j] + bias[j]
            if relu:
                a = pre if (pre > 0.0 or pre != pre) else 0.0  # NaN stays, like np.maximum
            else:
                a = math.tanh(pre)
            h[n, j] = a
            y[n, j] = a
            if store:
                xg[n, j] = a


# --- backward ------------------------------------------------------------------------------
# dh holds the direct part of the state gradient carried from the previous backward step and
# rec the recurrent part (dgates @ W_hh); their sum is the gradient of the state after step
# t. Inside the sequence, dy_t is added and the step's gates differentiated; outside, the sum
# passes through unchanged.

@_jit
def gradient_of_output(dh, rec, dy, dproj, lengths, t):
    """LSTM with projection: ``dproj = dh + rec + dy`` inside the sequence (zero outside,
    where dh becomes dh + rec); dh is zeroed inside (the cell adds no direct part)."""
    n_rows, p = dh.shape
    for n in prange(n_rows):
        inside = t < lengths[n]
        for j in range(p):
            g = dh[n, j] + rec[n, j]
            if inside:
                dproj[n, j] = g + dy[n, j]
                dh[n, j] = 0.0
            else:
                dproj[n, j] = 0.0
                dh[n, j] = g


@_jit
def lstm_backward_step(gates, cells, c_prev, dh, rec, dy, dm, dc, lengths, t, projected):
    """Overwrite gates (N, 4H) with the gradients of their pre-activations; dc (N, H) becomes
    the gradient of the previous cell state. Without projection the gradient of h is
    ``dh + rec + dy`` (dh then holds zero inside the sequence, the sum outside); with it, dm
    (N, H) is that gradient already multiplied by W_hr, and cells receives ``o * tanh(c)``
    (the projection's input, for the weight gradient)."""
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
                    dh[n, j] += rec[n, j]
            continue
        for j in range(hs):
            if projected:
                g_h = dm[n, j]
            else:
                g_h = dh[n, j] + rec[n, j] + dy[n, j]
                dh[n, j] = 0.0
            i = gates[n, j]
            f = gates[n, hs + j]
            g = gates[n, 2 * hs + j]
            o = gates[n, 3 * hs + j]
            tc = math.tanh(cells[n, j])
            dcn = dc[n, j] + g_h * o * (1.0 - tc * tc)
            gates[n, j] = dcn * g * i * (1.0 - i)
            gates[n, hs + j] = dcn * c_prev[n, j] * f * (1.0 - f)
            gates[n, 2 * hs + j] = dcn * i * (1.0 - g * g)
            gates[n, 3 * hs + j] = g_h * tc * o * (1.0 - o)
            dc[n, j] = dcn * f
            if projected:
                cells[n, j] = o * tc


@_jit
def gru_backward_step(gates, h_prev, hx, dh, rec, dy, lengths, t, reverse):
    """Overwrite gates (N, 4H: r, z, n, hn) with dr, dz, ``r * dn`` (the hidden path's n
    gradient) and dn (the input path's), so that the hidden path's three blocks are
    contiguous for the recurrent product; dh receives the direct part ``dh_t * z``. h_prev is the previous step's
    output, replaced by hx where that step is outside the sequence (reverse direction)."""
    n_rows, hs = dh.shape
    for n in prange(n_rows):
        if t >= lengths[n]:
            for j in range(4 * hs):
                gates[n, j] = 0.0
            for j in range(hs):
                dh[n, j] += rec[n, j]
            continue
        first = reverse and t + 1 >= lengths[n]
        for j in range(hs):
            g_h = dh[n, j] + rec[n, j] + dy[n, j]
            r = gates[n, j]
            z = gates[n, hs + j]
            nn = gates[n, 2 * hs + j]
            hn = gates[n, 3 * hs + j]
            hp = hx[n, j] if first else h_prev[n, j]
            dn = g_h * (1.0 - z) * (1.0 - nn * nn)
            gates[n, j] = dn * hn * r * (1.0 - r)
            gates[n, hs + j] = g_h * (hp - nn) * z * (1.0 - z)
            gates[n, 2 * hs + j] = dn * r
            gates[n, 3 * hs + j] = dn
            dh[n, j] = g_h * z


@_jit
def rnn_backward_step(gates, dh, rec, dy, lengths, t, relu):
    """Overwrite gates (N, H: the activations h) with the pre-activation gradient."""
    n_rows, hs = dh.shape
    for n in prange(n_rows):
        if t >= lengths[n]:
            for j in range(hs):
                gates[n, j] = 0.0
                dh[n, j] += rec[n, j]
            continue
        for j in range(hs):
            g_h = dh[n, j] + rec[n, j] + dy[n, j]
            a = gates[n, j]
            if relu:
                gates[n, j] = g_h if a > 0.0 else 0.0 * g_h
            else:
                gates[n, j] = g_h * (1.0 - a * a)
            dh[n, j] = 0.0


@_jit
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
