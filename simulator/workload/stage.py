"""One pipeline stage's workload: per micro-batch forward and backward ops (distinct tensor ids), optimizer.

A stage holds a contiguous range of transformer layers, plus the embedding on the first stage and the
final norm, head and loss on the last. A stage that is not first takes its input from the previous
stage (a tensor allocated by the Recv, `MicrobatchStage.stage_input`); one that is not last has no loss:
its backward is seeded by the gradient received from the next stage (`MicrobatchStage.grad_output`, a
tensor of the stage output's shape allocated by the Recv). What a stage saves for backward is exactly
what the whole-model builder saves for those layers (workload/training.py conventions).

Data parallelism is not applied here: gradient synchronization of a stage is added by the lowering.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from simulator.errors import PlanError
from simulator.workload.data_parallel import LandingPolicy
from simulator.workload.graph import ACTIVATIONS, GRADIENTS, OTHER, Op, Tensor
from simulator.workload.optimizers import IdSource
from simulator.workload.primitives import KernelProfile, Ops, annotate_collectives
from simulator.workload.tape import Ref, Tape, numel
from simulator.workload.training import CPU_RNG_STATE_BYTES, Recipe, dtypes_for, model_states
from simulator.workload.transformer import Checkpointing, Shape, TransformerBuilder

SEED_OP = "loss.backward_seed"


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

    Attributes:
        forward: ops up to the stage output (or the loss).
        backward: the loss seed (last stage only) then the backward ops.
        inputs: token ids / targets allocated before the forward and freed after the backward.
        stage_input: the activation received from the previous stage (None on the first stage).
        grad_output: the gradient of the stage output received from the next stage (None on the last).
        output_bytes: bytes of the stage output (sent forward; 0 on the last stage).
        input_grad_bytes: bytes of the gradient of `stage_input` (sent backward; 0 on the first stage).
    """

    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    inputs: tuple[int, ...]
    stage_input: int | None
    grad_output: int | None
    output_bytes: int
    input_grad_bytes: int


@dataclass
class StageWorkload:
    """Everything one pipeline stage does in an iteration (one rank of the stage, tp-sharded)."""

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


@dataclass(frozen=True)
class _Template:
    """A recorded micro-batch and its tensor-id block [base, base + span) that later ones copy."""

    microbatch: MicrobatchStage
    tensors: dict[int, Tensor]
    base: int
    span: int

    def copy(self, index: int, base: int, into: dict[int, Tensor]) -> MicrobatchStage:
        """Micro-batch `index` with its block at `base`; adds its tensors to `into`."""
        shift = base - self.base
        low = self.base

        def ids(values: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(v + shift if v >= low else v for v in values)

        def op(o: Op) -> Op:
            return replace(o, inputs=ids(o.inputs), outputs=ids(o.outputs), allocs=ids(o.allocs),
                           frees=ids(o.frees), microbatch=index)

        for tid, t in self.tensors.items():
            into[tid + shift] = replace(t, id=tid + shift)
        mb = self.microbatch
        return MicrobatchStage(
            forward=tuple(op(o) for o in mb.forward), backward=tuple(op(o) for o in mb.backward),
            inputs=ids(mb.inputs), stage_input=None if mb.stage_input is None else ids((mb.stage_input,))[0],
            grad_output=None if mb.grad_output is None else ids((mb.grad_output,))[0],
            output_bytes=mb.output_bytes, input_grad_bytes=mb.input_grad_bytes)


def _split(ops: list[Op], keep_seed: bool) -> tuple[tuple[Op, ...], tuple[Op, ...], int]:
    """Split a replayed micro-batch at the loss seed; returns (forward, backward, seed tensor id)."""
    for k, op in enumerate(ops):
        if op.name == SEED_OP:
            backward = ops[k:] if keep_seed else ops[k + 1:]
            return tuple(ops[:k]), tuple(backward), op.allocs[0]
    raise PlanError(f"stage workload: no {SEED_OP!r} op in the replay (an empty stage?)")


def build_stage(shape: Shape, recipe: Recipe, profile: KernelProfile, spec: StageSpec, microbatches: int,
                first_backward: int = 0, stage_input: tuple[tuple[int, ...], str] | None = None,
                replay_all: bool = False) -> StageWorkload:
    """Build one pipeline stage's ops for `microbatches` micro-batches.

    Args:
        shape, recipe, profile: as for `training.build_iteration` (recipe.dp is ignored here).
        spec: the layers of the stage and whether it is first and/or last.
        microbatches: micro-batches per iteration (each gets its own tensor ids).
        first_backward: the micro-batch whose backward runs first (its gradients become `.grad`;
            the others accumulate into them).
        stage_input: (shape, dtype) of the activation received from the previous stage; required
            unless `spec.first`.
        replay_all: record every micro-batch on its own tape. By default only the micro-batches up to
            the first one after `first_backward` (and after 0) are recorded; the later ones are that
            one's copy with its tensor ids moved to their own block (the same ops, allocs and frees).

    Returns:
        The StageWorkload.

    Raises:
        PlanError: an empty layer range, a missing stage_input or a bad micro-batch count.
    """
    if not isinstance(microbatches, int) or microbatches < 1:
        raise PlanError(f"microbatches = {microbatches!r} must be a positive integer")
    if not 0 <= first_backward < microbatches:
        raise PlanError(f"first_backward = {first_backward!r} must be in 0..{microbatches - 1}")
    if not spec.first and stage_input is None:
        raise PlanError(f"stage layers {spec.start}..{spec.stop}: a stage that is not first needs stage_input")
    dts = dtypes_for(recipe.precision, recipe.framework)
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
    next_id = 0
    for j in range(microbatches):
        if template is not None:
            # Identical up to tensor ids (its own block moves by a constant) and the micro-batch index.
            results.append(template.copy(j, next_id, tensors))
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
        results.append(MicrobatchStage(
            forward=forward, backward=backward, inputs=tuple(ref.id for ref in declared),
            stage_input=None if received is None else received.id,
            grad_output=None if spec.last else seed,
            output_bytes=0 if spec.last else loss.nbytes,
            input_grad_bytes=0 if received is None else received.nbytes))
        end = max(max(tensors) + 1, tape.next_tensor_id)
        if j > 0 and j > first_backward and replay_all is False:
            block = {tid: t for tid, t in tensors.items() if tid >= next_id}
            template = _Template(results[-1], block, next_id, end - next_id)
        next_id = end
    ids = IdSource(max(max(tensors) + 1, tape.next_tensor_id, next_id))
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
    return StageWorkload(
        tensors=tensors, persistent=tuple(persistent), optimizer_state_ids=tuple(t.id for t in state_tensors),
        microbatches=tuple(results), optimizer=opt_ops, gradients=tuple(grads),
        parameter_count=sum(numel(r.shape) for r in params.refs), output_shape=output_shape,
        output_dtype=output_dtype, meta={"dtypes": dts, "tp": recipe.tp, "layers": (spec.start, spec.stop)})
