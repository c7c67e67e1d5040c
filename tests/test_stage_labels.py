"""Stage labels in the outputs: Chrome process names and memory.png panel titles name (stage, rank, dp, tp)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simulator.cli import app
from simulator.parallel.plan import Coords
from simulator.report.plots import panel_titles, render_memory_png
from simulator.trace.chrome import chrome_trace
from simulator.trace.records import MemorySample, RankTrace, Span, Trace
from tiny_scenarios import tiny_gpt_on_4090s

GIB = 2**30
DEVICE = "rtx-4090"

TINY_GPT_TP2_PP2 = tiny_gpt_on_4090s("tiny-tp2-pp2", layers=4, global_batch=4, parallel="tp = 2\npp = 2",
                                     warmup_iterations=1)


def _trace(ranks: list[int]) -> Trace:
    out = []
    for r in ranks:
        rank = RankTrace(rank=r, device=DEVICE, capacity_bytes=24 * GIB)
        rank.spans.append(Span(r, "compute", "fwd", "gemm", "fwd", 0.0, 0.5))
        rank.memory.extend([MemorySample(0.0, GIB, 2 * GIB, (GIB, 0, 0, 0, 0, 0)),
                            MemorySample(0.5, GIB, 2 * GIB, (GIB, 0, 0, 0, 0, 0))])
        rank.peak_allocated, rank.peak_reserved = GIB, 2 * GIB
        out.append(rank)
    return Trace(out, [(0.0, 1.0)], 1.0)


# A placement where rank order is not stage order: rank 0 is on stage 1.
COORDS = {0: Coords(dp=0, pp=1, tp=0), 1: Coords(dp=0, pp=0, tp=1), 2: Coords(dp=1, pp=0, tp=0)}


def _process_names(doc: dict) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"}


def test_chrome_process_names_carry_stage_dp_and_tp():
    doc = chrome_trace(_trace([0, 1, 2]), "unit", coords_of_rank=COORDS)
    assert _process_names(doc) == {
        1: "rank 0 · stage 1 · dp 0 · tp 0 · rtx-4090",
        2: "rank 1 · stage 0 · dp 0 · tp 1 · rtx-4090",
        3: "rank 2 · stage 0 · dp 1 · tp 0 · rtx-4090",
    }


def test_panels_are_titled_by_stage_and_ordered_stage_by_stage():
    """Panels run by (stage, dp, tp): stage 0's ranks first whatever their rank numbers."""
    assert panel_titles(_trace([0, 1, 2]), coords_of_rank=COORDS) == [
        "stage 0 (rank 1, dp 0, tp 1) · rtx-4090",
        "stage 0 (rank 2, dp 1, tp 0) · rtx-4090",
        "stage 1 (rank 0, dp 0, tp 0) · rtx-4090",
    ]


def test_without_plan_coordinates_the_old_titles_stay():
    trace = _trace([0, 1])
    assert panel_titles(trace) == ["rank 0 · rtx-4090", "rank 1 · rtx-4090"]
    assert panel_titles(trace, {0: 0, 1: 1}) == ["rank 0 (stage 0) · rtx-4090", "rank 1 (stage 1) · rtx-4090"]
    assert _process_names(chrome_trace(trace, "unit")) == {1: "rank 0 rtx-4090", 2: "rank 1 rtx-4090"}


def test_titles_change_the_image():
    trace = _trace([0, 1, 2])
    assert render_memory_png(trace, "t", coords_of_rank=COORDS) != render_memory_png(trace, "t")


def _run(tmp_path: Path, *extra: str) -> tuple[dict, Path]:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY_GPT_TP2_PP2)
    out = tmp_path / ("out" + "".join(extra).replace("-", "_"))
    result = CliRunner().invoke(app, ["run", str(scenario), "--json", "--what-would-fit", "0", "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), out


# pcie-4x4090, tp 2 × pp 2, Megatron order (tp fastest): ranks 0, 1 are stage 0; ranks 2, 3 stage 1.
EXPECTED_NAMES = {
    1: "rank 0 · stage 0 · dp 0 · tp 0 · rtx-4090",
    2: "rank 1 · stage 0 · dp 0 · tp 1 · rtx-4090",
    3: "rank 2 · stage 1 · dp 0 · tp 0 · rtx-4090",
    4: "rank 3 · stage 1 · dp 0 · tp 1 · rtx-4090",
}
EXPECTED_COORDS = {0: Coords(0, 0, 0), 1: Coords(0, 0, 1), 2: Coords(0, 1, 0), 3: Coords(0, 1, 1)}


@pytest.mark.parametrize("full", [False, True])
def test_memsim_run_labels_every_simulated_rank_by_stage(tmp_path, full):
    """The representatives (one per stage) or, with --full, every rank: named in trace.json, and
    memory.png drawn with the stage titles (byte-equal to a render with the plan's coordinates)."""
    from simulator.api import simulate
    from simulator.scenario import load_scenario

    report, out = _run(tmp_path, *(["--full"] if full else []))
    ranks = [0, 1, 2, 3] if full else [0, 2]
    names = _process_names(json.loads((out / "trace.json").read_text()))
    assert names == {rank + 1: EXPECTED_NAMES[rank + 1] for rank in ranks}
    doc = json.loads((out / "trace.json").read_text())
    assert doc["distributedInfo"]["world_size"] == 4
    assert [r["stage"] for r in report["ranks"]] == [0, 1]
    scenario = load_scenario(tmp_path / "tiny.toml", ["run.full=true"] if full else [])
    trace = simulate(scenario).trace
    coords = {rank: EXPECTED_COORDS[rank] for rank in ranks}
    assert panel_titles(trace, coords_of_rank=coords) == [
        f"stage {c.pp} (rank {rank}, dp {c.dp}, tp {c.tp}) · rtx-4090" for rank, c in coords.items()]
    if not full:      # rendering four panels twice takes seconds: the reduced run checks the bytes
        title = f"{report['scenario']} on {report['device']}"
        assert (out / "memory.png").read_bytes() == render_memory_png(trace, title, coords_of_rank=coords)
