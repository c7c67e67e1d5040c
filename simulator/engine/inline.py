"""Collectives the compute stream runs itself, when nothing can interleave with them (exact): waited for at once
(`inline`, `inline_blocking`), or beside a few of its runs (`overlap`); and what a finished transfer records."""

from __future__ import annotations

from typing import TYPE_CHECKING

from simulator.engine.logs import PHASE_CODES, IntervalLog
from simulator.engine.memory_log import COLL_ALLOC, COLL_FREE, RUN_FREE, where
from simulator.engine.rank_state import COMPUTE_STREAM
from simulator.parallel.program import Collective

if TYPE_CHECKING:
    from simulator.engine.rank_state import RankState

FOREVER = float("inf")


def inline(state: RankState, world, plan: tuple[str, int], ready: str, now_s: float) -> float | None:
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


def overlap(state: RankState, world, instructions, index: int, now_s: float, limit_s: float,
             record_spans: bool) -> tuple[int, float] | None:
    """Run the compute stream's Signal(ready) at `index`, the runs after it and its WaitFor(done), and the collective
    its stream S posts between them (RankState.overlap_plans), if exact; returns (next index, clock), or None
    (nothing done).

    S waits at S[k] = WaitFor(ready), posts S[k+1] (it allocates and frees nothing) and signals done; compute runs
    the runs meanwhile and then waits for done. When S stands at k (as `inline` needs it), the collective may run
    inline (link-isolated, this rank its only simulated member, no shadow started) and the clock at the WaitFor
    stays below `limit_s` (the next scheduled event, or forever while the rank is quiet), nothing can interleave:
    S's collective starts at the Signal's time and lasts its isolated duration, exactly as the network model times
    it, its span and intervals are recorded, S is parked as `inline` parks it, the runs are run as the general loop
    runs them, and the WaitFor ends at max(clock, end), exposing what `expose` finds of S's transfer."""
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
    record_comm(state, name, collective, 0, now_s, end, record_spans)      # (it frees nothing)
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
        expose(state, name, now, final)
    return index + gap + 1, final


def finish_inline(state: RankState, plan: tuple[str, int], start_s: float, end_s: float,
                   record_spans: bool) -> None:
    """At the inlined collective's end, in the normal path's order: its stream's intervals, span and frees,
    then the compute stream's exposure; a stream with nothing left is woken to finish."""
    name, k = plan
    record_inline(state, name, state.program.streams[name][k + 1], where(state.stream_ids[name], k + 1), start_s,
                   end_s, record_spans)
    if state.cursor[name] >= len(state.program.streams[name]):
        state.release(name, end_s)


def inline_blocking(state: RankState, world, collective, name: str, index: int,
                     now_s: float) -> float | None:
    """Run a Blocking collective inline if exact, as `inline` does: its stream has nothing outstanding by
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


def record_comm(state: RankState, stream: str, instruction, at: int, start_s: float, end_s: float,
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


def record_inline(state: RankState, name: str, collective, at: int, start_s: float, end_s: float,
                   record_spans: bool) -> None:
    """An inlined collective's end, in the normal path's order: its stream's intervals, span and frees, then the
    compute stream's exposure."""
    record_comm(state, name, collective, at, start_s, end_s, record_spans)
    if end_s > start_s:
        state.exposed_intervals.add(start_s, end_s)     # the compute stream waited all along


def expose(state: RankState, signaller: str, waited_from_s: float, now_s: float) -> None:
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
