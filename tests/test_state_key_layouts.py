"""CachingAllocator.state_key with segment layouts kept between calls: the same keys as built afresh, and equal
exactly when the block-by-block key of before (reference_key) is equal."""

from __future__ import annotations

import random

import pytest

from simulator.engine.allocator import OutOfMemory
from simulator.engine.caching_allocator import CachingAllocator

MiB = 1 << 20
CONFIGS = [{}, {"max_split_size_bytes": 24 * MiB}, {"roundup_power2_divisions": 4},
           {"expandable_segments": True}, {"expandable_segments": True, "max_split_size_bytes": 24 * MiB}]
SIZES = [512, 1000, MiB, MiB + 1, 2 * MiB, 3 * MiB + 7, 8 * MiB, 12 * MiB, 20 * MiB, 26 * MiB]


def reference_key(a: CachingAllocator, owners: dict[int, object]) -> tuple:
    """The key as state_key built it before layouts were kept (every block walked, owners by address)."""
    live = a._live
    owner_at = {live[h].addr: label for h, label in owners.items() if h in live}
    segments = []
    for addr in sorted(a._segments):
        seg = a._segments[addr]
        blocks = []
        b = seg.head
        while b is not None:
            blocks.append((b.addr, b.size, b.state, b.mapped, b.requested, owner_at.get(b.addr)))
            b = b.next
        segments.append((addr, seg.size, seg.stream, seg.small, seg.page, seg.info, tuple(blocks)))
    return (tuple(segments), tuple(a._space._free), len(a._pending), a.capacity_bytes, a._allocated, a._reserved,
            a._requested, a._active, a._inactive_split)


def fresh_key(a: CachingAllocator, owners: dict[int, object]) -> tuple:
    for seg in a._segments.values():
        seg.layout = None
    return a.state_key(owners)


def drive(a: CachingAllocator, rng: random.Random, steps: int, check) -> None:
    """Random mallocs, frees (some pending on another stream), completions and empty_cache; `check(live)` after
    each step."""
    live: list[int] = []
    pending: list[int] = []
    for t in range(steps):
        r = rng.random()
        if r < 0.5 or not live:
            try:
                live.append(a.malloc(rng.choice(SIZES), rng.randrange(2), float(t), "op", "x", "activations"))
            except OutOfMemory:
                pending.clear()         # (the retry completed every pending free)
        elif r < 0.85:
            h = live.pop(rng.randrange(len(live)))
            away = rng.random() < 0.2
            a.free(h, float(t), "op", pending_streams=(5,) if away else ())
            if away and h in a._pending:
                pending.append(h)
        elif r < 0.95 and pending:
            a.complete_pending(pending.pop(rng.randrange(len(pending))), float(t))
        else:
            a.empty_cache(float(t))
            pending.clear()
        check(live)


@pytest.mark.parametrize("config", range(len(CONFIGS)))
@pytest.mark.parametrize("record_events", [True, False])
def test_kept_layouts_give_the_fresh_key(config, record_events):
    rng = random.Random(config)
    a = CachingAllocator(160 * MiB, record_events=record_events, **CONFIGS[config])

    def check(live):
        owners = {h: -i for i, h in enumerate(live) if i % 3}      # some live handles unnamed
        key = a.state_key(owners)
        assert key == fresh_key(a, owners)
        assert hash(key) == hash(fresh_key(a, owners))

    drive(a, rng, 400, check)


@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_keys_equal_exactly_when_the_reference_keys_are(config):
    """Two allocators on the same random calls, and one on its own calls: new keys compare as the reference
    keys do, at every pair of steps (the same layouts through different objects, and different states)."""
    def run(seed, labels):
        keys = []
        a = CachingAllocator(96 * MiB, **CONFIGS[config])

        def check(live):
            owners = {h: labels(i) for i, h in enumerate(live)}
            keys.append((reference_key(a, owners), a.state_key(owners)))

        drive(a, random.Random(seed), 150, check)
        return keys

    first, second = run(7, lambda i: i), run(7, lambda i: i)
    other, renamed = run(8, lambda i: i), run(7, lambda i: i % 4)
    assert [new for _, new in first] == [new for _, new in second]
    every = first + other + renamed
    equal_pairs = 0
    for i, (old_a, new_a) in enumerate(every):
        for old_b, new_b in every[i + 1:]:
            assert (old_a == old_b) == (new_a == new_b)
            equal_pairs += old_a == old_b
    assert equal_pairs > 0
