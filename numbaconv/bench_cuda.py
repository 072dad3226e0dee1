"""numbaconv's GPU benchmark: the ``cuda`` backend against PyTorch (cuDNN), float32.

Used by ``numbaconv bench --device cuda``; docs/gpu-benchmark.md says how to run it and read
it. For each case of :data:`CASES` (ResNet 3x3 layers at stride 1 and 2, a 1x1, a
depthwise 3x3 and a grouped 3x3, all N=32), each op of :data:`OPS` (or of :data:`ALL_OPS`,
which adds the bias gradient, as asked) and each layout:

1. numbaconv's result (public API under ``use_backend("cuda")``, Numba device arrays in and
   out, ``out=`` preallocated) is compared with PyTorch's in strict IEEE float32 (TF32 off):
   max |ours - torch| / max |torch| must not exceed the tolerance. A row that does not
   match is reported as failed and not timed.
2. numbaconv, PyTorch in IEEE float32 and PyTorch with TF32 allowed are timed with CUDA
   events on the legacy default stream (the stream Numba launches on, and PyTorch's default
   stream): ``warmup`` calls first (Numba compilation, cuDNN autotuning with
   ``torch.backends.cudnn.benchmark``), then the median of up to ``reps`` runs within
   ``budget`` seconds, each after a 256 MiB write that evicts the L2 cache. The host waits
   for each run before the next, so a run starts on an idle GPU; the events bracket
   everything the op does on the GPU timeline, including gaps while Python launches
   kernels.

Then, for each recurrent network of :data:`RNN_CASES` (an LSTM and a GRU at T=50, N=64,
I=H=512, a 2-layer bidirectional LSTM), one training step (:data:`RNN_OP`:
``rnn_forward(training=True)`` into a preallocated reserve, ``rnn_backward_data``,
``rnn_backward_weights(out=)``) is checked the same way against ``torch.nn.LSTM``/``GRU``
holding the same weights (y, dx and the weight gradients) and timed the same way against
PyTorch's forward and autograd backward (cuDNN): :func:`run_rnn_rows`.

Under Numba's CUDA simulator (``sim``), the same path runs on :data:`SIM_CASES` (the same
kinds of layer, a few channels at 5x5 to 7x7) and :data:`SIM_RNN_CASES` (T=3, N=2, I=4,
H=5), with PyTorch on the CPU as the oracle and one wall-clock call per "timing", which
only proves that the path runs: sim timings mean nothing.

This module imports only NumPy, Numba, PyTorch and numbaconv, and those lazily: importing it
touches no GPU. It uses numbaconv's public API only, never the kernels' internals.

Examples
--------
>>> from numbaconv import bench_cuda
>>> bench_cuda.enable_simulator()                      # doctest: +SKIP
>>> rows = bench_cuda.run_rows(bench_cuda.select_cases(sim=True, quick=True),
...                            sim=True)               # doctest: +SKIP
>>> rows[0].status                                     # doctest: +SKIP
'ok'
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .bench_cases import RNNCase
from .bench_torch import RNN_STEP_RESULTS, RNN_TOLERANCE, worst_error
from .problem import _physical

#: The ops timed: the forward convolution and its data and weight gradients.
OPS = ("conv", "conv_backward_data", "conv_backward_weight")
#: Every op ``--op`` may ask for: also the bias gradient (a reduction of dy; its "TFLOP/s"
#: count one add a dy element).
ALL_OPS = OPS + ("conv_backward_bias",)

#: The op of a recurrent row: one training step, rnn_forward(training=True) into a
#: preallocated reserve, rnn_backward_data, rnn_backward_weights(out=), as the CPU suite
#: (numbaconv.bench_rnn) times it; PyTorch's forward and autograd backward against it.
RNN_OP = "rnn_training_step"

#: The layout column of a recurrent row: sequences are (T, N, features).
RNN_LAYOUT = "time_major"

LAYOUTS = ("channels_first", "channels_last")

#: Default bound of max |ours - torch| / max |torch|. The products here sum 9 to 2304 terms
#: in float32; different summation orders differ by about 1e-6 relative to the largest
#: output, so a real indexing bug stands out by orders of magnitude.
DEFAULT_TOLERANCE = 2e-4

#: Both defaults when numbaconv's own float32 products run on TF32 tensor cores
#: (NUMBACONV_CUDA_TF32=1): operands rounded to 10 mantissa bits put errors of 1e-4 to 1e-3
#: on these sums (docs/cuda.md), still far below an indexing bug's.
TF32_TOLERANCE = 3e-3

#: Default bound of the recurrent rows' relative error, compared on y, dx and the weight
#: gradients: the CPU suite's (numbaconv.bench_torch.RNN_TOLERANCE, which says why 5e-4).
DEFAULT_RNN_TOLERANCE = RNN_TOLERANCE

DEFAULT_WARMUP = 3
DEFAULT_REPS = 25
QUICK_REPS = 10

#: Seconds of timed runs per measurement, after which no new run starts (once
#: :data:`MIN_RUNS` are done).
DEFAULT_BUDGET = 5.0
QUICK_BUDGET = 2.0
MIN_RUNS = 3

#: Bytes written between timed runs: several times the largest L2 of current GPUs (50 MiB
#: on an H100, 60 MiB on an H200), so each run starts with cold caches, as a layer in a
#: network does after its neighbours.
FLUSH_BYTES = 256 * 2**20

#: Threads per block and implicit-GEMM tile that ``--sim`` asks for (NUMBACONV_CUDA_THREADS
#: and NUMBACONV_CUDA_TILE, see numbaconv.config) unless they are set: the simulator runs
#: every thread of a block as a Python thread, so the defaults (256 threads, 16x16 tiles)
#: make even tiny problems take minutes.
SIM_CUDA_THREADS = "32"
SIM_CUDA_TILE = "4,8,4"


@dataclass(frozen=True)
class GpuCase:
    """A 2D convolution layer, square input and kernel, float32.

    Attributes
    ----------
    name : str
        Substring filters (``--case``) match it.
    batch, in_channels, out_channels, size, kernel : int
        N, C, K, H = W, R = S.
    stride, padding, groups : int
    quick : bool
        Part of the ``--quick`` subset.
    """

    name: str
    batch: int
    in_channels: int
    out_channels: int
    size: int
    kernel: int
    stride: int = 1
    padding: int = 0
    groups: int = 1
    quick: bool = False

    @property
    def output_size(self) -> int:
        """P = Q, the output's height and width."""
        return (self.size + 2 * self.padding - self.kernel) // self.stride + 1

    @property
    def weight_shape(self) -> tuple:
        """(K, C / groups, R, S), in both layouts."""
        return (self.out_channels, self.in_channels // self.groups, self.kernel, self.kernel)

    def input_shape(self, layout: str) -> tuple:
        """Physical shape of x and dx: (N, C, H, W) or, channels-last, (N, H, W, C)."""
        return _physical(self.batch, self.in_channels, (self.size, self.size), layout)

    def output_shape(self, layout: str) -> tuple:
        """Physical shape of y and dy: (N, K, P, Q) or, channels-last, (N, P, Q, K)."""
        return _physical(self.batch, self.out_channels, (self.output_size,) * 2, layout)

    @property
    def flops(self) -> int:
        """2 * N * K * (C / groups) * R * S * P * Q: the multiply-adds of each of the three
        ops, counted twice."""
        return (2 * self.batch * self.out_channels * (self.in_channels // self.groups)
                * self.kernel ** 2 * self.output_size ** 2)

    def op_flops(self, op: str) -> int:
        """:attr:`flops` for a convolution op; for the bias gradient one add a dy element."""
        if op == "conv_backward_bias":
            return self.batch * self.out_channels * self.output_size ** 2
        return self.flops

    def kwargs(self, layout: str) -> dict:
        return dict(stride=self.stride, padding=self.padding, groups=self.groups,
                    layout=layout)

    def as_dict(self) -> dict:
        record = dataclasses.asdict(self)
        record.update(output_size=self.output_size, weight_shape=list(self.weight_shape))
        return record


#: The layers timed on a GPU.
CASES = (
    GpuCase("resnet3x3_64c_56", 32, 64, 64, 56, 3, padding=1, quick=True),
    GpuCase("resnet3x3_256c_14", 32, 256, 256, 14, 3, padding=1),
    GpuCase("resnet3x3s2_64c_56", 32, 64, 64, 56, 3, stride=2, padding=1),
    GpuCase("resnet3x3s2_256c_14", 32, 256, 256, 14, 3, stride=2, padding=1),
    GpuCase("pointwise_64to256_56", 32, 64, 256, 56, 1, quick=True),
    GpuCase("depthwise3x3_128c_56", 32, 128, 128, 56, 3, padding=1, groups=128, quick=True),
    # ResNeXt's grouped 3x3 (32 groups of 4 channels): ``direct`` for the forward and data
    # gradient, ``implicit_gemm`` for the weight gradient.
    GpuCase("grouped3x3_128c_28", 32, 128, 128, 28, 3, padding=1, groups=32),
)

#: Their twins for the simulator: the same kernel sizes, strides, padding and groups, with
#: 2 to 8 channels at 4x4 to 7x7 (the simulator runs each GPU thread as a Python thread:
#: even these take a second or more per call).
SIM_CASES = (
    GpuCase("resnet3x3_4c_5", 2, 4, 4, 5, 3, padding=1, quick=True),
    GpuCase("resnet3x3_8c_4", 2, 8, 8, 4, 3, padding=1),
    GpuCase("resnet3x3s2_2c_5", 2, 2, 2, 5, 3, stride=2, padding=1),
    GpuCase("resnet3x3s2_8c_5", 2, 8, 8, 5, 3, stride=2, padding=1),
    GpuCase("pointwise_2to4_5", 2, 2, 4, 5, 1, quick=True),
    GpuCase("depthwise3x3_4c_5", 2, 4, 4, 5, 3, padding=1, groups=4, quick=True),
    GpuCase("grouped3x3_8c_5", 2, 8, 8, 5, 3, padding=1, groups=2),
)


#: The recurrent networks timed on a GPU, one training step each (:data:`RNN_OP`): the LSTM
#: and GRU of the CPU suite's target (numbaconv.bench_rnn.RNN_SHAPES, T=50, N=64,
#: I=H=512), and a 2-layer bidirectional LSTM at the size of that suite's bidirectional case.
RNN_CASES = (
    RNNCase("lstm_T50_N64_512", "lstm", 50, 64, 512, 512),
    RNNCase("gru_T50_N64_512", "gru", 50, 64, 512, 512),
    RNNCase("lstm_bi_L2_T50_N32_256", "lstm", 50, 32, 256, 256, num_layers=2,
            bidirectional=True),
)

#: Their twins for the simulator: the same networks at T=3, N=2, I=4, H=5 (a training step
#: of each takes a few seconds there).
SIM_RNN_CASES = (
    RNNCase("lstm_T3_N2_4_5", "lstm", 3, 2, 4, 5),
    RNNCase("gru_T3_N2_4_5", "gru", 3, 2, 4, 5),
    RNNCase("lstm_bi_L2_T3_N2_4_5", "lstm", 3, 2, 4, 5, num_layers=2, bidirectional=True),
)


def _matching(cases: tuple, patterns: Sequence[str]) -> tuple:
    """``cases`` whose name contains one of ``patterns`` (each may hold several,
    comma-separated), or all of them when none is given."""
    wanted = [p.strip() for text in patterns for p in text.split(",") if p.strip()]
    if wanted:
        cases = tuple(c for c in cases if any(p in c.name for p in wanted))
    return cases


def select_cases(*, sim: bool = False, quick: bool = False,
                 patterns: Sequence[str] = ()) -> tuple:
    """The cases to run: :data:`SIM_CASES` or :data:`CASES`, only the quick ones with
    ``quick``, only those whose name contains one of ``patterns`` (each may hold several,
    comma-separated) when any is given."""
    cases = SIM_CASES if sim else CASES
    if quick:
        cases = tuple(c for c in cases if c.quick)
    return _matching(cases, patterns)


def select_rnn_cases(*, sim: bool = False, quick: bool = False,
                     patterns: Sequence[str] = ()) -> tuple:
    """The recurrent cases to run: :data:`SIM_RNN_CASES` or :data:`RNN_CASES`, only the first
    (the LSTM of the target) with ``quick``, filtered by ``patterns`` as in
    :func:`select_cases`."""
    cases = SIM_RNN_CASES if sim else RNN_CASES
    return _matching(cases[:1] if quick else cases, patterns)


# --- the simulator -------------------------------------------------------------------------

def simulator_requested() -> bool:
    """Whether NUMBA_ENABLE_CUDASIM is set to something other than 0."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0").strip() not in ("", "0")


def enable_simulator() -> None:
    """Switch Numba's CUDA simulator on (NUMBA_ENABLE_CUDASIM=1) and ask for small blocks
    (:data:`SIM_CUDA_THREADS`, :data:`SIM_CUDA_TILE`) unless they are set.

    Must run before ``numba.cuda`` is imported; raises RuntimeError if it already was
    without the simulator. Numba itself may already be loaded: its configuration is read
    again.
    """
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    os.environ.setdefault("NUMBACONV_CUDA_THREADS", SIM_CUDA_THREADS)
    os.environ.setdefault("NUMBACONV_CUDA_TILE", SIM_CUDA_TILE)
    if "numba" not in sys.modules:
        return
    import numba
    if not numba.config.ENABLE_CUDASIM:
        if any(name == "numba.cuda" or name.startswith("numba.cuda.") for name in sys.modules):
            raise RuntimeError("the CUDA simulator must be switched on before numba.cuda is "
                               "imported: set NUMBA_ENABLE_CUDASIM=1 before starting Python")
        numba.core.config.reload_config()


# --- the backend ---------------------------------------------------------------------------

#: The entry point pyproject.toml declares for the built-in ``cuda`` backend.
CUDA_ENTRY_POINT = "numbaconv.cuda:make_backend"


def ensure_cuda_backend() -> Optional[str]:
    """Register the built-in ``cuda`` backend in this process if no entry point provides it,
    as when the source tree is run with ``PYTHONPATH=.`` without being installed (entry
    points come from an installed distribution's metadata). Returns a note saying so, or
    None when it was registered already. Nothing is imported until the backend is used."""
    import importlib

    import numbaconv
    if any(b.name == "cuda" for b in numbaconv.backends()):
        return None
    module, _, attribute = CUDA_ENTRY_POINT.partition(":")

    def make_backend():
        return getattr(importlib.import_module(module), attribute)()

    numbaconv.register_backend("cuda", make_backend)
    return (f"no 'cuda' entry point (numbaconv is not installed): registered "
            f"{CUDA_ENTRY_POINT} in this process")


# --- operands and the two implementations --------------------------------------------------

class Operands:
    """One case in one layout: PyTorch's tensors and numbaconv's arrays of the same values.

    PyTorch gets x, w and dy in the layout's memory format (``torch.channels_last`` for
    channels-last, weights included, as a model converted with ``.to(memory_format=...)``
    holds them). numbaconv gets Numba device arrays: x and dy physically (N, H, W, C) for
    channels-last, sharing the tensors' memory on a GPU (``__cuda_array_interface__``),
    copies made with ``numba.cuda.to_device`` in the simulator; w is (K, C/groups, R, S)
    and contiguous in both layouts (numbaconv's weight layout does not change with
    ``layout``). Each op writes into its own preallocated ``out``, so no allocation is timed.
    """

    def __init__(self, case: GpuCase, layout: str, *, sim: bool, seed: int = 0):
        import torch
        from numba import cuda

        self.case, self.layout, self.sim = case, layout, sim
        device = "cpu" if sim else "cuda"
        gen = torch.Generator(device="cpu").manual_seed(seed)
        n, c, k, h, p = (case.batch, case.in_channels, case.out_channels, case.size,
                         case.output_size)
        fan_in = case.weight_shape[1] * case.kernel ** 2
        logical = dict(x=torch.randn(n, c, h, h, generator=gen),
                       w=torch.randn(*case.weight_shape, generator=gen) / math.sqrt(fan_in),
                       dy=torch.randn(n, k, p, p, generator=gen))
        memory_format = (torch.channels_last if layout == "channels_last"
                         else torch.contiguous_format)
        #: x, w, dy for PyTorch (logical NCHW shapes, the layout's memory format).
        self.tensors = {name: t.to(device).contiguous(memory_format=memory_format)
                        for name, t in logical.items()}
        # What numbaconv reads: physical views (NHWC for channels-last) and a plain weight.
        self._keep = dict(x=self.physical(self.tensors["x"]),
                          dy=self.physical(self.tensors["dy"]),
                          w=self.tensors["w"].contiguous())
        if sim:
            self.arrays = {name: cuda.to_device(t.numpy()) for name, t in self._keep.items()}
        else:
            self.arrays = {name: cuda.as_cuda_array(t) for name, t in self._keep.items()}
        shapes = dict(conv=case.output_shape(layout),
                      conv_backward_data=case.input_shape(layout),
                      conv_backward_weight=case.weight_shape,
                      conv_backward_bias=(case.out_channels,))
        self.out = {op: cuda.device_array(shape, dtype="float32")
                    for op, shape in shapes.items()}

    def physical(self, t):
        """``t`` (logical NCHW) as numbaconv's layout has it: NHWC for channels-last."""
        return t.permute(0, 2, 3, 1) if self.layout == "channels_last" else t

    def arguments(self, op: str) -> tuple:
        """``(args, kwargs)`` of numbaconv's ``op`` on these operands, ``out=`` included."""
        a, case = self.arrays, self.case
        kwargs = dict(case.kwargs(self.layout), out=self.out[op])
        if op == "conv":
            return (a["x"], a["w"]), kwargs
        if op == "conv_backward_data":
            return (a["dy"], a["w"], case.input_shape(self.layout)), kwargs
        if op == "conv_backward_weight":
            return (a["x"], a["dy"], case.weight_shape), kwargs
        if op == "conv_backward_bias":
            return (a["dy"],), dict(layout=self.layout, out=self.out[op])
        raise ValueError(f"op: expected one of {ALL_OPS}, got {op!r}")


def numbaconv_call(op: str, operands: Operands):
    """numbaconv's ``op`` on ``operands`` through the public API: the default ``ours`` of
    :func:`run_rows`. Returns the result (``operands.out[op]``, a Numba device array)."""
    import numbaconv
    args, kwargs = operands.arguments(op)
    return getattr(numbaconv, op)(*args, **kwargs)


def torch_call(op: str, operands: Operands):
    """PyTorch's ``op`` on ``operands.tensors``: ``conv2d`` for the forward;
    ``aten.convolution_backward`` for the gradients, which is what autograd and
    ``torch.nn.grad.conv2d_input``/``conv2d_weight`` call. It is given the real x and w
    rather than those helpers' ``expand()``-ed placeholders, so cuDNN sees the memory
    format a channels-last model has, and only the gradient asked for is computed."""
    import torch
    t, case = operands.tensors, operands.case
    if op == "conv":
        return torch.nn.functional.conv2d(t["x"], t["w"], None, case.stride, case.padding, 1,
                                          case.groups)
    mask = [op == "conv_backward_data", op == "conv_backward_weight",
            op == "conv_backward_bias"]
    grads = torch.ops.aten.convolution_backward(
        t["dy"], t["x"], t["w"], [case.out_channels] if mask[2] else None,
        [case.stride] * 2, [case.padding] * 2, [1, 1], False, [0, 0], case.groups, mask)
    return grads[mask.index(True)]


def explain_call(op: str, operands: Operands) -> str:
    """``backend/algorithm`` numbaconv's dispatcher picks (informative only)."""
    import numbaconv
    args, kwargs = operands.arguments(op)
    choice = numbaconv.explain(op, *args, **kwargs)
    return f"{choice.backend}/{choice.algorithm}"


def set_torch_fp32(mode: str) -> None:
    """PyTorch's float32 precision for cuDNN convolutions and RNNs and cuBLAS matmuls:
    ``"ieee"`` (strict float32: ``allow_tf32 = False`` in the legacy flags) or ``"tf32"``.

    Through the ``fp32_precision`` settings where PyTorch has them (2.9 and later, which
    refuse a mix of those and the legacy ``allow_tf32`` flags), else the legacy flags.
    """
    import torch
    cudnn = torch.backends.cudnn
    if hasattr(cudnn, "conv") and hasattr(cudnn.conv, "fp32_precision"):
        cudnn.conv.fp32_precision = mode
        cudnn.rnn.fp32_precision = mode
        torch.backends.cuda.matmul.fp32_precision = mode
    else:
        cudnn.allow_tf32 = mode == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"


def relative_error(ours, reference, *, sim: bool) -> float:
    """max |ours - reference| / max |reference| in float64 (inf on a shape mismatch).

    ``ours`` is a device array (copied to the host in the simulator, wrapped without a copy
    by PyTorch on a GPU), ``reference`` a tensor of the same physical shape.
    """
    import torch

    from .bench_torch import relative_error as tensor_relative_error
    if sim:
        got = torch.from_numpy(ours.copy_to_host())
    else:
        got = torch.as_tensor(ours, device=reference.device)
    return tensor_relative_error(got, reference)


# --- timing --------------------------------------------------------------------------------

class Timer:
    """Median time in milliseconds of a call: CUDA events, or one wall-clock call in the
    simulator.

    Parameters
    ----------
    sim : bool
        One call, timed by the host clock (the number means nothing).
    warmup, reps : int
        Untimed calls first; timed runs at most.
    budget : float
        Seconds after which no new timed run starts, once :data:`MIN_RUNS` are done.
    flush : bool
        Write :data:`FLUSH_BYTES` before each timed run, outside the events.
    """

    def __init__(self, *, sim: bool, warmup: int = DEFAULT_WARMUP, reps: int = DEFAULT_REPS,
                 budget: float = DEFAULT_BUDGET, flush: bool = True):
        self.sim, self.warmup, self.reps, self.budget = sim, warmup, reps, budget
        self._flush = None
        if flush and not sim:
            import torch
            self._flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")

    def measure(self, fn: Callable[[], object]) -> dict:
        """``{"median_ms", "min_ms", "runs"}`` of ``fn()``."""
        if self.sim:
            start = time.perf_counter()
            fn()
            ms = (time.perf_counter() - start) * 1e3
            return dict(median_ms=ms, min_ms=ms, runs=1)
        import torch
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        started = time.perf_counter()
        while len(times) < self.reps:
            if self._flush is not None:
                self._flush.zero_()  # on the stream before the start event: not timed
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()  # an idle GPU for the next run, and an honest budget
            times.append(start.elapsed_time(end))
            if len(times) >= MIN_RUNS and time.perf_counter() - started > self.budget:
                break
        return dict(median_ms=statistics.median(times), min_ms=min(times), runs=len(times))


# --- rows ----------------------------------------------------------------------------------

@dataclass
class GpuRow:
    """One case, layout and op: the check and, when it passed, the three timings.

    ``status`` is ``"ok"`` (matched PyTorch and timed), ``"FAIL"`` (did not match: not
    timed), ``"error"`` (an exception, in ``detail``) or ``"skipped"`` (the time limit was
    reached before the row started). Times are median milliseconds; ``*_tflops`` count
    :attr:`GpuCase.flops`; ``torch_ieee_over_ours`` and ``torch_tf32_over_ours`` are
    PyTorch's time over numbaconv's (above 1: numbaconv is faster).
    """

    case: str
    layout: str
    op: str
    gflop: float
    status: str = "pending"
    rel_err: Optional[float] = None
    tolerance: Optional[float] = None
    algorithm: Optional[str] = None
    detail: str = ""
    ours_ms: Optional[float] = None
    torch_ieee_ms: Optional[float] = None
    torch_tf32_ms: Optional[float] = None
    timings: dict = dataclasses.field(default_factory=dict)
    #: Recurrent rows: the relative error of each result compared (y, dx, dparams);
    #: ``rel_err`` is the largest.
    errors: dict = dataclasses.field(default_factory=dict)

    def _tflops(self, ms):
        return None if not ms else self.gflop / ms  # GFLOP per ms = TFLOP/s

    @property
    def ours_tflops(self):
        return self._tflops(self.ours_ms)

    @property
    def torch_ieee_tflops(self):
        return self._tflops(self.torch_ieee_ms)

    @property
    def torch_tf32_tflops(self):
        return self._tflops(self.torch_tf32_ms)

    @property
    def torch_ieee_over_ours(self):
        return None if not (self.ours_ms and self.torch_ieee_ms) else (
            self.torch_ieee_ms / self.ours_ms)

    @property
    def torch_tf32_over_ours(self):
        return None if not (self.ours_ms and self.torch_tf32_ms) else (
            self.torch_tf32_ms / self.ours_ms)

    def as_dict(self) -> dict:
        record = dataclasses.asdict(self)
        for name in ("ours_tflops", "torch_ieee_tflops", "torch_tf32_tflops",
                     "torch_ieee_over_ours", "torch_tf32_over_ours"):
            record[name] = getattr(self, name)

        def finite(value):  # inf (a shape mismatch) and nan as text: JSON has neither
            return value if value is None or math.isfinite(value) else str(value)

        record["rel_err"] = finite(self.rel_err)
        record["errors"] = {name: finite(value) for name, value in self.errors.items()}
        return record


def run_rows(cases: Sequence[GpuCase], *, sim: bool, ops: Sequence[str] = OPS,
             layouts: Sequence[str] = LAYOUTS, tolerance: float = DEFAULT_TOLERANCE,
             timer: Optional[Timer] = None, tf32: bool = True,
             time_limit: Optional[float] = None, started: Optional[float] = None,
             ours: Callable[[str, Operands], object] = numbaconv_call,
             report: Optional[Callable[[GpuRow], None]] = None,
             progress: Optional[Callable[[str], None]] = None) -> list:
    """Check, then time, every case x layout x op; one :class:`GpuRow` each, in that order.

    Parameters
    ----------
    cases : sequence of GpuCase
    sim : bool
        Under Numba's CUDA simulator (PyTorch on the CPU), else on the GPU.
    ops, layouts : sequence of str
    tolerance : float
        Bound of the relative error (max abs error / max abs reference).
    timer : Timer, optional
        Default: ``Timer(sim=sim)``.
    tf32 : bool
        Also time PyTorch with TF32 allowed.
    time_limit : float, optional
        Seconds after ``started`` past which no row starts: the rest are ``"skipped"``.
    started : float, optional
        ``time.perf_counter()`` when the run began (default: now), so that one time limit
        covers this call and :func:`run_rnn_rows` after it.
    ours : callable, optional
        ``ours(op, operands)`` runs the implementation under test and returns its result, a
        device array of the physical shape; default :func:`numbaconv_call`. Tests hand in a
        wrong one to see the mismatch reported and left untimed.
    report : callable, optional
        Called with each row when it is finished.
    progress : callable, optional
        Called with a line of text before each step (for stderr).

    Returns
    -------
    list of GpuRow
        A failing case or op is recorded in its rows; nothing raises past this function
        except KeyboardInterrupt.
    """
    import numbaconv

    timer = timer if timer is not None else Timer(sim=sim)
    started = time.perf_counter() if started is None else started
    total = len(cases) * len(layouts) * len(ops)
    rows = []

    def say(text):
        if progress is not None:
            progress(f"[{len(rows) + 1}/{total} {time.perf_counter() - started:.0f} s] {text}")

    def finish(row):
        rows.append(row)
        if report is not None:
            report(row)

    def out_of_time():
        return time_limit is not None and time.perf_counter() - started > time_limit

    set_torch_fp32("ieee")
    with numbaconv.use_backend("cuda"), warnings.catch_warnings():
        # Numba's "grid size N will likely result in GPU under-utilization" on the small
        # launches of some algorithms: one per kernel, and the rows say how fast it is.
        warnings.filterwarnings("ignore", message=".*under-utilization.*")
        for case in cases:
            for layout in layouts:
                new_rows = [GpuRow(case.name, layout, op, case.op_flops(op) / 1e9,
                                   tolerance=tolerance) for op in ops]
                if out_of_time():
                    for row in new_rows:
                        row.status, row.detail = "skipped", f"time limit {time_limit:g} s"
                        finish(row)
                    continue
                operands = None
                try:
                    say(f"{case.name} {layout}: preparing operands")
                    operands = Operands(case, layout, sim=sim)
                except Exception as exc:
                    for row in new_rows:
                        row.status, row.detail = "error", f"operands: {_describe(exc)}"
                        finish(row)
                else:
                    for row in new_rows:
                        if out_of_time():
                            row.status, row.detail = "skipped", f"time limit {time_limit:g} s"
                        else:
                            _check_and_time(row, operands, sim=sim, timer=timer, tf32=tf32,
                                            ours=ours, say=say)
                        finish(row)
                finally:
                    del operands
                    set_torch_fp32("ieee")
                    if not sim:
                        _release_gpu_memory()
    return rows


def _check_and_time(row: GpuRow, operands: Operands, *, sim, timer, tf32, ours, say):
    import torch
    op, what = row.op, f"{row.case} {row.layout} {row.op}"
    try:
        row.algorithm = explain_call(op, operands)
    except Exception as exc:  # informative only; the call below reports real trouble
        row.algorithm = f"? ({_describe(exc, 60)})"
    try:
        say(f"{what}: checking against PyTorch (IEEE float32)")
        set_torch_fp32("ieee")
        reference = torch_call(op, operands)
        if op in ("conv", "conv_backward_data"):  # compare in numbaconv's physical layout
            reference = operands.physical(reference)
        got = ours(op, operands)
        if not sim:
            torch.cuda.synchronize()
        row.rel_err = relative_error(got, reference, sim=sim)
        del got, reference
        if not row.rel_err <= row.tolerance:  # NaN fails too
            row.status = "FAIL"
            row.detail = (f"relative error {row.rel_err:.2e} above the tolerance "
                          f"{row.tolerance:g}: not timed")
            return
        _time_checked_row(row, timer, what, say, lambda: ours(op, operands),
                          lambda: torch_call(op, operands), tf32)
    except Exception as exc:
        row.status, row.detail = "error", _describe(exc)
    finally:
        set_torch_fp32("ieee")


def _time_checked_row(row, timer, what, say, ours_call, torch_call, tf32):
    """Time a row that passed its check: numbaconv, PyTorch in IEEE float32, and with
    ``tf32`` PyTorch with TF32 allowed (left set: the caller restores IEEE); then "ok"."""
    say(f"{what}: timing numbaconv")
    timing = timer.measure(ours_call)
    row.timings["ours"], row.ours_ms = timing, timing["median_ms"]
    say(f"{what}: timing PyTorch (IEEE float32)")
    timing = timer.measure(torch_call)
    row.timings["torch_ieee"], row.torch_ieee_ms = timing, timing["median_ms"]
    if tf32:
        say(f"{what}: timing PyTorch (TF32 allowed)")
        set_torch_fp32("tf32")
        timing = timer.measure(torch_call)
        row.timings["torch_tf32"], row.torch_tf32_ms = timing, timing["median_ms"]
    row.status = "ok"


def _release_gpu_memory():
    try:
        import gc

        import torch
        gc.collect()  # the operands' Numba arrays free their memory when collected
        torch.cuda.empty_cache()
    except Exception:
        pass


def _describe(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --- recurrent networks --------------------------------------------------------------------

class RNNOperands:
    """One recurrent case: PyTorch's module and tensors, numbaconv's arrays of the same values.

    The weights are numbaconv's ``rnn_init_params`` (uniform +-1/sqrt(H), as PyTorch
    initialises them), copied into ``torch.nn.LSTM``/``GRU`` through
    ``numbaconv.rnn_param_views`` (:func:`numbaconv.bench_torch.load_rnn_params`); x and dy
    are standard normal, (T, N, features). numbaconv gets Numba device arrays: x and dy
    sharing PyTorch's memory on a GPU (``__cuda_array_interface__``), copies under the
    simulator; the flat parameters a copy on the device; the reserve and the weight gradient
    preallocated (``rnn_reserve_size``, ``out=``), as a training loop holds them. Initial
    states are zeros on both sides (``hx=None``), and no gradient flows into hy or cy.
    """

    def __init__(self, case: RNNCase, *, sim: bool, seed: int = 0):
        import numpy as np
        import torch
        from numba import cuda

        import numbaconv

        from .bench_torch import load_rnn_params, torch_rnn_module
        self.case, self.sim = case, sim
        self.config = cfg = case.config()
        device = "cpu" if sim else "cuda"
        gen = torch.Generator(device="cpu").manual_seed(seed)
        x = torch.randn(case.seq_len, case.batch, case.input_size, generator=gen)
        dy = torch.randn(case.seq_len, case.batch, cfg.num_directions * cfg.out_size,
                         generator=gen)
        params = numbaconv.rnn_init_params(cfg, seed=seed, dtype=np.float32)
        #: PyTorch's network, with numbaconv's weights; x (a leaf that wants its gradient)
        #: and dy.
        self.module = torch_rnn_module(case, torch).to(device)
        load_rnn_params(self.module, cfg, params)
        self.x = x.to(device).requires_grad_(True)
        self.dy = dy.to(device)
        if sim:
            self.arrays = dict(x=cuda.to_device(self.x.detach().numpy()),
                               dy=cuda.to_device(self.dy.numpy()))
        else:
            self.arrays = dict(x=cuda.as_cuda_array(self.x.detach()),
                               dy=cuda.as_cuda_array(self.dy))
        self.arrays["params"] = cuda.to_device(params)
        self.reserve = cuda.device_array(
            numbaconv.rnn_reserve_size(cfg, case.seq_len, case.batch), dtype="float32")
        self.dparams = cuda.device_array(cfg.num_params, dtype="float32")


def numbaconv_rnn_step(operands: RNNOperands) -> dict:
    """numbaconv's training step on ``operands`` through the public API (the default ``ours``
    of :func:`run_rnn_rows`): ``{"y", "dx", "dparams"}``, Numba device arrays."""
    import numbaconv
    cfg, a = operands.config, operands.arrays
    y, _, _, reserve = numbaconv.rnn_forward(cfg, a["x"], a["params"], training=True,
                                             reserve=operands.reserve)
    dx, _, _ = numbaconv.rnn_backward_data(cfg, y, a["dy"], a["params"], reserve)
    dparams = numbaconv.rnn_backward_weights(cfg, a["x"], a["params"], reserve,
                                             out=operands.dparams)
    return dict(y=y, dx=dx, dparams=dparams)


def torch_rnn_step(operands: RNNOperands):
    """PyTorch's training step on ``operands``
    (:func:`numbaconv.bench_torch.torch_rnn_training_step`: forward, cuDNN keeping its
    reserve for the backward, and autograd's backward into fresh gradients). Returns y."""
    from .bench_torch import torch_rnn_training_step
    return torch_rnn_training_step(operands.module, operands.x, operands.dy)


def torch_rnn_results(operands: RNNOperands) -> dict:
    """PyTorch's ``{"y", "dx", "dparams"}`` (the weight gradients in numbaconv's flat
    order), the reference of the check."""
    from . import bench_torch
    return bench_torch.torch_rnn_results(operands.module, operands.config, operands.x,
                                         operands.dy)


def explain_rnn(operands: RNNOperands) -> str:
    """``backend/algorithm`` numbaconv's dispatcher picks for the training forward
    (informative only)."""
    import numbaconv
    a = operands.arrays
    choice = numbaconv.explain("rnn_forward", operands.config, a["x"], a["params"],
                               training=True, reserve=operands.reserve)
    return f"{choice.backend}/{choice.algorithm}"


def product_path() -> str:
    """How the ``cuda`` backend's recurrent ops run their matrix products (cuBLAS through
    which binding, or the Numba gemm kernel, and why): the line ``numbaconv info`` prints,
    from the backend's ``product_path()``; once a product ran, the path in use. Never
    raises."""
    from . import dispatch
    try:
        describe = getattr(dispatch.get_backend("cuda"), "product_path", None)
        return describe() if describe is not None else "not reported by this cuda backend"
    except Exception as exc:
        return f"unknown ({_describe(exc, 80)})"


def run_rnn_rows(cases: Sequence[RNNCase], *, sim: bool,
                 tolerance: float = DEFAULT_RNN_TOLERANCE, timer: Optional[Timer] = None,
                 tf32: bool = True, time_limit: Optional[float] = None,
                 started: Optional[float] = None,
                 ours: Callable[[RNNOperands], dict] = numbaconv_rnn_step,
                 report: Optional[Callable[[GpuRow], None]] = None,
                 progress: Optional[Callable[[str], None]] = None) -> list:
    """Check, then time, a training step of each recurrent case: one :class:`GpuRow` each
    (layout :data:`RNN_LAYOUT`, op :data:`RNN_OP`), in order.

    The check compares y, dx and the weight gradients with PyTorch's in IEEE float32; the
    row's ``rel_err`` is the largest of the three (each in ``errors``) and must not exceed
    ``tolerance``, else the row fails and is not timed. Then numbaconv's step, PyTorch's in
    IEEE float32 and, with ``tf32``, PyTorch's with TF32 allowed for cuDNN and cuBLAS, as
    :func:`run_rows` times the convolutions. ``algorithm`` holds the dispatcher's choice and
    the product path (:func:`product_path`).

    Parameters are those of :func:`run_rows`, except ``ours(operands)``, which runs the
    training step under test and returns ``{"y", "dx", "dparams"}`` (device arrays); default
    :func:`numbaconv_rnn_step`. Nothing raises past this function except KeyboardInterrupt.
    """
    import numbaconv

    timer = timer if timer is not None else Timer(sim=sim)
    started = time.perf_counter() if started is None else started
    rows = []

    def say(text):
        if progress is not None:
            progress(f"[rnn {len(rows) + 1}/{len(cases)} {time.perf_counter() - started:.0f} "
                     f"s] {text}")

    set_torch_fp32("ieee")
    with numbaconv.use_backend("cuda"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*under-utilization.*")
        for case in cases:
            row = GpuRow(case.name, RNN_LAYOUT, RNN_OP, case.flops() / 1e9,
                         tolerance=tolerance)
            if time_limit is not None and time.perf_counter() - started > time_limit:
                row.status, row.detail = "skipped", f"time limit {time_limit:g} s"
            else:
                operands = None
                try:
                    say(f"{case.name}: preparing operands")
                    operands = RNNOperands(case, sim=sim)
                except Exception as exc:
                    row.status, row.detail = "error", f"operands: {_describe(exc)}"
                else:
                    _check_and_time_rnn(row, operands, sim=sim, timer=timer, tf32=tf32,
                                        ours=ours, say=say)
                finally:
                    del operands
                    set_torch_fp32("ieee")
                    if not sim:
                        _release_gpu_memory()
            rows.append(row)
            if report is not None:
                report(row)
    return rows


def _check_and_time_rnn(row: GpuRow, operands: RNNOperands, *, sim, timer, tf32, ours, say):
    import torch
    what = f"{row.case} {row.op}"
    try:
        row.algorithm = explain_rnn(operands)
    except Exception as exc:  # informative only; the call below reports real trouble
        row.algorithm = f"? ({_describe(exc, 60)})"
    try:
        say(f"{what}: checking y, dx and the weight gradients against PyTorch (IEEE "
            f"float32)")
        set_torch_fp32("ieee")
        reference = torch_rnn_results(operands)
        got = ours(operands)
        if not sim:
            torch.cuda.synchronize()
        row.algorithm += f"; products: {product_path()}"
        row.errors = {name: relative_error(got[name], reference[name], sim=sim)
                      for name in RNN_STEP_RESULTS}
        worst = worst_error(row.errors, row.tolerance)
        row.rel_err = row.errors[worst]
        del got, reference
        if not row.rel_err <= row.tolerance:  # NaN fails too
            row.status = "FAIL"
            row.detail = (f"relative error {row.rel_err:.2e} ({worst}) above the tolerance "
                          f"{row.tolerance:g}: not timed")
            return
        _time_checked_row(row, timer, what, say, lambda: ours(operands),
                          lambda: torch_rnn_step(operands), tf32)
    except Exception as exc:
        row.status, row.detail = "error", _describe(exc)
    finally:
        set_torch_fp32("ieee")


# --- environment and output ----------------------------------------------------------------

def environment(*, sim: bool) -> dict:
    """Versions and the device: what a result depends on. Never raises; what cannot be read
    is None."""
    import numpy as np

    from . import __version__
    info = dict(numbaconv=__version__, python=platform.python_version(),
                platform=platform.platform(), numpy=np.__version__, simulator=sim,
                numba=_try(lambda: __import__("numba").__version__),
                numba_cuda=_distribution_version("numba-cuda"),
                env={name: os.environ.get(name) for name in (
                    "NUMBACONV_BACKEND", "NUMBACONV_AUTOTUNE", "NUMBACONV_CUDA_THREADS",
                    "NUMBACONV_CUDA_TILE", "NUMBACONV_CUDA_CUBLAS", "NUMBACONV_CUDA_TF32",
                    "NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM",
                    "CUDA_VISIBLE_DEVICES")})
    try:
        import torch
        info.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    except Exception:
        info.update(torch=None, torch_cuda=None)
    if sim:
        info.update(device="Numba CUDA simulator (no GPU; times mean nothing)")
        return info
    import torch
    props = _try(lambda: torch.cuda.get_device_properties(torch.cuda.current_device()))
    info.update(
        device=_try(lambda: props.name),
        compute_capability=_try(lambda: f"{props.major}.{props.minor}"),
        multiprocessors=_try(lambda: props.multi_processor_count),
        memory_gib=_try(lambda: round(props.total_memory / 2**30, 1)),
        cudnn=_try(lambda: torch.backends.cudnn.version()),
        nvidia_driver=_try(_nvidia_driver_version),
        cuda_driver_api=_try(_numba_driver_version),
        stream=_try(lambda: torch.cuda.current_stream().cuda_stream),
    )
    return info


def _numba_driver_version():
    from numba.cuda.cudadrv import driver
    return ".".join(str(v) for v in driver.driver.get_version())


def _nvidia_driver_version():
    with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
        first = f.readline()
    words = [w for w in first.split() if w[:1].isdigit() and "." in w]
    return words[0] if words else first.strip()


def _distribution_version(name):
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _try(fn):
    try:
        return fn()
    except Exception:
        return None


def legacy_stream_problem() -> Optional[str]:
    """Why CUDA events on PyTorch's current stream would not bracket numbaconv's kernels,
    or None: Numba launches on the legacy default stream (handle 0) unless
    NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM is set, and PyTorch's default stream is that
    stream too."""
    import torch
    if os.environ.get("NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM", "0").strip() not in ("", "0"):
        return ("NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM is set: Numba launches on the "
                "per-thread default stream, which the events do not bracket")
    handle = torch.cuda.current_stream().cuda_stream
    if handle != 0:
        return (f"PyTorch's current stream is {handle:#x}, not the legacy default stream "
                f"Numba launches on")
    return None


def column_widths(cases: Sequence, layouts: Sequence[str], ops: Sequence[str]) -> tuple:
    """Widths of the table's columns for these cases (conv and recurrent alike: their
    names), layouts and ops."""
    return (max([4] + [len(c.name) for c in cases]), max(len(x) for x in layouts),
            max(len(o) for o in ops), 8, 8, 9, 10, 9, 10, 9, 8)


HEADERS = ("case", "layout", "op", "status", "rel err", "ours ms", "torch ieee", "ieee/ours",
           "torch tf32", "tf32/ours", "TFLOP/s", "algorithm")


def format_line(values: Sequence[object], widths: Sequence[int]) -> str:
    """Columns 0-2 left-aligned, the numbers right-aligned, the last column as it is."""
    cells = []
    for i, value in enumerate(values):
        text = str(value)
        if i >= len(widths):
            cells.append(text)
        else:
            cells.append(text.ljust(widths[i]) if i < 3 else text.rjust(widths[i]))
    return "  ".join(cells).rstrip()


def format_header(widths: Sequence[int]) -> list:
    return [format_line(HEADERS, widths),
            format_line(["-" * w for w in widths] + ["-" * 9], widths)]


def format_row(row: GpuRow, widths: Sequence[int]) -> str:
    def num(value, spec):
        return "-" if value is None else format(value, spec)

    line = format_line((row.case, row.layout, row.op, row.status, num(row.rel_err, ".1e"),
                        num(row.ours_ms, ".3f"), num(row.torch_ieee_ms, ".3f"),
                        num(row.torch_ieee_over_ours, ".2f"), num(row.torch_tf32_ms, ".3f"),
                        num(row.torch_tf32_over_ours, ".2f"), num(row.ours_tflops, ".2f"),
                        row.algorithm or ""), widths)
    return line + (f"  {row.detail}" if row.detail else "")


def summary_lines(rows: Sequence[GpuRow]) -> list:
    """Counts per status, the geometric means of the ratios, and the rows not ``ok``."""
    counts = {s: sum(r.status == s for r in rows) for s in ("ok", "FAIL", "error", "skipped")}
    lines = [f"{counts['ok']} of {len(rows)} rows checked and timed; {counts['FAIL']} "
             f"mismatched PyTorch (not timed), {counts['error']} errors, "
             f"{counts['skipped']} skipped (time limit)"]
    for key, label in (("torch_ieee_over_ours", "torch ieee / ours"),
                       ("torch_tf32_over_ours", "torch tf32 / ours")):
        for op in dict.fromkeys(r.op for r in rows):
            values = [getattr(r, key) for r in rows if r.op == op and getattr(r, key)]
            if values:
                mean = math.exp(sum(math.log(v) for v in values) / len(values))
                lines.append(f"geometric mean of {label}, {op}: {mean:.2f} "
                             f"({len(values)} rows)")
    return lines


def rnn_case_dict(case: RNNCase) -> dict:
    """A recurrent case for the JSON record: its fields and the GFLOP of a training step."""
    return dict(dataclasses.asdict(case), gflop=case.flops() / 1e9)


def write_json(path: str, *, environment: dict, settings: dict, cases: Sequence[GpuCase],
               rows: Sequence[GpuRow], finished: bool,
               rnn_cases: Sequence[RNNCase] = ()) -> None:
    """Every row and the environment, as JSON; ``finished`` False while rows remain (the file
    is rewritten after each row, so a run cut short leaves what it measured). The record's
    ``suite`` stays ``"conv-cuda"`` (what docs/benchmarks/render.py recognises) with
    recurrent rows among ``rows`` and their cases in ``rnn_cases``."""
    record = dict(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), suite="conv-cuda",
                  finished=finished, environment=environment, settings=settings,
                  cases=[c.as_dict() for c in cases],
                  rnn_cases=[rnn_case_dict(c) for c in rnn_cases],
                  rows=[r.as_dict() for r in rows])
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, default=_json_default)
    os.replace(tmp, path)


def _json_default(value):
    return str(value)
