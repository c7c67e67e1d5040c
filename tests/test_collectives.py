"""Collectives as flows: nccl-tests bus bandwidth on DGX/HGX, PCIe and multi-node bounds, schedules, choice."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.errors import TopologyError
from simulator.network.collectives import (
    KINDS,
    NVLS_EFFICIENCY,
    WIRE_EFFICIENCY,
    binary_tree_parents,
    bus_factor,
    candidates,
    choose_algorithm,
    collective_time_s,
    lower_collective,
    run_collective,
    simulate_schedule,
)
from simulator.network.topology import load_topology

GIB = 2**30
# shared/reference/hardware.md: nccl-tests all_reduce busbw, large messages, 8 GPUs.
MEASURED_BUSBW = {"dgx-a100": 230e9, "dgx-h100-ring": 370e9, "dgx-h100-nvls": 480e9, "hgx-h200": 475e9}


def test_dgx_a100_all_reduce_reaches_the_nccl_tests_busbw():
    result = run_collective(load_topology("dgx-a100"), "all_reduce", range(8), GIB)
    assert (result.algorithm, result.protocol) == ("ring", "simple")
    assert result.busbw_bytes_per_s == pytest.approx(MEASURED_BUSBW["dgx-a100"], rel=0.10)


def test_dgx_h100_all_reduce_ring_and_nvls_reach_the_nccl_tests_busbw():
    topology = load_topology("dgx-h100")
    ring = run_collective(topology, "all_reduce", range(8), GIB, "ring")
    assert ring.busbw_bytes_per_s == pytest.approx(MEASURED_BUSBW["dgx-h100-ring"], rel=0.10)
    chosen = run_collective(topology, "all_reduce", range(8), GIB)
    assert (chosen.algorithm, chosen.protocol) == ("nvls", "simple")
    assert chosen.busbw_bytes_per_s == pytest.approx(MEASURED_BUSBW["dgx-h100-nvls"], rel=0.10)
    h200 = run_collective(load_topology("hgx-h200"), "all_reduce", range(8), GIB)
    assert h200.busbw_bytes_per_s == pytest.approx(MEASURED_BUSBW["hgx-h200"], rel=0.10)


def test_nvls_bandwidth_follows_the_switch_traffic_model():
    # per GPU and direction: S (n+1)/n / 0.85 over an NVLink4 port of 18 x 20.6 GB/s
    topology = load_topology("dgx-h100")
    port = 18 * 20.6e9
    for n in (2, 4, 8):
        time_s = collective_time_s(topology, "all_reduce", range(n), GIB, "nvls", "simple")
        expected = 23e-6 + GIB * (n + 1) / n / NVLS_EFFICIENCY / port
        assert time_s == pytest.approx(expected, rel=1e-9)


def test_ring_collectives_on_nvswitch_run_at_the_link_payload_rate():
    topology = load_topology("dgx-a100")
    for kind in ("reduce_scatter", "all_gather", "broadcast", "all_reduce"):
        result = run_collective(topology, kind, range(8), 16 * GIB, "ring", "simple")
        assert result.busbw_bytes_per_s == pytest.approx(240e9, rel=0.01), kind


def test_pcie_4x4090_all_reduce_is_bounded_by_host_memory_paths():
    topology = load_topology("pcie-4x4090")
    pcie = topology.server.link("pcie4").bytes_per_s
    dram = topology.server.link("ddr4").bytes_per_s
    result = run_collective(topology, "all_reduce", range(4), GIB)
    schedule = lower_collective(topology, "all_reduce", range(4), GIB, result.algorithm, result.protocol)
    for flow in schedule.phases[0].flows:
        assert "n0/mem" in topology.route(flow.src, flow.dst).nodes
    assert result.busbw_bytes_per_s < pcie
    # 4 ring flows each write and read DRAM: the DRAM share caps each at dram / 8
    assert result.busbw_bytes_per_s == pytest.approx(min(pcie, dram / 8), rel=0.01)


def test_pcie_8xa100_ring_is_bounded_by_a_pcie_x16_link():
    result = run_collective(load_topology("pcie-8xa100"), "all_reduce", range(8), GIB)
    assert result.busbw_bytes_per_s == pytest.approx(0.794 * 31.5e9, rel=0.01)


def test_multi_node_all_reduce_is_limited_by_the_nics():
    topology = load_topology("dgx-a100", nodes=2)
    nics = topology.rails * topology.server.link("hdr").bytes_per_s          # 8 x 23.5 GB/s per node
    ring = run_collective(topology, "all_reduce", range(16), 4 * GIB, "ring", "simple")
    assert ring.busbw_bytes_per_s == pytest.approx(nics, rel=0.03)
    assert ring.busbw_bytes_per_s < run_collective(topology, "all_reduce", range(8), 4 * GIB).busbw_bytes_per_s
    for nodes in (2, 4):
        cluster = load_topology("dgx-a100", nodes=nodes)
        group = range(cluster.num_gpus)
        chosen = run_collective(cluster, "all_reduce", group, 4 * GIB)
        # every node must send at least 2 (N - 1) / N of the buffer through its NICs
        assert chosen.time_s >= 2 * (nodes - 1) / nodes * 4 * GIB / nics
        for algorithm, protocol in candidates(cluster, "all_reduce", group):
            time_s = collective_time_s(cluster, "all_reduce", group, 4 * GIB, algorithm, protocol)
            assert time_s >= chosen.time_s * (1 - 1e-12)


def test_multi_node_all_reduce_is_limited_by_an_oversubscribed_spine():
    def ring_busbw(**fabric) -> float:
        cluster = load_topology("dgx-a100", nodes=4, rail_optimized=False, leaf_down_ports=16, **fabric)
        return run_collective(cluster, "all_reduce", range(32), 4 * GIB, "ring", "simple").busbw_bytes_per_s

    full, over = ring_busbw(), ring_busbw(oversubscription=4.0)
    uplink = 16 * 23.5e9 / 4.0                       # each leaf's uplinks carry the 8 rings' crossings
    assert full == pytest.approx(8 * 23.5e9, rel=0.05)
    assert over == pytest.approx(uplink, rel=0.05) and over < 0.6 * full


def test_choice_follows_size_like_nccl():
    topology = load_topology("dgx-h100")
    assert choose_algorithm(topology, "all_reduce", range(8), 4096) == ("ring", "ll")
    assert choose_algorithm(topology, "all_reduce", range(8), GIB) == ("nvls", "simple")
    a100 = load_topology("dgx-a100")
    assert choose_algorithm(a100, "all_reduce", range(8), 4096) == ("ring", "ll")
    assert choose_algorithm(a100, "all_reduce", range(8), GIB) == ("ring", "simple")
    sizes = [2**k for k in range(10, 31, 2)]
    busbw = [run_collective(a100, "all_reduce", range(8), s).busbw_bytes_per_s for s in sizes]
    assert busbw == sorted(busbw)                    # bandwidth grows with size as latency amortises
    big = load_topology("dgx-a100", nodes=16)
    assert choose_algorithm(big, "all_reduce", range(128), 64 * 2**20)[0] == "tree"   # log-depth wins at scale


def test_candidates_depend_on_the_hardware():
    assert ("nvls", "simple") not in candidates(load_topology("dgx-a100"), "all_reduce", range(8))
    assert ("nvls", "simple") in candidates(load_topology("dgx-h100"), "reduce_scatter", range(8))
    assert all(p != "ll128" for _, p in candidates(load_topology("pcie-8xa100"), "all_reduce", range(8)))
    assert ("hierarchical", "simple") in candidates(load_topology("dgx-a100", nodes=2), "all_reduce", range(16))
    assert candidates(load_topology("dgx-a100"), "all_to_all", range(8)) == [("direct", "simple")]


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather", "broadcast"])
def test_ring_schedules_move_the_textbook_bytes(kind):
    topology = load_topology("dgx-a100", nodes=2)
    n, size = 16, 3.0 * GIB
    schedule = lower_collective(topology, kind, range(n), size, "ring", "ll128")
    wire = sum(flow.size_bytes for phase in schedule.phases for flow in phase.flows)
    per_gpu = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n}
    expected = size * per_gpu[kind] * n if kind in per_gpu else size * (n - 1)
    assert wire == pytest.approx(expected / WIRE_EFFICIENCY["ll128"], rel=1e-12)
    inter_node = [f for f in schedule.phases[0].flows if topology.node_of_gpu(f.src) != topology.node_of_gpu(f.dst)]
    if kind != "broadcast":   # rings cross between servers on the same rail, one channel per NIC
        assert sorted(topology.rail_of_gpu(f.src) for f in inter_node)[::2] == list(range(8))


def test_send_recv_and_all_to_all_schedules():
    topology = load_topology("dgx-a100", nodes=2)
    send = lower_collective(topology, "send", (3, 12), 1e6)
    assert [(f.src, f.dst, f.size_bytes) for f in send.phases[0].flows] == [(3, 12, 1e6)]
    assert collective_time_s(topology, "recv", (3, 12), 1e6) == collective_time_s(topology, "send", (3, 12), 1e6)
    a2a = lower_collective(topology, "all_to_all", range(16), 16e6)
    assert len(a2a.phases[0].flows) == 16 * 15 and {f.size_bytes for f in a2a.phases[0].flows} == {1e6}


def test_hierarchical_is_three_phases():
    topology = load_topology("dgx-a100", nodes=2)
    schedule = lower_collective(topology, "all_reduce", range(16), GIB, "hierarchical", "simple")
    assert len(schedule.phases) == 3
    assert all(topology.node_of_gpu(f.src) == topology.node_of_gpu(f.dst) for f in schedule.phases[0].flows)
    assert all(topology.rail_of_gpu(f.src) == topology.rail_of_gpu(f.dst) for f in schedule.phases[1].flows)


@given(st.integers(1, 300))
@settings(max_examples=100, deadline=None)
def test_binary_trees_are_spanning_with_at_most_two_children(n):
    for parents in (binary_tree_parents(n),):
        assert parents.count(-1) == 1
        children = [0] * n
        for child, parent in enumerate(parents):
            if parent >= 0:
                children[parent] += 1
        assert max(children) <= 2
        for start in range(n):      # every position reaches the root without a cycle
            seen, node = set(), start
            while parents[node] >= 0:
                assert node not in seen
                seen.add(node)
                node = parents[node]
    if n % 2 == 0 and n > 2:        # double binary tree: no position is inner in both trees
        inner = {p for p in parents if p >= 0}
        mirrored_inner = {n - 1 - p for p in parents if p >= 0}
        assert not inner & mirrored_inner


@given(st.sampled_from(["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"]),
       st.sampled_from([1, 2]), st.floats(1.0, 1e10))
@settings(max_examples=25, deadline=None)
def test_remembered_cost_per_byte_equals_a_fresh_simulation(kind, nodes, size):
    topology = load_topology("dgx-h100", nodes=nodes)
    group = range(topology.num_gpus)
    for algorithm, protocol in candidates(topology, kind, group):
        schedule = lower_collective(topology, kind, group, size, algorithm, protocol)
        assert collective_time_s(topology, kind, group, size, algorithm, protocol) == pytest.approx(
            simulate_schedule(topology, schedule), rel=1e-9)


def test_bus_factors_and_trivial_cases():
    assert bus_factor("all_reduce", 8) == 1.75 and bus_factor("all_gather", 8) == 0.875
    assert bus_factor("broadcast", 8) == 1.0 and set(KINDS) >= {"send", "recv"}
    topology = load_topology("dgx-a100")
    assert collective_time_s(topology, "all_reduce", [5], GIB) == 0.0
    assert collective_time_s(topology, "all_reduce", range(8), 0) == 0.0
    single = run_collective(topology, "all_gather", [2], GIB)
    assert math.isinf(single.algbw_bytes_per_s) and single.busbw_bytes_per_s == 0.0


def test_bad_input_names_the_value_and_the_rule():
    topology = load_topology("dgx-a100")
    with pytest.raises(TopologyError, match="kind = 'allreduce'"):
        collective_time_s(topology, "allreduce", range(8), GIB)
    with pytest.raises(TopologyError, match="distinct"):
        collective_time_s(topology, "all_reduce", [0, 1, 1], GIB)
    with pytest.raises(TopologyError, match="GPU id in 0..7"):
        collective_time_s(topology, "all_reduce", [0, 9], GIB)
    with pytest.raises(TopologyError, match=r"must be \(source, destination\)"):
        collective_time_s(topology, "send", [0, 1, 2], GIB)
    with pytest.raises(TopologyError, match="size_bytes = -1"):
        collective_time_s(topology, "all_reduce", range(8), -1)
    with pytest.raises(TopologyError, match="algorithm = 'nvls'.*allowed: ring/ll"):
        collective_time_s(topology, "all_reduce", range(8), GIB, "nvls", "simple")
