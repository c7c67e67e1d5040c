"""`memsim compare`: the best verified plan per cluster is the full simulation of that plan, priced; bad input is
one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simulator.api import simulate
from simulator.cli import app
from simulator.explore.cost import ClusterShape, Pricing, load_prices, per_million_tokens
from simulator.explore.table import outcome_of
from simulator.scenario import load_scenario
from tests.tiny_scenarios import tiny_gpt

TINY = tiny_gpt("compare-tiny", 2, 4) + "\n[run]\nwarmup_iterations = 0\n"


def _compare(*args: str):
    result = CliRunner().invoke(app, ["compare", *args], catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("compare") / "tiny.toml"
    path.write_text(TINY, encoding="utf-8")
    return path


@pytest.mark.slow
def test_the_best_plan_is_its_simulation_priced(scenario, tmp_path):
    result = _compare(str(scenario), "--cluster", "pcie-4x4090:1", "--top", "1", "--tokens", "1e9", "--json",
                      "--executor", "local:1", "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["tokens"] == 1e9 and len(shown["clusters"]) == 1
    row = shown["clusters"][0]
    assert (row["cluster"], row["gpus"], row["device"], row["status"], row["verified"]) == \
        ("pcie-4x4090:1", 4, "rtx-4090", "ok", 1)
    assert row["candidates"] >= row["estimated_fitting"] >= 1
    # `overrides` reproduces the plan with `memsim run --set ...`
    overrides = ['cluster.topology="pcie-4x4090"', "cluster.nodes=1", *row["overrides"].split()]
    expected = outcome_of(simulate(load_scenario(scenario, overrides), timelines=False).report)
    for key, value in expected.items():
        assert row[key] == value, key
    usd, kwh = per_million_tokens(load_prices(), ClusterShape("rtx-4090", 450.0, "pcie-4x4090", 1, 4),
                                  Pricing("rent"), row["tokens_per_s"], row["busy_fraction"])
    assert (row["usd_per_million_tokens"], row["kwh_per_million_tokens"]) == (usd, kwh)
    assert math.isclose(row["usd"], usd * 1e3, rel_tol=1e-12)
    assert math.isclose(row["time_to_train_s"], 1e9 / row["tokens_per_s"], rel_tol=1e-12)
    out = tmp_path / "out"
    assert json.loads((out / "compare.json").read_text()) == shown
    for name in ("compare.csv", "compare.parquet", "pareto_time_cost.svg", "heatmap_tp_pp.png"):
        assert (out / name).stat().st_size > 0


@pytest.mark.parametrize(("args", "fragment"), [
    (["--cluster", "dgx-h100"], "--cluster 'dgx-h100': must be TOPOLOGY:NODES"),
    (["--cluster", "dgx-h10:2"], "did you mean 'dgx-h100'?"),
    (["--cluster", "dgx-h100:0"], "with 1 to 100000 nodes"),
    (["--cluster", "dgx-h100:1", "--cluster", "dgx-h100:1"], "--cluster dgx-h100:1: given twice"),
    (["--cluster", "pcie-4x4090:1", "--pricing", "own"], "nodes.pcie-4x4090.purchase_usd is missing"),
    (["--cluster", "dgx-h100:1", "--executor", "dask://127.0.0.1"], "--executor 'dask://127.0.0.1'"),
])
def test_bad_input_is_one_line(scenario, tmp_path, args, fragment):
    result = _compare(str(scenario), *args, "--out", str(tmp_path / "out"))
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memsim: error: ") and fragment in lines[0], lines
    assert result.stdout == "" and not (tmp_path / "out").exists()
