"""What the executor hands back: each rank's trace and communication, and the deadlock report."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from simulator.engine.timelines import SampleColumns, SpanColumns
from simulator.errors import DeadlockError
from simulator.trace.records import Trace
from simulator.workload.graph import CATEGORIES

if TYPE_CHECKING:
    import numpy as np

    from simulator.engine.memory import MemoryOutcome
    from simulator.engine.rank_state import RankState


def _no_pairs() -> np.ndarray:
    """An empty (0, 2) interval array (numpy is imported where it is used: a large run's engine starts sooner)."""
    import numpy as np
    return np.empty((0, 2))


@dataclass(frozen=True, eq=False)
class RankCommunication:
    """One rank's communication, seconds: when its communication instructions were moving bytes (from the
    launch — all members or both peers posted — to completion; waiting for a late peer is not
    communication) and when its compute stream was held up by it: the part of a compute-stream wait, on
    an event a communication stream signalled, during which that stream was transferring, plus any
    communication instruction run on the compute stream itself."""

    intervals: np.ndarray = field(default_factory=_no_pairs)     # (n, 2) (start, end), sorted
    exposed_intervals: np.ndarray = field(default_factory=_no_pairs)
    # Offload (program.Transfer): when copies over PCIe or to the drives moved bytes, when the host computed
    # (route "host"), and when the compute stream waited for either (or ran a transfer itself).
    offload_intervals: np.ndarray = field(default_factory=_no_pairs)
    host_intervals: np.ndarray = field(default_factory=_no_pairs)
    offload_exposed_intervals: np.ndarray = field(default_factory=_no_pairs)

    @property
    def total_s(self) -> float:
        """Time with at least one communication instruction in progress (overlaps counted once)."""
        return self.between(-math.inf, math.inf)[0]

    @property
    def exposed_s(self) -> float:
        """Time the compute stream waited on communication."""
        return self.between(-math.inf, math.inf)[1]

    def between(self, start_s: float, end_s: float) -> tuple[float, float]:
        """(total, exposed) communication seconds inside the window [start_s, end_s]."""
        return covered(self.intervals, start_s, end_s), covered(self.exposed_intervals, start_s, end_s)

    def offload_between(self, start_s: float, end_s: float) -> tuple[float, float, float]:
        """(offload traffic, host compute, exposed offload) seconds inside the window [start_s, end_s]."""
        return (covered(self.offload_intervals, start_s, end_s), covered(self.host_intervals, start_s, end_s),
                covered(self.offload_exposed_intervals, start_s, end_s))

    def __eq__(self, other: object) -> bool:
        if type(other) is not RankCommunication:
            return NotImplemented
        import numpy as np
        return all(np.array_equal(getattr(self, name), getattr(other, name))
                   for name in ("intervals", "exposed_intervals", "offload_intervals", "host_intervals",
                                "offload_exposed_intervals"))


@dataclass
class EngineTrace(Trace):
    """The engine's Trace plus each simulated rank's communication, by rank."""

    communication: dict[int, RankCommunication] = field(default_factory=dict)


@dataclass(frozen=True)
class BlockedInstruction:
    """A stream that cannot go on: its rank, the stream, the index and text of the instruction, and why."""

    rank: int
    stream: str
    index: int
    instruction: str
    reason: str

    def __str__(self) -> str:
        return f"rank {self.rank} stream {self.stream} instruction {self.index} {self.instruction}: {self.reason}"


class EngineDeadlock(DeadlockError):
    """The programs cannot finish; `blocked` lists every blocked (rank, stream, instruction)."""

    def __init__(self, message: str, blocked: tuple[BlockedInstruction, ...]):
        super().__init__(message)
        self.blocked = blocked


def covered(pairs: np.ndarray, start_s: float, end_s: float) -> float:
    """Length of the union of the sorted intervals `pairs` (logs.sorted_pairs) clipped to [start_s, end_s]: each
    interval starts no earlier than the furthest end before it, and the positive lengths are added in order
    (numpy's cumsum adds in order, so the sum is the one of a loop over the intervals, to the bit;
    tests/test_stretches.py)."""
    if not len(pairs):
        return 0.0
    import numpy as np
    ends = np.minimum(pairs[:, 1], end_s)
    reach = np.empty(len(ends))
    reach[0] = -math.inf
    np.maximum.accumulate(ends[:-1], out=reach[1:])
    begins = np.maximum(np.maximum(pairs[:, 0], start_s), reach)
    lengths = (ends - begins)[ends > begins]
    return float(np.cumsum(lengths)[-1]) if len(lengths) else 0.0


def _event_time(event: tuple) -> float:
    return event[0]


def collect(states: list[RankState], outcomes: list[MemoryOutcome], end_time_s: float) -> EngineTrace:
    """Each simulated rank's trace and communication once the simulation has ended, with its memory outcome."""
    ranks = []
    bounds: list[tuple[float, float]] = []
    communication: dict[int, RankCommunication] = {}
    for state, memory in zip(states, outcomes):
        # Sorted: with lookahead, streams of a rank append them out of time order (totals are unchanged).
        communication[state.program.rank] = RankCommunication(
            state.comm_intervals.sorted_pairs(), state.exposed_intervals.sorted_pairs(),
            state.offload_intervals.sorted_pairs(), state.host_intervals.sorted_pairs(),
            state.offload_exposed.sorted_pairs())
        trace = state.trace
        trace.spans = SpanColumns(state.program.rank, [(name, state.spans[name]) for name in state.program.streams])
        trace.memory = SampleColumns(memory.samples)
        trace.allocator_events = memory.events
        trace.final_segments = memory.segments
        trace.oom = memory.oom
        trace.peak_allocated = memory.peak_allocated
        trace.peak_reserved = memory.peak_reserved
        trace.peak_time_s = memory.peak_time_s
        trace.peak_op = memory.peak_op
        trace.breakdown_at_peak = dict(zip(CATEGORIES, memory.peak_breakdown))
        trace.category_peaks = dict(zip(CATEGORIES, memory.category_peaks))
        # Host memory calls in time order (streams running ahead log out of order; ties keep the log's order).
        trace.host_events = sorted(state.host_events, key=_event_time)
        ranks.append(trace)
        if not bounds:
            starts = {it: t for label, it, t in state.marks if label == "iteration_start"}
            ends = {it: t for label, it, t in state.marks if label == "iteration_end"}
            bounds = [(starts[i], ends[i]) for i in sorted(starts) if i in ends]
    return EngineTrace(ranks, bounds, end_time_s, communication)
