"""The exact allocator (sum of live bytes) and the make_allocator factory."""

from __future__ import annotations

import pickle

import pytest

from simulator.engine.allocator import Allocator, ExactAllocator, OutOfMemory, make_allocator
from simulator.engine.caching_allocator import CachingAllocator
from simulator.errors import MemsimError, ScenarioError

MiB = 1 << 20


def test_allocated_equals_reserved_equals_sum_of_requested_bytes():
    a = make_allocator("exact", 100 * MiB)
    h1 = a.malloc(1000, 0, 0.0)
    h2 = a.malloc(3 * MiB + 7, 1, 0.0)
    assert a.allocated_bytes == a.reserved_bytes == a.requested_bytes == 3 * MiB + 1007
    assert (a.block_bytes(h1), a.block_bytes(h2)) == (1000, 3 * MiB + 7)
    a.free(h1, 1.0)
    assert a.allocated_bytes == a.reserved_bytes == 3 * MiB + 7
    assert a.inactive_split_bytes == 0


def test_oom_when_sum_would_exceed_capacity():
    a = make_allocator("exact", 10 * MiB)
    a.malloc(6 * MiB, 0, 0.0)
    a.malloc(4 * MiB, 0, 0.0)                       # exactly full is fine
    with pytest.raises(OutOfMemory) as info:
        a.malloc(1, 0, 1.0, "op", "t", "activations")
    err = info.value
    assert (err.requested_bytes, err.allocated_bytes, err.reserved_bytes, err.capacity_bytes) == (
        1, 10 * MiB, 10 * MiB, 10 * MiB)
    assert not isinstance(err, MemsimError)
    ev = a.events[-1]
    assert (ev.action, ev.addr, ev.size, ev.op, ev.tensor, ev.category) == ("oom", 0, 1, "op", "t", "activations")
    assert pickle.loads(pickle.dumps(err)).requested_bytes == 1


def test_events_per_allocation_and_free():
    a = make_allocator("exact", 100 * MiB)
    h = a.malloc(100, 2, 0.5, "fc1 fwd", "x", "activations")
    a.free(h, 1.5, "fc1 bwd")
    assert [(e.action, e.size, e.stream, e.time_s) for e in a.events] == [
        ("segment_alloc", 100, 2, 0.5), ("alloc", 100, 2, 0.5), ("free_requested", 100, 2, 1.5),
        ("free_completed", 100, 2, 1.5), ("segment_free", 100, 2, 1.5)]
    assert len({e.addr for e in a.events}) == 1
    assert a.events[2].op == "fc1 bwd" and a.events[2].tensor == "x"


def test_addresses_are_deterministic_distinct_and_aligned():
    def run():
        a = make_allocator("exact", 100 * MiB)
        hs = [a.malloc(n, 0, 0.0) for n in (100, 5000, 1)]
        a.free(hs[1], 1.0)
        a.malloc(4000, 0, 2.0)
        return [e.addr for e in a.events if e.action == "alloc"]

    first = run()
    assert first == run()
    assert all(addr % 512 == 0 for addr in first)
    assert len(set(first[:3])) == 3
    assert first[3] == first[1]                     # the freed range is reused


def test_segments_one_per_live_allocation():
    a = make_allocator("exact", 100 * MiB)
    h1 = a.malloc(2 * MiB, 0, 0.0, "op1", "w", "parameters")
    a.malloc(100, 1, 0.0)
    segs = a.segments()
    assert [s["total_size"] for s in segs] == [2 * MiB, 100]
    assert [s["segment_type"] for s in segs] == ["large", "small"]
    assert segs[0]["blocks"][0]["frames"] == [{"filename": "parameters", "line": 0, "name": "op1 w"}]
    assert all(sum(b["size"] for b in s["blocks"]) == s["total_size"] for s in segs)
    a.free(h1, 1.0)
    assert [s["total_size"] for s in a.segments()] == [100]


def test_pending_free_leaves_allocated_but_stays_reserved():
    a = make_allocator("exact", 10 * MiB)
    h = a.malloc(6 * MiB, 0, 0.0)
    a.free(h, 1.0, pending_streams=(1,))
    assert a.allocated_bytes == 0 and a.reserved_bytes == 6 * MiB
    assert a.segments()[0]["blocks"][0]["state"] == "active_pending_free"
    assert a.block_bytes(h) == 6 * MiB
    a.complete_pending(h, 2.0)
    assert a.reserved_bytes == 0 and a.segments() == []
    assert [e.action for e in a.events][-2:] == ["free_completed", "segment_free"]
    a.complete_pending(h, 3.0)                      # already done: no-op


def test_oom_completes_pending_frees_before_giving_up():
    a = make_allocator("exact", 10 * MiB)
    a.free(a.malloc(6 * MiB, 0, 0.0), 1.0, pending_streams=(1,))
    h = a.malloc(6 * MiB, 0, 2.0)                   # 6 + 6 > 10 until the pending free completes
    assert a.block_bytes(h) == 6 * MiB and a.reserved_bytes == 6 * MiB


def test_empty_cache_completes_pending():
    a = make_allocator("exact", 10 * MiB)
    h = a.malloc(MiB, 0, 0.0)
    a.free(h, 1.0, pending_streams=(2, 3))
    a.empty_cache(2.0)
    assert a.reserved_bytes == 0


def test_peaks_reset_and_no_events_mode():
    a = make_allocator("exact", 10 * MiB, record_events=False)
    h = a.malloc(5 * MiB, 0, 0.0)
    a.free(h, 1.0)
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (5 * MiB, 5 * MiB)
    a.reset_peaks()
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (0, 0)
    assert a.events == []


def test_zero_bytes_and_bad_handles():
    a = make_allocator("exact", 10 * MiB)
    z = a.malloc(0, 0, 0.0)
    assert a.block_bytes(z) == 0 and a.reserved_bytes == 0
    a.free(z, 0.0)
    with pytest.raises(ValueError, match="handle"):
        a.free(z, 0.0)
    with pytest.raises(ValueError, match="nbytes"):
        a.malloc(-5, 0, 0.0)
    with pytest.raises(TypeError):
        a.malloc(1.5, 0, 0.0)


def test_factory_kinds_and_protocol():
    exact = make_allocator("exact", MiB)
    caching = make_allocator("caching", MiB)
    assert isinstance(exact, ExactAllocator) and isinstance(caching, CachingAllocator)
    assert isinstance(exact, Allocator) and isinstance(caching, Allocator)


@pytest.mark.parametrize("kwargs, key", [
    ({"kind": "buddy"}, "allocator.kind = 'buddy'"),
    ({"capacity_bytes": 0}, "capacity_bytes (device memory left for the allocator) = 0"),
    ({"roundup_power2_divisions": 3}, "allocator.roundup_power2_divisions = 3"),
    ({"roundup_power2_divisions": 0}, "allocator.roundup_power2_divisions = 0"),
    ({"max_split_size_bytes": 1024}, "allocator.max_split_size_bytes = 1024"),
    ({"expandable_segments": "yes"}, "allocator.expandable_segments"),
])
def test_factory_rejects_bad_settings_with_one_line_message(kwargs, key):
    args = {"kind": "caching", "capacity_bytes": MiB, **kwargs}
    with pytest.raises(ScenarioError) as info:
        make_allocator(args.pop("kind"), args.pop("capacity_bytes"), **args)
    assert key in str(info.value) and "\n" not in str(info.value)
