"""The estimate's per-search memos of parallel plans (prepare._plan), of a plan's alike spans
(assemble.chunk_models) and of chunks' model states (stage_model._model_states) are exact: plans of one file
estimated together get the reports each gets alone."""

from __future__ import annotations

import tomllib

from simulator import scenario_from_dict
from simulator.explore.assemble import Caches, chunk_models
from simulator.explore.estimate import estimate_reports
from simulator.explore.prepare import prepare
from simulator.parallel.plan import make_plan
from tests.tiny_scenarios import tiny_gpt

TINY = tiny_gpt("plans-tiny", 4, 16) + '\n[cluster]\ntopology = "dgx-a100"\nnodes = 2\n'

# One source, as a search's candidates: plans differing only in recompute, ZeRO stage or a non-interleaved
# schedule share one parallel plan; pp 4 over 4 layers has two alike middle spans; the last two are refused by
# make_plan's schedule rules (not remembered) and by the interleaved schedule's.
PLANS = [
    ({"tp": 2, "pp": 4, "dp": 2, "schedule": "1f1b"}, {}),
    ({"tp": 2, "pp": 4, "dp": 2, "schedule": "1f1b"}, {"recompute": "full"}),
    ({"tp": 2, "pp": 4, "dp": 2, "schedule": "gpipe", "zero_stage": 1}, {}),
    ({"tp": 2, "pp": 4, "dp": 2, "schedule": "zb-h1"}, {"recompute": "selective"}),
    ({"tp": 2, "pp": 2, "dp": 4, "schedule": "interleaved-1f1b", "virtual_stages": 2}, {}),
    ({"tp": 2, "pp": 2, "dp": 4, "schedule": "1f1b"}, {}),
    ({"tp": 2, "pp": 2, "dp": 4, "schedule": "1f1b", "virtual_stages": 2}, {}),
    ({"tp": 2, "pp": 2, "dp": 4, "schedule": "interleaved-1f1b", "virtual_stages": 1}, {}),
]


def _scenarios() -> list:
    base = tomllib.loads(TINY)
    return [scenario_from_dict({**base, "parallel": dict(parallel), "training": {**base["training"], **training}},
                               "<plans>") for parallel, training in PLANS]


def test_plans_of_one_file_estimated_together_get_the_reports_each_gets_alone():
    scenarios = _scenarios()
    caches = Caches()
    together = estimate_reports(scenarios, errors="return", caches=caches)
    alone = [estimate_reports([s], errors="return", caches=Caches())[0] for s in scenarios]
    assert [isinstance(r, dict) for r in together] == [True] * 6 + [False] * 2
    assert [str(r) if not isinstance(r, dict) else r for r in together] == \
        [str(r) if not isinstance(r, dict) else r for r in alone]
    assert len(caches.plans) == 3          # pp 4; pp 2; pp 2 interleaved
    # ZeRO 0 and 1 chunks of one shape (plans 0 and 2) declare their model states once (stage_model._model_states).
    assert 0 < len(caches.states) < len(caches.chunks)


def test_a_remembered_plan_is_the_plan_make_plan_gives():
    plans = {}
    prepared = [prepare(scenario, plans=plans) for scenario in _scenarios()[:6]]
    for scenario, one in zip(_scenarios(), prepared):
        assert one.plan == make_plan(scenario, one.topology)
    assert prepared[1].plan is prepared[0].plan             # recompute differs only
    found = chunk_models(Caches(), prepared[0])
    assert found[(1, 0)] is found[(2, 0)]                   # pp 4: the two middle spans' chunk looked up once
