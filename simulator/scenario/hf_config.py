"""Import of Hugging Face `config.json` files (LLaMA, GPT-2, BERT, ViT) as ModelConfig field values."""

from __future__ import annotations

import json
import math
import os
from types import MappingProxyType
from typing import Callable, Mapping

from simulator.errors import ScenarioError
from simulator.scenario.schema import short_repr

# Defaults of the transformers configuration classes, used for keys a config.json leaves out
# (save_pretrained writes only values that differ from the class defaults). Sources:
# transformers/models/{llama,gpt2,bert,vit}/configuration_*.py (PretrainedConfig: tie_word_embeddings True).
_HF_DEFAULTS: Mapping[str, Mapping[str, object]] = MappingProxyType({
    "llama": MappingProxyType({
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }),
    "gpt2": MappingProxyType({
        "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
        "n_inner": None, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
        "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
    }),
    "bert": MappingProxyType({
        "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
        "intermediate_size": 3072, "hidden_dropout_prob": 0.1, "max_position_embeddings": 512,
        "type_vocab_size": 2, "layer_norm_eps": 1e-12, "tie_word_embeddings": True,
    }),
    "vit": MappingProxyType({
        "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
        "hidden_dropout_prob": 0.0, "layer_norm_eps": 1e-12, "image_size": 224, "patch_size": 16,
        "num_channels": 3,
    }),
})

# (HF key, ModelConfig field, kind) per model_type; kind is "int", "float" or "bool".
_FIELD_MAPS: Mapping[str, tuple[tuple[str, str, str], ...]] = MappingProxyType({
    "llama": (
        ("num_hidden_layers", "num_layers", "int"), ("hidden_size", "hidden_size", "int"),
        ("num_attention_heads", "num_attention_heads", "int"), ("num_key_value_heads", "num_kv_heads", "int"),
        ("intermediate_size", "ffn_hidden_size", "int"), ("vocab_size", "vocab_size", "int"),
        ("max_position_embeddings", "max_position_embeddings", "int"), ("rms_norm_eps", "norm_eps", "float"),
        ("rope_theta", "rope_theta", "float"), ("tie_word_embeddings", "tied_embeddings", "bool"),
    ),
    "gpt2": (
        ("n_layer", "num_layers", "int"), ("n_embd", "hidden_size", "int"),
        ("n_head", "num_attention_heads", "int"), ("n_inner", "ffn_hidden_size", "int"),
        ("vocab_size", "vocab_size", "int"), ("n_positions", "max_position_embeddings", "int"),
        ("resid_pdrop", "dropout", "float"), ("layer_norm_epsilon", "norm_eps", "float"),
        ("tie_word_embeddings", "tied_embeddings", "bool"),
    ),
    "bert": (
        ("num_hidden_layers", "num_layers", "int"), ("hidden_size", "hidden_size", "int"),
        ("num_attention_heads", "num_attention_heads", "int"), ("intermediate_size", "ffn_hidden_size", "int"),
        ("vocab_size", "vocab_size", "int"), ("max_position_embeddings", "max_position_embeddings", "int"),
        ("type_vocab_size", "type_vocab_size", "int"), ("hidden_dropout_prob", "dropout", "float"),
        ("layer_norm_eps", "norm_eps", "float"), ("tie_word_embeddings", "tied_embeddings", "bool"),
    ),
    "vit": (
        ("num_hidden_layers", "num_layers", "int"), ("hidden_size", "hidden_size", "int"),
        ("num_attention_heads", "num_attention_heads", "int"), ("intermediate_size", "ffn_hidden_size", "int"),
        ("image_size", "image_size", "int"), ("patch_size", "patch_size", "int"),
        ("num_channels", "num_channels", "int"), ("hidden_dropout_prob", "dropout", "float"),
        ("layer_norm_eps", "norm_eps", "float"),
    ),
})

_ARCHITECTURE = MappingProxyType({"llama": "llama", "gpt2": "gpt", "bert": "bert", "vit": "vit"})


def supported_model_types() -> tuple[str, ...]:
    """The Hugging Face `model_type` values memsim imports."""
    return tuple(sorted(_FIELD_MAPS))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_float(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return _is_int(value) and abs(value) < 2**1000  # a larger int overflows float()


def _checker(kind: str) -> Callable[[object], bool]:
    if kind == "int":
        return _is_int
    if kind == "float":
        return _is_float
    return lambda value: isinstance(value, bool)


_KIND_TEXT = MappingProxyType({"int": "an integer", "float": "a finite number", "bool": "true or false"})


def _resolve_path(path: str | os.PathLike) -> str:
    text = os.fspath(path)
    if os.path.isdir(text):
        return os.path.join(text, "config.json")
    return text


def read_hf_json(path: str | os.PathLike) -> dict:
    """Read and parse a config.json (or the config.json inside a directory) into a dict.

    Raises:
        ScenarioError: the file cannot be read, is not UTF-8 JSON, or is not a JSON object.
    """
    try:
        file = _resolve_path(path)
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{path!r}: not a path to a Hugging Face config.json: {exc}") from None
    try:
        with open(file, "rb") as handle:
            data = handle.read()
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ScenarioError(f"{file}: cannot read Hugging Face config: {reason}") from None
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{file}: Hugging Face config is not UTF-8 text: {exc}") from None
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise ScenarioError(f"{file}: malformed JSON in Hugging Face config: {' '.join(str(exc).split())}") from None
    if not isinstance(doc, dict):
        raise ScenarioError(f"{file}: Hugging Face config must be a JSON object, got {type(doc).__name__}")
    return doc


def model_config_from_hf(path: str | os.PathLike) -> dict[str, object]:
    """ModelConfig field values read from a Hugging Face config.json (LLaMA, GPT-2, BERT, ViT).

    Keys the file leaves out take the transformers class defaults. `seq_length` is not set here:
    the scenario loader defaults it to `max_position_embeddings`.

    Args:
        path: the config.json file, or a directory holding one.

    Returns:
        A new dict with `architecture` and the mapped ModelConfig fields.

    Raises:
        ScenarioError: unreadable file, malformed JSON, unsupported `model_type`, or a mapped key
            with a value of the wrong type (the message names the file and the key).
    """
    doc = read_hf_json(path)
    file = _resolve_path(path)
    model_type = doc.get("model_type")
    if not isinstance(model_type, str) or model_type not in _FIELD_MAPS:
        raise ScenarioError(f"{file}: model_type = {short_repr(model_type)}: unsupported "
                            f"(supported: {', '.join(supported_model_types())})")
    defaults = _HF_DEFAULTS[model_type]
    values: dict[str, object] = {"architecture": _ARCHITECTURE[model_type]}
    for hf_key, field, kind in _FIELD_MAPS[model_type]:
        value = doc.get(hf_key, defaults.get(hf_key))
        if value is None:
            continue  # n_inner / num_key_value_heads: None means the architecture default
        if not _checker(kind)(value):
            raise ScenarioError(f"{file}: {hf_key} = {short_repr(value)}: must be {_KIND_TEXT[kind]}")
        values[field] = float(value) if kind == "float" else value
    if model_type == "vit":
        values["num_classes"] = _vit_num_classes(doc, file)
    return values


def _vit_num_classes(doc: dict, file: str) -> int:
    """Classifier width of a ViT config: len(id2label), else num_labels, else 1000 (ImageNet)."""
    id2label = doc.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return len(id2label)
    num_labels = doc.get("num_labels")
    if num_labels is None:
        return 1000
    if isinstance(num_labels, bool) or not isinstance(num_labels, int):
        raise ScenarioError(f"{file}: num_labels = {short_repr(num_labels)}: must be an integer")
    return num_labels
