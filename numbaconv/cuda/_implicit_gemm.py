"""The ``implicit_gemm`` algorithm of the cuda backend: register-tiled implicit GEMMs.

Every convolution op that is a matrix product runs one of two kernels here:

``conv_gemm`` (forward, data gradient, transposed convolution)
    ``out[n, g*M + m, pos] = sum over (tap, r) of A[g, tap, r, m] * src[n, g*R + r, at(pos,
    tap)]``. Forward: m = output channel, r = input channel, ``at = pos*stride - before +
    tap*dilation``. Data gradient and transposed convolution: m = input channel, r = output
    channel, and the input positions are split into **stride phases** (positions whose
    ``i + before`` has one residue per dimension): in a phase only the taps that land on a
    multiple of the stride take part, so no multiply-add meets a zero of the dilated dy. A
    phase is a plain convolution with stride 1 over the phase's positions; the phases run
    in one launch (grid z). The weights are first packed once per call into ``A[g, tap, r,
    m]`` (r padded to the step, m fastest), so the main loop reads A at a pointer advanced
    by a constant.
``weight_gemm`` (weight gradient)
    ``dw[g*Kg + m, c, tap] = sum over j = (image, output position) of dy[j, m] * x[j, c at
    tap]``, the j range cut in chunks fixed by the shape (never by the device), each chunk
    writing its own partial, which ``sum_chunks`` adds in chunk order: deterministic, no
    atomics.

Both are tiled CUTLASS-style: a block computes a ``BM x BN`` tile, each thread a ``TM x
TN`` register tile (split in two halves of rows and of columns so that neighbouring threads
read neighbouring shared words), the reduction advances ``BK`` at a time through two
shared-memory buffers (the next step's global loads are issued before the current step's
multiply-adds). Gathers use offsets computed once per thread and per tap and advanced by
constants: the main loop has no division, and the few outside it are unsigned 32-bit.
Indices are 32-bit when every operand spans fewer than about 2**31 elements (``wide=False``),
else 64-bit. Operands are passed as device pointers with element strides (:func:`operand`;
flat 1D arrays under the simulator), so any non-negative strides work and channels-first
and channels-last differ only in which threads load which elements (channels-last: a warp
reads consecutive channels). docs/cuda.md gives the machine code and the measurements.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import itertools
import math
import os
import re
import threading
from typing import NamedTuple

import numpy as np
from numba import cuda  # the simulator swaps this module global for its fake module

from .._geometry import stride_phases
from ..config import cuda_gemm_tile, jit_cache, user_cache_dir
from ._layout import activation5, as_device, device_array, geom, simulated, view5, weight5

#: Largest element offset the 32-bit kernels handle (below 2**31 with room for the padding
#: reads whose offsets are formed before their bounds check).
INDEX32_LIMIT = 2 ** 31 - 2 ** 24
#: Blocks that fill a 132-SM GPU at two blocks per SM: tiles giving fewer score lower.
FULL_GRID = 264
#: Thread blocks to aim for when splitting the weight gradient's reduction: enough to fill
#: two waves of a 132-SM GPU; fixed, so the split (and the bits of dw) never depend on it.
WEIGHT_TARGET_BLOCKS = 528
#: Reduction steps the multiply loop does per iteration (more: fewer loop instructions per
#: FFMA, longer compiles).
KU = 2
#: The same for the weight gradient, whose (image, position) counter leaves fewer registers.
WEIGHT_KU = 1
#: Channels-last gathers: each thread reads its columns' channels at this many places a
#: step, half a step apart (more: fewer columns a thread, so fewer registers; fewer
#: consecutive channels per warp access).
CL_KREP = 2
#: Largest weight-gradient partial buffer, in accumulator elements (64 MiB of float32).
MAX_PARTIAL_ELEMENTS = 1 << 24


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
        ok = (tm % 2 == 0 and tn % 2 == 0 and bm % tm == 0 and bn % tn == 0
              and t % bm == 0 and t % bn == 0 and bk % (2 * CL_KREP) == 0
              and (bk * bm) % t == 0 and (bk * bn) % (t * CL_KREP) == 0 and t <= 1024)
        if not ok:
            raise ValueError(f"NUMBACONV_CUDA_GEMM_TILE: {tuple(self)} is not a usable "
                             f"(bm, bn, bk, tm, tn) tile")
        return self


#: The tiles the driver chooses from (float32/float16); float64 halves the register tile.
TILES = (Tile(128, 128, 8, 8, 8), Tile(64, 128, 8, 8, 8), Tile(128, 64, 8, 8, 8),
         Tile(64, 64, 8, 8, 8), Tile(32, 64, 8, 4, 8))
TILES64 = (Tile(64, 64, 8, 4, 4), Tile(32, 64, 8, 4, 4), Tile(64, 32, 8, 4, 4),
           Tile(32, 32, 8, 4, 4))


def forced_tile():
    """The tile NUMBACONV_CUDA_GEMM_TILE forces (tests use tiny ones), or None."""
    values = cuda_gemm_tile()
    return None if values is None else Tile(*values).check()


def choose_tile(rows: int, cols: int, blocks_per_tile: int, dtype: str) -> Tile:
    """The largest tile that wastes little of ``rows x cols`` and still gives about two
    blocks per SM of a 132-SM GPU (fewer, larger tiles read less per multiply-add)."""
    forced = forced_tile()
    if forced is not None:
        return forced
    tiles = TILES64 if dtype == "float64" else TILES

    def score(t):
        used = rows * cols / (_ceil(rows, t.bm) * t.bm * _ceil(cols, t.bn) * t.bn)
        blocks = _ceil(rows, t.bm) * _ceil(cols, t.bn) * blocks_per_tile
        fill = min(1.0, blocks / FULL_GRID)
        return used * fill * (1.0 + 0.25 * (t.bm * t.bn) / (128 * 128))
    return max(tiles, key=score)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# --- kernel source ---------------------------------------------------------------------------
#
# Numba does not unroll loops on request and NVVM leaves the register tile in local memory
# unless every loop over it is unrolled, so the kernels are written as templates whose
# ``#unroll VAR COUNT ... #end`` blocks are repeated with ``{expression}`` filled in, and
# whose ``#if EXPR ... #else ... #end`` blocks are kept or dropped by the constants (tile,
# layout, dimensions) that key each kernel. The result is plain Python, compiled by cuda.jit.

_DIRECTIVE = re.compile(r"^\s*#(unroll|if|elif|else|end)\b\s*(.*)$")
_FIELD = re.compile(r"\{([^{}]+)\}")


def _fill(line: str, names: dict) -> str:
    def value(match):
        try:
            return str(eval(match.group(1), {}, names))   # noqa: S307 - our own templates
        except NameError:
            return match.group(0)
    return _FIELD.sub(value, line)


def _expand(lines: list, names: dict) -> list:
    out = []
    i = 0
    while i < len(lines):
        found = _DIRECTIVE.match(lines[i])
        if not found:
            out.append(_fill(lines[i], names))
            i += 1
            continue
        kind, arg = found.groups()
        if kind not in ("unroll", "if"):
            raise ValueError(f"template: unmatched #{kind} at line {i}")
        branches, i = _block(lines, i + 1, arg)
        if kind == "unroll":
            var, count = arg.split(None, 1)
            for v in range(eval(count, {}, names)):          # noqa: S307
                out.extend(_expand(branches[0][1], dict(names, **{var: v})))
            continue
        for condition, body in branches:
            if condition is None or eval(condition, {}, names):   # noqa: S307
                out.extend(_expand(body, names))
                break
    return out


def _block(lines: list, i: int, condition: str):
    """The branches ``[(condition, lines)]`` of a block up to its #end (an #else branch has
    the condition None), and the index after the #end."""
    branches = [(condition, [])]
    depth = 0
    while i < len(lines):
        found = _DIRECTIVE.match(lines[i])
        kind = found.group(1) if found else None
        if kind in ("unroll", "if"):
            depth += 1
        elif kind == "end":
            if depth == 0:
                return branches, i + 1
            depth -= 1
        elif kind in ("elif", "else") and depth == 0:
            branches.append((found.group(2) if kind == "elif" else None, []))
            i += 1
            continue
        branches[-1][1].append(lines[i])
        i += 1
    raise ValueError("template: #unroll or #if without #end")


def _compile_source(name: str, template: str, names: dict, types_: dict):
    """The function ``name`` defined by ``template`` expanded with ``names``.

    The source is written to a file named by its hash under the cache folder and imported
    from there, so that Numba's disk cache keeps the compiled kernel for later processes
    (these kernels are slow to compile: docs/cuda.md); with the cache off, or where the
    folder cannot be written, under the simulator too, it is executed in memory."""
    body = "\n".join(_expand(template.strip("\n").splitlines(), names)) + "\n"
    header = ["import numba", "from numba import cuda", ""]
    header += [f"{key} = numba.{value}" for key, value in sorted(types_.items())]
    header += [f"{key} = {value!r}" for key, value in sorted(names.items())
               if isinstance(value, (bool, int))]
    source = "\n".join(header) + "\n\n\n" + body
    function = None
    if jit_cache() and not simulated():
        function = _import_source(name, source)
    if function is None:
        namespace = {}
        exec(compile(source, f"<numbaconv.cuda {name} {names.get('KEY', '')}>", "exec"),
             namespace)                                           # noqa: S102
        function = namespace[name]
    function.__numbaconv_source__ = source
    function.__numbaconv_unroll__ = names.get("KU", 1)
    return function


def _import_source(name: str, source: str):
    """``name`` from ``source`` written once to the cache folder and imported, or None."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    folder = os.path.join(user_cache_dir(), "cuda")
    path = os.path.join(folder, f"{name}_{digest}.py")
    try:
        if not os.path.exists(path):
            os.makedirs(folder, exist_ok=True)
            partial = f"{path}.{os.getpid()}.tmp"
            with open(partial, "w") as handle:
                handle.write(source)
            os.replace(partial, path)
        spec = importlib.util.spec_from_file_location(f"numbaconv_cuda_{name}_{digest}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except OSError:
        return None
    return getattr(module, name)


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


def _indent(text: str, spaces: int) -> str:
    pad = " " * spaces
    return "\n".join(pad + line[4:] if line.strip() and not _DIRECTIVE.match(line)
                     else line for line in text.strip("\n").splitlines())


CONV_GEMM = """
def conv_gemm(src, wp, out, bias, taps, phases, nph, n_images, M, R, Rp, T,
              sN, sC, s0, s1, s2, S0, S1, S2, cs0, cs1, cs2, co0, co1, co2,
              oN, oC, o0, o1, o2, os0, os1, os2):
    As = cuda.shared.array((2, BK, BMP), acc)
    Bs = cuda.shared.array((2, BK, BNP), acc)
    tid = I(cuda.threadIdx.x)
    tx = I(U(tid) % U(NTX))
    ty = I(U(tid) // U(NTX))
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
    steps = I(I(phases[ph * 8 + 7]) * I((R + BK - 1) // BK))
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
        if ok_{e // KREP} & (bk + {e % KREP * KC} < R):
            vb_{e} = acc(src[U(off_{e // KREP} + {e % KREP} * kc_step)])
        Bs[0, bk + {e % KREP * KC}, tid // KC + {e // KREP * B_QSTEP}] = vb_{e}
#else
        if ok_0 & (bk + {e * B_KSTEP} < R):
            vb_{e} = acc(src[U(off_0 + {e} * b_kstep)])
        Bs[0, bk + {e * B_KSTEP}, tid % BN] = vb_{e}
#end
#end
        cuda.syncthreads()
    for step in range(steps):
        buf = step & 1
        more = step + 1 < steps
        if more:
            a_ptr = I(a_ptr + a_step)
            r0 = I(r0 + BK)
            if r0 >= R:
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
            if ok_{e // KREP} & (r0 + bk + {e % KREP * KC} < R):
                rb_{e} = acc(src[U(off_{e // KREP} + {e % KREP} * kc_step)])
#else
            if ok_0 & (r0 + bk + {e * B_KSTEP} < R):
                rb_{e} = acc(src[U(off_0 + {e} * b_kstep)])
#end
#end
MULTIPLY
        if more:
            nxt = 1 - buf
#unroll e LA
            As[nxt, tid // BM + {e * A_KSTEP}, am] = ra_{e}
#end
#unroll e LB
#if cl
            Bs[nxt, bk + {e % KREP * KC}, tid // KC + {e // KREP * B_QSTEP}] = rb_{e}
#else
            Bs[nxt, bk + {e * B_KSTEP}, tid % BN] = rb_{e}
#end
#end
        cuda.syncthreads()
    f0 = I(phases[ph * 8 + 3])
    f1 = I(phases[ph * 8 + 4])
    f2 = I(phases[ph * 8 + 5])
    gm = I(g * M)
#unroll j TN
    q_{j} = col0 + I(tx * HN + {j if j < HN else BN // 2 + j - HN})
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
        m = m0 + I(ty * HM + {i if i < HM else BM // 2 + i - HM})
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
                       has_bias: bool, accumulate: bool):
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
    acc, I, U = _types(dtype, wide)
    bm, bn, bk, tm, tn = tile
    threads = tile.threads
    names = dict(BM=bm, BN=bn, BK=bk, TM=tm, TN=tn, HM=tm // 2, HN=tn // 2,
                 NTX=bn // tn, BMP=bm + 4, BNP=bn + 4, KU=1 if channels_last else KU, LA=bk * bm // threads, LB=bk * bn // threads,
                 A_KSTEP=threads // bm, B_KSTEP=threads // bn,
                 KC=bk // CL_KREP, KREP=CL_KREP, B_QSTEP=threads * CL_KREP // bk,
                 NCOL=bk * bn // threads // CL_KREP if channels_last else 1,
                 cl=channels_last, use0=nd >= 3, use1=nd >= 2, BIAS=has_bias, ACCUM=accumulate,
                 KEY=f"{dtype} cl={channels_last} nd={nd} wide={wide} tile={tuple(tile)} "
                     f"bias={has_bias} accumulate={accumulate}")
    template = (CONV_GEMM.replace("GATHER_TAP_8", _indent(_GATHER_TAP, 8))
                .replace("GATHER_TAP_16", _indent(_GATHER_TAP, 16))
                .replace("MULTIPLY", _indent(_MULTIPLY, 8)))
    return _compile_source("conv_gemm", template, names, dict(acc=acc, I=I, U=U))


def _types(dtype: str, wide: bool):
    import numba
    acc = numba.float64 if dtype == "float64" else numba.float32
    index = numba.int64 if wide else numba.int32
    unsigned = numba.uint64 if wide else numba.uint32
    return acc, index, unsigned



WEIGHT_GEMM = """
def weight_gemm(x, dy, partial, n_images, G, Kg, Cg, NC, row_tiles, chunk_len,
                xN, xC, x0, x1, x2, S0, S1, S2, yN, yC, y0, y1, y2, P0, P1, P2,
                R1, R2, st0, st1, st2, dl0, dl1, dl2, bf0, bf1, bf2):
    As = cuda.shared.array((2, BK, BMP), acc)
    Bs = cuda.shared.array((2, BK, BNP), acc)
    tid = I(cuda.threadIdx.x)
    tx = I(U(tid) % U(NTX))
    ty = I(U(tid) // U(NTX))
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
    n = I(U(jc) // U(PP))
    r = I(jc - n * PP)
    o0 = I(U(r) // U(P12))
    rr = I(r - o0 * P12)
    o1 = I(U(rr) // U(P2))
    o2 = I(rr - o1 * P2)
    ygoff = I(g * Kg * yC)
#unroll e LA
    am_{e} = I(m0 + tid // BK + {e * QSTEP})
    aok_{e} = am_{e} < Kg
    aoff_{e} = I(ygoff + am_{e} * yC)
#end
    R12 = I(R1 * R2)
#unroll e LB
    bc_{e} = I(col0 + tid // BK + {e * QSTEP})
    bok_{e} = bc_{e} < NC
    bcc_{e} = min(bc_{e}, NC - 1)
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
#end
#unroll i TM
#unroll j TN
    c_{i}_{j} = acc(0)
#end
#end
    if steps > 0:
LOAD_4
#unroll e LA
        As[0, kk, tid // BK + {e * QSTEP}] = va_{e}
#end
#unroll e LB
        Bs[0, kk, tid // BK + {e * QSTEP}] = vb_{e}
#end
        cuda.syncthreads()
    for step in range(steps):
        buf = step & 1
        more = step + 1 < steps
        if more:
            jj = I(jj + BK)
            o2 = I(o2 + BK)
            while o2 >= P2:
                o2 = I(o2 - P2)
                o1 = I(o1 + 1)
                if o1 >= P1:
                    o1 = I(0)
                    o0 = I(o0 + 1)
                    if o0 >= P0:
                        o0 = I(0)
                        n = I(n + 1)
LOAD_12
MULTIPLY
        if more:
            nxt = 1 - buf
#unroll e LA
            As[nxt, kk, tid // BK + {e * QSTEP}] = va_{e}
#end
#unroll e LB
            Bs[nxt, kk, tid // BK + {e * QSTEP}] = vb_{e}
#end
        cuda.syncthreads()
    pbase = I(I(I(chunk * G + g) * Kg) * NC)
#unroll i TM
    m_{i} = m0 + I(ty * HM + {i if i < HM else BM // 2 + i - HM})
#end
#unroll j TN
    col_{j} = col0 + I(tx * HN + {j if j < HN else BN // 2 + j - HN})
    if col_{j} < NC:
#unroll i TM
        if m_{i} < Kg:
            partial[U(pbase + m_{i} * NC + col_{j})] = c_{i}_{j}
#end
#end
"""

_LOAD = """
    jok = jj < j_stop
    ib2 = I(o2 * st2 - bf2)
#if use0
    ib0 = I(o0 * st0 - bf0)
    ib1 = I(o1 * st1 - bf1)
    ya = I(n * yN + o0 * y0 + o1 * y1 + o2 * y2)
    xb = I(n * xN + ib0 * x0 + ib1 * x1 + ib2 * x2)
#elif use1
    ib1 = I(o1 * st1 - bf1)
    ya = I(n * yN + o1 * y1 + o2 * y2)
    xb = I(n * xN + ib1 * x1 + ib2 * x2)
#else
    ya = I(n * yN + o2 * y2)
    xb = I(n * xN + ib2 * x2)
#end
#unroll e LA
    va_{e} = acc(0)
    if jok & aok_{e}:
        va_{e} = acc(dy[U(ya + aoff_{e})])
#end
#unroll e LB
    vb_{e} = acc(0)
#if use0
    if jok & bok_{e} & (U(ib2 + e2_{e}) < U(S2)) & (U(ib1 + e1_{e}) < U(S1)) & (U(ib0 + e0_{e}) < U(S0)):
#elif use1
    if jok & bok_{e} & (U(ib2 + e2_{e}) < U(S2)) & (U(ib1 + e1_{e}) < U(S1)):
#else
    if jok & bok_{e} & (U(ib2 + e2_{e}) < U(S2)):
#end
        vb_{e} = acc(x[U(xb + boff_{e})])
#end
"""


def weight_gemm_function(dtype: str, nd: int, wide: bool, tile: Tile):
    """The Python function of the weight-gradient kernel (compile with cuda.jit).

    Launch: ``tile.threads`` threads; grid ``(column tiles, row tiles * groups, chunks)``.
    Columns are ``(tap, input channel)`` pairs (``NC = taps * Cg``), rows output channels,
    the reduction runs over ``j = (image, output position)`` in ``[chunk * chunk_len, ...)``.
    Writes ``partial[chunk, g, m, col]`` (flat). Every thread loads the same reduction row
    ``j`` for all its elements, so one ``(image, position)`` counter per thread, advanced by
    the step without division, serves both operands.
    """
    acc, I, U = _types(dtype, wide)
    bm, bn, bk, tm, tn = tile
    threads = tile.threads
    qstep = threads // bk
    names = dict(BM=bm, BN=bn, BK=bk, TM=tm, TN=tn, HM=tm // 2, HN=tn // 2,
                 NTX=bn // tn, BMP=bm + 4, BNP=bn + 4, KU=WEIGHT_KU, QSTEP=qstep, LA=bm // qstep,
                 LB=bn // qstep, use0=nd >= 3, use1=nd >= 2,
                 KEY=f"{dtype} nd={nd} wide={wide} tile={tuple(tile)}")
    template = (WEIGHT_GEMM.replace("LOAD_4", _indent(_LOAD, 8))
                .replace("LOAD_12", _indent(_LOAD, 12))
                .replace("MULTIPLY", _indent(_MULTIPLY, 8)))
    return _compile_source("weight_gemm", template, names, dict(acc=acc, I=I, U=U))


def pack_weights_function(dtype: str):
    """``wp[g, t, r, m] = w[g*Kg + m, r, tap t]`` (forward) or ``w[g*Kg + r, m, tap t]``
    (data), zero for ``r >= R``: the A operand of ``conv_gemm``. One thread per element.

    Arguments: ``w, wp, wtaps (T x 3, flat), count, T, M, R, Rp, Kg, forward`` and w's five
    element strides.
    """
    acc = _types(dtype, True)[0]

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
        wp[e] = v

    return pack_weights


def sum_chunks_function(dtype: str):
    """``dw[k, c, tap] = [dw +] sum over chunks of partial[chunk, k, tap*Cg + c]``, chunks
    added in order. One thread per element of dw.

    Arguments: ``partial, w, count (= K*Cg*T), chunks, Cg, T, R1, R2, accumulate`` and w's
    five element strides.
    """
    acc = _types(dtype, True)[0]

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


_FUNCTIONS = {"conv_gemm": conv_gemm_function, "weight_gemm": weight_gemm_function,
              "pack_weights": pack_weights_function, "sum_chunks": sum_chunks_function}


@functools.lru_cache(maxsize=None)
def kernel(name: str, *key):
    """The kernel ``name`` built from ``key`` (see :func:`jit_kernel`)."""
    tile = {"conv_gemm": 4, "weight_gemm": 3}.get(name)
    return jit_kernel(_FUNCTIONS[name](*key), _launch_types(name, key),
                      None if tile is None else key[tile])


def jit_kernel(function, types: tuple, tile: Tile = None):
    """``function`` as a kernel. On a GPU it is compiled at once for ``types`` (device
    pointers and int64 scalars: what every launch passes), which keeps Numba's per-launch
    typing and array wrapping off the hot path, and kept in Numba's disk cache where its
    source is a file; a tiled GEMM gets launch bounds of two blocks per SM (at most 128
    registers at 256 threads). Under the simulator it takes arrays."""
    if simulated():
        return cuda.jit(function)
    options = dict(cache=not function.__code__.co_filename.startswith("<"))
    if tile is not None:
        options["launch_bounds"] = (tile.threads, 2)
    return cuda.jit(types, **options)(function)


@functools.lru_cache(maxsize=None)
def _copy5_kernel(dtype: str):
    return cuda.jit(copy5_function(dtype))


# --- operands ---------------------------------------------------------------------------------

class Operand(NamedTuple):
    """A device array as the kernels take it: ``ref`` (the device pointer on a GPU, a flat
    1D view under the simulator), element strides in the kernels' order (activations
    ``(N, C, S0, S1, S2)``, weights ``(K, C, R0, R1, R2)``, missing spatial dimensions
    with stride 0) and the elements reached from the first one."""
    ref: object
    strides: tuple
    span: int


def operand(a, channels_last=None, g=None) -> Operand:
    """``a`` (any ``__cuda_array_interface__`` object) for the kernels; ``channels_last``
    None for weights and biases (kept in their own order). An operand with a negative stride
    is first copied (contiguous), which needs the problem's geometry ``g``."""
    shape, strides, itemsize = _shape_strides(a)
    if any(st < 0 for st in strides):
        a = _copy5(_five(a, g, channels_last))
        shape, strides, itemsize = _shape_strides(a)
    if channels_last:
        shape = (shape[0], shape[-1]) + tuple(shape[1:-1])
        strides = (strides[0], strides[-1]) + tuple(strides[1:-1])
    pad = 5 - len(shape)
    shape = shape[:2] + (1,) * pad + tuple(shape[2:])
    strides = strides[:2] + (0,) * pad + tuple(strides[2:])
    span = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    if simulated():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        base = as_device(a)
        view = np.lib.stride_tricks.as_strided(base._ary, (span,), (itemsize,))
        return Operand(FakeCUDAArray(view), strides, span)
    return Operand(_pointer(a), strides, span)


def _shape_strides(a):
    """Shape, element strides and item size of a device array (numba's, or any
    ``__cuda_array_interface__`` object), read without wrapping it."""
    if getattr(a, "__cuda_ndarray__", False) or simulated():
        a = as_device(a)
        itemsize = a.dtype.itemsize
        return tuple(a.shape), tuple(int(s) // itemsize for s in a.strides), itemsize
    face = a.__cuda_array_interface__
    shape = tuple(face["shape"])
    itemsize = np.dtype(face["typestr"]).itemsize
    strides = face.get("strides")
    if strides is None:
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= n
        return shape, tuple(reversed(strides)), itemsize
    return shape, tuple(int(s) // itemsize for s in strides), itemsize


def _pointer(a) -> int:
    """The device pointer of ``a``'s first element; a producer's own stream (the interface's
    ``stream``, other than the legacy and per-thread default streams) is synchronised
    first, as the protocol asks of consumers."""
    if getattr(a, "__cuda_ndarray__", False):
        return a.device_ctypes_pointer.value or 0
    face = a.__cuda_array_interface__
    stream = face.get("stream")
    if stream not in (None, 1, 2):
        cuda.external_stream(stream).synchronize()
    return face["data"][0] or 0


def _ref(devary):
    """A device array of ours (workspace, table) as a kernel argument."""
    return devary if simulated() else (devary.device_ctypes_pointer.value or 0)


def _writable(result, shape, g, channels_last, accumulate):
    """Where a kernel writes ``result``: itself, or (negative strides) a contiguous stand-in
    holding its values when accumulating; and that target as an operand."""
    if all(st >= 0 for st in _shape_strides(result)[1]):
        return result, operand(result, channels_last)
    target = device_array(shape, result.dtype)
    if accumulate:
        _copy5(_five(result, g, channels_last), into=_five(target, g, channels_last))
    return target, operand(target, channels_last)


def _written(target, result, g, channels_last) -> None:
    """Copy a stand-in target back into ``result``."""
    if target is not result:
        _copy5(_five(target, g, channels_last), into=_five(result, g, channels_last))


def _five(a, g, channels_last):
    return weight5(a) if channels_last is None else activation5(g, a)


def _copy5(src, into=None):
    """A contiguous copy of the 5D device array ``src`` (or ``src`` copied into ``into``)."""
    dst = into if into is not None else device_array(src.shape, src.dtype)
    count = math.prod(dst.shape)
    if count:
        _copy5_kernel(str(src.dtype))[_ceil(count, 256), 256](src, dst)
    return dst


# --- drivers ---------------------------------------------------------------------------------

def convolution(mode: str, problem, src, w, bias, out, result_shape):
    """``out = [out +] conv(src, w) [+ bias]``: ``mode`` "forward" (conv) or "data" (data
    gradient, transposed convolution)."""
    g = geom(problem)
    dtype = problem.dtype
    cl = problem.channels_last
    result = out if out is not None else device_array(result_shape, dtype)
    if math.prod(result_shape) == 0:
        return result
    forward = mode == "forward"
    rows, reduce = (g.kg, g.cg) if forward else (g.cg, g.kg)
    plan = _conv_plan(g, forward)
    tile, most_cols = _conv_tile(problem, forward)
    rp = _ceil(reduce, tile.bk) * tile.bk
    s = operand(src, cl, g)
    target, o = _writable(result, result_shape, g, cl, problem.accumulate)
    wo = operand(w, None, g)
    count = g.groups * plan.taps * rp * rows
    wp = workspace("weights", count, _acc(dtype))
    kernel("pack_weights", dtype)[_ceil(count, 256), 256](
        wo.ref, _ref(wp), _table(plan.wtaps, np.int64), count, plan.taps, rows, reduce, rp,
        g.kg, forward, *wo.strides)
    wide = max(s.span, o.span, count) > INDEX32_LIMIT
    has_bias = bias is not None
    bias_ref = bias_operand(bias, dtype)
    run = kernel("conv_gemm", dtype, cl, problem.ndim, wide, tile, has_bias,
                 bool(problem.accumulate))
    index = np.int64 if wide else np.int32
    grid = (_ceil(most_cols, tile.bn), _ceil(rows, tile.bm), g.groups * len(plan.phases))
    run[grid, tile.threads](
        s.ref, _ref(wp), o.ref, bias_ref, _table(plan.deltas, index),
        _table(plan.phases, index), len(plan.phases), g.n, rows, reduce, rp, plan.taps,
        *s.strides, *plan.src_size, *plan.col_stride, *plan.col_offset, *o.strides,
        *plan.out_step)
    _written(target, result, g, cl)
    return result


def weight_gradient(problem, x, dy, out):
    """``dw = [dw +] sum over images and positions of dy x``, split in chunks fixed by the
    shape, the partials added in chunk order."""
    g = geom(problem)
    dtype = problem.dtype
    cl = problem.channels_last
    result = out if out is not None else device_array(problem.w_shape, dtype)
    if math.prod(problem.w_shape) == 0:
        return result
    xo = operand(x, cl, g)
    yo = operand(dy, cl, g)
    target, wo = _writable(result, problem.w_shape, g, None, problem.accumulate)
    cols = g.taps * g.cg
    reduce_total = g.n * g.positions
    tile = _weight_tile(problem)
    row_tiles = _ceil(g.kg, tile.bm)
    base = _ceil(cols, tile.bn) * row_tiles * g.groups
    steps = _ceil(reduce_total, tile.bk)
    chunks = max(1, min(steps, _ceil(WEIGHT_TARGET_BLOCKS, base), 65535,
                        MAX_PARTIAL_ELEMENTS // (g.k * cols)))
    chunk_len = _ceil(steps, chunks) * tile.bk
    chunks = max(1, _ceil(reduce_total, chunk_len))
    count = g.k * cols
    partial = workspace("partials", chunks * count, _acc(dtype))
    wide = max(xo.span, yo.span, chunks * count) > INDEX32_LIMIT
    run = kernel("weight_gemm", dtype, problem.ndim, wide, tile)
    run[(_ceil(cols, tile.bn), row_tiles * g.groups, chunks), tile.threads](
        xo.ref, yo.ref, _ref(partial), g.n, g.groups, g.kg, g.cg, cols, row_tiles, chunk_len,
        *xo.strides, *g.s, *yo.strides, *g.p, g.r[1], g.r[2], *g.stride, *g.dilation,
        *g.before)
    kernel("sum_chunks", dtype)[_ceil(count, 256), 256](
        _ref(partial), wo.ref, count, chunks, g.cg, g.taps, g.r[1], g.r[2],
        bool(problem.accumulate), *wo.strides)
    _written(target, result, g, None)
    return result


@functools.lru_cache(maxsize=1024)
def _conv_tile(problem, forward: bool):
    """The tile of a forward or data-gradient launch, and its most columns of a phase."""
    g = geom(problem)
    plan = _conv_plan(g, forward)
    rows = g.kg if forward else g.cg
    most_cols = max(g.n * math.prod(ph[:3]) for ph in plan.phases)
    return choose_tile(rows, most_cols, g.groups * len(plan.phases), problem.dtype), most_cols


@functools.lru_cache(maxsize=1024)
def _weight_tile(problem) -> Tile:
    """The weight gradient's tile: chunks of the reduction give the blocks, so only waste
    and size count."""
    g = geom(problem)
    return choose_tile(g.kg, g.taps * g.cg, FULL_GRID, problem.dtype)


def kernel_keys(problem) -> list:
    """The ``kernel(name, *key)`` calls that ``problem`` (a convolution op run by this
    algorithm) launches with 32-bit indices: what :func:`precompile` compiles ahead."""
    dtype, op = problem.dtype, problem.op
    if op == "conv_backward_weight":
        return [("weight_gemm", (dtype, problem.ndim, False, _weight_tile(problem))),
                ("sum_chunks", (dtype,))]
    if op == "conv_backward_bias":
        return []
    forward = op == "conv"
    tile, _ = _conv_tile(problem, forward)
    return [("pack_weights", (dtype,)),
            ("conv_gemm", (dtype, problem.channels_last, problem.ndim, False, tile,
                           bool(problem.has_bias), bool(problem.accumulate)))]


def precompile(problems, processes: int = 0) -> list:
    """Compile (into Numba's disk cache) every GEMM kernel that ``problems`` (run by this
    algorithm) launch, in up to ``processes`` Python processes at once (0: one per CPU, at
    most 16). Returns the keys; later processes load each kernel from the cache.
    :meth:`numbaconv.cuda.CudaBackend.precompile` picks the problems."""
    keys = sorted({key for p in problems for key in kernel_keys(p)}, key=repr)
    workers = processes or min(16, os.cpu_count() or 1)
    if workers <= 1 or len(keys) <= 1 or simulated():
        for name, key in keys:
            kernel(name, *key)
        return keys
    import subprocess
    import sys
    code = ("import sys; from numbaconv.cuda._implicit_gemm import Tile, kernel; "
            "[kernel(name, *key) for name, key in eval(sys.argv[1])]")
    batches = [keys[i::workers] for i in range(workers)]
    running = [subprocess.Popen([sys.executable, "-c", code, repr(batch)])
               for batch in batches if batch]
    failed = [p.args for p in running if p.wait() != 0]
    if failed:
        raise RuntimeError(f"precompile: {len(failed)} worker(s) failed")
    return keys


def pointer_types(dtype: str) -> tuple:
    """Numba types of a pointer to ``dtype`` elements and to their accumulators."""
    from numba import types
    elem = {"float16": types.float16, "float32": types.float32,
            "float64": types.float64}[dtype]
    acc = types.float64 if dtype == "float64" else types.float32
    return types.CPointer(elem), types.CPointer(acc)


def _launch_types(name: str, key: tuple) -> tuple:
    """The argument types of a launch: device pointers and int64 scalars (a boolean where
    the kernel takes a flag)."""
    from numba import types
    data, accs = pointer_types(key[0])
    i, flag = types.int64, types.boolean
    if name == "conv_gemm":
        table = types.CPointer(types.int64 if key[3] else types.int32)
        return (data, accs, data, data, table, table) + (i,) * 28
    if name == "weight_gemm":
        return (data, data, accs) + (i,) * 34
    if name == "pack_weights":
        return (data, accs, types.CPointer(types.int64)) + (i,) * 6 + (flag,) + (i,) * 5
    if name == "sum_chunks":
        return (accs, data) + (i,) * 6 + (flag,) + (i,) * 5
    raise ValueError(f"name: no launch types for {name!r}")


class ConvPlan(NamedTuple):
    """Tables and column geometry of one forward or data-gradient launch."""
    phases: tuple       # (J0, J1, J2, first0, first1, first2, tap start, tap count) each
    deltas: tuple       # (d0, d1, d2) per tap, phases after one another
    wtaps: tuple        # the weight tap (t0, t1, t2) of each
    taps: int
    src_size: tuple     # bounds of the gathered operand
    col_stride: tuple
    col_offset: tuple
    out_step: tuple


@functools.lru_cache(maxsize=256)
def _conv_plan(g, forward: bool) -> ConvPlan:
    if forward:
        per_dim = [[(0, g.p[d], tuple((t, t * g.dilation[d]) for t in range(g.r[d])))]
                   for d in range(3)]
        col_stride, col_offset = g.stride, tuple(-b for b in g.before)
        src_size, out_step = g.s, (1, 1, 1)
    else:
        per_dim = [stride_phases(g.s[d], g.p[d], g.r[d], g.stride[d], g.dilation[d],
                                 g.before[d]) for d in range(3)]
        col_stride, col_offset = (1, 1, 1), (0, 0, 0)
        src_size, out_step = g.p, g.stride
    phases, deltas, wtaps = [], [], []
    for a, b, c in itertools.product(*per_dim):
        start = len(deltas)
        for (t0, d0), (t1, d1), (t2, d2) in itertools.product(a[2], b[2], c[2]):
            deltas.append((d0, d1, d2))
            wtaps.append((t0, t1, t2))
        phases.append((a[1], b[1], c[1], a[0], b[0], c[0], start, len(deltas) - start))
    if not deltas:                      # every phase without taps: dx is zero (or bias)
        deltas.append((0, 0, 0))
        wtaps.append((0, 0, 0))
    return ConvPlan(tuple(phases), tuple(deltas), tuple(wtaps), len(deltas), tuple(src_size),
                    tuple(col_stride), tuple(col_offset), tuple(out_step))


def _acc(dtype: str) -> np.dtype:
    return np.dtype(np.float64 if dtype == "float64" else np.float32)


_TABLES: dict = {}


def _table(rows: tuple, dtype):
    """``rows`` flattened into a device array of ``dtype`` (copied to the current device
    once per ``rows``), as a kernel argument."""
    key = (rows, np.dtype(dtype).str, _device_id())
    found = _TABLES.get(key)
    if found is None:
        if len(_TABLES) > 512:
            _TABLES.clear()
        array = cuda.to_device(np.array(rows, dtype=dtype).reshape(-1))
        found = _TABLES[key] = (array, _ref(array))
    return found[1]


def _device_id() -> int:
    """The current device: device memory (tables, workspaces) is kept per device."""
    return 0 if simulated() else cuda.get_current_device().id


_WORKSPACES = threading.local()


def workspace(kind: str, elements: int, dtype):
    """A buffer on the current device of at least ``elements`` of ``dtype`` for ``kind``
    (packed weights, weight-gradient partials), reused by later calls of this host thread on
    that device: the kernels run in order on one stream, so a later call's writes wait for an
    earlier call's reads. Grows by powers of two."""
    cache = getattr(_WORKSPACES, "buffers", None)
    if cache is None:
        cache = _WORKSPACES.buffers = {}
    key = (kind, np.dtype(dtype).str, _device_id())
    buffer = cache.get(key)
    if buffer is None or buffer.shape[0] < elements:
        buffer = device_array((1 << max(10, (elements - 1).bit_length()),), dtype)
        cache[key] = buffer
    return buffer


def bias_operand(bias, dtype: str):
    """The bias as a kernel argument: its elements one after another (a strided bias is
    copied), or a stand-in never read when there is none."""
    if bias is None:
        return _no_bias(dtype)
    if _shape_strides(bias)[1][0] != 1:
        bias = _copy5(view5(bias, 1))
    return operand(bias).ref


_NO_BIAS: dict = {}


def _no_bias(dtype: str):
    """The bias argument of a kernel compiled without one (never read): a null pointer, or a
    one-element array under the simulator."""
    if not simulated():
        return 0
    if dtype not in _NO_BIAS:
        _NO_BIAS[dtype] = device_array((1,), dtype)
    return _NO_BIAS[dtype]


def signatures(dtype: str, channels_last: bool, nd: int = 2, tile: Tile = None,
               wide: bool = False):
    """The main kernels of one (dtype, layout) as ``(label, python function, signature,
    tile)`` for ``numba.cuda.compile_ptx``: the types every launch passes."""
    if tile is None:
        tile = (TILES64 if dtype == "float64" else TILES)[0]
    layout = "cl" if channels_last else "cf"
    found = []
    for mode, bias in (("forward", True), ("data", False)):
        key = (dtype, channels_last, nd, wide, tile, bias, False)
        found.append((f"conv_gemm_{mode}_{layout}_{dtype}", conv_gemm_function(*key),
                      _launch_types("conv_gemm", key), tile))
    key = (dtype, nd, wide, tile)
    found.append((f"weight_gemm_{dtype}", weight_gemm_function(*key),
                  _launch_types("weight_gemm", key), tile))
    return found
