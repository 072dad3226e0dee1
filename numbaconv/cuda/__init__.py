"""The ``cuda`` backend: Numba CUDA kernels (the ``cuda`` extra: ``numba-cuda[cu12]``, and
nvmath-python with cuBLAS for the recurrent ops' products).

Serves any array exposing ``__cuda_array_interface__`` (Numba device arrays, CuPy, PyTorch
CUDA tensors), with any strides, and returns Numba device arrays. float16 is stored as is and
accumulated in float32. Every reduction is deterministic (fixed splits, partials added in
order, no floating-point atomics; the recurrent ops' cuBLAS products are bitwise repeatable
on one GPU model and toolkit, docs/cuda.md); the GEMMs index in 32 bits where the operands
fit, else 64; no op copies to the host.

Importing this package imports neither Numba nor a kernel: creating the backend is free, and
``numba.cuda`` is imported by :meth:`CudaBackend.availability` and on the first run. Kernels
compile on first use of a (op, dtype, layout). Without a GPU the backend is unavailable,
except under Numba's simulator (``NUMBA_ENABLE_CUDASIM=1`` set before Numba is imported),
which the tests use.

Algorithms, per op (``numbaconv.explain`` says which one runs and why; docs/cuda.md gives
each kernel's performance model, read from its machine code):

``implicit_gemm``
    Any convolution, data gradient (by stride phases) or transposed convolution: a
    register-tiled matrix product of the weights, packed once per call, and of windows
    gathered on the fly (no im2col in memory). The weight gradient is the same product
    reduced over (image, position) in chunks fixed by the shape. With
    ``NUMBACONV_CUDA_TF32=1`` the float32 products run on TF32 tensor cores (sm_80+).
``depthwise``
    One channel per group and per output channel: per-channel gathers for the forward and
    data gradient, per-channel sums by chunks for the weight gradient.
``direct``
    One thread per output element, for other grouped convolutions with few channels per
    group, where GEMM tiles would be mostly empty.
``reduce``
    The bias gradient (two passes).
``fused`` (rnn_forward, rnn_backward_data, rnn_backward_weights)
    Matrix products (cuBLAS where it loads, else a tiled Numba GEMM) for the input
    projections of all steps, each step's recurrent product, the input gradient and the
    weight gradients (over all T*N rows), and one fused kernel per step for the gates and
    the state update (or their derivatives), writing the reserve layout every backend
    shares. RNN tanh/relu, LSTM (with projection) and GRU,
    any number of layers, both directions, sequence lengths, dropout between layers in
    training (masks drawn on the host by the frontend, as for cpu), batch_first (device
    arrays transposed on the device by the frontend).
``persistent`` (rnn_forward, rnn_backward_data)
    All steps of a layer and direction in one cooperative launch: each block computes
    tiles of the recurrent product in shared memory and the cells they feed, one grid-wide
    barrier a step (one more with proj_size: the projection is a second product; one more
    where a layer has few tiles and a step's product is split along its reduction), no
    launch a step. Offered
    beside ``fused`` but not chosen yet: it has not been timed on a GPU
    (docs/benchmarks/gpu_rnn_algorithms.py times both).
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
from typing import Optional

from ..backend import DIRECT_MAX_CHANNELS_PER_GROUP, OP_MODULES, Backend, run_op
from ..problem import RNN_OPS


#: The newest numba-cuda known to compile nothing under NumPy 2.5, which removed
#: ``np.row_stack`` (numba-cuda's array support overloads it when its target loads).
NUMBA_CUDA_WITHOUT_NUMPY_2_5 = (0, 30, 4)


def _numpy_problem(numpy_module=None, numba_cuda_version=None) -> Optional[str]:
    """Why no kernel would compile with this NumPy and numba-cuda, or None."""
    import numpy
    numpy_module = numpy if numpy_module is None else numpy_module
    if hasattr(numpy_module, "row_stack"):
        return None
    if numba_cuda_version is None:
        from importlib.metadata import version
        numba_cuda_version = version("numba-cuda")
    parts = tuple(int(p) for p in numba_cuda_version.split(".")[:3] if p.isdigit())
    if parts > NUMBA_CUDA_WITHOUT_NUMPY_2_5:
        return None
    return (f"numba-cuda {numba_cuda_version} compiles no kernel with NumPy "
            f"{numpy_module.__version__} (it uses np.row_stack, which NumPy 2.5 removed): "
            f"install numpy<2.5 or a newer numba-cuda")


def _tf32(problem) -> str:
    """What ``explain`` says of a float32 GEMM's arithmetic (not of the setting now: the
    dispatcher caches its choices, and the setting is read at each call)."""
    if problem.dtype != "float32":
        return ""
    return ("; FFMA, or TF32 tensor cores where NUMBACONV_CUDA_TF32=1 (compute capability "
            "8.0 and later)")


def _channels_summed(op, problem) -> int:
    """Channels each output element sums over (per group)."""
    if op == "conv":
        return problem.in_channels // problem.groups
    return problem.out_channels // problem.groups


class CudaBackend(Backend):
    """Numba CUDA kernels for the convolution ops (float16/32/64, both layouts) and the
    recurrent ops (every RNN feature)."""

    name = "cuda"
    device = "cuda"
    priority = 100
    version = "1"
    ops = frozenset(OP_MODULES)
    dtypes = ("float16", "float32", "float64")
    # No supports() override: every RNN feature is implemented (proj_size, dropout between
    # layers, batch_first), so only Backend's generic checks (op, dtype) can decline.

    def availability(self) -> Optional[str]:
        # Cheap checks only, importing nothing: numbaconv.backends() calls this, and must not
        # import numba.cuda or touch a GPU. A driver without a usable device surfaces when a
        # kernel first runs; device arrays cannot exist without one anyway.
        if importlib.util.find_spec("numba_cuda") is None:
            return ("numba-cuda is not installed (pip install 'numbaconv[cuda]', which "
                    "brings numba-cuda[cu12])")
        if os.environ.get("NUMBA_ENABLE_CUDASIM", "0").strip() not in ("", "0"):
            return None
        if ctypes.util.find_library("cuda") is None and not os.path.exists("/dev/nvidiactl"):
            return ("no CUDA driver found (libcuda); NUMBA_ENABLE_CUDASIM=1 runs the kernels "
                    "in Numba's simulator")
        return _numpy_problem()

    def algorithms(self, op, problem):
        if op in RNN_OPS:
            if op != "rnn_backward_weights":
                return ("fused", "persistent")
            return ("fused",)
        if op == "conv_backward_bias":
            return ("reduce",)
        from . import _depthwise
        if op == "conv_backward_weight":
            if _depthwise.weight_applies(problem):
                return ("depthwise", "implicit_gemm")
            return ("implicit_gemm",)
        if _depthwise.applies(problem):
            return ("depthwise", "direct", "implicit_gemm")
        if problem.groups > 1 and \
                _channels_summed(op, problem) <= DIRECT_MAX_CHANNELS_PER_GROUP:
            return ("direct", "implicit_gemm")
        return ("implicit_gemm", "direct")

    def choose(self, op, problem):
        if op in RNN_OPS:
            return "fused", ("the only algorithm: matrix products (cuBLAS or a tiled Numba "
                             "GEMM, both deterministic) and one fused gate kernel per step")
        if op == "conv_backward_bias":
            return "reduce", "the only algorithm (two passes, partials added in order)"
        first = self.algorithms(op, problem)[0]
        if first == "depthwise":
            return "depthwise", ("depthwise (one channel per group and per output channel): "
                                 "per-channel kernels, no GEMM tile to fill")
        if op == "conv_backward_weight":
            return "implicit_gemm", ("register-tiled product over fixed chunks of images and "
                                     "positions, partials added in order" + _tf32(problem))
        if first == "direct":
            return "direct", (f"grouped with {_channels_summed(op, problem)} channels per "
                              f"group: GEMM tiles would be mostly empty")
        return "implicit_gemm", ("general case: register-tiled GEMM of the packed weights "
                                 "and of windows gathered on the fly" + _tf32(problem))

    def precompile(self, problems, processes: int = 0) -> list:
        """Compile ahead, into Numba's disk cache and in ``processes`` processes at once (0:
        one per CPU, at most 16), the ``implicit_gemm`` kernels that the convolution
        ``problems`` would run (the slow ones to compile: docs/cuda.md gives the times).
        Returns what was compiled."""
        from . import _implicit_gemm
        chosen = [p for p in problems if p.op in OP_MODULES and p.op not in RNN_OPS
                  and self.choose(p.op, p)[0] == "implicit_gemm"]
        return _implicit_gemm.precompile(chosen, processes)

    def product_path(self) -> str:
        """How the recurrent ops' matrix products run (cuBLAS through which binding, or the
        Numba kernel, and why), for ``numbaconv info``; loads nothing before the first
        product."""
        from ._blas import describe
        return describe()

    def swap_time_batch(self, a):
        """``(T, N, F) <-> (N, T, F)`` of a device array as a new C-contiguous device array
        (one copy kernel): how ``numbaconv.rnn`` applies ``batch_first`` to device arrays."""
        from .rnn_forward import swap_time_batch
        return swap_time_batch(a)

    def zeros(self, shape, dtype):
        """A new device array of zeros, filled on the device (one kernel, no host copy):
        how ``numbaconv.rnn`` makes the states a caller leaves out."""
        from ._layout import device_array
        from ._rnn_elementwise import apply
        a = device_array(shape, dtype)
        apply("zero", a)
        return a

    def put(self, a, start, values):
        """``a[start:start + len(values)] = values`` on the device for a 1-D device array
        and a few small integers (one kernel, no host copy, so nothing waits for the
        device): how ``numbaconv.rnn`` writes a reserve's header."""
        from ._rnn_elementwise import put
        put(a, start, values)

    def run(self, op, problem, operands, out, algorithm):
        return run_op(__name__, op, problem, operands, out, algorithm)


def make_backend() -> CudaBackend:
    """Entry point of the built-in ``cuda`` backend."""
    return CudaBackend()
