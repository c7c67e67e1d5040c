"""Capture (needs torch): one tiny configuration end to end, CUDA refusal without a GPU, gloo collectives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from simulator.errors import DataError, ScenarioError  # noqa: E402
from validation.calibration_data import CAPTURE_FORMAT, load_dataset  # noqa: E402
from validation.capture import Protocol, capture  # noqa: E402
from validation.collectives import measure_collectives  # noqa: E402
from validation.memory_comparison import load_measurement  # noqa: E402

pytestmark = pytest.mark.torch
REPO = Path(__file__).resolve().parents[1]
NAME = "gpt-tiny-fp32-flash-none-adamw"
CONFIGS = REPO / "validation/configs/cpu_memory.toml"


def test_tiny_capture_writes_valid_files(tmp_path):
    written = capture("cpu", CONFIGS, tmp_path, [NAME], Protocol(warmup_steps=1, repetitions=2, profiled_steps=1))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == [f"memory/{NAME}.json", f"timing/{NAME}.json"]
    timing = json.loads((tmp_path / "timing" / f"{NAME}.json").read_text())
    assert timing["format"] == CAPTURE_FORMAT and timing["device"] == "cpu"
    assert timing["environment"]["torch_version"] == torch.__version__
    assert timing["environment"]["num_threads"] == 1
    iteration = timing["iteration"]
    assert len(iteration["wall_s"]) == len(iteration["cpu_s"]) == 2
    assert iteration["wall"]["min_s"] <= iteration["wall"]["median_s"] <= iteration["wall"]["max_s"]
    assert set(iteration["phases"]) == {"forward", "backward", "optimizer", "zero_grad"}
    rows = timing["ops"]["rows"]
    mm = [r for r in rows if r[0] == "aten::mm"]
    assert mm and all(len(r) == 7 and r[4] > 0 and 0 < r[6] <= r[5] for r in mm)
    assert {"c", "t"} & set(",".join(r[2] for r in mm).split(","))
    dataset = load_dataset(tmp_path)
    assert dataset.names == (NAME,) and len(dataset.op_rows[NAME]) > 10
    # The memory timeline is the exact tracker's: the same peak as the committed measurement.
    committed = load_measurement(REPO / "validation/data/cpu/memory" / f"{NAME}.json")
    fresh = load_measurement(tmp_path / "memory" / f"{NAME}.json")
    assert fresh["results"]["peak_allocated_bytes"] == committed["results"]["peak_allocated_bytes"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no CUDA device is available"):
        capture("cuda", CONFIGS, tmp_path, [NAME])
    with pytest.raises(ScenarioError, match="--device = 'tpu'"):
        capture("tpu", CONFIGS, tmp_path, [NAME])
    with pytest.raises(ScenarioError, match="--only nope"):
        capture("cpu", CONFIGS, tmp_path, ["nope"])


@pytest.mark.slow
def test_gloo_collectives_two_processes():
    """Spawns two processes that import torch (about 10 s on a 2-core machine)."""
    document = measure_collectives((2,), (4096,), warmup=0, repetitions=2)
    rows = document["results"]
    assert [r["collective"] for r in rows] == ["all_reduce", "all_gather", "reduce_scatter"]
    assert all(len(r["times_s"]) == 2 and r["median_s"] > 0 for r in rows)
    with pytest.raises(ScenarioError, match="world size"):
        measure_collectives((1,), (4096,))
