"""LoRA and QLoRA (training.peft): frozen base weights, adapters with their states, NF4 weights, refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from simulator import simulate
from simulator.api import kernel_profile, model_shape, recipe_for
from simulator.errors import MemsimError
from simulator.scenario import scenario_from_dict
from simulator.topology import resolve_cluster
from simulator.workload.graph import BACKWARD_WEIGHT, PARAMETERS
from simulator.workload.peft import nf4_parts, quantized_bytes
from simulator.workload.training import build_iteration

H, FFN, LAYERS, VOCAB = 256, 512, 2, 1000


def _doc(model: dict | None = None, **training) -> dict:
    base = {"architecture": "llama", "num_layers": LAYERS, "hidden_size": H, "num_attention_heads": 4,
            "num_kv_heads": 2, "ffn_hidden_size": FFN, "vocab_size": VOCAB, "seq_length": 64}
    return {"name": "peft", "model": {**base, **(model or {})},
            "training": {"micro_batch_size": 2, "precision": "bf16-mixed", **training},
            "cluster": {"topology": "rtx-4090"}, "run": {"warmup_iterations": 1}}


def _workload(doc: dict):
    scenario = scenario_from_dict(doc)
    device = resolve_cluster(scenario).device
    return build_iteration(model_shape(scenario), recipe_for(scenario, device), kernel_profile(device))


def _params(workload) -> int:
    return sum(t.nbytes for t in workload.tensors.values() if t.category == PARAMETERS and t.persistent)


def test_lora_trains_only_the_adapters():
    workload = _workload(_doc(peft="lora", lora_rank=8, lora_target_modules=["q_proj", "v_proj"]))
    kvd = 2 * (H // 4)
    adapters = LAYERS * (8 * H + H * 8 + 8 * H + kvd * 8)
    assert workload.meta["trainable_parameters"] == adapters
    assert len(workload.gradients) == 4 * LAYERS                 # one .grad per A and B
    assert sum(workload.tensors[g].nbytes for g in workload.gradients) == 4 * adapters
    # AdamW: exp_avg and exp_avg_sq of the fp32 adapters only.
    assert sum(workload.tensors[t].nbytes for t in workload.optimizer_state_ids) == 8 * adapters
    # The frozen model sits in bf16 (2 bytes), the fp32 adapters next to it.
    full = _workload(_doc())
    assert _params(workload) == 2 * full.parameter_count + 4 * adapters
    assert workload.parameter_count == full.parameter_count + adapters


def test_frozen_weights_get_no_weight_gradient_gemm():
    workload = _workload(_doc(peft="lora", lora_target_modules="all-linear"))
    weight_grads = {op.name for op in workload.first_microbatch if op.phase == BACKWARD_WEIGHT}
    assert "layers.1.attn.q_proj.lora_A.wgrad" in weight_grads
    assert "layers.1.attn.q_proj.wgrad" not in weight_grads
    assert not any(name.startswith("lm_head") or name.startswith("embed") for name in weight_grads)
    names = {op.name for op in workload.first_microbatch}
    assert "layers.1.attn.q_proj.dgrad" in names                 # input gradients still flow through frozen weights
    # Layer 0's input does not require a gradient: its frozen linears have no backward, its A no input gradient.
    assert "layers.0.attn.q_proj.dgrad" not in names and "layers.0.attn.q_proj.lora_A.dgrad" not in names


def test_lora_saves_fewer_activations_than_full_fine_tuning_and_dropout_adds_its_masks():
    def peaks(doc):
        return simulate(scenario_from_dict(doc)).report["ranks"][0]["category_peaks"]

    full = peaks(_doc())
    lora = peaks(_doc(peft="lora"))
    dropped = peaks(_doc(peft="lora", lora_dropout=0.1))
    assert lora["gradients"] < full["gradients"] / 20 and lora["optimizer_states"] < full["optimizer_states"] / 20
    assert lora["activations"] < full["activations"]           # frozen linears do not save their inputs
    # q_proj and v_proj share their input x (the norm output), which only the A linears saved: with dropout they
    # save their dropped-out inputs (bf16) and, where x needs a gradient (layer 1, not layer 0), the bool masks.
    elements = 2 * 64 * H
    assert dropped["activations"] - lora["activations"] == elements * ((2 * 2 + 2 * 1 - 2) + (2 * 2 - 2))


def test_qlora_holds_nf4_weights_with_double_quantisation():
    n = 4096 * 4096
    parts = dict((s, (shape, dt)) for s, shape, dt in nf4_parts(4096, 4096))
    assert parts["nf4"] == ((n // 2,), "uint8") and parts["absmax"] == ((n // 64,), "uint8")
    assert parts["absmax2"] == ((n // 64 // 256,), "fp32")
    assert quantized_bytes(4096, 4096) == n // 2 + n // 64 + 4 * (n // 64 // 256) + 4 + 64
    lora = _workload(_doc(peft="lora"))
    qlora = _workload(_doc(peft="qlora"))
    kvd = 2 * (H // 4)
    linears = [(H, H), (kvd, H), (kvd, H), (H, H), (FFN, H), (FFN, H), (H, FFN)]
    dense = 2 * LAYERS * sum(o * i for o, i in linears)
    packed = LAYERS * sum(quantized_bytes(o, i) for o, i in linears) + 256 * 4     # + the shared dynamic map
    assert _params(lora) - _params(qlora) == dense - packed
    phases = {op.name: op.phase for op in qlora.first_microbatch}
    # MatMul4Bit dequantises in the forward and again for the input gradient; it has no weight gradient.
    assert phases["layers.1.mlp.down_proj.dequantize_4bit"] == "fwd"
    assert phases["layers.1.mlp.down_proj.bwd_dequantize_4bit"] != "fwd"
    assert "layers.1.mlp.down_proj.dgrad" in phases and "layers.1.mlp.down_proj.wgrad" not in phases


def test_lora_table_and_flat_keys_are_the_same():
    flat = scenario_from_dict(_doc(peft="lora", lora_rank=4, lora_alpha=8.0))
    table = scenario_from_dict(_doc(peft="lora", lora={"rank": 4, "alpha": 8.0}))
    assert flat.training == table.training


def test_set_of_a_flat_key_replaces_the_tables_value():
    """--set training.lora_rank=16 on a file with [training.lora] rank = 4 overrides it (not "given twice")."""
    table = scenario_from_dict(_doc(peft="lora", lora={"rank": 4, "alpha": 8.0}), "<dict>", ["training.lora_rank=16"])
    assert table.training == scenario_from_dict(_doc(peft="lora", lora_rank=16, lora_alpha=8.0)).training


@pytest.mark.parametrize(("training", "model", "needle"), [
    ({"peft": "lora", "lora_target_modules": ["c_attn"]}, {}, "'c_attn' is not a linear of a llama block"),
    ({"peft": "lora", "lora_rank": 300, "lora_target_modules": ["q_proj"]}, {}, "training.lora_rank = 300"),
    ({"peft": "lora", "framework": "megatron"}, {}, "training.framework = 'megatron'"),
    ({"peft": "lora", "sparsity": "2:4", "precision": "bf16"}, {}, "training.sparsity"),
    ({"peft": "lora"}, {"share_layers": True}, "model.share_layers"),
])
def test_refusals_name_the_keys(training, model, needle):
    with pytest.raises(MemsimError) as error:
        simulate(scenario_from_dict(_doc(model, **training)))
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_bad_lora_keys_are_refused_at_load():
    with pytest.raises(MemsimError, match="training.lora_rank"):
        scenario_from_dict(_doc(peft="lora", lora_rank=0))
    with pytest.raises(MemsimError, match="training.lora.ranks"):
        scenario_from_dict(_doc(peft="lora", lora={"ranks": 4}))
    with pytest.raises(MemsimError, match="given twice"):
        scenario_from_dict(_doc(peft="lora", lora_rank=4, lora={"rank": 4}))
    with pytest.raises(MemsimError, match="training.lora_dropout = 0.1: has no effect with training.peft = 'none'"):
        scenario_from_dict(_doc(lora={"dropout": 0.1}))


def test_adapters_are_refused_off_the_transformers():
    from simulator.scenario import load_scenario

    path = Path(__file__).resolve().parents[1] / "scenarios" / "seeds" / "resnet50-fp32-b32-3090.toml"
    with pytest.raises(MemsimError, match="model.architecture = 'resnet'"):
        simulate(load_scenario(path, ['training.peft="lora"']))


def test_cli_refuses_qlora_on_the_cpu_and_zero3(tmp_path):
    path = tmp_path / "q.toml"
    path.write_text('[model]\npreset = "gpt2"\nnum_layers = 2\n[training]\npeft = "qlora"\n'
                    '[cluster]\ntopology = "cpu"\n')
    done = subprocess.run([sys.executable, "-m", "simulator.cli", "run", str(path)], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "no bitsandbytes 4-bit kernels" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "simulator.cli", "run", str(path), "--set", "cluster.topology=dgx-a100",
                           "--set", "parallel.dp=2", "--set", "parallel.zero_stage=3"], capture_output=True, text=True)
    assert done.returncode == 2 and "parallel.zero_stage = 3" in done.stderr and "Traceback" not in done.stderr


FOUR_GPUS = {"topology": "pcie-4x4090"}


@pytest.mark.parametrize(("parallel", "cluster", "training", "needle"), [
    ({"tp": 4}, FOUR_GPUS, {}, "parallel.tp = 4"),
    ({"pp": 4}, FOUR_GPUS, {"global_batch_size": 8}, "parallel.pp = 4"),
    ({"dp": 4, "gradient_compression": "int8"}, FOUR_GPUS, {"global_batch_size": 8}, "parallel.gradient_compression"),
    ({}, {"topology": "rtx-4090"}, {"precision": "fp8-mixed"}, "training.precision = 'fp8-mixed'"),
])
def test_parallel_refusals_name_the_keys(parallel, cluster, training, needle):
    doc = _doc({"num_layers": 4, "num_attention_heads": 4, "num_kv_heads": 4}, peft="lora", **training)
    doc.update(parallel=parallel, cluster=cluster)
    with pytest.raises(MemsimError) as error:
        simulate(scenario_from_dict(doc))
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_offload_is_refused_with_lora():
    doc = _doc(peft="lora", framework="torch")
    doc["cluster"] = {"topology": "workstation-rtx4090"}
    doc["parallel"] = {"offload_activations": "cpu"}
    with pytest.raises(MemsimError, match="training.peft = 'lora' with parallel.offload"):
        simulate(scenario_from_dict(doc))


PEFT_SCENARIOS = sorted((Path(__file__).resolve().parents[1] / "scenarios" / "peft").glob("*.toml"))


@pytest.mark.parametrize("path", PEFT_SCENARIOS, ids=[p.stem for p in PEFT_SCENARIOS])
def test_peft_scenarios_load_and_pass_the_checks(path):
    from simulator.api import check_scenario
    from simulator.scenario import load_scenario

    scenario = load_scenario(path)
    assert scenario.training.peft in ("lora", "qlora")
    check_scenario(scenario)


@pytest.mark.slow
def test_qlora_scenario_fits_the_4090_where_full_fine_tuning_does_not():
    from simulator.scenario import load_scenario

    path = next(p for p in PEFT_SCENARIOS if p.stem == "llama7b-qlora-4090")
    report = simulate(load_scenario(path), timelines=False).report
    assert report["fits"] and report["model"]["trainable_parameters"] == 159_907_840
    assert report["model"]["parameters"] == 6_898_323_456
