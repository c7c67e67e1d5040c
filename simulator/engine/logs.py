"""Typed columns the engine appends to while it runs: a stream's spans, and time intervals (communication)."""

from __future__ import annotations

from array import array
from itertools import compress
from operator import gt
from struct import Struct, pack
from typing import TYPE_CHECKING

from simulator.parallel.program import Run
from simulator.trace.records import COMM_PHASE

if TYPE_CHECKING:
    import numpy as np


class _PhaseCodes(dict):
    """phase -> a small integer code, given on first use (codes only index the report's lookup table)."""

    def __missing__(self, phase: str) -> int:
        code = self[phase] = len(self)
        return code


PHASE_CODES = _PhaseCodes()
COMM_CODE = PHASE_CODES[COMM_PHASE]


def info_phase(info) -> str:
    """The phase of a span's info: a Run's op phase, a tuple info's own field, else (an instruction) communication."""
    if type(info) is Run:
        return info.op.phase
    return info[0][4] if type(info) is tuple else COMM_PHASE


class SpanLog:
    """One stream's spans, in order: per span its info (engine/timelines.py), start and end time (doubles) and
    phase code (PHASE_CODES). The report sums durations from the typed columns without Python floats."""

    __slots__ = ("infos", "starts", "ends", "phases")

    def __init__(self) -> None:
        self.infos: list = []
        self.starts = array("d")
        self.ends = array("d")
        self.phases = array("H")

    def __len__(self) -> int:
        return len(self.infos)

    def add(self, info, start_s: float, end_s: float) -> None:
        self.infos.append(info)
        self.starts.append(start_s)
        self.ends.append(end_s)
        self.phases.append(PHASE_CODES[info_phase(info)])

    def add_comm(self, instruction, start_s: float, end_s: float) -> None:
        """add() for a communication instruction (Collective, Send, Recv)."""
        self.infos.append(instruction)
        self.starts.append(start_s)
        self.ends.append(end_s)
        self.phases.append(COMM_CODE)

    def extend(self, infos, starts: bytes, ends: bytes, phases: array) -> None:
        """Append spans column by column: times packed as doubles (`packer`), `phases` an array("H") of codes."""
        self.infos += infos
        self.starts.frombytes(starts)
        self.ends.frombytes(ends)
        self.phases.extend(phases)

    def since(self, n: int) -> tuple:
        """The spans from the n-th on, as (infos, starts, ends, phases) columns (compared with a record's)."""
        return self.infos[n:], self.starts[n:], self.ends[n:], self.phases[n:]


def span_columns(infos, starts, ends, phases: array) -> tuple:
    """Columns as SpanLog.since gives them."""
    return list(infos), array("d", starts), array("d", ends), phases


def phase_array(infos) -> array:
    """The phase codes of `infos`."""
    return array("H", [PHASE_CODES[info_phase(info)] for info in infos])


class IntervalLog:
    """Time intervals (start_s, end_s) in the order added, as two columns of doubles."""

    __slots__ = ("starts", "ends")

    def __init__(self) -> None:
        self.starts = array("d")
        self.ends = array("d")

    def __len__(self) -> int:
        return len(self.starts)

    def add(self, start_s: float, end_s: float) -> None:
        self.starts.append(start_s)
        self.ends.append(end_s)

    def extend(self, starts: bytes, ends: bytes) -> None:
        """Append intervals from their times packed as doubles (`packer`)."""
        self.starts.frombytes(starts)
        self.ends.frombytes(ends)

    def since(self, n: int) -> tuple[array, array]:
        """The intervals from the n-th on, as (starts, ends) columns."""
        return self.starts[n:], self.ends[n:]

    def sorted_pairs(self) -> np.ndarray:
        """The intervals sorted as sorted() sorts the (start, end) pairs, as an (n, 2) float array."""
        import numpy as np    # here, not at import: a large run's engine starts sooner (numpy is needed after it)
        return sorted_pairs(np.frombuffer(self.starts), np.frombuffer(self.ends))


def packer(count: int):
    """A function packing `count` floats, given as arguments, into doubles' bytes (array.frombytes reads them,
    several times faster than array.extend converts a tuple)."""
    return Struct(f"{count}d").pack


def doubles(values) -> bytes:
    """`values` packed as doubles."""
    return pack(f"{len(values)}d", *values)


def positive(starts, ends) -> tuple:
    """The (starts, ends) of the intervals that end after they start (all of them, unchanged, when so)."""
    keep = list(map(gt, ends, starts))
    if all(keep):
        return starts, ends
    return tuple(compress(starts, keep)), tuple(compress(ends, keep))


def sorted_pairs(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The intervals (starts[i], ends[i]) sorted by start, then end (a stable sort, as sorted() sorts the pairs),
    as a new (n, 2) float array."""
    import numpy as np        # (see IntervalLog.sorted_pairs)
    pairs = np.empty((len(starts), 2))
    pairs[:, 0] = starts
    pairs[:, 1] = ends
    step = np.diff(pairs[:, 0])
    if (step >= 0).all() and (np.diff(pairs[:, 1])[step == 0] >= 0).all():
        return pairs            # sorted already
    return pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))]
