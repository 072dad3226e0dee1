"""numbaconv's GPU benchmark: the ``cuda`` backend against PyTorch (cuDNN), float32.

Used by ``numbaconv bench --device cuda``; docs/gpu-benchmark.md says how to run it and read
it. For each case of :data:`CASES` (ResNet 3x3 layers at stride 1 and 2, a 1x1 and a
depthwise 3x3, all N=32), each op of :data:`OPS` and each layout:

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

Under Numba's CUDA simulator (``sim``), the same path runs on :data:`SIM_CASES` (the same
kinds of layer, a few channels at 5x5 to 7x7), with PyTorch on the CPU as the oracle and one
wall-clock call per "timing", which only proves that the path runs: sim timings mean
nothing.

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

from .problem import _physical

#: The ops timed: the forward convolution and its data and weight gradients.
OPS = ("conv", "conv_backward_data", "conv_backward_weight")

LAYOUTS = ("channels_first", "channels_last")

#: Default bound of max |ours - torch| / max |torch|. The products here sum 9 to 2304 terms
#: in float32; different summation orders differ by about 1e-6 relative to the largest
#: output, so a real indexing bug stands out by orders of magnitude.
DEFAULT_TOLERANCE = 2e-4

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
)


def select_cases(*, sim: bool = False, quick: bool = False,
                 patterns: Sequence[str] = ()) -> tuple:
    """The cases to run: :data:`SIM_CASES` or :data:`CASES`, only the quick ones with
    ``quick``, only those whose name contains one of ``patterns`` (each may hold several,
    comma-separated) when any is given."""
    cases = SIM_CASES if sim else CASES
    if quick:
        cases = tuple(c for c in cases if c.quick)
    wanted = [p.strip() for text in patterns for p in text.split(",") if p.strip()]
    if wanted:
        cases = tuple(c for c in cases if any(p in c.name for p in wanted))
    return cases


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
                      conv_backward_weight=case.weight_shape)
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
        raise ValueError(f"op: expected one of {OPS}, got {op!r}")


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
    mask = [op == "conv_backward_data", op == "conv_backward_weight", False]
    grads = torch.ops.aten.convolution_backward(
        t["dy"], t["x"], t["w"], None, [case.stride] * 2, [case.padding] * 2, [1, 1], False,
        [0, 0], case.groups, mask)
    return grads[0] if mask[0] else grads[1]


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
    if sim:
        got = torch.from_numpy(ours.copy_to_host())
    else:
        got = torch.as_tensor(ours, device=reference.device)
    if tuple(got.shape) != tuple(reference.shape):
        return math.inf
    got, reference = got.double(), reference.double()
    scale = reference.abs().max().item()
    return (got - reference).abs().max().item() / (scale if scale > 0 else 1.0)


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
        if self.rel_err is not None and not math.isfinite(self.rel_err):
            record["rel_err"] = str(self.rel_err)  # "inf" (a shape mismatch) or "nan"
        return record


def run_rows(cases: Sequence[GpuCase], *, sim: bool, ops: Sequence[str] = OPS,
             layouts: Sequence[str] = LAYOUTS, tolerance: float = DEFAULT_TOLERANCE,
             timer: Optional[Timer] = None, tf32: bool = True,
             time_limit: Optional[float] = None,
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
        Seconds after the start past which no row starts: the rest are ``"skipped"``.
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
    started = time.perf_counter()
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
                new_rows = [GpuRow(case.name, layout, op, case.flops / 1e9,
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
        if op != "conv_backward_weight":  # compare in numbaconv's physical layout
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
        say(f"{what}: timing numbaconv")
        timing = timer.measure(lambda: ours(op, operands))
        row.timings["ours"], row.ours_ms = timing, timing["median_ms"]
        say(f"{what}: timing PyTorch (IEEE float32)")
        timing = timer.measure(lambda: torch_call(op, operands))
        row.timings["torch_ieee"], row.torch_ieee_ms = timing, timing["median_ms"]
        if tf32:
            say(f"{what}: timing PyTorch (TF32 allowed)")
            set_torch_fp32("tf32")
            timing = timer.measure(lambda: torch_call(op, operands))
            row.timings["torch_tf32"], row.torch_tf32_ms = timing, timing["median_ms"]
        row.status = "ok"
    except Exception as exc:
        row.status, row.detail = "error", _describe(exc)
    finally:
        set_torch_fp32("ieee")


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
                    "NUMBACONV_CUDA_TILE", "NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM",
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


def column_widths(cases: Sequence[GpuCase], layouts: Sequence[str],
                  ops: Sequence[str]) -> tuple:
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


def write_json(path: str, *, environment: dict, settings: dict, cases: Sequence[GpuCase],
               rows: Sequence[GpuRow], finished: bool) -> None:
    """Every row and the environment, as JSON; ``finished`` False while rows remain (the file
    is rewritten after each row, so a run cut short leaves what it measured)."""
    record = dict(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), suite="conv-cuda",
                  finished=finished, environment=environment, settings=settings,
                  cases=[c.as_dict() for c in cases], rows=[r.as_dict() for r in rows])
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, default=_json_default)
    os.replace(tmp, path)


def _json_default(value):
    return str(value)
