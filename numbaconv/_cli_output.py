"""What the ``numbaconv`` commands share: plain-text tables, the progress line on stderr,
the OpenBLAS warnings and the exit status of usage errors."""

from __future__ import annotations

import sys
import time
from typing import Optional, Sequence

USAGE_ERROR = 2

#: OpenBLAS variables that override what it detects about the CPU; the issue's comparison
#: with PyTorch is to run with both unset, and ``bench`` says so when they are not.
OPENBLAS_TUNING_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def _print(*args, **kwargs) -> None:
    print(*args, **kwargs, flush=True)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]],
           right: Sequence[int] = ()) -> list:
    """Lines of a plain-text table; columns listed in ``right`` are right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(v.rjust(w) if i in right else v.ljust(w)
                         for i, (v, w) in enumerate(zip(r, widths))).rstrip()

    return [line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]]


def _one_line(text: str, limit: int = 160) -> str:
    """``text`` on one line, at most ``limit`` characters, shortened at a word boundary."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    cut = text[:limit - 3]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space].rstrip(",;:")
    return cut + "..."


def _wrapped_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                   right: Sequence[int] = (), width: Optional[int] = None) -> list:
    """:func:`_table` whose last column (free text, such as a reason) is wrapped at word
    boundaries to fit ``width`` (default: the terminal's, at least 100), never cut."""
    import shutil
    import textwrap
    if width is None:
        width = max(100, shutil.get_terminal_size().columns - 1)
    cells = [[str(h) for h in headers[:-1]]] + [[str(v) for v in row[:-1]] for row in rows]
    start = sum(max(len(r[i]) for r in cells) + 2 for i in range(len(headers) - 1))
    room = max(30, width - start)
    firsts, rests = [], []
    for row in rows:
        lines = textwrap.wrap(" ".join(str(row[-1]).split()), room,
                              break_long_words=False, break_on_hyphens=False) or [""]
        firsts.append(tuple(row[:-1]) + (lines[0],))
        rests.append(lines[1:])
    table = _table(headers, firsts, right)
    out = table[:2]
    for line, more in zip(table[2:], rests):
        out += [line] + [" " * start + extra for extra in more]
    return out


class _Progress:
    """One self-overwriting status line on stderr while ``bench`` measures.

    Drawn only when enabled (by default when stderr is a terminal), so that piped or
    captured output holds the table alone. :meth:`clear` wipes the line before anything
    else is printed, so that it never ends up inside the table.
    """

    def __init__(self, enabled: bool, stream=None):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()
        self.shown = False

    def update(self, done: int, total: int, what: str) -> None:
        """Show ``what`` and, when ``total`` is known, a bar of ``done`` out of ``total``."""
        if not self.enabled:
            return
        import shutil

        elapsed = time.perf_counter() - self.start
        if total:
            filled = round(20 * done / total)
            text = f"[{'#' * filled}{'.' * (20 - filled)}] {done}/{total} {elapsed:.0f} s: {what}"
        else:
            text = f"{elapsed:.0f} s: {what}"
        width = max(20, shutil.get_terminal_size().columns - 1)
        self.stream.write("\r\033[K" + text[:width])  # back to column 0, erase the line
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


def _openblas_warnings(bench, set_vars: dict, blas: Optional[dict]) -> list:
    """Warnings about OpenBLAS settings that make this run's figures unrepresentative.

    ``OPENBLAS_CORETYPE`` forcing an older kernel than OpenBLAS would pick is found out by
    asking a fresh interpreter without it (a fraction of a second, only when it is set);
    ``OPENBLAS_L2_SIZE`` overrides a detected cache size, which no interpreter reveals, so
    it is reported whenever set.
    """
    found = []
    coretype = set_vars.get("OPENBLAS_CORETYPE")
    if coretype and (blas is None or blas["library"] == "openblas"):
        natural = bench.openblas_natural_kernel()
        text = bench.openblas_coretype_warning(
            coretype, blas["kernel"] if blas else None, natural,
            bench.cpu_isa_level() if natural is None else None)
        if text:
            found.append(text)
    if set_vars.get("OPENBLAS_L2_SIZE"):
        found.append(f"OPENBLAS_L2_SIZE={set_vars['OPENBLAS_L2_SIZE']} overrides the L2 size "
                     f"OpenBLAS detects, which sizes its blocking; the comparison with "
                     f"PyTorch wants {' and '.join(OPENBLAS_TUNING_VARS)} unset")
    return found


def _conv_ops() -> tuple:
    from numbaconv.problem import CONV_OPS
    return CONV_OPS
