"""Capture (needs torch): one tiny configuration end to end, CUDA refusal without a GPU, gloo collectives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", exc_type=ImportError)

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


def test_layouts_and_cuda_profile_summary():
    """The CUDA branch of the op summary, fed with stand-in profiler events (no GPU needed)."""
    from types import SimpleNamespace

    from validation.capture import _layout, summarize_profile

    assert [_layout([4, 3], [3, 1]), _layout([4, 3], [1, 4]), _layout([4, 3], [6, 2]), _layout([], [])] == \
        ["c", "t", "x", ""]
    assert _layout([2, 1, 5], [5, 99, 1]) == "c"          # size-1 dimensions may have any stride

    def op(name, device_us, cpu_us=50.0):
        return SimpleNamespace(name=name, input_shapes=[[64, 32], [32, 16]],
                               structured_input_strides=[[32, 1], [1, 32]], input_dtypes=["float", "float"],
                               self_cpu_time_total=cpu_us,
                               self_device_time_total=device_us, device_type="DeviceType.CPU")

    kernel = SimpleNamespace(name="sm90_gemm", self_device_time_total=7.0, device_type="DeviceType.CUDA")
    steps = [[op("aten::mm", 7.0), op("aten::view", 0.0), kernel], [op("aten::mm", 9.0), kernel]]
    summary = summarize_profile(steps, cuda=True)
    assert summary["rows"] == [["aten::mm", [[64, 32], [32, 16]], "c,t", ["float", "float"], 1.0, 8.0, 7.0]]
    assert summary["kernels"]["rows"] == [["sm90_gemm", 1.0, 7.0, 7.0]]
    cpu = summarize_profile(steps, cuda=False)
    assert {r[0] for r in cpu["rows"]} == {"aten::mm", "aten::view"} and "kernels" not in cpu


def test_input_dtypes_fall_back_to_the_kineto_events():
    """torch before 2.13 (2.11 on the H200) leaves FunctionEvent without input dtypes and strides: the summary
    takes them from the profiler's kineto events (same correlation id and name) and gives the same rows."""
    import copy

    from torch.profiler import ProfilerActivity, profile

    from validation.capture import kineto_inputs, summarize_profile

    a, b = torch.randn(64, 32), torch.randn(16, 32)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        (a @ b.t()).sum()
    events = list(prof.events())
    stripped = []
    for event in events:
        event = copy.copy(event)
        event.input_dtypes, event.structured_input_strides = None, None
        stripped.append(event)
    direct = summarize_profile([events])["rows"]
    assert summarize_profile([stripped], False, [kineto_inputs(prof)])["rows"] == direct
    assert summarize_profile([stripped])["rows"] != direct           # without the fallback: no dtypes
    mm = next(r for r in direct if r[0] == "aten::mm")
    assert mm[2:4] == ["c,t", ["float", "float"]]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 2, reason="checks refusals without GPUs")
def test_collective_backend_errors_are_one_line():
    with pytest.raises(DataError, match="needs 2 GPUs"):
        measure_collectives((2,), (4096,), backend="nccl")
    with pytest.raises(ScenarioError, match="--backend = 'mpi' must be one of gloo, nccl"):
        measure_collectives((2,), (4096,), backend="mpi")
    with pytest.raises(ScenarioError, match="applies to --backend nccl only"):
        measure_collectives((2,), (4096,), topology="dgx-h100")
    with pytest.raises(ScenarioError, match="is not a memsim topology"):
        measure_collectives((2,), (4096,), backend="nccl", topology="dgx-z900")
