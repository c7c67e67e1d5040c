"""Hypothesis properties of both allocator models over random malloc/free/empty_cache sequences."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.engine.allocator import OutOfMemory, make_allocator

MiB = 1 << 20
CAPACITY_BYTES = 72 * MiB          # small enough that random runs hit the out-of-memory paths

CONFIGS = {
    "exact": ("exact", {}),
    "caching": ("caching", {}),
    "max_split": ("caching", {"max_split_size_bytes": 24 * MiB}),
    "roundup": ("caching", {"roundup_power2_divisions": 4}),
    "expandable": ("caching", {"expandable_segments": True}),
    "expandable_max_split": ("caching", {"expandable_segments": True, "max_split_size_bytes": 24 * MiB}),
}

sizes = st.one_of(st.sampled_from([512, MiB, 2 * MiB, 4 * MiB, 8 * MiB, 20 * MiB, 26 * MiB]),
                  st.integers(0, 4096), st.integers(4096, 2 * MiB), st.integers(MiB, 12 * MiB),
                  st.integers(20 * MiB, 44 * MiB))
operations = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), sizes, st.integers(0, 2)),
        st.tuples(st.just("free"), st.integers(0, 1 << 20), st.booleans()),
        st.tuples(st.just("complete"), st.integers(0, 1 << 20)),
        st.tuples(st.just("empty"), st.just(0)),
    ),
    min_size=4,
    max_size=80,
)


class Run:
    """Drives an allocator and keeps what the caller knows: live handles, pending handles, addresses."""

    def __init__(self, kind: str, options: dict):
        self.a = make_allocator(kind, CAPACITY_BYTES, **options)
        self.expandable = options.get("expandable_segments", False)
        self.live: dict[int, int] = {}          # handle -> requested bytes
        self.pending: dict[int, int] = {}
        self.addr: dict[int, int] = {}
        self.t = 0.0

    def step(self, op: tuple) -> None:
        self.t += 1.0
        kind = op[0]
        if kind == "malloc":
            _, nbytes, stream = op
            seen = len(self.a.events)
            try:
                h = self.a.malloc(nbytes, stream, self.t, "op", f"t{nbytes}", "activations")
            except OutOfMemory as err:
                assert err.capacity_bytes == CAPACITY_BYTES and self.a.events[-1].action == "oom"
                h = None
            # the out-of-memory path completes pending frees first (PyTorch synchronizes their events)
            completed = {e.addr for e in self.a.events[seen:] if e.action == "free_completed"}
            for p in [p for p in self.pending if self.addr[p] in completed]:
                del self.pending[p]
            if h is None:
                return
            self.live[h] = nbytes
            if nbytes:
                alloc = self.a.events[-1]
                assert alloc.action == "alloc" and alloc.size == nbytes and alloc.stream == stream
                self.addr[h] = alloc.addr
        elif kind == "free" and self.live:
            h = sorted(self.live)[op[1] % len(self.live)]
            nbytes = self.live.pop(h)
            self.a.free(h, self.t, "free_op", pending_streams=(7,) if op[2] else ())
            if op[2] and nbytes:
                self.pending[h] = nbytes
        elif kind == "complete" and self.pending:
            h = sorted(self.pending)[op[1] % len(self.pending)]
            del self.pending[h]
            self.a.complete_pending(h, self.t)
        elif kind == "empty":
            self.a.empty_cache(self.t)
            self.pending.clear()

    def check(self) -> None:
        a = self.a
        assert 0 <= a.requested_bytes <= a.allocated_bytes <= a.active_bytes <= a.reserved_bytes <= CAPACITY_BYTES
        assert a.allocated_bytes == sum(a.block_bytes(h) for h in self.live)
        assert a.requested_bytes == sum(self.live.values())
        assert a.active_bytes == a.allocated_bytes + sum(a.block_bytes(h) for h in self.pending)
        assert a.peak_allocated_bytes >= a.allocated_bytes and a.peak_reserved_bytes >= a.reserved_bytes
        segs = a.segments()
        assert sum(s["total_size"] for s in segs) == a.reserved_bytes
        end = 0
        allocated, pending, inactive_split = set(), set(), 0
        for s in segs:
            assert s["address"] >= end, "segments overlap or are out of order"
            addr = s["address"]
            for b in s["blocks"]:
                assert b["address"] == addr and b["size"] > 0
                addr += b["size"]
                if b["state"] == "active_allocated":
                    allocated.add((b["address"], b["size"], b["requested_size"]))
                elif b["state"] == "active_pending_free":
                    pending.add((b["address"], b["size"]))
                elif len(s["blocks"]) > 1 and not s["is_expandable"]:
                    inactive_split += b["size"]
            assert addr == s["address"] + s["total_size"], "blocks do not sum to total_size"
            assert s["allocated_size"] == sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated")
            end = addr
        assert allocated == {(self.addr[h], a.block_bytes(h), n) for h, n in self.live.items() if n}
        assert pending == {(self.addr[h], a.block_bytes(h)) for h in self.pending}
        assert a.inactive_split_bytes == inactive_split
        if self.expandable:
            assert a.inactive_split_bytes == 0

    def drain(self) -> None:
        for h in sorted(self.live):
            self.a.free(h, self.t)
        for h in sorted(self.pending):
            self.a.complete_pending(h, self.t)
        self.live.clear()
        self.pending.clear()


@pytest.mark.parametrize("config", sorted(CONFIGS))
@settings(max_examples=60, deadline=None)
@given(ops=operations)
def test_invariants_hold_after_every_operation(config, ops):
    run = Run(*CONFIGS[config])
    for op in ops:
        run.step(op)
        run.check()
    run.drain()
    run.check()
    assert run.a.allocated_bytes == 0 and run.a.requested_bytes == 0
    run.a.empty_cache(run.t + 1)
    assert run.a.reserved_bytes == 0 and run.a.segments() == []
    assert run.a.inactive_split_bytes == 0


@pytest.mark.parametrize("config", ["caching", "expandable"])
@settings(max_examples=25, deadline=None)
@given(ops=operations)
def test_same_operations_give_identical_events(config, ops):
    runs = [Run(*CONFIGS[config]) for _ in range(2)]
    for run in runs:
        for op in ops:
            run.step(op)
    assert runs[0].a.events == runs[1].a.events
    assert runs[0].a.segments() == runs[1].a.segments()


def mixed_workload(kind: str, n_ops: int, **options) -> tuple[float, object]:
    """Run n_ops mixed malloc/free calls (up to ~2,000 live tensors, 3 streams); return (seconds, allocator)."""
    rng = random.Random(0)
    a = make_allocator(kind, 80 << 30, record_events=False, **options)
    sizes_ = [rng.choice((rng.randint(1, 4096), rng.randint(4096, MiB), rng.randint(MiB, 64 * MiB)))
              for _ in range(n_ops)]
    streams = [rng.choice((0, 0, 0, 1, 2)) for _ in range(n_ops)]
    coins = [rng.random() for _ in range(n_ops)]
    live: list[int] = []
    start = time.perf_counter()
    for i in range(n_ops):
        if live and (coins[i] < 0.5 or len(live) > 2000):
            j = int(coins[i] * 1e6) % len(live)
            live[j], live[-1] = live[-1], live[j]
            a.free(live.pop(), 0.0)
        else:
            live.append(a.malloc(sizes_[i], streams[i], 0.0, "op", "t", "activations"))
    return time.perf_counter() - start, a


def test_mixed_workload_smoke():
    _, a = mixed_workload("caching", 5_000)
    assert a.reserved_bytes >= a.allocated_bytes > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind, options", [("caching", {}), ("exact", {}), ("caching", {"expandable_segments": True})])
def test_200k_mixed_operations_are_fast(kind, options):
    seconds, _ = mixed_workload(kind, 200_000, **options)
    print(f"{kind} {options}: 200,000 malloc/free in {seconds:.3f} s")
    assert seconds < 10.0       # generous: catches accidental O(n^2), not machine noise
