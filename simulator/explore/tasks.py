"""The work an executor runs for a sweep: check points, simulate one, each from the scenario document and overrides."""

from __future__ import annotations

from dataclasses import dataclass

from simulator.errors import MemsimError
from simulator.explore.cost import ClusterShape
from simulator.explore.table import PointCheck, outcome_of
from simulator.scenario import Scenario, scenario_from_dict


@dataclass(frozen=True)
class PointTask:
    """Everything a worker needs for one point: the scenario file's tables, its path, the point's overrides."""

    document: dict
    source: str
    overrides: tuple[str, ...]
    memory_workers: int | None = None     # for simulate (None: by the run's size; 0 in pool and Dask workers)

    def scenario(self) -> Scenario:
        """The point's scenario (raises ScenarioError as `memsim run --set ...` would)."""
        return scenario_from_dict(self.document, self.source, self.overrides)


def check_points(tasks: list[PointTask]) -> list[PointCheck]:
    """For each point: its cluster and plan if a run would start, else the error the run gives."""
    from simulator.api import check_scenario

    checked: list[PointCheck] = []
    for task in tasks:
        try:
            scenario = task.scenario()
            shape = ClusterShape.of(check_scenario(scenario))
        except MemsimError as error:
            checked.append(PointCheck(str(error)))
            continue
        p = scenario.parallel
        checked.append(PointCheck(None, shape, (p.dp, p.tp, p.pp)))
    return checked


def simulate_point(task: PointTask) -> dict:
    """The point's outcome from the full simulation (no timelines): the table's metrics, or {"error": message}."""
    from simulator.api import simulate

    try:
        return outcome_of(simulate(task.scenario(), timelines=False, events=False,
                                    memory_workers=task.memory_workers).report)
    except MemsimError as error:
        return {"error": str(error)}


def estimate_points(tasks: list[PointTask]) -> list[dict]:
    """The outcomes of a batch of points from the fast estimate, evaluated together (vectorised over plans)."""
    from simulator.explore.estimate import estimate_reports

    outcomes: list[dict | None] = [None] * len(tasks)
    loaded = []
    for position, task in enumerate(tasks):
        try:
            loaded.append((position, task.scenario()))
        except MemsimError as error:
            outcomes[position] = {"error": str(error)}
    reports = estimate_reports([scenario for _, scenario in loaded], errors="return")
    for (position, _), report in zip(loaded, reports):
        outcomes[position] = {"error": str(report)} if isinstance(report, MemsimError) else outcome_of(report)
    return outcomes
