"""Collectives lowered to flows by algorithm (ring, tree, hierarchical, NVLS, direct) and chosen as NCCL does.

A collective becomes a `CollectiveSchedule`: phases run one after another; each phase waits its latency
(NCCL's launch + per-step latency model) and then runs all its flows at once on a `FlowNetwork`. NCCL
pipelines every algorithm in small chunks, so one phase holds the whole pipelined traffic and its time is
set by the most loaded links; `hierarchical` is three phases (intra-node reduce_scatter, inter-node
all_reduce, intra-node all_gather). Sizes follow nccl-tests: the all_reduce buffer, all_gather's output,
reduce_scatter's input, all_to_all's send buffer, the broadcast buffer, the send/recv message.

Bandwidth efficiency comes from two places, both with sources: links carry payload at `bytes_per_s` =
raw rate x efficiency (topologies/*.toml, e.g. NVLink3 20 of 25 GB/s per link from NCCL's topo.h), and
protocols put extra bytes on the wire (`WIRE_EFFICIENCY`: LL sends a 4-byte flag with every 4 data bytes,
LL128 8 flag bytes per 128-byte line, NVLS reaches 0.85 of the link in NCCL's own model). Latencies are
NCCL's (src/graph/tuning.cc, NVIDIA/nccl@b6475625: baseLat + steps x hwLat).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from simulator.errors import TopologyError
from simulator.network.flows import Flow, FlowNetwork
from simulator.network.topology import Topology

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv")
ALGORITHMS = ("ring", "tree", "hierarchical", "nvls", "direct")
PROTOCOLS = ("ll", "ll128", "simple")

# Payload fraction of the bytes a protocol puts on the wire. LL: 8-byte stores of 4 data bytes + a 4-byte flag
# (NCCL src/device/prims_ll.h); LL128: 120 data bytes per 128-byte line (NCCL_LL128_ELEMS_PER_THREAD = 120
# of 128); Simple: plain copies. NVLS: NCCL's nvlsEfficiency for Hopper (src/graph/tuning.cc, NCCL 2.20+).
WIRE_EFFICIENCY = {"ll": 0.5, "ll128": 120 / 128, "simple": 1.0}
NVLS_EFFICIENCY = 0.85
REFERENCE_BYTES = 2**30   # size at which transfer_seconds_per_byte simulates a collective
# NCCL's cap on LL throughput, GB/s of bus bandwidth (src/graph/tuning.cc llMaxBws): one node (Ampere and
# Hopper rows) 87.7; two nodes 22.5, more 19.0 (AMD-host row, as DGX A100).
LL_MAX_BUS_BYTES_PER_S = {1: 87.7e9, 2: 22.5e9, 4: 19.0e9}
# NCCL latencies in microseconds: launch (baseLat) and per step by hardware (hwLat), src/graph/tuning.cc.
_BASE_US = {("tree", "ll"): 6.8, ("tree", "ll128"): 14.0, ("tree", "simple"): 0.0,
            ("ring", "ll"): 6.6, ("ring", "ll128"): 14.0, ("ring", "simple"): 8.4, ("nvls", "simple"): 0.0}
_STEP_US = {
    "nvlink": {("tree", "ll"): 0.6, ("tree", "ll128"): 1.25, ("tree", "simple"): 28.0, ("ring", "ll"): 0.6,
               ("ring", "ll128"): 1.9, ("ring", "simple"): 3.4, ("nvls", "simple"): 23.0},
    "pci": {("tree", "ll"): 1.0, ("tree", "ll128"): 1.9, ("tree", "simple"): 28.0, ("ring", "ll"): 1.0,
            ("ring", "ll128"): 2.5, ("ring", "simple"): 5.7, ("nvls", "simple"): 0.0},
    "net": {("tree", "ll"): 5.0, ("tree", "ll128"): 8.5, ("tree", "simple"): 28.0, ("ring", "ll"): 2.7,
            ("ring", "ll128"): 4.0, ("ring", "simple"): 14.0, ("nvls", "simple"): 18.0},
}


@dataclass(frozen=True)
class Phase:
    """Flows that run together after `latency_s` (NCCL's launch and per-step latency for this part)."""

    flows: tuple[Flow, ...]
    latency_s: float


@dataclass(frozen=True)
class CollectiveSchedule:
    """A collective lowered to phases of flows by one algorithm and protocol."""

    kind: str
    group: tuple[int, ...]
    size_bytes: float
    algorithm: str
    protocol: str
    phases: tuple[Phase, ...]


@dataclass(frozen=True)
class CollectiveResult:
    """A simulated collective: the algorithm and protocol used, its time, algorithm and bus bandwidth."""

    kind: str
    group: tuple[int, ...]
    size_bytes: float
    algorithm: str
    protocol: str
    time_s: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float


@dataclass(frozen=True)
class _Layout:
    """A group by server: GPU ids of each server in id order; `per_node` is 0 when servers hold unequal counts."""

    gpus: tuple[int, ...]
    nodes: tuple[tuple[int, ...], ...]
    per_node: int
    intra: str            # "nvlink" or "pci": NCCL's hardware class of intra-node steps


def bus_factor(kind: str, n: int) -> float:
    """busbw / algbw of nccl-tests for `kind` on n ranks (shared/reference/formulas.md)."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _layout(topology: Topology, group: tuple[int, ...]) -> _Layout:
    """How `group` sits on the servers, remembered per topology and group (it depends on nothing else)."""
    return topology.derived(("layout", group), lambda: _compute_layout(topology, group))


def _compute_layout(topology: Topology, group: tuple[int, ...]) -> _Layout:
    by_node: dict[int, list[int]] = {}
    for gpu in sorted(group):
        by_node.setdefault(topology.node_of_gpu(gpu), []).append(gpu)
    nodes = tuple(tuple(by_node[k]) for k in sorted(by_node))
    counts = {len(gpus) for gpus in nodes}
    pairs = [(a, b) for gpus in nodes for a, b in zip(gpus, gpus[1:] + gpus[:1]) if a != b]
    if not pairs and topology.gpus_per_node > 1:
        pairs = [(0, 1)]     # one GPU per server: NCCL still classifies the server's own GPU links
    # A server-local route depends only on the two local indices: look at the same pair on server 0.
    per = topology.gpus_per_node
    local_pairs = dict.fromkeys((a % per, b % per) for a, b in pairs)
    nvlink = pairs and all(c == "nvlink" for a, b in local_pairs for c in topology.route(a, b).link_classes)
    return _Layout(tuple(sorted(group)), nodes, counts.pop() if len(counts) == 1 else 0,
                   "nvlink" if nvlink else "pci")


def candidates(topology: Topology, kind: str, group: Sequence[int]) -> list[tuple[str, str]]:
    """Every (algorithm, protocol) that can run `kind` on `group`, in a fixed order (choose_algorithm's ties go to
    the earlier): LL128 only where GPUs talk over NVLink and NVLS only with Simple on an NVLS switch, as in NCCL."""
    members = _check(topology, kind, group, 0)
    return list(topology.derived(("candidates", kind, members), lambda: _candidates(topology, kind, members)))


def _candidates(topology: Topology, kind: str, members: tuple[int, ...]) -> tuple[tuple[str, str], ...]:
    layout = _layout(topology, members)
    if kind in ("all_to_all", "send", "recv"):
        return (("direct", "simple"),)
    protocols = ["ll", "ll128", "simple"] if layout.intra == "nvlink" else ["ll", "simple"]
    algorithms = ["ring"]
    if kind == "all_reduce" and layout.per_node:
        algorithms.append("tree")
        if len(layout.nodes) > 1 and layout.per_node > 1:
            algorithms.append("hierarchical")
    found = [(a, p) for a in algorithms for p in protocols]
    if kind in ("all_reduce", "reduce_scatter", "all_gather") and topology.reduction_switch(members):
        found.append(("nvls", "simple"))
    return tuple(found)


def _check(topology: Topology, kind: str, group: Sequence[int], size_bytes: float) -> tuple[int, ...]:
    if kind not in KINDS:
        raise TopologyError(f"collective kind = {kind!r}: must be one of {', '.join(KINDS)}")
    members = tuple(group)
    if not members:
        raise TopologyError(f"{kind}: group = []: must name at least one GPU")
    limit = topology.num_gpus
    for gpu in members:
        is_int = type(gpu) is int or (isinstance(gpu, int) and not isinstance(gpu, bool))    # (plain int first: fast)
        if not is_int or not 0 <= gpu < limit:
            raise TopologyError(f"{kind}: group member {gpu!r} must be a GPU id in 0..{limit - 1}")
    if len(set(members)) != len(members):
        raise TopologyError(f"{kind}: group = {list(members)}: GPU ids must be distinct")
    if kind in ("send", "recv") and len(members) != 2:
        raise TopologyError(f"{kind}: group = {list(members)}: must be (source, destination)")
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, (int, float)) or not math.isfinite(size_bytes) \
            or size_bytes < 0:
        raise TopologyError(f"{kind}: size_bytes = {size_bytes!r} must be a finite number >= 0")
    return members


def _ring_latency_s(kind: str, protocol: str, n: int, nodes: int, intra: str) -> float:
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    if kind == "all_reduce":
        inter = 2 * nodes if nodes > 1 else 0
    else:
        inter = nodes - 1
    inter = min(inter, steps)
    key = ("ring", protocol)
    return 1e-6 * (_BASE_US[key] + (steps - inter) * _STEP_US[intra][key] + inter * _STEP_US["net"][key])


def latency_s(topology: Topology, kind: str, group: Sequence[int], algorithm: str, protocol: str) -> float:
    """NCCL's latency term (launch + steps x per-step latency) for one collective, in seconds."""
    layout = _layout(topology, tuple(group))
    n, nodes, intra = len(layout.gpus), len(layout.nodes), layout.intra
    if algorithm == "ring":
        return _ring_latency_s(kind, protocol, n, nodes, intra)
    if algorithm == "tree":
        key = ("tree", protocol)
        depth = int(math.floor(math.log2(nodes))) if nodes > 1 else 0
        return 1e-6 * (_BASE_US[key] + 2 * ((layout.per_node - 1) * _STEP_US[intra][key]
                                            + depth * _STEP_US["net"][key]))
    if algorithm == "nvls":
        return 1e-6 * _STEP_US[intra][("nvls", "simple")]
    if algorithm == "hierarchical":
        per = layout.per_node
        return (_ring_latency_s("reduce_scatter", protocol, per, 1, intra)
                + _ring_latency_s("all_reduce", protocol, nodes, nodes, intra)
                + _ring_latency_s("all_gather", protocol, per, 1, intra))
    hardware = "net" if nodes > 1 else intra
    return 1e-6 * (_BASE_US[("ring", "simple")] + _STEP_US[hardware][("ring", "simple")])


def _ll_cap(protocol: str, nodes: int, flows_per_gpu: int) -> float | None:
    if protocol != "ll":
        return None
    bound = LL_MAX_BUS_BYTES_PER_S[1 if nodes == 1 else 2 if nodes == 2 else 4]
    return bound / max(flows_per_gpu, 1)


def _rings(layout: _Layout) -> list[tuple[int, ...]]:
    """Ring orders, one per channel. Across servers, channel c enters server k at local index (c - k) mod L and
    leaves at the one before it, so every hop between servers joins GPUs of the same rail (NIC)."""
    if len(layout.nodes) == 1 or not layout.per_node:
        return [layout.gpus]
    per = layout.per_node
    rings = []
    for channel in range(per):
        order: list[int] = []
        for k, gpus in enumerate(layout.nodes):
            entry = (channel - k) % per
            order.extend(gpus[(entry + j) % per] for j in range(per))
        rings.append(tuple(order))
    return rings


def _ring_phase(kind: str, layout: _Layout, size_bytes: float, protocol: str, root: int) -> list[Flow]:
    rings = _rings(layout)
    share = size_bytes / len(rings) / WIRE_EFFICIENCY[protocol]
    cap = _ll_cap(protocol, len(layout.nodes), len(rings))
    flows = []
    for ring in rings:
        n = len(ring)
        if kind == "broadcast":
            start = ring.index(root)
            order = ring[start:] + ring[:start]
            flows.extend(Flow(order[i], order[i + 1], share, cap, f"{kind}/ring") for i in range(n - 1))
            continue
        per_gpu = share * (2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n)
        flows.extend(Flow(ring[i], ring[(i + 1) % n], per_gpu, cap, f"{kind}/ring") for i in range(n))
    return flows


def _in_order_parent(j: int) -> int:
    """Parent of 1-based position j in the infinite in-order binary tree (height = trailing zeros of j)."""
    height = (j & -j).bit_length() - 1
    odd = j >> height
    return j - (1 << height) if ((odd - 1) // 2) % 2 == 1 else j + (1 << height)


def binary_tree_parents(n: int) -> list[int]:
    """Parent of every position 0..n-1 in an in-order binary tree (-1 for the root).

    Position i (1-based j = i + 1) sits at height = trailing zeros of j, so the even positions are leaves and
    the mirrored tree (position n-1-i) of an even n has them inside: the two trees of a double binary tree
    (Sanders, Speck and Traeff 2009, as NCCL's trees) load every position's links about equally. A parent
    beyond n is skipped for the next ancestor, which then has at most two children.
    """
    return list(_tree_parents(n))


@functools.lru_cache(maxsize=64)
def _tree_parents(n: int) -> tuple[int, ...]:
    """binary_tree_parents(n), remembered (every collective over n servers builds the same trees)."""
    top = 1 << (n.bit_length() - 1) if n else 0
    parents = []
    for j in range(1, n + 1):
        if j == top:
            parents.append(-1)
            continue
        parent = _in_order_parent(j)
        while parent > n:
            parent = _in_order_parent(parent)
        parents.append(parent - 1)
    return tuple(parents)


def _tree_phase(layout: _Layout, size_bytes: float, protocol: str) -> list[Flow]:
    per, nodes = layout.per_node, len(layout.nodes)
    channels = per if nodes > 1 else 1
    base = _tree_parents(nodes)
    if nodes > 1 and nodes % 2 == 0:
        mirrored = [nodes - 1 - base[nodes - 1 - i] if base[nodes - 1 - i] >= 0 else -1 for i in range(nodes)]
    else:
        mirrored = [(base[(i + 1) % nodes] - 1) % nodes if base[(i + 1) % nodes] >= 0 else -1 for i in range(nodes)]
    trees = [base, mirrored] if nodes > 1 else [base]
    share = size_bytes / (channels * len(trees)) / WIRE_EFFICIENCY[protocol]
    cap = _ll_cap(protocol, nodes, 2 * channels * len(trees))
    flows = []
    for channel in range(channels):
        chains = [tuple(gpus[(channel + j) % per] for j in range(per)) for gpus in layout.nodes]
        for parents in trees:
            for chain in chains:
                for j in range(per - 1):
                    flows.append(Flow(chain[j + 1], chain[j], share, cap, "all_reduce/tree-up"))
                    flows.append(Flow(chain[j], chain[j + 1], share, cap, "all_reduce/tree-down"))
            for child, parent in enumerate(parents):
                if parent >= 0:
                    flows.append(Flow(chains[child][0], chains[parent][0], share, cap, "all_reduce/tree-up"))
                    flows.append(Flow(chains[parent][0], chains[child][0], share, cap, "all_reduce/tree-down"))
    return flows


def _nvls_phase(kind: str, topology: Topology, layout: _Layout, size_bytes: float) -> list[Flow]:
    switch = topology.reduction_switch(layout.gpus)
    n = len(layout.gpus)
    wire = size_bytes / NVLS_EFFICIENCY
    # all_reduce: the switch reads every GPU's n slices (multimem.ld_reduce) and multicasts n reduced slices
    # (multimem.st); each GPU also receives its reduced slice and stores it back: S(n+1)/n each way.
    up, down = {"all_reduce": (wire * (n + 1) / n, wire * (n + 1) / n),
                "reduce_scatter": (wire, wire / n), "all_gather": (wire / n, wire)}[kind]
    flows = []
    for gpu in layout.gpus:
        flows.append(Flow(gpu, switch, up, None, f"{kind}/nvls-up"))
        flows.append(Flow(switch, gpu, down, None, f"{kind}/nvls-down"))
    return flows


def _resolve(topology: Topology, kind: str, members: tuple[int, ...], size_bytes: float, algorithm: str | None,
             protocol: str | None) -> tuple[str, str]:
    allowed = candidates(topology, kind, members)
    if algorithm is None or protocol is None:
        options = [pair for pair in allowed
                   if (algorithm is None or pair[0] == algorithm) and (protocol is None or pair[1] == protocol)]
        if len(options) == 1:
            return options[0]          # the fastest of one (no need to time it)
        if options:
            return _fastest(topology, kind, members, size_bytes, options)
    if (algorithm, protocol) not in allowed:
        raise TopologyError(f"{kind} on GPUs {list(members)} of {topology.name}: algorithm = {algorithm!r}, "
                            f"protocol = {protocol!r} is not available; allowed: "
                            + ", ".join(f"{a}/{p}" for a, p in allowed))
    return algorithm, protocol


def lower_collective(topology: Topology, kind: str, group: Sequence[int], size_bytes: float,
                     algorithm: str | None = None, protocol: str | None = None) -> CollectiveSchedule:
    """Lower a collective to phases of flows.

    Args:
        topology: the cluster.
        kind: one of KINDS.
        group: the participating GPU ids (for broadcast the first is the root; for send/recv (src, dst)).
        size_bytes: the collective's size in nccl-tests' convention (module docstring).
        algorithm: one of ALGORITHMS, or None to choose as NCCL does (choose_algorithm).
        protocol: one of PROTOCOLS, or None (with algorithm None: chosen; otherwise the fastest for it).

    Returns:
        The schedule; no phases for a single GPU or zero bytes.
    """
    members = _check(topology, kind, group, size_bytes)
    algorithm, protocol = _resolve(topology, kind, members, size_bytes, algorithm, protocol)
    if len(members) == 1 or size_bytes == 0:
        return CollectiveSchedule(kind, members, size_bytes, algorithm, protocol, ())
    layout = _layout(topology, members)
    latency = latency_s(topology, kind, members, algorithm, protocol)
    if algorithm == "ring":
        phases = [Phase(tuple(_ring_phase(kind, layout, size_bytes, protocol, members[0])), latency)]
    elif algorithm == "tree":
        phases = [Phase(tuple(_tree_phase(layout, size_bytes, protocol)), latency)]
    elif algorithm == "nvls":
        phases = [Phase(tuple(_nvls_phase(kind, topology, layout, size_bytes)), latency)]
    elif algorithm == "hierarchical":
        phases = _hierarchical(layout, size_bytes, protocol)
    else:
        wire = size_bytes / WIRE_EFFICIENCY[protocol]
        if kind == "all_to_all":
            n = len(members)
            flows = [Flow(a, b, wire / n, None, "all_to_all/direct") for a in members for b in members if a != b]
        else:
            flows = [Flow(members[0], members[1], wire, None, f"{kind}/direct")]
        phases = [Phase(tuple(flows), latency)]
    return CollectiveSchedule(kind, members, size_bytes, algorithm, protocol, tuple(phases))


def _hierarchical(layout: _Layout, size_bytes: float, protocol: str) -> list[Phase]:
    per, nodes = layout.per_node, len(layout.nodes)
    wire = size_bytes / WIRE_EFFICIENCY[protocol]
    intra = [Flow(g[i], g[(i + 1) % per], wire * (per - 1) / per, _ll_cap(protocol, 1, 1), "all_reduce/hier-intra")
             for g in layout.nodes for i in range(per)]
    rails = [tuple(g[j] for g in layout.nodes) for j in range(per)]
    inter = [Flow(r[i], r[(i + 1) % nodes], wire / per * 2 * (nodes - 1) / nodes, _ll_cap(protocol, nodes, 1),
                  "all_reduce/hier-inter") for r in rails for i in range(nodes)]
    return [Phase(tuple(intra), _ring_latency_s("reduce_scatter", protocol, per, 1, layout.intra)),
            Phase(tuple(inter), _ring_latency_s("all_reduce", protocol, nodes, nodes, layout.intra)),
            Phase(tuple(intra), _ring_latency_s("all_gather", protocol, per, 1, layout.intra))]


def simulate_schedule(topology: Topology, schedule: CollectiveSchedule) -> float:
    """Run a schedule alone on a fresh FlowNetwork; returns its duration in seconds."""
    network = FlowNetwork(topology)
    for phase in schedule.phases:
        network.advance(network.now_s + phase.latency_s)
        network.start_many(phase.flows, with_latency=False)
        network.advance_ids(math.inf)
    return network.now_s


def transfer_seconds_per_byte(topology: Topology, kind: str, group: Sequence[int], algorithm: str,
                              protocol: str) -> float:
    """Seconds per byte of the bandwidth part of a collective, simulated once per topology and remembered.

    Alone on the network, max-min rates do not depend on flow sizes, so every event time scales with the
    size: time(size) = latency + size x this. The simulation runs at REFERENCE_BYTES on a FlowNetwork.
    Groups whose schedules have the same shape (`_schedule_shape`) share one simulation: the flow network
    would do the same float operations for them.
    """
    members = tuple(group)

    def simulate() -> float:
        schedule = lower_collective(topology, kind, members, REFERENCE_BYTES, algorithm, protocol)
        bare = CollectiveSchedule(kind, members, REFERENCE_BYTES, algorithm, protocol,
                                  tuple(Phase(phase.flows, 0.0) for phase in schedule.phases))
        return topology.derived(("collective shape", _schedule_shape(topology, bare)),
                                lambda: simulate_schedule(topology, bare) / REFERENCE_BYTES)

    return topology.derived(("collective", kind, members, algorithm, protocol), simulate)


def _schedule_shape(topology: Topology, schedule: CollectiveSchedule) -> tuple:
    """What `simulate_schedule` depends on, with resource ids renumbered in their own order.

    A FlowNetwork run without latencies sees, per phase and in start order, each flow's size, rate cap and route
    uses; resource ids only as keys and through their order (heap ties), and their capacities. Two schedules
    with equal shapes therefore give the same float operations and the same duration.
    """
    route_uses = getattr(topology, "route_uses", None)
    if route_uses is None:
        def route_uses(src, dst):
            return topology.route(src, dst).resources
    routes = [[route_uses(flow.src, flow.dst) for flow in phase.flows] for phase in schedule.phases]
    ids = sorted({resource for phase in routes for uses in phase for resource, _ in uses})
    number = {resource: i for i, resource in enumerate(ids)}
    phases = tuple(
        (phase.latency_s, tuple((flow.size_bytes, flow.max_bytes_per_s,
                                 tuple((number[resource], count) for resource, count in uses))
                                for flow, uses in zip(phase.flows, phase_routes)))
        for phase, phase_routes in zip(schedule.phases, routes))
    return phases, tuple(topology.capacity_bytes_per_s(resource) for resource in ids)


def _time_s(topology: Topology, kind: str, members: tuple[int, ...], size_bytes: float, algorithm: str,
            protocol: str) -> float:
    if len(members) == 1 or size_bytes == 0:
        return 0.0
    return (latency_s(topology, kind, members, algorithm, protocol)
            + size_bytes * transfer_seconds_per_byte(topology, kind, members, algorithm, protocol))


def _fastest(topology: Topology, kind: str, group: tuple[int, ...], size_bytes: float,
             options: list[tuple[str, str]]) -> tuple[str, str]:
    times = [(_time_s(topology, kind, group, size_bytes, a, p), order) for order, (a, p) in enumerate(options)]
    return options[min(times)[1]]


def choose_algorithm(topology: Topology, kind: str, group: Sequence[int], size_bytes: float) -> tuple[str, str]:
    """Pick (algorithm, protocol) as NCCL does: the fastest candidate under the model (latency + bandwidth).

    NCCL estimates every algorithm/protocol pair from its latency and bandwidth tables and runs the fastest;
    memsim does the same with its own model (NCCL's latencies, bandwidth simulated on the topology).
    Ties go to the earlier candidate (ring before tree, LL before LL128 before Simple).
    """
    members = _check(topology, kind, group, size_bytes)
    return _fastest(topology, kind, members, size_bytes, candidates(topology, kind, members))


def run_collective(topology: Topology, kind: str, group: Sequence[int], size_bytes: float,
                   algorithm: str | None = None, protocol: str | None = None) -> CollectiveResult:
    """Simulate one collective alone on the topology; returns time and nccl-tests algorithm/bus bandwidth.

    Args:
        topology: the cluster.
        kind: one of KINDS.
        group: participating GPU ids.
        size_bytes: size in nccl-tests' convention.
        algorithm: force an algorithm (default: choose_algorithm).
        protocol: force a protocol (default: the fastest available).

    Returns:
        The result; time 0.0 and infinite algbw for one GPU or zero bytes (busbw 0.0 where nccl-tests'
        factor is 0, i.e. one GPU).
    """
    members = _check(topology, kind, group, size_bytes)
    algorithm, protocol = _resolve(topology, kind, members, size_bytes, algorithm, protocol)
    time_s = _time_s(topology, kind, members, size_bytes, algorithm, protocol)
    algbw = size_bytes / time_s if time_s > 0 else math.inf
    factor = bus_factor(kind, len(members))
    return CollectiveResult(kind, members, size_bytes, algorithm, protocol, time_s,
                            algbw, algbw * factor if factor > 0 else 0.0)


def collective_time_s(topology: Topology, kind: str, group: Sequence[int], size_bytes: float,
                      algorithm: str | None = None, protocol: str | None = None) -> float:
    """Seconds one collective takes alone on the topology: `run_collective(...).time_s` (same arguments)."""
    return run_collective(topology, kind, group, size_bytes, algorithm, protocol).time_s
