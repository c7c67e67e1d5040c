"""Op-model profiles: a pipeline chunk (or a whole model) recorded with a few layers by the simulator's own
builders and read off as Segments per action, plus what its persistent tensors and parameters are per layer.

A profile is keyed by everything that shapes a chunk's ops except its layer count and the data-parallel size
(model shape, training recipe, tensor parallelism, kernel profile, device, where the chunk sits, whether
backwards are split): `ChunkProfile.actions` then gives any layer count from three recorded layers
(segments.py). Data parallelism is applied afterwards from the parameter list (stage_model.py) with
data_parallel.py's own functions, except ZeRO-2/3 (pp = 1), whose gradients and parameters change every
backward: those profiles are recorded with their data-parallel size.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from simulator.hardware.catalog import DeviceSpec
from simulator.parallel.host_issue import host_active, host_costs
from simulator.parallel.lower import timed_ops
from simulator.workload.graph import ACTIVATIONS, COMMUNICATION_BUFFERS, OTHER, PARAMETERS, Op, Tensor
from simulator.workload.primitives import KernelProfile
from simulator.workload.stage import KEEPS_OUTPUT, SEED_OP, StageSpec, build_stage
from simulator.workload.training import Recipe, build_iteration
from simulator.workload.transformer import Shape
from simulator.workload.weight_split import RETAIN_GRAPH

from simulator.explore.segments import Blocks, blocks_of

_LAYER = re.compile(r"^layers\.(\d+)\.")
FIRST, MIDDLE, LAST, WHOLE = "first", "middle", "last", "whole"
RECORDED_LAYERS = 3          # a profile's layers when the chunk has more (segments.Blocks.for_layers)
PROFILE_MICROBATCHES = 2     # the first backward (which creates .grad) and a later one


@dataclass(frozen=True)
class ProfileKey:
    """What a chunk's ops depend on, besides its layer count (`recorded` is the layers actually built)."""

    shape: Shape
    recipe: Recipe              # accumulation_steps = the micro-batches recorded; dp, zero_stage as recorded
    kernels: KernelProfile
    device: DeviceSpec
    kind: str                   # FIRST | MIDDLE | LAST | WHOLE (pp = 1: the whole model, build_iteration)
    recorded: int               # layers built
    split: bool = False         # zero-bubble: backwards split into I and W
    stage_input: tuple[tuple[int, ...], str] | None = None    # MIDDLE / LAST: the received activation
    tp_overlap: tuple[bool, bool] = (False, False)   # (tp_comm_overlap, tp_backward_overlap) as resolved


@dataclass(frozen=True)
class ParamSpec:
    """A parameter as the optimizer and the gradient buckets see it (its layer: None outside the layers)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layer: int | None


@dataclass(frozen=True)
class ChunkProfile:
    """One chunk's (or pp = 1: the model's) per-micro-batch actions and persistent tensors.

    Attributes:
        key: what it was recorded for.
        forward, backward_first, backward_later: Blocks of F and of B (with a split: I) for the micro-batch
            whose backward runs first (it creates `.grad` where gradients are not persistent buffers) and a
            later one; weight_first / weight_later: W of a split backward (None without).
        before_forward_bytes: allocated before F (token ids / targets, the received stage input).
        before_backward_bytes: allocated before B or I (the received gradient of the stage output).
        after_backward_bytes: freed after B or I (inputs, the stage input unless W still reads it, a kept
            stage output); after_weight_bytes: freed after W (what it still read).
        sent_output_bytes: the stage output the send stream frees once sent (Megatron); input_grad_bytes:
            the input gradient it frees once sent. output_bytes: the activation sent to the next stage.
        params: the chunk's parameters in registration order.
        buffers: persistent non-parameter tensors (masks, sequence-parallel buffers) as (category, bytes, layer).
        tied_embedding_grad_bytes: the tied word embedding's gradient all_reduced between the end stages.
        output: (shape, dtype) of the chunk's output (the next stage's input).
        grad_shard_bytes: ZeRO-2/3's gradient shard in the recording (allocated by the first reduction).
    """

    key: ProfileKey
    forward: Blocks
    backward_first: Blocks
    backward_later: Blocks
    weight_first: Blocks | None
    weight_later: Blocks | None
    before_forward_bytes: int
    before_backward_bytes: int
    after_backward_bytes: int
    after_weight_bytes: int
    sent_output_bytes: int
    input_grad_bytes: int
    output_bytes: int
    params: tuple[ParamSpec, ...]
    buffers: tuple[tuple[str, int, int | None], ...]
    tied_embedding_grad_bytes: int
    output: tuple[tuple[int, ...], str]
    grad_shard_bytes: int = 0
    replay: "ReplayOps | None" = None


@dataclass(frozen=True)
class ReplayOps:
    """The recorded ops themselves, for replaying their memory calls through the allocator model (reserved.py):
    per micro-batch kind ("first": the one whose backward runs first, "later": another), its F, B (I) and W ops
    and the tensors allocated before and freed after them, with every Tensor."""

    tensors: dict
    ops: dict                 # (kind, action) -> tuple of Op, action in forward | backward | weight
    before_forward: dict      # kind -> tensor ids allocated before F (inputs; the received stage input on recv)
    received: dict            # kind -> the received stage input's id (None on the first stage)
    before_backward: dict     # kind -> the received output gradient's id (None on the last stage)
    after_backward: dict      # kind -> ids freed after B / I
    after_weight: dict        # kind -> ids freed after W
    sent: dict                # kind -> ids the send stream frees once sent (stage output, input gradient)


def _layer_of(name: str) -> int | None:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def _persistent(tensors: dict[int, Tensor], persistent: tuple[int, ...],
                frozen: frozenset[int] = frozenset()) -> tuple[tuple, tuple]:
    """(params, buffers) among persistent tensors, leaving out what model_states adds (gradient buffers, the loss
    scaler) and data parallelism's bucket buffers: stage_model.py makes those for the chunk's real size. Frozen
    parameters (`frozen`: PEFT's base weights) have no gradient nor optimizer state: they count as buffers."""
    params, buffers = [], []
    for tid in persistent:
        t = tensors[tid]
        if tid in frozen:
            buffers.append((t.category, t.nbytes, _layer_of(t.name)))
        elif t.category == PARAMETERS:
            params.append(ParamSpec(t.name, tuple(t.shape), t.dtype, _layer_of(t.name)))
        elif t.category in (OTHER, COMMUNICATION_BUFFERS, ACTIVATIONS) and not t.name.startswith(("grad_scaler.", "dp.")):
            buffers.append((t.category, t.nbytes, _layer_of(t.name)))
    return tuple(params), tuple(buffers)


def _timed(ops: tuple[Op, ...] | list[Op], tensors: dict[int, Tensor], device: DeviceSpec,
           cache: dict) -> tuple[list[Op], list[float]]:
    runs = timed_ops(list(ops), tensors, device, 0, cache)
    return [run.op for run in runs], [run.duration_s for run in runs]


def _blocks(ops, tensors, device, cache, key: ProfileKey | None = None, lists: tuple | None = None) -> Blocks:
    """The Blocks of `ops`; with `key` asking for tensor-parallel overlap, each op list of `lists` (the lowering's
    separate lists that make up `ops`: a backward and its weight-gradient ops) gets tp_overlap's pairs. Without
    it, the Blocks keep each op's kernel and host seconds, so that any layer count is timed on the host-issue
    clock over its whole list (segments.Issue); with it, the recorded issued times (the overlap scales a GEMM's
    issued time, host wait included, as lower_multi does)."""
    listed, durations = _timed(ops, tensors, device, cache)
    beside = None
    if key is not None and any(key.tp_overlap) and key.recipe.tp > 1:
        beside = [None] * len(listed)
        base = 0
        for part in (lists if lists is not None else (ops,)):
            _pair(listed, durations, beside, base, len(part), key, device)
            base += len(part)
    issue = None
    if beside is None and host_active(device):
        kernels = [run.duration_s for run in timed_ops(list(ops), tensors, _without_host(device), 0, cache)]
        starts, base = set(), 0
        for part in (lists if lists is not None else (ops,)):
            starts.add(base)
            base += len(part)
        issue = (kernels, host_costs(listed, device), starts)
    return blocks_of(listed, durations, tensors, beside, issue)


def _without_host(device: DeviceSpec) -> DeviceSpec:
    """`device` with launches that cost the host nothing: timed_ops then gives the kernels' own seconds."""
    return dataclasses.replace(device, host_forward_op_s=0.0, host_backward_op_s=0.0, host_checkpoint_s=0.0,
                               host_optimizer_tensor_s=0.0)


def _pair(ops: list[Op], durations: list[float], beside: list, base: int, count: int, key: ProfileKey,
          device: DeviceSpec) -> None:
    """Apply tp_overlap.plan_overlaps to ops[base:base + count] as rank_streams.RankStreams.overlapped runs them: the
    GEMM slowed by the SMs the collective holds, and the collective marked with the compute it runs beside."""
    from simulator.parallel.overlap import OverlapOptions
    from simulator.parallel.tp_overlap import plan_overlaps

    options = OverlapOptions(tp_comm_overlap=key.tp_overlap[0], tp_backward_overlap=key.tp_overlap[1])
    for o in plan_overlaps(ops[base:base + count], options, key.recipe.tp, device):
        c, g = base + o.collective, base + o.gemm
        alone = durations[g]
        scaled = alone * o.gemm_scale
        if o.collective_first:
            durations[g] = scaled * (1 - o.gemm_after) + alone * o.gemm_after
            beside[c] = (1.0, scaled * (1 - o.gemm_after))
        else:
            durations[g] = scaled
            between = sum(durations[k] for k in range(g + 1, c) if ops[k].op_class != "collective")
            beside[c] = (o.ahead, scaled * (1 - o.gemm_before) + between)


def _split_at_seed(ops: list[Op]) -> tuple[list[Op], list[Op]]:
    for k, op in enumerate(ops):
        if op.name == SEED_OP:
            return ops[:k], ops[k:]
    return ops, []


def record(key: ProfileKey, cache: dict | None = None) -> ChunkProfile:
    """Build `key`'s chunk with the simulator's builders and summarise it.

    `cache`: timed_ops' per-device cache of op times (shared across profiles of one device).
    """
    cache = {} if cache is None else cache
    if key.kind == WHOLE:
        return _record_whole(key, cache)
    shape, recipe, device = key.shape, key.recipe, key.device
    n = key.recorded
    start = 0 if key.kind == FIRST else shape.num_layers - n if key.kind == LAST else 1
    spec = StageSpec(start, start + n, key.kind == FIRST, key.kind == LAST)
    microbatches = recipe.accumulation_steps
    workload = build_stage(shape, recipe, key.kernels, spec, microbatches, 0, key.stage_input,
                           sync_microbatch=microbatches - 1, split_weight=key.split)
    tensors = workload.tensors
    first = workload.microbatches[0]
    later = workload.microbatches[-1].resolved()
    size = {tid: t.nbytes for tid, t in tensors.items()}
    before_forward = sum(size[t] for t in first.inputs) + (size[first.stage_input] if first.stage_input is not None
                                                           else 0)
    before_backward = size[first.grad_output] if first.grad_output is not None else 0
    done = tuple(first.inputs) + ((first.stage_input,) if first.stage_input is not None else ())
    held: tuple[int, ...] = ()
    if key.split:
        late = set(done) if workload.meta.get("weight_split") == RETAIN_GRAPH else {
            t for op in first.weight for t in op.inputs + op.outputs + op.allocs + op.frees}
        held = tuple(t for t in done if t in late)
        done = tuple(t for t in done if t not in late)
    after_backward = sum(size[t] for t in done) + (size[first.output] if first.output is not None else 0)
    params, buffers = _persistent(tensors, workload.persistent)
    backward_first = first.backward if key.split else first.backward + first.weight
    backward_later = later.backward if key.split else later.backward + later.weight
    replay = _stage_replay(workload, key, first, later)
    lists_first = None if key.split else (first.backward, first.weight)
    lists_later = None if key.split else (later.backward, later.weight)
    return ChunkProfile(
        key=key,
        forward=_blocks(first.forward, tensors, device, cache, key),
        backward_first=_blocks(backward_first, tensors, device, cache, key, lists_first),
        backward_later=_blocks(backward_later, tensors, device, cache, key, lists_later),
        weight_first=_blocks(first.weight, tensors, device, cache, key) if key.split else None,
        weight_later=_blocks(later.weight, tensors, device, cache, key) if key.split else None,
        before_forward_bytes=before_forward, before_backward_bytes=before_backward,
        after_backward_bytes=after_backward, after_weight_bytes=sum(size[t] for t in held),
        sent_output_bytes=size[first.sent_output] if first.sent_output is not None else 0,
        input_grad_bytes=size[first.input_grad] if first.input_grad is not None else 0,
        output_bytes=first.output_bytes, params=params, buffers=buffers,
        tied_embedding_grad_bytes=int(workload.meta.get("tied_embedding_grad_bytes", 0)),
        output=(tuple(workload.output_shape), workload.output_dtype), replay=replay)


def _record_whole(key: ProfileKey, cache: dict) -> ChunkProfile:
    """pp = 1: the whole model with `key.recorded` layers (build_iteration), its first micro-batch and a later
    one cut at the loss seed into F and B."""
    shape = dataclasses.replace(key.shape, num_layers=key.recorded)
    workload = build_iteration(shape, key.recipe, key.kernels)
    tensors, device = workload.tensors, key.device
    first_f, first_b = _split_at_seed(workload.first_microbatch)
    later_ops = workload.later_microbatch or workload.first_microbatch
    later_fw, later_b = _split_at_seed(later_ops)
    inputs = sum(tensors[t].nbytes for t in workload.microbatch_inputs)
    plain = workload
    if key.recipe.dp > 1:
        # ZeRO-3 replaces the parameters by shards: the parameter list is the model's, before data parallelism.
        plain = build_iteration(shape, dataclasses.replace(key.recipe, dp=1, zero_stage=0), key.kernels)
    params, buffers = _persistent(plain.tensors, plain.persistent, frozenset(plain.meta.get("frozen_ids", ())))
    shard = sum(t.nbytes for t in tensors.values() if t.name == "dp.grad_shard")
    return ChunkProfile(
        key=key, forward=_blocks(first_f, tensors, device, cache, key),
        backward_first=_blocks(first_b, tensors, device, cache, key),
        backward_later=_blocks(later_b, tensors, device, cache, key), weight_first=None, weight_later=None,
        before_forward_bytes=inputs, before_backward_bytes=0, after_backward_bytes=inputs, after_weight_bytes=0,
        sent_output_bytes=0, input_grad_bytes=0, output_bytes=0, params=params, buffers=buffers,
        tied_embedding_grad_bytes=0, output=((), ""), grad_shard_bytes=shard,
        replay=ReplayOps(tensors, {("first", "forward"): tuple(first_f), ("first", "backward"): tuple(first_b),
                                   ("later", "forward"): tuple(later_fw), ("later", "backward"): tuple(later_b)},
                         {k: tuple(workload.microbatch_inputs) for k in KINDS}, {k: None for k in KINDS},
                         {k: None for k in KINDS}, {k: tuple(workload.microbatch_inputs) for k in KINDS},
                         {k: () for k in KINDS}, {k: () for k in KINDS}))


KINDS = ("first", "later")


def _stage_replay(workload, key: ProfileKey, first, later) -> ReplayOps:
    """ReplayOps of a stage recording: micro-batch 0 (first backward) and the last one (recorded on its own tape,
    or a copy resolved to its own ids)."""
    ops, before, received, grad_in, after_b, after_w, sent = {}, {}, {}, {}, {}, {}, {}
    for kind, mb in (("first", first), ("later", later)):
        ops[(kind, "forward")] = tuple(mb.forward)
        ops[(kind, "backward")] = tuple(mb.backward if key.split else mb.backward + mb.weight)
        ops[(kind, "weight")] = tuple(mb.weight) if key.split else ()
        before[kind] = tuple(mb.inputs)
        received[kind] = mb.stage_input
        grad_in[kind] = mb.grad_output
        done = tuple(mb.inputs) + ((mb.stage_input,) if mb.stage_input is not None else ())
        held: tuple[int, ...] = ()
        if key.split:
            late = set(done) if workload.meta.get("weight_split") == RETAIN_GRAPH else {
                t for op in mb.weight for t in op.inputs + op.outputs + op.allocs + op.frees}
            held = tuple(t for t in done if t in late)
            done = tuple(t for t in done if t not in late)
        after_b[kind] = done + ((mb.output,) if mb.output is not None else ())
        after_w[kind] = held
        sent[kind] = tuple(t for t in (mb.sent_output, mb.input_grad) if t is not None)
    return ReplayOps(workload.tensors, ops, before, received, grad_in, after_b, after_w, sent)


def keeps_output(framework: str) -> bool:
    """Whether the pipeline runtime keeps a stage's output until its backward (torch, DeepSpeed)."""
    return framework in KEEPS_OUTPUT
