"""LoRA and QLoRA fine-tuning: frozen base weights, trainable low-rank adapters, NF4 base weights (docs/peft.md).

LoRA (Hu et al. 2021, arXiv:2106.09685) as Hugging Face PEFT's ``lora.Linear.forward`` runs it:
``result = base_layer(x) + lora_B(lora_A(dropout(x))) * (alpha / r)``, A of shape (r, in) and B of shape (out, r),
no biases. Every base parameter is frozen (``requires_grad = False``): it has no gradient and no optimizer state,
and autograd saves for a frozen linear only what its input gradient needs (the weight, not the input: torch's
codegen saves a matmul operand only when the other operand's gradient is required), so the backward through a
frozen weight computes input gradients only. The adapters add the input saved for A's weight gradient (or the
dropped-out input and its mask when dropout > 0), the r-wide intermediate saved for B's, two small GEMMs forward
and four backward.

QLoRA (Dettmers et al. 2023, arXiv:2305.14314) keeps each block linear's base weight as bitsandbytes' ``Params4bit``
(``quantize_4bit`` with quant_type "nf4", blocksize 64, compress_statistics = True: double quantisation): the packed
4-bit codes (n/2 bytes), one 8-bit absmax per 64-element block, and for those absmaxes a second-level fp32 scale per
256 blocks, an fp32 offset and the 16-entry NF4 code table (bitsandbytes/functional.py ``quantize_4bit``,
``QuantState``). ``MatMul4Bit`` (bitsandbytes/autograd/_functions.py) dequantises the weight into a temporary of the
compute dtype before the forward GEMM and again before the input-gradient GEMM, and saves nothing but the packed
weight. Dequantising first expands the absmaxes into an fp32 temporary (``dequantize_blockwise`` of the nested state).
Embeddings, norms and the LM head stay in the compute dtype, as transformers' BitsAndBytes integration leaves them.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.errors import PlanError
from simulator.workload.graph import DTYPE_BYTES, ELEMENTWISE, GEMM, PARAMETERS
from simulator.workload.tape import Grad, Kernel, Ref, numel

NF4_BLOCK = 64                 # bitsandbytes quantize_4bit blocksize (QLoRA: 64)
NESTED_BLOCK = 256             # double quantisation: quantize_blockwise(absmax, blocksize=256)
NF4_CODE_ENTRIES = 16          # get_4bit_type("nf4"): 16 fp32 values per QuantState
DYNAMIC_MAP_ENTRIES = 256      # the 8-bit dynamic map of the nested absmax, one tensor shared by every weight

# The linears of a block, by memsim's parameter key, with the names a model's modules have (HF LLaMA, GPT-2).
LLAMA_MODULES = (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "o"))
GPT_MODULES = (("c_attn", "qkv"), ("attn.c_proj", "o"))
SWIGLU_MODULES = (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))
GELU_MODULES = (("c_fc", "fc1"), ("mlp.c_proj", "fc2"))
# PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: llama q_proj, v_proj; gpt2 c_attn; BERT and ViT query,
# value (memsim's bert and vit have one fused c_attn projection).
DEFAULT_TARGETS = {"llama": ("q_proj", "v_proj"), "gpt": ("c_attn",), "bert": ("c_attn",), "vit": ("c_attn",)}


@dataclass(frozen=True)
class LoraConfig:
    """The resolved adapters: which linears (memsim parameter keys), their rank, scale and dropout."""

    kind: str = "none"                   # none | lora | qlora
    rank: int = 8
    alpha: float = 8.0
    targets: frozenset[str] = frozenset()
    dropout: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    @property
    def quantized(self) -> bool:
        return self.kind == "qlora"


def block_modules(architecture: str, activation: str) -> tuple[tuple[str, str], ...]:
    """(module name, parameter key) of every linear in a block of this model."""
    attention = LLAMA_MODULES if architecture == "llama" else GPT_MODULES
    return attention + (SWIGLU_MODULES if activation == "swiglu" else GELU_MODULES)


def resolve_targets(names: tuple[str, ...], architecture: str, activation: str) -> frozenset[str]:
    """The parameter keys `training.lora_target_modules` names (PEFT matches a module name's suffix).

    Raises:
        PlanError: a name no linear of the model's blocks has.
    """
    if architecture not in DEFAULT_TARGETS:
        raise PlanError(f"training.peft with model.architecture = {architecture!r}: adapters are simulated on "
                        f"transformer linears; allowed: {', '.join(DEFAULT_TARGETS)}")
    modules = block_modules(architecture, activation)
    if names == ("auto",):
        names = DEFAULT_TARGETS[architecture]
    if names == ("all-linear",):
        return frozenset(key for _, key in modules)
    keys: set[str] = set()
    for name in names:
        hits = [key for module, key in modules if module == name or module.endswith("." + name)]
        if not hits:
            allowed = ", ".join(m for m, _ in modules)
            raise PlanError(f"training.lora_target_modules: {name!r} is not a linear of a {architecture} block "
                            f"(allowed: {allowed}, all-linear, auto)")
        keys.update(hits)
    return frozenset(keys)


def check_peft(config: LoraConfig, *, precision: str, framework: str, tp: int, pp: int, zero_stage: int,
               offloading: bool, compression: str, sparsity: str, shared_layers: bool, device_kind: str,
               device: str, shapes: dict[str, tuple[int, int]]) -> None:
    """Refuse what memsim does not simulate with LoRA / QLoRA, one line naming the keys and the rule.

    `shapes`: (out, in) of each targeted linear, for the rank check.
    """
    if not config.enabled:
        return
    key = f"training.peft = {config.kind!r}"
    for target, (out_f, in_f) in sorted(shapes.items()):
        if config.rank > min(out_f, in_f):
            raise PlanError(f"training.lora_rank = {config.rank}: larger than a targeted linear's dimensions "
                            f"({target}: {out_f} x {in_f}); allowed: 1 .. {min(out_f, in_f)}")
    if framework != "torch":
        raise PlanError(f"{key} with training.framework = {framework!r}: memsim simulates PEFT's adapters on a "
                        f"torch model only; allowed: framework = 'torch'")
    if precision == "fp8-mixed":
        raise PlanError(f"{key} with training.precision = 'fp8-mixed' is not simulated; allowed: fp32, bf16, "
                        f"bf16-mixed, fp16-mixed")
    for name, value, allowed in (("parallel.tp", tp, 1), ("parallel.pp", pp, 1)):
        if value != allowed:
            raise PlanError(f"{key} with {name} = {value}: adapters on sharded or staged layers are not simulated; "
                            f"allowed: {name.split('.')[1]} = 1")
    if zero_stage > 2:
        raise PlanError(f"{key} with parallel.zero_stage = 3: sharding frozen and trainable parameters apart is not "
                        f"simulated; allowed: zero_stage 0, 1, 2")
    if offloading:
        raise PlanError(f"{key} with parallel.offload_*: offload of a PEFT model is not simulated; allowed: none")
    if compression != "none":
        raise PlanError(f"{key} with parallel.gradient_compression = {compression!r} is not simulated; allowed: none")
    if sparsity != "none":
        raise PlanError(f"{key} with training.sparsity = {sparsity!r}: torchao's 2:4 training updates the dense "
                        f"weight, which LoRA freezes; allowed: sparsity = 'none'")
    if shared_layers:
        raise PlanError(f"{key} with model.share_layers = true is not simulated; allowed: false")
    if config.quantized and device_kind != "gpu":
        raise PlanError(f"{key}: device {device!r} has no bitsandbytes 4-bit kernels (NF4 quantisation and "
                        f"MatMul4Bit run on GPUs); use a GPU device or training.peft = 'lora'")


def frozen_dtype(param_dtype: str, autocast: str | None) -> str:
    """The dtype of frozen base weights: under mixed precision the compute dtype (PEFT models are loaded with
    torch_dtype = bfloat16: a frozen weight needs no fp32 master), else the parameter dtype."""
    return autocast or param_dtype


def nf4_parts(out_f: int, in_f: int) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """(suffix, shape, dtype) of the storages of one Params4bit weight with double quantisation."""
    n = out_f * in_f
    blocks = -(-n // NF4_BLOCK)
    return (("nf4", ((n + 1) // 2,), "uint8"), ("absmax", (blocks,), "uint8"),
            ("absmax2", (-(-blocks // NESTED_BLOCK),), "fp32"), ("offset", (), "fp32"),
            ("code", (NF4_CODE_ENTRIES,), "fp32"))


def quantized_bytes(out_f: int, in_f: int) -> int:
    """Bytes of one NF4 weight with its quantisation state (without the shared dynamic map)."""
    return sum(numel(shape) * DTYPE_BYTES[dtype] for _, shape, dtype in nf4_parts(out_f, in_f))


class Adapters:
    """Declares a builder's frozen parameters and adapters, and records LoRA / QLoRA linears."""

    def __init__(self, config: LoraConfig, ops, adapter_dtype: str, base_dtype: str):
        self.config = config
        self.ops = ops
        self.adapter_dtype = adapter_dtype
        self.base_dtype = base_dtype
        self.frozen: list[Ref] = []          # persistent, no gradient
        self.frozen_count = 0                # base parameters (an NF4 weight counts its out x in elements)
        self.quant: dict[int, tuple[Ref, int, tuple[int, int]]] = {}   # packed id -> (absmax, blocks, shape)
        self.dynamic_map: Ref | None = None

    def frozen_param(self, name: str, shape: tuple[int, ...]) -> Ref:
        ref = self.ops.tape.storage(name, shape, self.base_dtype, PARAMETERS)
        self.frozen.append(ref)
        self.frozen_count += numel(shape)
        return ref

    def base_weight(self, name: str, out_f: int, in_f: int) -> Ref:
        """A block linear's frozen weight: NF4 storages under QLoRA (the packed codes stand for it), else dense."""
        if not self.config.quantized:
            return self.frozen_param(name, (out_f, in_f))
        self.frozen_count += out_f * in_f
        tape = self.ops.tape
        refs = [tape.storage(f"{name}.{suffix}", shape, dtype, PARAMETERS) for suffix, shape, dtype
                in nf4_parts(out_f, in_f)]
        self.frozen += refs
        if self.dynamic_map is None:
            self.dynamic_map = tape.storage("bnb.dynamic_map", (DYNAMIC_MAP_ENTRIES,), "fp32", PARAMETERS)
            self.frozen.append(self.dynamic_map)
        self.quant[refs[0].id] = (refs[1], refs[1].shape[0], (out_f, in_f))
        return refs[0]

    def linear_params(self, builder, prefix: str, in_f: int, out_f: int, key: str) -> dict[str, Ref]:
        """A block linear's frozen (or NF4) weight and bias and, when targeted, the adapters lora_A (r, in) and
        lora_B (out, r) in the adapter dtype, registered after the base layer as PEFT does (`builder.params`)."""
        targeted = key in self.config.targets
        out = {"w": self.base_weight(f"{prefix}.base_layer.weight" if targeted else f"{prefix}.weight", out_f, in_f)}
        if builder.m.bias:
            out["b"] = self.frozen_param(f"{prefix}.bias", (out_f,))
        if targeted:
            r = self.config.rank
            out["lora_a"] = builder.params.add(self.ops, f"{prefix}.lora_A.weight", (r, in_f), self.adapter_dtype)
            out["lora_b"] = builder.params.add(self.ops, f"{prefix}.lora_B.weight", (out_f, r), self.adapter_dtype)
        return out

    def linear(self, x: Ref, w: Ref, bias: Ref | None, name: str, adapters: tuple[Ref, Ref] | None) -> Ref:
        """The base linear (dense frozen or NF4), plus ``lora_B(lora_A(dropout(x))) * scaling`` when adapted."""
        ops = self.ops
        if w.id in self.quant:
            out = self._quantized_linear(x, w, bias, name)
        else:
            out = ops.linear(x, w, bias, name)
        if adapters is None:
            return out
        a, b = adapters
        h = ops.dropout(x, self.config.dropout, f"{name}.lora_dropout")
        low = ops.linear(h, a, None, f"{name}.lora_A")
        up = ops.linear(low, b, None, f"{name}.lora_B")
        scaled = ops.scale(up, f"{name}.lora_scale")
        if scaled.dtype != out.dtype:       # fp32 compute under autocast never happens here (frozen_dtype)
            raise PlanError(f"{name}: adapter output {scaled.dtype} and base output {out.dtype} differ")
        result = ops.add(out, scaled, f"{name}.lora_add")
        ops.tape.hold(h)
        return result

    def _quantized_linear(self, x: Ref, packed: Ref, bias: Ref | None, name: str) -> Ref:
        """bitsandbytes MatMul4Bit: dequantise (an fp32 absmax temporary, a compute-dtype weight), F.linear, free;
        the backward dequantises again for the input gradient (module docstring)."""
        ops, tape = self.ops, self.ops.tape
        absmax, blocks, (out_f, in_f) = self.quant[packed.id]
        x = ops._autocast_input(x, name)
        dt = x.dtype
        e = DTYPE_BYTES[dt]
        n = out_f * in_f
        dequant_read = packed.nbytes + absmax.nbytes + 4 * blocks
        absmax_temp = (((blocks,), "fp32"),)
        (weight,) = tape.node(f"{name}.dequantize_4bit", ELEMENTWISE, (packed, absmax),
                              ((f"{name}.dequantized", (out_f, in_f), dt),), flops=2.0 * n,
                              bytes_read=dequant_read, bytes_written=n * e + 4 * blocks, dtype=dt,
                              workspace=absmax_temp, requires_grad=False)
        rows = numel(x.shape[:-1])
        flops = 2.0 * rows * in_f * out_f
        kernels = (
            # The dequantised weight lives from this kernel through the GEMM: held by both (released and taken
            # again in between, the same size: both peaks are torch's; docs/peft.md).
            Kernel("bwd_dequantize_4bit", ELEMENTWISE, flops=2.0 * n, bytes_read=dequant_read,
                   bytes_written=n * e + 4 * blocks, dtype=dt, workspace=absmax_temp + (((out_f, in_f), dt),)),
            Kernel("dgrad", GEMM, flops=flops, bytes_read=rows * out_f * e + n * e, bytes_written=rows * in_f * e,
                   dtype=dt, gemm_mnk=(rows, in_f, out_f), grads=(Grad(0, dtype=dt),),
                   workspace=(((out_f, in_f), dt),)),
        )
        inputs = (x, weight) + ((bias,) if bias is not None else ())
        (out,) = tape.node(name, GEMM, inputs, ((name, x.shape[:-1] + (out_f,), dt),), saves=(packed,),
                           flops=flops, bytes_read=x.nbytes + n * e, dtype=dt, gemm_mnk=(rows, out_f, in_f),
                           backward=kernels)
        return out
