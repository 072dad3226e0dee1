"""TF32 tensor-core multiply-adds for the implicit-GEMM kernels (``NUMBACONV_CUDA_TF32=1``).

``mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)`` is PTX's warp-wide
``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32``: the 32 lanes of a warp together
compute ``D = A B + C`` for a 16x8 ``A``, an 8x8 ``B`` and a 16x8 ``C``, each lane holding
the elements the PTX ISA assigns it (``group = lane // 4``, ``member = lane % 4``)::

    a0 = A[group, member]      a1 = A[group + 8, member]
    a2 = A[group, member + 4]  a3 = A[group + 8, member + 4]
    b0 = B[member, group]      b1 = B[member + 4, group]
    c0, c1 = C[group, 2 * member], C[group, 2 * member + 1]
    c2, c3 = C[group + 8, 2 * member], C[group + 8, 2 * member + 1]

and D as C. Every lane of the warp must call it, with the same control flow (``.sync
.aligned``). ``tf32(x)`` rounds a float32 to TF32 (10 mantissa bits, to nearest, ties away
from zero: ``cvt.rna.tf32.f32``); the tensor cores ignore the 13 bits below. Both need
sm_80 or newer.

On a GPU both are Numba intrinsics of one inline-PTX instruction each. Under the simulator
they are Python: ``tf32`` rounds the bits the same way, and ``mma_tf32`` trades the lanes'
fragments through the block (two barriers a call, so every thread of the block must call it
together, as the GEMM kernels do) and sums the products in float64, rounded once to
float32; the hardware's sums may differ from that in the last bits.
"""

from __future__ import annotations

import threading

import numpy as np

from ._layout import simulated

__all__ = ["mma_tf32", "tf32", "round_tf32", "MIN_COMPUTE_CAPABILITY"]

#: The first architecture with TF32 ``mma.sync`` (Ampere).
MIN_COMPUTE_CAPABILITY = (8, 0)


def round_tf32(values) -> np.ndarray:
    """float32 ``values`` rounded as ``cvt.rna.tf32.f32`` rounds them (as float32 with the
    13 low mantissa bits zero). NaN and infinity stay what they are."""
    x = np.asarray(values, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isfinite(x), rounded, x)


def _truncated(value) -> float:
    """What a tensor core reads of a float32 operand: its TF32 bits, the rest dropped."""
    bits = np.float32(value).view(np.uint32) & np.uint32(0xFFFFE000)
    return float(bits.view(np.float32))


def _sim_tf32(x):
    return np.float32(round_tf32(np.float32(x)))


def _sim_mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    me = threading.current_thread()
    board = me._manager.__dict__.setdefault("_numbaconv_mma", {})
    board[me.thread_id] = (a0, a1, a2, a3, b0, b1)
    me.syncthreads()
    first = me.thread_id - me.thread_id % 32
    a = np.zeros((16, 8))
    b = np.zeros((8, 8))
    for lane in range(32):
        f = board[first + lane]
        group, member = lane // 4, lane % 4
        a[group, member], a[group + 8, member] = _truncated(f[0]), _truncated(f[1])
        a[group, member + 4], a[group + 8, member + 4] = _truncated(f[2]), _truncated(f[3])
        b[member, group], b[member + 4, group] = _truncated(f[4]), _truncated(f[5])
    me.syncthreads()                    # everyone has read the board before it is reused
    group, member = me.thread_id % 32 // 4, me.thread_id % 4
    product = a @ b
    rows, cols = (group, group, group + 8, group + 8), (2 * member, 2 * member + 1) * 2
    return tuple(np.float32(c + product[r, k])
                 for c, r, k in zip((c0, c1, c2, c3), rows, cols))


def _intrinsics():
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    f32 = types.float32

    @intrinsic
    def tf32(typingctx, x):
        if x != f32:
            return None

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.FloatType()])
            asm = ir.InlineAsm(fnty, "cvt.rna.tf32.f32 $0, $1;", "=r,f")
            return builder.bitcast(builder.call(asm, args), ir.FloatType())
        return f32(f32), codegen

    @intrinsic
    def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        if any(arg != f32 for arg in (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)):
            return None

        def codegen(context, builder, sig, args):
            i32, f = ir.IntType(32), ir.FloatType()
            fnty = ir.FunctionType(ir.LiteralStructType([f] * 4), [i32] * 6 + [f] * 4)
            asm = ir.InlineAsm(
                fnty, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                      "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", side_effect=True)
            operands = [builder.bitcast(v, i32) for v in args[:6]] + list(args[6:])
            d = builder.call(asm, operands)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(d, i) for i in range(4)])
        return types.UniTuple(f32, 4)(*([f32] * 10)), codegen

    return tf32, mma_tf32


if simulated():
    tf32, mma_tf32 = _sim_tf32, _sim_mma
else:
    tf32, mma_tf32 = _intrinsics()
