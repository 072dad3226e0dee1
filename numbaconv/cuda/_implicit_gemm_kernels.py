"""The ``implicit_gemm`` kernels of the cuda backend (see :mod:`._implicit_gemm`, which
launches them): the templates of ``conv_gemm`` and ``weight_gemm`` with their register tiles,
and the small kernels beside them (weight packing, chunk sums, 5D copies), each a function
that expands its template (:mod:`._templates`) for one key.
"""

from __future__ import annotations

from typing import NamedTuple

from numba import cuda  # the simulator swaps this module global for its fake module

from ._templates import compile_source, indent, scalar_types

#: Reduction steps the multiply loop does per iteration (more: fewer loop instructions per
#: FFMA, longer compiles).
KU = 2


#: The same for the weight gradient (its columns' tap offsets kept in shared memory leave
#: the registers for 2; 4 issues more, docs/cuda.md).
WEIGHT_KU = 2


#: Channels-last gathers: each thread reads its columns' channels at this many places a
#: step, half a step apart (more: fewer columns a thread, so fewer registers; fewer
#: consecutive channels per warp access). Deeper steps read at more places
#: (:func:`cl_places`), at most CL_CHANNELS consecutive channels each.
CL_KREP = 2
CL_CHANNELS = 4


def cl_places(bk: int) -> int:
    """Places a channels-last gather reads a step of ``bk``: :data:`CL_KREP`, or more for
    deep steps, so that each place reads at most :data:`CL_CHANNELS` channels (a 16-deep
    TF32 step at 2 places holds 8 channels' columns a thread and spills; at 4, none)."""
    return max(CL_KREP, bk // CL_CHANNELS)


class Tile(NamedTuple):
    """Block tile ``bm x bn``, reduction step ``bk``, register tile ``tm x tn``."""
    bm: int
    bn: int
    bk: int
    tm: int
    tn: int

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    def check(self) -> "Tile":
        bm, bn, bk, tm, tn = self
        t = self.threads
        places = cl_places(bk)
        ok = (tm % 2 == 0 and tn % 2 == 0 and bm % tm == 0 and bn % tn == 0
              and t % bm == 0 and t % bn == 0 and bk % (2 * places) == 0
              and (bk * bm) % t == 0 and (bk * bn) % (t * places) == 0 and t <= 1024)
        if not ok:
            raise ValueError(f"NUMBACONV_CUDA_GEMM_TILE: {tuple(self)} is not a usable "
                             f"(bm, bn, bk, tm, tn) tile")
        return self


#: The tiles the driver chooses from (float32/float16); float64 halves the register tile.
TILES = (Tile(128, 128, 8, 8, 8), Tile(64, 128, 8, 8, 8), Tile(128, 64, 8, 8, 8),
         Tile(64, 64, 8, 8, 8), Tile(32, 64, 8, 4, 8))


TILES64 = (Tile(64, 64, 8, 4, 4), Tile(32, 64, 8, 4, 4), Tile(64, 32, 8, 4, 4),
           Tile(32, 32, 8, 4, 4))


_MULTIPLY = """
    k = I(0)
    while k < BK:
#unroll u KU
#unroll i HM
        a_{i} = As[buf, k + {u}, ty * HM + {i}]
        a_{i + HM} = As[buf, k + {u}, ty * HM + {BM // 2 + i}]
#end
#unroll j HN
        b_{j} = Bs[buf, k + {u}, tx * HN + {j}]
        b_{j + HN} = Bs[buf, k + {u}, tx * HN + {BN // 2 + j}]
#end
#unroll i TM
#unroll j TN
        c_{i}_{j} += a_{i} * b_{j}
#end
#end
#end
        k = I(k + KU)
"""


#: The tensor-core step (``tc``): each warp multiplies its WM x WN part of the block tile by
#: m16n8k8 TF32 products (numbaconv/cuda/_mma.py), MI x NJ of them per 8 reduction steps,
#: reading its fragments from the shared tiles (``ty``/``tx``: the warp's first row/column
#: plus the lane's group); ``c_{2i + h}_{2j + b}`` is the result ``ROWOFF[2i + h] = 16 i +
#: 8 h`` rows and ``COLOFF[2j + b] = 8 j + b`` columns past the lane's first (``er, ec``).
_MULTIPLY_TC = """
    k = I(0)
    while k < BK:
#unroll i MI
        fa_{i}_0 = As[buf, k + tig64, ty64 + {16 * i}]
        fa_{i}_1 = As[buf, k + tig64, ty64 + {16 * i + 8}]
        fa_{i}_2 = As[buf, k + tig64 + 4, ty64 + {16 * i}]
        fa_{i}_3 = As[buf, k + tig64 + 4, ty64 + {16 * i + 8}]
#end
#unroll j NJ
        fb_{j}_0 = Bs[buf, k + tig64, tx64 + {8 * j}]
        fb_{j}_1 = Bs[buf, k + tig64 + 4, tx64 + {8 * j}]
#end
#unroll i MI
#unroll j NJ
        c_{2*i}_{2*j}, c_{2*i}_{2*j+1}, c_{2*i+1}_{2*j}, c_{2*i+1}_{2*j+1} = mma_tf32(
            fa_{i}_0, fa_{i}_1, fa_{i}_2, fa_{i}_3, fb_{j}_0, fb_{j}_1,
            c_{2*i}_{2*j}, c_{2*i}_{2*j+1}, c_{2*i+1}_{2*j}, c_{2*i+1}_{2*j+1})
#end
#end
        k = I(k + 8)
"""


#: The thread's place in the block tile: with tensor cores (``tc``) its warp's tile of WM x
#: WN and its lane's group (``ty``, ``tx``: where its A and B fragments start) and member;
#: ``er``/``ec``: the first row/column of its results.
_PLACE = """
#if tc
    lane = I(U(tid) % U(32))
    wrp = I(U(tid) // U(32))
    tig = I(U(lane) % U(4))
    ty = I(I(U(wrp) // U(WARPS_N)) * WM + I(U(lane) // U(4)))
    wc = I(I(U(wrp) % U(WARPS_N)) * WN)
    tx = I(wc + I(U(lane) // U(4)))
    # The fragments' shared indices in 64 bits: ptxas folds their constant offsets into
    # the loads (32-bit ones, sign-extended one by one, cost an address each a step).
    tig64 = numba.int64(tig)
    ty64 = numba.int64(ty)
    tx64 = numba.int64(tx)
#else
    tx = I(U(tid) % U(NTX))
    ty = I(U(tid) // U(NTX))
#end
"""


_RESULT_PLACE = """
#if tc
    er = ty
    ec = I(wc + 2 * tig)
#else
    er = I(ty * HM)
    ec = I(tx * HN)
#end
"""


_GATHER_TAP = """
#if use0
    d0 = I(taps[U(t * 3)])
#end
#if use1
    d1 = I(taps[U(t * 3 + 1)])
#end
    d2 = I(taps[U(t * 3 + 2)])
#unroll e NCOL
    i2_{e} = p2_{e} + d2
#if use0
    i1_{e} = p1_{e} + d1
    i0_{e} = p0_{e} + d0
    ok_{e} = (nb_{e} >= 0) & (U(i2_{e}) < U(S2)) & (U(i1_{e}) < U(S1)) & (U(i0_{e}) < U(S0))
    off_{e} = I(nb_{e} + i0_{e} * s0 + i1_{e} * s1 + i2_{e} * s2)
#elif use1
    i1_{e} = p1_{e} + d1
    ok_{e} = (nb_{e} >= 0) & (U(i2_{e}) < U(S2)) & (U(i1_{e}) < U(S1))
    off_{e} = I(nb_{e} + i1_{e} * s1 + i2_{e} * s2)
#else
    ok_{e} = (nb_{e} >= 0) & (U(i2_{e}) < U(S2))
    off_{e} = I(nb_{e} + i2_{e} * s2)
#end
#end
"""


def mma_tile(tile: Tile) -> bool:
    """Whether the tensor-core step can run ``tile``: warps of 32 threads, each holding the
    4 x 4 results of (tm / 2) x (tn / 2) m16n8 products, tiling the block exactly."""
    bm, bn, bk, tm, tn = tile
    return (tm % 2 == 0 and tn % 2 == 0 and bk % 8 == 0 and bm % (8 * tm) == 0
            and bn % (4 * tn) == 0)


def _tile_names(tile: Tile, tc: bool, ku: int) -> dict:
    """The template constants of a tile: the register tile's rows and columns past the
    thread's first (ROWOFF, COLOFF: two halves a side, or the m16n8 products' places), the
    shared rows' padding (8 with tensor cores: a fragment's 32 reads in 32 banks)."""
    bm, bn, bk, tm, tn = tile
    if tc:
        if not mma_tile(tile):
            raise ValueError(f"tile {tuple(tile)}: not a tensor-core tile")
        rows = tuple(16 * (i // 2) + 8 * (i % 2) for i in range(tm))
        cols = tuple(8 * (j // 2) + j % 2 for j in range(tn))
        pad, ku = 8, 8
    else:
        rows = tuple(i if i < tm // 2 else bm // 2 + i - tm // 2 for i in range(tm))
        cols = tuple(j if j < tn // 2 else bn // 2 + j - tn // 2 for j in range(tn))
        pad = 4
    return dict(BM=bm, BN=bn, BK=bk, TM=tm, TN=tn, HM=tm // 2, HN=tn // 2, NTX=bn // tn,
                BMP=bm + pad, BNP=bn + pad, KU=ku, ROWOFF=rows, COLOFF=cols, tc=tc,
                WM=8 * tm, WN=4 * tn, WARPS_N=bn // (4 * tn), MI=tm // 2, NJ=tn // 2)


def _placed(template: str, tc: bool) -> str:
    """``template`` with its thread placement, multiply step and shared stores (TF32-rounded
    with tensor cores) filled in."""
    return (template.replace("RESULT_PLACE", indent(_RESULT_PLACE, 4))
            .replace("PLACE", indent(_PLACE, 4))
            .replace("MULTIPLY", indent(_MULTIPLY_TC if tc else _MULTIPLY, 8))
            .replace("CVT(", "tf32(" if tc else "("))


CONV_GEMM = """
#if tc
from numbaconv.cuda._mma import mma_tf32, tf32
#end
def conv_gemm(src, wp, out, bias, taps, phases, nph, n_images, M, R, Rp, T,
              sN, sC, s0, s1, s2, S0, S1, S2, cs0, cs1, cs2, co0, co1, co2,
              oN, oC, o0, o1, o2, os0, os1, os2):
    As = cuda.shared.array((2, BK, BMP), acc)
    Bs = cuda.shared.array((2, BK, BNP), acc)
    tid = I(cuda.threadIdx.x)
PLACE
    ph = I(U(cuda.blockIdx.z) % U(nph))
    g = I(U(cuda.blockIdx.z) // U(nph))
    J0 = I(phases[ph * 8])
    J1 = I(phases[ph * 8 + 1])
    J2 = I(phases[ph * 8 + 2])
    J12 = I(J1 * J2)
    Jall = I(J0 * J12)
    Q = I(n_images * Jall)
    col0 = I(cuda.blockIdx.x * BN)
    if col0 >= Q:
        return
    m0 = I(cuda.blockIdx.y * BM)
    tap0 = I(phases[ph * 8 + 6])
    Ri = I(R)  # the bound checks in 32 bits (R is an int64 argument)
    steps = I(I(phases[ph * 8 + 7]) * I((Ri + BK - 1) // BK))
    am = I(U(tid) % U(BM))
    a_ok = m0 + am < M
    a_ptr = I(I(I(g * T + tap0) * Rp + tid // BM) * M + m0 + am)
    a_step = I(BK * M)
    a_kstep = I(A_KSTEP * M)
    c_step = I(BK * sC)
    kc_step = I(KC * sC)
#if cl
    bk = I(U(tid) % U(KC))
#else
    bk = I(U(tid) // U(BN))
    b_kstep = I(B_KSTEP * sC)
#end
#unroll e NCOL
#if cl
    q_{e} = col0 + I(tid // KC + {e * B_QSTEP})
#else
    q_{e} = col0 + I(U(tid) % U(BN))
#end
    qq_{e} = min(q_{e}, Q - 1)
    n_{e} = I(U(qq_{e}) // U(Jall))
    r_{e} = I(qq_{e} - n_{e} * Jall)
    j0_{e} = I(U(r_{e}) // U(J12))
    rr_{e} = I(r_{e} - j0_{e} * J12)
    j1_{e} = I(U(rr_{e}) // U(J2))
    j2_{e} = I(rr_{e} - j1_{e} * J2)
    nb_{e} = I(n_{e} * sN + I(g * R + bk) * sC) if q_{e} < Q else I(-1)
#if use0
    p0_{e} = I(j0_{e} * cs0 + co0)
#end
#if use1
    p1_{e} = I(j1_{e} * cs1 + co1)
#end
    p2_{e} = I(j2_{e} * cs2 + co2)
    off_{e} = I(0)
    ok_{e} = False
#end
#unroll i TM
#unroll j TN
    c_{i}_{j} = acc(0)
#end
#end
    t = tap0
    r0 = I(0)
    if steps > 0:
GATHER_TAP_8
#unroll e LA
        va_{e} = acc(0)
        if a_ok:
            va_{e} = acc(wp[U(a_ptr + {e} * a_kstep)])
        As[0, tid // BM + {e * A_KSTEP}, am] = va_{e}
#end
#unroll e LB
        vb_{e} = acc(0)
#if cl
        if ok_{e // KREP} & (I(bk + {e % KREP * KC}) < Ri):
            vb_{e} = acc(src[U(off_{e // KREP} + {e % KREP} * kc_step)])
        Bs[0, bk + {e % KREP * KC}, tid // KC + {e // KREP * B_QSTEP}] = CVT(vb_{e})
#else
        if ok_0 & (I(bk + {e * B_KSTEP}) < Ri):
            vb_{e} = acc(src[U(off_0 + {e} * b_kstep)])
        Bs[0, bk + {e * B_KSTEP}, tid % BN] = CVT(vb_{e})
#end
#end
        cuda.syncthreads()
    step = I(0)
    while step < steps:
        buf = I(step & 1)
        step = I(step + 1)
        more = step < steps
        if more:
            a_ptr = I(a_ptr + a_step)
            r0 = I(r0 + BK)
            if r0 >= Ri:
                r0 = I(0)
                t += 1
GATHER_TAP_16
            else:
#unroll e NCOL
                off_{e} = I(off_{e} + c_step)
#end
#unroll e LA
            ra_{e} = acc(0)
            if a_ok:
                ra_{e} = acc(wp[U(a_ptr + {e} * a_kstep)])
#end
#unroll e LB
            rb_{e} = acc(0)
#if cl
            if ok_{e // KREP} & (I(r0 + bk + {e % KREP * KC}) < Ri):
                rb_{e} = acc(src[U(off_{e // KREP} + {e % KREP} * kc_step)])
#else
            if ok_0 & (I(r0 + bk + {e * B_KSTEP}) < Ri):
                rb_{e} = acc(src[U(off_0 + {e} * b_kstep)])
#end
#end
MULTIPLY
        if more:
            nxt = I(1 - buf)
#unroll e LA
            As[nxt, tid // BM + {e * A_KSTEP}, am] = ra_{e}
#end
#unroll e LB
#if cl
            Bs[nxt, bk + {e % KREP * KC}, tid // KC + {e // KREP * B_QSTEP}] = CVT(rb_{e})
#else
            Bs[nxt, bk + {e * B_KSTEP}, tid % BN] = CVT(rb_{e})
#end
#end
        cuda.syncthreads()
    f0 = I(phases[ph * 8 + 3])
    f1 = I(phases[ph * 8 + 4])
    f2 = I(phases[ph * 8 + 5])
    gm = I(g * M)
RESULT_PLACE
#unroll j TN
    q_{j} = col0 + I(ec + {COLOFF[j]})
    if q_{j} < Q:
        n_{j} = I(U(q_{j}) // U(Jall))
        r_{j} = I(q_{j} - n_{j} * Jall)
        j0_{j} = I(U(r_{j}) // U(J12))
        rr_{j} = I(r_{j} - j0_{j} * J12)
        j1_{j} = I(U(rr_{j}) // U(J2))
        j2_{j} = I(rr_{j} - j1_{j} * J2)
        ob_{j} = I(n_{j} * oN + I(f0 + j0_{j} * os0) * o0 + I(f1 + j1_{j} * os1) * o1
                   + I(f2 + j2_{j} * os2) * o2)
#unroll i TM
        m = m0 + I(er + {ROWOFF[i]})
        if m < M:
            at = U(ob_{j} + I(gm + m) * oC)
#if BIAS and ACCUM
            out[at] = c_{i}_{j} + acc(bias[U(gm + m)]) + acc(out[at])
#elif BIAS
            out[at] = c_{i}_{j} + acc(bias[U(gm + m)])
#elif ACCUM
            out[at] = c_{i}_{j} + acc(out[at])
#else
            out[at] = c_{i}_{j}
#end
#end
#end
"""


def conv_gemm_function(dtype: str, channels_last: bool, nd: int, wide: bool, tile: Tile,
                       has_bias: bool, accumulate: bool, tc: bool = False):
    """The Python function of the forward / data-gradient kernel (compile with cuda.jit).

    Launch: ``tile.threads`` threads; grid ``(column tiles, row tiles, groups * phases)``.
    Arguments::

        src, wp, out, bias, taps (T x 3: source deltas per tap), phases (nph x 8: J0, J1,
        J2, first0, first1, first2, tap start, tap count), all flat (device pointers on a
        GPU, 1D arrays under the simulator), nph, n, rows M, reduction channels R, padded
        Rp, taps T,
        src strides (N, C, 0, 1, 2), src sizes (0, 1, 2),
        column stride (3), column offset (3),
        out strides (N, C, 0, 1, 2), out step (3)

    ``src`` position of column ``j`` and tap ``t``: ``j * cstride + coffset + taps[t]``;
    ``out`` position: ``first + j * ostep``; ``wp`` holds the packed weights ``(groups, T,
    Rp, M)`` and ``Rp`` is R rounded up to the step.
    """
    acc, I, U = scalar_types(dtype, wide)
    bm, bn, bk, tm, tn = tile
    threads = tile.threads
    places = cl_places(bk)
    names = dict(_tile_names(tile, tc, 1 if channels_last else KU), LA=bk * bm // threads,
                 LB=bk * bn // threads, A_KSTEP=threads // bm, B_KSTEP=threads // bn,
                 KC=bk // places, KREP=places, B_QSTEP=threads * places // bk,
                 NCOL=bk * bn // threads // places if channels_last else 1,
                 cl=channels_last, use0=nd >= 3, use1=nd >= 2, BIAS=has_bias, ACCUM=accumulate,
                 KEY=f"{dtype} cl={channels_last} nd={nd} wide={wide} tile={tuple(tile)} "
                     f"bias={has_bias} accumulate={accumulate} tc={tc}")
    template = _placed(CONV_GEMM.replace("GATHER_TAP_8", indent(_GATHER_TAP, 8))
                       .replace("GATHER_TAP_16", indent(_GATHER_TAP, 16)), tc)
    return compile_source("conv_gemm", template, names, dict(acc=acc, I=I, U=U))


WEIGHT_GEMM = """
#if tc
from numbaconv.cuda._mma import mma_tf32, tf32
#end
def weight_gemm(x, dy, partial, n_images, G, Kg, Cg, NC, row_tiles, chunk_len,
                xN, xC, x0, x1, x2, S0, S1, S2, yN, yC, y0, y1, y2, P0, P1, P2,
                R1, R2, st0, st1, st2, dl0, dl1, dl2, bf0, bf1, bf2):
    As = cuda.shared.array((2, BK, BMP), acc)
    Bs = cuda.shared.array((2, BK, BNP), acc)
    columns = cuda.shared.array((BN, 4), I)
    tid = I(cuda.threadIdx.x)
PLACE
    by = I(cuda.blockIdx.y)
    g = I(U(by) // U(row_tiles))
    m0 = I(I(by - g * row_tiles) * BM)
    col0 = I(cuda.blockIdx.x * BN)
    chunk = I(cuda.blockIdx.z)
    P12 = I(P1 * P2)
    PP = I(P0 * P12)
    total = I(n_images * PP)
    j_start = I(chunk * chunk_len)
    j_stop = min(I(j_start + chunk_len), total)
    steps = I(I(j_stop - j_start + BK - 1) // BK)
    kk = I(U(tid) % U(BK))
    jj = I(j_start + kk)
    jc = min(jj, total - 1)
    left = I(j_stop - j_start)
    n = I(U(jc) // U(PP))
    r = I(jc - n * PP)
    o0 = I(U(r) // U(P12))
    rr = I(r - o0 * P12)
    o1 = I(U(rr) // U(P2))
    o2 = I(rr - o1 * P2)
    end2 = I(P2 * st2 - bf2)
    lim2 = U(S2)
    ib2 = I(o2 * st2 - bf2)
    ib2_step = I(BK * st2)
    ib2_wrap = I(P2 * st2)
    ya_step = I(BK * y2)
    xb_step = I(I(BK * st2) * x2)
#if use1
    end1 = I(P1 * st1 - bf1)
    lim1 = U(S1)
    ib1 = I(o1 * st1 - bf1)
    ib1_next = I(st1)
    ib1_wrap = I(P1 * st1)
    ya_wrap2 = I(y1 - P2 * y2)
    xb_wrap2 = I(st1 * x1 - I(P2 * st2) * x2)
#else
    ya_wrap2 = I(yN - P2 * y2)
    xb_wrap2 = I(xN - I(P2 * st2) * x2)
#end
#if use0
    end0 = I(P0 * st0 - bf0)
    lim0 = U(S0)
    ib0 = I(o0 * st0 - bf0)
    ib0_next = I(st0)
    ib0_wrap = I(P0 * st0)
    ya_wrap1 = I(y0 - P1 * y1)
    xb_wrap1 = I(st0 * x0 - I(P1 * st1) * x1)
    ya_wrap0 = I(yN - P0 * y0)
    xb_wrap0 = I(xN - I(P0 * st0) * x0)
    ya = I(n * yN + o0 * y0 + o1 * y1 + o2 * y2)
    xb = I(n * xN + ib0 * x0 + ib1 * x1 + ib2 * x2)
#elif use1
    ya_wrap1 = I(yN - P1 * y1)
    xb_wrap1 = I(xN - I(P1 * st1) * x1)
    ya = I(n * yN + o1 * y1 + o2 * y2)
    xb = I(n * xN + ib1 * x1 + ib2 * x2)
#else
    ya = I(n * yN + o2 * y2)
    xb = I(n * xN + ib2 * x2)
#end
    ygoff = I(g * Kg * yC)
    # Rows past Kg read row Kg - 1: in bounds, and their sums are never stored.
#unroll e LA
    aoff_{e} = I(ygoff + I(min(m0 + I(tid // BK + {e * QSTEP}), Kg - 1)) * yC)
#end
    R12 = I(R1 * R2)
#unroll e LB
    bcc_{e} = I(min(col0 + I(tid // BK + {e * QSTEP}), NC - 1))
    t_{e} = I(U(bcc_{e}) // U(Cg))
    c_{e} = I(bcc_{e} - t_{e} * Cg)
    t0_{e} = I(U(t_{e}) // U(R12))
    tr_{e} = I(t_{e} - t0_{e} * R12)
    t1_{e} = I(U(tr_{e}) // U(R2))
#if use0
    e0_{e} = I(t0_{e} * dl0)
#else
    e0_{e} = I(0)
#end
#if use1
    e1_{e} = I(t1_{e} * dl1)
#else
    e1_{e} = I(0)
#end
    e2_{e} = I(I(tr_{e} - t1_{e} * R2) * dl2)
    boff_{e} = I(I(g * Cg + c_{e}) * xC + e0_{e} * x0 + e1_{e} * x1 + e2_{e} * x2)
    # The loop reads its columns' offsets back from shared memory: registers are short.
    if kk == 0:
        columns[tid // BK + {e * QSTEP}, 0] = boff_{e}
        columns[tid // BK + {e * QSTEP}, 1] = e2_{e}
        columns[tid // BK + {e * QSTEP}, 2] = e1_{e}
        columns[tid // BK + {e * QSTEP}, 3] = e0_{e}
#end
ROW_OK_4
    cuda.syncthreads()
#unroll i TM
#unroll j TN
    c_{i}_{j} = acc(0)
#end
#end
    if steps > 0:
LOAD_8
#unroll e LA
        As[0, kk, tid // BK + {e * QSTEP}] = CVT(va_{e})
#end
#unroll e LB
        Bs[0, kk, tid // BK + {e * QSTEP}] = CVT(vb_{e})
#end
        cuda.syncthreads()
    step = I(0)
    while step < steps:
        buf = step & 1
        more = step + 1 < steps
        if more:
            left = I(left - BK)
            ib2 = I(ib2 + ib2_step)
            ya = I(ya + ya_step)
            xb = I(xb + xb_step)
            # The step crossed a row (several where rows are shorter than BK), maybe an
            # image: the wrap deltas, and the outer bound checks redone.
            while ib2 >= end2:
                ib2 = I(ib2 - ib2_wrap)
                ya = I(ya + ya_wrap2)
                xb = I(xb + xb_wrap2)
#if use1
                ib1 = I(ib1 + ib1_next)
                if ib1 >= end1:
                    ib1 = I(ib1 - ib1_wrap)
                    ya = I(ya + ya_wrap1)
                    xb = I(xb + xb_wrap1)
#if use0
                    ib0 = I(ib0 + ib0_next)
                    if ib0 >= end0:
                        ib0 = I(ib0 - ib0_wrap)
                        ya = I(ya + ya_wrap0)
                        xb = I(xb + xb_wrap0)
#end
#unroll e LB
                f1_{e} = columns[tid // BK + {e * QSTEP}, 2]
#if use0
                f0_{e} = columns[tid // BK + {e * QSTEP}, 3]
#end
#end
ROW_OK_16
#end
LOAD_12
MULTIPLY
        if more:
            nxt = 1 - buf
#unroll e LA
            As[nxt, kk, tid // BK + {e * QSTEP}] = CVT(va_{e})
#end
#unroll e LB
            Bs[nxt, kk, tid // BK + {e * QSTEP}] = CVT(vb_{e})
#end
        cuda.syncthreads()
        step = I(step + 1)
    pbase = I(I(I(chunk * G + g) * Kg) * NC)
RESULT_PLACE
#unroll i TM
    m_{i} = m0 + I(er + {ROWOFF[i]})
#end
#unroll j TN
    col_{j} = col0 + I(ec + {COLOFF[j]})
    if col_{j} < NC:
#unroll i TM
        if m_{i} < Kg:
            partial[U(pbase + m_{i} * NC + col_{j})] = c_{i}_{j}
#end
#end
"""


_ROW_OK = """
#unroll e LB
#if use0
    row_ok_{e} = (U(ib1 + e1_{e}) < lim1) & (U(ib0 + e0_{e}) < lim0)
#elif use1
    row_ok_{e} = U(ib1 + e1_{e}) < lim1
#end
#end
"""


_LOAD = """
    jok = kk < left
#unroll e LA
    va_{e} = acc(0)
    if jok:
        va_{e} = acc(dy[U(ya + aoff_{e})])
#end
#unroll e LB
    vb_{e} = acc(0)
    g2_{e} = columns[tid // BK + {e * QSTEP}, 1]
#if use1
    if jok & row_ok_{e} & (U(ib2 + g2_{e}) < lim2):
#else
    if jok & (U(ib2 + g2_{e}) < lim2):
#end
        vb_{e} = acc(x[U(xb + columns[tid // BK + {e * QSTEP}, 0])])
#end
"""


def weight_gemm_function(dtype: str, nd: int, wide: bool, tile: Tile, tc: bool = False):
    """The Python function of the weight-gradient kernel (compile with cuda.jit).

    Launch: ``tile.threads`` threads; grid ``(column tiles, row tiles * groups, chunks)``.
    Columns are ``(tap, input channel)`` pairs (``NC = taps * Cg``), rows output channels,
    the reduction runs over ``j = (image, output position)`` in ``[chunk * chunk_len, ...)``.
    Writes ``partial[chunk, g, m, col]`` (flat). Every thread loads the same reduction row
    ``j`` for all its elements, so one ``(image, position)`` counter per thread serves both
    operands. The loop keeps that position as 32-bit offsets into dy and x and its input
    coordinates, advanced by the step and, where the step crosses a row (or an image), by
    the wrap's precomputed deltas; the bound checks of a column's outer dimensions are
    redone only on such a crossing, the innermost one each step. A column's offset into x
    and its tap offsets are read from a shared table each step (``columns``), which leaves
    the registers for two reduction rows per multiply loop iteration.
    """
    acc, I, U = scalar_types(dtype, wide)
    bm, bn, bk, tm, tn = tile
    threads = tile.threads
    qstep = threads // bk
    names = dict(_tile_names(tile, tc, WEIGHT_KU), QSTEP=qstep, LA=bm // qstep,
                 LB=bn // qstep, use0=nd >= 3, use1=nd >= 2,
                 KEY=f"{dtype} nd={nd} wide={wide} tile={tuple(tile)} tc={tc}")
    # In the loop the checks read the tap offsets loaded back from the table (f0_, f1_).
    row_ok_in_loop = _ROW_OK.replace("e0_", "f0_").replace("e1_", "f1_")
    template = _placed(WEIGHT_GEMM.replace("LOAD_8", indent(_LOAD, 8))
                       .replace("LOAD_12", indent(_LOAD, 12))
                       .replace("ROW_OK_4", indent(_ROW_OK, 4))
                       .replace("ROW_OK_16", indent(row_ok_in_loop, 16)), tc)
    return compile_source("weight_gemm", template, names, dict(acc=acc, I=I, U=U))


def pack_weights_function(dtype: str, tc: bool = False):
    """``wp[g, t, r, m] = w[g*Kg + m, r, tap t]`` (forward) or ``w[g*Kg + r, m, tap t]``
    (data), zero for ``r >= R``: the A operand of ``conv_gemm``, rounded to TF32 for its
    tensor-core variant (``tc``: then ``conv_gemm`` stores it to shared memory as it is).
    One thread per element.

    Arguments: ``w, wp, wtaps (T x 3, flat), count, T, M, R, Rp, Kg, forward`` and w's five
    element strides.
    """
    acc = scalar_types(dtype, True)[0]
    tf32 = None
    if tc:
        from ._mma import tf32

    def pack_weights(w, wp, wtaps, count, T, M, R, Rp, Kg, forward, ws0, ws1, ws2, ws3, ws4):
        e = cuda.grid(1)
        if e >= count:
            return
        m = e % M
        rest = e // M
        r = rest % Rp
        rest = rest // Rp
        t = rest % T
        g = rest // T
        v = acc(0)
        if r < R:
            tap = wtaps[t * 3] * ws2 + wtaps[t * 3 + 1] * ws3 + wtaps[t * 3 + 2] * ws4
            if forward:
                v = acc(w[(g * Kg + m) * ws0 + r * ws1 + tap])
            else:
                v = acc(w[(g * Kg + r) * ws0 + m * ws1 + tap])
        if tc:                          # a constant: Numba compiles one branch
            v = tf32(v)
        wp[e] = v

    return pack_weights


def sum_chunks_function(dtype: str):
    """``dw[k, c, tap] = [dw +] sum over chunks of partial[chunk, k, tap*Cg + c]``, chunks
    added in order. One thread per element of dw.

    Arguments: ``partial, w, count (= K*Cg*T), chunks, Cg, T, R1, R2, accumulate`` and w's
    five element strides.
    """
    acc = scalar_types(dtype, True)[0]

    def sum_chunks(partial, w, count, chunks, Cg, T, R1, R2, accumulate,
                   ws0, ws1, ws2, ws3, ws4):
        e = cuda.grid(1)
        if e >= count:
            return
        k = e // (Cg * T)
        rest = e % (Cg * T)
        c = rest // T
        t = rest % T
        at = k * Cg * T + t * Cg + c
        total = partial[at]
        for chunk in range(1, chunks):
            total += partial[at + chunk * count]
        off = k * ws0 + c * ws1 + (t // (R1 * R2)) * ws2 + ((t // R2) % R1) * ws3 + \
            (t % R2) * ws4
        if accumulate:
            total += acc(w[off])
        w[off] = total

    return sum_chunks


def copy5_function(dtype: str):
    """``dst[...] = src[...]`` for 5D arrays of one shape, one thread per element."""
    def copy5(src, dst):
        e = cuda.grid(1)
        d1, d2, d3, d4 = dst.shape[1], dst.shape[2], dst.shape[3], dst.shape[4]
        if e >= dst.shape[0] * d1 * d2 * d3 * d4:
            return
        i4 = e % d4
        rest = e // d4
        i3 = rest % d3
        rest = rest // d3
        i2 = rest % d2
        rest = rest // d2
        dst[rest // d1, rest % d1, i2, i3, i4] = src[rest // d1, rest % d1, i2, i3, i4]
    return copy5
