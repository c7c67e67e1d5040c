"""The discrete-event executor: one simpy process per (rank, stream) running its instruction list."""

from __future__ import annotations

from dataclasses import dataclass

import simpy

from simulator.engine.allocator import Allocator
from simulator.engine.memory import RankMemory
from simulator.errors import DeadlockError
from simulator.parallel.program import Alloc, Free, Mark, Program, Run, Signal, WaitFor
from simulator.trace.records import RankTrace, Span, Trace
from simulator.workload.graph import CATEGORIES


@dataclass(frozen=True)
class EngineOptions:
    """Knobs of one simulation run."""

    record_timeline: bool = True
    record_spans: bool = True


class _RankState:
    def __init__(self, program: Program, allocator: Allocator, capacity_bytes: int,
                 options: EngineOptions, env: simpy.Environment):
        stream_ids = {name: i for i, name in enumerate(program.streams)}
        self.program = program
        self.memory = RankMemory(allocator, program.tensors, stream_ids, options.record_timeline)
        self.trace = RankTrace(program.rank, program.device, capacity_bytes)
        self.events: dict[str, simpy.Event] = {}
        self.env = env
        self.failed = False
        self.marks: list[tuple[str, int, float]] = []
        self.blocked: dict[str, str] = {}

    def event(self, name: str) -> simpy.Event:
        if name not in self.events:
            self.events[name] = self.env.event()
        return self.events[name]


def simulate_programs(programs: list[Program], allocators: list[Allocator],
                      capacities: list[int], options: EngineOptions = EngineOptions()) -> Trace:
    """Run every rank's streams to completion; returns the Trace (OOM stops the failing rank)."""
    env = simpy.Environment()
    states = [_RankState(p, a, c, options, env) for p, a, c in zip(programs, allocators, capacities)]
    finished: list[str] = []
    for state in states:
        for stream, instructions in state.program.streams.items():
            env.process(_stream_process(env, state, stream, instructions, options, finished))
    env.run()
    expected = sum(len(s.program.streams) for s in states)
    if len(finished) != expected and not any(s.failed for s in states):
        blocked = [f"rank {s.program.rank} stream {stream} waiting for {event}"
                   for s in states for stream, event in sorted(s.blocked.items())]
        raise DeadlockError("simulation deadlocked: " + "; ".join(blocked))
    return _collect(states, env.now)


def _stream_process(env, state: _RankState, stream: str, instructions, options: EngineOptions,
                    finished: list[str]):
    memory = state.memory
    trace = state.trace
    rank = state.program.rank
    record_spans = options.record_spans
    for instruction in instructions:
        if state.failed:
            return
        kind = type(instruction)
        if kind is Run:
            op = instruction.op
            start = env.now
            if op.allocs and not _allocate(state, op.allocs, stream, start, op.name):
                return
            if instruction.duration_s > 0:
                yield env.timeout(instruction.duration_s)
            if record_spans:
                trace.spans.append(Span(rank, stream, op.name, op.op_class, op.phase, start, env.now,
                                        op.flops, op.bytes_read + op.bytes_written,
                                        instruction.iteration))
            if op.frees:
                memory.free(op.frees, env.now, op.name)
        elif kind is Alloc:
            if not _allocate(state, instruction.tensors, stream, env.now, instruction.reason):
                return
        elif kind is Free:
            memory.free(instruction.tensors, env.now, instruction.reason)
        elif kind is Signal:
            event = state.event(instruction.event)
            if not event.triggered:
                event.succeed()
        elif kind is WaitFor:
            event = state.event(instruction.event)
            if not event.triggered:
                state.blocked[stream] = instruction.event
                yield event
                state.blocked.pop(stream, None)
        elif kind is Mark:
            if instruction.label == "measure":
                memory.start_measuring()
            state.marks.append((instruction.label, instruction.iteration, env.now))
    finished.append(stream)


def _allocate(state: _RankState, tensors, stream: str, time_s: float, op: str) -> bool:
    state.memory.allocate(tensors, stream, time_s, op)
    return True


def _collect(states: list[_RankState], end_time_s: float) -> Trace:
    ranks = []
    bounds: list[tuple[float, float]] = []
    for state in states:
        memory = state.memory
        trace = state.trace
        trace.memory = memory.samples
        trace.allocator_events = memory.allocator.events
        trace.final_segments = memory.allocator.segments()
        trace.oom = memory.first_oom
        trace.peak_allocated = max(memory.peak_allocated, 0)
        trace.peak_reserved = memory.peak_reserved
        trace.peak_time_s = memory.peak_time_s
        trace.peak_op = memory.peak_op
        trace.breakdown_at_peak = dict(zip(CATEGORIES, memory.peak_breakdown))
        trace.category_peaks = dict(zip(CATEGORIES, memory.category_peaks))
        ranks.append(trace)
        if not bounds:
            starts = {it: t for label, it, t in state.marks if label == "iteration_start"}
            ends = {it: t for label, it, t in state.marks if label == "iteration_end"}
            bounds = [(starts[i], ends[i]) for i in sorted(starts) if i in ends]
    return Trace(ranks, bounds, end_time_s)
