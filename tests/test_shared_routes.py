"""FlowNetwork's routes shared by the networks over one Topology: a network whose routes another one looked up gives
the same deliveries, rates and capacities as one over a topology never used."""

from __future__ import annotations

from simulator.network import load_topology
from simulator.network.flows import Flow, FlowNetwork


def _run(topology, flows):
    network = FlowNetwork(topology)
    ids = network.start_many(flows[:6])
    rates = network.rates()
    network.advance(1e-3)
    network.start_many(flows[6:], with_latency=False)
    return list(ids), rates, network.run(), dict(network._capacity)


def test_a_network_after_others_on_one_topology_runs_as_on_a_fresh_one():
    flows = [Flow(src, dst, float(1 << (20 + src % 3)), 2e10 if src == 3 else None)
             for src, dst in [(0, 9), (1, 9), (2, 10), (3, 11), (8, 0), (9, 1), (4, 12), (0, 1), (5, 13), (9, 0)]]
    used = load_topology("dgx-a100", nodes=2)
    FlowNetwork(used).start_many(flows[::-1])           # another network fills the shared routes first
    assert used.derived(("flow_routes",), dict)
    assert _run(used, flows) == _run(load_topology("dgx-a100", nodes=2), flows)
