"""Replay of the compute stream's repeated stretches: a micro-batch copy's runs and inlined collectives, applied in
bulk from a record of an earlier copy's.

The executor runs a stretch (consecutive runs, Allocs and Frees, inlined and overlapped collectives:
engine/inline.py; nothing that can make the compute stream yield: executor._run_stretch) instruction by
instruction. In a pipeline's steady state each micro-batch copy's forward and backward run the same stretches: the
same template ops (workload/stage.py), the same durations, collectives of the same kind, group, size and name. What
such a stretch does then depends on nothing but its start time and where its instructions stand: spans,
communication intervals, the inlined streams' cursors, and the memory calls it logs (engine/memory_log.py: words
naming its instructions, with times). So the first time a stretch starting with a given op runs, its effects are
predicted from its instructions and compared with what the executor really did; when equal, they are kept as a
`StretchRecord` (engine/stretch_record.py). A later stretch with the same first op whose instructions match the
record one by one (ops by identity, durations, shifts, iterations, collectives' kind, group, size, name, iteration
and stream positions) is applied from the record: its times are computed from the start time by the same float
operations in the same order, its memory words the record's moved to where its instructions stand, everything else
copied. Results are identical to running it (tests/test_stretches.py compares them).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from operator import itemgetter
from typing import TYPE_CHECKING

from simulator.engine.logs import IntervalLog, doubles, positive
from simulator.engine.memory_log import ALLOC, COLL_ALLOC, COLL_FREE, FREE, RUN_ALLOC, RUN_FREE, where
from simulator.engine.rank_state import COMPUTE_STREAM
from simulator.engine.stretch_record import (ADD, BLOCK, BLOCK1, StretchRecord, collective_tensors, others_match,
                                             overlaps_match, runs_match, same_collective)
from simulator.parallel.program import Alloc, Blocking, Collective, Free, Run, Signal

if TYPE_CHECKING:
    from simulator.engine.network_model import NetworkModel
    from simulator.engine.rank_state import RankState

MIN_LENGTH = 8                # shorter stretches are not worth a record
MAX_RECORDS = 4               # records (and failed attempts) per first op
MAX_TAIL = 4                  # Allocs and Frees a stretch may hold after a template copy's part and match it


def _intervals(times: list[float], pairs) -> tuple[array, array]:
    """The (starts, ends) columns of the intervals between points `pairs` that end after they start, as
    IntervalLog.since gives them."""
    starts, ends = positive([times[a] for a, _ in pairs], [times[b] for _, b in pairs])
    return array("d", starts), array("d", ends)


class Stretches:
    """One rank's stretch records and the bookkeeping of learning one."""

    def __init__(self, copies: tuple = (), blocks: tuple = (), compute: tuple = ()) -> None:
        # The compute stream's Program.copies and template copies' parts (Program.blocks), by start: (start, stop,
        # what copy_of names them by but for the offset).
        self.copies = sorted([(start, stop, (template, iteration, low, blocking))
                              for start, stop, template, iteration, low, blocking in copies]
                             + [(start, stop, (key,)) for start, stop, key, _ in blocks], key=itemgetter(0, 1))
        self.copy_starts = [copy[0] for copy in self.copies]
        self.compute = compute                               # the compute stream (a block's tail is read)
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
        count = len(instructions)
        candidates = [(record, index + record.length) for record in records if index + record.length <= count]
        shift = first.shift
        copied = [record.copy is not None and self.copy_of(index, end) == record.copy
                  and all([instructions[index + p].shift == shift for p in record.probes])
                  for record, end in candidates]
        for (record, end), same_copy in sorted(zip(candidates, copied), key=lambda pair: not pair[1]):
            if not same_copy:
                position, op = record.probe
                last = instructions[index + position]
                if type(last) is not Run or last.op is not op \
                        or not runs_match(record.run_columns, instructions[index:end], first.shift):
                    continue
            if record.others and not others_match(record.other_columns, instructions[index:end]):
                continue
            starts = self._inline_starts(state, network, instructions, index, record, same_copy, now_s)
            if starts is None:
                continue
            self.replayed += 1
            if records[0] is not record:          # the one that matched is tried first next time
                records.remove(record)
                records.insert(0, record)
            return end, self._apply(state, network, index, first.shift, now_s, record, starts)
        return None

    def copy_of(self, index: int, end: int) -> tuple | None:
        """(template, offset, iteration, low, blocking) of the micro-batch copy holding instructions [index, end)
        of the compute stream; (key, offset, tail) of the template copy's part (Program.blocks) holding them but
        for a tail of up to MAX_TAIL Allocs and Frees after it (a backward's "micro-batch done" Free: their
        positions are matched as a record's others, and nothing else of them is recorded); ("chain", offset,
        parts, tail) when they run on over consecutive copies and parts, each named as above but for the offset
        (a last stage's forward, backward and what follows, with no instruction between them; the later parts'
        shifts are checked at their runs: `chain_probes`); or None."""
        i = bisect_right(self.copy_starts, index) - 1
        if i < 0:
            return None
        start, stop, named = self.copies[i]
        if end > stop and i + 1 < len(self.copies) and self.copies[i + 1][0] == stop:
            parts = [named]
            j = i + 1
            while True:
                _, stop, named = self.copies[j]
                parts.append(named)
                if end <= stop:
                    return ("chain", index - start, tuple(parts), 0)
                j += 1
                if j == len(self.copies) or self.copy_starts[j] != stop:
                    break             # the next part does not start where this one ends
            tail = self._tail((), stop, end)
            return None if tail is None else ("chain", index - start, tuple(parts), tail)
        if len(named) == 1:
            tail = self._tail(named, stop, end)
            return None if tail is None else (named[0], index - start, tail)
        if end > stop:
            return None
        return (named[0], index - start, *named[1:])

    def _tail(self, named: tuple, stop: int, end: int) -> int | None:
        """How many Allocs and Frees a stretch ending at `end` holds after a part named `named` ending at `stop`
        (None: more than MAX_TAIL, other instructions, or a single micro-batch copy, which takes no tail; `named`
        () after a chain, which does)."""
        if end <= stop:
            return 0
        if len(named) > 1 or end - stop > MAX_TAIL \
                or not all(type(ins) is Alloc or type(ins) is Free for ins in self.compute[stop:end]):
            return None
        return end - stop

    def chain_probes(self, index: int, copy: tuple | None) -> tuple | None:
        """For a stretch at `index` named `copy` by copy_of: the positions, relative to `index`, of the first run of
        each part after its first when it is a chain, () when it is not; None when a later part has no run."""
        if copy is None or copy[0] != "chain":
            return ()
        i = bisect_right(self.copy_starts, index) - 1
        probes = []
        for start, stop, _ in self.copies[i + 1:i + len(copy[2])]:
            if start == stop:
                continue                  # an empty part: nothing of it to check
            for position in range(start, stop):
                if type(self.compute[position]) is Run:
                    probes.append(position - index)
                    break
            else:
                return None
        return tuple(probes)

    def _inline_starts(self, state: RankState, network, instructions, index: int, record: StretchRecord,
                       copied: bool, now_s: float) -> dict[str, int] | None:
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
                if not same_collective(signal.collective, recorded, tensors, shift, low):
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
            if not same_collective(other[k + 1], recorded, tensors, shift, low):
                return None
            if k + 3 >= len(other):
                return None                      # the stream would be released at the end: not recorded
            if k == first_k and not state.can_inline(name, k, signal.event):
                return None                      # where the stream must stand, as inline.inline checks
            after = state.events.get(other[k + 3].event)
            if after is not None and after.triggered:
                return None
        if copied and record.overlap_part is not None and record.overlap_columns is not None \
                and index + record.overlap_part in state.moved_parts:
            # The same part of another copy of the key, both with moved plans: its Signals' plans are the record's
            # but for where their stream's part starts (RankState._plan_blocks), so only where that stream stands
            # is checked, as below.
            return self._moved_overlaps(state, network, instructions, index, record, starts, now_s)
        if record.overlap_columns is not None:
            fast = overlaps_match(state, record.overlap_columns, instructions[index:index + record.length], starts,
                                   now_s)
            if fast is not None:
                return starts if fast and network is not None else None
        plans = state.overlap_plans
        for position, name, dk, gap, recorded in record.overlaps:
            # (RankState._plan_inline made sure the stream's wait after the collective is not signalled before the
            # compute stream passes this block: only the inlined stream's position and collective are checked.)
            signal = instructions[index + position]
            if type(signal) is not Signal:
                return None
            plan = plans.get(signal.event)
            if plan is None or plan[0] != name or plan[2] != gap:
                return None
            k = plan[1]
            first_k = starts.setdefault(name, k - dk)
            if k - dk != first_k:
                return None
            collective = plan[3]
            if collective is not recorded and not same_collective(collective, recorded, ((), ()), shift, low):
                return None
            if k == first_k:
                if not state.can_inline(name, k, signal.event) or name in state.offload_streams:
                    return None
                transfers = state.stream_transfers.get(name)
                if transfers is not None and transfers.ends and transfers.ends[-1] > now_s:
                    return None                  # inline.expose would find more of that stream than the record did
        if (record.inlines or record.overlaps) and network is None:
            return None
        return starts

    @staticmethod
    def _moved_overlaps(state: RankState, network, instructions, index: int, record: StretchRecord,
                        starts: dict[str, int], now_s: float) -> dict[str, int] | None:
        """_inline_starts' end for a record whose overlaps' plans are moved ones of the stretch's part's key."""
        position, name, dk, _, _ = record.overlaps[0]
        event = instructions[index + position].event
        first_k = state.overlap_plans[event][1] - dk
        if not state.can_inline(name, first_k, event) or name in state.offload_streams:
            return None
        transfers = state.stream_transfers.get(name)
        if transfers is not None and transfers.ends and transfers.ends[-1] > now_s:
            return None                  # inline.expose would find more of that stream than the record did
        if network is None:
            return None
        starts[name] = first_k
        return starts

    def _apply(self, state: RankState, network, index: int, shift: int, now_s: float, record: StretchRecord,
               starts: dict[str, int]) -> float:
        """Apply the record at `index` (its runs' shift `shift`) from `now_s`; returns the clock at its end."""
        import numpy as np     # (imported once the first record exists)
        times = record.times(now_s)
        words, selector, names, samples, span_starts, span_ends = record.columns
        points = np.frombuffer(record.points_pack(*times, float(shift)))    # point -1: the STRETCH words' time
        if record.memory_words:
            log = state.log
            bases = np.array([index << 12 if name == COMPUTE_STREAM else starts[name] << 12 if name else 0
                              for name in names], dtype=np.int64)
            log.note_blocks(record.headers, state.env.now)     # a Send's Free may come among their calls
            log.words.frombytes((words + bases[selector]).tobytes())    # (memory_log.apply reads STRETCH words)
            log.times.frombytes(points[samples].tobytes())
        if state.record_spans:
            state.spans[COMPUTE_STREAM].extend(record.span_runs, points[span_starts].tobytes(),
                                               points[span_ends].tobytes(), record.span_phases)
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
            if state.record_spans:
                state.spans[name].extend(infos, *packed, phases)
        if record.exposures:
            pick_starts, pick_ends = record.exposure_times
            begins, ends = positive(pick_starts(times), pick_ends(times))
            if begins:
                state.exposed_intervals.extend(doubles(begins), doubles(ends))
        for name, offset in record.cursor_moves:
            state.cursor[name] = starts[name] + offset
        if network is not None:
            network.isolated_operations += record.isolated
            network.shadows_dropped += record.dropped
        return times[record.final]

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
        record = predicted[0]
        self.records.setdefault(key, []).append(record)      # the record keeps that op alive
        self.count += max(1, sum(calls > 0 for _, calls in record.pieces))     # numbers of its STRETCH words

    @staticmethod
    def _reproduces(record: StretchRecord, starts: dict[str, int], state: RankState, index: int, start_s: float,
                    now_s: float, watched: tuple) -> bool:
        """Whether applying `record` at `index` (inlined streams' parts at `starts`) gives exactly what the executor
        did."""
        (_, _, n_calls, n_spans, n_comm_spans, n_intervals, n_exposed, n_transfers, _, parked0, _) = watched
        times = record.times(start_s)
        if times[record.final] != now_s:
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
        if state.comm_intervals.since(n_intervals) != _intervals(times, [(a, b) for _, a, b, _ in record.comm]) \
                or state.exposed_intervals.since(n_exposed) != _intervals(times, record.exposures):
            return False
        for name, n in n_transfers.items():
            mine = _intervals(times, [(a, b) for s, a, b, _ in record.comm if s == name])
            transfers = state.stream_transfers.get(name)
            if (transfers.since(n) if transfers is not None else (array("d"), array("d"))) != mine:
                return False
        for name in record.streams:
            if name not in state.parked or (name in parked0 and parked0[name] != state.parked[name]):
                return False
        return True

    def _predict(self, state: RankState, network, instructions, index: int, end: int, counters: tuple,
                 cursor0: dict) -> tuple[StretchRecord, dict[str, int]] | None:
        """The record of instructions[index:end] (runs, Allocs and Frees, inlined Signal/WaitFor pairs, Blocking
        collectives and overlapped ones) and, per inlined stream, the k of its first collective; None if it has
        anything a record cannot reproduce."""
        shift = instructions[index].shift
        runs, inlines, overlaps, others, span_runs, span_points, comm, exposures = [], [], [], [], [], [], [], []
        program: list[tuple] = []
        adds: list[float] = []
        sample_steps: list[int] = []
        words: list[int] = []
        bases: list[str] = []
        plain: set[int] = set()      # the calls of Allocs and Frees
        first_k: dict[str, int] = {}
        streams = state.program.streams
        stream_ids = state.stream_ids
        compute_id = stream_ids[COMPUTE_STREAM]
        points, clock = 1, 0        # points so far, the clock's
        block = False               # in an overlapped collective's runs

        def add_step(duration: float) -> int:
            nonlocal points, clock
            if not adds and (program or block):
                clock = points            # a segment after a block or in one starts with the clock again (times())
                points += 1
            adds.append(duration)
            start, clock = clock, points
            points += 1
            return start

        def flush() -> None:
            if adds:
                program.append((ADD, tuple(adds)))
                adds.clear()

        def run_step(instruction: Run, position: int) -> bool:
            op = instruction.op
            if instruction.shift != shift or not instruction.duration_s >= 0:
                return False          # (nor NaN: runs_match compares durations as tuples, identity first)
            runs.append((position - index, op, instruction.duration_s, instruction.iteration, instruction.low))
            span_runs.append(instruction)
            start = add_step(instruction.duration_s if instruction.duration_s > 0 else 0.0)
            span_points.append((start, clock))
            at = where(compute_id, position - index)
            _calls(op, start, clock, at | RUN_ALLOC, at | RUN_FREE, COMPUTE_STREAM, sample_steps, words, bases)
            return True

        position = index
        while position < end:
            instruction = instructions[position]
            kind = type(instruction)
            if kind is Run:
                if not run_step(instruction, position):
                    return None
                position += 1
            elif kind is Alloc or kind is Free:
                others.append((position - index, kind))
                sample_steps.append(clock)
                words.append(where(compute_id, position - index) | (ALLOC if kind is Alloc else FREE))
                bases.append(COMPUTE_STREAM)
                plain.add(len(words) - 1)
                position += 1
            elif kind is Signal and instruction.event in state.overlap_plans \
                    and instruction.event not in state.inline_plans:
                if network is None:
                    return None
                name, k, gap, collective = state.overlap_plans[instruction.event]
                duration = network.timed_isolated_s(collective.kind, collective.group, collective.size_bytes)
                if duration is None or duration < 0 or position + gap >= end:
                    return None
                dk = k - first_k.setdefault(name, k)
                overlaps.append((position - index, name, dk, gap, collective))
                flush()
                fork = points
                points += 1
                comm.append((name, clock, fork, collective))
                block = True
                for inner in range(position + 1, position + gap):
                    if type(instructions[inner]) is not Run or not run_step(instructions[inner], inner):
                        return None
                block = False
                program.append((BLOCK1, (duration, adds[0])) if len(adds) == 1 else (BLOCK, (duration, tuple(adds))))
                adds.clear()
                exposures.append((clock, points))
                clock = points
                points += 1
                position += gap + 1
            elif kind is Signal or kind is Blocking:
                if network is None:
                    return None
                if kind is Blocking:
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
                tensors = collective_tensors(collective, shift, instructions[index].low)
                if duration is None or duration < 0 or tensors is None:
                    return None
                inlines.append((position - index, name, dk, collective, tensors))
                start = add_step(duration)
                comm.append((name, start, clock, collective))
                exposures.append((start, clock))
                frees = collective.frees if type(collective) is Collective else ()
                _calls(collective, start, clock, at | COLL_ALLOC, at | COLL_FREE if frees else None, base,
                       sample_steps, words, bases)
                position += width
            else:
                return None
        flush()
        if position != end:
            return None
        for name, k in first_k.items():
            last = max([inline[2] for inline in inlines if inline[1] == name and inline[2] is not None]
                       + [overlap[2] for overlap in overlaps if overlap[1] == name])
            if cursor0.get(name, k) != k or state.cursor.get(name) != k + last + 3:
                return None              # the stream did not stand where _inline needs it, or ended elsewhere
        isolated, dropped = (network.isolated_operations - counters[0], network.shadows_dropped - counters[1]) \
            if network is not None else (0, 0)
        if isolated != len(inlines) + len(overlaps):
            return None
        pieces: list[tuple[int, int]] = []
        for call in range(len(words)):
            if call in plain:
                pieces.append((call, -1))
            elif pieces and pieces[-1][1] > 0 and pieces[-1][0] + pieces[-1][1] == call:
                pieces[-1] = (pieces[-1][0], pieces[-1][1] + 1)
            else:
                pieces.append((call, 1))
        record = StretchRecord(end - index, tuple(runs), tuple(inlines), tuple(overlaps), tuple(others),
                               tuple(program), tuple(span_runs), tuple(span_points), tuple(comm), tuple(exposures),
                               tuple(sample_steps), tuple(words), tuple(bases), tuple(pieces), tuple(first_k),
                               isolated, dropped, self.count, *self._named(index, end),
                               self._overlap_part(state, index, overlaps))
        return record, first_k

    def _overlap_part(self, state: RankState, index: int, overlaps: list) -> int | None:
        """The start, relative to `index`, of the template part holding every one of `overlaps` (positions relative
        to `index`) if its plans were moved (RankState.moved_parts), else None."""
        if not overlaps:
            return None
        i = bisect_right(self.copy_starts, index + overlaps[0][0]) - 1
        if i < 0:
            return None
        start, stop, named = self.copies[i]
        if len(named) != 1 or start not in state.moved_parts or index + overlaps[-1][0] >= stop:
            return None
        return start - index

    def _named(self, index: int, end: int) -> tuple:
        """(copy_of, chain_probes) of the stretch [index, end), (None, ()) when a part of its chain has no run."""
        copy = self.copy_of(index, end)
        probes = self.chain_probes(index, copy)
        return (None, ()) if probes is None else (copy, probes)




def _calls(op_or_collective, start: int, end: int, alloc_word: int, free_word: int | None, base: str,
           sample_steps: list[int], words: list[int], bases: list[str]) -> None:
    """Note the memory calls of a step as the executor logs them: an allocation at its start point, a free at its
    end point (a collective's free only when `free_word` is given: the executor frees only a Collective's)."""
    if op_or_collective.allocs:
        sample_steps.append(start)
        words.append(alloc_word)
        bases.append(base)
    if op_or_collective.frees and free_word is not None:
        sample_steps.append(end)
        words.append(free_word)
        bases.append(base)
