"""Communication in the engine: collectives and send/recv on the shared flow network, exposure, deadlocks."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.engine.allocator import ExactAllocator
from simulator.engine.executor import EngineOptions, simulate_programs
from simulator.engine.results import EngineDeadlock, EngineTrace
from simulator.errors import DeadlockError, PlanError, TopologyError
from simulator.network import collective_time_s, load_topology
from simulator.parallel.plan import ParallelPlan
from simulator.parallel.program import Collective, Mark, Program, Recv, Run, Send, Signal, WaitFor
from simulator.parallel.schedule_check import CommStep, execute_uniform, program as schedule_program
from simulator.parallel.schedules import one_f_one_b
from simulator.workload.graph import ACTIVATIONS, COMMUNICATION_BUFFERS, Op, Tensor

GIB = 2**30
MIB = 2**20
CAPACITY = 80 * GIB


@pytest.fixture(scope="module")
def a100():
    return load_topology("dgx-a100")


@pytest.fixture(scope="module")
def h100():
    return load_topology("dgx-h100")


@pytest.fixture(scope="module")
def pcie():
    return load_topology("pcie-4x4090")


def compute(name: str, seconds: float, phase: str = "fwd") -> Run:
    return Run(Op(name, "gemm", phase), seconds)


def run(streams_by_rank: dict[int, dict[str, tuple]], topology=None, plan=None, tensors=None,
        options: EngineOptions = EngineOptions()) -> EngineTrace:
    programs = [Program(rank, "gpu", 0, dict(tensors or {}), streams) for rank, streams in streams_by_rank.items()]
    allocators = [ExactAllocator(CAPACITY) for _ in programs]
    return simulate_programs(programs, allocators, [CAPACITY] * len(programs), options, topology, plan)


def spans(trace: EngineTrace, rank: int, kind: str) -> list:
    return [s for r in trace.ranks if r.rank == rank for s in r.spans if s.kind == kind]


def all_reduce(group: tuple[int, ...], size: float, name: str = "ar") -> Collective:
    return Collective(name, "all_reduce", group, size)


# ----- collectives ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dgx-a100", "dgx-h100"])
def test_isolated_all_reduce_takes_collective_time(name):
    topology = load_topology(name)
    group = tuple(range(8))
    trace = run({r: {"comm": (all_reduce(group, GIB),)} for r in group}, topology)
    expected = collective_time_s(topology, "all_reduce", group, GIB)
    assert trace.end_time_s == pytest.approx(expected, rel=1e-9)
    for rank in group:
        (span,) = spans(trace, rank, "all_reduce")
        assert span.phase == "comm" and span.stream == "comm" and span.bytes == GIB
        assert span.end_s - span.start_s == pytest.approx(expected, rel=1e-9)
        assert trace.communication[rank].total_s == pytest.approx(expected, rel=1e-9)
        assert trace.communication[rank].exposed_s == 0.0


def test_collective_starts_when_last_member_arrives(a100):
    group = (0, 1)
    late = 0.004
    trace = run({0: {"comm": (all_reduce(group, 64 * MIB),)},
                 1: {"compute": (compute("late", late), Signal("go")),
                     "comm": (WaitFor("go"), all_reduce(group, 64 * MIB))}}, a100)
    alone = collective_time_s(a100, "all_reduce", group, 64 * MIB)
    assert trace.end_time_s == pytest.approx(late + alone, rel=1e-9)
    (span,) = spans(trace, 0, "all_reduce")
    assert span.start_s == pytest.approx(late) and trace.communication[0].total_s == pytest.approx(alone)


def test_disjoint_nvlink_groups_do_not_slow_each_other(a100):
    size = 256 * MIB
    groups = ((0, 1, 2, 3), (4, 5, 6, 7))
    trace = run({r: {"comm": (all_reduce(g, size),)} for g in groups for r in g}, a100)
    alone = collective_time_s(a100, "all_reduce", groups[0], size)
    assert trace.end_time_s == pytest.approx(alone, rel=1e-9)


def test_shared_pcie_path_slows_concurrent_all_reduces(pcie):
    size = 256 * MIB
    groups = ((0, 1), (2, 3))
    alone = collective_time_s(pcie, "all_reduce", groups[0], size)
    single = run({r: {"comm": (all_reduce(groups[0], size),)} for r in groups[0]}, pcie)
    both = run({r: {"comm": (all_reduce(g, size),)} for g in groups for r in g}, pcie)
    assert single.end_time_s == pytest.approx(alone, rel=1e-9)
    assert both.end_time_s > 1.15 * alone      # both rings cross the host memory behind the root complex


def test_collective_buffers_allocated_at_post_and_freed_at_completion(a100):
    tensors = {0: Tensor(0, "bucket0", 64 * MIB, COMMUNICATION_BUFFERS)}
    instruction = Collective("bucket0", "all_reduce", (0, 1), 64 * MIB, allocs=(0,), frees=(0,))
    programs = {0: {"comm": (instruction,)}, 1: {"comm": (Collective("bucket0", "all_reduce", (0, 1), 64 * MIB),)}}
    trace = run(programs, a100, tensors=tensors)
    rank0 = trace.ranks[0]
    assert rank0.peak_allocated == 64 * MIB
    assert rank0.memory[-1].allocated == 0
    assert rank0.memory[-1].time_s == pytest.approx(trace.end_time_s)


# ----- overlap and exposure ---------------------------------------------------------------------------------
def _overlap_programs(size: float, busy_s: float, group=(0, 1)) -> dict:
    programs = {}
    for rank in group:
        programs[rank] = {
            "compute": (compute("bwd_a", 1e-4, "bwd_input"), Signal("grads_ready"), compute("bwd_b", busy_s, "bwd_input"),
                        WaitFor("reduced"), compute("step", 1e-4, "optimizer")),
            "comm": (WaitFor("grads_ready"), all_reduce(group, size), Signal("reduced")),
        }
    return programs


def test_compute_hides_a_collective_on_another_stream(h100):
    size = 64 * MIB
    time = collective_time_s(h100, "all_reduce", (0, 1), size)
    trace = run(_overlap_programs(size, busy_s=2 * time), h100)
    assert trace.communication[0].total_s == pytest.approx(time, rel=1e-9)
    assert trace.communication[0].exposed_s == 0.0
    assert trace.end_time_s == pytest.approx(1e-4 + 2 * time + 1e-4, rel=1e-9)


def test_wait_before_next_compute_exposes_the_remainder(h100):
    size = 64 * MIB
    time = collective_time_s(h100, "all_reduce", (0, 1), size)
    busy = 0.25 * time
    trace = run(_overlap_programs(size, busy_s=busy), h100)
    for rank in (0, 1):
        assert trace.communication[rank].exposed_s == pytest.approx(time - busy, rel=1e-9)
        assert trace.communication[rank].total_s == pytest.approx(time, rel=1e-9)
    assert trace.end_time_s == pytest.approx(1e-4 + time + 1e-4, rel=1e-9)
    window = trace.communication[0].between(0.0, 1e-4 + busy)
    assert window == (pytest.approx(busy), 0.0)


def test_collective_on_the_compute_stream_is_fully_exposed(h100):
    time = collective_time_s(h100, "all_reduce", (0, 1), 8 * MIB)
    trace = run({r: {"compute": (all_reduce((0, 1), 8 * MIB),)} for r in (0, 1)}, h100)
    assert trace.communication[0].exposed_s == pytest.approx(time, rel=1e-9)


# ----- send / recv ------------------------------------------------------------------------------------------
def test_send_recv_pair_matches_and_takes_the_transfer_time(h100):
    size = 32 * MIB
    tensors = {0: Tensor(0, "act_in", size, ACTIVATIONS)}
    late = 1e-3
    trace = run({0: {"compute": (compute("f0", late),), "pp_send": (Send("act", 1, size, "a0"),)},
                 1: {"pp_recv": (Recv("act", 0, size, "a0", allocs=(0,)),)}}, h100, tensors=tensors)
    transfer = collective_time_s(h100, "send", (0, 1), size)
    (send,) = spans(trace, 0, "send")
    (recv,) = spans(trace, 1, "recv")
    assert send.start_s == recv.start_s == 0.0
    assert recv.end_s == pytest.approx(transfer, rel=1e-9) and recv.stream == "pp_recv"
    assert trace.ranks[1].memory[0].time_s == 0.0 and trace.ranks[1].peak_allocated == size   # allocated at post
    assert trace.end_time_s == pytest.approx(max(late, transfer))


def test_send_waits_for_its_recv(h100):
    size = 32 * MIB
    late = 2e-3
    trace = run({0: {"pp_send": (Send("act", 1, size, "a0"),)},
                 1: {"compute": (compute("busy", late), Signal("ready")),
                     "pp_recv": (WaitFor("ready"), Recv("act", 0, size, "a0"))}}, h100)
    transfer = collective_time_s(h100, "send", (0, 1), size)
    (send,) = spans(trace, 0, "send")
    assert send.start_s == pytest.approx(late) and send.end_s == pytest.approx(late + transfer, rel=1e-9)
    assert trace.communication[0].total_s == pytest.approx(transfer, rel=1e-9)


def test_tags_keep_messages_apart(h100):
    trace = run({0: {"pp_send": (Send("x", 1, MIB, "t1"), Send("y", 1, 2 * MIB, "t2"))},
                 1: {"pp_recv": (Recv("x", 0, MIB, "t1"), Recv("y", 0, 2 * MIB, "t2"))}}, h100)
    assert [s.bytes for s in spans(trace, 1, "recv")] == [MIB, 2 * MIB]


def test_missing_recv_deadlocks_naming_the_blocked_send(h100):
    with pytest.raises(EngineDeadlock) as info:
        run({0: {"compute": (compute("f", 1e-4), Signal("sent_ok")), "pp_send": (Send("act0", 1, MIB, "a0"),)},
             1: {"compute": (WaitFor("never"),)}}, h100)
    error = info.value
    assert isinstance(error, DeadlockError)
    blocked = {(b.rank, b.stream): b for b in error.blocked}
    assert set(blocked) == {(0, "pp_send"), (1, "compute")}
    assert blocked[(0, "pp_send")].instruction == "Send('act0')"
    assert "send 'act0' to rank 1" in str(error) and "waiting for the matching recv" in str(error)
    assert "rank 1 stream compute instruction 0 WaitFor('never'): waiting for never" in str(error)


def test_collective_missing_a_member_deadlocks_naming_it(a100):
    with pytest.raises(EngineDeadlock) as info:
        run({0: {"comm": (all_reduce((0, 1, 2), MIB),)}, 1: {"comm": (all_reduce((0, 1, 2), MIB),)},
             2: {"comm": (all_reduce((0, 1, 2), MIB, name="other"),)}}, a100)
    text = str(info.value)
    assert len(info.value.blocked) == 3
    assert "'ar' over ranks [0, 1, 2] waiting for ranks [2]" in text
    assert "'other' over ranks [0, 1, 2] waiting for ranks [0, 1]" in text


def test_communication_needs_a_topology():
    with pytest.raises(TopologyError, match="topology = None"):
        run({0: {"comm": (Send("x", 1, 1, "t"),)}})


def test_bad_instructions_are_rejected():
    with pytest.raises(PlanError, match="kind = 'reduce'"):
        Collective("x", "reduce", (0, 1), 1)
    with pytest.raises(PlanError, match="size_bytes = -1"):
        Send("x", 1, -1, "t")
    with pytest.raises(PlanError, match="every rank once"):
        Collective("x", "all_gather", (0, 0), 1)


# ----- pipelines --------------------------------------------------------------------------------------------
def pipeline_programs(schedule, f_s: float, b_s: float, size: float) -> dict[int, dict[str, tuple]]:
    """Lower a schedule as the engine runs it: compute stream, sends on pp_send, recvs on pp_recv."""
    programs = {}
    for rank, steps in enumerate(schedule_program(schedule)):
        main, sends, recvs = [Mark("iteration_start", 0)], [], []
        for step in steps:
            if isinstance(step, CommStep):
                t = step.transfer
                tag = f"{t.kind}:{t.producer.stage}:{t.producer.microbatch}"
                if step.op == "recv":
                    recvs += [Recv(tag, step.peer, size, tag), Signal(f"recv {tag}")]
                    main.append(WaitFor(f"recv {tag}"))
                else:
                    main.append(Signal(f"send {tag}"))
                    sends += [WaitFor(f"send {tag}"), Send(tag, step.peer, size, tag)]
            else:
                phase = "fwd" if step.kind == "F" else "bwd_input"
                main.append(compute(str(step), f_s if step.kind == "F" else b_s, phase))
        main.append(Mark("iteration_end", 0))
        programs[rank] = {"compute": tuple(main), "pp_send": tuple(sends), "pp_recv": tuple(recvs)}
    return programs


@pytest.mark.parametrize("microbatches", [1, 4, 6])
def test_two_stage_1f1b_matches_uniform_execution(h100, microbatches):
    schedule = one_f_one_b(2, microbatches)
    f, b = 1e-3, 2e-3
    free = run(pipeline_programs(schedule, f, b, 0), h100)
    expected = execute_uniform(schedule, f, b).iteration_time_s
    assert expected == pytest.approx((microbatches + 1) * (f + b))
    assert free.end_time_s == pytest.approx(expected, rel=1e-12)
    assert free.communication[0].exposed_s == 0.0

    size = 64 * MIB
    transfer = collective_time_s(h100, "send", (0, 1), size)
    real = run(pipeline_programs(schedule, f, b, size), h100)
    with_comm = execute_uniform(schedule, f, b, comm=transfer).iteration_time_s
    assert real.end_time_s == pytest.approx(with_comm, rel=1e-9)
    assert real.end_time_s > free.end_time_s
    sends = [s for r in real.ranks for s in r.spans if s.kind == "send"]
    recvs = [s for r in real.ranks for s in r.spans if s.kind == "recv"]
    assert len(sends) == len(recvs) == 2 * microbatches
    assert real.communication[1].exposed_s > 0.0


def test_determinism(h100):
    schedule = one_f_one_b(2, 4)
    first = run(pipeline_programs(schedule, 1e-3, 2e-3, 16 * MIB), h100)
    second = run(pipeline_programs(schedule, 1e-3, 2e-3, 16 * MIB), h100)
    assert [r.spans for r in first.ranks] == [r.spans for r in second.ranks]
    assert first.communication == second.communication and first.end_time_s == second.end_time_s


# ----- symmetry ---------------------------------------------------------------------------------------------
def _stage_programs(plan: ParallelPlan, ranks, size: float, busy_s: float) -> dict:
    """Every rank: compute, then a TP all_reduce and a DP all_reduce of its own groups on the comm stream."""
    programs = {}
    for rank in ranks:
        programs[rank] = {
            "compute": (compute("fwd", busy_s), Signal("go"), compute("more", busy_s), WaitFor("done")),
            "comm": (WaitFor("go"), Collective("tp", "all_reduce", plan.group_of(rank, "tp"), size),
                     Collective("dp", "all_reduce", plan.group_of(rank, "dp"), size), Signal("done")),
        }
    return programs


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tp=st.sampled_from((1, 2, 4, 8)), dp_nodes=st.sampled_from((1, 2)),
       size=st.sampled_from((4 * MIB, 64 * MIB)), busy=st.sampled_from((1e-5, 1e-3)))
def test_symmetry_reduction_gives_the_full_result(tp, dp_nodes, size, busy):
    topology = load_topology("dgx-a100", nodes=dp_nodes)
    world = topology.num_gpus
    plan = ParallelPlan(dp=world // tp, tp=tp, pp=1, gpus_per_node=topology.gpus_per_node)
    full = run(_stage_programs(plan, range(world), size, busy), topology, plan)
    representative = plan.representatives()[0].rank
    reduced = run(_stage_programs(plan, [representative], size, busy), topology, plan)
    assert reduced.end_time_s == pytest.approx(full.end_time_s, rel=1e-9)
    full_spans = [(s.name, s.start_s, s.end_s) for s in full.ranks[representative].spans]
    reduced_spans = [(s.name, s.start_s, s.end_s) for s in reduced.ranks[0].spans]
    assert reduced_spans == [(n, pytest.approx(a, rel=1e-9, abs=1e-15), pytest.approx(b, rel=1e-9))
                             for n, a, b in full_spans]
    assert reduced.communication[0].exposed_s == pytest.approx(full.communication[representative].exposed_s,
                                                              rel=1e-9, abs=1e-15)


def test_symmetry_shadows_load_shared_links(pcie):
    """tp = 2 on pcie-4x4090: the two TP groups share host memory; the reduced run must still see both."""
    plan = ParallelPlan(dp=2, tp=2, pp=1, gpus_per_node=4)
    size = 64 * MIB
    reduced = run({0: {"comm": (Collective("tp", "all_reduce", (0, 1), size),)}}, pcie, plan)
    no_plan = run({0: {"comm": (Collective("tp", "all_reduce", (0, 1), size),)}}, pcie)
    full = run({r: {"comm": (Collective("tp", "all_reduce", plan.group_of(r, "tp"), size),)} for r in range(4)},
               pcie, plan)
    assert no_plan.end_time_s == pytest.approx(collective_time_s(pcie, "all_reduce", (0, 1), size), rel=1e-9)
    assert reduced.end_time_s == pytest.approx(full.end_time_s, rel=1e-9)
    assert reduced.end_time_s > 1.15 * no_plan.end_time_s
    unshadowed = run({0: {"comm": (Collective("tp", "all_reduce", (0, 1), size),)}}, pcie, plan,
                     options=EngineOptions(shadow_traffic=False))
    assert unshadowed.end_time_s == no_plan.end_time_s


def test_no_communication_behaves_as_before():
    trace = run({0: {"compute": (compute("a", 1e-3), Signal("x")), "side": (WaitFor("x"), compute("b", 1e-3))}})
    assert trace.end_time_s == pytest.approx(2e-3)
    assert trace.communication[0].total_s == 0.0 and trace.communication[0].exposed_s == 0.0
    assert math.isfinite(trace.end_time_s)
