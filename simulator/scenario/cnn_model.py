"""The [model] table of a ResNet (`model.architecture = "resnet"`): its keys, checks and the ModelConfig it resolves to."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from simulator.scenario.parsers import Invalid, int_at_least

RESNET_BLOCKS = ("bottleneck", "basic")
# The keys a ResNet reads; every transformer key written for one is refused (it would have no effect).
RESNET_KEYS = ("preset", "architecture", "resnet_blocks", "resnet_block", "image_size", "num_channels", "num_classes")
RESNET_DEFAULTS = {"resnet_block": "bottleneck", "image_size": 224, "num_channels": 3, "num_classes": 1000}
STEM = 32                  # the stem (stride 2) and max-pool (stride 2) and three strided stages: 2^5 in all

_POSITIVE = int_at_least(1)


def block_counts(value: object) -> tuple[int, ...]:
    """Parser for model.resnet_blocks: a non-empty array of positive integers (residual blocks per stage)."""
    if not isinstance(value, (list, tuple)) or not value or len(value) > 8:
        raise Invalid("must be an array of 1 to 8 positive integers (blocks per stage), e.g. [3, 4, 6, 3]")
    try:
        return tuple(_POSITIVE(n) for n in value)
    except Invalid:
        raise Invalid("must be an array of positive integers (blocks per stage), e.g. [3, 4, 6, 3]") from None


def resolve_resnet(values: dict[str, object], explicit: Mapping[str, object],
                   fail: Callable[[str, str], Exception]) -> dict[str, object]:
    """The ModelConfig fields of a ResNet from its [model] values (preset values overridden by explicit keys).

    The transformer fields are filled with what they mean here, so reports and the plan checks read them
    uniformly: num_layers = residual blocks, hidden_size = the pooled feature width, seq_length = 1 (a
    "token" is an image: tokens_per_s counts images), one "head", no vocabulary.

    Raises:
        whatever `fail(key, rule)` makes: a transformer key written for a ResNet, a missing block list.
    """
    for key in explicit:
        if key not in RESNET_KEYS:
            raise fail(key, "a transformer key; model.architecture = 'resnet' reads only "
                            + ", ".join(k for k in RESNET_KEYS if k != "architecture"))
    if "resnet_blocks" not in values:
        raise fail("resnet_blocks", "is required for a resnet (blocks per stage, e.g. [3, 4, 6, 3] for ResNet-50), "
                                    "or give model.preset = 'resnet50'")
    fields = {key: values[key] for key in RESNET_KEYS if key in values and key != "preset"}
    for key, default in RESNET_DEFAULTS.items():
        fields.setdefault(key, default)
    stages = len(fields["resnet_blocks"])
    if fields["image_size"] < STEM:
        raise fail("image_size", f"must be at least {STEM} pixels (the stem and max-pool divide it by 4, each later "
                                 f"stage by 2 more)")
    expansion = 4 if fields["resnet_block"] == "bottleneck" else 1
    features = 64 * 2 ** (stages - 1) * expansion
    fields.update(num_layers=sum(fields["resnet_blocks"]), hidden_size=features, num_attention_heads=1,
                  num_kv_heads=1, ffn_hidden_size=features, vocab_size=0, seq_length=1, max_position_embeddings=1,
                  activation="relu", norm="batchnorm", norm_eps=1e-5, bias=False, attention="none", dropout=0.0,
                  tied_embeddings=False, post_norm=False)
    if "preset" in values:
        fields["preset"] = values["preset"]
    return fields
