"""One rank's memory: tensors through an allocator model, with a timeline and per-category peaks."""

from __future__ import annotations

from simulator.engine.allocator import Allocator, OutOfMemory
from simulator.trace.records import MemorySample, OomInfo
from simulator.workload.graph import CATEGORIES, Tensor

_CATEGORY_INDEX = {name: i for i, name in enumerate(CATEGORIES)}
UNBOUNDED_BYTES = 1 << 44     # capacity after an OOM (16 TiB): keep simulating to measure the requirement


class RankMemory:
    """Allocates and frees a rank's tensors, keeping allocated bytes by category and the peak."""

    def __init__(self, allocator: Allocator, tensors: dict[int, Tensor], stream_ids: dict[str, int],
                 record_timeline: bool = True):
        self.allocator = allocator
        self.tensors = tensors
        self.stream_ids = stream_ids
        self.record_timeline = record_timeline
        self.handles: dict[int, int] = {}
        self.bytes_of: dict[int, int] = {}
        self.by_category = [0] * len(CATEGORIES)
        self.samples: list[MemorySample] = []
        self.peak_allocated = -1
        self.peak_reserved = 0
        self.peak_time_s = 0.0
        self.peak_op = ""
        self.peak_breakdown: tuple[int, ...] = tuple(self.by_category)
        self.category_peaks = [0] * len(CATEGORIES)
        self.measuring = True
        self.first_oom: OomInfo | None = None

    def allocate(self, tensor_ids: tuple[int, ...], stream: str, time_s: float, op: str) -> None:
        """Allocate tensors in order; raises OutOfMemory (with the allocator's numbers) on failure."""
        allocator = self.allocator
        stream_id = self.stream_ids[stream]
        for tid in tensor_ids:
            tensor = self.tensors[tid]
            try:
                handle = allocator.malloc(tensor.nbytes, stream_id, time_s, op, tensor.name,
                                          tensor.category)
            except OutOfMemory as error:
                # Record the first failure, then lift the limit and go on: the run still tells
                # the user how much memory the job would need and where the rest of it goes.
                if self.first_oom is None:
                    self.first_oom = self.oom_info(error, time_s, op, tid)
                allocator.capacity_bytes = UNBOUNDED_BYTES
                handle = allocator.malloc(tensor.nbytes, stream_id, time_s, op, tensor.name,
                                          tensor.category)
            self.handles[tid] = handle
            size = allocator.block_bytes(handle)
            self.bytes_of[tid] = size
            index = _CATEGORY_INDEX[tensor.category]
            self.by_category[index] += size
            if self.measuring and self.by_category[index] > self.category_peaks[index]:
                self.category_peaks[index] = self.by_category[index]
        self._sample(time_s, op)

    def free(self, tensor_ids: tuple[int, ...], time_s: float, op: str) -> None:
        """Free tensors (unknown or already freed ids are a program error)."""
        allocator = self.allocator
        for tid in tensor_ids:
            handle = self.handles.pop(tid)
            allocator.free(handle, time_s, op)
            self.by_category[_CATEGORY_INDEX[self.tensors[tid].category]] -= self.bytes_of.pop(tid)
        self._sample(time_s, op)

    def _sample(self, time_s: float, op: str) -> None:
        allocated = self.allocator.allocated_bytes
        reserved = self.allocator.reserved_bytes
        if self.record_timeline:
            self.samples.append(MemorySample(time_s, allocated, reserved, tuple(self.by_category)))
        if self.measuring:
            if allocated > self.peak_allocated:
                self.peak_allocated = allocated
                self.peak_time_s = time_s
                self.peak_op = op
                self.peak_breakdown = tuple(self.by_category)
            if reserved > self.peak_reserved:
                self.peak_reserved = reserved

    def start_measuring(self) -> None:
        """Reset peaks (torch.cuda.reset_peak_memory_stats) at the start of the measured iterations."""
        self.measuring = True
        self.peak_allocated = -1
        self.peak_reserved = self.allocator.reserved_bytes
        self.category_peaks = list(self.by_category)
        self._sample_peak_now()

    def _sample_peak_now(self) -> None:
        self.peak_allocated = self.allocator.allocated_bytes
        self.peak_breakdown = tuple(self.by_category)

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
