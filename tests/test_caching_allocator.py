"""Each rule of the PyTorch CUDA caching allocator model, pinned by its own test (reference/allocator.md)."""

from __future__ import annotations

import pytest

from simulator.engine.allocator import OutOfMemory, make_allocator
from simulator.engine.caching_allocator import CachingAllocator, round_size, segment_size
from simulator.errors import ScenarioError

MiB = 1 << 20
GiB = 1 << 30


def caching(capacity_bytes: int = 80 * GiB, **kw) -> CachingAllocator:
    return make_allocator("caching", capacity_bytes, **kw)


def addr_of_last_alloc(a: CachingAllocator) -> int:
    return [e for e in a.events if e.action == "alloc"][-1].addr


def actions(a: CachingAllocator) -> list[str]:
    return [e.action for e in a.events]


# --- the four worked examples of allocator.md ------------------------------------------------------

def test_worked_example_1000_bytes_gets_1024_block_in_new_2mib_small_segment():
    a = caching()
    h = a.malloc(1000, 0, 0.0)
    assert a.block_bytes(h) == 1024
    assert a.reserved_bytes == 2 * MiB
    (seg,) = a.segments()
    assert seg["segment_type"] == "small" and seg["total_size"] == 2 * MiB


def test_worked_example_1mib_plus_one_gets_1049088_block_in_20mib_segment():
    a = caching()
    h = a.malloc(MiB + 1, 0, 0.0)
    assert a.block_bytes(h) == 1_049_088
    assert a.reserved_bytes == 20 * MiB
    (seg,) = a.segments()
    assert seg["segment_type"] == "large" and seg["total_size"] == 20 * MiB


def test_worked_example_12mb_gets_12582912_segment():
    a = caching()
    h = a.malloc(12_000_000, 0, 0.0)
    assert a.reserved_bytes == 12_582_912
    # the 582,656 B remainder is <= 1 MiB, so the block is not split and counts whole as allocated
    assert a.block_bytes(h) == 12_582_912
    assert a.allocated_bytes == 12_582_912 and a.requested_bytes == 12_000_000
    (seg,) = a.segments()
    assert [(b["size"], b["requested_size"], b["state"]) for b in seg["blocks"]] == [
        (12_582_912, 12_000_000, "active_allocated")]


def test_worked_example_power2_divisions_4_rounds_5000000_to_5242880():
    a = caching(roundup_power2_divisions=4)
    h = a.malloc(5_000_000, 0, 0.0)
    assert a.block_bytes(h) == 5_242_880
    assert round_size(5_000_000, 4) == 5_242_880


# --- rounding ------------------------------------------------------------------------------------

@pytest.mark.parametrize("nbytes, expected", [(1, 512), (511, 512), (512, 512), (513, 1024), (1536, 1536),
                                              (1537, 2048), (10**9 + 1, 1_000_000_512)])
def test_round_size_to_multiple_of_512(nbytes, expected):
    assert round_size(nbytes) == expected


@pytest.mark.parametrize("nbytes, divisions, expected", [
    (1200, 4, 1536),                 # 1200 <= 512 * 4: plain 512 rounding
    (2049, 4, 2560),                 # steps of 512 between 2048 and 4096
    (4096, 4, 4096),                 # a power of two stays
    (3 * MiB + 1, 8, 3 * MiB + 256 * 1024),
    (5_000_000, 1, 5_000_192),       # 1 division = off
])
def test_round_size_power2_divisions(nbytes, divisions, expected):
    assert round_size(nbytes, divisions) == expected


def test_split_remainder_block_is_exactly_what_remains():
    a = caching()
    a.malloc(3_000_000, 0, 0.0)                     # 3,000,320 B block in a 20 MiB segment
    (seg,) = a.segments()
    assert [b["size"] for b in seg["blocks"]] == [3_000_320, 20 * MiB - 3_000_320]
    assert [b["state"] for b in seg["blocks"]] == ["active_allocated", "inactive"]
    assert seg["allocated_size"] == 3_000_320 and seg["requested_size"] == 3_000_000


# --- pools and segment sizes -----------------------------------------------------------------------

@pytest.mark.parametrize("size, expected", [(512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB),
                                            (10 * MiB - 512, 20 * MiB), (10 * MiB, 10 * MiB),
                                            (10 * MiB + 512, 12 * MiB), (100 * MiB + 1, 102 * MiB)])
def test_segment_size(size, expected):
    assert segment_size(size) == expected


def test_one_mib_request_is_small_pool_and_one_more_byte_is_large():
    a = caching()
    a.malloc(MiB, 0, 0.0)
    a.malloc(MiB + 1, 0, 0.0)
    assert sorted(s["segment_type"] for s in a.segments()) == ["large", "small"]
    assert a.reserved_bytes == 22 * MiB


def test_small_request_does_not_use_a_free_large_block():
    a = caching()
    h = a.malloc(5 * MiB, 0, 0.0)
    a.free(h, 1.0)
    assert a.reserved_bytes == 20 * MiB
    a.malloc(1000, 0, 2.0)
    assert a.reserved_bytes == 22 * MiB            # a new 2 MiB small segment, not a piece of the 20 MiB one


# --- best fit, splitting -------------------------------------------------------------------------------

def test_best_fit_picks_smallest_adequate_block():
    a = caching()
    handles = [a.malloc(n * MiB, 0, 0.0) for n in (16, 12, 14)]      # three own segments
    addrs = [e.addr for e in a.events if e.action == "alloc"]
    for h in handles:
        a.free(h, 1.0)
    h = a.malloc(13 * MiB, 0, 2.0)
    assert addr_of_last_alloc(a) == addrs[2]        # the 14 MiB block, not 16 MiB
    assert a.reserved_bytes == 42 * MiB             # no new segment
    assert a.block_bytes(h) == 14 * MiB             # remainder 1 MiB is not split: waste counts as allocated
    assert a.allocated_bytes == 14 * MiB and a.requested_bytes == 13 * MiB


def test_small_pool_splits_a_512_byte_remainder():
    a = caching()
    a.malloc(MiB, 0, 0.0)
    h = a.malloc(MiB - 512, 0, 0.0)
    assert a.block_bytes(h) == MiB - 512
    (seg,) = a.segments()
    assert [b["size"] for b in seg["blocks"]] == [MiB, MiB - 512, 512]
    a.malloc(1, 0, 0.0)
    assert a.reserved_bytes == 2 * MiB              # the 512 B remainder served it


def test_large_pool_does_not_split_remainder_of_exactly_1mib():
    a = caching()
    h = a.malloc(19 * MiB, 0, 0.0)                  # 20 MiB segment, remainder 1 MiB
    assert a.reserved_bytes == 20 * MiB
    assert a.block_bytes(h) == 20 * MiB
    assert a.allocated_bytes == 20 * MiB and a.requested_bytes == 19 * MiB
    assert a.inactive_split_bytes == 0
    assert len(a.segments()[0]["blocks"]) == 1


def test_large_pool_splits_remainder_above_1mib():
    a = caching()
    h = a.malloc(19 * MiB - 512, 0, 0.0)            # remainder 1 MiB + 512 B
    assert a.block_bytes(h) == 19 * MiB - 512
    assert a.inactive_split_bytes == MiB + 512
    assert [b["size"] for b in a.segments()[0]["blocks"]] == [19 * MiB - 512, MiB + 512]


def test_inactive_split_tracks_free_pieces_of_partly_used_segments():
    a = caching()
    h1 = a.malloc(4 * MiB, 0, 0.0)
    h2 = a.malloc(4 * MiB, 0, 0.0)                  # same 20 MiB segment
    assert a.inactive_split_bytes == 12 * MiB
    a.free(h1, 1.0)
    assert a.inactive_split_bytes == 16 * MiB
    a.free(h2, 2.0)                                 # whole segment free again: no longer "split"
    assert a.inactive_split_bytes == 0


# --- streams, merging, empty_cache ----------------------------------------------------------------------

def test_free_block_of_one_stream_is_not_reused_by_another():
    a = caching()
    h = a.malloc(4 * MiB, 1, 0.0)
    first = addr_of_last_alloc(a)
    a.free(h, 1.0)
    a.malloc(4 * MiB, 2, 2.0)
    assert addr_of_last_alloc(a) != first
    assert a.reserved_bytes == 40 * MiB             # a second segment for stream 2
    a.malloc(4 * MiB, 1, 3.0)
    assert addr_of_last_alloc(a) == first           # stream 1 reuses its own block
    assert a.reserved_bytes == 40 * MiB


def test_free_merges_with_both_neighbours():
    a = caching()
    hs = [a.malloc(2 * MiB, 0, 0.0) for _ in range(3)]
    a.free(hs[0], 1.0)
    a.free(hs[2], 1.0)
    assert [b["state"] for b in a.segments()[0]["blocks"]] == ["inactive", "active_allocated", "inactive"]
    a.free(hs[1], 2.0)
    (seg,) = a.segments()
    assert seg["blocks"] == [{"address": seg["address"], "size": 20 * MiB, "requested_size": 0,
                              "state": "inactive", "frames": []}]
    assert a.inactive_split_bytes == 0


def test_empty_cache_frees_only_entirely_free_segments():
    a = caching()
    keep = a.malloc(4 * MiB, 0, 0.0)
    a.free(a.malloc(4 * MiB, 0, 0.0), 1.0)          # split segment, partly used
    a.free(a.malloc(30 * MiB, 0, 0.0), 1.0)         # a whole free 30 MiB segment
    a.free(a.malloc(1000, 0, 0.0), 1.0)             # a whole free small segment
    assert a.reserved_bytes == 52 * MiB
    a.empty_cache(2.0)
    assert a.reserved_bytes == 20 * MiB
    assert a.inactive_split_bytes == 16 * MiB
    assert actions(a)[-2:] == ["segment_free", "segment_free"]
    assert [e.size for e in a.events[-2:]] == [30 * MiB, 2 * MiB]     # large pool first, then small
    assert a.block_bytes(keep) == 4 * MiB


# --- out of memory -------------------------------------------------------------------------------------

def test_oom_retry_releases_cached_segments_and_succeeds():
    a = caching(30 * MiB)
    a.free(a.malloc(20 * MiB, 0, 0.0), 1.0)         # cached on stream 0
    h = a.malloc(20 * MiB, 1, 2.0, "op", "t")       # stream 1 cannot reuse it; 20 + 20 > 30
    assert a.block_bytes(h) == 20 * MiB
    assert a.reserved_bytes == 20 * MiB
    assert actions(a)[-3:] == ["segment_free", "segment_alloc", "alloc"]
    assert a.peak_reserved_bytes == 20 * MiB


def test_oom_raises_when_nothing_can_be_released():
    a = caching(30 * MiB)
    a.malloc(20 * MiB, 0, 0.0)
    with pytest.raises(OutOfMemory) as info:
        a.malloc(15 * MiB, 0, 1.0, "op", "x")
    err = info.value
    assert (err.requested_bytes, err.allocated_bytes, err.reserved_bytes, err.capacity_bytes) == (
        15 * MiB, 20 * MiB, 20 * MiB, 30 * MiB)
    oom = a.events[-1]
    assert (oom.action, oom.addr, oom.size, oom.op, oom.tensor) == ("oom", 10 * MiB, 15 * MiB, "op", "x")
    assert a.reserved_bytes == 20 * MiB and a.allocated_bytes == 20 * MiB


def test_oom_from_fragmentation_split_segments_cannot_be_released():
    a = caching(40 * MiB)
    h1 = a.malloc(9 * MiB, 0, 0.0)
    a.malloc(9 * MiB, 0, 0.0)                       # one 20 MiB segment, 2 MiB free
    a.free(h1, 1.0)                                 # 9 MiB free + 2 MiB free, not adjacent
    a.malloc(12 * MiB, 0, 2.0)                      # new 12 MiB segment
    assert a.reserved_bytes == 32 * MiB
    with pytest.raises(OutOfMemory):
        a.malloc(10 * MiB, 0, 3.0)                  # 11 MiB free in total but no 10 MiB segment fits
    assert a.inactive_split_bytes == 11 * MiB


# --- max_split_size ------------------------------------------------------------------------------------

def test_max_split_size_must_be_at_least_20mib():
    with pytest.raises(ScenarioError, match="max_split_size_bytes"):
        caching(max_split_size_bytes=10 * MiB)
    caching(max_split_size_bytes=20 * MiB)


def test_oversize_block_is_not_split_for_a_smaller_request():
    a = caching(max_split_size_bytes=64 * MiB)
    a.free(a.malloc(100 * MiB, 0, 0.0), 1.0)
    a.malloc(30 * MiB, 0, 2.0)
    assert a.reserved_bytes == 130 * MiB            # a new segment instead of splitting the 100 MiB block


def test_oversize_block_serves_oversize_request_within_20mib():
    a = caching(max_split_size_bytes=64 * MiB)
    a.free(a.malloc(100 * MiB, 0, 0.0), 1.0)
    h = a.malloc(90 * MiB, 0, 2.0)
    assert a.reserved_bytes == 100 * MiB
    assert a.block_bytes(h) == 100 * MiB            # not split: >= max_split_size
    a.free(h, 3.0)
    a.malloc(70 * MiB, 0, 4.0)                      # 100 >= 70 + 20: not reused
    assert a.reserved_bytes == 170 * MiB


def test_without_max_split_size_large_blocks_are_split():
    a = caching()
    a.free(a.malloc(100 * MiB, 0, 0.0), 1.0)
    h = a.malloc(30 * MiB, 0, 2.0)
    assert a.reserved_bytes == 100 * MiB and a.block_bytes(h) == 30 * MiB
    assert a.inactive_split_bytes == 70 * MiB


def test_oom_with_max_split_size_frees_only_oversize_blocks_first():
    a = caching(150 * MiB, max_split_size_bytes=64 * MiB)
    a.free(a.malloc(100 * MiB, 0, 0.0), 1.0)        # cached oversize segment
    a.free(a.malloc(5 * MiB, 0, 0.0), 1.0)          # cached 20 MiB segment (not oversize)
    a.malloc(70 * MiB, 0, 2.0)                      # 120 + 70 > 150
    assert a.reserved_bytes == 90 * MiB             # the 20 MiB segment survived the retry
    frees = [e.size for e in a.events if e.action == "segment_free"]
    assert frees == [100 * MiB]


def test_oom_with_max_split_size_frees_several_oversize_blocks_largest_first():
    a = caching(100 * MiB, max_split_size_bytes=24 * MiB)
    big = [a.malloc(30 * MiB, 0, 0.0), a.malloc(26 * MiB, 0, 0.0)]
    for h in big:
        a.free(h, 1.0)
    a.free(a.malloc(5 * MiB, 0, 0.0), 1.0)          # a 20 MiB segment: an oversize block is not split for it
    assert a.reserved_bytes == 76 * MiB
    a.malloc(40 * MiB, 0, 2.0)                      # no single oversize block >= 40 MiB: free 30, then 26
    assert [e.size for e in a.events if e.action == "segment_free"] == [30 * MiB, 26 * MiB]
    assert a.reserved_bytes == 60 * MiB


# --- record_stream / pending frees --------------------------------------------------------------------

def test_pending_free_is_not_reusable_until_completed():
    a = caching()
    h = a.malloc(4 * MiB, 0, 0.0)
    first = addr_of_last_alloc(a)
    a.free(h, 1.0, pending_streams=(1,))
    assert a.allocated_bytes == 0 and a.requested_bytes == 0      # PyTorch: no longer "allocated"
    assert a.active_bytes == 4 * MiB and a.reserved_bytes == 20 * MiB
    assert a.block_bytes(h) == 4 * MiB
    assert [b["state"] for b in a.segments()[0]["blocks"]] == ["active_pending_free", "inactive"]
    h2 = a.malloc(4 * MiB, 0, 2.0)
    assert addr_of_last_alloc(a) != first
    a.free(h2, 3.0)
    a.complete_pending(h, 4.0)
    assert actions(a)[-1] == "free_completed"
    a.malloc(4 * MiB, 0, 5.0)
    assert addr_of_last_alloc(a) == first
    a.complete_pending(h, 6.0)                      # already completed: no-op


def test_pending_on_own_stream_only_frees_at_once():
    a = caching()
    h = a.malloc(4 * MiB, 3, 0.0)
    a.free(h, 1.0, pending_streams=(3,))
    assert actions(a)[-2:] == ["free_requested", "free_completed"]
    a.complete_pending(h, 2.0)                      # tolerated no-op


def test_empty_cache_completes_pending_frees_first():
    a = caching()
    h = a.malloc(4 * MiB, 0, 0.0)
    a.free(h, 1.0, pending_streams=(1,))
    a.empty_cache(2.0)
    assert a.reserved_bytes == 0 and a.active_bytes == 0
    assert actions(a)[-2:] == ["free_completed", "segment_free"]


def test_bad_handles_raise():
    a = caching()
    h = a.malloc(100, 0, 0.0)
    a.free(h, 1.0)
    with pytest.raises(ValueError, match="handle"):
        a.free(h, 2.0)
    with pytest.raises(ValueError, match="handle"):
        a.block_bytes(h)
    with pytest.raises(ValueError, match="handle"):
        a.complete_pending(999, 2.0)
    with pytest.raises(ValueError, match="nbytes"):
        a.malloc(-1, 0, 0.0)


def test_zero_byte_allocations_take_no_memory():
    a = caching()
    h = a.malloc(0, 0, 0.0)
    assert a.block_bytes(h) == 0 and a.reserved_bytes == 0 and a.events == []
    a.free(h, 1.0)


def test_peaks_and_reset():
    a = caching()
    h = a.malloc(30 * MiB, 0, 0.0)
    a.free(h, 1.0)
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (30 * MiB, 30 * MiB)
    a.empty_cache(2.0)
    a.reset_peaks()
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (0, 0)
    a.malloc(1000, 0, 3.0)
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (1024, 2 * MiB)


def test_record_events_false_keeps_statistics():
    a = caching(record_events=False)
    a.free(a.malloc(5 * MiB, 0, 0.0), 1.0)
    assert a.events == [] and a.reserved_bytes == 20 * MiB and a.peak_allocated_bytes == 5 * MiB


# --- expandable segments --------------------------------------------------------------------------------

def test_expandable_segment_grows_by_20mib_pages_in_one_segment():
    a = caching(GiB, expandable_segments=True)
    h1 = a.malloc(5 * MiB, 0, 0.0)
    assert a.reserved_bytes == 20 * MiB
    h2 = a.malloc(30 * MiB, 0, 1.0)
    assert a.reserved_bytes == 40 * MiB
    assert [(e.action, e.size) for e in a.events if e.action.startswith("segment")] == [
        ("segment_map", 20 * MiB), ("segment_map", 20 * MiB)]
    (seg,) = a.segments()
    assert seg["is_expandable"] and seg["total_size"] == 40 * MiB
    assert [b["size"] for b in seg["blocks"]] == [5 * MiB, 30 * MiB, 5 * MiB]
    a.free(h1, 2.0)
    a.free(h2, 2.0)
    a.empty_cache(3.0)
    assert a.reserved_bytes == 0 and a.segments() == []
    assert (a.events[-1].action, a.events[-1].size) == ("segment_unmap", 40 * MiB)


def test_expandable_small_pool_uses_2mib_pages():
    a = caching(GiB, expandable_segments=True)
    for _ in range(3):
        a.malloc(MiB, 0, 0.0)
    assert a.reserved_bytes == 4 * MiB
    (seg,) = a.segments()
    assert seg["segment_type"] == "small" and seg["total_size"] == 4 * MiB


def test_expandable_avoids_fragmentation_between_segments():
    plain, grow = caching(), caching(expandable_segments=True)
    for a in (plain, grow):
        a.free(a.malloc(12 * MiB, 0, 0.0), 1.0)
        a.malloc(14 * MiB, 0, 2.0)
    assert plain.reserved_bytes == 26 * MiB         # a second segment
    assert grow.reserved_bytes == 20 * MiB          # the same mapped page serves both


def test_expandable_empty_cache_unmaps_only_whole_free_pages():
    a = caching(GiB, expandable_segments=True)
    a.malloc(5 * MiB, 0, 0.0)
    a.free(a.malloc(30 * MiB, 0, 0.0), 1.0)         # free [5, 40) MiB of the segment
    a.empty_cache(2.0)
    assert a.reserved_bytes == 20 * MiB
    base = a.segments()[0]["address"]
    unmap = a.events[-1]
    assert (unmap.action, unmap.addr, unmap.size) == ("segment_unmap", base + 20 * MiB, 20 * MiB)
    assert [b["size"] for b in a.segments()[0]["blocks"]] == [5 * MiB, 15 * MiB]


def test_expandable_streams_get_their_own_segments():
    a = caching(GiB, expandable_segments=True)
    a.malloc(5 * MiB, 0, 0.0)
    a.malloc(5 * MiB, 1, 0.0)
    segs = a.segments()
    assert [s["stream"] for s in segs] == [0, 1] and a.reserved_bytes == 40 * MiB


def test_expandable_oom_unmaps_cached_pages_and_retries():
    a = caching(60 * MiB, expandable_segments=True)
    a.free(a.malloc(40 * MiB, 0, 0.0), 1.0)         # 40 MiB mapped on stream 0, free
    h = a.malloc(40 * MiB, 1, 2.0)                  # stream 1 needs its own pages: 40 + 40 > 60
    assert a.block_bytes(h) == 40 * MiB and a.reserved_bytes == 40 * MiB
    assert [e.action for e in a.events][-3:] == ["segment_unmap", "segment_map", "alloc"]
    with pytest.raises(OutOfMemory):
        a.malloc(30 * MiB, 1, 3.0)
