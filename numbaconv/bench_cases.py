"""What :mod:`numbaconv.bench` measures: the standard shapes and their groups, one op on one
shape as a :class:`Call`, and one timed line of the table as a :class:`Row`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from . import dispatch
from . import problem as pb
from .conv import (conv, conv_backward_bias, conv_backward_data, conv_backward_weight,
                   conv_transpose)
from .problem import CONV_OPS
from .testing import ConvCase, case_arrays


#: Label of PyTorch called directly (not through a numbaconv backend) in tables and JSON. It
#: is deliberately not "torch", which is the name of a numbaconv plugin backend.
PYTORCH = "pytorch"

#: The groups of :data:`SHAPES`, in the order the summary lists them.
GROUPS = ("resnet3x3", "pointwise", "depthwise", "stem", "conv1d", "conv3d", "small")

#: The targets per group (issue 29): the geometric mean, over the group's shapes and both
#: layouts, of PyTorch's time over numbaconv's, for each op of :data:`TARGET_OPS`. None
#: would mean a group measured and summarised without a target.
GROUP_TARGETS = {"resnet3x3": 1.0, "pointwise": 1.0, "depthwise": 1.5, "stem": 1.0,
                 "conv1d": 1.0, "conv3d": 1.0, "small": None}

#: The ops the targets apply to (the data and weight gradients).
TARGET_OPS = ("conv_backward_data", "conv_backward_weight")

#: Groups whose ops are bound by memory, not arithmetic: each of their rows is also read as
#: a fraction of the copy bandwidth (:func:`traffic_bytes`, ``Row.copy_fraction``).
MEMORY_BOUND_GROUPS = ("depthwise",)


@dataclass(frozen=True)
class BenchCase(ConvCase):
    """A benchmark shape: a :class:`~numbaconv.testing.ConvCase` and its summary group.

    Attributes
    ----------
    group : str
        One of :data:`GROUPS` for the standard shapes; rows of a shape are summarised
        (:func:`summarize`) with the other shapes of its group.
    """

    group: str = "other"


def group_of(case: ConvCase) -> str:
    """The summary group of ``case`` (``"other"`` for a plain ConvCase)."""
    return getattr(case, "group", "other")


#: Layers of common CNNs at a realistic batch size (channels-first logical shapes), grouped
#: as the issue's targets are. ``output_padding=1`` on the stride-2 shapes makes their
#: transposed convolutions map the output back to the input's size (28 to 56, 112 to 224).
SHAPES = (
    BenchCase("resnet3x3_64c_56", (8, 64, 56, 56), (64, 64, 3, 3), padding=1,
              group="resnet3x3"),
    BenchCase("resnet3x3_128c_28", (8, 128, 28, 28), (128, 128, 3, 3), padding=1,
              group="resnet3x3"),
    BenchCase("resnet3x3_256c_14", (8, 256, 14, 14), (256, 256, 3, 3), padding=1,
              group="resnet3x3"),
    BenchCase("resnet3x3_512c_7", (8, 512, 7, 7), (512, 512, 3, 3), padding=1,
              group="resnet3x3"),
    BenchCase("resnet3x3s2_128c_56", (8, 128, 56, 56), (128, 128, 3, 3), stride=2,
              padding=1, output_padding=1, group="resnet3x3"),
    BenchCase("resnet3x3s2_256c_28", (8, 256, 28, 28), (256, 256, 3, 3), stride=2,
              padding=1, output_padding=1, group="resnet3x3"),
    BenchCase("pointwise_64to256_56", (8, 64, 56, 56), (256, 64, 1, 1), group="pointwise"),
    BenchCase("pointwise_1024to256_14", (8, 1024, 14, 14), (256, 1024, 1, 1),
              group="pointwise"),
    BenchCase("depthwise3x3_128c_56", (8, 128, 56, 56), (128, 1, 3, 3), padding=1,
              groups=128, group="depthwise"),
    BenchCase("depthwise3x3_512c_14", (8, 512, 14, 14), (512, 1, 3, 3), padding=1,
              groups=512, group="depthwise"),
    BenchCase("depthwise3x3_256c_28", (8, 256, 28, 28), (256, 1, 3, 3), padding=1,
              groups=256, group="depthwise"),
    BenchCase("depthwise5x5s2_96c_112", (8, 96, 112, 112), (96, 1, 5, 5), stride=2,
              padding=2, output_padding=1, groups=96, group="depthwise"),
    BenchCase("stem7x7s2_3c_224", (8, 3, 224, 224), (64, 3, 7, 7), stride=2, padding=3,
              output_padding=1, group="stem"),
    # Sequence models (audio, text): a kernel-5 layer and a stride-2 downsampling one.
    BenchCase("conv1d_k5_128c_1024", (8, 128, 1024), (128, 128, 5), padding=2,
              group="conv1d"),
    BenchCase("conv1d_k3s2_256c_512", (8, 256, 512), (256, 256, 3), stride=2, padding=1,
              output_padding=1, group="conv1d"),
    # Video and volumetric models (C3D, 3D U-Net): 3x3x3, plain and stride 2.
    BenchCase("conv3d_3x3x3_64c_8x28", (2, 64, 8, 28, 28), (64, 64, 3, 3, 3), padding=1,
              group="conv3d"),
    BenchCase("conv3d_3x3x3s2_32c_16x56", (2, 32, 16, 56, 56), (32, 32, 3, 3, 3), stride=2,
              padding=1, output_padding=1, group="conv3d"),
    # Small networks, as users who train in plain NumPy often do: CIFAR-10's ResNet-20 (16,
    # 32 and 64 channels at 32x32, 16x16, 8x8, a stride-2 transition) and an MNIST CNN's
    # second layer, at their training batch sizes.
    BenchCase("cifar_resnet_16c_32", (128, 16, 32, 32), (16, 16, 3, 3), padding=1,
              group="small"),
    BenchCase("cifar_resnet_32c_16", (128, 32, 16, 16), (32, 32, 3, 3), padding=1,
              group="small"),
    BenchCase("cifar_resnet_64c_8", (128, 64, 8, 8), (64, 64, 3, 3), padding=1,
              group="small"),
    BenchCase("cifar_resnet_s2_16to32_32", (128, 16, 32, 32), (32, 16, 3, 3), stride=2,
              padding=1, output_padding=1, group="small"),
    BenchCase("mnist_16to32_14", (64, 16, 14, 14), (32, 16, 3, 3), padding=1,
              group="small"),
)

#: The same kinds of layer shrunk so that every op on every backend, the slow reference
#: included, finishes in milliseconds; two in the ResNet group, so that its summary is a
#: mean over shapes.
QUICK_SHAPES = (
    BenchCase("resnet3x3_16c_14", (2, 16, 14, 14), (16, 16, 3, 3), padding=1,
              group="resnet3x3"),
    BenchCase("resnet3x3s2_16c_14", (2, 16, 14, 14), (16, 16, 3, 3), stride=2, padding=1,
              output_padding=1, group="resnet3x3"),
    BenchCase("pointwise_16to64_14", (2, 16, 14, 14), (64, 16, 1, 1), group="pointwise"),
    BenchCase("depthwise3x3_32c_14", (2, 32, 14, 14), (32, 1, 3, 3), padding=1, groups=32,
              group="depthwise"),
    BenchCase("stem7x7s2_3c_32", (2, 3, 32, 32), (16, 3, 7, 7), stride=2, padding=3,
              output_padding=1, group="stem"),
    BenchCase("conv1d_k5_16c_64", (2, 16, 64), (16, 16, 5), padding=2, group="conv1d"),
    BenchCase("conv3d_3x3x3_8c_6x8", (2, 8, 6, 8, 8), (8, 8, 3, 3, 3), padding=1,
              group="conv3d"),
    BenchCase("small_16to32_8", (4, 16, 8, 8), (32, 16, 3, 3), padding=1, group="small"),
)


@dataclass(frozen=True)
class RNNCase:
    """One recurrent benchmark shape: a network (mode, sizes, layers, directions) and T, N.

    Shared by the CPU suite (:mod:`numbaconv.bench_rnn`: ``RNN_SHAPES``, ``QUICK_RNN_SHAPES``)
    and the GPU benchmark (:mod:`numbaconv.bench_cuda`: ``RNN_CASES``, ``SIM_RNN_CASES``).
    """

    name: str
    mode: str
    seq_len: int
    batch: int
    input_size: int
    hidden_size: int
    num_layers: int = 1
    bidirectional: bool = False
    proj_size: int = 0

    def config(self):
        """The :class:`numbaconv.RNNConfig` of the network."""
        from .problem import RNNConfig
        return RNNConfig(self.mode, self.input_size, self.hidden_size,
                         num_layers=self.num_layers, bidirectional=self.bidirectional,
                         proj_size=self.proj_size)

    def flops(self) -> int:
        """Matrix-product flops of a training step: 3x the forward's."""
        from .problem import RNNProblem
        return 3 * RNNProblem("rnn_forward", self.config(), self.seq_len, self.batch).flops


#: The problem whose public call is timed against the backend's ``run`` to measure what
#: validation and dispatch add: small enough that the arithmetic is negligible.
TINY = ConvCase("tiny", (1, 2, 6, 6), (2, 2, 3, 3), padding=1)

#: Shapes on which the plain-NumPy reference is too slow to time by default.
BIG_SHAPE_NAMES = frozenset(c.name for c in SHAPES)

#: Seconds between measuring two engines, for their idle thread pools to stop spinning (seen
#: here: about 0.1 s for NumPy's OpenBLAS, 0.25 s for PyTorch's OpenMP; see
#: :func:`run_benchmarks`).
DEFAULT_SETTLE = 0.3

#: Environment variables that change what a benchmark measures; ``environment`` reports them.
ENV_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
            "OPENBLAS_THREAD_TIMEOUT", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER", "NUMBA_OPT",
            "OMP_WAIT_POLICY", "NUMBACONV_BACKEND", "NUMBACONV_AUTOTUNE",
            "NUMBACONV_JIT_CACHE", "NUMBACONV_FASTMATH", "NUMBACONV_OMP_PASSIVE")


# --- problems and calls ------------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    """One op on one case, ready to run through the public API or a backend directly.

    Attributes
    ----------
    op : str
    case : ConvCase
    layout : str
    problem : ConvProblem or BiasProblem
        What validation makes of the public call's arguments.
    public : callable
        The numbaconv public function for ``op``.
    args : tuple
    kwargs : dict
        ``public(*args, **kwargs)`` is the user's call.
    operands : tuple
        What the backend's ``run`` receives for this op (see :mod:`numbaconv.backend`).
    """

    op: str
    case: ConvCase
    layout: str
    problem: object
    public: Callable
    args: tuple
    kwargs: dict
    operands: tuple

    def __call__(self):
        """Run the public call (validation, dispatch, backend)."""
        return self.public(*self.args, **self.kwargs)


def make_call(op: str, case: ConvCase, layout: str = "channels_first",
              dtype: str = "float32", arrays: Optional[dict] = None, seed: int = 0) -> Call:
    """Build the public call of ``op`` on ``case``, and its validated problem and operands.

    Parameters
    ----------
    op : str
        One of :data:`numbaconv.problem.CONV_OPS`.
    case : ConvCase
    layout : str
    dtype : str
    arrays : dict, optional
        :func:`numbaconv.testing.case_arrays` of this case, layout and dtype (reused across
        ops to save memory and time); made here if omitted.
    seed : int
        Seed of the random arrays when they are made here.

    Returns
    -------
    Call
    """
    a = arrays if arrays is not None else case_arrays(case, layout, dtype, seed)
    kw = dict(case.kwargs, layout=layout)
    if op == "conv":
        public, builder = conv, pb.conv_problem
        args = operands = (a["x"], a["w"], a["bias"])
    elif op == "conv_backward_data":
        public, builder = conv_backward_data, pb.conv_backward_data_problem
        args, operands = (a["dy"], a["w"], a["x"].shape), (a["dy"], a["w"])
    elif op == "conv_backward_weight":
        public, builder = conv_backward_weight, pb.conv_backward_weight_problem
        args, operands = (a["x"], a["dy"], a["w"].shape), (a["x"], a["dy"])
    elif op == "conv_backward_bias":
        public, builder = conv_backward_bias, pb.conv_backward_bias_problem
        args = operands = (a["dy"],)
        kw = dict(layout=layout)
    elif op == "conv_transpose":
        public, builder = conv_transpose, pb.conv_transpose_problem
        args = operands = (a["xt"], a["w"], a["bias_t"])
        kw["output_padding"] = case.output_padding
    else:
        raise ValueError(f"op: expected one of {CONV_OPS}, got {op!r}")
    # The problem builders take exactly the public functions' arguments.
    return Call(op, case, layout, builder(*args, **kw), public, args, kw, operands)


def flops(call: Call) -> int:
    """Floating-point operations of the call's main contraction (``problem.flops``)."""
    return int(call.problem.flops)


def traffic_bytes(call: Call) -> int:
    """Bytes the call must move at the least: its operands read once and its result written
    once (the floor of a memory-bound op)."""
    result = call.problem.result_shape
    itemsize = np.dtype(call.problem.dtype).itemsize
    return (sum(a.nbytes for a in call.operands if a is not None)
            + int(np.prod(result, dtype=np.int64)) * itemsize)


def cpu_backends(include_reference: bool = True) -> list:
    """Names of the available CPU backends, by descending priority (discovered, never assumed).

    Parameters
    ----------
    include_reference : bool
        Whether to list the plain-NumPy ``reference`` backend.

    Returns
    -------
    list of str
    """
    return [b.name for b in dispatch.backends() if b.available and b.device == "cpu"
            and (include_reference or b.name != "reference")]


def supports(backend: str, call: Call) -> Optional[str]:
    """``None`` if ``backend`` can run ``call`` here, else why it cannot."""
    info = next((b for b in dispatch.backends() if b.name == backend), None)
    if info is None:
        return f"no backend called {backend!r} is registered"
    if not info.available:
        return f"not available: {info.reason}"
    obj = dispatch.get_backend(backend)
    if obj.device != call.problem.device:
        return f"runs on {obj.device}, the arrays are on {call.problem.device}"
    try:
        return obj.supports(call.op, call.problem)
    except Exception as exc:  # a plugin's bug must not end the whole benchmark run
        return f"supports() raised {type(exc).__name__}: {exc}"


# --- one line of the table ---------------------------------------------------------------

@dataclass
class Row:
    """One line of the benchmark table.

    Attributes
    ----------
    shape, op, backend : str
        ``backend`` is a numbaconv backend name or :data:`PYTORCH`.
    layout, dtype : str
    status : str
        ``"ok"``, ``"skipped"`` (with the reason in ``detail``) or ``"error"``.
    median_s, best_s : float or None
        Per-call times in seconds.
    gflops : float or None
        ``flops / median_s / 1e9``.
    vs_pytorch : float or None
        PyTorch's median time over this row's: above 1 means this row is faster.
    detail : str
    group : str
        The shape's summary group (:func:`group_of`).
    peak_fraction : float or None
        ``gflops`` over the GEMM peak measured in the same run (:func:`gemm_peak`), when
        one was given to :func:`run_benchmarks`.
    pytorch_s : float or None
        PyTorch's median time on the same op, shape and layout (the baseline of
        ``vs_pytorch``), on the backends' rows.
    traffic_bytes : int or None
        On the rows of :data:`MEMORY_BOUND_GROUPS` (when the run measured copies):
        :func:`traffic_bytes`.
    copy_fraction : float or None
        On those rows: the time of a parallel copy that moves as many bytes (half read,
        half written; :func:`numbaconv.bench_machine.copy_seconds`, measured in the same
        run) over ``median_s``: the fraction of the copy bandwidth the row reaches.
    """

    shape: str
    op: str
    backend: str
    layout: str
    dtype: str
    status: str
    median_s: Optional[float] = None
    best_s: Optional[float] = None
    gflops: Optional[float] = None
    vs_pytorch: Optional[float] = None
    detail: str = ""
    group: str = "other"
    peak_fraction: Optional[float] = None
    pytorch_s: Optional[float] = None
    traffic_bytes: Optional[int] = None
    copy_fraction: Optional[float] = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)
