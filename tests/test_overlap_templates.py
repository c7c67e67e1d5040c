"""Overlapped micro-batch copies made from their template (parallel/overlap_templates.py) equal lowering each one."""

from __future__ import annotations

import pytest

from simulator.parallel.lower_multi import lower_multi
from simulator.parallel.rank_streams import RankStreams
from simulator.parallel.overlap import OverlapOptions
from simulator.parallel.overlap_templates import MARK
from simulator.parallel.program import Blocking, Collective, Run
from tests.test_lowering_compiled import _doc
from tests.test_stage_copies import _setup

OVERLAPS = [OverlapOptions(tp_backward_overlap=True), OverlapOptions(tp_backward_overlap=True, tp_comm_overlap=True),
            OverlapOptions(tp_backward_overlap=True, overlap_grad_reduce=True)]
CASES = [
    ("pcie-4x4090", "1f1b", "full", "megatron", 6, dict(tp=2, pp=2, sequence_parallel=True)),
    ("pcie-4x4090", "interleaved-1f1b", "selective", "megatron", 4,
     dict(tp=2, pp=2, virtual_stages=2, sequence_parallel=True)),
    ("pcie-4x4090", "zb-h1", "none", "megatron", 4, dict(tp=2, pp=2, sequence_parallel=True)),
    ("dgx-a100", "1f1b", "selective", "megatron", 4, dict(tp=2, pp=2, dp=2, sequence_parallel=True)),
]


def _programs(doc: dict, overlap: OverlapOptions, full: bool):
    shape, recipe, profile, plan, schedule, device = _setup(doc)
    programs, _ = lower_multi(shape, recipe, profile, plan, schedule, device, 1, 1, None, full, overlap)
    return programs


@pytest.mark.parametrize("overlap", OVERLAPS, ids=["backward", "comm", "grad-reduce"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[1]}-{case[2]}-{case[5]}")
def test_templated_copies_equal_lowering_each_copy(case, overlap, monkeypatch):
    topology, schedule, recompute, framework, microbatches, parallel = case
    doc = _doc(topology, schedule, recompute, framework, microbatches, **parallel)
    full = parallel.get("dp", 1) > 1
    made = []
    record = RankStreams._templated

    def spy(self, *args):
        done = record(self, *args)
        made.append(done)
        return done

    monkeypatch.setattr(RankStreams, "_templated", spy)
    fast = _programs(doc, overlap, full)
    assert any(made)             # copies were made from a template
    monkeypatch.setattr(RankStreams, "templates_on", False)
    slow = _programs(doc, overlap, full)
    assert [p.streams for p in fast] == [p.streams for p in slow]
    assert _shared(fast) == _shared(slow)


def _shared(programs) -> list:
    """Each Run's op and each collective's `moved` (not compared by ==) with the objects it shares named by first
    appearance: the engine matches replayed memory calls and stretches by these identities. (Collective objects
    themselves are values the engine never compares by identity: a template's copies share the unmoved ones.)"""
    names: dict[int, int] = {}
    kept = []

    def name(obj) -> int:
        kept.append(obj)
        return names.setdefault(id(obj), len(names))

    out = []
    for program in programs:
        for stream in sorted(program.streams):
            for ins in program.streams[stream]:
                if type(ins) is Run:
                    out.append((name(ins.op), name(ins.op.allocs), name(ins.op.frees)))
                elif type(ins) is Blocking or type(ins) is Collective:
                    moved = (ins.collective if type(ins) is Blocking else ins).moved
                    out.append(None if moved is None else (name(moved[0]), name(moved[1]), moved))
    return out



@pytest.mark.parametrize("bulk", [0, 10 ** 9], ids=["all-in-bulk", "all-one-by-one"])
def test_copies_made_in_bulk_or_one_by_one_are_the_same(bulk, monkeypatch):
    # overlap_templates makes a class's instances of a copy in bulk (slot setters) from _BULK of them on, else one
    # by one (program.py's fast constructors): both give the programs lowering each copy gives.
    from simulator.parallel import overlap_templates

    doc = _doc("pcie-4x4090", "1f1b", "full", "megatron", 6, tp=2, pp=2, sequence_parallel=True)
    monkeypatch.setattr(overlap_templates, "_BULK", bulk)
    applied = []
    real = overlap_templates.apply
    monkeypatch.setattr(overlap_templates, "apply", lambda *args: applied.append(real(*args)))
    overlap = OVERLAPS[1]
    fast = _programs(doc, overlap, False)
    assert applied                   # copies were made from a template
    monkeypatch.setattr(RankStreams, "templates_on", False)
    slow = _programs(doc, overlap, False)
    assert [p.streams for p in fast] == [p.streams for p in slow]
    assert _shared(fast) == _shared(slow)


@pytest.mark.parametrize("tuples", [
    [(1, 2), ()],                                                   # none moves
    [(MARK + 3,), (MARK,)],                                         # each one moved id
    [(MARK + 3,), (4,), (), (MARK + 9,)],                           # one-id moved among unmoved
    [(MARK + 3, 4), (MARK + 1,), (5, MARK + 2, MARK + 7), ()],      # any
])
def test_mover_moves_as_ids_does(tuples):
    from simulator.parallel.overlap_templates import _ids, _mover

    mover = _mover(tuples)
    for shift in (0, 17, 1 << 40):
        assert list(mover(shift)) == [_ids(ids, shift) for ids in tuples]
