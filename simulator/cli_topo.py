"""`memsim topo`: list topologies, show one's structure, GPU-pair bandwidths and collective bandwidth, draw it."""

from __future__ import annotations

import io
import math
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from simulator.errors import MemsimError

if TYPE_CHECKING:
    from simulator.network.topology import Topology

topo_app = typer.Typer(add_completion=False, no_args_is_help=True,
                       help="Cluster topologies: list them, show their structure and bandwidths, draw them.")

_MAX_DRAWN_SERVERS = 4
# Pair classes in display order: (label, test on the kinds of the route's intermediate nodes).
_PAIR_CLASSES = (
    ("across nodes, through the spine", lambda kinds: "spine" in kinds),
    ("across nodes, same leaf switch", lambda kinds: "leaf" in kinds),
    ("same node, through host memory", lambda kinds: "host_memory" in kinds),
    ("same node, across CPU sockets", lambda kinds: kinds.count("root_complex") > 1),
    ("same node, through a CPU root complex", lambda kinds: "root_complex" in kinds),
    ("same node, over NVSwitch", lambda kinds: "nvswitch" in kinds),
    ("same node, same PCIe switch", lambda kinds: "pcie_switch" in kinds),
    ("same node, direct link", lambda kinds: True),
)
_KIND_STYLE = {  # marker, color, row (y) inside a server drawing
    "gpu": ("s", "#76B900", 0.0), "nvswitch": ("D", "#4C72B0", -1.2), "pcie_switch": ("o", "#DD8452", 1.0),
    "nic": ("^", "#8172B3", 1.8), "root_port": ("o", "#C44E52", 1.2), "root_complex": ("h", "#C44E52", 2.6),
    "host_memory": ("p", "#937860", 3.4), "leaf": ("v", "#55A868", 5.2), "spine": ("v", "#2F6B3F", 6.6),
}
_CLASS_COLOR = {"nvlink": "#76B900", "pcie": "#DD8452", "memory": "#937860", "socket": "#C44E52",
                "network": "#8172B3"}


def _fail(message: str) -> None:
    sys.stderr.write(f"memsim: error: {message}\n")
    raise typer.Exit(2)


def _console() -> Console:
    return Console() if sys.stdout.isatty() else Console(width=120)


def pair_class(topology: Topology, a: int, b: int) -> str:
    """The class of GPU pair (a, b): which kinds of element its route crosses (see _PAIR_CLASSES)."""
    kind = _kind_of(topology)
    kinds = [kind(node) for node in topology.route(a, b).nodes[1:-1]]
    return next(label for label, test in _PAIR_CLASSES if test(kinds))


def _kind_of(topology: Topology) -> Callable[[str], str]:
    names = {c.name: c.kind for c in topology.server.components}

    def kind(node: str) -> str:
        if node.startswith("leaf"):
            return "leaf"
        if node.startswith("spine"):
            return "spine"
        return names.get(node.split("/", 1)[1], "gpu")

    return kind


def representative_pairs(topology: Topology) -> dict[str, tuple[int, int]]:
    """One example GPU pair per class: pairs inside server 0, then from server 0 to servers 1, 2, ... until both
    inter-server classes are found."""
    found: dict[str, tuple[int, int]] = {}
    per = topology.gpus_per_node

    def scan(pairs: Iterable[tuple[int, int]]) -> None:
        for a, b in pairs:
            found.setdefault(pair_class(topology, a, b), (a, b))

    scan((a, b) for a in range(per) for b in range(per) if a != b)
    inter = {"across nodes, through the spine", "across nodes, same leaf switch"}
    for node in range(1, topology.nodes):
        if inter <= found.keys():
            break
        scan((a, node * per + b) for a in range(per) for b in range(per))
    return {label: found[label] for label, _ in _PAIR_CLASSES if label in found}


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:,.1f} GB/s"


def render_topology(topology: Topology, console: Console) -> None:
    """Print structure, GPU-pair bandwidth classes and the all_reduce bus bandwidth at 1 GiB."""
    from simulator.network.collectives import run_collective
    from simulator.units import format_seconds

    device = topology.gpu_device
    console.print(f"[bold]{topology.name}[/bold]: {topology.server.description}")
    console.print(f"GPU {device.name} ({device.display_name}) x {topology.gpus_per_node} per node x "
                  f"{topology.nodes} node(s) = {topology.num_gpus} GPUs")
    if topology.nodes > 1:
        fabric = topology.fabric
        console.print(f"fabric: {'rail-optimized' if fabric.rail_optimized else 'not rail-optimized'} leaf/spine, "
                      f"{topology.leaves} leaves x {fabric.leaf_down_ports} NIC ports, "
                      f"{topology.node_kind_counts().get('spine', 0)} spine(s), oversubscription "
                      f"{fabric.oversubscription:g}:1, {_rate(topology.uplink_bytes_per_s)} per leaf-spine link")
    structure = Table(title="structure")
    structure.add_column("graph nodes by kind")
    structure.add_column("count", justify="right")
    structure.add_column("directed edges by class")
    structure.add_column("count", justify="right")
    nodes = list(topology.node_kind_counts().items())
    edges = list(topology.edge_class_counts().items())
    for i in range(max(len(nodes), len(edges))):
        n = nodes[i] if i < len(nodes) else ("", "")
        e = edges[i] if i < len(edges) else ("", "")
        structure.add_row(n[0], str(n[1]), e[0], str(e[1]))
    console.print(structure)
    pairs = Table(title="GPU pairs (one flow alone, payload per direction)")
    for column in ("class", "example", "path", "bandwidth", "latency"):
        pairs.add_column(column)
    for label, (a, b) in representative_pairs(topology).items():
        route = topology.route(a, b)
        pairs.add_row(label, f"GPU {a} -> GPU {b}", " > ".join(route.nodes), _rate(route.bottleneck_bytes_per_s),
                      format_seconds(route.latency_s))
    console.print(pairs)
    groups = [tuple(range(min(8, topology.num_gpus)))]
    if topology.num_gpus > 8:
        groups.append(tuple(range(topology.num_gpus)))
    collectives = Table(title="all_reduce of 1 GiB, alone (nccl-tests bus bandwidth)")
    for column in ("GPUs", "algorithm", "protocol", "time", "algbw", "busbw"):
        collectives.add_column(column)
    for group in groups:
        result = run_collective(topology, "all_reduce", group, 2**30)
        collectives.add_row(f"{group[0]}-{group[-1]} ({len(group)})", result.algorithm, result.protocol,
                            format_seconds(result.time_s), _rate(result.algbw_bytes_per_s),
                            _rate(result.busbw_bytes_per_s))
    console.print(collectives)


def draw_topology(topology: Topology, path: Path) -> None:
    """Draw the graph (first servers, their leaves, the spines) to a PNG, deterministically and atomically."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    from simulator.io import atomic_write_bytes

    graph = topology.graph
    servers = min(topology.nodes, _MAX_DRAWN_SERVERS)
    kind = _kind_of(topology)
    width = max(8.0, 1.1 * max(topology.gpus_per_node, 4))
    positions: dict[str, tuple[float, float]] = {}
    for node in range(servers):
        rows: dict[str, list[str]] = {}
        for local in [f"gpu{i}" for i in range(topology.gpus_per_node)] + [c.name for c in topology.server.components]:
            rows.setdefault(kind(f"n{node}/{local}"), []).append(local)
        for row_kind, names in rows.items():
            y = _KIND_STYLE[row_kind][2]
            for i, local in enumerate(names):
                positions[f"n{node}/{local}"] = (node * (width + 2) + (i + 0.5) * width / len(names), y)
    total = servers * (width + 2) - 2
    drawn_leaves = sorted({leaf for u, leaf in graph.edges() if u in positions and leaf.startswith("leaf")},
                          key=lambda n: int(n[4:]))
    for i, leaf in enumerate(drawn_leaves):
        positions[leaf] = ((i + 0.5) * total / len(drawn_leaves), _KIND_STYLE["leaf"][2])
    spines = [n for n in graph.nodes if n.startswith("spine")]
    for i, spine in enumerate(spines):
        positions[spine] = ((i + 0.5) * total / len(spines), _KIND_STYLE["spine"][2])
    with matplotlib.rc_context({"font.family": "DejaVu Sans", "font.size": 8, "svg.hashsalt": "memsim"}):
        figure = Figure(figsize=(min(4 + total * 0.9, 40), 6.5), dpi=90)
        axes = figure.add_subplot(1, 1, 1)
        seen: set[tuple[str, str]] = set()
        for u, v, data in graph.edges(data=True):
            if u not in positions or v not in positions or (v, u) in seen:
                continue
            seen.add((u, v))
            (x0, y0), (x1, y1) = positions[u], positions[v]
            line_width = 0.5 + 1.2 * math.log10(max(data["bytes_per_s"] / 1e9, 1.0))
            axes.plot([x0, x1], [y0, y1], color=_CLASS_COLOR[data["link_class"]], linewidth=line_width,
                      zorder=1, alpha=0.8)
        for node, (x, y) in positions.items():
            marker, color, _ = _KIND_STYLE[kind(node)]
            axes.scatter([x], [y], marker=marker, s=140, color=color, edgecolors="black", linewidths=0.5, zorder=2)
            label = node.split("/", 1)[1] if "/" in node else node
            axes.annotate(label, (x, y), textcoords="offset points", xytext=(0, -13), ha="center", fontsize=6)
        low = min(y for _, y in positions.values())
        high = max(y for _, y in positions.values())
        if topology.nodes > 1:
            for node in range(servers):
                axes.text(node * (width + 2) + width / 2, low - 0.8, f"node {node}", ha="center", fontsize=9,
                          weight="bold")
        axes.set_ylim(low - 1.2, high + 0.6)
        handles = [Line2D([0], [0], color=color, linewidth=2, label=name) for name, color in _CLASS_COLOR.items()]
        axes.legend(handles=handles, loc="upper right", fontsize=7, frameon=False)
        shown = f" (first {servers} of {topology.nodes} nodes)" if servers < topology.nodes else ""
        axes.set_title(f"{topology.name}: {topology.num_gpus} x {topology.gpu_device.name}{shown}")
        axes.set_axis_off()
        figure.subplots_adjust(left=0.01, right=0.99, bottom=0.02, top=0.93)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", metadata={"Software": None})
    atomic_write_bytes(path, buffer.getvalue())


@topo_app.command("list")
def list_command() -> None:
    """List the bundled topologies (cluster.topology = NAME)."""
    from simulator.network.topology import list_topologies, load_topology

    for name in list_topologies():
        typer.echo(f"{name:14s} {load_topology(name).server.description}")


@topo_app.command("show")
def show(
    name: Annotated[str, typer.Argument(help="A bundled topology name or a path to a topology TOML file.")],
    nodes: Annotated[int, typer.Option("--nodes", help="Servers joined by the leaf/spine fabric.")] = 1,
    oversubscription: Annotated[Optional[float], typer.Option("--oversubscription",
                                                              help="Leaf downlink / uplink ratio.")] = None,
    rail_optimized: Annotated[Optional[bool], typer.Option("--rail-optimized/--no-rail-optimized",
                                                           help="Rail-optimized fabric.")] = None,
    png: Annotated[Optional[Path], typer.Option("--png", help="Also draw the graph to this PNG file.")] = None,
) -> None:
    """Print a topology's structure, the bandwidth of every class of GPU pair and the all_reduce busbw."""
    from simulator.network.topology import load_topology

    try:
        topology = load_topology(name, nodes=nodes, oversubscription=oversubscription, rail_optimized=rail_optimized)
    except MemsimError as error:
        _fail(str(error))
        return
    if png is not None:
        try:
            draw_topology(topology, png)
        except OSError as error:
            _fail(f"{png}: cannot write the drawing: {error.strerror or error}")
            return
    render_topology(topology, _console())
    if png is not None:
        _console().print(f"wrote {png}")
