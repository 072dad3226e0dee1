"""``python -m numbaconv`` and the ``numbaconv`` console script (see :mod:`numbaconv.cli`)."""

import sys

from .cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
