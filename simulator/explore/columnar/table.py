"""The columnar estimate: many plans' report fields at once, grouped by what they share (a schedule's graph, its
memory rows), from the estimate's own per-plan numbers (assemble.numbers) and its graph evaluation.

    table = estimate_columns(scenarios, caches=caches)            # Scenarios
    table = estimate_table(rows, document=doc, source=path, fixed=[...])   # a base file and settings rows
    table.iteration_time_s[k], table.fits[k], table.peak_allocated[k]      # per-stage tuple

Each field equals (==) estimate_reports(replay=False)'s for the same plan (tests/test_columnar.py); a plan the
estimate leaves something out of (offload, overlap_param_gather) falls back to estimate_reports and is counted.
Peak reserved is not computed here: it is the allocator replay per plan (reserved.py), `replay=True`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from simulator.errors import MemsimError
from simulator.explore.assemble import Caches, PlanNumbers, chunk_models, numbers
from simulator.explore.candidates import Settings, overrides
from simulator.explore.columnar.fields import group_fields
from simulator.explore.columnar.merged import evaluate_many
from simulator.explore.estimate import _replayed, allocated_peaks, estimate_reports, fits_allocated, leaves_out
from simulator.explore.prepare import Prepared, prepare
from simulator.scenario import Scenario

OK, INVALID, FALLBACK, MEMORY_ONLY = "ok", "invalid", "fallback", "memory-only"
# Plans whose numbers are held before their structure's group is evaluated (the plans are sorted by schedule, so
# a group is split only where it is larger than this).
GROUP_PLANS = 512
# (plan, node) entries of the graphs evaluated in one merged pass (about 80 bytes each while it runs).
MERGED_ENTRIES = 4_000_000
# A group with at least this many (plan, node) entries per graph level is evaluated alone (pipeline.evaluate: one
# numpy step per level over its plans' columns); merging it would cost more per entry (index arrays, sort) than
# its own levels' steps cost. Fewer (few plans, narrow graphs: LLaMA-13B's) are merged.
ALONE_ENTRIES_PER_LEVEL = 256
FIELDS = ("fits", "iteration_time_s", "tokens_per_s", "mfu", "bubble_fraction", "exposed_communication_s",
          "communication_s", "busy_fraction")


@dataclass
class Columns:
    """One entry per plan, in the order given. `status[k]`: OK (computed here), INVALID (`errors[k]` is the
    MemsimError a run raises), FALLBACK (estimate_reports computed it: `reports[k]`), MEMORY_ONLY (memory_first:
    does not fit by peak allocated; times are NaN). Peak allocated per stage; `peak_reserved` per stage only with
    replay (else None)."""

    status: list
    errors: dict = field(default_factory=dict)
    reports: dict = field(default_factory=dict)
    fits: np.ndarray = None
    iteration_time_s: np.ndarray = None
    tokens_per_s: np.ndarray = None
    mfu: np.ndarray = None
    bubble_fraction: np.ndarray = None
    exposed_communication_s: np.ndarray = None
    communication_s: np.ndarray = None
    busy_fraction: np.ndarray = None
    peak_allocated: list = None
    peak_reserved: list = None
    oom: list = None
    structures: int = 0                   # schedule graphs evaluated
    seconds: dict = field(default_factory=dict)   # CPU seconds per phase: check (prepare, chunk models, memory
                                                  # first), numbers (assemble.numbers), evaluate (graphs, fields)

    @property
    def fallbacks(self) -> int:
        return sum(s == FALLBACK for s in self.status)

    def fields(self, k: int) -> dict:
        """Plan k's fields as a dict (the names of FIELDS, "peak_allocated" and "peak_reserved" per stage)."""
        out = {name: getattr(self, name)[k].item() for name in FIELDS}
        out["peak_allocated"] = self.peak_allocated[k]
        out["peak_reserved"] = self.peak_reserved[k] if self.peak_reserved is not None else None
        return out


def report_fields(report: dict) -> dict:
    """The same fields read off an estimate_reports report (what Columns.fields is compared with)."""
    ranks = report["ranks"]
    iteration = report["iteration_time_s"]
    busy = 0.0 if iteration <= 0 or not ranks else min(
        1.0, max(0.0, sum(r["compute_s"] for r in ranks) / len(ranks) / iteration))
    return {"fits": bool(report["fits"]), "iteration_time_s": iteration, "tokens_per_s": report["tokens_per_s"],
            "mfu": report["mfu"], "bubble_fraction": report["bubble_fraction"],
            "exposed_communication_s": report["communication"]["exposed_s"],
            "communication_s": report["communication"]["total_s"], "busy_fraction": busy,
            "peak_allocated": tuple(int(r["peak_allocated_bytes"]) for r in ranks),
            "peak_reserved": tuple(int(r["peak_reserved_bytes"]) for r in ranks)
            if report.get("reserved_replayed") else None}


def estimate_table(rows: Sequence[Settings], *, document: dict, source: str, fixed: Sequence[str] = (),
                   caches: Caches | None = None, memory_first: bool = False, replay: bool = False) -> Columns:
    """The columnar estimate of each settings row (candidates.py's (key, value) pairs) applied to the scenario
    file `document` (read from `source`) with the `fixed` --set items; a row a run refuses is INVALID with the
    loader's or the checks' error."""
    from simulator.scenario.loader import scenario_from_dict

    scenarios: list = []
    for settings in rows:
        try:
            scenarios.append(scenario_from_dict(document, source, list(fixed) + overrides(settings)))
        except MemsimError as error:
            scenarios.append(error)
    return estimate_columns(scenarios, caches=caches, memory_first=memory_first, replay=replay)


def estimate_columns(scenarios: Sequence[Scenario | MemsimError], *, caches: Caches | None = None,
                     memory_first: bool = False, replay: bool = False) -> Columns:
    """The columnar estimate of each scenario (a MemsimError in the list stays INVALID).

    memory_first: as estimate_reports takes it (a plan that does not fit by peak allocated gets its memory only).
    replay: peak reserved per stage by the allocator replay of each plan (reserved.py; per plan, not columnar),
    and "fits" by it, as estimate_reports(replay=True) gives them.
    """
    caches = Caches() if caches is None else caches
    n = len(scenarios)
    table = Columns(status=[None] * n)
    floats = {name: np.full(n, math.nan) for name in FIELDS if name != "fits"}
    fits = np.zeros(n, dtype=bool)
    allocated: list = [None] * n
    reserved: list = [None] * n
    ooms: list = [None] * n
    pending: list[tuple[int, Prepared, dict | None]] = []
    clock = time.process_time()
    for k in _profile_order(scenarios):
        scenario = scenarios[k]
        if isinstance(scenario, MemsimError):
            table.status[k], table.errors[k] = INVALID, scenario
            continue
        try:
            prepared = prepare(scenario, caches.schedules, caches.clusters, caches.plans)
            if leaves_out(prepared):
                report = estimate_reports([scenario], caches=caches, replay=replay)[0]
                table.status[k], table.reports[k] = FALLBACK, report
                _from_report(report, k, floats, fits, allocated, reserved)
                continue
            found = chunk_models(caches, prepared)
            if memory_first and not replay:
                peaks = allocated_peaks(caches, prepared, found)
                if not fits_allocated(prepared, peaks):
                    table.status[k] = MEMORY_ONLY
                    allocated[k] = tuple(peaks)
                    continue
        except MemsimError as error:
            table.status[k], table.errors[k] = INVALID, error
            continue
        pending.append((k, prepared, found))
    # Every plan's numbers, in order of their schedule (plans of one structure come together): each graph is built
    # once and evaluated once for all the plans that share it, then let go.
    table.seconds["check"] = time.process_time() - clock
    table.seconds["numbers"] = table.seconds["evaluate"] = 0.0
    pending.sort(key=lambda item: _schedule_order(item[1]))
    group: list[tuple[int, PlanNumbers]] = []
    ready: list[list[tuple[int, PlanNumbers]]] = []      # groups whose graphs are evaluated together
    entries = 0
    for k, prepared, found in pending:
        clock = time.process_time()
        try:
            plan = numbers(caches, prepared, found)
        except MemsimError as error:
            table.status[k], table.errors[k] = INVALID, error
            continue
        table.seconds["numbers"] += time.process_time() - clock
        if group and (group[0][1].structure_key != plan.structure_key or len(group) >= GROUP_PLANS):
            ready.append(group)
            entries += len(group) * group[0][1].structure.n_nodes
            group = []
            if entries >= MERGED_ENTRIES:
                _evaluate_ready(ready, table, floats, fits, allocated, reserved, ooms, caches, replay)
                ready, entries = [], 0
        group.append((k, plan))
    if group:
        ready.append(group)
    _evaluate_ready(ready, table, floats, fits, allocated, reserved, ooms, caches, replay)
    table.fits = fits
    for name, values in floats.items():
        setattr(table, name, values)
    table.peak_allocated = allocated
    table.peak_reserved = reserved if replay else None
    table.oom = ooms if replay else None
    return table


def _profile_order(scenarios) -> list[int]:
    """Indices by (tp, micro-batch), then as given: plans of one (tp, micro-batch) share their chunks' profiles
    whatever their pp, so the bounded profile memo records each once (as spread.profile_order orders a search)."""
    def key(k: int) -> tuple:
        scenario = scenarios[k]
        if isinstance(scenario, MemsimError):
            return (0, 0, k)
        return (scenario.parallel.tp, scenario.training.micro_batch_size, k)

    return sorted(range(len(scenarios)), key=key)


def _schedule_order(prepared: Prepared) -> tuple:
    """A sort key that puts plans of one schedule together (the structure key adds flags read off the chunks)."""
    schedule = prepared.schedule
    return (prepared.builtin is None, prepared.builtin or (schedule.name,), schedule.num_ranks,
            schedule.virtual_stages, schedule.microbatches, id(schedule))


def _evaluate_ready(ready, table: Columns, *rest) -> None:
    """The graphs of the groups with few entries per level evaluated in one pass (merged.evaluate_many), the
    others' alone (group_fields), then each group's fields."""
    if not ready:
        return
    clock = time.process_time()
    merged = [g for g in ready if not _alone(g)]
    ends = dict(zip(map(id, merged), evaluate_many(
        [(g[0][1].structure, np.stack([p.costs for _, p in g]), np.stack([p.offsets for _, p in g])) for g in merged])))
    table.seconds["evaluate"] += time.process_time() - clock
    for group in ready:
        _evaluate(group, table, *rest, ends=ends.get(id(group)))


def _alone(group) -> bool:
    structure = group[0][1].structure
    return len(group) * structure.n_nodes >= ALONE_ENTRIES_PER_LEVEL * max(1, len(structure.levels))


def _evaluate(group, table: Columns, floats: dict, fits, allocated, reserved, ooms, caches, replay,
              ends=None) -> None:
    clock = time.process_time()
    plans = [plan for _, plan in group]
    values = group_fields(plans, ends)
    table.structures += 1
    for i, (k, plan) in enumerate(group):
        table.status[k] = OK
        for name, column in floats.items():
            column[k] = getattr(values, name)[i]
        peaks = tuple(int(x) for x in values.peak_allocated[i])
        allocated[k] = peaks
        if replay:
            replayed = _replayed(caches, plan)
            reserved[k] = tuple(max(int(res), peak) for (res, _, _), peak in zip(replayed, peaks))
            ooms[k] = tuple(bool(oom) for _, _, oom in replayed)
            capacity, context = int(plan.prepared.device.memory_bytes), int(plan.prepared.cluster.context_bytes)
            fits[k] = all(not oom and res + context <= capacity for res, oom in zip(reserved[k], ooms[k]))
        else:
            fits[k] = fits_allocated(plan.prepared, peaks)
    table.seconds["evaluate"] += time.process_time() - clock


def _from_report(report: dict, k: int, floats: dict, fits, allocated, reserved) -> None:
    values = report_fields(report)
    for name in floats:
        floats[name][k] = values[name]
    fits[k] = values["fits"]
    allocated[k] = values["peak_allocated"]
    reserved[k] = values["peak_reserved"]
