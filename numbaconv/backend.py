"""The backend protocol: what a numbaconv backend is, for built-in and third-party ones alike.

A backend is any object with the attributes and methods of :class:`Backend` (subclassing it is
optional but gives sensible defaults). It is registered by a distribution's entry point in the
group ``numbaconv.backends``; the entry point names a zero-argument callable returning the
backend object::

    [project.entry-points."numbaconv.backends"]
    mybackend = "mypackage.backend:make_backend"

Creating the backend object must be cheap and must not compile kernels, import heavy
libraries or touch a GPU: numbaconv creates every registered backend on first dispatch to read
its ``name``, ``device`` and ``priority``. Put expensive checks in :meth:`Backend.availability`
(called once, only when the backend is a candidate) and expensive imports in :meth:`Backend.run`.

Selection, for each call: backends whose ``device`` matches the arrays', that are available,
in the order of ``use_backend``/``NUMBACONV_BACKEND`` if set, else by descending ``priority``;
the first whose :meth:`Backend.supports` returns ``None`` runs the call with the algorithm from
:meth:`Backend.choose` (or the fastest of :meth:`Backend.algorithms` under autotuning).

Operands handed to :meth:`Backend.run`, by op (``problem`` is a
:class:`numbaconv.problem.ConvProblem` or, for ``conv_backward_bias``, a
:class:`numbaconv.problem.BiasProblem`):

==========================  ===========================  =====================================
op                          operands                     result shape
==========================  ===========================  =====================================
``conv``                    ``(x, w, bias or None)``     ``problem.y_shape``
``conv_backward_data``      ``(dy, w)``                  ``problem.x_shape``
``conv_backward_weight``    ``(x, dy)``                  ``problem.w_shape``
``conv_backward_bias``      ``(dy,)``                    ``(problem.channels,)``
``conv_transpose``          ``(x, w, bias or None)``     ``problem.x_shape`` (x has y_shape)
==========================  ===========================  =====================================

The recurrent ops get a :class:`numbaconv.problem.RNNProblem` (time-major arrays, missing
states as zeros; its docstring lists their operands) and return ``(y, hy, cy)``,
``(dx, dhx, dcx)`` and the flat dparams. Their training forward fills the reserve laid out by
:class:`numbaconv.problem.RNNReserveLayout`, which every backend shares, so that a reserve
filled by one backend's forward can be differentiated by another's.

On the CPU every operand is a C-contiguous NumPy array of ``problem.dtype`` in the problem's
layout (possibly read-only, possibly sharing memory with another operand: never write to
operands), and ``out`` is ``None`` or a C-contiguous, writable array of the result shape and
dtype. CUDA backends get objects with ``__cuda_array_interface__`` as the user passed them
(any strides) and must handle them. ``run`` returns the result, of ``problem.dtype`` and,
without ``out``, C-contiguous in the problem's layout; when ``out`` is given it must
write into it and return it, adding to its contents when ``problem.accumulate`` is set.
Validation has already happened: a backend may assume consistent shapes and dtypes.
An exception raised by ``run`` propagates to the user with a note naming the backend, the
algorithm and the problem; no other backend is tried and ``out`` is then undefined (possibly
partly written): decline in :meth:`Backend.supports` what ``run`` cannot do.
Kernels should read padding from ``problem.frame_padding`` (what the windows actually read),
not from ``problem.padding``, whose ``after`` part only determined ``output_size``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np


class NoBackendError(RuntimeError):
    """No backend among the candidates supports the problem; the message says why each declined."""


@dataclass(frozen=True)
class Choice:
    """What the dispatcher picked for one call, and why the others were not picked."""

    backend: str
    algorithm: str
    reason: str
    rejected: dict = field(default_factory=dict)


class Backend:
    """Base class and reference documentation of the backend protocol.

    Attributes
    ----------
    name : str
        Unique backend name (the one users pass to ``use_backend``); must equal the entry
        point's name.
    device : str
        ``"cpu"`` (NumPy arrays) or ``"cuda"`` (``__cuda_array_interface__`` arrays).
    priority : int
        Higher runs first when several backends support a problem. Built-ins: ``cpu`` and
        ``cuda`` 100, ``reference`` 0. Third-party accelerators usually pick 50 to 200.
    version : str
        Part of the autotune cache key; bump it when algorithms change speed or meaning.
    ops : frozenset of str
        The ops this backend implements (see :data:`numbaconv.problem.OPS`).
    dtypes : tuple of str
        The dtypes it computes; the default :meth:`supports` declines the others.
    """

    name: str = "unnamed"
    device: str = "cpu"
    priority: int = 0
    version: str = "0"
    ops: frozenset = frozenset()
    dtypes: tuple = ("float32", "float64")

    def availability(self) -> Optional[str]:
        """``None`` if the backend can run here, else the reason it cannot (called once)."""
        return None

    def supports(self, op: str, problem) -> Optional[str]:
        """``None`` if this backend runs ``op`` on ``problem``, else a short reason why not."""
        if op not in self.ops:
            return f"op {op!r} not implemented"
        if problem.dtype not in self.dtypes:
            return f"dtype {problem.dtype} not supported ({', '.join(self.dtypes)})"
        return None

    def algorithms(self, op: str, problem) -> Sequence[str]:
        """Names of the algorithms that can run this problem (autotuning times each)."""
        return ("default",)

    def choose(self, op: str, problem) -> tuple[str, str]:
        """The heuristic's algorithm for this problem and a short reason for it."""
        algos = self.algorithms(op, problem)
        return algos[0], ("the only algorithm" if len(algos) == 1 else "the first listed")

    def start_threads(self) -> None:
        """Start what the backend's first parallel call would start (a threading layer,
        thread pools), so that a warm-up pays for it. Optional; the default does nothing."""

    def run(self, op: str, problem, operands: tuple, out, algorithm: str):
        """Compute ``op`` (see the module docstring for operands and ``out`` semantics)."""
        raise NotImplementedError


def store(result: np.ndarray, out: Optional[np.ndarray], accumulate: bool) -> np.ndarray:
    """Helper for CPU backends computing into a fresh array: honour ``out`` and accumulate."""
    if out is None:
        return result
    if accumulate:
        out += result
    else:
        out[...] = result
    return out


#: Where the built-in backends keep each op: the module (one per op, in the backend's
#: package) and its function, imported on the op's first run (:func:`run_op`).
OP_MODULES = {
    "conv": ("conv", "run"),
    "conv_backward_data": ("conv_backward_data", "run"),
    "conv_backward_weight": ("conv_backward_weight", "run"),
    "conv_backward_bias": ("conv_backward_bias", "run"),
    "conv_transpose": ("conv_backward_data", "run_transpose"),
    "rnn_forward": ("rnn_forward", "run"),
    "rnn_backward_data": ("rnn_backward_data", "run"),
    "rnn_backward_weights": ("rnn_backward_weights", "run"),
}

#: Channels per group up to which the built-in backends offer their ``direct`` algorithm
#: (and choose it for grouped problems): a GEMM over so few channels multiplies thin
#: matrices.
DIRECT_MAX_CHANNELS_PER_GROUP = 16


def run_op(package: str, op: str, problem, operands: tuple, out, algorithm: str):
    """Run ``op`` by the op module of the backend package ``package`` (a module name), as
    :data:`OP_MODULES` files it; the module is imported on first use."""
    module_name, function = OP_MODULES[op]
    module = kept_module(f"{package}.{module_name}")
    return getattr(module, function)(problem, operands, out, algorithm)


def kept_module(name: str):
    """The module ``name``, imported on first use and then kept: ``importlib.import_module``
    runs Python code on every call, several microseconds on the smallest calls (and
    ``sys.modules`` holds a module while another thread is still importing it)."""
    module = _kept.get(name)
    if module is None:
        module = _kept[name] = importlib.import_module(name)
    return module


_kept: dict = {}
