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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from simulator.errors import TopologyError
from simulator.network.topology import Route

# Events closer than this (relative) are processed together: symmetric flows finish in one step.
_SAME_TIME = 1e-12
# Components of at least this many flows have their rates remembered by shape (FlowNetwork._refresh) ...
_MEMO_MIN_FLOWS = 64
# ... in at most this many entries (the oldest is forgotten first).
_MEMO_ENTRIES = 256


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
    __slots__ = ("flow", "start_s", "uses", "res", "seeds", "remaining", "rate", "updated_s", "version", "latency_s",
                 "shape", "end_s")

    def __init__(self, flow: Flow, start_s: float, uses: tuple[tuple[int, int], ...], res: tuple[int, ...],
                 seeds: dict[int, None], latency_s: float, shape: int) -> None:
        self.flow = flow
        self.shape = shape          # FlowNetwork._shapes id of (route resources, rate cap)
        self.start_s = start_s
        self.uses = uses
        self.res = res              # the resource ids of `uses`
        self.seeds = seeds          # the same ids as dict keys (shared by the flows of one route)
        self.remaining = float(flow.size_bytes)
        self.rate = 0.0
        self.updated_s = start_s
        self.version = 0
        self.latency_s = latency_s
        self.end_s = math.nan       # end of transmission of the flow's valid `_finish` entry (nan: none yet)


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
        self._dirty: dict[int, None] = {}            # resources whose flows need new rates (some may be idle)
        # (src, dst) -> (route resources, their ids, the ids as dict keys, route latency, shape id without a cap)
        self._routes: dict[tuple, tuple] = {}
        self._finish: list[tuple[float, int, int]] = []    # (end of transmission, flow id, version)
        self._arrive: list[tuple[float, int]] = []         # (delivery, flow id) after the route latency
        self._sent: dict[int, tuple[_Active, float]] = {}  # transmitted, waiting for their latency
        self._shapes: dict[tuple, int] = {}          # (route resources, rate cap) -> small id
        self._memo: dict[tuple[int, ...], tuple[float, ...]] = {}   # component shapes -> rates (_refresh)

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
        src, dst = flow.src, flow.dst
        known = self._routes.get((src, dst))
        if known is None:
            known = self._route(src, dst)
        uses, res, keys, latency_s, shape = known
        flow_id = self._next_id
        self._next_id += 1
        cap = flow.max_bytes_per_s
        if cap is not None:
            cap = float(cap)
            cap_resource = -1 - flow_id          # a private resource holding the flow's own cap
            self._capacity[cap_resource] = cap
            shapes = self._shapes
            shape = shapes.setdefault((uses, cap), len(shapes))
            uses = uses + ((cap_resource, 1),)
            res = res + (cap_resource,)
            keys = dict.fromkeys(res)
        active = _Active(flow, self._now, uses, res, keys, latency_s if with_latency else 0.0, shape)
        if flow.size_bytes == 0 or not uses:
            self._sent[flow_id] = (active, self._now)
            heapq.heappush(self._arrive, (self._now + active.latency_s, flow_id))
            return flow_id
        self._active[flow_id] = active
        on = self._on
        for resource, count in uses:
            flows = on.get(resource)
            if flows is None:
                on[resource] = {flow_id: count}
            else:
                flows[flow_id] = count
        self._dirty.update(keys)
        return flow_id

    def _route(self, src: int | str, dst: int | str) -> tuple:
        """Remember what `start` needs of the route src -> dst (the link capacities included)."""
        route = self._topology.route(src, dst)
        uses = route.resources
        res = tuple(resource for resource, _ in uses)
        for resource in res:
            if resource not in self._capacity:
                self._capacity[resource] = self._topology.capacity_bytes_per_s(resource)
        shapes = self._shapes
        shape = shapes.setdefault((uses, None), len(shapes))
        known = self._routes[(src, dst)] = (uses, res, dict.fromkeys(res), route.latency_s, shape)
        return known

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
        on = self._on
        for resource in active.res:
            flows = on[resource]
            del flows[flow_id]
            if not flows:
                del on[resource]
                if resource < 0:
                    del self._capacity[resource]
        self._dirty.update(active.seeds)   # a resource left idle is no seed (_components)
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
        """Recompute rates of the flows connected (through shared resources) to a changed resource.

        Each connected component is filled on its own (components share no resource, so filling them together
        would do the same float operations on each), on the network's own bookkeeping: `_on` lists each
        resource's flows in id order, which is what `max_min_rates` would build.

        A large component's rates are remembered under its shape: the shape id of every flow (route resources
        and rate cap), in flow id order. Equal shapes mean the same resources with the same capacities, the same
        uses and the same order of flows and of resource ids (a cap resource's id, -1 - flow id, orders the caps
        as their flows), so the filling would repeat the same float operations and return the same rates.
        """
        if not self._dirty:
            return
        components = self._components(self._dirty)
        self._dirty.clear()
        now = self._now
        finish = self._finish
        memo = self._memo
        active_of = self._active
        heappush = heapq.heappush
        inf = math.inf
        for found, resources in components:
            ids = sorted(found)
            flows = [active_of[flow_id] for flow_id in ids]
            if len(ids) >= _MEMO_MIN_FLOWS:
                key = tuple([active.shape for active in flows])
                rates = memo.get(key)
                if rates is None:
                    rates = self._fill_component(ids, flows, resources)
                    if len(memo) >= _MEMO_ENTRIES:
                        del memo[next(iter(memo))]
                    memo[key] = rates
            else:
                rates = self._fill_component(ids, flows, resources)
            for flow_id, active, rate in zip(ids, flows, rates):
                remaining = active.remaining - active.rate * (now - active.updated_s)
                if not remaining > 0.0:     # max(0.0, remaining)
                    remaining = 0.0
                active.remaining = remaining
                active.updated_s = now
                active.rate = rate
                end = now + remaining / rate if rate > 0 else inf
                if end != active.end_s:     # else its valid entry already says so: the heap pops the same
                    active.version += 1
                    active.end_s = end
                    heappush(finish, (end, flow_id, active.version))

    def _fill_component(self, ids: list[int], flows: list[_Active], resources: Iterable[int]) -> tuple[float, ...]:
        """Rates of one component's flows (`ids` increasing, `flows` their states), in that order."""
        capacity, on = self._capacity, self._on
        rates: dict[int, float] = {}
        _fill({r: capacity[r] for r in resources}, {r: sum(on[r].values()) for r in resources}, on,
              {flow_id: active.uses for flow_id, active in zip(ids, flows)}, resources, rates)
        return tuple([rates[flow_id] for flow_id in ids])

    def _components(self, seeds: Iterable[int]) -> list[tuple[set[int], set[int]]]:
        """The connected components (active flow ids, resource ids) holding `seeds` (idle seeds are skipped).

        Breadth-first, a whole frontier at a time with set operations (the components are sets: whoever uses
        them orders what needs an order).
        """
        on, active = self._on, self._active
        seen: set[int] = set()
        components = []
        for seed in seeds:
            if seed in seen or seed not in on:
                continue
            resources = {seed}
            found: set[int] = set()
            frontier: Iterable[int] = resources
            while frontier:
                new_flows = set().union(*[on[r] for r in frontier])
                new_flows -= found
                if not new_flows:
                    break
                found |= new_flows
                frontier = set().union(*[active[flow_id].res for flow_id in new_flows])
                frontier -= resources
                resources |= frontier
            seen |= resources
            components.append((found, resources))
        return components


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
    weight: dict[int, float] = {r: 0.0 for r in capacities}
    members: dict[int, list[int]] = {r: [] for r in capacities}
    rates: dict[int, float] = {}
    for flow_id in sorted(uses):
        if not uses[flow_id]:
            rates[flow_id] = math.inf
        for resource, count in uses[flow_id]:
            weight[resource] += count
            members[resource].append(flow_id)
    _fill(dict(capacities), weight, members, uses, list(capacities), rates)
    return rates


def _fill(remaining: dict[int, float], weight: dict[int, float], members: Mapping[int, Iterable[int]],
          uses: Mapping[int, tuple[tuple[int, int], ...]], resources: Iterable[int], rates: dict[int, float]) -> None:
    """Progressive filling: freeze every flow of `uses` into `rates` (both dicts are consumed).

    The loop is the textbook one: take the resource of lowest fair share (ties: lowest id), give its
    unfrozen flows (in flow id order) that share, take their rates off every resource they cross, repeat.
    `remaining` and `weight` (capacity left and times crossed by unfrozen flows, per resource) change only
    there, by the same float operations in the same order whatever the heap holds, so the rates depend only
    on which resource is taken at each step. The heap keeps, for every resource still in play, an entry
    no larger than its current share (`floor`): a share that grows (the usual case, as frozen flows leave
    their links) is not pushed at once, only when its old entry comes up; a share that shrinks (float
    rounding) is pushed at once. An entry equal to the current share is taken; a lower one is pushed again
    at the current share; a higher one is stale. So each step takes the least (share, id), as a heap
    refreshed after every change would, with far fewer pushes. Infinite capacities (inf - inf is nan, which
    no heap orders) take `_fill_eager`, the refresh-after-every-change loop.

    Args:
        remaining: resource -> capacity (bytes/s), every resource of the flows.
        weight: resource -> total times crossed by the flows of `uses`.
        members: resource -> the flows crossing it, in increasing flow id.
        uses: flow id -> ((resource, times crossed), ...) of the flows to rate.
        resources: the resources, in any order.
        rates: receives flow id -> rate.
    """
    if not all(math.isfinite(c) for c in remaining.values()):
        _fill_eager(remaining, weight, members, uses, resources, rates)
        return
    heap = [(remaining[r] / weight[r], r) for r in resources if weight[r] > 0]
    floor = dict((r, share) for share, r in heap)
    heapq.heapify(heap)
    heappop, heappush = heapq.heappop, heapq.heappush
    while heap:
        share, resource = heappop(heap)
        w = weight[resource]
        if w <= 0:
            continue
        left = remaining[resource]
        current = (0.0 if 0.0 > left else left) / w         # max(left, 0.0) / w
        if current != share:
            if share < current:                          # a floor entry come up: queue the share it grew to
                heappush(heap, (current, resource))
                floor[resource] = current
            continue
        for flow_id in members[resource]:
            if flow_id in rates:
                continue
            rates[flow_id] = current
            for other, count in uses[flow_id]:
                left = remaining[other] = remaining[other] - current * count
                w = weight[other] = weight[other] - count
                if w > 0 and other != resource:
                    fresh = (0.0 if 0.0 > left else left) / w
                    if fresh < floor[other]:             # the share shrank (rounding): queue it now
                        heappush(heap, (fresh, other))
                        floor[other] = fresh
        weight[resource] = 0


def _fill_eager(remaining: dict[int, float], weight: dict[int, float], members: Mapping[int, Iterable[int]],
                uses: Mapping[int, tuple[tuple[int, int], ...]], resources: Iterable[int],
                rates: dict[int, float]) -> None:
    """`_fill` with a fresh heap entry for every resource a step changed (any capacities, infinite included)."""
    heap = [(remaining[r] / weight[r], r) for r in sorted(resources) if weight[r] > 0]
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
