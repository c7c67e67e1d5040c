"""A chunk of L layers with its data-parallel setting, as numbers: each action's Segment, the persistent bytes
by category, the optimizer step, the gradient buckets and when they are ready.

The actions come from a profile (profiles.py) extrapolated to L layers (segments.py); what does not repeat
per layer — optimizer states and step, gradient buffers, the loss scaler, cuBLAS workspaces, gradient buckets,
ZeRO shards — is made for the chunk's real parameter list by the workload's own functions
(training.model_states, data_parallel.prepare_sync / sharded_step / gradient_buckets), as a simulation does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

from simulator.hardware.catalog import DeviceSpec
from simulator.parallel.lower import timed_ops
from simulator.workload.data_parallel import DataParallelSetup, ParamInfo, prepare_sync, shard_numel, sharded_step
from simulator.workload.graph import (BACKWARD_INPUT, CATEGORIES, COMMUNICATION_BUFFERS, COPY, DTYPE_BYTES,
                                      GRADIENTS, OPTIMIZER_STATES, OTHER, PARAMETERS, Op, Tensor)
from simulator.workload.optimizers import IdSource
from simulator.workload.primitives import KernelProfile
from simulator.workload.tape import numel
from simulator.workload.training import Recipe, dtypes_for, model_states

from simulator.explore.profiles import WHOLE, ChunkProfile, ParamSpec, keeps_output
from simulator.explore.segments import Segment, summarize


@dataclass(frozen=True)
class Bucket:
    """A gradient bucket reduced during the synchronising backward: collective, bytes, seconds of that
    backward's compute from its start to when the bucket's last gradient has landed, and after which of its
    runs (ChunkModel.backward_runs) that is."""

    kind: str
    nbytes: int
    ready_s: float
    run: int = 0


@dataclass(frozen=True)
class ChunkModel:
    """One chunk of `layers` layers on one rank.

    Attributes:
        forward: F, with what is allocated before it (inputs, the received activation) and, for a runtime
            that frees the stage output once sent, that free at its end.
        backward_first / backward_later: B (I when split) of the micro-batch whose backward runs first and of a
            later one, with the received gradient before and the frees after (the input gradient's at its end).
        weight_first / weight_later: W of a split backward (None otherwise).
        sync_extra_s: compute the synchronising backward adds (copies into and out of bucket buffers).
        buckets: reductions of that backward (empty without data parallelism, or when they run every
            backward: `sync_every_backward`).
        persistent: bytes per category held from the start of a measured iteration (parameters, buffers,
            gradient buffers, optimizer states, bucket buffers; workspaces are the rank's: `workspace_bytes`).
        workspace_bytes: the cuBLAS workspaces (allocated once per rank).
        grad_shard_bytes: ZeRO-2/3's gradient shard, allocated by the first reduction of an iteration.
        step: the optimizer step (with ZeRO-1/2's parameter all_gather as a blocking collective).
        parameter_count: parameters of the chunk (its tp shard).
        output_bytes / input_grad_bytes: the activation sent to the next stage, the gradient to the previous.
        tied_embedding_grad_bytes: as ChunkProfile.
    """

    layers: int
    forward: Segment
    backward_first: Segment
    backward_later: Segment
    weight_first: Segment | None
    weight_later: Segment | None
    sync_extra_s: float
    buckets: tuple[Bucket, ...]
    sync_every_backward: bool
    persistent: tuple[tuple[str, int], ...]
    workspace_bytes: int
    grad_shard_bytes: int
    step: Segment
    parameter_count: int
    output_bytes: int
    input_grad_bytes: int
    tied_embedding_grad_bytes: int
    setup_sizes: tuple[int, ...] = ()         # persistent tensors allocated at set-up, in order (reserved.py)
    state_sizes: tuple[int, ...] = ()         # optimizer states, allocated at the first step
    workspace_groups: tuple[tuple[int, ...], ...] = ()   # cuBLAS workspaces: the forward handle's, the backward's
    step_calls: tuple[tuple[bool, int, int], ...] = ()   # the step's (allocate?, tensor id, bytes)
    backward_runs: tuple[Segment, ...] = ()   # the synchronising backward's runs (backward_runs())


def _params_for(profile: ChunkProfile, layers: int) -> list[ParamSpec]:
    """The chunk's parameters with `layers` layers: the recorded ones, the middle layer's repeated."""
    params = profile.params
    recorded = sorted({p.layer for p in params if p.layer is not None})
    if layers == len(recorded) or not recorded:
        return list(params)
    first_layer = min(recorded)
    before = [p for p in params if p.layer is None and params.index(p) < _first_index(params)]
    after = [p for p in params if p.layer is None and p not in before]
    by_layer = {layer: [p for p in params if p.layer == layer] for layer in recorded}
    middle = by_layer[recorded[1]]
    out = list(before) + by_layer[recorded[0]]
    for k in range(1, layers - 1):
        out += [ParamSpec(p.name.replace(f"layers.{recorded[1]}.", f"layers.{first_layer + k}.", 1), p.shape,
                          p.dtype, first_layer + k) for p in middle]
    last = first_layer + layers - 1
    out += [ParamSpec(p.name.replace(f"layers.{recorded[-1]}.", f"layers.{last}.", 1), p.shape, p.dtype, last)
            for p in by_layer[recorded[-1]]]
    return out + after


def _first_index(params: tuple[ParamSpec, ...]) -> int:
    return next((k for k, p in enumerate(params) if p.layer is not None), len(params))


def _buffer_sizes(profile: ChunkProfile, layers: int) -> list[tuple[str, int]]:
    """(category, bytes) of each persistent buffer of the chunk with `layers` layers (the middle layer's repeated)."""
    recorded = sorted({layer for _, _, layer in profile.buffers if layer is not None})
    scale = {layer: 1 for layer in recorded}
    if recorded and layers != len(recorded):
        scale[recorded[1]] = layers - 2
    return [(category, nbytes) for category, nbytes, layer in profile.buffers
            for _ in range(scale.get(layer, 1) if layer is not None else 1)]


def _buffer_bytes(profile: ChunkProfile, layers: int) -> dict[str, int]:
    recorded = sorted({layer for _, _, layer in profile.buffers if layer is not None})
    scale = {layer: 1 for layer in recorded}
    if recorded and layers != len(recorded):
        scale[recorded[1]] = layers - 2
    out: dict[str, int] = {}
    for category, nbytes, layer in profile.buffers:
        out[category] = out.get(category, 0) + nbytes * (scale.get(layer, 1) if layer is not None else 1)
    return out


def _copy(nbytes: int, dtype: str) -> Op:
    """data_parallel's gradient copy (into or out of a bucket buffer) as an op to time."""
    return Op("dp.copy", COPY, BACKWARD_INPUT, bytes_read=nbytes, bytes_written=nbytes, dtype=dtype)


def backward_runs(profile: ChunkProfile, layers: int, margin_s: float = 0.0) -> list[Segment]:
    """The synchronising backward's runs in order: the ops before the layers (the head), each layer (the chunk's
    last first), the ops after (the embedding); timed on the host-issue clock where the profile can
    (segments.Blocks.run_seconds, from a GPU `margin_s` ahead of the host)."""
    blocks = profile.backward_later
    if layers == len(blocks.layers):
        per_layer = list(blocks.layers)
    else:
        first, mid, last = blocks.layers
        per_layer = [first] + [mid] * (layers - 2) + [last]
    runs = [blocks.before] + per_layer + [blocks.after]
    seconds = blocks.run_seconds(layers, margin_s)
    if seconds is None:
        return runs
    return [dataclasses.replace(run, phase_s=(("backward_s", s),)) for run, s in zip(runs, seconds)]


def _landing_run(params: list[ParamSpec], layers: int) -> list[int]:
    """The run of backward_runs after which each parameter's gradient has landed: a layer's at the end of that
    layer's backward, the head's after the ops before the layers, the embedding's at the end."""
    layered = sorted({p.layer for p in params if p.layer is not None})
    position = {layer: len(layered) - k for k, layer in enumerate(layered)}
    before = _first_index(tuple(params))
    return [position[p.layer] if p.layer is not None else layers + 1 if k < before else 0
            for k, p in enumerate(params)]


def _model_states(profile: ChunkProfile, layers: int, params, dts, recipe: Recipe, kernels: KernelProfile,
                  memo) -> tuple[IdSource, dict[int, Tensor], object]:
    """(the id source after them, the tensors they registered, the model states) of a chunk's parameters. What
    the memo keeps is never changed by chunk_model: each call gets its own copy of the tensor dict (the later
    steps add and drop entries; Tensors are frozen) and its own id source, continuing where the states' ids end."""
    key = (profile.key, layers, kernels)
    found = memo.get(key) if memo is not None else None
    if found is None:
        ids = IdSource(1)
        tensors: dict[int, Tensor] = {}
        refs = [SimpleNamespace(shape=p.shape, dtype=p.dtype) for p in params]
        states = model_states(SimpleNamespace(refs=refs, names=[p.name for p in params]), dts, recipe, kernels,
                              ids, tensors)
        found = (states, dict(tensors), ids.next)
        if memo is not None:
            memo[key] = found
    states, registered, next_id = found
    return IdSource(next_id), dict(registered), states


def chunk_model(profile: ChunkProfile, layers: int, dp: int, zero_stage: int, bucket_size_bytes: int,
                kernels: KernelProfile, device: DeviceSpec, cache: dict, states_memo=None) -> ChunkModel:
    """The chunk of `layers` layers (its profile's key), data-parallel over `dp` ranks with `zero_stage`.

    `cache`: timed_ops' op-time cache for `device`. `states_memo`: a dict-like the caller keeps of the model
    states (training.model_states) by (profile key, layers, kernels): they do not depend on dp or the ZeRO stage,
    so chunks of one shape under several of them declare them once (None: each call declares its own).
    """
    key = profile.key
    recipe: Recipe = key.recipe
    dts = dtypes_for(recipe.precision, recipe.framework)
    keep_output = keeps_output(recipe.framework)
    recorded_dp = recipe.dp > 1
    forward = profile.forward.for_layers(layers).allocating(profile.before_forward_bytes)
    if not keep_output and profile.sent_output_bytes:
        forward = forward.freeing(profile.sent_output_bytes)

    # A whole model's micro-batch is one lowering list (the host-issue clock runs on from its forward into its
    # backward); a pipeline stage's F, B and W are one each.
    margin_s = profile.forward.end_margin_s(layers) if key.kind == WHOLE else 0.0

    def backward(blocks) -> Segment:
        segment = blocks.for_layers(layers, margin_s).allocating(profile.before_backward_bytes)
        return segment.freeing(profile.after_backward_bytes + profile.input_grad_bytes)

    def weight(blocks) -> Segment | None:
        return None if blocks is None else blocks.for_layers(layers).freeing(profile.after_weight_bytes)

    backward_first, backward_later = backward(profile.backward_first), backward(profile.backward_later)
    params = _params_for(profile, layers)
    sync_runs = backward_runs(profile, layers, margin_s)
    ids, tensors, states = _model_states(profile, layers, params, dts, recipe, kernels, states_memo)
    persistent = {c: 0 for c in CATEGORIES}
    parameter_count = sum(numel(p.shape) for p in params)
    param_bytes = sum(numel(p.shape) * DTYPE_BYTES[p.dtype] for p in params)
    for category, nbytes in _buffer_bytes(profile, layers).items():
        persistent[category] += nbytes
    for tid in states.persistent:
        persistent[tensors[tid].category] += tensors[tid].nbytes
    workspace_bytes = sum(tensors[t].nbytes for group in states.workspaces for t in group)
    step_ops = list(states.optimizer_ops)
    state_ids = [t.id for t in states.state_tensors]
    buckets: tuple[Bucket, ...] = ()
    sync_extra_s = 0.0
    grad_shard_bytes = 0
    sync_every = False
    if dp > 1:
        setup = DataParallelSetup(dp, zero_stage, recipe.framework, bucket_size_bytes, recipe.accumulation_steps,
                                  recipe.optimizer, recipe.optimizer_implementation, kernels.device_kind == "cpu",
                                  dts.param, dts.master)
        infos = [ParamInfo(ids(), p.name, numel(p.shape), dts.grad,
                           states.grad_buffers[k] if states.grad_buffers else None) for k, p in enumerate(params)]
        sync = prepare_sync(setup, infos, tensors, ids)
        for tid in sync.plan.bucket_buffers:
            persistent[COMMUNICATION_BUFFERS] += tensors[tid].nbytes
        if sync.plan.grad_shard is not None:
            grad_shard_bytes = tensors[sync.plan.grad_shard].nbytes
        if zero_stage >= 1:
            stub = SimpleNamespace(optimizer=step_ops, optimizer_state_ids=state_ids,
                                   meta={"loss_scaler": states.loss_scaler})
            state_ids, step_ops = sharded_step(stub, setup, sync.shard_numel, sync.total_numel, tensors, ids,
                                               sync.plan.grad_shard if key.kind == WHOLE else None)
        if zero_stage == 3:
            param_bytes = sum(shard_numel(numel(p.shape), dp) * DTYPE_BYTES[p.dtype] for p in params)
        sync_every = setup.sync_every_microbatch
        landing = _landing_run(params, layers)
        ends = []
        elapsed = 0.0
        for run in sync_runs:
            elapsed += run.compute_s
            ends.append(elapsed)
        order = {info.id: k for k, info in enumerate(infos)}
        running = 0
        out = []
        for bucket in sync.plan.buckets:
            running = max(running, max(landing[order[pid]] for pid in bucket.param_ids))
            out.append(Bucket(setup.reduction, bucket.nbytes, ends[running], running))
        buckets = tuple(out)
        if setup.buffers == "per_bucket" and not recorded_dp:
            copies = [_copy(numel(p.shape) * DTYPE_BYTES[dts.grad], dts.grad) for p in params]
            copies += [_copy(bucket.nbytes, dts.grad) for bucket in sync.plan.buckets]
            sync_extra_s = sum(run.duration_s for run in timed_ops(copies, tensors, device, 0, cache))
    if recorded_dp and grad_shard_bytes != profile.grad_shard_bytes:
        # The recording's shard is its layers'; the chunk's is allocated at the same place.
        extra = grad_shard_bytes - profile.grad_shard_bytes
        backward_first = Segment(backward_first.phase_s, backward_first.delta_bytes + extra,
                                 backward_first.excursion_bytes + extra, backward_first.collectives,
                                 backward_first.overlapped, backward_first.model_flops)
    persistent[PARAMETERS] += param_bytes
    persistent[OPTIMIZER_STATES] += sum(tensors[t].nbytes for t in state_ids if tensors[t].category
                                        == OPTIMIZER_STATES)
    persistent[OTHER] += sum(tensors[t].nbytes for t in state_ids if tensors[t].category == OTHER)
    persistent[GRADIENTS] += sum(tensors[t].nbytes for t in state_ids if tensors[t].category == GRADIENTS)
    runs = timed_ops(step_ops, tensors, device, 0, cache)
    step = summarize([r.op for r in runs], [r.duration_s for r in runs], tensors)
    if dp > 1 and zero_stage == 3:
        param_sizes = [shard_numel(numel(p.shape), dp) * DTYPE_BYTES[p.dtype] for p in params]
    else:
        param_sizes = [numel(p.shape) * DTYPE_BYTES[p.dtype] for p in params]
    setup = param_sizes + [nbytes for _, nbytes in _buffer_sizes(profile, layers)]
    setup += [tensors[t].nbytes for t in states.persistent]
    if dp > 1:
        setup += [tensors[t].nbytes for t in sync.plan.bucket_buffers]
    step_calls = tuple(call for op in step_ops for call in [(True, t, tensors[t].nbytes) for t in op.allocs]
                       + [(False, t, 0) for t in op.frees])
    return ChunkModel(
        layers=layers, forward=forward, backward_first=backward_first, backward_later=backward_later,
        weight_first=weight(profile.weight_first), weight_later=weight(profile.weight_later),
        sync_extra_s=sync_extra_s, buckets=buckets, sync_every_backward=sync_every,
        persistent=tuple(sorted(persistent.items())), workspace_bytes=workspace_bytes,
        grad_shard_bytes=grad_shard_bytes, step=step, parameter_count=parameter_count,
        output_bytes=profile.output_bytes, input_grad_bytes=profile.input_grad_bytes,
        tied_embedding_grad_bytes=profile.tied_embedding_grad_bytes, setup_sizes=tuple(setup),
        state_sizes=tuple(tensors[t].nbytes for t in state_ids),
        workspace_groups=tuple(tuple(tensors[t].nbytes for t in group) for group in states.workspaces),
        step_calls=step_calls, backward_runs=tuple(sync_runs))
