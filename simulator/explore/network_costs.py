"""Seconds of the collectives and messages of a plan's representative ranks, from the network model
(network/collectives.py `collective_time_s`: NCCL's algorithm choice and latencies, bandwidth simulated on the
topology's links), each (kind, group, size) computed once per topology."""

from __future__ import annotations

from simulator.network.collectives import collective_time_s
from simulator.network.topology import Topology


class NetworkCosts:
    """collective_time_s on one topology, remembered per (kind, group, bytes)."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self._seen: dict[tuple, float] = {}

    def collective_s(self, kind: str, group: tuple[int, ...], size_bytes: float) -> float:
        """Seconds of one `kind` collective over the GPUs `group` alone on the network (0 for one GPU)."""
        if len(group) <= 1 or size_bytes <= 0:
            return 0.0
        key = (kind, group, float(size_bytes))
        seconds = self._seen.get(key)
        if seconds is None:
            seconds = self._seen[key] = collective_time_s(self.topology, kind, group, float(size_bytes))
        return seconds

    def send_s(self, src: int, dst: int, size_bytes: float) -> float:
        """Seconds of a point-to-point message from GPU `src` to GPU `dst` (one direct flow and NCCL's p2p
        latency, as the engine lowers a Send)."""
        if src == dst or size_bytes <= 0:
            return 0.0
        return self.collective_s("send", (src, dst), size_bytes)
