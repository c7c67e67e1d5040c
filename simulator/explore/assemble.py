"""One plan's numbers for the vectorised evaluation: per rank its chunks' models (profiles extrapolated to their
layers, data parallelism applied), the cost and offset tables of its schedule's graph, and the memory
coefficients of its ranks' rows. `Caches` keeps what plans share (profiles, chunk models, structures,
collective times), so a search pays for each once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from simulator.explore.bounded import Lru
from simulator.explore.network_costs import NetworkCosts
from simulator.explore.pipeline import (B_FIRST, B_LATER, B_SYNC, COORDS, DONE_B, DONE_W, F, M_B_FIRST, M_B_LATER,
                                        M_F, M_W_FIRST, M_W_LATER, MTYPES, N_F, N_I, SLOTS, W_FIRST, W_LATER,
                                        W_SYNC, Structure, build_structure, cost_table_size, offset_table_size,
                                        transfer_slot)
from simulator.explore.prepare import Prepared, schedule_identity
from simulator.explore.profiles import (FIRST, LAST, MIDDLE, PROFILE_MICROBATCHES, RECORDED_LAYERS, WHOLE,
                                        ChunkProfile, ProfileKey, record)
from simulator.explore.segments import Segment
from simulator.explore.stage_model import ChunkModel, chunk_model
from simulator.workload.graph import CATEGORIES


# Bounds of the memos (docs/explore.md, "Memory"): a search walks its plans in enumeration order, so plans that
# share a profile, a schedule or a graph come together and a few hundred recent entries are all it reuses.
PROFILES_KEPT = 512                    # recorded profiles, about 0.5 MB each (a search share's: spread.py)
CHUNKS_KEPT = 4096                     # chunk models (tens of KB each)
SCHEDULE_ACTIONS_KEPT = 1_000_000      # actions of the built-in schedules kept (about 160 bytes each)
STRUCTURE_NODES_KEPT = 400_000         # graph nodes of the structures kept (about 360 bytes each)
STATES_KEPT = 512                      # chunks' model states (a tensor dict each; ZeRO 0 and 1 share them)
SMALL_KEPT = 4096                      # stage inputs, rank layouts
ROWS_KEPT = 256                        # schedules' memory rows (a few KB each)


def _actions(schedule) -> int:
    return sum(len(actions) for actions in schedule.ranks)


@dataclass
class Caches:
    """Profiles, chunk models, schedules, schedule structures and network costs, shared by the plans of one
    estimate or one search. Every memo but the per-topology NetworkCosts is bounded (bounded.Lru); each value
    is a pure function of its key, so what is dropped is recomputed the same."""

    profiles: Lru = field(default_factory=lambda: Lru(PROFILES_KEPT))
    chunks: Lru = field(default_factory=lambda: Lru(CHUNKS_KEPT))
    structures: Lru = field(default_factory=lambda: Lru(STRUCTURE_NODES_KEPT, lambda s: s.n_nodes))
    schedules: Lru = field(default_factory=lambda: Lru(SCHEDULE_ACTIONS_KEPT, _actions))
    networks: dict = field(default_factory=dict)
    op_times: dict = field(default_factory=dict)      # device -> timed_ops' cache
    outputs: Lru = field(default_factory=lambda: Lru(SMALL_KEPT))
    layouts: Lru = field(default_factory=lambda: Lru(SMALL_KEPT))    # a plan layout's stage groups and pairs
    memory_rows: Lru = field(default_factory=lambda: Lru(ROWS_KEPT))   # a schedule's ranks' memory rows
    clusters: Lru = field(default_factory=lambda: Lru(ROWS_KEPT))      # resolved clusters (prepare._cluster)
    plans: Lru = field(default_factory=lambda: Lru(SMALL_KEPT))        # parallel plans (prepare._plan)
    states: Lru = field(default_factory=lambda: Lru(STATES_KEPT))      # chunks' model states (stage_model)

    def profile(self, key: ProfileKey) -> ChunkProfile:
        found = self.profiles.get(key)
        if found is None:
            found = self.profiles[key] = record(key, self.op_times.setdefault(key.device, {}))
        return found

    def network(self, topology) -> NetworkCosts | None:
        if topology is None:
            return None
        # Keyed by the topology's value (its server and fabric): each scenario loads its own equal Topology, and
        # equal topologies have the same routes and collective times, so plans share one NetworkCosts (and the
        # first Topology's route and derived caches) instead of recomputing them per plan.
        key = (topology.server, topology.fabric)
        found = self.networks.get(key)
        if found is None:
            found = self.networks[key] = NetworkCosts(topology)
        return found


@dataclass(frozen=True)
class RankNumbers:
    """One rank (a stage's representative) of a plan."""

    rank: int
    start_bytes: int                     # allocated at the start of a measured iteration
    persistent: dict                     # bytes per category of start_bytes
    coefficients: np.ndarray             # (v * COORDS,) bytes per memory coordinate
    excursions: np.ndarray               # (v * MTYPES,) each action type's own excursion
    step_bytes: int                      # the level before the step above start_bytes (gradients)
    step_excursion: int
    compute_s: float                     # per iteration, actions and step
    blocking_s: float                    # compute held by communication in actions and step
    collectives_s: float                 # the blocking collectives' own seconds (without waits behind others)
    phases: dict                         # seconds per time-breakdown key
    model_flops: float
    parameters: int
    reductions_s: float                  # data-parallel reductions' seconds (overlapped)


@dataclass(frozen=True)
class PlanNumbers:
    """A plan's inputs to the graph evaluation and the report."""

    prepared: Prepared
    structure: Structure
    structure_key: tuple
    costs: np.ndarray
    offsets: np.ndarray
    ranks: tuple[RankNumbers, ...]
    chunks: dict = field(default_factory=dict)     # (stage, chunk) -> (ChunkModel, ProfileKey, cache key)


def _kind(span, pp: int) -> str:
    if pp == 1:
        return WHOLE
    if span.has_embedding and not span.has_head:
        return FIRST
    if span.has_head and not span.has_embedding:
        return LAST
    return MIDDLE if not span.has_embedding else WHOLE


def _recorded(layers: int, recompute: str) -> int:
    if recompute.startswith("segments:"):
        return layers                 # checkpoint_sequential's regions depend on the stage's layer count
    return layers if layers <= RECORDED_LAYERS else RECORDED_LAYERS


def _chunk(caches: Caches, prepared: Prepared, span, split: bool) -> tuple[ChunkModel, ProfileKey, tuple]:
    """The chunk model of a stage span, its profile's key and its cache key (`split`: the schedule splits
    backwards). The profile itself is not kept with the model (caches.profile gives it back)."""
    recipe = prepared.recipe
    pp = prepared.plan.pp
    kind = _kind(span, pp)
    layers = span.stop - span.start
    in_profile_dp = kind == WHOLE and recipe.dp > 1 and recipe.zero_stage >= 2
    # Offload is left out (the report says so): the profile is the plan's ops without it.
    profile_recipe = dataclasses.replace(
        recipe, accumulation_steps=PROFILE_MICROBATCHES, offload=None,
        dp=recipe.dp if in_profile_dp else 1, zero_stage=recipe.zero_stage if in_profile_dp else 0)
    split = split and pp > 1
    stage_input = None
    if kind in (MIDDLE, LAST):
        stage_input = _stage_input(caches, prepared, profile_recipe)
    overlap = prepared.overlap
    key = ProfileKey(prepared.shape, profile_recipe, prepared.kernels, prepared.device, kind,
                     _recorded(layers, recipe.recompute), split, stage_input,
                     (overlap.tp_comm_overlap, overlap.tp_backward_overlap) if recipe.tp > 1 else (False, False))
    chunk_key = (key, layers, recipe.dp, recipe.zero_stage, recipe.bucket_size_bytes,
                 recipe.accumulation_steps)
    found = caches.chunks.get(chunk_key)
    if found is None:
        profile = caches.profile(key)
        found = caches.chunks[chunk_key] = (chunk_model(
            profile, layers, recipe.dp, recipe.zero_stage, recipe.bucket_size_bytes, prepared.kernels,
            prepared.device, caches.op_times.setdefault(prepared.device, {}), caches.states), key, chunk_key)
    return found


def _stage_input(caches: Caches, prepared: Prepared, recipe) -> tuple:
    """(shape, dtype) of what a first stage sends on (every stage's input)."""
    key = (prepared.shape, recipe, prepared.kernels, prepared.device)
    found = caches.outputs.get(key)
    if found is None:
        first = ProfileKey(prepared.shape, recipe, prepared.kernels, prepared.device, FIRST, 1, False, None)
        found = caches.outputs[key] = caches.profile(first).output
    return found


def _collectives_s(segment: Segment, groups: dict, network: NetworkCosts | None) -> float:
    """Seconds of a segment's blocking collectives: `groups` maps an axis to (the rank's group, every group of
    the axis in its stage)."""
    if network is None or not segment.collectives:
        return 0.0
    total = 0.0
    for key, count in segment.collectives:
        group, kind, nbytes = key[:3]
        mine, together = groups[group]
        if len(key) == 3:
            total += count * network.collective_s(kind, mine, nbytes, together)
            continue
        # Run beside a GEMM (tp_overlap.py): its share there waits only past the compute beside it; the rest blocks.
        share, hidden_s = key[3], key[4]
        ahead = network.collective_s(kind, mine, nbytes * share, together) if share > 0 else 0.0
        rest = network.collective_s(kind, mine, nbytes * (1 - share), together) if share < 1 else 0.0
        total += count * (max(0.0, ahead - hidden_s) + rest)
    return total


def _layout(caches: Caches, plan, what, *args):
    """`what(plan, *args)` (_stage_groups, _pairs), remembered per rank layout: they depend only on the degrees
    and the strides of the plan's axes."""
    key = (plan.dp, plan.tp, plan.pp, plan.stride("dp"), plan.stride("pp"), plan.stride("tp"), what, args)
    found = caches.layouts.get(key)
    if found is None:
        found = caches.layouts[key] = what(plan, *args)
    return found


def _stage_groups(plan, stage: int, axis: str) -> tuple[tuple[int, ...], ...]:
    """The groups of `axis` among the ranks of pipeline stage `stage` (they run the same collectives together)."""
    members = set(plan.stage_ranks(stage))
    return tuple(g for g in plan.groups(axis) if g[0] in members)


def _shared_stream(model: ChunkModel, durations: list[float], groups, network) -> tuple[float, float]:
    """pp = 1 puts data-parallel reductions and blocking tensor-parallel collectives on one communication stream
    (lower_multi.lower_data_tensor_parallel): a tensor-parallel collective waits for the reductions posted before
    it. Returns (the synchronising backward's seconds, seconds from its start until its reductions end), walking
    its runs (a run's collectives taken at its start)."""
    now = free = 0.0
    by_run: dict[int, list[float]] = {}
    for bucket, seconds in zip(model.buckets, durations):
        by_run.setdefault(bucket.run, []).append(seconds)
    for k, run in enumerate(model.backward_runs):
        waited = _collectives_s(run, groups, network)
        if waited:
            now = max(now, free) + waited
            free = now
        now += run.compute_s
        for seconds in by_run.get(k, ()):
            free = max(free, now) + seconds
    return now, free


def _reduction_tail(buckets, durations, scale: float) -> float:
    """Seconds from the synchronising action's start until its last reduction ends: bucket k starts when it is
    ready (its last gradient landed; `scale` maps a backward's time to its W) and the previous one is done."""
    end = 0.0
    for bucket, seconds in zip(buckets, durations):
        end = max(end, bucket.ready_s * scale) + seconds
    return end


def _pairs(plan, src: int, dst: int) -> tuple[tuple[int, int], ...]:
    """(rank on stage src, the rank at the same dp and tp on stage dst) for every position of the stage."""
    return tuple((plan.rank_of(dp=d, pp=src, tp=t), plan.rank_of(dp=d, pp=dst, tp=t))
                 for d in range(plan.dp) for t in range(plan.tp))


def chunk_models(caches: Caches, prepared: Prepared) -> dict:
    """(stage, chunk) -> (ChunkModel, ProfileKey, cache key) of every chunk of the plan."""
    split = prepared.schedule.split_backward
    # A span's chunk depends on it only through its kind and its layer count (_chunk): spans alike (a pipeline's
    # middle stages, an interleaved plan's chunks) are looked up once per plan, not once each.
    alike: dict[tuple, tuple] = {}
    out = {}
    for span in prepared.plan.stages:
        key = (span.has_embedding, span.has_head, span.stop - span.start)
        found = alike.get(key)
        if found is None:
            found = alike[key] = _chunk(caches, prepared, span, split)
        out[(span.stage, span.chunk)] = found
    return out


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory numbers (what its allocated level is made of; RankNumbers repeats them)."""

    persistent: dict                     # bytes per category allocated at the start of an iteration
    coefficients: np.ndarray             # (v * COORDS,) bytes per memory coordinate
    excursions: np.ndarray               # (v * MTYPES,) each action type's own excursion
    step_bytes: int                      # the level before the step above the start (gradients)
    step: Segment                        # the rank's optimizer step (its chunks' steps in order)

    @property
    def start_bytes(self) -> int:
        return int(sum(self.persistent.values()))


def rank_memory(chunks: dict, r: int, v: int) -> RankMemory:
    """Rank r's memory numbers from its chunks' models (`chunks`: (stage, chunk) -> ChunkModel)."""
    persistent = {c: 0 for c in CATEGORIES}
    coefficients = np.zeros(v * COORDS)
    excursions = np.zeros(v * MTYPES)
    step_bytes = 0
    step = Segment()
    for c in range(v):
        model = chunks[(r, c)]
        for category, nbytes in model.persistent:
            persistent[category] += nbytes
        fwd, b_first, b_later = model.forward, model.backward_first, model.backward_later
        w_first, w_later = model.weight_first, model.weight_later
        base = c * COORDS
        coefficients[base + N_F] = fwd.delta_bytes
        coefficients[base + N_I] = fwd.delta_bytes + b_later.delta_bytes
        coefficients[base + DONE_B] = b_first.delta_bytes - b_later.delta_bytes
        if w_first is not None:
            coefficients[base + DONE_W] = w_first.delta_bytes - w_later.delta_bytes
        kinds = c * MTYPES
        excursions[kinds + M_F] = fwd.excursion_bytes
        excursions[kinds + M_B_FIRST] = b_first.excursion_bytes
        excursions[kinds + M_B_LATER] = b_later.excursion_bytes
        if w_first is not None:
            excursions[kinds + M_W_FIRST] = w_first.excursion_bytes
            excursions[kinds + M_W_LATER] = w_later.excursion_bytes
        step_bytes += coefficients[base + DONE_B] + coefficients[base + DONE_W]
        step = step.then(model.step)
    persistent["other"] += chunks[(r, 0)].workspace_bytes      # one set of cuBLAS workspaces per rank
    return RankMemory(persistent, coefficients, excursions, int(step_bytes), step)


def numbers(caches: Caches, prepared: Prepared, found: dict | None = None) -> PlanNumbers:
    """The plan's cost and offset tables and per-rank numbers (`found`: its chunk_models, if computed)."""
    plan, schedule, recipe = prepared.plan, prepared.schedule, prepared.recipe
    p, v = plan.pp, plan.virtual_stages
    pp = p
    network = caches.network(prepared.topology if prepared.multi else None)
    found = chunk_models(caches, prepared) if found is None else found
    chunks = {key: value[0] for key, value in found.items()}
    every_sync = any(c.sync_every_backward for c in chunks.values())
    overlap = prepared.overlap
    # Where data-parallel reductions run (rank_streams.RankStreams.post): beside the backward (overlap_grad_reduce),
    # all after the last action (Megatron's finish_grad_sync), or blocking where each bucket fills (DeepSpeed).
    wait = "overlap" if overlap.overlap_grad_reduce else overlap.grad_reduce_wait
    at_end = wait == "end" and plan.dp > 1
    in_place = wait == "bucket" and plan.dp > 1
    reduces = plan.dp > 1 and (at_end or (not every_sync and not in_place))
    tied = p > 1 and any(c.tied_embedding_grad_bytes for c in chunks.values())
    blocking_sends = p > 1 and not overlap.overlap_p2p_comm
    skey = (schedule_identity(prepared), p, v, schedule.microbatches, at_end, blocking_sends, reduces, tied)
    structure = caches.structures.get(skey)
    if structure is None:
        structure = caches.structures[skey] = build_structure(schedule, reduces=reduces, tied=tied,
                                                              reduce_at_end=at_end, blocking_sends=blocking_sends)
    costs = np.zeros(cost_table_size(structure))
    offsets = np.zeros(offset_table_size(structure))
    transfer_base = p * v * SLOTS
    tail_base = transfer_base + 2 * p
    ranks = []
    reps = [plan.rank_of(dp=0, pp=s, tp=0) for s in range(p)]
    for r in range(p):
        rank = reps[r]
        groups = {axis: (plan.group_of(rank, axis), _layout(caches, plan, _stage_groups, r, axis)) for axis in ("tp", "dp")} \
            if prepared.multi else {}
        memory = rank_memory(chunks, r, v)
        step = memory.step
        compute = blocking = collectives = reductions = flops = 0.0
        phases: dict[str, float] = {}
        parameters = 0
        for c in range(v):
            model = chunks[(r, c)]
            parameters += model.parameter_count
            fwd, b_first, b_later = model.forward, model.backward_first, model.backward_later
            w_first, w_later = model.weight_first, model.weight_later
            durations = [network.collective_s(b.kind, groups["dp"][0], b.nbytes, groups["dp"][1]) for b in model.buckets] \
                if network is not None and plan.dp > 1 else [0.0] * len(model.buckets)
            reductions += sum(durations)
            # A whole model of one micro-batch: that backward is a first one (it creates .grad), not a later one
            # (which accumulates into it); the reductions are the buckets' unless the profile recorded them.
            only = pp == 1 and recipe.accumulation_steps == 1 and found[(r, c)][1].recipe.dp == 1
            by_slot = {F: fwd, B_FIRST: b_first, B_LATER: b_later, B_SYNC: b_first if only else b_later}
            if w_first is not None:
                by_slot.update({W_FIRST: w_first, W_LATER: w_later, W_SYNC: w_later})
            counts = structure.action_counts[r, c]
            shared = pp == 1 and plan.tp > 1 and plan.dp > 1 and model.buckets and wait == "overlap"
            if shared:
                sync_s, reduced_s = _shared_stream(model, durations, groups, network)
            for slot, segment in by_slot.items():
                own = waited = _collectives_s(segment, groups, network)
                extra = model.sync_extra_s if slot in (B_SYNC, W_SYNC) else 0.0
                seconds = segment.compute_s + extra + waited
                syncs = slot == B_SYNC or (every_sync and slot in (B_FIRST, B_LATER))
                if in_place and model.buckets and (syncs or (slot == W_SYNC and not every_sync)):
                    # Each bucket's reduction waited for where it fills (a split backward's in its last W): the
                    # backward holds for all of them.
                    seconds += sum(durations)
                    waited += sum(durations)
                    own += sum(durations)
                    syncs = False
                if shared and syncs:
                    seconds = sync_s + (extra if slot == B_SYNC else 0.0) + (segment.compute_s - b_later.compute_s)
                    waited = seconds - segment.compute_s - (extra if slot == B_SYNC else 0.0)
                if every_sync and not in_place and not at_end and slot in (B_FIRST, B_LATER, B_SYNC):
                    tail = reduced_s if shared else _reduction_tail(model.buckets, durations, 1.0)
                    seconds = max(seconds, tail)
                costs[r * v * SLOTS + c * SLOTS + slot] = seconds
                n = int(counts[slot])
                if n:
                    compute += n * (segment.compute_s + extra)
                    blocking += n * waited
                    collectives += n * own
                    flops += n * segment.model_flops
                    for key, s in segment.phase_s:
                        phases[key] = phases.get(key, 0.0) + n * s
            if at_end:
                # Every syncing backward's reductions, posted one after another once the last action is done.
                syncing = int(counts[B_FIRST] + counts[B_LATER] + counts[B_SYNC]) if every_sync else 1
                offsets[2 * (r * v + c)] = offsets[2 * (r * v + c) + 1] = syncing * sum(durations)
            elif reduces:
                sync_slot = W_SYNC if w_first is not None else B_SYNC
                scale = 1.0
                if w_first is not None and b_later.compute_s + w_later.compute_s > 0:
                    scale = w_later.compute_s / (b_later.compute_s + w_later.compute_s)
                offsets[2 * (r * v + c)] = sum(durations)
                tail = reduced_s if shared else _reduction_tail(model.buckets, durations, scale)
                offsets[2 * (r * v + c) + 1] = tail - costs[r * v * SLOTS + c * SLOTS + sync_slot]
        step_waited = _collectives_s(step, groups, network)
        costs[tail_base + 2 * r + 1] = step.compute_s + step_waited
        compute += step.compute_s
        blocking += step_waited
        collectives += step_waited
        for key, s in step.phase_s:
            phases[key] = phases.get(key, 0.0) + s
        if tied and r in (0, p - 1):
            size = max(chunks[(r, c)].tied_embedding_grad_bytes for c in range(v))
            costs[tail_base + 2 * r] = network.collective_s("all_reduce", (reps[0], reps[-1]), size,
                                                            _layout(caches, plan, _pairs, 0, p - 1))
        if network is not None and p > 1:
            # Messages: activations to the next rank, gradients to the previous (with v > 1, around the ring),
            # every (dp, tp) position of the stage sending to its own on the other.
            last_chunk = chunks[(r, v - 1)]
            after, before = (r + 1) % p, (r - 1) % p
            costs[transfer_base + transfer_slot("activation", r)] = network.send_s(
                rank, reps[after], last_chunk.output_bytes, _layout(caches, plan, _pairs, r, after))
            costs[transfer_base + transfer_slot("gradient", r)] = network.send_s(
                rank, reps[before], chunks[(r, 0)].input_grad_bytes or last_chunk.output_bytes,
                _layout(caches, plan, _pairs, r, before))
        ranks.append(RankNumbers(rank, memory.start_bytes, memory.persistent, memory.coefficients,
                                 memory.excursions, memory.step_bytes, int(step.excursion_bytes), compute, blocking,
                                 collectives, phases, flops, parameters, reductions))
    return PlanNumbers(prepared, structure, skey, costs, offsets, tuple(ranks), found)
