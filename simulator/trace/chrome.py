"""Chrome/Perfetto trace-event JSON export of a simulated Trace (PyTorch-profiler-like layout)."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from simulator.io import atomic_write_bytes
from simulator.trace.records import MemorySample, RankTrace, Span, Trace
from simulator.workload.graph import CATEGORIES

if TYPE_CHECKING:
    from simulator.parallel.plan import Coords

# Counter samples kept per rank before downsampling kicks in.
MAX_COUNTER_SAMPLES = 20_000

# Streams listed first (in this order) on every rank; any other stream follows alphabetically.
_STREAM_ORDER = ("compute", "comm", "h2d", "d2h")
# Span kinds drawn as communication (everything else on a non-copy stream is a compute kernel).
_COMM_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce",
               "send", "recv", "barrier")
_COPY_STREAMS = ("h2d", "d2h")
# Perfetto treats pid 0 / tid 0 as the kernel's idle task, so ids start at 1: pid = rank + 1,
# tid 1 is the per-rank "iterations" track (ProfilerStep#N annotations), stream k (0-based, in
# _stream_names order) has id and tid k + 2, and its overflow lanes tids id * _OVERFLOW_BASE + lane.
_STEP_TID = 1
_FIRST_STREAM_ID = 2
_OVERFLOW_BASE = 1000


@dataclass(frozen=True, slots=True)
class _Placed:
    """A span with integer-nanosecond bounds and the track (tid) it was put on."""

    span: Span
    start_ns: int
    end_ns: int
    tid: int
    stream_id: int


def _ns(time_s: float) -> int:
    return int(round(time_s * 1e9))


def _us(time_ns: int) -> float:
    return time_ns / 1000.0


def _stream_names(spans: list[Span]) -> list[str]:
    present = sorted({span.stream for span in spans})
    head = [name for name in _STREAM_ORDER if name in present]
    return head + [name for name in present if name not in _STREAM_ORDER]


def _stream_label(stream: str) -> str:
    labels = {"compute": "compute stream", "comm": "communication stream",
              "h2d": "host-to-device copy stream", "d2h": "device-to-host copy stream"}
    return labels.get(stream, f"{stream} stream")


def _place_spans(spans: list[Span]) -> tuple[list[_Placed], list[tuple[int, str]]]:
    """Assign every span a tid so that slices on one tid nest or are disjoint.

    Spans of one stream go to that stream's tid; a span that would overlap an open slice only
    partially goes to the first overflow lane of its stream where it nests (Perfetto would
    otherwise move it itself, out of order).

    Returns:
        The placed spans (in input order) and the (tid, thread name) of every track used.
    """
    streams = _stream_names(spans)
    stream_index = {name: i for i, name in enumerate(streams)}
    by_stream: dict[str, list[tuple[int, int, int]]] = {name: [] for name in streams}
    for idx, span in enumerate(spans):
        start_ns = _ns(span.start_s)
        end_ns = max(start_ns, _ns(span.end_s))
        by_stream[span.stream].append((start_ns, end_ns, idx))
    placed: list[_Placed | None] = [None] * len(spans)
    tracks: list[tuple[int, str]] = []
    for name in streams:
        k = stream_index[name]
        stream_id = k + _FIRST_STREAM_ID
        lanes: list[list[int]] = []          # per lane: stack of open slice end times
        # Longer slices first at equal start so that the shorter ones nest inside them.
        for start_ns, end_ns, idx in sorted(by_stream[name], key=lambda t: (t[0], -t[1], t[2])):
            chosen = -1
            for lane_no, stack in enumerate(lanes):
                while stack and stack[-1] <= start_ns:
                    stack.pop()
                if not stack or end_ns <= stack[-1]:
                    chosen = lane_no
                    break
            if chosen < 0:
                lanes.append([])
                chosen = len(lanes) - 1
            lanes[chosen].append(end_ns)
            tid = stream_id if chosen == 0 else stream_id * _OVERFLOW_BASE + chosen
            placed[idx] = _Placed(spans[idx], start_ns, end_ns, tid, stream_id)
        for lane_no in range(len(lanes)):
            if lane_no == 0:
                tracks.append((stream_id, _stream_label(name)))
            else:
                tracks.append((stream_id * _OVERFLOW_BASE + lane_no,
                               f"{_stream_label(name)} (overflow {lane_no})"))
    return [p for p in placed if p is not None], tracks


def downsample_memory(samples: list[MemorySample], max_samples: int = MAX_COUNTER_SAMPLES,
                      ) -> list[MemorySample]:
    """Thin a memory timeline deterministically, keeping its envelope and its peaks.

    The samples are cut into equal index buckets; each bucket keeps its lowest and highest
    allocated sample (first one on ties). The first and last samples, the first sample with the
    highest allocated bytes and the first with the highest reserved bytes are always kept.

    Args:
        samples: memory samples in time order.
        max_samples: the most samples returned (at least 8).

    Returns:
        The samples themselves when there are at most `max_samples`, else a time-ordered subset.
    """
    count = len(samples)
    limit = max(8, int(max_samples))
    if count <= limit:
        return list(samples)
    buckets = (limit - 4) // 2
    allocated = np.fromiter((s.allocated for s in samples), dtype=np.int64, count=count)
    reserved = np.fromiter((s.reserved for s in samples), dtype=np.int64, count=count)
    keep = {0, count - 1, int(np.argmax(allocated)), int(np.argmax(reserved))}
    for b in range(buckets):
        lo = b * count // buckets
        hi = (b + 1) * count // buckets
        if lo >= hi:
            continue
        chunk = allocated[lo:hi]
        keep.add(lo + int(np.argmin(chunk)))
        keep.add(lo + int(np.argmax(chunk)))
    return [samples[i] for i in sorted(keep)]


def process_label(rank: int, device: str, coords: Coords) -> str:
    """The Chrome process name of a rank of a parallel plan: "rank 5 · stage 1 · dp 0 · tp 1 · a100-sxm-80gb"."""
    return f"rank {rank} · stage {coords.pp} · dp {coords.dp} · tp {coords.tp} · {device}"


def _rank_label(rank: RankTrace, stage_of_rank: dict[int, int] | None,
                coords_of_rank: Mapping[int, Coords] | None = None) -> str:
    if coords_of_rank is not None and rank.rank in coords_of_rank:
        return process_label(rank.rank, rank.device, coords_of_rank[rank.rank])
    if stage_of_rank is not None and rank.rank in stage_of_rank:
        return f"rank {rank.rank} (stage {stage_of_rank[rank.rank]}) {rank.device}"
    return f"rank {rank.rank} {rank.device}"


def _event_category(span: Span) -> str:
    if span.kind in _COMM_KINDS:
        return "communication"
    if span.stream in _COPY_STREAMS or span.kind in _OFFLOAD_COPIES:
        return "gpu_memcpy"
    if span.kind == "host":
        return "cpu_op"              # the host's offloaded optimizer step
    if span.kind in ("nvme_read", "nvme_write"):
        return "io"                  # drive reads and writes of NVMe offload
    if span.phase == "comm":
        return "communication"
    return "kernel"


_OFFLOAD_COPIES = ("d2h", "h2d")     # offload transfers (program.Transfer routes) that are PCIe copies


def _event_name(span: Span, category: str) -> str:
    # HTA classifies kernels by name: "nccl..." is communication, "Memcpy..." is a copy.
    if category == "communication" and not span.name.lower().startswith("nccl"):
        return f"nccl:{span.kind} {span.name}"
    if category == "gpu_memcpy" and not span.name.startswith("Memcpy"):
        direction = span.kind if span.kind in _OFFLOAD_COPIES else span.stream
        return f"Memcpy {direction.upper()} {span.name}"
    return span.name


def _span_events(pid: int, placed: list[_Placed], stream_names: list[str]) -> list[dict]:
    events = []
    for item in placed:
        span = item.span
        category = _event_category(span)
        events.append({
            "ph": "X", "cat": category, "name": _event_name(span, category),
            "pid": pid, "tid": item.tid,
            "ts": _us(item.start_ns), "dur": _us(item.end_ns - item.start_ns),
            "args": {"flops": span.flops, "bytes": span.bytes, "phase": span.phase,
                     "iteration": span.iteration, "kind": span.kind,
                     "stream": item.stream_id,
                     "stream_name": stream_names[item.stream_id - _FIRST_STREAM_ID]},
        })
    return events


def _step_events(pid: int, bounds: list[tuple[float, float]]) -> list[dict]:
    events = []
    last_end_ns = None
    for number, (start_s, end_s) in enumerate(bounds):
        start_ns = _ns(start_s)
        if last_end_ns is not None and start_ns < last_end_ns:
            start_ns = last_end_ns
        end_ns = max(start_ns, _ns(end_s))
        last_end_ns = end_ns
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{number}",
                       "pid": pid, "tid": _STEP_TID, "ts": _us(start_ns),
                       "dur": _us(end_ns - start_ns), "args": {"iteration": number}})
    return events


def _counter_events(pid: int, samples: list[MemorySample]) -> list[dict]:
    events = []
    for sample in downsample_memory(samples):
        ts = _us(_ns(sample.time_s))
        events.append({"ph": "C", "name": "memory", "pid": pid, "ts": ts,
                       "args": {"allocated": sample.allocated, "reserved": sample.reserved}})
        values = sample.by_category
        if len(values) != len(CATEGORIES):
            values = tuple(values[:len(CATEGORIES)]) + (0,) * (len(CATEGORIES) - len(values))
        by_category = dict(zip(CATEGORIES, values))
        events.append({"ph": "C", "name": "memory by category", "pid": pid, "ts": ts,
                       "args": by_category})
    return events


def _flow_order(pair: tuple[int, _Placed]) -> tuple[int, int, int, int]:
    pid, item = pair
    return (item.start_ns, pid, item.tid, item.end_ns)


def _flow_events(placed_by_pid: list[tuple[int, list[_Placed]]]) -> list[dict]:
    """Pair the k-th send and the k-th recv of one (name, iteration) with a flow arrow."""
    sends: dict[tuple[int, str], list[tuple[int, _Placed]]] = {}
    recvs: dict[tuple[int, str], list[tuple[int, _Placed]]] = {}
    for pid, placed in placed_by_pid:
        for item in placed:
            if item.span.kind not in ("send", "recv"):
                continue
            table = sends if item.span.kind == "send" else recvs
            table.setdefault((item.span.iteration, item.span.name), []).append((pid, item))
    events = []
    flow_id = 0
    for key in sorted(set(sends) & set(recvs)):
        iteration, name = key
        for (s_pid, send), (r_pid, recv) in zip(sorted(sends[key], key=_flow_order),
                                                 sorted(recvs[key], key=_flow_order)):
            flow_id += 1
            common = {"name": name, "cat": "send_recv", "id": flow_id}
            events.append({"ph": "s", **common, "pid": s_pid, "tid": send.tid,
                           "ts": _us(send.start_ns), "args": {"iteration": iteration}})
            events.append({"ph": "f", "bp": "e", **common, "pid": r_pid, "tid": recv.tid,
                           "ts": _us(recv.start_ns), "args": {"iteration": iteration}})
    return events


def _metadata_events(pid: int, label: str, tracks: list[tuple[int, str]], has_steps: bool,
                     ) -> list[dict]:
    events = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": _STEP_TID, "args": {"name": label}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": _STEP_TID,
         "args": {"sort_index": pid}},
    ]
    named = ([(_STEP_TID, "iterations")] if has_steps else []) + sorted(tracks)
    for order, (tid, name) in enumerate(named):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                       "args": {"sort_index": order}})
    return events


def chrome_trace(trace: Trace, scenario_name: str, *, stage_of_rank: dict[int, int] | None = None,
                 world_size: int | None = None, coords_of_rank: Mapping[int, Coords] | None = None) -> dict:
    """Build a Chrome/Perfetto trace-event document for a simulated Trace.

    One pid per simulated rank (pid = rank + 1: Perfetto treats pid 0 specially), one tid per
    stream (a span that would overlap another only partially goes to an overflow track of its
    stream), complete events for spans (cat "kernel", "communication" or "gpu_memcpy"; args
    flops, bytes, phase, iteration, kind, stream (int > 0, as HTA wants) and stream_name),
    counters "memory" (allocated, reserved bytes) and "memory by category" (one series per
    category, downsampled past MAX_COUNTER_SAMPLES per rank keeping the peaks), iteration
    annotations ProfilerStep#N (cat "user_annotation") and send→recv flow arrows pairing the
    k-th send with the k-th recv of the same (name, iteration). Times are in microseconds,
    rounded to the nanosecond.

    Args:
        trace: the simulation result.
        scenario_name: written as the trace name.
        stage_of_rank: pipeline stage of each rank, used in process names when given.
        world_size: ranks in the whole job (default: the number of simulated ranks).
        coords_of_rank: (dp, pp, tp) coordinates of each rank in the parallel plan; a rank found
            here is named "rank r · stage s · dp d · tp t · device" (process_label).

    Returns:
        A JSON-serializable dict (see write_chrome_trace).
    """
    ranks = sorted(trace.ranks, key=lambda r: r.rank)
    events: list[dict] = []
    placed_by_pid: list[tuple[int, list[_Placed]]] = []
    for rank in ranks:
        pid = rank.rank + 1
        placed, tracks = _place_spans(rank.spans)
        steps = _step_events(pid, trace.iteration_bounds_s)
        events.extend(_metadata_events(pid, _rank_label(rank, stage_of_rank, coords_of_rank), tracks,
                                       bool(steps)))
        events.extend(steps)
        events.extend(_span_events(pid, placed, _stream_names(rank.spans)))
        events.extend(_counter_events(pid, rank.memory))
        placed_by_pid.append((pid, placed))
    events.extend(_flow_events(placed_by_pid))
    return {
        "schemaVersion": 1,
        "traceName": scenario_name,
        "deviceProperties": [
            {"id": rank.rank, "name": rank.device, "totalGlobalMem": rank.capacity_bytes}
            for rank in ranks
        ],
        "distributedInfo": {
            "backend": "nccl",
            "rank": ranks[0].rank if ranks else 0,
            "world_size": int(world_size) if world_size is not None else len(ranks),
        },
        "displayTimeUnit": "ms",
        "traceEvents": events,
    }


def chrome_trace_json(trace: Trace, scenario_name: str, *,
                      stage_of_rank: dict[int, int] | None = None,
                      world_size: int | None = None,
                      coords_of_rank: Mapping[int, Coords] | None = None) -> str:
    """Serialize chrome_trace(...) deterministically, with a space after colons ("rank": 0)."""
    document = chrome_trace(trace, scenario_name, stage_of_rank=stage_of_rank,
                            world_size=world_size, coords_of_rank=coords_of_rank)
    return json.dumps(document, indent=None, separators=(", ", ": "), allow_nan=False)


def write_chrome_trace(path: str | os.PathLike, trace: Trace, scenario_name: str, *,
                       stage_of_rank: dict[int, int] | None = None,
                       world_size: int | None = None,
                       coords_of_rank: Mapping[int, Coords] | None = None) -> None:
    """Write the Chrome/Perfetto trace atomically; a path ending in ".gz" is gzip-compressed.

    Args:
        path: output file (".json" or ".json.gz").
        trace: the simulation result.
        scenario_name: written as the trace name.
        stage_of_rank: pipeline stage of each rank, used in process names when given.
        world_size: ranks in the whole job (default: the number of simulated ranks).
        coords_of_rank: (dp, pp, tp) of each rank, for process names (see chrome_trace).
    """
    data = chrome_trace_json(trace, scenario_name, stage_of_rank=stage_of_rank,
                             world_size=world_size, coords_of_rank=coords_of_rank).encode("utf-8")
    if os.fspath(path).endswith(".gz"):
        data = gzip.compress(data, compresslevel=6, mtime=0)
    atomic_write_bytes(path, data)
