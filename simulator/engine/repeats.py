"""Repeated periods of a rank's memory calls: recognise one, then replay its outcomes instead of the allocator.

A pipeline stage in its steady state runs the same calls for every micro-batch, on tensors whose ids differ
by a constant (micro-batch copies, workload/stage.py). The lowering marks the start of each copied
micro-batch's forward with a `Period(key, shift, low, high)` instruction: ids in [low, high) belong to
micro-batch copies and move by `shift` from the template's. At each boundary RankMemory computes the
allocator's state with every live tensor named by its id relative to the boundary (`state_key`). When a
boundary gives the same relative state as one of the last MAX_BOUNDARIES boundaries, the calls in between
(relative to that boundary) are a period: from the same relative state, the same relative calls give the same outcomes
(allocated, reserved, bytes by category, allocator events), because the allocator model depends on
tensor sizes, categories and streams, which copies share, never on ids or handles. So while the following
calls match the period one by one (same kind, relative ids and stream), their outcomes are replayed from
the recording and the allocator stays frozen at the boundary's state; a boundary after a complete period
moves the reference on. At the first call that does not match (or when the allocator must be read), the
allocator catches up: live tensors are renamed by the distance moved, the matched calls of the current
period are applied to it silently, and allocations attributed to ops whose names differ from the
recording's (names carry micro-batch indices) are renamed. Results are identical to calling the allocator
every time (tests/test_repeats.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from simulator.parallel.program import Period

ALLOC, FREE, BOUNDARY = 0, 1, 2
MAX_BOUNDARIES = 40          # a period may span this many boundaries (a 1F1B stage keeps up to pp micro-batches)
_RELATIVE = 1 << 50          # ids of micro-batch copies are stored as (id - reference) - _RELATIVE (< 0)


class RecordedCall(NamedTuple):
    """One memory call of a recording: what it was (relative ids) and what it gave (a named tuple: cheaper to
    make than a frozen dataclass, and a recording makes hundreds of thousands)."""

    kind: int
    ids: tuple[int, ...]             # relative ids (absolute while being recorded: Recording)
    stream: int
    op: str
    allocated: int
    reserved: int
    by_category: tuple[int, ...]     # after the call: also its largest per category (a call only allocates or
                                     # only frees)
    events: tuple[tuple, ...]        # the allocator's raw event tuples (time at index 4, op at index 5)
    template: tuple[int, ...] | None = None   # a Run's op ids before moving (the fast match), or None
    delta: int = 0                   # that Run's shift minus the reference (absolute while being recorded)


@dataclass(frozen=True, slots=True)
class RecordedBoundary:
    """A boundary inside a recording: its key and its shift (absolute while a Recording keeps it, relative to
    the reference once rebased)."""

    key: str
    shift: int
    kind: int = BOUNDARY
    template: None = None            # never matches a Run's call


def relative(ids: tuple[int, ...], reference: int, low: int, high: int) -> tuple[int, ...]:
    """`ids` with those of micro-batch copies expressed relative to `reference` (negative numbers)."""
    return tuple([v - reference - _RELATIVE if low <= v < high else v for v in ids])


def absolute(ids: tuple[int, ...], reference: int) -> tuple[int, ...]:
    """The inverse of `relative` for the given reference."""
    return tuple([v + _RELATIVE + reference if v < 0 else v for v in ids])


def rebase(calls: list, reference: int, low: int, high: int) -> list:
    """A recording's raw calls (plain tuples with absolute ids and shifts, as Recording keeps them) made relative
    to `reference`."""
    out = []
    for call in calls:
        if type(call) is RecordedBoundary:
            out.append(RecordedBoundary(call.key, call.shift - reference))
        else:
            kind, ids, stream, op, allocated, reserved, by_category, events, template, shift = call
            out.append(RecordedCall(kind, relative(ids, reference, low, high), stream, op, allocated, reserved,
                                    by_category, events, template, shift - reference if template is not None else 0))
    return out


class Recording:
    """The calls since the oldest of the last MAX_BOUNDARIES boundaries, raw: plain tuples of RecordedCall's fields
    with absolute ids and, in `delta`, a Run's absolute shift; RecordedBoundary with its absolute shift (`rebase`
    makes a period of them relative RecordedCalls, once, when one is found: most recorded calls never are)."""

    __slots__ = ("low", "high", "calls", "marks")

    def __init__(self, boundary: Period):
        self.low, self.high = boundary.low, boundary.high
        self.calls: list = []
        self.marks: list[tuple] = []    # (summary, hash, state or None, shift, index in calls)

    def worth_comparing(self, summary: tuple) -> bool:
        """Whether a kept boundary has the same cheap summary (key, bytes by category, live tensor count):
        only then is the full state computed (a growing phase, like GPipe's forwards, never pays for it)."""
        return any(mark[0] == summary for mark in self.marks)

    def period_to(self, summary: tuple, state: tuple, boundary: Period, digest: int) -> tuple[list, int] | None:
        """If `state` (whose hash is `digest`) was seen at a kept boundary: the calls since then (relative to its
        shift), and the shift distance; else None."""
        for mark_summary, h, key, shift, index in self.marks:
            if key is not None and h == digest and mark_summary == summary and shift != boundary.shift \
                    and key == state:
                return rebase(self.calls[index:], shift, self.low, self.high), boundary.shift - shift
        return None

    def mark(self, summary: tuple, state: tuple | None, boundary: Period, digest: int) -> None:
        """Keep this boundary (dropping the oldest beyond MAX_BOUNDARIES); `state` None: not computed; `digest`:
        hash(state) (hashing a whole allocator state once per boundary is enough)."""
        self.marks.append((summary, digest, state, boundary.shift, len(self.calls)))
        self.calls.append(RecordedBoundary(boundary.key, boundary.shift))
        if len(self.marks) > MAX_BOUNDARIES:
            del self.marks[0]
            cut = self.marks[0][4]
            # Calls before the oldest kept boundary are never read again; drop them once they are half the
            # list (copying the kept calls at every boundary cost more than the calls themselves).
            if 2 * cut >= len(self.calls):
                del self.calls[:cut]
                self.marks = [(m, h, k, s, i - cut) for m, h, k, s, i in self.marks]


class Skipping:
    """A recognised period being replayed: the recording, the position in it and the frozen reference."""

    __slots__ = ("low", "high", "calls", "position", "reference", "frozen_reference", "step", "by_category",
                 "renamed", "passes")

    def __init__(self, boundary: Period, calls: list, step: int, by_category: list[int]):
        self.low, self.high = boundary.low, boundary.high
        self.calls = calls                       # calls[0] is the period's starting boundary
        self.position = 1
        self.reference = boundary.shift          # the id shift at the start of the period replayed now
        self.frozen_reference = boundary.shift   # the allocator's tensors are named as of this shift
        self.step = step                         # shift distance of one period
        self.by_category = tuple(by_category)    # bytes by category at the frozen boundary
        self.renamed: dict[int, str] = {}        # tensor id -> op that really allocated it (names differ)
        # Whole periods replayed: after one, replaying the same outcomes again cannot raise a peak (a peak
        # reset ends the replay: RankMemory.start_measuring catches up first).
        self.passes = 0

    def advance(self, boundary: Period) -> bool:
        """A boundary where the period expects one (inside it, or starting the next): True, and move on."""
        if boundary.low != self.low or boundary.high != self.high:
            return False
        if self.position == len(self.calls):
            first = self.calls[0]
            if boundary.key == first.key and boundary.shift - self.reference == self.step:
                self.reference = boundary.shift
                self.position = 1
                self.passes += 1
                return True
            return False
        call = self.calls[self.position]
        if call.kind == BOUNDARY and call.key == boundary.key and boundary.shift - self.reference == call.shift:
            self.position += 1
            return True
        return False
