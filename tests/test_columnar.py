"""The columnar estimate (explore/columnar) gives each plan the very fields estimate_reports gives it: random
candidates of the plan search's axes on a small model, each fallback (offload, overlap_param_gather), invalid
plans, memory_first, the allocator replay, and `memsim sweep --fast`'s table bytes."""

from __future__ import annotations

import tomllib

import pytest

from hypothesis import HealthCheck, given, settings, strategies as st

from simulator import scenario_from_dict
from simulator.errors import MemsimError
from simulator.explore.assemble import Caches
from simulator.explore.candidates import AXES, Context, enumerate_plans
from simulator.explore.columnar import estimate_columns, estimate_table, report_fields
from simulator.explore.columnar.table import FALLBACK, INVALID, MEMORY_ONLY, OK
from simulator.explore.estimate import estimate_reports
from tests.tiny_scenarios import tiny_gpt

FIXED = ['cluster.topology="dgx-a100"', "cluster.nodes=2"]
SOURCE = "<columnar-tiny>"


def _document(framework: str) -> dict:
    document = tomllib.loads(tiny_gpt(f"columnar-{framework}", 4, 16))
    document["training"]["framework"] = framework
    return document


def _candidates(framework: str) -> list:
    context = Context(16, 8, 4, 4, 4, 16, framework)
    return list(enumerate_plans(AXES, context))


DOCUMENTS = {f: _document(f) for f in ("megatron", "deepspeed")}
CANDIDATES = {f: _candidates(f) for f in DOCUMENTS}
CACHES = Caches()


def _compare(framework: str, rows: list, **options) -> tuple:
    table = estimate_table(rows, document=DOCUMENTS[framework], source=SOURCE, fixed=FIXED, caches=CACHES,
                           **options)
    scenarios = estimate_table_scenarios(framework, rows)
    valid = [s for s in scenarios if not isinstance(s, MemsimError)]
    estimated = iter(estimate_reports(valid, errors="return", caches=CACHES, replay=options.get("replay", False),
                                      memory_first=options.get("memory_first", False)))
    reports = [s if isinstance(s, MemsimError) else next(estimated) for s in scenarios]
    for k, report in enumerate(reports):
        if isinstance(report, MemsimError):
            assert table.status[k] == INVALID and str(table.errors[k]) == str(report)
            continue
        assert table.status[k] in (OK, FALLBACK, MEMORY_ONLY)
        if report.get("memory_only"):
            assert table.status[k] == MEMORY_ONLY
            assert table.peak_allocated[k] == tuple(r["peak_allocated_bytes"] for r in report["ranks"])
            continue
        assert table.status[k] != MEMORY_ONLY
        assert (table.status[k] == FALLBACK) == bool(report["leaves_out"])
        assert table.fields(k) == report_fields(report), rows[k]
    return table, reports


def estimate_table_scenarios(framework: str, rows: list) -> list:
    from simulator.explore.candidates import overrides

    out = []
    for settings_ in rows:
        try:
            out.append(scenario_from_dict(DOCUMENTS[framework], SOURCE, FIXED + overrides(settings_)))
        except MemsimError as error:
            out.append(error)
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(DOCUMENTS)).flatmap(
    lambda f: st.tuples(st.just(f), st.lists(st.sampled_from(CANDIDATES[f]), min_size=1, max_size=8, unique=True))))
def test_random_candidates_get_the_fields_of_estimate_reports(drawn):
    framework, rows = drawn
    _compare(framework, rows)


def test_every_schedule_and_zero_stage_in_one_call_are_each_plans_fields():
    # Rows sharing a structure and rows alone, in one call: the graph of each structure evaluated once for all.
    rows = [c for c in CANDIDATES["megatron"] if dict(c)["training.micro_batch_size"] == 1
            and dict(c)["parallel.tp"] == 2][:40]
    table, _ = _compare("megatron", rows)
    assert table.structures < sum(s == OK for s in table.status)


def test_offload_falls_back_to_estimate_reports_and_is_counted():
    rows = [c for c in CANDIDATES["deepspeed"] if dict(c)["parallel.offload_optimizer"] != "none"][:2]
    assert rows
    table, reports = _compare("deepspeed", rows)
    assert table.fallbacks == len(rows) and all(r["leaves_out"] for r in reports)


def test_overlap_param_gather_falls_back():
    row = next(c for c in CANDIDATES["megatron"] if dict(c)["parallel.dp"] > 1 and dict(c)["parallel.zero_stage"] == 1)
    rows = [row + (("parallel.overlap_param_gather", True),), row]
    table, reports = _compare("megatron", rows)
    assert table.status[0] == FALLBACK and table.status[1] == OK


def test_invalid_plans_carry_the_run_error():
    rows = [(("parallel.tp", 3),), (("parallel.virtual_stages", 3), ("parallel.schedule", "interleaved-1f1b"),
                                    ("parallel.pp", 2), ("parallel.dp", 4), ("parallel.tp", 2))]
    table, reports = _compare("megatron", rows)
    assert table.status == [INVALID, INVALID]


def test_memory_first_and_the_allocator_replay():
    rows = [c for c in CANDIDATES["deepspeed"] if dict(c)["parallel.pp"] == 1][:12]
    _compare("deepspeed", rows, memory_first=True)
    table, reports = _compare("deepspeed", rows, replay=True)
    assert all(table.peak_reserved[k] is not None for k, s in enumerate(table.status) if s == OK)


def test_memory_first_stops_the_plans_that_do_not_fit_by_peak_allocated():
    # A model too large for some plans on 80 GB A100s: those get their memory numbers only, as estimate_reports.
    document = _document("megatron")
    document["model"].update(hidden_size=16384, num_attention_heads=128, seq_length=2048)
    DOCUMENTS["big"] = document
    rows = [c for c in _candidates("megatron") if dict(c)["training.micro_batch_size"] == 1
            and dict(c)["parallel.schedule"] == "1f1b" and dict(c)["training.recompute"] == "full"]
    try:
        table, reports = _compare("big", rows, memory_first=True)
    finally:
        del DOCUMENTS["big"]
    assert MEMORY_ONLY in table.status and OK in table.status


def test_sweep_fast_writes_the_same_table_bytes_as_the_per_plan_estimate(tmp_path, monkeypatch):
    from simulator.explore import tasks
    from simulator.explore.columnar import points
    from simulator.explore.executors import InlineExecutor
    from simulator.explore.sweep import run_sweep, sweep_spec
    from tests.tiny_scenarios import tiny_gpt_on_one_4090

    grid = "[sweep.grid]\nmodel.num_layers = [2, 5]\ntraining.micro_batch_size = [1, 2, 3]\n"
    path = tmp_path / "tiny.toml"
    path.write_text(tiny_gpt_on_one_4090("columnar-sweep", grid), encoding="utf-8")
    spec = sweep_spec(path, fast=True)
    run_sweep(spec, tmp_path / "columnar", InlineExecutor())
    monkeypatch.setattr(points, "estimate_points", tasks.estimate_points)
    run_sweep(spec, tmp_path / "per-plan", InlineExecutor())
    columnar = (tmp_path / "columnar" / "sweep.csv").read_bytes()
    assert columnar == (tmp_path / "per-plan" / "sweep.csv").read_bytes()
    assert columnar.count(b",ok,") >= 4


@pytest.mark.parametrize("narrow", [True, False], ids=["int32-radix", "int64"])
def test_graphs_evaluated_together_end_where_each_alone_ends(narrow, monkeypatch):
    import numpy as np

    from simulator.explore.assemble import numbers
    from simulator.explore.columnar import merged
    from simulator.explore.columnar.merged import evaluate_many

    if not narrow:      # the 64-bit indices and keys of very large passes
        monkeypatch.setattr(merged, "INDEX32_ENTRIES", 0)
        monkeypatch.setattr(merged, "RADIX_LEVELS", 0)
    from simulator.explore.pipeline import evaluate
    from simulator.explore.prepare import prepare

    groups: dict = {}
    for scenario in estimate_table_scenarios("megatron", CANDIDATES["megatron"][:120]):
        if isinstance(scenario, MemsimError):
            continue
        try:
            plan = numbers(CACHES, prepare(scenario, CACHES.schedules, CACHES.clusters))
        except MemsimError:
            continue
        groups.setdefault(plan.structure_key, []).append(plan)
    items = [(g[0].structure, np.stack([p.costs for p in g]), np.stack([p.offsets for p in g]))
             for g in groups.values()]
    assert len(items) > 3
    for alone, together in zip([evaluate(*item) for item in items], evaluate_many(items)):
        assert np.array_equal(alone, together)


def test_column_sums_add_left_to_right_from_zero_as_the_report_does():
    import numpy as np

    from simulator.explore.columnar.fields import _column_sum

    rng = np.random.default_rng(3)
    columns = rng.standard_normal((40, 9)) * 10.0 ** rng.integers(-12, 12, (40, 9))
    columns[0] = -0.0                   # 0 + -0.0 is 0.0, as Python's sum() starting from 0 gives
    columns[1, 0] = 1e300 * 10          # inf, then inf - inf: nan where the loop gives nan
    columns[1, 1] = -columns[1, 0]
    weights = rng.integers(0, 3, 9)
    got = _column_sum(weights, columns)
    for row, value in zip(columns, got):
        expected = float(sum(weights[s] * row[s] for s in range(9)))
        assert np.array_equal(np.float64(expected), value, equal_nan=True)
        assert np.signbit(expected) == np.signbit(value)


def test_chunk_models_with_the_split_read_once_per_schedule_are_the_per_plan_ones():
    """Schedule.split_backward is read once per schedule object (a cached walk of every action); the chunk
    models with it are those of a fresh copy of the schedule, and plans of one built-in schedule share it."""
    import dataclasses

    from simulator.explore.assemble import chunk_models
    from simulator.explore.prepare import prepare

    schedules: dict = {}
    seen = set()
    plans = 0
    for scenario in estimate_table_scenarios("megatron", CANDIDATES["megatron"]):
        if isinstance(scenario, MemsimError) or scenario.parallel.pp == 1:
            continue
        try:
            prepared = prepare(scenario, CACHES.schedules, CACHES.clusters)
        except MemsimError:
            continue
        plans += 1
        found = chunk_models(CACHES, prepared)
        fresh = dataclasses.replace(prepared.schedule)           # its split not read yet
        assert "split_backward" not in vars(fresh)
        assert found == chunk_models(CACHES, dataclasses.replace(prepared, schedule=fresh))
        assert vars(prepared.schedule)["split_backward"] == fresh.split_backward
        seen.add(prepared.schedule.split_backward)
        schedules[id(prepared.schedule)] = prepared.schedule
    assert seen == {True, False}                # zero-bubble (split) and whole backwards both met
    assert len(schedules) < plans               # shared by the plans of one schedule


@pytest.mark.parametrize("alone", [0, 10 ** 9], ids=["every-graph-alone", "every-graph-merged"])
def test_graphs_alone_or_merged_give_each_plans_fields(alone, monkeypatch):
    from simulator.explore.columnar import table as columnar_table

    monkeypatch.setattr(columnar_table, "ALONE_ENTRIES_PER_LEVEL", alone)
    rows = CANDIDATES["megatron"][::7]
    _compare("megatron", rows)
