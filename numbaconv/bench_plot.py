"""``numbaconv bench --plot``: a bar chart of each backend's ratio to PyTorch, one panel per
op (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

from typing import Optional, Sequence

from .bench_cases import PYTORCH, Row


#: What :func:`plot_ratios` raises without matplotlib.
MATPLOTLIB_MISSING = ("plotting needs matplotlib, which is not installed: "
                      "pip install 'numbaconv[plot]' (or pip install matplotlib)")


def require_matplotlib() -> None:
    """Raise ImportError with :data:`MATPLOTLIB_MISSING` when matplotlib cannot be imported.

    ``numbaconv bench --plot`` calls it before measuring, not after minutes of timing.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(MATPLOTLIB_MISSING) from exc


def plot_ratios(rows: Sequence[Row], path: str, *, title: Optional[str] = None,
                peak_name: str = "SGEMM") -> str:
    """Save a bar chart of each backend's ratio to PyTorch, one panel per op.

    Each panel has a bar per shape and layout for each backend, on a log scale with a line
    at 1 (left of it PyTorch is faster, right of it the backend is). Without any ratio (no
    PyTorch in the run) it shows each row's fraction of the GEMM peak instead. Drawn on
    matplotlib's Agg canvas, without pyplot, so it needs no display and leaves no global
    figure behind.

    Parameters
    ----------
    rows : sequence of Row
        From :func:`run_benchmarks`; PyTorch's own rows and rows without a value are left
        out.
    path : str
        The image file; its extension picks the format (``.png``, ``.svg``, ``.pdf``...).
    title : str, optional
        The figure's title.
    peak_name : str
        What the GEMM peak is called on the axis, when fractions of it are drawn.

    Returns
    -------
    str
        What was drawn: ``"vs_pytorch"`` or ``"peak_fraction"``.

    Raises
    ------
    ImportError
        Without matplotlib (:data:`MATPLOTLIB_MISSING`).
    ValueError
        When no row has a value to draw.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    mine = [r for r in rows if r.backend != PYTORCH and r.status == "ok"]
    metric = "vs_pytorch" if any(r.vs_pytorch is not None for r in mine) else "peak_fraction"
    mine = [r for r in mine if getattr(r, metric) is not None]
    if not mine:
        raise ValueError("rows: nothing to plot (no row has a ratio to PyTorch or a fraction "
                         "of the GEMM peak)")
    ops = list(dict.fromkeys(r.op for r in mine))
    backends = list(dict.fromkeys(r.backend for r in mine))
    layouts = set(r.layout for r in mine)
    short = {"channels_first": "NC..", "channels_last": "N..C"}

    def label(r):
        return r.shape if len(layouts) == 1 else f"{r.shape} {short.get(r.layout, r.layout)}"

    labels = list(dict.fromkeys(label(r) for r in mine))
    values = {(r.op, label(r), r.backend): getattr(r, metric) for r in mine}

    bar = 0.8 / len(backends)
    height = max(3.0, 0.6 + len(labels) * (0.16 * len(backends) + 0.12))
    fig = Figure(figsize=(3.2 * len(ops) + 2.5, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(ops), sharey=True, squeeze=False)[0]
    colours = [f"C{i}" for i in range(len(backends))]
    ratio = metric == "vs_pytorch"
    if ratio:  # one log axis for every panel, with 1 inside and round ticks
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter
        low = min(1.0, min(values.values())) / 1.25
        high = max(1.0, max(values.values())) * 1.25
        ticks = [m * 10.0 ** e for e in range(-4, 5) for m in (1, 2, 5)
                 if low <= m * 10.0 ** e <= high]
    for ax, op in zip(axes, ops):
        for i, backend in enumerate(backends):
            ys, xs = [], []
            for j, lab in enumerate(labels):
                value = values.get((op, lab, backend))
                if value is not None:
                    ys.append(j + (i - (len(backends) - 1) / 2) * bar)
                    xs.append(value if ratio else value * 100)
            if ratio:  # bars grow from 1: left slower than PyTorch, right faster
                ax.barh(ys, [x - 1 for x in xs], left=1, height=bar, color=colours[i],
                        label=backend)
            else:
                ax.barh(ys, xs, height=bar, color=colours[i], label=backend)
        ax.set_title(op, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(labelsize=7)
        if ratio:
            ax.set_xscale("log")
            ax.set_xlim(low, high)
            ax.xaxis.set_major_locator(FixedLocator(ticks))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.axvline(1.0, color="black", linewidth=0.8)
            ax.set_xlabel("PyTorch time / backend time", fontsize=8)
        else:
            ax.set_xlabel(f"% of {peak_name} peak", fontsize=8)
    axes[0].set_yticks(range(len(labels)), labels)
    axes[0].invert_yaxis()
    if len(backends) > 1 or ratio:  # beside the panels, where it hides no bar
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, fontsize=7, loc="outside right upper")
    if title is None:
        title = ("numbaconv vs PyTorch (> 1: numbaconv faster)" if metric == "vs_pytorch"
                 else f"numbaconv: fraction of the {peak_name} peak (no PyTorch baseline)")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=100)
    return metric
