"""Which network operations can interact: the links a lowered collective loads and their connected components.

Under max-min fair sharing a flow's rate depends only on the flows it is connected to through shared
resources, so operations whose footprints (the resources of every flow of every phase) fall into different
components of the union of all footprints never change each other's timing. `interference_components` groups
operations by those components (union-find over resource ids); the engine uses it to drop symmetry shadows
that cannot reach a simulated rank's traffic and to time link-isolated collectives without flows.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

from simulator.network.collectives import CollectiveSchedule, simulate_schedule
from simulator.network.flows import RoutingModel


def footprint(topology: RoutingModel, schedule: CollectiveSchedule) -> tuple[int, ...]:
    """Sorted resource ids any flow of `schedule` loads (a flow's private rate cap is not a shared resource).

    Args:
        topology: the routing model the flows run on.
        schedule: the lowered collective or transfer.

    Returns:
        The resource ids; empty when the schedule moves no bytes over any link.
    """
    return tuple(sorted(pairs_footprint(topology, schedule_pairs(schedule))))


def schedule_pairs(schedule: CollectiveSchedule) -> dict[tuple, None]:
    """The distinct (src, dst) of the flows of `schedule` that move bytes, in order of first appearance."""
    return dict.fromkeys((flow.src, flow.dst) for phase in schedule.phases for flow in phase.flows
                         if flow.size_bytes != 0)


def pairs_footprint(topology: RoutingModel, pairs: Iterable[tuple]) -> set[int]:
    """Resource ids the routes of `pairs` load together (Topology.pairs_resources where the model has it)."""
    fast = getattr(topology, "pairs_resources", None)
    if fast is not None:
        return fast(pairs)
    found: set[int] = set()
    for src, dst in pairs:
        found.update(route_resources(topology, src, dst))
    return found


def route_resources(topology: RoutingModel, src: int, dst: int) -> tuple[int, ...]:
    """Sorted resource ids of the route src -> dst: Topology.route_resources where the model has it (no
    hop names, latency or bottleneck built), else from `route`."""
    fast = getattr(topology, "route_resources", None)
    if fast is not None:
        return fast(src, dst)
    return tuple(r for r, _ in topology.route(src, dst).resources)


def interference_components(footprints: Mapping[Hashable, tuple[int, ...]]) -> dict[Hashable, int]:
    """Component id of every operation: operations share a component when a chain of shared resources joins them.

    Args:
        footprints: operation key -> resource ids it loads (footprint()).

    Returns:
        operation key -> component id (the smallest resource id of the component); -1 for an empty footprint.
        Deterministic: ids depend only on the resources, not on the order of the mapping.
    """
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    # Operations often share one footprint tuple (footprints are cached per group): union each once. The roots
    # do not depend on the order of the unions (every root is its component's smallest id).
    distinct = list({id(resources): resources for resources in footprints.values()}.values())
    get = parent.get
    for resources in distinct:
        root = -1                                 # the least root met so far among `resources`
        for resource in resources:                # (sorted: a new resource is above every root met)
            node = get(resource)
            if node is None:                      # not seen before: join the current root directly
                parent[resource] = resource if root < 0 else root
                if root < 0:
                    root = resource
                continue
            top = parent[node]
            while top != node:                    # find the root ...
                node, top = top, parent[top]
            if parent[resource] != node:
                parent[resource] = node           # ... and point straight at it
            if root < 0:
                root = node
            elif node != root:
                if node < root:
                    parent[root] = node           # the smallest id is the root
                    root = node
                else:
                    parent[node] = root
    roots = {id(resources): find(resources[0]) if resources else -1 for resources in distinct}
    return {key: roots[id(resources)] for key, resources in footprints.items()}


def isolated_duration_s(topology: RoutingModel, schedule: CollectiveSchedule) -> float:
    """Seconds `schedule` takes alone on the network: each phase's latency, then its flows until delivered.

    Args:
        topology: the routing model.
        schedule: the lowered collective.

    Returns:
        The duration, as a FlowNetwork simulation of the schedule alone gives it (0.0 without phases).
    """
    return simulate_schedule(topology, schedule) if schedule.phases else 0.0
