"""Topologies' host side for offload: host memory sizes, CPU rates, NVMe drives with their read and write rates."""

from __future__ import annotations

import pytest

from simulator.errors import TopologyError
from simulator.network.collectives import simulate_schedule
from simulator.network.host import (drives_of_node, host_capacity_bytes, host_cpu_of_gpu, host_memory_of_gpu,
                                    host_spec, nvme_capacity_bytes, transfer_schedule)
from simulator.network.topology import list_topologies, load_topology, topology_dir

PCIE4_PAYLOAD = 31.5e9 * 0.794          # topologies/*.toml [links.pcie4]: bytes_per_s x efficiency


def test_every_bundled_topology_has_sourced_host_memory_and_cpu_rates():
    for name in list_topologies():
        topology = load_topology(name)
        memories = topology.server.components_of("host_memory")
        assert memories and all(m.capacity_bytes > 0 and m.capacity_source.strip() for m in memories), name
        host = host_spec(topology)
        assert host.cpu_adam_elements_per_s > 0 and host.cpu_adam_source.strip()
        assert host.cpu_stream_bytes_per_s > 0 and host.cpu_stream_source.strip()


def test_datasheet_host_memory_and_drives():
    assert host_capacity_bytes(load_topology("dgx-a100")) == 2 * 10**12          # DGX A100 640GB: 2 TB
    assert host_capacity_bytes(load_topology("dgx-h100")) == 2 * 10**12
    assert host_capacity_bytes(load_topology("workstation-rtx4090")) == 128 * 10**9
    for name in ("dgx-a100", "dgx-h100"):
        topology = load_topology(name)
        assert len(drives_of_node(topology, 0)) == 8 and nvme_capacity_bytes(topology) == 8 * 3_840 * 10**9
    assert drives_of_node(load_topology("hgx-h200"), 0) == ()
    assert drives_of_node(load_topology("pcie-4x4090"), 0) == ()


def test_a_gpu_reaches_its_own_sockets_memory_and_the_drives_at_their_rates():
    a100 = load_topology("dgx-a100", nodes=2)
    assert host_memory_of_gpu(a100, 0) == "n0/mem0" and host_memory_of_gpu(a100, 5) == "n0/mem1"
    assert host_memory_of_gpu(a100, 8) == "n1/mem0" and host_memory_of_gpu(a100, 12) == "n1/mem1"
    assert host_cpu_of_gpu(a100, 5) == "n0/cpu1"
    assert a100.route(0, "n0/mem0").bottleneck_bytes_per_s == pytest.approx(PCIE4_PAYLOAD)
    drive = a100.route("n0/nvme0", "n0/mem0")
    assert drive.bottleneck_bytes_per_s == 6.4e9                      # PM1733 read
    assert a100.route("n0/mem0", "n0/nvme0").bottleneck_bytes_per_s == 3.8e9     # and write
    assert not any("nvme" in node for a, b in [(0, 5), (0, 9)] for node in a100.route(a, b).nodes)   # never a hop


def test_transfers_alone_take_their_bytes_over_the_bottleneck_plus_the_route_latency():
    workstation = load_topology("workstation-rtx4090")
    latency = 0.5e-6 + 0.1e-6                                          # pcie4 + ddr5
    for route in ("d2h", "h2d"):
        assert simulate_schedule(workstation, transfer_schedule(workstation, 0, route, 1e9)) == \
            pytest.approx(latency + 1e9 / PCIE4_PAYLOAD)
    assert simulate_schedule(workstation, transfer_schedule(workstation, 0, "nvme_read", 1e9)) == \
        pytest.approx(100e-6 + 0.1e-6 + 1e9 / 7.45e9)
    assert simulate_schedule(workstation, transfer_schedule(workstation, 0, "nvme_write", 1e9)) == \
        pytest.approx(100e-6 + 0.1e-6 + 1e9 / 6.9e9)
    assert simulate_schedule(workstation, transfer_schedule(workstation, 0, "host", 1e9, 1e10)) == \
        pytest.approx(0.1e-6 + 0.1)                                    # capped by the CPU's rate
    dram = 83.2e9 * 0.8
    assert simulate_schedule(workstation, transfer_schedule(workstation, 0, "host", 1e9, 1e12)) == \
        pytest.approx(0.1e-6 + 1e9 / dram)                             # or by DRAM
    a100 = load_topology("dgx-a100")
    striped = transfer_schedule(a100, 0, "nvme_read", 8e9)
    assert [flow.size_bytes for flow in striped.phases[0].flows] == [1e9] * 8     # one RAID-0 stripe per drive


def test_nvme_transfer_on_a_topology_without_drives_is_refused():
    with pytest.raises(TopologyError, match="no nvme drive"):
        transfer_schedule(load_topology("pcie-4x4090"), 0, "nvme_read", 1e9)


def _variant(tmp_path, name: str, old: str, new: str, count: int = 1) -> str:
    text = (topology_dir() / f"{name}.toml").read_text()
    assert old in text
    path = tmp_path / f"{name}-variant.toml"
    path.write_text(text.replace(old, new, count))
    return str(path)


def test_bad_host_and_drive_definitions_name_the_key_and_the_rule(tmp_path):
    cases = [
        ('write_bytes_per_s = "6.9 GB/s"\n', "", r"links\.m2-nvme\.write_bytes_per_s is required for class 'storage'"),
        ('capacity = "128 GB"', 'capacity = "-1 GB"', r"components\[1\]\.capacity = '-1 GB': must be a positive size"),
        ('names = ["rp0", "rp1"]\nsource', 'names = ["rp0", "rp1"]\ncapacity = "1 GB"\ncapacity_source = "x"\nsource',
         r"components\[0\]\.capacity = '1 GB': only host_memory and nvme components hold bytes"),
        ('link = "m2-nvme"\na = ["nvme0"]\nb = ["rp1"]', 'link = "m2-nvme"\na = ["rp1"]\nb = ["nvme0"]',
         r"connect\[2\]\.a = 'rp1': a link of class 'storage' must have the drive"),
        ('cpu_adam_elements_per_s = 2.377e9', 'cpu_adam_elements_per_s = 0',
         r"host\.cpu_adam_elements_per_s = 0: must be a positive rate"),
        ('cpu_stream_source', 'cpu_streem_source', "host.cpu_streem_source is not a known key"),
    ]
    for old, new, message in cases:
        with pytest.raises(TopologyError, match=message):
            load_topology(_variant(tmp_path, "workstation-rtx4090", old, new))
    no_capacity = _variant(tmp_path, "pcie-4x4090", 'capacity = "256 GB"\n', "")
    with pytest.raises(TopologyError, match="capacity_source given without capacity"):
        load_topology(no_capacity)
