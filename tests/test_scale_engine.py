"""Scale shortcuts of the engine keep results exact: isolated collectives, pruned shadows, compute run ahead."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from simulator.api import simulate
from simulator.engine.allocator import ExactAllocator
from simulator.engine.executor import EngineOptions, simulate_programs
from simulator.network import load_topology
from simulator.network.collectives import lower_collective
from simulator.network.footprint import footprint, interference_components, isolated_duration_s
from simulator.parallel.program import Collective, Program, Run, Signal, WaitFor, Alloc, Free
from simulator.scenario import scenario_from_dict
from simulator.workload.graph import ACTIVATIONS, Op, Tensor

GIB = 2**30
CAPACITY = 80 * GIB


@pytest.fixture(scope="module")
def a100x2():
    return load_topology("dgx-a100", nodes=2)


def _run(streams_by_rank, topology, options=EngineOptions(), tensors=None):
    programs = [Program(rank, "gpu", 0, dict(tensors or {}), streams) for rank, streams in streams_by_rank.items()]
    return simulate_programs(programs, [ExactAllocator(CAPACITY) for _ in programs], [CAPACITY] * len(programs),
                             options, topology)


def _durations(trace, rank: int, name: str) -> list[float]:
    return [s.end_s - s.start_s for r in trace.ranks if r.rank == rank for s in r.spans if s.name == name]


@pytest.mark.parametrize("topology_name, group", [("dgx-a100", tuple(range(8))), ("dgx-h100", tuple(range(8))),
                                                  ("dgx-a100", (2, 5)), ("pcie-4x4090", (0, 1, 2, 3))])
@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter"])
@pytest.mark.parametrize("size", [4096.0, 3 * 2**20, 512 * 2**20])
def test_isolated_collective_time_equals_the_flow_simulation(topology_name, group, kind, size):
    topology = load_topology(topology_name)
    streams = {r: {"comm": (Run(Op("c", "gemm", "fwd"), 1e-3), Collective("x", kind, group, size))} for r in group}
    fast = _run(streams, topology)
    flows = _run(streams, topology, EngineOptions(isolated_collectives=False))
    alone = isolated_duration_s(topology, lower_collective(topology, kind, group, size))
    for rank in group:
        (a,), (b,) = _durations(fast, rank, "x"), _durations(flows, rank, "x")
        assert a == pytest.approx(b, rel=1e-9, abs=0) and a == pytest.approx(alone, rel=1e-9, abs=0)
        assert a > 0


def test_a_collective_sharing_links_with_another_group_runs_as_flows(a100x2):
    # The two groups share GPU 0's NVLink ports: concurrent, they slow each other (no isolated shortcut).
    size = 256 * 2**20
    big, pair = tuple(range(8)), (0, 1)
    streams = {r: {"comm": (Collective("big", "all_reduce", big, size),)} for r in big}
    for r in pair:
        streams[r]["comm.b"] = (Collective("pair", "all_reduce", pair, size),)
    together = _run(streams, a100x2)
    alone = isolated_duration_s(a100x2, lower_collective(a100x2, "all_reduce", pair, size))
    assert _durations(together, 0, "pair")[0] > alone * 1.05


def test_interference_components_join_chains_of_shared_resources():
    components = interference_components({"a": (1, 2), "b": (2, 7), "c": (7, 9), "d": (4, 5), "e": ()})
    assert components == {"a": 1, "b": 1, "c": 1, "d": 4, "e": -1}


def test_tp_groups_of_two_nodes_have_disjoint_footprints(a100x2):
    first = footprint(a100x2, lower_collective(a100x2, "all_reduce", tuple(range(8)), 2**24))
    second = footprint(a100x2, lower_collective(a100x2, "all_reduce", tuple(range(8, 16)), 2**24))
    assert first and second and not set(first) & set(second)


def _doc(nodes: int, **parallel) -> dict:
    return {"name": "tiny", "model": {"architecture": "gpt", "num_layers": 4, "hidden_size": 128,
                                      "num_attention_heads": 8, "vocab_size": 512, "seq_length": 32, "dropout": 0.0},
            "training": {"micro_batch_size": 1, "global_batch_size": 8, "precision": "bf16-mixed",
                         "framework": "megatron"},
            "parallel": parallel, "cluster": {"topology": "dgx-a100", "nodes": nodes},
            "run": {"warmup_iterations": 1, "iterations": 1, "record_events": False}}


def test_multi_node_reduced_simulation_with_pruned_shadows_equals_full():
    # tp 8 inside each node, 2 stages x 2 data-parallel copies on 4 nodes: the other copy's TP traffic
    # stays on its own NVSwitch (pruned); its pipeline and DP traffic share NICs and leaves (kept).
    doc = _doc(4, tp=8, pp=2, dp=2)
    reduced = simulate(scenario_from_dict(doc)).report
    doc["run"]["full"] = True
    full = simulate(scenario_from_dict(doc)).report
    keys = ("iteration_time_s", "bubble_fraction", "communication", "fits")
    assert {k: reduced[k] for k in keys} == {k: full[k] for k in keys}
    assert [r["peak_allocated_bytes"] for r in reduced["ranks"]] == [r["peak_allocated_bytes"] for r in full["ranks"]]


_ops = st.lists(st.tuples(st.sampled_from([0.0, 1e-6, 2.5e-6, 1e-3]), st.booleans()), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(compute=_ops, other=_ops, wait_at=st.integers(0, 11))
def test_running_compute_ahead_changes_nothing(compute, other, wait_at):
    # Two streams of one rank allocate and free through one allocator; the other stream starts when the
    # compute stream signals. Running ahead must give the same memory timeline, spans and peaks.
    tensors = {k: Tensor(k, f"t{k}", 1000 + k, ACTIVATIONS) for k in range(64)}

    def stream(ops, first_id, prefix):
        out = []
        for k, (seconds, holds) in enumerate(ops):
            tid = first_id + k
            out.append(Run(Op(f"{prefix}{k}", "gemm", "fwd", allocs=(tid,), frees=() if holds else (tid,)), seconds))
        return out, [first_id + k for k, (_, holds) in enumerate(ops) if holds]

    main, held = stream(compute, 0, "c")
    side, side_held = stream(other, 32, "s")
    at = min(wait_at, len(main))
    compute_stream = tuple(main[:at] + [Signal("go")] + main[at:] + [Free(tuple(held), "end")])
    side_stream = tuple([WaitFor("go")] + side + [Free(tuple(side_held), "end")])
    results = []
    for ahead in (True, False):
        programs = [Program(0, "gpu", 0, tensors, {"compute": compute_stream, "side": side_stream})]
        trace = simulate_programs(programs, [ExactAllocator(CAPACITY)], [CAPACITY],
                                  EngineOptions(run_ahead=ahead))
        rank = trace.ranks[0]
        results.append((rank.memory, rank.spans, rank.peak_allocated, rank.peak_time_s, trace.end_time_s))
    assert results[0] == results[1]
    assert [s.time_s for s in results[0][0]] == sorted(s.time_s for s in results[0][0])


def test_run_ahead_keeps_alloc_order_against_another_stream():
    tensors = {0: Tensor(0, "a", 10, ACTIVATIONS), 1: Tensor(1, "b", 20, ACTIVATIONS)}
    programs = [Program(0, "gpu", 0, tensors, {
        "compute": (Signal("go"), Run(Op("long", "gemm", "fwd"), 1.0), Alloc((0,), "late"), Free((0,), "x")),
        "side": (WaitFor("go"), Run(Op("short", "gemm", "fwd"), 0.25), Alloc((1,), "early"), Free((1,), "y"))})]
    trace = simulate_programs(programs, [ExactAllocator(CAPACITY)], [CAPACITY])
    times = [s.time_s for s in trace.ranks[0].memory]
    assert times == [0.25, 0.25, 1.0, 1.0]
