"""Reference torch implementations (GPT-2 and LLaMA blocks) of the models memsim describes, and one training step.

Every allocation a forward pass makes is written out and commented, so that memsim's op model can
mirror it line by line. Conventions used throughout (b micro-batch, s sequence, h hidden, nh heads,
kv key/value heads, hd = h / nh head size, V vocabulary, P max positions):

* Parameters are created in the build dtype: fp32 for "fp32" and "bf16-mixed", bf16 for "bf16"
  (the default dtype is set to bf16 while the model is built, then restored).
* "bf16-mixed" runs forward + loss under ``torch.autocast("cpu", dtype=torch.bfloat16)``; autocast
  casts fp32 weights to bf16 copies (cached until the autocast region exits) and upcasts the
  logits to fp32 inside cross_entropy (a (b*s, V) fp32 copy). In pure "bf16" nothing is upcast:
  cross_entropy (log_softmax + nll_loss) runs in bf16.
* Only storages allocated by an op count; views (``view``, ``transpose``, slicing, ``split``,
  ``expand``) allocate nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from simulator.errors import ScenarioError
from validation.lora_models import LORA_KEYS, LoraSpec, apply_lora, parse_lora

__all__ = [
    "ModelSpec", "TrainingSpec", "parse_model", "parse_training",
    "build_model", "build_optimizer", "make_batch", "train_step", "BUILD_DTYPES",
]

# dtype parameters are built in, per training.precision.
BUILD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16-mixed": torch.float32}

# Learning rates (irrelevant to memory; fixed so runs are reproducible).
_LR = {"adamw": 1e-3, "sgd": 1e-2, "sgd-momentum": 1e-2}


# ----------------------------------------------------------------------------------------------
# Configuration: plain dicts with memsim's ModelConfig / TrainingConfig key names -> frozen specs


@dataclass(frozen=True)
class ModelSpec:
    """Resolved model fields (memsim ModelConfig names); defaults filled in per architecture."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    max_position_embeddings: int
    activation: str
    norm: str
    norm_eps: float
    bias: bool
    attention: str
    dropout: float
    tied_embeddings: bool
    rope_theta: float
    share_layers: bool = False      # ALBERT-style: one block module run num_layers times


@dataclass(frozen=True)
class TrainingSpec:
    """Resolved training fields (memsim TrainingConfig names) that change a measured step."""

    micro_batch_size: int
    precision: str
    optimizer: str
    recompute: str
    lora: LoraSpec | None = None     # training.peft = "lora": validation/lora_models.py


# Per-architecture defaults (GPT-2 and LLaMA conventions) for keys a config may omit.
_ARCH_DEFAULTS = {
    "gpt": {"activation": "gelu", "norm": "layernorm", "norm_eps": 1e-5, "bias": True,
            "tied_embeddings": True, "dropout": 0.0},
    "llama": {"activation": "swiglu", "norm": "rmsnorm", "norm_eps": 1e-6, "bias": False,
              "tied_embeddings": False, "dropout": 0.0},
}
_CHOICES = {
    "architecture": ("gpt", "llama"), "activation": ("gelu", "swiglu"), "norm": ("layernorm", "rmsnorm"),
    "attention": ("eager", "flash"), "precision": ("fp32", "bf16", "bf16-mixed"),
    "optimizer": ("adamw", "sgd", "sgd-momentum"),
}
_REQUIRED_INTS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length")
_TRAINING_KEYS = ("micro_batch_size", "precision", "optimizer", "recompute", "global_batch_size") + LORA_KEYS


def _choice(section: str, key: str, value: object) -> str:
    if value not in _CHOICES[key]:
        raise ScenarioError(f"{section}.{key} = {value!r} must be one of {', '.join(_CHOICES[key])}")
    return str(value)


def _positive_int(section: str, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScenarioError(f"{section}.{key} = {value!r} must be a positive integer")
    return value


def parse_model(model: Mapping[str, object]) -> "ModelSpec | ResNetSpec":
    """Resolve a ``[model]`` table (memsim key names) into a ModelSpec (a ResNetSpec for architecture resnet).

    Raises:
        ScenarioError: on an unknown key, a missing required key or a value out of range.
    """
    if model.get("architecture") == "resnet":
        from validation.torch_resnet import parse_resnet

        return parse_resnet(model)
    unknown = sorted(set(model) - set(ModelSpec.__dataclass_fields__))
    if unknown:
        raise ScenarioError(f"model.{unknown[0]} is not a key the torch models know; allowed: "
                            f"{', '.join(ModelSpec.__dataclass_fields__)}")
    arch = _choice("model", "architecture", model.get("architecture", "gpt"))
    missing = [k for k in _REQUIRED_INTS if k not in model]
    if missing:
        raise ScenarioError(f"model.{missing[0]} is required (a positive integer)")
    ints = {k: _positive_int("model", k, model[k]) for k in _REQUIRED_INTS}
    h, nh = ints["hidden_size"], ints["num_attention_heads"]
    fields = dict(_ARCH_DEFAULTS[arch])
    fields.update({k: v for k, v in model.items() if k in fields})
    kv = _positive_int("model", "num_kv_heads", model.get("num_kv_heads", nh))
    if h % nh or nh % kv or (h // nh) % 2:
        raise ScenarioError(f"model.num_attention_heads = {nh} must divide hidden_size = {h} into an even "
                            f"head size and be a multiple of num_kv_heads = {kv}")
    ffn_default = 4 * h if fields["activation"] == "gelu" else 256 * math.ceil(int(8 * h / 3) / 256)
    dropout = model.get("dropout", fields["dropout"])
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0.0 <= dropout < 1.0:
        raise ScenarioError(f"model.dropout = {dropout!r} must be a number in [0, 1)")
    positions = _positive_int("model", "max_position_embeddings",
                              model.get("max_position_embeddings", ints["seq_length"]))
    if positions < ints["seq_length"]:
        raise ScenarioError(f"model.max_position_embeddings = {positions} must be >= seq_length = "
                            f"{ints['seq_length']}")
    return ModelSpec(
        architecture=arch, **ints, num_kv_heads=kv,
        ffn_hidden_size=_positive_int("model", "ffn_hidden_size", model.get("ffn_hidden_size", ffn_default)),
        max_position_embeddings=positions,
        activation=_choice("model", "activation", fields["activation"]),
        norm=_choice("model", "norm", fields["norm"]), norm_eps=float(fields["norm_eps"]),
        bias=bool(fields["bias"]), attention=_choice("model", "attention", model.get("attention", "flash")),
        dropout=float(dropout), tied_embeddings=bool(fields["tied_embeddings"]),
        rope_theta=float(model.get("rope_theta", 10000.0)),
        share_layers=bool(model.get("share_layers", False)),
    )


def parse_training(training: Mapping[str, object]) -> TrainingSpec:
    """Resolve a ``[training]`` table into a TrainingSpec (one micro-batch step, no accumulation).

    Raises:
        ScenarioError: on an unknown key or a value out of range.
    """
    unknown = sorted(set(training) - set(_TRAINING_KEYS))
    if unknown:
        raise ScenarioError(f"training.{unknown[0]} is not a key the measurement knows; allowed: "
                            f"{', '.join(_TRAINING_KEYS)}")
    b = _positive_int("training", "micro_batch_size", training.get("micro_batch_size", 1))
    if training.get("global_batch_size", b) != b:
        raise ScenarioError(f"training.global_batch_size = {training['global_batch_size']!r} must equal "
                            f"micro_batch_size = {b} (one measured step, no gradient accumulation)")
    recompute = training.get("recompute", "none")
    segments = str(recompute).removeprefix("segments:")
    if recompute not in ("none", "selective", "full") and not (
            str(recompute).startswith("segments:") and segments.isdigit() and int(segments) >= 1):
        raise ScenarioError(f"training.recompute = {recompute!r} must be none, selective, full or segments:N (N >= 1)")
    return TrainingSpec(
        micro_batch_size=b,
        precision=_choice("training", "precision", training.get("precision", "fp32")),
        optimizer=_choice("training", "optimizer", training.get("optimizer", "adamw")),
        recompute=str(recompute),
        lora=parse_lora(training),
    )


# ----------------------------------------------------------------------------------------------
# Shared pieces: norms, MLPs, attention cores


class RMSNorm(nn.Module):
    """LLaMA RMSNorm exactly as HF writes it (compute in fp32, cast back, then scale)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # build dtype
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        xf = x.to(torch.float32)                          # alloc fp32 copy (b,s,h) unless x is already fp32
        variance = xf.pow(2).mean(-1, keepdim=True)       # alloc pow (b,s,h) fp32 (freed), mean (b,s,1) fp32
        xf = xf * torch.rsqrt(variance + self.eps)        # alloc add (b,s,1), rsqrt (b,s,1), mul (b,s,h) fp32
        return self.weight * xf.to(input_dtype)           # alloc cast (b,s,h) unless fp32; mul (b,s,h)


def make_norm(spec: ModelSpec) -> nn.Module:
    """The block's norm: nn.LayerNorm (with bias iff spec.bias) or RMSNorm."""
    if spec.norm == "layernorm":
        # LayerNorm saves its input, mean (b,s,1) fp32 and rstd (b,s,1) fp32 for backward.
        return nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps, bias=spec.bias)
    return RMSNorm(spec.hidden_size, spec.norm_eps)


class GeluMLP(nn.Module):
    """GPT-2 MLP: c_fc h->ffn, GELU(tanh), c_proj ffn->h."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.c_fc = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=spec.bias)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # allocs: c_fc out (b,s,ffn), gelu out (b,s,ffn), c_proj out (b,s,h).
        return self.c_proj(self.act(self.c_fc(x)))


class SwiGLUMLP(nn.Module):
    """LLaMA MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=spec.bias)
        self.up_proj = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=spec.bias)
        self.down_proj = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # allocs: gate (b,s,ffn), silu (b,s,ffn), up (b,s,ffn), product (b,s,ffn), down (b,s,h).
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def make_mlp(spec: ModelSpec) -> nn.Module:
    """GeluMLP for activation "gelu", SwiGLUMLP for "swiglu"."""
    return GeluMLP(spec) if spec.activation == "gelu" else SwiGLUMLP(spec)


class EagerAttentionCore(nn.Module):
    """scores -> causal mask -> softmax -> dropout -> @ v, on (b, nh, s, hd) q, k, v.

    A module of its own so that selective recompute can checkpoint exactly this region and the
    tracker's module hooks see its recompute.
    """

    def __init__(self, dropout: float, softmax_in_fp32: bool) -> None:
        super().__init__()
        self.dropout = dropout
        # HF LLaMA computes softmax in fp32 and casts back (softmax_in_fp32=True); GPT-2 does not.
        self.softmax_in_fp32 = softmax_in_fp32

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        """``causal`` is a bool (1, 1, s, s) view of a causal-mask buffer, True where attending is allowed."""
        # q @ k^T: matmul of non-contiguous 4-D views copies q and k to contiguous (b*nh, s, hd)
        # buffers (saved for backward), then bmm allocs scores (b,nh,s,s).
        scores = q @ k.transpose(-2, -1)
        # Scale as HF GPT-2 does, dividing by a 0-dim tensor: torch.full allocs one element of the
        # scores' dtype, which div saves for backward (a Python-float multiply would instead save an
        # 8-byte wrapped double that no dispatch-level tracker can see). div allocs a second (b,nh,s,s).
        scores = scores / torch.full([], math.sqrt(q.size(-1)), dtype=scores.dtype)
        # ~causal allocs a bool (1,1,s,s) that masked_fill saves for backward; masked_fill allocs (b,nh,s,s).
        scores = scores.masked_fill(~causal, float("-inf"))
        if self.softmax_in_fp32:
            # softmax allocs fp32 (b,nh,s,s) (saved); .to allocs the cast back unless already fp32.
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            probs = F.softmax(scores, dim=-1)            # allocs (b,nh,s,s), saved for backward
        # dropout p>0 allocs a mask of the input's dtype (b,nh,s,s) (saved) and the output;
        # p == 0 (or eval) returns its input and allocates nothing.
        probs = F.dropout(probs, p=self.dropout, training=self.training)
        return probs @ v                                  # copies v if non-contiguous; allocs (b,nh,s,hd)


class SdpaAttentionCore(nn.Module):
    """F.scaled_dot_product_attention(q, k, v, is_causal=True) ("flash" attention).

    On CPU, dropout_p == 0 runs the flash kernel (saves q, k, v, out and a logsumexp (b,nh,s) fp32);
    dropout_p > 0 falls back to the math path, which materializes scores, softmax and dropout.
    """

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        """``causal`` is unused (is_causal=True builds the mask inside the kernel); kept for one signature."""
        del causal
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


def make_attention_core(spec: ModelSpec, softmax_in_fp32: bool) -> nn.Module:
    """EagerAttentionCore for attention "eager", SdpaAttentionCore for "flash"."""
    if spec.attention == "eager":
        return EagerAttentionCore(spec.dropout, softmax_in_fp32)
    return SdpaAttentionCore(spec.dropout)


def run_core(core: nn.Module, selective: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             causal: torch.Tensor) -> torch.Tensor:
    """Run the attention core, under a non-reentrant checkpoint when recompute is "selective"."""
    if selective:
        # Saves only q, k, v (and the mask view) and the CPU RNG state; everything inside is recomputed.
        return checkpoint(core, q, k, v, causal, use_reentrant=False)
    return core(q, k, v, causal)


def causal_mask(positions: int) -> torch.Tensor:
    """Bool lower-triangular mask (1, 1, P, P), P*P bytes, True where a query may attend a key."""
    return torch.tril(torch.ones(positions, positions, dtype=torch.bool)).view(1, 1, positions, positions)


# ----------------------------------------------------------------------------------------------
# GPT (nanoGPT / HF GPT-2)


class GPTAttention(nn.Module):
    """GPT-2 attention: fused c_attn h->3h, split into heads, core, merge heads, c_proj h->h."""

    def __init__(self, spec: ModelSpec, selective: bool) -> None:
        super().__init__()
        self.n_head = spec.num_attention_heads
        self.c_attn = nn.Linear(spec.hidden_size, 3 * spec.hidden_size, bias=spec.bias)
        self.c_proj = nn.Linear(spec.hidden_size, spec.hidden_size, bias=spec.bias)
        self.core = make_attention_core(spec, softmax_in_fp32=False)
        self.selective = selective
        # Causal mask: one bool (1, 1, P, P) buffer per layer, as HF GPT-2 and nanoGPT register it
        # ("bias"), persistent (in the state dict). P*P bytes per layer; flash attention never reads it.
        self.register_buffer("bias", causal_mask(spec.max_position_embeddings), persistent=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        hd = h // self.n_head
        qkv = self.c_attn(x)                                   # allocs (b,s,3h)
        q, k, v = qkv.split(h, dim=2)                          # views
        q = q.view(b, s, self.n_head, hd).transpose(1, 2)      # views (b,nh,s,hd), non-contiguous
        k = k.view(b, s, self.n_head, hd).transpose(1, 2)
        v = v.view(b, s, self.n_head, hd).transpose(1, 2)
        y = run_core(self.core, self.selective, q, k, v, self.bias[:, :, :s, :s])
        y = y.transpose(1, 2).contiguous().view(b, s, h)       # contiguous allocs (b,s,h)
        return self.c_proj(y)                                  # allocs (b,s,h)


class GPTBlock(nn.Module):
    """x = x + dropout(attn(ln_1(x))); x = x + dropout(mlp(ln_2(x)))."""

    def __init__(self, spec: ModelSpec, selective: bool) -> None:
        super().__init__()
        self.ln_1 = make_norm(spec)
        self.attn = GPTAttention(spec, selective)
        self.ln_2 = make_norm(spec)
        self.mlp = make_mlp(spec)
        self.resid_dropout = nn.Dropout(spec.dropout)  # p>0: mask (b,s,h) of x's dtype + output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn(self.ln_1(x)))   # ln out, ..., residual add allocs (b,s,h)
        x = x + self.resid_dropout(self.mlp(self.ln_2(x)))
        return x


class GPT(nn.Module):
    """wte + wpe -> dropout -> L blocks -> ln_f -> lm_head (tied to wte, no bias) -> cross-entropy."""

    def __init__(self, spec: ModelSpec, recompute: str) -> None:
        super().__init__()
        self.spec = spec
        self.recompute = recompute
        self.wte = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.wpe = nn.Embedding(spec.max_position_embeddings, spec.hidden_size)
        self.drop = nn.Dropout(spec.dropout)
        self.h = nn.Sequential(*_blocks(spec, lambda: GPTBlock(spec, recompute == "selective")))
        self.ln_f = make_norm(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.lm_head.weight = self.wte.weight  # one storage, counted once

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, s = idx.shape
        pos = torch.arange(0, s, dtype=torch.long)          # allocs s int64 (8*s bytes), every forward
        x = self.drop(self.wte(idx) + self.wpe(pos))        # allocs tok (b,s,h), pos (s,h), sum (b,s,h)
        x = run_blocks(self.h, x, self.recompute)
        x = self.ln_f(x)
        logits = self.lm_head(x)                            # allocs (b,s,V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ----------------------------------------------------------------------------------------------
# LLaMA (HF LlamaForCausalLM, no biases)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF rotate_half: cat(-x2, x1) on the last dim; allocs neg (half size) and the cat (full size)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with cos/sin (s, hd) broadcast over (b, heads, s, hd).

    Allocs: x*cos, rotate_half (neg half-size, cat), *sin, sum -- each (b, heads, s, hd); the sum is
    kept. Under bf16-mixed, x is bf16 (an autocast linear's output) and cos/sin are fp32 buffers, so
    the products and the sum are fp32 by type promotion (neg and cat stay bf16).
    """
    return (x * cos) + (rotate_half(x) * sin)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """HF repeat_kv: (b, kv, s, hd) -> (b, kv*n_rep, s, hd) by expand + reshape (a copy when n_rep > 1)."""
    if n_rep == 1:
        return x
    b, kv, s, hd = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, s, hd).reshape(b, kv * n_rep, s, hd)


class LlamaAttention(nn.Module):
    """q_proj h->h, k_proj/v_proj h->kv*hd, RoPE on q and k, repeat_kv, core, o_proj h->h."""

    def __init__(self, spec: ModelSpec, selective: bool) -> None:
        super().__init__()
        self.n_head = spec.num_attention_heads
        self.n_kv = spec.num_kv_heads
        hd = spec.hidden_size // spec.num_attention_heads
        self.q_proj = nn.Linear(spec.hidden_size, spec.hidden_size, bias=spec.bias)
        self.k_proj = nn.Linear(spec.hidden_size, self.n_kv * hd, bias=spec.bias)
        self.v_proj = nn.Linear(spec.hidden_size, self.n_kv * hd, bias=spec.bias)
        self.o_proj = nn.Linear(spec.hidden_size, spec.hidden_size, bias=spec.bias)
        self.core = make_attention_core(spec, softmax_in_fp32=True)
        self.selective = selective

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        hd = h // self.n_head
        q = self.q_proj(x).view(b, s, self.n_head, hd).transpose(1, 2)   # allocs (b,s,h); view
        k = self.k_proj(x).view(b, s, self.n_kv, hd).transpose(1, 2)     # allocs (b,s,kv*hd); view
        v = self.v_proj(x).view(b, s, self.n_kv, hd).transpose(1, 2)     # allocs (b,s,kv*hd); view
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k = repeat_kv(k, self.n_head // self.n_kv)
        v = repeat_kv(v, self.n_head // self.n_kv)
        y = run_core(self.core, self.selective, q, k, v, causal)
        y = y.transpose(1, 2).contiguous().view(b, s, h)                  # contiguous allocs (b,s,h)
        return self.o_proj(y)


class LlamaBlock(nn.Module):
    """x = x + attn(rms1(x)); x = x + mlp(rms2(x)); takes and returns x only (for checkpointing)."""

    def __init__(self, spec: ModelSpec, selective: bool, tables: "LlamaTables") -> None:
        super().__init__()
        self.input_layernorm = make_norm(spec)
        self.self_attn = LlamaAttention(spec, selective)
        self.post_attention_layernorm = make_norm(spec)
        self.mlp = make_mlp(spec)
        # A plain reference to the model's shared tables, not a submodule (its buffers belong to the model).
        object.__setattr__(self, "_tables", tables)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin, causal = self._tables.views(x.shape[1])
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, causal)   # residual add allocs (b,s,h)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class LlamaTables(nn.Module):
    """Model-level buffers every LLaMA layer reads: RoPE cos/sin tables and the causal mask.

    RoPE: cos/sin are *cached buffers* computed once at build (not recomputed each forward), each
    (P, hd) in the build dtype (computed in fp32, then cast), non-persistent like HF's.
    Causal mask (eager attention): one bool (1, 1, P, P) buffer shared by all layers, non-persistent
    (HF builds an equivalent mask each forward; a buffer keeps that allocation out of the step).
    ``views(s)`` slices the first s positions: views only, no allocation.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        hd = spec.hidden_size // spec.num_attention_heads
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        freqs = torch.outer(torch.arange(spec.max_position_embeddings, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(torch.get_default_dtype()), persistent=False)
        self.register_buffer("sin", emb.sin().to(torch.get_default_dtype()), persistent=False)
        self.register_buffer("causal", causal_mask(spec.max_position_embeddings), persistent=False)

    def views(self, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos (s, hd), sin (s, hd), causal (1, 1, s, s) -- views of the buffers."""
        return self.cos[:s], self.sin[:s], self.causal[:, :, :s, :s]


class Llama(nn.Module):
    """embed_tokens -> L blocks -> final RMSNorm -> lm_head (untied, V x h) -> cross-entropy."""

    def __init__(self, spec: ModelSpec, recompute: str) -> None:
        super().__init__()
        self.spec = spec
        self.recompute = recompute
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.tables = LlamaTables(spec)
        self.layers = nn.Sequential(*_blocks(spec, lambda: LlamaBlock(spec, recompute == "selective", self.tables)))
        self.norm = make_norm(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)                          # allocs (b,s,h)
        x = run_blocks(self.layers, x, self.recompute)
        x = self.norm(x)
        logits = self.lm_head(x)                            # allocs (b,s,V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ----------------------------------------------------------------------------------------------
# Recompute, build, step


def _blocks(spec: ModelSpec, make: Callable[[], nn.Module]) -> list[nn.Module]:
    """spec.num_layers blocks; with share_layers one block repeated (parameters() lists its weights once)."""
    if spec.share_layers:
        return [make()] * spec.num_layers
    return [make() for _ in range(spec.num_layers)]


def run_blocks(blocks: nn.Sequential, x: torch.Tensor, recompute: str) -> torch.Tensor:
    """Run the blocks with the recompute policy: none/selective plain, full per block, segments:N."""
    if recompute == "full":
        for block in blocks:
            # Saves only the block input (and the CPU RNG state); the block is replayed in backward.
            x = checkpoint(block, x, use_reentrant=False)
        return x
    if recompute.startswith("segments:"):
        # checkpoint_sequential checkpoints the first N-1 segments; the last runs normally.
        return checkpoint_sequential(blocks, int(recompute.split(":")[1]), x, use_reentrant=False)
    for block in blocks:
        x = block(x)
    return x


def build_model(model_spec: ModelSpec, training_spec: TrainingSpec) -> nn.Module:
    """Build the GPT or LLaMA module in training mode, in the precision's build dtype.

    Args:
        model_spec: resolved model fields (memsim ModelConfig names).
        training_spec: resolved training fields (precision selects the build dtype, recompute the policy).

    Returns:
        The module on CPU, ``train()`` mode; the caller seeds torch beforehand.
    """
    if training_spec.recompute.startswith("segments:"):
        segments = int(training_spec.recompute.removeprefix("segments:"))
        if segments > model_spec.num_layers:
            raise ScenarioError(f"training.recompute = {training_spec.recompute!r} must use at most "
                                f"model.num_layers = {model_spec.num_layers} segments")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(BUILD_DTYPES[training_spec.precision])
    try:
        if model_spec.architecture == "resnet":
            from validation.torch_resnet import ResNet

            return ResNet(model_spec, training_spec.recompute).train()
        cls = GPT if model_spec.architecture == "gpt" else Llama
        model = cls(model_spec, training_spec.recompute)
        model.apply(_init_weights)
    finally:
        torch.set_default_dtype(previous)
    if training_spec.lora is not None:
        apply_lora(model, model_spec.architecture, training_spec.lora, training_spec.precision)
    return model.train()


def _init_weights(module: nn.Module) -> None:
    """GPT-2 / LLaMA initialization: N(0, 0.02) weights, zero biases (in place, no new storage)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_optimizer(model: nn.Module, training_spec: TrainingSpec) -> torch.optim.Optimizer:
    """torch.optim.AdamW (defaults), SGD, or SGD(momentum=0.9) over model.parameters().

    foreach/fused are left at their defaults (None): on CPU torch picks the single-tensor loop;
    the measurement records which implementation actually ran.
    """
    lr = _LR[training_spec.optimizer]
    params = [p for p in model.parameters() if p.requires_grad]     # all of them, or LoRA's adapters
    if training_spec.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    momentum = 0.9 if training_spec.optimizer == "sgd-momentum" else 0.0
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def make_batch(model_spec: ModelSpec, training_spec: TrainingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and targets, each int64 (micro_batch_size, seq_length): 8*b*s bytes each (a ResNet: fp32
    images (b, C, H, W) in the build dtype and int64 class targets (b,))."""
    if model_spec.architecture == "resnet":
        from validation.torch_resnet import make_images

        return make_images(model_spec, training_spec)
    shape = (training_spec.micro_batch_size, model_spec.seq_length)
    idx = torch.randint(0, model_spec.vocab_size, shape, dtype=torch.long)
    targets = torch.randint(0, model_spec.vocab_size, shape, dtype=torch.long)
    return idx, targets


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    idx: torch.Tensor,
    targets: torch.Tensor,
    training_spec: TrainingSpec,
    on_phase: Callable[[str], None] | None = None,
) -> float:
    """One step: forward + loss, backward, optimizer.step(), optimizer.zero_grad(set_to_none=True).

    Args:
        on_phase: called with "forward", "backward", "optimizer", "zero_grad" before each phase.

    Returns:
        The loss value.
    """
    notify = on_phase or (lambda _phase: None)
    notify("forward")
    if training_spec.precision == "bf16-mixed":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, targets)
    else:
        loss = model(idx, targets)
    notify("backward")
    loss.backward()
    value = loss.item()
    del loss
    notify("optimizer")
    optimizer.step()
    notify("zero_grad")
    optimizer.zero_grad(set_to_none=True)
    return value

