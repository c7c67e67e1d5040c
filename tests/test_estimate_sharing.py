"""The estimate's caches are exact: plans estimated together on one Caches (shared NetworkCosts per equal topology,
built-in schedules, rank layouts, the footprint shortcut) get the very reports each gets estimated alone."""

from __future__ import annotations

from simulator import scenario_from_dict
from simulator.explore.assemble import Caches
from simulator.explore.estimate import estimate_reports
import tomllib
from tests.tiny_scenarios import tiny_gpt

TINY = tiny_gpt("share-tiny", 4, 16) + '\n[cluster]\ntopology = "dgx-a100"\nnodes = 2\n'

# 16 GPUs on two nodes: tensor-parallel groups inside a node (their footprints never meet), data-parallel groups
# across the fabric (checked at each size), pipeline messages inside and between nodes, two schedules.
PLANS = [
    {"tp": 2, "pp": 2, "dp": 4, "schedule": "1f1b"},
    {"tp": 4, "pp": 1, "dp": 4, "schedule": "1f1b"},
    {"tp": 2, "pp": 4, "dp": 2, "schedule": "1f1b", "virtual_stages": 1},
    {"tp": 1, "pp": 2, "dp": 8, "schedule": "gpipe"},
    {"tp": 2, "pp": 2, "dp": 4, "schedule": "1f1b", "zero_stage": 1},
    {"tp": 4, "pp": 2, "dp": 2, "schedule": "1f1b", "sequence_parallel": True},
]


def _scenarios() -> list:
    base = tomllib.loads(TINY)
    out = []
    for k, parallel in enumerate(PLANS):
        document = {**base, "name": f"share-{k}", "parallel": dict(parallel)}
        out.append(scenario_from_dict(document, f"<share-{k}>"))
    return out


def test_plans_estimated_together_get_the_reports_each_gets_alone():
    scenarios = _scenarios()
    together = estimate_reports(scenarios, errors="return", caches=Caches())
    alone = []
    for scenario in scenarios:
        alone.append(estimate_reports([scenario], errors="return", caches=Caches())[0])
    assert all(isinstance(report, dict) for report in together), together
    assert together == alone
