"""The demos' check of a whole model's backward pass against finite differences."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


def directional_gradient_error(loss: Callable[[], float], params: Sequence[np.ndarray],
                               grads: Sequence[np.ndarray], rng: np.random.Generator,
                               h: float = 1e-6) -> float:
    """Worst relative disagreement of ``grads`` with central differences of ``loss``.

    For each parameter array ``p`` (float64, perturbed in place and restored), the analytic
    directional derivative ``<grad, v>`` along a random direction ``v`` is compared with
    ``(loss(p + h v) - loss(p - h v)) / 2h``. One direction per array tests every entry of
    its gradient at once; a correct backward pass gives about 1e-8 or less in float64, a
    wrong one order 1.

    Parameters
    ----------
    loss : callable
        Computes the loss from the current values of ``params``.
    params : sequence of ndarray
        The model's parameters, float64.
    grads : sequence of ndarray
        The backward pass's gradients at the current parameters, same order.
    rng : numpy Generator
        Draws the directions.
    h : float
        Finite-difference step.

    Returns
    -------
    float
        ``max |numeric - analytic| / max(|analytic|, 1e-6)`` over the parameters.
    """
    worst = 0.0
    for param, grad in zip(params, grads):
        if param.dtype != np.float64:
            raise TypeError(f"params: expected float64 arrays (finite differences in float32 "
                            f"measure rounding, not gradients), got {param.dtype}")
        v = rng.standard_normal(param.shape)
        param += h * v
        plus = loss()
        param -= 2 * h * v
        minus = loss()
        param += h * v
        numeric = (plus - minus) / (2 * h)
        analytic = float(np.sum(grad * v))
        worst = max(worst, abs(numeric - analytic) / max(abs(analytic), 1e-6))
    return worst
