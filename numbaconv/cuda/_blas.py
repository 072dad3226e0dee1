"""The one matrix product of the cuda recurrent ops, ``c (+)= op(a) @ op(b)`` on 2-D device
arrays, and the launch geometry of their kernels.

:func:`product` calls cuBLAS where it loads (NVIDIA's ``nvmath-python`` bindings, else
CuPy's), else the Numba ``gemm`` kernel of :mod:`numbaconv.cuda._rnn_kernels`, which also
serves float16, arrays that cuBLAS cannot address, the simulator, and
``NUMBACONV_CUDA_CUBLAS=0``. The binding is looked for on the first product, never at import,
and a failure is remembered (:func:`describe` says which path is in use, and why).

Row-major arrays on column-major cuBLAS: a row-major ``(rows, cols)`` array whose rows are
``ld`` elements apart is, read column-major, the ``(cols, rows)`` matrix with leading
dimension ``ld``: its transpose. So ``C = op(A) @ op(B)`` is computed as
``C^T = op(B)^T @ op(A)^T``: the operands swap places, m and n are C's columns and rows, and
each operand's transpose flag says whether cuBLAS's view of its memory is the factor or its
transpose (:func:`plan`). Arrays with a unit stride along either axis and the other stride
large enough are expressible; the rest go to the Numba kernel.

cuBLAS runs on the stream the kernels use (Numba's default stream: the legacy default
stream, or the per-thread one with ``NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM=1``), with one
handle per (device, host thread), created on first use and kept. Math mode: cuBLAS's
default, which never uses TF32 for float32 (IEEE products, as the Numba kernel); with
``NUMBACONV_CUDA_TF32=1``, ``CUBLAS_TF32_TENSOR_OP_MATH``. Alpha and beta are host scalars;
``accumulate`` is beta = 1.

Grids (:func:`gemm_launch`, :func:`elementwise_launch`) stay within the hardware's limits
(x up to 2**31 - 1 blocks, y and z up to 65,535): the product kernel puts output rows on x
and columns on y, and loops over tiles beyond the grid.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import NamedTuple, Optional

from ..config import cuda_cublas, cuda_tf32, cuda_tile

#: Hardware limits of a launch grid (every CUDA device since compute capability 3.0).
MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535
#: cuBLAS's dimensions and leading dimensions are C ints.
_MAX_INT = 2**31 - 1


def blocks(count: int, per_block: int) -> int:
    return max(1, -(-count // per_block))


def gemm_launch(rows: int, cols: int, tile: tuple) -> tuple:
    """``(grid, block)`` of the Numba product kernel for a ``rows x cols`` output: row tiles
    (:func:`._rnn_kernels.block_tile`) on x, column tiles on y, each capped at the hardware
    limit (the kernel loops over the tiles beyond it); the block is ``(columns, rows)`` of
    the threads' tile."""
    from ._rnn_kernels import block_tile
    tm, tq, _ = tile
    bm, bq = block_tile(tile)
    grid = (min(blocks(rows, bm), MAX_GRID_X), min(blocks(cols, bq), MAX_GRID_YZ))
    return grid, (tq, tm)


def elementwise_launch(count: int, threads: int) -> tuple:
    """``(grid, block)`` of a 1-D element-wise kernel over ``count`` threads."""
    grid = blocks(count, threads)
    if grid > MAX_GRID_X:
        raise ValueError(f"{count} elements need {grid} blocks of {threads} threads, more "
                         f"than a grid holds ({MAX_GRID_X})")
    return grid, threads


# --- the mapping onto column-major cuBLAS ----------------------------------------------------

class Call(NamedTuple):
    """A column-major ``gemm`` computing the row-major product: ``first``/``second`` name
    the operand ("a" or "b") at cuBLAS's A and B."""
    transa: bool
    transb: bool
    m: int
    n: int
    k: int
    first: str
    lda: int
    second: str
    ldb: int
    ldc: int


def column_major(shape, strides) -> Optional[tuple]:
    """``(ld, transposed)``: cuBLAS's view of a 2-D array of ``shape`` and element
    ``strides`` is the column-major matrix with leading dimension ``ld`` at its first
    element, which is the array's transpose (``transposed``, a row-major array) or the
    array itself (a column-major one); None where there is no such view (no unit stride,
    a negative or too short other stride)."""
    rows, cols = (int(v) for v in shape)
    s0, s1 = (int(v) for v in strides)
    if (cols <= 1 or s1 == 1) and (rows <= 1 or s0 >= max(1, cols)):
        return (s0 if rows > 1 else max(1, cols)), True
    if (rows <= 1 or s0 == 1) and (cols <= 1 or s1 >= max(1, rows)):
        return (s1 if cols > 1 else max(1, rows)), False
    return None


def plan(a_shape, a_strides, b_shape, b_strides, c_shape, c_strides, ta: bool,
         tb: bool) -> Optional[Call]:
    """The cuBLAS call computing ``c = op(a) @ op(b)`` (shapes and element strides of
    row-major arrays), or None where an operand has no column-major view."""
    views = [column_major(s, st) for s, st in
             ((a_shape, a_strides), (b_shape, b_strides), (c_shape, c_strides))]
    if any(v is None for v in views):
        return None
    (lda, a_t), (ldb, b_t), (ldc, c_t) = views
    rows, cols = (int(v) for v in c_shape)
    reduce_len = int(a_shape[0] if ta else a_shape[1])
    if c_t:  # cuBLAS's C is c^T = op(b)^T @ op(a)^T
        m, n = cols, rows
        factors = (("b", not tb, ldb, b_t), ("a", not ta, lda, a_t))
    else:    # cuBLAS's C is c = op(a) @ op(b)
        m, n = rows, cols
        factors = (("a", ta, lda, a_t), ("b", tb, ldb, b_t))
    # A factor wants the operand transposed or not; cuBLAS's view of the operand is
    # transposed or not: a transpose is asked for where the two differ.
    (first, want1, ld1, view1), (second, want2, ld2, view2) = factors
    call = Call(want1 != view1, want2 != view2, m, n, reduce_len, first, ld1, second, ld2,
                ldc)
    if max(m, n, reduce_len, ld1, ld2, ldc) > _MAX_INT:
        return None
    return call


class Cublas(NamedTuple):
    """A cuBLAS binding as :func:`product` calls it. ``sgemm``/``dgemm`` take cuBLAS's
    arguments as nvmath-python does: ``(handle, transa, transb, m, n, k, alpha, A, lda, B,
    ldb, beta, C, ldc)``, with alpha and beta host pointers and A, B, C device pointers."""
    name: str
    sgemm: object
    dgemm: object
    create: object
    set_stream: object
    set_math_mode: object
    op_n: int = 0
    op_t: int = 1
    default_math: int = 0
    tf32_math: int = 3


def _scalars(dtype: str):
    import numpy as np
    return np.array([1], dtype), np.array([0], dtype)


_SCALARS: dict = {}


def pointer(a) -> int:
    """The address of ``a``'s first element: its ``__cuda_array_interface__``, else (the
    simulator's arrays, NumPy arrays) its ``__array_interface__``."""
    interface = getattr(a, "__cuda_array_interface__", None)
    if interface is None:
        interface = a.__array_interface__
    return int(interface["data"][0] or 0)


def element_strides(a) -> tuple:
    itemsize = a.dtype.itemsize
    return tuple(int(s) // itemsize for s in a.strides)


def cublas_arguments(binding: Cublas, handle, a, b, c, dtype: str, ta: bool, tb: bool,
                     accumulate: bool) -> Optional[tuple]:
    """``(gemm, arguments, where)``: the cuBLAS function and its argument list computing
    ``c (+)= op(a) @ op(b)``, and the index of ``a``'s pointer in the list; None where the
    arrays have no column-major view or the dtype is not float32/float64."""
    gemm = binding.sgemm if dtype == "float32" else \
        binding.dgemm if dtype == "float64" else None
    if gemm is None:
        return None
    call = plan(a.shape, element_strides(a), b.shape, element_strides(b), c.shape,
                element_strides(c), bool(ta), bool(tb))
    if call is None:
        return None
    scalars = _SCALARS.get(dtype)
    if scalars is None:
        scalars = _SCALARS[dtype] = _scalars(dtype)
    one, zero = scalars
    operands = {"a": a, "b": b}
    arguments = [handle, binding.op_t if call.transa else binding.op_n,
                 binding.op_t if call.transb else binding.op_n, call.m, call.n, call.k,
                 one.ctypes.data, pointer(operands[call.first]), call.lda,
                 pointer(operands[call.second]), call.ldb,
                 (one if accumulate else zero).ctypes.data, pointer(c), call.ldc]
    return gemm, arguments, 7 if call.first == "a" else 9


def cublas_product(binding: Cublas, handle, a, b, c, dtype: str, *, ta=False, tb=False,
                   accumulate=False) -> bool:
    """``c (+)= op(a) @ op(b)`` as one cuBLAS gemm; False (nothing done) where the arrays
    have no column-major view or the dtype is not float32/float64."""
    found = cublas_arguments(binding, handle, a, b, c, dtype, ta, tb, accumulate)
    if found is None:
        return False
    gemm, arguments, _ = found
    gemm(*arguments)
    return True


# --- which binding ---------------------------------------------------------------------------

#: ``(binding or None, description)`` once looked for; None before the first product.
_state: Optional[tuple] = None
_lock = threading.Lock()
_handles = threading.local()


def _nvmath() -> Cublas:
    from nvmath.bindings import cublas
    try:
        from importlib.metadata import version
        name = f"nvmath-python {version('nvmath-python')}"
    except Exception:  # pragma: no cover - metadata missing
        name = "nvmath-python"
    return Cublas(name, cublas.sgemm, cublas.dgemm, cublas.create, cublas.set_stream,
                  cublas.set_math_mode, int(cublas.Operation.N), int(cublas.Operation.T),
                  int(cublas.Math.DEFAULT_MATH), int(cublas.Math.TF32_TENSOR_OP_MATH))


def _cupy() -> Cublas:
    from cupy_backends.cuda.libs import cublas
    try:
        import cupy
        name = f"CuPy {cupy.__version__}"
    except Exception:  # pragma: no cover
        name = "CuPy"
    return Cublas(name, cublas.sgemm, cublas.dgemm, cublas.create, cublas.setStream,
                  cublas.setMathMode, int(getattr(cublas, "CUBLAS_OP_N", 0)),
                  int(getattr(cublas, "CUBLAS_OP_T", 1)),
                  int(getattr(cublas, "CUBLAS_DEFAULT_MATH", 0)),
                  int(getattr(cublas, "CUBLAS_TF32_TENSOR_OP_MATH", 3)))


#: The bindings tried, in order: (name, module whose presence is checked, loader).
BINDINGS = (("nvmath-python", "nvmath", _nvmath), ("CuPy", "cupy_backends", _cupy))


def _simulated() -> bool:
    from .._device import simulated
    return simulated()


def _load() -> tuple:
    if not cuda_cublas():
        return None, "the Numba gemm kernel (NUMBACONV_CUDA_CUBLAS=0)"
    if _simulated():
        return None, "the Numba gemm kernel (the CUDA simulator has no cuBLAS)"
    failures = []
    for name, module, loader in BINDINGS:
        if importlib.util.find_spec(module) is None:
            failures.append(f"{name} is not installed")
            continue
        try:
            binding = loader()
            handle(binding, tf32=False)  # loads libcublas: fails here, not mid-op
        except Exception as error:
            failures.append(f"{name}: {type(error).__name__}: {error}")
            continue
        return binding, f"cuBLAS through {binding.name}"
    return None, ("the Numba gemm kernel (cuBLAS did not load: " + "; ".join(failures)
                  + "; pip install 'numbaconv[cuda]' brings nvmath-python and cuBLAS)")


def binding() -> tuple:
    """``(Cublas or None, description)``: the binding products use, looked for once."""
    global _state
    state = _state
    if state is None:
        with _lock:
            if _state is None:
                _state = _load()
            state = _state
    return state


def set_binding(new: Optional[Cublas], description: str = "") -> Optional[tuple]:
    """Use ``new`` for every later product (None: the Numba kernel); returns the previous
    state, for :func:`restore`. Tests install a NumPy stand-in this way."""
    global _state
    previous = _state
    _state = (new, description or (f"cuBLAS through {new.name}" if new is not None
                                   else "the Numba gemm kernel"))
    _handles.__dict__.clear()
    return previous


def restore(previous: Optional[tuple]) -> None:
    global _state
    _state = previous
    _handles.__dict__.clear()


def describe() -> str:
    """Which path the products take, for ``numbaconv info``: the one in use once a product
    ran, else what the first product will try (nothing is loaded here)."""
    if _state is not None:
        return _state[1]
    if not cuda_cublas():
        return "the Numba gemm kernel (NUMBACONV_CUDA_CUBLAS=0)"
    found = [name for name, module, _ in BINDINGS if importlib.util.find_spec(module)]
    if not found:
        return ("the Numba gemm kernel: neither nvmath-python nor CuPy is installed "
                "(pip install 'numbaconv[cuda]')")
    return (f"cuBLAS through {found[0]} where it loads, looked for at the first product, "
            f"else the Numba gemm kernel")


def _stream_handle() -> int:
    """The stream Numba's kernels run on when launched without one: CUDA's legacy default
    stream (0 for cuBLAS), or the per-thread default stream (2, ``cudaStreamPerThread``)
    with ``NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM=1``."""
    try:
        from numba.cuda.core import config
    except ImportError:  # older numba-cuda: Numba's own config
        from numba.core import config
    return 2 if getattr(config, "CUDA_PER_THREAD_DEFAULT_STREAM", 0) else 0


def _new_handle(binding: Cublas, tf32: bool):
    handle = binding.create()
    binding.set_stream(handle, _stream_handle())
    binding.set_math_mode(handle, binding.tf32_math if tf32 else binding.default_math)
    return handle


def _device_id() -> int:
    from numba import cuda
    try:
        return int(cuda.get_current_device().id)
    except Exception:  # the simulator's device has no id everywhere
        return 0


def handle(binding: Cublas, tf32: bool):
    """This host thread's handle on the current device (created on first use, kept: cuBLAS
    recommends a handle per thread and device)."""
    key = (binding.name, _device_id(), tf32)
    handles = _handles.__dict__
    found = handles.get(key)
    if found is None:
        found = handles[key] = _new_handle(binding, tf32)
    return found


#: Products run so far on each path, for tests and the launch count in docs/cuda.md.
counts = {"cublas": 0, "numba": 0}


def product(a, b, c, dtype: str, *, ta=False, tb=False, accumulate=False) -> None:
    """``c (+)= op(a) @ op(b)`` on the device: 2-D arrays of ``dtype``, any strides; ``op``
    transposes with ``ta``/``tb``; ``accumulate`` adds to ``c``. cuBLAS where it loaded and
    can address the arrays, else the Numba kernel (both deterministic: see docs/cuda.md)."""
    rows, cols = c.shape
    if rows == 0 or cols == 0:
        return
    cublas, _ = binding()
    if cublas is not None and (a.shape[0] if ta else a.shape[1]) > 0:
        if cublas_product(cublas, handle(cublas, cuda_tf32()), a, b, c, dtype, ta=ta, tb=tb,
                          accumulate=accumulate):
            counts["cublas"] += 1
            return
    numba_product(a, b, c, dtype, ta=ta, tb=tb, accumulate=accumulate)


class Prepared:
    """One product planned once and run many times, as a step loop runs its recurrent
    product: the path, the handle, the cuBLAS arguments (pointers included) are worked out
    at preparation, so that a step costs one binding call. ``prepared()`` runs it on ``a``.

    With ``steps``, a 3-D array whose step 0 ``a`` is (``a`` is ``steps[0]``, or its
    leading columns), ``prepared(t)`` runs it on step t's operand: on cuBLAS by moving a's
    pointer ``t`` strides of ``steps`` on (no slice of a device array per step, which costs
    Numba tens of microseconds), on the Numba kernel on ``steps[t][:, :a.shape[1]]``."""

    __slots__ = ("a", "b", "c", "dtype", "ta", "tb", "accumulate", "gemm", "arguments",
                 "where", "a_pointer", "steps", "step_bytes")

    def __init__(self, a, b, c, dtype: str, *, ta=False, tb=False, accumulate=False,
                 steps=None):
        self.a, self.b, self.c, self.dtype = a, b, c, dtype
        self.ta, self.tb, self.accumulate = bool(ta), bool(tb), bool(accumulate)
        self.steps = steps
        self.gemm = None
        if steps is not None:
            if len(steps.shape) != 3 or pointer(steps) != pointer(a) or \
                    tuple(a.strides) != tuple(steps.strides[1:]):
                raise ValueError("steps: expected the 3-D array whose step 0 is a")
            self.step_bytes = int(steps.strides[0])
        cublas, _ = binding()
        reduce_len = a.shape[0] if ta else a.shape[1]
        if cublas is not None and c.shape[0] and c.shape[1] and reduce_len > 0:
            found = cublas_arguments(cublas, handle(cublas, cuda_tf32()), a, b, c, dtype,
                                     self.ta, self.tb, self.accumulate)
            if found is not None:
                self.gemm, self.arguments, self.where = found
                self.a_pointer = self.arguments[self.where]

    def __call__(self, t=None) -> None:
        if self.gemm is None:
            a = self.a if t is None else self.steps[t][:, :self.a.shape[1]]
            product(a, self.b, self.c, self.dtype, ta=self.ta, tb=self.tb,
                    accumulate=self.accumulate)
            return
        self.arguments[self.where] = self.a_pointer if t is None else \
            self.a_pointer + t * self.step_bytes
        self.gemm(*self.arguments)
        counts["cublas"] += 1


def numba_product(a, b, c, dtype: str, *, ta=False, tb=False, accumulate=False) -> None:
    """``c (+)= op(a) @ op(b)`` by the Numba ``gemm`` kernel (any strides, any dtype)."""
    from . import _rnn_kernels
    tile = cuda_tile()
    kernel = _rnn_kernels.kernel("gemm", bool(ta), bool(tb), dtype, tile)
    grid, block = gemm_launch(c.shape[0], c.shape[1], tile)
    kernel[grid, block](a, b, c, bool(accumulate))
    counts["numba"] += 1
