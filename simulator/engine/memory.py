"""One rank's memory: tensors through an allocator model, with a timeline and per-category peaks."""

from __future__ import annotations

from dataclasses import dataclass
from operator import gt

from simulator.engine.allocator import Allocator, OutOfMemory
from simulator.engine.repeats import ALLOC, BOUNDARY, FREE, RecordedCall, Recording, Skipping, absolute, relative
from simulator.errors import PlanError
from simulator.parallel.program import Collective, Period
from simulator.trace.records import OomInfo
from simulator.workload.graph import CATEGORIES, Tensor, moved_ids

_CATEGORY_INDEX = {name: i for i, name in enumerate(CATEGORIES)}
UNBOUNDED_BYTES = 1 << 44     # capacity after an OOM (16 TiB): keep simulating to measure the requirement
_NONE_HASH = hash(None)       # a boundary's digest when its state is not computed


@dataclass
class MemoryOutcome:
    """What a rank's memory calls left: the samples, the allocator's events and segments, the first OOM, the peaks."""

    samples: list                 # flat (time_s, allocated, reserved, by_category) quadruples
    events: list                  # AllocatorEvent
    segments: list                # the snapshot's "segments"
    oom: OomInfo | None
    peak_allocated: int
    peak_reserved: int
    peak_time_s: float
    peak_op: str
    peak_breakdown: tuple
    category_peaks: list


@dataclass(frozen=True, slots=True)
class StretchCalls:
    """The outcome of a replayed period's calls `first`..`first + count` taken at once (RankMemory.replay_stretch)."""

    calls: list                  # the period's recorded calls (kept: the key holds their id)
    first: int
    count: int
    category_max: tuple          # the largest bytes per category over the calls
    allocated_peak: int          # the index (from `first`) of the first call with the largest allocated bytes
    reserved_max: int


def beyond_any_device(name: str, nbytes: int, op: str) -> PlanError:
    """The error for a rank that needs more than UNBOUNDED_BYTES even with the device's limit lifted."""
    return PlanError(f"op {op!r}: tensor {name!r} of {nbytes} bytes takes one rank past {UNBOUNDED_BYTES} bytes "
                     f"(16 TiB, the most memsim tracks on one device): no device holds this job")


class RankMemory:
    """Allocates and frees a rank's tensors, keeping allocated bytes by category and the peak."""

    def __init__(self, allocator: Allocator, tensors: dict[int, Tensor], stream_ids: dict[str, int],
                 record_timeline: bool = True, repeats: bool = True):
        self.allocator = allocator
        self.tensors = tensors
        self.stream_ids = stream_ids
        self.record_timeline = record_timeline
        self.handles: dict[int, int] = {}
        self.bytes_of: dict[int, int] = {}
        self.by_category = [0] * len(CATEGORIES)
        self.samples: list = []      # flat (time_s, allocated, reserved, by_category) quadruples (engine/timelines.py)
        self.peak_allocated = -1
        self.peak_reserved = 0
        self.peak_time_s = 0.0
        self.peak_op = ""
        self.peak_breakdown: tuple[int, ...] = tuple(self.by_category)
        self.category_peaks = [0] * len(CATEGORIES)
        self.measuring = True
        self.first_oom: OomInfo | None = None
        # Repeated periods (engine/repeats.py): the calls since recent boundaries, or a period being replayed.
        self.repeats = repeats
        self._recording: Recording | None = None
        self._skipping: Skipping | None = None
        self.boundaries_left: int | None = None     # Period instructions still to come, when known
        # A replayed stretch's calls (engine/memory_log.py STRETCH) seen to replay a period's calls one by one:
        # (period, stretch record, position, shift - reference) -> what they gave (StretchCalls)
        self.stretch_calls: dict[tuple, StretchCalls] = {}

    def run_allocate(self, op_ids: tuple[int, ...], shift: int, low: int, stream: str, time_s: float,
                     op: str) -> None:
        """allocate() for a Run: its op's ids, those >= low moved by shift (a micro-batch copy)."""
        stream_id = self.stream_ids[stream]
        if self._skipping is not None:
            if self._replayed_run(ALLOC, op_ids, shift, stream_id, time_s, op):
                return
            ids = moved_ids(op_ids, shift, low)
            if self._replayed(ALLOC, ids, stream_id, time_s, op):
                return
        else:
            ids = moved_ids(op_ids, shift, low)
        # allocate(), without its first steps done above (hot path)
        log = self.allocator._log
        log_start = len(log._raw) if log is not None else 0
        self._allocate(ids, stream_id, time_s, op)
        self._after(ALLOC, ids, stream_id, time_s, op, log_start, op_ids, shift)

    def run_free(self, op_ids: tuple[int, ...], shift: int, low: int, time_s: float, op: str) -> None:
        """free() for a Run (see run_allocate)."""
        if self._skipping is not None:
            if self._replayed_run(FREE, op_ids, shift, 0, time_s, op):
                return
            ids = moved_ids(op_ids, shift, low)
            if self._replayed(FREE, ids, 0, time_s, op):
                return
        else:
            ids = moved_ids(op_ids, shift, low)
        log = self.allocator._log
        log_start = len(log._raw) if log is not None else 0
        self._free(ids, time_s, op)
        self._after(FREE, ids, 0, time_s, op, log_start, op_ids, shift)

    def _replayed_run(self, kind: int, op_ids: tuple[int, ...], shift: int, stream_id: int, time_s: float,
                      op: str) -> bool:
        """The fast match of a replayed period's next call: the recorded call came from the same op ids moved
        by the same distance from the reference (so its relative ids are equal); replay it. False: no match
        (the general path then tries relative ids)."""
        skipping = self._skipping
        calls = skipping.calls
        if skipping.position < len(calls):
            call = calls[skipping.position]
            if call.template is op_ids and call.delta == shift - skipping.reference and call.kind == kind \
                    and call.op == op and call.stream == stream_id:
                self._replay(call, time_s, op)
                return True
        return False

    def collective_allocate(self, collective: Collective, stream: str, time_s: float) -> None:
        """allocate() for a collective's allocs (a micro-batch copy's: through its template's, as run_allocate)."""
        moved = collective.moved
        if moved is None:
            self.allocate(collective.allocs, stream, time_s, collective.name)
        else:
            self.run_allocate(moved[0], moved[2], moved[3], stream, time_s, collective.name)

    def collective_free(self, collective: Collective, time_s: float) -> None:
        """free() for a collective's frees (see collective_allocate)."""
        moved = collective.moved
        if moved is None:
            self.free(collective.frees, time_s, collective.name)
        else:
            self.run_free(moved[1], moved[2], moved[3], time_s, collective.name)

    def allocate(self, tensor_ids: tuple[int, ...], stream: str, time_s: float, op: str) -> None:
        """Allocate tensors in order (an OOM is recorded, then the limit is lifted and the run goes on)."""
        stream_id = self.stream_ids[stream]
        if self._skipping is not None and self._replayed(ALLOC, tensor_ids, stream_id, time_s, op):
            return
        log = self.allocator._log
        log_start = len(log._raw) if log is not None else 0
        self._allocate(tensor_ids, stream_id, time_s, op)
        self._after(ALLOC, tensor_ids, stream_id, time_s, op, log_start, None, 0)

    def _allocate(self, tensor_ids: tuple[int, ...], stream_id: int, time_s: float, op: str) -> None:
        allocator = self.allocator
        malloc = allocator.malloc
        tensors, handles, bytes_of, by_category = self.tensors, self.handles, self.bytes_of, self.by_category
        measuring, peaks = self.measuring, self.category_peaks
        for tid in tensor_ids:
            tensor = tensors[tid]
            try:
                handle = malloc(tensor.nbytes, stream_id, time_s, op, tensor.name, tensor.category)
            except OutOfMemory as error:
                # Record the first failure, then lift the limit and go on: the run still tells
                # the user how much memory the job would need and where the rest of it goes.
                if self.first_oom is None:
                    self.first_oom = self.oom_info(error, time_s, op, tid)
                allocator.capacity_bytes = UNBOUNDED_BYTES
                try:
                    handle = malloc(tensor.nbytes, stream_id, time_s, op, tensor.name, tensor.category)
                except OutOfMemory:
                    raise beyond_any_device(tensor.name, tensor.nbytes, op) from None
            handles[tid] = handle
            size = bytes_of[tid] = allocator.last_block_bytes     # block_bytes(handle)
            index = _CATEGORY_INDEX[tensor.category]
            total = by_category[index] = by_category[index] + size
            if measuring and total > peaks[index]:
                peaks[index] = total

    def free(self, tensor_ids: tuple[int, ...], time_s: float, op: str) -> None:
        """Free tensors (unknown or already freed ids are a program error)."""
        if self._skipping is not None and self._replayed(FREE, tensor_ids, 0, time_s, op):
            return
        log = self.allocator._log
        log_start = len(log._raw) if log is not None else 0
        self._free(tensor_ids, time_s, op)
        self._after(FREE, tensor_ids, 0, time_s, op, log_start, None, 0)

    def _free(self, tensor_ids: tuple[int, ...], time_s: float, op: str) -> None:
        free, tensors, handles, bytes_of, by_category = (self.allocator.free, self.tensors, self.handles,
                                                         self.bytes_of, self.by_category)
        for tid in tensor_ids:
            free(handles.pop(tid), time_s, op)
            by_category[_CATEGORY_INDEX[tensors[tid].category]] -= bytes_of.pop(tid)

    def _after(self, kind: int, tensor_ids: tuple[int, ...], stream_id: int, time_s: float, op: str,
               log_start: int, op_ids: tuple[int, ...] | None, shift: int) -> None:
        """After a call the allocator made: the sample, the peaks and, while recording, the recorded call (with a
        Run's op ids before moving and its shift; None and 0 for other calls)."""
        allocator = self.allocator
        allocated = allocator._allocated      # allocated_bytes, reserved_bytes (AllocatorBase)
        reserved = allocator._reserved
        breakdown = None
        if self.record_timeline:
            breakdown = tuple(self.by_category)
            self.samples += (time_s, allocated, reserved, breakdown)
        if self.measuring:
            if allocated > self.peak_allocated:
                self.peak_allocated = allocated
                self.peak_time_s = time_s
                self.peak_op = op
                self.peak_breakdown = breakdown = breakdown or tuple(self.by_category)
            if reserved > self.peak_reserved:
                self.peak_reserved = reserved
        recording = self._recording
        if recording is not None:
            log = allocator._log
            recording.calls.append((     # raw: a plain tuple of RecordedCall's fields, absolute ids and shift
                kind, tensor_ids, stream_id, op, allocated, reserved, breakdown or tuple(self.by_category),
                tuple(log._raw[log_start:]) if log is not None else (), op_ids, shift))

    # repeated periods (engine/repeats.py) --------------------------------------------------------
    def boundary(self, boundary: Period) -> None:
        """A point where a period may start: go on replaying, or look for this state among recent boundaries."""
        if not self.repeats:
            return
        if self.boundaries_left is not None:
            self.boundaries_left -= 1
        if self._skipping is not None:
            if self._skipping.advance(boundary):
                return
            self.catch_up()
        recording = self._recording
        if self.first_oom is not None:
            self._recording = None
            return
        if recording is None or (recording.low, recording.high) != (boundary.low, boundary.high):
            recording = self._recording = Recording(boundary)
        summary = (boundary.key, tuple(self.by_category), len(self.handles))
        state = None
        digest = _NONE_HASH
        if recording.worth_comparing(summary):
            handles = self.handles
            names = relative(tuple(handles), boundary.shift, boundary.low, boundary.high)
            labels = dict(zip(handles.values(), names))
            state = (tuple(sorted(names)), self.allocator.state_key(labels))
            digest = hash(state)
            period = recording.period_to(summary, state, boundary, digest)
            if period is not None:
                calls, step = period
                self._skipping = Skipping(boundary, calls, step, self.by_category)
                self._recording = None
                return
        if self.boundaries_left == 0:
            self._recording = None         # no boundary is left to end a period: recording is useless
            return
        recording.mark(summary, state, boundary, digest)

    def catch_up(self) -> None:
        """Bring the frozen allocator to where the replayed calls left it (before it is read or called)."""
        skipping = self._skipping
        if skipping is None:
            return
        self._skipping = None
        lag = skipping.reference - skipping.frozen_reference
        if lag:
            low, high = skipping.low, skipping.high
            self.handles = {(t + lag if low <= t < high else t): h for t, h in self.handles.items()}
            self.bytes_of = {(t + lag if low <= t < high else t): n for t, n in self.bytes_of.items()}
        self.by_category = list(skipping.by_category)
        log, self.allocator._log = self.allocator._log, None     # their events were replayed already
        measuring, self.measuring = self.measuring, False
        try:
            for call in skipping.calls[1:skipping.position]:
                if call.kind == BOUNDARY:
                    continue
                ids = absolute(call.ids, skipping.reference)
                if call.kind == ALLOC:
                    self._allocate(ids, call.stream, 0.0, call.op)
                else:
                    self._free(ids, 0.0, call.op)
        finally:
            self.allocator._log, self.measuring = log, measuring
        for tid, op in skipping.renamed.items():
            handle = self.handles.get(tid)
            if handle is not None:
                self.allocator.rename(handle, op)

    def stretch_key(self, record: int, shift: int) -> tuple | None:
        """The key of a replayed stretch's calls here (None: no period is being replayed)."""
        skipping = self._skipping
        if skipping is None:
            return None
        return (id(skipping.calls), record, skipping.position, shift - skipping.reference)

    def learn_stretch(self, key: tuple, skipping: Skipping, renamed: int) -> None:
        """After a stretch's calls were made one by one from the state `key` names: if they all replayed the period
        (still the same Skipping, no call renamed an allocation or replayed allocator events), keep what they gave."""
        _, _, first, _ = key
        if self._skipping is not skipping or len(skipping.renamed) != renamed or skipping.position <= first:
            return
        calls = skipping.calls[first:skipping.position]
        if any(call.kind == BOUNDARY or call.events for call in calls):
            return
        allocated = [call.allocated for call in calls]
        self.stretch_calls[key] = StretchCalls(skipping.calls, first, len(calls),
                                               tuple(map(max, zip(*(c.by_category for c in calls)))),
                                               allocated.index(max(allocated)), max(call.reserved for call in calls))

    def replay_stretch(self, known: StretchCalls, times, start: int) -> None:
        """Take the outcome of a stretch's calls at once (times[start:start + count] are theirs): what replaying
        them one by one gives."""
        skipping = self._skipping
        first, count = known.first, known.count
        calls = known.calls                        # skipping.calls (the key names them)
        skipping.position = first + count
        self.by_category = calls[first + count - 1].by_category
        if self.record_timeline:
            flat = [None] * (4 * count)
            flat[0::4] = times[start:start + count]
            flat[1::4] = [call.allocated for call in calls[first:first + count]]
            flat[2::4] = [call.reserved for call in calls[first:first + count]]
            flat[3::4] = [call.by_category for call in calls[first:first + count]]
            self.samples += flat
        if self.measuring:
            peaks = self.category_peaks
            for i, value in enumerate(known.category_max):
                if value > peaks[i]:
                    peaks[i] = value
            call = calls[first + known.allocated_peak]
            if call.allocated > self.peak_allocated:
                self.peak_allocated = call.allocated
                self.peak_time_s = times[start + known.allocated_peak]
                self.peak_op = call.op
                self.peak_breakdown = call.by_category
            if known.reserved_max > self.peak_reserved:
                self.peak_reserved = known.reserved_max

    def make_runs(self, words, times, start: int, streams: list, end: int) -> int:
        """Make logged Run calls (engine/memory_log.py) from words[start] (before words[end]) while no period is
        being replayed and no allocator events are recorded: run_allocate / run_free in one loop (the calls of
        ranks whose memory never repeats); returns the index of the first word not made.

        What _allocate, _free and _after do, inlined (the hot path of a rank whose allocator layout takes a long
        transient to repeat: each call here is a few microseconds, a third of it was calls between them); an
        allocation the allocator refuses goes through _allocate's out-of-memory path for that tensor and the
        next ones of the call."""
        if self._skipping is not None or self.allocator._log is not None:
            return start
        allocator = self.allocator
        malloc, release = allocator.malloc, allocator.free
        tensors, handles, bytes_of, category_index = self.tensors, self.handles, self.bytes_of, _CATEGORY_INDEX
        timeline, samples, recording = self.record_timeline, self.samples, self._recording
        calls = recording.calls if recording is not None else None
        i = start
        while i < end:
            word = words[i]
            code = word & 15
            if code > 1:                           # RUN_ALLOC = ALLOC, RUN_FREE = FREE
                break
            stream_id = (word >> 4) & 255
            instruction = streams[stream_id][word >> 12]
            op = instruction.op
            shift, time_s, name = instruction.shift, times[i], op.name
            i += 1
            by_category = self.by_category
            if code:
                op_ids = op.frees
                ids = moved_ids(op_ids, shift, instruction.low)
                for tid in ids:
                    release(handles.pop(tid), time_s, name)
                    by_category[category_index[tensors[tid].category]] -= bytes_of.pop(tid)
                stream_id = 0
            else:
                op_ids = op.allocs
                ids = moved_ids(op_ids, shift, instruction.low)
                measuring, peaks = self.measuring, self.category_peaks
                for n, tid in enumerate(ids):
                    tensor = tensors[tid]
                    try:
                        handle = malloc(tensor.nbytes, stream_id, time_s, name, tensor.name, tensor.category)
                    except OutOfMemory:
                        self._allocate(ids[n:], stream_id, time_s, name)    # records the OOM, lifts the limit
                        break
                    handles[tid] = handle
                    size = bytes_of[tid] = allocator.last_block_bytes
                    index = category_index[tensor.category]
                    total = by_category[index] = by_category[index] + size
                    if measuring and total > peaks[index]:
                        peaks[index] = total
            # _after(code, ids, stream_id, time_s, name, 0, op_ids, shift), inlined
            allocated, reserved = allocator._allocated, allocator._reserved
            breakdown = None
            if timeline:
                breakdown = tuple(by_category)
                samples += (time_s, allocated, reserved, breakdown)
            if self.measuring:
                if allocated > self.peak_allocated:
                    self.peak_allocated = allocated
                    self.peak_time_s = time_s
                    self.peak_op = name
                    self.peak_breakdown = breakdown = breakdown or tuple(by_category)
                if reserved > self.peak_reserved:
                    self.peak_reserved = reserved
            if calls is not None:
                calls.append((code, ids, stream_id, name, allocated, reserved, breakdown or tuple(by_category), (),
                              op_ids, shift))
        return i

    def replay_runs(self, words, times, start: int, streams: list, end: int) -> int:
        """Replay logged Run calls (engine/memory_log.py) from words[start] (before words[end]) while they are the
        period's next calls (the fast match of _replayed_run, in one loop); returns the index of the first word
        not replayed."""
        skipping = self._skipping
        calls, reference = skipping.calls, skipping.reference
        count = len(calls)
        i = start
        while i < end and skipping.position < count:
            word = words[i]
            code = word & 15
            if code > 1:                           # RUN_ALLOC = ALLOC, RUN_FREE = FREE
                break
            stream_id = (word >> 4) & 255
            instruction = streams[stream_id][word >> 12]
            op = instruction.op
            call = calls[skipping.position]
            if call.template is not (op.frees if code else op.allocs) or call.kind != code \
                    or call.delta != instruction.shift - reference or call.op != op.name \
                    or call.stream != (0 if code else stream_id):
                break
            self._replay(call, times[i], op.name)
            i += 1
        return i

    def _replayed(self, kind: int, tensor_ids: tuple[int, ...], stream_id: int, time_s: float, op: str) -> bool:
        """Replay this call's outcome if it is the next call of the period; else catch up (False)."""
        skipping = self._skipping
        calls = skipping.calls
        if skipping.position < len(calls):
            call = calls[skipping.position]
            if call.kind == kind and call.stream == stream_id \
                    and call.ids == relative(tensor_ids, skipping.reference, skipping.low, skipping.high):
                if kind == ALLOC and op != call.op:
                    for tid in tensor_ids:
                        skipping.renamed[tid] = op
                self._replay(call, time_s, op)
                return True
        self.catch_up()
        return False

    def _replay(self, call: RecordedCall, time_s: float, op: str) -> None:
        """Take the recorded outcome of the next call of the period (what _after does, inlined: hot path)."""
        self._skipping.position += 1
        self.by_category = by_category = call.by_category   # a tuple while replaying; catch_up makes it a list
        if call.events:
            self._replay_events(call, time_s, op)
        allocated, reserved = call.allocated, call.reserved
        if self.record_timeline:
            self.samples += (time_s, allocated, reserved, by_category)
        # After one whole period replayed, the same outcomes again cannot raise a peak (Skipping.passes).
        if self.measuring and not self._skipping.passes:
            peaks = self.category_peaks
            if any(map(gt, by_category, peaks)):
                for i, value in enumerate(by_category):
                    if value > peaks[i]:
                        peaks[i] = value
            if allocated > self.peak_allocated:
                self.peak_allocated = allocated
                self.peak_time_s = time_s
                self.peak_op = op
                self.peak_breakdown = by_category
            if reserved > self.peak_reserved:
                self.peak_reserved = reserved

    def _replay_events(self, call: RecordedCall, time_s: float, op: str) -> None:
        append = self.allocator._log.append
        for event in call.events:
            event_op = op if event[5] == call.op else event[5]
            append(*event[:4], time_s, event_op, *event[6:])

    def start_measuring(self) -> None:
        """Reset peaks (torch.cuda.reset_peak_memory_stats) at the start of the measured iterations."""
        self.catch_up()
        self.measuring = True
        self.peak_reserved = self.allocator.reserved_bytes
        self.category_peaks = list(self.by_category)
        self.peak_allocated = self.allocator.allocated_bytes
        self.peak_breakdown = tuple(self.by_category)

    def outcome(self, event_rows: bool = False) -> MemoryOutcome:
        """What the calls made so far left (a replayed period caught up first); `event_rows`: the allocator's
        events as field tuples (AllocatorEvent(*row) makes each: what a memory worker hands back)."""
        self.catch_up()
        log = self.allocator._log
        events = (log.rows() if log is not None else []) if event_rows else self.allocator.events
        return MemoryOutcome(self.samples, events, self.allocator.segments(), self.first_oom,
                             max(self.peak_allocated, 0), self.peak_reserved, self.peak_time_s, self.peak_op,
                             self.peak_breakdown, self.category_peaks)

    def oom_info(self, error: OutOfMemory, time_s: float, op: str, tensor_id: int) -> OomInfo:
        """Describe an out-of-memory failure: what was live and which op asked."""
        live = sorted(((self.tensors[t].name, b) for t, b in self.bytes_of.items()),
                      key=lambda item: (-item[1], item[0]))
        return OomInfo(
            time_s=time_s, op=op, tensor=self.tensors[tensor_id].name,
            requested_bytes=error.requested_bytes, allocated_bytes=error.allocated_bytes,
            reserved_bytes=error.reserved_bytes, capacity_bytes=error.capacity_bytes,
            live_by_category={name: self.by_category[i] for i, name in enumerate(CATEGORIES)},
            largest_live=tuple(live[:10]))

