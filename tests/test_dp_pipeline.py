"""Data parallelism with pipeline parallelism: per-stage DDP buckets and ZeRO-1 bytes, bucket reductions in
the last micro-batch's backward, the tied-embedding all_reduce, reduced vs --full, and bad input."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from simulator.api import kernel_profile, model_shape, multi_recipe, simulate
from simulator.errors import PlanError
from simulator.parallel.lower_multi import DP_STREAM, lower_multi
from simulator.parallel.plan import make_plan
from simulator.parallel.program import Collective, Run, Signal, posted_collectives
from simulator.parallel.schedule_check import load_schedule
from simulator.scenario import scenario_from_dict
from simulator.topology import resolve_cluster
from simulator.workload.data_parallel import DDP_FIRST_BUCKET_BYTES, gradient_buckets, shard_numel
from simulator.workload.graph import (
    BACKWARD_INPUT, COMMUNICATION_BUFFERS, DTYPE_BYTES, GRADIENTS, OPTIMIZER_STATES, PARAMETERS,
)
from simulator.workload.stage import StageSpec, build_stage
from test_scale import _comparable

TIED = "pp.tied_embedding_grad_all_reduce"
VOCAB, HIDDEN = 512, 64
# framework -> (parameter, gradient, bucket-buffer bytes per parameter, optimizer bytes per element of the shard)
BYTES = {"torch": (4, 4, 4, 8), "megatron": (2, 4, 0, 12), "deepspeed": (2, 2, 2, 12)}


def _doc(topology: str = "dgx-a100", *, framework: str = "torch", microbatches: int = 4, tied: bool = True,
         bucket: str = "60 kB", **parallel) -> dict:
    dp = parallel.get("dp", 1)
    return {"name": "dp-pp", "model": {"architecture": "gpt", "num_layers": 4, "hidden_size": HIDDEN,
                                       "num_attention_heads": 4, "vocab_size": VOCAB, "seq_length": 32,
                                       "dropout": 0.0, "tied_embeddings": tied},
            "training": {"micro_batch_size": 1, "global_batch_size": microbatches * dp,
                         "precision": "bf16-mixed", "framework": framework},
            "parallel": dict(parallel, bucket_size=bucket), "cluster": {"topology": topology},
            "run": {"warmup_iterations": 1, "iterations": 1, "record_events": False}}


def _lowered(doc: dict):
    """(plan, recipe, stage workloads, programs of the representatives) of a scenario document."""
    scenario = scenario_from_dict(doc)
    cluster = resolve_cluster(scenario)
    plan = make_plan(scenario, cluster.topology)
    recipe = multi_recipe(scenario, cluster.device)
    p = scenario.parallel
    schedule = load_schedule(p.schedule, p.pp, recipe.accumulation_steps, p.virtual_stages)
    shape, profile = model_shape(scenario), kernel_profile(cluster.device)
    programs, workloads = lower_multi(shape, recipe, profile, plan, schedule, cluster.device, 1, 1)
    return plan, recipe, workloads, programs


def _state_bytes(workload) -> dict[str, int]:
    out = dict.fromkeys((PARAMETERS, GRADIENTS, OPTIMIZER_STATES, COMMUNICATION_BUFFERS), 0)
    for tid in workload.persistent + workload.optimizer_state_ids + workload.gradients:
        tensor = workload.tensors[tid]
        if tensor.category in out:
            out[tensor.category] += tensor.nbytes
    return out


# ------------------------------------------------------------------------------- model states per stage
PLANS = [("pcie-4x4090", dict(tp=1, pp=2, dp=2)), ("dgx-a100", dict(tp=2, pp=2, dp=2)),
         ("dgx-a100", dict(tp=1, pp=2, dp=4))]


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("framework", ["torch", "megatron", "deepspeed"])
@pytest.mark.parametrize("topology,parallel", PLANS)
def test_stage_model_states_equal_the_ddp_and_zero1_formulas(topology, parallel, framework, zero):
    """Per stage with Ψ its (tp-sharded) parameters: DDP p·Ψ + g·Ψ + K·Ψ (+ bucket buffers b·Ψ);
    ZeRO-1 / distributed optimizer p·Ψ + g·Ψ + K·ceil(Ψ / dp); exact bytes."""
    dp = parallel["dp"]
    _, _, workloads, _ = _lowered(_doc(topology, framework=framework, zero_stage=zero, **parallel))
    p, g, b, k = BYTES[framework]
    for (stage, _chunk), workload in workloads.items():
        psi = workload.parameter_count
        got = _state_bytes(workload)
        states = k * (shard_numel(psi, dp) if zero else psi)
        buffers = 0 if (zero and framework == "deepspeed") else b * psi   # DeepSpeed ZeRO-1 reduces in place
        assert got == {PARAMETERS: p * psi, GRADIENTS: g * psi, OPTIMIZER_STATES: states,
                       COMMUNICATION_BUFFERS: buffers}, (stage, got)
        assert workload.meta["dp_shard_numel"] == shard_numel(psi, dp)


@pytest.mark.parametrize("framework", ["torch", "deepspeed"])
def test_stage_buckets_use_the_pp1_bucket_assignment(framework):
    """The buckets of a stage are gradient_buckets over its parameters in reverse registration order."""
    _, _, workloads, _ = _lowered(_doc(framework=framework, tp=2, pp=2, dp=2, bucket="50 kB"))
    for workload in workloads.values():
        grad_bytes = DTYPE_BYTES[workload.meta["dtypes"].grad]
        params = [t for tid, t in sorted(workload.tensors.items()) if t.category == PARAMETERS and t.persistent]
        sizes = {t.id: (t.nbytes // DTYPE_BYTES[t.dtype]) * grad_bytes for t in params}
        cap = min(DDP_FIRST_BUCKET_BYTES, 50_000) if framework == "torch" else None
        expected = gradient_buckets([t.id for t in reversed(params)], sizes, 50_000, cap)
        assert workload.meta["dp_buckets"] == tuple(b.nbytes for b in expected)
        assert sum(workload.meta["dp_buckets"]) == workload.parameter_count * grad_bytes
        assert len(workload.meta["dp_buckets"]) > 1


def test_reported_optimizer_states_are_sharded_per_stage():
    """The engine's optimizer-state bytes at the peak equal 12·ceil(Ψ/dp) on every stage (Megatron's
    distributed optimizer with pp = 2, dp = 4; exact allocator: no 512-byte rounding)."""
    doc = _doc(framework="megatron", tp=1, pp=2, dp=4, zero_stage=1)
    doc["allocator"] = {"kind": "exact"}
    _, _, workloads, _ = _lowered(doc)
    report = simulate(scenario_from_dict(doc)).report
    for row in report["ranks"]:
        psi = workloads[(row["stage"], 0)].parameter_count
        assert row["breakdown_at_peak"]["optimizer_states"] == 12 * shard_numel(psi, 4)


# ------------------------------------------------------------------------------- buckets in the schedule
def _bucket_positions(program, iteration: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Compute-stream indices of bucket-ready signals and (index, micro-batch) of backward runs."""
    signals, backward = [], []
    compute = program.streams["compute"]
    runs = [k for k, ins in enumerate(compute) if isinstance(ins, Run) and ins.iteration == iteration]
    lo, hi = runs[0], runs[-1]
    for k in range(lo, hi + 1):
        ins = compute[k]
        if isinstance(ins, Signal) and ins.event.startswith("dp.bucket"):
            signals.append(k)
        elif isinstance(ins, Run) and ins.op.phase == BACKWARD_INPUT and not ins.op.name.startswith("dp."):
            backward.append((k, ins.op.microbatch))
    return signals, backward


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("framework,zero", [("torch", 0), ("megatron", 1)])
def test_bucket_reductions_run_inside_the_last_microbatch_backward(schedule, framework, zero):
    plan, _, workloads, programs = _lowered(_doc(framework=framework, tp=2, pp=2, dp=2, zero_stage=zero,
                                                 schedule=schedule))
    for program in programs:
        workload = workloads[(program.stage, 0)]
        last = workload.meta["dp_sync_microbatch"]
        assert last == 3                        # both schedules run micro-batch 3's backward last
        for iteration in (0, 1):
            signals, backward = _bucket_positions(program, iteration)
            assert len(signals) == len(workload.meta["dp_buckets"])
            last_rows = [k for k, mb in backward if mb == last]
            earlier = [k for k, mb in backward if mb != last]
            # every reduction is issued after the earlier micro-batches' backward, during the last one's,
            # and all but the last bucket before that backward ends (overlap)
            assert max(earlier) < min(signals) and min(last_rows) < min(signals)
            assert sum(1 for k in signals if k < max(last_rows)) >= len(signals) - 1
        collectives = posted_collectives(program.streams, DP_STREAM)
        assert all(c.group == plan.group_of(program.rank, "dp") for c in collectives)
        reductions = [c for c in collectives if c.name.startswith("dp.bucket")]
        kind = "reduce_scatter" if framework == "megatron" else "all_reduce"
        assert {c.kind for c in reductions} == {kind}
        assert sum(c.size_bytes for c in reductions) == 2 * sum(workload.meta["dp_buckets"])   # 2 iterations
        gathers = [c for c in collectives if c.kind == "all_gather"]      # ZeRO-1: updated parameters
        assert [c.size_bytes for c in gathers] == [2 * workload.parameter_count] * (2 if zero else 0)


def _union(intervals):
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        a = max(a, reach)
        if b > a:
            total += b - a
        reach = max(reach, b)
    return total


@pytest.mark.parametrize("topology,dp", [("pcie-4x4090", 2), ("dgx-a100", 4)])
def test_dp_communication_overlaps_the_last_backward(topology, dp):
    """In the engine trace the bucket reductions start during the last backward; the part of them not
    hidden behind compute (exposed) is smaller than their total."""
    doc = _doc(topology, tp=1, pp=2, dp=dp, microbatches=4, bucket="25 kB")
    result = simulate(scenario_from_dict(doc))
    for rank in result.trace.ranks:
        spans = [s for s in rank.spans if s.iteration == 1]
        dp = [(s.start_s, s.end_s) for s in spans if s.stream == DP_STREAM]
        compute = [(s.start_s, s.end_s) for s in spans if s.stream == "compute" and s.phase != "comm"]
        backward_end = max(s.end_s for s in spans if s.stream == "compute" and s.phase == BACKWARD_INPUT
                           and not s.name.startswith("dp."))
        assert len(dp) > 1
        assert min(a for a, _ in dp) < backward_end
        total = _union(dp)
        hidden = _union([(max(a, c), min(b, d)) for a, b in dp for c, d in compute if min(b, d) > max(a, c)])
        assert total > 0 and hidden > 0
        assert total - hidden < total           # exposed < total


# ------------------------------------------------------------------------------- tied embeddings
def _tied(programs):
    return {p.rank: [c for s in p.streams.values() for c in s if isinstance(c, Collective) and c.name == TIED]
            for p in programs}


@pytest.mark.parametrize("tp,pp,dp", [(1, 2, 4), (2, 2, 2), (1, 4, 2), (2, 4, 1)])
def test_tied_embedding_gradient_is_all_reduced_between_first_and_last_stage(tp, pp, dp):
    plan, recipe, workloads, programs = _lowered(_doc(tp=tp, pp=pp, dp=dp))
    found = _tied(programs)
    grad_bytes = DTYPE_BYTES[workloads[(0, 0)].meta["dtypes"].grad]
    for program in programs:
        collectives = found[program.rank]
        if program.stage in (0, pp - 1):
            assert len(collectives) == 2                    # one per iteration (warm-up + measured)
            assert all(c.size_bytes == VOCAB // tp * HIDDEN * grad_bytes for c in collectives)
            assert all(c.group == (plan.rank_of(dp=0, pp=0, tp=0), plan.rank_of(dp=0, pp=pp - 1, tp=0))
                       for c in collectives)
        else:
            assert collectives == []


@pytest.mark.parametrize("doc", [_doc(tied=False, tp=1, pp=2, dp=4), _doc("pcie-4x4090", tp=1, pp=1, dp=4),
                                 _doc(tp=2, pp=1, dp=4)])
def test_no_tied_all_reduce_when_untied_or_without_pipeline(doc):
    result = simulate(scenario_from_dict(doc))
    assert not any(s.name == TIED for rank in result.trace.ranks for s in rank.spans)


def test_tied_all_reduce_runs_after_the_dp_reductions_and_before_the_step():
    result = simulate(scenario_from_dict(_doc("pcie-4x4090", tp=1, pp=2, dp=2)))
    for rank in result.trace.ranks:
        spans = [s for s in rank.spans if s.iteration == 1]
        tied = [s for s in spans if s.name == TIED]
        assert len(tied) == 1
        assert max(s.end_s for s in spans if s.stream == DP_STREAM) <= tied[0].start_s
        assert min(s.start_s for s in spans if s.phase == "optimizer") >= tied[0].end_s


# ------------------------------------------------------------------------------- symmetry
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from([("pcie-4x4090", dict(tp=1, pp=2, dp=2)), ("dgx-a100", dict(tp=2, pp=2, dp=2)),
                             ("dgx-a100", dict(tp=1, pp=4, dp=2)), ("dgx-a100", dict(tp=1, pp=2, dp=4))]),
       framework=st.sampled_from(["torch", "megatron", "deepspeed"]), zero=st.sampled_from([0, 1]),
       tied=st.booleans(), microbatches=st.sampled_from([1, 2, 4]))
def test_reduced_and_full_simulation_agree_with_dp_and_pp(case, framework, zero, tied, microbatches):
    topology, parallel = case
    doc = _doc(topology, framework=framework, zero_stage=zero, tied=tied, microbatches=microbatches, **parallel)
    reduced = simulate(scenario_from_dict(doc)).report
    doc["run"]["full"] = True
    full = simulate(scenario_from_dict(doc)).report
    assert _comparable(reduced) == _comparable(full)


def test_reduced_equals_full_with_tied_embeddings_over_four_stages_on_shared_links():
    """The other dp copies' first/last-stage embedding all_reduce loads the shared links in a reduced run."""
    doc = _doc("pcie-8xa100", tp=1, pp=4, dp=2)
    reduced = simulate(scenario_from_dict(doc)).report
    doc["run"]["full"] = True
    full = simulate(scenario_from_dict(doc)).report
    assert _comparable(reduced) == _comparable(full)


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("zero", [2, 3])
def test_zero2_and_zero3_with_pipeline_are_refused_in_one_line(zero):
    with pytest.raises(PlanError) as info:
        simulate(scenario_from_dict(_doc(framework="deepspeed", tp=1, pp=2, dp=4, zero_stage=zero)))
    message = str(info.value)
    assert "\n" not in message
    assert f"parallel.zero_stage = {zero}" in message and "parallel.pp = 2" in message
    assert "DeepSpeed" in message and "allowed with pp > 1: 0, 1" in message


def test_zero_stage_with_pipeline_and_one_data_parallel_rank_is_accepted():
    report = simulate(scenario_from_dict(_doc(tp=2, pp=4, dp=1, zero_stage=3))).report
    assert report["iteration_time_s"] > 0


@pytest.mark.parametrize("sync", [-1, 4, True, "3"])
def test_build_stage_rejects_a_bad_sync_microbatch(sync):
    scenario = scenario_from_dict(_doc(tp=1, pp=2, dp=2))
    device = resolve_cluster(scenario).device
    recipe = multi_recipe(scenario, device)
    with pytest.raises(PlanError, match=r"sync_microbatch = .* must be in 0\.\.3"):
        build_stage(model_shape(scenario), recipe, kernel_profile(device), StageSpec(0, 2, True, False), 4,
                    sync_microbatch=sync)


def test_build_stage_refuses_zero2():
    scenario = scenario_from_dict(_doc(tp=1, pp=2, dp=2))
    device = resolve_cluster(scenario).device
    recipe = multi_recipe(scenario, device)
    recipe = dataclasses.replace(recipe, zero_stage=2)
    with pytest.raises(PlanError, match=r"parallel.zero_stage = 2: .*allowed with parallel.pp > 1: 0, 1"):
        build_stage(model_shape(scenario), recipe, kernel_profile(device), StageSpec(0, 2, True, False), 4)
