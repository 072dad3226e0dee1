"""The kernels of Winograd F(4x4, 3x3) (the ``winograd`` algorithm's larger tiles, driven by
:mod:`._winograd`): each 4x4 block of output pixels needs the 6x6 input patch above it, and
Y = A^T [(G g G^T) ⊙ (B^T d B)] A, 36 products where F(2x2, 3x3) has 16 for a quarter of the
pixels: 2.25 multiplications per output and tap row, against 4 (and 9 for im2col).

The interpolation points are 0, 1, -1, 2, -1/2 and infinity: Lavin & Gray's 0, +-1, +-2
put 5 and 8 into B and A and a larger float32 error (docs/cpu-algorithms.md, "`winograd`:
larger tiles"):

    B^T = [[1, 3/2, -2, -3/2, 1, 0],   G = [[1, 0, 0],            A^T = [[1, 1, 1, 1, 1, 0],
           [0, -1, -5/2, -1/2, 1, 0],        [-1/3, -1/3, -1/3],         [0, 1, -1, 2, -1/2, 0],
           [0, 1, 1/2, -5/2, 1, 0],          [1/3, -1/3, 1/3],           [0, 1, 1, 4, 1/4, 0],
           [0, -1/2, -1, 1/2, 1, 0],         [1/15, 2/15, 4/15],         [0, 1, -1, 8, -1/8, 1]]
           [0, 2, -1, -2, 1, 0],             [-16/15, 8/15, -4/15],
           [0, 1, 3/2, -2, -3/2, 1]]         [0, 0, 1]]

Channels-last only (a channels-first problem takes them through channels-last copies, as
:func:`._winograd.convolve` does for F(2x2, 3x3)): U (36, tiles, C), M (36, tiles, K) and
V (36, C, K), the loops over channels vectorised. The transforms multiply by constants of
the arrays' dtype (``consts``: a Python float would make Numba compute in float64) and keep
flat indices unsigned, as :mod:`._winograd`'s do. :func:`_tile` and :func:`_out` serve
both tile sizes.
"""

from __future__ import annotations

import numpy as np
from numba import prange, uint64

from ..config import parallel_jit, serial_jit


def constants(dtype) -> np.ndarray:
    """The transforms' constants in ``dtype``: 3/2, 2, 5/2, 1/2, 4, 1/4, 8, 1/8."""
    return np.array([1.5, 2.0, 2.5, 0.5, 4.0, 0.25, 8.0, 0.125], dtype)


@serial_jit
def _values(consts):
    """:func:`constants` as a tuple: values, which no store can change, so that LLVM keeps
    them in registers and vectorises the loops that use them."""
    return (consts[0], consts[1], consts[2], consts[3], consts[4], consts[5], consts[6],
            consts[7])


@serial_jit
def _tile(j, th, tw):
    """Image, tile row and tile column of global tile j (of ``th`` x ``tw`` per image)."""
    per_image = th * tw
    n = j // per_image
    rest = j - n * per_image
    ty = rest // tw
    return n, ty, rest - ty * tw


@serial_jit
def _bt(d0, d1, d2, d3, d4, d5, k):
    """B^T applied to six values (k: :func:`constants`)."""
    return (d0 + k[0] * d1 - k[1] * d2 - k[0] * d3 + d4,
            d4 - d1 - k[2] * d2 - k[3] * d3,
            d1 + k[3] * d2 - k[2] * d3 + d4,
            k[3] * d3 - k[3] * d1 - d2 + d4,
            k[1] * d1 - d2 - k[1] * d3 + d4,
            d1 + k[0] * d2 - k[1] * d3 - k[0] * d4 + d5)


@serial_jit
def _at(m0, m1, m2, m3, m4, m5, k):
    """A^T applied to six values: four."""
    return (m0 + m1 + m2 + m3 + m4,
            m1 - m2 + k[1] * m3 - k[3] * m4,
            m1 + m2 + k[4] * m3 + k[5] * m4,
            m1 - m2 + k[6] * m3 - k[7] * m4 + m5)


@serial_jit
def _patch_row(xf, base, q, k):
    """B^T along one row of a patch: its six values xf[base + q[i]]."""
    return _bt(xf[base + q[0]], xf[base + q[1]], xf[base + q[2]], xf[base + q[3]],
               xf[base + q[4]], xf[base + q[5]], k)


@serial_jit
def _u(pf, rows, c, q, k, j):
    """Column j of U = B^T d B for channel c of the patch (rows: its rows' offsets): B^T
    across the entries j of the six rows' B^T."""
    a = _patch_row(pf, rows[0] + c, q, k)
    b = _patch_row(pf, rows[1] + c, q, k)
    d = _patch_row(pf, rows[2] + c, q, k)
    e = _patch_row(pf, rows[3] + c, q, k)
    g = _patch_row(pf, rows[4] + c, q, k)
    p = _patch_row(pf, rows[5] + c, q, k)
    return _bt(a[j], b[j], d[j], e[j], g[j], p[j], k)


@serial_jit
def _column(uf, at, step, col, v):
    """Column ``col`` (uint64) of a patch's U, the six values v, at uf[at + plane * step]
    (planes 6 * row + col)."""
    uf[at + col * step] = v[0]
    uf[at + (col + uint64(6)) * step] = v[1]
    uf[at + (col + uint64(12)) * step] = v[2]
    uf[at + (col + uint64(18)) * step] = v[3]
    uf[at + (col + uint64(24)) * step] = v[4]
    uf[at + (col + uint64(30)) * step] = v[5]


@parallel_jit
def _padded_cl(xf, pf, images, h, w, channels, b1, b2, ph, pw):
    """pf (N, PH, PW, C): x (N, H, W, C) shifted b1 rows down and b2 columns right (either
    may be negative: the data gradient's forward form of a wide padding starts inside x),
    zeros where no pixel of x lands (both flat)."""
    cs = uint64(channels)
    row = uint64(pw) * cs
    lo, hi = max(0, b2), min(pw, b2 + w)
    first, last = uint64(lo) * cs, uint64(max(lo, hi)) * cs
    for j in prange(images * ph):
        n, r = j // ph, j % ph
        out = uint64(j) * row
        src = r - b1
        if src < 0 or src >= h or hi <= lo:
            for e in range(row):
                pf[out + e] = 0
            continue
        for e in range(first):
            pf[out + e] = 0
        start = uint64((n * h + src) * w + lo - b2) * cs
        for e in range(last - first):
            pf[out + first + e] = xf[start + e]
        for e in range(last, row):
            pf[out + e] = 0


@parallel_jit
def _input_cl(pf, uf, step, t0, t1, th, tw, ph, pw, channels, pitch, consts):
    """U (36, tiles, C) of the tiles [t0, t1), from a padded channels-last copy of x
    (:func:`_padded_cl`: (N, PH, PW, C), every tile's patch inside it), both flat; U's
    tiles ``pitch`` (>= C) values apart, its planes ``step`` apart."""
    cs = uint64(channels)
    k = _values(consts)
    rs = uint64(pw) * cs
    for at in prange(t1 - t0):
        n, ty, tx = _tile(t0 + at, th, tw)
        col = uint64(4 * tx) * cs
        q = (col, col + cs, col + uint64(2) * cs, col + uint64(3) * cs, col + uint64(4) * cs,
             col + uint64(5) * cs)
        row0 = uint64((n * ph + 4 * ty) * pw) * cs
        rows = (row0, row0 + rs, row0 + uint64(2) * rs, row0 + uint64(3) * rs,
                row0 + uint64(4) * rs, row0 + uint64(5) * rs)
        out = uint64(at) * uint64(pitch)
        # One column of U a loop (B^T of the six rows' entries j), each loop reading the
        # patch again (from L1): LLVM vectorises a loop of 6 stores into one array, not of 12
        # or 36 (too many run-time overlap checks between them).
        for c in range(cs):
            _column(uf, out + c, step, uint64(0), _u(pf, rows, c, q, k, 0))
        for c in range(cs):
            _column(uf, out + c, step, uint64(1), _u(pf, rows, c, q, k, 1))
        for c in range(cs):
            _column(uf, out + c, step, uint64(2), _u(pf, rows, c, q, k, 2))
        for c in range(cs):
            _column(uf, out + c, step, uint64(3), _u(pf, rows, c, q, k, 3))
        for c in range(cs):
            _column(uf, out + c, step, uint64(4), _u(pf, rows, c, q, k, 4))
        for c in range(cs):
            _column(uf, out + c, step, uint64(5), _u(pf, rows, c, q, k, 5))


@serial_jit
def _out(value, big):
    """1 where ``value`` is not finite (NaN fails the comparison too), else 0."""
    return 0 if abs(value) <= big else 1


@serial_jit
def _at_row(mf, at, step, k):
    """A^T along one row of a tile's 6x6 M: its six values mf[at + i * step]."""
    return _at(mf[at], mf[at + step], mf[at + uint64(2) * step], mf[at + uint64(3) * step],
               mf[at + uint64(4) * step], mf[at + uint64(5) * step], k)


@serial_jit
def _y(mf, at, step, k, x):
    """Column x of a tile's outputs, Y = A^T M A (its four rows), from the tile's 36 values
    mf[at + plane * step]: A^T across the entries x of the six rows' A^T."""
    row = uint64(6) * step
    r0 = _at_row(mf, at, step, k)
    r1 = _at_row(mf, at + row, step, k)
    r2 = _at_row(mf, at + uint64(2) * row, step, k)
    r3 = _at_row(mf, at + uint64(3) * row, step, k)
    r4 = _at_row(mf, at + uint64(4) * row, step, k)
    r5 = _at_row(mf, at + uint64(5) * row, step, k)
    return _at(r0[x], r1[x], r2[x], r3[x], r4[x], r5[x], k)


@serial_jit
def _store_y(yf, at, row, v, big):
    """The four values v down a column of y (rows ``row`` apart, from yf[at]); returns how
    many are not finite."""
    yf[at] = v[0]
    yf[at + row] = v[1]
    yf[at + row + row] = v[2]
    yf[at + row + row + row] = v[3]
    return _out(v[0], big) + _out(v[1], big) + _out(v[2], big) + _out(v[3], big)


@parallel_jit
def _output_cl(mf, step, yf, t0, t1, th, tw, channels, big, consts):
    """y's 4x4 tiles [t0, t1) from M (36, tiles, K), into y (N, 4 * th, 4 * tw, K)
    channels-last (both flat; see :func:`_cropped_cl` for a y of other sizes); returns how
    many of the values written are not finite (see :func:`._winograd._output_cl`). One
    column of a tile a loop (4 stores; LLVM vectorises no loop of 16 here)."""
    ks = uint64(channels)
    k = _values(consts)
    row = uint64(4 * tw) * ks
    bad = 0
    for at in prange(t1 - t0):
        n, ty, tx = _tile(t0 + at, th, tw)
        top = uint64((n * 4 * th + 4 * ty) * 4 * tw + 4 * tx) * ks
        src = uint64(at) * ks
        part = 0
        for kk in range(ks):
            part += _store_y(yf, top + kk, row, _y(mf, src + kk, step, k, 0), big)
        for kk in range(ks):
            part += _store_y(yf, top + ks + kk, row, _y(mf, src + kk, step, k, 1), big)
        for kk in range(ks):
            part += _store_y(yf, top + uint64(2) * ks + kk, row, _y(mf, src + kk, step, k, 2),
                             big)
        for kk in range(ks):
            part += _store_y(yf, top + uint64(3) * ks + kk, row, _y(mf, src + kk, step, k, 3),
                             big)
        bad += part
    return bad


@parallel_jit
def _cropped_cl(tf, yf, images, th, tw, ph, pw, channels, big):
    """y (N, P1, P2, K) = the top-left corner of t (N, 4 * th, 4 * tw, K), both flat and
    channels-last; returns how many of the values copied are not finite."""
    ks = uint64(channels)
    run = uint64(pw) * ks
    bad = 0
    for j in prange(images * ph):
        n, r = j // ph, j % ph
        src = uint64((n * 4 * th + r) * 4 * tw) * ks
        out = uint64(j) * run
        part = 0
        for e in range(run):
            value = tf[src + e]
            yf[out + e] = value
            part += _out(value, big)
        bad += part
    return bad


def weight_constants(dtype) -> np.ndarray:
    """G's constants in ``dtype``: 1/3, 1/15, 2, 4, 8, 16 (its other entries are 0 and 1)."""
    return np.array([1 / 3, 1 / 15, 2.0, 4.0, 8.0, 16.0], dtype)


@serial_jit
def _g(a, b, c, k):
    """G applied to three values: six (k: :func:`weight_constants`)."""
    return (a, -(a + b + c) * k[0], (a - b + c) * k[0], (a + k[2] * b + k[3] * c) * k[1],
            (k[4] * b - k[5] * a - k[3] * c) * k[1], c)


@serial_jit
def _store_row(vf, o, plane, v):
    """vf[o + i * plane] = v[i] for the six values of one row of V; returns o + 6 * plane."""
    vf[o] = v[0]
    o += plane
    vf[o] = v[1]
    o += plane
    vf[o] = v[2]
    o += plane
    vf[o] = v[3]
    o += plane
    vf[o] = v[4]
    o += plane
    vf[o] = v[5]
    return o + plane


@parallel_jit
def _weights(wf, vf, first, last, width, swap, flipped, consts):
    """V[xi, a, b] = (G g G^T)[xi] for a in [first, last), b < width, where g is w[a, b]
    (w[b, a] with ``swap``; each tap flipped with ``flipped``); k: :func:`weight_constants`.

    Each a's 36 rows are computed into a scratch block of a padded pitch, then copied into
    V's planes: V's planes are C * K values apart, often a multiple of 4 KiB, and 36 values
    written there one (a, b) at a time would fall into one L1 set and evict each other.
    """
    height = uint64(vf.size // (36 * width))
    ws = uint64(width)
    plane = height * ws
    pitch = ws + uint64(16)
    k = (consts[0], consts[1], consts[2], consts[3], consts[4], consts[5])
    for a in prange(first, last):
        block = np.empty(36 * pitch, vf.dtype)
        for b in range(ws):
            at = (b * height + uint64(a) if swap else uint64(a) * ws + b) * uint64(9)
            g00, g01, g02 = wf[at], wf[at + uint64(1)], wf[at + uint64(2)]
            g10, g11, g12 = wf[at + uint64(3)], wf[at + uint64(4)], wf[at + uint64(5)]
            g20, g21, g22 = wf[at + uint64(6)], wf[at + uint64(7)], wf[at + uint64(8)]
            if flipped:
                g00, g01, g02, g10, g12, g20, g21, g22 = g22, g21, g20, g12, g10, g02, g01, g00
            # G g along the kernel's columns, then (G g) G^T along each row of that.
            c0 = _g(g00, g10, g20, k)
            c1 = _g(g01, g11, g21, k)
            c2 = _g(g02, g12, g22, k)
            o = _store_row(block, b, pitch, _g(c0[0], c1[0], c2[0], k))
            o = _store_row(block, o, pitch, _g(c0[1], c1[1], c2[1], k))
            o = _store_row(block, o, pitch, _g(c0[2], c1[2], c2[2], k))
            o = _store_row(block, o, pitch, _g(c0[3], c1[3], c2[3], k))
            o = _store_row(block, o, pitch, _g(c0[4], c1[4], c2[4], k))
            _store_row(block, o, pitch, _g(c0[5], c1[5], c2[5], k))
        out = uint64(a) * ws
        for xi in range(uint64(36)):
            row = xi * pitch
            target = xi * plane + out
            for b in range(ws):
                vf[target + b] = block[row + b]


# --- the weight gradient -------------------------------------------------------------------

@serial_jit
def _a(d0, d1, d2, d3, k):
    """A (6x4, the transpose of A^T) applied to four values: six (k: :func:`constants`)."""
    return (d0, d0 + d1 + d2 + d3, d0 - d1 + d2 - d3, d0 + k[1] * d1 + k[4] * d2 + k[6] * d3,
            d0 - k[3] * d1 + k[5] * d2 - k[7] * d3, d3)


@serial_jit
def _dy_row(df, base, q, k):
    """A along one row of a tile's 4x4 dy: its four values df[base + q[i]]."""
    return _a(df[base + q[0]], df[base + q[1]], df[base + q[2]], df[base + q[3]], k)


@serial_jit
def _d(dyf, rows, kk, q, k, j):
    """Column j of D = A dy A^T for output channel kk of a tile (rows: its four rows'
    offsets): A across the entries j of the four rows' A."""
    a = _dy_row(dyf, rows[0] + kk, q, k)
    b = _dy_row(dyf, rows[1] + kk, q, k)
    c = _dy_row(dyf, rows[2] + kk, q, k)
    d = _dy_row(dyf, rows[3] + kk, q, k)
    return _a(a[j], b[j], c[j], d[j], k)


@parallel_jit
def _grad_cl(dyf, df, step, t0, t1, th, tw, channels, consts):
    """D (36, tiles, K) of the tiles [t0, t1) from dy (N, 4 * th, 4 * tw, K) channels-last
    (whole tiles: a zero-padded copy where dy is smaller), both flat; D's planes ``step``
    apart. One column of D a loop, as :func:`_input_cl` writes U."""
    ks = uint64(channels)
    k = _values(consts)
    rs = uint64(4 * tw) * ks
    for at in prange(t1 - t0):
        n, ty, tx = _tile(t0 + at, th, tw)
        col = uint64(4 * tx) * ks
        q = (col, col + ks, col + uint64(2) * ks, col + uint64(3) * ks)
        row0 = uint64((n * 4 * th + 4 * ty) * 4 * tw) * ks
        rows = (row0, row0 + rs, row0 + uint64(2) * rs, row0 + uint64(3) * rs)
        out = uint64(at) * ks
        for kk in range(ks):
            _column(df, out + kk, step, uint64(0), _d(dyf, rows, kk, q, k, 0))
        for kk in range(ks):
            _column(df, out + kk, step, uint64(1), _d(dyf, rows, kk, q, k, 1))
        for kk in range(ks):
            _column(df, out + kk, step, uint64(2), _d(dyf, rows, kk, q, k, 2))
        for kk in range(ks):
            _column(df, out + kk, step, uint64(3), _d(dyf, rows, kk, q, k, 3))
        for kk in range(ks):
            _column(df, out + kk, step, uint64(4), _d(dyf, rows, kk, q, k, 4))
        for kk in range(ks):
            _column(df, out + kk, step, uint64(5), _d(dyf, rows, kk, q, k, 5))


@serial_jit
def _gt(v0, v1, v2, v3, v4, v5, k):
    """G^T applied to six values: three (k: :func:`weight_constants`)."""
    return (v0 + (v2 - v1) * k[0] + (v3 - k[5] * v4) * k[1],
            (k[2] * v3 + k[4] * v4) * k[1] - (v1 + v2) * k[0],
            (v2 - v1) * k[0] + (v3 - v4) * k[3] * k[1] + v5)


@serial_jit
def _gt_row(vf, at, plane, row, k):
    """G^T along row ``row`` of one weight's 6x6 dV (planes 6 * row + 0..5 at vf[at])."""
    base = at + uint64(6 * row) * plane
    return _gt(vf[base], vf[base + plane], vf[base + uint64(2) * plane],
               vf[base + uint64(3) * plane], vf[base + uint64(4) * plane],
               vf[base + uint64(5) * plane], k)


@parallel_jit
def _weights_back(vf, wf, first, last, kernels, channels, consts):
    """dw[k, c] = G^T dV[:, c, k] G for k in [first, last), dV channels-last (36, C, K),
    read along its rows (k innermost), each plane in order; dw (K, C, 3, 3)."""
    plane = uint64(kernels * channels)
    k = (consts[0], consts[1], consts[2], consts[3], consts[4], consts[5])
    for c in prange(channels):
        for kk in range(first, last):
            at = uint64(c * kernels + kk)
            r0 = _gt_row(vf, at, plane, 0, k)
            r1 = _gt_row(vf, at, plane, 1, k)
            r2 = _gt_row(vf, at, plane, 2, k)
            r3 = _gt_row(vf, at, plane, 3, k)
            r4 = _gt_row(vf, at, plane, 4, k)
            r5 = _gt_row(vf, at, plane, 5, k)
            o = uint64((kk * channels + c) * 9)
            for b in range(3):
                v = _gt(r0[b], r1[b], r2[b], r3[b], r4[b], r5[b], k)
                wf[o + uint64(b)] = v[0]
                wf[o + uint64(3 + b)] = v[1]
                wf[o + uint64(6 + b)] = v[2]
