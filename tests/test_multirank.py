"""Multi-rank lowering: pipeline stages, TP/DP collectives and `simulate` for tp/pp/dp > 1."""

from __future__ import annotations

import pytest

from simulator.api import kernel_profile, model_shape, recipe_for, simulate, simulate_multi
from simulator.scenario import scenario_from_dict
from simulator.topology import resolve_cluster
from simulator.workload.stage import StageSpec, build_stage
from simulator.workload.training import build_iteration

GLOBAL_BATCH = 8


def _doc(topology: str = "pcie-4x4090", **parallel) -> dict:
    return {"name": "tiny", "model": {"architecture": "gpt", "num_layers": 4, "hidden_size": 64,
                                      "num_attention_heads": 4, "vocab_size": 512, "seq_length": 32,
                                      "dropout": 0.0},
            "training": {"micro_batch_size": 1, "global_batch_size": GLOBAL_BATCH, "precision": "bf16-mixed"},
            "parallel": parallel, "cluster": {"topology": topology},
            "run": {"warmup_iterations": 1, "iterations": 1}}


def _rows(ops, tensors):
    return [(op.name, op.op_class, op.phase, tuple(tensors[i].nbytes for i in op.allocs),
             tuple(tensors[i].nbytes for i in op.frees)) for op in ops]


@pytest.mark.parametrize("architecture", ["gpt", "llama"])
def test_full_range_stage_is_the_whole_model_program(architecture):
    doc = _doc("rtx-4090")
    if architecture == "llama":
        doc["model"].update(architecture="llama", num_kv_heads=2)
    scenario = scenario_from_dict(doc)
    device = resolve_cluster(scenario).device
    recipe = recipe_for(scenario, device)
    whole = build_iteration(model_shape(scenario), recipe, kernel_profile(device))
    stage = build_stage(model_shape(scenario), recipe, kernel_profile(device), StageSpec(0, 4, True, True),
                        recipe.accumulation_steps)
    first, later = stage.microbatches[0], stage.microbatches[1]
    assert _rows(first.forward + first.backward, stage.tensors) == _rows(whole.first_microbatch, whole.tensors)
    assert _rows(later.forward + later.backward, stage.tensors) == _rows(whole.later_microbatch, whole.tensors)
    assert _rows(stage.optimizer, stage.tensors) == _rows(whole.optimizer, whole.tensors)
    assert [stage.tensors[i].nbytes for i in stage.persistent] == [whole.tensors[i].nbytes for i in whole.persistent]
    assert [(n, [stage.tensors[i].nbytes for i in ids]) for n, ids in stage.first_use] == \
        [(n, [whole.tensors[i].nbytes for i in ids]) for n, ids in whole.first_use]
    assert len(whole.first_use) == 2          # forward and autograd-thread cuBLAS workspaces (RTX 4090)


@pytest.mark.parametrize("parallel", [dict(tp=2, pp=2), dict(pp=4), dict(tp=4), dict(dp=4)])
def test_plans_simulate_on_four_4090s(parallel):
    report = simulate(scenario_from_dict(_doc(**parallel))).report
    pp = parallel.get("pp", 1)
    assert [r["stage"] for r in report["ranks"]] == list(range(pp))
    assert report["iteration_time_s"] > 0
    assert all(r["peak_allocated_bytes"] > 0 for r in report["ranks"])
    if parallel.get("tp", 1) > 1 or pp > 1 or parallel.get("dp", 1) > 1:
        assert report["communication"]["total_s"] > 0


def test_one_f_one_b_first_stage_holds_more_activations_than_the_last():
    report = simulate(scenario_from_dict(_doc(pp=4))).report
    first, last = report["ranks"][0], report["ranks"][-1]
    # 1F1B: stage 0 holds p = 4 micro-batches of activations, the last stage one (plus its logits).
    assert first["category_peaks"]["activations"] > last["category_peaks"]["activations"]


def test_pipeline_iteration_is_at_least_the_busiest_stage_compute():
    report = simulate(scenario_from_dict(_doc(pp=4))).report
    busiest = max(r["compute_s"] for r in report["ranks"])
    assert report["iteration_time_s"] >= busiest
    assert 0.0 < report["bubble_fraction"] < 1.0


def test_multirank_is_deterministic():
    a = simulate(scenario_from_dict(_doc(tp=2, pp=2))).report
    b = simulate(scenario_from_dict(_doc(tp=2, pp=2))).report
    assert a == b


def test_multirank_path_with_one_device_equals_the_single_device_result():
    scenario = scenario_from_dict(_doc("rtx-4090"))
    single = simulate(scenario).report
    multi = simulate_multi(scenario).report
    for key in ("fits", "iteration_time_s", "bubble_fraction"):
        assert multi[key] == single[key]
    assert multi["ranks"][0]["peak_allocated_bytes"] == single["ranks"][0]["peak_allocated_bytes"]
    assert multi["ranks"][0]["peak_reserved_bytes"] == single["ranks"][0]["peak_reserved_bytes"]
