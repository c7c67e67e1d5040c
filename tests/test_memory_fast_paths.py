"""The inlined hot paths of the caching allocator and RankMemory give what the plain paths give, call by call."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.engine.allocator import ADDRESS_BITS, SMALL_SIZE_BYTES, OutOfMemory
from simulator.engine.caching_allocator import (ALLOCATED, MIN_BLOCK_BYTES, CachingAllocator, _Block, _link_after,
                                                round_size)
from simulator.engine.memory import RankMemory
from simulator.parallel.program import Period
from simulator.workload.graph import CATEGORIES, Tensor, moved_ids

MiB = 1 << 20
CAPACITY_BYTES = 72 * MiB          # small enough that random runs reach the out-of-memory retry


class PlainAllocator(CachingAllocator):
    """malloc and free as they were before the hot paths were inlined: best fit through _take_free_block, the
    split through _link_after, every free through _free_block."""

    def malloc(self, nbytes, stream, time_s, op="", tensor="", category=""):
        if nbytes <= 0:
            return self._zero_handle(nbytes)
        size = round_size(nbytes, self._divisions)
        small = size <= SMALL_SIZE_BYTES
        info = (op, tensor, category)
        free = self._free.get(2 * stream + small)
        block = self._take_free_block(free, size) if free else None
        if block is None:
            block = self._new_block(size, small, stream, nbytes, time_s, info)
            free = self._free.get(2 * stream + small)
        block.seg.layout = None              # (state_key's kept layout of the segment: stale from here)
        remaining = block.size - size
        if small or self._expandable:
            split = remaining >= MIN_BLOCK_BYTES
        else:
            split = remaining > SMALL_SIZE_BYTES and size < self._max_split
        already_split = block.prev is not None or block.next is not None
        if split:
            addr = block.addr + size
            rest = _Block(addr, remaining, block.seg)
            _link_after(block, rest)
            block.size = size
            if free is None:
                free = self._free[2 * stream + small] = []
            free.append((remaining << ADDRESS_BITS) | addr)
            free.sort()
            self._free_at[addr] = rest
            if not self._expandable:
                self._inactive_split += -size if already_split else remaining
        elif already_split and not self._expandable:
            self._inactive_split -= block.size
        block.state = ALLOCATED
        block.requested = nbytes
        block.info = info
        handle = block.handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = block
        self.last_block_bytes = block.size      # (the contract RankMemory reads; block_bytes(handle))
        self._allocated += block.size
        self._active += block.size
        self._requested += nbytes
        self._peak_allocated = max(self._peak_allocated, self._allocated)
        if self._log is not None:
            self._log.append("alloc", block.addr, nbytes, stream, time_s, op, tensor, category)
        return handle

    def free(self, handle, time_s, op="", pending_streams=()):
        block = self._live.pop(handle, None)
        if block is None:
            return self._unknown("free", handle)
        self._allocated -= block.size
        self._requested -= block.requested
        if self._log is not None:
            a_op, tensor, category = block.info
            self._log.append("free_requested", block.addr, block.requested, block.seg.stream, time_s, op or a_op,
                             tensor, category)
        if pending_streams and any(s != block.seg.stream for s in pending_streams):
            block.seg.layout = None
            block.state = 2
            self._pending[handle] = block
            return None
        self._free_block(block, time_s, op)
        return None


CONFIGS = [{}, {"max_split_size_bytes": 24 * MiB}, {"roundup_power2_divisions": 4}, {"expandable_segments": True},
           {"expandable_segments": True, "max_split_size_bytes": 24 * MiB}]
sizes = st.one_of(st.sampled_from([512, MiB, 2 * MiB, 4 * MiB, 8 * MiB, 20 * MiB, 26 * MiB, 46 * MiB]),
                  st.integers(0, 4096), st.integers(4096, 2 * MiB), st.integers(MiB, 12 * MiB),
                  st.integers(20 * MiB, 44 * MiB))
operations = st.lists(st.one_of(st.tuples(st.just("malloc"), sizes, st.integers(0, 2)),
                                st.tuples(st.just("free"), st.integers(0, 1 << 20), st.booleans()),
                                st.tuples(st.just("complete"), st.integers(0, 1 << 20)),
                                st.tuples(st.just("empty"), st.just(0))), min_size=4, max_size=80)


def _stats(a: CachingAllocator) -> tuple:
    return (a.allocated_bytes, a.reserved_bytes, a.requested_bytes, a.active_bytes, a.inactive_split_bytes,
            a.peak_allocated_bytes, a.peak_reserved_bytes, a.capacity_bytes)


def _drive(a: CachingAllocator, ops: list) -> list:
    """Run `ops`; what every call returned and the statistics after it (an OOM lifts the limit, as RankMemory)."""
    out, live, pending = [], [], []
    for t, op in enumerate(ops):
        if op[0] == "malloc":
            try:
                handle = a.malloc(op[1], op[2], float(t), "op", "t", "activations")
            except OutOfMemory:
                a.capacity_bytes = 1 << 40
                handle = a.malloc(op[1], op[2], float(t), "op", "t", "activations")
            live.append(handle)
            out.append((handle, a.block_bytes(handle), a.last_block_bytes))
        elif op[0] == "free" and live:
            handle = live.pop(op[1] % len(live))
            a.free(handle, float(t), "f", pending_streams=(7,) if op[2] else ())
            if op[2]:
                pending.append(handle)
        elif op[0] == "complete" and pending:
            a.complete_pending(pending.pop(op[1] % len(pending)), float(t))
        elif op[0] == "empty":
            a.empty_cache(float(t))
            pending.clear()
        out.append(_stats(a))
    owners = {h: i for i, h in enumerate(live)}
    return out + [a.segments(), a.state_key(owners), a.events]


@settings(max_examples=100, deadline=None)
@given(config=st.sampled_from(range(len(CONFIGS))), events=st.booleans(), ops=operations)
def test_inlined_malloc_and_free_equal_the_plain_ones(config, events, ops):
    options = dict(CONFIGS[config], record_events=events)
    assert _drive(CachingAllocator(CAPACITY_BYTES, **options), ops) == \
        _drive(PlainAllocator(CAPACITY_BYTES, **options), ops)


@given(ids=st.lists(st.integers(0, 50), max_size=5).map(tuple), shift=st.integers(0, 30), low=st.integers(0, 50))
def test_moved_ids_short_paths_equal_the_plain_rule(ids, shift, low):
    assert moved_ids(ids, shift, low) == tuple(v + shift if v >= low else v for v in ids)


run_calls = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4), st.booleans()), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(calls=run_calls, timeline=st.booleans(), events=st.booleans())
def test_run_calls_equal_plain_allocate_and_free(calls, timeline, events):
    """run_allocate / run_free (a micro-batch copy's ids moved inline, the fused hot path) leave exactly what
    allocate / free of the moved ids leave: samples, peaks, bytes by category, allocator state and events."""
    templates = [(10, 11), (12,), (3, 13), (14, 15, 16, 4)]
    sizes = [300, 5 * MiB, 600 * 1024, 25 * MiB, 3000, 7 * MiB, 512, 1, 2 * MiB, 40 * MiB, 100, 9 * MiB, 64, 8, 3]
    tensors = {}
    for tid in range(100):
        tensors[tid] = Tensor(tid, f"t{tid}", sizes[tid % 17 % len(sizes)], CATEGORIES[tid % len(CATEGORIES)])

    def run(fast: bool) -> tuple:
        memory = RankMemory(CachingAllocator(CAPACITY_BYTES, record_events=events), tensors, {"compute": 0, "comm": 1},
                            record_timeline=timeline, repeats=False)
        live = []                      # (template, shift) allocated and not freed
        for step, (which, copy, stream) in enumerate(calls):
            template, shift = templates[which], 20 * copy
            ids = moved_ids(template, shift, 10)
            if (template, shift) in live:
                live.remove((template, shift))
                if fast:
                    memory.run_free(template, shift, 10, float(step), f"op{which}")
                else:
                    memory.free(ids, float(step), f"op{which}")
            elif not any(set(ids) & set(moved_ids(t, s, 10)) for t, s in live):
                live.append((template, shift))
                name = "comm" if stream else "compute"
                if fast:
                    memory.run_allocate(template, shift, 10, name, float(step), f"op{which}")
                else:
                    memory.allocate(ids, name, float(step), f"op{which}")
        a = memory.allocator
        return (memory.samples, memory.peak_allocated, memory.peak_reserved, memory.peak_time_s, memory.peak_op,
                memory.peak_breakdown, memory.category_peaks, list(memory.by_category), memory.bytes_of,
                memory.first_oom, _stats(a), a.segments(), a.events)

    assert run(True) == run(False)


class _Op:
    def __init__(self, name, allocs, frees):
        self.name, self.allocs, self.frees = name, allocs, frees


class _Run:
    def __init__(self, op, shift, low):
        self.op, self.shift, self.low = op, shift, low


@settings(max_examples=80, deadline=None)
@given(calls=run_calls, timeline=st.booleans(), record=st.booleans())
def test_logged_runs_made_in_one_loop_equal_run_allocate_and_free(calls, timeline, record):
    """make_runs (the logged Run calls of memory_log.apply, _allocate / _free / _after inlined) leaves exactly what
    run_allocate / run_free leave, an out-of-memory allocation and a recording of the calls included."""
    templates = [(10, 11), (12,), (3, 13), (14, 15, 16, 4)]
    sizes = [300, 5 * MiB, 600 * 1024, 25 * MiB, 3000, 7 * MiB, 512, 1, 2 * MiB, 40 * MiB, 100, 9 * MiB, 64, 8, 3]
    tensors = {tid: Tensor(tid, f"t{tid}", sizes[tid % 17 % len(sizes)], CATEGORIES[tid % len(CATEGORIES)])
               for tid in range(100)}
    runs: list = [[], []]          # per stream: the Run-like instructions the words name
    words, times, plain = [], [], []
    live = []
    for step, (which, copy, stream) in enumerate(calls):
        template, shift = templates[which], 20 * copy
        ids = moved_ids(template, shift, 10)
        if (template, shift) in live:
            live.remove((template, shift))
            op, code, stream = _Op(f"op{which}", (), template), 1, 0
        elif not any(set(ids) & set(moved_ids(t, s, 10)) for t, s in live):
            live.append((template, shift))
            op, code, stream = _Op(f"op{which}", template, ()), 0, int(stream)
        else:
            continue
        runs[stream].append(_Run(op, shift, 10))
        words.append((len(runs[stream]) - 1) << 12 | stream << 4 | code)
        times.append(float(step))
        plain.append((code, op, shift, "comm" if stream else "compute", float(step)))

    def run(fast: bool) -> tuple:
        memory = RankMemory(CachingAllocator(CAPACITY_BYTES, record_events=False), tensors, {"compute": 0, "comm": 1},
                            record_timeline=timeline, repeats=record)
        if record:
            memory.boundary(Period("F0", 0, 10, 100))
        if fast:
            assert memory.make_runs(words, times, 0, runs, len(words)) == len(words)
        for code, op, shift, stream, time_s in ([] if fast else plain):
            if code:
                memory.run_free(op.frees, shift, 10, time_s, op.name)
            else:
                memory.run_allocate(op.allocs, shift, 10, stream, time_s, op.name)
        a = memory.allocator
        recorded = memory._recording.calls if memory._recording is not None else None
        return (memory.samples, memory.peak_allocated, memory.peak_reserved, memory.peak_time_s, memory.peak_op,
                memory.peak_breakdown, memory.category_peaks, list(memory.by_category), memory.bytes_of,
                memory.first_oom, _stats(a), a.segments(), recorded)

    assert run(True) == run(False)
