"""PyTorch memory snapshots: build the `_dump_snapshot()` dict from allocator events and segments, write it."""

from __future__ import annotations

import os
import pickle
from sys import intern

from simulator.io import atomic_write_bytes
from simulator.trace.records import AllocatorEvent

# Pickle protocol of the written file: pytorch.org/memory_viz's unpickler accepts protocols 2-4 only.
SNAPSHOT_PICKLE_PROTOCOL = 4

# Every string of a snapshot is interned: pickle writes a string object once and refers back to it after, so
# the bytes of the file would otherwise depend on which equal strings the run happened to share (those made by
# memory worker processes, engine/memory_worker.py, are copies): one object per value makes them depend on the
# values only.

# Trace actions the viewer understands (torch/csrc/cuda/memory_snapshot.cpp).
TRACE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                 "segment_map", "segment_unmap", "snapshot", "oom")


def make_frames(op: str, tensor: str, category: str) -> list[dict]:
    """Stack frames naming the simulated op and tensor, as the viewer shows them.

    Args:
        op: operator name ("layer3.mlp.fc1 fwd"); may be empty.
        tensor: tensor name; may be empty.
        category: memory category ("activations"); shown as the frame's file name.

    Returns:
        `[{"filename": category, "line": 0, "name": "<op> <tensor>"}]`, or `[]` when all are empty.
    """
    if not (op or tensor or category):
        return []
    name = f"{op} {tensor}".strip() or "<unnamed>"
    return [{"filename": intern(category or "memsim"), "line": 0, "name": intern(name)}]


def trace_entry(event: AllocatorEvent) -> dict:
    """One `device_traces` entry for an allocator event (an `oom` carries `device_free`, not `addr`).

    Args:
        event: the allocator event; for `oom` its `addr` holds the device's free bytes, as in PyTorch.

    Returns:
        A dict with plain Python values only; `time_us` is the event time in whole microseconds.
    """
    entry: dict = {"action": intern(str(event.action))}
    if event.action == "oom":
        entry["device_free"] = int(event.addr)
    else:
        entry["addr"] = int(event.addr)
    entry["size"] = int(event.size)
    entry["stream"] = int(event.stream)
    entry["time_us"] = int(round(float(event.time_s) * 1e6))
    entry["frames"] = make_frames(event.op, event.tensor, event.category)
    return entry


def _plain_frames(frames: list) -> list[dict]:
    return [{"filename": intern(str(f["filename"])), "line": int(f["line"]), "name": intern(str(f["name"]))}
            for f in frames]


def _plain_segment(segment: dict, device: int) -> dict:
    blocks = [
        {
            "address": int(b["address"]),
            "size": int(b["size"]),
            "requested_size": int(b["requested_size"]),
            "state": intern(str(b["state"])),
            "frames": _plain_frames(b.get("frames", [])),
        }
        for b in segment["blocks"]
    ]
    pool_id = segment.get("segment_pool_id", (0, 0))
    return {
        "device": int(device),
        "address": int(segment["address"]),
        "total_size": int(segment["total_size"]),
        "allocated_size": int(segment["allocated_size"]),
        "active_size": int(segment["active_size"]),
        "requested_size": int(segment["requested_size"]),
        "stream": int(segment["stream"]),
        "segment_type": intern(str(segment["segment_type"])),
        "segment_pool_id": (int(pool_id[0]), int(pool_id[1])),
        "is_expandable": bool(segment.get("is_expandable", False)),
        "frames": _plain_frames(segment.get("frames", [])),
        "blocks": blocks,
    }


def build_snapshot(device_events: list[list[AllocatorEvent]], device_segments: list[list[dict]]) -> dict:
    """The snapshot dict `torch.cuda.memory._snapshot()` would return for the simulated devices.

    Device `i` is `device_events[i]` (its allocator events, in order) with `device_segments[i]` (the
    allocator's `segments()` at the end). Segments are sorted by address and get `"device": i`.
    Trace entries carry no `category` key: the viewer's category legend breaks unless one is
    named "unknown"; the category is in each entry's frame instead.

    Args:
        device_events: one list of AllocatorEvent per device.
        device_segments: one `segments()` list per device, same length as `device_events`.

    Returns:
        `{"segments": [...], "device_traces": [[...], ...], "allocator_settings": {}}` holding only
        dict/list/tuple/str/int/float/bool/None.

    Raises:
        ValueError: the two lists have different lengths.
    """
    if len(device_events) != len(device_segments):
        raise ValueError(
            f"build_snapshot: {len(device_events)} event lists but {len(device_segments)} segment lists; "
            "give one of each per device"
        )
    segments = []
    for device, segs in enumerate(device_segments):
        segments.extend(_plain_segment(s, device) for s in segs)
    segments.sort(key=lambda s: (s["device"], s["address"]))
    traces = [[trace_entry(e) for e in events] for events in device_events]
    return {"segments": segments, "device_traces": traces, "allocator_settings": {}}


def write_snapshot(path: str | os.PathLike, snapshot: dict) -> None:
    """Write a snapshot as a pickle (protocol 4) atomically: a temporary file, then a rename.

    Args:
        path: target file, conventionally `memory_snapshot.pickle`; parent folders are created.
        snapshot: a dict from `build_snapshot`.
    """
    atomic_write_bytes(path, pickle.dumps(snapshot, protocol=SNAPSHOT_PICKLE_PROTOCOL))
