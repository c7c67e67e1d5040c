"""Allocator models shared contract: the Allocator protocol, OutOfMemory, the exact allocator, a factory."""

from __future__ import annotations

import operator
from bisect import bisect_left, insort
from dataclasses import astuple
from typing import Protocol, runtime_checkable

from simulator.errors import ScenarioError
from simulator.trace.records import AllocatorEvent
from simulator.trace.snapshot import make_frames

# Fake device addresses start here (a typical CUDA virtual address) inside a 256 TiB space.
ADDRESS_BASE = 0x7F00_0000_0000
ADDRESS_SPACE_BYTES = 1 << 48
ADDRESS_BITS = 50                   # sorted keys pack (size << ADDRESS_BITS) | address into one int
ADDRESS_MASK = (1 << ADDRESS_BITS) - 1
ALLOCATOR_KINDS = ("caching", "exact")
SMALL_SIZE_BYTES = 1 << 20          # snapshot "segment_type": small when <= 1 MiB


class OutOfMemory(Exception):
    """An allocation the device cannot hold (an internal signal the engine catches; not a MemsimError)."""

    def __init__(self, requested_bytes: int, allocated_bytes: int, reserved_bytes: int, capacity_bytes: int):
        super().__init__(
            f"out of memory: tried to allocate {requested_bytes} bytes with {allocated_bytes} allocated, "
            f"{reserved_bytes} reserved of {capacity_bytes} bytes capacity"
        )
        self.requested_bytes = requested_bytes
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes
        self.capacity_bytes = capacity_bytes

    def __reduce__(self):
        return (OutOfMemory, (self.requested_bytes, self.allocated_bytes, self.reserved_bytes, self.capacity_bytes))


@runtime_checkable
class Allocator(Protocol):
    """What the engine calls: malloc/free with handles, statistics, events and snapshot segments.

    Statistics follow PyTorch: `allocated_bytes` counts the (rounded) block of every allocation that
    has not been freed; a block freed while other streams still use it (`pending_streams`) leaves
    `allocated_bytes` (and `requested_bytes`) at once but stays reserved and unusable
    ("active_pending_free") until `complete_pending`.
    """

    capacity_bytes: int
    events: list[AllocatorEvent]

    def malloc(self, nbytes: int, stream: int, time_s: float, op: str = "", tensor: str = "",
               category: str = "") -> int: ...

    def free(self, handle: int, time_s: float, op: str = "", pending_streams: tuple[int, ...] = ()) -> None: ...

    def complete_pending(self, handle: int, time_s: float) -> None: ...

    def empty_cache(self, time_s: float) -> None: ...

    def block_bytes(self, handle: int) -> int: ...

    @property
    def allocated_bytes(self) -> int: ...

    @property
    def reserved_bytes(self) -> int: ...

    @property
    def requested_bytes(self) -> int: ...

    @property
    def inactive_split_bytes(self) -> int: ...

    @property
    def peak_allocated_bytes(self) -> int: ...

    @property
    def peak_reserved_bytes(self) -> int: ...

    def reset_peaks(self) -> None: ...

    def segments(self) -> list[dict]: ...


class AddressSpace:
    """Deterministic fake virtual addresses: best fit over free ranges, coalescing on release."""

    __slots__ = ("_free", "_start_size", "_end_start")

    def __init__(self, base: int = ADDRESS_BASE, size_bytes: int = ADDRESS_SPACE_BYTES):
        self._free: list[int] = [(size_bytes << ADDRESS_BITS) | base]   # size << ADDRESS_BITS | start, sorted
        self._start_size = {base: size_bytes}
        self._end_start = {base + size_bytes: base}

    def reserve(self, size_bytes: int) -> int:
        """Take the smallest free range that fits `size_bytes` (lowest address on ties); return its start."""
        i = bisect_left(self._free, size_bytes << ADDRESS_BITS)
        if i == len(self._free):
            raise MemoryError(f"fake address space exhausted reserving {size_bytes} bytes")
        k = self._free.pop(i)
        size, start = k >> ADDRESS_BITS, k & ADDRESS_MASK
        del self._start_size[start]
        del self._end_start[start + size]
        if size > size_bytes:
            self._add(start + size_bytes, size - size_bytes)
        return start

    def release(self, start: int, size_bytes: int) -> None:
        """Give back a range taken by `reserve`, merging it with free neighbours."""
        end = start + size_bytes
        before = self._end_start.get(start)
        if before is not None:
            self._remove(before, start - before)
            start = before
        after = self._start_size.get(end)
        if after is not None:
            self._remove(end, after)
            end += after
        self._add(start, end - start)

    def _add(self, start: int, size: int) -> None:
        insort(self._free, (size << ADDRESS_BITS) | start)
        self._start_size[start] = size
        self._end_start[start + size] = start

    def _remove(self, start: int, size: int) -> None:
        del self._free[bisect_left(self._free, (size << ADDRESS_BITS) | start)]
        del self._start_size[start]
        del self._end_start[start + size]


class EventLog:
    """Allocator events kept as tuples while running and turned into AllocatorEvents when read."""

    __slots__ = ("_raw", "_events")

    def __init__(self):
        self._raw: list[tuple] = []
        self._events: list[AllocatorEvent] = []

    def append(self, *fields) -> None:
        """Record one event: (action, addr, size, stream, time_s, op, tensor, category)."""
        self._raw.append(fields)

    def rows(self) -> list[tuple]:
        """All events so far as field tuples (what a memory worker hands back: faster to pickle)."""
        return [astuple(event) for event in self._events] + self._raw

    def materialize(self) -> list[AllocatorEvent]:
        """All events so far, in order, as one growing list."""
        if self._raw:
            self._events.extend([AllocatorEvent(*f) for f in self._raw])
            self._raw.clear()
        return self._events


class AllocatorBase:
    """Statistics, peaks, handles and the event log that both allocator models share."""

    def __init__(self, capacity_bytes: int, record_events: bool):
        self.capacity_bytes = capacity_bytes
        self._log = EventLog() if record_events else None
        self._zero: set[int] = set()        # handles of 0-byte requests (they never reach the allocator)
        self._live: dict = {}               # handle -> the model's record of a live allocation
        self._next_handle = 1
        self._allocated = self._reserved = self._requested = self._active = self._inactive_split = 0
        self._peak_allocated = self._peak_reserved = 0
        self.last_block_bytes = 0           # block_bytes of the handle the last malloc returned (RankMemory)

    @property
    def events(self) -> list[AllocatorEvent]:
        """Allocator events in order (empty when built with record_events=False)."""
        return self._log.materialize() if self._log is not None else []

    @property
    def allocated_bytes(self) -> int:
        """Bytes of allocated blocks, rounded as the model rounds (torch.cuda.memory_allocated)."""
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        """Bytes held from the device (torch.cuda.memory_reserved)."""
        return self._reserved

    @property
    def requested_bytes(self) -> int:
        """Requested (unrounded) bytes of allocated blocks."""
        return self._requested

    @property
    def active_bytes(self) -> int:
        """Allocated plus pending-free block bytes (PyTorch's active_bytes)."""
        return self._active

    @property
    def inactive_split_bytes(self) -> int:
        """Free bytes inside partly used segments: what empty_cache cannot release."""
        return self._inactive_split

    @property
    def peak_allocated_bytes(self) -> int:
        """Highest allocated_bytes since construction or the last reset_peaks()."""
        return self._peak_allocated

    @property
    def peak_reserved_bytes(self) -> int:
        """Highest reserved_bytes since construction or the last reset_peaks()."""
        return self._peak_reserved

    def reset_peaks(self) -> None:
        """Set both peaks to the current values (torch.cuda.reset_peak_memory_stats)."""
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved

    def _zero_handle(self, nbytes: int) -> int:
        if nbytes < 0:
            raise ValueError(f"malloc: nbytes = {nbytes} must be >= 0")
        handle = self._next_handle
        self._next_handle += 1
        self._zero.add(handle)
        self.last_block_bytes = 0
        return handle

    def _unknown(self, what: str, handle: int) -> None:
        """A handle that is neither live nor pending: fine for 0-byte handles, else raise ValueError.

        `complete_pending` of a handle already released (freed on its own stream only, or completed
        by empty_cache / the out-of-memory path) is a no-op.
        """
        if handle in self._zero:
            if what == "free":
                self._zero.discard(handle)
            return
        live = handle in self._live
        if what == "complete_pending" and 0 < handle < self._next_handle and not live:
            return
        kind = "a pending" if what == "complete_pending" else "a live or pending" if what == "block_bytes" else "a live"
        raise ValueError(f"{what}: handle {handle} is not {kind} allocation")


def _segment_type(nbytes: int) -> str:
    return "small" if nbytes <= SMALL_SIZE_BYTES else "large"


class ExactAllocator(AllocatorBase):
    """Ideal memory: every allocation takes exactly its requested bytes, nothing is cached.

    allocated == reserved == the sum of live requested bytes, except while a free is pending on
    other streams: then the bytes leave `allocated_bytes` (as in PyTorch) but stay in
    `reserved_bytes` until `complete_pending` (the memory is still in use). An allocation that would
    take reserved past capacity first completes pending frees (PyTorch synchronizes its events before
    giving up), then records an `oom` event and raises OutOfMemory. Each live allocation is its
    own snapshot segment at a deterministic fake address, so snapshots stay valid.
    """

    def __init__(self, capacity_bytes: int, *, record_events: bool = True):
        super().__init__(capacity_bytes, record_events)
        self._space = AddressSpace()
        # handle -> (addr, nbytes, stream, op, tensor, category)
        self._live: dict[int, tuple] = {}
        self._pending: dict[int, tuple] = {}

    # operations --------------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int, time_s: float, op: str = "", tensor: str = "",
               category: str = "") -> int:
        """Allocate exactly `nbytes`; return a handle (0-byte requests get a handle and no memory).

        Raises:
            OutOfMemory: reserved + nbytes would exceed capacity even after pending frees complete.
        """
        nbytes = operator.index(nbytes)
        if nbytes <= 0:
            return self._zero_handle(nbytes)
        if self._reserved + nbytes > self.capacity_bytes and self._pending:
            self._complete_all_pending(time_s)
        if self._reserved + nbytes > self.capacity_bytes:
            if self._log is not None:
                self._log.append("oom", self.capacity_bytes - self._reserved, nbytes, stream, time_s, op, tensor,
                                 category)
            raise OutOfMemory(nbytes, self._allocated, self._reserved, self.capacity_bytes)
        addr = self._space.reserve(-(-nbytes // 512) * 512)
        handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = (addr, nbytes, stream, op, tensor, category)
        self.last_block_bytes = nbytes
        self._allocated += nbytes
        self._requested += nbytes
        self._reserved += nbytes
        self._active += nbytes
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
        if self._log is not None:
            self._log.append("segment_alloc", addr, nbytes, stream, time_s, op, tensor, category)
            self._log.append("alloc", addr, nbytes, stream, time_s, op, tensor, category)
        return handle

    def free(self, handle: int, time_s: float, op: str = "", pending_streams: tuple[int, ...] = ()) -> None:
        """Free an allocation; if other streams still use it, it stays reserved until complete_pending."""
        rec = self._live.pop(handle, None)
        if rec is None:
            return self._unknown("free", handle)
        addr, nbytes, stream, a_op, tensor, category = rec
        self._allocated -= nbytes
        self._requested -= nbytes
        if self._log is not None:
            self._log.append("free_requested", addr, nbytes, stream, time_s, op or a_op, tensor, category)
        if pending_streams and any(s != stream for s in pending_streams):
            self._pending[handle] = rec
            return
        self._release(rec, time_s, op)

    def complete_pending(self, handle: int, time_s: float) -> None:
        """The other streams are done with a pending block: release it (no-op if already released)."""
        rec = self._pending.pop(handle, None)
        if rec is None:
            return self._unknown("complete_pending", handle)
        self._release(rec, time_s, "")

    def empty_cache(self, time_s: float) -> None:
        """Complete pending frees (PyTorch synchronizes outstanding events); nothing is cached."""
        self._complete_all_pending(time_s)

    def block_bytes(self, handle: int) -> int:
        """Bytes this allocation counts in allocated_bytes (its requested bytes; 0 for 0-byte handles)."""
        rec = self._live.get(handle) or self._pending.get(handle)
        if rec is not None:
            return rec[1]
        self._unknown("block_bytes", handle)
        return 0

    def segments(self) -> list[dict]:
        """One snapshot segment per live or pending allocation, in address order."""
        recs = [(rec, False) for rec in self._live.values()] + [(rec, True) for rec in self._pending.values()]
        out = []
        for (addr, nbytes, stream, op, tensor, category), pending in sorted(recs, key=lambda r: r[0][0]):
            frames = make_frames(op, tensor, category)
            out.append({
                "device": 0, "address": addr, "total_size": nbytes,
                "allocated_size": 0 if pending else nbytes, "active_size": nbytes,
                "requested_size": nbytes, "stream": stream, "segment_type": _segment_type(nbytes),
                "segment_pool_id": (0, 0), "is_expandable": False, "frames": frames,
                "blocks": [{"address": addr, "size": nbytes, "requested_size": nbytes,
                            "state": "active_pending_free" if pending else "active_allocated",
                            "frames": frames}],
            })
        return out

    def state_key(self, owners: dict[int, object]) -> tuple:
        """Everything later calls depend on, live allocations named by `owners` (handle -> label) instead of
        handles and op names (see CachingAllocator.state_key)."""
        live = sorted((rec[0], rec[1], rec[2], rec[4], rec[5], owners.get(h)) for h, rec in self._live.items())
        return (tuple(live), tuple(self._space._free), len(self._pending), self.capacity_bytes,
                self._allocated, self._reserved, self._requested, self._active)

    def rename(self, handle: int, op: str) -> None:
        """Set the op a live allocation is attributed to (snapshot frames, free events)."""
        rec = self._live.get(handle)
        if rec is not None:
            self._live[handle] = rec[:3] + (op,) + rec[4:]

    # internals ---------------------------------------------------------------------------------
    def _release(self, rec: tuple, time_s: float, op: str) -> None:
        addr, nbytes, stream, a_op, tensor, category = rec
        self._reserved -= nbytes
        self._active -= nbytes
        self._space.release(addr, -(-nbytes // 512) * 512)
        if self._log is not None:
            op = op or a_op
            self._log.append("free_completed", addr, nbytes, stream, time_s, op, tensor, category)
            self._log.append("segment_free", addr, nbytes, stream, time_s, op, tensor, category)

    def _complete_all_pending(self, time_s: float) -> None:
        for handle in sorted(self._pending):
            self._release(self._pending.pop(handle), time_s, "")


def _check_int(key: str, value: object, minimum: int, rule: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ScenarioError(f"{key} = {value!r} must be {rule}")
    return value


def make_allocator(kind: str, capacity_bytes: int, *, max_split_size_bytes: int | None = None,
                   roundup_power2_divisions: int | None = None, expandable_segments: bool = False,
                   record_events: bool = True) -> Allocator:
    """Build the allocator model of one device.

    Args:
        kind: "caching" (PyTorch's CUDA caching allocator) or "exact" (sum of live bytes).
        capacity_bytes: memory the allocator may reserve (device memory minus what lives outside it).
        max_split_size_bytes: PyTorch's max_split_size_mb in bytes (>= 20 MiB); None = unlimited.
        roundup_power2_divisions: a power of two; None or 1 = plain 512-byte rounding.
        expandable_segments: one growing segment per (stream, pool) instead of cudaMalloc segments.
        record_events: keep the event list (turn off for big runs; statistics still work).
        The three caching options are ignored by the exact allocator.

    Returns:
        An object satisfying the Allocator protocol.

    Raises:
        ScenarioError: an unknown kind or an out-of-range setting.
    """
    if kind not in ALLOCATOR_KINDS:
        raise ScenarioError(f"allocator.kind = {kind!r} is not one of: {', '.join(ALLOCATOR_KINDS)}")
    _check_int("allocator capacity_bytes (device memory left for the allocator)", capacity_bytes, 1,
               "a positive integer number of bytes")
    if kind == "exact":
        return ExactAllocator(capacity_bytes, record_events=record_events)
    from simulator.engine.caching_allocator import CachingAllocator, LARGE_BUFFER_BYTES

    if max_split_size_bytes is not None:
        _check_int("allocator.max_split_size_bytes", max_split_size_bytes, LARGE_BUFFER_BYTES,
                   f">= {LARGE_BUFFER_BYTES} bytes (20 MiB), as PyTorch requires of max_split_size_mb")
    if roundup_power2_divisions is not None:
        value = roundup_power2_divisions
        _check_int("allocator.roundup_power2_divisions", value, 1, "a power of two (1, 2, 4, 8, ...)")
        if value & (value - 1):
            raise ScenarioError(f"allocator.roundup_power2_divisions = {value!r} must be a power of two "
                                "(1, 2, 4, 8, ...)")
    if not isinstance(expandable_segments, bool):
        raise ScenarioError(f"allocator.expandable_segments = {expandable_segments!r} must be true or false")
    return CachingAllocator(capacity_bytes, max_split_size_bytes=max_split_size_bytes,
                            roundup_power2_divisions=roundup_power2_divisions,
                            expandable_segments=expandable_segments, record_events=record_events)
