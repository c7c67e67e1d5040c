"""The human summary of `memsim run`: verdict, memory per rank, breakdown, time, warnings, OOM."""

from __future__ import annotations

import math

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from simulator.units import format_bytes, format_seconds
from simulator.workload.graph import CATEGORIES, CATEGORY_LABELS

# Rows of the per-rank table before the rest is summarised in one line.
MAX_RANK_ROWS = 32
# Largest live tensors listed on OOM.
MAX_LIVE_ROWS = 10
_BAR_WIDTH = 30
_TIME_ROWS = (
    ("forward_s", "forward"),
    ("backward_s", "backward"),
    ("recompute_s", "recompute"),
    ("optimizer_s", "optimizer"),
    ("exposed_communication_s", "exposed communication"),
    ("exposed_offload_s", "exposed offload"),
    ("idle_s", "idle / bubble"),
)
_WAITING = ("exposed communication", "exposed offload", "idle / bubble")


def _number(value: object) -> float | None:
    """A finite float, or None for missing / non-numeric / NaN / infinite values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _seconds(value: object) -> str:
    number = _number(value)
    return "—" if number is None else format_seconds(number)


def _bytes(value: object) -> str:
    number = _number(value)
    return "—" if number is None else format_bytes(number)


def _percent(part: object, whole: object) -> str:
    p, w = _number(part), _number(whole)
    if p is None or w is None or w <= 0:
        return "—"
    return f"{100.0 * p / w:.1f}%"


def _count(value: float) -> str:
    """1234567 -> "1.23 M"; plain for values under a thousand."""
    for factor, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {suffix}"
    return f"{value:.0f}"


def _header(report: dict, console: Console) -> None:
    model = report.get("model") or {}
    lines = Text()
    lines.append("scenario  ", style="bold")
    lines.append(str(report.get("scenario", "?")))
    name = model.get("name")
    if name:
        lines.append("\nmodel     ", style="bold")
        lines.append(str(name))
        params = _number(model.get("parameters"))
        trainable = _number(model.get("trainable_parameters"))
        if params is not None and trainable is not None:
            lines.append(f" ({_count(params)} parameters, {_count(trainable)} trainable: adapters)")
        elif params is not None:
            lines.append(f" ({_count(params)} parameters)")
    if report.get("device"):
        lines.append("\ndevice    ", style="bold")
        lines.append(str(report["device"]))
    if report.get("precision"):
        lines.append("\nprecision ", style="bold")
        lines.append(str(report["precision"]))
    console.print(Panel(lines, title="memsim run", title_align="left", expand=False))


def _verdict(report: dict, console: Console) -> None:
    ranks = report.get("ranks") or []
    oom_ranks = [r.get("rank") for r in ranks if r.get("oom")]
    if report.get("fits"):
        worst = max((r for r in ranks), key=lambda r: _number(r.get("peak_reserved_bytes")) or 0,
                    default=None)
        detail = ""
        if worst is not None:
            detail = (f": highest peak reserved {_bytes(worst.get('peak_reserved_bytes'))} of "
                      f"{_bytes(worst.get('capacity_bytes'))} on rank {worst.get('rank')}")
        console.print(Text(f"✔ FITS{detail}", style="bold green"))
    else:
        where = ""
        if oom_ranks:
            where = f" (out of memory on rank {', '.join(str(r) for r in oom_ranks)})"
        hosts = [str(n.get("node")) for n in report.get("host_memory") or [] if not n.get("fits", True)]
        if hosts:
            where += f" (host memory of node {', '.join(hosts)})"
        console.print(Text(f"✘ DOES NOT FIT{where}", style="bold red"))


def _rank_table(report: dict, console: Console) -> None:
    ranks = list(report.get("ranks") or [])
    if not ranks:
        return
    shown = ranks
    if len(ranks) > MAX_RANK_ROWS:
        order = sorted(ranks, key=lambda r: (-(_number(r.get("peak_reserved_bytes")) or 0),
                                             r.get("rank", 0)))
        keep = {id(r) for r in order[:MAX_RANK_ROWS]}
        shown = [r for r in ranks if id(r) in keep]
    table = Table(title="Memory per rank", title_justify="left", header_style="bold")
    for column, justify in (("rank", "right"), ("stage", "right"), ("device", "left"),
                            ("peak allocated", "right"), ("peak reserved", "right"),
                            ("capacity", "right"), ("used", "right"), ("headroom", "right"),
                            ("peak op", "left")):
        table.add_column(column, justify=justify)
    for r in shown:
        capacity = _number(r.get("capacity_bytes"))
        reserved = _number(r.get("peak_reserved_bytes"))
        if reserved is not None:
            reserved_total = reserved + (_number(r.get("context_bytes")) or 0)   # what `fits` compares
        used = _percent(reserved_total if reserved is not None else None, capacity)
        style = ""
        if r.get("oom") or (capacity and reserved is not None and reserved_total > capacity):
            style = "red"
        elif capacity and reserved is not None and reserved_total > 0.9 * capacity:
            style = "yellow"
        headroom = "—"
        if capacity is not None and reserved is not None:
            headroom = format_bytes(capacity - reserved_total)
        table.add_row(str(r.get("rank", "?")), str(r.get("stage", "")), str(r.get("device", "")),
                      _bytes(r.get("peak_allocated_bytes")), _bytes(reserved), _bytes(capacity),
                      Text(used, style=style), Text(headroom, style=style),
                      str(r.get("peak_op", "")))
    console.print(table)
    context = _number(shown[0].get("context_bytes")) if shown else None
    capacity = _number(shown[0].get("capacity_bytes")) if shown else None
    if context and capacity:
        # Three capacities meet here: the device's, what is outside the allocator, and what the allocator may use.
        console.print(Text(f"capacity: the device's memory; {format_bytes(context)} of it is outside the allocator "
                           f"(CUDA context, NCCL, cuBLAS: allocator.context_bytes), counted in used and headroom; "
                           f"the out-of-memory box and memory.png show what is left to the allocator "
                           f"({format_bytes(capacity - context)}, less under allocator.memory_fraction)", style="dim"))
    if len(shown) < len(ranks):
        console.print(Text(f"{len(ranks) - len(shown)} more ranks not shown (lowest peak reserved)",
                           style="dim"))


def _breakdown(report: dict, console: Console) -> None:
    ranks = list(report.get("ranks") or [])
    candidates = [r for r in ranks if r.get("breakdown_at_peak")]
    if not candidates:
        return
    worst = max(candidates, key=lambda r: (bool(r.get("oom")),
                                           _number(r.get("peak_allocated_bytes")) or 0,
                                           -(r.get("rank") or 0)))
    breakdown = worst["breakdown_at_peak"]
    total = sum(_number(breakdown.get(c)) or 0 for c in CATEGORIES)
    title = (f"Breakdown at peak (rank {worst.get('rank')}, stage {worst.get('stage', '?')}, "
             f"during {worst.get('peak_op') or '?'})")
    table = Table(title=title,
                  title_justify="left", header_style="bold")
    table.add_column("category")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    table.add_column("", justify="left")
    for category in CATEGORIES:
        value = _number(breakdown.get(category)) or 0
        share = value / total if total > 0 else 0.0
        table.add_row(CATEGORY_LABELS[category], format_bytes(value), f"{100 * share:.1f}%",
                      Text("█" * int(round(share * _BAR_WIDTH)), style="cyan"))
    table.add_row(Text("total", style="bold"), Text(format_bytes(total), style="bold"), "100.0%"
                  if total > 0 else "—", "")
    console.print(table)


def _performance(report: dict, console: Console) -> None:
    title = "Performance"
    if not report.get("fits", True) and not any(not n.get("fits", True) for n in report.get("host_memory") or []):
        title += " (of the run up to the failure)"   # a host that is too small fails nothing while it runs
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    table.add_row("iteration time", _seconds(report.get("iteration_time_s")))
    interval = report.get("iteration_time_interval_s")
    if interval:
        kind = (report.get("iteration_time_interval") or {}).get("kind", "")
        label = "calibration bootstrap, 95%" if kind == "calibration-bootstrap" else "validation set's error range"
        table.add_row(f"expected ({label})", f"{_seconds(interval[0])} – {_seconds(interval[1])}")
    tokens = _number(report.get("tokens_per_s"))
    table.add_row("tokens/s", "—" if tokens is None else f"{tokens:,.0f}")
    mfu = _number(report.get("mfu"))
    table.add_row("MFU", "—" if mfu is None else f"{100 * mfu:.1f}%")
    flops = _number(report.get("model_flops_per_iteration"))
    if flops is not None:
        table.add_row("model FLOPs / iteration", f"{flops:.3e}")
    bubble = _number(report.get("bubble_fraction"))
    if bubble is not None:
        table.add_row("pipeline bubble", f"{100 * bubble:.1f}%")
    communication = report.get("communication") or {}
    if communication:
        table.add_row("communication (total / exposed)",
                      f"{_seconds(communication.get('total_s'))} / "
                      f"{_seconds(communication.get('exposed_s'))}")
    offload = report.get("offload") or {}
    if offload:
        table.add_row("offload traffic / host compute / exposed",
                      f"{_seconds(offload.get('traffic_s'))} / {_seconds(offload.get('host_compute_s'))} / "
                      f"{_seconds(offload.get('exposed_s'))}")
    console.print(table)


def _host_memory(report: dict, console: Console) -> None:
    nodes = report.get("host_memory") or []
    if not nodes:
        return
    table = Table(title="Host memory per node (offload)", title_justify="left", header_style="bold")
    for name, justify in (("node", "right"), ("ranks", "right"), ("peak", "right"), ("capacity", "right"),
                          ("used", "right")):
        table.add_column(name, justify=justify)
    for node in nodes:
        style = "red" if not node.get("fits", True) else None
        table.add_row(str(node.get("node")), str(node.get("ranks")), _bytes(node.get("peak_bytes")),
                      _bytes(node.get("capacity_bytes")), _percent(node.get("peak_bytes"), node.get("capacity_bytes")),
                      style=style)
    console.print(table)


def _time_breakdown(report: dict, console: Console) -> None:
    breakdown = report.get("time_breakdown") or {}
    if not breakdown:
        return
    values = [(label, _number(breakdown.get(key)) or 0.0) for key, label in _TIME_ROWS]
    total = sum(v for _, v in values)
    table = Table(title="Where the time went", title_justify="left", header_style="bold")
    table.add_column("phase")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    table.add_column("", justify="left")
    for label, value in values:
        share = value / total if total > 0 else 0.0
        style = "yellow" if label in _WAITING else "green"
        table.add_row(label, format_seconds(value), f"{100 * share:.1f}%",
                      Text("█" * int(round(share * _BAR_WIDTH)), style=style))
    console.print(table)


def _warnings(report: dict, console: Console) -> None:
    warnings = [str(w) for w in report.get("warnings") or []]
    if not warnings:
        return
    body = Text("\n".join(f"• {w}" for w in warnings), style="yellow")
    console.print(Panel(body, title=f"warnings ({len(warnings)})", title_align="left",
                        border_style="yellow"))


def _oom(report: dict, console: Console) -> None:
    oom = report.get("oom")
    if not oom:
        return
    rank = oom.get("rank")
    if rank is None:
        rank = next((r.get("rank") for r in report.get("ranks") or [] if r.get("oom")), None)
    where = f"rank {rank}" if rank is not None else "a rank"
    body = Text()
    body.append(f"{where} ran out of memory in op ", style="red")
    body.append(str(oom.get("op", "?")), style="bold red")
    body.append(" allocating ", style="red")
    body.append(str(oom.get("tensor", "?")), style="bold red")
    body.append(
        f"\nrequested {_bytes(oom.get('requested_bytes'))} with "
        f"{_bytes(oom.get('allocated_bytes'))} allocated and "
        f"{_bytes(oom.get('reserved_bytes'))} reserved of {_bytes(oom.get('capacity_bytes'))} left to the "
        f"allocator (the device's memory less allocator.context_bytes)")
    shortfall = [_number(oom.get(key))
                 for key in ("allocated_bytes", "requested_bytes", "capacity_bytes")]
    if all(v is not None for v in shortfall):
        missing = shortfall[0] + shortfall[1] - shortfall[2]
        if missing > 0:
            body.append(f"\nshort by at least {format_bytes(missing)}", style="bold")
    live = list(oom.get("largest_live") or [])[:MAX_LIVE_ROWS]
    console.print(Panel(body, title="out of memory", title_align="left", border_style="red"))
    if live:
        table = Table(title="Largest live tensors at the OOM", title_justify="left",
                      header_style="bold")
        table.add_column("tensor")
        table.add_column("bytes", justify="right")
        for name, size in live:
            table.add_row(str(name), _bytes(size))
        console.print(table)


def _what_would_fit(report: dict, console: Console) -> None:
    advice = report.get("what_would_fit")
    if advice is None or report.get("fits", True):
        return
    if not advice:
        console.print("No change memsim tried could be simulated for this job (memsim run --what-would-fit N).")
        return
    table = Table(title="What would make it fit (each change simulated; memsim run FILE --set ...)",
                  title_justify="left", header_style="bold")
    table.add_column("change", overflow="fold", ratio=2)
    table.add_column("--set", no_wrap=True)
    for column in ("needs / has", "iteration", "time per token", "GPUs"):
        table.add_column(column, justify="right")
    fitting = [entry for entry in advice if entry.get("fits")]
    for entry in fitting:
        table.add_row(str(entry.get("label", "")), "\n".join(entry.get("changes") or []),
                      f"{_bytes(entry.get('needed_bytes'))} / {_bytes(entry.get('capacity_bytes'))}",
                      _seconds(entry.get("iteration_time_s")), f"{_number(entry.get('time_ratio')) or 0:.2f}x",
                      str(entry.get("gpus", "")))
    if fitting:
        console.print(table)
    else:
        console.print("None of the changes memsim simulated makes this job fit.")
    if len(fitting) < len(advice):
        console.print(f"{len(advice) - len(fitting)} more simulated that do not fit (memsim run --json: what_would_fit).")


def render_summary(report: dict, console: Console) -> None:
    """Print the human summary of one simulation report (the DESIGN.md JSON report shape).

    Sections: scenario/model/device header, fits verdict (green or red), memory per rank with
    % of capacity and headroom, on OOM the op, tensor and largest live tensors, breakdown at
    peak of the most loaded rank, iteration time, tokens/s, MFU, where the time went, warnings.
    Missing optional keys are skipped; missing numbers print as "—".

    Args:
        report: the JSON report dict produced by the engine.
        console: where to print (a rich Console).
    """
    _header(report, console)
    _verdict(report, console)
    _rank_table(report, console)
    _host_memory(report, console)
    _oom(report, console)
    _breakdown(report, console)
    _performance(report, console)
    _time_breakdown(report, console)
    _warnings(report, console)
    _what_would_fit(report, console)
