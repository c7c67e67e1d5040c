"""Gradient compression on the data-parallel path: which kind, where it applies, and the ops it adds (interface).

Each kind is simulated as the library that implements it does it (docs/compression.md has the sources):

* ``1bit`` — DeepSpeed's 1-bit Adam (``OnebitAdam`` with ``NcclBackend.compressed_allreduce``): in its compressed
  stage the backward all_reduce is off and the optimizer step all_to_alls the sign bits of the momentum and
  all_gathers them back (onebit.py); its warm-up stage is an uncompressed all_reduce with 1-bit Adam's own Adam.
* ``int8`` — Bagua's ByteGrad (flat, ``hierarchical=False``): per bucket, MinMax uint8 chunks all_to_all'd,
  averaged, re-quantized and all_gathered, the codec kernels on the communication stream (bytegrad.py).
* ``topk:F`` — GRACE's TopKCompressor + ResidualMemory + Allgather communicator (Horovod): per gradient, the
  F largest magnitudes' values and int64 indices all_gathered, decompressed in the optimizer step (topk.py).
* ``powersgd:R`` — torch's ``powerSGD_hook`` (DDP communication hook): per bucket, rank-R factors P and Q
  all_reduced in turn, vectors and matrices not worth compressing all_reduced as they are (powersgd.py).

`check_compression` refuses the combinations those libraries do not run; `make_codec` builds the ops that replace
a DDP bucket's all_reduce, run at a gradient's landing or before the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from simulator.errors import PlanError
from simulator.workload.graph import Op, Tensor
from simulator.workload.optimizers import IdSource

KINDS = ("none", "1bit", "int8", "topk", "powersgd")
STAGES = ("compressed", "warmup")
WARMUP_KINDS = ("1bit", "powersgd")          # the kinds whose library starts uncompressed


@dataclass(frozen=True)
class Compression:
    """A parsed `parallel.gradient_compression` with `parallel.gradient_compression_stage`."""

    kind: str = "none"
    fraction: float | None = None    # topk: the fraction of elements sent
    rank: int | None = None          # powersgd: the approximation rank
    stage: str = "compressed"

    @classmethod
    def parse(cls, text: str, stage: str = "compressed") -> Compression:
        """From the schema's normalised text ("none", "1bit", "int8", "topk:0.01", "powersgd:4")."""
        kind, _, arg = text.partition(":")
        return cls(kind, float(arg) if kind == "topk" else None, int(arg) if kind == "powersgd" else None, stage)

    @property
    def text(self) -> str:
        """The scenario value this was parsed from."""
        if self.kind == "topk":
            return f"topk:{self.fraction!r}"
        if self.kind == "powersgd":
            return f"powersgd:{self.rank}"
        return self.kind

    @property
    def compressing(self) -> bool:
        """Whether the simulated iteration compresses (a kind, in its compressed stage)."""
        return self.kind != "none" and self.stage == "compressed"

    @property
    def replaces_bucket_buffers(self) -> bool:
        """Whether torch DDP's bucket buffers are gone: 1-bit Adam turns the backward all_reduce off, GRACE does
        not use DDP, Bagua's gradients live in its own flattened buckets."""
        return self.compressing and self.kind in ("1bit", "topk", "int8")

    @property
    def gradients_in_buckets(self) -> bool:
        """Bagua (int8): every gradient accumulates into a persistent flattened bucket (no `.grad` to free)."""
        return self.compressing and self.kind == "int8"


NONE = Compression()


def check_compression(compression: Compression, *, dp: int, zero_stage: int, framework: str, precision: str,
                      optimizer: str) -> None:
    """Refuse a compression its library cannot run with these options (one line naming the keys and the rule).

    Raises:
        PlanError: the combination is not one the modelled library runs.
    """
    kind, value = compression.kind, f"parallel.gradient_compression = {compression.text!r}"
    if compression.stage == "warmup" and kind not in WARMUP_KINDS:
        what = "no compression" if kind == "none" else f"{kind!r}"
        raise PlanError(f"parallel.gradient_compression_stage = 'warmup': {what} has no warm-up stage (1bit and "
                        f"powersgd:R start uncompressed); allowed here: 'compressed'")
    if kind == "none":
        return
    if dp == 1:
        raise PlanError(f"{value} needs parallel.dp > 1: with dp = 1 there is no data-parallel gradient traffic")
    if kind == "1bit":
        if framework != "deepspeed":
            raise PlanError(f"{value} is DeepSpeed's 1-bit Adam: it needs training.framework = 'deepspeed' "
                            f"(is {framework!r})")
        if zero_stage != 0:
            raise PlanError(f"{value} with parallel.zero_stage = {zero_stage}: 1-bit Adam has no compressed "
                            f"reduce_scatter (DeepSpeed: '1bit-Adam is not compatible with ZeRO'); allowed: 0")
        if optimizer != "adamw":
            raise PlanError(f"{value} replaces the optimizer by 1-bit Adam: it needs training.optimizer = 'adamw' "
                            f"(is {optimizer!r})")
        if precision not in ("fp16-mixed", "fp32"):
            raise PlanError(f"{value} runs under DeepSpeed's fp16 optimizer or in fp32: training.precision must be "
                            f"'fp16-mixed' or 'fp32' (is {precision!r})")
        return
    library = {"int8": "Bagua's ByteGrad", "topk": "GRACE's top-k over Horovod", "powersgd": "torch's PowerSGD "
               "DDP communication hook"}[kind]
    if framework != "torch":
        raise PlanError(f"{value} is {library}: it needs training.framework = 'torch' ({framework!r} reduces "
                        f"gradients its own way)")
    allowed = (0, 1) if kind == "powersgd" else (0,)
    if zero_stage not in allowed:
        raise PlanError(f"{value} with parallel.zero_stage = {zero_stage}: {library} replaces the data-parallel "
                        f"all_reduce and has no reduce_scatter variant; allowed: "
                        f"{', '.join(str(s) for s in allowed)}")


@dataclass(frozen=True)
class BucketParam:
    """A parameter of a gradient bucket as a codec sees it: its gradient's elements, shape and tensor."""

    id: int
    name: str
    numel: int
    shape: tuple[int, ...]
    grad: int | None = None     # the persistent tensor holding its gradient (Bagua), if any


@dataclass
class GradientCodec:
    """The ops one compression adds to a rank's iteration (templates: `_sync` sets their layer and micro-batch).

    `bucket_ops[k]`: what replaces bucket k's all_reduce, after its last gradient lands; `landing_ops[param id]`:
    what runs once that parameter's gradient is complete; `step_ops`: what runs first in the optimizer step;
    `persistent`: tensors allocated at set-up (error feedback, low-rank factors).
    """

    bucket_ops: dict[int, tuple[Op, ...]] = field(default_factory=dict)
    landing_ops: dict[int, tuple[Op, ...]] = field(default_factory=dict)
    step_ops: tuple[Op, ...] = ()
    persistent: tuple[int, ...] = ()


def make_codec(compression: Compression, dp: int, buckets: list[list[BucketParam]], grad_dtype: str,
               bucket_buffers: list[int | None], ids: IdSource, tensors: dict[int, Tensor]) -> GradientCodec | None:
    """The codec of `compression` over `buckets` (each the parameters of one bucket, in bucket order), or None
    where the bucket all_reduce stays as it is (no compression; 1-bit Adam's warm-up stage).

    `bucket_buffers[k]`: torch DDP's buffer of bucket k (None where there is none); new tensors go into `tensors`.
    """
    if compression.kind == "none" or (compression.kind == "1bit" and not compression.compressing):
        return None
    if compression.kind == "1bit":
        return GradientCodec()       # compressed stage: no backward all_reduce (the step communicates: onebit.py)
    if compression.kind == "int8":
        from simulator.workload.compression.bytegrad import bytegrad_codec
        return bytegrad_codec(dp, buckets, grad_dtype, ids, tensors)
    if compression.kind == "topk":
        from simulator.workload.compression.topk import topk_codec
        return topk_codec(compression.fraction, dp, [p for bucket in buckets for p in bucket], grad_dtype, ids,
                          tensors)
    from simulator.workload.compression.powersgd import powersgd_codec
    return powersgd_codec(compression, dp, buckets, grad_dtype, bucket_buffers, ids, tensors)
