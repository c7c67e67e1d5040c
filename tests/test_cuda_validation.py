"""The committed H200 captures (validation/data/cuda): allocator replay, peak and reserved predictions, the report."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from simulator.engine.caching_allocator import CachingAllocator
from validation.compare import RunComparison, _memory_runs

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "validation/data/cuda"
CAPTURES = sorted(p.stem for p in (DATA / "memory").glob("*.json"))
def _document(name: str) -> dict:
    return json.loads((DATA / "memory" / f"{name}.json").read_text())


def _replay(document: dict) -> tuple[CachingAllocator, list[int]]:
    """Feed the measured alloc/free sequence (model build to the measured step's end) to memsim's allocator."""
    actions = document["history"]["actions"]
    allocator = CachingAllocator(200 * 2**30, record_events=False)
    handles: dict[int, int] = {}
    measured_segments = []
    for step, (action, size, address) in enumerate(document["history"]["rows"] + document["trace"]["rows"]):
        kind = actions[action]
        if kind == "alloc":
            handles[address] = allocator.malloc(size, 0, step * 1e-6)
        elif kind == "free_completed":
            allocator.free(handles.pop(address), step * 1e-6)
        elif kind == "segment_alloc":
            measured_segments.append(size)
    return allocator, measured_segments


def test_eight_configurations_were_captured_on_one_h200():
    assert len(CAPTURES) == 8
    for name in CAPTURES:
        env = _document(name)["environment"]
        assert env["device_name"] == "NVIDIA H200" and env["torch_version"].startswith("2.11")
        assert (DATA / "timing" / f"{name}.json").exists()


@pytest.mark.parametrize("name", CAPTURES)
def test_memsim_allocator_replays_the_measured_trace_to_the_measured_segments(name):
    """The caching-allocator model alone: the real request sequence gives the real segments (one stream)."""
    document = _document(name)
    allocator, measured = _replay(document)
    reserved = sum(s["total_size"] for s in allocator.segments())
    assert sum(measured) == document["results"]["max_memory_reserved_bytes"]
    if name.startswith("llama-1b"):
        # 328 segments; three differ (one 16/20 MiB vs 44 MiB choice): 12 MiB of 18.9 GiB.
        assert abs(reserved - sum(measured)) <= 0.001 * sum(measured)
    else:
        assert Counter(s["total_size"] for s in allocator.segments()) == Counter(measured)
    # The trace's sizes are requested bytes; allocated also counts each block's rounding and unsplit rest.
    assert abs(allocator._peak_allocated / document["results"]["max_memory_allocated_bytes"] - 1) < 0.002


@pytest.fixture(scope="module")
def predictions() -> dict[str, dict]:
    return _memory_runs(DATA, None, None)


def test_peak_allocated_within_one_percent_on_every_cuda_capture(predictions):
    """Issue 4 target; measured: every peak within 0.08%."""
    assert sorted(predictions) == CAPTURES
    for name, run in predictions.items():
        assert abs(RunComparison.error(run["predicted_peak_bytes"], run["measured_peak_bytes"])) < 0.001, name


def test_reserved_within_three_percent_on_every_cuda_capture(predictions):
    """Issue 4 target (reserved within 3%); measured: every configuration within 0.13%."""
    for name, run in predictions.items():
        error = RunComparison.error(run["predicted_reserved_bytes"], run["measured_reserved_bytes"])
        assert abs(error) < 0.002, (name, error)


def test_timelines_follow_the_measured_allocator_trace(predictions):
    """Largest gap between the predicted and measured curves (phases aligned), as a share of the peak:
    measured at most 0.97%."""
    for name, run in predictions.items():
        assert run["timeline_error"] < 0.015, (name, run["timeline_error"])
