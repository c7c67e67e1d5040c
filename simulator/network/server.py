"""One server of a topology indexed for routing: local nodes, directed edges with their local resources, and
shortest paths (GPUs never transit) by the cost `latency_s + 1 MiB / bytes_per_s` in integer picoseconds."""

from __future__ import annotations

import heapq

from simulator.errors import TopologyError
from simulator.network.spec import LinkKind, ServerSpec

ROUTE_REFERENCE_BYTES = 2**20   # routes minimise the time to move this many bytes hop by hop
_PS = 1e12


class ServerIndex:
    """Index of one server: local names, directed edges with local resources, cached shortest paths."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.names = [f"gpu{i}" for i in range(spec.gpus)] + [c.name for c in spec.components]
        self.kinds = ["gpu"] * spec.gpus + [c.kind for c in spec.components]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.edges: list[tuple[int, int, LinkKind, int]] = []
        capacities: list[float] = []
        for connection in spec.connections:
            link = spec.link(connection.link)
            group = len(capacities)
            if connection.shared == "all":
                capacities.append(link.bytes_per_s)
            for a, b in connection.pairs:
                u, v = self.index[a], self.index[b]
                if connection.shared == "all":
                    forward = backward = group
                elif connection.shared == "pair":
                    forward = backward = len(capacities)
                    capacities.append(link.bytes_per_s)
                else:
                    forward, backward = len(capacities), len(capacities) + 1
                    capacities.extend([link.bytes_per_s, link.reverse_bytes_per_s])
                self.edges.append((u, v, link, forward))
                self.edges.append((v, u, link, backward))
        self.capacities = capacities
        self.out: list[list[tuple[int, int]]] = [[] for _ in self.names]
        for e, (u, v, _, _) in enumerate(self.edges):
            self.out[u].append((v, e))
        for hops in self.out:
            hops.sort()
        self.cost = [int(round((link.latency_s + ROUTE_REFERENCE_BYTES / capacities[res]) * _PS))
                     for _, _, link, res in self.edges]
        self.transit = [kind not in ("gpu", "nvme") for kind in self.kinds]      # a drive is an end, never a hop
        self.nics = [i for i, kind in enumerate(self.kinds) if kind == "nic"]
        self._paths: dict[int, dict[int, tuple[int, tuple[int, ...]]]] = {}
        self._edge_of = {(u, v): e for e, (u, v, _, _) in enumerate(self.edges)}
        for g in range(spec.gpus):
            for h in range(spec.gpus):
                if g != h and h not in self.paths_from(g):
                    raise TopologyError(f"{spec.path}: gpu{h} cannot be reached from gpu{g} (check [[connect]])")
        if spec.nic_of_gpu is not None:
            self.gpu_rail = [self.nics.index(self.index[name]) for name in spec.nic_of_gpu]
        else:
            self.gpu_rail = [self.nearest_rail(g, outbound=True) if self.nics else -1 for g in range(spec.gpus)]

    def paths_from(self, src: int) -> dict[int, tuple[int, tuple[int, ...]]]:
        """Shortest (cost, node path) from local `src` to every reachable local node; GPUs are not transit."""
        done = self._paths.get(src)
        if done is not None:
            return done
        done = {}
        heap: list[tuple[int, tuple[int, ...]]] = [(0, (src,))]
        best = {src: heap[0]}
        while heap:
            cost, path = heapq.heappop(heap)
            u = path[-1]
            if u in done:
                continue
            done[u] = (cost, path)
            if u != src and not self.transit[u]:
                continue
            for v, e in self.out[u]:
                if v in done:
                    continue
                candidate = (cost + self.cost[e], path + (v,))
                if v not in best or candidate < best[v]:
                    best[v] = candidate
                    heapq.heappush(heap, candidate)
        self._paths[src] = done
        return done

    def edge_path(self, src: int, dst: int) -> list[int]:
        """Local edge indices of the shortest path src -> dst (raises if unreachable)."""
        found = self.paths_from(src).get(dst)
        if found is None:
            raise TopologyError(f"{self.spec.path}: no path from {self.names[src]} to {self.names[dst]}")
        path = found[1]
        return [self._edge_of[(path[i], path[i + 1])] for i in range(len(path) - 1)]

    def nearest_rail(self, local: int, outbound: bool) -> int:
        """Rail (index into the NIC list) nearest to `local`: leaving (outbound) or arriving; ties -> lowest."""
        options = []
        for rail, nic in enumerate(self.nics):
            found = self.paths_from(local).get(nic) if outbound else self.paths_from(nic).get(local)
            if found is not None:
                options.append((found[0], rail))
        if not options:
            raise TopologyError(f"{self.spec.path}: {self.names[local]} reaches no NIC")
        return min(options)[1]
