"""Offload in the engine: Transfer instructions as flows on the shared network, their exposure, their memory calls,
and the host memory model (torch's pinned caching host allocator, node sums)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.engine.allocator import ExactAllocator
from simulator.engine.executor import EngineOptions, simulate_programs
from simulator.errors import PlanError
from simulator.network.topology import load_topology
from simulator.offload.host_memory import PAGEABLE, PINNED, HostMemory, HostTensor, node_peak_bytes, pinned_block_bytes
from simulator.parallel.program import (HostAlloc, HostFree, Mark, Program, Run, Signal, Transfer, WaitFor)
from simulator.workload.graph import ACTIVATIONS, Op, Tensor

CAPACITY = 1 << 34
PCIE4 = 31.5e9 * 0.794
LATENCY = 0.6e-6                       # workstation-rtx4090: pcie4 0.5 us + ddr5 0.1 us


@pytest.fixture(scope="module")
def workstation():
    return load_topology("workstation-rtx4090")


def _run(streams: dict, topology, tensors=None, host_tensors=None, rank: int = 0):
    program = Program(rank, "rtx-4090", 0, dict(tensors or {}), streams, host_tensors=dict(host_tensors or {}))
    return simulate_programs([program], [ExactAllocator(CAPACITY)], [CAPACITY], EngineOptions(), topology)


def _gemm(seconds: float) -> Run:
    return Run(Op("gemm", "gemm", "fwd"), seconds)


def test_a_copy_on_its_own_stream_overlaps_compute_and_only_its_remainder_is_exposed(workstation):
    size = 0.5e9
    compute = (Mark("iteration_start", 0), _gemm(0.01), Signal("ready"), _gemm(0.01), WaitFor("done"),
               Mark("iteration_end", 0))
    copies = (WaitFor("ready"), Transfer("grad_to_host", "d2h", size), Signal("done"))
    trace = _run({"compute": compute, "offload.d2h": copies}, workstation)
    copy_s = LATENCY + size / PCIE4
    assert trace.end_time_s == pytest.approx(0.01 + copy_s)
    traffic, host, exposed = trace.communication[0].offload_between(0.0, 1.0)
    assert traffic == pytest.approx(copy_s) and host == 0.0
    assert exposed == pytest.approx(0.01 + copy_s - 0.02)              # compute waited for the copy's last part
    assert trace.communication[0].between(0.0, 1.0) == (0.0, 0.0)      # offload is not communication


def test_a_copy_on_the_compute_stream_is_exposed_whole_and_frees_memory_at_its_end(workstation):
    tensors = {1: Tensor(1, "saved", 1000, ACTIVATIONS)}
    host = {2: HostTensor(2, "saved.on_cpu", 1000, ACTIVATIONS, PINNED)}
    compute = (Run(Op("forward", "gemm", "fwd", allocs=(1,)), 0.001),
               Transfer("pack", "d2h", 1e8, frees=(1,), host_allocs=(2,)),
               Transfer("unpack", "h2d", 1e8, host_frees=(2,)))
    trace = _run({"compute": compute}, workstation, tensors, host)
    copy_s = LATENCY + 1e8 / PCIE4
    assert trace.end_time_s == pytest.approx(0.001 + 2 * copy_s)
    assert trace.communication[0].offload_between(0.0, 1.0)[2] == pytest.approx(2 * copy_s)
    timeline = trace.ranks[0].memory
    assert [sample.allocated for sample in timeline] == [1000, 0]
    assert timeline[1].time_s == pytest.approx(0.001 + copy_s)          # freed when the pack copy ended
    events = trace.ranks[0].host_events
    assert [(sign, ids) for _, sign, ids in events] == [(1, (2,)), (-1, (2,))]
    assert events[0][0] == pytest.approx(0.001) and events[1][0] == pytest.approx(0.001 + 2 * copy_s)


def test_host_work_shares_dram_with_copies(workstation):
    dram = 83.2e9 * 0.8
    alone = _run({"host": (Transfer("adam", "host", 10e9, cap_bytes_per_s=1e12),)}, workstation).end_time_s
    assert alone == pytest.approx(0.1e-6 + 10e9 / dram)
    both = _run({"host": (Transfer("adam", "host", 10e9, cap_bytes_per_s=1e12),),
                 "offload.d2h": (Transfer("copy", "d2h", 10e9),)}, workstation).end_time_s
    assert both > alone                                                  # the copy's writes take DRAM from the CPU


def test_ranks_on_one_pcie_switch_share_its_uplink_and_full_simulation_agrees():
    from simulator.parallel.plan import ParallelPlan

    a100 = load_topology("dgx-a100")
    plan = ParallelPlan(dp=8, tp=1, pp=1, gpus_per_node=8)

    def program(rank: int) -> Program:
        return Program(rank, "a100", 0, {}, {"compute": (Transfer("copy", "d2h", 1e9),)})

    reduced = simulate_programs([program(0)], [ExactAllocator(CAPACITY)], [CAPACITY], EngineOptions(), a100, plan)
    full = simulate_programs([program(r) for r in range(8)], [ExactAllocator(CAPACITY) for _ in range(8)],
                             [CAPACITY] * 8, EngineOptions(), a100, plan)
    uplink = 31.5e9 * 0.794 / 2                                         # gpu0 and gpu1 share pcie0 -> cpu0
    assert reduced.end_time_s == pytest.approx(1.1e-6 + 1e9 / uplink)    # two PCIe hops + DRAM of latency
    assert reduced.end_time_s == full.end_time_s


def test_transfer_arguments_are_checked():
    with pytest.raises(PlanError, match="route = 'sideways' must be one of d2h, h2d"):
        Transfer("x", "sideways", 1.0)
    with pytest.raises(PlanError, match="cap_bytes_per_s = 0"):
        Transfer("x", "host", 1.0, cap_bytes_per_s=0)


def test_host_alloc_and_free_instructions_log_host_memory(workstation):
    host = {5: HostTensor(5, "master", 3000, "optimizer_states", PINNED),
            6: HostTensor(6, "exp_avg", 1000, "optimizer_states", PAGEABLE)}
    trace = _run({"compute": (HostAlloc((5, 6), "set-up"), _gemm(0.5), HostFree((6,), "done"))}, workstation,
                 host_tensors=host)
    outcome = HostMemory(host).replay(trace.ranks[0].host_events)
    assert outcome.peak_bytes == 4096 + 1000 and outcome.pinned_reserved_bytes == 4096
    assert outcome.timeline[-1] == (pytest.approx(0.5), 4096)            # pinned blocks stay reserved


def test_pinned_blocks_round_to_powers_of_two_and_are_reused_by_size():
    assert [pinned_block_bytes(n) for n in (0, 1, 2, 3, 4096, 4097, 26_953_662_464)] == \
        [0, 1, 2, 4, 4096, 8192, 2**35]
    tensors = {i: HostTensor(i, f"t{i}", size, ACTIVATIONS, PINNED) for i, size in ((1, 3000), (2, 4000), (3, 5000))}
    memory = HostMemory(tensors)
    outcome = memory.replay([(0.0, 1, (1,)), (1.0, -1, (1,)), (2.0, 1, (2,)), (3.0, 1, (3,))])
    assert memory.pinned_reserved == 4096 + 8192                         # t2 took t1's cached 4 KiB block
    assert outcome.peak_bytes == 4096 + 8192 and outcome.breakdown_at_peak["pinned_cache"] == 0
    with pytest.raises(PlanError, match="freed but not allocated"):
        HostMemory(tensors).replay([(0.0, -1, (1,))])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 10**6)), min_size=1, max_size=12),
                min_size=1, max_size=4), st.lists(st.integers(1, 4), min_size=4, max_size=4))
def test_a_nodes_peak_lies_between_its_largest_rank_and_the_sum_of_peaks(raw, counts):
    timelines = [sorted((float(t), level) for t, level in events) for events in raw]
    levels = list(zip(timelines, counts))
    peak, _ = node_peak_bytes(levels)
    peaks = [max(level for _, level in timeline) for timeline in timelines]
    assert max(p * c for p, c in zip(peaks, counts)) <= peak <= sum(p * c for p, c in zip(peaks, counts))
    single = node_peak_bytes([(timelines[0], 1)])[0]
    assert single == peaks[0]
