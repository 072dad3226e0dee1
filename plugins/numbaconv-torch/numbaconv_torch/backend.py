"""The ``torch`` backend object: the numbaconv backend protocol, without importing torch.

Everything here must stay cheap: numbaconv creates every registered backend on its first
dispatch to read ``name``, ``device`` and ``priority``, and calls :meth:`TorchBackend.supports`
while choosing a backend (also from :func:`numbaconv.explain`, which computes nothing). Only
:meth:`TorchBackend.run` imports torch, through :mod:`numbaconv_torch._aten`.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import numpy as np

from numbaconv.backend import Backend, store
from numbaconv.problem import CONV_OPS

from ._version import __version__

#: dtypes PyTorch's CPU convolutions compute natively (float16 would be a silent upcast or a
#: slow path, and numbaconv's CPU contract is float32/float64 anyway).
_DTYPES = ("float32", "float64")

_ALGORITHM = "aten"


class TorchBackend(Backend):
    """The five convolution ops on PyTorch's CPU kernels (ATen, oneDNN where it applies).

    Supports every convolution problem numbaconv can describe on the CPU in float32 and
    float64: 1, 2 or 3 spatial dims, stride, dilation, asymmetric padding, groups and
    depthwise, both layouts, bias, ``out=`` and ``accumulate=True``.

    Attributes
    ----------
    name : str
        ``"torch"``, the entry point's name.
    device : str
        ``"cpu"``: operands are NumPy arrays, handed to PyTorch without copies.
    priority : int
        10: preferred over ``reference`` (0), not over numbaconv's native ``cpu`` (100).
    version : str
        This distribution's version (part of the autotune cache key).
    ops : frozenset of str
        :data:`numbaconv.problem.CONV_OPS`.
    """

    name = "torch"
    device = "cpu"
    priority = 10
    version = __version__
    ops = frozenset(CONV_OPS)

    def availability(self) -> Optional[str]:
        """``None`` when torch can be imported, else why not (torch itself is not imported).

        ``find_spec`` only looks for the package on ``sys.path``; a torch that is present but
        broken fails on the first :meth:`run` with PyTorch's own error.
        """
        if importlib.util.find_spec("torch") is None:
            return ("PyTorch is not installed (it is not a dependency of numbaconv-torch; "
                    "install a CPU build, e.g. pip install torch==2.13.0)")
        return None

    def supports(self, op: str, problem) -> Optional[str]:
        """``None`` for every convolution op on a float32/float64 CPU problem."""
        if op not in self.ops:
            return f"op {op!r} not implemented"
        if problem.device != "cpu":
            return f"runs on the CPU, the problem is on {problem.device}"
        if problem.dtype not in _DTYPES:
            return f"dtype {problem.dtype} not supported ({', '.join(_DTYPES)})"
        return None

    def algorithms(self, op: str, problem) -> tuple:
        """One algorithm: PyTorch chooses its own kernel (oneDNN, im2col, ...) internally."""
        return (_ALGORITHM,)

    def choose(self, op: str, problem) -> tuple[str, str]:
        return _ALGORITHM, "the only algorithm (PyTorch picks its CPU kernel itself)"

    def run(self, op: str, problem, operands: tuple, out, algorithm: str):
        """Compute ``op`` with PyTorch; see :mod:`numbaconv.backend` for the operands.

        Returns
        -------
        numpy.ndarray
            ``out`` when given (written, or added to under ``problem.accumulate``), else a
            fresh C-contiguous array of ``problem.result_shape`` in the problem's layout and
            dtype.
        """
        if op not in self.ops:
            raise ValueError(f"op: expected one of {sorted(self.ops)}, got {op!r}")
        if algorithm != _ALGORITHM:
            raise ValueError(f"algorithm: expected {_ALGORITHM!r}, got {algorithm!r}")
        from . import _aten  # imports torch: deferred to the first call that computes

        result = _aten.OPS[op](problem, *operands).numpy()
        if out is None:
            # PyTorch may return a view (a crop, a channels-last permutation); the protocol
            # promises a C-contiguous array in the problem's layout.
            return np.ascontiguousarray(result)
        # store() copies or adds the (possibly strided) view straight into out: no extra copy.
        return store(result, out, problem.accumulate)


def make_backend() -> TorchBackend:
    """Entry point of the ``torch`` backend (``numbaconv.backends`` group)."""
    return TorchBackend()
