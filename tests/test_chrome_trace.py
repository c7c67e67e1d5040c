"""Tests of the Chrome/Perfetto trace exporter (simulator/trace/chrome.py)."""

from __future__ import annotations

import gzip
import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.trace.chrome import (
    MAX_COUNTER_SAMPLES,
    chrome_trace,
    chrome_trace_json,
    downsample_memory,
    write_chrome_trace,
)
from simulator.trace.records import MemorySample, RankTrace, Span, Trace
from simulator.workload.graph import CATEGORIES

GIB = 2**30


def _sample(time_s: float, activations: int, reserved_extra: int = 0) -> MemorySample:
    by_category = (1000, 0, 0, activations, 0, 0)
    allocated = sum(by_category)
    return MemorySample(time_s, allocated, allocated + reserved_extra, by_category)


def _two_rank_trace() -> Trace:
    """Rank 0 sends an activation to rank 1 in each of two iterations; both all-reduce."""
    ranks = []
    for r in range(2):
        rank = RankTrace(rank=r, device="h100-sxm", capacity_bytes=80 * GIB)
        for it in range(2):
            t0 = it * 1.0
            rank.spans.append(Span(r, "compute", "layer0.fc1", "gemm", "fwd", t0, t0 + 0.1,
                                   flops=2e12, bytes=4096, iteration=it))
            rank.spans.append(Span(r, "compute", "layer0.fc1.bwd", "gemm", "bwd_input",
                                   t0 + 0.3, t0 + 0.5, flops=4e12, iteration=it))
            kind = "send" if r == 0 else "recv"
            rank.spans.append(Span(r, "comm", "act.mb0", kind, "comm", t0 + 0.1 + 0.05 * r,
                                   t0 + 0.2 + 0.05 * r, bytes=1 << 20, iteration=it))
            rank.spans.append(Span(r, "comm", "grads", "all_reduce", "comm", t0 + 0.5, t0 + 0.7,
                                   bytes=1 << 24, iteration=it))
            rank.memory.extend([_sample(t0, 0), _sample(t0 + 0.1, 500 + r, 64),
                                _sample(t0 + 0.5, 0, 64)])
        rank.peak_allocated = 1500 + r
        rank.peak_time_s = 1.1
        ranks.append(rank)
    return Trace(ranks=ranks, iteration_bounds_s=[(0.0, 1.0), (1.0, 2.0)], end_time_s=2.0)


def _events(doc: dict, ph: str) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == ph]


def test_top_level_like_pytorch_profiler():
    doc = chrome_trace(_two_rank_trace(), "unit", world_size=8)
    assert doc["schemaVersion"] == 1
    assert doc["displayTimeUnit"] == "ms"
    assert doc["distributedInfo"] == {"backend": "nccl", "rank": 0, "world_size": 8}
    assert [d["id"] for d in doc["deviceProperties"]] == [0, 1]
    assert doc["deviceProperties"][0]["totalGlobalMem"] == 80 * GIB
    text = chrome_trace_json(_two_rank_trace(), "unit")
    # HTA finds the rank with the regex "rank":\s+(\d+): it needs the space.
    assert re.search(r'"rank":\s+(\d+)', text).group(1) == "0"
    assert json.loads(text) == chrome_trace(_two_rank_trace(), "unit")


def test_complete_events_fields_and_microseconds():
    doc = chrome_trace(_two_rank_trace(), "unit")
    slices = [e for e in _events(doc, "X") if e["cat"] != "user_annotation"]
    assert len(slices) == 16
    fc1 = [e for e in slices if e["name"] == "layer0.fc1" and e["pid"] == 1]
    assert fc1[1]["ts"] == 1_000_000.0 and fc1[1]["dur"] == 100_000.0
    assert fc1[1]["cat"] == "kernel"
    assert fc1[1]["args"] == {"flops": 2e12, "bytes": 4096, "phase": "fwd", "iteration": 1,
                              "kind": "gemm", "stream": 2, "stream_name": "compute"}
    comm = [e for e in slices if e["args"]["kind"] in ("all_reduce", "send", "recv")]
    assert len(comm) == 8
    assert all(e["cat"] == "communication" and e["name"].startswith("nccl") for e in comm)
    assert all(e["args"]["stream"] > 0 for e in slices)
    assert {e["pid"] for e in doc["traceEvents"]} == {1, 2}     # pid = rank + 1, never 0


def test_metadata_names_processes_and_streams():
    doc = chrome_trace(_two_rank_trace(), "unit", stage_of_rank={0: 0, 1: 1})
    meta = _events(doc, "M")
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert processes == {1: "rank 0 (stage 0) h100-sxm", 2: "rank 1 (stage 1) h100-sxm"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads[(1, 1)] == "iterations"
    assert threads[(1, 2)] == "compute stream"
    assert threads[(1, 3)] == "communication stream"
    used = {(e["pid"], e["tid"]) for e in _events(doc, "X")}
    assert used <= set(threads)


def test_iteration_annotations():
    doc = chrome_trace(_two_rank_trace(), "unit")
    steps = [e for e in _events(doc, "X") if e["cat"] == "user_annotation" and e["pid"] == 1]
    assert [(e["name"], e["ts"], e["dur"]) for e in steps] == [
        ("ProfilerStep#0", 0.0, 1_000_000.0), ("ProfilerStep#1", 1_000_000.0, 1_000_000.0)]


def test_memory_counters():
    doc = chrome_trace(_two_rank_trace(), "unit")
    counters = _events(doc, "C")
    memory = [e for e in counters if e["name"] == "memory" and e["pid"] == 2]
    assert len(memory) == 6
    assert memory[1] == {"ph": "C", "name": "memory", "pid": 2, "ts": 100_000.0,
                         "args": {"allocated": 1501, "reserved": 1565}}
    by_cat = [e for e in counters if e["name"] == "memory by category" and e["pid"] == 2]
    assert len(by_cat) == 6
    assert list(by_cat[1]["args"]) == list(CATEGORIES)
    assert by_cat[1]["args"]["activations"] == 501
    assert by_cat[1]["args"]["parameters"] == 1000


def test_flows_pair_send_and_recv_by_name_and_iteration():
    doc = chrome_trace(_two_rank_trace(), "unit")
    starts, finishes = _events(doc, "s"), _events(doc, "f")
    assert len(starts) == len(finishes) == 2
    assert len({e["id"] for e in starts}) == 2
    for s in starts:
        f = next(e for e in finishes if e["id"] == s["id"])
        assert f["bp"] == "e" and f["cat"] == s["cat"] and f["name"] == s["name"] == "act.mb0"
        assert (s["pid"], f["pid"]) == (1, 2)
        assert s["args"]["iteration"] == f["args"]["iteration"]
        # Each flow end lies inside a slice on its tid (the send / the recv).
        for end in (s, f):
            slices = [e for e in _events(doc, "X") if (e["pid"], e["tid"]) == (end["pid"], end["tid"])]
            assert any(e["ts"] <= end["ts"] <= e["ts"] + e["dur"] and e["name"].endswith("act.mb0")
                       for e in slices)
    iterations = sorted(e["args"]["iteration"] for e in starts)
    assert iterations == [0, 1]


def test_unmatched_send_has_no_flow():
    trace = _two_rank_trace()
    trace.ranks[1].spans = [s for s in trace.ranks[1].spans if s.kind != "recv"]
    doc = chrome_trace(trace, "unit")
    assert _events(doc, "s") == [] and _events(doc, "f") == []


def _assert_nested_per_tid(doc: dict) -> None:
    tracks: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for e in _events(doc, "X"):
        start = round(e["ts"] * 1000)
        tracks.setdefault((e["pid"], e["tid"]), []).append((start, start + round(e["dur"] * 1000)))
    for intervals in tracks.values():
        for i, (a0, a1) in enumerate(intervals):
            for b0, b1 in intervals[i + 1:]:
                disjoint = a1 <= b0 or b1 <= a0
                nested = (a0 <= b0 and b1 <= a1) or (b0 <= a0 and a1 <= b1)
                assert disjoint or nested, ((a0, a1), (b0, b1))


def test_partially_overlapping_spans_go_to_an_overflow_track():
    rank = RankTrace(rank=0, device="a100", capacity_bytes=40 * GIB)
    rank.spans = [
        Span(0, "comm", "ar0", "all_reduce", "comm", 0.0, 2.0),
        Span(0, "comm", "ar1", "all_reduce", "comm", 1.0, 3.0),      # partial overlap with ar0
        Span(0, "comm", "ar2", "all_reduce", "comm", 0.5, 1.5),      # nests in ar0
        Span(0, "comm", "ar3", "all_reduce", "comm", 2.0, 2.5),      # touches ar0's end
    ]
    doc = chrome_trace(Trace([rank], [], 3.0), "overlap")
    tid_of = {e["name"].split()[-1]: e["tid"] for e in _events(doc, "X")}
    assert tid_of["ar0"] == tid_of["ar2"] == tid_of["ar3"] == 2
    assert tid_of["ar1"] == 2 * 1000 + 1
    names = {e["tid"]: e["args"]["name"] for e in _events(doc, "M") if e["name"] == "thread_name"}
    assert names[2001] == "communication stream (overflow 1)"
    _assert_nested_per_tid(doc)


_interval = st.tuples(st.integers(0, 2000), st.integers(0, 500))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["compute", "comm", "h2d"]), _interval), max_size=30))
def test_slices_on_one_tid_nest_or_are_disjoint(items):
    rank = RankTrace(rank=3, device="a100", capacity_bytes=40 * GIB)
    rank.spans = [Span(3, stream, f"op{i}", "gemm", "fwd", start * 1e-6, (start + dur) * 1e-6)
                  for i, (stream, (start, dur)) in enumerate(items)]
    doc = chrome_trace(Trace([rank], [(0.0, 0.001), (0.001, 0.0025)], 0.0025), "prop")
    assert len([e for e in _events(doc, "X") if e["cat"] != "user_annotation"]) == len(items)
    _assert_nested_per_tid(doc)


def test_deterministic_bytes(tmp_path):
    write_chrome_trace(tmp_path / "a.json", _two_rank_trace(), "unit")
    write_chrome_trace(tmp_path / "b.json", _two_rank_trace(), "unit")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    write_chrome_trace(tmp_path / "a.json.gz", _two_rank_trace(), "unit")
    write_chrome_trace(tmp_path / "b.json.gz", _two_rank_trace(), "unit")
    assert (tmp_path / "a.json.gz").read_bytes() == (tmp_path / "b.json.gz").read_bytes()
    unzipped = gzip.decompress((tmp_path / "a.json.gz").read_bytes())
    assert unzipped == (tmp_path / "a.json").read_bytes()
    # Input order of ranks does not change the output.
    reversed_trace = _two_rank_trace()
    reversed_trace.ranks.reverse()
    assert chrome_trace_json(reversed_trace, "unit") == chrome_trace_json(_two_rank_trace(), "unit")


def test_downsampling_keeps_peak_and_bounds():
    count = 3 * MAX_COUNTER_SAMPLES
    samples = [_sample(i * 1e-6, (i * 7919) % 10007, reserved_extra=(i * 31) % 97)
               for i in range(count)]
    samples[40_001] = _sample(40_001e-6, 50_000)
    samples[12_345] = _sample(12_345e-6, 0, reserved_extra=10**6)
    kept = downsample_memory(samples)
    assert len(kept) <= MAX_COUNTER_SAMPLES
    assert kept[0] is samples[0] and kept[-1] is samples[-1]
    assert samples[40_001] in kept and samples[12_345] in kept
    assert max(s.allocated for s in kept) == 50_000 + 1000
    assert [s.time_s for s in kept] == sorted(s.time_s for s in kept)
    assert downsample_memory(samples) == kept
    rank = RankTrace(rank=0, device="h100-sxm", capacity_bytes=80 * GIB, memory=samples)
    doc = chrome_trace(Trace([rank], [], count * 1e-6), "big")
    memory = [e for e in _events(doc, "C") if e["name"] == "memory"]
    assert len(memory) <= MAX_COUNTER_SAMPLES
    assert max(e["args"]["allocated"] for e in memory) == 50_000 + 1000
    assert max(e["args"]["reserved"] for e in memory) == 10**6 + 1000


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 10**9), min_size=1, max_size=400), st.integers(8, 60))
def test_downsampling_property(values, limit):
    samples = [_sample(i * 1e-3, v) for i, v in enumerate(values)]
    kept = downsample_memory(samples, limit)
    assert len(kept) <= max(limit, 8) or len(kept) == len(samples)
    assert max(s.allocated for s in kept) == max(s.allocated for s in samples)
    assert kept[0] is samples[0] and kept[-1] is samples[-1]
    assert all(a.time_s < b.time_s for a, b in zip(kept, kept[1:]))
