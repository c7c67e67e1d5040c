"""Transformer forward passes (GPT-2, LLaMA, BERT, ViT) recorded op by op on a tape.

Each builder mirrors the reference torch modules in validation/torch_models.py statement by
statement, so that allocation order, saved tensors and Python lifetimes match PyTorch's.

With tensor parallelism (`ops.tp` > 1) a rank holds Megatron-LM's shards: column-parallel QKV /
q, k, v / fc1 / gate / up (out_features/t), row-parallel output projections (in_features/t, bias
replicated and added after the reduction), heads/t and kv_heads/t, a vocabulary-parallel embedding,
LM head and cross-entropy (vocabulary padded up to a multiple of t); norms and dropout replicated.
With sequence parallelism the residual stream, norms and dropout hold s/t tokens.
"""

from __future__ import annotations

from simulator.errors import PlanError
from simulator.workload.graph import OTHER
from simulator.workload.model_parts import Checkpointing, Params, Shape  # noqa: F401  (callers import them from here)
from simulator.workload.peft import Adapters
from simulator.workload.sparsity import sparse_linear
from simulator.workload.primitives import Ops
from simulator.workload.tape import Ref


class TransformerBuilder:
    """Declares a model's parameters and records one micro-batch's forward pass."""

    def __init__(self, ops: Ops, shape: Shape, param_dtype: str, checkpointing: Checkpointing,
                 micro_batch: int, layers: range | None = None, first: bool = True, last: bool = True,
                 adapters: Adapters | None = None):
        """A builder of the whole model, or of one pipeline stage.

        Args:
            layers: the transformer layers this builder holds (default: all of them).
            first: it holds the embedding (the first pipeline stage).
            last: it holds the final norm, the head and the loss (the last pipeline stage).
            adapters: LoRA / QLoRA (workload/peft.py): every declared parameter is frozen in its dtype, the
                targeted block linears get trainable adapters (the only entries of `params`).
        """
        self.adapters = adapters
        self.ops = ops
        self.tape = ops.tape
        self.m = shape
        self.pdt = param_dtype
        self.ckpt = checkpointing
        self.b = micro_batch
        self.tp = ops.tp
        self.sp = ops.sp
        self.layer_range = range(shape.num_layers) if layers is None else layers
        if not self.layer_range or self.layer_range.step != 1 or self.layer_range.start < 0 \
                or self.layer_range.stop > shape.num_layers:
            raise PlanError(f"layers = {self.layer_range!r}: must be a non-empty contiguous range inside "
                            f"0..{shape.num_layers} (model.num_layers = {shape.num_layers})")
        self.first = first
        self.last = last
        self._check_tp()
        self.vocab_rank = -(-shape.vocab // self.tp)      # rows of the vocabulary on this rank
        self.params = Params([], [])
        self.layers: dict[int, dict[str, Ref]] = {}
        self.top: dict[str, Ref] = {}
        self.buffers: list[Ref] = []
        self._declare()

    def _check_tp(self) -> None:
        m, t = self.m, self.tp
        if t < 1:
            raise PlanError(f"parallel.tp = {t} must be a positive integer")
        if t == 1:
            return
        for key, value in (("model.num_attention_heads", m.heads), ("model.num_kv_heads", m.kv_heads),
                           ("model.ffn_hidden_size", m.ffn)):
            if value % t:
                raise PlanError(f"parallel.tp = {t} must divide {key} = {value}")
        if self.sp and m.seq % t:
            raise PlanError(f"parallel.sequence_parallel = true: parallel.tp = {t} must divide the "
                            f"sequence length = {m.seq}")

    # ------------------------------------------------------------------ parameters
    def _p(self, name: str, shape: tuple[int, ...]) -> Ref:
        if self.adapters is not None:
            return self.adapters.frozen_param(name, shape)
        return self.params.add(self.ops, name, shape, self.pdt)

    def _norm_params(self, prefix: str) -> dict[str, Ref]:
        h = self.m.hidden
        out = {"w": self._p(f"{prefix}.weight", (h,))}
        if self.m.norm == "layernorm" and self.m.bias:
            out["b"] = self._p(f"{prefix}.bias", (h,))
        return out

    def _linear_params(self, prefix: str, in_f: int, out_f: int, key: str | None = None) -> dict[str, Ref]:
        """A linear's weight and bias (a block linear, `key`, under PEFT: Adapters.linear_params)."""
        if self.adapters is not None and key is not None:
            return self.adapters.linear_params(self, prefix, in_f, out_f, key)
        out = {"w": self._p(f"{prefix}.weight", (out_f, in_f))}
        if self.m.bias:
            out["b"] = self._p(f"{prefix}.bias", (out_f,))
        return out

    def _declare(self) -> None:
        m = self.m
        h = m.hidden
        t = self.tp
        kvd = m.kv_heads * m.head_dim
        vocab = self.vocab_rank
        if not self.first:
            pass
        elif m.architecture == "llama":
            self.top["wte"] = self._p("embed_tokens.weight", (vocab, h))
        elif m.architecture == "vit":
            self.top["patch"] = self._p("patch_embed.weight", (h, m.channels * m.patch * m.patch))
            self.top["patch_b"] = self._p("patch_embed.bias", (h,))
            self.top["cls"] = self._p("cls_token", (1, 1, h))
            self.top["wpe"] = self._p("pos_embed", (1, m.seq, h))
        else:
            self.top["wte"] = self._p("wte.weight", (vocab, h))
            self.top["wpe"] = self._p("wpe.weight", (m.positions, h))
            if m.architecture == "bert":
                self.top["wtt"] = self._p("token_type_embeddings.weight", (m.type_vocab, h))
                self.top.update({f"emb_ln_{k}": v for k, v in self._norm_params("embeddings.LayerNorm").items()})
        for i in self.layer_range:
            if m.shared_layers and self.layers:
                # ALBERT: one set of layer parameters, used by every layer (autograd sums their gradients).
                self.layers[i] = self.layers[self.layer_range.start]
                continue
            layer: dict[str, Ref] = {}
            pre = f"layers.{i}"
            layer.update({f"ln1_{k}": v for k, v in self._norm_params(f"{pre}.ln_1").items()})
            if m.architecture == "llama":
                for proj, out_f in (("q", h), ("k", kvd), ("v", kvd)):
                    layer.update({f"{proj}_{k}": v for k, v in
                                  self._linear_params(f"{pre}.{proj}_proj", h, out_f // t, proj).items()})
                layer.update({f"o_{k}": v for k, v in self._linear_params(f"{pre}.o_proj", h // t, h, "o").items()})
            else:
                layer.update({f"qkv_{k}": v for k, v in
                              self._linear_params(f"{pre}.c_attn", h, (h + 2 * kvd) // t, "qkv").items()})
                layer.update({f"o_{k}": v for k, v in
                              self._linear_params(f"{pre}.attn.c_proj", h // t, h, "o").items()})
            if m.attention == "linformer":
                from simulator.workload.linformer import linformer_parameters     # here: only Linformer loads it

                layer.update(linformer_parameters(self, pre))
            layer.update({f"ln2_{k}": v for k, v in self._norm_params(f"{pre}.ln_2").items()})
            if m.activation == "swiglu":
                for proj in ("gate", "up"):
                    layer.update({f"{proj}_{k}": v for k, v in
                                  self._linear_params(f"{pre}.mlp.{proj}_proj", h, m.ffn // t, proj).items()})
                layer.update({f"down_{k}": v for k, v in
                              self._linear_params(f"{pre}.mlp.down_proj", m.ffn // t, h, "down").items()})
            else:
                layer.update({f"fc1_{k}": v for k, v in
                              self._linear_params(f"{pre}.mlp.c_fc", h, m.ffn // t, "fc1").items()})
                layer.update({f"fc2_{k}": v for k, v in
                              self._linear_params(f"{pre}.mlp.c_proj", m.ffn // t, h, "fc2").items()})
            self.layers[i] = layer
        if self.last:
            self._declare_head(vocab)
        self._declare_buffers()

    def _declare_head(self, vocab: int) -> None:
        m, h = self.m, self.m.hidden
        self.top.update({f"lnf_{k}": v for k, v in self._norm_params("ln_f").items()})
        if m.architecture == "bert":
            self.top.update({f"mlm_{k}": v for k, v in self._linear_params("cls.transform.dense", h, h).items()})
            self.top.update({f"mlm_ln_{k}": v for k, v in self._norm_params("cls.transform.LayerNorm").items()})
            self.top["mlm_bias"] = self._p("cls.decoder.bias", (vocab,))
        if m.architecture == "vit":
            self.top["head"] = self._p("head.weight", (m.classes, h))
            self.top["head_b"] = self._p("head.bias", (m.classes,))
        elif not m.tied or not self.first:
            # A tied head on a later pipeline stage keeps its own copy of the word embeddings (Megatron).
            self.top["head"] = self._p("lm_head.weight", (vocab, h))
        else:
            self.top["head"] = self.top["wte"]

    def _declare_buffers(self) -> None:
        m = self.m
        ops = self.ops
        self.causal: dict[int, Ref] = {}
        if m.architecture == "gpt":
            # One bool (1, 1, P, P) causal-mask buffer per layer, as HF GPT-2 / nanoGPT register it.
            for i in self.layer_range:
                if m.shared_layers and self.causal:
                    self.causal[i] = self.causal[self.layer_range.start]     # the shared layer's buffer
                    continue
                ref = ops.buffer(f"layers.{i}.attn.bias", (1, 1, m.positions, m.positions), "bool")
                self.buffers.append(ref)
                self.causal[i] = ref
        elif m.architecture == "llama":
            # RoPE cos/sin tables (P, head_dim) in the build dtype and one shared bool causal mask.
            self.rope_cos = ops.buffer("rope_cos", (m.positions, m.head_dim), self.pdt)
            self.rope_sin = ops.buffer("rope_sin", (m.positions, m.head_dim), self.pdt)
            mask = ops.buffer("causal_mask", (1, 1, m.positions, m.positions), "bool")
            self.buffers += [self.rope_cos, self.rope_sin, mask]
            self.causal = {i: mask for i in self.layer_range}

    # ------------------------------------------------------------------ forward
    def forward(self, idx: Ref | None, targets: Ref | None, stage_input: Ref | None = None) -> Ref:
        """Record the forward of one micro-batch; returns the loss ref (the stage output if not last).

        A builder that is not `first` starts from `stage_input` (the activation received from the
        previous pipeline stage) instead of embedding `idx`; one that is not `last` returns the
        output of its last layer, kept alive until backward (the pipeline's output cache).
        """
        x = self._embed(idx) if self.first else stage_input
        start = self.layer_range.start
        regions = {start + first: start + last
                   for first, last in self.ckpt.block_regions(len(self.layer_range))}
        closing: int | None = None
        for i in self.layer_range:
            self.tape.layer = i
            if i in regions:
                self.tape.begin_checkpoint((x,))
                closing = regions[i]
            x = self._block(i, x)
            if closing == i:
                self.tape.end_checkpoint()
                closing = None
        self.tape.layer = -1
        if not self.last:
            self.tape.keep_until_end(x)
            return x
        return self._head(x, targets)

    def _embed(self, idx: Ref) -> Ref:
        m, ops, b = self.m, self.ops, self.b
        if m.architecture == "llama":
            if self.tp > 1:
                return ops.vocab_parallel_embedding(self.top["wte"], idx, "embed_tokens", reduce_scatter=self.sp)
            return ops.embedding(self.top["wte"], idx, "embed_tokens")
        if m.architecture == "vit":
            return self._embed_vit(idx)
        (pos,) = self.tape.node("arange", "elementwise", (), (("pos", (m.seq,), "int64"),),
                                requires_grad=False)
        if self.tp > 1:
            tok = ops.vocab_parallel_embedding(self.top["wte"], idx, "wte", reduce_scatter=False)
        else:
            tok = ops.embedding(self.top["wte"], idx, "wte")
        pos_emb = ops.embedding(self.top["wpe"], pos, "wpe")
        x = ops.add(tok, pos_emb, "embed_add")
        if m.architecture == "bert":
            (types,) = self.tape.node("token_type_ids", "elementwise", (), (("token_types", (b, m.seq), "int64"),),
                                      requires_grad=False, category=OTHER)
            x = ops.add(x, ops.embedding(self.top["wtt"], types, "token_type"), "embed_add_types")
            x = self._norm(self._scatter(x), "emb_ln", self.top, "embeddings.LayerNorm")
            return ops.dropout(x, m.dropout, "embed_dropout")
        return ops.dropout(self._scatter(x), m.dropout, "embed_dropout")

    def _scatter(self, x: Ref) -> Ref:
        """With sequence parallelism, keep this rank's s/t tokens of the embedding output."""
        return self.ops.scatter_sequence(x, "embed_scatter") if self.sp else x

    def _embed_vit(self, pixels: Ref) -> Ref:
        m, ops, b = self.m, self.ops, self.b
        patches = (m.seq - 1)
        k = m.channels * m.patch * m.patch
        # Conv2d(stride=patch) == unfold + linear; the conv saves its input image.
        unfolded = self.tape.view(pixels, (b, patches, k), "patchify", grad_copies=True)
        x = ops.linear(unfolded, self.top["patch"], self.top["patch_b"], "patch_embed")
        cls = self.tape.view(self.top["cls"], (b, 1, m.hidden), "cls_expand")
        x = ops.cat((cls, x), (b, m.seq, m.hidden), "cat_cls")
        x = ops.add(x, self.top["wpe"], "pos_add")
        return ops.dropout(self._scatter(x), m.dropout, "embed_dropout")

    def _norm(self, x: Ref, key: str, params: dict[str, Ref], name: str) -> Ref:
        if self.m.norm == "rmsnorm":
            return self.ops.rms_norm(x, params[f"{key}_w"], name)
        return self.ops.layer_norm(x, params[f"{key}_w"], params.get(f"{key}_b"), name)

    def _block(self, i: int, x: Ref) -> Ref:
        m, ops = self.m, self.ops
        p = self.layers[i]
        pre = f"layers.{i}"
        if m.post_norm:
            # BERT: x = LN(x + dropout(attn(x))); x = LN(x + dropout(mlp(x)))
            a = ops.dropout(self._attention(i, x), m.dropout, f"{pre}.attn_dropout")
            x = self._norm(ops.add(x, a, f"{pre}.residual1"), "ln1", p, f"{pre}.ln_1")
            f = ops.dropout(self._mlp(i, x), m.dropout, f"{pre}.mlp_dropout")
            return self._norm(ops.add(x, f, f"{pre}.residual2"), "ln2", p, f"{pre}.ln_2")
        a = self._attention(i, self._norm(x, "ln1", p, f"{pre}.ln_1"))
        x = ops.add(x, ops.dropout(a, m.dropout, f"{pre}.attn_dropout"), f"{pre}.residual1")
        f = self._mlp(i, self._norm(x, "ln2", p, f"{pre}.ln_2"))
        return ops.add(x, ops.dropout(f, m.dropout, f"{pre}.mlp_dropout"), f"{pre}.residual2")

    def _mlp(self, i: int, x: Ref) -> Ref:
        m, ops = self.m, self.ops
        p = self.layers[i]
        pre = f"layers.{i}.mlp"
        xin = self._column_input(x, f"{pre}.column_input")
        def linear(inp: Ref, key: str, name: str, row: bool) -> Ref:
            if m.mlp_sparsity == "2:4":    # torchao SemiSparseLinear (tp = 1: api refuses 2:4 with tp > 1)
                return sparse_linear(ops, inp, p[f"{key}_w"], p.get(f"{key}_b"), name)
            return self._row_linear(inp, p, key, name) if row else self._column_linear(inp, x, p, key, name)

        if m.activation == "swiglu":
            act = ops.unary(linear(xin, "gate", f"{pre}.gate_proj", False), f"{pre}.silu", 4.0)
            up = linear(xin, "up", f"{pre}.up_proj", False)
            out = linear(ops.mul(act, up, f"{pre}.mul"), "down", f"{pre}.down_proj", True)
        else:
            act = ops.unary(linear(xin, "fc1", f"{pre}.c_fc", False), f"{pre}.gelu", 8.0)
            out = linear(act, "fc2", f"{pre}.c_proj", True)
        self.tape.hold(x, xin)             # the module's argument lives until forward returns
        return out

    def _adapted_linear(self, x: Ref, p: dict[str, Ref], key: str, name: str) -> Ref:
        """A block linear of a PEFT model: frozen (or NF4) base, plus its adapters when targeted."""
        pair = (p[f"{key}_lora_a"], p[f"{key}_lora_b"]) if f"{key}_lora_a" in p else None
        return self.adapters.linear(x, p[f"{key}_w"], p.get(f"{key}_b"), name, pair)

    # ------------------------------------------------------------------ tensor-parallel linears
    def _column_input(self, x: Ref, name: str) -> Ref:
        """Enter a column-parallel region: f (identity; all_reduce of the input gradient) or, with
        sequence parallelism, the all_gather of the s/t shard into the persistent buffer."""
        if self.tp == 1:
            return x
        if self.sp:
            return self.ops.gather_to_buffer(x, f"{name}.all_gather")
        return self.ops.copy_to_tp(x, f"{name}.copy_to_tp")

    def _column_linear(self, xin: Ref, shard: Ref, p: dict[str, Ref], key: str, name: str) -> Ref:
        """A column-parallel linear on the region's input; with sequence parallelism it saves the
        shard and re-gathers it in backward."""
        if self.adapters is not None:     # PEFT: tp = 1 (api refuses adapters with tp > 1)
            return self._adapted_linear(xin, p, key, name)
        return self.ops.linear(xin, p[f"{key}_w"], p.get(f"{key}_b"), name,
                               saved_shard=shard if self.sp else None)

    def _row_linear(self, x: Ref, p: dict[str, Ref], key: str, name: str) -> Ref:
        """A row-parallel linear: partial sums all_reduced (reduce_scattered to s/t tokens with
        sequence parallelism), then the replicated bias added (RowParallelLinear)."""
        bias = p.get(f"{key}_b")
        if self.adapters is not None:
            return self._adapted_linear(x, p, key, name)
        if self.tp == 1:
            return self.ops.linear(x, p[f"{key}_w"], bias, name)
        partial = self.ops.linear(x, p[f"{key}_w"], None, name)
        if self.sp:
            out = self.ops.reduce_scatter_sequence(partial, f"{name}.reduce_scatter")
        else:
            out = self.ops.reduce_from_tp(partial, f"{name}.all_reduce")
        if bias is None:
            return out
        promoted = "fp32" if "fp32" in (out.dtype, bias.dtype) else out.dtype
        return self.ops.add(out, bias, f"{name}.bias_add", out_dtype=promoted)

    # ------------------------------------------------------------------ attention
    def _attention(self, i: int, x: Ref) -> Ref:
        m, ops, tape, b = self.m, self.ops, self.tape, self.b
        p = self.layers[i]
        pre = f"layers.{i}.attn"
        s, hd = m.seq, m.head_dim
        nh, kv = m.heads // self.tp, m.kv_heads // self.tp
        h = m.hidden // self.tp           # this rank's share of the hidden size
        xin = self._column_input(x, f"{pre}.column_input")
        if m.architecture == "llama":
            q = tape.view(self._column_linear(xin, x, p, "q", f"{pre}.q_proj"), (b, nh, s, hd),
                          f"{pre}.q_view", grad_copies=True)
            k = tape.view(self._column_linear(xin, x, p, "k", f"{pre}.k_proj"), (b, kv, s, hd),
                          f"{pre}.k_view", grad_copies=True)
            v = tape.view(self._column_linear(xin, x, p, "v", f"{pre}.v_proj"), (b, kv, s, hd),
                          f"{pre}.v_view", grad_copies=True)
            q = self._rope(q, f"{pre}.rope_q")
            k = self._rope(k, f"{pre}.rope_k")
            k = self._repeat_kv(k, f"{pre}.repeat_k")
            v = self._repeat_kv(v, f"{pre}.repeat_v")
            holders = (q, k, v)
        else:
            qkv = self._column_linear(xin, x, p, "qkv", f"{pre}.c_attn")
            q, k, v = tape.views(qkv, ((b, nh, s, hd), (b, kv, s, hd), (b, kv, s, hd)), f"{pre}.split",
                                 cat_grad=True)
            holders = (qkv,)
        y, contiguous_out = self._core(i, q, k, v, pre)
        if not contiguous_out:
            y = ops.contiguous(y, f"{pre}.merge_heads")
        merged = tape.view(y, (b, s, h), f"{pre}.merge_view")
        out = self._row_linear(merged, p, "o", f"{pre}.o_proj")
        tape.hold(x, xin, merged, *holders)   # the argument and the locals live until forward returns
        return out

    def _rope(self, x: Ref, name: str) -> Ref:
        """x * cos + rotate_half(x) * sin (HF apply_rotary_pos_emb with cached tables).

        The tables have the build dtype: under bf16-mixed a bf16 x times fp32 tables promotes, so both products
        and the sum are fp32 (neg and cat stay bf16) and repeat_kv, SDPA and matmul see fp32 q and k.
        """
        ops, tape = self.ops, self.tape
        b, heads, s, hd = x.shape
        cos = tape.view(self.rope_cos, (s, hd), f"{name}.cos")
        sin = tape.view(self.rope_sin, (s, hd), f"{name}.sin")
        xc = ops.mul(x, cos, f"{name}.mul_cos")
        # rotate_half: cat(-x[..., h/2:], x[..., :h/2]); each slice's backward (slice_backward) allocates a full-size
        # gradient of x, and the two are accumulated.
        upper = tape.view(x, (b, heads, s, hd // 2), f"{name}.slice_upper", grad_copies=True)
        neg = ops.neg(upper, f"{name}.neg")
        lower = tape.view(x, (b, heads, s, hd // 2), f"{name}.slice_lower", grad_copies=True)
        rotated = ops.cat((neg, lower), x.shape, f"{name}.cat")
        rs = ops.mul(rotated, sin, f"{name}.mul_sin")
        out = ops.add(xc, rs, f"{name}.add")
        tape.hold(x)                       # apply_rope's argument lives until it returns
        return out

    def _repeat_kv(self, x: Ref, name: str) -> Ref:
        m = self.m
        rep = m.heads // m.kv_heads
        if rep == 1:
            return x
        b, kv, s, hd = x.shape
        expanded = self.tape.view(x, (b, kv, rep, s, hd), f"{name}.expand", grad_copies=True)
        return self.ops.contiguous(expanded, f"{name}.reshape")

    def _core(self, i: int, q: Ref, k: Ref, v: Ref, pre: str) -> tuple[Ref, bool]:
        """The attention core; returns (output, whether it is already laid out as (b, s, nh, hd))."""
        m, ops, tape = self.m, self.ops, self.tape
        selective = self.ckpt.selective
        if selective:
            tape.begin_checkpoint((q, k, v))
        flash = m.attention == "flash" and (m.dropout == 0.0 or ops.profile.flash_with_dropout)
        if m.attention == "flash":
            # SDPA is a lower-precision autocast op: q, k, v of another float dtype (LLaMA's fp32 RoPE outputs
            # under bf16-mixed) are cast first; the casts are what the kernel saves.
            q, k, v = (ops.autocast_operand(t, f"{pre}.{n}") for t, n in ((q, "q"), (k, "k"), (v, "v")))
        if flash:
            b, nh, s, hd = q.shape
            flops = 4.0 * b * nh * s * s * hd / 2   # causal: half the score matrix
            y = ops.sdpa_flash(q, k, v, (b, s, nh, hd), (b, nh, s), flops, f"{pre}.sdpa")
            y = tape.view(y, (b, nh, s, hd), f"{pre}.sdpa_view")
            contiguous_out = True
        elif m.attention == "flash":
            y = self._math_sdpa_core(q, k, v, pre)
            contiguous_out = False
        elif m.attention == "linformer":
            from simulator.workload.linformer import linformer_core

            y = linformer_core(self, i, q, k, v, pre)
            contiguous_out = False
        else:
            y = self._eager_core(q, k, v, pre)
            contiguous_out = False
        if selective:
            tape.end_checkpoint()
        return y, contiguous_out

    def _eager_core(self, q: Ref, k: Ref, v: Ref, pre: str) -> Ref:
        m, ops = self.m, self.ops
        b, nh, s, hd = q.shape
        # q @ k^T and probs @ v: autocast casts both operands (copies keeping their layout), then matmul copies
        # each one that cannot be viewed as (b*nh, rows, cols): q always (a head-transposed view, or LLaMA's RoPE
        # output, which keeps that layout); k and v unless repeat_kv already made them contiguous copies.
        repeated = m.architecture == "llama" and m.heads // m.kv_heads > 1
        qa = ops.autocast_operand(q, f"{pre}.q")
        ka = ops.autocast_operand(k, f"{pre}.k")
        qc = ops.contiguous(qa, f"{pre}.q_contiguous")
        kc = ka if repeated else ops.contiguous(ka, f"{pre}.k_contiguous")
        scores = ops.bmm(qc, kc, (b, nh, s, s), b * nh, s, s, hd, f"{pre}.scores")
        self.tape.hold(qa, ka)             # the autocast copies live until matmul returns
        scores = ops.div_by_scalar_tensor(scores, f"{pre}.scale")
        scores = ops.masked_fill(scores, (1, 1, s, s), f"{pre}.mask")
        masked = scores
        if m.architecture == "llama":
            probs = ops.softmax(scores, f"{pre}.softmax", out_dtype="fp32")
            probs = ops.cast(probs, q.dtype, f"{pre}.softmax_cast")
        else:
            probs = ops.softmax(scores, f"{pre}.softmax")
        probs = ops.dropout(probs, m.dropout, f"{pre}.attn_dropout")
        pa = ops.autocast_operand(probs, f"{pre}.probs")
        va = ops.autocast_operand(v, f"{pre}.v")
        vc = va if repeated else ops.contiguous(va, f"{pre}.v_contiguous")
        out = ops.bmm(pa, vc, (b, nh, s, hd), b * nh, s, hd, s, f"{pre}.context")
        self.tape.hold(masked, probs, va)  # locals `scores` and `probs` live until the core returns
        return out

    def _math_sdpa_core(self, q: Ref, k: Ref, v: Ref, pre: str) -> Ref:
        """SDPA's math fallback (CPU with dropout), as torch 2.13's _scaled_dot_product_attention_math
        runs it: q and k each scaled by sqrt(scale), a float causal mask built from ones().tril(),
        scores + mask, _safe_softmax, dropout, @ v. The scaled k and the mask live to the end."""
        m, ops, tape = self.m, self.ops, self.tape
        b, nh, s, hd = q.shape
        low = ops.autocast
        if low is not None:
            # Under CPU autocast SDPA runs in fp32: q, k, v are upcast first, and the attention
            # weights and the output are cast back to the autocast dtype at the end.
            q, k, v = (ops.cast(t, "fp32", f"{pre}.{n}_fp32") for t, n in ((q, "q"), (k, "k"), (v, "v")))
        qs = ops.scale(q, f"{pre}.q_scale")
        (ones,) = tape.node(f"{pre}.mask_ones", "elementwise", (), ((f"{pre}.mask_ones", (s, s), "bool"),),
                            requires_grad=False)
        (tril,) = tape.node(f"{pre}.mask_tril", "elementwise", (ones,), ((f"{pre}.mask_tril", (s, s), "bool"),),
                            requires_grad=False)
        (zero,) = tape.node(f"{pre}.mask_zero", "elementwise", (), ((f"{pre}.mask_zero", (), "fp32"),),
                            requires_grad=False)
        (neg_inf,) = tape.node(f"{pre}.mask_neg_inf", "elementwise", (), ((f"{pre}.mask_neg_inf", (), "fp32"),),
                               requires_grad=False)
        (mask,) = tape.node(f"{pre}.mask_where", "elementwise", (tril, zero, neg_inf),
                            ((f"{pre}.mask", (s, s), q.dtype),), requires_grad=False)
        ks = ops.scale(k, f"{pre}.k_scale")
        qc = ops.contiguous(qs, f"{pre}.q_contiguous")
        kc = ops.contiguous(ks, f"{pre}.k_contiguous")
        scores = ops.bmm(qc, kc, (b, nh, s, s), b * nh, s, s, hd, f"{pre}.scores")
        scores = ops.add(scores, mask, f"{pre}.add_mask")
        probs = ops.softmax(scores, f"{pre}.safe_softmax")
        probs = ops.dropout(probs, m.dropout, f"{pre}.attn_dropout")
        weights = ops.cast(probs, low, f"{pre}.weights_cast") if low is not None else probs
        vc = ops.contiguous(v, f"{pre}.v_contiguous")
        out = ops.bmm(probs, vc, (b, nh, s, hd), b * nh, s, hd, s, f"{pre}.context")
        if low is not None:
            context = out
            out = ops.cast(context, low, f"{pre}.output_cast")
            tape.hold(q, k, v, weights, context)
        tape.hold(ks, mask, probs)         # C++ locals of the math kernel, released when it returns
        return out

    # ------------------------------------------------------------------ head and loss
    def _head(self, x: Ref, targets: Ref) -> Ref:
        m, ops = self.m, self.ops
        x = self._norm(x, "lnf", self.top, "ln_f")
        if m.architecture == "vit":
            if self.sp:
                x = ops.gather_sequence(x, "ln_f.all_gather")
            cls = self.tape.view(x, (self.b, m.hidden), "cls_select", grad_copies=True)
            logits = ops.linear(cls, self.top["head"], self.top["head_b"], "head")
            return ops.cross_entropy(logits, targets, "loss")
        if m.architecture == "bert":
            x = ops.linear(x, self.top["mlm_w"], self.top.get("mlm_b"), "cls.transform.dense")
            x = ops.unary(x, "cls.transform.gelu", 8.0)
            x = self._norm(x, "mlm_ln", self.top, "cls.transform.LayerNorm")
        if self.tp > 1:
            xin = self._column_input(x, "lm_head.column_input")
            logits = self._column_linear(xin, x, {"head_w": self.top["head"], "head_b": self.top.get("mlm_bias")},
                                         "head", "lm_head")
            flat = self.tape.view(logits, (self.b * m.seq, self.vocab_rank), "logits_view")
            loss = ops.vocab_parallel_cross_entropy(flat, targets, "loss")
            self.tape.hold(x, xin, logits)
            return loss
        logits = ops.linear(x, self.top["head"], self.top.get("mlm_bias"), "lm_head")
        flat = self.tape.view(logits, (self.b * m.seq, m.vocab), "logits_view")
        loss = ops.cross_entropy(flat, targets, "loss")
        self.tape.hold(x, logits)      # locals of the model's forward, alive until it returns
        return loss



def model_parameter_count(shape: Shape) -> int:
    """Parameters of the whole (unsharded) model, as its builder declares them."""
    from simulator.workload.primitives import KernelProfile, Ops
    if shape.architecture == "resnet":
        from simulator.workload.resnet import resnet_parameter_count

        return resnet_parameter_count(shape)
    if shape.architecture == "dlrm":
        from simulator.workload.dlrm import dlrm_parameter_count

        return dlrm_parameter_count(shape)
    from simulator.workload.tape import Tape, numel

    builder = TransformerBuilder(Ops(Tape(), KernelProfile()), shape, "fp32", Checkpointing(), 1)
    return sum(numel(ref.shape) for ref in builder.params.refs)
