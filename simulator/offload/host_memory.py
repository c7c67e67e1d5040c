"""Host memory of offload: host tensors, torch's pinned caching host allocator, pageable and NVMe bytes, node sums.

Pinned buffers (cudaHostAlloc) come from torch's CachingHostAllocator (aten/src/ATen/core/CachingHostAllocator.h,
`allocate`): every request is rounded up to a power of two, a freed block is cached in the free list of its size and
reused by the next request of that size, and cached blocks are only returned by empty_cache (never, in training).
So pinned memory is counted by its blocks, reserved until the end. Pageable host tensors (torch's CPU allocator)
count their bytes while they live; tensors on NVMe count against the drives, not host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from simulator.errors import PlanError

PINNED = "pinned"
PAGEABLE = "pageable"
NVME = "nvme"
MEDIA = (PINNED, PAGEABLE, NVME)


@dataclass(frozen=True, slots=True)
class HostTensor:
    """A tensor outside the GPU: its size, memory category (workload.graph.CATEGORIES) and medium (MEDIA)."""

    id: int
    name: str
    nbytes: int
    category: str
    medium: str = PINNED

    def __post_init__(self) -> None:
        if self.medium not in MEDIA:
            raise PlanError(f"host tensor {self.name!r}: medium = {self.medium!r} must be one of {', '.join(MEDIA)}")


def pinned_block_bytes(nbytes: int) -> int:
    """Bytes the CachingHostAllocator reserves for a request: the next power of two (c10::llvm::PowerOf2Ceil)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


@dataclass
class HostOutcome:
    """What a rank's host memory calls left: peaks (bytes), the breakdown at the host peak, and the timeline."""

    peak_bytes: int = 0                # pinned blocks reserved + pageable bytes live, at most
    peak_time_s: float = 0.0
    pinned_reserved_bytes: int = 0     # pinned blocks at the end (the cache never shrinks)
    pageable_peak_bytes: int = 0
    nvme_peak_bytes: int = 0
    breakdown_at_peak: dict[str, int] = field(default_factory=dict)   # live bytes by category; "pinned_cache": free
    timeline: list[tuple[float, int]] = field(default_factory=list)    # (time, host bytes) after each call


class HostMemory:
    """One rank's host memory replayed from its (time, +1 | -1, tensor ids) events (engine RankTrace.host_events)."""

    def __init__(self, tensors: dict[int, HostTensor]):
        self.tensors = tensors
        self.live: dict[int, int] = {}             # tensor id -> bytes it holds (a pinned block's size)
        self.cached: dict[int, int] = {}           # pinned block size -> free blocks of that size
        self.pinned_reserved = 0
        self.pageable = 0
        self.nvme = 0
        self.by_category: dict[str, int] = {}

    def replay(self, events) -> HostOutcome:
        """Apply `events` in order; the outcome's peak is the highest host level reached."""
        outcome = HostOutcome()
        for time_s, sign, ids in events:
            for tid in ids:
                if sign > 0:
                    self._allocate(tid)
                else:
                    self._free(tid)
            level = self.pinned_reserved + self.pageable
            outcome.timeline.append((time_s, level))
            if level > outcome.peak_bytes:
                outcome.peak_bytes, outcome.peak_time_s = level, time_s
                cache = self.pinned_reserved - sum(b for t, b in self.live.items()
                                                   if self.tensors[t].medium == PINNED)
                outcome.breakdown_at_peak = {**dict(sorted(self.by_category.items())), "pinned_cache": cache}
            outcome.pageable_peak_bytes = max(outcome.pageable_peak_bytes, self.pageable)
            outcome.nvme_peak_bytes = max(outcome.nvme_peak_bytes, self.nvme)
        outcome.pinned_reserved_bytes = self.pinned_reserved
        return outcome

    def _allocate(self, tid: int) -> None:
        tensor = self.tensors[tid]
        if tid in self.live:
            raise PlanError(f"host tensor {tensor.name!r} allocated twice")
        size = tensor.nbytes
        if tensor.medium == PINNED:
            size = pinned_block_bytes(size)
            free = self.cached.get(size, 0)
            if free:
                self.cached[size] = free - 1
            else:
                self.pinned_reserved += size
        elif tensor.medium == PAGEABLE:
            self.pageable += size
        else:
            self.nvme += size
        self.live[tid] = size
        if tensor.medium != NVME:
            self.by_category[tensor.category] = self.by_category.get(tensor.category, 0) + size

    def _free(self, tid: int) -> None:
        tensor = self.tensors[tid]
        size = self.live.pop(tid, None)
        if size is None:
            raise PlanError(f"host tensor {tensor.name!r} freed but not allocated")
        if tensor.medium == PINNED:
            self.cached[size] = self.cached.get(size, 0) + 1
        elif tensor.medium == PAGEABLE:
            self.pageable -= size
        else:
            self.nvme -= size
        if tensor.medium != NVME:
            self.by_category[tensor.category] -= size


def node_peak_bytes(levels: list[tuple[list[tuple[float, int]], int]]) -> tuple[int, float]:
    """The highest summed host level of one node and when: `levels` holds (a rank's timeline, how many of the
    node's ranks run it) pairs. At an instant where several calls happen, each rank counts with the highest level
    it reaches during the instant (ranks' simultaneous calls have no order between them).

    Returns:
        (peak bytes, its time; 0.0 when nothing was allocated).
    """
    instants: dict[float, dict[int, tuple[int, int]]] = {}    # time -> timeline index -> (highest, level after)
    for k, (timeline, _) in enumerate(levels):
        for time_s, level in timeline:
            calls = instants.setdefault(time_s, {})
            highest = calls[k][0] if k in calls else level
            calls[k] = (max(highest, level), level)
    current = [0] * len(levels)
    peak, peak_time = 0, 0.0
    for time_s in sorted(instants):
        calls = instants[time_s]
        total = sum((calls[k][0] if k in calls else current[k]) * count for k, (_, count) in enumerate(levels))
        if total > peak:
            peak, peak_time = total, time_s
        for k, (_, after) in calls.items():
            current[k] = after
    return peak, peak_time
