"""PyTorch memory snapshots from simulated allocators: structure, pickle, viewer replay, torch rendering."""

from __future__ import annotations

import os
import pickle
import pickletools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.engine.allocator import OutOfMemory, make_allocator
from simulator.trace.records import AllocatorEvent
from simulator.trace.snapshot import TRACE_ACTIONS, build_snapshot, make_frames, write_snapshot

MiB = 1 << 20

# Opcodes the unpickler in torch/utils/viz/MemoryViz.js understands (it rejects everything else).
VIEWER_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWTRUE", "NEWFALSE",
    "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE",
}
PLAIN = (dict, list, tuple, str, int, float, bool, type(None))


def random_run(kind: str, seed: int, n_ops: int = 300, **options):
    """A small random workload on three streams with pending frees, empty_cache and OOMs."""
    rng = random.Random(seed)
    a = make_allocator(kind, 96 * MiB, **options)
    live: list[int] = []
    pending: list[int] = []
    for i in range(n_ops):
        t = i * 1e-3
        r = rng.random()
        if r < 0.5 or not live:
            size = rng.choice((rng.randint(1, 8192), rng.randint(8192, 2 * MiB), rng.randint(MiB, 30 * MiB)))
            try:
                live.append(a.malloc(size, rng.choice((0, 0, 1, 2)), t, f"layer{i % 4}.op{i}", f"t{i}",
                                     rng.choice(("activations", "parameters", "other"))))
            except OutOfMemory:
                pass
        elif r < 0.9:
            h = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.2:
                a.free(h, t, "bwd", pending_streams=(3,))
                pending.append(h)
            else:
                a.free(h, t)
        elif r < 0.97 and pending:
            a.complete_pending(pending.pop(0), t)
        else:
            a.empty_cache(t)
    return a


def assert_plain(value) -> None:
    assert isinstance(value, PLAIN), type(value)
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str)
            assert_plain(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            assert_plain(v)


def replay_backwards(snapshot: dict, device: int) -> None:
    """Replay device_traces backwards from the final segments as MemoryViz.js does, checking each step.

    Every live block must lie inside a live segment, every segment_alloc/segment_map must find its
    segment, and before the first event nothing may be left (the simulated allocator starts empty).
    """
    events: list[dict] = []
    for e in snapshot["device_traces"][device]:              # the viewer elides requested+completed pairs
        if (e["action"] == "free_completed" and events and events[-1]["action"] == "free_requested"
                and events[-1]["addr"] == e["addr"]):
            events[-1] = {**events[-1], "action": "free"}
            continue
        events.append(e)
    segs = sorted(([s["address"], s["total_size"], s["stream"]] for s in snapshot["segments"]
                   if s["device"] == device), key=lambda s: s[0])
    blocks: dict[int, list] = {}
    for s in snapshot["segments"]:
        if s["device"] != device:
            continue
        for b in s["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                blocks[b["address"]] = [b["requested_size"], b["state"] == "active_pending_free"]

    def check(where: str) -> None:
        for i in range(len(segs) - 1):
            assert segs[i][0] + segs[i][1] <= segs[i + 1][0], f"{where}: segments overlap"
        for addr, (size, _) in blocks.items():
            assert any(s[0] <= addr and addr + size <= s[0] + s[1] for s in segs), f"{where}: block {addr} homeless"

    check("final state")
    for idx in range(len(events) - 1, -1, -1):
        e = events[idx]
        action, addr = e["action"], e.get("addr")
        where = f"event {idx} {action}"
        if action == "free":
            assert addr not in blocks, where
            blocks[addr] = [e["size"], False]
        elif action == "free_requested":
            assert addr in blocks and blocks[addr][1], where
            blocks[addr][1] = False
        elif action == "free_completed":
            assert addr not in blocks, where
            blocks[addr] = [e["size"], True]
        elif action == "alloc":
            assert addr in blocks and not blocks[addr][1] and blocks[addr][0] == e["size"], where
            del blocks[addr]
        elif action == "segment_free":
            segs.append([addr, e["size"], e["stream"]])
            segs.sort(key=lambda s: s[0])
        elif action == "segment_alloc":
            match = [s for s in segs if s[0] == addr and s[1] == e["size"]]
            assert len(match) == 1, where
            segs.remove(match[0])
        elif action == "segment_unmap":                        # map back in, merging with same-stream neighbours
            segs.append([addr, e["size"], e["stream"]])
            segs.sort(key=lambda s: s[0])
            merged: list[list] = []
            for s in segs:
                if merged and merged[-1][0] + merged[-1][1] == s[0] and merged[-1][2] == s[2]:
                    merged[-1][1] += s[1]
                else:
                    merged.append(list(s))
            segs[:] = merged
        elif action == "segment_map":                          # cut the range out of the segment holding it
            end = addr + e["size"]
            (s,) = [s for s in segs if s[0] <= addr and end <= s[0] + s[1]] or [None]
            assert s is not None, where
            segs.remove(s)
            if s[0] < addr:
                segs.append([s[0], addr - s[0], s[2]])
            if end < s[0] + s[1]:
                segs.append([end, s[0] + s[1] - end, s[2]])
            segs.sort(key=lambda x: x[0])
        check(where)
    assert segs == [] and blocks == {}, "state left before the first event"


CONFIGS = [("exact", {}), ("caching", {}), ("caching", {"max_split_size_bytes": 24 * MiB}),
           ("caching", {"expandable_segments": True}), ("caching", {"roundup_power2_divisions": 8})]


@pytest.mark.parametrize("kind, options", CONFIGS)
def test_snapshot_structure_and_replay(kind, options):
    runs = [random_run(kind, seed, **options) for seed in (1, 2)]
    snap = build_snapshot([a.events for a in runs], [a.segments() for a in runs])
    assert set(snap) == {"segments", "device_traces", "allocator_settings"}
    assert_plain(snap)
    assert len(snap["device_traces"]) == 2
    for device, a in enumerate(runs):
        segs = [s for s in snap["segments"] if s["device"] == device]
        assert sum(s["total_size"] for s in segs) == a.reserved_bytes
        for s in segs:
            assert {"device", "address", "total_size", "allocated_size", "active_size", "requested_size",
                    "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"} <= set(s)
            assert s["segment_pool_id"] == (0, 0) and s["segment_type"] in ("small", "large")
            addr = s["address"]
            for b in s["blocks"]:
                assert set(b) == {"address", "size", "requested_size", "state", "frames"}
                assert b["address"] == addr
                addr += b["size"]
            assert addr == s["address"] + s["total_size"]
        for e in snap["device_traces"][device]:
            assert e["action"] in TRACE_ACTIONS and isinstance(e["time_us"], int)
            assert ("device_free" in e) == (e["action"] == "oom") and ("addr" in e) != (e["action"] == "oom")
        replay_backwards(snap, device)


@pytest.mark.parametrize("kind, options", CONFIGS[:2] + CONFIGS[3:4])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), n_ops=st.integers(1, 200))
def test_replay_is_consistent_for_random_runs(kind, options, seed, n_ops):
    a = random_run(kind, seed, n_ops, **options)
    replay_backwards(build_snapshot([a.events], [a.segments()]), 0)


def test_frames_name_op_and_tensor_and_time_is_in_microseconds():
    a = make_allocator("caching", 96 * MiB)
    h = a.malloc(1000, 1, 1.5, "layer3.mlp.fc1 fwd", "act", "activations")
    a.free(h, 2.25)
    snap = build_snapshot([a.events], [a.segments()])
    alloc = [e for e in snap["device_traces"][0] if e["action"] == "alloc"][0]
    assert alloc["frames"] == [{"filename": "activations", "line": 0, "name": "layer3.mlp.fc1 fwd act"}]
    assert alloc["time_us"] == 1_500_000 and alloc["size"] == 1000 and alloc["stream"] == 1
    assert snap["device_traces"][0][-1]["time_us"] == 2_250_000
    assert make_frames("", "", "") == []


def test_oom_entry_carries_device_free():
    a = make_allocator("caching", 30 * MiB)
    a.malloc(20 * MiB, 0, 0.0)
    with pytest.raises(OutOfMemory):
        a.malloc(20 * MiB, 0, 1.0)
    entry = build_snapshot([a.events], [a.segments()])["device_traces"][0][-1]
    assert entry["action"] == "oom" and entry["device_free"] == 10 * MiB and entry["size"] == 20 * MiB


def test_build_snapshot_rejects_mismatched_devices():
    with pytest.raises(ValueError, match="per device"):
        build_snapshot([[]], [])


def test_snapshot_accepts_plain_event_records():
    ev = AllocatorEvent("segment_alloc", 4096, 2 * MiB, 0, 0.0)
    snap = build_snapshot([[ev]], [[]])
    assert snap["device_traces"][0][0] == {"action": "segment_alloc", "addr": 4096, "size": 2 * MiB, "stream": 0,
                                           "time_us": 0, "frames": []}


def test_write_snapshot_pickle_protocol_4_atomic_and_viewer_readable(tmp_path):
    a = random_run("caching", 3, expandable_segments=False)
    snap = build_snapshot([a.events], [a.segments()])
    path = tmp_path / "out" / "memory_snapshot.pickle"
    write_snapshot(path, snap)
    data = path.read_bytes()
    assert os.listdir(path.parent) == ["memory_snapshot.pickle"]           # no temporary file left
    ops = list(pickletools.genops(data))
    assert ops[0][0].name == "PROTO" and ops[0][1] <= 4
    assert {op.name for op, _, _ in ops} <= VIEWER_OPCODES
    assert pickle.loads(data) == snap


def test_snapshot_bytes_depend_on_values_not_on_shared_strings(tmp_path):
    # Two devices' events and segments as two memory worker processes hand them back (each unpickled on its own:
    # their equal strings are different objects) give the same file as the originals, whose strings the run
    # shares between the devices.
    runs = [random_run("caching", seed, expandable_segments=False) for seed in (5, 6)]
    events, segments = [a.events for a in runs], [a.segments() for a in runs]
    copies = [pickle.loads(pickle.dumps((e, s))) for e, s in zip(events, segments)]
    assert copies[0][0][0].action == events[1][0].action and copies[0][0][0].action is not copies[1][0][0].action
    write_snapshot(tmp_path / "a.pickle", build_snapshot(events, segments))
    write_snapshot(tmp_path / "b.pickle", build_snapshot([e for e, _ in copies], [s for _, s in copies]))
    assert (tmp_path / "a.pickle").read_bytes() == (tmp_path / "b.pickle").read_bytes()


@pytest.mark.torch
@pytest.mark.slow            # importing torch takes seconds
def test_torch_renders_the_snapshot():
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    for kind, options in CONFIGS:
        a = random_run(kind, 5, **options)
        snap = build_snapshot([a.events], [a.segments()])
        for html in (memory_viz.trace_plot(snap), memory_viz.segment_plot(snap)):
            assert "snapshot.pickle" in html and "MemoryViz.js" in html
        summary = memory_viz.segsum(snap)               # checks its own accounting
        assert "total_reserved" in summary
        assert "entries" in memory_viz.trace(snap)
