"""The plan search's verification order changes no result: its simulations heaviest first (or in any order) give
the Verified tuple the rank order gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.explore import search
from simulator.explore.candidates import AXES, Axis
from tests.tiny_scenarios import tiny_gpt


def _fixed(values: dict) -> tuple[Axis, ...]:
    return tuple(Axis(a.key, (lambda c, chosen, v=values[a.key]: v)) if a.key in values else a for a in AXES)


def test_simulation_order_is_heaviest_first_ties_in_rank_order():
    plans = [(("parallel.pp", 2), ("parallel.dp", 2), ("training.micro_batch_size", 1)),
             (("parallel.pp", 4), ("parallel.dp", 1), ("training.micro_batch_size", 1),
              ("parallel.virtual_stages", 2)),
             (("parallel.pp", 2), ("parallel.dp", 2), ("training.micro_batch_size", 1)),
             (("parallel.pp", 1), ("parallel.dp", 4), ("training.micro_batch_size", 2))]
    # pp x micro-batches x v at global batch 16: 16, 128, 16, 2.
    assert search.simulation_order(plans, 16) == [1, 0, 2, 3]


class _Recording:
    """In this process (estimates included), recording the verification's job order."""

    in_process, workers = True, 1

    def __init__(self):
        self.orders = []

    def map(self, fn, items):
        items = list(items)
        self.orders.append([tuple(item[2]) for item in items])
        return [fn(item) for item in items]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("order") / "tiny.toml"
    path.write_text(tiny_gpt("plan-order", 2, 2) + "\n[run]\nwarmup_iterations = 0\n", encoding="utf-8")
    return path


def test_the_verification_order_gives_the_verified_tuple_of_the_rank_order(scenario, monkeypatch):
    axes = _fixed({"parallel.tp": [1, 2], "parallel.pp": [1, 2], "training.recompute": ["none"],
                   "parallel.schedule": ["1f1b"], "parallel.zero_stage": [0]})
    found = {}
    for name, order in (("heaviest", search.simulation_order),
                        ("rank", lambda settings, batch: list(range(len(settings)))),
                        ("reversed", lambda settings, batch: list(range(len(settings)))[::-1])):
        monkeypatch.setattr(search, "simulation_order", order)
        runner = _Recording()
        out = search.search_plans(scenario, gpus=4, topology="pcie-4x4090", top_k=3, axes=axes, executor=runner)
        found[name] = ([(v.candidate, v.report, v.error) for v in out.verified], runner.orders[-1])
    assert len(found["rank"][0]) == 3
    assert found["heaviest"][0] == found["rank"][0] == found["reversed"][0]
    assert found["rank"][1] == found["reversed"][1][::-1]        # the jobs did run in another order
