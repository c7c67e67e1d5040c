"""Multi-rank lowering: per representative rank, compute + communication streams from a pipeline schedule.

Conventions (what is modelled and how):
* Compute stream runs each schedule action's ops: F = the forward ops of that micro-batch and chunk,
  B = its backward ops. A stage chunk whose schedule splits backwards has them split into I (input
  gradients, with the send to the previous stage) and W (weight gradients) by
  workload/weight_split.py, which also places every free at the tensor's last use in that order; B of
  such a chunk runs I then W. The micro-batch's inputs are freed after I, or after W when W reads them
  (always after W under torch's retained graph: weight_split.RETAIN_GRAPH). A stage output the runtime
  keeps (MicrobatchStage.output: torch, DeepSpeed) is freed after B or I.
* Pipeline messages: after F the stage output is sent to the next stage, after B the input gradient
  to the previous one (SEND_STREAM, one stream per peer and kind so that sends to different peers do
  not queue behind each other); the input gradient, and a stage output the runtime does not keep for
  the backward (Megatron-LM), are freed by the send stream once the send has completed; a Recv
  (RECV_STREAM) is posted right before the action that needs it (as torch.distributed.pipelining does) and
  allocates the received tensor; the compute stream waits for it.
* Tensor-parallel collectives (group "tp") run on COMM_STREAM and the compute stream waits for them
  (Megatron's are blocking). Data-parallel reductions (group "dp", all_reduce / reduce_scatter) run
  on COMM_STREAM overlapped with backward; the compute stream waits for them before the optimizer
  step. Data-parallel all_gathers (ZeRO parameters) are waited for at once. A collective waited for at
  once, on a stream with no overlapped reduction outstanding, is one `Blocking` instruction of the
  compute stream (program.py); the others are Signal / WaitFor pairs around the comm stream's Collective.
* With pp > 1 the stage workload carries its data-parallel ops (workload/stage.py): bucket reductions
  during the backward of the stage's last micro-batch (per chunk), on their own stream (DP_STREAM:
  Megatron's DP and TP communicators run concurrently), overlapped with the rest of the backward;
  the optimizer step waits for all; ZeRO-1 all_gathers the updated parameters after the step;
  ZeRO-2/3 are refused. With tied embeddings, the first and last stage then all_reduce the word
  embedding's gradient (V/tp x h elements) over their "embedding group" (Megatron's
  finalize_model_grads), blocking, before the step.
* Persistent tensors (parameters, buffers) are allocated at set-up; optimizer states at the first step.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import repeat
from operator import add

from simulator.errors import PlanError
from simulator.hardware.catalog import DeviceSpec
from simulator.parallel.lower import COMPUTE, lower_single_rank, timed_ops
from simulator.parallel import overlap_templates
from simulator.parallel.overlap import NO_OVERLAP_CHANGE, OverlapOptions
from simulator.parallel.plan import ParallelPlan
from simulator.parallel.program import (COMM_STREAM, RECV_STREAM, SEND_STREAM, Alloc, Blocking, Collective, Free,
                                        Instruction, Mark, Period, Program, Run, Signal, WaitFor, alloc, free, recv,
                                        send, signal, wait_for)
from simulator.parallel.rank_streams import RankStreams, TimedOps
from simulator.parallel.schedule_check import CommStep, program as schedule_program
from simulator.parallel.schedules import Action, Schedule
from simulator.workload.graph import COLLECTIVE, FORWARD, GEMM, Op, Tensor, moved_ids
from simulator.workload.loss_scaler import skipped_step
from simulator.workload.primitives import KernelProfile
from simulator.workload.stage import MicrobatchStage, StageSpec, StageWorkload, build_stage
from simulator.workload.stage_reuse import relabel_layers
from simulator.workload.training import IterationWorkload, Recipe
from simulator.workload.transformer import Shape
from simulator.workload.weight_split import RETAIN_GRAPH

DP_STREAM = f"{COMM_STREAM}.dp"      # data-parallel reductions of pipeline stages (module docstring)


def lower_data_tensor_parallel(workload: IterationWorkload, device: DeviceSpec, plan: ParallelPlan, rank: int,
                               warmup_iterations: int, iterations: int, accumulation_steps: int,
                               overlap: OverlapOptions = NO_OVERLAP_CHANGE) -> Program:
    """pp = 1: the whole-model program of `rank` (lower_single_rank) with its collectives on COMM_STREAM."""
    single = lower_single_rank(workload, device, warmup_iterations, iterations, accumulation_steps, rank=rank)
    instructions = list(single.streams[COMPUTE])
    if workload.last_microbatch and accumulation_steps > 1:
        # The last micro-batch synchronizes gradients (DDP no_sync on the others): swap its ops in.
        last = timed_ops(workload.last_microbatch, workload.tensors, device, 0)
        later_ids = {id(op) for op in workload.later_microbatch}
        swapped: list[Instruction] = []
        microbatch = 0
        k = 0
        while k < len(instructions):
            ins = instructions[k]
            if isinstance(ins, Alloc) and ins.reason.startswith("micro-batch "):
                microbatch = int(ins.reason.split()[1])
            if isinstance(ins, Run) and microbatch == accumulation_steps - 1 and id(ins.op) in later_ids:
                while k < len(instructions) and isinstance(instructions[k], Run):
                    k += 1
                swapped += [_retag(run, ins.iteration) for run in last]
                continue
            swapped.append(ins)
            k += 1
        instructions = swapped
    streams = RankStreams(rank, plan, overlap=overlap, device=device)
    gathers: list[Run] = []
    if overlap.overlap_param_gather:
        # As lower_stage_rank: each iteration posts the parameter all_gather at its start, waited for after the first
        # micro-batch's forward.
        gathers = list({id(i.op): i for i in instructions if isinstance(i, Run) and _is_param_gather(i.op)}.values())
        instructions = [i for i in instructions if not (isinstance(i, Run) and _is_param_gather(i.op))]
    if workload.host is not None:
        streams.host_caps = dict(workload.host.caps)
    pending_runs: list[Run] = []
    for instruction in instructions:
        if isinstance(instruction, Run):
            if streams.gathering and instruction.op.phase != FORWARD:
                streams.emit(pending_runs)
                pending_runs = []
                streams.compute += [wait_for(event) for event in streams.gathering]
                streams.gathering.clear()
            pending_runs.append(instruction)
            continue
        if pending_runs:
            streams.emit(pending_runs)
            pending_runs = []
        if gathers and isinstance(instruction, Mark) and instruction.label == "iteration_start":
            streams.compute.append(instruction)
            streams.gathering += [streams.beside(_retag(run, instruction.iteration), 1.0, True) for run in gathers]
            continue
        if isinstance(instruction, (Mark, Free)) and (streams.pending or streams.deferred):
            streams.flush()
        streams.compute.append(instruction)
    if pending_runs:
        streams.emit(pending_runs)
    return streams.program(device, 0, workload.tensors, single.host_tensors)


def stage_specs(plan: ParallelPlan) -> dict[tuple[int, int], StageSpec]:
    """(stage, chunk) -> the layers it holds, from the plan's partition."""
    if not plan.stages:
        raise PlanError("parallel plan has no stage partition (make_plan builds it)")
    last = max(span.index for span in plan.stages)
    return {(span.stage, span.chunk): StageSpec(span.start, span.stop, span.index == 0, span.index == last)
            for span in plan.stages}


def stage_backward_order(schedule: Schedule, stage: int, chunk: int) -> tuple[int, int, bool]:
    """(first backward, last backward, split into I and W) of a (stage, chunk): build_stage's arguments.

    .grad is created by the backward that starts first; gradients are reduced after the one that ends last.
    """
    actions = [a for a in schedule.ranks[stage] if a.chunk == chunk]
    backwards = [a.microbatch for a in actions if a.kind in ("B", "I")]
    ends = [a.microbatch for a in actions if a.kind in ("B", "W")]
    return (backwards[0] if backwards else 0, ends[-1] if ends else schedule.microbatches - 1,
            any(a.kind == "I" for a in actions))


def build_stage_workloads(shape: Shape, recipe: Recipe, profile: KernelProfile, plan: ParallelPlan,
                          schedule: Schedule) -> dict[tuple[int, int], StageWorkload]:
    """Every (stage, chunk) workload in model order; a stage's input has the previous one's output shape."""
    specs = stage_specs(plan)
    spans = sorted(plan.stages, key=lambda span: span.index)
    result: dict[tuple[int, int], StageWorkload] = {}
    middles: dict[tuple, StageWorkload] = {}
    previous: tuple[tuple[int, ...], str] | None = None
    for span in spans:
        first_backward, last_backward, split = stage_backward_order(schedule, span.stage, span.chunk)
        spec = specs[(span.stage, span.chunk)]
        # A middle stage like one built already (as many layers, the same input and backward order) is that
        # one with its layer numbers moved (workload/stage_reuse.py): no second recording.
        key = (spec.stop - spec.start, previous, first_backward, last_backward, split)
        like = None if spec.first or spec.last else middles.get(key)
        if like is not None:
            workload = relabel_layers(like, spec.start)
        else:
            workload = build_stage(shape, recipe, profile, spec, schedule.microbatches, first_backward, previous,
                                   sync_microbatch=last_backward, split_weight=split)
            if not (spec.first or spec.last):
                middles[key] = workload
        result[(span.stage, span.chunk)] = workload
        previous = (workload.output_shape, workload.output_dtype)
    return result


def lower_stage_rank(plan: ParallelPlan, schedule: Schedule, stage: int,
                     workloads: dict[tuple[int, int], StageWorkload], device: DeviceSpec,
                     warmup_iterations: int, iterations: int, dp: int = 0, tp: int = 0,
                     schedule_steps: tuple[tuple[Action | CommStep, ...], ...] | None = None,
                     timing_cache: dict[tuple, float] | None = None,
                     overlap: OverlapOptions = NO_OVERLAP_CHANGE, templates: bool = True) -> Program:
    """The program of rank (dp, stage, tp); by default the stage's representative (dp = tp = 0).

    `schedule_steps`: `schedule_check.program(schedule)` (every stage's) when the caller lowers several
    ranks; computed here otherwise. `timing_cache`: timed_ops' cache, shared by the caller's ranks.
    """
    rank = plan.rank_of(dp=dp, pp=stage, tp=tp)
    chunks = sorted(chunk for (s, chunk) in workloads if s == stage)
    tensors: dict[int, object] = {}
    # Tensor ids of the chunks of one rank are made disjoint by an offset per chunk.
    offset = 0
    mine: dict[int, StageWorkload] = {}
    for chunk in chunks:
        if mine:
            offset = max(tensors) + 1
        workload = workloads[(stage, chunk)]
        if offset:
            workload = _shift(workload, offset)
        mine[chunk] = workload
        # One chunk's tensors are the program's as they are (read only; a copy costs ~10^5 inserts per rank).
        tensors = {**tensors, **workload.tensors} if tensors else workload.tensors
    cache = timing_cache if timing_cache is not None else {}
    timed = {chunk: _timed_microbatches(w, device, cache) for chunk, w in mine.items()}
    steps = {chunk: timed_ops(w.optimizer, w.tensors, device, 0) for chunk, w in mine.items()}
    gathers: dict[int, list[Run]] = {chunk: [] for chunk in chunks}
    if overlap.overlap_param_gather:
        # The distributed optimizer's all_gather of updated parameters runs during the next forward: in every
        # iteration it is posted at the start, beside the first forward action (the previous step's, in steady state).
        for chunk in chunks:
            gathers[chunk] = [run for run in steps[chunk] if _is_param_gather(run.op)]
            steps[chunk] = [run for run in steps[chunk] if not _is_param_gather(run.op)]
    streams = RankStreams(rank, plan, dp_stream=DP_STREAM, overlap=overlap, device=device)
    if not templates:
        streams.templates_on = False
    streams.compute.append(Alloc(tuple(t for w in mine.values() for t in w.persistent), "model set-up"))
    # One set of cuBLAS workspaces per rank (its first chunk's), allocated at the first forward and the first
    # backward GEMM the rank runs, whichever chunk that belongs to.
    first = mine[min(mine)]
    forward_names = {o.name for o in first.microbatches[0].forward}
    # The forward handle's group comes first (training.workspace_first_use); a backward group whose first GEMM is a
    # recomputed forward one has a forward op's name, so it is keyed by its order, not by its name.
    for name, ids in first.first_use:
        forward = name in forward_names and True not in streams.first_gemm
        streams.first_gemm[forward] = streams.first_gemm.get(forward, ()) + tuple(ids)
    lowered = (schedule_steps if schedule_steps is not None else schedule_program(schedule))[stage]
    streams.consumer_position = _positions(schedule)
    total = warmup_iterations + iterations
    for it in range(total):
        if it == warmup_iterations:
            streams.compute.append(Mark("measure", it))
        streams.compute.append(Mark("iteration_start", it))
        for chunk in chunks:
            streams.gathering += [streams.beside(_retag(run, it), 1.0, True) for run in gathers[chunk]]
        for step in lowered:
            if isinstance(step, CommStep):
                _comm(streams, step, plan, mine, schedule, it)
                continue
            _action(streams, step, mine, timed, it)
            if streams.gathering and step.kind == "F":
                streams.compute += [wait_for(event) for event in streams.gathering]
                streams.gathering.clear()
        streams.post_sends()
        streams.sends_done()
        streams.flush()
        _tied_embedding_all_reduce(streams, mine, plan, it)
        for chunk in chunks:
            workload = mine[chunk]
            if it == 0:
                streams.compute.append(Alloc(workload.optimizer_state_ids, "optimizer state (first step)"))
            streams.runs([_retag(run, it) for run in steps[chunk]])
            streams.compute.append(Free(workload.gradients, "zero_grad(set_to_none=True)"))
        streams.compute.append(Mark("iteration_end", it))
    return streams.program(device, stage, tensors)


def _timed_microbatches(workload: StageWorkload, device: DeviceSpec,
                        cache: dict[tuple, float]) -> list[tuple[TimedOps, TimedOps, TimedOps]]:
    """(forward, backward, weight) timed ops per micro-batch; a copy (`shift` != 0) shares its template's, whose
    durations are its own (same ops and sizes; the L2 reuse only looks at adjacent ops of one micro-batch)."""
    by_ops: dict[int, TimedOps] = {}      # id(op tuple) -> its timing (copies share their template's tuple)

    def timed(ops: tuple[Op, ...]) -> TimedOps:
        found = by_ops.get(id(ops))
        if found is None:
            found = by_ops[id(ops)] = TimedOps.of(timed_ops(list(ops), workload.tensors, device, 0, cache))
        return found

    return [(timed(mb.forward), timed(mb.backward), timed(mb.weight)) for mb in workload.microbatches]


def _action(streams: RankStreams, action: Action, mine: dict[int, StageWorkload], timed, it: int) -> None:
    if streams.unsent:
        streams.sends_done()
    workload = mine[action.chunk]
    mb = workload.microbatches[action.microbatch]
    forward, backward, weight = timed[action.chunk][action.microbatch]
    if action.kind == "F":
        if mb.shift:
            # A copy's forward: where a repeated period of memory calls may start (engine/repeats.py).
            region = streams.regions.get(action.chunk)
            if region is None:
                region = streams.regions[action.chunk] = _copy_region(workload)
            streams.compute.append(Period(f"F{action.chunk}", mb.shift, *region))
        if mb.inputs:
            streams.compute.append(alloc(mb.inputs, f"micro-batch {action.microbatch} inputs"))
        streams.microbatch(forward, it, mb.shift, mb.low)
        return
    if action.kind in ("B", "I"):
        streams.microbatch(backward, it, mb.shift, mb.low)
    if action.kind in ("B", "W"):
        streams.microbatch(weight, it, mb.shift, mb.low)      # nothing unless the chunk's backwards are split
    done = mb.inputs + ((mb.stage_input,) if mb.stage_input is not None else ())
    if action.kind == "I":
        # What W still reads (everything, where I keeps the autograd graph) is freed after W, the rest now.
        late = set(done) if workload.meta.get("weight_split") == RETAIN_GRAPH else _weight_touched(mb)
        streams.held[(action.chunk, action.microbatch)] = tuple(t for t in done if t in late)
        done = tuple(t for t in done if t not in late)
    elif action.kind == "W":
        done = streams.held.pop((action.chunk, action.microbatch))
    if mb.output is not None and action.kind != "W":
        done = (mb.output,) + done            # the stage output the runtime kept for this backward
    if done:
        streams.compute.append(free(done, f"micro-batch {action.microbatch} done"))


def _is_param_gather(op: Op) -> bool:
    """The distributed optimizer's data-parallel all_gather of updated parameters (in the optimizer's ops)."""
    return op.op_class == COLLECTIVE and op.group == "dp" and op.collective == "all_gather"


def _weight_touched(mb: MicrobatchStage) -> set[int]:
    """The tensor ids (this micro-batch's) that its W ops read, write or free."""
    ids = tuple({t for op in mb.weight for t in op.inputs + op.outputs + op.allocs + op.frees})
    return set(moved_ids(ids, mb.shift, mb.low) if mb.shift else ids)


def _copy_region(workload: StageWorkload) -> tuple[int, int]:
    """[low, high): the tensor ids of the template micro-batch and its copies (workload/stage.py lays them out
    as consecutive blocks of one span; shared and later ids lie outside)."""
    first = next(mb for mb in workload.microbatches if mb.shift)
    template = first.copy_of                     # copy j's block starts (j - template) spans after the template's
    span = first.shift // (first.index - template)
    return first.low, first.low + span * (len(workload.microbatches) - template)


_SEND_STREAMS = {kind: f"{SEND_STREAM}.{kind}" for kind in ("activation", "gradient")}


def _comm(streams: RankStreams, step: CommStep, plan: ParallelPlan, mine: dict[int, StageWorkload],
          schedule: Schedule, it: int) -> None:
    transfer = step.transfer
    peer = streams.peers.get(step.peer)
    if peer is None:
        coords = plan.coords(streams.rank)
        peer = streams.peers[step.peer] = plan.rank_of(dp=coords.dp, pp=step.peer, tp=coords.tp)
    producer = transfer.producer
    kind = transfer.kind
    tag = f"{kind}:{producer.stage}:{producer.microbatch}:{it}"     # the message's tag (both ends)
    # Both ends carry the same name, which is how the Chrome trace pairs them into a flow arrow.
    name = f"{kind} from stage {producer.stage} microbatch {producer.microbatch}"
    compute = streams.compute
    count = streams.count
    if step.op == "send":
        mb = mine[producer.chunk if producer.chunk is not None else _chunk_of(streams, schedule, producer.stage)] \
            .microbatches[producer.microbatch]
        if kind == "activation":
            size, sent = mb.output_bytes, mb.sent_output
        else:
            size, sent = mb.input_grad_bytes, mb.input_grad
        ready = f"send.{tag}#{count + 1}"                                # streams.event(...)
        compute.append(signal(ready))
        stream: list[Instruction] = [wait_for(ready), send(name, peer, float(size), tag, it)]
        stream_name = _SEND_STREAMS.get(kind) or f"{SEND_STREAM}.{kind}"
        streams.stream(stream_name)                        # created in program order, filled by post_sends
        sends = streams.sends.get(stream_name)
        if sends is None:
            sends = streams.sends[stream_name] = []
        consumer = transfer.consumer
        sends.append((streams.consumer_position[(consumer.stage, consumer.kind, consumer.microbatch)], len(sends),
                      stream))
        if sent is not None:
            # The runtime holds the tensor until its send has completed (the request keeps it alive).
            stream.append(free((sent,), f"{kind} sent"))
        if streams.overlap.overlap_p2p_comm:
            streams.count = count + 1
            return
        # A blocking send: the stage's next action waits for it (after the recvs posted for that action, as
        # Megatron's batched send_forward_recv_backward waits for both).
        done = f"sent.{tag}#{count + 2}"
        streams.count = count + 2
        stream.append(signal(done))
        streams.unsent.append(done)
        return
    consumer = transfer.consumer
    chunk = consumer.chunk if consumer.chunk is not None else _chunk_of(streams, schedule, consumer.stage)
    workload = mine[chunk]
    mb = workload.microbatches[consumer.microbatch]
    received = mb.stage_input if kind == "activation" else mb.grad_output
    post, done = f"post.{tag}#{count + 1}", f"recv.{tag}#{count + 2}"
    streams.count = count + 2
    compute.append(signal(post))
    streams.stream(RECV_STREAM).extend([wait_for(post), recv(name, peer, float(workload.tensors[received].nbytes),
                                                             tag, (received,), it), signal(done)])
    compute.append(wait_for(done))


_LAST_POSITIONS: list = [None, None]     # (schedule, its positions): the ranks of one run share them


def _positions(schedule: Schedule) -> dict[tuple, int]:
    """Action key -> its position on its rank's list (computed once for the ranks of one lowering)."""
    if _LAST_POSITIONS[0] is not schedule:
        _LAST_POSITIONS[:] = [schedule, {a.key: i for actions in schedule.ranks for i, a in enumerate(actions)}]
    return _LAST_POSITIONS[1]


def _chunk_of(streams: RankStreams, schedule: Schedule, stage: int) -> int:
    """schedule.chunk_of(stage), once per stage."""
    chunk = streams.chunks.get(stage)
    if chunk is None:
        chunk = streams.chunks[stage] = schedule.chunk_of(stage)
    return chunk


def _tied_embedding_all_reduce(streams: RankStreams, mine: dict[int, StageWorkload], plan: ParallelPlan,
                               it: int) -> None:
    """First and last stage: all_reduce the tied word embedding's gradient over the embedding group."""
    size = max((int(w.meta.get("tied_embedding_grad_bytes", 0)) for w in mine.values()), default=0)
    if size == 0 or plan.pp == 1:
        return
    coords = plan.coords(streams.rank)
    group = (plan.rank_of(dp=coords.dp, pp=0, tp=coords.tp),
             plan.rank_of(dp=coords.dp, pp=plan.pp - 1, tp=coords.tp))
    ready, done = streams.event("embedding.grad.ready"), streams.event("embedding.grad.done")
    streams.compute.append(Signal(ready))
    reduce = Collective("pp.tied_embedding_grad_all_reduce", "all_reduce", group, float(size), (), (), it)
    streams.stream(COMM_STREAM).extend([WaitFor(ready), reduce, Signal(done)])
    streams.compute.append(WaitFor(done))


def _retag(run: Run, iteration: int) -> Run:
    return run if iteration == 0 else Run(run.op, run.duration_s, iteration, run.shift, run.low)


def _shift(workload: StageWorkload, offset: int) -> StageWorkload:
    """The workload with every tensor id moved by `offset` (for a second chunk on the same rank).

    Op tuples shared by micro-batch copies are moved once and stay shared; a copy's `low` moves with
    its template's ids (its `shift` is unchanged).
    """
    def ids(values):
        return tuple(v + offset for v in values)

    def op(o):
        return replace(o, inputs=ids(o.inputs), outputs=ids(o.outputs), allocs=ids(o.allocs), frees=ids(o.frees))

    moved: dict[int, tuple[Op, ...]] = {}      # id(op tuple) -> the moved tuple

    def ops(values: tuple[Op, ...]) -> tuple[Op, ...]:
        found = moved.get(id(values))
        if found is None:
            found = moved[id(values)] = tuple(op(o) for o in values)
        return found

    # A copy's id maps to its template's Tensor (StageWorkload.tensors; nothing reads `.id` of a copy's entry): each
    # Tensor object is moved once, and the ids that shared it share the moved one (a Tensor per id cost ~1.5 us, 10^6
    # ids at GPT-3 530B).
    values = workload.tensors.values()
    moved_tensors = {key: Tensor(t.id + offset, t.name, t.nbytes, t.category, t.dtype, t.shape, t.persistent)
                     for key, t in dict(zip(map(id, values), values)).items()}
    tensors = dict(zip(map(add, workload.tensors, repeat(offset)), map(moved_tensors.__getitem__, map(id, values))))
    microbatches = tuple(replace(mb, forward=ops(mb.forward), backward=ops(mb.backward), weight=ops(mb.weight),
                                 inputs=ids(mb.inputs),
                                 stage_input=None if mb.stage_input is None else mb.stage_input + offset,
                                 grad_output=None if mb.grad_output is None else mb.grad_output + offset,
                                 output=None if mb.output is None else mb.output + offset,
                                 sent_output=None if mb.sent_output is None else mb.sent_output + offset,
                                 input_grad=None if mb.input_grad is None else mb.input_grad + offset,
                                 low=mb.low + offset if mb.shift else 0)
                         for mb in workload.microbatches)
    return replace(workload, tensors=tensors, persistent=ids(workload.persistent),
                   optimizer_state_ids=ids(workload.optimizer_state_ids), microbatches=microbatches,
                   optimizer=[op(o) for o in workload.optimizer], gradients=ids(workload.gradients),
                   first_use=tuple((name, ids(group)) for name, group in workload.first_use))


def lower_multi(shape: Shape, recipe: Recipe, profile: KernelProfile, plan: ParallelPlan, schedule: Schedule,
                device: DeviceSpec, warmup_iterations: int, iterations: int,
                workload: IterationWorkload | None = None, full: bool = False,
                overlap: OverlapOptions = NO_OVERLAP_CHANGE,
                skipped_steps: bool = False, templates: bool = True) -> tuple[list[Program], dict]:
    """One Program per representative rank of `plan` (one per pipeline stage), or per rank with `full`.

    Args:
        shape, recipe, profile: the model, training options (tp, dp, zero) and kernel profile.
        plan: the parallel plan (with its stage partition).
        schedule: the pipeline schedule (pp ranks, recipe.accumulation_steps micro-batches).
        device: the GPU of every rank.
        warmup_iterations, iterations: as for lower_single_rank.
        workload: with pp = 1, the whole-model iteration (training.build_iteration) to lower.
        full: lower every rank of the plan (no symmetry reduction); programs come in rank order, rank 0
            (stage 0's representative) first.
        overlap: which communication overlaps compute (parallel/overlap.py resolve_overlap).
        skipped_steps: pp > 1: every stage's optimizer step is skipped (an fp16 overflow: only the loss scaler's
            kernels run); with pp = 1 the caller passes such a `workload`.
        templates: make overlapped micro-batch copies from their template (parallel/overlap_templates.py; the
            programs are the same either way; False: each lowered op by op).

    Returns:
        (programs, workloads): programs ordered by stage (by rank with `full`); workloads by stage (IterationWorkload for pp = 1,
        else a dict (stage, chunk) -> StageWorkload).

    Raises:
        PlanError: ZeRO-2/3 with pp > 1, or pp = 1 without `workload`.
    """
    if plan.pp == 1:
        if workload is None:
            raise PlanError("lower_multi: pp = 1 needs the whole-model workload")
        ranks = range(plan.world_size) if full else (0,)
        programs = [lower_data_tensor_parallel(workload, device, plan, rank, warmup_iterations, iterations,
                                               recipe.accumulation_steps, overlap) for rank in ranks]
        return programs, {0: workload}
    if recipe.dp > 1 and recipe.zero_stage > 1:
        raise PlanError(f"parallel.zero_stage = {recipe.zero_stage}: ZeRO-2/3 with parallel.pp = {plan.pp} > 1 is not "
                        f"supported (DeepSpeed's PipelineEngine refuses it too; allowed with pp > 1: 0, 1)")
    workloads = build_stage_workloads(shape, recipe, profile, plan, schedule)
    if skipped_steps:
        workloads = {key: replace(w, optimizer=skipped_step(w.optimizer)) for key, w in workloads.items()}
    schedule_steps = schedule_program(schedule)
    cache: dict[tuple, float] = {}
    if not full:
        programs = [lower_stage_rank(plan, schedule, stage, workloads, device, warmup_iterations, iterations,
                                     schedule_steps=schedule_steps, timing_cache=cache, overlap=overlap,
                                     templates=templates)
                    for stage in range(plan.pp)]
        return programs, workloads
    programs = []
    for rank in range(plan.world_size):
        c = plan.coords(rank)
        programs.append(lower_stage_rank(plan, schedule, c.pp, workloads, device, warmup_iterations, iterations,
                                         dp=c.dp, tp=c.tp, schedule_steps=schedule_steps, timing_cache=cache,
                                         overlap=overlap, templates=templates))
    return programs, workloads
