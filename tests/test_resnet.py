"""ResNet workload (workload/resnet.py, conv_ops.py): what autograd saves, parameter counts, refusals, time."""

from __future__ import annotations

import pytest

from simulator import simulate
from simulator.api import kernel_profile, model_shape, recipe_for
from simulator.errors import MemsimError
from simulator.scenario import scenario_from_dict
from simulator.topology import resolve_cluster
from simulator.workload.graph import ACTIVATIONS, GEMM
from simulator.workload.training import build_iteration
from simulator.workload.transformer import model_parameter_count

TORCHVISION = {"resnet18": 11_689_512, "resnet34": 21_797_672, "resnet50": 25_557_032, "resnet101": 44_549_160,
               "resnet152": 60_192_808}


def _doc(model=None, training=None, topology="rtx-4090") -> dict:
    return {"name": "resnet", "model": model or {"architecture": "resnet", "resnet_blocks": [1, 1], "image_size": 32,
                                                 "num_classes": 10},
            "training": {"micro_batch_size": 2, "precision": "fp32", **(training or {})},
            "cluster": {"topology": topology}, "run": {"warmup_iterations": 1}}


def _workload(doc: dict):
    scenario = scenario_from_dict(doc)
    device = resolve_cluster(scenario).device
    return build_iteration(model_shape(scenario), recipe_for(scenario, device), kernel_profile(device))


@pytest.mark.parametrize("name", sorted(TORCHVISION))
def test_builder_declares_torchvision_parameter_counts(name):
    assert model_parameter_count(model_shape(scenario_from_dict({"model": {"preset": name}}))) == TORCHVISION[name]


def test_in_place_relu_and_add_allocate_nothing_and_the_first_conv_has_no_input_gradient():
    ops = _workload(_doc()).first_microbatch
    relus = [op for op in ops if op.phase == "fwd" and (".relu" in op.name or op.name == "relu" or op.name.endswith(".add"))]
    assert relus and all(not op.allocs for op in relus)
    assert not any(op.name == "conv1.dgrad" for op in ops)
    assert any(op.name == "conv1.wgrad" for op in ops)


def test_fp32_convs_run_as_tf32_on_a_gpu_and_amp_halves_the_conv_activations():
    fp32 = _workload(_doc())
    assert {op.dtype for op in fp32.first_microbatch if op.op_class == GEMM and op.name.startswith("layer")} == {"tf32"}

    def saved(workload):
        return sum(t.nbytes for t in workload.tensors.values() if t.category == ACTIVATIONS)

    big = {"architecture": "resnet", "resnet_blocks": [1, 1], "image_size": 128, "num_classes": 10}
    amp = _workload(_doc(big, training={"precision": "bf16-mixed"}))
    assert 0.45 < saved(amp) / saved(_workload(_doc(big))) < 0.65     # the 16-bit weight casts are the rest


def test_full_recompute_keeps_only_block_inputs():
    plain = simulate(scenario_from_dict(_doc())).report["ranks"][0]["category_peaks"][ACTIVATIONS]
    full = simulate(scenario_from_dict(_doc(training={"recompute": "full"}))).report["ranks"][0]["category_peaks"]
    assert full[ACTIVATIONS] < plain


@pytest.mark.parametrize("change, words", [
    ({"model": {"preset": "resnet50", "hidden_size": 512}}, "model.hidden_size = 512: a transformer key"),
    ({"model": {"architecture": "resnet"}}, "model.resnet_blocks"),
    ({"model": {"preset": "resnet50", "resnet_blocks": [3, 0]}}, "model.resnet_blocks = [3, 0]"),
    ({"model": {"preset": "resnet50", "image_size": 16}}, "model.image_size = 16: must be at least 32"),
    ({"training": {"recompute": "selective"}}, "training.recompute = 'selective' with model.architecture = 'resnet'"),
    ({"training": {"sparsity": "2:4", "precision": "bf16"}}, "training.sparsity = '2:4'"),
    ({"parallel": {"tp": 2, "dp": 4}, "cluster": {"topology": "dgx-a100"}}, "parallel.tp = 2: a resnet is simulated"),
])
def test_refusals_are_one_line(change, words):
    doc = _doc()
    for section, values in change.items():
        doc[section] = {**doc.get(section, {}), **values} if section != "model" else values
    with pytest.raises(MemsimError) as error:
        simulate(scenario_from_dict(doc))
    assert words in str(error.value) and "\n" not in str(error.value)


def test_fast_estimate_refuses_a_resnet():
    from simulator.explore.estimate import estimate_reports

    (outcome,) = estimate_reports([scenario_from_dict(_doc())], errors="return")
    assert isinstance(outcome, MemsimError) and "fast estimate" in str(outcome)
