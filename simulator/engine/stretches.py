"""Replay of the compute stream's repeated stretches: a micro-batch copy's runs and inlined collectives, applied in
bulk from a record of an earlier copy's.

The executor runs a stretch (consecutive runs and inlined collectives, nothing that can make the compute stream
yield: executor._run_stretch) instruction by instruction. In a pipeline's steady state each micro-batch copy's
forward and backward run the same stretches: the same template ops (workload/stage.py), the same durations,
collectives of the same kind, group, size and name. What such a stretch does then depends on nothing but its start
time and where its instructions stand: spans, communication intervals, the inlined streams' cursors, and the
memory calls it logs (engine/memory_log.py: words naming its instructions, with times). So the first time a
stretch starting with a given op runs, its effects are predicted from its instructions and compared with what the
executor really did; when equal, they are kept as a `StretchRecord`. A later stretch with the same first op whose
instructions match the record one by one (ops by identity, durations, shifts, iterations, collectives' kind,
group, size, name, iteration and stream positions) is applied from the record: its times are the start time plus
the durations accumulated in the same order (so the same floats), its memory words the record's moved to where
its instructions stand, everything else copied. Results are identical to running it (tests/test_stretches.py
compares them).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import add, is_, itemgetter
from typing import TYPE_CHECKING

from simulator.engine.logs import IntervalLog, doubles, packer, phase_array, positive, span_columns
from simulator.engine.memory_log import COLL_ALLOC, COLL_FREE, RUN_ALLOC, RUN_FREE, stretch_word, where
from simulator.engine.rank_state import COMPUTE_STREAM
from simulator.parallel.program import Blocking, Collective, Run, Signal

if TYPE_CHECKING:
    from simulator.engine.network_model import NetworkModel
    from simulator.engine.rank_state import RankState

MIN_LENGTH = 8                # shorter stretches are not worth a record
MAX_RECORDS = 4               # records (and failed attempts) per first op


@dataclass(slots=True)
class StretchRecord:
    """What one stretch did, relative to its start time, and what a later one must match to be replayed."""

    length: int                       # instructions consumed
    runs: tuple                       # (position in the stretch, op, duration, iteration, low) of each run
    inlines: tuple                    # (position, stream, k - first k of that stream or None for a Blocking
                                      # instruction, the recorded collective, its memory tensors)
    durations: tuple                  # per step (a run or a collective), the time it adds
    span_runs: tuple                  # per run: the recorded Run, a span's info (only its op and iteration are read)
    span_steps: tuple                 # per run: its step (the span is times[step], times[step + 1])
    comm: tuple                       # per inlined collective: (stream, step, span info: the recorded collective)
    sample_steps: tuple               # per memory call: the index of its time in the stretch's times
    memory_words: tuple               # per memory call: its log word, relative to where its stream's part starts
    memory_bases: tuple               # per memory call: that stream (the compute stream, or an inlined one)
    streams: tuple                    # inlined streams, in order of first use
    isolated: int                     # network counters added
    dropped: int
    number: int                       # the record's number in its rank (the memory log's STRETCH words name it)
    copy: tuple | None                # (template, offset, iteration, low, blocking) of the micro-batch copy it lay
                                      # in (Program.copies), or None
    # derived in __post_init__, to apply and match the record at C speed
    run_columns: tuple = field(init=False)     # the runs' (picker from the stretch's instructions, ops, durations,
                                               # iterations, lows)
    span_times: tuple = field(init=False)      # pickers of the runs' start and end times from the stretch's times
    sample_times: object = field(init=False)   # picker of the memory calls' times
    span_phases: array = field(init=False)     # the runs' phase codes (engine/logs.py)
    span_pack: object = field(init=False)      # packs the runs' start (end) times as doubles
    comm_streams: tuple = field(init=False)    # per inlined stream: (name, start and end time pickers, infos,
                                               # phase codes, packer of its times)
    cursor_moves: tuple = field(init=False)    # (stream, dk + 3) of each collective after a Signal, in order
    signal_inlines: tuple = field(init=False)  # the inlines after a Signal (not Blocking instructions)

    def __post_init__(self) -> None:
        positions, ops, durations, iterations, lows = zip(*self.runs)
        self.run_columns = (_picker(positions), ops, durations, iterations, lows)
        self.span_times = (_picker(self.span_steps), _picker([step + 1 for step in self.span_steps]))
        self.span_phases = phase_array(self.span_runs)
        self.span_pack = packer(len(self.span_runs))
        self.sample_times = _picker(self.sample_steps)
        groups: dict[str, list] = {}
        for name, step, info in self.comm:
            groups.setdefault(name, []).append((step, info))
        self.comm_streams = tuple((name, _picker([step for step, _ in mine]), _picker([step + 1 for step, _ in mine]),
                                   tuple(info for _, info in mine), phase_array(info for _, info in mine),
                                   packer(len(mine))) for name, mine in groups.items())
        self.cursor_moves = tuple((name, dk + 3) for _, name, dk, *_ in self.inlines if dk is not None)
        self.signal_inlines = tuple(inline for inline in self.inlines if inline[2] is not None)

    def run_spans(self, times: list[float]) -> tuple:
        """The compute stream's spans of this stretch started at times[0], as SpanLog.since gives them."""
        starts, ends = self.span_times
        return span_columns(self.span_runs, starts(times), ends(times), self.span_phases)

    def comm_spans(self, times: list[float], stream: str) -> tuple:
        """Stream `stream`'s spans of this stretch's inlined collectives, as SpanLog.since gives them."""
        for name, starts, ends, infos, phases, _ in self.comm_streams:
            if name == stream:
                return span_columns(infos, starts(times), ends(times), phases)
        return span_columns((), (), (), array("H"))

    def words(self, index: int, starts: dict[str, int]) -> map:
        """The memory words of this stretch started at `index`, its inlined streams' parts at `starts`."""
        bases = {name: k << 12 for name, k in starts.items()}
        bases[COMPUTE_STREAM] = index << 12
        return map(add, self.memory_words, map(bases.__getitem__, self.memory_bases))


def _picker(indices) -> itemgetter:
    """A function of a sequence giving the tuple of its items at `indices` (itemgetter, also for 0 or 1 index)."""
    if len(indices) > 1:
        return itemgetter(*indices)
    if indices:
        return itemgetter(slice(indices[0], indices[0] + 1))      # a one-item tuple of a tuple, a list of a list
    return itemgetter(slice(0, 0))


def _intervals(times: list[float], steps: list[int]) -> tuple[array, array]:
    """The (starts, ends) columns of the steps' intervals that end after they start, as IntervalLog.since gives."""
    starts, ends = positive([times[step] for step in steps], [times[step + 1] for step in steps])
    return array("d", starts), array("d", ends)


class Stretches:
    """One rank's stretch records and the bookkeeping of learning one."""

    def __init__(self, copies: tuple = ()) -> None:
        self.copies = copies                                 # the compute stream's Program.copies
        self.copy_starts = [copy[0] for copy in copies]
        self.records: dict[int, list[StretchRecord]] = {}    # id(first op) -> records
        self.count = 0                                       # records made
        self.failures: dict[int, int] = {}                   # id(first op) -> stretches not learnable
        self.replayed = 0             # stretches applied from a record (tests check it is used)

    # replay ----------------------------------------------------------------------------------------
    def replay(self, state: RankState, network: NetworkModel | None, instructions, index: int,
               now_s: float) -> tuple[int, float] | None:
        """Apply the stretch at `index` from its record if one matches; (next index, clock), else None."""
        first = instructions[index]
        records = self.records.get(id(first.op))
        if not records:
            return None
        # The same part of a copy of the same template is the same instructions but for the shift: the runs and
        # Blocking collectives match without a look at them. Such records are tried first: one learned from the
        # template's own micro-batch (not moved) matches a moved copy's runs but rarely its collectives.
        candidates = [(record, index + record.length) for record in records
                      if index + record.length <= len(instructions)]
        copied = [record.copy is not None and self.copy_of(index, end) == record.copy for record, end in candidates]
        for (record, end), same_copy in sorted(zip(candidates, copied), key=lambda pair: not pair[1]):
            if not same_copy and not _runs_match(record.run_columns, instructions[index:end], first.shift):
                continue
            starts = self._inline_starts(state, network, instructions, index, record, same_copy)
            if starts is None:
                continue
            self.replayed += 1
            return end, self._apply(state, network, index, first.shift, now_s, record, starts)
        return None

    def copy_of(self, index: int, end: int) -> tuple | None:
        """(template, offset, iteration, low, blocking) of the micro-batch copy holding instructions [index, end)
        of the compute stream, or None."""
        i = bisect_right(self.copy_starts, index) - 1
        if i < 0:
            return None
        start, stop, template, iteration, low, blocking = self.copies[i]
        if end > stop:
            return None
        return template, index - start, iteration, low, blocking

    def _inline_starts(self, state: RankState, network, instructions, index: int, record: StretchRecord,
                       copied: bool) -> dict[str, int] | None:
        """Check the collectives would all be inlined as in the record (Blocking ones are when `copied`: the same
        part of a copy of the same template); per stream, the k of its first one."""
        starts: dict[str, int] = {}
        streams = state.program.streams
        shift, low = instructions[index].shift, instructions[index].low
        for position, name, dk, recorded, tensors in record.signal_inlines if copied else record.inlines:
            signal = instructions[index + position]
            if dk is None:
                if type(signal) is not Blocking or signal.stream != name:
                    return None
                if not _same_collective(signal.collective, recorded, tensors, shift, low):
                    return None
                continue
            if type(signal) is not Signal:
                return None
            plan = state.inline_plans.get(signal.event)
            if plan is None or plan[0] != name:
                return None
            k = plan[1]
            first_k = starts.setdefault(name, k - dk)
            if k - dk != first_k:
                return None
            other = streams[name]
            if not _same_collective(other[k + 1], recorded, tensors, shift, low):
                return None
            if k + 3 >= len(other):
                return None                      # the stream would be released at the end: not recorded
            if k == first_k and not state.can_inline(name, k, signal.event):
                return None                      # where the stream must stand, as _inline checks
            after = state.events.get(other[k + 3].event)
            if after is not None and after.triggered:
                return None
        if record.inlines and network is None:
            return None
        return starts

    def _apply(self, state: RankState, network, index: int, shift: int, now_s: float, record: StretchRecord,
               starts: dict[str, int]) -> float:
        """Apply the record at `index` (its runs' shift `shift`) from `now_s`; returns the clock at its end."""
        times = list(accumulate(record.durations, initial=now_s))
        if record.memory_words:
            log = state.log
            log.words.append(stretch_word(record.number, len(record.memory_words)))    # (memory_log.apply)
            log.times.append(float(shift))
            log.words.extend(record.words(index, starts))
            log.times.extend(record.sample_times(times))
        if state.record_spans:
            span_starts, span_ends = record.span_times
            pack = record.span_pack
            state.spans[COMPUTE_STREAM].extend(record.span_runs, pack(*span_starts(times)), pack(*span_ends(times)),
                                               record.span_phases)
        streams = state.program.streams
        for name in record.streams:
            state.comm_streams[name] = None
            if state.cursor.get(name) is None:
                state.parked[name] = streams[name][starts[name]].event
        # Per stream, in order (the interval lists are sorted at the end: only each stream's transfers keep an order).
        for name, pick_starts, pick_ends, infos, phases, pack in record.comm_streams:
            begins, ends = pick_starts(times), pick_ends(times)
            packed = pack(*begins), pack(*ends)
            moving = positive(begins, ends)
            if moving[0]:
                if moving[0] is not begins:
                    packed_moving = doubles(moving[0]), doubles(moving[1])
                else:
                    packed_moving = packed
                state.comm_intervals.extend(*packed_moving)
                transfers = state.stream_transfers.get(name)
                if transfers is None:
                    transfers = state.stream_transfers[name] = IntervalLog()
                transfers.extend(*packed_moving)
                state.exposed_intervals.extend(*packed_moving)
            if state.record_spans:
                state.spans[name].extend(infos, *packed, phases)
        for name, offset in record.cursor_moves:
            state.cursor[name] = starts[name] + offset
        if network is not None:
            network.isolated_operations += record.isolated
            network.shadows_dropped += record.dropped
        return times[-1]

    # learning --------------------------------------------------------------------------------------
    def watch(self, state: RankState, network, instructions, index: int, now_s: float) -> tuple | None:
        """Before the executor runs the stretch at `index`: what to compare afterwards (None: not learnable)."""
        if network is None:
            return None
        key = id(instructions[index].op)
        if len(self.records.get(key, ())) + self.failures.get(key, 0) >= MAX_RECORDS:
            return None                   # enough tried for stretches starting with this op
        names = [n for n in state.program.streams if n != COMPUTE_STREAM]
        return (index, now_s, len(state.log), len(state.spans[COMPUTE_STREAM]),
                {n: len(state.spans[n]) for n in names},
                len(state.comm_intervals), len(state.exposed_intervals),
                {n: len(state.stream_transfers.get(n, ())) for n in names},
                dict(state.cursor), dict(state.parked), (network.isolated_operations, network.shadows_dropped))

    def learn(self, watched: tuple, state: RankState, network, instructions, end: int, now_s: float) -> None:
        """After the executor ran the stretch: keep a record of it if predicting it reproduces what it did."""
        (index, start_s, n_calls, n_spans, n_comm_spans, n_intervals, n_exposed, n_transfers, cursor0, parked0,
         counters) = watched
        if end - index < MIN_LENGTH:
            return
        key = id(instructions[index].op)
        predicted = self._predict(state, network, instructions, index, end, counters, cursor0)
        if predicted is None or not self._reproduces(*predicted, state, index, start_s, now_s, watched):
            self.failures[key] = self.failures.get(key, 0) + 1
            return
        self.records.setdefault(key, []).append(predicted[0])      # the record keeps that op alive
        self.count += 1

    @staticmethod
    def _reproduces(record: StretchRecord, starts: dict[str, int], state: RankState, index: int, start_s: float,
                    now_s: float, watched: tuple) -> bool:
        """Whether applying `record` at `index` (inlined streams' parts at `starts`) gives exactly what the executor
        did."""
        (_, _, n_calls, n_spans, n_comm_spans, n_intervals, n_exposed, n_transfers, _, parked0, _) = watched
        times = list(accumulate(record.durations, initial=start_s))
        if times[-1] != now_s:
            return False
        log = state.log
        if log.words[n_calls:] != array("q", record.words(index, starts)) \
                or log.times[n_calls:] != array("d", record.sample_times(times)):
            return False
        if state.record_spans:
            if state.spans[COMPUTE_STREAM].since(n_spans) != record.run_spans(times):
                return False
            for name, n in n_comm_spans.items():
                if state.spans[name].since(n) != record.comm_spans(times, name):
                    return False
        intervals = _intervals(times, [step for _, step, _ in record.comm])
        if state.comm_intervals.since(n_intervals) != intervals \
                or state.exposed_intervals.since(n_exposed) != intervals:
            return False
        for name, n in n_transfers.items():
            mine = _intervals(times, [step for s, step, _ in record.comm if s == name])
            transfers = state.stream_transfers.get(name)
            if (transfers.since(n) if transfers is not None else (array("d"), array("d"))) != mine:
                return False
        for name in record.streams:
            if name not in state.parked or (name in parked0 and parked0[name] != state.parked[name]):
                return False
        return True

    def _predict(self, state: RankState, network, instructions, index: int, end: int, counters: tuple,
                 cursor0: dict) -> tuple[StretchRecord, dict[str, int]] | None:
        """The record of instructions[index:end] (runs, inlined Signal/WaitFor pairs and Blocking collectives) and,
        per inlined stream, the k of its first collective; None if it has anything a record cannot reproduce."""
        shift = instructions[index].shift
        runs, inlines, durations, span_runs, span_steps, comm = [], [], [], [], [], []
        sample_steps: list[int] = []
        words: list[int] = []
        bases: list[str] = []
        first_k: dict[str, int] = {}
        streams = state.program.streams
        stream_ids = state.stream_ids
        compute_id = stream_ids[COMPUTE_STREAM]
        position = index
        while position < end:
            instruction = instructions[position]
            step = len(durations)
            if type(instruction) is Run:
                op = instruction.op
                if instruction.shift != shift or not instruction.duration_s >= 0:
                    return None          # (nor NaN: _runs_match compares durations as tuples, identity first)
                runs.append((position - index, op, instruction.duration_s, instruction.iteration, instruction.low))
                durations.append(instruction.duration_s if instruction.duration_s > 0 else 0.0)
                span_runs.append(instruction)
                span_steps.append(step)
                at = where(compute_id, position - index)
                _calls(op, step, at | RUN_ALLOC, at | RUN_FREE, COMPUTE_STREAM, sample_steps, words, bases)
                position += 1
            elif type(instruction) is Signal or type(instruction) is Blocking:
                if network is None:
                    return None
                if type(instruction) is Blocking:
                    (collective, name), dk, width = instruction, None, 1
                    at, base = where(compute_id, position - index), COMPUTE_STREAM
                else:
                    plan = state.inline_plans.get(instruction.event)
                    if plan is None:
                        return None
                    name, k = plan
                    if k + 3 >= len(streams[name]):
                        return None
                    collective, dk, width = streams[name][k + 1], k - first_k.setdefault(name, k), 2
                    at, base = where(stream_ids[name], dk + 1), name
                duration = network.timed_isolated_s(collective.kind, collective.group, collective.size_bytes)
                tensors = _tensors(collective, shift, instructions[index].low)
                if duration is None or duration < 0 or tensors is None:
                    return None
                inlines.append((position - index, name, dk, collective, tensors))
                durations.append(duration)
                comm.append((name, step, collective))
                frees = collective.frees if type(collective) is Collective else ()
                _calls(collective, step, at | COLL_ALLOC, at | COLL_FREE if frees else None, base, sample_steps,
                       words, bases)
                position += width
            else:
                return None
        if position != end:
            return None
        for name, k in first_k.items():
            last = max(inline[2] for inline in inlines if inline[1] == name and inline[2] is not None)
            if cursor0.get(name, k) != k or state.cursor.get(name) != k + last + 3:
                return None              # the stream did not stand where _inline needs it, or ended elsewhere
        isolated, dropped = (network.isolated_operations - counters[0], network.shadows_dropped - counters[1]) \
            if network is not None else (0, 0)
        if isolated != len(inlines):
            return None
        record = StretchRecord(end - index, tuple(runs), tuple(inlines), tuple(durations), tuple(span_runs),
                               tuple(span_steps), tuple(comm), tuple(sample_steps), tuple(words), tuple(bases),
                               tuple(first_k), isolated, dropped, self.count, self.copy_of(index, end))
        return record, first_k


def _runs_match(columns: tuple, stretch, shift: int) -> bool:
    """Whether the runs of `stretch` (the instructions a record would consume) are the record's: Run instructions
    of the same ops (by identity), durations, iterations and lows, all with shift `shift`. Equal to comparing
    field by field: recorded durations are never NaN, so tuple equality (identity first) is value equality."""
    pick, ops, durations, iterations, lows = columns
    runs = pick(stretch)
    if not all(map(is_, map(type, runs), repeat(Run))):
        return False
    new_ops, new_durations, new_iterations, shifts, new_lows = zip(*runs)
    return new_durations == durations and all(map(is_, new_ops, ops)) and new_iterations == iterations \
        and new_lows == lows and shifts.count(shift) == len(shifts)


def _calls(op_or_collective, step: int, alloc_word: int, free_word: int | None, base: str, sample_steps: list[int],
           words: list[int], bases: list[str]) -> None:
    """Note the memory calls of a step as the executor logs them: an allocation at its start, a free at its end
    (a collective's free only when `free_word` is given: the executor frees only a Collective's)."""
    if op_or_collective.allocs:
        sample_steps.append(step)
        words.append(alloc_word)
        bases.append(base)
    if op_or_collective.frees and free_word is not None:
        sample_steps.append(step + 1)
        words.append(free_word)
        bases.append(base)


def _tensors(collective, shift: int, low: int) -> tuple | None:
    """What a collective's memory calls are matched by: its template's tensor tuples (a copy's post, moved by
    the runs' shift and low), or its own tuples (not moved); None if moved otherwise."""
    moved = collective.moved
    if moved is None:
        return (collective.allocs, collective.frees)
    if moved[2] != shift or moved[3] != low:
        return None
    return (moved[0], moved[1], True)


def _same_collective(collective, recorded, tensors: tuple, shift: int, low: int) -> bool:
    """Whether `collective` takes as long, has the same span and makes the same memory calls as `recorded`, whose
    memory tensors are `tensors` (see _tensors)."""
    if collective.kind != recorded.kind or collective.group != recorded.group \
            or collective.size_bytes != recorded.size_bytes or collective.name != recorded.name \
            or collective.iteration != recorded.iteration:
        return False
    moved = collective.moved
    if len(tensors) == 2:
        return moved is None and collective.allocs == tensors[0] and collective.frees == tensors[1]
    return moved is not None and moved[0] is tensors[0] and moved[1] is tensors[1] and moved[2] == shift \
        and moved[3] == low
