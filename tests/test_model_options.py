"""Model-side memory options: ALBERT's cross-layer sharing (model.share_layers)."""

from __future__ import annotations

import pytest

from simulator import simulate
from simulator.api import kernel_profile, model_shape, recipe_for
from simulator.errors import PlanError
from simulator.scenario import scenario_from_dict
from simulator.topology import resolve_cluster
from simulator.workload.graph import ACTIVATIONS, PARAMETERS
from simulator.workload.training import build_iteration
from simulator.workload.transformer import model_parameter_count


def _doc(**model) -> dict:
    base = {"architecture": "bert", "num_layers": 6, "hidden_size": 128, "num_attention_heads": 4,
            "vocab_size": 1000, "seq_length": 64, "dropout": 0.0}
    return {"name": "options", "model": {**base, **model},
            "training": {"micro_batch_size": 2, "precision": "bf16-mixed"},
            "cluster": {"topology": "rtx-4090"}, "run": {"warmup_iterations": 1}}


def _workload(doc: dict):
    scenario = scenario_from_dict(doc)
    device = resolve_cluster(scenario).device
    return build_iteration(model_shape(scenario), recipe_for(scenario, device), kernel_profile(device))


def test_shared_layers_hold_one_layer_of_parameters():
    plain = model_parameter_count(model_shape(scenario_from_dict(_doc())))
    one_layer = plain - model_parameter_count(model_shape(scenario_from_dict(_doc(num_layers=5))))
    shared = model_parameter_count(model_shape(scenario_from_dict(_doc(share_layers=True))))
    assert shared == plain - 5 * one_layer
    workload = _workload(_doc(share_layers=True))
    params = [t for t in workload.tensors.values() if t.category == PARAMETERS and t.persistent]
    assert sum(t.nbytes for t in params) == 4 * shared                      # fp32 under autocast
    assert len(workload.gradients) == len(params)                            # one .grad per shared weight
    assert sum(workload.tensors[t].nbytes for t in workload.optimizer_state_ids) == 8 * shared


def test_shared_layers_keep_per_layer_activations_and_sum_their_gradients():
    plain, shared = _workload(_doc()), _workload(_doc(share_layers=True))

    def saved_by_layer(workload):
        return sorted({op.layer for op in workload.first_microbatch if op.layer >= 0})

    assert saved_by_layer(shared) == saved_by_layer(plain) == list(range(6))
    # Every layer's weight-gradient GEMMs still run; their results are added into the one gradient.
    gemms = [op for op in shared.first_microbatch if op.op_class == "gemm" and op.phase != "fwd"]
    assert len(gemms) == len([op for op in plain.first_microbatch if op.op_class == "gemm" and op.phase != "fwd"])
    accumulations = [op for op in shared.first_microbatch if op.name.endswith(".accumulate_grad")]
    assert len(accumulations) > len([op for op in plain.first_microbatch if op.name.endswith(".accumulate_grad")])
    # In fp32 (no autocast weight casts) the saved activations are the same bytes with or without sharing.
    fp32 = {"micro_batch_size": 2, "precision": "fp32"}
    p = simulate(scenario_from_dict({**_doc(), "training": fp32})).report["ranks"][0]["category_peaks"]
    s = simulate(scenario_from_dict({**_doc(share_layers=True), "training": fp32})).report["ranks"][0][
        "category_peaks"]
    assert s[PARAMETERS] < p[PARAMETERS] / 2
    assert s[ACTIVATIONS] == p[ACTIVATIONS]


def test_shared_layers_with_pipeline_stages_are_refused():
    doc = _doc(share_layers=True)
    doc["parallel"] = {"pp": 2}
    doc["training"]["global_batch_size"] = 4
    doc["cluster"] = {"topology": "pcie-4x4090"}
    doc["parallel"]["dp"] = 1
    with pytest.raises(PlanError, match="model.share_layers = true with parallel.pp = 2"):
        simulate(scenario_from_dict(doc))


def test_shared_layers_with_autocast_recompute_warns():
    report = simulate(scenario_from_dict({**_doc(share_layers=True), "training": {
        "micro_batch_size": 2, "precision": "bf16-mixed", "recompute": "full"}})).report
    assert any("model.share_layers with autocast and training.recompute" in w for w in report["warnings"])
