"""A report's main fields for every plan of one schedule structure at once, as numpy columns: the same float
operations in the same order as estimate._report takes them per plan, so each value is equal (==) to that report's."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.explore.assemble import PlanNumbers
from simulator.explore.pipeline import SLOTS, Structure, evaluate
from simulator.report.metrics import peak_flop_rate


@dataclass(frozen=True)
class GroupFields:
    """Per plan of a group (rows) and per rank (columns where 2-D) the estimate's report fields."""

    iteration_time_s: np.ndarray          # (plans,)
    tokens_per_s: np.ndarray
    mfu: np.ndarray
    bubble_fraction: np.ndarray
    exposed_communication_s: np.ndarray   # communication.exposed_s: the largest rank's
    communication_s: np.ndarray           # communication.total_s
    busy_fraction: np.ndarray             # cost.busy_fraction of the report's ranks
    peak_allocated: np.ndarray            # (plans, ranks) int64
    rank_compute_s: np.ndarray            # (plans, ranks)
    rank_exposed_s: np.ndarray
    rank_idle_s: np.ndarray


def _column_sum(weights: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """sum(w[s] * columns[:, s] for s) per row, added left to right from 0 as Python's sum() adds: one
    np.add.accumulate along the row (sequential by definition, not pairwise) over [0, w[0] * c[0], ...]."""
    products = np.empty((columns.shape[0], columns.shape[1] + 1))
    products[:, 0] = 0.0
    np.multiply(weights, columns, out=products[:, 1:])
    return np.add.accumulate(products, axis=1)[:, -1]


def action_peaks(structure: Structure, plans: list[PlanNumbers]) -> list[np.ndarray]:
    """Per rank, each plan's highest action level above its start (estimate._evaluate_group's `peaks`)."""
    peaks = []
    for r in range(structure.p):
        rows = structure.memory[r]
        coefficients = np.stack([p.ranks[r].coefficients for p in plans])
        excursions = np.stack([p.ranks[r].excursions for p in plans])
        levels = coefficients @ rows.coords.T.astype(float) + excursions[:, rows.types]
        peaks.append(levels.max(axis=1))
    return peaks


def group_fields(plans: list[PlanNumbers], ends: np.ndarray | None = None) -> GroupFields:
    """The fields of plans sharing one structure (their graph evaluated together, as estimate_reports does;
    `ends`: that evaluation, if done: merged.evaluate_many)."""
    structure = plans[0].structure
    costs = np.stack([p.costs for p in plans])
    if ends is None:
        ends = evaluate(structure, costs, np.stack([p.offsets for p in plans]))
    peaks = action_peaks(structure, plans)
    p = structure.p
    transfer_base = p * structure.v * SLOTS
    transfers = costs[:, transfer_base:transfer_base + 2 * p]
    iteration = ends[:, structure.rank_last[0]]
    n = len(plans)
    compute = np.empty((n, p))
    exposed = np.empty((n, p))
    idle = np.empty((n, p))
    total = np.empty((n, p))
    allocated = np.empty((n, p), dtype=np.int64)
    flops_total = np.zeros(n)
    for r in range(p):
        ranks = [plan.ranks[r] for plan in plans]
        recv_s = _column_sum(structure.transfer_counts[r], transfers)
        send_s = _column_sum(structure.sends[r], transfers)
        flush_s = ends[:, structure.rank_flush[r]] - ends[:, structure.rank_compute_end[r]]
        tied_s = costs[:, transfer_base + 2 * p + 2 * r] if structure.tied_node[r] >= 0 else np.zeros(n)
        sends_s = np.zeros(n)
        for j in (structure.joins[r] if structure.joins else ()):
            sends_s = sends_s + (ends[:, j] - ends[:, structure.preds[j, 0]])
        blocking = np.array([rank.blocking_s for rank in ranks])
        exposed[:, r] = blocking + recv_s + flush_s + tied_s + sends_s
        compute[:, r] = np.array([rank.compute_s for rank in ranks])
        total[:, r] = (np.array([rank.collectives_s for rank in ranks]) + recv_s + send_s
                       + np.array([rank.reductions_s for rank in ranks]) + tied_s)
        idle[:, r] = np.maximum(0.0, iteration - compute[:, r] - exposed[:, r])
        start = np.array([rank.start_bytes for rank in ranks], dtype=np.int64)
        step = start + np.array([rank.step_bytes + rank.step_excursion for rank in ranks], dtype=np.int64)
        # max(start + action peak, start + step, start) as estimate.peak_level takes it, then int().
        level = np.maximum(np.maximum(start + peaks[r], step.astype(float)), start.astype(float))
        allocated[:, r] = level.astype(np.int64)
        flops_total = flops_total + np.array([rank.model_flops for rank in ranks])
    tp = np.array([pl.prepared.plan.tp for pl in plans], dtype=np.int64)
    dp = np.array([pl.prepared.plan.dp for pl in plans], dtype=np.int64)
    world = dp * tp * p
    flops = flops_total * tp * dp
    peak = np.array([peak_flop_rate(pl.prepared.device, pl.prepared.scenario.training.precision) for pl in plans])
    tokens = np.array([pl.prepared.recipe.micro_batch_size * pl.prepared.recipe.accumulation_steps * pl.prepared.plan.dp
                       * pl.prepared.scenario.model.seq_length for pl in plans], dtype=np.int64)
    multi = np.array([pl.prepared.multi for pl in plans], dtype=bool)
    positive = iteration > 0
    safe = np.where(positive, iteration, 1.0)
    busiest = np.argmax(compute, axis=1)           # the first of the largest, as max(key=(compute, -k))
    rows = np.arange(n)
    bubble = np.where(positive & multi, idle[rows, busiest] / safe, 0.0)
    busy_sum = np.zeros(n)
    for r in range(p):
        busy_sum = busy_sum + compute[:, r]
    busy = np.where(positive, np.minimum(1.0, np.maximum(0.0, busy_sum / p / safe)), 0.0)
    return GroupFields(
        iteration_time_s=iteration, tokens_per_s=np.where(positive, tokens / safe, 0.0),
        mfu=np.where(positive, flops / safe / (peak * world), 0.0), bubble_fraction=bubble,
        exposed_communication_s=exposed.max(axis=1), communication_s=total.max(axis=1), busy_fraction=busy,
        peak_allocated=allocated, rank_compute_s=compute, rank_exposed_s=exposed, rank_idle_s=idle)
