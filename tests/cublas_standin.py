"""A NumPy stand-in for a cuBLAS binding's ``sgemm``/``dgemm``, written from cuBLAS's
documented column-major semantics and from nothing in numbaconv, so that the mapping of
row-major arrays onto cuBLAS calls (numbaconv/cuda/_blas.py) is tested without a GPU.

``gemm(handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc)`` computes
``C = alpha * op(A) @ op(B) + beta * C`` where every matrix is column-major: element
``(i, j)`` of a matrix with leading dimension ``ld`` is at ``pointer + (i + j * ld) *
itemsize``; ``op(A)`` is ``m x k``, so A itself is ``m x k`` (``lda >= max(1, m)``) with
transa N and ``k x m`` (``lda >= max(1, k)``) with T; likewise B (``k x n`` or ``n x k``) and
C (``m x n``, ``ldc >= max(1, m)``). C is not read when beta is 0. ``alpha`` and ``beta``
are host pointers (cuBLAS's default pointer mode).

Device pointers are resolved through :class:`Memory`: the buffers registered with it (under
the simulator, every device array's host buffer); a matrix reaching outside every registered
buffer is an error, as an out-of-bounds access would be.
"""

from __future__ import annotations

import ctypes

import numpy as np

OP_N, OP_T = 0, 1
DEFAULT_MATH, TF32_TENSOR_OP_MATH = 0, 3


class CublasError(RuntimeError):
    """What cuBLAS would return as CUBLAS_STATUS_INVALID_VALUE."""


class Memory:
    """Host buffers standing for device memory: pointer -> NumPy view."""

    def __init__(self):
        self.buffers = {}  # start address -> root ndarray

    def register(self, array: np.ndarray) -> None:
        root = array
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root.nbytes and (root.flags.c_contiguous or root.flags.f_contiguous):
            self.buffers[root.__array_interface__["data"][0]] = root

    def view(self, pointer: int, dtype, rows: int, cols: int, ld: int) -> np.ndarray:
        """The column-major ``rows x cols`` matrix of ``dtype`` with leading dimension
        ``ld`` at ``pointer``, as a (writable) NumPy view."""
        dtype = np.dtype(dtype)
        if rows == 0 or cols == 0:
            return np.zeros((rows, cols), dtype)
        extent = ((cols - 1) * ld + rows) * dtype.itemsize
        for start, root in self.buffers.items():
            if start <= pointer and pointer + extent <= start + root.nbytes:
                flat = root.ravel(order="K").view(np.uint8)
                offset = pointer - start
                window = flat[offset:offset + extent]
                return np.lib.stride_tricks.as_strided(
                    window.view(dtype), shape=(rows, cols),
                    strides=(dtype.itemsize, ld * dtype.itemsize))
        raise CublasError(f"a {rows}x{cols} matrix (ld {ld}) at {pointer:#x} lies outside "
                          f"every device buffer")


def host_scalar(pointer: int, dtype):
    ctype = ctypes.c_float if np.dtype(dtype) == np.float32 else ctypes.c_double
    return np.dtype(dtype).type(ctype.from_address(pointer).value)


class StandIn:
    """The stand-in binding: ``sgemm``/``dgemm`` and the handle functions, recording every
    gemm call as ``(dtype, transa, transb, m, n, k, lda, ldb, ldc, alpha, beta)``."""

    def __init__(self, memory: Memory):
        self.memory = memory
        self.calls = []
        self.handles = 0
        self.streams = {}
        self.math_modes = {}

    def create(self):
        self.handles += 1
        return self.handles

    def set_stream(self, handle, stream):
        self.streams[handle] = stream

    def set_math_mode(self, handle, mode):
        self.math_modes[handle] = mode

    def sgemm(self, *args):
        self._gemm(np.float32, *args)

    def dgemm(self, *args):
        self._gemm(np.float64, *args)

    def _gemm(self, dtype, handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c,
              ldc):
        if handle not in self.streams:
            raise CublasError("a handle that create() did not give")
        if transa not in (OP_N, OP_T) or transb not in (OP_N, OP_T):
            raise CublasError(f"transa, transb: {transa}, {transb}")
        if min(m, n, k) < 0:
            raise CublasError(f"m, n, k: {m}, {n}, {k}")
        a_rows, a_cols = (m, k) if transa == OP_N else (k, m)
        b_rows, b_cols = (k, n) if transb == OP_N else (n, k)
        for name, ld, rows in (("lda", lda, a_rows), ("ldb", ldb, b_rows), ("ldc", ldc, m)):
            if ld < max(1, rows):
                raise CublasError(f"{name} = {ld} < max(1, {rows})")
        alpha_v, beta_v = host_scalar(alpha, dtype), host_scalar(beta, dtype)
        self.calls.append((np.dtype(dtype).name, transa, transb, m, n, k, lda, ldb, ldc,
                           float(alpha_v), float(beta_v)))
        if m == 0 or n == 0:
            return
        c_view = self.memory.view(c, dtype, m, n, ldc)
        if k == 0:
            product = np.zeros((m, n), dtype)
        else:
            a_view = self.memory.view(a, dtype, a_rows, a_cols, lda)
            b_view = self.memory.view(b, dtype, b_rows, b_cols, ldb)
            op_a = a_view if transa == OP_N else a_view.T
            op_b = b_view if transb == OP_N else b_view.T
            product = np.matmul(op_a, op_b)
        result = alpha_v * product
        if beta_v != 0:
            result = result + beta_v * c_view
        c_view[...] = result
