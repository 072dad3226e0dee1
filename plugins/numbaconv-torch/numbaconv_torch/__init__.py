"""numbaconv-torch: a numbaconv backend that runs the convolution ops on PyTorch's CPU kernels.

It registers itself through the ``numbaconv.backends`` entry-point group as ``"torch"``
(device ``"cpu"``, priority 10: above the ``reference`` backend, below numbaconv's native
``cpu`` backend). Importing this package, and creating the backend, does not import torch:
numbaconv creates every registered backend on its first dispatch, and importing torch costs
seconds. torch is imported on the first :meth:`TorchBackend.run`.

It is also meant as a worked example for plugin authors: see ``backend.py`` for the protocol
side (names, availability, supports, algorithms, out/accumulate) and ``_aten.py`` for the
translation of a :class:`numbaconv.problem.ConvProblem` into PyTorch calls.
"""

from ._version import __version__
from .backend import TorchBackend, make_backend

__all__ = ["TorchBackend", "make_backend", "__version__"]
