"""Hugging Face config.json import: field mapping per model_type, defaults, paths and errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from simulator.errors import MemsimError, ScenarioError
from simulator.scenario import model_config_from_hf, scenario_from_dict

HF = Path(__file__).resolve().parent / "data" / "hf"


def _strip(model):
    return dataclasses.replace(model, preset=None, hf_config=None)


def _from_hf(path) -> object:
    return scenario_from_dict({"model": {"hf_config": str(path)}}).model


def test_llama_mapping():
    values = model_config_from_hf(HF / "llama-2-7b" / "config.json")
    assert values == {
        "architecture": "llama", "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "num_kv_heads": 32, "ffn_hidden_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096,
        "norm_eps": 1e-5, "rope_theta": 10000.0, "tied_embeddings": False,
    }


def test_gpt2_mapping_with_null_n_inner_and_resid_dropout():
    values = model_config_from_hf(HF / "gpt2" / "config.json")
    assert values == {
        "architecture": "gpt", "num_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
        "vocab_size": 50257, "max_position_embeddings": 1024, "dropout": 0.1, "norm_eps": 1e-5,
        "tied_embeddings": True,
    }
    assert _from_hf(HF / "gpt2" / "config.json").ffn_hidden_size == 4 * 768


def test_bert_and_vit_mapping():
    bert = model_config_from_hf(HF / "bert-large-uncased")  # a folder holding config.json
    assert bert == {
        "architecture": "bert", "num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16,
        "ffn_hidden_size": 4096, "vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2,
        "dropout": 0.1, "norm_eps": 1e-12, "tied_embeddings": True,
    }
    vit = model_config_from_hf(HF / "vit-base-patch16-224-in21k" / "config.json")
    assert vit == {
        "architecture": "vit", "num_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
        "ffn_hidden_size": 3072, "image_size": 224, "patch_size": 16, "num_channels": 3, "dropout": 0.0,
        "norm_eps": 1e-12, "num_classes": 1000,
    }


@pytest.mark.parametrize("folder, preset", [
    ("llama-2-7b", "llama-7b"), ("gpt2", "gpt2"), ("bert-large-uncased", "bert-large"),
])
def test_hf_files_resolve_like_the_presets(folder, preset):
    from_hf = _from_hf(HF / folder / "config.json")
    from_preset = scenario_from_dict({"model": {"preset": preset}}).model
    assert _strip(from_hf) == _strip(from_preset)
    assert from_hf.hf_config == str(HF / folder / "config.json")


def test_vit_from_hf_resolves():
    model = _from_hf(HF / "vit-base-patch16-224-in21k")
    assert (model.seq_length, model.vocab_size, model.num_classes, model.ffn_hidden_size) == (197, 0, 1000, 3072)


def _write(tmp_path, doc, name="config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path


def test_missing_keys_take_transformers_defaults_and_gqa(tmp_path):
    path = _write(tmp_path, {"model_type": "llama", "num_key_value_heads": 8, "num_attention_heads": 64,
                             "hidden_size": 8192})
    values = model_config_from_hf(path)
    assert (values["num_kv_heads"], values["num_layers"], values["ffn_hidden_size"], values["norm_eps"],
            values["max_position_embeddings"]) == (8, 32, 11008, 1e-6, 2048)
    model = _from_hf(path)
    assert (model.num_kv_heads, model.seq_length) == (8, 2048)


def test_vit_classes_from_id2label(tmp_path):
    path = _write(tmp_path, {"model_type": "vit", "id2label": {str(i): f"c{i}" for i in range(10)}})
    assert model_config_from_hf(path)["num_classes"] == 10


def test_relative_hf_path_and_explicit_override(tmp_path):
    (tmp_path / "hf").mkdir()
    _write(tmp_path / "hf", {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4})
    scenario_file = tmp_path / "s.toml"
    model = scenario_from_dict({"model": {"hf_config": "hf/config.json", "seq_length": 128, "dropout": 0.0}},
                               source=str(scenario_file)).model
    assert (model.num_layers, model.hidden_size, model.seq_length, model.max_position_embeddings,
            model.dropout) == (2, 64, 128, 1024, 0.0)
    assert model.hf_config == str(tmp_path / "hf" / "config.json")


@pytest.mark.parametrize("content, expected", [
    ("{not json", "malformed JSON in Hugging Face config: Expecting property name enclosed in double quotes"),
    ("[1, 2]", "Hugging Face config must be a JSON object, got list"),
    ({"model_type": "gptj"}, "model_type = 'gptj': unsupported (supported: bert, gpt2, llama, vit)"),
    ({"n_layer": 2}, "model_type = None: unsupported (supported: bert, gpt2, llama, vit)"),
    ({"model_type": "gpt2", "n_layer": "12"}, "n_layer = '12': must be an integer"),
    ({"model_type": "gpt2", "n_layer": 12.0}, "n_layer = 12.0: must be an integer"),
    ({"model_type": "llama", "rope_theta": "1e4"}, "rope_theta = '1e4': must be a finite number"),
    ({"model_type": "llama", "tie_word_embeddings": 0}, "tie_word_embeddings = 0: must be true or false"),
    ('{"model_type": "bert", "layer_norm_eps": NaN}', "layer_norm_eps = nan: must be a finite number"),
])
def test_file_errors_name_the_file(tmp_path, content, expected):
    path = _write(tmp_path, content)
    with pytest.raises(ScenarioError) as info:
        model_config_from_hf(path)
    assert str(info.value).startswith(f"{path}: {expected}")
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict({"model": {"hf_config": str(path)}}, "s.toml")
    message = str(info.value)
    assert message.startswith(f"s.toml: model.hf_config = {str(path)!r}: {path}: ") and "\n" not in message


def test_unreadable_file(tmp_path):
    missing = tmp_path / "nope" / "config.json"
    with pytest.raises(ScenarioError, match=r"config\.json: cannot read Hugging Face config: No such file"):
        model_config_from_hf(missing)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(ScenarioError, match=r"binary\.json: Hugging Face config is not UTF-8 text"):
        model_config_from_hf(binary)


def test_out_of_range_hf_values_say_where_they_came_from(tmp_path):
    path = _write(tmp_path, {"model_type": "gpt2", "n_head": 0})
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict({"model": {"hf_config": str(path)}}, "s.toml")
    assert str(info.value) == f"s.toml: model.num_attention_heads = 0: must be a positive integer (from hf_config {str(path)!r})"


_HF_KEYS = ["model_type", "n_layer", "n_embd", "n_head", "n_inner", "n_positions", "resid_pdrop",
            "layer_norm_epsilon", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
            "tie_word_embeddings", "type_vocab_size", "hidden_dropout_prob", "layer_norm_eps", "image_size",
            "patch_size", "num_channels", "id2label", "num_labels"]
_JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5000), st.integers(),
                          st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(["llama", "gpt2", "bert", "vit"]),
                          st.text(max_size=5))
_JSON = _JSON_SCALARS | st.lists(st.integers(0, 3), max_size=2) | st.dictionaries(st.sampled_from(["0", "1"]), st.text(max_size=2), max_size=2)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(_HF_KEYS) | st.text(max_size=6), _JSON, max_size=10))
def test_random_hf_files_only_raise_memsim_errors(tmp_path_factory, doc):
    path = tmp_path_factory.getbasetemp() / "fuzz-config.json"
    path.write_text(json.dumps(doc))
    try:
        scenario_from_dict({"model": {"hf_config": str(path)}}, "s.toml")
    except MemsimError as exc:
        assert "\n" not in str(exc)
