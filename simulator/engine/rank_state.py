"""One rank's state while the executor runs it: memory, spans, events, blocked and parked streams, quiet test."""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from itertools import chain, compress, repeat
from operator import add, attrgetter, is_, itemgetter
from typing import TYPE_CHECKING, Sequence

import simpy

from simulator.engine.allocator import Allocator
from simulator.engine.logs import IntervalLog, SpanLog
from simulator.engine.memory import RankMemory
from simulator.engine.memory_log import MAX_STREAMS, MemoryLog
from simulator.errors import PlanError
from simulator.parallel.program import Collective, Free, Period, Program, Recv, Run, Send, Signal, Transfer, WaitFor
from simulator.trace.records import RankTrace

if TYPE_CHECKING:
    from simulator.engine.options import EngineOptions

_event_of = attrgetter("event")
COMPUTE_STREAM = "compute"    # waits of this stream on communication are "exposed" communication
MAX_OVERLAPPED_RUNS = 8       # runs between a Signal and the WaitFor of an overlapped inline collective, at most


def _outside(instructions: tuple, copies: tuple, blocks: tuple = ()) -> tuple[Sequence[int], Sequence]:
    """(positions, instructions) of `instructions` but the micro-batch copies `copies` (Program.copies, in order),
    which hold only Run and Blocking instructions (~5% of a pipeline stage's compute stream is outside them), and
    of the template copies' parts `blocks` (Program.blocks) only their Signals and WaitFors."""
    if not copies and not blocks:
        return range(len(instructions)), instructions
    if not blocks:
        starts = [0] + [copy[1] for copy in copies]
        ends = [copy[0] for copy in copies] + [len(instructions)]
        positions = list(chain.from_iterable(map(range, starts, ends)))
        return positions, list(chain.from_iterable(map(instructions.__getitem__, map(slice, starts, ends))))
    positions: list[int] = []
    at = 0
    for start, end, sync in sorted([(copy[0], copy[1], ()) for copy in copies]
                                   + [(block[0], block[1], block[3]) for block in blocks]):
        positions += range(at, start)
        positions += map(add, sync, repeat(start))
        at = end
    positions += range(at, len(instructions))
    if len(positions) < 2:
        return positions, [instructions[i] for i in positions]
    return positions, itemgetter(*positions)(instructions)


def follows_send(instructions, index: int) -> bool:
    """Whether the Free at `index` follows a Send, maybe after other Frees (memory_log.SENT_FREE)."""
    index -= 1
    while index >= 0 and type(instructions[index]) is Free:
        index -= 1
    return index >= 0 and type(instructions[index]) is Send


def _same_shape(shape: list | None, first: list) -> bool:
    """Whether two _loose_shape lists are equal, collectives by identity (a part's moved plans share the objects)."""
    return shape is not None and len(shape) == len(first) and all(
        a is b or (a is not None and b is not None and len(a) == len(b) and a[:3] == b[:3]
                   and (len(a) < 4 or a[3] is b[3])) for a, b in zip(shape, first))


class RankState:
    """One simulated rank while it runs: its memory, trace, events, blocked streams and inline plans."""

    def __init__(self, program: Program, allocator: Allocator, capacity_bytes: int,
                 options: EngineOptions, env: simpy.Environment):
        stream_ids = {name: i for i, name in enumerate(program.streams)}
        if len(stream_ids) > MAX_STREAMS:
            raise PlanError(f"rank {program.rank}: {len(stream_ids)} streams; at most {MAX_STREAMS} are allowed")
        self.program = program
        self.stream_ids = stream_ids
        self.record_spans = options.record_spans
        self.inline_collectives = options.inline_collectives     # Blocking instructions too (executor)
        self.started: set[str] = set()               # streams whose process has begun
        # stream -> (Blocking, its index, resume event): posted by that stream when it starts (executor)
        self.handoffs: dict[str, tuple] = {}
        self.stretches = None                        # a Stretches (engine/stretches.py) when the executor replays them
        self.memory = RankMemory(allocator, program.tensors, stream_ids, options.record_timeline, options.repeats)
        self.log = MemoryLog()                       # its calls, made later (engine/memory_log.py)
        self.flush_log = None                        # sends the log to a memory worker (engine/memory_worker.py)
        self.trace = RankTrace(program.rank, program.device, capacity_bytes)
        self.spans: dict[str, SpanLog] = {name: SpanLog() for name in program.streams}    # per stream, in order
        self.done: set[str] = set()                  # streams that finished
        self.events: dict[str, simpy.Event] = {}
        self.signal_time: dict[str, float] = {}      # event -> when a stream signalled it (maybe ahead of now)
        self.env = env
        self.failed = False
        self.marks: list[tuple[str, int, float]] = []
        self.blocked: dict[str, tuple[int, object, object]] = {}    # stream -> (index, instruction, why)
        self.comm_streams: dict[str, None] = {}
        self.comm_signalled: dict[str, str] = {}     # event -> the communication stream that signalled it
        self.stream_transfers: dict[str, IntervalLog] = {}   # comm stream -> transfer times
        self.comm_intervals = IntervalLog()
        self.exposed_intervals = IntervalLog()
        # Offload (Transfer instructions): the streams that post them, when copies moved bytes, when the host
        # computed, when the compute stream waited for either; host memory calls as (time, +1 | -1, tensor ids).
        self.offload_streams: dict[str, None] = {}
        self.offload_intervals = IntervalLog()
        self.host_intervals = IntervalLog()
        self.offload_exposed = IntervalLog()
        self.host_events: list[tuple[float, int, tuple[int, ...]]] = []
        wait_at: dict[str, dict[str, int]] = {}      # stream -> event -> index of its (last) WaitFor on it
        wait_stream: dict[str, str] = {}             # event -> the (last) stream waiting for it
        signalled: dict[str, dict[str, int] | set[str]] = {}   # stream -> the events it signals (compute: -> first)
        compute_signals: list[int] = []              # indices of the compute stream's Signals
        waited: list[list[str]] = []                 # per stream, the events of its WaitFors
        periods = 0
        for name, instructions in program.streams.items():
            # Only the waits, signals and periods matter here: pick them out at C speed (runs are most of a stream),
            # and none of the compute stream's micro-batch copies (Program.copies: runs and Blocking instructions),
            # of template copies' parts (Program.blocks) only their Signals and WaitFors.
            positions, picked = _outside(instructions, program.copies if name == COMPUTE_STREAM else (),
                                         program.blocks.get(name, ()))
            kinds = list(map(type, picked))
            is_wait = list(map(is_, kinds, repeat(WaitFor)))
            wait_events = list(map(_event_of, compress(picked, is_wait)))
            waited.append(wait_events)
            wait_at[name] = dict(zip(wait_events, compress(positions, is_wait)))
            wait_stream.update(zip(wait_events, repeat(name)))
            periods += kinds.count(Period)
            is_signal = list(map(is_, kinds, repeat(Signal)))
            signal_events = list(map(_event_of, compress(picked, is_signal)))
            if name == COMPUTE_STREAM:
                compute_signals = list(compress(positions, is_signal))
                # event -> its first Signal (reversed: the first one written last)
                signalled[name] = dict(zip(reversed(signal_events), reversed(compute_signals)))
            else:
                signalled[name] = set(signal_events)
        # events waited for twice or more (all streams) -> how many WaitFors; an event waited for once is not listed
        if sum(map(len, waited)) == len(wait_stream):
            self.waiters: dict[str, int] = {}
            shared = ()
        else:
            counts = Counter(chain.from_iterable(waited))
            self.waiters = {event: count for event, count in counts.items() if count > 1}
            shared = list(self.waiters)
        self.memory.boundaries_left = periods
        for event in shared:
            del wait_stream[event]
        self.wait_stream = wait_stream               # events with one WaitFor -> its stream
        # Inline candidates (see engine/inline.py): compute Signal(r) -> (stream S, k) with S[k:k+3] = WaitFor(r),
        # Collective, Signal(d) and the compute stream's next instruction WaitFor(d).
        self.inline_plans: dict[str, tuple[str, int]] = {}
        # Overlapped inline candidates (engine/inline.py, `overlap`): compute Signal(r) at i -> (S, k, j - i) with
        # S[k:k+3] = WaitFor(r), a Collective that allocates and frees nothing, Signal(d), and compute[j] = WaitFor(d)
        # after only runs (the collective runs beside them, as Megatron's overlapped TP backward posts it).
        self.overlap_plans: dict[str, tuple[str, int, int, Collective]] = {}   # (S, k, j - i, S[k + 1])
        self.parked: dict[str, str] = {}             # stream whose instructions compute ran -> event it sleeps on
        self.cursor: dict[str, int] = {}             # such a stream -> index of its next instruction to run
        # (stream, its `blocked` entry) that made quiet() False last: it stays False while that entry stands
        self._loud: tuple | None = None
        # EngineOptions.send_lookahead: quiet() may pass a stream whose Send's Free is still to come (it is logged
        # at its time later: MemoryLog.add_sent_free); `deferring`: the last full quiet() test did (counted).
        self.send_lookahead = options.send_lookahead
        self.deferring = False
        self.deferred_quiet = 0                      # quiet() True with deferring (tests, benchmarks)
        self.moved_plans = 0                         # compute Signals planned from their key's first copy (tests)
        # Starts of the compute stream's template parts whose Signals' plans are all their key's first part's
        # moved (_plan_blocks): two such parts of one key have the same plans but for their sibling part's start.
        self.moved_parts: set[int] = set()
        if options.inline_collectives:
            self._plan_inline(wait_at, signalled, compute_signals, options.inline_overlapped, shared)

    def _plan_inline(self, wait_at: dict[str, dict[str, int]], signalled: dict, compute_signals: list[int],
                     overlapped: bool, shared) -> None:
        streams = self.program.streams
        compute = streams.get(COMPUTE_STREAM, ())
        by_compute = signalled.get(COMPUTE_STREAM, {})       # event -> the compute stream's first Signal of it
        by_others = set().union(*(events for name, events in signalled.items() if name != COMPUTE_STREAM))
        plans, overlaps = self.inline_plans, self.overlap_plans     # hot loop: locals
        stream_of = self.wait_stream.get

        def where_of(event: str) -> tuple[str, int] | None:
            """(stream, index) of the WaitFor on `event`; None when none or several wait for it."""
            name = stream_of(event)
            return None if name is None else (name, wait_at[name][event])

        shared = set(shared)          # events waited for more than once
        signal_at = by_compute
        last = len(compute) - 1

        def plan(i: int) -> None:
            """The plan of the compute stream's Signal at i, if it has one."""
            if i >= last:
                return
            ready = compute[i].event
            where = where_of(ready)
            if where is None or ready in shared:
                return
            name, k = where
            if name == COMPUTE_STREAM:
                return
            other = streams[name]
            if k + 2 >= len(other):
                return
            collective, signal = other[k + 1], other[k + 2]
            if type(collective) is not Collective or type(signal) is not Signal:
                return
            done = signal.event
            joined = where_of(done)
            if joined is None or done in shared:
                return
            # After the collective the stream must sleep anyway (end, or a wait only the compute stream ends),
            # so parking it until then changes nothing.
            after = other[k + 3] if k + 3 < len(other) else None
            if after is not None and not (type(after) is WaitFor and after.event not in shared
                                          and after.event in by_compute and after.event not in by_others):
                return
            wait = compute[i + 1]
            if type(wait) is WaitFor and wait.event == done:
                plans[ready] = (name, k)
                return
            if not overlapped or after is None or collective.allocs or collective.frees \
                    or joined[0] != COMPUTE_STREAM:
                return
            # The collective runs beside the runs up to compute's WaitFor(done): inline.overlap. (Its stream's next
            # ready is signalled by the compute stream only, after i: never before the compute stream gets there.)
            j = joined[1]
            if i + 1 < j <= i + MAX_OVERLAPPED_RUNS + 1 and signal_at.get(after.event, -1) > j:
                for x in range(i + 1, j):
                    if type(compute[x]) is not Run:
                        break
                else:
                    overlaps[ready] = (name, k, j - i, collective)

        blocks = self.program.blocks.get(COMPUTE_STREAM, ()) if not shared else ()
        if blocks:
            compute_signals = self._plan_blocks(blocks, compute_signals, plan, where_of)
        for i in compute_signals:
            plan(i)

    def _plan_blocks(self, blocks: tuple, compute_signals: list[int], plan, where_of) -> list[int]:
        """The plans of the Signals in the compute stream's template copies' parts (Program.blocks), made for the
        first part of each key and moved to the others; returns the compute Signals left to `plan` one by one.

        A template copy's parts (one per stream, appended together by overlap_templates.apply, so the n-th part
        of one key on the compute stream and the n-th part of a sibling key on another stream are one copy) hold
        the same instructions but for tensor ids and event numbers, and no instruction outside the copy names one
        of its events (each is numbered once by the streams' counter). With no event waited for twice, a Signal's
        plan then depends only on its copy's parts wherever `plan` reads nothing outside them: the Signal's next
        instruction inside its part, and its WaitFor, collective, Signal and next instruction inside the sibling
        part. Such Signals' plans are the first copy's moved to each copy's parts; the others are planned one by
        one. (tests/test_template_blocks.py compares the plans with those of a whole scan.)"""
        streams = self.program.streams
        compute = streams[COMPUTE_STREAM]
        plans, overlaps = self.inline_plans, self.overlap_plans
        by_key: dict[int, list[tuple]] = {}
        for block in blocks:
            by_key.setdefault(id(block[2]), []).append(block)
        # Per other stream: its parts' starts (for bisect), and per key the (start, end) of its parts in order.
        parts_of: dict[str, tuple[list[int], list[tuple], dict[int, list[int]]]] = {}
        for name, parts in self.program.blocks.items():
            if name != COMPUTE_STREAM:
                starts_by_key: dict[int, list[int]] = {}
                for part in parts:
                    starts_by_key.setdefault(id(part[2]), []).append(part[0])
                parts_of[name] = ([part[0] for part in parts], parts, starts_by_key)
        moved: set[int] = set()           # Signals planned here
        for parts in by_key.values():
            start0, end0, _, sync = parts[0]
            offsets = [s for s in sync if type(compute[start0 + s]) is Signal]
            loose: list[int] = []         # offsets planned one by one in every copy
            groups: dict[tuple, tuple[list[int], list[int], list[int]]] = {}   # (kind, stream, key) -> columns
            for s in offsets:
                i = start0 + s
                plan(i)
                ready = compute[i].event
                where = where_of(ready)
                if i + 1 >= end0:
                    loose.append(s)
                    continue
                if where is None or where[0] == COMPUTE_STREAM:
                    continue              # no plan in any copy
                name, k = where
                found = parts_of.get(name)
                sibling = None
                if found is not None:
                    at = bisect_right(found[0], k) - 1
                    if at >= 0:
                        c_start, c_end, c_key, _ = found[1][at]
                        starts = found[2][id(c_key)]
                        if c_start <= k and k + 3 < c_end and starts[0] == c_start and len(starts) == len(parts):
                            sibling = id(c_key)
                if sibling is None:
                    loose.append(s)
                    continue
                if ready in plans:
                    kind, gap = 0, 0
                elif ready in overlaps:
                    kind, gap = 1, overlaps[ready][2]
                else:
                    continue
                columns = groups.setdefault((kind, name, sibling), ([], [], []))
                columns[0].append(s)
                columns[1].append(k - c_start)
                columns[2].append(gap)
            moved.update(map(add, offsets, repeat(start0)))
            # The loose Signals' plans relative to their stream's sibling part: a copy whose loose plans are these
            # too has all its plans moved ones (moved_parts).
            siblings = {name: sibling for _, name, sibling in groups}
            if len(siblings) < len({(name, sibling) for _, name, sibling in groups}):
                siblings = {}             # two sibling keys on one stream: not described
            shape = self._loose_shape(loose, start0, siblings, parts_of, 0)
            if shape is not None:
                self.moved_parts.add(start0)
            for n in range(1, len(parts)):
                start = parts[n][0]
                made = []
                for (kind, name, sibling), (signal_offsets, dks, gaps) in groups.items():
                    c_start = parts_of[name][2][sibling][n]
                    readies = [compute[i].event for i in map(add, signal_offsets, repeat(start))]
                    if where_of(readies[0]) != (name, c_start + dks[0]):
                        break             # not this copy's sibling part: every Signal planned one by one
                    made.append((kind, name, readies, list(map(add, dks, repeat(c_start))), gaps))
                else:
                    for s in loose:
                        plan(start + s)
                    for kind, name, readies, ks, gaps in made:
                        if kind == 0:
                            plans.update(zip(readies, zip(repeat(name), ks)))
                        else:
                            other = streams[name]
                            collectives = [other[k] for k in map(add, ks, repeat(1))]
                            overlaps.update(zip(readies, zip(repeat(name), ks, gaps, collectives)))
                    moved.update(map(add, offsets, repeat(start)))
                    self.moved_plans += len(offsets) - len(loose)
                    if shape is not None and _same_shape(self._loose_shape(loose, start, siblings, parts_of, n),
                                                         shape):
                        self.moved_parts.add(start)
                    continue
                for s in offsets:
                    plan(start + s)
                moved.update(map(add, offsets, repeat(start)))
        return [i for i in compute_signals if i not in moved]

    def _loose_shape(self, loose: list[int], start: int, siblings: dict[str, int], parts_of: dict,
                     n: int) -> list | None:
        """The plans of the Signals at `loose` (offsets from `start`) of the n-th part of a key, each as (stream,
        k less the start of that stream's n-th sibling part, gap, collective) or (stream, k less it) or None;
        None when a plan's stream has no sibling part (`siblings`: stream -> the sibling key)."""
        shape = []
        compute = self.program.streams[COMPUTE_STREAM]
        for s in loose:
            ready = compute[start + s].event
            found = self.overlap_plans.get(ready) or self.inline_plans.get(ready)
            if found is None:
                shape.append(None)
                continue
            sibling = siblings.get(found[0])
            if sibling is None:
                return None
            shape.append((found[0], found[1] - parts_of[found[0]][2][sibling][n], *found[2:]))
        return shape

    def can_inline(self, name: str, k: int, ready: str) -> bool:
        """Whether stream `name` stands where an inlined collective at name[k + 1] needs it (inline.inline):
        blocked at name[k] = WaitFor(ready), or parked by an earlier inline with its cursor at k, and its wait
        after the collective not signalled yet (else it would go on at once)."""
        cursor = self.cursor.get(name)
        if cursor is None:
            blocked = self.blocked.get(name)
            if blocked is None or blocked[0] != k or type(blocked[1]) is not WaitFor or blocked[1].event != ready:
                return False
        elif cursor != k:
            return False
        instructions = self.program.streams[name]
        if k + 3 < len(instructions):
            after = self.events.get(instructions[k + 3].event)     # not made yet: not signalled yet
            if after is not None and after.triggered:
                return False
        return True

    def quiet(self) -> bool:
        """Whether no stream but the compute stream can touch this rank's memory, marks or periods before the
        compute stream next yields: each is finished, parked, or blocked (on an event not signalled yet, or
        in a transfer) with nothing but sends, signals to the compute stream and effect-free communication
        ahead of it until it must wait again. The compute stream may then run past other ranks' events: what
        they do reaches this rank only through events it waits for (docs/engine.md).

        A stream blocked where it was not quiet stays so while it is blocked there (the same `blocked` entry):
        events are only ever triggered, never reset, so the instructions ahead of it never become effect-free.
        quiet() remembers that stream and answers False at once while its entry stands."""
        loud = self._loud
        if loud is not None and self.blocked.get(loud[0]) is loud[1] and loud[0] not in self.parked:
            return False
        self.deferring = False
        for name in self.program.streams:
            if name == COMPUTE_STREAM or name in self.done or name in self.parked:
                continue
            where = self.blocked.get(name)
            if where is None:
                return False                      # runnable: scheduled to go on
            index, instruction, pending = where
            if pending is None:
                if not self.events[instruction.event].triggered:
                    continue
            elif type(instruction) is Collective and instruction.frees or type(instruction) is Transfer:
                self._loud = (name, where)
                return False              # its end makes memory calls (a transfer's: device or host ones)
            if not self._effect_free(name, index + 1):
                self._loud = (name, where)
                return False
        if self.deferring:
            self.deferred_quiet += 1
        return True

    def _effect_free(self, name: str, start: int) -> bool:
        """The instructions of stream `name` from `start` up to its next blocking wait touch nothing rank-local."""
        instructions = self.program.streams[name]
        for position, instruction in enumerate(instructions[start:start + 8], start):
            kind = type(instruction)
            if kind is WaitFor:
                event = self.events.get(instruction.event)
                if event is None or not event.triggered:
                    return True
            elif kind is Signal:
                if self.wait_stream.get(instruction.event, COMPUTE_STREAM) != COMPUTE_STREAM \
                        or self.waiters.get(instruction.event, 0) > 1:
                    return False
            elif kind is Send or (kind is Recv and not instruction.allocs) \
                    or (kind is Collective and not instruction.allocs and not instruction.frees):
                continue
            elif kind is Free and self.send_lookahead and follows_send(instructions, position):
                self.deferring = True             # logged at its time whenever it comes (executor)
            else:
                return False
        return len(instructions) - start <= 8

    def release(self, stream: str, time_s: float) -> None:
        """Wake a parked stream at `time_s`; it goes on from its cursor."""
        event = self.event(self.parked.pop(stream))
        if not event.triggered:
            self.env.trigger_at(event, time_s)

    def event(self, name: str) -> simpy.Event:
        event = self.events.get(name)
        if event is None:
            event = self.events[name] = self.env.event()
        return event
