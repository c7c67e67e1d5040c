"""The networkx view of a Topology: every node and directed link with its attributes (memsim topo show, tests)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import networkx as nx

from simulator.network.server import _PS, ROUTE_REFERENCE_BYTES
from simulator.network.spec import LinkKind

if TYPE_CHECKING:
    from simulator.network.topology import Topology


def build_graph(topology: Topology) -> nx.DiGraph:
    """Topology.graph: the frozen DiGraph (its docstring lists the attributes)."""
    index = topology._index
    graph = nx.DiGraph(name=topology.name)
    for node in range(topology.nodes):
        for local, (name, kind) in enumerate(zip(index.names, index.kinds)):
            attrs = {"kind": kind, "server": node}
            if kind == "gpu":
                attrs["gpu"] = node * topology.server.gpus + local
            graph.add_node(f"n{node}/{name}", **attrs)
    for leaf in range(topology.leaves):
        graph.add_node(f"leaf{leaf}", kind="leaf", server=None)
    for spine in range(topology._spines):
        graph.add_node(f"spine{spine}", kind="spine", server=None)

    def add(u: str, v: str, link: LinkKind, resource: int) -> None:
        capacity = topology.capacity_bytes_per_s(resource)
        cost = int(round((link.latency_s + ROUTE_REFERENCE_BYTES / capacity) * _PS))
        graph.add_edge(u, v, bytes_per_s=capacity, raw_bytes_per_s=capacity / link.efficiency,
                       efficiency=link.efficiency, latency_s=link.latency_s, link=link.name,
                       link_class=link.link_class, resource=resource, cost_ps=cost, source=link.source)

    for node in range(topology.nodes):
        for u, v, link, res in index.edges:
            add(f"n{node}/{index.names[u]}", f"n{node}/{index.names[v]}", link, node * topology._local_resources + res)
    if topology.nodes > 1:
        link = topology.server.link(topology.fabric.link)
        base = topology._fabric_base
        for node in range(topology.nodes):
            for rail, nic in enumerate(index.nics):
                port, leaf = node * topology.rails + rail, topology.leaf_of(node, rail)
                add(f"n{node}/{index.names[nic]}", f"leaf{leaf}", link, base + 2 * port)
                add(f"leaf{leaf}", f"n{node}/{index.names[nic]}", link, base + 2 * port + 1)
        up = base + 2 * topology.nodes * topology.rails
        for leaf in range(topology.leaves):
            for spine in range(topology._spines):
                add(f"leaf{leaf}", f"spine{spine}", link, up + 2 * (leaf * topology._spines + spine))
                add(f"spine{spine}", f"leaf{leaf}", link, up + 2 * (leaf * topology._spines + spine) + 1)
    return nx.freeze(graph)
