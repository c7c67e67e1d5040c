"""Collectives run inline by the compute stream, micro-batch copies and route shortcuts keep results exact."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import simulator.api as api
import simulator.engine.executor as executor
import simulator.parallel.lower_multi as lower_multi
from simulator.parallel.rank_streams import RankStreams
from simulator.engine.caching_allocator import CachingAllocator
from simulator.engine.executor import EngineOptions, simulate_programs
from simulator.errors import PlanError
from simulator.network import load_topology
from simulator.parallel.program import Blocking, Collective, Free, Program, Run, Signal, WaitFor
from simulator.scenario import scenario_from_dict
from simulator.workload.graph import ACTIVATIONS, COMMUNICATION_BUFFERS, Op, Tensor

GIB = 2**30
CAPACITY = 80 * GIB


def _doc(nodes: int, global_batch: int = 8, **parallel) -> dict:
    return {"name": "tiny", "model": {"architecture": "gpt", "num_layers": 4, "hidden_size": 128,
                                      "num_attention_heads": 8, "vocab_size": 512, "seq_length": 32, "dropout": 0.0},
            "training": {"micro_batch_size": 1, "global_batch_size": global_batch, "precision": "bf16-mixed",
                         "framework": "megatron", "recompute": "full"},
            "parallel": parallel, "cluster": {"topology": "dgx-a100", "nodes": nodes},
            "run": {"warmup_iterations": 1, "iterations": 1, "record_events": True}}


def _everything(result) -> tuple:
    """Every output of a run: the report, each rank's timeline, spans, events, peaks and segments, communication."""
    trace = result.trace
    ranks = [(r.rank, r.memory, r.spans, r.allocator_events, r.peak_allocated, r.peak_reserved, r.peak_time_s,
              r.peak_op, r.breakdown_at_peak, r.category_peaks, r.final_segments, r.oom) for r in trace.ranks]
    return result.report, ranks, trace.communication, trace.end_time_s, trace.iteration_bounds_s


@pytest.mark.parametrize("nodes, parallel, inlines", [
    (1, {"tp": 2, "pp": 2, "dp": 2}, False),     # one node: other copies' traffic shares the TP links
    (1, {"tp": 4, "pp": 2, "sequence_parallel": True}, False),
    (1, {"tp": 4, "dp": 2}, False),              # pp = 1: DP collectives share the comm stream
    (4, {"tp": 8, "pp": 2, "dp": 2, "sequence_parallel": True}, True),
    (4, {"tp": 8, "dp": 4}, True),
    (2, {"tp": 8, "pp": 2, "dp": 1, "schedule": "interleaved-1f1b", "virtual_stages": 2}, True),
])
def test_inline_collectives_change_nothing(monkeypatch, nodes, parallel, inlines):
    # The whole result (report, memory timelines, spans, allocator events, communication) with the compute
    # stream running isolated TP collectives itself equals the one where each goes through its comm stream.
    doc = _doc(nodes, **parallel)
    inlined = []

    def spy(real):
        def run(*args):
            end = real(*args)
            inlined.append(end is not None)
            return end
        return run

    monkeypatch.setattr(executor, "_inline", spy(executor._inline))
    monkeypatch.setattr(executor, "_inline_blocking", spy(executor._inline_blocking))
    fast = _everything(api.simulate(scenario_from_dict(doc)))
    assert any(inlined) == inlines
    monkeypatch.setattr(api, "EngineOptions", lambda: EngineOptions(inline_collectives=False))
    slow = _everything(api.simulate(scenario_from_dict(doc)))
    assert fast == slow


@pytest.mark.parametrize("nodes, parallel", [
    (1, {"tp": 2, "pp": 2, "dp": 2}),                                   # TP shares links: not inlined
    (4, {"tp": 8, "pp": 2, "dp": 2, "sequence_parallel": True}),         # inlined
    (1, {"tp": 2, "dp": 4, "zero_stage": 3}),       # pp = 1: TP, ZeRO gathers and DP share a stream
    (2, {"tp": 8, "pp": 2, "dp": 1, "schedule": "interleaved-1f1b", "virtual_stages": 2}),
])
def test_blocking_instructions_equal_their_signal_wait_form(monkeypatch, nodes, parallel):
    # The lowering writes a collective waited for at once as one Blocking instruction; written as Signal /
    # WaitFor around a Collective on its stream, everything comes out the same.
    doc = _doc(nodes, **parallel)
    if parallel.get("zero_stage", 0) > 1:
        doc["training"]["framework"] = "deepspeed"
    fused = _everything(api.simulate(scenario_from_dict(doc)))
    monkeypatch.setattr(RankStreams, "fuse_blocking", False)
    assert _everything(api.simulate(scenario_from_dict(doc))) == fused


def test_a_blocking_collective_on_a_stream_the_program_lacks_is_a_plan_error():
    collective = Collective("tp0", "all_reduce", tuple(range(8)), 1024.0)
    program = Program(0, "gpu", 0, {}, {"compute": (Blocking(collective, "comm"),)})
    with pytest.raises(PlanError, match=r"rank 0: Blocking collective 'tp0' on stream 'comm', which its program "
                                        r"does not have \(streams: compute\)"):
        simulate_programs([program], [CachingAllocator(CAPACITY)], [CAPACITY], EngineOptions(),
                          load_topology("dgx-a100"))


def test_a_blocking_collective_off_the_compute_stream_is_a_plan_error():
    collective = Collective("tp0", "all_reduce", tuple(range(8)), 1024.0)
    program = Program(0, "gpu", 0, {}, {"compute": (), "side": (Blocking(collective, "comm"),), "comm": ()})
    with pytest.raises(PlanError, match=r"rank 0: Blocking collective 'tp0' on stream 'side': only the compute "
                                        r"stream runs Blocking instructions"):
        simulate_programs([program], [CachingAllocator(CAPACITY)], [CAPACITY], EngineOptions(),
                          load_topology("dgx-a100"))


_steps = st.lists(st.tuples(st.sampled_from(["run", "tp", "side"]), st.sampled_from([0.0, 1e-6, 3e-6, 1e-3]),
                            st.booleans()), min_size=1, max_size=14)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=_steps, side_first=st.booleans())
def test_inline_keeps_order_against_other_streams(steps, side_first):
    # A compute stream with blocking collectives (Signal -> comm stream Collective -> WaitFor, or one Blocking
    # instruction) among compute ops, and a side stream that allocates when signalled: every memory event, span
    # and interval is the same whether or not the compute stream runs the collectives itself, and the same
    # with either way of writing them.
    topology = load_topology("dgx-a100")
    group = tuple(range(8))
    tensors = {k: Tensor(k, f"t{k}", 512 * (1 + k % 5), ACTIVATIONS) for k in range(96)}
    tensors.update({k: Tensor(k, f"c{k}", 2048, COMMUNICATION_BUFFERS) for k in range(96, 128)})
    results = []
    for fused in (False, True):
        streams = _order_program(steps, side_first, fused, group)
        for inline in (True, False):
            programs = [Program(0, "gpu", 0, tensors, streams)]
            allocator = CachingAllocator(CAPACITY, record_events=True)
            trace = simulate_programs(programs, [allocator], [CAPACITY], EngineOptions(inline_collectives=inline),
                                      topology)
            rank = trace.ranks[0]
            results.append((rank.memory, rank.spans, rank.allocator_events, trace.communication, trace.end_time_s))
    assert all(result == results[0] for result in results)


def _order_program(steps, side_first: bool, fused: bool, group: tuple[int, ...]) -> dict:
    """The streams of test_inline_keeps_order_against_other_streams; `fused`: TP collectives as Blocking."""
    compute, comm, side = [], [], []
    held = []
    for k, (what, seconds, hold) in enumerate(steps):
        if what == "run":
            compute.append(Run(Op(f"op{k}", "gemm", "fwd", allocs=(k,), frees=() if hold else (k,)), seconds))
            held += [k] if hold else []
        elif what == "tp":
            collective = Collective(f"tp{k}", "all_reduce", group, float(2**20 * (1 + k % 3)), (96 + k,),
                                    () if hold else (96 + k,), 0)
            if fused:
                compute.append(Blocking(collective, "comm"))
            else:
                comm += [WaitFor(f"r{k}"), collective, Signal(f"d{k}")]
                compute += [Signal(f"r{k}"), WaitFor(f"d{k}")]
            held += [96 + k] if hold else []
        else:
            side += [WaitFor(f"s{k}"), Run(Op(f"side{k}", "gemm", "fwd", allocs=(48 + k,), frees=(48 + k,)),
                                           seconds)]
            compute.append(Signal(f"s{k}"))
    compute.append(Free(tuple(held), "end"))
    streams = {"compute": tuple(compute), "comm": tuple(comm), "side": tuple(side)}
    if side_first:
        streams = {"side": streams["side"], "comm": streams["comm"], "compute": streams["compute"]}
    return streams


@pytest.mark.parametrize("schedule_name", ["1f1b", "zb-h1"])
def test_micro_batch_copies_are_timed_like_their_original(schedule_name):
    # A stage's copied micro-batches reuse their original's op durations: the same as costing them again.
    from simulator.parallel.lower import timed_ops
    from simulator.parallel.lower_multi import _timed_microbatches
    from simulator.parallel.plan import make_plan
    from simulator.parallel.schedule_check import load_schedule
    from simulator.parallel.lower_multi import build_stage_workloads

    scenario = scenario_from_dict(_doc(1, tp=2, pp=2, dp=2))
    cluster = api.resolve_cluster(scenario)
    device = cluster.device
    plan = make_plan(scenario, cluster.topology)
    recipe = api.multi_recipe(scenario, device)
    schedule = load_schedule(schedule_name, 2, recipe.accumulation_steps, scenario.parallel.virtual_stages)
    workloads = build_stage_workloads(api.model_shape(scenario), recipe, api.kernel_profile(device), plan, schedule)
    for workload in workloads.values():
        assert any(mb.copy_of >= 0 for mb in workload.microbatches)
        fast = _timed_microbatches(workload, device, {})
        for mb, (forward, backward, weight) in zip(workload.microbatches, fast):
            # Timed once per template (a copy shares its ops), the same as costing the copy's own ops.
            own = mb.resolved()
            assert bool(mb.weight) == (schedule_name == "zb-h1")
            for timed, ops, own_ops in ((forward, mb.forward, own.forward), (backward, mb.backward, own.backward),
                                        (weight, mb.weight, own.weight)):
                assert [op for op, _ in timed.pairs] == list(ops)
                assert [d for _, d in timed.pairs] == \
                    [r.duration_s for r in timed_ops(list(own_ops), workload.tensors, device, 0)]


@pytest.mark.parametrize("name, nodes, rail_optimized", [("dgx-a100", 40, True), ("dgx-a100", 12, False),
                                                         ("dgx-h100", 3, True), ("pcie-8xa100", 1, True),
                                                         ("pcie-4x4090", 1, True)])
def test_route_resources_equal_the_route(name, nodes, rail_optimized):
    topology = load_topology(name, nodes=nodes) if nodes > 1 else load_topology(name)
    if not rail_optimized:
        fabric = dataclasses.replace(topology.fabric, rail_optimized=False, leaf_down_ports=16)
        topology = dataclasses.replace(topology, fabric=fabric)
    n = topology.num_gpus
    rng = random.Random(7)
    pairs = [(a, b) for a in range(n) for b in range(n)] if n <= 32 else \
        [(rng.randrange(n), rng.randrange(n)) for _ in range(2000)]
    for a, b in pairs:
        fast = topology.route_resources(a, b)
        assert fast == tuple(r for r, _ in topology.route(a, b).resources)
        assert topology.route_resources(a, b) == fast


@pytest.mark.parametrize("enabled", [True, False])
def test_simulate_multi_restores_the_garbage_collector(enabled):
    import gc

    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        api.simulate_multi(scenario_from_dict(_doc(1, tp=2, pp=2, dp=2)))
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()
