"""Linformer attention (Wang et al. 2020, arXiv:2006.04768): keys and values projected along the sequence to k.

As lucidrains/linformer's ``LinformerSelfAttention`` does it (``proj_k``, ``proj_v``: one learned projection per
layer for keys and one for values, applied after the key and value projections, no bias), on the fused QKV of
GPT/BERT/ViT blocks, with fairseq's layout of a projection as ``nn.Linear(seq_len, k, bias=False)``
(examples/linformer: ``compress_k``, ``compress_v``): per head, keys K (n x d) become E K (k x d), values
F V (k x d); the scores are n x k instead of n x n, and so are the softmax output and the dropout mask.

Ops per layer: each of k and v copied to (b, d, n) (the head-split view is not contiguous) and projected by
``F.linear`` with E or F (k x n) into (b, d, k), which is already the per-head k^T layout; q made contiguous;
scores q k_c (b, heads, n, k), the 1/sqrt(d_head) scale, softmax, dropout, and the context with v_c. There is no
attention mask: the projection mixes every position, so Linformer has no causal form (refused for gpt and llama).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from simulator.workload.tape import Ref

if TYPE_CHECKING:
    from simulator.workload.transformer import TransformerBuilder


def linformer_parameters(builder: TransformerBuilder, prefix: str) -> dict[str, Ref]:
    """E and F of one layer: (k, n) each, in the parameter dtype."""
    m = builder.m
    return {"lin_e": builder._p(f"{prefix}.attn.proj_k", (m.linformer_k, m.seq)),
            "lin_f": builder._p(f"{prefix}.attn.proj_v", (m.linformer_k, m.seq))}


def linformer_core(builder: TransformerBuilder, i: int, q: Ref, k: Ref, v: Ref, pre: str) -> Ref:
    """The attention of layer `i` on its (b, heads, n, d_head) q, k, v views; returns (b, heads, n, d_head)."""
    m, ops, tape = builder.m, builder.ops, builder.tape
    p = builder.layers[i]
    b, nh, s, hd = q.shape
    kk = m.linformer_k
    d = nh * hd
    projected = []
    for x, key, name in ((k, "lin_e", "proj_k"), (v, "lin_f", "proj_v")):
        seq_last = ops.contiguous(tape.view(x, (b, d, s), f"{pre}.{name}.transpose", grad_copies=True),
                                  f"{pre}.{name}.contiguous")
        compressed = ops.linear(seq_last, p[key], None, f"{pre}.{name}")          # (b, d, k)
        projected.append(tape.view(compressed, (b, nh, hd, kk), f"{pre}.{name}.heads", grad_copies=True))
    keys, values = projected
    qa = ops.autocast_operand(q, f"{pre}.q")
    qc = ops.contiguous(qa, f"{pre}.q_contiguous")
    scores = ops.bmm(qc, keys, (b, nh, s, kk), b * nh, s, kk, hd, f"{pre}.scores")
    tape.hold(qa)
    scores = ops.div_by_scalar_tensor(scores, f"{pre}.scale")
    probs = ops.softmax(scores, f"{pre}.softmax")
    probs = ops.dropout(probs, m.dropout, f"{pre}.attn_dropout")
    out = ops.bmm(probs, values, (b, nh, s, hd), b * nh, s, hd, kk, f"{pre}.context")
    tape.hold(scores, probs)
    return out
