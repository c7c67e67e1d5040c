"""Scale optimizations keep results exact: copied micro-batches, the symmetry reduction against --full."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from simulator.api import kernel_profile, model_shape, multi_recipe, simulate
from simulator.scenario import scenario_from_dict
from simulator.topology import resolve_cluster
from simulator.workload.stage import StageSpec, build_stage


def _doc(topology: str, global_batch: int = 8, precision: str = "bf16-mixed", framework: str = "torch",
         **parallel) -> dict:
    return {"name": "tiny", "model": {"architecture": "gpt", "num_layers": 4, "hidden_size": 64,
                                      "num_attention_heads": 4, "vocab_size": 512, "seq_length": 32,
                                      "dropout": 0.0},
            "training": {"micro_batch_size": 1, "global_batch_size": global_batch, "precision": precision,
                         "framework": framework},
            "parallel": parallel, "cluster": {"topology": topology},
            "run": {"warmup_iterations": 1, "iterations": 1, "record_events": False}}


@pytest.mark.parametrize("first_backward", [0, 1, 3])
@pytest.mark.parametrize("spec", [StageSpec(0, 2, True, False), StageSpec(2, 4, False, True),
                                  StageSpec(1, 3, False, False)])
@pytest.mark.parametrize("framework", ["torch", "megatron"])
def test_copied_microbatches_equal_recorded_ones(first_backward, spec, framework):
    scenario = scenario_from_dict(_doc("dgx-a100", framework=framework, tp=2, pp=2, dp=2))
    device = resolve_cluster(scenario).device
    recipe = multi_recipe(scenario, device)
    shape, profile = model_shape(scenario), kernel_profile(device)
    stage_input = None if spec.first else ((1, 32, 64), "bf16")
    fast = build_stage(shape, recipe, profile, spec, 6, first_backward, stage_input)
    slow = build_stage(shape, recipe, profile, spec, 6, first_backward, stage_input, replay_all=True)
    # The last micro-batch reduces the gradients (dp 2): it has its own ops, so with first_backward 3 (template
    # 4) no copy is left.
    assert any(mb.shift for mb in fast.microbatches) == (first_backward < 3)
    assert [mb.resolved() for mb in fast.microbatches] == list(slow.microbatches)
    # A copy's id maps to its template's Tensor: everything but `.id` is the recorded tensor's.
    assert fast.tensors.keys() == slow.tensors.keys()
    assert all(dataclasses.replace(fast.tensors[tid], id=tid) == t for tid, t in slow.tensors.items())
    assert (fast.persistent, fast.gradients, fast.optimizer, fast.optimizer_state_ids) == \
        (slow.persistent, slow.gradients, slow.optimizer, slow.optimizer_state_ids)


def _comparable(report: dict) -> dict:
    return {"iteration_time_s": report["iteration_time_s"], "bubble_fraction": report["bubble_fraction"],
            "communication": report["communication"], "fits": report["fits"],
            "ranks": [(r["rank"], r["stage"], r["peak_allocated_bytes"], r["peak_reserved_bytes"],
                       r["breakdown_at_peak"], r["compute_s"], r["exposed_communication_s"], r["idle_s"])
                      for r in report["ranks"]]}


PLANS = [dict(tp=2, pp=2), dict(dp=4), dict(tp=4), dict(pp=4), dict(tp=2, pp=2, dp=2), dict(dp=2, pp=4)]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=st.sampled_from(["pcie-4x4090", "dgx-a100"]), plan=st.sampled_from(PLANS),
       microbatches=st.sampled_from([1, 2, 4]))
def test_reduced_and_full_simulation_give_the_same_report(topology, plan, microbatches):
    if topology == "pcie-4x4090" and plan.get("tp", 1) * plan.get("pp", 1) * plan.get("dp", 1) != 4:
        plan = dict(tp=2, pp=2)
    world = 4 if topology == "pcie-4x4090" else 8
    dp = plan.get("dp", 1) if plan.get("tp", 1) * plan.get("pp", 1) * plan.get("dp", 1) == world else \
        world // (plan.get("tp", 1) * plan.get("pp", 1))
    parallel = dict(plan, dp=dp)
    doc = _doc(topology, global_batch=microbatches * dp, **parallel)
    reduced = simulate(scenario_from_dict(doc)).report
    doc["run"]["full"] = True
    full = simulate(scenario_from_dict(doc)).report
    assert _comparable(reduced) == _comparable(full)
