"""Scenario loading: defaults, TOML files, --set overrides, relative paths and every error message."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from simulator.errors import MemsimError, ScenarioError
from simulator.scenario import (
    ModelConfig, Scenario, apply_overrides, load_scenario, parse_override_value, scenario_from_dict,
)
from simulator.scenario.loader import reference_markdown
from simulator.scenario.schema import SECTION_KEYS

REPO = Path(__file__).resolve().parent.parent

DESIGN_EXAMPLE = """
name = "llama7b-4090"
[model]
preset = "llama-7b"
[training]
micro_batch_size = 1
global_batch_size = 8
precision = "bf16-mixed"
framework = "torch"
optimizer = "adamw"
recompute = "none"
activation_compression = "none"
[parallel]
tp = 1
pp = 1
dp = 1
sequence_parallel = false
schedule = "1f1b"
virtual_stages = 1
zero_stage = 0
offload_optimizer = "none"
offload_params = "none"
offload_activations = "none"
gradient_compression = "none"
bucket_size = "25 MB"
[cluster]
topology = "dgx-a100"
nodes = 1
[allocator]
kind = "caching"
[run]
iterations = 1
seed = 0
"""

TINY = {"architecture": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
        "vocab_size": 100, "seq_length": 32}


def _doc(**sections) -> dict:
    doc = {"model": dict(TINY)}
    for section, table in sections.items():
        doc.setdefault(section, {}).update(table)
    return doc


def _error(doc: dict, source: str = "x.toml", overrides=()) -> str:
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(doc, source, overrides)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{source}: ")
    return message


def test_design_example_loads_with_its_values(tmp_path):
    path = tmp_path / "llama7b.toml"
    path.write_text(DESIGN_EXAMPLE)
    scenario = load_scenario(path)
    assert isinstance(scenario, Scenario)
    assert scenario.name == "llama7b-4090"
    assert scenario.source == str(path)
    assert scenario.model.preset == "llama-7b"
    assert (scenario.model.num_layers, scenario.model.hidden_size, scenario.model.ffn_hidden_size) == (32, 4096, 11008)
    assert scenario.training.global_batch_size == 8
    assert scenario.training.gradient_accumulation_steps == 8
    assert scenario.parallel.bucket_size == 25_000_000 == scenario.parallel.bucket_size_bytes
    assert scenario.allocator.kind == "caching"
    assert scenario.cluster.topology == "dgx-a100"


def test_minimal_scenario_gets_every_default():
    scenario = scenario_from_dict({"model": dict(TINY)})
    assert scenario.name == "scenario"
    assert scenario.description == ""
    training = scenario.training
    assert (training.micro_batch_size, training.global_batch_size, training.precision, training.framework,
            training.optimizer, training.optimizer_implementation, training.recompute,
            training.activation_compression, training.loss_scale) == (
        1, 1, "bf16-mixed", "torch", "adamw", "auto", "none", "none", "dynamic")
    parallel = scenario.parallel
    assert (parallel.tp, parallel.pp, parallel.dp, parallel.sequence_parallel, parallel.schedule,
            parallel.virtual_stages, parallel.zero_stage, parallel.offload_optimizer, parallel.offload_params,
            parallel.offload_activations, parallel.gradient_compression, parallel.bucket_size,
            parallel.placement) == (1, 1, 1, False, "1f1b", 1, 0, "none", "none", "none", "none", 25_000_000, "auto")
    assert scenario.cluster == scenario.cluster.__class__(topology="dgx-a100", nodes=1, calibration=None)
    allocator = scenario.allocator
    assert (allocator.kind, allocator.max_split_size, allocator.roundup_power2_divisions,
            allocator.expandable_segments, allocator.context_bytes) == ("auto", None, None, False, None)
    run = scenario.run
    assert (run.iterations, run.warmup_iterations, run.seed, run.full, run.record_events) == (1, 1, 0, False, True)


def test_model_defaults_per_architecture():
    gpt = scenario_from_dict({"model": dict(TINY)}).model
    assert (gpt.num_kv_heads, gpt.ffn_hidden_size, gpt.max_position_embeddings) == (4, 256, 32)
    assert (gpt.activation, gpt.norm, gpt.norm_eps, gpt.bias, gpt.attention, gpt.dropout,
            gpt.tied_embeddings, gpt.post_norm, gpt.rope_theta) == (
        "gelu", "layernorm", 1e-5, True, "flash", 0.1, True, False, None)
    llama = scenario_from_dict({"model": {**TINY, "architecture": "llama", "hidden_size": 4096,
                                          "num_attention_heads": 32}}).model
    assert llama.ffn_hidden_size == 11008  # LLaMA: 256 * ceil(int(2/3 * 4h) / 256)
    assert (llama.activation, llama.norm, llama.bias, llama.dropout, llama.tied_embeddings,
            llama.rope_theta) == ("swiglu", "rmsnorm", False, 0.0, False, 10000.0)
    bert = scenario_from_dict({"model": {**TINY, "architecture": "bert"}}).model
    assert (bert.post_norm, bert.type_vocab_size, bert.norm_eps, bert.dropout, bert.tied_embeddings) == (
        True, 2, 1e-12, 0.1, True)
    vit = scenario_from_dict({"model": {"architecture": "vit", "num_layers": 2, "hidden_size": 64,
                                        "num_attention_heads": 4, "image_size": 32, "patch_size": 8}}).model
    assert (vit.seq_length, vit.max_position_embeddings, vit.vocab_size, vit.num_patches) == (17, 17, 0, 16)
    assert (vit.num_channels, vit.num_classes, vit.dropout, vit.tied_embeddings) == (3, 1000, 0.0, False)


def test_seq_length_defaults_to_max_position_embeddings():
    model = {k: v for k, v in TINY.items() if k != "seq_length"}
    assert scenario_from_dict({"model": {**model, "max_position_embeddings": 128}}).model.seq_length == 128


def test_global_batch_default_and_accumulation():
    scenario = scenario_from_dict(_doc(training={"micro_batch_size": 2}, parallel={"dp": 4}))
    assert scenario.training.global_batch_size == 8
    assert scenario.training.gradient_accumulation_steps == 1
    scenario = scenario_from_dict(_doc(training={"micro_batch_size": 2, "global_batch_size": 48}, parallel={"dp": 4}))
    assert scenario.training.gradient_accumulation_steps == 6


@pytest.mark.parametrize("text, value", [
    ("4", 4), ("0.0", 0.0), ("true", True), ('"x y"', "x y"), ("h100-sxm", "h100-sxm"),
    ("25 MB", "25 MB"), ("[1, 2]", [1, 2]), ("segments:4", "segments:4"), (" 7 ", 7), ("", ""),
    ("1\nx = 2", "1\nx = 2"),
])
def test_parse_override_value(text, value):
    assert parse_override_value(text) == value


def test_overrides_apply_in_order_and_parse_values():
    scenario = scenario_from_dict(_doc(), "x.toml", [
        "parallel.tp=4", "cluster.topology=h100-sxm", "model.dropout=0.0", "parallel.tp=2",
        "parallel.bucket_size=16 MiB", "run.full=true", "name=swept", "training.recompute=segments:2",
    ])
    assert scenario.parallel.tp == 2
    assert scenario.cluster.topology == "h100-sxm"
    assert scenario.model.dropout == 0.0
    assert scenario.parallel.bucket_size == 16 * 2**20
    assert scenario.run.full is True
    assert scenario.name == "swept"
    assert scenario.training.recompute_segments == 2


def test_override_changes_preset_value_and_creates_sections():
    scenario = scenario_from_dict({"model": {"preset": "gpt2"}}, overrides=["model.num_layers=2", "allocator.kind=exact"])
    assert scenario.model.num_layers == 2 and scenario.model.hidden_size == 768
    assert scenario.allocator.kind == "exact"


def test_apply_overrides_does_not_mutate_input():
    doc = _doc(parallel={"tp": 1})
    apply_overrides(doc, ["parallel.tp=2"])
    assert doc["parallel"]["tp"] == 1


@pytest.mark.parametrize("override, expected", [
    ("parallel.tp", "x.toml: --set 'parallel.tp': expected KEY=VALUE, e.g. parallel.tp=4"),
    ("parallel.tpp=4", "x.toml: --set 'parallel.tpp=4': unknown key path 'parallel.tpp'; did you mean 'parallel.tp'?"),
    ("paralel.tp=4", "x.toml: --set 'paralel.tp=4': unknown key path 'paralel.tp'; did you mean 'parallel.tp'?"),
    ("parallel=4", "x.toml: --set 'parallel=4': unknown key path 'parallel'; did you mean 'parallel.tp'?"),
    ("a.b.c=1", "x.toml: --set 'a.b.c=1': unknown key path 'a.b.c' (expected section.key, e.g. parallel.tp)"),
])
def test_bad_override_messages(override, expected):
    assert _error(_doc(), overrides=[override]) == expected


@pytest.mark.parametrize("sections, expected", [
    ({"model": {"hiden_size": 64}}, "x.toml: model.hiden_size = 64: unknown key in [model]; did you mean 'hidden_size'?"),
    ({"parallel": {"zero": 1}}, "x.toml: parallel.zero = 1: unknown key in [parallel]; did you mean 'zero_stage'?"),
    ({"parallel": {"qqqqq": 1}}, "x.toml: parallel.qqqqq = 1: unknown key in [parallel] (allowed: tp, pp, dp, "
     "sequence_parallel, schedule, virtual_stages, zero_stage, offload_optimizer, offload_params, "
     "offload_activations, gradient_compression, gradient_compression_stage, bucket_size, prefetch_bucket_size, "
     "placement, tp_comm_overlap, tp_backward_overlap, overlap_grad_reduce, overlap_param_gather, overlap_p2p_comm)"),
    ({"model": {"num_layers": "4"}}, "x.toml: model.num_layers = '4': must be a positive integer"),
    ({"model": {"num_layers": 0}}, "x.toml: model.num_layers = 0: must be a positive integer"),
    ({"model": {"num_layers": True}}, "x.toml: model.num_layers = True: must be a positive integer"),
    ({"model": {"hidden_size": 65}}, "x.toml: model.hidden_size = 65: must be divisible by model.num_attention_heads = 4"),
    ({"model": {"num_kv_heads": 3}}, "x.toml: model.num_kv_heads = 3: must divide model.num_attention_heads = 4"),
    ({"model": {"dropout": 1.0}}, "x.toml: model.dropout = 1.0: must be a number in [0, 1)"),
    ({"model": {"dropout": float("nan")}}, "x.toml: model.dropout = nan: must be a finite number"),
    ({"model": {"activation": "swiglue"}}, "x.toml: model.activation = 'swiglue': must be one of gelu, swiglu; did you mean 'swiglu'?"),
    ({"model": {"architecture": "gtp"}}, "x.toml: model.architecture = 'gtp': must be one of gpt, llama, bert, vit, resnet, dlrm; did you mean 'gpt'?"),
    ({"model": {"seq_length": 64, "max_position_embeddings": 32}},
     "x.toml: model.seq_length = 64: must be at most model.max_position_embeddings = 32 (gpt has learned positions)"),
    ({"model": {"rope_theta": 500000.0}},
     "x.toml: model.rope_theta = 500000.0: applies only to architecture 'llama' (model.architecture = 'gpt')"),
    ({"model": {"bias": "yes"}}, "x.toml: model.bias = 'yes': must be true or false"),
    ({"training": {"precision": "bf16mixed"}},
     "x.toml: training.precision = 'bf16mixed': must be one of fp32, fp16-mixed, bf16-mixed, bf16, fp8-mixed; did you mean 'bf16-mixed'?"),
    ({"training": {"recompute": "segments:0"}},
     'x.toml: training.recompute = \'segments:0\': must be none, selective, full or "segments:N" with N >= 1'),
    ({"training": {"recompute": "segments:\u00b2"}},
     'x.toml: training.recompute = \'segments:\u00b2\': must be none, selective, full or "segments:N" with N >= 1'),
    ({"training": {"loss_scale": -1}}, 'x.toml: training.loss_scale = -1: must be "dynamic" or a number > 0'),
    ({"training": {"micro_batch_size": 2, "global_batch_size": 6}, "parallel": {"dp": 2}},
     "x.toml: training.global_batch_size = 6: must be a multiple of training.micro_batch_size * parallel.dp = 2 * 2 = 4"),
    ({"parallel": {"tp": 3}}, "x.toml: parallel.tp = 3: must divide model.num_attention_heads = 4"),
    ({"model": {"num_kv_heads": 2}, "parallel": {"tp": 4}}, "x.toml: parallel.tp = 4: must divide model.num_kv_heads = 2"),
    ({"parallel": {"pp": 5}}, "x.toml: parallel.pp = 5: must be at most model.num_layers = 4"),
    ({"parallel": {"pp": 2, "virtual_stages": 3}},
     "x.toml: parallel.virtual_stages = 3: must divide model.num_layers / parallel.pp = 4 / 2"),
    ({"parallel": {"zero_stage": 4}}, "x.toml: parallel.zero_stage = 4: must be an integer from 0 to 3"),
    ({"parallel": {"offload_optimizer": "gpu"}},
     "x.toml: parallel.offload_optimizer = 'gpu': must be one of none, cpu, nvme; did you mean 'cpu'?"),
    ({"parallel": {"gradient_compression": "topk:1.5"}},
     'x.toml: parallel.gradient_compression = \'topk:1.5\': must be none, 1bit, int8, "topk:F" with 0 < F < 1 '
     'or "powersgd:R" with R >= 1'),
    ({"parallel": {"gradient_compression": "powersgd:0"}},
     'x.toml: parallel.gradient_compression = \'powersgd:0\': must be none, 1bit, int8, "topk:F" with 0 < F < 1 '
     'or "powersgd:R" with R >= 1'),
    ({"parallel": {"schedule": "zbh1"}},
     "x.toml: parallel.schedule = 'zbh1': must be one of gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2 or a path "
     "to an action file; did you mean 'zb-h1'?"),
    ({"parallel": {"bucket_size": "25 MBs"}},
     "x.toml: parallel.bucket_size = '25 MBs': must be a size: bytes as a number or a string like '25 MB' "
     "('25 MBs': unknown size unit 'MBs' (allowed: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB))"),
    ({"cluster": {"nodes": 0}}, "x.toml: cluster.nodes = 0: must be a positive integer"),
    ({"allocator": {"kind": "cached"}},
     "x.toml: allocator.kind = 'cached': must be one of caching, exact, auto; did you mean 'caching'?"),
    ({"allocator": {"max_split_size": "20 MB"}},
     'x.toml: allocator.max_split_size = \'20 MB\': must be "unlimited" or a size >= 20 MiB (20971520 bytes)'),
    ({"allocator": {"roundup_power2_divisions": 3}},
     'x.toml: allocator.roundup_power2_divisions = 3: must be "none" or a power of two from 1 to 16'),
    ({"allocator": {"context_bytes": "lots"}},
     'x.toml: allocator.context_bytes = \'lots\': must be "auto" or a size >= 0 (bytes or a string like "500 MiB")'),
    ({"run": {"warmup_iterations": -1}}, "x.toml: run.warmup_iterations = -1: must be an integer >= 0"),
    ({"run": {"iterations": 1.0}}, "x.toml: run.iterations = 1.0: must be a positive integer"),
])
def test_error_messages(sections, expected):
    assert _error(_doc(**sections)) == expected


@pytest.mark.parametrize("doc, expected", [
    ({"model": {"preset": "lama-7b"}}, "x.toml: model.preset = 'lama-7b': unknown preset; did you mean 'llama-7b'? (presets: "),
    ({"model": {"preset": "gpt2", "hf_config": "c.json"}},
     "x.toml: model.hf_config = 'c.json': give model.preset or model.hf_config, not both"),
    ({"model": {"num_layers": 2}}, "x.toml: model.architecture is missing: one of gpt, llama, bert, vit, resnet, dlrm is required"),
    ({"model": {"architecture": "gpt", "num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "seq_length": 8}},
     "x.toml: model.vocab_size is missing: a positive integer is required"),
    ({"training": {}}, "x.toml: [model] is missing: give model.preset, model.hf_config or the model's fields"),
    ({"model": 3}, "x.toml: model = 3: must be a table ([model])"),
    ({"model": dict(TINY), "modle": {}}, "x.toml: modle = {}: unknown key at the top level; did you mean 'model'?"),
    ({"model": dict(TINY), "name": ""}, "x.toml: name = '': must be a non-empty string"),
    ({"model": dict(TINY), 3: 4}, "x.toml: 3 = 4: keys must be strings"),
    ({"model": {"architecture": "vit", "num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "seq_length": 8}},
     "x.toml: model.seq_length = 8: vit derives it as (image_size / patch_size)^2 + 1 = 197; remove the key or match it"),
    ({"model": {"architecture": "vit", "num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 8}},
     "x.toml: model.vocab_size = 8: vit has no token vocabulary; remove the key"),
    ({"model": {"architecture": "vit", "num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "image_size": 30}},
     "x.toml: model.image_size = 30: must be divisible by model.patch_size = 16"),
    ({"model": {"preset": "gpt2", "num_attention_heads": 5}},
     "x.toml: model.hidden_size = 768: must be divisible by model.num_attention_heads = 5 (from preset 'gpt2')"),
])
def test_model_error_messages(doc, expected):
    assert _error(doc).startswith(expected)


def test_malformed_toml_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\npreset = \n")
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    message = str(info.value)
    assert message.startswith(f"{path}: invalid TOML: ") and "line 2" in message and "\n" not in message


def test_unreadable_and_non_utf8_files(tmp_path):
    missing = tmp_path / "missing.toml"
    with pytest.raises(ScenarioError, match=r"missing\.toml: cannot read scenario file: No such file or directory"):
        load_scenario(missing)
    with pytest.raises(ScenarioError, match="cannot read scenario file"):
        load_scenario(tmp_path)
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"name = '\xff'\n")
    with pytest.raises(ScenarioError, match=r"binary\.toml: scenario file is not UTF-8 text"):
        load_scenario(binary)


def test_relative_paths_resolve_against_the_scenario_folder(tmp_path):
    folder = tmp_path / "scenarios"
    (folder / "cfg").mkdir(parents=True)
    (folder / "cfg" / "config.json").write_text((REPO / "tests/data/hf/gpt2/config.json").read_text())
    path = folder / "s.toml"
    path.write_text('[model]\nhf_config = "cfg/config.json"\n[parallel]\nschedule = "sched/my.txt"\n'
                    '[cluster]\ntopology = "../topo/mine.toml"\ncalibration = "fit.json"\n')
    scenario = load_scenario(path)
    assert scenario.model.hf_config == str(folder / "cfg" / "config.json")
    assert scenario.parallel.schedule == str(folder / "sched" / "my.txt") and scenario.parallel.schedule_is_file
    assert scenario.cluster.topology == str(tmp_path / "topo" / "mine.toml") and scenario.cluster.topology_is_path
    assert scenario.cluster.calibration == str(folder / "fit.json")
    assert scenario.name == "s"


def test_unit_strings_for_sizes():
    scenario = scenario_from_dict(_doc(parallel={"bucket_size": "16 MiB"},
                                       allocator={"max_split_size": "128 MiB", "context_bytes": "500 MB",
                                                  "roundup_power2_divisions": 4}))
    assert scenario.parallel.bucket_size == 16 * 2**20
    assert scenario.allocator.max_split_size_bytes == 128 * 2**20
    assert scenario.allocator.context_bytes == 500_000_000
    assert scenario.allocator.roundup_power2_divisions == 4
    unlimited = scenario_from_dict(_doc(allocator={"max_split_size": "unlimited", "context_bytes": "auto"}))
    assert unlimited.allocator.max_split_size is None and unlimited.allocator.context_bytes is None


def test_compression_and_recompute_are_normalised():
    scenario = scenario_from_dict(_doc(parallel={"gradient_compression": "topk: 0.01"},
                                       training={"recompute": "segments: 3"}))
    assert scenario.parallel.gradient_compression == "topk:0.01"
    assert scenario.parallel.gradient_compression_kind == "topk"
    assert scenario.parallel.gradient_compression_parameter == 0.01
    assert scenario.training.recompute == "segments:3" and scenario.training.recompute_segments == 3
    powersgd = scenario_from_dict(_doc(parallel={"gradient_compression": "powersgd:4"})).parallel
    assert (powersgd.gradient_compression_kind, powersgd.gradient_compression_parameter) == ("powersgd", 4)


def test_every_documented_key_can_be_overridden():
    for section, specs in SECTION_KEYS.items():
        for spec in specs:
            doc = apply_overrides({}, [f"{section}.{spec.key}=1"])
            assert doc == {section: {spec.key: 1}}


def test_values_are_frozen_and_loading_is_deterministic():
    first = scenario_from_dict(_doc(parallel={"dp": 2}))
    second = scenario_from_dict(_doc(parallel={"dp": 2}))
    assert first == second
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.model.num_layers = 3  # type: ignore[misc]
    assert isinstance(first.model, ModelConfig)


def test_scenario_error_is_a_memsim_error():
    with pytest.raises(MemsimError):
        scenario_from_dict("not a dict")  # type: ignore[arg-type]


def test_docs_reference_is_generated_from_the_schema():
    text = (REPO / "docs" / "scenario-reference.md").read_text()
    assert text == reference_markdown()
    for specs in SECTION_KEYS.values():
        for spec in specs:
            assert f"| `{spec.key}` |" in text
