"""A stretch record: what one stretch of the compute stream did, relative to its start (engine/stretches.py replays
it), with the columns that apply and match it at C speed, and the tests a stretch must pass to match it."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import add, attrgetter, is_, itemgetter, sub
from typing import TYPE_CHECKING

from simulator.engine.logs import packer, phase_array, span_columns
from simulator.engine.memory_log import stretch_word
from simulator.engine.rank_state import COMPUTE_STREAM
from simulator.parallel.program import Run, Signal

if TYPE_CHECKING:
    from simulator.engine.rank_state import RankState

_EVENT = attrgetter("event")

ADD, BLOCK, BLOCK1 = 0, 1, 2     # StretchRecord.program's steps (BLOCK1: a BLOCK of one run)


@dataclass(slots=True)
class StretchRecord:
    """What one stretch did, relative to its start time, and what a later one must match to be replayed.

    Its times are points computed from the start time by `program` (see `times`): a run or a collective the compute
    stream waits for adds its duration to the clock; an overlapped collective (engine/inline.py, `overlap`) starts at
    the clock and ends its duration later (a point beside the clock), its runs add theirs, and the WaitFor after
    them moves the clock to the later of the two. Every span, interval and memory call's time is one of these points."""

    length: int                       # instructions consumed
    runs: tuple                       # (position in the stretch, op, duration, iteration, low) of each run
    inlines: tuple                    # (position, stream, k - first k of that stream or None for a Blocking
                                      # instruction, the recorded collective, its memory tensors)
    overlaps: tuple                   # (position, stream, k - first k, instructions to the WaitFor, collective) of
                                      # each overlapped collective
    others: tuple                     # (position, type) of each Alloc and Free
    program: tuple                    # (ADD, durations) / (BLOCK, (collective's duration, its runs' durations)) /
                                      # (BLOCK1, (collective's duration, its one run's))
    span_runs: tuple                  # per run: the recorded Run, a span's info (only its op and iteration are read)
    span_points: tuple                # per run: (start point, end point)
    comm: tuple                       # per collective, in the executor's order: (stream, start, end point, info)
    exposures: tuple                  # per wait on a collective, in the executor's order: (start, end point)
    sample_steps: tuple               # per memory call: the point of its time
    memory_words: tuple               # per memory call: its log word, relative to where its stream's part starts
    memory_bases: tuple               # per memory call: that stream (the compute stream, or an inlined one)
    pieces: tuple                     # (first call, calls) of each part of the calls between Allocs and Frees,
                                      # (call, -1) for an Alloc's or a Free's
    streams: tuple                    # inlined streams, in order of first use
    isolated: int                     # network counters added
    dropped: int
    number: int                       # the record's first number in its rank (the memory log's STRETCH words name
                                      # number + i before piece i's calls)
    copy: tuple | None                # (template, offset, iteration, low, blocking) of the micro-batch copy it lay
                                      # in (Program.copies), (key, offset, tail) of the template copy's part
                                      # (Program.blocks), a chain of them, or None: Stretches.copy_of
    probes: tuple                     # positions of a run of each part of a chain after its first (their shifts
                                      # must be the first run's): Stretches.chain_probes
    overlap_part: int | None          # where the template part holding all its overlaps starts, relative to the
                                      # stretch, if RankState moved that part's plans (RankState.moved_parts)
    # derived in __post_init__, to apply and match the record at C speed
    run_columns: tuple = field(init=False)     # the runs' (picker from the stretch's instructions, ops, durations,
                                               # iterations, lows)
    other_columns: tuple = field(init=False)   # (picker of the Allocs and Frees, their types)
    span_times: tuple = field(init=False)      # pickers of the runs' start and end times from the stretch's times
    sample_times: object = field(init=False)   # picker of the memory calls' times
    span_phases: array = field(init=False)     # the runs' phase codes (engine/logs.py)
    span_pack: object = field(init=False)      # packs the runs' start (end) times as doubles
    comm_streams: tuple = field(init=False)    # per inlined stream: (name, start and end time pickers, infos,
                                               # phase codes, packer of its times)
    comm_times: tuple = field(init=False)      # pickers of every collective's start and end times, in order
    exposure_times: tuple = field(init=False)  # pickers of the exposures' start and end times
    cursor_moves: tuple = field(init=False)    # (stream, dk + 3) of the last collective after a Signal of each
                                               # stream
    signal_inlines: tuple = field(init=False)  # the inlines after a Signal (not Blocking instructions)
    durations: tuple | None = field(init=False)   # the program's durations when it only adds (no overlap)
    final: int = field(init=False)             # the point of the clock at the end
    logged: tuple = field(init=False)          # (words, bases, sample picker) as the memory log gets them: each
                                               # piece after its STRETCH word (base "", time the shift: point -1)
    headers: tuple = field(init=False)         # (offset in `logged`, calls) of each STRETCH word (MemoryLog.blocks)
    columns: tuple = field(init=False)         # numpy arrays to apply it: (logged words, their bases' numbers,
                                               # bases' streams, sample points, span start and end points)
    points_pack: object = field(init=False)    # packs its points and the shift (point -1) as doubles
    probe: tuple = field(init=False)           # (position, op) of its last run: a cheap first test of a match
    overlap_columns: tuple | None = field(init=False)   # its overlaps, to match them at C speed when they are all
                                                        # on one stream that no Signal inline uses (overlaps_match)

    def __post_init__(self) -> None:
        positions, ops, durations, iterations, lows = zip(*self.runs)
        self.run_columns = (picker(positions), ops, durations, iterations, lows)
        self.other_columns = (picker([position for position, _ in self.others]),
                              tuple(kind for _, kind in self.others))
        self.span_times = (picker([a for a, _ in self.span_points]), picker([b for _, b in self.span_points]))
        self.span_phases = phase_array(self.span_runs)
        self.span_pack = packer(len(self.span_runs))
        self.sample_times = picker(self.sample_steps)
        groups: dict[str, list] = {}
        for name, start, end, info in self.comm:
            groups.setdefault(name, []).append((start, end, info))
        self.comm_streams = tuple((name, picker([a for a, _, _ in mine]), picker([b for _, b, _ in mine]),
                                   tuple(info for _, _, info in mine), phase_array(info for _, _, info in mine),
                                   packer(len(mine))) for name, mine in groups.items())
        self.comm_times = (picker([a for _, a, _, _ in self.comm]), picker([b for _, _, b, _ in self.comm]))
        self.exposure_times = (picker([a for a, _ in self.exposures]), picker([b for _, b in self.exposures]))
        # Only each stream's last move stays (in the order streams first move: the cursor dict's own order).
        self.cursor_moves = tuple(dict([(name, dk + 3) for _, name, dk, *_ in self.inlines if dk is not None]
                                       + [(name, dk + 3) for _, name, dk, _, _ in self.overlaps]).items())
        self.signal_inlines = tuple(inline for inline in self.inlines if inline[2] is not None)
        self.durations = self.program[0][1] if len(self.program) == 1 else None
        points, clock = 1, 0
        for i, (code, value) in enumerate(self.program):
            points += len(value) + (1 if i else 0) if code is ADD else len(value[1]) + 3 if code is BLOCK else 4
        self.final = points - 1
        self.points_pack = packer(points + 1)
        words, bases, steps = [], [], []
        piece = 0
        headers = []                             # (offset, calls) of its STRETCH words (MemoryLog.blocks)
        for first, calls in self.pieces:
            if calls < 0:                        # an Alloc or Free: made one by one
                words.append(self.memory_words[first])
                bases.append(self.memory_bases[first])
                steps.append(self.sample_steps[first])
                continue
            headers.append((len(words), calls))
            words.append(stretch_word(self.number + piece, calls))
            piece += 1
            bases.append("")
            steps.append(-1)
            words += self.memory_words[first:first + calls]
            bases += self.memory_bases[first:first + calls]
            steps += self.sample_steps[first:first + calls]
        self.logged = (tuple(words), tuple(bases), picker(steps))
        self.headers = tuple(headers)
        import numpy as np      # (here: a run without a stretch record does not need it in the engine)
        names = list(dict.fromkeys(bases))
        self.columns = (np.array(words, dtype=np.int64), np.array([names.index(b) for b in bases], dtype=np.intp),
                        tuple(names), np.array(steps, dtype=np.intp),
                        np.array([a for a, _ in self.span_points], dtype=np.intp),
                        np.array([b for _, b in self.span_points], dtype=np.intp))
        self.probe = (self.runs[-1][0], self.runs[-1][1])
        names = {name for _, name, *_ in self.overlaps}
        self.overlap_columns = None
        if len(names) == 1 and not any(inline[1] in names for inline in self.signal_inlines):
            positions, _, dks, gaps, collectives = zip(*self.overlaps)
            self.overlap_columns = (picker(positions), names.pop(), dks, gaps, collectives)

    def times(self, start_s: float) -> list[float]:
        """The stretch's points started at `start_s`: the same float operations as the executor's, in order."""
        if self.durations is not None:
            return list(accumulate(self.durations, initial=start_s))
        program = self.program
        if program[0][0] is ADD:
            points = list(accumulate(program[0][1], initial=start_s))
            program = program[1:]
        else:
            points = [start_s]
        clock = fork = points[-1]
        extend, append = points.extend, points.append
        for code, value in program:
            if code is ADD:
                extend(accumulate(value, initial=clock))      # (the clock again first: a point of its own)
                clock = points[-1]
            elif code is BLOCK1:                                # an overlapped collective beside one run
                duration, run = value
                fork = clock + duration
                end = clock + run
                join = fork if fork > end else end              # max(end, fork)
                extend((fork, clock, end, join))                # (as BLOCK makes them)
                clock = join
            else:                                               # an overlapped collective beside runs
                duration, runs = value
                fork = clock + duration
                if len(runs) == 2:                              # (the loop below, unrolled: half of the blocks)
                    first = clock + runs[0]
                    end = first + runs[1]
                    join = fork if fork > end else end
                    extend((fork, clock, first, end, join))
                    clock = join
                    continue
                append(fork)
                extend(accumulate(runs, initial=clock))
                clock = max(points[-1], fork)
                append(clock)
        return points

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

    def words(self, index: int, starts: dict[str, int], logged: bool = False) -> map:
        """The memory words of this stretch started at `index`, its inlined streams' parts at `starts` (`logged`:
        with the STRETCH words before its pieces, as _apply logs them)."""
        bases = {name: k << 12 for name, k in starts.items()}
        bases[COMPUTE_STREAM] = index << 12
        if not logged:
            return map(add, self.memory_words, map(bases.__getitem__, self.memory_bases))
        bases[""] = 0
        words, names, _ = self.logged
        return map(add, words, map(bases.__getitem__, names))


def picker(indices) -> itemgetter:
    """A function of a sequence giving the tuple of its items at `indices` (itemgetter, also for 0 or 1 index)."""
    if len(indices) > 1:
        return itemgetter(*indices)
    if indices:
        return itemgetter(slice(indices[0], indices[0] + 1 or None))    # a one-item tuple of a tuple, a list of a list
    return itemgetter(slice(0, 0))


# matching a stretch against a record ----------------------------------------------------------------------
def runs_match(columns: tuple, stretch, shift: int) -> bool:
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


def overlaps_match(state: RankState, columns: tuple, stretch, starts: dict[str, int], now_s: float) -> bool | None:
    """The overlaps of a record checked at C speed, as Stretches._inline_starts checks them one by one: True (and the
    stream's first k in `starts`) if they match, False if not, None to leave it to that loop (a collective of the
    stretch is not the recorded object)."""
    pick, name, dks, gaps, recorded = columns
    signals = pick(stretch)
    if not all(map(is_, map(type, signals), repeat(Signal))):
        return False
    plans = list(map(state.overlap_plans.get, map(_EVENT, signals)))
    if None in plans:
        return False
    names, ks, found_gaps, collectives = zip(*plans)
    if found_gaps != gaps or names.count(name) != len(names):
        return False
    first_k = ks[0] - dks[0]
    if list(map(sub, ks, dks)).count(first_k) != len(ks):
        return False
    if not all(map(is_, collectives, recorded)):
        return None
    if not state.can_inline(name, first_k, signals[0].event) or name in state.offload_streams:
        return False
    transfers = state.stream_transfers.get(name)
    if transfers is not None and transfers.ends and transfers.ends[-1] > now_s:
        return False
    starts[name] = first_k
    return True


def others_match(columns: tuple, stretch) -> bool:
    """Whether the Allocs and Frees of a record stand where `stretch` has instructions of the same types (their
    memory words name those instructions; a stretch holding them logs no STRETCH word over them)."""
    pick, kinds = columns
    return tuple(map(type, pick(stretch))) == kinds


def collective_tensors(collective, shift: int, low: int) -> tuple | None:
    """What a collective's memory calls are matched by: its template's tensor tuples (a copy's post, moved by
    the runs' shift and low), or its own tuples (not moved); None if moved otherwise."""
    moved = collective.moved
    if moved is None:
        return (collective.allocs, collective.frees)
    if moved[2] != shift or moved[3] != low:
        return None
    return (moved[0], moved[1], True)


def same_collective(collective, recorded, tensors: tuple, shift: int, low: int) -> bool:
    """Whether `collective` takes as long, has the same span and makes the same memory calls as `recorded`, whose
    memory tensors are `tensors` (see collective_tensors)."""
    if collective.kind != recorded.kind or collective.group != recorded.group \
            or collective.size_bytes != recorded.size_bytes or collective.name != recorded.name \
            or collective.iteration != recorded.iteration:
        return False
    moved = collective.moved
    if len(tensors) == 2:
        return moved is None and collective.allocs == tensors[0] and collective.frees == tensors[1]
    return moved is not None and moved[0] is tensors[0] and moved[1] is tensors[1] and moved[2] == shift \
        and moved[3] == low
