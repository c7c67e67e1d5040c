"""`memsim sweep --fast`'s work per block of points from the columnar estimate: the table's outcome of each point
(explore/table.outcome_of's keys and values), with peak reserved from the allocator replay of each plan."""

from __future__ import annotations

from simulator.errors import MemsimError
from simulator.explore.columnar.table import FALLBACK, INVALID, estimate_columns
from simulator.explore.table import outcome_of


def estimate_points(tasks: list) -> list[dict]:
    """The outcomes of a batch of sweep points (tasks.PointTask), estimated together: the same dicts as
    tasks.estimate_points gives (tests/test_columnar.py compares the sweep's CSV bytes)."""
    scenarios: list = []
    for task in tasks:
        try:
            scenarios.append(task.scenario())
        except MemsimError as error:
            scenarios.append(error)
    table = estimate_columns(scenarios, replay=True)
    outcomes = []
    for k, status in enumerate(table.status):
        if status == INVALID:
            outcomes.append({"error": str(table.errors[k])})
        elif status == FALLBACK:
            outcomes.append(outcome_of(table.reports[k]))
        else:
            outcomes.append({
                "fits": bool(table.fits[k]),
                "peak_allocated_bytes": max(table.peak_allocated[k]),
                "peak_reserved_bytes": max(table.peak_reserved[k]),
                "iteration_time_s": float(table.iteration_time_s[k]),
                "tokens_per_s": float(table.tokens_per_s[k]),
                "mfu": float(table.mfu[k]),
                "bubble_fraction": float(table.bubble_fraction[k]),
                "exposed_communication_s": float(table.exposed_communication_s[k]),
                "busy_fraction": float(table.busy_fraction[k]),
                "estimate": True,
            })
    return outcomes
