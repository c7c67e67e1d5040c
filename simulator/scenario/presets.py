"""Named model presets (GPT-2, GPT-3, LLaMA-2, BERT, ViT, ResNet, DLRM) with the source of every number."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True)
class Preset:
    """One named model shape: ModelConfig field values and where they come from.

    Only structural values are listed; architecture-style defaults (activation, norm, bias,
    dropout, tied embeddings, post-norm) come from the architecture (see schema.ARCH_DEFAULTS).
    """

    name: str
    source: str
    values: tuple[tuple[str, object], ...]


def _gpt2(name: str, layers: int, hidden: int, heads: int, source: str) -> Preset:
    return Preset(name, source, (
        ("architecture", "gpt"), ("num_layers", layers), ("hidden_size", hidden),
        ("num_attention_heads", heads), ("vocab_size", 50257), ("seq_length", 1024),
        ("max_position_embeddings", 1024),
    ))


def _gpt3(name: str, layers: int, hidden: int, heads: int, source: str) -> Preset:
    return Preset(name, source, (
        ("architecture", "gpt"), ("num_layers", layers), ("hidden_size", hidden),
        ("num_attention_heads", heads), ("vocab_size", 50257), ("seq_length", 2048),
        ("max_position_embeddings", 2048),
    ))


def _llama2(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, source: str) -> Preset:
    return Preset(name, source, (
        ("architecture", "llama"), ("num_layers", layers), ("hidden_size", hidden),
        ("num_attention_heads", heads), ("num_kv_heads", kv_heads), ("ffn_hidden_size", ffn),
        ("vocab_size", 32000), ("seq_length", 4096), ("max_position_embeddings", 4096),
        ("norm_eps", 1e-5), ("rope_theta", 10000.0),
    ))


_GPT3 = "Brown et al. 2020, 'Language Models are Few-Shot Learners', Table 2.1 (n_ctx 2048, GPT-2 BPE vocab 50257)"

PRESETS: tuple[Preset, ...] = (
    # HF gpt2/config.json: n_layer 12, n_embd 768, n_head 12, n_positions 1024, vocab_size 50257.
    _gpt2("gpt2", 12, 768, 12, "Hugging Face gpt2/config.json"),
    # HF gpt2-medium/config.json: n_layer 24, n_embd 1024, n_head 16.
    _gpt2("gpt2-medium", 24, 1024, 16, "Hugging Face gpt2-medium/config.json"),
    # HF gpt2-large/config.json: n_layer 36, n_embd 1280, n_head 20.
    _gpt2("gpt2-large", 36, 1280, 20, "Hugging Face gpt2-large/config.json"),
    # HF gpt2-xl/config.json: n_layer 48, n_embd 1600, n_head 25.
    _gpt2("gpt2-xl", 48, 1600, 25, "Hugging Face gpt2-xl/config.json"),
    # GPT-3 Small: n_layers 12, d_model 768, n_heads 12, d_head 64.
    _gpt3("gpt3-125m", 12, 768, 12, _GPT3),
    # GPT-3 Medium: 24, 1024, 16, d_head 64.
    _gpt3("gpt3-350m", 24, 1024, 16, _GPT3),
    # GPT-3 Large: 24, 1536, 16, d_head 96.
    _gpt3("gpt3-760m", 24, 1536, 16, _GPT3),
    # GPT-3 XL: the table gives 24 layers, d_model 2048, n_heads 24, d_head 128, but 24 x 128 != 2048;
    # we keep d_model 2048 and d_head 128, hence 16 heads.
    _gpt3("gpt3-1.3b", 24, 2048, 16, _GPT3 + "; n_heads 24 x d_head 128 != d_model 2048: kept d_model, d_head 128 -> 16 heads"),
    # GPT-3 2.7B: 32, 2560, 32, d_head 80.
    _gpt3("gpt3-2.7b", 32, 2560, 32, _GPT3),
    # GPT-3 6.7B: 32, 4096, 32, d_head 128.
    _gpt3("gpt3-6.7b", 32, 4096, 32, _GPT3),
    # GPT-3 13B: the table gives d_model 5140 with 40 heads of 128 (= 5120); 5140 is divisible by
    # neither 40 nor 128, so we use 5120 = 40 x 128 (as Megatron-LM's GPT-3 13B recipe does).
    _gpt3("gpt3-13b", 40, 5120, 40, _GPT3 + "; d_model 5140 is not divisible by 40 heads: used 5120 = 40 x 128"),
    # GPT-3 175B: 96, 12288, 96, d_head 128.
    _gpt3("gpt3-175b", 96, 12288, 96, _GPT3),
    # HF meta-llama/Llama-2-7b-hf/config.json: 32 layers, 4096, 32 heads, intermediate 11008.
    _llama2("llama-7b", 32, 4096, 32, 32, 11008, "Hugging Face meta-llama/Llama-2-7b-hf/config.json"),
    # HF meta-llama/Llama-2-13b-hf/config.json: 40 layers, 5120, 40 heads, intermediate 13824.
    _llama2("llama-13b", 40, 5120, 40, 40, 13824, "Hugging Face meta-llama/Llama-2-13b-hf/config.json"),
    # HF meta-llama/Llama-2-70b-hf/config.json: 80 layers, 8192, 64 heads, 8 KV heads, intermediate 28672.
    _llama2("llama-70b", 80, 8192, 64, 8, 28672, "Hugging Face meta-llama/Llama-2-70b-hf/config.json"),
    # HF bert-large-uncased/config.json: 24 layers, 1024, 16 heads, intermediate 4096, vocab 30522,
    # max_position_embeddings 512, type_vocab_size 2.
    Preset("bert-large", "Hugging Face bert-large-uncased/config.json", (
        ("architecture", "bert"), ("num_layers", 24), ("hidden_size", 1024), ("num_attention_heads", 16),
        ("ffn_hidden_size", 4096), ("vocab_size", 30522), ("seq_length", 512),
        ("max_position_embeddings", 512), ("type_vocab_size", 2),
    )),
    # ViT-L/16: Dosovitskiy et al. 2021, Table 1 (ViT-Large: 24 layers, hidden 1024, MLP 4096, 16 heads),
    # patch 16 at 224 x 224 (HF google/vit-large-patch16-224/config.json), 1000 ImageNet classes.
    Preset("vit-large", "Dosovitskiy et al. 2021 Table 1 (ViT-Large) and HF google/vit-large-patch16-224", (
        ("architecture", "vit"), ("num_layers", 24), ("hidden_size", 1024), ("num_attention_heads", 16),
        ("ffn_hidden_size", 4096), ("image_size", 224), ("patch_size", 16), ("num_channels", 3),
        ("num_classes", 1000),
    )),
    # He et al. 2016, "Deep Residual Learning for Image Recognition", Table 1: blocks per stage (conv2_x..conv5_x)
    # 18: [2, 2, 2, 2] basic, 34: [3, 4, 6, 3] basic, 50: [3, 4, 6, 3], 101: [3, 4, 23, 3], 152: [3, 8, 36, 3]
    # bottleneck; 224 x 224 ImageNet input, 1000 classes (torchvision.models.resnet: the same layout, v1.5 stride).
    *(Preset(f"resnet{depth}", "He et al. 2016 Table 1; torchvision.models.resnet", (
        ("architecture", "resnet"), ("resnet_blocks", blocks), ("resnet_block", kind), ("image_size", 224),
        ("num_channels", 3), ("num_classes", 1000),
    )) for depth, blocks, kind in ((18, (2, 2, 2, 2), "basic"), (34, (3, 4, 6, 3), "basic"),
                                   (50, (3, 4, 6, 3), "bottleneck"), (101, (3, 4, 23, 3), "bottleneck"),
                                   (152, (3, 8, 36, 3), "bottleneck"))),
    # DLRM on Criteo 1TB as TorchRec's example trains it (pytorch/torchrec examples/dlrm/dlrm_main.py defaults for
    # Criteo 1TB: --num_embeddings_per_feature, --embedding_dim 128, --dense_arch_layer_sizes 512,256,128,
    # --over_arch_layer_sizes 1024,1024,512,256,1); 13 dense features, one index per categorical feature.
    Preset("dlrm-criteo-1tb", "pytorch/torchrec examples/dlrm/dlrm_main.py (Criteo 1TB defaults)", (
        ("architecture", "dlrm"),
        ("embedding_rows", (45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10,
                            2209, 11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35)),
        ("embedding_dim", 128), ("lookups_per_table", 1), ("dense_features", 13), ("bottom_mlp", (512, 256, 128)),
        ("top_mlp", (1024, 1024, 512, 256, 1)),
    )),
)

ALIASES: Mapping[str, str] = MappingProxyType({
    "gpt2-124m": "gpt2",
    "gpt2-355m": "gpt2-medium",
    "gpt2-774m": "gpt2-large",
    "gpt2-1.5b": "gpt2-xl",
    "gpt3-175b": "gpt3-175b",
    "resnet-50": "resnet50",
})

_BY_NAME: Mapping[str, Preset] = MappingProxyType({preset.name: preset for preset in PRESETS})


def list_presets(include_aliases: bool = False) -> tuple[str, ...]:
    """Names of the presets in definition order (with the aliases after them if asked)."""
    names = tuple(preset.name for preset in PRESETS)
    if include_aliases:
        names += tuple(alias for alias in ALIASES if alias not in _BY_NAME)
    return names


def canonical_preset_name(name: str) -> str | None:
    """The canonical preset name for a name or alias, or None when it is not a preset."""
    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    if key in _BY_NAME:
        return key
    return ALIASES.get(key)


def get_preset(name: str) -> Preset:
    """The preset called `name` (or an alias of it).

    Raises:
        KeyError: `name` is neither a preset nor an alias (the loader turns this into a ScenarioError).
    """
    canonical = canonical_preset_name(name)
    if canonical is None:
        raise KeyError(name)
    return _BY_NAME[canonical]


def preset_values(name: str) -> dict[str, object]:
    """A fresh dict of the ModelConfig field values of preset `name` (raises KeyError if unknown)."""
    return dict(get_preset(name).values)
