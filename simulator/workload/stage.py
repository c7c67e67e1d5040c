"""One pipeline stage's workload: per micro-batch forward and backward ops (distinct tensor ids), optimizer.

A stage holds a contiguous range of transformer layers, plus the embedding on the first stage and the
final norm, head and loss on the last. A stage that is not first takes its input from the previous
stage (a tensor allocated by the Recv, `MicrobatchStage.stage_input`); one that is not last has no loss:
its backward is seeded by the gradient received from the next stage (`MicrobatchStage.grad_output`, a
tensor of the stage output's shape allocated by the Recv). What a stage saves for backward is exactly
what the whole-model builder saves for those layers (workload/training.py conventions).

With `recipe.dp` > 1 the stage synchronizes its own gradients as Megatron-LM's DDP does with pp > 1
(`overlap_grad_reduce`): the same buckets as with pp = 1 (data_parallel.prepare_sync over the stage's
parameters) are reduced during the backward of the stage's LAST micro-batch (`sync_microbatch`; the
earlier ones only accumulate), each as soon as its last gradient lands; ZeRO-1 (and Megatron's
distributed optimizer) shards the optimizer states of the stage's parameters and all_gathers the
updated parameters after the step. ZeRO-2/3 are refused with pp > 1 (DeepSpeed's PipelineEngine
refuses them too). A tied embedding's gradient all_reduce between the first and last stage is added by
the lowering (`meta["tied_embedding_grad_bytes"]`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import repeat
from operator import add

from simulator.errors import PlanError
from simulator.workload.data_parallel import (
    DataParallelSetup, LandingPolicy, ParamInfo, prepare_sync, reduce_gradients, sharded_step,
)
from simulator.workload.graph import (ACTIVATIONS, BACKWARD_WEIGHT, DTYPE_BYTES, GRADIENTS, OTHER, Op, Tensor,
                                      moved_ids)
from simulator.workload.optimizers import IdSource
from simulator.workload.primitives import KernelProfile, Ops, annotate_collectives
from simulator.workload.tape import Ref, Tape, numel
from simulator.workload.training import CPU_RNG_STATE_BYTES, Recipe, model_states, recipe_dtypes, workspace_first_use
from simulator.workload.transformer import Checkpointing, Shape, TransformerBuilder
from simulator.workload.weight_split import RETAIN_GRAPH, WEIGHT_STORE, split_backward

SEED_OP = "loss.backward_seed"
INPUT_GRAD_NAME = "grad(stage_input)"      # the replay's name for the gradient of the received activation
KEEPS_OUTPUT = ("torch", "deepspeed")      # frameworks whose pipeline runtime keeps a stage output until backward


@dataclass(frozen=True)
class StageSpec:
    """Which part of the model a stage holds: layers [start, stop), embedding (first), head and loss (last)."""

    start: int
    stop: int
    first: bool
    last: bool


@dataclass(frozen=True)
class MicrobatchStage:
    """One micro-batch on a stage: forward ops, backward ops and the tensors exchanged with neighbours.

    A copy (`shift` != 0) shares its template's Op objects: its tensor ids are the ids of those ops
    that are >= `low`, moved by `shift` (ids below `low` are the stage's shared tensors: parameters,
    gradients, communication buffers), and its ops' `microbatch` field is the template's. `resolved()`
    builds the ops with the copy's own ids; the lowering emits `Run(op, ..., shift, low)` instead.

    Attributes:
        forward: ops up to the stage output (or the loss).
        backward: the loss seed (last stage only) then the backward ops; with a zero-bubble split, only
            the input-gradient part (I).
        weight: the weight-gradient part (W) of a zero-bubble split (workload/weight_split.py), else empty.
        inputs: token ids / targets allocated before the forward and freed after the backward.
        stage_input: the activation received from the previous stage (None on the first stage).
        grad_output: the gradient of the stage output received from the next stage (None on the last).
        output_bytes: bytes of the stage output (sent forward; 0 on the last stage).
        input_grad_bytes: bytes of the gradient of `stage_input` (sent backward; 0 on the first stage).
        output: the stage output when the runtime keeps it until the micro-batch's backward (B or I) —
            torch.distributed.pipelining's fwd_cache, DeepSpeed's pipe_buffers —, else None.
        sent_output: the stage output when the runtime frees it once its send has completed — Megatron-LM's
            `deallocate_pipeline_outputs`, which its training scripts set —, else None. Either way the forward
            ops do not free it (the send reads it).
        input_grad: the gradient of `stage_input`, freed once its send to the previous stage has completed
            (the backward ops do not free it); None on the first stage.
        shift, low: how the ids of `forward` / `backward` map to this micro-batch's (0, 0: as they are).
        index: the micro-batch's index (its ops' `microbatch` once resolved).
    """

    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    inputs: tuple[int, ...]
    stage_input: int | None
    grad_output: int | None
    output_bytes: int
    input_grad_bytes: int
    weight: tuple[Op, ...] = ()
    output: int | None = None
    sent_output: int | None = None
    input_grad: int | None = None
    # The recorded micro-batch whose ops a copy shares (-1: recorded, or given its own ops after copying).
    copy_of: int = field(default=-1, compare=False)
    shift: int = 0
    low: int = 0
    index: int = 0

    def resolved(self) -> MicrobatchStage:
        """This micro-batch with its own ops (ids moved, `microbatch` = `index`); itself if not a copy."""
        if not self.shift:
            return self
        return replace(self, forward=_moved_ops(self.forward, self.shift, self.low, self.index),
                       backward=_moved_ops(self.backward, self.shift, self.low, self.index),
                       weight=_moved_ops(self.weight, self.shift, self.low, self.index), shift=0, low=0)


def _moved_ops(ops: tuple[Op, ...], shift: int, low: int, index: int) -> tuple[Op, ...]:
    """`ops` with their tensor ids >= `low` moved by `shift` and micro-batch `index`."""
    return tuple([Op(o.name, o.op_class, o.phase, o.flops, o.bytes_read, o.bytes_written, o.dtype, o.gemm_mnk,
                     o.gemm_batch, moved_ids(o.inputs, shift, low), moved_ids(o.outputs, shift, low),
                     moved_ids(o.allocs, shift, low), moved_ids(o.frees, shift, low), o.layer, index,
                     o.collective, o.group, o.comm_bytes, o.host_allocs, o.host_frees, o.placement, o.tensors)
                  for o in ops])


@dataclass
class StageWorkload:
    """Everything one pipeline stage does in an iteration (one rank of the stage, tp-sharded).

    `tensors` maps every tensor id to its Tensor; the id of a micro-batch copy (MicrobatchStage.shift)
    maps to its template's Tensor object, whose name, size, category, dtype and shape it has but whose
    `.id` is the template's: take ids from the keys (nothing reads `.id` of a copy's entry).
    """

    tensors: dict[int, Tensor]
    persistent: tuple[int, ...]
    optimizer_state_ids: tuple[int, ...]
    microbatches: tuple[MicrobatchStage, ...]
    optimizer: list[Op]
    gradients: tuple[int, ...]
    parameter_count: int
    output_shape: tuple[int, ...] = ()
    output_dtype: str = ""
    meta: dict[str, object] = field(default_factory=dict)
    # The cuBLAS workspaces, allocated at the rank's first forward / backward GEMM (as IterationWorkload's).
    first_use: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class _Template:
    """A recorded micro-batch and its tensor-id block [base, base + span) that later ones copy."""

    microbatch: MicrobatchStage
    tensors: dict[int, Tensor]
    base: int
    span: int
    index: int

    def copy(self, index: int, base: int, into: dict[int, Tensor]) -> MicrobatchStage:
        """Micro-batch `index` with its block at `base`, sharing the template's ops; adds its tensors to `into`.

        Its tensor ids map to the template's Tensor objects (StageWorkload.tensors): building a Tensor per
        id cost ~2.5 us, 4-6 s for the ~1.8 M copied ids of GPT-3 175B at global batch 1,536.
        """
        shift = base - self.base
        low = self.base
        into.update(zip(map(add, self.tensors, repeat(shift)), self.tensors.values()))
        mb = self.microbatch

        def moved(value: int) -> int:
            return value + shift if value >= low else value

        return MicrobatchStage(
            forward=mb.forward, backward=mb.backward, weight=mb.weight, inputs=tuple([moved(v) for v in mb.inputs]),
            stage_input=None if mb.stage_input is None else moved(mb.stage_input),
            grad_output=None if mb.grad_output is None else moved(mb.grad_output),
            output=None if mb.output is None else moved(mb.output), output_bytes=mb.output_bytes,
            input_grad_bytes=mb.input_grad_bytes,
            sent_output=None if mb.sent_output is None else moved(mb.sent_output),
            input_grad=None if mb.input_grad is None else moved(mb.input_grad),
            copy_of=mb.copy_of if mb.copy_of >= 0 else self.index, shift=shift, low=low, index=index)


def _retained(recipe: Recipe, tensors: dict[int, Tensor], backward: tuple[Op, ...], landings):
    """What a zero-bubble I keeps until W besides what W reads, or None.

    Megatron's zero-bubble implementation (Qi et al.) stores only the deferred weight gradients' inputs
    (workload/weight_split.py). torch.distributed.pipelining runs I with the autograd graph retained: every
    saved activation stays, and so does the gradient arriving at every node that computes a weight gradient
    (captured by its hooks for W), here the incoming gradient of the I kernels where a parameter's gradient
    lands (norms compute theirs with their input gradient; `landings`: indices into `backward`).
    """
    if recipe.framework != "torch":
        return None
    captured = set()
    for k in landings:
        if backward[k].name.endswith(".accumulate_grad") and k > 0:
            k -= 1                                   # the kernel whose gradient it hands to .grad
        kernel = backward[k]
        if kernel.phase != BACKWARD_WEIGHT and kernel.inputs:
            captured.add(kernel.inputs[0])           # a backward kernel reads its incoming gradient first
    return lambda tid: tid in captured or tensors[tid].category == ACTIVATIONS


def _keep_output(forward: tuple[Op, ...], nbytes: int) -> tuple[tuple[Op, ...], int]:
    """The forward without the release of the stage output (its last op's output, `nbytes`), and its id."""
    last = forward[-1] if forward else None
    output = last.outputs[0] if last is not None and last.outputs else None
    if output is None or output not in last.frees:
        raise PlanError(f"stage workload: the forward's last op {last.name if last else None!r} does not release "
                        f"the stage output ({nbytes} bytes) as the replayed forward of a stage does")
    return forward[:-1] + (replace(last, frees=tuple(t for t in last.frees if t != output)),), output


def _keep_input_grad(backward: tuple[Op, ...], tensors: dict[int, Tensor]) -> tuple[tuple[Op, ...], int]:
    """The backward without the release of the stage input's gradient, and its id: the send to the previous stage
    reads it. The replay releases it, still held (autograd's `.grad` of the received leaf), with the last op, after
    that op's own releases — which may include gradients of the stage input merged into it by an accumulation."""
    last = backward[-1] if backward else None
    grads = [t for t in last.frees if tensors[t].name == INPUT_GRAD_NAME] if last is not None else []
    if not grads:
        raise PlanError(f"stage workload: the backward's last op {last.name if last else None!r} does not release "
                        f"the {INPUT_GRAD_NAME!r} as the replayed backward of a stage does")
    grad = grads[-1]
    return backward[:-1] + (replace(last, frees=tuple(t for t in last.frees if t != grad)),), grad


def _split(ops: list[Op], keep_seed: bool) -> tuple[tuple[Op, ...], tuple[Op, ...], int]:
    """Split a replayed micro-batch at the loss seed; returns (forward, backward, seed tensor id)."""
    for k, op in enumerate(ops):
        if op.name == SEED_OP:
            backward = ops[k:] if keep_seed else ops[k + 1:]
            return tuple(ops[:k]), tuple(backward), op.allocs[0]
    raise PlanError(f"stage workload: no {SEED_OP!r} op in the replay (an empty stage?)")


@dataclass(frozen=True)
class _Landings:
    """Where each parameter's gradient lands in one micro-batch's backward op list (data_parallel._sync)."""

    landing: dict[int, int]
    order: list[int]
    grad_id: dict[int, int]


def build_stage(shape: Shape, recipe: Recipe, profile: KernelProfile, spec: StageSpec, microbatches: int,
                first_backward: int = 0, stage_input: tuple[tuple[int, ...], str] | None = None,
                replay_all: bool = False, sync_microbatch: int | None = None,
                split_weight: bool = False) -> StageWorkload:
    """Build one pipeline stage's ops for `microbatches` micro-batches.

    Args:
        shape, recipe, profile: as for `training.build_iteration`; with recipe.dp > 1 the stage's
            gradients are bucketed and reduced over the data-parallel group (module docstring).
        spec: the layers of the stage and whether it is first and/or last.
        microbatches: micro-batches per iteration (each gets its own tensor ids).
        first_backward: the micro-batch whose backward runs first (its gradients become `.grad`;
            the others accumulate into them).
        stage_input: (shape, dtype) of the activation received from the previous stage; required
            unless `spec.first`.
        replay_all: record every micro-batch on its own tape. By default only the micro-batches up to
            the first one after `first_backward` (and after 0) are recorded; the later ones are that
            one's copy with its tensor ids moved to their own block (the same Op objects, with
            `MicrobatchStage.shift` / `low` saying how their ids move).
        sync_microbatch: the micro-batch whose backward runs last on this stage (it reduces the
            gradients when recipe.dp > 1); default the last one.
        split_weight: split every backward into I and W (zero-bubble schedules; workload/weight_split.py).
            `first_backward` is then the first I (its I and W create `.grad`: exact when the W passes
            run in the order of the I passes, as in the built-in schedules) and `sync_microbatch` the last W.

    Returns:
        The StageWorkload.

    Raises:
        PlanError: an empty layer range, a missing stage_input, a bad micro-batch count or ZeRO-2/3.
    """
    if not isinstance(microbatches, int) or microbatches < 1:
        raise PlanError(f"microbatches = {microbatches!r} must be a positive integer")
    if not 0 <= first_backward < microbatches:
        raise PlanError(f"first_backward = {first_backward!r} must be in 0..{microbatches - 1}")
    sync_microbatch = microbatches - 1 if sync_microbatch is None else sync_microbatch
    if isinstance(sync_microbatch, bool) or not isinstance(sync_microbatch, int) \
            or not 0 <= sync_microbatch < microbatches:
        raise PlanError(f"sync_microbatch = {sync_microbatch!r} must be in 0..{microbatches - 1}")
    if recipe.dp > 1 and recipe.zero_stage > 1:
        raise PlanError(f"parallel.zero_stage = {recipe.zero_stage}: ZeRO-2/3 shard gradients or parameters, which "
                        f"pipeline parallelism does not support (DeepSpeed's PipelineEngine refuses them too); "
                        f"allowed with parallel.pp > 1: 0, 1")
    if not spec.first and stage_input is None:
        raise PlanError(f"stage layers {spec.start}..{spec.stop}: a stage that is not first needs stage_input")
    dts = recipe_dtypes(recipe)
    b = recipe.micro_batch_size
    compress = recipe.activation_compression == "int8"
    rng_bytes = CPU_RNG_STATE_BYTES if profile.device_kind == "cpu" else 0
    fp8 = recipe.precision == "fp8-mixed"
    input_dtype = dts.autocast or dts.param
    tape = Tape(microbatch=0, compress_saved=compress, rng_state_bytes=rng_bytes)
    ops = Ops(tape, profile, dts.autocast, fp8_linear=fp8, tp=recipe.tp, sequence_parallel=recipe.sequence_parallel)
    builder = TransformerBuilder(ops, shape, dts.param, Checkpointing(recipe.recompute), b,
                                 layers=range(spec.start, spec.stop), first=spec.first, last=spec.last)
    tensors: dict[int, Tensor] = {}
    results: list[MicrobatchStage] = []
    first_policy: LandingPolicy | None = None
    persistent_refs: list[Ref] = []
    output_shape: tuple[int, ...] = ()
    output_dtype = ""
    template: _Template | None = None     # a replayed micro-batch the later ones are copies of
    landings: list[_Landings] = []        # per micro-batch, gradient landings in its backward ops
    next_id = 0
    for j in range(microbatches):
        if template is not None:
            # Identical up to tensor ids (its own block moves by a constant) and the micro-batch index.
            results.append(template.copy(j, next_id, tensors))
            landings.append(landings[-1])     # the template's: a copy runs the same ops in the same order
            next_id += template.span
            continue
        if j > 0:
            next_id = max(max(tensors) + 1, tape.next_tensor_id)
            new_tape = Tape(microbatch=j, first_tensor_id=next_id, compress_saved=compress, rng_state_bytes=rng_bytes)
            new_tape._storages.update({ref.id: tape._storages[ref.id] for ref in persistent_refs})
            ops = Ops(new_tape, profile, dts.autocast, fp8_linear=fp8, tp=recipe.tp,
                      sequence_parallel=recipe.sequence_parallel, comm_buffers=ops._comm_buffers)
            builder.ops, builder.tape = ops, new_tape
            tape = new_tape
        idx = targets = received = None
        declared: list[Ref] = []
        if spec.first:
            if shape.architecture == "vit":
                side = int(round((shape.seq - 1) ** 0.5)) * shape.patch
                idx = tape.storage("pixels", (b, shape.channels, side, side), input_dtype, OTHER)
            else:
                idx = tape.storage("input_ids", (b, shape.seq), "int64", OTHER)
            declared.append(idx)
        else:
            in_shape, in_dtype = stage_input
            received = tape.storage("stage_input", in_shape, in_dtype, ACTIVATIONS, requires_grad=True)
        if spec.last:
            targets = tape.storage("targets", (b,) if shape.architecture == "vit" else (b, shape.seq),
                                   "int64", OTHER)
            declared.append(targets)
        loss = builder.forward(idx, targets, received)
        if j == 0:
            persistent_refs = builder.params.refs + builder.buffers + ops.comm_buffers
            output_shape, output_dtype = loss.shape, loss.dtype
        accumulate = dts.persistent_grad_buffer or j != first_backward
        policy = LandingPolicy(accumulate)
        replayed, new_tensors = policy.finish(tape, loss)
        replayed = annotate_collectives(replayed, ops.collectives)
        tensors.update(new_tensors)
        if j == first_backward:
            first_policy = policy
        for ref in declared:
            tensors[ref.id] = Tensor(ref.id, tape._storages[ref.id].name, ref.nbytes, OTHER, ref.dtype, ref.shape)
        if received is not None:
            tensors[received.id] = Tensor(received.id, "stage_input", received.nbytes, ACTIVATIONS,
                                          received.dtype, received.shape)
        forward, backward, seed = _split(replayed, keep_seed=spec.last)
        output = sent_output = input_grad = None
        if not spec.last:
            forward, kept = _keep_output(forward, loss.nbytes)
            if recipe.framework in KEEPS_OUTPUT:
                output = kept
            else:
                sent_output = kept
        if received is not None:
            backward, input_grad = _keep_input_grad(backward, tensors)
        offset = len(forward) + (0 if spec.last else 1)
        landing = {pid: max(0, k - offset) for pid, k in policy.landing.items()}
        weight: tuple[Op, ...] = ()
        if split_weight:
            split = split_backward(backward, _retained(recipe, tensors, backward, landing.values()))
            backward, weight = split.input_part, split.weight_part
            landing = {pid: split.position(k) for pid, k in landing.items()}
        landings.append(_Landings(landing, list(policy.order), dict(policy.grad_id)))
        results.append(MicrobatchStage(
            forward=forward, backward=backward, weight=weight, inputs=tuple(ref.id for ref in declared),
            stage_input=None if received is None else received.id,
            grad_output=None if spec.last else seed, output=output, sent_output=sent_output,
            input_grad=input_grad,
            output_bytes=0 if spec.last else loss.nbytes,
            input_grad_bytes=0 if received is None else received.nbytes, index=j))
        end = max(max(tensors) + 1, tape.next_tensor_id)
        if j > 0 and j > first_backward and replay_all is False:
            block = {tid: t for tid, t in tensors.items() if tid >= next_id}
            template = _Template(results[-1], block, next_id, end - next_id, j)
        next_id = end
    # After copies every id lies below next_id (a copy's block ends there): no need to scan the ~10^5 keys.
    ids = IdSource(max(tape.next_tensor_id, next_id) if template is not None
                   else max(max(tensors) + 1, tape.next_tensor_id, next_id))
    first_tape_storages = tape._storages
    for ref in persistent_refs:
        st = first_tape_storages[ref.id]
        tensors[ref.id] = Tensor(ref.id, st.name, ref.nbytes, st.category, ref.dtype, ref.shape, persistent=True)
    persistent = [ref.id for ref in persistent_refs]
    params = builder.params
    states = model_states(params, dts, recipe, profile, ids, tensors)
    persistent += states.persistent
    state_tensors, opt_ops = states.state_tensors, states.optimizer_ops
    grads = [g.id for g in first_policy.grads] if first_policy is not None else []
    for gid in grads:
        t = tensors[gid]
        tensors[gid] = Tensor(t.id, t.name, t.nbytes, GRADIENTS, t.dtype, t.shape)
    meta: dict[str, object] = {"dtypes": dts, "tp": recipe.tp, "layers": (spec.start, spec.stop),
                               "loss_scaler": states.loss_scaler}
    if split_weight:
        meta["weight_split"] = RETAIN_GRAPH if recipe.framework == "torch" else WEIGHT_STORE
    if shape.tied and spec.first != spec.last and shape.architecture != "vit":
        # Megatron: the first stage's word embedding and the last stage's copy of it (the head) have
        # their gradients summed over the embedding group before the step (V/tp x h elements).
        meta["tied_embedding_grad_bytes"] = builder.vocab_rank * shape.hidden * DTYPE_BYTES[dts.grad]
    workload = StageWorkload(
        tensors=tensors, persistent=tuple(persistent), optimizer_state_ids=tuple(t.id for t in state_tensors),
        microbatches=tuple(results), optimizer=opt_ops, gradients=tuple(grads),
        parameter_count=sum(numel(r.shape) for r in params.refs), output_shape=output_shape,
        output_dtype=output_dtype, meta=meta,
        first_use=workspace_first_use(list(results[0].forward + results[0].backward + results[0].weight),
                                      states.workspaces))
    if recipe.dp == 1:
        return workload
    infos = [ParamInfo(ref.id, name, numel(ref.shape), dts.grad,
                       states.grad_buffers[k] if states.grad_buffers else None, tuple(ref.shape))
             for k, (ref, name) in enumerate(zip(params.refs, params.names))]
    return _data_parallel(workload, recipe, profile, infos, landings, first_backward, sync_microbatch, ids)


def _data_parallel(workload: StageWorkload, recipe: Recipe, profile: KernelProfile, params: list[ParamInfo],
                   landings: list[_Landings], first_backward: int, sync_microbatch: int,
                   ids: IdSource) -> StageWorkload:
    """The stage with its gradient buckets reduced during `sync_microbatch`'s backward (and ZeRO-1)."""
    dts = workload.meta["dtypes"]
    setup = DataParallelSetup(recipe.dp, recipe.zero_stage, recipe.framework, recipe.bucket_size_bytes,
                              len(workload.microbatches), recipe.optimizer, recipe.optimizer_implementation,
                              profile.device_kind == "cpu", dts.param, dts.master, recipe.compression)
    tensors = workload.tensors       # build_stage's own, not kept elsewhere: extended in place, not copied
    sync = prepare_sync(setup, params, tensors, ids)
    mb = workload.microbatches[sync_microbatch].resolved()     # a copy gets its own ops (their ids change)
    # A split backward's landings index I + W (build_stage); what lands in W is reduced in W.
    backward = reduce_gradients(list(mb.backward + mb.weight), landings[sync_microbatch], setup, sync,
                                landings[first_backward].grad_id, allocate_shard=True)
    cut = next((k for k, op in enumerate(backward) if mb.weight and op is mb.weight[0]), len(backward))
    microbatches = list(workload.microbatches)
    microbatches[sync_microbatch] = replace(mb, backward=tuple(backward[:cut]), weight=tuple(backward[cut:]),
                                            copy_of=-1)
    state_ids, optimizer = workload.optimizer_state_ids, workload.optimizer
    if recipe.zero_stage == 1:
        state_list, optimizer = sharded_step(workload, setup, sync.shard_numel, sync.total_numel, tensors, ids, None)
        state_ids = tuple(state_list)
    optimizer = sync.step_ops() + list(optimizer)
    meta = dict(workload.meta)
    meta.update({"dp": recipe.dp, "zero_stage": recipe.zero_stage,
                 "dp_buckets": tuple(b.nbytes for b in sync.plan.buckets), "dp_shard_numel": sync.shard_numel,
                 "dp_sync_microbatch": sync_microbatch})
    return replace(workload, tensors=tensors, persistent=workload.persistent + sync.persistent,
                   optimizer_state_ids=state_ids, microbatches=tuple(microbatches), optimizer=optimizer,
                   meta=meta)
