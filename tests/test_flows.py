"""FlowNetwork and max-min fairness: exact small cases; hypothesis properties (capacity, bottlenecks, determinism)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.errors import TopologyError
from simulator.network.flows import Flow, FlowNetwork, max_min_rates
from simulator.network.topology import Route, load_topology

REL = 1e-9


class TableNetwork:
    """A routing model from tables: route (src, dst) -> resources, capacities by resource id."""

    def __init__(self, capacities: list[float], routes: dict[tuple[int, int], tuple[tuple[int, int], ...]],
                 latency_s: float = 0.0) -> None:
        self.capacities = capacities
        self.routes = routes
        self.latency_s = latency_s

    def route(self, src, dst) -> Route:
        uses = self.routes[(src, dst)]
        bottleneck = min((self.capacities[r] / n for r, n in uses), default=math.inf)
        return Route((str(src), str(dst)), uses, self.latency_s if uses else 0.0, bottleneck, ())

    def capacity_bytes_per_s(self, resource: int) -> float:
        return self.capacities[resource]


def check_max_min(capacities: dict[int, float], uses: dict[int, tuple[tuple[int, int], ...]],
                  rates: dict[int, float]) -> None:
    """No resource over capacity; every flow crosses a saturated resource where no other flow is faster."""
    load = {r: 0.0 for r in capacities}
    for flow, route in uses.items():
        for resource, count in route:
            load[resource] += rates[flow] * count
    for resource, used in load.items():
        assert used <= capacities[resource] * (1 + REL), (resource, used, capacities[resource])
    for flow, route in uses.items():
        assert rates[flow] > 0
        bottlenecks = [r for r, _ in route
                       if load[r] >= capacities[r] * (1 - 1e-7)
                       and all(rates[flow] >= rates[other] * (1 - 1e-7)
                               for other, other_route in uses.items() if any(r == x for x, _ in other_route))]
        assert bottlenecks, f"flow {flow} at {rates[flow]} has no bottleneck resource"


@st.composite
def flow_sets(draw):
    resources = draw(st.integers(1, 8))
    capacities = {r: draw(st.floats(1.0, 1000.0)) for r in range(resources)}
    flows = draw(st.integers(1, 12))
    uses = {}
    for f in range(flows):
        chosen = draw(st.lists(st.integers(0, resources - 1), min_size=1, max_size=4, unique=True))
        uses[f] = tuple(sorted((r, draw(st.integers(1, 2))) for r in chosen))
    return capacities, uses


@given(flow_sets())
@settings(max_examples=150, deadline=None)
def test_max_min_rates_are_feasible_and_bottlenecked(case):
    capacities, uses = case
    rates = max_min_rates(capacities, uses)
    assert sorted(rates) == sorted(uses)
    check_max_min(capacities, uses, rates)


@given(flow_sets(), st.randoms(use_true_random=False))
@settings(max_examples=60, deadline=None)
def test_max_min_rates_do_not_depend_on_flow_order(case, rng):
    capacities, uses = case
    order = list(uses)
    rng.shuffle(order)
    relabel = {old: new for new, old in enumerate(order)}
    shuffled = {relabel[f]: route for f, route in uses.items()}
    first = max_min_rates(capacities, uses)
    second = max_min_rates(capacities, shuffled)
    for f in uses:
        assert second[relabel[f]] == pytest.approx(first[f], rel=1e-9)
    assert max_min_rates(capacities, uses) == first   # deterministic


def test_two_flows_share_a_link_then_the_survivor_speeds_up():
    net = FlowNetwork(TableNetwork([100.0, 100.0], {(0, 1): ((0, 1),), (2, 1): ((0, 1), (1, 1))}))
    a = net.start(Flow(0, 1, 100.0))
    b = net.start(Flow(2, 1, 300.0))
    assert net.rates() == {a: 50.0, b: 50.0}
    done = net.run()
    assert [(d.flow_id, d.end_s) for d in done] == [(a, 2.0), (b, pytest.approx(4.0))]


def test_weighted_use_of_a_shared_resource():
    # a flow crossing a shared resource twice (host memory written, then read) uses it at twice its rate
    net = FlowNetwork(TableNetwork([90.0, 1000.0], {(0, 1): ((0, 2), (1, 1)), (2, 3): ((0, 1),)}))
    a = net.start(Flow(0, 1, 1.0))
    b = net.start(Flow(2, 3, 1.0))
    assert net.rates() == {a: pytest.approx(30.0), b: pytest.approx(30.0)}


def test_latency_delays_delivery_but_not_the_link():
    net = FlowNetwork(TableNetwork([10.0], {(0, 1): ((0, 1),)}, latency_s=0.5))
    first = net.start(Flow(0, 1, 10.0))
    done = net.advance(1.0)
    assert done == [] and net.now_s == 1.0 and net.rate_bytes_per_s(first) == 0.0
    second = net.start(Flow(0, 1, 10.0))
    assert net.rate_bytes_per_s(second) == 10.0          # the link is free although the first is in flight
    done = net.run()
    assert [(d.flow_id, d.end_s) for d in done] == [(first, 1.5), (second, 2.5)]
    quiet = FlowNetwork(TableNetwork([10.0], {(0, 1): ((0, 1),)}, latency_s=0.5))
    quiet.start(Flow(0, 1, 10.0), with_latency=False)
    assert quiet.run()[0].end_s == 1.0


def test_rate_cap_and_zero_size_and_local_flows():
    net = FlowNetwork(TableNetwork([100.0], {(0, 1): ((0, 1),), (0, 0): ()}))
    capped = net.start(Flow(0, 1, 10.0, max_bytes_per_s=20.0))
    other = net.start(Flow(0, 1, 10.0))
    assert net.rates() == {capped: 20.0, other: 80.0}
    empty = net.start(Flow(0, 1, 0.0))
    local = net.start(Flow(0, 0, 5.0))
    done = {d.flow_id: d.end_s for d in net.run()}
    assert done[empty] == 0.0 and done[local] == 0.0
    assert done[other] == pytest.approx(0.125) and done[capped] == pytest.approx(0.5)


def test_bad_input_is_rejected():
    with pytest.raises(TopologyError, match="size_bytes"):
        Flow(0, 1, -1.0)
    with pytest.raises(TopologyError, match="max_bytes_per_s"):
        Flow(0, 1, 1.0, max_bytes_per_s=0.0)
    net = FlowNetwork(TableNetwork([1.0], {(0, 1): ((0, 1),)}), start_s=5.0)
    with pytest.raises(TopologyError, match="before now_s"):
        net.advance(4.0)


@st.composite
def timed_flows(draw):
    capacities, uses = draw(flow_sets())
    routes = {(f, f + 1000): route for f, route in uses.items()}
    starts = [draw(st.floats(0.0, 5.0)) for _ in uses]
    sizes = [draw(st.floats(1.0, 500.0)) for _ in uses]
    return [capacities[r] for r in sorted(capacities)], routes, sorted(zip(starts, sizes, sorted(uses)))


def _replay(capacities, routes, schedule, check=False):
    net = FlowNetwork(TableNetwork(capacities, routes))
    delivered = []
    ids = {}
    for start, size, f in schedule:
        delivered += net.advance(start)
        ids[net.start(Flow(f, f + 1000, size))] = f
        if check:   # incremental recomputation equals recomputing every active flow from scratch
            rates = net.rates()
            active = {i: routes[(ids[i], ids[i] + 1000)] for i in rates}
            fresh = max_min_rates({r: c for r, c in enumerate(capacities)}, active)
            for i, rate in rates.items():
                assert rate == pytest.approx(fresh[i], rel=1e-9)
            check_max_min({r: c for r, c in enumerate(capacities)}, active, rates)
    delivered += net.run()
    return [(d.flow_id, d.start_s, d.end_s) for d in delivered]


@given(timed_flows())
@settings(max_examples=80, deadline=None)
def test_network_delivers_every_flow_fairly_and_deterministically(case):
    capacities, routes, schedule = case
    result = _replay(capacities, routes, schedule, check=True)
    assert sorted(r[0] for r in result) == list(range(len(schedule)))
    for (flow_id, start_s, end_s), (start, size, f) in zip(sorted(result), schedule):
        best = min(capacities[r] / n for r, n in routes[(f, f + 1000)])
        assert start_s == start
        assert end_s >= start + size / best * (1 - 1e-9)      # never faster than the bottleneck alone
    assert _replay(capacities, routes, schedule) == result     # same input, same output


@given(timed_flows())
@settings(max_examples=60, deadline=None)
def test_network_is_work_conserving(case):
    """While flows are sending, every one of them is limited by a saturated resource (or its cap)."""
    capacities, routes, schedule = case
    net = FlowNetwork(TableNetwork(capacities, routes))
    ids = {}
    for start, size, f in schedule:
        net.advance(start)
        ids[net.start(Flow(f, f + 1000, size))] = f
    while net.active_count:
        rates = net.rates()
        active = {i: routes[(ids[i], ids[i] + 1000)] for i in rates}
        check_max_min({r: c for r, c in enumerate(capacities)}, active, rates)
        event = net.next_event_s()
        net.advance(event)


def test_topology_ring_on_nvswitch_runs_at_link_speed():
    topology = load_topology("dgx-a100")
    net = FlowNetwork(topology)
    for gpu in range(8):
        net.start(Flow(gpu, (gpu + 1) % 8, 240e9))
    assert set(net.rates().values()) == {240e9}
    loads = net.resource_loads()
    assert all(used <= capacity * (1 + REL) for used, capacity in loads.values())
    done = net.run()
    assert [d.end_s for d in done] == [pytest.approx(1.0 + topology.route(0, 1).latency_s, rel=1e-12)] * 8
