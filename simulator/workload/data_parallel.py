"""Data parallelism on one rank's iteration: DDP gradient buckets and ZeRO-1/2/3 sharding, as ops.

What one data-parallel rank holds and does, by `framework` and `zero_stage` (dp = N ranks):

* stage 0 — torch DDP (and deepspeed without ZeRO): one persistent bucket buffer per gradient bucket
  (category communication_buffers; buckets packed in reverse registration order up to
  `bucket_size_bytes`, torch's first bucket capped at 1 MiB); each gradient is copied into its
  bucket view when it lands (`gradient_as_bucket_view=False`), a bucket is all_reduced as soon as it
  and every earlier bucket are full, and the reduced buckets are copied back into `.grad` at the end
  of backward. Megatron's persistent main_grad buffer is its own bucket: no copy, no extra buffer.
  Only the last micro-batch synchronizes (`no_sync` on the others).
* stage 1 — optimizer states (and the fp32 master copy) sharded: the step runs on a flat shard of
  ceil(Ψ / N) elements (DeepSpeed pads the flattened group to a multiple of N); gradients stay
  whole and are reduce_scattered in place bucket by bucket on the last micro-batch (torch: DDP's
  all_reduce plus ZeroRedundancyOptimizer; megatron: the distributed optimizer, 6 + 12/N bytes per
  parameter); the updated parameters are all_gathered after the step.
* stage 2 — gradients sharded too: each gradient is copied into a persistent staging bucket
  (sized to the largest bucket) and released; a full bucket is reduce_scattered into the rank's
  gradient shard (allocated by the first reduction of the iteration, freed by zero_grad). Every
  micro-batch reduces (DeepSpeed's ZeRO-2 has no no_sync).
* stage 3 — parameters sharded per tensor (ceil(n / N) elements each, DeepSpeed's `ds_tensor`):
  every module segment (embedding, each layer, head) all_gathers its parameters before it runs in
  forward and again in backward, prefetching the next segment (at most two segments gathered at
  once), and releases them after use; the step updates the shard; no all_gather after it.

The 16-bit DeepSpeed step converts its gradient shard to fp32 (a transient of 4 bytes per shard
element) and copies the fp32 master back into the 16-bit parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from simulator.workload.compression import NONE, BucketParam, Compression, GradientCodec, make_codec
from simulator.workload.graph import (
    BACKWARD_INPUT,
    COLLECTIVE,
    COMMUNICATION_BUFFERS,
    COPY,
    DTYPE_BYTES,
    FORWARD,
    GRADIENTS,
    OPTIMIZER_STATES,
    OPTIMIZER_STEP,
    PARAMETERS,
    Op,
    Tensor,
)
from simulator.workload.optimizers import IdSource, MasterParam, optimizer_states, step_ops
from simulator.workload.replay import Replay

if TYPE_CHECKING:
    from simulator.workload.training import IterationWorkload

DDP_FIRST_BUCKET_BYTES = 1 << 20      # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES (torch 2.13)
BACKWARD_SEED = "loss.backward_seed"  # the first backward op of a micro-batch (replay.py)
GROUP = "dp"


# ------------------------------------------------------------------------------- gradient landings
class LandingPolicy:
    """A `replay.ParamGradPolicy` that also records where each parameter's gradient lands.

    `accumulate` = the gradient is added into an existing `.grad` (gradient accumulation, or
    megatron's persistent main_grad). After `finish`, `landing[param id]` is the index of the op
    after which the parameter's gradient is complete and `grad_id[param id]` the tensor that
    became `.grad` (absent when it was accumulated into an existing one).
    """

    def __init__(self, accumulate: bool):
        self.accumulate = accumulate
        self.seen: set[int] = set()
        self.grads: list[Tensor] = []
        self.order: list[int] = []
        self.landing: dict[int, int] = {}
        self.grad_id: dict[int, int] = {}
        self._ops: list[Op] = []

    def has_grad(self, param) -> bool:
        # Called once per parameter, when its last gradient of the micro-batch arrives, just before
        # the op of the backward kernel that delivered it is emitted.
        self.order.append(param.id)
        self.landing[param.id] = len(self._ops)
        return self.accumulate or param.id in self.seen

    def became_grad(self, param, grad: Tensor) -> None:
        self.seen.add(param.id)
        self.grads.append(grad)
        self.grad_id[param.id] = grad.id

    def finish(self, tape, loss) -> tuple[list[Op], dict[int, Tensor]]:
        """Replay `tape` (like `Tape.finish`) and resolve the landing ops."""
        replay = Replay(tape, loss, self)
        self._ops = replay.ops
        ops, tensors = replay.run()
        for pid, index in self.landing.items():
            # The kernel's trailing accumulate_grad op (if any) completes the landing.
            if index + 1 < len(ops) and ops[index + 1].name.endswith(".accumulate_grad"):
                self.landing[pid] = index + 1
        self._ops = []
        return ops, tensors


# ------------------------------------------------------------------------------- buckets
@dataclass(frozen=True)
class Bucket:
    """A group of gradients reduced by one collective."""

    index: int
    param_ids: tuple[int, ...]
    nbytes: int


def gradient_buckets(param_ids: list[int], nbytes: dict[int, int], bucket_size_bytes: int,
                     first_bucket_bytes: int | None = None) -> list[Bucket]:
    """Pack gradients, in the given order, into buckets the way torch's Reducer does.

    A gradient is added to the open bucket, which closes once it holds at least its limit
    (`first_bucket_bytes` for the first bucket when given, `bucket_size_bytes` after).
    """
    buckets: list[Bucket] = []
    current: list[int] = []
    size = 0
    for pid in param_ids:
        current.append(pid)
        size += nbytes[pid]
        limit = first_bucket_bytes if (first_bucket_bytes is not None and not buckets) else bucket_size_bytes
        if size >= limit:
            buckets.append(Bucket(len(buckets), tuple(current), size))
            current, size = [], 0
    if current:
        buckets.append(Bucket(len(buckets), tuple(current), size))
    return buckets


def shard_numel(numel: int, dp: int) -> int:
    """Elements of one rank's shard of `numel` elements over `dp` ranks (padded up)."""
    return -(-numel // dp)


# ------------------------------------------------------------------------------- set-up
@dataclass(frozen=True)
class ParamInfo:
    """A model parameter as data parallelism sees it."""

    id: int
    name: str
    numel: int
    grad_dtype: str
    grad_buffer: int | None = None      # megatron (and Bagua): the persistent gradient tensor id
    shape: tuple[int, ...] = ()         # the parameter's (local) shape; () = a vector of `numel`


@dataclass(frozen=True)
class DataParallelSetup:
    """The options and byte conventions that decide a rank's data-parallel program."""

    dp: int
    zero_stage: int
    framework: str
    bucket_size_bytes: int
    accumulation_steps: int
    optimizer: str
    optimizer_implementation: str
    step_on_device: bool
    param_dtype: str
    master_dtype: str | None          # separate fp32 master (megatron/deepspeed mixed precision)
    compression: Compression = NONE   # gradient compression (workload/compression)

    @property
    def reduction(self) -> str:
        return "all_reduce" if self.zero_stage == 0 or (self.framework == "torch" and self.zero_stage == 1) \
            else "reduce_scatter"

    @property
    def buffers(self) -> str:
        """'per_bucket' (DDP), 'staging' (ZeRO-2/3) or 'none' (gradients reduced in place, or no DDP buckets:
        Compression.replaces_bucket_buffers)."""
        if self.framework == "megatron" or self.compression.replaces_bucket_buffers:
            return "none"
        if self.zero_stage >= 2:
            return "staging"
        if self.zero_stage == 1 and self.framework == "deepspeed":
            return "none"
        return "per_bucket"

    @property
    def sync_every_microbatch(self) -> bool:
        return self.zero_stage >= 2


@dataclass
class MicrobatchOps:
    """The raw micro-batch op lists and where their gradients landed."""

    first: list[Op]
    first_policy: LandingPolicy
    later: list[Op]
    later_policy: LandingPolicy | None


# ------------------------------------------------------------------------------- weaving
def _weave(ops: list[Op], before: dict[int, list[Op]], after: dict[int, list[Op]],
           extra_frees: dict[int, list[int]], remap: dict[int, dict[int, int]]) -> list[Op]:
    """Insert ops before/after raw op indices, add frees and rename inputs, in one pass."""
    out: list[Op] = []
    for i, op in enumerate(ops):
        out.extend(before.get(i, ()))
        names = remap.get(i)
        if names:
            op = replace(op, inputs=tuple(names.get(t, t) for t in op.inputs))
        if i in extra_frees:
            op = replace(op, frees=op.frees + tuple(extra_frees[i]))
        out.append(op)
        out.extend(after.get(i, ()))
    return out


def _collective(name: str, kind: str, phase: str, comm_bytes: int, *, layer: int = -1, microbatch: int = 0,
                allocs: tuple[int, ...] = (), inputs: tuple[int, ...] = (), dtype: str = "fp32") -> Op:
    return Op(name, COLLECTIVE, phase, bytes_read=comm_bytes, bytes_written=comm_bytes, dtype=dtype,
              inputs=inputs, outputs=allocs, allocs=allocs, layer=layer, microbatch=microbatch,
              collective=kind, group=GROUP, comm_bytes=comm_bytes)


def _copy(name: str, nbytes: int, phase: str, *, layer: int = -1, microbatch: int = 0,
          inputs: tuple[int, ...] = (), frees: tuple[int, ...] = (), allocs: tuple[int, ...] = (),
          dtype: str = "fp32") -> Op:
    return Op(name, COPY, phase, bytes_read=nbytes, bytes_written=nbytes, dtype=dtype, inputs=inputs,
              outputs=allocs, allocs=allocs, frees=frees, layer=layer, microbatch=microbatch)


# ------------------------------------------------------------------------------- gradient sync
@dataclass(frozen=True)
class _SyncPlan:
    buckets: tuple[Bucket, ...]
    bucket_buffers: tuple[int, ...]       # per_bucket: one tensor per bucket; staging: one tensor
    grad_shard: int | None                # ZeRO-2/3 gradient shard tensor id
    names: dict[int, str]
    grad_nbytes: dict[int, int]
    grad_buffer: dict[int, int]           # megatron main_grad ids
    grad_dtype: str
    codec: GradientCodec | None = None    # gradient compression's ops (None: plain collectives)


def _sync(ops: list[Op], policy: LandingPolicy, setup: DataParallelSetup, plan: _SyncPlan,
          grad_ids: dict[int, int], allocate_shard: bool) -> tuple[dict[int, list[Op]], list[Op]]:
    """Ops to insert after raw op indices (gradient copies, bucket collectives) and to append."""
    after: dict[int, list[Op]] = {}
    end = len(ops) - 1
    landing = {pid: policy.landing.get(pid, end) for pid in plan.names}
    mode = setup.buffers
    microbatch = ops[0].microbatch if ops else 0
    grad_dt = {pid: plan.grad_nbytes[pid] for pid in plan.names}
    arrival = {pid: k for k, pid in enumerate(policy.order)}
    codec = plan.codec
    for pid in sorted(plan.names, key=lambda p: (landing[p], arrival.get(p, len(arrival)))):
        if codec is not None and pid in codec.landing_ops:
            op = ops[landing[pid]]
            after.setdefault(landing[pid], []).extend(
                replace(o, layer=op.layer, microbatch=microbatch) for o in codec.landing_ops[pid])
        if mode == "none":
            continue
        grad = policy.grad_id.get(pid, grad_ids.get(pid))
        inputs = (grad,) if grad is not None else ()
        frees = inputs if mode == "staging" else ()
        op = ops[landing[pid]]
        after.setdefault(landing[pid], []).append(
            _copy(f"dp.copy_grad.{plan.names[pid]}", grad_dt[pid], BACKWARD_INPUT, layer=op.layer,
                  microbatch=microbatch, inputs=inputs, frees=frees, dtype=plan.grad_dtype))
    position = -1
    shard_pending = allocate_shard and plan.grad_shard is not None
    for bucket in plan.buckets:
        position = max(position, max(landing[pid] for pid in bucket.param_ids))
        allocs: tuple[int, ...] = ()
        if shard_pending:
            allocs, shard_pending = (plan.grad_shard,), False
        if codec is not None:
            layer = ops[position].layer
            after.setdefault(position, []).extend(
                replace(o, layer=layer, microbatch=microbatch) for o in codec.bucket_ops.get(bucket.index, ()))
            continue
        if mode == "per_bucket":
            inputs = (plan.bucket_buffers[bucket.index],)
        elif mode == "staging":
            inputs = plan.bucket_buffers
        else:
            inputs = tuple(plan.grad_buffer.get(pid, grad_ids.get(pid, -1)) for pid in bucket.param_ids)
            inputs = tuple(t for t in inputs if t >= 0)
        after.setdefault(position, []).append(
            _collective(f"dp.bucket{bucket.index}.{setup.reduction}", setup.reduction, BACKWARD_INPUT,
                        bucket.nbytes, layer=ops[position].layer, microbatch=microbatch, allocs=allocs,
                        inputs=inputs, dtype=plan.grad_dtype))
    tail = []
    if mode == "per_bucket":
        for bucket in plan.buckets:
            tail.append(_copy(f"dp.bucket{bucket.index}.copy_to_grads", bucket.nbytes, BACKWARD_INPUT,
                              microbatch=microbatch, inputs=(plan.bucket_buffers[bucket.index],),
                              dtype=plan.grad_dtype))
    return after, tail


@dataclass(frozen=True)
class GradientSync:
    """A rank's gradient buckets, the buffers and shard they reduce into, and its shard size."""

    plan: _SyncPlan
    shard_numel: int        # elements of this rank's optimizer (and ZeRO-2/3 gradient) shard
    total_numel: int        # elements of the parameters being synchronized

    @property
    def persistent(self) -> tuple[int, ...]:
        """The tensors it allocates at set-up: bucket buffers, the compression's state."""
        codec = self.plan.codec
        return self.plan.bucket_buffers + (codec.persistent if codec is not None else ())

    def step_ops(self) -> list[Op]:
        """What runs first in the optimizer step (a compression's decompression)."""
        return list(self.plan.codec.step_ops) if self.plan.codec is not None else []


def prepare_sync(setup: DataParallelSetup, params: list[ParamInfo], tensors: dict[int, Tensor],
                 ids: IdSource) -> GradientSync:
    """Bucket `params` (registration order) and declare the bucket buffers and gradient shard.

    Buckets are packed in reverse registration order (torch's Reducer); the new tensors (persistent
    bucket buffers, the ZeRO-2/3 gradient shard) are added to `tensors`.
    """
    dp, stage = setup.dp, setup.zero_stage
    names = {p.id: p.name for p in params}
    grad_nbytes = {p.id: p.numel * DTYPE_BYTES[p.grad_dtype] for p in params}
    order = [p.id for p in reversed(params)]
    first_cap = DDP_FIRST_BUCKET_BYTES if setup.framework == "torch" else None
    first_cap = min(first_cap, setup.bucket_size_bytes) if first_cap is not None else None
    buckets = gradient_buckets(order, grad_nbytes, setup.bucket_size_bytes, first_cap)
    grad_dtype = params[0].grad_dtype if params else "fp32"
    buffers: list[int] = []
    if setup.buffers == "per_bucket":
        for bucket in buckets:
            t = Tensor(ids(), f"dp.bucket{bucket.index}", bucket.nbytes, COMMUNICATION_BUFFERS, grad_dtype,
                       (bucket.nbytes // DTYPE_BYTES[grad_dtype],), persistent=True)
            tensors[t.id] = t
            buffers.append(t.id)
    elif setup.buffers == "staging":
        size = max(b.nbytes for b in buckets)
        t = Tensor(ids(), "dp.grad_bucket", size, COMMUNICATION_BUFFERS, grad_dtype,
                   (size // DTYPE_BYTES[grad_dtype],), persistent=True)
        tensors[t.id] = t
        buffers.append(t.id)
    total = sum(p.numel for p in params)
    shard = sum(shard_numel(p.numel, dp) for p in params) if stage == 3 else shard_numel(total, dp)
    grad_shard = None
    if stage >= 2:
        g = Tensor(ids(), "dp.grad_shard", shard * DTYPE_BYTES[grad_dtype], GRADIENTS, grad_dtype, (shard,))
        tensors[g.id] = g
        grad_shard = g.id
    by_id = {p.id: p for p in params}
    bucket_params = [[BucketParam(pid, by_id[pid].name, by_id[pid].numel, by_id[pid].shape or (by_id[pid].numel,),
                                  by_id[pid].grad_buffer) for pid in bucket.param_ids] for bucket in buckets]
    bucket_buffers = list(buffers) if setup.buffers == "per_bucket" else [None] * len(buckets)
    codec = make_codec(setup.compression, dp, bucket_params, grad_dtype, bucket_buffers, ids, tensors)
    plan = _SyncPlan(tuple(buckets), tuple(buffers), grad_shard, names, grad_nbytes,
                     {p.id: p.grad_buffer for p in params if p.grad_buffer is not None}, grad_dtype, codec)
    return GradientSync(plan, shard, total)


def reduce_gradients(ops: list[Op], landings: "LandingPolicy", setup: DataParallelSetup, sync: GradientSync,
                     grad_ids: dict[int, int], allocate_shard: bool) -> list[Op]:
    """`ops` (one micro-batch's backward) with each bucket's reduction after its last gradient lands.

    `landings` gives, per parameter id, the index in `ops` after which its gradient is complete
    (`landing`), the order gradients arrived (`order`) and the tensors that became `.grad`
    (`grad_id`); `grad_ids` are the `.grad` tensors of the first backward (used where this one
    accumulated into them). The per-bucket copies back into `.grad` (torch DDP) are appended.
    """
    after, tail = _sync(ops, landings, setup, sync.plan, grad_ids, allocate_shard)
    return _weave(ops, {}, after, {}, {}) + tail


# ------------------------------------------------------------------------------- ZeRO-3 gathers
def _segments(ops: list[Op], start: int, stop: int, backward: bool) -> list[tuple[object, list[int]]]:
    """Consecutive runs of ops of one module: a layer, or what runs before/after the layers."""
    layered = [i for i in range(start, stop) if ops[i].layer >= 0]
    first, last = (layered[0], layered[-1]) if layered else (stop, stop)
    head, tail = ("post", "pre") if backward else ("pre", "post")
    runs: list[tuple[object, list[int]]] = []
    for i in range(start, stop):
        layer = ops[i].layer
        if layer >= 0:
            key: object = layer
        elif i < first:
            key = head
        elif i > last:
            key = tail
        else:
            key = runs[-1][0]
        if runs and runs[-1][0] == key:
            runs[-1][1].append(i)
        else:
            runs.append((key, [i]))
    return runs


def _gathers(ops: list[Op], params: dict[int, Tensor], ids: IdSource, tensors: dict[int, Tensor]
             ) -> tuple[dict[int, list[Op]], dict[int, list[int]], dict[int, dict[int, int]]]:
    """ZeRO-3: all_gather each segment's parameters one segment ahead, release them after it."""
    seed = next((i for i, op in enumerate(ops) if op.name == BACKWARD_SEED), len(ops))
    microbatch = ops[0].microbatch if ops else 0
    before: dict[int, list[Op]] = {}
    extra_frees: dict[int, list[int]] = {}
    remap: dict[int, dict[int, int]] = {}
    forward_need: dict[object, list[int]] = {}
    for backward, (start, stop) in ((False, (0, seed)), (True, (seed, len(ops)))):
        segments = _segments(ops, start, stop, backward)
        needs = []
        for key, members in segments:
            need: list[int] = list(forward_need.get(key, [])) if backward else []
            for i in members:
                for tid in ops[i].inputs:
                    if tid in params and tid not in need:
                        need.append(tid)
            if not backward:
                merged = forward_need.setdefault(key, [])
                merged.extend(p for p in need if p not in merged)
            needs.append(need)
        phase = BACKWARD_INPUT if backward else FORWARD
        for k, ((key, members), need) in enumerate(zip(segments, needs)):
            if not need:
                continue
            copies = {}
            for pid in need:
                full = params[pid]
                copy = Tensor(ids(), f"{full.name}.gathered", full.nbytes, PARAMETERS, full.dtype, full.shape)
                tensors[copy.id] = copy
                copies[pid] = copy.id
            # Prefetch: gathered while the previous segment runs (the first one right before it).
            at = segments[k - 1][1][0] if k > 0 else members[0]
            layer = key if isinstance(key, int) else -1
            before.setdefault(at, []).append(
                _collective(f"zero3.all_gather.{'bwd' if backward else 'fwd'}.{key}", "all_gather", phase,
                            sum(params[p].nbytes for p in need), layer=layer, microbatch=microbatch,
                            allocs=tuple(copies[p] for p in need), inputs=tuple(need),
                            dtype=params[need[0]].dtype))
            for i in members:
                remap[i] = copies
            extra_frees.setdefault(members[-1], []).extend(copies[p] for p in need)
    return before, extra_frees, remap


# ------------------------------------------------------------------------------- the pass
def apply_data_parallel(workload: "IterationWorkload", setup: DataParallelSetup, params: list[ParamInfo],
                        lists: MicrobatchOps, ids: IdSource) -> "IterationWorkload":
    """Turn one rank's single-device iteration into its data-parallel program (a new workload).

    `workload` is the dp = 1 `IterationWorkload`; `lists` its raw micro-batch ops with the
    policies that recorded where gradients landed; `params` in registration order.
    """
    dp, stage = setup.dp, setup.zero_stage
    tensors = dict(workload.tensors)
    prepared = prepare_sync(setup, params, tensors, ids)
    plan, shard, total = prepared.plan, prepared.shard_numel, prepared.total_numel
    grad_shard = plan.grad_shard
    persistent = list(workload.persistent) + list(prepared.persistent)
    gradients = [grad_shard] if grad_shard is not None else list(workload.gradients)
    buckets = plan.buckets
    first_grads = dict(lists.first_policy.grad_id)
    param_tensors = {p.id: tensors[p.id] for p in params}

    def build(ops: list[Op], policy: LandingPolicy, sync: bool, allocate_shard: bool) -> list[Op]:
        before: dict[int, list[Op]] = {}
        frees: dict[int, list[int]] = {}
        remap: dict[int, dict[int, int]] = {}
        if stage == 3:
            before, frees, remap = _gathers(ops, param_tensors, ids, tensors)
        after: dict[int, list[Op]] = {}
        tail: list[Op] = []
        if sync:
            after, tail = _sync(ops, policy, setup, plan, first_grads, allocate_shard)
        return _weave(ops, before, after, frees, remap) + tail

    accumulating = setup.accumulation_steps > 1
    first_sync = setup.sync_every_microbatch or not accumulating
    first = build(lists.first, lists.first_policy, first_sync, True)
    later: list[Op] = []
    last: list[Op] = []
    if accumulating and lists.later_policy is not None:
        later = build(lists.later, lists.later_policy, setup.sync_every_microbatch, False)
        if not setup.sync_every_microbatch:
            last = build(lists.later, lists.later_policy, True, False)

    optimizer_ids = list(workload.optimizer_state_ids)
    optimizer = list(workload.optimizer)
    if stage >= 1:
        optimizer_ids, optimizer = sharded_step(workload, setup, shard, total, tensors, ids, grad_shard)
    optimizer = prepared.step_ops() + optimizer
    if stage == 3:
        for p in params:
            full = tensors[p.id]
            n = shard_numel(p.numel, dp)
            tensors[p.id] = Tensor(p.id, f"{full.name}.shard", n * DTYPE_BYTES[full.dtype], PARAMETERS,
                                   full.dtype, (n,), persistent=True)
    meta = dict(workload.meta)
    meta.update({"dp": dp, "zero_stage": stage, "dp_buckets": tuple(b.nbytes for b in buckets),
                 "dp_shard_numel": shard})
    return replace(workload, tensors=tensors, persistent=tuple(persistent),
                   optimizer_state_ids=tuple(optimizer_ids), first_microbatch=first, later_microbatch=later,
                   last_microbatch=last, optimizer=optimizer, gradients=tuple(gradients), meta=meta)


def sharded_step(workload, setup: DataParallelSetup, shard: int, total: int, tensors: dict[int, Tensor],
                 ids: IdSource, grad_shard: int | None) -> tuple[list[int], list[Op]]:
    """Optimizer states and step ops on this rank's flat shard (replacing the per-parameter ones).

    `workload` is an IterationWorkload or a pipeline StageWorkload (its `optimizer` and
    `optimizer_state_ids` are replaced); `total` = the elements of the parameters it updates.
    """
    # The per-parameter step goes, the loss scaler's kernels too: they are made again below, over the shard
    # (with their own temporaries).
    old_temps = [t for op in workload.optimizer for t in op.allocs]
    for tid in list(workload.optimizer_state_ids) + old_temps:
        tensors.pop(tid, None)
    master_dtype = setup.master_dtype or setup.param_dtype
    grad_dtype = tensors[grad_shard].dtype if grad_shard is not None else None
    flat = MasterParam("zero.shard", (shard,), shard, master_dtype, grad_dtype or master_dtype)
    use = workload.meta.get("loss_scaler")
    before: list[Op] = []
    after: list[Op] = []
    if use is not None:
        # The fp16 loss scaler checks what this rank's step reads: torch's ZeRO-1 (ZeroRedundancyOptimizer behind
        # DDP) every gradient, the sharded optimizers their gradient shard (DeepSpeed then all_reduces the flag).
        checked = list(use.params) if setup.framework == "torch" and setup.zero_stage == 1 else \
            [MasterParam("zero.shard", (shard,), shard, master_dtype, use.params[0].grad_dtype if use.params
                         else master_dtype)]
        before, after = use.scaler.ops(checked, ids, tensors, self_unscaling=use.self_unscaling,
                                       dp_overflow_reduce=setup.framework == "deepspeed")
    states: list[Tensor] = []
    if setup.master_dtype:
        states.append(Tensor(ids(), "zero.shard.master", shard * DTYPE_BYTES[master_dtype], OPTIMIZER_STATES,
                             master_dtype, (shard,), persistent=True))
    states += optimizer_states(setup.optimizer, [flat], ids, setup.step_on_device)
    for t in states:
        tensors[t.id] = t
    ops = list(before)
    converted = None
    if setup.framework == "deepspeed" and setup.master_dtype and setup.param_dtype != setup.master_dtype:
        # DeepSpeed hands the optimizer an fp32 copy of the (16-bit) gradient shard.
        t = Tensor(ids(), "zero.grad_shard.fp32", shard * DTYPE_BYTES[master_dtype], GRADIENTS, master_dtype,
                   (shard,))
        tensors[t.id] = t
        converted = t.id
        ops.append(_copy("zero.grad_shard_to_fp32", shard * DTYPE_BYTES[master_dtype], OPTIMIZER_STEP,
                         allocs=(t.id,), dtype=master_dtype))
    ops += step_ops(setup.optimizer, setup.optimizer_implementation, [flat], ids, tensors)
    param_bytes = DTYPE_BYTES[setup.param_dtype]
    if setup.master_dtype:
        frees = (converted,) if converted is not None else ()
        ops.append(_copy("zero.master_to_params", shard * param_bytes, OPTIMIZER_STEP, frees=frees,
                         dtype=setup.param_dtype))
    elif converted is not None:
        ops[-1] = replace(ops[-1], frees=ops[-1].frees + (converted,))
    ops += after
    if setup.zero_stage in (1, 2):
        ops.append(_collective("zero.all_gather_params", "all_gather", OPTIMIZER_STEP, total * param_bytes,
                               dtype=setup.param_dtype))
    return [t.id for t in states], ops
