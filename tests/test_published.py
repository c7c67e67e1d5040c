"""The public validation set (validation/published): files, conversions, bad input, and two runs predicted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from simulator.errors import DataError
from validation.published import (PUBLISHED_DIR, SETS, load_run, load_runs, megatron_2021_flops, predict,
                                  report_dict, summary)

ROOT = Path(__file__).resolve().parent.parent


def test_every_file_loads_with_its_source():
    runs = load_runs()
    assert len(runs) >= 12
    assert len({run.name for run in runs}) == len(runs)
    assert {run.set for run in runs} == set(SETS)
    cluster_scale = [run for run in runs if run.gpus > 1]
    assert len(cluster_scale) >= 12
    for run in runs:
        for key in ("reference", "location", "url", "read"):
            assert run.source[key].strip()
        assert run.measured_s > 0


def test_megatron_table_1_conversion():
    # 1.7B: B 512, s 2048, l 24, h 2304, V 51200 at 137 teraFLOP/s on 32 GPUs (Narayanan et al. Eq. 3).
    run = load_run(PUBLISHED_DIR / "megatron2021-gpt-1.7b.toml")
    flops = 96 * 512 * 2048 * 24 * 2304 ** 2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304))
    assert megatron_2021_flops(512, 2048, 24, 2304, 51200) == flops
    assert run.measured_s == flops / (32 * 137e12)


def test_capture_rows_read_the_capture_file():
    run = load_run(PUBLISHED_DIR / "h200-capture-gpt-124m-bf16-mixed-flash-none-adamw.toml")
    data = json.loads((ROOT / "validation/data/cuda/timing/gpt-124m-bf16-mixed-flash-none-adamw.json").read_text())
    assert run.measured_s == data["iteration"]["cuda_event"]["median_s"]
    assert run.scenario["model"] == data["config"]["model"]


def _write(tmp_path: Path, text: str, name: str = "bad-run") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


GOOD = PUBLISHED_DIR.joinpath("megatron2021-gpt-1.7b.toml").read_text().replace(
    'name = "megatron2021-gpt-1.7b"', 'name = "bad-run"')


@pytest.mark.parametrize("change, key", [
    (lambda t: t.replace('flop_formula = "megatron-2021"', ""), "measured.flop_formula"),
    (lambda t: t.replace("flop_vocab = 51200", ""), "measured.flop_vocab"),
    (lambda t: t.replace('url = "https://arxiv.org/abs/2104.04473"', ""), "source.url"),
    (lambda t: t.replace("gpus = 32", "gpus = 64"), "gpus"),
    (lambda t: t.replace('set = "development"', 'set = "dev"'), "set"),
    (lambda t: t.replace("tflops_per_gpu = 137.0", "iteration_time_s = 3.0\ntflops_per_gpu = 137.0"), "measured"),
])
def test_missing_or_bad_fields_name_the_key(tmp_path, change, key):
    path = _write(tmp_path, change(GOOD))
    with pytest.raises(DataError) as error:
        load_run(path)
    assert f"{path}: {key}" in str(error.value)


def test_cli_bad_file_is_one_line_and_exit_2(tmp_path):
    _write(tmp_path, GOOD.replace('framework = "Megatron-LM (2021), container nvcr.io/nvidia/pytorch:20.12-py3 '
                                  '(examples/sc21/SRUN.sh)"', ""))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "simulator.cli", "validate", "published", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "system.framework: missing" in done.stderr
    assert "Traceback" not in done.stderr


def test_two_runs_predicted_within_the_target():
    runs = load_runs(only=["megatron2021-gpt-1.7b", "h200-capture-gpt-124m-bf16-mixed-flash-none-adamw"])
    predictions = [predict(run, memory_workers=0) for run in runs]
    for prediction in predictions:
        assert abs(prediction.error) < 0.15, (prediction.run.name, prediction.error)
    document = report_dict(predictions)
    assert document["summary"] == summary(predictions)
    assert [row["name"] for row in document["runs"]] == [run.name for run in runs]


def test_committed_summary_matches_the_files():
    data = json.loads((PUBLISHED_DIR / "summary.json").read_text())
    runs = {run.name: run for run in load_runs()}
    assert sorted(row["name"] for row in data["runs"]) == sorted(runs)
    for row in data["runs"]:
        assert row["measured_s"] == runs[row["name"]].measured_s
        assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1, rel=1e-12)
