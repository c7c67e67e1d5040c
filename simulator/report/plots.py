"""memory.png: per-rank memory timelines (allocated by category, reserved, capacity, peak, OOM)."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from simulator.io import atomic_write_bytes
from simulator.trace.chrome import downsample_memory
from simulator.trace.records import MemorySample, RankTrace, Trace
from simulator.workload.graph import CATEGORIES, CATEGORY_LABELS

if TYPE_CHECKING:
    from simulator.parallel.plan import Coords

MAX_PANELS = 16
# Samples drawn per panel at most (min/max envelope kept, see downsample_memory).
_MAX_PLOT_SAMPLES = 6000
_DPI = 110
_GIB = float(2**30)
_CATEGORY_COLORS = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer_states": "#55A868",
    "activations": "#C44E52",
    "communication_buffers": "#8172B3",
    "other": "#9C9C9C",
}
_RC = {
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "legend.fontsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "svg.hashsalt": "memsim",
    "path.simplify": True,
}


def _ranges(numbers: list[int]) -> str:
    """Compact form of sorted ints: [1, 2, 3, 7] -> "1-3, 7"."""
    parts: list[str] = []
    start = prev = None
    for n in numbers:
        if start is None:
            start = prev = n
        elif n == prev + 1:
            prev = n
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = n
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


def _select_ranks(ranks: list[RankTrace], stage_of_rank: dict[int, int] | None,
                  ) -> tuple[list[RankTrace], list[int]]:
    """Pick at most MAX_PANELS ranks: each stage's top-peak rank, OOM ranks, then top peaks."""
    ordered = sorted(ranks, key=lambda r: r.rank)
    if len(ordered) <= MAX_PANELS:
        return ordered, []
    by_peak = sorted(ordered, key=lambda r: (-_peak(r)[1], r.rank))
    chosen: list[int] = []
    if stage_of_rank:
        seen_stages: list[int] = []
        for rank in by_peak:
            stage = stage_of_rank.get(rank.rank)
            if stage is not None and stage not in seen_stages and len(chosen) < MAX_PANELS:
                seen_stages.append(stage)
                chosen.append(rank.rank)
    oom_first = [r for r in by_peak if r.oom is not None] + [r for r in by_peak if r.oom is None]
    for rank in oom_first:
        if len(chosen) >= MAX_PANELS:
            break
        if rank.rank not in chosen:
            chosen.append(rank.rank)
    shown = [r for r in ordered if r.rank in chosen]
    left_out = [r.rank for r in ordered if r.rank not in chosen]
    return shown, left_out


def panel_label(rank: int, coords: Coords) -> str:
    """The panel title of a rank of a parallel plan: "stage 1 (rank 5, dp 0, tp 1)"."""
    return f"stage {coords.pp} (rank {rank}, dp {coords.dp}, tp {coords.tp})"


def _panel_order(shown: list[RankTrace], coords_of_rank: Mapping[int, Coords] | None) -> list[RankTrace]:
    """Stages side by side: panels by (stage, dp, tp) when the plan coordinates are known."""
    if not coords_of_rank:
        return shown

    def key(rank: RankTrace) -> tuple[int, int, int, int]:
        coords = coords_of_rank.get(rank.rank)
        if coords is None:
            return (1 << 30, 0, 0, rank.rank)
        return (coords.pp, coords.dp, coords.tp, rank.rank)

    return sorted(shown, key=key)


def _peak(rank: RankTrace) -> tuple[float, int]:
    """(time_s, allocated bytes) of the rank's peak: the recorded one, else the samples' maximum."""
    if rank.peak_allocated > 0 or not rank.memory:
        return rank.peak_time_s, rank.peak_allocated
    best = max(rank.memory, key=lambda s: s.allocated)
    return best.time_s, best.allocated


def _time_scale(end_time_s: float) -> tuple[float, str]:
    if end_time_s >= 2.0:
        return 1.0, "s"
    if end_time_s >= 2e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _step_series(samples: list[MemorySample], end_time_s: float, scale: float, y_bytes: float = _GIB,
                 ) -> tuple[list[float], list[list[float]], list[float], list[float]]:
    """x, per-category, allocated and reserved in units of y_bytes; the last level held to the end."""
    xs = [s.time_s * scale for s in samples]
    cats = [[(s.by_category[i] if i < len(s.by_category) else 0) / y_bytes for s in samples]
            for i in range(len(CATEGORIES))]
    alloc = [s.allocated / y_bytes for s in samples]
    reserved = [s.reserved / y_bytes for s in samples]
    end = end_time_s * scale
    if samples and end > xs[-1]:
        xs.append(end)
        for series in cats:
            series.append(series[-1])
        alloc.append(alloc[-1])
        reserved.append(reserved[-1])
    return xs, cats, alloc, reserved


def _draw_panel(ax, rank: RankTrace, trace: Trace, title: str, scale: float, unit: str) -> None:
    samples = downsample_memory(rank.memory, _MAX_PLOT_SAMPLES)
    end_time_s = max([trace.end_time_s] + [s.time_s for s in samples[-1:]])
    peak_time_s, peak_bytes = _peak(rank)
    used = max([peak_bytes, rank.peak_reserved] + [s.reserved for s in samples] + [1])
    # Small jobs are drawn in MiB; a capacity far above the curve is named, not drawn to scale.
    y_unit, y_bytes = ("GiB", _GIB) if used >= _GIB / 4 else ("MiB", 1 << 20)
    capacity_on_scale = rank.capacity_bytes > 0 and rank.capacity_bytes <= 4 * used
    xs, cats, alloc, reserved = _step_series(samples, end_time_s, scale, y_bytes)
    capacity_gib = rank.capacity_bytes / y_bytes
    if xs:
        ax.stackplot(xs, *cats, colors=[_CATEGORY_COLORS[c] for c in CATEGORIES], step="post",
                     linewidth=0, alpha=0.85)
        ax.step(xs, alloc, where="post", color="black", linewidth=1.0)
        ax.step(xs, reserved, where="post", color="#1f77b4", linewidth=1.0, linestyle="-")
    else:
        ax.text(0.5, 0.5, "no memory samples", transform=ax.transAxes, ha="center", va="center",
                color="#555555")
    for number, (start_s, end_s) in enumerate(trace.iteration_bounds_s):
        for t in (start_s, end_s):
            ax.axvline(t * scale, color="#666666", linewidth=0.7, linestyle=":", zorder=4)
        if len(trace.iteration_bounds_s) <= 12:
            ax.text((start_s + end_s) / 2 * scale, 1.0, f"iter {number}", ha="center", va="bottom",
                    fontsize=7, color="#666666", transform=ax.get_xaxis_transform())
    if capacity_on_scale:
        ax.axhline(capacity_gib, color="#d62728", linewidth=1.2, linestyle="--")
    if peak_bytes > 0:
        ax.plot([peak_time_s * scale], [peak_bytes / y_bytes], marker="v", color="black",
                markersize=7, zorder=5, clip_on=False)
    top = max([capacity_gib if capacity_on_scale else 0.0, peak_bytes / y_bytes,
               rank.peak_reserved / y_bytes] + reserved + [1e-3])
    if rank.oom is not None:
        oom = rank.oom
        ax.axvline(oom.time_s * scale, color="#d62728", linewidth=2.0, zorder=6)
        wanted_gib = (oom.allocated_bytes + oom.requested_bytes) / y_bytes
        ax.plot([oom.time_s * scale], [wanted_gib], marker="X", color="#d62728", markersize=9,
                zorder=7)
        top = max(top, wanted_gib)
        ax.text(0.02, 0.97, f"OOM in {oom.op}\nasked {oom.requested_bytes / _GIB:.2f} GiB "
                f"for {oom.tensor}", transform=ax.transAxes, ha="left", va="top", fontsize=8,
                color="#d62728", bbox={"boxstyle": "round", "fc": "white", "ec": "#d62728"})
    ax.set_ylim(0, top * (1.3 if rank.oom is not None else 1.12))
    ax.set_xlim(0, max(end_time_s * scale, 1e-9))
    subtitle = (f"peak {peak_bytes / y_bytes:.2f} {y_unit} allocated, "
                f"{rank.peak_reserved / y_bytes:.2f} {y_unit} reserved")
    if rank.capacity_bytes > 0:
        subtitle += f" of {rank.capacity_bytes / _GIB:.2f} GiB left to the allocator"
        if not capacity_on_scale:
            subtitle += " (capacity off scale)"
    ax.set_title(f"{title}\n{subtitle}", color="#d62728" if rank.oom is not None else "black",
                 pad=12)
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel(y_unit)
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)


def _legend_handles(with_oom: bool) -> list:
    handles: list = [Patch(color=_CATEGORY_COLORS[c], alpha=0.85, label=CATEGORY_LABELS[c])
                     for c in CATEGORIES]
    handles += [
        Line2D([], [], color="black", linewidth=1.0, label="allocated"),
        Line2D([], [], color="#1f77b4", linewidth=1.0, label="reserved"),
        Line2D([], [], color="#d62728", linewidth=1.2, linestyle="--", label="capacity left to the allocator"),
        Line2D([], [], color="black", marker="v", linestyle="", label="peak allocated"),
        Line2D([], [], color="#666666", linewidth=0.7, linestyle=":", label="iteration bounds"),
    ]
    if with_oom:
        handles.append(Line2D([], [], color="#d62728", marker="X", linestyle="",
                              label="OOM (allocated + request)"))
    return handles


def _panels(trace: Trace, stage_of_rank: dict[int, int] | None, coords_of_rank: Mapping[int, Coords] | None,
            ) -> tuple[list[RankTrace], list[int], list[str]]:
    """The ranks drawn (in panel order), the ranks left out and each panel's title."""
    if coords_of_rank and stage_of_rank is None:
        stage_of_rank = {rank: coords.pp for rank, coords in coords_of_rank.items()}
    shown, left_out = _select_ranks(trace.ranks, stage_of_rank)
    shown = _panel_order(shown, coords_of_rank)
    labels = []
    for rank in shown:
        if coords_of_rank is not None and rank.rank in coords_of_rank:
            label = panel_label(rank.rank, coords_of_rank[rank.rank])
        else:
            label = f"rank {rank.rank}"
            if stage_of_rank is not None and rank.rank in stage_of_rank:
                label += f" (stage {stage_of_rank[rank.rank]})"
        labels.append(f"{label} · {rank.device}")
    return shown, left_out, labels


def panel_titles(trace: Trace, stage_of_rank: dict[int, int] | None = None,
                 coords_of_rank: Mapping[int, Coords] | None = None) -> list[str]:
    """The first title line of each panel of memory.png, left to right and top to bottom.

    Args:
        trace: the simulation result.
        stage_of_rank, coords_of_rank: as for plot_memory.

    Returns:
        One title per drawn panel, e.g. "stage 1 (rank 2, dp 0, tp 0) · rtx-4090".
    """
    return _panels(trace, stage_of_rank, coords_of_rank)[2]


def render_memory_png(trace: Trace, title: str, stage_of_rank: dict[int, int] | None = None,
                      coords_of_rank: Mapping[int, Coords] | None = None) -> bytes:
    """Render the memory figure (see plot_memory) and return the PNG bytes."""
    shown, left_out, labels = _panels(trace, stage_of_rank, coords_of_rank)
    panels = max(1, len(shown))
    ncols = panels if panels <= 4 else (3 if panels <= 9 else 4)
    nrows = math.ceil(panels / ncols)
    legend_cols = 4 if ncols == 1 else 6
    handles = _legend_handles(any(r.oom is not None for r in shown))
    legend_rows = math.ceil(len(handles) / legend_cols) + (1 if left_out else 0)
    # Fixed layout in inches (a layout engine would cost seconds for 16 panels).
    axis_w_in = 6.6 if ncols == 1 else 4.4
    axis_h_in = 2.5
    left_in, right_in, col_gap_in = 0.65, 0.25, 0.8
    top_in, row_gap_in = 0.35 + 0.75, 0.55 + 0.8         # suptitle + panel titles; xlabel + titles
    bottom_in = 0.55 + 0.22 * legend_rows + 0.1
    width_in = left_in + ncols * axis_w_in + (ncols - 1) * col_gap_in + right_in
    height_in = top_in + nrows * axis_h_in + (nrows - 1) * row_gap_in + bottom_in
    end_time_s = max([trace.end_time_s] + [s.time_s for r in shown for s in r.memory[-1:]])
    scale, unit = _time_scale(end_time_s)
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(width_in, height_in), dpi=_DPI)
        fig.subplots_adjust(left=left_in / width_in, right=1 - right_in / width_in,
                            bottom=bottom_in / height_in, top=1 - top_in / height_in,
                            wspace=col_gap_in / axis_w_in, hspace=row_gap_in / axis_h_in)
        axes = fig.subplots(nrows, ncols, squeeze=False, sharey=False)
        for i, ax in enumerate(axes.flat):
            if i >= len(shown):
                ax.set_visible(False)
                continue
            _draw_panel(ax, shown[i], trace, labels[i], scale, unit)
        if not shown:
            axes.flat[0].set_visible(True)
            axes.flat[0].text(0.5, 0.5, "no ranks simulated", ha="center", va="center")
            axes.flat[0].set_axis_off()
        fig.suptitle(title, fontsize=12, fontweight="bold", y=1 - 0.12 / height_in, va="top")
        note = None
        if left_out:
            note = (f"{len(left_out)} of {len(trace.ranks)} ranks not shown (at most {MAX_PANELS} "
                    f"panels): {_ranges(left_out)}")
        legend = fig.legend(handles=handles, loc="lower center",
                            bbox_to_anchor=(0.5, 0.05 / height_in), ncol=legend_cols,
                            frameon=False, title=note, title_fontproperties={"size": 8})
        if note is not None:
            legend.get_title().set_color("#555555")
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=_DPI, metadata={"Software": None})
    return buffer.getvalue()


def plot_memory(trace: Trace, path: str | os.PathLike, title: str,
                stage_of_rank: dict[int, int] | None = None,
                coords_of_rank: Mapping[int, Coords] | None = None) -> None:
    """Write memory.png: one panel per simulated rank (at most 16) of memory over time.

    Each panel stacks allocated bytes by category (GiB) over time, draws total allocated and
    reserved bytes, the device capacity (dashed), a marker at the peak, the OOM point if any
    and the iteration boundaries. Ranks beyond 16 are named above the legend. The bytes of the
    file depend only on the inputs.

    Args:
        trace: the simulation result.
        path: the PNG file to write (atomically).
        title: the figure title (e.g. the scenario name).
        stage_of_rank: pipeline stage of each rank, for panel titles and panel selection.
        coords_of_rank: (dp, pp, tp) of each rank in the parallel plan: panels are then ordered
            by stage and titled "stage s (rank r, dp d, tp t) · device" (panel_label).
    """
    atomic_write_bytes(path, render_memory_png(trace, title, stage_of_rank, coords_of_rank))
