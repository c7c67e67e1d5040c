"""Model presets: every preset loads, its parameter count matches the published one, aliases resolve."""

from __future__ import annotations

import pytest

from simulator.errors import ScenarioError
from simulator.scenario import ModelConfig, get_preset, list_presets, preset_values, scenario_from_dict
from simulator.scenario.presets import ALIASES, PRESETS


def resnet_count(m: ModelConfig) -> int:
    """torchvision ResNet parameters in closed form: stem conv + bn, blocks (with downsample), fc."""
    bottleneck = m.resnet_block == "bottleneck"
    n, cin = 64 * m.num_channels * 49 + 2 * 64, 64
    for i, count in enumerate(m.resnet_blocks):
        w = 64 * 2**i
        cout = 4 * w if bottleneck else w
        for j in range(count):
            if bottleneck:
                n += cin * w + w * w * 9 + w * cout + 4 * w + 2 * cout
            else:
                n += cin * w * 9 + w * w * 9 + 4 * w
            if (i > 0 and j == 0) or cin != cout:
                n += cin * cout + 2 * cout
            cin = cout
    return n + cin * m.num_classes + m.num_classes


def dlrm_count(m: ModelConfig) -> int:
    """DLRM parameters in closed form: tables, bottom MLP, top MLP (input: d + T(T+1)/2 interactions)."""
    t = len(m.embedding_rows)
    widths = [(m.dense_features, *m.bottom_mlp), (m.embedding_dim + t * (t + 1) // 2, *m.top_mlp)]
    return sum(m.embedding_rows) * m.embedding_dim + sum(a * b + b for w in widths for a, b in zip(w, w[1:]))


def param_count(m: ModelConfig) -> int:
    """Trainable parameters of the HF-style model: GPT-2 LM / LLaMA CausalLM / BertModel (with pooler) /
    ViT-for-classification (timm layout: patch conv, cls token, positions, blocks, final norm, head)."""
    if m.architecture == "resnet":
        return resnet_count(m)
    if m.architecture == "dlrm":
        return dlrm_count(m)
    h, f, layers, vocab = m.hidden_size, m.ffn_hidden_size, m.num_layers, m.vocab_size
    kv = m.num_kv_heads * m.head_dim
    norm = 2 * h if m.norm == "layernorm" else h
    attention = 2 * h * h + 2 * h * kv + ((2 * h + 2 * kv) if m.bias else 0)
    if m.activation == "swiglu":
        mlp = 3 * h * f + ((2 * f + h) if m.bias else 0)
    else:
        mlp = 2 * h * f + ((f + h) if m.bias else 0)
    blocks = layers * (attention + mlp + 2 * norm)
    if m.architecture == "vit":
        embeddings = m.num_channels * m.patch_size**2 * h + h + h + m.seq_length * h
        return embeddings + blocks + norm + h * m.num_classes + m.num_classes
    embeddings = vocab * h
    if m.architecture in ("gpt", "bert"):
        embeddings += m.max_position_embeddings * h
    if m.architecture == "bert":
        embeddings += m.type_vocab_size * h + norm
        return embeddings + blocks + h * h + h
    head = 0 if m.tied_embeddings else vocab * h
    return embeddings + blocks + norm + head


def _model(name: str) -> ModelConfig:
    return scenario_from_dict({"model": {"preset": name}}).model


# Published counts: HF model.num_parameters() for GPT-2 / LLaMA-2 / bert-large-uncased (BertModel),
# timm vit_large_patch16_224 for ViT-L/16.
EXACT = {
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200,
    "llama-7b": 6_738_415_616, "llama-13b": 13_015_864_320, "llama-70b": 68_976_648_192,
    "bert-large": 335_141_888, "vit-large": 304_326_632,
    # torchvision.models.resnetN(): sum(p.numel() for p in model.parameters()) (its model docs list the same).
    "resnet18": 11_689_512, "resnet34": 21_797_672, "resnet50": 25_557_032, "resnet101": 44_549_160,
    "resnet152": 60_192_808,
    # TorchRec's DLRM for Criteo 1TB: 177,944,275 rows x 128 plus the MLPs.
    "dlrm-criteo-1tb": 22_779_236_097,
}

# Brown et al. 2020 Table 2.1 nominal sizes; our count (tied embeddings, learned positions) is within 2%.
GPT3_NOMINAL = {
    "gpt3-125m": 125e6, "gpt3-350m": 350e6, "gpt3-760m": 760e6, "gpt3-1.3b": 1.3e9, "gpt3-2.7b": 2.7e9,
    "gpt3-6.7b": 6.7e9, "gpt3-13b": 13e9, "gpt3-175b": 175e9,
}
GPT3_EXACT = {
    "gpt3-125m": 125_226_240, "gpt3-350m": 355_871_744, "gpt3-760m": 760_300_032, "gpt3-1.3b": 1_315_723_264,
    "gpt3-2.7b": 2_651_553_280, "gpt3-6.7b": 6_658_404_352, "gpt3-13b": 12_853_386_240,
    "gpt3-175b": 174_604_259_328,
}


def test_every_preset_is_covered_by_a_count():
    assert set(list_presets()) == set(EXACT) | set(GPT3_NOMINAL)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_published_parameter_counts(name):
    assert param_count(_model(name)) == EXACT[name]


@pytest.mark.parametrize("name", sorted(GPT3_NOMINAL))
def test_gpt3_parameter_counts(name):
    count = param_count(_model(name))
    assert count == GPT3_EXACT[name]
    assert abs(count - GPT3_NOMINAL[name]) / GPT3_NOMINAL[name] < 0.02


def test_gpt3_heads_where_the_paper_is_inconsistent():
    xl = _model("gpt3-1.3b")
    assert (xl.hidden_size, xl.num_attention_heads, xl.head_dim) == (2048, 16, 128)
    thirteen = _model("gpt3-13b")
    assert (thirteen.hidden_size, thirteen.num_attention_heads, thirteen.head_dim) == (5120, 40, 128)
    assert "5140" in get_preset("gpt3-13b").source and "24" in get_preset("gpt3-1.3b").source
    assert _model("gpt3-175b").seq_length == 2048


def test_llama_70b_uses_grouped_query_attention():
    model = _model("llama-70b")
    assert (model.num_kv_heads, model.ffn_hidden_size, model.vocab_size, model.seq_length) == (8, 28672, 32000, 4096)
    assert (model.activation, model.norm, model.bias, model.tied_embeddings) == ("swiglu", "rmsnorm", False, False)


def test_vit_large_derives_its_sequence():
    model = _model("vit-large")
    assert (model.seq_length, model.image_size, model.patch_size, model.num_classes) == (197, 224, 16, 1000)


@pytest.mark.parametrize("alias, target", sorted(ALIASES.items()))
def test_aliases_resolve(alias, target):
    model = _model(alias)
    assert model.preset == target
    assert model == _model(target)


def test_preset_names_are_case_and_space_tolerant():
    assert _model(" GPT2 ").preset == "gpt2"


def test_list_presets_and_sources():
    names = list_presets()
    assert names[0] == "gpt2" and len(names) == len(set(names)) == len(PRESETS) == 23
    assert set(list_presets(include_aliases=True)) == set(names) | set(ALIASES)
    for preset in PRESETS:
        assert preset.source and dict(preset.values)["architecture"] in ("gpt", "llama", "bert", "vit", "resnet", "dlrm")


def test_preset_values_is_a_fresh_copy():
    values = preset_values("gpt2")
    values["num_layers"] = 1
    assert preset_values("gpt2")["num_layers"] == 12
    with pytest.raises(KeyError):
        preset_values("gpt5")


def test_explicit_keys_override_a_preset():
    model = scenario_from_dict({"model": {"preset": "llama-7b", "num_layers": 2, "seq_length": 512,
                                          "attention": "eager", "dropout": 0.1}}).model
    assert (model.num_layers, model.seq_length, model.max_position_embeddings, model.hidden_size) == (2, 512, 4096, 4096)
    assert (model.attention, model.dropout) == ("eager", 0.1)


def test_changing_architecture_drops_preset_only_keys():
    model = scenario_from_dict({"model": {"preset": "llama-7b", "architecture": "gpt"}}).model
    assert model.rope_theta is None and model.activation == "gelu" and model.tied_embeddings is True
    vit = scenario_from_dict({"model": {"preset": "gpt2", "architecture": "vit"}}).model
    assert (vit.vocab_size, vit.seq_length) == (0, 197)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict({"model": {"preset": "gpt3-1.3"}}, "s.toml")
    message = str(info.value)
    assert message.startswith("s.toml: model.preset = 'gpt3-1.3': unknown preset; did you mean 'gpt3-1.3b'?")
    assert all(name in message for name in list_presets(include_aliases=True))
