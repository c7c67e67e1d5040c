"""PyTorch's CUDA caching allocator as a model: rounding, pools, segments, best fit, splitting, streams, OOM retry."""

from __future__ import annotations

from bisect import bisect_left, insort
from itertools import chain
from operator import attrgetter, index as _index

from simulator.engine.allocator import (ADDRESS_BITS, ADDRESS_MASK, SMALL_SIZE_BYTES, AddressSpace, AllocatorBase,
                                        OutOfMemory)
from simulator.trace.snapshot import make_frames

# Constants of c10/cuda/CUDACachingAllocator.cpp (torch 2.13).
MIN_BLOCK_BYTES = 512                  # kMinBlockSize: every size is rounded to a multiple of this
SMALL_BUFFER_BYTES = 2 << 20           # kSmallBuffer: small-pool segment (and expandable small page)
LARGE_BUFFER_BYTES = 20 << 20          # kLargeBuffer: segment for 1-10 MiB requests (and large page)
MIN_LARGE_ALLOC_BYTES = 10 << 20       # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 << 20            # kRoundLarge: larger segments are rounded up to this
MAX_NON_SPLIT_ROUNDING_BYTES = 20 << 20  # an oversize block serves requests at most this much smaller
_UNLIMITED = 1 << 62                   # max_split_size when unset (SIZE_MAX in PyTorch)
_GAP_BYTES = 2 << 20                   # fake-address gap after each segment (the viewer merges touching ones)
_NO_INFO = ("", "", "")

FREE, ALLOCATED, PENDING = 0, 1, 2     # block states; unmapped expandable space is FREE with mapped=False


def round_size(nbytes: int, roundup_power2_divisions: int | None = None) -> int:
    """Block size PyTorch uses for a request of `nbytes` (round_size in CUDACachingAllocator.cpp).

    Args:
        nbytes: requested bytes.
        roundup_power2_divisions: if > 1, sizes above 512 * divisions round up to the next of
            `divisions` equal steps between powers of two.

    Returns:
        The rounded size in bytes: at least 512 and a multiple of 512.
    """
    if nbytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    d = roundup_power2_divisions or 1
    if d > 1 and nbytes > MIN_BLOCK_BYTES * d:
        if nbytes & (nbytes - 1) == 0:
            return nbytes
        floor_pow2 = 1 << (nbytes.bit_length() - 1)
        step = floor_pow2 >> (d.bit_length() - 1)
        return -(-nbytes // step) * step if step else floor_pow2 << 1
    return -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def segment_size(size: int) -> int:
    """Bytes cudaMalloc'd for a new segment serving a rounded `size` (get_allocation_size)."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


class _Segment:
    """A cudaMalloc'd segment, or the reserved virtual range of one expandable segment."""

    __slots__ = ("addr", "size", "stream", "small", "key", "page", "head", "info", "layout")

    def __init__(self, addr: int, size: int, stream: int, small: bool, page: int, info: tuple):
        self.addr = addr
        self.size = size
        self.stream = stream
        self.small = small
        self.key = 2 * stream + small      # free lists are per (stream, pool)
        self.page = page                   # mapping granularity; 0 for a cudaMalloc'd segment
        self.head = None
        self.info = info                   # (op, tensor, category) that created it
        self.layout = None                 # its _Layout as of the last state_key; None once a block changed


class _Block:
    """A contiguous piece of a segment: free, allocated, pending free, or (expandable) unmapped."""

    __slots__ = ("addr", "size", "requested", "prev", "next", "state", "mapped", "seg", "info", "handle")

    def __init__(self, addr: int, size: int, seg: _Segment, mapped: bool = True):
        self.addr = addr
        self.size = size
        self.requested = 0
        self.prev = None
        self.next = None
        self.state = FREE
        self.mapped = mapped
        self.seg = seg
        self.info = _NO_INFO
        self.handle = 0                    # the handle of its last allocation (read while ALLOCATED only)


class _Layout:
    """A segment as state_key names it: its fields and every block's (address, size, state, mapped, requested),
    flat, with the handles of its allocated blocks in block order (not compared: state_key names them). Kept on
    the segment until one of its blocks changes, its hash computed once (most segments of a big run stay the same
    from one period boundary to the next: the key was rebuilt and rehashed block by block every time)."""

    __slots__ = ("fields", "handles", "hash")

    def __init__(self, seg: _Segment):
        fields = [seg.addr, seg.size, seg.stream, seg.small, seg.page, seg.info]
        handles = []
        b = seg.head
        while b is not None:
            fields += (b.addr, b.size, b.state, b.mapped, b.requested)
            if b.state == ALLOCATED:
                handles.append(b.handle)
            b = b.next
        self.fields = tuple(fields)
        self.handles = tuple(handles)
        self.hash = hash(self.fields)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not _Layout:
            return NotImplemented
        return self.hash == other.hash and self.fields == other.fields


_handles = attrgetter("handles")


def _link_after(block: _Block, new: _Block) -> None:
    new.prev = block
    new.next = block.next
    if block.next is not None:
        block.next.prev = new
    block.next = new


def _absorb_next(block: _Block) -> None:
    """Merge block.next into block (the lower block object survives)."""
    nxt = block.next
    block.size += nxt.size
    block.next = nxt.next
    if nxt.next is not None:
        nxt.next.prev = block


def _expandable_size(block: _Block) -> int:
    """A free block's size plus the unmapped space right after it (it can grow into that)."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


class CachingAllocator(AllocatorBase):
    """The PyTorch CUDA caching allocator of one device (see shared/reference/allocator.md).

    Free blocks sit in sorted int lists `size << ADDRESS_BITS | address`, one per (stream, pool),
    so best fit is a bisect. Statistics: reserved = mapped segment bytes; allocated = sizes of
    allocated blocks (rounded, including unsplit waste); requested = their requested sizes
    (PyTorch lowers its requested stat only when a pending free completes; here it falls with
    allocated, so allocated >= requested always holds); inactive_split = free blocks of split
    segments (not tracked for expandable segments, as in PyTorch). A block freed with other
    `pending_streams` leaves allocated at once and becomes reusable at complete_pending, which
    frees it right away (PyTorch notices at its next malloc); empty_cache and the OOM retry
    complete every pending free first, as PyTorch synchronizes their events.
    """

    def __init__(self, capacity_bytes: int, *, max_split_size_bytes: int | None = None,
                 roundup_power2_divisions: int | None = None, expandable_segments: bool = False,
                 record_events: bool = True):
        super().__init__(capacity_bytes, record_events)
        self._max_split = max_split_size_bytes if max_split_size_bytes is not None else _UNLIMITED
        self._divisions = roundup_power2_divisions if (roundup_power2_divisions or 1) > 1 else None
        self._expandable = expandable_segments
        self._space = AddressSpace()
        self._free: dict[int, list[int]] = {}      # segment key -> sorted size << ADDRESS_BITS | addr
        self._free_at: dict[int, _Block] = {}      # address -> free mapped block
        self._unmapped: dict[int, list[int]] = {}  # segment key -> sorted addresses of unmapped blocks
        self._unmapped_at: dict[int, _Block] = {}
        self._segments: dict[int, _Segment] = {}   # cudaMalloc'd segments and expandable ranges by address
        self._live: dict[int, _Block] = {}
        self._pending: dict[int, _Block] = {}

    # public operations -------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int, time_s: float, op: str = "", tensor: str = "",
               category: str = "") -> int:
        """Allocate `nbytes` on `stream`; return a handle (0-byte requests take no memory, as in PyTorch).

        Raises:
            OutOfMemory: no cached block fits and no new segment fits, even after releasing the cache.
        """
        nbytes = _index(nbytes)
        if nbytes <= 0:
            return self._zero_handle(nbytes)
        if self._divisions is None:
            size = -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES
        else:
            size = round_size(nbytes, self._divisions)
        small = size <= SMALL_SIZE_BYTES
        info = (op, tensor, category)
        key = 2 * stream + small
        free = self._free.get(key)
        block = None
        if free:
            if self._expandable:
                block = self._take_free_block(free, size)
            else:
                # _take_free_block without expandable segments, inlined (the hot path of a big run)
                i = bisect_left(free, size << ADDRESS_BITS)
                if i < len(free):
                    entry = free[i]
                    bsize = entry >> ADDRESS_BITS
                    max_split = self._max_split
                    if (size >= max_split or bsize < max_split) \
                            and (size < max_split or bsize < size + MAX_NON_SPLIT_ROUNDING_BYTES):
                        del free[i]
                        block = self._free_at.pop(entry & ADDRESS_MASK)
        if block is None:
            block = self._new_block(size, small, stream, nbytes, time_s, info)
            free = self._free.get(key)
        block.seg.layout = None
        remaining = block.size - size
        if small or self._expandable:
            split = remaining >= MIN_BLOCK_BYTES
        else:
            split = remaining > SMALL_SIZE_BYTES and size < self._max_split
        already_split = block.prev is not None or block.next is not None
        if split:
            addr = block.addr + size
            rest = _Block(addr, remaining, block.seg)
            nxt = rest.next = block.next     # _link_after(block, rest), inlined
            if nxt is not None:
                nxt.prev = rest
            rest.prev = block
            block.next = rest
            block.size = size
            if free is None:
                free = self._free[key] = []
            insort(free, (remaining << ADDRESS_BITS) | addr)
            self._free_at[addr] = rest
            if not self._expandable:
                self._inactive_split += -size if already_split else remaining
        elif already_split and not self._expandable:
            self._inactive_split -= block.size
            size = block.size
        else:
            size = block.size
        block.state = ALLOCATED
        block.requested = nbytes
        block.info = info
        handle = block.handle = self._next_handle
        self._next_handle = handle + 1
        self._live[handle] = block
        self.last_block_bytes = size
        allocated = self._allocated = self._allocated + size
        self._active += size
        self._requested += nbytes
        if allocated > self._peak_allocated:
            self._peak_allocated = allocated
        if self._log is not None:
            self._log.append("alloc", block.addr, nbytes, stream, time_s, op, tensor, category)
        return handle

    def free(self, handle: int, time_s: float, op: str = "", pending_streams: tuple[int, ...] = ()) -> None:
        """Free an allocation; if streams other than its own still use it, it waits for complete_pending."""
        block = self._live.pop(handle, None)
        if block is None:
            return self._unknown("free", handle)
        self._allocated -= block.size
        self._requested -= block.requested
        if self._log is None and not pending_streams:
            # _free_block without events, inlined (the hot path of a big run)
            self._active -= block.size
            block.state = FREE
            block.requested = 0
            block.info = _NO_INFO
            self._insert_free(block)
            return None
        stream = block.seg.stream
        if self._log is not None:
            a_op, tensor, category = block.info
            self._log.append("free_requested", block.addr, block.requested, stream, time_s, op or a_op, tensor,
                             category)
        if pending_streams and any(s != stream for s in pending_streams):
            block.state = PENDING
            block.seg.layout = None
            self._pending[handle] = block
            return
        self._free_block(block, time_s, op)

    def complete_pending(self, handle: int, time_s: float) -> None:
        """The other streams finished with a pending block: return it to the cache (no-op if done already)."""
        block = self._pending.pop(handle, None)
        if block is None:
            return self._unknown("complete_pending", handle)
        self._free_block(block, time_s, "")

    def empty_cache(self, time_s: float) -> None:
        """Complete pending frees, then release every entirely free segment (and free expandable pages)."""
        self._release_cached(time_s, _NO_INFO)

    def block_bytes(self, handle: int) -> int:
        """Bytes this allocation counts in allocated_bytes: its rounded (maybe unsplit) block size."""
        block = self._live.get(handle) or self._pending.get(handle)
        if block is not None:
            return block.size
        self._unknown("block_bytes", handle)
        return 0

    def segments(self) -> list[dict]:
        """Current state in the snapshot "segments" format, sorted by address.

        An expandable segment is reported as one segment per contiguous mapped range, as PyTorch does.
        """
        out = []
        for seg in self._segments.values():
            b = seg.head
            while b is not None:
                if b.mapped:
                    out.append(_segment_dict(seg, b))
                    while b is not None and b.mapped:
                        b = b.next
                else:
                    b = b.next
        out.sort(key=lambda s: s["address"])
        return out

    def state_key(self, owners: dict[int, object]) -> tuple:
        """Everything later calls depend on, with live blocks named by `owners` (handle -> label) instead of
        handles and op names: equal keys mean equal futures for equally named calls (engine/repeats.py).

        The segments' _Layouts (fields and blocks) by address, then the labels of their allocated blocks in that
        order (None for a handle `owners` does not name). The layouts fix which blocks those are, so two keys are
        equal exactly when every segment has the same blocks with the same labels."""
        segments = self._segments
        layouts = []
        for addr in sorted(segments):
            seg = segments[addr]
            layout = seg.layout
            if layout is None:
                layout = seg.layout = _Layout(seg)
            layouts.append(layout)
        labels = tuple(map(owners.get, chain.from_iterable(map(_handles, layouts))))
        return (tuple(layouts), labels, tuple(self._space._free), len(self._pending), self.capacity_bytes,
                self._allocated, self._reserved, self._requested, self._active, self._inactive_split)

    def rename(self, handle: int, op: str) -> None:
        """Set the op a live allocation is attributed to (snapshot frames, free events)."""
        block = self._live.get(handle)
        if block is not None:
            block.info = (op,) + block.info[1:]

    # free lists ----------------------------------------------------------------------------------
    def _push_free(self, block: _Block) -> None:
        key = block.seg.key
        free = self._free.get(key)
        if free is None:
            free = self._free[key] = []
        insort(free, (block.size << ADDRESS_BITS) | block.addr)
        self._free_at[block.addr] = block

    def _pop_free(self, block: _Block) -> None:
        free = self._free[block.seg.key]
        del free[bisect_left(free, (block.size << ADDRESS_BITS) | block.addr)]
        del self._free_at[block.addr]

    def _take_free_block(self, free: list[int], size: int) -> _Block | None:
        """Best fit: the smallest free block >= size of this stream and pool (get_free_block)."""
        i = bisect_left(free, size << ADDRESS_BITS)
        n = len(free)
        if i == n:
            return None
        if self._expandable:
            grow = _expandable_size(self._free_at[free[i] & ADDRESS_MASK])
            while i + 1 < n:
                nxt = _expandable_size(self._free_at[free[i + 1] & ADDRESS_MASK])
                if nxt >= grow:
                    break
                i, grow = i + 1, nxt
        bsize = free[i] >> ADDRESS_BITS
        if size < self._max_split <= bsize:
            return None            # an oversize block is not split for a smaller request
        if size >= self._max_split and bsize >= size + MAX_NON_SPLIT_ROUNDING_BYTES:
            return None            # nor given whole to a much smaller oversize request
        return self._free_at.pop(free.pop(i) & ADDRESS_MASK)

    def _insert_free(self, block: _Block) -> _Block:
        """Merge a free mapped block with free mapped neighbours and put it in its free list."""
        free_at = self._free_at
        seg = block.seg
        seg.layout = None
        free = self._free.get(seg.key)
        if free is None:
            free = self._free[seg.key] = []
        delta = 0
        prev = block.prev
        if prev is not None and prev.state == FREE and prev.mapped:
            del free[bisect_left(free, (prev.size << ADDRESS_BITS) | prev.addr)]
            del free_at[prev.addr]
            delta -= prev.size
            _absorb_next(prev)
            block = prev
        nxt = block.next
        if nxt is not None and nxt.state == FREE and nxt.mapped:
            del free[bisect_left(free, (nxt.size << ADDRESS_BITS) | nxt.addr)]
            del free_at[nxt.addr]
            delta -= nxt.size
            _absorb_next(block)
        insort(free, (block.size << ADDRESS_BITS) | block.addr)
        free_at[block.addr] = block
        if not seg.page:
            if block.prev is not None or block.next is not None:
                delta += block.size
            self._inactive_split += delta
        return block

    def _free_block(self, block: _Block, time_s: float, op: str) -> None:
        if self._log is not None:
            a_op, tensor, category = block.info
            self._log.append("free_completed", block.addr, block.requested, block.seg.stream, time_s, op or a_op,
                             tensor, category)
        self._active -= block.size
        block.state = FREE
        block.requested = 0
        block.info = _NO_INFO
        self._insert_free(block)

    # new segments and the out-of-memory path -------------------------------------------------
    def _new_block(self, size: int, small: bool, stream: int, nbytes: int, time_s: float, info: tuple) -> _Block:
        block = self._alloc_block(size, small, stream, time_s, info)
        if block is None and self._max_split < _UNLIMITED and not self._expandable:
            if self._release_available(size, 2 * stream + small, time_s, info):
                block = self._alloc_block(size, small, stream, time_s, info)
        if block is None:
            self._release_cached(time_s, info)
            block = self._alloc_block(size, small, stream, time_s, info)
        if block is None:
            if self._log is not None:
                self._log.append("oom", self.capacity_bytes - self._reserved, size, stream, time_s, *info)
            raise OutOfMemory(nbytes, self._allocated, self._reserved, self.capacity_bytes)
        return block

    def _alloc_block(self, size: int, small: bool, stream: int, time_s: float, info: tuple) -> _Block | None:
        """cudaMalloc a new segment for `size` (or map expandable pages); None if it would exceed capacity."""
        if self._expandable:
            return self._alloc_expandable(size, small, stream, time_s, info)
        seg_bytes = segment_size(size)
        if self._reserved + seg_bytes > self.capacity_bytes:
            return None
        addr = self._space.reserve(seg_bytes + _GAP_BYTES)
        seg = _Segment(addr, seg_bytes, stream, small, 0, info)
        seg.head = block = _Block(addr, seg_bytes, seg)
        self._segments[addr] = seg
        self._grow_reserved(seg_bytes)
        if self._log is not None:
            self._log.append("segment_alloc", addr, seg_bytes, stream, time_s, *info)
        return block

    def _grow_reserved(self, nbytes: int) -> None:
        self._reserved += nbytes
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved

    def _release_segment(self, block: _Block, time_s: float, info: tuple) -> None:
        """cudaFree a whole free segment (release_block)."""
        self._pop_free(block)
        seg = block.seg
        del self._segments[seg.addr]
        self._space.release(seg.addr, seg.size + _GAP_BYTES)
        self._reserved -= seg.size
        if self._log is not None:
            self._log.append("segment_free", seg.addr, seg.size, seg.stream, time_s,
                             *(info if info[0] or info[1] else seg.info))

    def _release_available(self, size: int, key: int, time_s: float, info: tuple) -> bool:
        """Free oversize cached segments of this stream and pool (release_available_cached_blocks)."""
        free = self._free.get(key) or []
        target = max(size, self._max_split)
        i = bisect_left(free, target << ADDRESS_BITS)
        if i < len(free):
            block = self._free_at[free[i] & ADDRESS_MASK]
            if block.prev is not None or block.next is not None:
                return False
            self._release_segment(block, time_s, info)
            return True
        released = 0
        j = len(free) - 1
        while j >= 0 and released < target and free[j] >> ADDRESS_BITS >= self._max_split:
            block = self._free_at[free[j] & ADDRESS_MASK]
            if block.prev is None and block.next is None:
                released += block.size
                self._release_segment(block, time_s, info)
            j -= 1
        return released >= target

    def _release_cached(self, time_s: float, info: tuple) -> None:
        """Complete pending frees, then release whole free segments, large pool first (release_cached_blocks)."""
        for handle in sorted(self._pending):
            self._free_block(self._pending.pop(handle), time_s, "")
        for small in (0, 1):
            to_unmap = []
            for key in sorted(k for k in self._free if k & 1 == small):
                for entry in list(self._free[key]):
                    block = self._free_at[entry & ADDRESS_MASK]
                    if block.seg.page:
                        to_unmap.append(block)
                    elif block.prev is None and block.next is None:
                        self._release_segment(block, time_s, info)
            for block in to_unmap:
                hole = self._unmap_block(block, time_s, info)
                if hole is not None and hole.prev is None and hole.next is None:
                    self._release_expandable(hole)

    # expandable segments -----------------------------------------------------------------------
    def _alloc_expandable(self, size: int, small: bool, stream: int, time_s: float, info: tuple) -> _Block | None:
        """Map pages at the lowest address with room (try_allocate_expandable_block)."""
        cand = self._find_expandable(size, small, stream)
        if not cand.mapped:
            cand = self._map_block(cand, min(cand.size, size), time_s, info)
        while cand is not None and cand.size < size:
            nxt = cand.next
            if nxt is None or nxt.mapped:
                return None
            cand = self._map_block(nxt, min(size - cand.size, nxt.size), time_s, info)
        if cand is not None:
            self._pop_free(cand)
        return cand

    def _find_expandable(self, size: int, small: bool, stream: int) -> _Block:
        """Lowest-address unmapped space (with the free block before it) that can hold `size`."""
        key = 2 * stream + small
        unmapped = self._unmapped.setdefault(key, [])
        for addr in unmapped:
            cand = self._unmapped_at[addr]
            if cand.prev is not None and cand.prev.state == FREE:
                cand = cand.prev
            room, b = 0, cand
            while room < size and b is not None and b.state == FREE:
                room += b.size
                b = b.next
            if room >= size:
                return cand
        page = SMALL_BUFFER_BYTES if small else LARGE_BUFFER_BYTES
        va_bytes = -(-(self.capacity_bytes + self.capacity_bytes // 8) // page) * page
        addr = self._space.reserve(va_bytes + _GAP_BYTES)
        seg = _Segment(addr, va_bytes, stream, small, page, _NO_INFO)
        seg.head = block = _Block(addr, va_bytes, seg, mapped=False)
        self._segments[addr] = seg
        insort(unmapped, addr)
        self._unmapped_at[addr] = block
        return block

    def _map_block(self, block: _Block, nbytes: int, time_s: float, info: tuple) -> _Block | None:
        """Map the pages covering the first `nbytes` of an unmapped block and merge it into the free pool."""
        seg = block.seg
        mapped = -(-nbytes // seg.page) * seg.page
        if self._reserved + mapped > self.capacity_bytes:
            return None
        unmapped = self._unmapped[seg.key]
        del unmapped[bisect_left(unmapped, block.addr)]
        del self._unmapped_at[block.addr]
        if mapped < block.size:
            rest = _Block(block.addr + mapped, block.size - mapped, seg, mapped=False)
            _link_after(block, rest)
            insort(unmapped, rest.addr)
            self._unmapped_at[rest.addr] = rest
            block.size = mapped
        block.mapped = True
        if block.prev is None and seg.info is _NO_INFO:
            seg.info = info
        self._grow_reserved(mapped)
        if self._log is not None:
            self._log.append("segment_map", block.addr, mapped, seg.stream, time_s, *info)
        return self._insert_free(block)

    def _unmap_block(self, block: _Block, time_s: float, info: tuple) -> _Block | None:
        """Unmap the whole pages inside a free expandable block (unmap_block); return the unmapped block."""
        seg = block.seg
        begin = seg.addr + -(-(block.addr - seg.addr) // seg.page) * seg.page
        end = seg.addr + (block.addr + block.size - seg.addr) // seg.page * seg.page
        if begin >= end:
            return None
        seg.layout = None
        self._pop_free(block)
        block_end = block.addr + block.size
        if begin > block.addr:
            hole = _Block(begin, end - begin, seg, mapped=False)
            _link_after(block, hole)
            block.size = begin - block.addr
            self._push_free(block)
        else:
            hole = block
            hole.size = end - begin
            hole.mapped = False
        if end < block_end:
            after = _Block(end, block_end - end, seg)
            _link_after(hole, after)
            self._push_free(after)
        unmapped = self._unmapped[seg.key]
        prev = hole.prev
        if prev is not None and not prev.mapped:
            del unmapped[bisect_left(unmapped, prev.addr)]
            del self._unmapped_at[prev.addr]
            _absorb_next(prev)
            hole = prev
        nxt = hole.next
        if nxt is not None and not nxt.mapped:
            del unmapped[bisect_left(unmapped, nxt.addr)]
            del self._unmapped_at[nxt.addr]
            _absorb_next(hole)
        insort(unmapped, hole.addr)
        self._unmapped_at[hole.addr] = hole
        self._reserved -= end - begin
        if self._log is not None:
            self._log.append("segment_unmap", begin, end - begin, seg.stream, time_s,
                             *(info if info[0] or info[1] else seg.info))
        return hole

    def _release_expandable(self, hole: _Block) -> None:
        """Give back the address range of an expandable segment that is entirely unmapped."""
        seg = hole.seg
        unmapped = self._unmapped[seg.key]
        del unmapped[bisect_left(unmapped, hole.addr)]
        del self._unmapped_at[hole.addr]
        del self._segments[seg.addr]
        self._space.release(seg.addr, seg.size + _GAP_BYTES)


def _segment_dict(seg: _Segment, first: _Block) -> dict:
    """The snapshot dict of the mapped run of blocks starting at `first`."""
    blocks = []
    total = allocated = active = requested = 0
    b = first
    while b is not None and b.mapped:
        if b.state == FREE:
            state = "inactive"
        else:
            state = "active_allocated" if b.state == ALLOCATED else "active_pending_free"
            allocated += b.size if b.state == ALLOCATED else 0
            active += b.size
            requested += b.requested
        blocks.append({"address": b.addr, "size": b.size, "requested_size": b.requested, "state": state,
                       "frames": make_frames(*b.info)})
        total += b.size
        b = b.next
    return {
        "device": 0, "address": first.addr, "total_size": total, "allocated_size": allocated,
        "active_size": active, "requested_size": requested, "stream": seg.stream,
        "segment_type": "small" if seg.small else "large", "segment_pool_id": (0, 0),
        "is_expandable": bool(seg.page), "frames": make_frames(*seg.info), "blocks": blocks,
    }
