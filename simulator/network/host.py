"""Where a GPU's host side is on a topology: its host memory, the CPU end beside it, the server's drives and sizes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from simulator.errors import TopologyError

if TYPE_CHECKING:
    from simulator.network.collectives import CollectiveSchedule
    from simulator.network.spec import HostSpec
    from simulator.network.topology import Topology


def host_memory_of_gpu(topology: Topology, gpu: int) -> str:
    """The host memory node ("n<node>/<name>") a GPU's offload traffic goes to: the nearest by route cost.

    Pinned buffers are taken as allocated on the GPU's own socket (a process bound to its NUMA node, as
    DeepSpeed's --bind_cores_to_rank and NUMA-aware launchers do); ties go to the first in file order.

    Raises:
        TopologyError: the server has no host_memory component.
    """
    return topology.derived(("host_memory_of_gpu", gpu), lambda: _nearest(topology, gpu))


def _nearest(topology: Topology, gpu: int) -> str:
    memories = topology.server.components_of("host_memory")
    if not memories:
        raise TopologyError(f"topology {topology.name}: no host_memory component: offload needs host memory")
    node = topology.node_of_gpu(gpu)
    index = topology._index
    paths = index.paths_from(gpu % topology.gpus_per_node)
    costs = []
    for position, memory in enumerate(memories):
        found = paths.get(index.index[memory.name])
        if found is not None:
            costs.append((found[0], position, memory.name))
    if not costs:
        raise TopologyError(f"topology {topology.name}: gpu{gpu % topology.gpus_per_node} reaches no host memory")
    return f"n{node}/{min(costs)[2]}"


def host_cpu_of_gpu(topology: Topology, gpu: int) -> str:
    """The node just before the GPU's host memory on its route there (a root complex or root port): a flow from it
    to the memory loads only the memory's own resource (DRAM), which is how host compute traffic is modelled."""
    def compute() -> str:
        route = topology.route(gpu, host_memory_of_gpu(topology, gpu))
        return route.nodes[-2]
    return topology.derived(("host_cpu_of_gpu", gpu), compute)


def drives_of_node(topology: Topology, node: int) -> tuple[str, ...]:
    """The nvme drives of server `node` ("n<node>/<name>", file order); a rank's NVMe traffic is striped over all of
    them (one RAID-0 volume, as DGX systems configure their data drives)."""
    return tuple(f"n{node}/{c.name}" for c in topology.server.components_of("nvme"))


def host_capacity_bytes(topology: Topology) -> int:
    """Host memory of one server, bytes (the sum of its host_memory capacities).

    Raises:
        TopologyError: a host_memory component does not give its capacity.
    """
    memories = topology.server.components_of("host_memory")
    missing = [c.name for c in memories if not c.capacity_bytes]
    if not memories or missing:
        raise TopologyError(f"topology {topology.name}: host_memory {', '.join(missing) or '(none)'} has no capacity; "
                            f"offload needs the server's host memory size (components.capacity)")
    return sum(c.capacity_bytes for c in memories)


def nvme_capacity_bytes(topology: Topology) -> int:
    """Bytes the drives of one server hold together (0 without drives or when a drive gives no capacity)."""
    drives = topology.server.components_of("nvme")
    if not drives or any(not c.capacity_bytes for c in drives):
        return 0
    return sum(c.capacity_bytes for c in drives)


def host_spec(topology: Topology) -> HostSpec:
    """The topology's `[host]` rates.

    Raises:
        TopologyError: the topology has no `[host]` table.
    """
    host = topology.server.host
    if host is None:
        raise TopologyError(f"topology {topology.name}: no [host] table: offloading the optimizer step needs the "
                            f"CPU's rates (host.cpu_adam_elements_per_s, host.cpu_stream_bytes_per_s)")
    return host


def transfer_schedule(topology: Topology, gpu: int, route: str, size_bytes: float,
                      cap_bytes_per_s: float | None = None) -> CollectiveSchedule:
    """An offload Transfer of GPU `gpu`'s rank as one phase of flows (program.Transfer names the routes).

    d2h / h2d: one flow between the GPU and its host memory; nvme_write / nvme_read: the bytes striped evenly over
    the server's drives, one flow per drive to or from the GPU's host memory (ZeRO-Infinity's swap buffers are in
    pinned host memory); host: one flow of DRAM traffic from the CPU end to the memory, capped at the CPU's rate.
    The phase waits the longest route latency, then its flows start together.

    Raises:
        TopologyError: a route the topology cannot serve (no host memory, no drive).
    """
    from simulator.network.collectives import CollectiveSchedule, Phase
    from simulator.network.flows import Flow

    memory = host_memory_of_gpu(topology, gpu)
    size = float(size_bytes)
    if route in ("d2h", "h2d"):
        ends = [(gpu, memory) if route == "d2h" else (memory, gpu)]
    elif route == "host":
        ends = [(host_cpu_of_gpu(topology, gpu), memory)]
    elif route in ("nvme_read", "nvme_write"):
        drives = drives_of_node(topology, topology.node_of_gpu(gpu))
        if not drives:
            raise TopologyError(f"topology {topology.name}: no nvme drive for {route} (NVMe offload needs drives)")
        ends = [(drive, memory) if route == "nvme_read" else (memory, drive) for drive in drives]
        size /= len(drives)
    else:
        raise TopologyError(f"transfer route {route!r}: must be d2h, h2d, nvme_read, nvme_write or host")
    cap = None if cap_bytes_per_s is None else float(cap_bytes_per_s)
    flows = tuple(Flow(src, dst, size, cap) for src, dst in ends) if size > 0 else ()
    latency = max(topology.route_latency_s(src, dst) for src, dst in ends)
    return CollectiveSchedule(route, (gpu,), float(size_bytes), "direct", "simple",
                              (Phase(flows, latency),) if flows else ())
