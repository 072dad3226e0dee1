"""A one-line progress bar for the demos, drawn only on a terminal.

A dependency (tqdm) for one line of output is not worth it; this redraws the line in place
with a carriage return, at most ten times a second, and draws nothing when the stream is not
a terminal, so logs, pipes and captured test output hold only the per-epoch lines.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class ProgressBar:
    """``[#####-----] 120/300  epoch 3  loss 0.2512`` on one line, redrawn in place.

    Parameters
    ----------
    total : int
        Steps in the whole run.
    stream : text stream, optional
        Where to draw (default ``sys.stderr``, which keeps stdout to the results).
    enabled : bool, optional
        Draw or not; default: whether ``stream`` is a terminal.
    width : int
        Characters of the bar itself.

    Use it as a context manager: leaving the block erases the bar.
    """

    def __init__(self, total: int, *, stream: Optional[TextIO] = None,
                 enabled: Optional[bool] = None, width: int = 30):
        self.total = max(int(total), 1)
        self.stream = sys.stderr if stream is None else stream
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.width = width
        self.done = 0
        self._last_draw = 0.0
        self._drawn = 0

    def update(self, steps: int = 1, status: str = "") -> None:
        """Count ``steps`` more; redraw with ``status`` after the counts if it is time to."""
        self.done = min(self.done + steps, self.total)
        now = time.perf_counter()
        if not self.enabled or (now - self._last_draw < 0.1 and self.done < self.total):
            return
        self._last_draw = now
        filled = self.width * self.done // self.total
        line = (f"[{'#' * filled}{'-' * (self.width - filled)}] "
                f"{self.done}/{self.total}  {status}")
        # Pad with spaces so a shorter line fully covers the previous one.
        self.stream.write("\r" + line.ljust(self._drawn))
        self.stream.flush()
        self._drawn = len(line)

    def close(self) -> None:
        """Erase the bar, so the next line of output starts clean."""
        if self.enabled and self._drawn:
            self.stream.write("\r" + " " * self._drawn + "\r")
            self.stream.flush()
            self._drawn = 0

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
