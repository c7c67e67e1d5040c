"""The discrete-event executor: one simpy process per (rank, stream) running its instruction list."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import simpy
import simpy.core

from simulator import lifetime
from simulator.engine import memory_worker
from simulator.engine.allocator import Allocator
from simulator.engine.logs import PHASE_CODES, IntervalLog
from simulator.engine.memory_log import (ALLOC, BOUNDARY, COLL_ALLOC, COLL_FREE, FREE, MEASURE, RECV_ALLOC,
                                         RUN_FREE, TRANSFER_ALLOC, TRANSFER_FREE, apply, where)
from simulator.engine.options import EngineOptions  # noqa: F401  (callers import it from here too)
from simulator.engine.results import BlockedInstruction, EngineDeadlock, EngineTrace, collect
from simulator.engine.rank_state import COMPUTE_STREAM, RankState
from simulator.engine.stretches import Stretches
from simulator.errors import PlanError, TopologyError
from simulator.parallel.program import (Alloc, Blocking, Collective, Free, HostAlloc, HostFree, Mark, Period,
                                        Program, Recv, Run, Send, Signal, Transfer, WaitFor)

if TYPE_CHECKING:
    from simulator.engine.network_model import NetworkModel
    from simulator.network.topology import Topology
    from simulator.parallel.plan import ParallelPlan



_FOREVER = float("inf")


class _Environment(simpy.Environment):
    """simpy's Environment plus events at an absolute time (streams may run their clocks ahead of env.now)."""

    def at(self, time_s: float) -> simpy.Event:
        """An event that fires at exactly `time_s` (>= now); a timeout would add the delay to now and round."""
        event = simpy.Event(self)
        self.trigger_at(event, time_s)
        return event

    def trigger_at(self, event: simpy.Event, time_s: float) -> None:
        """Succeed `event` at exactly `time_s` (>= now), ordered like `event.succeed()` called at that time."""
        event._ok = True
        event._value = None
        heapq.heappush(self._queue, (time_s, simpy.core.NORMAL, next(self._eid), event))


class _World:
    """What all ranks share: the clock and, created on first use, the network model."""

    def __init__(self, env: simpy.Environment, programs: list[Program], topology: Topology | None,
                 plan: ParallelPlan | None, isolate: bool = True):
        self.env = env
        self.isolate = isolate
        self.programs = programs
        self.ranks = tuple(p.rank for p in programs)
        self.topology = topology
        self.plan = plan
        self._network: NetworkModel | None = None

    def network(self, rank: int, instruction) -> NetworkModel:
        if self._network is None:
            if self.topology is None:
                raise TopologyError(f"rank {rank} posts {type(instruction).__name__.lower()} "
                                    f"{instruction.name!r}: topology = None; communication needs a topology")
            from simulator.engine.network_model import NetworkModel
            self._network = NetworkModel(self.env, self.topology, self.ranks, self.plan, self.programs,
                                         isolate=self.isolate)
        return self._network

    @property
    def network_model(self) -> NetworkModel | None:
        return self._network


def simulate_programs(programs: list[Program], allocators: list[Allocator],
                      capacities: list[int], options: EngineOptions = EngineOptions(),
                      topology: Topology | None = None, plan: ParallelPlan | None = None) -> EngineTrace:
    """Run every rank's streams to completion; returns the trace with each rank's communication.

    Args:
        programs: one per simulated rank (global rank r runs on GPU r of `topology`).
        allocators: one allocator model per program.
        capacities: device memory per program, bytes.
        options: recording knobs.
        topology: the cluster; needed as soon as a program holds a Collective, Send or Recv.
        plan: the parallel plan; with it, ranks not simulated (symmetry) load the network like their
            representatives (see simulator/engine/network_model.py).

    Raises:
        EngineDeadlock: (a DeadlockError) streams blocked forever; lists every blocked (rank, stream,
            instruction) with what it waits for: an event, a peer's send/recv, members of a collective.
    """
    env = _Environment()
    states = [RankState(p, a, c, options, env) for p, a, c in zip(programs, allocators, capacities)]
    if options.stretches:
        for state in states:
            state.stretches = Stretches(state.program.copies)
    world = _World(env, programs, topology, plan if options.shadow_traffic else None,
                   options.isolated_collectives)
    finished: list[str] = []
    for state in states:
        for stream, instructions in state.program.streams.items():
            env.process(_stream_process(env, state, stream, instructions, options, finished, world))
    sizes = [sum(map(len, program.streams.values())) for program in programs]     # instructions per rank
    count = memory_worker.workers_for(options.memory_workers, sum(sizes), len(states))
    worker = memory_worker.MemoryWorkers(states, sizes, count) if count else None
    try:
        env.run()
        expected = sum(len(s.program.streams) for s in states)
        if len(finished) != expected and not any(s.failed for s in states):
            blocked = tuple(_blocked(s, stream) for s in states for stream in sorted(s.blocked))
            raise EngineDeadlock("simulation deadlocked: " + "; ".join(str(b) for b in blocked), blocked)
        if worker is not None:
            outcomes = worker.finish()
        else:
            outcomes = []
            for state in states:
                apply(state.memory, state.program, *state.log.take())
                outcomes.append(state.memory.outcome())
    finally:
        if worker is not None:
            worker.close()
    lifetime.keep(states, world, env)
    return collect(states, outcomes, env.now)


def _blocked(state: RankState, stream: str) -> BlockedInstruction:
    index, instruction, why = state.blocked[stream]
    cursor = state.cursor.get(stream)
    if cursor is not None and cursor < len(state.program.streams[stream]):
        # parked after inlined collectives: it really waits at its cursor
        index, instruction, why = cursor, state.program.streams[stream][cursor], None
    if isinstance(instruction, WaitFor):
        text, reason = f"WaitFor({instruction.event!r})", f"waiting for {instruction.event}"
    elif isinstance(instruction, Blocking):
        text = f"Blocking(Collective({instruction.collective.name!r}) on {instruction.stream})"
        reason = why.reason or "in progress"
    else:
        text = f"{type(instruction).__name__}({instruction.name!r})"
        reason = why.reason or "in progress"
    return BlockedInstruction(state.program.rank, stream, index, text, reason)


def _stream_process(env: _Environment, state: RankState, stream: str, instructions, options: EngineOptions,
                    finished: list[str], world: _World):
    """Run one stream's instructions.

    The stream keeps its own clock `now`. After a resume that wakes only this stream (its own timer, an
    event no other stream waits for), a compute op that ends before the next scheduled simpy event cannot
    be interleaved with anything else, so it is run without yielding and the clock moves ahead of
    env.now; every memory event, span and mark still gets its exact time. The stream yields (to an event
    at exactly `now`) before anything that other streams or the network can observe at env.now.
    """
    # Memory calls are logged, made later (engine/memory_log.py): a word is stream_word | index << 12 | code
    # (12: memory_log.INDEX_SHIFT, written out on the hot paths).
    log = state.log
    log_word, log_time = log.words.append, log.times.append
    flush_log = state.flush_log
    stream_word = where(state.stream_ids[stream], 0)
    rank = state.program.rank
    record_spans = options.record_spans
    spans = state.spans[stream]
    span_info, span_start, span_end, span_phase = \
        spans.infos.append, spans.starts.append, spans.ends.append, spans.phases.append
    phase_codes = PHASE_CODES
    peek = env.peek
    lookahead = options.run_ahead and options.rank_lookahead and stream == COMPUTE_STREAM
    quiet = None         # state.quiet() while nothing else has run (None: not known)

    def may_go_on() -> bool:
        """Whether the compute stream may run past the next scheduled event (its rank's other streams are
        quiet: EngineOptions.rank_lookahead)."""
        nonlocal quiet
        if not (lookahead and own):
            return False
        if quiet is None:
            quiet = state.quiet()
        return quiet

    state.started.add(stream)
    handoff = state.handoffs.pop(stream, None)
    if handoff is not None:      # a Blocking collective the compute stream reached before this stream started
        yield from _post_blocking(env, state, world, *handoff, record_spans)
    waiters = state.waiters
    now = env.now
    own = options.run_ahead    # the last resume woke this stream alone: nothing else runs before peek()
    ahead = options.run_ahead
    inline_plans = state.inline_plans if stream == COMPUTE_STREAM else {}
    overlap_plans = state.overlap_plans if stream == COMPUTE_STREAM else {}
    count = len(instructions)
    index = 0
    while index < count:
        instruction = instructions[index]
        index += 1
        if state.failed:
            return
        kind = type(instruction)
        if kind is Run:
            if lookahead and own and may_go_on():
                # Nothing can make this stream yield before its next instruction that is neither a run nor an
                # inlined collective: run that stretch in a tight loop (the same steps as below, in order).
                index, now = _run_stretch(state, world, instructions, index - 1, now, record_spans)
                continue
            op = instruction.op
            start = now
            if op.allocs:
                log_word(stream_word | (index - 1) << 12)       # RUN_ALLOC
                log_time(start)
            duration = instruction.duration_s
            if duration > 0:
                now = start + duration
                if (not own or now >= peek()) and not may_go_on():
                    yield env.at(now)
                    own = ahead
                    quiet = None
            if record_spans:                            # engine/timelines.py makes the Span when read
                span_info(instruction)
                span_start(start)
                span_end(now)
                span_phase(phase_codes[op.phase])
            if op.frees:
                log_word(stream_word | (index - 1) << 12 | RUN_FREE)
                log_time(now)
        elif kind is Alloc:
            log.add(stream_word | (index - 1) << 12 | ALLOC, now)
        elif kind is Free:
            log.add(stream_word | (index - 1) << 12 | FREE, now)
        elif kind is Signal or kind is Blocking:
            # A blocking collective runs inline: a Blocking one, or the Collective after a Signal with a plan.
            if kind is Blocking:
                collective, name = instruction
                _check_stream(state, collective, name, stream)
                plan, inline = None, state.inline_collectives
            else:
                plan = inline_plans.get(instruction.event)
                inline = plan is not None
                if not inline and own and instruction.event in overlap_plans:
                    done = _overlap(state, world, instructions, index - 1, now,
                                    _FOREVER if may_go_on() else peek(), record_spans)
                    if done is not None:
                        index, now = done
                        continue
            if inline and own and (now < peek() or may_go_on()):
                start = now
                end = _inline_blocking(state, world, collective, name, index - 1, now) if plan is None \
                    else _inline(state, world, plan, instruction.event, now)
                if end is not None:
                    if plan is not None:
                        index += 1            # the WaitFor(done) that follows: done at `end`
                    if end > now:
                        now = end
                        if (not own or now >= peek()) and not may_go_on():
                            yield env.at(now)
                            own = ahead
                            quiet = None
                    if plan is None:
                        _record_inline(state, name, collective, stream_word | (index - 1) << 12, start, now,
                                       record_spans)
                    else:
                        _finish_inline(state, plan, start, now, record_spans)
                    continue
            quiet = None          # a stream it wakes may have work
            if kind is Blocking:
                # Signal(ready) -> `name` posts it and at its end signals done -> compute: the same simpy steps.
                # An idle stream waits at a WaitFor, so it would wake at an event triggered now: the compute
                # stream goes on there in its place; one not started yet does it at its first step (handoff).
                waited_from = now
                resume = env.event()
                state.blocked[stream] = (index - 1, instruction, None)
                if name in state.started:
                    yield env.at(now)
                    yield from _post_blocking(env, state, world, instruction, index - 1, resume, record_spans)
                else:
                    state.handoffs[name] = (instruction, index - 1, resume)
                yield resume
                now = max(now, env.now)
                own = ahead
                quiet = None
                state.blocked.pop(stream, None)
                if now > waited_from:
                    _expose(state, name, waited_from, now)
                continue
            target = state.wait_stream.get(instruction.event)
            if target is not None and target in state.parked:
                state.release(target, now)
            event = state.event(instruction.event)
            if not event.triggered:
                if stream in state.comm_streams:
                    state.comm_signalled[instruction.event] = stream
                env.trigger_at(event, now)
                state.signal_time[instruction.event] = now
        elif kind is WaitFor:
            event = state.event(instruction.event)
            # A stream running ahead may have signalled it for a time after this stream's clock.
            if not event.triggered or state.signal_time.get(instruction.event, now) > now:
                state.blocked[stream] = (index - 1, instruction, None)
                waited_from = now
                yield event
                now = max(now, env.now)     # with lookahead the event may have fired before this clock
                own = ahead and waiters.get(instruction.event, 0) <= 1
                quiet = None
                state.blocked.pop(stream, None)
                jump = state.cursor.pop(stream, None)
                if jump is not None:      # the compute stream ran instructions of this stream inline
                    index = jump
                    continue
                signaller = state.comm_signalled.get(instruction.event)
                if stream == COMPUTE_STREAM and signaller is not None and now > waited_from:
                    _expose(state, signaller, waited_from, now)
        elif kind is Period:
            log.add(stream_word | (index - 1) << 12 | BOUNDARY, now)
            if flush_log is not None:
                flush_log()               # send the log to the memory worker when it is long enough
        elif kind is Mark:
            if instruction.label == "measure":
                log.add(stream_word | (index - 1) << 12 | MEASURE, now)
            state.marks.append((instruction.label, instruction.iteration, now))
        elif kind is Transfer:
            if now > env.now:
                yield env.at(now)     # the network model works at env.now
                quiet = None
            yield from _transfer(env, state, world, stream, instruction, index - 1, stream_word | (index - 1) << 12,
                                 record_spans)
            now = env.now
            own = ahead
            quiet = None
        elif kind is HostAlloc or kind is HostFree:
            state.host_events.append((now, 1 if kind is HostAlloc else -1, instruction.tensors))
        elif kind is Collective or kind is Send or kind is Recv:
            if now > env.now:
                yield env.at(now)     # the network model works at env.now
                quiet = None
            state.comm_streams[stream] = None
            if kind is Collective:
                if instruction.allocs:
                    log.add(stream_word | (index - 1) << 12 | COLL_ALLOC, now)
            elif kind is Recv and instruction.allocs:
                log.add(stream_word | (index - 1) << 12 | RECV_ALLOC, now)
            network = world.network(rank, instruction)
            if kind is Collective:
                pending = network.collective(rank, instruction)
            elif kind is Send:
                pending = network.send(rank, instruction)
            else:
                pending = network.recv(rank, instruction)
            if not pending.done.triggered:
                state.blocked[stream] = (index - 1, instruction, pending)
            yield pending.done
            now = env.now
            own = ahead    # a posted instruction's completion wakes only its own stream
            quiet = None
            state.blocked.pop(stream, None)
            started = pending.start_s
            _record_comm(state, stream, instruction, stream_word | (index - 1) << 12, started, now, record_spans)
            if stream == COMPUTE_STREAM and now > started:
                state.exposed_intervals.add(started, now)
    for parked in list(state.parked) if stream == COMPUTE_STREAM else ():
        state.release(parked, now)
    if now > env.now:
        yield env.at(now)        # the simulation ends when the last stream's clock does
    finished.append(stream)
    state.done.add(stream)


def _run_stretch(state: RankState, world: _World, instructions, index: int, now_s: float,
                 record_spans: bool) -> tuple[int, float]:
    """Run the compute stream's instructions from `index` (a Run) while they are runs or collectives it can
    inline; returns the index of the first one it did not run and the clock. The caller checked that the
    stream woke alone and its rank is quiet (EngineOptions.rank_lookahead), which stays true throughout: a run
    or an inlined collective wakes nobody, so the general loop would not yield in between either."""
    stretches = state.stretches
    watched = None
    if stretches is not None:
        done = stretches.replay(state, world.network_model, instructions, index, now_s)
        if done is not None:
            return done
        watched = stretches.watch(state, world.network_model, instructions, index, now_s)
    log = state.log
    log_word, log_time = log.words.append, log.times.append
    compute_word = where(state.stream_ids[COMPUTE_STREAM], 0)
    spans = state.spans[COMPUTE_STREAM]
    span_info, span_start, span_end, span_phase = \
        spans.infos.append, spans.starts.append, spans.ends.append, spans.phases.append
    phase_codes = PHASE_CODES
    inline_plans = state.inline_plans
    overlap_plans = state.overlap_plans
    count = len(instructions)
    now = now_s
    while index < count:
        instruction = instructions[index]
        kind = type(instruction)
        if kind is Run:
            index += 1
            op = instruction.op
            start = now
            if op.allocs:
                log_word(compute_word | (index - 1) << 12)       # RUN_ALLOC
                log_time(start)
            duration = instruction.duration_s
            if duration > 0:
                now = start + duration
            if record_spans:
                span_info(instruction)
                span_start(start)
                span_end(now)
                span_phase(phase_codes[op.phase])
            if op.frees:
                log_word(compute_word | (index - 1) << 12 | RUN_FREE)
                log_time(now)
        elif kind is Alloc or kind is Free:
            index += 1
            log_word(compute_word | (index - 1) << 12 | (ALLOC if kind is Alloc else FREE))
            log_time(now)
        elif kind is Signal:
            plan = inline_plans.get(instruction.event)
            if plan is None:
                if instruction.event not in overlap_plans:
                    break
                done = _overlap(state, world, instructions, index, now, _FOREVER, record_spans)
                if done is None:
                    break
                index, now = done
                continue
            end = _inline(state, world, plan, instruction.event, now)
            if end is None:
                break
            index += 2                # the Signal and the WaitFor(done) that follows
            start = now
            if end > now:
                now = end
            _finish_inline(state, plan, start, now, record_spans)
        elif kind is Blocking:
            if not state.inline_collectives:
                break
            collective, name = instruction
            end = _inline_blocking(state, world, collective, name, index, now)
            if end is None:
                break
            start = now
            if end > now:
                now = end
            _record_inline(state, name, collective, compute_word | index << 12, start, now, record_spans)
            index += 1
        else:
            break
    if watched is not None:
        stretches.learn(watched, state, world.network_model, instructions, index, now)
    return index, now


def _inline(state: RankState, world: _World, plan: tuple[str, int], ready: str, now_s: float) -> float | None:
    """Run the collective of `plan` from the compute stream, as its own stream would, if that is exact.

    The compute stream signals `ready` to stream S waiting at S[k] = WaitFor(ready), S[k+1] is a Collective
    and S[k+2] signals the event compute waits for next. When S is idle at k (blocked there, or parked by an
    earlier inline at cursor k), nothing else is scheduled at `now_s` (checked by the caller) and the network
    model says the collective is link-isolated with this rank its only simulated member and no shadow
    started, the collective's allocations, span, communication and exposure intervals are exactly those of
    the normal path, so they are recorded here and S is parked (its process sleeps until an instruction of
    it is needed, then jumps to its cursor). Returns the end time, or None (nothing done) when not exact.
    """
    name, k = plan
    if not state.can_inline(name, k, ready):
        return None
    collective = state.program.streams[name][k + 1]
    rank = state.program.rank
    duration = world.network(rank, collective).inline_duration_s(rank, collective)
    if duration is None:
        return None
    if name not in state.cursor:
        state.parked[name] = ready
    state.cursor[name] = k + 3
    state.comm_streams[name] = None
    if collective.allocs:
        state.log.add(where(state.stream_ids[name], k + 1) | COLL_ALLOC, now_s)
    return now_s + duration


def _overlap(state: RankState, world: _World, instructions, index: int, now_s: float, limit_s: float,
             record_spans: bool) -> tuple[int, float] | None:
    """Run the compute stream's Signal(ready) at `index`, the runs after it and its WaitFor(done), and the collective
    its stream S posts between them (RankState.overlap_plans), if exact; returns (next index, clock), or None
    (nothing done).

    S waits at S[k] = WaitFor(ready), posts S[k+1] (it allocates and frees nothing) and signals done; compute runs
    the runs meanwhile and then waits for done. When S stands at k (as _inline needs it), the collective may run
    inline (link-isolated, this rank its only simulated member, no shadow started) and the clock at the WaitFor
    stays below `limit_s` (the next scheduled event, or forever while the rank is quiet), nothing can interleave:
    S's collective starts at the Signal's time and lasts its isolated duration, exactly as the network model times
    it, its span and intervals are recorded, S is parked as _inline parks it, the runs are run as the general loop
    runs them, and the WaitFor ends at max(clock, end), exposing what _expose finds of S's transfer."""
    signal = instructions[index]
    name, k, gap, collective = state.overlap_plans[signal.event]
    if not state.can_inline(name, k, signal.event):
        return None
    rank = state.program.rank
    network = world.network(rank, collective)
    known = network.inline_answer(rank, collective)
    if not known:
        return None
    runs = instructions[index + 1:index + gap]
    clock = now_s
    for run in runs:
        duration = run.duration_s
        if duration > 0:
            clock = clock + duration
    end = now_s + known[0]
    final = max(clock, end)
    if final >= limit_s:
        return None
    network.isolated_operations += 1
    network.shadows_dropped += known[1]
    if name not in state.cursor:
        state.parked[name] = signal.event
    state.cursor[name] = k + 3
    state.comm_streams[name] = None
    _record_comm(state, name, collective, 0, now_s, end, record_spans)      # (it frees nothing)
    log = state.log
    log_word, log_time = log.words.append, log.times.append
    compute_word = where(state.stream_ids[COMPUTE_STREAM], 0)
    spans = state.spans[COMPUTE_STREAM]
    now = now_s
    for position, run in enumerate(runs, index + 1):
        op = run.op
        start = now
        if op.allocs:
            log_word(compute_word | position << 12)       # RUN_ALLOC
            log_time(start)
        duration = run.duration_s
        if duration > 0:
            now = start + duration
        if record_spans:
            spans.infos.append(run)
            spans.starts.append(start)
            spans.ends.append(now)
            spans.phases.append(PHASE_CODES[op.phase])
        if op.frees:
            log_word(compute_word | position << 12 | RUN_FREE)
            log_time(now)
    if final > now:
        _expose(state, name, now, final)
    return index + gap + 1, final


def _finish_inline(state: RankState, plan: tuple[str, int], start_s: float, end_s: float,
                   record_spans: bool) -> None:
    """At the inlined collective's end, in the normal path's order: its stream's intervals, span and frees,
    then the compute stream's exposure; a stream with nothing left is woken to finish."""
    name, k = plan
    _record_inline(state, name, state.program.streams[name][k + 1], where(state.stream_ids[name], k + 1), start_s,
                   end_s, record_spans)
    if state.cursor[name] >= len(state.program.streams[name]):
        state.release(name, end_s)


def _post_blocking(env: _Environment, state: RankState, world: _World, instruction: Blocking, index: int,
                   resume: simpy.Event, record_spans: bool):
    """What stream `instruction.stream` does for a Blocking collective that is not inlined, at the step where it
    would: post it, at its end record its intervals, span and frees, and trigger `resume` (its Signal(done))."""
    collective, name = instruction
    rank = state.program.rank
    state.comm_streams[name] = None
    at = where(state.stream_ids[COMPUTE_STREAM], index)       # the memory calls name the Blocking instruction
    if collective.allocs:
        state.log.add(at | COLL_ALLOC, env.now)
    pending = world.network(rank, collective).collective(rank, collective)
    state.blocked[COMPUTE_STREAM] = (index, instruction, pending)
    yield pending.done
    _record_comm(state, name, collective, at, pending.start_s, env.now, record_spans)
    env.trigger_at(resume, env.now)


def _check_stream(state: RankState, collective, name: str, waiter: str) -> None:
    """A Blocking collective is the compute stream's, and its stream one of its program's."""
    if waiter != COMPUTE_STREAM:
        raise PlanError(f"rank {state.program.rank}: Blocking collective {collective.name!r} on stream {waiter!r}: "
                        f"only the {COMPUTE_STREAM} stream runs Blocking instructions")
    if name not in state.spans:
        raise PlanError(f"rank {state.program.rank}: Blocking collective {collective.name!r} on stream {name!r}, "
                        f"which its program does not have (streams: {', '.join(state.spans)})")


def _inline_blocking(state: RankState, world: _World, collective, name: str, index: int,
                     now_s: float) -> float | None:
    """Run a Blocking collective inline if exact, as _inline does: its stream has nothing outstanding by
    construction, so only its having started (reached its first wait, as can_inline asks) and the network's
    condition remain (an absent stream never starts: the Blocking branch reports it); returns the end time, or
    None. `index`: the Blocking instruction's, in the compute stream."""
    if name not in state.started:
        return None
    rank = state.program.rank
    duration = world.network(rank, collective).inline_duration_s(rank, collective)
    if duration is None:
        return None
    state.comm_streams[name] = None
    if collective.allocs:
        state.log.add(where(state.stream_ids[COMPUTE_STREAM], index) | COLL_ALLOC, now_s)
    return now_s + duration


def _record_comm(state: RankState, stream: str, instruction, at: int, start_s: float, end_s: float,
                 record_spans: bool) -> None:
    """A transfer of `stream` that ended: its communication interval, its span (the instruction is its info:
    engine/timelines.py) and a collective's frees (`at`: the memory log's word of the instruction that posted it)."""
    if end_s > start_s:
        state.comm_intervals.add(start_s, end_s)
        transfers = state.stream_transfers.get(stream)
        if transfers is None:
            transfers = state.stream_transfers[stream] = IntervalLog()
        transfers.add(start_s, end_s)
    if record_spans:
        state.spans[stream].add_comm(instruction, start_s, end_s)
    if type(instruction) is Collective and instruction.frees:
        state.log.add(at | COLL_FREE, end_s)


def _record_inline(state: RankState, name: str, collective, at: int, start_s: float, end_s: float,
                   record_spans: bool) -> None:
    """An inlined collective's end, in the normal path's order: its stream's intervals, span and frees, then the
    compute stream's exposure."""
    _record_comm(state, name, collective, at, start_s, end_s, record_spans)
    if end_s > start_s:
        state.exposed_intervals.add(start_s, end_s)     # the compute stream waited all along


def _expose(state: RankState, signaller: str, waited_from_s: float, now_s: float) -> None:
    """Count the part of a compute-stream wait during which the signalling stream was transferring (exposed
    communication, or exposed offload when the stream is one that posts offload transfers)."""
    transfers = state.stream_transfers.get(signaller)
    if transfers is None:
        return
    exposed = state.offload_exposed if signaller in state.offload_streams else state.exposed_intervals
    for start_s, end_s in zip(reversed(transfers.starts), reversed(transfers.ends)):   # sequential per stream
        if end_s <= waited_from_s:
            break
        a, b = max(start_s, waited_from_s), min(end_s, now_s)
        if b > a:
            exposed.add(a, b)


def _transfer(env: _Environment, state: RankState, world: _World, stream: str, instruction: Transfer, index: int,
              at: int, record_spans: bool):
    """Run an offload transfer of `stream` at env.now: its allocations, its flows, then its frees; its time is offload
    traffic (host compute for route "host"), exposed while the compute stream runs it itself."""
    now = env.now
    state.comm_streams[stream] = None            # compute waits on its signals count as exposure (_expose)
    state.offload_streams[stream] = None
    if instruction.allocs:
        state.log.add(at | TRANSFER_ALLOC, now)
    if instruction.host_allocs:
        state.host_events.append((now, 1, instruction.host_allocs))
    rank = state.program.rank
    pending = world.network(rank, instruction).transfer(rank, instruction)
    if not pending.done.triggered:
        state.blocked[stream] = (index, instruction, pending)
    yield pending.done
    state.blocked.pop(stream, None)
    start_s, end_s = pending.start_s, env.now
    if end_s > start_s:
        (state.host_intervals if instruction.route == "host" else state.offload_intervals).add(start_s, end_s)
        transfers = state.stream_transfers.get(stream)
        if transfers is None:
            transfers = state.stream_transfers[stream] = IntervalLog()
        transfers.add(start_s, end_s)
        if stream == COMPUTE_STREAM:
            state.offload_exposed.add(start_s, end_s)
    if record_spans:
        state.spans[stream].add_comm(instruction, start_s, end_s)
    if instruction.frees:
        state.log.add(at | TRANSFER_FREE, end_s)
    if instruction.host_frees:
        state.host_events.append((end_s, -1, instruction.host_frees))
