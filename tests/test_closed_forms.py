"""Published closed forms (Korthikanti 2022, Narayanan 2021) against memsim's op-level model."""

from __future__ import annotations

import pytest

from simulator.analytic import (
    gpt_parameters, korthikanti_activation_bytes, narayanan_model_flops, saved_activation_bytes_by_layer,
)
from simulator.api import build_workload, simulate
from simulator.report.metrics import MODEL_PHASES
from simulator.scenario import scenario_from_dict
from simulator.topology import resolve_cluster
from simulator.workload.graph import GEMM

# (s, b, h, a): GPT-3-like and a smaller shape with b > 1.
SHAPES = [(2048, 1, 4096, 32), (1024, 2, 2048, 16)]
LAYERS = 3
MIDDLE = 1          # a layer whose input and output are both produced by other blocks
VOCAB = 1000


def _document(s: int, b: int, h: int, a: int, *, architecture: str = "gpt", attention: str = "eager",
              recompute: str = "none", dropout: float = 0.1, layers: int = LAYERS, vocab: int = VOCAB,
              kv_heads: int | None = None) -> dict:
    model = {"architecture": architecture, "num_layers": layers, "hidden_size": h, "num_attention_heads": a,
             "vocab_size": vocab, "seq_length": s, "attention": attention, "dropout": dropout}
    if kv_heads is not None:
        model["num_kv_heads"] = kv_heads
    # A GPU profile: dropout masks are 1-byte bools, flash attention supports dropout.
    return {"name": "closed-form", "model": model,
            "training": {"micro_batch_size": b, "precision": "bf16", "recompute": recompute},
            "cluster": {"topology": "h100-sxm"}, "run": {"warmup_iterations": 0}}


def _workload(doc: dict):
    scenario = scenario_from_dict(doc)
    return scenario, build_workload(scenario, resolve_cluster(scenario).device)


def _layer_bytes(doc: dict) -> int:
    _, workload = _workload(doc)
    by_layer = saved_activation_bytes_by_layer(workload.first_microbatch, workload.tensors)
    # Every block of a homogeneous stack holds the same bytes.
    assert len({by_layer[i] for i in range(LAYERS)}) == 1, by_layer
    return by_layer[MIDDLE]


def _layer_norm_stats_bytes(s: int, b: int) -> int:
    """Two LayerNorms per block each keep fp32 mean and rstd of shape (b, s, 1): 16bs bytes."""
    return 2 * 2 * 4 * b * s


# ------------------------------------------------------------------------------- Korthikanti Table 2
@pytest.mark.parametrize("s,b,h,a", SHAPES)
def test_gpt_block_without_recompute_is_korthikanti_34_plus_5as_over_h(s, b, h, a):
    got = _layer_bytes(_document(s, b, h, a))
    expected = korthikanti_activation_bytes(s, b, h, a)
    assert expected == s * b * h * (34 + 5 * a * s / h)
    assert got == pytest.approx(expected, rel=0.01)
    # The exact remainder: what the paper leaves out. LayerNorm statistics (16bs), the bool copy
    # `~mask` of the (1, 1, s, s) causal mask that masked_fill keeps (s^2), and the 0-d bf16 divisor
    # of `scores / sqrt(d)` (2 bytes).
    assert got - expected == _layer_norm_stats_bytes(s, b) + s * s + 2


@pytest.mark.parametrize("s,b,h,a", SHAPES)
def test_gpt_block_selective_recompute_is_korthikanti_34(s, b, h, a):
    got = _layer_bytes(_document(s, b, h, a, recompute="selective"))
    expected = korthikanti_activation_bytes(s, b, h, a, recompute="selective")
    assert expected == 34 * s * b * h
    assert got == pytest.approx(expected, rel=0.01)
    # The checkpointed core keeps its inputs q, k, v (one qkv buffer, 6sbh, the paper's QK + V);
    # everything else of the core (scores, softmax, mask, dropout) is dropped.
    assert got - expected == _layer_norm_stats_bytes(s, b)


@pytest.mark.parametrize("s,b,h,a", SHAPES)
def test_gpt_block_full_recompute_keeps_only_the_block_input(s, b, h, a):
    got = _layer_bytes(_document(s, b, h, a, recompute="full"))
    assert got == korthikanti_activation_bytes(s, b, h, a, recompute="full") == 2 * s * b * h


@pytest.mark.parametrize("s,b,h,a", SHAPES)
def test_gpt_block_with_flash_attention(s, b, h, a):
    """Flash attention saves q, k, v, its output and the fp32 logsumexp instead of the s x s tensors.

    Attention: LN input 2 + QKV-linear input 2 + q, k, v (views of one qkv buffer) 6 + output 2
    (also the projection's input) + dropout mask 1 = 13sbh, plus logsumexp (b, a, s) fp32 = 4abs and,
    on a GPU, the RNG seed and offset (two int64 scalars, 16 bytes; measured with cuDNN attention).
    LN2 input 2sbh, MLP 19sbh (as in the paper), LayerNorm statistics 16bs.
    """
    sbh = s * b * h
    attention = (2 + 2 + 6 + 2 + 1) * sbh + 4 * a * b * s + 16
    mlp = (2 + 8 + 8 + 1) * sbh                    # fc1 input, gelu input, fc2 input, dropout mask
    expected = attention + 2 * sbh + mlp + _layer_norm_stats_bytes(s, b)
    assert expected == 34 * sbh + 4 * a * b * s + 16 + _layer_norm_stats_bytes(s, b)
    assert _layer_bytes(_document(s, b, h, a, attention="flash")) == expected


def _llama_block_bytes(s: int, b: int, h: int, a: int, f: int, attention: str) -> int:
    """A LLaMA block (RMSNorm, RoPE, GQA, SwiGLU, no dropout) in pure bf16, derived term by term.

    RMSNorm (HF): keeps the fp32 input copy (4sbh, saved by pow and mul), rsqrt's (b, s, 1) fp32
    output (4bs) and the bf16 normalised value that multiplies the weight (2sbh): 6sbh + 4bs, twice.
    q/k/v projections share their input (2sbh). RoPE saves only its cos/sin tables (buffers).
    Flash: q (2sbh) and the repeated k, v (2sbh each) + output (2sbh, also o_proj's input) +
    logsumexp 4abs + the RNG seed and offset (16 bytes). Eager: contiguous q, k copies (4sbh), fp32 softmax output (4as^2b) and its bf16
    cast (2as^2b), the `~mask` bool (s^2), the 0-d divisor (2), contiguous v (2sbh) and the merged
    heads (2sbh). SwiGLU MLP: input 2sbh, gate (silu input), silu output, up (all saved by mul and
    silu) and the product (down_proj input): 4 x 2sbf.
    """
    sbh = s * b * h
    norms = 2 * (6 * sbh + 4 * b * s)
    if attention == "flash":
        core = 4 * 2 * sbh + 4 * a * b * s + 16
    else:
        core = 4 * sbh + 6 * a * s * s * b + s * s + 2 + 2 * sbh + 2 * sbh
    mlp = 2 * sbh + 4 * 2 * s * b * f
    return norms + 2 * sbh + core + mlp


@pytest.mark.parametrize("attention", ["flash", "eager"])
@pytest.mark.parametrize("s,b,h,a,kv", [(2048, 1, 4096, 32, 8), (1024, 2, 2048, 16, 16)])
def test_llama_block_with_swiglu_and_gqa(s, b, h, a, kv, attention):
    doc = _document(s, b, h, a, architecture="llama", attention=attention, dropout=0.0, kv_heads=kv)
    scenario, _ = _workload(doc)
    f = scenario.model.ffn_hidden_size
    assert f == 256 * -(-(8 * h // 3) // 256)
    assert _layer_bytes(doc) == _llama_block_bytes(s, b, h, a, f, attention)


def test_flash_attention_saves_less_than_eager_by_the_score_matrices():
    s, b, h, a = SHAPES[0]
    eager = _layer_bytes(_document(s, b, h, a))
    flash = _layer_bytes(_document(s, b, h, a, attention="flash"))
    assert eager - flash == 5 * a * s * s * b + s * s + 2 - 4 * a * b * s - 16


# ------------------------------------------------------------------------------- FLOPs and parameters
def _recompute_pass_flops(B: int, s: int, L: int, h: int) -> float:
    """The extra forward pass over the transformer layers that Narayanan et al.'s 96 includes."""
    return 24.0 * B * s * L * h * h * (1 + s / (6 * h))


FLOP_SHAPES = [(1024, 2, 1024, 16, 4, 50257), (2048, 1, 2048, 16, 2, 50257)]


@pytest.mark.parametrize("s,b,h,a,L,V", FLOP_SHAPES)
def test_gemm_flops_are_narayanan_without_the_recompute_pass(s, b, h, a, L, V):
    """Narayanan et al. (2021) count 4 passes over the layers (forward, backward = 2x, and the
    activation-recompute forward) and 3 over the logit layer: 96BsLh^2(1 + s/6h) + 6BshV.
    memsim's model FLOPs have no recompute pass, so its GEMM FLOPs are 72BsLh^2(1 + s/6h) + 6BshV,
    exactly (eager attention computes the full s x s score matrix, as the paper assumes)."""
    _, workload = _workload(_document(s, b, h, a, layers=L, vocab=V))
    gemm = sum(op.flops for op in workload.first_microbatch if op.op_class == GEMM and op.phase in MODEL_PHASES)
    expected = narayanan_model_flops(b, s, L, h, V) - _recompute_pass_flops(b, s, L, h)
    assert gemm == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("attention", ["eager", "flash"])
@pytest.mark.parametrize("s,b,h,a,L,V", FLOP_SHAPES)
def test_reported_model_flops_vs_narayanan(s, b, h, a, L, V, attention):
    """The report's model FLOPs are Narayanan's minus the recompute pass, within 0.5%.

    What differs: memsim also counts elementwise, softmax, norm and embedding FLOPs (+0.1-0.3%),
    and flash attention computes only the causal half of the scores in forward (2bs^2h instead of
    4) with a 2.5x backward: 7bs^2h per layer instead of 12bs^2h.
    """
    result = simulate(scenario_from_dict(_document(s, b, h, a, layers=L, vocab=V, attention=attention)))
    reported = result.report["model_flops_per_iteration"]
    expected = narayanan_model_flops(b, s, L, h, V) - _recompute_pass_flops(b, s, L, h)
    if attention == "flash":
        expected -= 5.0 * b * s * s * h * L
    assert reported == pytest.approx(expected, rel=0.005)
    assert reported > expected      # the non-GEMM FLOPs only add
    # Against the paper's figure itself: 3/4 of the layer term plus the full logit term.
    layer_fraction = 72.0 / 96.0
    paper = narayanan_model_flops(b, s, L, h, V)
    logits = 6.0 * b * s * h * V
    assert reported / paper == pytest.approx((layer_fraction * (paper - logits) + logits) / paper, rel=0.035)


@pytest.mark.parametrize("preset", ["gpt2", "gpt3-1.3b", "gpt3-175b"])
def test_parameter_count_is_narayanan_plus_the_final_layer_norm(preset):
    scenario = scenario_from_dict({"model": {"preset": preset}, "cluster": {"topology": "h100-sxm"}})
    m = scenario.model
    workload = build_workload(scenario, resolve_cluster(scenario).device)
    closed = gpt_parameters(m.num_layers, m.hidden_size, m.vocab_size, m.max_position_embeddings)
    # The closed form has 13h per layer (two LayerNorms + biases) and tied embeddings, but no
    # final LayerNorm (weight and bias: 2h).
    assert workload.parameter_count == round(closed) + 2 * m.hidden_size
