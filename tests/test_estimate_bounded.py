"""The estimate's bounded memos and faster graph are exact: caches that drop almost everything, evaluation every
plan, the graph built without schedule_check.program and evaluated by level columns give what the unbounded,
plain versions give."""

from __future__ import annotations

import numpy as np
import pytest

from simulator.explore import estimate as estimate_module
from simulator.explore.assemble import Caches
from simulator.explore.bounded import Lru
from simulator.explore.estimate import estimate_reports
from simulator.explore.pipeline import _lowered, build_structure, cost_table_size, evaluate, offset_table_size
from simulator.parallel.schedule_check import CommStep, load_schedule, program
from tests.test_estimate_sharing import _scenarios

SCHEDULES = [("1f1b", 4, 8, 1), ("gpipe", 3, 5, 1), ("interleaved-1f1b", 2, 4, 2), ("zb-h1", 4, 6, 1),
             ("zb-h2", 3, 6, 1), ("1f1b", 1, 3, 1)]


def test_lru_drops_the_least_recently_used_past_its_weight():
    cache = Lru(10, weight=len)
    cache["a"], cache["b"] = "xxxx", "yyyy"
    assert cache.get("a") == "xxxx"            # "a" is now the most recent
    cache["c"] = "zzzz"                        # 12 > 10: "b" goes
    assert "b" not in cache and "a" in cache and "c" in cache and cache.weight == 8
    cache["d"] = "w" * 20                      # heavier than the bound alone: kept, the rest dropped
    assert len(cache) == 1 and cache["d"] == "w" * 20
    assert cache.setdefault("e", "v") == "v" and cache.get("missing") is None
    with pytest.raises(ValueError):
        Lru(0)


def _tiny_caches() -> Caches:
    caches = Caches()
    for name in ("profiles", "chunks", "structures", "schedules", "outputs", "layouts"):
        setattr(caches, name, Lru(1, getattr(caches, name)._weigh))
    return caches


def test_caches_that_drop_everything_and_evaluation_per_plan_give_the_same_reports(monkeypatch):
    scenarios = _scenarios() * 2
    expected = estimate_reports(scenarios, errors="return", caches=Caches())
    monkeypatch.setattr(estimate_module, "PENDING_PLANS", 1)
    got = estimate_reports(scenarios, errors="return", caches=_tiny_caches())
    assert all(isinstance(report, dict) for report in expected)
    assert got == expected


@pytest.mark.parametrize("spec", SCHEDULES)
def test_lowered_posts_what_program_posts(spec):
    schedule = load_schedule(*spec)
    for rank, steps in enumerate(program(schedule)):
        from_program = []
        for step in steps:
            if isinstance(step, CommStep):
                t = step.transfer
                item = ((t.kind, t.src_rank, t.producer.key, t.key) if step.op == "recv" else t.key)
                from_program.append((step.op, item))
            else:
                from_program.append(("action", step))
        mine = []
        for recv, action, send in _lowered(schedule)[rank]:
            mine += [("recv", recv)] if recv is not None else []
            mine.append(("action", action))
            mine += [("send", send)] if send is not None else []
        assert mine == from_program


def _plain_evaluate(structure, costs, offsets):
    """The level-by-level evaluation without per-level columns (the evaluation before them)."""
    plans = costs.shape[0]
    padded_costs = np.concatenate([costs, np.zeros((plans, 1))], axis=1)
    padded_offsets = np.concatenate([offsets, np.zeros((plans, 1))], axis=1)
    node_cost = padded_costs[:, structure.cost_index]
    end = np.zeros((plans, structure.n_nodes + 1))
    preds = np.where(structure.preds >= 0, structure.preds, structure.n_nodes)
    for nodes in structure.levels:
        start = end[:, preds[nodes, 0]] + padded_offsets[:, structure.offset_index[nodes, 0]]
        for k in (1, 2):
            np.maximum(start, end[:, preds[nodes, k]] + padded_offsets[:, structure.offset_index[nodes, k]],
                       out=start)
        end[:, nodes] = start + node_cost[:, nodes]
    return end[:, :-1]


@pytest.mark.parametrize("spec", SCHEDULES)
@pytest.mark.parametrize("flags", [dict(reduces=True, tied=True), dict(reduces=True, tied=False, reduce_at_end=True,
                                                                      blocking_sends=True)])
def test_evaluate_by_level_columns_gives_the_plain_bytes(spec, flags):
    structure = build_structure(load_schedule(*spec), **flags)
    rng = np.random.default_rng(len(spec[0]) + spec[1])
    costs = rng.random((5, cost_table_size(structure)))
    costs[:, ::3] = 0.0
    offsets = rng.random((5, offset_table_size(structure))) - 0.5      # negative offsets too
    assert evaluate(structure, costs, offsets).tobytes() == _plain_evaluate(structure, costs, offsets).tobytes()
