"""Reserved memory and out-of-memory from the allocator model itself: a rank's memory calls — set-up, every
action of its schedule for a warm-up and a measured iteration, the optimizer step — replayed through the
simulator's allocator (engine/caching_allocator.py, with its capacity and settings) without running anything
else. The calls are the profile's recorded ops (profiles.ReplayOps) with a stage's middle layer repeated to its
layer count; the streams are the engine's (compute; tensor-parallel and data-parallel collectives on their
communication streams, one shared at pp = 1; received tensors on the receive stream), so the allocator
keeps their pools apart.

What is left out (so reserved can differ a little from a simulation's): when the send stream frees a sent tensor
(here: at the end of the action that produced it), and the exact moment workspaces are first allocated (here: at
the first forward). Long schedules are replayed with fewer micro-batches once the pipeline's steady state repeats
(`replay_microbatches`): GPipe up to MAX_GPIPE micro-batches, the others 2p + 2.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass

from simulator.engine.allocator import OutOfMemory, make_allocator
from simulator.errors import PlanError
from simulator.parallel.schedules import SCHEDULE_NAMES, Schedule, by_name
from simulator.workload.graph import COLLECTIVE, FORWARD, GEMM, GRADIENTS, Op

from simulator.explore.profiles import WHOLE
from simulator.explore.segments import run_layers

_LAYER = re.compile(r"layers\.(\d+)")
COMPUTE, COMM, COMM_DP, RECV = 0, 1, 2, 3
WORKSPACE = ("workspace",)     # a call's identity that marks a GEMM where a workspace group may be allocated
MAX_GPIPE = 48
UNBOUNDED = 1 << 62


@dataclass(frozen=True)
class Calls:
    """One action's memory calls: (allocate?, identity, bytes, stream, category) in order; an identity is unique
    within a micro-batch (it names the same tensor in that micro-batch's F, B and W)."""

    calls: tuple[tuple[bool, tuple, int, int, str], ...]
    sent: tuple[tuple, ...] = ()     # identities the send stream frees once this action's message is delivered


def _stream(op: Op) -> int:
    if op.op_class == COLLECTIVE:
        return COMM_DP if op.group == "dp" else COMM
    return COMPUTE


def _canon(replay, ops_lists, recorded_layers: tuple[int, ...]):
    """Per tensor id of one micro-batch: (pattern, layer or None, occurrence) — the same for a tensor's twin in
    another layer (same name but the layer number, same rank among that layer's tensors of that name)."""
    tensors = replay.tensors
    seen: dict[tuple, int] = {}
    key: dict[int, tuple] = {}
    for ops in ops_lists:
        for op in ops:
            for tid in op.allocs + op.frees:
                if tid in key:
                    continue
                name = tensors[tid].name
                match = _LAYER.search(name)
                layer = int(match.group(1)) if match and int(match.group(1)) in recorded_layers else None
                pattern = _LAYER.sub("layers.#", name) if layer is not None else name
                rank = seen.get((pattern, layer), 0)
                seen[(pattern, layer)] = rank + 1
                key[tid] = (pattern, layer, rank)
    return key


def expand(replay, kind: str, action: str, layers: int, extra_before: tuple = (), extra_after: tuple = (),
           sent: tuple = (), one_comm: bool = False, sizes: dict | None = None) -> Calls:
    """The memory calls of one action of a chunk of `layers` layers, from its recording.

    `extra_before` / `extra_after`: tensor ids (of this micro-batch kind) allocated before / freed after the ops,
    as (id, stream) / id. `one_comm`: data-parallel collectives share the tensor-parallel ones' stream (pp = 1:
    lower_multi.lower_data_tensor_parallel). `sizes`: bytes by tensor name where the chunk's differ from the
    recording's (ZeRO's gradient shard: the recording's is its layers').
    """
    sizes = sizes or {}
    ops = replay.ops.get((kind, action), ())
    all_ops = [replay.ops.get((kind, a), ()) for a in ("forward", "backward", "weight")]
    recorded = tuple(sorted({op.layer for lst in all_ops for op in lst if op.layer >= 0}))
    canon = _canon(replay, all_ops, recorded)
    tensors = replay.tensors
    # Profile layer -> the chunk's first layer it stands for, and how many it stands for.
    place = {layer: k for k, layer in enumerate(recorded)}
    copies = {layer: 1 for layer in recorded}
    if layers != len(recorded) and len(recorded) == 3:
        first, mid, last = recorded
        place = {first: 0, mid: 1, last: layers - 1}
        copies[mid] = layers - 2

    out: list = []
    for tid, stream in extra_before:
        out.append((True, _shifted(canon, tid, None, 0, place), tensors[tid].nbytes, stream,
                    tensors[tid].category))
    marked: set[str] = set()
    runs = run_layers(ops)
    layered = [layer for layer in runs if layer >= 0]
    descending = bool(layered) and layered[0] > layered[-1]      # a backward: the copies run last layer first
    k = 0
    while k < len(ops):
        layer = runs[k]
        j = k
        while j < len(ops) and runs[j] == layer:
            j += 1
        block = ops[k:j]
        times = copies.get(layer, 1) if layer >= 0 else 1
        base = layer if layer >= 0 else None
        for n in range(times):
            copy = times - 1 - n if descending else n
            for op in block:
                # An op that frees tensors of layers beyond its neighbours releases what the micro-batch saved
                # (a W pass's end frees every layer's recomputed activations): the middle layer's stand for
                # every copy.
                spread = base is not None and any(
                    canon.get(tid, (0, None))[1] is not None and abs(canon[tid][1] - base) > 1 for tid in op.frees)
                if op.op_class == GEMM:
                    # The cuBLAS workspaces are allocated at a rank's first forward GEMM and its first other one.
                    group = "forward" if op.phase == FORWARD else "backward"
                    if group not in marked:
                        marked.add(group)
                        out.append((True, WORKSPACE, 0, 0, group))
                stream = _stream(op)
                if one_comm and stream == COMM_DP:
                    stream = COMM
                for tid in op.allocs:
                    nbytes = sizes.get(tensors[tid].name, tensors[tid].nbytes)
                    for key in _identities(canon, tid, base, copy, place, copies):
                        out.append((True, key, nbytes, stream, tensors[tid].category))
                for tid in op.frees:
                    for key in _identities(canon, tid, None if spread else base, copy, place, copies):
                        out.append((False, key, 0, 0, ""))
        k = j
    for tid in extra_after:
        out.append((False, _shifted(canon, tid, None, 0, place), 0, 0, ""))
    return Calls(tuple(out), tuple(_shifted(canon, tid, None, 0, place) for tid in sent))


def _identities(canon, tid: int, block_layer, copy: int, place, copies) -> list[tuple]:
    """The identities a call on `tid` stands for: one, except a call outside the layers on a tensor of the
    repeated middle layer (the autocast cache freed at the end of a forward, say), which every copy makes."""
    pattern, layer, rank = canon.get(tid, (tid, None, 0))
    if block_layer is None and layer is not None and copies.get(layer, 1) > 1:
        return [(pattern, place[layer] + k, rank) for k in range(copies[layer])]
    return [_shifted(canon, tid, block_layer, copy, place)]


def _shifted(canon, tid: int, block_layer, copy: int, place) -> tuple:
    """The identity of tensor `tid` referenced from copy `copy` of the block of profile layer `block_layer`: a
    tensor of profile layer Q seen from the block of profile layer P placed at actual layer A is layer A + Q - P
    (neighbours), or the one Q stands for (further apart)."""
    pattern, layer, rank = canon.get(tid, (tid, None, 0))
    if layer is None:
        return (pattern, None, rank)
    if block_layer is None or abs(layer - block_layer) > 1:
        # Outside the layers, or a first layer's op on a last layer's tensor (the residual stream's gradient,
        # accumulated through every layer): the tensor the recording's end layer stands for.
        return (pattern, place[layer], rank)
    actual = place[block_layer] + copy + (layer - block_layer)
    return (pattern, actual, rank)


def replay_microbatches(schedule: Schedule) -> int:
    """Micro-batches replayed for `schedule` (its steady state repeats after 2p + 2; GPipe holds them all)."""
    p, m = schedule.num_ranks, schedule.microbatches
    if schedule.name == "gpipe":
        return min(m, MAX_GPIPE)
    cap = 2 * p + 2
    if schedule.name == "interleaved-1f1b":
        cap = p * (-(-cap // p))
    return min(m, cap)


def replay_schedule(schedule: Schedule) -> Schedule:
    """The schedule replayed: a built-in one with replay_microbatches(schedule) micro-batches, else itself."""
    m = replay_microbatches(schedule)
    if m == schedule.microbatches or schedule.name not in SCHEDULE_NAMES:
        return schedule
    return by_name(schedule.name, schedule.num_ranks, m, schedule.virtual_stages)


@dataclass
class _Rank:
    """The allocator and the live handles of one rank while its calls are replayed."""

    allocator: object
    live: dict
    oom: bool = False

    def malloc(self, key, nbytes: int, stream: int, category: str) -> None:
        try:
            handle = self.allocator.malloc(nbytes, stream, 0.0)
        except OutOfMemory:
            self.oom = True
            self.allocator.capacity_bytes = UNBOUNDED
            try:
                handle = self.allocator.malloc(nbytes, stream, 0.0)
            except OutOfMemory:
                raise PlanError(f"a tensor of {nbytes} bytes takes one rank past {UNBOUNDED} bytes: "
                                f"no device holds this job") from None
        self.live[key] = (handle, category)

    def free(self, key) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.allocator.free(entry[0], 0.0)


@dataclass(frozen=True)
class Timing:
    """When a rank's replayed actions run (from the schedule's graph, pipeline.py): per action (start, when its
    message is delivered), when the optimizer step starts, and the iteration's length (seconds)."""

    actions: tuple[tuple[float, float], ...]
    step_s: float
    period_s: float


def replay_rank(kind: str, settings, capacity_bytes: int, chunks: dict, actions, kinds_first: dict,
                keep_output: bool, timing: Timing) -> tuple[int, int, bool]:
    """Replay one rank: (peak reserved, peak allocated in the measured iteration, ran out of memory).

    `chunks`: chunk index -> (ChunkModel, ChunkProfile); `actions`: the rank's schedule actions (replayed);
    `kinds_first`: chunk -> the micro-batch whose backward runs first; `kind`: the cluster's allocator kind;
    `settings`: the scenario's [allocator].
    """
    allocator = make_allocator(kind, capacity_bytes, max_split_size_bytes=settings.max_split_size,
                               roundup_power2_divisions=settings.roundup_power2_divisions,
                               expandable_segments=settings.expandable_segments, record_events=False)
    rank = _Rank(allocator, {})
    for c, (model, _) in sorted(chunks.items()):
        for n, size in enumerate(model.setup_sizes):
            rank.malloc(("setup", c, n), size, COMPUTE, "persistent")
    calls_cache: dict = {}

    def calls(c: int, mb_kind: str, action: str) -> Calls:
        found = calls_cache.get((c, mb_kind, action))
        if found is None:
            found = calls_cache[(c, mb_kind, action)] = action_calls(*chunks[c], mb_kind, action, keep_output)
        return found

    groups = dict(zip(("forward", "backward"), chunks[min(chunks)][0].workspace_groups))
    pending: list[tuple[float, int, tuple]] = []       # (when the send stream frees it, order, tensor)

    def release(until_s: float) -> None:
        while pending and pending[0][0] <= until_s:
            rank.free(heapq.heappop(pending)[2])

    count = 0
    for iteration in (0, 1):
        if iteration == 1:
            allocator.reset_peaks()
        offset = iteration * timing.period_s
        for k, act in enumerate(actions):
            start_s, delivered_s = timing.actions[k]
            release(offset + start_s)
            c = act.chunk
            mb_kind = "first" if act.microbatch == kinds_first[c] else "later"
            if act.kind == "F":
                parts = ("forward",)
            elif act.kind == "B":
                parts = ("backward",) if not chunks[c][1].replay.ops.get((mb_kind, "weight")) else ("backward", "weight")
            elif act.kind == "I":
                parts = ("backward",)
            else:
                parts = ("weight",)
            for part in parts:
                made = calls(c, mb_kind, part)
                for is_alloc, key, size, stream, category in made.calls:
                    if key is WORKSPACE:
                        for n, nbytes in enumerate(groups.pop(category, ())):
                            rank.malloc(("workspace", category, n), nbytes, COMPUTE, "persistent")
                        continue
                    full = (c, act.microbatch, key)
                    if is_alloc:
                        rank.malloc(full, size, stream, category)
                    else:
                        rank.free(full)
                for key in made.sent:
                    count += 1
                    heapq.heappush(pending, (offset + delivered_s, count, (c, act.microbatch, key)))
        release(offset + timing.step_s)
        for c, (model, _) in sorted(chunks.items()):
            if iteration == 0:
                for n, size in enumerate(model.state_sizes):
                    rank.malloc(("state", c, n), size, COMPUTE, "persistent")
            for is_alloc, key, size in model.step_calls:
                if is_alloc:
                    rank.malloc(("step", c, key), size, COMPUTE, "step")
                else:
                    rank.free(("step", c, key))
        for key in [k for k, (_, category) in rank.live.items() if category == GRADIENTS]:
            rank.free(key)                                          # zero_grad(set_to_none=True)
    return allocator.peak_reserved_bytes, allocator.peak_allocated_bytes, rank.oom


def action_calls(model, profile, mb_kind: str, action: str, keep_output: bool) -> Calls:
    """One action's memory calls for a chunk model, with what the lowering allocates before it (inputs, received
    tensors on the receive stream) and frees after it (what the micro-batch no longer needs); what it sends (a
    stage output the runtime does not keep, an input gradient) is freed when the message is delivered."""
    replay = profile.replay
    grads = _grads_of(replay, mb_kind)
    if action == "forward":
        before = tuple((t, COMPUTE) for t in replay.before_forward[mb_kind])
        if replay.received[mb_kind] is not None:
            before += ((replay.received[mb_kind], RECV),)
        after = ()
        sent = tuple(t for t in replay.sent[mb_kind] if not keep_output and t not in grads)
    elif action == "backward":
        received = replay.before_backward[mb_kind]
        before = ((received, RECV),) if received is not None else ()
        after, sent = replay.after_backward[mb_kind], grads
    else:
        before, after, sent = (), replay.after_weight[mb_kind], ()
    sizes = {"dp.grad_shard": model.grad_shard_bytes} if model.grad_shard_bytes != profile.grad_shard_bytes else {}
    return expand(replay, mb_kind, action, model.layers, before, after, sent, profile.key.kind == WHOLE, sizes)


def _grads_of(replay, mb_kind: str) -> tuple[int, ...]:
    """The input gradient the send stream frees once sent (freed with its backward here)."""
    received = replay.received[mb_kind]
    sent = replay.sent[mb_kind]
    if received is None:
        return ()
    return tuple(t for t in sent if replay.tensors[t].name == "grad(stage_input)")
