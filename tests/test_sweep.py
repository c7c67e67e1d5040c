"""`memsim sweep`: the table of every point (against `memsim run`), [sweep] = --grid, bad input refused whole."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simulator.api import simulate
from simulator.cli import app
from simulator.errors import MemsimError
from simulator.explore.table import outcome_of
from simulator.scenario import load_scenario
from tests.tiny_scenarios import tiny_gpt_on_one_4090

GRID = "[sweep.grid]\nmodel.num_layers = [2, 4]\ntraining.micro_batch_size = [1, 2, 3]\n"
POINTS = [(layers, micro) for layers in (2, 4) for micro in (1, 2, 3)]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _sweep(*args: str):
    result = CliRunner().invoke(app, ["sweep", *args], catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def _one_line_error(result, *fragments: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memsim: error: "), lines
    assert "Traceback" not in result.stderr and result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def _rows(path: Path) -> list[dict]:
    return list(csv.DictReader(io.StringIO(path.read_text(encoding="utf-8"))))


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """One sweep of the tiny GPT over layers x micro-batch (micro-batch 3 does not divide the batch of 4)."""
    folder = tmp_path_factory.mktemp("sweep")
    scenario = _write(folder, "tiny.toml", tiny_gpt_on_one_4090("sweep-tiny", GRID))
    result = _sweep(str(scenario), "--out", str(folder / "out"), "--executor", "local:1", "--tokens", "1e9")
    assert result.exit_code == 0, result.stderr
    return scenario, folder / "out", result


def test_every_point_is_a_row_in_point_order_with_the_run_outcome(swept):
    scenario, out, _ = swept
    rows = _rows(out / "sweep.csv")
    assert [(int(r["model.num_layers"]), int(r["training.micro_batch_size"])) for r in rows] == POINTS
    assert [int(r["point"]) for r in rows] == list(range(6))
    for row, (layers, micro) in zip(rows, POINTS):
        overrides = [f"model.num_layers={layers}", f"training.micro_batch_size={micro}"]
        if micro == 3:
            with pytest.raises(MemsimError) as refused:
                load_scenario(scenario, overrides)
            assert (row["status"], row["reason"]) == ("invalid", str(refused.value))
            assert row["fits"] == row["tokens_per_s"] == ""
            continue
        expected = outcome_of(simulate(load_scenario(scenario, overrides), timelines=False).report)
        assert row["status"] == "ok" and row["reason"] == "" and row["device"] == "rtx-4090"
        for key, value in expected.items():
            shown = row[key]
            if isinstance(value, bool):
                assert shown == ("true" if value else "false"), key
            elif isinstance(value, int):
                assert int(shown) == value, key
            else:
                assert float(shown) == value, key      # floats written so they read back exactly


def test_cost_and_budget_columns_follow_from_the_rate(swept):
    _, out, _ = swept
    for row in _rows(out / "sweep.csv"):
        if row["status"] != "ok":
            assert row["usd_per_million_tokens"] == row["time_to_train_s"] == ""
            continue
        tokens_per_s, usd = float(row["tokens_per_s"]), float(row["usd_per_million_tokens"])
        assert math.isclose(float(row["time_to_train_s"]), 1e9 / tokens_per_s, rel_tol=1e-12)
        assert math.isclose(float(row["usd"]), 1e3 * usd, rel_tol=1e-12)
        # rented at $0.60 per GPU-hour (topologies/costs/prices.toml): dollars per million tokens = 0.60 / 3600 * 1e6 / rate
        assert math.isclose(usd, 0.60 / 3600 * 1e6 / tokens_per_s, rel_tol=1e-12)
        assert float(row["kwh"]) > 0


def test_parquet_holds_the_same_table_typed(swept):
    import pyarrow.parquet as pq

    _, out, _ = swept
    table = pq.read_table(out / "sweep.parquet")
    rows = _rows(out / "sweep.csv")
    assert table.column_names == list(rows[0])
    assert str(table.schema.field("model.num_layers").type) == "int64"
    assert str(table.schema.field("fits").type) == "bool"
    for name in table.column_names:
        for value, shown in zip(table.column(name).to_pylist(), (row[name] for row in rows)):
            if value is None:
                assert shown == ""
            elif isinstance(value, bool):
                assert shown == ("true" if value else "false")
            elif isinstance(value, float):
                assert float(shown) == value
            else:
                assert str(value) == shown


def test_summary_lists_the_invalid_points_and_the_files(swept):
    _, out, result = swept
    assert result.stdout.startswith("6 points: 4 fit, 0 do not fit, 2 invalid\n")
    assert "invalid: point 2 (model.num_layers=2 training.micro_batch_size=3): training.global_batch_size" \
        in result.stdout
    for name in ("sweep.csv", "sweep.parquet", "pareto_time_cost.png", "pareto_time_cost.svg",
                 "pareto_memory_throughput.svg", "heatmap_tp_pp.png"):
        assert (out / name).stat().st_size > 0 and str(out / name) in result.stdout


def test_grid_options_give_the_same_table_as_the_sweep_table(swept, tmp_path):
    _, out, _ = swept
    plain = _write(tmp_path, "tiny.toml", tiny_gpt_on_one_4090("sweep-tiny"))
    result = _sweep(str(plain), "--grid", "model.num_layers=2,4", "--grid", "training.micro_batch_size=1,2,3",
                    "--out", str(tmp_path / "out"), "--executor", "local:1", "--tokens", "1e9")
    assert result.exit_code == 0, result.stderr
    # the same bytes but for the scenario path that starts each invalid point's reason
    assert ((tmp_path / "out" / "sweep.csv").read_text().replace(str(plain), "SCENARIO")
            == (out / "sweep.csv").read_text().replace(str(swept[0]), "SCENARIO"))
    # a --grid axis replaces the [sweep] table's axis of the same key, keeping its place
    replaced = _sweep(str(swept[0]), "--grid", "model.num_layers=4", "--out", str(tmp_path / "one"),
                      "--executor", "local:1")
    assert replaced.exit_code == 0, replaced.stderr
    rows = _rows(tmp_path / "one" / "sweep.csv")
    assert [(r["model.num_layers"], r["training.micro_batch_size"]) for r in rows] == [("4", "1"), ("4", "2"),
                                                                                       ("4", "3")]


def test_tables_and_pictures_are_the_same_bytes_on_a_process_pool(swept, tmp_path):
    scenario, out, _ = swept
    result = _sweep(str(scenario), "--out", str(tmp_path / "pool"), "--executor", "local:2", "--tokens", "1e9")
    assert result.exit_code == 0, result.stderr
    names = sorted(path.name for path in out.iterdir() if path.name not in ("journal.jsonl",))
    assert names == sorted(path.name for path in (tmp_path / "pool").iterdir() if path.name != "journal.jsonl")
    for name in names:
        if name != "sweep.json":      # the header names the folder's scenario path, the same here
            assert (tmp_path / "pool" / name).read_bytes() == (out / name).read_bytes(), name


@pytest.mark.parametrize(("args", "fragments"), [
    (["--grid", "model.num_layer=2,4"], ["--grid model.num_layer=2,4", "did you mean 'model.num_layers'"]),
    (["--grid", "training.micro_batch_size=1,x"], ["training.micro_batch_size = 'x'", "positive integer"]),
    (["--grid", "training.micro_batch_size=1,1"], ["is given twice"]),
    (["--grid", "training.micro_batch_size="], ["has no values"]),
    (["--grid", "parallel.tp"], ["expected KEY=V1,V2"]),
    (["--grid", "sweep.fast=true,false"], ["unknown key path 'sweep.fast'"]),
    (["--grid", "training.micro_batch_size=3,5"], ["all 2 points of the sweep are invalid",
                                                   "point 0 (training.micro_batch_size=3)"]),
    (["--executor", "lokal:2"], ["--executor 'lokal:2'", "local:N"]),
    (["--pricing", "buy"], ["--pricing 'buy'"]),
    (["--tokens", "-5"], ["--tokens -5.0", "> 0"]),
    (["--set", "cluster.topology=cpu"], ["devices.cpu.idle_w is missing"]),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, args, fragments):
    scenario = _write(tmp_path, "tiny.toml", tiny_gpt_on_one_4090("bad"))
    out = tmp_path / "out"
    _one_line_error(_sweep(str(scenario), "--executor", "local:1", *args, "--out", str(out)), *fragments)
    assert not out.exists()


def test_bad_sweep_table_and_price_file_are_one_line(tmp_path):
    out = tmp_path / "out"
    bad_table = _write(tmp_path, "t.toml", tiny_gpt_on_one_4090("bad", "[sweep.grid]\nparallel.tp = []\n"))
    _one_line_error(_sweep(str(bad_table), "--out", str(out)), "sweep.grid", "non-empty array")
    prices = _write(tmp_path, "prices.toml", "[devices.rtx-4090]\nrent_usd_per_gpu_hour = -1\n")
    scenario = _write(tmp_path, "s.toml", tiny_gpt_on_one_4090("bad"))
    _one_line_error(_sweep(str(scenario), "--prices", str(prices), "--out", str(out), "--executor", "local:1"),
                    "devices.rtx-4090.rent_usd_per_gpu_hour = -1", "> 0")
    assert not out.exists()


def test_a_folder_holding_a_sweep_needs_resume_and_the_same_sweep(swept, tmp_path):
    scenario, out, _ = swept
    _one_line_error(_sweep(str(scenario), "--out", str(out), "--executor", "local:1"), "holds a sweep already",
                    f"--resume {out}")
    _one_line_error(_sweep(str(scenario), "--grid", "model.num_layers=2", "--resume", str(out)),
                    "differs from this one in axes")
    _one_line_error(_sweep(str(scenario), "--resume", str(tmp_path / "none")), "no sweep to resume here")
    _one_line_error(_sweep(str(scenario)), "give --out DIR")


def test_run_accepts_a_sweep_table_and_checks_it(tmp_path):
    good = load_scenario(_write(tmp_path, "g.toml", tiny_gpt_on_one_4090("g", GRID)), ())
    assert good.sweep.grid == (("model.num_layers", (2, 4)), ("training.micro_batch_size", (1, 2, 3)))
    with pytest.raises(MemsimError, match="sweep.grid: unknown key path 'model.layers'; did you mean"):
        load_scenario(_write(tmp_path, "b.toml", tiny_gpt_on_one_4090("b", "[sweep.grid]\nmodel.layers = [2]\n")))


def test_fast_rows_are_the_estimate_of_each_point(swept, tmp_path):
    from simulator.explore.estimate import estimate_reports

    scenario, _, _ = swept
    result = _sweep(str(scenario), "--fast", "--out", str(tmp_path / "fast"), "--executor", "local:2")
    assert result.exit_code == 0, result.stderr
    rows = _rows(tmp_path / "fast" / "sweep.csv")
    valid = [(layers, micro) for layers, micro in POINTS if micro != 3]
    scenarios = [load_scenario(scenario, [f"model.num_layers={layers}", f"training.micro_batch_size={micro}"])
                 for layers, micro in valid]
    expected = [outcome_of(report) for report in estimate_reports(scenarios)]
    shown = [row for row in rows if row["status"] == "ok"]
    assert len(shown) == len(expected) and all(row["estimate"] == "true" for row in shown)
    for row, outcome in zip(shown, expected):
        assert float(row["iteration_time_s"]) == outcome["iteration_time_s"]
        assert int(row["peak_reserved_bytes"]) == outcome["peak_reserved_bytes"]
    assert [row["status"] for row in rows] == ["ok", "ok", "invalid", "ok", "ok", "invalid"]
    # a fast sweep is not the full one: resuming one as the other is refused
    again = _sweep(str(scenario), "--resume", str(tmp_path / "fast"), "--executor", "local:1")
    _one_line_error(again, "differs from this one in mode")
