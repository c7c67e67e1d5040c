"""Program.blocks (the parts of template copies, parallel/overlap_templates.py): what they list is what the streams
hold, and the engine's set-up and network analysis reading them find what reading every instruction finds
(stretch replay matching by them: tests/test_stretches.py, test_copies_match_as_the_instructions_do)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from simulator.engine.allocator import make_allocator
from simulator.engine.executor import EngineOptions, _Environment
from simulator.engine.network_analysis import _streams_to_scan
from simulator.engine.rank_state import RankState
from simulator.parallel.program import Blocking, Collective, Period, Recv, Send, Signal, Transfer, WaitFor
from tests.test_lowering_compiled import _doc
from tests.test_overlap_templates import CASES, OVERLAPS, _programs

_PROGRAM_CASES = [(case, overlap) for case in CASES for overlap in OVERLAPS[:2]]


def _lowered(case, overlap):
    topology, schedule, recompute, framework, microbatches, parallel = case
    doc = _doc(topology, schedule, recompute, framework, microbatches, **parallel)
    programs = _programs(doc, overlap, parallel.get("dp", 1) > 1)
    assert any(program.blocks for program in programs)       # copies were made from a template
    return programs


@pytest.mark.parametrize("case, overlap", _PROGRAM_CASES,
                         ids=lambda value: getattr(value, "__class__", None) is tuple and f"{value[1]}-{value[5]}"
                         or None)
def test_blocks_list_where_their_signals_and_waits_stand(case, overlap):
    for program in _lowered(case, overlap):
        for name, blocks in program.blocks.items():
            instructions = program.streams[name]
            ends = [0]
            by_key: dict[int, list] = {}
            for start, end, key, sync in blocks:
                assert ends[-1] <= start <= end <= len(instructions)     # in order, disjoint
                ends.append(end)
                part = instructions[start:end]
                assert tuple(i for i, ins in enumerate(part) if type(ins) in (Signal, WaitFor)) == sync
                assert not any(type(ins) is Period for ins in part)
                by_key.setdefault(id(key), []).append(part)
            for parts in by_key.values():      # one key: the same kinds of instructions, collectives alike
                shapes = {tuple((type(ins), _post_key(ins)) for ins in part) for part in parts}
                assert len(shapes) == 1


def _post_key(instruction):
    collective = instruction[0] if type(instruction) is Blocking else instruction
    if type(collective) is not Collective:
        return None
    return (collective.name, collective.kind, collective.group, collective.size_bytes, collective.iteration,
            instruction[1] if type(instruction) is Blocking else None)


@pytest.mark.parametrize("case, overlap", _PROGRAM_CASES,
                         ids=lambda value: getattr(value, "__class__", None) is tuple and f"{value[1]}-{value[5]}"
                         or None)
def test_rank_set_up_with_blocks_finds_what_a_whole_scan_finds(case, overlap):
    def set_up(program):
        state = RankState(program, make_allocator("exact", 1 << 40), 1 << 40, EngineOptions(), _Environment())
        return (state.waiters, state.wait_stream, state.inline_plans, state.overlap_plans,
                state.memory.boundaries_left)

    for program in _lowered(case, overlap):
        assert set_up(program) == set_up(replace(program, copies=(), blocks={}))


def _set_up(program):
    state = RankState(program, make_allocator("exact", 1 << 40), 1 << 40, EngineOptions(), _Environment())
    overlaps = {event: (name, k, gap, id(collective)) for event, (name, k, gap, collective)
                in state.overlap_plans.items()}           # the collective object itself, as a whole scan finds it
    return state, (state.inline_plans, overlaps)


@pytest.mark.parametrize("case, overlap", _PROGRAM_CASES,
                         ids=lambda value: getattr(value, "__class__", None) is tuple and f"{value[1]}-{value[5]}"
                         or None)
def test_inline_plans_moved_from_a_keys_first_copy_equal_planning_each_signal(case, overlap):
    # RankState._plan_blocks plans the first part of each key and moves its plans to the other copies; a program
    # whose other streams' parts are not listed, or listed out of order (so a copy's sibling part is not where the
    # move would look), is planned Signal by Signal: every way, the plans of a whole scan.
    moved, repeated = 0, False
    for program in _lowered(case, overlap):
        state, plans = _set_up(program)
        moved += state.moved_plans
        parts = program.blocks.get("compute", ())
        repeated = repeated or len({id(part[2]) for part in parts}) < len(parts)
        assert plans == _set_up(replace(program, copies=(), blocks={}))[1]
        compute_only = {name: parts for name, parts in program.blocks.items() if name == "compute"}
        assert _set_up(replace(program, blocks=compute_only))[0].moved_plans == 0
        assert plans == _set_up(replace(program, blocks=compute_only))[1]
        swapped = {name: parts if name == "compute" or len(parts) < 3 else (parts[0], parts[2], parts[1], *parts[3:])
                   for name, parts in program.blocks.items()}
        assert plans == _set_up(replace(program, blocks=swapped))[1]
    assert moved > 0 or not repeated


@pytest.mark.parametrize("case, overlap", _PROGRAM_CASES,
                         ids=lambda value: getattr(value, "__class__", None) is tuple and f"{value[1]}-{value[5]}"
                         or None)
def test_network_scan_of_one_part_per_key_finds_every_operation_in_order(case, overlap):
    # NetworkModel._analyze keeps (kind, group, size) and (group, stream) of each communication, first occurrence
    # first: one part per key gives the same, in the same order, as every instruction.
    def keys(parts):
        found = {}
        for stream, instructions in parts:
            for ins in instructions:
                kind = type(ins)
                if kind is Blocking or kind is Collective:
                    collective = ins[0] if kind is Blocking else ins
                    found[(collective.kind, collective.group, collective.size_bytes)] = None
                    found[(collective.group, ins[1] if kind is Blocking else stream)] = None
                elif kind in (Send, Recv, Transfer):
                    found[(kind, ins.peer if kind is not Transfer else ins.route, ins.size_bytes)] = None
        return list(found)

    for program in _lowered(case, overlap):
        scanned = _streams_to_scan(program)
        repeated = any(len({id(block[2]) for block in blocks}) < len(blocks) for blocks in program.blocks.values())
        if repeated:                         # parts of a key seen before are left out
            assert sum(map(len, (part for _, part in scanned))) < sum(map(len, program.streams.values()))
        assert keys(scanned) == keys(program.streams.items())

