"""Closed-form estimates from the literature, and measurements of the op-level model to check them against."""

from __future__ import annotations

from simulator.workload.graph import ACTIVATIONS, FORWARD


def korthikanti_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                                 recompute: str = "none") -> float:
    """Activation bytes per transformer layer (Korthikanti et al. 2022, Table 2), 16-bit GPT block.

    Args:
        s: sequence length; b: micro-batch size; h: hidden size; a: attention heads;
        t: tensor-parallel size; sequence_parallel: Megatron sequence parallelism;
        recompute: "none", "selective" (attention core) or "full".
    """
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh
    if recompute == "selective":
        return 34.0 * sbh / t if sequence_parallel else sbh * (10 + 24 / t)
    if sequence_parallel:
        return sbh * (34 + 5 * a * s / h) / t
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def narayanan_model_flops(batch: int, s: int, layers: int, h: int, vocab: int) -> float:
    """FLOPs of one iteration of a GPT model as Narayanan et al. 2021 count them (eq. 3).

    Their factor 96 includes the forward recomputation of full activation checkpointing (four
    passes over the layers, three over the logits); without recompute the layer term is 72/96 of it.
    """
    return 96.0 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def gpt_parameters(layers: int, h: int, vocab: int, s: int) -> float:
    """Parameter count of a GPT model (Narayanan et al. 2021's closed form)."""
    return 12.0 * layers * h * h * (1 + 13 / (12 * h) + (vocab + s) / (12 * layers * h))


def saved_activation_bytes_by_layer(ops, tensors) -> dict[int, int]:
    """Bytes of activations each layer still holds when the forward pass ends (what backward needs).

    Replays the allocs and frees of a micro-batch's forward ops and attributes every tensor still
    live at the end of forward to the layer of the op that allocated it.
    """
    live: dict[int, int] = {}
    for op in ops:
        if op.phase != FORWARD:
            break
        for tid in op.allocs:
            if tensors[tid].category == ACTIVATIONS:
                live[tid] = op.layer
        for tid in op.frees:
            live.pop(tid, None)
    result: dict[int, int] = {}
    for tid, layer in live.items():
        result[layer] = result.get(layer, 0) + tensors[tid].nbytes
    return result
