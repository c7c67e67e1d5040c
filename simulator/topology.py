"""Resolve a scenario's [cluster] and [allocator] into the device a rank runs on and its memory budget."""

from __future__ import annotations

from dataclasses import dataclass

from simulator.errors import TopologyError
from simulator.hardware.catalog import DeviceSpec, get_device
from simulator.scenario import Scenario


@dataclass(frozen=True)
class Cluster:
    """A one-device cluster: the device, the allocator model and the bytes the allocator may use."""

    device: DeviceSpec
    nodes: int
    allocator_kind: str
    context_bytes: int              # memory outside the allocator (CUDA context, library workspaces)
    allocator_capacity_bytes: int   # device memory minus context_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.device.memory_bytes


def resolve_cluster(scenario: Scenario) -> Cluster:
    """Find the device named by cluster.topology and size the allocator's budget."""
    name = scenario.cluster.topology
    try:
        device = get_device(name)
    except TopologyError as error:
        raise TopologyError(f"{scenario.source}: cluster.topology = {name!r}: {error}") from None
    if scenario.cluster.nodes != 1:
        raise TopologyError(f"{scenario.source}: cluster.nodes = {scenario.cluster.nodes}: a single "
                            f"device topology has exactly one node")
    kind = scenario.allocator.kind
    if kind == "auto":
        kind = device.default_allocator
    context = scenario.allocator.context_bytes
    if context is None:
        context = device.context_bytes
    if context >= device.memory_bytes:
        raise TopologyError(f"{scenario.source}: allocator.context_bytes = {context}: must be less than "
                            f"the device memory ({device.memory_bytes} bytes)")
    return Cluster(device, 1, kind, context, device.memory_bytes - context)
