"""A flow-level network: concurrent transfers share link capacity max-min fairly (progressive filling).

`FlowNetwork` is event-driven. `start(flow)` (or `start_many`) begins transfers at the current time;
`advance(until_s)` (or `advance_ids`) moves time forward and returns the transfers delivered on the way; `run()`
runs until nothing is left. Rates are max-min fair over the resources (link directions, shared links) of every
active flow's route, computed by progressive filling (simulator/network/filling.py) and recomputed when a flow
starts or finishes — only for the flows connected to it through shared resources (its component), so
independent traffic is not touched. The search for components walks *units* — sets of flows found connected
through their own resources, kept until one of their flows ends — whole, so a component that loses some of its
flows is not walked flow by flow again; a component whose flows all end at one rate gets it without filling
(`filling.one_level`); a flow alone on every resource it crosses is rated without a search, by its shape
(`_lone_flows`); components' rates are remembered by shape. A flow occupies its links until its
bytes are sent and is delivered `latency_s` (its route's latency) later.

Works on any routing model with `route(src, dst) -> Route` and `capacity_bytes_per_s(resource) -> float`
(a `Topology`, or a small table in tests; a `Topology`'s `route_uses` and `route_latency_s` are used instead of
`route` when present). Deterministic: ties break by flow id and resource id.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain, compress, filterfalse
from operator import attrgetter
from typing import Protocol

from simulator.errors import TopologyError
from simulator.network.filling import fill_rates, max_min_rates, one_level
from simulator.network.topology import Route
from simulator.network.units import Unit, components

__all__ = ["Delivery", "Flow", "FlowNetwork", "RoutingModel", "max_min_rates"]

# Events closer than this (relative) are processed together: symmetric flows finish in one step.
_SAME_TIME = 1e-12
# Components of at least this many flows have their rates remembered by shape (FlowNetwork._refresh): a pipeline's
# steady state repeats the same few (at 1,536 GPUs, 118 shapes among 3,545 components of 2 to 28 flows) ...
_MEMO_MIN_FLOWS = 2
# ... in at most this many entries (the oldest is forgotten first).
_MEMO_ENTRIES = 256

_shape = attrgetter("shape")
_multi = attrgetter("multi")


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
        size, cap = self.size_bytes, self.max_bytes_per_s
        if type(size) is float and 0.0 <= size < math.inf and (cap is None or type(cap) is float and cap > 0.0):
            return      # the usual case, checked in full below
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
    __slots__ = ("flow", "start_s", "uses", "res", "remaining", "rate", "updated_s", "version", "latency_s",
                 "shape", "end_s", "multi")

    def __init__(self, flow: Flow, start_s: float, uses: tuple[tuple[int, int], ...], res: tuple[int, ...],
                 latency_s: float, shape: int, multi: bool) -> None:
        self.flow = flow
        self.shape = shape          # FlowNetwork._shapes id of (route resources, rate cap)
        self.multi = multi          # the route crosses some resource more than once
        self.start_s = start_s
        self.uses = uses
        self.res = res              # the resource ids of `uses`
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
        self._fast_routes = hasattr(topology, "route_uses") and hasattr(topology, "route_latency_s")
        self._now = float(start_s)
        self._next_id = 0
        self._left_alone: dict[int, None] = {}       # flows left alone on a resource since the last re-rating
        self._started_alone: list[int] = []          # flows started since then on idle resources only
        self._active: dict[int, _Active] = {}
        # resource -> {flow id: uses}, in start order; empty once idle (a link's dict is kept for its next flows:
        # making and dropping a dict per link per flow cost more than the rest of a start), read with `get`
        self._on: defaultdict[int, dict[int, int]] = defaultdict(dict)
        self._capacity: dict[int, float] = {}
        self._dirty: dict[int, None] = {}            # resources whose flows need new rates (some may be idle)
        # (src, dst) -> (route resources, their ids, the ids as dict keys, route latency, shape id without a cap,
        # whether the route crosses a resource more than once)
        self._routes: dict[tuple, tuple] = {}
        # (src, dst) -> (route resources, their ids, route latency, crosses one twice, their capacities): what
        # depends on the topology alone, shared by the networks over one Topology (a collective's state_at and
        # alone_steps build a network each: its routes were looked up again, link by link)
        derived = getattr(topology, "derived", None)
        self._common_routes: dict[tuple, tuple] = derived(("flow_routes",), dict) \
            if self._fast_routes and derived is not None else {}
        # (end of transmission, push number, [(flow id, version), ...]): one entry for the flows of a re-rating
        # that end at the same time; a flow's entry is valid while its version is the one listed
        self._finish: list[tuple[float, int, list[tuple[int, int]]]] = []
        self._pushes = 0
        self._arrive: list[tuple[float, int]] = []         # (delivery, flow id) after the route latency
        self._sent: dict[int, _Active] = {}          # transmitted, waiting for their latency
        self._shapes: dict[tuple, int] = {}          # (route resources, rate cap) -> small id
        self._memo: dict[tuple[int, ...], tuple[float, ...]] = {}   # component shapes -> rates (_refresh)
        self._levels: dict[tuple, tuple[float, float]] = {}    # filling.one_level's share ranges
        self._lone: dict[int, float] = {}            # shape id -> rate of a flow alone on its resources
        self._unit_of: dict[int, Unit] = {}         # rated flow id -> its unit (_components)
        self._stamp = 0                              # _components call counter (marks units taken whole)

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
        return self.start_many((flow,), with_latency=with_latency).start

    def start_many(self, flows: Iterable[Flow], *, with_latency: bool = True) -> range:
        """Start every flow of `flows` now, in order: the same as `start` on each in turn.

        Args:
            flows: the transfers.
            with_latency: as for `start`, for all of them.

        Returns:
            Their ids (consecutive, in the order of `flows`).
        """
        first = flow_id = self._next_id
        routes, on, active_of, dirty = self._routes, self._on, self._active, self._dirty
        alone = self._started_alone
        now = self._now
        try:
            for flow in flows:
                known = routes.get((flow.src, flow.dst))
                if known is None:
                    known = self._route(flow.src, flow.dst)
                uses, res, keys, latency_s, shape, multi = known
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
                active = _Active(flow, now, uses, res, latency_s if with_latency else 0.0, shape, multi)
                if flow.size_bytes == 0 or not uses:
                    self._sent[flow_id] = active
                    heapq.heappush(self._arrive, (now + active.latency_s, flow_id))
                else:
                    active_of[flow_id] = active
                    shared = False
                    for resource, count in uses:
                        crossing = on[resource]
                        if crossing:
                            shared = True
                        crossing[flow_id] = count
                    if not shared:          # (one that shares a resource now is not alone at the next re-rating)
                        alone.append(flow_id)
                    dirty.update(keys)
                flow_id += 1
        finally:
            self._next_id = flow_id         # (the flows before one whose route is refused are started)
        return range(first, flow_id)

    def _route(self, src: int | str, dst: int | str) -> tuple:
        """Remember what `start` needs of the route src -> dst (the link capacities included)."""
        common = self._common_routes.get((src, dst))
        if common is None:
            topology = self._topology
            if self._fast_routes:   # a Topology: the route's resources and latency without building the route
                uses, latency_s = topology.route_uses(src, dst), topology.route_latency_s(src, dst)
            else:
                route = topology.route(src, dst)
                uses, latency_s = route.resources, route.latency_s
            res = tuple(resource for resource, _ in uses)
            common = self._common_routes[(src, dst)] = (uses, res, latency_s, any(count != 1 for _, count in uses),
                                                        tuple(map(topology.capacity_bytes_per_s, res)))
        uses, res, latency_s, multi, capacities = common
        self._capacity.update(zip(res, capacities))     # (a link's capacity is the topology's: set again, equal)
        shapes = self._shapes
        shape = shapes.setdefault((uses, None), len(shapes))
        known = self._routes[(src, dst)] = (uses, res, dict.fromkeys(res), latency_s, shape, multi)
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
            if resource >= 0 and self._on[resource]:
                used = sum(self._active[f].rate * n for f, n in self._on[resource].items())
                loads[resource] = (used, self._capacity[resource])
        return loads

    def sending(self) -> list[tuple[Flow, float]]:
        """(flow, bytes still to send at now_s) of every flow still transmitting, by flow id (the bytes as the next
        re-rating would compute them)."""
        self._refresh()
        now = self._now
        found = []
        for _, active in sorted(self._active.items()):
            remaining = active.remaining - active.rate * (now - active.updated_s)
            found.append((active.flow, remaining if remaining > 0.0 else 0.0))
        return found

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
        return [Delivery(flow_id, active.flow, active.start_s, end_s)
                for end_s, flow_id, active in self._advance(until_s)]

    def advance_ids(self, until_s: float) -> list[int]:
        """`advance(until_s)`, returning only the ids of the flows delivered (in the same order)."""
        return [flow_id for _, flow_id, _ in self._advance(until_s)]

    def run(self) -> list[Delivery]:
        """Advance until every flow is delivered; returns the deliveries."""
        return self.advance(math.inf)

    # ----- internals ---------------------------------------------------------------------------------------
    def _advance(self, until_s: float) -> list[tuple[float, int, _Active]]:
        """`advance`'s work: (delivery time, flow id, flow state) of the flows delivered, sorted."""
        if until_s < self._now:
            raise TopologyError(f"advance: until_s = {until_s!r} is before now_s = {self._now!r}")
        delivered: list[tuple[float, int, _Active]] = []
        finish, arrive, active_of, sent = self._finish, self._arrive, self._active, self._sent
        heappop = heapq.heappop
        while True:
            event = self.next_event_s()
            if event is None or event > until_s:
                break
            self._now = max(self._now, event)
            horizon = event + _SAME_TIME * max(event, 1e-9)
            ended = []
            while finish and finish[0][0] <= horizon:
                end_s, _, members = heappop(finish)
                for flow_id, version in members:
                    active = active_of.get(flow_id)
                    if active is not None and active.version == version:
                        ended.append((end_s, flow_id))
            if ended:
                ended.sort()                # by (end, flow id), as one heap entry per flow would pop them
                self._end_transmissions([flow_id for _, flow_id in ended], delivered)
            while arrive and arrive[0][0] <= horizon:
                arrive_s, flow_id = heappop(arrive)
                active = sent.pop(flow_id)
                start_s = active.start_s
                delivered.append((start_s if start_s > arrive_s else arrive_s, flow_id, active))   # max(arrive, start)
        if math.isfinite(until_s):
            self._now = max(self._now, until_s)
        delivered.sort()        # by (delivery, flow id): no two are equal, so the states are never compared
        return delivered

    def _end_transmissions(self, ended: list[int], delivered: list[tuple[float, int, _Active]]) -> None:
        """Flows `ended` (in this order) have sent their last byte now: free their resources, await delivery.

        A flow without latency is delivered now, into `delivered`, instead of through the arrival heap (which
        `_advance` empties up to now right after this: the same deliveries, sorted there)."""
        active_of, on, unit_of, capacity, sent, arrive = (self._active, self._on, self._unit_of, self._capacity,
                                                          self._sent, self._arrive)
        dirty = self._dirty
        now = self._now
        heappush = heapq.heappush
        alone = self._left_alone
        for flow_id in ended:
            active = active_of.pop(flow_id)
            if active.latency_s:
                sent[flow_id] = active
                heappush(arrive, (now + active.latency_s, flow_id))
            else:                           # (started at or before now: delivered at now)
                delivered.append((now, flow_id, active))
            unit = unit_of.pop(flow_id)     # (every flow was rated, hence in a unit, before it can end)
            if not unit.broken:
                # Its other flows may no longer be connected: they become seeds, to be walked one by one and put
                # into new units (_components relies on every such flow's resources being seeds). A unit of this
                # flow alone has its resources: those still busy, below, are enough (idle seeds are skipped).
                unit.broken = True
                if len(unit.flows) > 1:
                    dirty.update(dict.fromkeys(unit.resources))
            res = active.res
            for resource in res:            # (each resource's other flows keep their order)
                crossing = on[resource]
                del crossing[flow_id]
                if crossing:                # its other flows need new rates
                    dirty[resource] = None
                    if len(crossing) == 1:  # one left alone here may now be alone everywhere
                        alone[next(iter(crossing))] = None
            if res[-1] < 0:                 # its private cap resource (always last) is dropped
                del capacity[res[-1]], on[res[-1]]

    def _drop_stale(self) -> None:
        """Pop finish entries none of whose flows is still valid; keep only the valid flows of the first one."""
        finish, active_of = self._finish, self._active
        while finish:
            members = finish[0][2]
            flow_id, version = members[0]
            active = active_of.get(flow_id)
            if active is not None and active.version == version:
                return
            valid = [(flow_id, version) for flow_id, version in members
                     if (active := active_of.get(flow_id)) is not None and active.version == version]
            if valid:
                members[:] = valid          # (the push number keeps the heap from comparing member lists)
                return
            heapq.heappop(finish)

    def _refresh(self) -> None:
        """Recompute rates of the flows connected (through shared resources) to a changed resource.

        Each connected component is filled on its own (components share no resource, so filling them together
        would do the same float operations on each), on the network's own bookkeeping: `_on` lists each
        resource's flows in id order, which is what `max_min_rates` would build.

        A component's rates are remembered under its shape: the shape id of every flow (route resources
        and rate cap), in flow id order. Equal shapes mean the same resources with the same capacities, the same
        uses and the same order of flows and of resource ids (a cap resource's id, -1 - flow id, orders the caps
        as their flows), so the filling would repeat the same float operations and return the same rates.
        """
        dirty = self._dirty
        if not dirty:
            return
        rated, seeds = self._lone_flows(dirty)
        dirty.clear()
        self._started_alone.clear()
        self._left_alone.clear()
        components = self._components(seeds) if seeds else ()
        now = self._now
        finish = self._finish
        memo = self._memo
        active_get = self._active.__getitem__
        inf = math.inf
        for found, resources in components:
            ids = sorted(found)
            flows = list(map(active_get, ids))
            if len(ids) >= _MEMO_MIN_FLOWS:
                key = tuple(map(_shape, flows))
                rates = memo.get(key)
                if rates is None:
                    rates = self._fill_component(ids, flows, resources)
                    if len(memo) >= _MEMO_ENTRIES:
                        del memo[next(iter(memo))]
                    memo[key] = rates
            else:
                rates = self._fill_component(ids, flows, resources)
            rated.append((ids, flows, rates))
        changed: defaultdict[float, list[tuple[int, int]]] = defaultdict(list)   # end -> [(flow id, version)]
        for ids, flows, rates in rated:
            for flow_id, active, rate in zip(ids, flows, rates):
                remaining = active.remaining - active.rate * (now - active.updated_s)
                if not remaining > 0.0:     # max(0.0, remaining)
                    remaining = 0.0
                active.remaining = remaining
                active.updated_s = now
                active.rate = rate
                end = now + remaining / rate if rate > 0 else inf
                if end != active.end_s:     # else its valid entry already says so: the heap pops the same
                    version = active.version = active.version + 1
                    active.end_s = end
                    changed[end].append((flow_id, version))
        heappush = heapq.heappush
        pushes = self._pushes
        for end, members in changed.items():
            pushes += 1
            heappush(finish, (end, pushes, members))
        self._pushes = pushes

    def _lone_flows(self, dirty: dict[int, None]) -> tuple[list[tuple[list[int], list[_Active], tuple[float]]],
                                                            list[int]]:
        """Rate the flows started since the last re-rating on idle resources only, or left alone on a resource since,
        that are alone on every resource they cross: ([flow id], [its state], (its rate,)) for each, and the busy
        resources of `dirty` that are none of theirs (in order), to search.

        Such a flow is a component of its own, which the search would find and `one_level` rate: with one flow
        every resource's share is capacity / times crossed, the least of them is tight, so `one_level` returns
        exactly that least share (when positive and finite; else the search and filling rate it). It depends
        only on the flow's shape, and is remembered by it. The flow gets the unit the search would give it: its
        own intact unit if it has one (that unit is then this flow alone), else a new one. A flow on a `dirty`
        resource that is alone everywhere is one of those (it started since on idle resources — one that found a busy
        resource is not alone before that resource's other flows end —, or the others on one of its resources ended
        since), so only they are looked at: a pass per flow, not per resource. (A flow the search rates gets
        the same float.) Idle resources are left out of the seeds: the search skips them anyway.
        """
        on, capacity, unit_of, lone, active_of = self._on, self._capacity, self._unit_of, self._lone, self._active
        on_get = on.__getitem__
        found: list[tuple[list[int], list[_Active], tuple[float]]] = []
        taken: set[int] = set()             # the resources of the flows rated here
        for flow_id in chain(self._left_alone, self._started_alone):
            active = active_of.get(flow_id)
            if active is None:              # (ended, or nothing to send: delivered without rating)
                continue
            res = active.res
            if res[0] in taken:             # rated above already (started since, and left alone since)
                continue
            if max(map(len, map(on_get, res))) != 1:
                continue
            rate = lone.get(active.shape)
            if rate is None:
                rate = lone[active.shape] = min([capacity[r] / on[r][flow_id] for r in res])
            if not 0.0 < rate < math.inf:
                continue
            unit = unit_of.get(flow_id)
            if unit is None or unit.broken:
                unit_of[flow_id] = Unit({flow_id}, set(res))
            taken.update(res)
            found.append(([flow_id], [active], (rate,)))
        busy = compress(dirty, map(on.get, dirty))      # (a dropped cap resource: None)
        return found, list(filterfalse(taken.__contains__, busy) if taken else busy)

    def _fill_component(self, ids: list[int], flows: list[_Active], resources: Iterable[int]) -> tuple[float, ...]:
        """Rates of one component's flows (`ids` increasing, `flows` their states), in that order: one level when
        `one_level` recognises it, else by filling."""
        capacity, on = self._capacity, self._on
        level = one_level(capacity, on, resources, flows, self._levels, not any(map(_multi, flows)))
        if level is not None:
            return (level,) * len(ids)
        rates: dict[int, float] = {}
        fill_rates({r: capacity[r] for r in resources}, {r: sum(on[r].values()) for r in resources}, on,
                   {flow_id: active.uses for flow_id, active in zip(ids, flows)}, resources, rates)
        return tuple([rates[flow_id] for flow_id in ids])

    def _components(self, seeds: Iterable[int]) -> list[tuple[set[int], set[int]]]:
        """The connected components (active flow ids, resource ids) holding `seeds` (`units.components`)."""
        self._stamp += 1
        return components(self._on, self._active, self._unit_of, seeds, self._stamp)
