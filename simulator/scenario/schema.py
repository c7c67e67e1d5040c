"""Scenario value types (frozen) and the key tables that parse, default and document every scenario key."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

from simulator.hardware.attention_backend import BACKEND_CHOICES
from simulator.scenario.cnn_model import RESNET_BLOCKS, block_counts
from simulator.scenario.dlrm_model import PLACEMENTS, int_array, rows_per_table
from simulator.scenario.parsers import (  # noqa: F401  parsers the key tables use, and names callers import from here
    SCHEDULES, Invalid, short_repr, did_you_mean, int_at_least, int_between, positive_float, unit_fraction,
    fraction_below_one, boolean, choice, text, string, optional_path, size_bytes, recompute_mode,
    gradient_compression, loss_scale, schedule_name, is_schedule_file, topology_name, topology_is_path,
    max_split_size, roundup_power2_divisions, context_bytes, host_memory_size, auto_or_bool, module_list,
)

ARCHITECTURES = ("gpt", "llama", "bert", "vit", "resnet", "dlrm")
TRANSFORMERS = ("gpt", "llama", "bert", "vit")     # resnet: scenario/cnn_model.py; dlrm: scenario/dlrm_model.py
ACTIVATIONS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
ATTENTIONS = ("flash", "eager", "linformer")
PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16", "fp8-mixed")
FRAMEWORKS = ("torch", "megatron", "deepspeed")
OPTIMIZERS = ("adamw", "adam-8bit", "sgd", "sgd-momentum", "adafactor")
OPTIMIZER_IMPLEMENTATIONS = ("auto", "foreach", "single-tensor", "fused")
ACTIVATION_COMPRESSIONS = ("none", "int8")
OFFLOAD_TARGETS = ("none", "cpu", "nvme")
COMPRESSION_STAGES = ("compressed", "warmup")
SPARSITIES = ("none", "2:4")
PEFTS = ("none", "lora", "qlora")
ALLOCATOR_KINDS = ("caching", "exact", "auto")
PRICINGS = ("rent", "own")
SECTIONS = ("model", "training", "parallel", "cluster", "allocator", "run", "sweep")


# Architecture-style defaults (HF GPT-2 / LLaMA-2 / BERT / ViT configurations).
ARCH_DEFAULTS: Mapping[str, Mapping[str, object]] = MappingProxyType({
    "gpt": MappingProxyType({"activation": "gelu", "norm": "layernorm", "norm_eps": 1e-5, "bias": True,
                             "dropout": 0.1, "tied_embeddings": True, "post_norm": False}),
    "llama": MappingProxyType({"activation": "swiglu", "norm": "rmsnorm", "norm_eps": 1e-5, "bias": False,
                               "dropout": 0.0, "tied_embeddings": False, "post_norm": False,
                               "rope_theta": 10000.0}),
    "bert": MappingProxyType({"activation": "gelu", "norm": "layernorm", "norm_eps": 1e-12, "bias": True,
                              "dropout": 0.1, "tied_embeddings": True, "post_norm": True, "type_vocab_size": 2}),
    "vit": MappingProxyType({"activation": "gelu", "norm": "layernorm", "norm_eps": 1e-12, "bias": True,
                             "dropout": 0.0, "tied_embeddings": False, "post_norm": False, "image_size": 224,
                             "patch_size": 16, "num_channels": 3, "num_classes": 1000}),
})

# Model keys that only some architectures use (one name or a tuple of them).
ARCH_ONLY_KEYS: Mapping[str, str | tuple[str, ...]] = MappingProxyType({
    "rope_theta": "llama", "type_vocab_size": "bert", "image_size": ("vit", "resnet"), "patch_size": "vit",
    "num_channels": ("vit", "resnet"), "num_classes": ("vit", "resnet"), "resnet_blocks": "resnet",
    "resnet_block": "resnet", **{key: "dlrm" for key in (
        "embedding_rows", "embedding_tables", "embedding_dim", "lookups_per_table", "dense_features", "bottom_mlp",
        "top_mlp", "embedding_placement")},
})


@dataclass(frozen=True)
class KeySpec:
    """One scenario key: how its value is parsed, its default and its documentation."""

    key: str
    parse: Callable[[object], object]
    default: object
    type_doc: str
    default_doc: str
    doc: str


def toml_text(value: object) -> str:
    """How `value` is written in TOML (strings quoted, booleans lower case, None as none)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def optional_positive(value: object) -> float | None:
    """Parser for "none" (None) or a finite number > 0."""
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    try:
        return positive_float(value)
    except Invalid:
        raise Invalid('must be a number > 0 or "none"') from None


def grid_table(value: object) -> tuple[tuple[str, tuple], ...]:
    """Parser for [sweep] grid: section.key = [values] (dotted keys or nested tables), in document order.

    Only the shape is checked here; the loader checks each key path and each value against its key's parser.
    """
    if not isinstance(value, Mapping):
        raise Invalid('must be a table of section.key = [values], e.g. [sweep.grid] parallel.tp = [1, 2]')
    axes: list[tuple[str, tuple]] = []
    for head, body in value.items():
        items = body.items() if isinstance(body, Mapping) else [(None, body)]
        for key, values in items:
            path = str(head) if key is None else f"{head}.{key}"
            if not isinstance(values, list) or not values or any(isinstance(v, (dict, list)) for v in values):
                raise Invalid(f"{path} = {short_repr(values)}: must be a non-empty array of values")
            axes.append((path, tuple(values)))
    return tuple(axes)


def _k(key: str, parse: Callable[[object], object], default: object, type_doc: str, doc: str,
       default_doc: str | None = None) -> KeySpec:
    return KeySpec(key, parse, default, type_doc, toml_text(default) if default_doc is None else default_doc, doc)


_POS = int_at_least(1)
_ARCH_DEFAULT = "by architecture"

MODEL_KEYS: tuple[KeySpec, ...] = (
    _k("preset", text, None, "str", "a preset name (see presets); its values are the base, explicit keys override them", "none"),
    _k("hf_config", text, None, "path", "a Hugging Face config.json (or its folder), relative to the scenario file; base values like a preset", "none"),
    _k("architecture", choice(ARCHITECTURES), None, " | ".join(ARCHITECTURES), "model family (required unless a preset or hf_config gives it)", "required"),
    _k("num_layers", _POS, None, "int >= 1", "transformer blocks", "required"),
    _k("hidden_size", _POS, None, "int >= 1", "model width h; must be divisible by num_attention_heads", "required"),
    _k("num_attention_heads", _POS, None, "int >= 1", "query heads", "required"),
    _k("num_kv_heads", _POS, None, "int >= 1", "key/value heads (GQA/MQA); must divide num_attention_heads", "num_attention_heads"),
    _k("ffn_hidden_size", _POS, None, "int >= 1", "MLP inner width", "gpt/bert/vit: 4h; llama: 256 * ceil((8h/3) / 256)"),
    _k("vocab_size", _POS, None, "int >= 1", "token vocabulary (not used by vit)", "required (vit: 0)"),
    _k("seq_length", _POS, None, "int >= 1", "tokens per sample; vit derives it as (image_size/patch_size)^2 + 1", "max_position_embeddings"),
    _k("max_position_embeddings", _POS, None, "int >= 1", "position table size; gpt/bert need seq_length <= it", "seq_length"),
    _k("activation", choice(ACTIVATIONS), None, " | ".join(ACTIVATIONS), "MLP activation", "llama: swiglu; others: gelu"),
    _k("norm", choice(NORMS), None, " | ".join(NORMS), "normalisation layer", "llama: rmsnorm; others: layernorm"),
    _k("norm_eps", positive_float, None, "float > 0", "normalisation epsilon", "gpt/llama: 1e-5; bert/vit: 1e-12"),
    _k("bias", boolean, None, "bool", "linear layers have biases", "llama: false; others: true"),
    _k("attention", choice(ATTENTIONS), "flash", " | ".join(ATTENTIONS), "fused (flash/SDPA), eager, or Linformer's low-rank attention (bert and vit: it has no causal form)"),
    _k("linformer_k", _POS, None, "int >= 1", "Linformer: keys and values projected along the sequence to this length (< seq_length); required with attention = linformer", "none"),
    _k("dropout", fraction_below_one, None, "float in [0, 1)", "dropout probability (residual, attention, embeddings)", "gpt/bert: 0.1; llama/vit: 0.0"),
    _k("tied_embeddings", boolean, None, "bool", "output head shares the token embedding", "gpt/bert: true; llama/vit: false"),
    _k("share_layers", boolean, False, "bool", "ALBERT's cross-layer sharing: every transformer layer runs with the first layer's parameters (one set of weights and optimizer states; gradients summed over the uses; activations per layer)"),
    _k("post_norm", boolean, None, "bool", "normalisation after the residual add (BERT) instead of before", "bert: true; others: false"),
    _k("rope_theta", positive_float, None, "float > 0", "rotary embedding base (llama only)", "llama: 10000.0"),
    _k("type_vocab_size", _POS, None, "int >= 1", "token-type embeddings (bert only)", "bert: 2"),
    _k("image_size", _POS, None, "int >= 1", "input image side in pixels (vit and resnet)", "vit, resnet: 224"),
    _k("patch_size", _POS, None, "int >= 1", "patch side in pixels; must divide image_size (vit only)", "vit: 16"),
    _k("num_channels", _POS, None, "int >= 1", "input image channels (vit and resnet)", "vit, resnet: 3"),
    _k("num_classes", _POS, None, "int >= 1", "classifier outputs (vit and resnet)", "vit, resnet: 1000"),
    _k("resnet_blocks", block_counts, None, "array of int >= 1", "resnet: residual blocks per stage (ResNet-50: [3, 4, 6, 3]); stage i has width 64 * 2^i", "required for resnet (or a resnet preset)"),
    _k("resnet_block", choice(RESNET_BLOCKS), None, " | ".join(RESNET_BLOCKS), "resnet: bottleneck (1x1, 3x3, 1x1, 4x wider out; ResNet-50/101/152) or basic (3x3, 3x3; ResNet-18/34) blocks", "resnet: bottleneck"),
    _k("embedding_rows", rows_per_table, None, "int >= 1 | array of int >= 1", "dlrm: rows of each embedding table (one number for every table, with embedding_tables)", "required for dlrm (or a dlrm preset)"),
    _k("embedding_tables", _POS, None, "int >= 1", "dlrm: number of embedding tables (categorical features) when embedding_rows is one number", "len(embedding_rows)"),
    _k("embedding_dim", _POS, None, "int >= 1", "dlrm: embedding dimension (the bottom MLP's output width)", "required for dlrm"),
    _k("lookups_per_table", _POS, None, "int >= 1", "dlrm: indices sum-pooled per table and sample (1: one-hot categorical features)", "dlrm: 1"),
    _k("dense_features", _POS, None, "int >= 1", "dlrm: dense input features", "dlrm: 13"),
    _k("bottom_mlp", int_array, None, "array of int >= 1", "dlrm: bottom MLP widths; the last equals embedding_dim", "required for dlrm"),
    _k("top_mlp", int_array, None, "array of int >= 1", "dlrm: top MLP widths; the last is 1", "required for dlrm"),
    _k("embedding_placement", choice(PLACEMENTS), None, " | ".join(PLACEMENTS), "dlrm: where the embedding tables live: GPU parameters, or host memory with pooled lookups copied over PCIe and the sparse update on the host (docs/model-options.md; needs a topology with host memory)", "dlrm: device"),
)

TRAINING_KEYS: tuple[KeySpec, ...] = (
    _k("micro_batch_size", _POS, 1, "int >= 1", "samples per microbatch per data-parallel rank"),
    _k("global_batch_size", _POS, None, "int >= 1", "samples per iteration; a multiple of micro_batch_size * parallel.dp", "micro_batch_size * parallel.dp"),
    _k("precision", choice(PRECISIONS), "bf16-mixed", " | ".join(PRECISIONS), "numeric format of parameters, activations and gradients"),
    _k("framework", choice(FRAMEWORKS), "torch", " | ".join(FRAMEWORKS), "whose mixed-precision memory layout to model"),
    _k("optimizer", choice(OPTIMIZERS), "adamw", " | ".join(OPTIMIZERS), "optimizer (sets optimizer-state bytes)"),
    _k("optimizer_implementation", choice(OPTIMIZER_IMPLEMENTATIONS), "auto", " | ".join(OPTIMIZER_IMPLEMENTATIONS), "torch optimizer kernel style; auto = what torch picks on the device (megatron, deepspeed on a GPU: their fused Adam)"),
    _k("recompute", recompute_mode, "none", 'none | selective | full | "segments:N"', "activation checkpointing (segments:N = checkpoint_sequential)"),
    _k("activation_compression", choice(ACTIVATION_COMPRESSIONS), "none", " | ".join(ACTIVATION_COMPRESSIONS), "compression of saved activations"),
    _k("sparsity", choice(SPARSITIES), "none", " | ".join(SPARSITIES), "2:4 semi-structured sparsity of the MLP linears in training, as torchao's SemiSparseLinear (bf16, sparse tensor cores; docs/model-options.md)"),
    _k("peft", choice(PEFTS), "none", " | ".join(PEFTS), "parameter-efficient fine-tuning: lora = frozen base weights with trainable low-rank adapters (PEFT's LoraLayer); qlora = the same on bitsandbytes NF4 base weights with double quantisation (docs/peft.md); the lora_* keys, also as a [training.lora] table (rank = ..., alpha = ...)"),
    _k("lora_rank", _POS, 8, "int >= 1", "LoRA rank r: adapters A (r x in) and B (out x r); at most min(in, out) of every target (PEFT's default 8)"),
    _k("lora_alpha", positive_float, 8.0, "float > 0", "LoRA alpha: the adapter output is scaled by alpha / r (PEFT's default 8)"),
    _k("lora_target_modules", module_list, ("auto",), '"auto" | "all-linear" | names', "linears that get adapters, named as the model has them (llama: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; gpt/bert/vit: c_attn, attn.c_proj, c_fc, mlp.c_proj, c_proj = both); auto = PEFT's default for the architecture (llama: q_proj, v_proj; others: c_attn); all-linear = every linear of the blocks", '"auto"'),
    _k("lora_dropout", fraction_below_one, 0.0, "float in [0, 1)", "dropout on the adapters' input (its mask is saved for backward; PEFT's default 0)"),
    _k("loss_scale", loss_scale, "dynamic", '"dynamic" | float > 0', "fp16-mixed loss scaling: dynamic (torch GradScaler, Megatron DynamicGradScaler, DeepSpeed DynamicLossScaler) or a static scale (Megatron, DeepSpeed); other precisions: dynamic only"),
    _k("skipped_steps_fraction", fraction_below_one, 0.0, "float in [0, 1)", "fp16-mixed: share of iterations whose optimizer step the loss scaler skips (an overflow); iteration_time_s averages both kinds"),
    _k("attention_backend", choice(BACKEND_CHOICES), "auto", " | ".join(BACKEND_CHOICES), "fused attention kernel with model.attention = flash: cudnn, flash2 (FlashAttention-2), flash3 (FlashAttention-3, Hopper); auto = what torch's SDPA and Transformer Engine pick on the GPU (Hopper: cuDNN; Ampere, Ada, MI300X: FlashAttention-2), the backend of its measured attention_efficiency (hardware/measured.py)"),
    _k("cuda_graphs", boolean, False, "bool", "the training step is captured as CUDA graphs and replayed: no per-kernel host launch cost (parallel/host_issue.py); needs a GPU, no ZeRO-3, a static loss scale with fp16-mixed and no skipped steps, no offload, not deepspeed"),
    _k("vocab_divisible_by", _POS, None, "int >= 1", "pad the vocabulary to a multiple of this times parallel.tp (Megatron --make-vocab-size-divisible-by)", "megatron: 128; others: 1"),
)

PARALLEL_KEYS: tuple[KeySpec, ...] = (
    _k("tp", _POS, 1, "int >= 1", "tensor-parallel degree; divides num_attention_heads and num_kv_heads"),
    _k("pp", _POS, 1, "int >= 1", "pipeline-parallel stages; at most num_layers"),
    _k("dp", _POS, 1, "int >= 1", "data-parallel degree"),
    _k("sequence_parallel", boolean, False, "bool", "Megatron sequence parallelism over the tp group"),
    _k("schedule", schedule_name, "1f1b", " | ".join(SCHEDULES) + " | path", "pipeline schedule, or an action file (relative to the scenario file)"),
    _k("virtual_stages", _POS, 1, "int >= 1", "model chunks per pipeline stage; divides num_layers / pp"),
    _k("zero_stage", int_between(0, 3), 0, "0 | 1 | 2 | 3", "ZeRO sharding of optimizer states (1), gradients (2), parameters (3)"),
    _k("offload_optimizer", choice(OFFLOAD_TARGETS), "none", " | ".join(OFFLOAD_TARGETS), "where optimizer states live: DeepSpeed ZeRO-Offload / ZeRO-Infinity (framework deepspeed, adamw, zero_stage 2 or 3; nvme: 3 and a topology with drives): master, gradients and Adam states in host memory (or on NVMe), CPU-Adam on the host"),
    _k("offload_params", choice(OFFLOAD_TARGETS), "none", " | ".join(OFFLOAD_TARGETS), "where parameters live between uses: ZeRO-3 offload_param (zero_stage 3, with offload_optimizer), fetched ahead over PCIe (nvme: read from the drives first)"),
    _k("offload_activations", choice(OFFLOAD_TARGETS), "none", "none | cpu", "where saved activations wait for backward; cpu = torch's save_on_cpu(pin_memory=True) (framework torch or deepspeed, no recompute); nvme is refused with the reason"),
    _k("gradient_compression", gradient_compression, "none", 'none | 1bit | int8 | "topk:F" | "powersgd:R"', "compression of data-parallel gradient traffic: 1bit = DeepSpeed 1-bit Adam, int8 = Bagua ByteGrad, topk = GRACE top-k, powersgd = torch's PowerSGD hook (docs/compression.md)"),
    _k("gradient_compression_stage", choice(COMPRESSION_STAGES), "compressed", " | ".join(COMPRESSION_STAGES), "which iteration is simulated: compressed, or the uncompressed warm-up before it (1bit: before freeze_step; powersgd: before start_powerSGD_iter)"),
    _k("bucket_size", size_bytes, 25_000_000, "size", "gradient bucket size (DDP bucket_cap_mb)", '"25 MB" (25000000)'),
    _k("prefetch_bucket_size", int_at_least(0), 50_000_000, "int >= 0", "offloaded parameters are fetched while the segments fetched ahead hold fewer elements than this (DeepSpeed stage3_prefetch_bucket_size; 0: no prefetch)"),
    _k("placement", text, "auto", "str", "how ranks map onto devices; auto = the parallel layer's default order"),
    _k("tp_comm_overlap", auto_or_bool, "auto", '"auto" | bool', "tensor-parallel all_gather / reduce_scatter split into chunks pipelined with their GEMMs (Transformer Engine userbuffers, Megatron --tp-comm-overlap); needs sequence_parallel; auto = the framework's default (parallel/overlap.py)", '"auto" (all frameworks: false)'),
    _k("tp_backward_overlap", auto_or_bool, "auto", '"auto" | bool', "a column-parallel layer's backward collectives run during its GEMMs (input all_gather with the dgrad GEMM, the dgrad reduce_scatter / all_reduce with the wgrad GEMM); auto = the framework's default", '"auto" (megatron: true; torch, deepspeed: false)'),
    _k("overlap_grad_reduce", auto_or_bool, "auto", '"auto" | bool', "data-parallel gradient reductions run during the backward as buckets fill; false: Megatron reduces every bucket after the backward, DeepSpeed waits for each bucket where it fills; auto = the framework's default", '"auto" (torch: true; megatron: false; deepspeed: true with ZeRO-3, else false)'),
    _k("overlap_param_gather", auto_or_bool, "auto", '"auto" | bool', "with ZeRO-1/2 (Megatron's distributed optimizer), the updated parameters' all_gather runs during the next forward instead of after the step; auto = the framework's default", '"auto" (all frameworks: false)'),
    _k("overlap_p2p_comm", auto_or_bool, "auto", '"auto" | bool', "pipeline sends run while the stage computes; false: a stage waits for its sends to complete before its next action (Megatron's blocking send/recv, DeepSpeed); auto = the framework's default", '"auto" (torch: true; megatron: true with interleaved-1f1b, else false; deepspeed: false)'),
)

CLUSTER_KEYS: tuple[KeySpec, ...] = (
    _k("topology", topology_name, "dgx-a100", "str | path", "a topology name from topologies/ or a TOML path (relative to the scenario file)"),
    _k("nodes", _POS, 1, "int >= 1", "number of nodes of that topology"),
    _k("calibration", optional_path, None, 'path | "none"', "fitted device/link parameters (relative to the scenario file)", "none"),
    _k("host_memory", host_memory_size, None, '"auto" | size > 0', "host memory of each node, what offload may fill; auto = the topology's (its host_memory capacities)", '"auto"'),
)

ALLOCATOR_KEYS: tuple[KeySpec, ...] = (
    _k("kind", choice(ALLOCATOR_KINDS), "auto", " | ".join(ALLOCATOR_KINDS), "allocator model; auto = caching on GPUs, exact on cpu"),
    _k("max_split_size", max_split_size, None, '"unlimited" | size >= 20 MiB', "PYTORCH_ALLOC_CONF max_split_size (None = unlimited)", '"unlimited"'),
    _k("roundup_power2_divisions", roundup_power2_divisions, None, '"none" | 1 | 2 | 4 | 8 | 16', "PYTORCH_ALLOC_CONF roundup_power2_divisions", '"none"'),
    _k("expandable_segments", boolean, False, "bool", "PYTORCH_ALLOC_CONF expandable_segments"),
    _k("memory_fraction", unit_fraction, 1.0, "float in (0, 1]", "torch.cuda.set_per_process_memory_fraction: the caching allocator's reserved bytes may not pass this fraction of the device's total memory (1.0: not set)"),
    _k("context_bytes", context_bytes, None, '"auto" | size', "memory outside the allocator (CUDA context, NCCL, cuBLAS); auto = the device's value", '"auto"'),
)

RUN_KEYS: tuple[KeySpec, ...] = (
    _k("iterations", _POS, 1, "int >= 1", "measured training iterations"),
    _k("warmup_iterations", int_at_least(0), 1, "int >= 0", "iterations simulated before measuring"),
    _k("seed", int_at_least(0), 0, "int >= 0", "seed for all randomness (numpy SeedSequence)"),
    _k("full", boolean, False, "bool", "simulate every rank (turns symmetry reduction off)"),
    _k("record_events", boolean, True, "bool", "keep allocator events (needed for the memory snapshot)"),
)

SWEEP_KEYS: tuple[KeySpec, ...] = (
    _k("grid", grid_table, (), "table", "the sweep's axes: section.key = [values]; `memsim sweep` runs their product (--grid adds or replaces axes)", "{}"),
    _k("fast", boolean, False, "bool", "evaluate every sweep point with the fast estimate only (`memsim sweep --fast`)"),
    _k("tokens", optional_positive, None, 'float > 0 | "none"', "token budget for time to train, dollars and kWh (`--tokens`; sweep and compare)", "none"),
    _k("prices", optional_path, None, 'path | "none"', "price and power table overriding topologies/costs/prices.toml (`--prices`; relative to the scenario file)", "none"),
    _k("pricing", choice(PRICINGS), "rent", " | ".join(PRICINGS), "dollars from hourly rental, or from the purchase price amortised plus electricity (`--pricing`)"),
    _k("amortization_years", optional_positive, None, 'float > 0 | "none"', "years over which owned hardware is written off (`--amortization-years`); none = the price table's", "none"),
)

TOP_LEVEL_KEYS: tuple[KeySpec, ...] = (
    _k("name", text, None, "str", "scenario name shown in reports", "the file name without .toml"),
    _k("description", string, "", "str", "free text"),
)

SECTION_KEYS: Mapping[str, tuple[KeySpec, ...]] = MappingProxyType({
    "model": MODEL_KEYS, "training": TRAINING_KEYS, "parallel": PARALLEL_KEYS,
    "cluster": CLUSTER_KEYS, "allocator": ALLOCATOR_KEYS, "run": RUN_KEYS, "sweep": SWEEP_KEYS,
})


def key_names(section: str | None) -> tuple[str, ...]:
    """The keys allowed in `section` (None: the top level, including the section names)."""
    if section is None:
        return tuple(spec.key for spec in TOP_LEVEL_KEYS) + SECTIONS
    return tuple(spec.key for spec in SECTION_KEYS[section])


def key_spec(section: str | None, key: str) -> KeySpec | None:
    """The KeySpec of `section.key` (section None: a top-level key), or None if there is none."""
    specs = TOP_LEVEL_KEYS if section is None else SECTION_KEYS.get(section, ())
    for spec in specs:
        if spec.key == key:
            return spec
    return None


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A fully resolved model shape: preset / hf_config values, then explicit keys, then defaults.

    Architecture-only fields (rope_theta, type_vocab_size, image_size, patch_size, num_channels,
    num_classes) are None for architectures that do not use them; vocab_size is 0 for vit.
    """

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
    post_norm: bool
    share_layers: bool = False
    linformer_k: int | None = None
    preset: str | None = None
    hf_config: str | None = None
    rope_theta: float | None = None
    type_vocab_size: int | None = None
    image_size: int | None = None
    patch_size: int | None = None
    num_channels: int | None = None
    num_classes: int | None = None
    resnet_blocks: tuple[int, ...] | None = None
    resnet_block: str | None = None
    embedding_rows: tuple[int, ...] | None = None
    embedding_tables: int | None = None
    embedding_dim: int | None = None
    lookups_per_table: int | None = None
    dense_features: int | None = None
    bottom_mlp: tuple[int, ...] | None = None
    top_mlp: tuple[int, ...] | None = None
    embedding_placement: str | None = None

    @property
    def head_dim(self) -> int:
        """Width of one attention head (hidden_size / num_attention_heads)."""
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches(self) -> int | None:
        """Image patches per sample for vit ((image_size / patch_size)^2), None otherwise."""
        if self.image_size is None or self.patch_size is None:
            return None
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The training recipe. `data_parallel_size` is a copy of parallel.dp (not a scenario key)."""

    micro_batch_size: int = 1
    global_batch_size: int = 1
    precision: str = "bf16-mixed"
    framework: str = "torch"
    optimizer: str = "adamw"
    optimizer_implementation: str = "auto"
    recompute: str = "none"
    activation_compression: str = "none"
    sparsity: str = "none"
    peft: str = "none"
    lora_rank: int = 8
    lora_alpha: float = 8.0
    lora_target_modules: tuple[str, ...] = ("auto",)
    lora_dropout: float = 0.0
    loss_scale: str | float = "dynamic"
    skipped_steps_fraction: float = 0.0
    vocab_divisible_by: int = 1
    attention_backend: str = "auto"
    cuda_graphs: bool = False
    data_parallel_size: int = 1

    @property
    def gradient_accumulation_steps(self) -> int:
        """Microbatches per iteration per data-parallel rank: global / (micro * dp)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def recompute_segments(self) -> int | None:
        """N of recompute = "segments:N", else None."""
        head, _, count = self.recompute.partition(":")
        return int(count) if head == "segments" else None


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The parallel plan as written (whether the engine supports it is checked elsewhere)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero_stage: int = 0
    offload_optimizer: str = "none"
    offload_params: str = "none"
    offload_activations: str = "none"
    gradient_compression: str = "none"
    gradient_compression_stage: str = "compressed"
    bucket_size: int = 25_000_000
    prefetch_bucket_size: int = 50_000_000
    placement: str = "auto"
    tp_comm_overlap: str | bool = "auto"
    tp_backward_overlap: str | bool = "auto"
    overlap_grad_reduce: str | bool = "auto"
    overlap_param_gather: str | bool = "auto"
    overlap_p2p_comm: str | bool = "auto"

    @property
    def world_size(self) -> int:
        """Ranks the plan needs: tp * pp * dp."""
        return self.tp * self.pp * self.dp

    @property
    def bucket_size_bytes(self) -> int:
        """Gradient bucket size in bytes (same as bucket_size)."""
        return self.bucket_size

    @property
    def schedule_is_file(self) -> bool:
        """Whether `schedule` is a path to an action file rather than a built-in name."""
        return is_schedule_file(self.schedule)

    @property
    def gradient_compression_kind(self) -> str:
        """none | 1bit | int8 | topk | powersgd."""
        return self.gradient_compression.partition(":")[0]

    @property
    def gradient_compression_parameter(self) -> float | int | None:
        """The top-k fraction (float), the PowerSGD rank (int), or None."""
        kind, _, arg = self.gradient_compression.partition(":")
        if kind == "topk":
            return float(arg)
        if kind == "powersgd":
            return int(arg)
        return None


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Which cluster: a topology name or path, how many nodes, and optional calibration data."""

    topology: str = "dgx-a100"
    nodes: int = 1
    calibration: str | None = None
    host_memory: int | None = None

    @property
    def topology_is_path(self) -> bool:
        """Whether `topology` is a file path rather than a name from topologies/."""
        return topology_is_path(self.topology)


@dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """The allocator model and its PYTORCH_ALLOC_CONF-style settings."""

    kind: str = "auto"
    max_split_size: int | None = None
    roundup_power2_divisions: int | None = None
    expandable_segments: bool = False
    memory_fraction: float = 1.0
    context_bytes: int | None = None

    @property
    def max_split_size_bytes(self) -> int | None:
        """max_split_size in bytes, None when unlimited."""
        return self.max_split_size


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How to run the simulation."""

    iterations: int = 1
    warmup_iterations: int = 1
    seed: int = 0
    full: bool = False
    record_events: bool = True


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """The [sweep] table: read by `memsim sweep` and `memsim compare`; a single run ignores it."""

    grid: tuple[tuple[str, tuple], ...] = ()     # (section.key, values) in document order
    fast: bool = False
    tokens: float | None = None
    prices: str | None = None
    pricing: str = "rent"
    amortization_years: float | None = None


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """A loaded, validated scenario: every section resolved, every default filled in."""

    name: str
    source: str
    model: ModelConfig
    training: TrainingConfig
    parallel: ParallelConfig
    cluster: ClusterConfig
    allocator: AllocatorConfig
    run: RunConfig
    description: str = ""
    sweep: SweepConfig = SweepConfig()
