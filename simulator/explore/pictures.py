"""Pictures of a sweep or comparison: Pareto fronts and an iteration-time heat map over (tp, pp), PNG and SVG.

Figures are drawn with matplotlib's Agg canvas (no pyplot state) and saved without dates or version strings
(`svg.hashsalt` fixed, metadata cleared), so the same rows give byte-identical files.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

_DPI = 110
_GIB = float(2**30)
_RC = {"font.family": "DejaVu Sans", "font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9,
       "xtick.labelsize": 8, "ytick.labelsize": 8, "axes.spines.top": False, "axes.spines.right": False,
       "svg.hashsalt": "memsim", "svg.fonttype": "path"}
MAX_LABELS = 12         # points named on a Pareto front (the rest are drawn, not named)


def pareto_front(xs: list[float], ys: list[float], *, maximize_y: bool = False) -> list[int]:
    """Indices of the points no other point beats on both axes (x smaller; y smaller, or larger with
    `maximize_y`), in increasing x. Ties keep the earlier index."""
    sign = -1.0 if maximize_y else 1.0
    order = sorted(range(len(xs)), key=lambda k: (xs[k], sign * ys[k], k))
    front: list[int] = []
    best = math.inf
    for k in order:
        if sign * ys[k] < best:
            front.append(k)
            best = sign * ys[k]
    return front


def render(figure: Figure) -> tuple[bytes, bytes]:
    """(PNG, SVG) bytes of a figure, with no date, software version or random ids in them."""
    with matplotlib.rc_context(_RC):
        png, svg = io.BytesIO(), io.BytesIO()
        figure.savefig(png, format="png", dpi=_DPI, metadata={"Software": None})
        figure.savefig(svg, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    return png.getvalue(), svg.getvalue()


def pareto_figure(xs: list[float], ys: list[float], labels: list[str], *, x_label: str, y_label: str, title: str,
                  maximize_y: bool = False) -> Figure:
    """Every point in grey, the Pareto front joined and named (its first MAX_LABELS points)."""
    with matplotlib.rc_context(_RC):
        figure = Figure(figsize=(7.5, 5.0), layout="constrained")
        axes = figure.add_subplot()
        axes.scatter(xs, ys, s=14, color="#9C9C9C", label="plans that fit")
        front = pareto_front(xs, ys, maximize_y=maximize_y)
        axes.plot([xs[k] for k in front], [ys[k] for k in front], "-o", color="#C44E52", markersize=5,
                  label="Pareto front")
        for k in front[:MAX_LABELS]:
            axes.annotate(labels[k], (xs[k], ys[k]), textcoords="offset points", xytext=(5, 4), fontsize=7)
        axes.set_xlabel(x_label)
        axes.set_ylabel(y_label)
        axes.set_title(title)
        axes.grid(True, alpha=0.3)
        axes.legend(loc="best")
    return figure


def heatmap_figure(cells: dict[tuple[int, int], float | None], title: str) -> Figure:
    """Iteration time (s) per (tp, pp): the best fitting plan of each cell; cells with plans that all do not fit
    are hatched and marked "does not fit"."""
    tps = sorted({tp for tp, _ in cells})
    pps = sorted({pp for _, pp in cells})
    grid = [[cells.get((tp, pp), math.nan) for tp in tps] for pp in pps]
    values = [[math.nan if v is None else v for v in row] for row in grid]
    with matplotlib.rc_context(_RC):
        figure = Figure(figsize=(1.6 + 1.2 * len(tps), 1.4 + 0.9 * len(pps)), layout="constrained")
        axes = figure.add_subplot()
        image = axes.imshow(values, cmap="viridis_r", aspect="auto", origin="lower")
        figure.colorbar(image, ax=axes, label="iteration time (s)")
        for row, pp in enumerate(pps):
            for column, tp in enumerate(tps):
                value = grid[row][column]
                if value is None:
                    axes.add_patch(Rectangle((column - 0.5, row - 0.5), 1, 1, fill=False, hatch="xx",
                                             edgecolor="#C44E52"))
                    axes.text(column, row, "does not fit", ha="center", va="center", fontsize=7, color="#C44E52")
                elif not math.isnan(value):
                    axes.text(column, row, f"{value:.3g}", ha="center", va="center", fontsize=8, color="white")
        axes.set_xticks(range(len(tps)), [str(tp) for tp in tps])
        axes.set_yticks(range(len(pps)), [str(pp) for pp in pps])
        axes.set_xlabel("tensor parallel (tp)")
        axes.set_ylabel("pipeline stages (pp)")
        axes.set_title(title)
    return figure


def table_pictures(rows, *, label: Callable[[dict], str], tokens: float | None, title: str) -> dict[str, bytes]:
    """The pictures of a sweep or comparison table, by file name (none when no row fits); `label` names a row.

    pareto_time_cost: time to train against dollars for `tokens` (per million tokens without a budget);
    pareto_memory_throughput: largest peak reserved memory against tokens/s; heatmap_tp_pp: iteration time.
    """
    fitting = [row for row in rows if row["status"] == "ok" and row["fits"] and row["usd_per_million_tokens"]]
    if not fitting:
        return {}
    labels = [label(row) for row in fitting]
    millions = (tokens or 1e6) / 1e6
    budget = f"{tokens:.3g} tokens" if tokens is not None else "one million tokens"
    hours = [1e6 / row["tokens_per_s"] * millions / 3600.0 for row in fitting]
    dollars = [row["usd_per_million_tokens"] * millions for row in fitting]
    pictures = {}
    figures = {
        "pareto_time_cost": pareto_figure(hours, dollars, labels, x_label=f"time to train {budget} (hours)",
                                          y_label=f"dollars for {budget}", title=f"{title}: time against cost"),
        "pareto_memory_throughput": pareto_figure(
            [row["peak_reserved_bytes"] / _GIB for row in fitting], [row["tokens_per_s"] for row in fitting], labels,
            x_label="largest peak reserved memory per GPU (GiB)", y_label="tokens/s", maximize_y=True,
            title=f"{title}: memory against throughput"),
    }
    cells: dict[tuple[int, int], float | None] = {}
    for row in rows:
        if row["status"] != "ok":
            continue
        key = (row["tp"], row["pp"])
        best = cells.get(key)
        if row["fits"]:
            cells[key] = row["iteration_time_s"] if best is None else min(best, row["iteration_time_s"])
        else:
            cells.setdefault(key, None)
    figures["heatmap_tp_pp"] = heatmap_figure(cells, f"{title}: best iteration time per (tp, pp)")
    for name, figure in figures.items():
        png, svg = render(figure)
        pictures[f"{name}.png"], pictures[f"{name}.svg"] = png, svg
    return pictures
