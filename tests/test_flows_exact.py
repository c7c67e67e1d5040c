"""The fast flow-network paths return the very floats of the plain ones: lazy progressive filling against the
textbook loop, one-level components, remembered component rates, components kept as groups, batched starts,
shared collective simulations, interference components, footprints moved across servers."""

from __future__ import annotations

import heapq
import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import simulator.network.flows as flows_module
import simulator.network.units as units_module
from simulator.errors import TopologyError
from simulator.network.collectives import (REFERENCE_BYTES, CollectiveSchedule, Phase, lower_collective,
                                           simulate_schedule, transfer_seconds_per_byte)
from simulator.network.filling import one_level
from simulator.network.flows import Flow, FlowNetwork, max_min_rates
from simulator.network.footprint import interference_components
from simulator.network.topology import Route, load_topology


def reference_max_min_rates(capacities, uses):
    """The progressive filling memsim used before the lazy heap: a fresh entry after every change. A copy on
    purpose (filling._fill_eager is the same loop): an oracle that does not change with the code it checks."""
    remaining = dict(capacities)
    weight = {r: 0.0 for r in capacities}
    members = {r: [] for r in capacities}
    rates = {}
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
            continue
        touched = {}
        for flow_id in members[resource]:
            if flow_id in rates:
                continue
            rates[flow_id] = current
            for other, count in uses[flow_id]:
                remaining[other] -= current * count
                weight[other] -= count
                touched[other] = None
        weight[resource] = 0
        for other in touched:
            if weight[other] > 0 and other != resource:
                heapq.heappush(heap, (max(remaining[other], 0.0) / weight[other], other))
    return rates


# Few distinct capacities (ties between resources), awkward ones (rounding in every subtraction), and flows that
# repeat one another's routes (classes of identical flows).
CAPACITIES = st.sampled_from([1.0, 3.0, 7.0, 10.0, 0.1, 1 / 3, 25e9, 12.5e9, 300e9, 1e-3])


@st.composite
def duplicated_flow_sets(draw):
    resources = draw(st.integers(1, 10))
    capacities = {r: draw(CAPACITIES) for r in range(resources)}
    routes = []
    for _ in range(draw(st.integers(1, 6))):
        chosen = draw(st.lists(st.integers(0, resources - 1), min_size=1, max_size=5, unique=True))
        routes.append(tuple((r, draw(st.integers(1, 3))) for r in chosen))
    picks = draw(st.lists(st.integers(0, len(routes) - 1), min_size=1, max_size=40))
    uses = {flow_id: routes[pick] for flow_id, pick in enumerate(picks)}
    return capacities, uses


def same_floats(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] and math.copysign(1, a[k]) == math.copysign(1, b[k])
                                        for k in a)


@given(duplicated_flow_sets())
@settings(max_examples=150, deadline=None)
def test_lazy_filling_returns_the_reference_floats(case):
    capacities, uses = case
    assert same_floats(max_min_rates(capacities, uses), reference_max_min_rates(capacities, uses))


@given(duplicated_flow_sets(), st.integers(0, 3))
@settings(max_examples=100, deadline=None)
def test_eager_filling_for_infinite_capacities_is_the_reference(case, infinite):
    capacities, uses = case
    for r in list(capacities)[:infinite]:
        capacities[r] = math.inf
    new = max_min_rates(capacities, uses)
    old = reference_max_min_rates(capacities, uses)
    assert new.keys() == old.keys()
    assert all(new[k] == old[k] or (math.isnan(new[k]) and math.isnan(old[k])) for k in new)


# Inputs where a resource's share shrinks by rounding after a step (found by a seeded search): the lazy heap must
# queue the smaller share at once, or it takes the resource too late.
SHRINKING = [
    ({0: 1.0, 1: 1.0},
     {0: ((0, 3), (1, 3)), 1: ((0, 2),), 2: ((1, 1),), 3: ((1, 1),), 4: ((1, 1),), 5: ((0, 3), (1, 3)),
      6: ((1, 1),), 7: ((0, 2),), 8: ((1, 1),), 9: ((1, 1), (0, 1)), 10: ((1, 1),), 11: ((1, 1), (0, 1)),
      12: ((1, 1),), 13: ((0, 2),), 14: ((1, 1), (0, 1)), 15: ((1, 1),), 16: ((0, 2),), 17: ((0, 3), (1, 3)),
      18: ((0, 3), (1, 3)), 19: ((0, 3), (1, 3))}),
    ({0: 12500000000.0, 1: 1 / 3, 2: 0.1, 3: 7.0, 4: 0.1, 5: 3.0, 6: 7.0, 7: 10.0},
     {0: ((1, 3), (3, 2), (2, 1), (5, 3)), 1: ((1, 3), (3, 2), (2, 1), (5, 3)), 2: ((2, 3), (4, 1), (7, 2), (0, 2)),
      3: ((3, 2), (7, 3), (0, 3), (4, 3)), 4: ((2, 3), (4, 1), (7, 2), (0, 2)), 5: ((3, 2), (7, 3), (0, 3), (4, 3)),
      6: ((3, 2), (7, 3), (0, 3), (4, 3)), 7: ((2, 3), (0, 3))}),
    ({0: 7.0, 1: 7.0},
     {0: ((1, 3), (0, 3)), 1: ((1, 1),), 2: ((1, 1), (0, 3)), 3: ((1, 3), (0, 3)), 4: ((1, 3), (0, 3)),
      5: ((1, 1), (0, 3)), 6: ((1, 1),), 7: ((1, 1), (0, 3)), 8: ((1, 3), (0, 3)), 9: ((1, 1),),
      10: ((1, 3), (0, 3)), 11: ((1, 1),), 12: ((1, 3), (0, 3)), 13: ((0, 1), (1, 1)), 14: ((1, 1),),
      15: ((1, 1),), 16: ((1, 3), (0, 3)), 17: ((1, 1),), 18: ((0, 1), (1, 1)), 19: ((1, 3), (0, 3)),
      20: ((1, 1), (0, 3)), 21: ((1, 3), (0, 3)), 22: ((1, 1),), 23: ((1, 3), (0, 3)), 24: ((0, 1), (1, 1))}),
]


@pytest.mark.parametrize("capacities,uses", SHRINKING)
def test_shares_that_shrink_by_rounding_are_taken_in_order(capacities, uses):
    assert same_floats(max_min_rates(capacities, uses), reference_max_min_rates(capacities, uses))


def test_seeded_sweep_of_duplicated_flows_matches_the_reference():
    rng = random.Random(7)
    for _ in range(1500):
        resources = rng.randint(2, 8)
        capacities = {r: rng.choice([1.0, 3.0, 7.0, 0.1, 1 / 3, 10.0, 1e-3, 12.5e9]) for r in range(resources)}
        routes = [tuple((r, rng.randint(1, 3)) for r in rng.sample(range(resources), rng.randint(1, min(4, resources))))
                  for _ in range(rng.randint(1, 5))]
        uses = {f: rng.choice(routes) for f in range(rng.randint(1, 30))}
        assert same_floats(max_min_rates(capacities, uses), reference_max_min_rates(capacities, uses)), \
            (capacities, uses)


class TableNetwork:
    def __init__(self, capacities, routes):
        self.capacities = capacities
        self.routes = routes

    def route(self, src, dst) -> Route:
        uses = self.routes[(src, dst)]
        return Route((str(src), str(dst)), uses, 0.0, min(self.capacities[r] / n for r, n in uses), ())

    def capacity_bytes_per_s(self, resource: int) -> float:
        return self.capacities[resource]


def _replay(capacities, routes, batches):
    """Start each batch of flows at its time; return every delivery and the rates seen after each batch."""
    net = FlowNetwork(TableNetwork(capacities, routes))
    seen = []
    delivered = []
    for start_s, batch in batches:
        delivered += net.advance(start_s)
        for src, size, cap in batch:
            net.start(Flow(src, src + 1000, size, cap))
        seen.append(net.rates())
    delivered += net.run()
    return [(d.flow_id, d.start_s, d.end_s) for d in delivered], seen


@st.composite
def repeated_batches(draw):
    resources = draw(st.integers(2, 8))
    capacities = [draw(CAPACITIES) for _ in range(resources)]
    kinds = draw(st.integers(1, 4))
    routes = {}
    for src in range(kinds):
        chosen = draw(st.lists(st.integers(0, resources - 1), min_size=1, max_size=4, unique=True))
        routes[(src, src + 1000)] = tuple((r, 1) for r in chosen)
    batch = [(draw(st.integers(0, kinds - 1)), draw(st.sampled_from([1.0, 2.0, 5.0, 1e9])),
              draw(st.sampled_from([None, 0.5, 2.0]))) for _ in range(draw(st.integers(1, 12)))]
    times = sorted(draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 7.0, 30.0]), min_size=1, max_size=5)))
    return capacities, routes, [(t, batch) for t in times]


@given(repeated_batches())
@settings(max_examples=60, deadline=None)
def test_remembered_component_rates_change_nothing(case):
    """Components with the same shapes recur (the same batch started again); remembering their rates from the
    first filling gives the same deliveries, to the last bit, as filling every time."""
    capacities, routes, batches = case
    original = flows_module._MEMO_MIN_FLOWS
    try:
        flows_module._MEMO_MIN_FLOWS = 1
        remembered = _replay(capacities, routes, batches)
        flows_module._MEMO_MIN_FLOWS = 10**9
        filled = _replay(capacities, routes, batches)
    finally:
        flows_module._MEMO_MIN_FLOWS = original
    assert remembered == filled


def test_remembered_rates_are_used_for_a_recurring_component():
    capacities = [10.0, 1 / 3, 7.0]
    routes = {(f, f + 1000): ((f % 3, 1), ((f + 1) % 3, 1)) for f in range(80)}
    net = FlowNetwork(TableNetwork(capacities, routes))
    for f in range(80):
        net.start(Flow(f, f + 1000, 1.0))
    first = list(net.rates().values())
    net.run()
    remembered = dict(net._memo)        # (with the smaller components left as flows ended)
    for f in range(80):
        net.start(Flow(f, f + 1000, 1.0))
    assert list(net.rates().values()) == first
    assert net._memo == remembered and tuple(first) in remembered.values()


def test_collectives_with_the_same_shape_share_one_simulation_and_its_exact_value():
    topology = load_topology("dgx-a100", nodes=8)
    for kind, group in (("all_reduce", tuple(range(16, 24))), ("all_reduce", tuple(range(24, 32))),
                        ("all_reduce", tuple(range(3, 64, 8))), ("all_reduce", tuple(range(5, 64, 8))),
                        ("all_gather", tuple(range(5, 64, 8))), ("reduce_scatter", (0, 1, 2, 3))):
        for algorithm, protocol in (("ring", "ll"), ("ring", "simple"), ("tree", "ll128")):
            if algorithm == "tree" and kind != "all_reduce":
                continue
            schedule = lower_collective(topology, kind, group, REFERENCE_BYTES, algorithm, protocol)
            bare = CollectiveSchedule(kind, group, REFERENCE_BYTES, algorithm, protocol,
                                      tuple(Phase(p.flows, 0.0) for p in schedule.phases))
            direct = simulate_schedule(topology, bare) / REFERENCE_BYTES
            assert transfer_seconds_per_byte(topology, kind, group, algorithm, protocol) == direct
    shapes = [key for key in topology._derived if key[0] == "collective shape"]
    collectives = [key for key in topology._derived if key[0] == "collective"]
    assert len(shapes) < len(collectives)     # rails 3 and 5 (and the two node-local groups) share shapes


def _reference_components(footprints):
    """Components by repeated merging of overlapping resource sets (no union-find)."""
    groups: list[set[int]] = []
    for resources in footprints.values():
        merged = set(resources)
        rest = []
        for group in groups:
            if group & merged:
                merged |= group
            else:
                rest.append(group)
        groups = rest + [merged] if merged else rest
    root = {r: min(g) for g in groups for r in g}
    return {key: root[resources[0]] if resources else -1 for key, resources in footprints.items()}


@given(st.lists(st.lists(st.integers(0, 40), max_size=5, unique=True).map(lambda x: tuple(sorted(x))),
                min_size=1, max_size=25), st.data())
@settings(max_examples=60, deadline=None)
def test_interference_components_with_shared_footprints(distinct, data):
    shared = [data.draw(st.sampled_from(distinct)) for _ in range(data.draw(st.integers(1, 40)))]
    footprints = {i: resources for i, resources in enumerate(shared)}
    assert interference_components(footprints) == _reference_components(footprints)


@pytest.mark.parametrize("dp,pp,tp", [(2, 3, 4), (4, 2, 1), (1, 1, 8)])
def test_rank_of_and_coords_round_trip(dp, pp, tp):
    from simulator.errors import PlanError
    from simulator.parallel.plan import ParallelPlan
    plan = ParallelPlan(dp=dp, pp=pp, tp=tp)
    for rank in range(plan.world_size):
        c = plan.coords(rank)
        assert plan.rank_of(dp=c.dp, pp=c.pp, tp=c.tp) == rank
    with pytest.raises(PlanError, match="tp = True"):
        plan.rank_of(dp=0, pp=0, tp=True)
    with pytest.raises(PlanError, match="rank = "):
        plan.coords(plan.world_size)
    with pytest.raises(PlanError, match="dp = "):
        plan.rank_of(dp=dp, pp=0, tp=0)


class ReferenceNetwork:
    """The FlowNetwork algorithm before its fast paths: one flow at a time through per-resource dicts, components
    by a flow-by-flow search, every component filled by `max_min_rates`, a finish heap with versions."""

    def __init__(self, topology):
        self.topology, self.now, self.next_id = topology, 0.0, 0
        self.active, self.on, self.capacity, self.dirty = {}, {}, {}, {}
        self.finish, self.arrive, self.sent = [], [], {}

    def start(self, flow, with_latency=True):
        route = self.topology.route(flow.src, flow.dst)
        flow_id, self.next_id = self.next_id, self.next_id + 1
        uses = route.resources
        if flow.max_bytes_per_s is not None:
            self.capacity[-1 - flow_id] = float(flow.max_bytes_per_s)
            uses = uses + ((-1 - flow_id, 1),)
        state = {"flow": flow, "start": self.now, "uses": uses, "remaining": float(flow.size_bytes), "rate": 0.0,
                 "updated": self.now, "version": 0, "latency": route.latency_s if with_latency else 0.0}
        if flow.size_bytes == 0 or not uses:
            self.sent[flow_id] = state
            heapq.heappush(self.arrive, (self.now + state["latency"], flow_id))
            return flow_id
        self.active[flow_id] = state
        for resource, count in uses:
            if resource not in self.capacity:
                self.capacity[resource] = self.topology.capacity_bytes_per_s(resource)
            self.on.setdefault(resource, {})[flow_id] = count
            self.dirty[resource] = None
        return flow_id

    def refresh(self):
        seen = set()
        for seed in self.dirty:
            if seed in seen or seed not in self.on:
                continue
            seen.add(seed)
            found, stack = {}, [seed]
            while stack:
                for flow_id in self.on[stack.pop()]:
                    if flow_id not in found:
                        found[flow_id] = self.active[flow_id]
                        for other, _ in found[flow_id]["uses"]:
                            if other not in seen:
                                seen.add(other)
                                stack.append(other)
            uses = {flow_id: state["uses"] for flow_id, state in found.items()}
            rates = max_min_rates({r: self.capacity[r] for u in uses.values() for r, _ in u}, uses)
            for flow_id, state in found.items():
                state["remaining"] = max(0.0, state["remaining"] - state["rate"] * (self.now - state["updated"]))
                state["updated"], state["rate"] = self.now, rates[flow_id]
                state["version"] += 1
                end = self.now + state["remaining"] / state["rate"] if state["rate"] > 0 else math.inf
                heapq.heappush(self.finish, (end, flow_id, state["version"]))
        self.dirty.clear()

    def next_event_s(self):
        self.refresh()
        while self.finish and (self.finish[0][1] not in self.active
                               or self.active[self.finish[0][1]]["version"] != self.finish[0][2]):
            heapq.heappop(self.finish)
        times = [heap[0][0] for heap in (self.finish, self.arrive) if heap]
        return min(times) if times else None

    def advance(self, until_s):
        delivered = []
        while True:
            event = self.next_event_s()
            if event is None or event > until_s:
                break
            self.now = max(self.now, event)
            horizon = event + flows_module._SAME_TIME * max(event, 1e-9)
            ended = []
            while self.finish and self.finish[0][0] <= horizon:
                _, flow_id, version = heapq.heappop(self.finish)
                if flow_id in self.active and self.active[flow_id]["version"] == version:
                    ended.append(flow_id)
            for flow_id in ended:
                state = self.sent[flow_id] = self.active.pop(flow_id)
                for resource, _ in state["uses"]:
                    del self.on[resource][flow_id]
                    self.dirty[resource] = None
                    if not self.on[resource]:
                        del self.on[resource]
                heapq.heappush(self.arrive, (self.now + state["latency"], flow_id))
            while self.arrive and self.arrive[0][0] <= horizon:
                arrive_s, flow_id = heapq.heappop(self.arrive)
                state = self.sent.pop(flow_id)
                delivered.append((flow_id, state["start"], max(arrive_s, state["start"])))
        if math.isfinite(until_s):
            self.now = max(self.now, until_s)
        return sorted(delivered, key=lambda d: (d[2], d[0]))


@st.composite
def launch_plans(draw):
    """Routes over a few resources (some shared by every route, some private), then batches of flows started at
    increasing times: symmetric flows that end together, caps, repeated batches (remembered rates)."""
    resources = draw(st.integers(2, 9))
    capacities = [draw(CAPACITIES) for _ in range(resources)]
    routes = {}
    for src in range(draw(st.integers(1, 6))):
        chosen = draw(st.lists(st.integers(0, resources - 1), min_size=0, max_size=4, unique=True))
        routes[(src, src + 1000)] = tuple(sorted((r, draw(st.integers(1, 2))) for r in chosen))
    batches = []
    for start_s in sorted(draw(st.lists(st.sampled_from([0.0, 0.25, 1.0, 3.0, 3.5, 40.0]), min_size=1, max_size=6))):
        batch = [(draw(st.integers(0, len(routes) - 1)), draw(st.sampled_from([0.0, 1.0, 3.0, 1e9, 1 / 3])),
                  draw(st.sampled_from([None, None, 0.5, 7.0])), draw(st.booleans()))
                 for _ in range(draw(st.integers(1, 10)))]
        batches.append((start_s, batch))
    return capacities, routes, batches


class LatencyTable(TableNetwork):
    """TableNetwork with route latencies and empty routes (source == destination)."""

    def route(self, src, dst) -> Route:
        uses = self.routes[(src, dst)]
        bottleneck = min((self.capacities[r] / n for r, n in uses), default=math.inf)
        return Route((str(src), str(dst)), uses, 0.125 * (src % 3), bottleneck, ())


def _drive(net, batches, memo_min_flows, max_units=None):
    """Every FlowNetwork call the engine makes, recording what each returns (with `max_units` units at most in
    a component, when given)."""
    original, original_units = flows_module._MEMO_MIN_FLOWS, units_module.MAX_UNITS
    flows_module._MEMO_MIN_FLOWS = memo_min_flows
    units_module.MAX_UNITS = original_units if max_units is None else max_units
    try:
        seen = []
        for start_s, batch in batches:
            seen.append(("advance", [tuple(d) if isinstance(d, tuple) else (d.flow_id, d.start_s, d.end_s)
                                     for d in net.advance(start_s)]))
            for src, size, cap, with_latency in batch:
                seen.append(("start", net.start(Flow(src, src + 1000, size, cap), with_latency=with_latency)))
            seen.append(("next", net.next_event_s()))
        while (event := net.next_event_s()) is not None:
            seen.append(("advance", [tuple(d) if isinstance(d, tuple) else (d.flow_id, d.start_s, d.end_s)
                                     for d in net.advance(event)]))
        return seen
    finally:
        flows_module._MEMO_MIN_FLOWS, units_module.MAX_UNITS = original, original_units


@given(launch_plans(), st.sampled_from([1, 3, 10**9]), st.sampled_from([1, 2, 16]))
@settings(max_examples=100, deadline=None)
def test_flow_network_returns_the_floats_of_the_reference_network(case, memo_min_flows, max_units):
    """Set-based component search over units, per-route start data, idle resources left among the seeds, weights
    summed when filling, remembered rates: every delivery and event time is the reference's, to the last bit."""
    capacities, routes, batches = case
    table = LatencyTable(capacities, routes)
    fast = _drive(FlowNetwork(table), batches, memo_min_flows, max_units)
    assert fast == _drive(ReferenceNetwork(table), batches, memo_min_flows)


def test_flow_network_matches_the_reference_on_a_fabric():
    """Two all-reduce-like rings across nodes and a stream of point-to-point sends over a dgx-a100 fabric."""
    topology = load_topology("dgx-a100", nodes=4)
    rng = random.Random(3)
    batches = []
    for step in range(12):
        batch = [(gpu, float(rng.choice([1e6, 4e6, 16e6])), rng.choice([None, None, 5e9]), rng.random() < 0.5)
                 for gpu in rng.sample(range(32), rng.randint(1, 12))]
        batches.append((step * rng.choice([1e-4, 3e-4, 1e-3]), batch))
    batches.sort(key=lambda b: b[0])

    class Ring:
        def route(self, src, dst):
            return topology.route(src, (src * 8 + 9) % 32 if src % 2 else (src + 1) % 32)

        def capacity_bytes_per_s(self, resource):
            return topology.capacity_bytes_per_s(resource)

    fast = _drive(FlowNetwork(Ring()), batches, 4)
    assert fast == _drive(ReferenceNetwork(Ring()), batches, 4)
    assert len(fast) > 30


# ----- one level without filling, components kept as groups, batched starts, footprints moved across servers -----

def _one_level_of(capacities, uses):
    """filling.one_level on the bookkeeping FlowNetwork keeps for `uses` (flow id -> route uses)."""
    on = {}
    for flow_id in sorted(uses):
        for resource, count in uses[flow_id]:
            on.setdefault(resource, {})[flow_id] = count

    class State:
        def __init__(self, res):
            self.res = res

    flows = [State(tuple(r for r, _ in uses[f])) for f in sorted(uses)]
    level = one_level(capacities, on, list(on), flows, {})
    if all(count == 1 for route in uses.values() for _, count in route):     # the caller may say so: same answer
        assert one_level(capacities, on, list(on), flows, {}, True) == level or level is None and \
            one_level(capacities, on, list(on), flows, {}, True) is None
    return level


@st.composite
def ring_like_flow_sets(draw):
    """Rings of flows over a few links with awkward capacities: often one level, sometimes a dip by rounding."""
    capacity = draw(st.sampled_from([1.0, 1 / 3, 0.1, 7.0, 25e9, 12.5e9]))
    links = draw(st.integers(2, 12))
    capacities = {r: capacity if draw(st.integers(0, 4)) else capacity * draw(st.sampled_from([2.0, 3.0, 0.5]))
                  for r in range(2 * links)}
    uses = {}
    for flow_id in range(draw(st.integers(1, 30))):
        first = draw(st.integers(0, links - 1))
        route = {first: 1, links + (first + draw(st.integers(1, 3))) % links: 1}
        if draw(st.booleans()):
            route[draw(st.integers(0, 2 * links - 1))] = 1
        uses[flow_id] = tuple(sorted(route.items()))
    return capacities, uses


@st.composite
def single_use_flow_sets(draw):
    """Few resources with awkward capacities, every flow crossing each of its resources once."""
    resources = draw(st.integers(2, 6))
    capacities = {r: draw(st.sampled_from([1.0, 0.1, 1 / 3, 0.7, 3.0, 10.0, 0.3, 1e-3, 12.5e9, 7.0]))
                  for r in range(resources)}
    uses = {flow_id: tuple((r, 1) for r in sorted(draw(st.lists(st.integers(0, resources - 1), min_size=1,
                                                                  max_size=3, unique=True))))
            for flow_id in range(draw(st.integers(2, 12)))}
    return capacities, uses


@given(st.one_of(ring_like_flow_sets(), single_use_flow_sets(), duplicated_flow_sets()))
@settings(max_examples=250, deadline=None)
def test_one_level_answers_only_with_the_reference_rate_of_every_flow(case):
    capacities, uses = case
    level = _one_level_of(capacities, uses)
    if level is not None:
        reference = reference_max_min_rates(capacities, uses)
        assert all(rate == level for rate in reference.values())


# Found by a seeded search: every flow crosses a resource whose share stays at the level, but another resource's
# share dips below it by rounding (first two), or a resource only starts at the level and then rises (last two);
# filling then gives two rates that differ in the last bits, and the shortcut must decline.
TWO_LEVELS_BY_ROUNDING = [
    ({0: 1.0, 1: 10.0, 2: 1.0},
     {0: ((0, 1), (1, 1), (2, 1)), 1: ((0, 1), (2, 1)), 2: ((2, 1),), 3: ((0, 1),), 4: ((0, 1), (1, 1), (2, 1)),
      5: ((2, 1),), 6: ((0, 1),), 7: ((0, 1), (2, 1)), 8: ((0, 1), (1, 1), (2, 1)), 9: ((0, 1), (1, 1), (2, 1)),
      10: ((0, 1), (2, 1))}),
    ({0: 0.1, 1: 0.1},
     {0: ((0, 1), (1, 1)), 1: ((1, 1),), 2: ((1, 1),), 3: ((0, 1),), 4: ((0, 1), (1, 1)), 5: ((0, 1), (1, 1)),
      6: ((0, 1),), 7: ((0, 1), (1, 1)), 8: ((0, 1), (1, 1))}),
    ({0: 0.3, 1: 0.3},
     {0: ((1, 1),), 1: ((1, 1),), 2: ((0, 1), (1, 1)), 3: ((0, 1), (1, 1)), 4: ((0, 1),), 5: ((0, 1), (1, 1)),
      6: ((0, 1),), 7: ((0, 1), (1, 1))}),
    ({0: 0.1, 1: 1 / 3, 2: 7.0, 3: 0.1},
     {0: ((0, 1), (2, 1)), 1: ((1, 1), (3, 1)), 2: ((2, 1), (3, 1)), 3: ((0, 1),), 4: ((3, 1),),
      5: ((0, 1), (1, 1), (3, 1)), 6: ((0, 1), (2, 1))}),
]


@pytest.mark.parametrize("capacities,uses", TWO_LEVELS_BY_ROUNDING)
def test_one_level_declines_when_rounding_makes_two_levels(capacities, uses):
    assert len(set(reference_max_min_rates(capacities, uses).values())) == 2
    assert _one_level_of(capacities, uses) is None


def test_one_level_answers_for_symmetric_rings_and_declines_otherwise():
    ring = {f: ((f, 1), (10 + (f + 1) % 10, 1)) for f in range(10)}
    assert _one_level_of({r: 1 / 3 for r in range(20)}, ring) == 1 / 3
    # two flows share a link of capacity 1: they get 1/2, the others 1 -> two levels
    shared = dict(ring)
    shared[10] = ((0, 1), (11, 1))
    capacities = {r: 1.0 for r in range(20)}
    assert _one_level_of(capacities, shared) is None
    assert set(reference_max_min_rates(capacities, shared).values()) == {0.5, 1.0}
    # a link crossed twice by one flow and once by another: counts differ on one resource
    assert _one_level_of({0: 1.0, 1: 1.0}, {0: ((0, 2),), 1: ((0, 1), (1, 1))}) is None


def test_one_level_answers_on_a_good_share_of_ring_like_sets():
    """The shortcut is worth having only if it answers often: count its answers on a seeded sample."""
    rng = random.Random(11)
    answered = 0
    for _ in range(300):
        links = rng.randint(2, 12)
        capacity = rng.choice([1.0, 1 / 3, 0.1, 7.0, 25e9])
        capacities = {r: capacity for r in range(2 * links)}
        uses = {f: tuple(sorted({f % links: 1, links + (f + 1) % links: 1}.items())) for f in range(links)}
        level = _one_level_of(capacities, uses)
        answered += level is not None
        if level is not None:
            assert all(rate == level for rate in reference_max_min_rates(capacities, uses).values())
    assert answered >= 250


def _true_component(net, resource):
    """The flows connected to `resource`, by a plain search over the network's bookkeeping."""
    flows, seen, stack = set(), {resource}, [resource]
    while stack:
        for flow_id in net._on[stack.pop()]:
            if flow_id not in flows:
                flows.add(flow_id)
                for other in net._active[flow_id].res:
                    if other not in seen:
                        seen.add(other)
                        stack.append(other)
    return flows, seen


def _connected_alone(net, flows):
    """Whether `flows` are connected through their own resources (the other flows left out)."""
    flows = set(flows)
    first = next(iter(flows))
    reached, stack = {first}, [first]
    while stack:
        for resource in net._active[stack.pop()].res:
            for other in net._on[resource]:
                if other in flows and other not in reached:
                    reached.add(other)
                    stack.append(other)
    return reached == flows


@given(launch_plans(), st.sampled_from([1, 2, 16]))
@settings(max_examples=80, deadline=None)
def test_units_are_connected_and_the_search_finds_the_true_components(case, max_units):
    """After every re-rating each sending flow is in an intact unit: flows connected through their own resources,
    with exactly those (busy) resources, linked to every intact unit it shares a resource with; and the component
    search from all busy resources, taking units whole, gives exactly the true components."""
    capacities, routes, batches = case
    net = FlowNetwork(LatencyTable(capacities, routes))
    original = units_module.MAX_UNITS
    units_module.MAX_UNITS = max_units
    try:
        _check_units(net, batches)
    finally:
        units_module.MAX_UNITS = original


def _busy(net):
    """The resources some flow crosses (the network keeps an idle link's empty dict)."""
    return {resource for resource, crossing in net._on.items() if crossing}


def _check_units(net, batches):
    for start_s, batch in batches:
        net.advance(start_s)
        for src, size, cap, with_latency in batch:
            net.start(Flow(src, src + 1000, size, cap), with_latency=with_latency)
        net.next_event_s()
        assert set(net._unit_of) == set(net._active)                # rated, hence in a unit
        units = list({id(u): u for u in net._unit_of.values()}.values())
        for unit in units:
            assert not unit.broken and unit.flows == {f for f in net._active if net._unit_of[f] is unit}
            assert unit.resources == set().union(*(net._active[f].res for f in unit.flows)) <= _busy(net)
            assert _connected_alone(net, unit.flows)
        for one, other in itertools.combinations(units, 2):
            if not one.resources.isdisjoint(other.resources):
                assert other in one.neighbors or one in other.neighbors
        components = net._components(list(net._on))      # (idle resources among them are skipped)
        assert sorted(map(sorted, (f for f, _ in components))) == \
            sorted(sorted(_true_component(net, r)[0]) for r in {min(res) for _, res in components})
        for flows, resources in components:
            assert (flows, resources) == _true_component(net, next(iter(resources)))
        assert set().union(*(f for f, _ in components)) == set(net._active)
    net.run()
    assert not _busy(net) and not net._unit_of


def test_a_component_cut_in_two_by_an_ending_flow_is_two_components():
    """A and B are joined only through C; once C ends, a new flow on A's link re-rates A alone, not B."""
    capacities = [10.0, 1 / 3, 3.0]
    routes = {(0, 1000): ((0, 1),), (1, 1001): ((2, 1),), (2, 1002): ((0, 1), (1, 1), (2, 1)),
              (3, 1003): ((0, 1),)}
    net = FlowNetwork(TableNetwork(capacities, routes))
    a, b, c = (net.start(Flow(src, src + 1000, size)) for src, size in ((0, 50.0), (1, 50.0), (2, 0.1)))
    assert [d.flow_id for d in net.advance(1.0)] == [c]
    net.next_event_s()
    b_state = (net._active[b].updated_s, net._active[b].remaining)
    d = net.start(Flow(3, 1003, 5.0))
    net.next_event_s()
    assert net._unit_of[a].flows | net._unit_of[d].flows == {a, d} and net._unit_of[b].flows == {b}
    assert (net._active[b].updated_s, net._active[b].remaining) == b_state    # B was not re-rated
    assert net.run() and not _busy(net)


@given(launch_plans())
@settings(max_examples=60, deadline=None)
def test_batched_starts_and_delivered_ids_match_one_by_one(case):
    capacities, routes, batches = case
    table = LatencyTable(capacities, routes)
    single, batched = FlowNetwork(table), FlowNetwork(table)
    for start_s, batch in batches:
        assert [d.flow_id for d in single.advance(start_s)] == batched.advance_ids(start_s)
        for with_latency in (False, True):
            flows = [Flow(src, src + 1000, size, cap) for src, size, cap, w in batch if w == with_latency]
            ids = [single.start(flow, with_latency=with_latency) for flow in flows]
            assert list(batched.start_many(flows, with_latency=with_latency)) == ids
        assert single.next_event_s() == batched.next_event_s()
    assert [(d.flow_id, d.start_s, d.end_s) for d in single.run()] == \
        [(d.flow_id, d.start_s, d.end_s) for d in batched.run()]


def _footprint_from_lowering(topology, kind, group, size):
    """NetworkModel._any_footprint without its shortcuts: every candidate algorithm lowered on its own links."""
    from simulator.network.collectives import candidates
    from simulator.network.footprint import footprint
    found = set()
    first = {}
    for algorithm, protocol in candidates(topology, kind, group):
        first.setdefault(algorithm, protocol)
    for algorithm, protocol in first.items():
        found.update(footprint(topology, lower_collective(topology, kind, group, size, algorithm, protocol)))
    return tuple(sorted(found))


@pytest.mark.parametrize("name", ["dgx-a100", "dgx-h100", "hgx-h200", "pcie-8xa100", "pcie-4x4090"])
def test_footprints_inside_one_server_are_those_of_server_0_moved(name):
    import simpy
    from simulator.engine.network_model import NetworkModel
    topology = load_topology(name, nodes=3)
    per = topology.gpus_per_node
    rng = random.Random(5)
    for node in (1, 2):
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
            for _ in range(3):
                local = rng.sample(range(per), rng.randint(2, per))
                group = tuple(node * per + g for g in local)
                model = NetworkModel(simpy.Environment(), topology, (0,))
                assert model._any_footprint((kind, group, 1e6)) == \
                    _footprint_from_lowering(topology, kind, group, 1e6), (name, kind, group)
    with pytest.raises(TopologyError, match="node = 3"):
        topology.local_offset(3)


@pytest.mark.parametrize("name, nodes, rail_optimized", [("dgx-a100", 40, True), ("dgx-a100", 12, False),
                                                         ("dgx-h100", 3, True), ("pcie-4x4090", 2, True)])
def test_route_uses_resources_and_latency_without_the_route_equal_the_route(name, nodes, rail_optimized):
    import dataclasses
    topology = load_topology(name, nodes=nodes)
    if not rail_optimized:
        fabric = dataclasses.replace(topology.fabric, rail_optimized=False, leaf_down_ports=16)
        topology = dataclasses.replace(topology, fabric=fabric)
    rng = random.Random(9)
    components = topology._index.names
    points = list(range(topology.num_gpus)) + [f"n{node}/{c}" for node in range(nodes) for c in components]
    pairs = [(rng.choice(points), rng.choice(points)) for _ in range(1500)]
    reference = dataclasses.replace(topology)       # a fresh copy: its routes are built first
    for a, b in pairs[::2]:     # half of the pairs' hops found by pairs_resources first (route_uses reuses them)
        try:
            topology.pairs_resources([(a, b)])
        except TopologyError:
            pass
    repeats = 0
    for a, b in pairs:
        try:
            expected = reference.route(a, b).resources
        except TopologyError:                       # e.g. a switch that reaches no NIC
            with pytest.raises(TopologyError):
                topology.route_uses(a, b)
            with pytest.raises(TopologyError):
                topology.route_latency_s(a, b)
            continue
        assert topology.route_uses(a, b) == expected                     # before topology builds the route
        assert topology.route_resources(a, b) == tuple(r for r, _ in expected)
        assert topology.pairs_resources([(a, b), (b, a)]) == \
            {r for r, _ in expected} | {r for r, _ in reference.route(b, a).resources}
        latency_s, route_latency_s = topology.route_latency_s(a, b), reference.route(a, b).latency_s
        assert latency_s == route_latency_s and type(latency_s) is type(route_latency_s)
        repeats += any(n > 1 for _, n in expected)
    assert repeats > 0 or name != "pcie-4x4090"     # host memory links are crossed twice there


@pytest.mark.parametrize("name", ["dgx-a100", "pcie-8xa100", "pcie-4x4090"])
def test_layout_link_class_is_that_of_the_groups_own_routes(name):
    from simulator.network.collectives import _layout
    topology = load_topology(name, nodes=3)
    per = topology.gpus_per_node
    rng = random.Random(3)
    for _ in range(40):
        group = tuple(sorted(rng.sample(range(topology.num_gpus), rng.randint(2, 2 * per))))
        nodes = {}
        for gpu in group:
            nodes.setdefault(gpu // per, []).append(gpu)
        pairs = [(a, b) for gpus in nodes.values() for a, b in zip(gpus, gpus[1:] + gpus[:1]) if a != b] or [(0, 1)]
        nvlink = all(c == "nvlink" for a, b in pairs for c in topology.route(a, b).link_classes)
        assert _layout(topology, group).intra == ("nvlink" if nvlink else "pci")
