"""A flow-level network: concurrent transfers share link capacity max-min fairly (progressive filling).

`FlowNetwork` is event-driven. `start(flow)` begins a transfer at the current time; `advance(until_s)` moves
time forward and returns the transfers delivered on the way; `run()` runs until nothing is left. Rates are
max-min fair over the resources (link directions, shared links) of every active flow's route, computed by
progressive filling and recomputed when a flow starts or finishes — only for the flows connected to it
through shared resources (its component), so independent traffic is not touched. A flow occupies its
links until its bytes are sent and is delivered `latency_s` (its route's latency) later.

Works on any routing model with `route(src, dst) -> Route` and `capacity_bytes_per_s(resource) -> float`
(a `Topology`, or a small table in tests). Deterministic: ties break by flow id and resource id.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Protocol

from simulator.errors import TopologyError
from simulator.network.topology import Route

# Events closer than this (relative) are processed together: symmetric flows finish in one step.
_SAME_TIME = 1e-12


class RoutingModel(Protocol):
    """What FlowNetwork needs from a topology."""

    def route(self, src: int | str, dst: int | str) -> Route: ...

    def capacity_bytes_per_s(self, resource: int) -> float: ...


@dataclass(frozen=True)
class Flow:
    """One transfer: `size_bytes` from `src` to `dst` (GPU ids or component names), optionally rate-capped."""

    src: int | str
    dst: int | str
    size_bytes: float
    max_bytes_per_s: float | None = None   # a cap of the endpoint (protocol or copy engine), not of a link
    tag: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.size_bytes, bool) or not isinstance(self.size_bytes, (int, float)) \
                or not math.isfinite(self.size_bytes) or self.size_bytes < 0:
            raise TopologyError(f"flow {self.src}->{self.dst}: size_bytes = {self.size_bytes!r} must be a "
                                f"finite number >= 0")
        cap = self.max_bytes_per_s
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise TopologyError(f"flow {self.src}->{self.dst}: max_bytes_per_s = {cap!r} must be a positive number")


@dataclass(frozen=True)
class Delivery:
    """A finished flow: its id, the flow, when it started and when its last byte arrived."""

    flow_id: int
    flow: Flow
    start_s: float
    end_s: float


class _Active:
    __slots__ = ("flow", "start_s", "uses", "remaining", "rate", "updated_s", "version", "latency_s")

    def __init__(self, flow: Flow, start_s: float, uses: tuple[tuple[int, int], ...], latency_s: float) -> None:
        self.flow = flow
        self.start_s = start_s
        self.uses = uses
        self.remaining = float(flow.size_bytes)
        self.rate = 0.0
        self.updated_s = start_s
        self.version = 0
        self.latency_s = latency_s


class FlowNetwork:
    """Transfers over a topology with max-min fair sharing, advanced event by event (see the module docstring)."""

    def __init__(self, topology: RoutingModel, *, start_s: float = 0.0) -> None:
        """Create an empty network at time `start_s` over `topology`."""
        self._topology = topology
        self._now = float(start_s)
        self._next_id = 0
        self._active: dict[int, _Active] = {}
        self._on: dict[int, dict[int, int]] = {}     # resource -> {flow id: uses}, in start order
        self._capacity: dict[int, float] = {}
        self._dirty: dict[int, None] = {}            # resources whose flows need new rates
        self._finish: list[tuple[float, int, int]] = []    # (end of transmission, flow id, version)
        self._arrive: list[tuple[float, int]] = []         # (delivery, flow id) after the route latency
        self._sent: dict[int, tuple[_Active, float]] = {}  # transmitted, waiting for their latency

    @property
    def now_s(self) -> float:
        """The current simulated time in seconds."""
        return self._now

    @property
    def active_count(self) -> int:
        """Flows still sending or in flight."""
        return len(self._active) + len(self._sent)

    def start(self, flow: Flow, *, with_latency: bool = True) -> int:
        """Start `flow` now and return its id.

        Args:
            flow: the transfer.
            with_latency: add the route's latency after the last byte is sent (collectives pass False when
                their own step latencies already include the wire).

        Returns:
            The flow id (increasing from 0 in start order).
        """
        route = self._topology.route(flow.src, flow.dst)
        flow_id = self._next_id
        self._next_id += 1
        uses = route.resources
        if flow.max_bytes_per_s is not None:
            cap_resource = -1 - flow_id          # a private resource holding the flow's own cap
            self._capacity[cap_resource] = float(flow.max_bytes_per_s)
            uses = uses + ((cap_resource, 1),)
        active = _Active(flow, self._now, uses, route.latency_s if with_latency else 0.0)
        if flow.size_bytes == 0 or not uses:
            self._sent[flow_id] = (active, self._now)
            heapq.heappush(self._arrive, (self._now + active.latency_s, flow_id))
            return flow_id
        self._active[flow_id] = active
        for resource, count in uses:
            if resource not in self._capacity:
                self._capacity[resource] = self._topology.capacity_bytes_per_s(resource)
            self._on.setdefault(resource, {})[flow_id] = count
            self._dirty[resource] = None
        return flow_id

    def rate_bytes_per_s(self, flow_id: int) -> float:
        """The current sending rate of an active flow (0.0 once it has sent everything)."""
        self._refresh()
        active = self._active.get(flow_id)
        return active.rate if active is not None else 0.0

    def rates(self) -> dict[int, float]:
        """Current rate of every flow still sending, by flow id."""
        self._refresh()
        return {flow_id: active.rate for flow_id, active in sorted(self._active.items())}

    def resource_loads(self) -> dict[int, tuple[float, float]]:
        """For every loaded link resource: (bytes/s in use, capacity); cap resources of flows are left out."""
        self._refresh()
        loads = {}
        for resource in sorted(self._on):
            if resource >= 0:
                used = sum(self._active[f].rate * n for f, n in self._on[resource].items())
                loads[resource] = (used, self._capacity[resource])
        return loads

    def next_event_s(self) -> float | None:
        """Time of the next transmission end or delivery, or None when idle."""
        self._refresh()
        self._drop_stale()
        times = []
        if self._finish:
            times.append(self._finish[0][0])
        if self._arrive:
            times.append(self._arrive[0][0])
        return min(times) if times else None

    def advance(self, until_s: float) -> list[Delivery]:
        """Move time to `until_s`, processing every event up to it.

        Args:
            until_s: the new time (>= now_s); math.inf runs until idle.

        Returns:
            Flows delivered on the way, by (end time, flow id).
        """
        if until_s < self._now:
            raise TopologyError(f"advance: until_s = {until_s!r} is before now_s = {self._now!r}")
        delivered: list[Delivery] = []
        while True:
            event = self.next_event_s()
            if event is None or event > until_s:
                break
            self._now = max(self._now, event)
            horizon = event + _SAME_TIME * max(event, 1e-9)
            ended = []
            while self._finish and self._finish[0][0] <= horizon:
                end_s, flow_id, version = heapq.heappop(self._finish)
                active = self._active.get(flow_id)
                if active is not None and active.version == version:
                    ended.append(flow_id)
            for flow_id in ended:
                self._end_transmission(flow_id)
            while self._arrive and self._arrive[0][0] <= horizon:
                arrive_s, flow_id = heapq.heappop(self._arrive)
                active, _ = self._sent.pop(flow_id)
                delivered.append(Delivery(flow_id, active.flow, active.start_s, max(arrive_s, active.start_s)))
        if math.isfinite(until_s):
            self._now = max(self._now, until_s)
        delivered.sort(key=lambda d: (d.end_s, d.flow_id))
        return delivered

    def run(self) -> list[Delivery]:
        """Advance until every flow is delivered; returns the deliveries."""
        return self.advance(math.inf)

    # ----- internals ---------------------------------------------------------------------------------------
    def _end_transmission(self, flow_id: int) -> None:
        active = self._active.pop(flow_id)
        active.remaining = 0.0
        active.rate = 0.0
        for resource, _ in active.uses:
            flows = self._on[resource]
            del flows[flow_id]
            if flows:
                self._dirty[resource] = None
            else:
                del self._on[resource]
                self._dirty.pop(resource, None)
                if resource < 0:
                    del self._capacity[resource]
        self._sent[flow_id] = (active, self._now)
        heapq.heappush(self._arrive, (self._now + active.latency_s, flow_id))

    def _drop_stale(self) -> None:
        while self._finish:
            _, flow_id, version = self._finish[0]
            active = self._active.get(flow_id)
            if active is not None and active.version == version:
                return
            heapq.heappop(self._finish)

    def _refresh(self) -> None:
        """Recompute rates of the flows connected (through shared resources) to a changed resource."""
        if not self._dirty:
            return
        flows, resources = self._component(list(self._dirty))
        self._dirty.clear()
        now = self._now
        for flow_id in flows:
            active = self._active[flow_id]
            active.remaining = max(0.0, active.remaining - active.rate * (now - active.updated_s))
            active.updated_s = now
        rates = max_min_rates({r: self._capacity[r] for r in resources},
                              {f: self._active[f].uses for f in flows})
        for flow_id in flows:
            active = self._active[flow_id]
            active.rate = rates[flow_id]
            active.version += 1
            end = now + active.remaining / active.rate if active.rate > 0 else math.inf
            heapq.heappush(self._finish, (end, flow_id, active.version))

    def _component(self, seeds: list[int]) -> tuple[list[int], list[int]]:
        seen_resources = dict.fromkeys(r for r in seeds if r in self._on)
        seen_flows: dict[int, None] = {}
        stack = list(seen_resources)
        while stack:
            resource = stack.pop()
            for flow_id in self._on[resource]:
                if flow_id in seen_flows:
                    continue
                seen_flows[flow_id] = None
                for other, _ in self._active[flow_id].uses:
                    if other not in seen_resources:
                        seen_resources[other] = None
                        stack.append(other)
        return sorted(seen_flows), sorted(seen_resources)


def max_min_rates(capacities: dict[int, float], uses: dict[int, tuple[tuple[int, int], ...]]) -> dict[int, float]:
    """Max-min fair rates by progressive filling.

    All unfrozen flows rise together; a resource saturates when the weighted sum of its flows' rates (a flow
    crossing it n times counts n times) reaches its capacity, and freezes its flows at that level.

    Args:
        capacities: resource id -> capacity in bytes/s (every resource used below must be present).
        uses: flow id -> ((resource id, times crossed), ...); a flow with no resources gets math.inf.

    Returns:
        flow id -> rate in bytes/s.
    """
    remaining = dict(capacities)
    weight: dict[int, float] = {r: 0.0 for r in capacities}
    members: dict[int, list[int]] = {r: [] for r in capacities}
    rates: dict[int, float] = {}
    for flow_id in sorted(uses):
        if not uses[flow_id]:
            rates[flow_id] = math.inf
        for resource, count in uses[flow_id]:
            weight[resource] += count
            members[resource].append(flow_id)
    heap = [(remaining[r] / weight[r], r) for r in sorted(capacities) if weight[r] > 0]
    heapq.heapify(heap)
    while heap:
        share, resource = heapq.heappop(heap)
        if weight[resource] <= 0:
            continue
        current = max(remaining[resource], 0.0) / weight[resource]
        if current != share:
            continue    # stale: every change of a resource pushed a fresh entry
        touched: dict[int, None] = {}
        for flow_id in members[resource]:
            if flow_id in rates:
                continue
            rates[flow_id] = current
            for other, count in uses[flow_id]:
                remaining[other] -= current * count
                weight[other] -= count
                touched[other] = None
        weight[resource] = 0
        # One fresh entry per changed resource (pushing after every flow only adds entries that go stale).
        for other in touched:
            if weight[other] > 0 and other != resource:
                heapq.heappush(heap, (max(remaining[other], 0.0) / weight[other], other))
    return rates
