"""Arrays as the backends receive them, for the public functions of conv.py and rnn.py.

CPU backends get C-contiguous NumPy operands in native byte order (:func:`contiguous` copies
the others once) and an ``out`` they can write directly; :func:`run` routes a strided or
byte-swapped NumPy ``out`` through a contiguous scratch array and copies the result into it.
Device arrays pass through untouched: CUDA backends take any strides.
"""

from __future__ import annotations

import numpy as np

from . import dispatch


def contiguous(a):
    """``a`` as a C-contiguous NumPy array of native byte order (copied only when it is not);
    None and device arrays as they are."""
    if a is None or not isinstance(a, np.ndarray):
        return a
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    return np.ascontiguousarray(a)


def ready(a) -> bool:
    """Whether a NumPy array can be handed to a CPU backend as it is."""
    return a.flags.c_contiguous and a.dtype.isnative


def run(op, problem, operands, out=None):
    """``dispatch.run(op, problem, operands, out)``, with a NumPy ``out`` that is not
    :func:`ready` replaced by a contiguous scratch array (a copy of it when accumulating),
    whose result is then written into ``out``; returns ``out`` where one was given."""
    if not isinstance(out, np.ndarray) or ready(out):
        return dispatch.run(op, problem, operands, out)
    scratch = contiguous(out) if problem.accumulate else np.empty(out.shape, out.dtype.name)
    out[...] = dispatch.run(op, problem, operands, scratch)
    return out
