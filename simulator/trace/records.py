"""Value types the engine produces: executed spans, memory samples, allocator events, per-rank traces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

COMM_PHASE = "comm"      # Span.phase of collectives and transfers (communication, not compute)


class Span(NamedTuple):
    """One executed instruction that took time on a stream (a kernel, a transfer, a collective).

    A named tuple, not a frozen dataclass: a cluster-scale run creates millions and a frozen dataclass's
    constructor costs seven times as much (2.2 vs 0.3 µs each)."""

    rank: int
    stream: str          # "compute", "comm", "h2d", "d2h", ...
    name: str            # op name, e.g. "layer3.mlp.fc1"
    kind: str            # op class ("gemm", ...) or "send"/"recv"/"all_reduce"/...
    phase: str           # "fwd", "bwd_input", "bwd_weight", "recompute", "optimizer", "comm"
    start_s: float
    end_s: float
    flops: float = 0.0
    bytes: int = 0
    iteration: int = 0


class MemorySample(NamedTuple):
    """Memory of one rank right after a change: allocated and reserved bytes, allocated by category (a named
    tuple for the same reason as Span)."""

    time_s: float
    allocated: int
    reserved: int
    by_category: tuple[int, ...]     # allocated bytes per category, order of workload.graph.CATEGORIES


@dataclass(frozen=True, slots=True)
class AllocatorEvent:
    """One allocator trace entry in the vocabulary of PyTorch's memory snapshot (device_traces)."""

    action: str          # alloc | free_requested | free_completed | segment_alloc | segment_free | oom
    addr: int
    size: int            # requested bytes for alloc/free, segment bytes for segment events
    stream: int
    time_s: float
    op: str = ""         # the op that caused it (becomes a frame in the snapshot)
    tensor: str = ""     # tensor name
    category: str = ""


@dataclass(frozen=True)
class OomInfo:
    """Where and why a rank ran out of memory."""

    time_s: float
    op: str
    tensor: str
    requested_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    capacity_bytes: int
    live_by_category: dict[str, int]
    largest_live: tuple[tuple[str, int], ...]     # (tensor name, bytes), largest first


@dataclass
class RankTrace:
    """Everything recorded for one simulated rank."""

    rank: int
    device: str
    capacity_bytes: int
    spans: list[Span] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)
    allocator_events: list[AllocatorEvent] = field(default_factory=list)
    final_segments: list[dict] = field(default_factory=list)   # snapshot "segments" at the end
    peak_allocated: int = 0
    peak_reserved: int = 0
    peak_time_s: float = 0.0
    breakdown_at_peak: dict[str, int] = field(default_factory=dict)
    category_peaks: dict[str, int] = field(default_factory=dict)   # each category's own peak
    peak_op: str = ""
    oom: OomInfo | None = None
    host_events: list = field(default_factory=list)   # (time_s, +1 | -1, host tensor ids): offload's host memory


@dataclass
class Trace:
    """The result of one simulation: a RankTrace per simulated rank plus iteration boundaries."""

    ranks: list[RankTrace]
    iteration_bounds_s: list[tuple[float, float]]   # (start, end) of each measured iteration
    end_time_s: float
