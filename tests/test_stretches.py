"""Stretch replay (engine/stretches.py) and the engine's span and sample columns (engine/timelines.py) change no
result: whole runs with it on and off, the report's column sums against the loop over Span objects, the
vectorised union of communication intervals against a loop."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

import simulator.api as api
from simulator.engine.executor import EngineOptions
from simulator.engine.results import covered
from simulator.engine.logs import IntervalLog
from simulator.engine.stretches import Stretches
from simulator.engine.timelines import SampleColumns, SpanColumns
from simulator.parallel.program import Free, Run
from simulator.report.metrics import span_sums
from simulator.scenario import scenario_from_dict
from simulator.trace.records import COMM_PHASE, MemorySample, Span
from simulator.workload.graph import Op
from test_scale_inline import _doc, _everything
from test_span_logs import log_of


def _steady(nodes: int, global_batch: int, **parallel) -> dict:
    """A tiny GPT with enough micro-batches for a steady state; allocator events off (as at cluster scale)."""
    doc = _doc(nodes, global_batch, **parallel)
    doc["run"]["record_events"] = False
    return doc


CASES = [    # (nodes, global batch, parallel plan, also against every engine shortcut off)
    (4, 32, {"tp": 8, "pp": 4, "dp": 1, "sequence_parallel": True}, True),
    (4, 48, {"tp": 8, "pp": 2, "dp": 2, "sequence_parallel": True}, False),
]


def _count_replays(monkeypatch) -> list[bool]:
    """Stretches.replay spied on: the list gets, per call, whether it applied a record."""
    replayed: list[bool] = []
    real = Stretches.replay

    def spy(self, *args):
        done = real(self, *args)
        replayed.append(done is not None)
        return done

    monkeypatch.setattr(Stretches, "replay", spy)
    return replayed


@pytest.mark.parametrize("nodes, global_batch, parallel, plain", CASES)
def test_stretch_replay_changes_nothing(monkeypatch, nodes, global_batch, parallel, plain):
    replayed = _count_replays(monkeypatch)
    doc = _steady(nodes, global_batch, **parallel)
    fast = _everything(api.simulate(scenario_from_dict(doc)))
    assert sum(replayed) > 0           # the comparison below compares two different computations
    monkeypatch.setattr(api, "EngineOptions", lambda: EngineOptions(stretches=False))
    assert fast == _everything(api.simulate(scenario_from_dict(doc)))
    if plain:
        monkeypatch.setattr(api, "EngineOptions", lambda: EngineOptions(rank_lookahead=False, repeats=False))
        assert fast == _everything(api.simulate(scenario_from_dict(doc)))


@pytest.mark.parametrize("record_events", [False, True])
def test_runs_without_memory_samples_give_everything_else_unchanged(monkeypatch, record_events):
    # `memsim run` without --out keeps no samples (api.simulate(timelines=False)): stretches and periods are
    # replayed and checked without them, and every other result must be the same.
    replayed = _count_replays(monkeypatch)
    doc = _steady(4, 32, tp=8, pp=4, dp=1, sequence_parallel=True)
    doc["run"]["record_events"] = record_events
    full = _everything(api.simulate(scenario_from_dict(doc)))
    bare = api.simulate(scenario_from_dict(doc), timelines=False)
    assert all(not rank.memory for rank in bare.trace.ranks)
    assert any(rank[1] for rank in full[1])
    assert sum(replayed) > 0

    def without_samples(everything):
        report, ranks, *rest = everything
        return report, [rank[:1] + rank[2:] for rank in ranks], *rest

    assert without_samples(_everything(bare)) == without_samples(full)


def test_stretches_replay_without_memory_periods(monkeypatch):
    # Stretches no longer wait for a replayed period of memory calls (their memory calls are logged, not made):
    # with periods off they are still replayed, and everything is the same.
    doc = _steady(4, 32, tp=8, pp=4, dp=1, sequence_parallel=True)
    fast = _everything(api.simulate(scenario_from_dict(doc)))
    replayed = _count_replays(monkeypatch)
    monkeypatch.setattr(api, "EngineOptions", lambda: EngineOptions(repeats=False))
    assert _everything(api.simulate(scenario_from_dict(doc))) == fast
    assert sum(replayed) > 0


@pytest.mark.parametrize("global_batch, parallel, named", [
    (48, dict(tp=8, pp=2, dp=2, sequence_parallel=True), 5),    # a compiled copy (Program.copies)
    (32, dict(tp=8, pp=4, dp=1, sequence_parallel=True), 4),    # a template copy's part (Program.blocks) and the
])                                                               # (empty) compiled copy after it: a chain
def test_copies_match_as_the_instructions_do(monkeypatch, global_batch, parallel, named):
    # A stretch in the same part of a copy of the same template (Program.copies; Program.blocks, with a tail of
    # Allocs and Frees) is replayed without comparing its runs and Blocking collectives: the same result as
    # comparing them, and the shortcut is taken.
    doc = _steady(4, global_batch, **parallel)
    copied = []
    real = Stretches.copy_of

    def spy(self, index, end):
        found = real(self, index, end)
        copied.append(found is not None and len(found) == named)
        return found

    monkeypatch.setattr(Stretches, "copy_of", spy)
    replayed = _count_replays(monkeypatch)
    fast = _everything(api.simulate(scenario_from_dict(doc)))
    assert sum(copied) > 0 and sum(replayed) > 0
    monkeypatch.setattr(Stretches, "copy_of", lambda self, index, end: None)
    assert _everything(api.simulate(scenario_from_dict(doc))) == fast


@pytest.mark.parametrize("global_batch, parallel", [(32, dict(tp=8, pp=4, dp=1, sequence_parallel=True)),
                                                    (48, dict(tp=8, pp=2, dp=2, sequence_parallel=True))])
def test_moved_plans_match_overlaps_as_their_check_does(monkeypatch, global_batch, parallel):
    # A record whose overlapped collectives lie in one template part with moved plans (RankState.moved_parts) is
    # matched in the same part of another such copy without its Signals' plans compared one by one: the same
    # results as comparing them, and the shortcut is taken.
    doc = _steady(4, global_batch, **parallel)
    used = []
    real = Stretches._moved_overlaps

    def spy(*args):
        found = real(*args)
        used.append(found is not None)
        return found

    monkeypatch.setattr(Stretches, "_moved_overlaps", staticmethod(spy))
    fast = _everything(api.simulate(scenario_from_dict(doc)))
    assert sum(used) > 0
    monkeypatch.setattr(Stretches, "_overlap_part", lambda self, state, index, overlaps: None)
    assert _everything(api.simulate(scenario_from_dict(doc))) == fast


def test_copy_of_names_copies_parts_and_chains_of_them():
    # Stretches.copy_of: a compiled copy (5 fields), a template copy's part with a tail of Allocs / Frees (3), parts
    # that follow one another with nothing between them (a chain, 4: a tail after its last part too), None where an
    # instruction lies between two parts or the tail is not Allocs and Frees; chain_probes: a run of each later part.
    op = Op("op", "gemm", "fwd")
    run = Run(op, 1.0, 0, 7, 0)
    free = Free((1,), "done")
    compute = [run] * 10 + [free, free, run] + [run] * 5 + [free]
    copies = [(0, 4, "t", 0, 0, ()), (4, 4, "empty", 0, 0, ()), (6, 10, "u", 0, 0, ()), (13, 18, "v", 0, 0, ())]
    key = object()
    stretches = Stretches(copies, [(4, 6, key, ())], compute)
    assert stretches.copy_of(1, 4) == ("t", 1, 0, 0, ())
    assert stretches.copy_of(1, 5) == ("chain", 1, (("t", 0, 0, ()), ("empty", 0, 0, ()), (key,)), 0)
    chain = stretches.copy_of(1, 12)
    assert chain == ("chain", 1, (("t", 0, 0, ()), ("empty", 0, 0, ()), (key,), ("u", 0, 0, ())), 2)
    assert stretches.chain_probes(1, chain) == (3, 5)      # the empty copy has no run to check
    assert stretches.copy_of(1, 13) is None                # a run after the chain: not a tail
    assert stretches.copy_of(7, 12) is None                # a compiled copy alone takes no tail
    assert stretches.copy_of(14, 18) == ("v", 1, 0, 0, ())
    assert stretches.copy_of(14, 19) is None
    assert stretches.chain_probes(14, ("v", 1, 0, 0, ())) == ()


_PHASES = ["fwd", "bwd_input", "bwd_weight", "recompute", "optimizer", "other"]
_span = st.tuples(st.sampled_from(_PHASES + [COMM_PHASE]), st.floats(0, 10), st.floats(0, 1e-3),
                  st.integers(0, 2))


@settings(max_examples=100, deadline=None)
@given(streams=st.lists(st.lists(_span, max_size=30), min_size=1, max_size=3), bounds=st.tuples(st.floats(0, 5),
                                                                                                 st.floats(5, 12)))
def test_column_sums_equal_the_span_loop(streams, bounds):
    columns = []
    for s, spans in enumerate(streams):
        flat: list = []
        for phase, start, duration, iteration in spans:
            if phase == COMM_PHASE:
                info = ((3, f"s{s}", "ar", "all_reduce", COMM_PHASE), (0.0, 1024, iteration))
            else:
                info = Run(Op(f"op.{phase}", "gemm", phase, flops=1e9), duration, iteration)
            flat += (info, start, start + duration)
        columns.append((f"s{s}", log_of(flat)))
    recorded = SpanColumns(3, columns)
    # The columns' sums against the report's loop over the Span objects (a plain list has no phase_sums).
    assert span_sums(recorded, *bounds) == span_sums(list(recorded), *bounds)


def test_columns_make_the_objects():
    op = Op("layer.fc1", "gemm", "fwd", flops=2e9, bytes_read=10, bytes_written=6)
    comm = ((0, "comm", "tp.all_gather", "all_gather", COMM_PHASE), (0.0, 4096, 1))
    spans = SpanColumns(0, [("compute", log_of([Run(op, 1e-3, 1), 0.5, 0.501])), ("comm", log_of([comm, 0.2, 0.3]))])
    assert list(spans) == [Span(0, "compute", "layer.fc1", "gemm", "fwd", 0.5, 0.501, 2e9, 16, 1),
                           Span(0, "comm", "tp.all_gather", "all_gather", COMM_PHASE, 0.2, 0.3, 0.0, 4096, 1)]
    samples = SampleColumns([0.5, 10, 20, (10, 0), 0.6, 0, 20, (0, 0)])
    assert samples == [MemorySample(0.5, 10, 20, (10, 0)), MemorySample(0.6, 0, 20, (0, 0))]
    assert samples[-1].allocated == 0 and len(samples) == 2 and samples == SampleColumns(list(samples.flat))


def _covered_loop(intervals, start_s: float, end_s: float) -> float:
    """The union length as a loop (the engine's numpy version must add the same lengths in the same order)."""
    total, reach = 0.0, -math.inf
    for a, b in sorted(intervals):
        a, b = max(a, start_s, reach), min(b, end_s)
        if b > a:
            total += b - a
        reach = max(reach, b)
    return total


_time = st.floats(0, 100, allow_nan=False)


@settings(max_examples=120, deadline=None)
@given(intervals=st.lists(st.tuples(_time, _time).map(sorted).map(tuple), max_size=40),
       window=st.tuples(_time, _time).map(sorted))
def test_union_length_equals_the_loop(intervals, window):
    log = IntervalLog()
    for start_s, end_s in intervals:
        log.add(start_s, end_s)
    assert log.sorted_pairs().tolist() == [list(pair) for pair in sorted(intervals)]
    for start_s, end_s in (window, (-math.inf, math.inf)):
        assert covered(log.sorted_pairs(), start_s, end_s) == _covered_loop(intervals, start_s, end_s)
