"""Flows alone on every resource they cross are rated without a component search (FlowNetwork._lone_flows): the
same floats, deliveries and event times as the search and `one_level` give them, over random traffic and a
whole pipeline-parallel scenario."""

from __future__ import annotations

import math
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.network.flows import Flow, FlowNetwork
from simulator.network.topology import Route

ROOT = Path(__file__).resolve().parents[1]


class _Table:
    """Routes given as resource uses; latencies differ by source so deliveries do not all coincide."""

    def __init__(self, capacities, routes):
        self.capacities, self.routes = capacities, routes

    def route(self, src, dst) -> Route:
        uses = self.routes[(src, dst)]
        bottleneck = min((self.capacities[r] / n for r, n in uses), default=math.inf)
        return Route((str(src), str(dst)), uses, 0.0625 * (src % 3), bottleneck, ())

    def capacity_bytes_per_s(self, resource: int) -> float:
        return self.capacities[resource]


@st.composite
def mostly_private_traffic(draw):
    """Routes with private resources (their flows are often alone), some crossing a resource twice, some sharing
    one resource with another route; flows started in batches at increasing times, with and without caps."""
    capacities = {}
    routes = {}
    shared = draw(st.integers(0, 2))
    for r in range(shared):
        capacities[r] = draw(st.sampled_from([1.0, 1 / 3, 25e9]))
    for src in range(draw(st.integers(1, 7))):
        uses = []
        for k in range(draw(st.integers(1, 3))):
            resource = 100 + 10 * src + k
            capacities[resource] = draw(st.sampled_from([1.0, 3.0, 0.1, 1 / 3, 12.5e9, 25e9, 7.0]))
            uses.append((resource, draw(st.sampled_from([1, 1, 2]))))
        if shared and draw(st.booleans()):
            uses.append((draw(st.integers(0, shared - 1)), 1))
        routes[(src, src + 1000)] = tuple(sorted(uses))
    batches = []
    for start_s in sorted(draw(st.lists(st.sampled_from([0.0, 0.2, 0.5, 1.0, 3.0, 3.25, 40.0]),
                                        min_size=1, max_size=7))):
        batch = [(draw(st.integers(0, len(routes) - 1)), draw(st.sampled_from([1.0, 3.0, 1e9, 1 / 3, 0.0])),
                  draw(st.sampled_from([None, None, 0.5, 7.0])), draw(st.booleans()))
                 for _ in range(draw(st.integers(1, 5)))]
        batches.append((start_s, batch))
    return capacities, routes, batches


def _drive(net, batches):
    """What the engine asks of the network, with every answer: deliveries, flow ids, next events and rates."""
    seen = []
    for start_s, batch in batches:
        seen.append([(d.flow_id, d.start_s, d.end_s) for d in net.advance(start_s)])
        for src, size, cap, with_latency in batch:
            seen.append(net.start(Flow(src, src + 1000, size, cap), with_latency=with_latency))
        seen.append(net.next_event_s())
        seen.append(net.rates())
    while (event := net.next_event_s()) is not None:
        seen.append([(d.flow_id, d.start_s, d.end_s) for d in net.advance(event)])
        seen.append(net.rates())
    return seen


class _Searched(FlowNetwork):
    """A FlowNetwork that rates every component through the search (no lone-flow path)."""

    def _lone_flows(self, dirty):
        return [], list(dirty)


class _Counting(FlowNetwork):
    lone = 0

    def _lone_flows(self, dirty):
        found, seeds = super()._lone_flows(dirty)
        _Counting.lone += len(found)
        return found, seeds


@given(mostly_private_traffic())
@settings(max_examples=80, deadline=None)
def test_lone_flows_get_the_floats_of_the_search(case):
    capacities, routes, batches = case
    table = _Table(capacities, routes)
    assert _drive(_Counting(table), batches) == _drive(_Searched(table), batches)


def test_the_lone_path_is_taken_and_agrees_on_a_seeded_sweep():
    """Deterministic companion of the property test: it must actually rate flows alone (else it proves nothing)."""
    _Counting.lone = 0
    capacities = {0: 1 / 3, 100: 3.0, 101: 0.1, 110: 1 / 3, 111: 12.5e9, 120: 7.0}
    routes = {(0, 1000): ((100, 1), (101, 2)), (1, 1001): ((0, 1), (110, 1), (111, 1)), (2, 1002): ((0, 1), (120, 2))}
    batches = [(0.0, [(0, 1.0, None, True), (1, 3.0, 0.5, False)]), (0.5, [(2, 1 / 3, None, True)]),
               (3.0, [(0, 1e9, 7.0, True), (2, 1.0, None, False), (1, 1.0, None, True)])]
    table = _Table(capacities, routes)
    assert _drive(_Counting(table), batches) == _drive(_Searched(table), batches)
    assert _Counting.lone >= 3


def test_a_pipeline_scenario_reports_the_same_with_and_without_the_lone_path(monkeypatch):
    """Pipeline sends over PCIe, end to end: the report is the same to the last digit."""
    from simulator.api import simulate
    from simulator.cli import report_json
    from simulator.scenario.loader import scenario_from_dict
    from tests.test_stage_copies import _doc

    scenario = scenario_from_dict(_doc(pp=4))
    rated = []
    lone_flows = FlowNetwork._lone_flows

    def counted(self, dirty):
        found, seeds = lone_flows(self, dirty)
        rated.extend(found)
        return found, seeds

    monkeypatch.setattr(FlowNetwork, "_lone_flows", counted)
    fast = report_json(simulate(scenario, timelines=False).report)
    assert rated                    # the scenario's sends were rated alone
    monkeypatch.setattr(FlowNetwork, "_lone_flows", lambda self, dirty: ([], list(dirty)))
    searched = report_json(simulate(scenario, timelines=False).report)
    assert fast == searched


def test_a_flow_that_started_sharing_is_rated_alone_once_the_other_ends():
    """Only flows that started on idle resources are looked at as started since (FlowNetwork.start_many); one that
    found a busy resource is marked when that resource's other flow ends, and is then rated alone."""
    capacities = {0: 1.0, 100: 4.0, 110: 2.0}
    routes = {(0, 1000): ((0, 1), (100, 1)), (1, 1001): ((0, 1), (110, 1))}
    table = _Table(capacities, routes)
    net = _Counting(table)
    _Counting.lone = 0
    short = net.start(Flow(0, 1000, 0.5), with_latency=False)
    net.next_event_s()                      # alone on idle resources: rated alone
    assert _Counting.lone == 1 and net._started_alone == []
    long = net.start(Flow(1, 1001, 3.0), with_latency=False)
    assert net._started_alone == []         # it found resource 0 busy
    assert net.rates() == {short: 0.5, long: 0.5} and _Counting.lone == 1
    assert net.advance_ids(1.0) == [short]
    assert net.rates() == {long: 1.0} and _Counting.lone == 2   # alone once the short one ended
    batches = [(0.0, [(0, 0.5, None, False)]), (0.0, [(1, 3.0, None, False)])]
    assert _drive(_Counting(table), batches) == _drive(_Searched(table), batches)
