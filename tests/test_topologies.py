"""Topologies: bundled files load with sources, graphs match the resource model, routes exist and are shortest."""

from __future__ import annotations

import itertools

import networkx as nx
import pytest
import typer
from typer.testing import CliRunner

from simulator.cli_topo import pair_class, representative_pairs, topo_app
from simulator.errors import TopologyError
from simulator.hardware.catalog import get_device
from simulator.network.topology import list_topologies, load_topology

BUNDLED = ["dgx-a100", "dgx-h100", "hgx-h200", "pcie-4x4090", "pcie-8xa100"]    # multi-GPU servers with NICs
ONE_GPU = ["workstation-rtx4090"]


def test_bundled_topologies_load_with_catalog_gpus_and_sources():
    assert list_topologies() == sorted(BUNDLED + ONE_GPU)
    for name in BUNDLED + ONE_GPU:
        topology = load_topology(name)
        assert get_device(topology.server.gpu).kind == "gpu"
        for link in topology.server.links:
            assert link.source and link.efficiency_source and link.latency_source, link.name
            assert 0 < link.efficiency <= 1 and link.raw_bytes_per_s > 0
        assert topology.server.fabric.source


def test_dgx_numbers_are_the_datasheet_rates_times_nccl_payload_fractions():
    a100, h100 = load_topology("dgx-a100"), load_topology("dgx-h100")
    assert a100.route(0, 1).bottleneck_bytes_per_s == pytest.approx(12 * 20.0e9)   # NCCL SM80_NVLINK_BW x 12
    assert h100.route(0, 1).bottleneck_bytes_per_s == pytest.approx(18 * 20.6e9)   # NCCL SM90_NVLINK_BW x 18
    assert a100.server.link("hdr").raw_bytes_per_s == 25e9
    assert h100.server.link("ndr").raw_bytes_per_s == 50e9
    assert a100.reduction_switch(range(8)) is None
    assert h100.reduction_switch(range(8)) == "n0/nvswitch"
    assert h100.reduction_switch([0, 3]) == "n0/nvswitch"


@pytest.mark.parametrize("name", BUNDLED)
@pytest.mark.parametrize("nodes", [1, 2])
def test_routes_exist_between_every_gpu_pair_and_follow_graph_edges(name, nodes):
    topology = load_topology(name, nodes=nodes)
    graph = topology.graph
    assert graph.number_of_nodes() == sum(topology.node_kind_counts().values())
    assert graph.number_of_edges() == sum(topology.edge_class_counts().values())
    resources = {data["resource"] for _, _, data in graph.edges(data=True)}
    assert resources == set(range(topology.resource_count))
    for a, b in itertools.permutations(range(topology.num_gpus), 2):
        route = topology.route(a, b)
        assert route.nodes[0] == topology.gpu_name(a) and route.nodes[-1] == topology.gpu_name(b)
        hops = list(zip(route.nodes, route.nodes[1:]))
        uses: dict[int, int] = {}
        for u, v in hops:
            assert graph.has_edge(u, v), (u, v)
            uses[graph.edges[u, v]["resource"]] = uses.get(graph.edges[u, v]["resource"], 0) + 1
        assert route.resources == tuple(sorted(uses.items()))
        assert not any(graph.nodes[n]["kind"] == "gpu" for n in route.nodes[1:-1])   # GPUs are not routers
        assert route.latency_s == pytest.approx(sum(graph.edges[u, v]["latency_s"] for u, v in hops))
        assert route.bottleneck_bytes_per_s == pytest.approx(
            min(graph.edges[u, v]["bytes_per_s"] / uses[graph.edges[u, v]["resource"]] for u, v in hops))


@pytest.mark.parametrize("name", BUNDLED)
def test_intra_node_routes_are_shortest_paths(name):
    topology = load_topology(name)
    graph = topology.graph
    for a, b in itertools.permutations(range(topology.num_gpus), 2):
        ends = {topology.gpu_name(a), topology.gpu_name(b)}
        allowed = graph.subgraph([n for n, kind in graph.nodes(data="kind") if kind != "gpu" or n in ends])
        best = nx.shortest_path_length(allowed, topology.gpu_name(a), topology.gpu_name(b), weight="cost_ps")
        assert topology.route_cost_ps(topology.route(a, b)) == best


def test_multi_node_routes_use_the_gpus_own_nic_and_rails():
    topology = load_topology("dgx-a100", nodes=3)
    same_rail = topology.route(2, 8 + 2)
    assert same_rail.nodes[1:4] == ("n0/pcie1", "n0/nic2", "leaf2")
    assert not any(n.startswith("spine") for n in same_rail.nodes)
    cross_rail = topology.route(0, 8 + 5)
    assert "spine0" in cross_rail.nodes and cross_rail.nodes[2] == "n0/nic0" and cross_rail.nodes[-3] == "n1/nic5"
    assert pair_class(topology, 2, 10) == "across nodes, same leaf switch"
    assert pair_class(topology, 0, 13) == "across nodes, through the spine"
    flat = load_topology("dgx-a100", nodes=3, rail_optimized=False)
    assert flat.leaves == 2 and not any(n.startswith("spine") for n in flat.route(0, 13).nodes)
    assert "spine0" in flat.route(0, 16 + 5).nodes


def test_oversubscription_scales_leaf_uplinks():
    full = load_topology("dgx-a100", nodes=4)
    half = load_topology("dgx-a100", nodes=4, oversubscription=2.0)
    assert full.uplink_bytes_per_s == pytest.approx(20 * 23.5e9)
    assert half.uplink_bytes_per_s == pytest.approx(full.uplink_bytes_per_s / 2)
    spread = load_topology("dgx-a100", nodes=4, spines=4)
    assert spread.uplink_bytes_per_s == pytest.approx(full.uplink_bytes_per_s / 4)
    spines = {n for a in range(8) for b in range(8, 32) for n in spread.route(a, b).nodes if n.startswith("spine")}
    assert spines == {f"spine{s}" for s in range(4)}    # the ECMP hash spreads pairs over every spine


def test_gpu_pairs_of_pcie_4x4090_go_through_host_memory():
    topology = load_topology("pcie-4x4090")
    dram = topology.server.link("ddr4").bytes_per_s
    for a, b in itertools.permutations(range(4), 2):
        route = topology.route(a, b)
        assert "n0/mem" in route.nodes
        assert max(n for _, n in route.resources) == 2      # DRAM written, then read: one resource, used twice
        assert route.bottleneck_bytes_per_s == pytest.approx(min(25.011e9, dram / 2))
    assert representative_pairs(topology) == {"same node, through host memory": (0, 1)}


def test_pcie_8xa100_pair_classes():
    topology = load_topology("pcie-8xa100")
    assert representative_pairs(topology) == {
        "same node, across CPU sockets": (0, 4),
        "same node, through a CPU root complex": (0, 2),
        "same node, same PCIe switch": (0, 1),
    }


def test_endpoints_other_than_gpus():
    topology = load_topology("dgx-a100", nodes=2)
    offload = topology.route(0, "n0/mem0")
    assert offload.nodes == ("n0/gpu0", "n0/pcie0", "n0/cpu0", "n0/mem0")
    remote = topology.route("n0/mem1", "n1/mem0")
    assert remote.nodes[0] == "n0/mem1" and remote.nodes[-1] == "n1/mem0" and "leaf4" in remote.nodes
    assert topology.route(3, 3).resources == ()


def test_bad_input_names_the_key_and_the_rule(tmp_path):
    with pytest.raises(TopologyError, match="did you mean 'dgx-a100'"):
        load_topology("dgx-a10")
    with pytest.raises(TopologyError, match="fabric.nodes = 0"):
        load_topology("dgx-a100", nodes=0)
    with pytest.raises(TopologyError, match="oversubscription"):
        load_topology("dgx-a100", oversubscription=-1.0)
    topology = load_topology("dgx-a100")
    with pytest.raises(TopologyError, match="GPU id 8"):
        topology.route(0, 8)
    with pytest.raises(TopologyError, match="did you mean 'n0/nvswitch'"):
        topology.route(0, "n0/nvswich")
    text = (load_topology.__globals__["topology_dir"]() / "pcie-4x4090.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('link = "pcie4"', 'link = "pcie5"', 1))
    with pytest.raises(TopologyError, match=r"connect\[0\]\.link = 'pcie5'.*did you mean 'pcie4'"):
        load_topology(str(bad))
    bad.write_text(text.replace("efficiency = 0.794", "efficency = 0.794", 1))
    with pytest.raises(TopologyError, match="efficency is not a known key.*did you mean 'efficiency'"):
        load_topology(str(bad))
    bad.write_text(text.replace('a = ["gpu0", "gpu1", "gpu2", "gpu3", "nic0"]\nb = ["rp0", "rp1", "rp2", "rp3", "rp4"]',
                                'a = ["gpu0", "gpu1", "gpu2", "nic0"]\nb = ["rp0", "rp1", "rp2", "rp4"]'))
    with pytest.raises(TopologyError, match="gpu3 cannot be reached"):
        load_topology(str(bad))
    bad.write_text(text.replace('bytes_per_s = "31.5 GB/s"', 'bytes_per_s = "31.5 parsecs"'))
    with pytest.raises(TopologyError, match="links.pcie4"):
        load_topology(str(bad))


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.add_typer(topo_app, name="topo")
    return app


def test_topo_show_prints_classes_and_busbw_and_draws_deterministically(tmp_path):
    runner = CliRunner()
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    result = runner.invoke(_cli(), ["topo", "show", "dgx-a100", "--nodes", "2"])
    assert result.exit_code == 0, result.output
    for text in ("same node, over NVSwitch", "across nodes, same leaf switch", "240.0 GB/s", "23.5 GB/s",
                 "busbw", "0-15 (16)", "leaf"):
        assert text in result.output
    for path in (first, second):
        drawn = runner.invoke(_cli(), ["topo", "show", "pcie-8xa100", "--png", str(path)])
        assert drawn.exit_code == 0 and "same node, same PCIe switch" in drawn.output
    assert first.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and first.read_bytes() == second.read_bytes()
    bad = runner.invoke(_cli(), ["topo", "show", "dgx-a10"])
    assert bad.exit_code == 2 and "did you mean 'dgx-a100'" in bad.output
    listing = runner.invoke(_cli(), ["topo", "list"])
    assert listing.exit_code == 0 and all(name in listing.output for name in BUNDLED)
