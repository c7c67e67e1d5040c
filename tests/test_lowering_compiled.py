"""A micro-batch's instructions made from its op list's compiled form equal lowering it op by op."""

from __future__ import annotations

import re

import pytest

from simulator.parallel.lower_multi import lower_multi
from simulator.parallel.rank_streams import RankStreams
from simulator.parallel.program import Blocking, Collective, Run
from tests.test_stage_copies import _setup


def _doc(topology: str, schedule: str, recompute: str, framework: str, microbatches: int, **parallel) -> dict:
    return {"name": "compiled", "model": {"architecture": "gpt", "num_layers": 8, "hidden_size": 64,
                                          "num_attention_heads": 4, "vocab_size": 512, "seq_length": 32,
                                          "dropout": 0.0},
            "training": {"micro_batch_size": 1, "global_batch_size": microbatches * parallel.get("dp", 1),
                         "precision": "bf16-mixed", "framework": framework, "recompute": recompute},
            "parallel": dict(parallel, schedule=schedule, bucket_size="25 kB"), "cluster": {"topology": topology},
            "run": {"warmup_iterations": 1, "iterations": 1, "record_events": False}}


def _programs(doc: dict, full: bool = False):
    shape, recipe, profile, plan, schedule, device = _setup(doc)
    programs, _ = lower_multi(shape, recipe, profile, plan, schedule, device, 1, 1, full=full)
    return programs


def _identities(programs) -> list[tuple]:
    """Every instruction with the objects it shares named by first appearance: the op of a Run, the tensor
    tuples a copy's collective was moved from, the collective objects themselves (the engine matches replayed
    memory calls by these identities)."""
    names: dict[int, int] = {}
    kept = []        # the objects named, alive until the end

    def name(obj) -> int:
        kept.append(obj)
        return names.setdefault(id(obj), len(names))

    def collective(c: Collective) -> tuple:
        moved = None if c.moved is None else (name(c.moved[0]), name(c.moved[1]), c.moved)
        return name(c), c, moved

    out = []
    for program in programs:
        out.append((program.rank, program.stage, list(program.tensors.items())))
        for stream in sorted(program.streams):
            for ins in program.streams[stream]:
                if type(ins) is Run:
                    out.append((stream, name(ins.op), name(ins.op.allocs), name(ins.op.frees), ins))
                elif type(ins) is Blocking:
                    out.append((stream, ins.stream, collective(ins.collective)))
                elif type(ins) is Collective:
                    out.append((stream, collective(ins)))
                else:
                    out.append((stream, type(ins).__name__, ins))
    return out


CASES = [
    ("pcie-4x4090", "1f1b", "full", "megatron", 8, dict(tp=2, pp=2)),
    ("pcie-4x4090", "1f1b", "none", "torch", 6, dict(pp=4)),
    ("pcie-4x4090", "interleaved-1f1b", "full", "megatron", 8, dict(pp=2, tp=2, virtual_stages=2)),
    ("pcie-4x4090", "interleaved-1f1b", "none", "megatron", 4, dict(pp=4, virtual_stages=2)),
    ("pcie-4x4090", "zb-h1", "full", "megatron", 6, dict(pp=2, tp=2)),
    ("pcie-4x4090", "zb-h1", "none", "torch", 6, dict(pp=4)),
    ("dgx-a100", "1f1b", "full", "megatron", 6, dict(tp=2, pp=2, dp=2)),
    ("dgx-a100", "zb-h1", "selective", "megatron", 6, dict(tp=2, pp=2, dp=2, sequence_parallel=True)),
    ("dgx-a100", "interleaved-1f1b", "full", "torch", 4, dict(tp=2, pp=2, dp=2, virtual_stages=2)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[1]}-{case[2]}-{case[3]}-{case[5]}")
def test_compiled_microbatches_equal_lowering_op_by_op(case, monkeypatch):
    topology, schedule, recompute, framework, microbatches, parallel = case
    doc = _doc(topology, schedule, recompute, framework, microbatches, **parallel)
    full = parallel.get("dp", 1) > 1
    fast = _programs(doc, full)
    compiled = sum(1 for program in fast for ins in program.streams["compute"] if type(ins) is Run and ins.shift)
    assert compiled > 0          # the plans have micro-batch copies, which take the compiled path
    monkeypatch.setattr(RankStreams, "_compile", lambda self, timed, low: None)     # every op list op by op
    slow = _programs(doc, full)
    assert [p.streams for p in fast] == [p.streams for p in slow]
    assert _identities(fast) == _identities(slow)


def test_compiled_path_is_taken_and_keeps_moved_collectives_on_their_template_tuples():
    doc = _doc("pcie-4x4090", "1f1b", "full", "megatron", 8, tp=2, pp=2, sequence_parallel=True)
    programs = _programs(doc)
    moved = [ins.collective for program in programs for ins in program.streams["compute"]
             if type(ins) is Blocking and ins.collective.moved is not None]
    assert moved
    for collective in moved:
        allocs, frees, shift, low = collective.moved
        assert collective.allocs == tuple(v + shift if v >= low else v for v in allocs)
        assert collective.frees == tuple(v + shift if v >= low else v for v in frees)
        assert collective.allocs != allocs or collective.frees != frees


def test_checked_collective_is_the_collective_the_constructor_makes():
    from simulator.parallel.program import checked_collective

    group = (0, 3, 5)
    moved = ((7, 9), (9,), 100, 5)
    fast = checked_collective("tp.all_gather", "all_gather", group, 48.0, (107, 109), (109,), 2, moved)
    slow = Collective("tp.all_gather", "all_gather", group, 48.0, (107, 109), (109,), 2, moved)
    assert type(fast) is Collective
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    assert [getattr(fast, name) for name in Collective.__slots__] == \
        [getattr(slow, name) for name in Collective.__slots__]
    assert fast.moved is moved and fast.group is group
    with pytest.raises(AttributeError):
        fast.allocs = ()                 # frozen like any Collective


@pytest.mark.parametrize("case", CASES[:3] + CASES[6:7], ids=lambda case: f"{case[1]}-{case[5]}")
def test_rank_set_up_outside_copies_finds_what_a_whole_scan_finds(case):
    # RankState looks for waits, signals and periods outside Program.copies (runs and Blocking instructions only).
    from dataclasses import replace

    from simulator.engine.allocator import make_allocator
    from simulator.engine.executor import EngineOptions, _Environment
    from simulator.engine.rank_state import RankState

    topology, schedule, recompute, framework, microbatches, parallel = case
    programs = _programs(_doc(topology, schedule, recompute, framework, microbatches, **parallel))
    assert any(program.copies for program in programs)

    def set_up(program):
        state = RankState(program, make_allocator("exact", 1 << 40), 1 << 40, EngineOptions(), _Environment())
        return (state.waiters, state.wait_stream, state.inline_plans, state.memory.boundaries_left)

    for program in programs:
        compute = program.streams["compute"]
        assert all({type(ins) for ins in compute[start:end]} <= {Run, Blocking} for start, end, *_ in program.copies)
        assert set_up(program) == set_up(replace(program, copies=()))


@pytest.mark.parametrize("peer, size", [(3, 5.0), (0, 0.0), (-1, 5.0), (True, 1.0), (2, float("nan")), (2, -1.0),
                                        ("1", 2.0)])
def test_fast_send_recv_and_free_are_what_the_constructors_make(peer, size):
    from simulator.errors import PlanError
    from simulator.parallel.program import Free, Recv, Send, free, recv, send

    for fast, slow, extra in ((send, Send, ("t", 1)), (recv, Recv, ("t", (4, 5), 1))):
        try:
            expected = slow("x", peer, size, *extra)
        except PlanError as error:
            with pytest.raises(PlanError, match=re.escape(str(error))):
                fast("x", peer, size, *extra)
            continue
        made = fast("x", peer, size, *extra)
        assert type(made) is slow and made == expected and hash(made) == hash(expected)
        assert repr(made) == repr(expected)
        with pytest.raises(AttributeError):
            made.peer = 0                     # frozen like any instance
        fast("x", peer, size, *extra)         # the pair is validated once, then skipped: still the same value
    made = free((1, 2), "r")
    assert type(made) is Free and made == Free((1, 2), "r") and repr(made) == repr(Free((1, 2), "r"))
