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


# ------------------------------------------------------------------------------- Linformer
def test_linformer_scores_are_n_by_k_and_e_f_are_parameters():
    kk = 16
    doc = _doc(attention="linformer", linformer_k=kk)
    workload = _workload(doc)
    shape = model_shape(scenario_from_dict(doc))
    extra = model_parameter_count(shape) - model_parameter_count(model_shape(scenario_from_dict(_doc(attention="eager"))))
    assert extra == 6 * 2 * kk * 64                  # E and F, (k x n) each, per layer
    scores = [op for op in workload.first_microbatch if op.name.endswith(".attn.scores")]
    assert len(scores) == 6
    b, nh, s = 2, 4, 64
    for op in scores:
        assert op.gemm_mnk == (s, kk, 128 // nh) and op.gemm_batch == b * nh
        assert op.bytes_written == b * nh * s * kk * 2          # bf16 under autocast
    projections = [op for op in workload.first_microbatch if op.name.endswith((".proj_k", ".proj_v"))]
    assert len(projections) == 12 and all(op.gemm_mnk == (2 * 128, kk, s) for op in projections)


def test_linformer_saves_less_than_eager_attention():
    eager = simulate(scenario_from_dict(_doc(attention="eager", seq_length=256, num_layers=2))).report
    linear = simulate(scenario_from_dict(_doc(attention="linformer", linformer_k=32, seq_length=256,
                                              num_layers=2))).report
    peak = lambda r: r["ranks"][0]["category_peaks"][ACTIVATIONS]           # noqa: E731
    assert peak(linear) < peak(eager)


@pytest.mark.parametrize("model, message", [
    ({"architecture": "gpt", "attention": "linformer", "linformer_k": 8}, "has no causal form"),
    ({"attention": "linformer"}, "model.linformer_k is missing"),
    ({"attention": "linformer", "linformer_k": 64}, "must be less than the sequence length = 64"),
    ({"attention": "eager", "linformer_k": 8}, "applies only to model.attention = 'linformer'"),
])
def test_linformer_refusals(model, message):
    from simulator.errors import ScenarioError
    with pytest.raises(ScenarioError, match=message):
        scenario_from_dict(_doc(**model))


def test_linformer_with_tensor_parallelism_is_refused():
    doc = _doc(attention="linformer", linformer_k=8)
    doc["parallel"] = {"tp": 2}
    doc["cluster"] = {"topology": "pcie-4x4090"}
    with pytest.raises(PlanError, match="with parallel.tp = 2"):
        simulate(scenario_from_dict(doc))


# ------------------------------------------------------------------------------- 2:4 sparsity
def _sparse_doc(sparsity: str = "2:4", precision: str = "bf16", topology: str = "h100-sxm") -> dict:
    return {"name": "sparse",
            "model": {"architecture": "gpt", "num_layers": 2, "hidden_size": 512, "num_attention_heads": 8,
                      "vocab_size": 1024, "seq_length": 256, "dropout": 0.0},
            "training": {"micro_batch_size": 4, "precision": precision, "sparsity": sparsity},
            "cluster": {"topology": topology}, "run": {"warmup_iterations": 1}}


def test_compressed_weight_is_half_the_values_plus_an_eighth_of_metadata():
    from simulator.workload.sparsity import compressed_weight_bytes
    assert compressed_weight_bytes(2048, 512, "bf16") == 2048 * 512 * 2 // 2 + 2048 * 512 // 8
    assert compressed_weight_bytes(2048, 512, "bf16") / (2048 * 512 * 2) == 0.5625      # 1.78x smaller


def test_sparse_mlp_saves_both_packs_and_the_bitmask_and_keeps_dense_weights():
    dense, sparse = _workload(_sparse_doc("none")), _workload(_sparse_doc())
    packs = [t for t in sparse.tensors.values() if t.name.endswith((".packed", ".packed_t", ".bitmask"))]
    h, ffn = 512, 2048
    per_layer = 2 * 2 * (h * ffn + h * ffn // 8) + 2 * h * ffn // 8       # fc1 and fc2: two packs + a bitmask each
    assert sum(t.nbytes for t in packs) == 2 * per_layer
    params = lambda w: sum(t.nbytes for t in w.tensors.values() if t.category == PARAMETERS and t.persistent)  # noqa: E731
    assert params(sparse) == params(dense)
    classes = {op.name.rsplit(".", 1)[-1]: op.op_class for op in sparse.first_microbatch if ".mlp." in op.name}
    assert classes["c_fc"] == "sparse_gemm" and classes["c_proj"] == "sparse_gemm"


def test_sparse_gemms_run_at_twice_the_dense_rate():
    from simulator.hardware.catalog import get_device
    from simulator.hardware.cost import effective_flop_per_s
    from simulator.workload.graph import GEMM, SPARSE_GEMM, Op
    device = get_device("h100-sxm")
    dense = Op("g", GEMM, "fwd", flops=2.0 * 8192 ** 3, dtype="bf16", gemm_mnk=(8192, 8192, 8192))
    sparse = Op("g", SPARSE_GEMM, "fwd", flops=2.0 * 8192 ** 3, dtype="bf16", gemm_mnk=(8192, 8192, 8192))
    assert effective_flop_per_s(sparse, device) == 2 * effective_flop_per_s(dense, device)
    # The weight is re-sparsified every forward (a pass over it): the sparse GEMMs win only with enough rows.
    wide = {"hidden_size": 2048, "num_attention_heads": 16}
    def run(sparsity):
        doc = _sparse_doc(sparsity)
        doc["model"].update(wide)
        doc["training"]["micro_batch_size"] = 32
        return simulate(scenario_from_dict(doc)).report
    a, b = run("none"), run("2:4")
    assert b["time_breakdown"]["forward_s"] < a["time_breakdown"]["forward_s"]
    assert b["ranks"][0]["category_peaks"][ACTIVATIONS] > a["ranks"][0]["category_peaks"][ACTIVATIONS]


@pytest.mark.parametrize("doc, message", [
    (_sparse_doc(precision="bf16-mixed"), "it needs training.precision = 'bf16'"),
    (_sparse_doc(topology="mi300x"), "device 'mi300x' has no sparse tensor cores"),
    (_sparse_doc(topology="cpu"), "device 'cpu' has no sparse tensor cores"),
])
def test_sparsity_refusals(doc, message):
    with pytest.raises(PlanError, match=message):
        simulate(scenario_from_dict(doc))
