"""A scenario's model as the numbers the workload builders take (a Shape), below api and report."""

from __future__ import annotations

from simulator.scenario import Scenario
from simulator.workload.transformer import Shape


def model_shape(scenario: Scenario, padded: bool = True) -> Shape:
    """Reduce a scenario's ModelConfig to the numbers the builders need.

    With `padded`, the vocabulary is padded to a multiple of training.vocab_divisible_by x parallel.tp, as
    Megatron pads it (`_vocab_size_with_padding`): the embedding, the LM head and the logits hold the
    padded rows. Without, the shape is the model as published (its parameter count).
    """
    m = scenario.model
    multiple = scenario.training.vocab_divisible_by * scenario.parallel.tp if padded else 1
    return Shape(
        architecture=m.architecture, num_layers=m.num_layers, hidden=m.hidden_size,
        heads=m.num_attention_heads, kv_heads=m.num_kv_heads, ffn=m.ffn_hidden_size,
        vocab=-(-m.vocab_size // multiple) * multiple, seq=m.seq_length, positions=m.max_position_embeddings,
        activation=m.activation, norm=m.norm, bias=m.bias, attention=m.attention,
        dropout=m.dropout, tied=m.tied_embeddings, post_norm=m.post_norm,
        patch=m.patch_size or 16, channels=m.num_channels or 3, classes=m.num_classes or 1000,
        type_vocab=m.type_vocab_size or 2, shared_layers=m.share_layers, linformer_k=m.linformer_k or 0,
        mlp_sparsity=scenario.training.sparsity, resnet_blocks=m.resnet_blocks or (),
        resnet_bottleneck=m.resnet_block != "basic", image=m.image_size or 224, dlrm=_dlrm_shape(m))


def _dlrm_shape(m):
    """A DLRM's DLRMShape (None for other architectures)."""
    if m.architecture != "dlrm":
        return None
    from simulator.workload.dlrm import DLRMShape

    return DLRMShape(m.embedding_rows, m.embedding_dim, m.lookups_per_table, m.dense_features, m.bottom_mlp,
                     m.top_mlp, m.embedding_placement)
