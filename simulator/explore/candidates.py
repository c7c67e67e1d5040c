"""The plans `memsim plan` considers for a model, a global batch and a GPU count, as data: each axis is a scenario
key with the values it takes given the choices made before it, so another axis (offload, say) is one more entry.

    for settings in enumerate_plans(AXES, context):     # settings: (("parallel.tp", 8), ("parallel.pp", 16), ...)
        ...

An axis only lists values worth a run (tp divides the GPUs of a node and the heads; pp divides the GPUs left and is
at most the layers; the micro-batch divides the global batch per replica; ZeRO-2/3 only without a pipeline, as
`simulate` allows; offload where simulator/offload/config.py simulates it); what else a run would refuse is found by running its checks (search.py), with its message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

Settings = tuple[tuple[str, object], ...]


@dataclass(frozen=True)
class Context:
    """What the axes read: the GPUs, the model's sizes and the global batch."""

    gpus: int
    gpus_per_node: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    global_batch_size: int
    framework: str
    max_micro_batch_size: int = 64
    optimizer: str = "adamw"
    precision: str = "bf16-mixed"


@dataclass(frozen=True)
class Axis:
    """A scenario key and the values it takes, given the context and the settings chosen so far (a dict)."""

    key: str
    values: Callable[[Context, dict], Sequence[object]]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp(c: Context, chosen: dict) -> list[int]:
    return [t for t in _divisors(c.gpus) if c.gpus_per_node % t == 0 and c.num_attention_heads % t == 0
            and c.num_kv_heads % t == 0]


def _pp(c: Context, chosen: dict) -> list[int]:
    return [q for q in _divisors(c.gpus // chosen["parallel.tp"]) if q <= c.num_layers]


def _dp(c: Context, chosen: dict) -> list[int]:
    return [c.gpus // (chosen["parallel.tp"] * chosen["parallel.pp"])]


def _micro(c: Context, chosen: dict) -> list[int]:
    if c.global_batch_size % chosen["parallel.dp"]:
        return [1]             # no micro-batch fits: one candidate, refused with the loader's message
    per_replica = c.global_batch_size // chosen["parallel.dp"]
    return [b for b in _divisors(per_replica) if b <= c.max_micro_batch_size]


def _schedule(c: Context, chosen: dict) -> list[str]:
    if chosen["parallel.pp"] == 1:
        return ["1f1b"]
    return ["1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb-h2"]


def _virtual(c: Context, chosen: dict) -> list[int]:
    if chosen["parallel.schedule"] != "interleaved-1f1b":
        return [1]
    pp = chosen["parallel.pp"]
    microbatches = c.global_batch_size // (chosen["parallel.dp"] * chosen["training.micro_batch_size"])
    per_stage = c.num_layers // pp
    options = [v for v in _divisors(per_stage) if v > 1] if c.num_layers % pp == 0 and microbatches % pp == 0 else []
    return options or [2]      # none valid: one candidate, refused with the run's message


def _recompute(c: Context, chosen: dict) -> list[str]:
    return ["none", "selective", "full"]


def _zero(c: Context, chosen: dict) -> list[int]:
    if chosen["parallel.dp"] == 1:
        return [0]
    if chosen["parallel.pp"] > 1 or c.framework == "megatron":
        return [0, 1]
    return [0, 1, 2, 3]


def _sequence_parallel(c: Context, chosen: dict) -> list[bool]:
    return [False, True] if chosen["parallel.tp"] > 1 else [False]


def _zero_offload(c: Context, chosen: dict) -> bool:
    """Whether ZeRO-Offload can run here (simulator/offload/config.py check_offload): DeepSpeed, pp = 1, ZeRO-2/3,
    AdamW in mixed precision, no gradient accumulation."""
    per_replica = c.global_batch_size // chosen["parallel.dp"] if c.global_batch_size % chosen["parallel.dp"] == 0 else 0
    return (c.framework == "deepspeed" and chosen["parallel.pp"] == 1 and chosen["parallel.zero_stage"] in (2, 3)
            and c.optimizer == "adamw" and c.precision in ("bf16-mixed", "fp16-mixed")
            and chosen["training.micro_batch_size"] == per_replica)


def _offload_optimizer(c: Context, chosen: dict) -> list[str]:
    if not _zero_offload(c, chosen):
        return ["none"]
    return ["none", "cpu", "nvme"] if chosen["parallel.zero_stage"] == 3 else ["none", "cpu"]


def _offload_params(c: Context, chosen: dict) -> list[str]:
    if chosen["parallel.offload_optimizer"] == "none" or chosen["parallel.zero_stage"] != 3:
        return ["none"]
    return ["none", "cpu", "nvme"]


def _offload_activations(c: Context, chosen: dict) -> list[str]:
    if chosen["parallel.pp"] > 1 or c.framework == "megatron" or chosen["training.recompute"] != "none":
        return ["none"]
    return ["none", "cpu"]


# In order: a later axis may read the values of earlier ones.
AXES: tuple[Axis, ...] = (
    Axis("parallel.tp", _tp),
    Axis("parallel.pp", _pp),
    Axis("parallel.dp", _dp),
    Axis("training.micro_batch_size", _micro),
    Axis("parallel.schedule", _schedule),
    Axis("parallel.virtual_stages", _virtual),
    Axis("training.recompute", _recompute),
    Axis("parallel.zero_stage", _zero),
    Axis("parallel.sequence_parallel", _sequence_parallel),
    Axis("parallel.offload_optimizer", _offload_optimizer),
    Axis("parallel.offload_params", _offload_params),
    Axis("parallel.offload_activations", _offload_activations),
)


def enumerate_plans(axes: Sequence[Axis], context: Context) -> Iterator[Settings]:
    """Every combination of the axes' values, in axis order (the first axis slowest)."""
    def walk(k: int, chosen: dict) -> Iterator[Settings]:
        if k == len(axes):
            yield tuple(chosen.items())
            return
        axis = axes[k]
        for value in axis.values(context, chosen):
            chosen[axis.key] = value
            yield from walk(k + 1, chosen)
            del chosen[axis.key]

    yield from walk(0, {})


def overrides(settings: Settings) -> list[str]:
    """The settings as `--set KEY=VALUE` arguments (TOML values)."""
    out = []
    for key, value in settings:
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = f'"{value}"'
        else:
            text = str(value)
        out.append(f"{key}={text}")
    return out
