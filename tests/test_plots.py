"""Tests of memory.png rendering (simulator/report/plots.py)."""

from __future__ import annotations

import pytest

from simulator.report.plots import MAX_PANELS, plot_memory, render_memory_png
from simulator.trace.records import MemorySample, OomInfo, RankTrace, Span, Trace

GIB = 2**30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rank(rank: int, capacity_gib: int = 80, oom: bool = False) -> RankTrace:
    trace = RankTrace(rank=rank, device="h100-sxm", capacity_bytes=capacity_gib * GIB)
    params, grads, optim = 14 * GIB, 14 * GIB, 28 * GIB
    for it in range(2):
        t0 = it * 0.4
        for step in range(10):
            act = (step if step < 5 else 10 - step) * (3 + rank) * GIB // 2
            cats = (params, grads if it else 0, optim if it else 0, act, GIB // 4, GIB // 8)
            allocated = sum(cats)
            trace.memory.append(MemorySample(t0 + step * 0.04, allocated,
                                             allocated + GIB + step * GIB // 8, cats))
        trace.spans.append(Span(rank, "compute", "fwd", "gemm", "fwd", t0, t0 + 0.2,
                                iteration=it))
    peak = max(trace.memory, key=lambda s: s.allocated)
    trace.peak_allocated, trace.peak_time_s = peak.allocated, peak.time_s
    trace.peak_reserved = max(s.reserved for s in trace.memory)
    if oom:
        trace.oom = OomInfo(peak.time_s, "layer3.mlp.fc1", "layer3.mlp.fc1.out", 6 * GIB,
                            peak.allocated, peak.reserved, trace.capacity_bytes, {},
                            (("layer0.in", GIB),))
    return trace


def _trace(ranks: int, oom_rank: int | None = None) -> Trace:
    return Trace([_rank(r, 60 if oom_rank is not None else 80, r == oom_rank)
                  for r in range(ranks)], [(0.0, 0.4), (0.4, 0.8)], 0.8)


def test_png_written_non_trivial_and_deterministic(tmp_path):
    trace = _trace(2)
    plot_memory(trace, tmp_path / "a" / "memory.png", "two ranks", {0: 0, 1: 1})
    plot_memory(trace, tmp_path / "b" / "memory.png", "two ranks", {0: 0, 1: 1})
    first = (tmp_path / "a" / "memory.png").read_bytes()
    assert first.startswith(PNG_MAGIC)
    assert len(first) > 20_000
    assert first == (tmp_path / "b" / "memory.png").read_bytes()
    assert b"Software" not in first                 # no matplotlib version stamp
    assert not list((tmp_path / "a").glob("*.tmp"))     # atomic write left no temp file


def test_oom_changes_the_image():
    plain = render_memory_png(_trace(1), "t")
    with_oom = render_memory_png(_trace(1, oom_rank=0), "t")
    assert with_oom.startswith(PNG_MAGIC) and with_oom != plain


@pytest.mark.slow
def test_many_ranks_render():
    trace = _trace(MAX_PANELS + 4)
    stages = {r: r // 5 for r in range(MAX_PANELS + 4)}
    png = render_memory_png(trace, "many", stages)
    assert png.startswith(PNG_MAGIC) and len(png) > 100_000


def test_rank_selection_keeps_every_stage_and_names_the_rest():
    from simulator.report.plots import _ranges, _select_ranks

    ranks = [_rank(r) for r in range(20)]
    stages = {r: r // 5 for r in range(20)}
    shown, left_out = _select_ranks(ranks, stages)
    assert len(shown) == MAX_PANELS and len(left_out) == 4
    assert {stages[r.rank] for r in shown} == {0, 1, 2, 3}
    assert sorted([r.rank for r in shown] + left_out) == list(range(20))
    assert _ranges(left_out) == "0-3"                # lowest peaks dropped, stage 0 kept by rank 4
    assert _ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"


def test_empty_rank_and_empty_trace_render():
    empty = RankTrace(rank=0, device="a100", capacity_bytes=40 * GIB)
    assert render_memory_png(Trace([empty], [], 0.0), "empty").startswith(PNG_MAGIC)
    assert render_memory_png(Trace([], [], 0.0), "nothing").startswith(PNG_MAGIC)
