"""Models trained end to end in NumPy on numbaconv's gradients: ``numbaconv demo NAME``.

Each demo is a module here with the same small interface, so the command line needs no
knowledge of any one of them:

- ``DEFAULT_EPOCHS`` (int);
- ``run_demo(*, epochs, seed, log, **options) -> int``: prints what it does through ``log``
  (a gradient check against finite differences, then the loss per epoch) and returns the
  exit status: 0 when the gradients check out and the model learned, 1 otherwise.

Only the modules listed in :data:`DEMOS` are offered; a demo is added by writing its module
and adding a line there.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import NamedTuple


class DemoInfo(NamedTuple):
    """One demo: what it trains and which optional packages it needs."""

    summary: str
    requires: tuple  # importable module names, from the ``demo`` extra


#: The demos, in the order ``numbaconv demo --help`` lists them.
DEMOS = {
    "autoencoder": DemoInfo("a convolutional autoencoder (conv encoder, transposed-conv "
                            "decoder) on scikit-learn's 8x8 handwritten digits",
                            ("sklearn",)),
    "cnn": DemoInfo("a small CNN telling apart synthetic images of bars (no extra packages)",
                    ()),
    "lstm": DemoInfo("a character-level LSTM language model of the Zen of Python, trained by "
                     "truncated backpropagation through time (no extra packages)", ()),
}

#: What bare ``numbaconv demo`` runs when its packages are installed, and otherwise.
DEFAULT_DEMO = "autoencoder"
FALLBACK_DEMO = "cnn"

INSTALL_HINT = 'pip install "numbaconv[demo]"'


class DemoUnavailable(ImportError):
    """A demo's optional packages are not installed; the message says what to install."""


def missing_requirements(name: str) -> list:
    """The modules that demo ``name`` needs and cannot import (found without importing)."""
    return [module for module in DEMOS[name].requires
            if importlib.util.find_spec(module) is None]


def default_demo() -> tuple:
    """``(name, note)``: the demo bare ``numbaconv demo`` runs, and why if not the default.

    ``note`` is None when :data:`DEFAULT_DEMO` can run, else a line saying what is missing.
    """
    missing = missing_requirements(DEFAULT_DEMO)
    if not missing:
        return DEFAULT_DEMO, None
    return FALLBACK_DEMO, (f"the {DEFAULT_DEMO} demo needs {', '.join(missing)} "
                           f"({INSTALL_HINT}); running the {FALLBACK_DEMO} demo instead")


def load(name: str):
    """The module of demo ``name``.

    Raises
    ------
    ValueError
        ``name`` is not in :data:`DEMOS`.
    DemoUnavailable
        Its optional packages are missing.
    """
    if name not in DEMOS:
        raise ValueError(f"name: expected one of {', '.join(DEMOS)}, got {name!r}")
    missing = missing_requirements(name)
    if missing:
        raise DemoUnavailable(f"the {name} demo needs {', '.join(missing)}, which is not "
                              f"installed: {INSTALL_HINT}")
    return importlib.import_module(f"{__name__}.{name}")

