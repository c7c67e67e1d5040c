"""search_plans over a process pool (explore/spread.py) gives the search it gives in one process: every candidate's
verdict, estimate and reason, the ranking, the verified reports and the counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.explore import spread
from simulator.explore.candidates import AXES, Axis
from simulator.explore.executors import ProcessExecutor
from simulator.explore.search import search_plans
from tests.tiny_scenarios import tiny_gpt

TINY = tiny_gpt("plan-spread", 2, 2) + "\n[run]\nwarmup_iterations = 0\n"


def _fixed(values: dict) -> tuple[Axis, ...]:
    return tuple(Axis(a.key, (lambda c, chosen, v=values[a.key]: v)) if a.key in values else a for a in AXES)


# Two tp values and three micro-batches: six shares; pp 1 and 2 so that replays and schedules differ by share.
AXES_SMALL = _fixed({"parallel.tp": [1, 2], "parallel.pp": [1, 2], "training.recompute": ["none", "full"],
                     "parallel.schedule": ["1f1b", "zb-h1"]})


def _outcome(found) -> tuple:
    return (found.scenario, found.candidates, [c.settings for c in found.ranked],
            [(v.candidate.settings, v.report, v.error) for v in found.verified], found.pruned)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spread") / "tiny.toml"
    path.write_text(TINY, encoding="utf-8")
    return path


def test_a_pool_gives_the_search_one_process_gives(scenario):
    alone = search_plans(scenario, gpus=4, topology="pcie-4x4090", top_k=2, axes=AXES_SMALL)
    pool = ProcessExecutor(2)
    try:
        spread_out = search_plans(scenario, gpus=4, topology="pcie-4x4090", top_k=2, axes=AXES_SMALL, executor=pool)
    finally:
        pool.close()
    assert _outcome(spread_out) == _outcome(alone)
    assert len(alone.verified) == 2
    replayed = [c for c in alone.candidates if c.estimate and c.estimate["reserved_replayed"]]
    assert replayed and len(replayed) < len([c for c in alone.candidates if c.estimate])


def test_shares_split_by_tp_to_micro_batch_ratio_heaviest_first():
    items = [(k, (("parallel.tp", tp), ("parallel.pp", pp), ("parallel.dp", 8 // (tp * pp)),
                  ("training.micro_batch_size", mb)))
             for k, (tp, pp, mb) in enumerate([(1, 1, 1), (2, 4, 1), (1, 8, 1), (2, 1, 2), (1, 2, 1)])]
    found = spread.shares(items, 64)
    assert sorted(k for share in found for k, _ in share) == list(range(5))
    # tp 2 : micro-batch 2 is ratio 1 with tp 1 : micro-batch 1 (the same micro-batch counts, so schedules).
    assert [sorted(k for k, _ in share) for share in found] == [[0, 2, 3, 4], [1]]


def test_profile_order_by_ratio_then_pp_then_tp_and_micro_batch():
    rows = [(2, 4, 2), (1, 8, 1), (2, 4, 1), (1, 4, 1), (2, 8, 2), (2, 4, 2)]
    settings = [(("parallel.tp", tp), ("parallel.pp", pp), ("training.micro_batch_size", mb)) for tp, pp, mb in rows]
    assert spread.profile_order(settings) == [3, 0, 5, 1, 4, 2]


LLAMA = Path(__file__).resolve().parent.parent / "scenarios" / "multi" / "llama7b-4x4090-pp4.toml"
# A search where most plans do not fit (Llama 7B on four 24 GB cards) and some fit (recompute, ZeRO).
AXES_MEMORY = _fixed({"parallel.tp": [1], "parallel.pp": [1, 4], "parallel.schedule": ["1f1b", "interleaved-1f1b"],
                      "training.micro_batch_size": [1, 4]})


def test_memory_first_gives_the_same_verdicts_reasons_and_memory_numbers():
    from simulator.explore.plan_report import plan_json
    from simulator.explore.search import NO_FIT

    on = search_plans(LLAMA, gpus=4, topology="pcie-4x4090", top_k=2, axes=AXES_MEMORY, verify=False)
    off = search_plans(LLAMA, gpus=4, topology="pcie-4x4090", top_k=2, axes=AXES_MEMORY, verify=False,
                       shortcuts=False)
    assert plan_json(on) == plan_json(off)
    assert [c.settings for c in on.ranked] == [c.settings for c in off.ranked] and on.pruned == off.pruned
    memory_only = 0
    for a, b in zip(on.candidates, off.candidates):
        assert (a.settings, a.verdict, a.reason) == (b.settings, b.verdict, b.reason)
        if a.estimate is not None and a.estimate.get("memory_only"):
            memory_only += 1
            assert a.verdict == NO_FIT and not b.estimate.get("memory_only")
            assert [{key: r[key] for key in ra} for ra, r in zip(a.estimate["ranks"], b.estimate["ranks"])] == \
                a.estimate["ranks"]
        else:
            assert a.estimate == b.estimate
    assert memory_only and any(c.verdict == NO_FIT for c in off.candidates)


def test_verified_simulations_leave_the_cores_to_each_other():
    """A local pool with a simulation on every core runs them without memory workers, anything else lets each run
    choose; the report is the same either way."""
    from simulator.explore.executors import InlineExecutor, ProcessExecutor, available_cores
    from simulator.explore.search import simulate_candidate, verification_memory_workers
    from simulator.scenario.loader import read_scenario_document

    cores = available_cores()
    assert verification_memory_workers(ProcessExecutor(cores), cores) == 0
    assert verification_memory_workers(InlineExecutor(), 10) is None
    if cores > 1:
        assert verification_memory_workers(ProcessExecutor(cores), cores - 1) is None
        assert verification_memory_workers(ProcessExecutor(cores - 1), 10) is None
    source = str(Path(__file__).resolve().parents[1] / "scenarios" / "multi" / "llama7b-4x4090-tp2-pp2.toml")
    document = read_scenario_document(source)
    alone = simulate_candidate((document, source, []))
    assert alone[0] is not None
    assert simulate_candidate((document, source, [], 0)) == alone
    assert simulate_candidate((document, source, [], 2)) == alone
