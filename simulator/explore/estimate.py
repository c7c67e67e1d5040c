"""The fast estimate: a run's report (the keys of `memsim run --json`, DESIGN.md) computed from the simulator's
own models without simulating, for many plans at once.

    from simulator.explore.estimate import estimate_reports
    reports = estimate_reports([scenario_a, scenario_b])          # one dict per scenario, "estimate": True
    reports = estimate_reports(scenarios, errors="return")        # a MemsimError in the slot of an invalid one

How (docs/explore.md, "Estimate"): each plan is checked as `simulate` checks it (prepare.py); each pipeline
chunk's ops come from a profile recorded with the real builders and extrapolated to its layers (profiles.py,
segments.py), with data parallelism applied by data_parallel.py's functions (stage_model.py); collective and
message times come from the network model (network_costs.py); the schedule's dependency graph is evaluated for
all plans sharing it in one vectorised pass, and each rank's memory peak is the highest of its actions' levels
(pipeline.py); reserved memory adds the caching allocator's overhead (reserved.py).
"""

from __future__ import annotations

from typing import Hashable, Iterable, Iterator, Sequence

import numpy as np

from simulator.errors import MemsimError
from simulator.explore.assemble import Caches, PlanNumbers, chunk_models, numbers, rank_memory
from simulator.explore.pipeline import SLOTS, build_structure, evaluate, memory_rows
from simulator.explore.prepare import Prepared, prepare, schedule_identity
from simulator.explore.profiles import keeps_output
from simulator.explore.reserved import Timing, replay_rank, replay_schedule
from simulator.report.metrics import peak_flop_rate
from simulator.scenario import Scenario
from simulator.workload.graph import ACTIVATIONS, CATEGORIES

_ERRORS = ("raise", "return")


def estimate_reports(scenarios: Sequence[Scenario], *, errors: str = "raise",
                     caches: Caches | None = None, replay: bool = True, memory_first: bool = False) -> list:
    """Estimate the report of each scenario.

    Args:
        scenarios: the scenarios (any mix of models, plans and clusters; plans sharing a schedule's shape are
            evaluated together).
        errors: "raise": an invalid scenario raises the MemsimError `simulate` would raise for it (the first
            in order); "return": that error object takes the scenario's place in the list.
        caches: profiles, chunk models and collective times to reuse across calls (a search passes one).
        replay: replay each rank's memory calls through the allocator model for peak reserved memory (most of
            the estimate's time). False: peak reserved is given as peak allocated, a lower bound, so "fits" is only
            necessary (a plan that does not fit this way does not fit at all); the report says
            "reserved_replayed": False. A search replays only the fastest of those (search.py).
        memory_first: with replay=False, a plan whose peak allocated memory does not fit (computed from its
            schedule's memory rows and its chunks' models, as the full estimate computes it, without its graph,
            its network costs or its times) gets a memory-only report (`memory_report`: "memory_only": True, its
            ranks' memory keys only, the same values); a plan the estimate leaves something out of is estimated
            in full. The other reports are unchanged.

    Returns:
        One report dict per scenario (or MemsimError with errors="return"), with "estimate": True.

    Raises:
        MemsimError: with errors="raise", the first invalid scenario's error; or errors is not allowed.
    """
    if errors not in _ERRORS:
        raise MemsimError(f"estimate_reports: errors = {errors!r}: allowed: {', '.join(_ERRORS)}")
    caches = Caches() if caches is None else caches
    results: list = [None] * len(scenarios)
    groups: dict[tuple, list[tuple[int, PlanNumbers]]] = {}
    pending = 0
    for k, scenario in enumerate(scenarios):
        try:
            prepared = prepare(scenario, caches.schedules, caches.clusters, caches.plans)
            found = None
            if memory_first and not replay and not leaves_out(prepared):
                found = chunk_models(caches, prepared)
                peaks = allocated_peaks(caches, prepared, found)
                if not fits_allocated(prepared, peaks):
                    results[k] = memory_report(prepared, peaks)
                    continue
            item = (k, numbers(caches, prepared, found))
        except MemsimError as error:
            if errors == "raise":
                raise
            results[k] = error
            continue
        groups.setdefault(item[1].structure_key, []).append(item)
        pending += 1
        if pending >= PENDING_PLANS:
            _flush(groups, results, caches, replay)
            pending = 0
    _flush(groups, results, caches, replay)
    return results


def leaves_out(prepared: Prepared) -> list[str]:
    """What the estimate leaves out of the plan (the report's "leaves_out")."""
    out = []
    if prepared.recipe.offload is not None:
        out.append("offload (its host traffic, host work and the GPU memory it frees)")
    if prepared.overlap.overlap_param_gather:
        out.append("parallel.overlap_param_gather")
    return out


def peak_level(start_bytes: int, action_peak: float, step_bytes: int, step_excursion: int) -> float:
    """A rank's peak allocated level: the highest of its actions' levels, the step's and the start."""
    return max(start_bytes + action_peak, start_bytes + step_bytes + step_excursion, start_bytes)


def allocated_peaks(caches: Caches, prepared: Prepared, found: dict) -> list[int]:
    """Each rank's peak allocated bytes as the full estimate reports it (_evaluate_group, _report): its chunks'
    memory numbers (`found`: assemble.chunk_models) over its schedule's memory rows. The levels are sums of
    whole bytes (below 2**53), so they are the same numbers however the products are grouped."""
    key = schedule_identity(prepared)
    rows = caches.memory_rows.get(key)
    if rows is None:
        rows = caches.memory_rows[key] = memory_rows(prepared.schedule)
    chunks = {at: value[0] for at, value in found.items()}
    peaks = []
    for r in range(prepared.plan.pp):
        memory = rank_memory(chunks, r, prepared.plan.virtual_stages)
        levels = memory.coefficients @ rows[r].coords.T.astype(float) + memory.excursions[rows[r].types]
        peaks.append(int(peak_level(memory.start_bytes, float(levels.max()), memory.step_bytes,
                                    int(memory.step.excursion_bytes))))
    return peaks


def fits_allocated(prepared: Prepared, peaks) -> bool:
    """Whether every stage's peak allocated plus the CUDA context fits the device."""
    capacity, context = int(prepared.device.memory_bytes), int(prepared.cluster.context_bytes)
    return all(peak + context <= capacity for peak in peaks)


def memory_report(prepared: Prepared, peaks: list[int]) -> dict:
    """The report of a plan that does not fit by peak allocated (estimate_reports' memory_first): its ranks'
    memory keys only (peak reserved given as peak allocated, as without the replay)."""
    plan = prepared.plan
    ranks = [{"rank": plan.rank_of(dp=0, pp=r, tp=0), "stage": r, "device": prepared.device.name,
              "peak_allocated_bytes": peak, "peak_reserved_bytes": peak,
              "capacity_bytes": int(prepared.device.memory_bytes),
              "context_bytes": int(prepared.cluster.context_bytes), "oom": False} for r, peak in enumerate(peaks)]
    return {"scenario": prepared.scenario.name, "estimate": True, "memory_only": True, "leaves_out": [],
            "reserved_replayed": False, "fits": False, "ranks": ranks}


def replayed_until_fit(candidates: Iterable[tuple[Hashable, Scenario]], enough: int, caches: Caches) -> Iterator:
    """(key, estimate with the allocator replay) for candidates in the order given — those that fit by peak
    allocated (estimate_reports with replay=False), best first — until `enough` of them fit by peak reserved. A
    candidate that does not fit by peak allocated does not fit at all (reserved >= allocated), so the candidates
    that fit are those a replay of every one would give, in the same order (explore/search.py and fit.py)."""
    fitting = 0
    for key, scenario in candidates:
        if fitting >= enough:
            return
        report = estimate_reports([scenario], errors="return", caches=caches)[0]
        fitting += bool(report["fits"])
        yield key, report


# Plans whose numbers wait for their group's evaluation: each plan's report is the same whichever plans are
# evaluated beside it (the evaluation is row by row), so evaluating every few hundred plans bounds what a search
# holds (a plan's numbers keep its schedule's graph alive) at the price of a group split now and then.
PENDING_PLANS = 256


def _flush(groups: dict, results: list, caches: Caches, replay: bool) -> None:
    for items in groups.values():
        for (k, _), report in zip(items, _evaluate_group([plan for _, plan in items], caches, replay)):
            results[k] = report
    groups.clear()


def _replay_timing(caches: Caches, numbers_: PlanNumbers, schedule) -> list[Timing]:
    """Per rank, when the actions of the replayed schedule run: its graph evaluated with the plan's costs."""
    plan = numbers_.prepared.plan
    skey = ("replay", schedule.name, tuple(schedule.ranks)) + numbers_.structure_key[1:]
    structure = numbers_.structure if schedule is numbers_.prepared.schedule else caches.structures.get(skey)
    if structure is None:
        at_end, blocking, reduces, tied = numbers_.structure_key[-4:]
        structure = caches.structures[skey] = build_structure(schedule, reduces=reduces, tied=tied,
                                                              reduce_at_end=at_end, blocking_sends=blocking)
    ends = evaluate(structure, numbers_.costs[None], numbers_.offsets[None])[0]
    costs = np.concatenate([numbers_.costs, [0.0]])[structure.cost_index]
    starts = ends - costs
    actions_base = structure.p * structure.v * SLOTS
    delivered: dict[int, float] = {}
    for node in np.flatnonzero((structure.cost_index >= actions_base)
                               & (structure.cost_index < actions_base + 2 * structure.p)):
        producer = int(structure.preds[node, 1])
        delivered[producer] = max(delivered.get(producer, 0.0), float(ends[node]))
    per_rank = []
    is_action = (structure.cost_index >= 0) & (structure.cost_index < actions_base)
    owner = structure.cost_index // (structure.v * SLOTS)
    period = float(ends[structure.rank_last[0]])
    for r in range(plan.pp):
        nodes = np.flatnonzero(is_action & (owner == r))
        step = structure.rank_last[r]
        per_rank.append(Timing(tuple((float(starts[n]), delivered.get(int(n), float(ends[n]))) for n in nodes),
                               float(starts[step]), period))
    return per_rank


def _replayed(caches: Caches, numbers_: PlanNumbers) -> list[tuple[int, int, bool]]:
    """Per rank (peak reserved, peak allocated, out of memory) from the allocator model (reserved.py)."""
    prepared = numbers_.prepared
    schedule = replay_schedule(prepared.schedule)
    timings = _replay_timing(caches, numbers_, schedule)
    allocator = prepared.scenario.allocator
    out = []
    for r in range(prepared.plan.pp):
        actions = schedule.ranks[r]
        chunks = {}
        for c in range(prepared.plan.virtual_stages):
            model, profile_key, _ = numbers_.chunks[(r, c)]
            chunks[c] = (model, caches.profile(profile_key))
        firsts: dict[int, int] = {}
        for a in actions:
            if a.kind in ("B", "I"):
                firsts.setdefault(a.chunk, a.microbatch)
        out.append(replay_rank(prepared.cluster.allocator_kind, allocator, prepared.cluster.allocator_capacity_bytes,
                               chunks, actions, firsts,
                               keeps_output(prepared.recipe.framework), timings[r]))
    return out


def _evaluate_group(plans: list[PlanNumbers], caches: Caches, replay: bool = True) -> list[dict]:
    """Reports of plans that share one structure (`replay`: as for estimate_reports)."""
    structure = plans[0].structure
    ends = evaluate(structure, np.stack([p.costs for p in plans]), np.stack([p.offsets for p in plans]))
    peaks = []
    for r in range(structure.p):
        rows = structure.memory[r]
        coefficients = np.stack([p.ranks[r].coefficients for p in plans])        # (plans, coords)
        excursions = np.stack([p.ranks[r].excursions for p in plans])            # (plans, types)
        levels = coefficients @ rows.coords.T.astype(float) + excursions[:, rows.types]
        peaks.append(levels.max(axis=1))
    return [_report(plan, ends[i], [float(peaks[r][i]) for r in range(structure.p)],
                    _replayed(caches, plan) if replay else None)
            for i, plan in enumerate(plans)]


def _report(numbers_: PlanNumbers, ends: np.ndarray, action_peaks: list[float], replayed: list) -> dict:
    prepared: Prepared = numbers_.prepared
    structure = numbers_.structure
    scenario, plan, recipe, device, cluster = (prepared.scenario, prepared.plan, prepared.recipe, prepared.device,
                                                prepared.cluster)
    iteration = float(ends[structure.rank_last[0]])
    transfer_base = structure.p * structure.v * 7
    ranks = []
    warnings: list[str] = []
    flops_total = 0.0
    for r, rank in enumerate(numbers_.ranks):
        recv_s = float(sum(structure.transfer_counts[r, s] * numbers_.costs[transfer_base + s]
                           for s in range(2 * structure.p)))
        send_s = float(sum(structure.sends[r, s] * numbers_.costs[transfer_base + s] for s in range(2 * structure.p)))
        flush_s = float(ends[structure.rank_flush[r]] - ends[structure.rank_compute_end[r]])
        tied_s = float(numbers_.costs[transfer_base + 2 * structure.p + 2 * r]) if structure.tied_node[r] >= 0 else 0.0
        joins = structure.joins[r] if structure.joins else ()
        sends_s = float(sum(ends[j] - ends[structure.preds[j, 0]] for j in joins))     # blocking sends waited for
        exposed = rank.blocking_s + recv_s + flush_s + tied_s + sends_s
        total = rank.collectives_s + recv_s + send_s + rank.reductions_s + tied_s
        idle = max(0.0, iteration - rank.compute_s - exposed)
        peak_allocated = peak_level(rank.start_bytes, action_peaks[r], rank.step_bytes, rank.step_excursion)
        peak_reserved, _, oom = replayed[r] if replayed is not None else (0, 0, False)
        peak_reserved = max(int(peak_reserved), int(peak_allocated))
        capacity = int(device.memory_bytes)
        breakdown = {c: int(rank.persistent.get(c, 0)) for c in CATEGORIES}
        breakdown[ACTIVATIONS] += int(peak_allocated - rank.start_bytes)
        ranks.append({
            "rank": rank.rank, "stage": r, "device": device.name,
            "peak_allocated_bytes": int(peak_allocated), "peak_reserved_bytes": int(peak_reserved),
            "capacity_bytes": capacity, "context_bytes": int(cluster.context_bytes), "oom": bool(oom),
            "breakdown_at_peak": breakdown, "compute_s": rank.compute_s, "exposed_communication_s": exposed,
            "idle_s": idle, "parameters": int(rank.parameters),
            "communication_s": total,
        })
        flops_total += rank.model_flops
        if oom:
            warnings.append(f"stage {r}: estimated peak reserved {int(peak_reserved)} bytes exceeds the allocator's "
                            f"{int(cluster.allocator_capacity_bytes)} bytes (out of memory)")
    fits = all(not r["oom"] and r["peak_reserved_bytes"] + r["context_bytes"] <= r["capacity_bytes"] for r in ranks)
    if fits and any(r["peak_reserved_bytes"] + r["context_bytes"] > 0.95 * r["capacity_bytes"] for r in ranks):
        warnings.append("peak reserved memory is within 5% of the device capacity")
    if scenario.parallel.zero_stage and scenario.parallel.dp == 1:
        warnings.append("parallel.zero_stage has no effect with dp = 1 (nothing to shard across)")
    if scenario.parallel.gradient_compression != "none":
        warnings.append("the estimate leaves out parallel.gradient_compression (its collectives, codec and state): "
                        "a simulation (memsim run, a sweep without --fast) includes them")
    if scenario.training.skipped_steps_fraction > 0:
        warnings.append("the estimate leaves out training.skipped_steps_fraction: a simulation averages the "
                        "skipped steps in")
    if replayed is None:
        warnings.append("peak reserved memory not replayed: peak allocated is shown (a lower bound)")
    left_out = leaves_out(prepared)
    for what in left_out:
        warnings.append(f"the estimate leaves out {what}: a simulation includes it")
    warnings += [w for w in plan.warnings if w not in warnings]
    world = plan.dp * plan.tp * plan.pp
    flops = flops_total * plan.tp * plan.dp
    peak = peak_flop_rate(device, scenario.training.precision)
    busiest = max(range(len(ranks)), key=lambda k: (ranks[k]["compute_s"], -k))
    tokens = recipe.micro_batch_size * recipe.accumulation_steps * plan.dp * scenario.model.seq_length
    head = numbers_.ranks[0]
    phases = {key: head.phases.get(key, 0.0) for key in ("forward_s", "backward_s", "recompute_s", "optimizer_s")}
    report = {
        "scenario": scenario.name,
        "estimate": True,
        "leaves_out": left_out,
        "reserved_replayed": replayed is not None,
        "fits": bool(fits),
        "iteration_time_s": iteration,
        "tokens_per_s": tokens / iteration if iteration > 0 else 0.0,
        "model_flops_per_iteration": flops,
        "mfu": flops / iteration / (peak * world) if iteration > 0 else 0.0,
        "bubble_fraction": ranks[busiest]["idle_s"] / iteration if iteration > 0 and prepared.multi else 0.0,
        "communication": {"total_s": max(r["communication_s"] for r in ranks),
                          "exposed_s": max(r["exposed_communication_s"] for r in ranks)},
        "ranks": ranks,
        "warnings": warnings,
        "device": device.name,
        "precision": scenario.training.precision,
        "framework": scenario.training.framework,
        "allocator": cluster.allocator_kind,
        "time_breakdown": {**phases, "exposed_communication_s": ranks[0]["exposed_communication_s"],
                           "idle_s": ranks[0]["idle_s"]},
        "parallel": {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "virtual_stages": plan.virtual_stages,
                     "schedule": scenario.parallel.schedule, "world_size": world},
        "stages": [{"stage": span.stage, "chunk": span.chunk, "layers": [span.start, span.stop]}
                   for span in plan.stages],
    }
    for r in ranks:
        del r["communication_s"]
    return report
