"""Scenario value types (frozen) and the key tables that parse, default and document every scenario key."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

from simulator import units

ARCHITECTURES = ("gpt", "llama", "bert", "vit")
ACTIVATIONS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
ATTENTIONS = ("flash", "eager", "linformer")
PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16", "fp8-mixed")
FRAMEWORKS = ("torch", "megatron", "deepspeed")
OPTIMIZERS = ("adamw", "adam-8bit", "sgd", "sgd-momentum", "adafactor")
OPTIMIZER_IMPLEMENTATIONS = ("auto", "foreach", "single-tensor", "fused")
ACTIVATION_COMPRESSIONS = ("none", "int8")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2")
OFFLOAD_TARGETS = ("none", "cpu", "nvme")
COMPRESSION_STAGES = ("compressed", "warmup")
SPARSITIES = ("none", "2:4")
ALLOCATOR_KINDS = ("caching", "exact", "auto")
SECTIONS = ("model", "training", "parallel", "cluster", "allocator", "run")
MAX_INT = 2**63 - 1  # largest count or size accepted (int64, what numpy and torch can hold)
MIN_MAX_SPLIT_SIZE_BYTES = 20 * 2**20  # kLargeBuffer: torch rejects a smaller max_split_size_mb


def short_repr(value: object) -> str:
    """repr() for error messages: at most 120 characters, safe for ints too long to print."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for str() (sys.int_info.default_max_str_digits)
        text = f"<{type(value).__name__} too large to print>"
    return text if len(text) <= 120 else text[:117] + "..."

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

# Model keys that only one architecture uses, and the keys a vit derives instead of reading.
ARCH_ONLY_KEYS: Mapping[str, str] = MappingProxyType({
    "rope_theta": "llama", "type_vocab_size": "bert", "image_size": "vit", "patch_size": "vit",
    "num_channels": "vit", "num_classes": "vit",
})


class Invalid(ValueError):
    """A value breaks its key's rule; the message says what is allowed (the loader adds file and key)."""


def did_you_mean(word: object, options: tuple[str, ...] | list[str]) -> str:
    """A "; did you mean 'x'?" hint for the closest option to `word`, or "" when none is close."""
    if not isinstance(word, str):
        return ""
    lowered = {option.lower(): option for option in options}
    word = word.lower()
    matches = difflib.get_close_matches(word, list(lowered), n=1, cutoff=0.6)
    if not matches and len(word) >= 3:
        matches = [option for option in lowered if option.startswith(word)][:1]
    return f"; did you mean {lowered[matches[0]]!r}?" if matches else ""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_at_least(minimum: int) -> Callable[[object], int]:
    """Parser for an integer from `minimum` to MAX_INT (booleans and floats are rejected)."""
    def parse(value: object) -> int:
        if not _is_int(value) or value < minimum:
            raise Invalid("must be a positive integer" if minimum == 1 else f"must be an integer >= {minimum}")
        if value > MAX_INT:
            raise Invalid(f"must be at most 2**63 - 1 = {MAX_INT}")
        return value
    return parse


def int_between(low: int, high: int) -> Callable[[object], int]:
    """Parser for an integer in low..high inclusive."""
    def parse(value: object) -> int:
        if not _is_int(value) or not low <= value <= high:
            raise Invalid(f"must be an integer from {low} to {high}")
        return value
    return parse


def to_float(value: object) -> float:
    """A finite float from an int or float (bools, strings, NaN, infinities and huge ints rejected)."""
    if _is_int(value) and abs(value) < 2**1000:
        return float(value)
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise Invalid("must be a finite number")


def positive_float(value: object) -> float:
    """Parser for a finite number > 0."""
    number = to_float(value)
    if number <= 0:
        raise Invalid("must be a number > 0")
    return number


def unit_fraction(value: object) -> float:
    """Parser for a fraction in (0, 1]."""
    number = to_float(value)
    if not 0.0 < number <= 1.0:
        raise Invalid("must be a number in (0, 1]")
    return number


def fraction_below_one(value: object) -> float:
    """Parser for a probability or fraction in [0, 1)."""
    number = to_float(value)
    if not 0.0 <= number < 1.0:
        raise Invalid("must be a number in [0, 1)")
    return number


def boolean(value: object) -> bool:
    """Parser for true/false (no 0/1, no strings)."""
    if not isinstance(value, bool):
        raise Invalid("must be true or false")
    return value


def choice(options: tuple[str, ...]) -> Callable[[object], str]:
    """Parser for one of `options` (exact spelling), with a did-you-mean hint."""
    def parse(value: object) -> str:
        if isinstance(value, str) and value in options:
            return value
        raise Invalid(f"must be one of {', '.join(options)}{did_you_mean(value, options)}")
    return parse


def text(value: object) -> str:
    """Parser for a non-empty string without NUL characters."""
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise Invalid("must be a non-empty string")
    return value


def string(value: object) -> str:
    """Parser for any string (possibly empty)."""
    if not isinstance(value, str):
        raise Invalid("must be a string")
    return value


def optional_path(value: object) -> str | None:
    """Parser for a path string, or "none" for no file."""
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    try:
        return text(value)
    except Invalid:
        raise Invalid('must be a path string or "none"') from None


def size_bytes(value: object, minimum: int = 0) -> int:
    """Parser for a size: bytes as a number or a string with a unit ("25 MB", "2 GiB")."""
    try:
        parsed = units.parse_bytes(value)
    except (ValueError, OverflowError, TypeError) as exc:
        raise Invalid(f"must be a size: bytes as a number or a string like '25 MB' ({exc})") from None
    if not minimum <= parsed <= MAX_INT:
        raise Invalid(f"must be a size from {minimum} to {MAX_INT} bytes")
    return parsed


def _count(text: str) -> int | None:
    """The integer written in `text` (ASCII digits only), or None."""
    text = text.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        return None
    return int(text)


def recompute_mode(value: object) -> str:
    """Parser for none | selective | full | "segments:N" (N >= 1), normalised."""
    if isinstance(value, str):
        if value in ("none", "selective", "full"):
            return value
        head, sep, count = value.partition(":")
        segments = _count(count)
        if sep and head.strip() == "segments" and segments is not None and segments >= 1:
            return f"segments:{segments}"
    modes = ("none", "selective", "full", "segments")
    head = value.partition(":")[0].strip() if isinstance(value, str) else value
    hint = "" if head in modes else did_you_mean(head, modes)
    raise Invalid(f'must be none, selective, full or "segments:N" with N >= 1{hint}')


def gradient_compression(value: object) -> str:
    """Parser for none | 1bit | int8 | "topk:F" (0 < F < 1) | "powersgd:R" (R >= 1), normalised."""
    if isinstance(value, str):
        if value in ("none", "1bit", "int8"):
            return value
        head, sep, arg = value.partition(":")
        head, arg = head.strip(), arg.strip()
        if sep and head == "topk":
            try:
                fraction = float(arg)
            except ValueError:
                fraction = math.nan
            if 0.0 < fraction < 1.0:
                return f"topk:{fraction!r}"
        rank = _count(arg)
        if sep and head == "powersgd" and rank is not None and rank >= 1:
            return f"powersgd:{rank}"
    kinds = ("none", "1bit", "int8", "topk", "powersgd")
    head = value.partition(":")[0].strip() if isinstance(value, str) else value
    hint = "" if head in kinds else did_you_mean(head, kinds)
    raise Invalid(f'must be none, 1bit, int8, "topk:F" with 0 < F < 1 or "powersgd:R" with R >= 1{hint}')


def loss_scale(value: object) -> str | float:
    """Parser for "dynamic" or a static loss scale > 0."""
    if value == "dynamic" and isinstance(value, str):
        return value
    try:
        return positive_float(value)
    except Invalid:
        raise Invalid('must be "dynamic" or a number > 0') from None


def _looks_like_path(value: str) -> bool:
    return "/" in value or "\\" in value or "." in value


def schedule_name(value: object) -> str:
    """Parser for a schedule name or a path to an action file (anything with '/', '\\' or '.')."""
    if isinstance(value, str) and (value in SCHEDULES or (_looks_like_path(value) and "\0" not in value)):
        return value
    raise Invalid(f"must be one of {', '.join(SCHEDULES)} or a path to an action file"
                  f"{did_you_mean(value, SCHEDULES)}")


def is_schedule_file(schedule: str) -> bool:
    """Whether a parsed `parallel.schedule` names a file rather than a built-in schedule."""
    return schedule not in SCHEDULES


def topology_name(value: object) -> str:
    """Parser for a topology name from topologies/ or a path to a topology file."""
    try:
        return text(value)
    except Invalid:
        raise Invalid("must be a topology name (e.g. dgx-a100) or a path to a topology TOML file") from None


def topology_is_path(topology: str) -> bool:
    """Whether a parsed `cluster.topology` is a file path rather than a name."""
    return "/" in topology or "\\" in topology or topology.endswith(".toml")


def max_split_size(value: object) -> int | None:
    """Parser for "unlimited" (None) or a size >= 20 MiB."""
    if isinstance(value, str) and value.strip().lower() == "unlimited":
        return None
    try:
        return size_bytes(value, MIN_MAX_SPLIT_SIZE_BYTES)
    except Invalid:
        raise Invalid(f'must be "unlimited" or a size >= 20 MiB ({MIN_MAX_SPLIT_SIZE_BYTES} bytes)') from None


def roundup_power2_divisions(value: object) -> int | None:
    """Parser for "none" (None) or a power of two from 1 to 16."""
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    if _is_int(value) and value in (1, 2, 4, 8, 16):
        return value
    raise Invalid('must be "none" or a power of two from 1 to 16')


def context_bytes(value: object) -> int | None:
    """Parser for "auto" (None: the device's default) or a size."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        return size_bytes(value)
    except Invalid:
        raise Invalid('must be "auto" or a size >= 0 (bytes or a string like "500 MiB")') from None


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
    _k("image_size", _POS, None, "int >= 1", "input image side in pixels (vit only)", "vit: 224"),
    _k("patch_size", _POS, None, "int >= 1", "patch side in pixels; must divide image_size (vit only)", "vit: 16"),
    _k("num_channels", _POS, None, "int >= 1", "input image channels (vit only)", "vit: 3"),
    _k("num_classes", _POS, None, "int >= 1", "classifier outputs (vit only)", "vit: 1000"),
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
    _k("loss_scale", loss_scale, "dynamic", '"dynamic" | float > 0', "fp16-mixed loss scaling: dynamic (torch GradScaler, Megatron DynamicGradScaler, DeepSpeed DynamicLossScaler) or a static scale (Megatron, DeepSpeed); other precisions: dynamic only"),
    _k("skipped_steps_fraction", fraction_below_one, 0.0, "float in [0, 1)", "fp16-mixed: share of iterations whose optimizer step the loss scaler skips (an overflow); iteration_time_s averages both kinds"),
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
    _k("offload_optimizer", choice(OFFLOAD_TARGETS), "none", " | ".join(OFFLOAD_TARGETS), "where optimizer states live"),
    _k("offload_params", choice(OFFLOAD_TARGETS), "none", " | ".join(OFFLOAD_TARGETS), "where parameters live between uses"),
    _k("offload_activations", choice(OFFLOAD_TARGETS), "none", " | ".join(OFFLOAD_TARGETS), "where saved activations wait for backward"),
    _k("gradient_compression", gradient_compression, "none", 'none | 1bit | int8 | "topk:F" | "powersgd:R"', "compression of data-parallel gradient traffic: 1bit = DeepSpeed 1-bit Adam, int8 = Bagua ByteGrad, topk = GRACE top-k, powersgd = torch's PowerSGD hook (docs/compression.md)"),
    _k("gradient_compression_stage", choice(COMPRESSION_STAGES), "compressed", " | ".join(COMPRESSION_STAGES), "which iteration is simulated: compressed, or the uncompressed warm-up before it (1bit: before freeze_step; powersgd: before start_powerSGD_iter)"),
    _k("bucket_size", size_bytes, 25_000_000, "size", "gradient bucket size (DDP bucket_cap_mb)", '"25 MB" (25000000)'),
    _k("placement", text, "auto", "str", "how ranks map onto devices; auto = the parallel layer's default order"),
)

CLUSTER_KEYS: tuple[KeySpec, ...] = (
    _k("topology", topology_name, "dgx-a100", "str | path", "a topology name from topologies/ or a TOML path (relative to the scenario file)"),
    _k("nodes", _POS, 1, "int >= 1", "number of nodes of that topology"),
    _k("calibration", optional_path, None, 'path | "none"', "fitted device/link parameters (relative to the scenario file)", "none"),
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

TOP_LEVEL_KEYS: tuple[KeySpec, ...] = (
    _k("name", text, None, "str", "scenario name shown in reports", "the file name without .toml"),
    _k("description", string, "", "str", "free text"),
)

SECTION_KEYS: Mapping[str, tuple[KeySpec, ...]] = MappingProxyType({
    "model": MODEL_KEYS, "training": TRAINING_KEYS, "parallel": PARALLEL_KEYS,
    "cluster": CLUSTER_KEYS, "allocator": ALLOCATOR_KEYS, "run": RUN_KEYS,
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
    loss_scale: str | float = "dynamic"
    skipped_steps_fraction: float = 0.0
    vocab_divisible_by: int = 1
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
    placement: str = "auto"

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
