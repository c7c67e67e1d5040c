"""Topologies as graphs: servers from topologies/*.toml joined by a leaf/spine fabric, with resources and routes.

A `Topology` is N copies of one server (GPU ids 0..N*G-1 in node-major order) and, for N > 1, a two-level
leaf/spine fabric. Every directed link is backed by a *resource* (an integer id with a payload capacity in
bytes/s); both directions of host-memory links map to one shared resource, because DRAM reads and writes
share the same channels. Routes are shortest paths by the cost `latency_s + 1 MiB / bytes_per_s` (integer
picoseconds, so ties are exact) with GPUs never used as transit; ties go to the lexicographically smallest
node sequence. Between servers a GPU leaves and enters through its own NIC (`nic_of_gpu`, the PCIe-nearest
NIC as NCCL picks it); leaves talk through the spine chosen by a fixed hash of the two NIC ports (ECMP).
Routes are computed once per (source, destination) and cached.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING


from simulator.errors import TopologyError
from simulator.hardware.catalog import DeviceSpec, get_device
from simulator.network.server import ServerIndex
from simulator.network.spec import FabricSpec, LinkKind, ServerSpec, read_server, validate_fabric

if TYPE_CHECKING:
    import networkx as nx

_ENDPOINT = re.compile(r"^n(\d+)/(.+)$")


@dataclass(frozen=True)
class Route:
    """A path through the topology: node names, the resources it loads (id, uses), latency, bottleneck."""

    nodes: tuple[str, ...]
    resources: tuple[tuple[int, int], ...]   # sorted by resource id; uses > 1 when a shared resource repeats
    latency_s: float
    bottleneck_bytes_per_s: float            # inf for an empty route (source == destination)
    link_classes: tuple[str, ...]            # class of every hop, in order


@dataclass(frozen=True)
class _Constants:
    """Numbers of a Topology that the hot paths (resource ids, capacities) read many times, computed once."""

    gpus: int                 # per server
    rails: int
    nodes: int
    local_count: int          # resources per server
    base: int                 # first fabric resource id (NIC ports)
    spines: int
    nic_end: int              # first leaf <-> spine resource id
    resource_count: int
    nic_bytes_per_s: float
    uplink_bytes_per_s: float
    rail_optimized: bool
    leaf_down_ports: int


@dataclass(frozen=True, eq=False)
class Topology:
    """N copies of a server joined by a leaf/spine fabric: GPUs, resources, routes and the networkx graph."""

    server: ServerSpec
    fabric: FabricSpec          # fabric.nodes servers; the fabric is used only when there are two or more
    _index: ServerIndex = field(init=False, repr=False, compare=False)
    _routes: dict = field(init=False, repr=False, compare=False)
    _derived: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate_fabric(self.fabric, self.server.path)
        index = ServerIndex(self.server)
        if self.nodes > 1 and not index.nics:
            raise TopologyError(f"{self.server.path}: nodes = {self.nodes}: the server has no NIC to join a fabric")
        if self.nodes > 1 and not self.fabric.rail_optimized and self.fabric.leaf_down_ports < len(index.nics):
            raise TopologyError(f"{self.server.path}: fabric.leaf_down_ports = {self.fabric.leaf_down_ports}: must be "
                                f"at least the NICs per node ({len(index.nics)}) when rail_optimized = false")
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_routes", {})
        object.__setattr__(self, "_derived", {})

    def derived(self, key: tuple, compute: Callable[[], object]) -> object:
        """A value computed from this topology alone, remembered under `key` (e.g. a collective's cost per byte)."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    # ----- sizes and names -------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The topology's name (the TOML `name`)."""
        return self.server.name

    @property
    def nodes(self) -> int:
        """Servers in the cluster."""
        return self.fabric.nodes

    @property
    def gpus_per_node(self) -> int:
        """GPUs in one server."""
        return self.server.gpus

    @property
    def num_gpus(self) -> int:
        """GPUs in the whole cluster."""
        return self.nodes * self.server.gpus

    @property
    def gpu_device(self) -> DeviceSpec:
        """The catalog spec of the GPU type."""
        return get_device(self.server.gpu)

    @property
    def rails(self) -> int:
        """NICs per server (each is one rail of a rail-optimized fabric)."""
        return len(self._index.nics)

    @property
    def resource_count(self) -> int:
        """Number of resources (capacity-carrying link directions or shared links)."""
        return self._fabric_base + self._nic_resources + 2 * self.leaves * self._spines

    def gpu_name(self, gpu: int) -> str:
        """Graph node name of GPU id `gpu`, e.g. "n1/gpu3"."""
        self._check_gpu(gpu)
        return f"n{gpu // self.server.gpus}/gpu{gpu % self.server.gpus}"

    def node_of_gpu(self, gpu: int) -> int:
        """The server index holding GPU id `gpu`."""
        self._check_gpu(gpu)
        return gpu // self.server.gpus

    def rail_of_gpu(self, gpu: int) -> int:
        """Index of the NIC GPU `gpu` uses to leave its server (-1 without NICs)."""
        self._check_gpu(gpu)
        return self._index.gpu_rail[gpu % self.server.gpus]

    def _check_gpu(self, gpu: int) -> None:
        if isinstance(gpu, bool) or not isinstance(gpu, int) or not 0 <= gpu < self.num_gpus:
            raise TopologyError(f"topology {self.name}: GPU id {gpu!r} must be an integer in 0..{self.num_gpus - 1}")

    # ----- fabric layout ---------------------------------------------------------------------------------------
    @property
    def _local_resources(self) -> int:
        return len(self._index.capacities)

    @property
    def _fabric_base(self) -> int:
        return self.nodes * self._local_resources

    @property
    def _nic_resources(self) -> int:
        return 2 * self.nodes * self.rails if self.nodes > 1 else 0

    @property
    def _spines(self) -> int:
        return self.fabric.spines if self.leaves > 1 else 0

    @property
    def leaves(self) -> int:
        """Leaf switches of the fabric (0 for one server)."""
        if self.nodes == 1:
            return 0
        if self.fabric.rail_optimized:
            return -(-self.nodes // self.fabric.leaf_down_ports) * self.rails
        per_leaf = self.fabric.leaf_down_ports // self.rails
        return -(-self.nodes // per_leaf)

    def leaf_of(self, node: int, rail: int) -> int:
        """The leaf switch NIC `rail` of server `node` plugs into."""
        if self.fabric.rail_optimized:
            return (node // self.fabric.leaf_down_ports) * self.rails + rail
        return node // (self.fabric.leaf_down_ports // self.rails)

    @property
    def uplink_bytes_per_s(self) -> float:
        """Payload capacity of one leaf -> spine resource (leaf downlink capacity / oversubscription / spines)."""
        link = self.server.link(self.fabric.link)
        return self.fabric.leaf_down_ports * link.bytes_per_s / self.fabric.oversubscription / max(self._spines, 1)

    def capacity_bytes_per_s(self, resource: int) -> float:
        """Payload capacity of a resource id."""
        k = self._constants()
        if resource < 0 or resource >= k.resource_count:
            raise TopologyError(f"topology {self.name}: resource {resource} out of range 0..{k.resource_count - 1}")
        if resource < k.base:
            return self._index.capacities[resource % k.local_count]
        if resource < k.nic_end:
            return k.nic_bytes_per_s
        return k.uplink_bytes_per_s

    def local_offset(self, node: int) -> int:
        """What to add to the id of a link inside server 0 to get the same link inside server `node`.

        Server-local resource ids are numbered server by server (`node * resources per server + local id`), so a
        route between two components of one server is that of server 0 shifted by this offset.
        """
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.nodes:
            raise TopologyError(f"topology {self.name}: node = {node!r} must be an integer in 0..{self.nodes - 1}")
        return node * self._local_resources

    def _constants(self) -> _Constants:
        """The topology's `_Constants` (computed on first use)."""
        found = self._derived.get("constants")
        if found is None:
            fabric = self.fabric
            found = self._derived["constants"] = _Constants(
                self.server.gpus, self.rails, self.nodes, self._local_resources, self._fabric_base, self._spines,
                self._fabric_base + self._nic_resources, self.resource_count,
                self.server.link(fabric.link).bytes_per_s, self.uplink_bytes_per_s, fabric.rail_optimized,
                fabric.leaf_down_ports)
        return found

    # ----- routes ----------------------------------------------------------------------------------------------
    def _endpoint(self, point: int | str) -> tuple[int, int]:
        if type(point) is int:                  # the usual case first
            k = self._constants()
            if 0 <= point < k.gpus * k.nodes:
                return divmod(point, k.gpus)
        if isinstance(point, int) and not isinstance(point, bool):
            self._check_gpu(point)
            return point // self.server.gpus, point % self.server.gpus
        match = _ENDPOINT.match(point) if isinstance(point, str) else None
        if match:
            node, local = int(match.group(1)), self._index.index.get(match.group(2))
            if node < self.nodes and local is not None:
                return node, local
        hint = ""
        if isinstance(point, str) and match and int(match.group(1)) < self.nodes:
            close = difflib.get_close_matches(match.group(2), self._index.names, n=1)
            hint = f" (did you mean 'n{match.group(1)}/{close[0]}'?)" if close else ""
        raise TopologyError(f"topology {self.name}: endpoint {point!r} must be a GPU id or 'n<node>/<component>' "
                            f"with node < {self.nodes}{hint}")

    def route(self, src: int | str, dst: int | str) -> Route:
        """The cached route from `src` to `dst` (GPU ids or names like "n0/gpu3", "n1/mem0").

        Args:
            src: GPU id or server-component name.
            dst: GPU id or server-component name.

        Returns:
            The Route; an empty one when src and dst are the same element.
        """
        key = (src, dst)
        found = self._routes.get(key)
        if found is None:
            found = self._compute_route(self._endpoint(src), self._endpoint(dst))
            self._routes[key] = found
        return found

    def route_resources(self, src: int | str, dst: int | str) -> tuple[int, ...]:
        """The resource ids `route(src, dst)` loads, sorted (its `resources` without the use counts).

        Cheaper than `route` when only the links matter (interference analysis of many shadow operations):
        no hop names, latency or bottleneck are built, and server-local paths are cached per (src, dst) pair
        of local components.
        """
        return self.derived(("route_resources", src, dst),
                            lambda: tuple(resource for resource, _ in self.route_uses(src, dst)))

    def route_uses(self, src: int | str, dst: int | str) -> tuple[tuple[int, int], ...]:
        """`route(src, dst).resources` — (resource id, times crossed), sorted — without building the route."""
        return self.derived(("route_uses", src, dst), lambda: self._uses(src, dst))

    def pairs_resources(self, pairs: Iterable[tuple[int | str, int | str]]) -> set[int]:
        """The resource ids the routes of all `pairs` (src, dst) load together: the union of their `route_resources`,
        from each pair's hops as `route` would find them, remembered per pair unsorted (interference analysis of
        many shadow operations)."""
        found: set[int] = set()
        endpoint, compute = self._endpoint, self._compute_resources
        known = self._derived.get("pair_resources")
        if known is None:
            known = self._derived["pair_resources"] = {}      # (src, dst) -> its resource ids, unsorted
        get = known.get
        k = self._constants()
        gpus, count = k.gpus, k.gpus * k.nodes
        for pair in pairs:
            ids = get(pair)
            if ids is None:
                src, dst = pair
                if type(src) is int and type(dst) is int and 0 <= src < count and 0 <= dst < count:
                    ids = compute(divmod(src, gpus), divmod(dst, gpus))    # (`_endpoint` of GPU ids)
                else:
                    ids = compute(endpoint(src), endpoint(dst))
                known[pair] = ids
            found.update(ids)
        return found

    def route_latency_s(self, src: int | str, dst: int | str) -> float:
        """`route(src, dst).latency_s` without building the route: the same hop latencies summed in the same order."""
        route = self._routes.get((src, dst))
        if route is not None:
            return route.latency_s
        return self.derived(("route_latency", src, dst),
                            lambda: self._compute_latency(self._endpoint(src), self._endpoint(dst)))

    def _compute_latency(self, a: tuple[int, int], b: tuple[int, int]) -> float:
        """`_compute_route(a, b).latency_s`: every hop's latency in the order `_compute_route` lists the hops."""
        index = self._index

        def local(src: int, dst: int) -> list[float]:
            return [link.latency_s for link in self._local_edges(src, dst, 2)]

        if a[0] == b[0]:
            return sum(local(a[1], b[1]))
        gpus = self.server.gpus
        out_rail = index.gpu_rail[a[1]] if a[1] < gpus else index.nearest_rail(a[1], True)
        in_rail = index.gpu_rail[b[1]] if b[1] < gpus else index.nearest_rail(b[1], False)
        wire = self.server.link(self.fabric.link).latency_s
        hops = local(a[1], index.nics[out_rail]) + [wire]
        if self.leaf_of(a[0], out_rail) != self.leaf_of(b[0], in_rail):
            hops += [wire, wire]
        hops.append(wire)
        return sum(hops + local(index.nics[in_rail], b[1]))

    def _uses(self, src: int | str, dst: int | str) -> tuple[tuple[int, int], ...]:
        route = self._routes.get((src, dst))
        if route is not None:
            return route.resources
        ids = self._derived.get("pair_resources", {}).get((src, dst))     # (pairs_resources found them already)
        uses: dict[int, int] = {}
        for resource in self._resource_list(src, dst) if ids is None else ids:
            uses[resource] = uses.get(resource, 0) + 1
        return tuple(sorted(uses.items()))

    def _resource_list(self, src: int | str, dst: int | str) -> list[int]:
        """The resource id of every hop of `route(src, dst)`, in no particular order (repeats kept)."""
        return self._compute_resources(self._endpoint(src), self._endpoint(dst))

    def _compute_resources(self, a: tuple[int, int], b: tuple[int, int]) -> list[int]:
        """`_compute_route`'s resource id of every hop (the same multiset; repeats kept, not sorted)."""
        index = self._index
        k = self._constants()
        gpus, rails, nodes, local_count, base, spines = k.gpus, k.rails, k.nodes, k.local_count, k.base, k.spines

        def local(node: int, src: int, dst: int) -> list[int]:
            return [node * local_count + res for res in self._local_edges(src, dst, 3)]

        if a[0] == b[0]:
            ids = local(a[0], a[1], b[1])
        else:
            out_rail = index.gpu_rail[a[1]] if a[1] < gpus else index.nearest_rail(a[1], True)
            in_rail = index.gpu_rail[b[1]] if b[1] < gpus else index.nearest_rail(b[1], False)
            ids = local(a[0], a[1], index.nics[out_rail])
            port_a, port_b = a[0] * rails + out_rail, b[0] * rails + in_rail
            if k.rail_optimized:       # leaf_of
                per_leaf = k.leaf_down_ports
                leaf_a, leaf_b = (a[0] // per_leaf) * rails + out_rail, (b[0] // per_leaf) * rails + in_rail
            else:
                per_leaf = k.leaf_down_ports // rails
                leaf_a, leaf_b = a[0] // per_leaf, b[0] // per_leaf
            ids.append(base + 2 * port_a)
            if leaf_a != leaf_b:
                spine = (port_a + port_b) % spines
                up = base + 2 * nodes * rails
                ids += [up + 2 * (leaf_a * spines + spine), up + 2 * (leaf_b * spines + spine) + 1]
            ids.append(base + 2 * port_b + 1)
            ids += local(b[0], index.nics[in_rail], b[1])
        return ids

    def _local_edges(self, src: int, dst: int, field: int) -> list:
        """Field `field` (2: the link, 3: the resource id on server 0) of every edge of the server-local path
        src -> dst, in path order, remembered."""
        index = self._index
        return self.derived(("local_edges", field, src, dst),
                            lambda: [index.edges[e][field] for e in index.edge_path(src, dst)])

    def _compute_route(self, a: tuple[int, int], b: tuple[int, int]) -> Route:
        index = self._index
        hops: list[tuple[str, str, int, LinkKind]] = []

        def local(node: int, src: int, dst: int) -> None:
            for e in index.edge_path(src, dst):
                u, v, link, res = index.edges[e]
                hops.append((f"n{node}/{index.names[u]}", f"n{node}/{index.names[v]}",
                             node * self._local_resources + res, link))

        if a[0] == b[0]:
            local(a[0], a[1], b[1])
        else:
            out_rail = index.gpu_rail[a[1]] if a[1] < self.server.gpus else index.nearest_rail(a[1], True)
            in_rail = index.gpu_rail[b[1]] if b[1] < self.server.gpus else index.nearest_rail(b[1], False)
            link = self.server.link(self.fabric.link)
            local(a[0], a[1], index.nics[out_rail])
            port_a, port_b = a[0] * self.rails + out_rail, b[0] * self.rails + in_rail
            leaf_a, leaf_b = self.leaf_of(a[0], out_rail), self.leaf_of(b[0], in_rail)
            nic_a = f"n{a[0]}/{index.names[index.nics[out_rail]]}"
            nic_b = f"n{b[0]}/{index.names[index.nics[in_rail]]}"
            base = self._fabric_base
            hops.append((nic_a, f"leaf{leaf_a}", base + 2 * port_a, link))
            if leaf_a != leaf_b:
                spine = (port_a + port_b) % self._spines
                up = base + 2 * self.nodes * self.rails
                hops.append((f"leaf{leaf_a}", f"spine{spine}", up + 2 * (leaf_a * self._spines + spine), link))
                hops.append((f"spine{spine}", f"leaf{leaf_b}", up + 2 * (leaf_b * self._spines + spine) + 1, link))
            hops.append((f"leaf{leaf_b}", nic_b, base + 2 * port_b + 1, link))
            local(b[0], index.nics[in_rail], b[1])
        uses: dict[int, int] = {}
        for _, _, res, _ in hops:
            uses[res] = uses.get(res, 0) + 1
        nodes = tuple([hops[0][0]] + [h[1] for h in hops]) if hops else (self._name(a),)
        fabric_base, local_count = self._fabric_base, self._local_resources
        nic_end = fabric_base + self._nic_resources
        capacities = index.capacities

        def capacity(r: int) -> float:     # capacity_bytes_per_s for ids known to be in range
            if r < fabric_base:
                return capacities[r % local_count]
            return link.bytes_per_s if r < nic_end else self.uplink_bytes_per_s

        link = self.server.link(self.fabric.link)
        bottleneck = min((capacity(r) / n for r, n in uses.items()), default=math.inf)
        return Route(nodes, tuple(sorted(uses.items())), sum(h[3].latency_s for h in hops), bottleneck,
                     tuple(h[3].link_class for h in hops))

    def _name(self, point: tuple[int, int]) -> str:
        return f"n{point[0]}/{self._index.names[point[1]]}"

    def route_cost_ps(self, route: Route) -> int:
        """The routing cost of a route (sum over hops of latency + 1 MiB / bandwidth, integer picoseconds)."""
        graph = self.graph
        return sum(graph.edges[u, v]["cost_ps"] for u, v in zip(route.nodes, route.nodes[1:]))

    # ----- features used by collectives ------------------------------------------------------------------------
    def reduction_switch(self, gpus: Sequence[int]) -> str | None:
        """The NVLS-capable switch every GPU of `gpus` links to directly, if they share one server and one exists."""
        if not gpus:
            return None
        nodes = {self.node_of_gpu(g) for g in gpus}
        if len(nodes) != 1:
            return None
        index = self._index
        locals_ = [g % self.server.gpus for g in gpus]
        for position, component in enumerate(self.server.components):
            if not component.in_switch_reduction:
                continue
            switch = self.server.gpus + position
            if all((g, switch) in index._edge_of for g in locals_):
                return f"n{nodes.pop()}/{component.name}"
        return None

    # ----- the graph -------------------------------------------------------------------------------------------
    def node_kind_counts(self) -> dict[str, int]:
        """Number of graph nodes of each kind (gpu, nvswitch, ..., leaf, spine), in a fixed order."""
        counts: dict[str, int] = {}
        for kind in self._index.kinds:
            counts[kind] = counts.get(kind, 0) + self.nodes
        if self.leaves:
            counts["leaf"] = self.leaves
        if self._spines:
            counts["spine"] = self._spines
        return counts

    def edge_class_counts(self) -> dict[str, int]:
        """Number of directed graph edges of each link class, in a fixed order."""
        counts: dict[str, int] = {}
        for _, _, link, _ in self._index.edges:
            counts[link.link_class] = counts.get(link.link_class, 0) + self.nodes
        if self.nodes > 1:
            counts["network"] = counts.get("network", 0) + 2 * self.nodes * self.rails + 2 * self.leaves * self._spines
        return counts

    @functools.cached_property
    def graph(self) -> nx.DiGraph:
        """The frozen networkx DiGraph: nodes with `kind` (and `gpu` ids), edges with `bytes_per_s` (payload),
        `raw_bytes_per_s`, `efficiency`, `latency_s`, `link`, `link_class`, `resource`, `cost_ps`, `source`."""
        from simulator.network.topology_graph import build_graph   # networkx only when a graph is asked for

        return build_graph(self)


def topology_dir() -> Path:
    """The directory holding the bundled topology files (topologies/ at the repository root)."""
    return Path(__file__).resolve().parents[2] / "topologies"


def list_topologies() -> list[str]:
    """Names of the bundled topologies, sorted."""
    return sorted(p.stem for p in topology_dir().glob("*.toml"))


def load_topology(name: str, *, nodes: int | None = None, oversubscription: float | None = None,
                  rail_optimized: bool | None = None, spines: int | None = None,
                  leaf_down_ports: int | None = None) -> Topology:
    """Load a topology by bundled name (e.g. "dgx-a100") or TOML path, overriding fabric settings.

    Args:
        name: a name from list_topologies() or a path to a .toml file.
        nodes: servers joined by the fabric (default: the file's fabric.nodes, usually 1).
        oversubscription: leaf downlink / uplink capacity ratio (default: the file's).
        rail_optimized: NIC r of every server to the rail-r leaf (default: the file's).
        spines: spine switches (default: the file's).
        leaf_down_ports: NIC ports per leaf (default: the file's).

    Returns:
        The Topology.
    """
    path = Path(name)
    if path.suffix != ".toml":
        path = topology_dir() / f"{name}.toml"
        if not path.exists():
            known = list_topologies()
            hint = difflib.get_close_matches(name, known, n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise TopologyError(f"topology {name!r} is unknown{extra}; known: {', '.join(known)}")
    server = read_server(path)
    fabric = server.fabric
    changes = {"nodes": nodes, "oversubscription": oversubscription, "rail_optimized": rail_optimized,
               "spines": spines, "leaf_down_ports": leaf_down_ports}
    for key, value in changes.items():
        if value is None:
            continue
        kind = bool if key == "rail_optimized" else (int, float) if key == "oversubscription" else int
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            raise TopologyError(f"{path}: {key} = {value!r}: must be {'true or false' if kind is bool else 'a number'}")
        fabric = dataclasses.replace(fabric, **{key: float(value) if key == "oversubscription" else value})
    validate_fabric(fabric, str(path))
    return Topology(server, fabric)

