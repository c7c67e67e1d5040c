"""The discrete-event executor: one simpy process per (rank, stream) running its instruction list."""

from __future__ import annotations

import heapq
from heapq import heappush
from typing import TYPE_CHECKING

import simpy
import simpy.core
from simpy.core import NORMAL

from simulator import lifetime
from simulator.engine import memory_worker
from simulator.engine.allocator import Allocator
from simulator.engine.logs import PHASE_CODES, IntervalLog
from simulator.engine.memory_log import (ALLOC, BOUNDARY, COLL_ALLOC, FREE, MEASURE, RECV_ALLOC,
                                         RUN_FREE, SENT_FREE, TRANSFER_ALLOC, TRANSFER_FREE, apply, where)
from simulator.engine.options import EngineOptions  # noqa: F401  (callers import it from here too)
from simulator.engine.results import BlockedInstruction, EngineDeadlock, EngineTrace, collect
from simulator.engine.inline import FOREVER as _FOREVER
from simulator.engine.inline import expose as _expose
from simulator.engine.inline import finish_inline as _finish_inline
from simulator.engine.inline import inline as _inline
from simulator.engine.inline import inline_blocking as _inline_blocking
from simulator.engine.inline import overlap as _overlap
from simulator.engine.inline import record_comm as _record_comm
from simulator.engine.inline import record_inline as _record_inline
from simulator.engine.rank_state import COMPUTE_STREAM, RankState, follows_send
from simulator.engine.stretches import Stretches
from simulator.errors import PlanError, TopologyError
from simulator.parallel.program import (Alloc, Blocking, Collective, Free, HostAlloc, HostFree, Mark, Period,
                                        Program, Recv, Run, Send, Signal, Transfer, WaitFor)

if TYPE_CHECKING:
    from simulator.engine.network_model import NetworkModel
    from simulator.network.topology import Topology
    from simulator.parallel.plan import ParallelPlan



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
                 plan: ParallelPlan | None, isolate: bool = True, quiet: bool = False):
        self.env = env
        self.isolate = isolate
        self.quiet = quiet
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
                                         isolate=self.isolate, quiet=self.quiet)
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
            program = state.program
            state.stretches = Stretches(program.copies, program.blocks.get(COMPUTE_STREAM, ()),
                                        program.streams.get(COMPUTE_STREAM, ()))
    world = _World(env, programs, topology, plan if options.shadow_traffic else None,
                   options.isolated_collectives, options.quiet_collectives)
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
    timer = simpy.Event(env)       # this stream's own timer (the Run path's env.at), pushed only when waited for
    timer._ok, timer._value = True, None
    queue, eids = env._queue, env._eid
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
                    # env.at(now) without a new Event: this stream's own timer, out of the queue whenever it runs
                    timer.callbacks = []
                    heappush(queue, (now, NORMAL, next(eids), timer))
                    yield timer
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
            if stream != COMPUTE_STREAM and follows_send(instructions, index - 1):
                # placed by its time: a compute stream running ahead (RankState.quiet) may have logged later calls
                log.add_sent_free(stream_word | (index - 1) << 12 | SENT_FREE, now)
            else:
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
