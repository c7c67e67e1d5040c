"""Calibration: the vectorized roofline is memsim's, fits recover known values, files round-trip, bad input fails."""

from __future__ import annotations

import json
import itertools
import math
import shutil
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.api import simulate
from simulator.errors import DataError, TopologyError
from simulator.hardware.catalog import get_device, with_overrides
from simulator.hardware.cost import gemm_time_s, op_time_s, rate_dtype
from simulator.scenario import scenario_from_dict
from simulator.topology import apply_calibration, read_calibration, resolve_cluster
from simulator.workload.graph import ATTENTION, ELEMENTWISE, Op
from validation.calibrate import (
    apply_params, calibrate, calibration_toml, fit_links, link_bus_bytes, overrides, write_calibration,
)
from validation.calibration_data import (
    CAPTURE_FORMAT, GEMM, OpRows, config_features, device_params, load_dataset, predict_iteration_s, predict_ops_s,
)
from validation.memory_comparison import scenario_document

REPO = Path(__file__).resolve().parents[1]
CONFIGS = tomllib.loads((REPO / "validation/configs/cpu_memory.toml").read_text())
DATA = REPO / "validation/data/cpu"
NAMES = ("gpt-tiny-fp32-flash-none-adamw", "llama-tiny-bf16-mixed-eager-gqa-none-adamw",
         "gpt-tiny-fp32-eager-drop-full-adamw")
CPU = get_device("cpu")
TRUTH = with_overrides(CPU, gemm_efficiency={"fp32": 0.7, "bf16": 1.5}, gemm_k_overhead=40, hbm_efficiency=0.4,
                       attention_efficiency=0.3, launch_overhead_s=2e-5)
ENV = {"torch_version": "2.13.0+cpu", "device_name": "synthetic"}
HEADER = 'format = "memsim-calibration-1"\ndevice = "cpu"\n[fields]\n'


def _truth_calibration(path: Path) -> Path:
    path.write_text('format = "memsim-calibration-1"\ndevice = "cpu"\ntorch_version = "2.13.0+cpu"\n[fields]\n'
                    "gemm_k_overhead = 40\nhbm_efficiency = 0.4\nattention_efficiency = 0.3\n"
                    "launch_overhead_s = 2e-05\n[fields.gemm_efficiency]\nfp32 = 0.7\nbf16 = 1.5\n")
    return path


def _scenario(name: str, calibration: Path | None = None, topology: str = "cpu"):
    doc = scenario_document(name, CONFIGS[name])
    doc["cluster"] = {"topology": topology, **({"calibration": str(calibration)} if calibration else {})}
    return scenario_from_dict(doc, source=f"<{name}>")


def _synthetic_rows() -> list[list]:
    """Profiler-style rows whose times TRUTH's roofline gives (cost.py itself, not the code under test)."""
    rows = []
    torch_dtype = {"fp32": "float", "bf16": "c10::BFloat16"}
    for dtype in ("fp32", "bf16"):
        for m, n in ((64, 128), (128, 128), (256, 64)):
            for k in (16, 32, 64, 128, 256, 512, 1024):
                t = gemm_time_s(TRUTH, m, n, k, 1, dtype)
                rows.append(["aten::mm", [[m, k], [k, n]], "c,c", [torch_dtype[dtype]] * 2, 2.0, t * 2e6, t * 1e6])
        t = gemm_time_s(TRUTH, 64, 64, 32, 8, dtype)
        rows.append(["aten::bmm", [[8, 64, 32], [8, 32, 64]], "c,t", [torch_dtype[dtype]] * 2, 4.0, t * 1e6, t * 1e6])
    for numel in (256, 4096, 65536, 262144, 1048576):
        op = Op("add", ELEMENTWISE, "fwd", bytes_read=8 * numel, bytes_written=4 * numel)
        t = op_time_s(op, TRUTH)
        rows.append(["aten::add", [[numel], [numel], []], "c,c,", ["float", "float", "Scalar"], 3.0, t * 1e6, t * 1e6])
    for b, h, s, d in ((2, 4, 64, 32), (2, 8, 128, 32)):
        qkv = 3 * 4 * b * h * s * d
        op = Op("sdpa", ATTENTION, "fwd", flops=4.0 * b * h * s * s * d / 2, bytes_read=qkv, dtype="fp32")
        t = op_time_s(op, TRUTH)
        rows.append(["aten::_scaled_dot_product_flash_attention_for_cpu", [[b, h, s, d]] * 3 + [[], []], "c,c,c,,",
                     ["float"] * 3 + ["Scalar", "Scalar"], 2.0, t * 1e6, t * 1e6])
    return rows


def _write_timing(folder: Path, name: str, rows: list[list], iteration_s: float, env: dict = ENV) -> Path:
    doc = {"format": CAPTURE_FORMAT, "name": name, "device": "cpu", "config": CONFIGS[name], "environment": env,
           "iteration": {"cpu": {"median_s": iteration_s, "iqr_over_median": 0.0}},
           "ops": {"columns": ["name", "input_shapes", "input_layouts", "input_dtypes", "calls_per_step",
                               "median_us", "min_us"], "rows": rows}}
    path = folder / "timing" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    """A capture folder whose every number comes from memsim's cost model with TRUTH's parameters."""
    folder = tmp_path_factory.mktemp("synthetic")
    truth_file = _truth_calibration(folder / "truth.toml")
    rows = _synthetic_rows()
    for name in NAMES:
        iteration_s = simulate(_scenario(name, truth_file)).report["iteration_time_s"]
        _write_timing(folder, name, rows, iteration_s)
    results = []
    for collective in ("all_reduce", "all_gather"):
        for size in (4096, 65536, 1048576, 16777216):
            t = 1e-3 + link_bus_bytes(collective, 2, size) / 1e9
            results.append({"collective": collective, "world_size": 2, "size_bytes": size, "median_s": t,
                            "iqr_over_median": 0.0, "times_s": [t, t, t]})
    (folder / "collectives.json").write_text(json.dumps({"environment": ENV, "results": results}))
    return folder


@pytest.mark.parametrize("name", ["gpt-tiny-fp32-eager-drop-none-adamw", "llama-tiny-bf16-mixed-eager-gqa-none-adamw"])
def test_vectorized_roofline_equals_simulate(name, tmp_path):
    """predict_iteration_s is memsim's own iteration time, for the default device and a calibrated one."""
    scenario = _scenario(name)
    features = config_features(name, CONFIGS[name], CPU)
    expected = simulate(scenario).report["iteration_time_s"]
    assert predict_iteration_s(features, CPU, device_params(CPU)) == pytest.approx(expected, rel=1e-12)
    calibrated = simulate(_scenario(name, _truth_calibration(tmp_path / "c.toml"))).report["iteration_time_s"]
    assert predict_iteration_s(features, CPU, device_params(TRUTH)) == pytest.approx(calibrated, rel=1e-12)


@pytest.mark.parametrize("device", ["h200-sxm", "a100-80gb-sxm", "cpu"])
def test_vectorized_gemm_rows_equal_the_cost_model(device):
    """predict_ops_s gives cost.op_time_s (less the launch) for GEMMs, aligned or not, in every rate dtype."""
    spec = get_device(device)
    shapes = [(2048, 50257, 12288), (2048, 50304, 12288), (50257, 12288, 2048), (4096, 1000, 1024), (12, 20, 36),
              (8192, 8192, 8192), (1024, 30522, 1024), (2048, 4100, 512)]
    dtypes = [d for d in ("fp32", "tf32", "bf16", "fp16", "fp8") if d in spec.peak_flop_per_s]
    ops, records = [], []
    for (m, n, k), dtype in itertools.product(shapes, dtypes):
        op = Op(name="mm", op_class="gemm", phase="fwd", flops=2.0 * m * n * k, bytes_read=2 * (m * k + k * n),
                bytes_written=2 * m * n, dtype=dtype, gemm_mnk=(m, n, k))
        ops.append(op)
        records.append((GEMM, rate_dtype(spec, dtype), op.flops, op.bytes_read + op.bytes_written, m, n, k, 1,
                        math.nan, 1.0))
    predicted = predict_ops_s(OpRows.build(records), spec, device_params(spec), overhead_s=0.0)
    expected = [op_time_s(op, spec) - spec.launch_overhead_s for op in ops]
    assert predicted == pytest.approx(expected, rel=1e-12)


def test_fit_recovers_known_parameters(synthetic):
    """Stage 1 and 2 recover every parameter the synthetic data were generated with."""
    result = calibrate(synthetic, bootstrap=0)
    params = result.fit.params
    assert set(result.fit.gemm_dtypes) == {"fp32", "bf16"} and result.fit.attention
    assert params.gemm_efficiency["fp32"] == pytest.approx(0.7, rel=1e-4)
    assert params.gemm_efficiency["bf16"] == pytest.approx(1.5, rel=1e-4)
    assert params.peak_flop_per_s == CPU.peak_flop_per_s
    assert params.gemm_k_overhead == pytest.approx(40, abs=0.05)
    assert params.attention_efficiency == pytest.approx(0.3, rel=1e-4)
    assert params.memory_bytes_per_s == pytest.approx(0.4 * CPU.hbm_bytes_per_s, rel=1e-4)
    assert params.op_overhead_s == pytest.approx(2e-5, rel=1e-4)
    assert params.launch_overhead_s == pytest.approx(2e-5, rel=1e-4)
    assert max(abs(r) for r in result.fit.iteration_log_residuals) < 1e-5
    fitted = overrides(CPU, params, result.fit.gemm_dtypes)
    assert fitted["gemm_k_overhead"] == 40 and fitted["hbm_efficiency"] == pytest.approx(0.4, rel=1e-4)
    links = {(l.collective, l.world_size): l for l in result.links}
    for key in (("all_reduce", 2), ("all_gather", 2)):
        assert links[key].latency_s == pytest.approx(1e-3, rel=1e-5)
        assert links[key].bytes_per_s == pytest.approx(1e9, rel=1e-5)


def test_rate_above_the_efficiency_limit_moves_the_peak():
    """A GEMM rate more than twice the peak (DeviceSpec allows efficiency <= 2) is written as the peak."""
    params = device_params(CPU)
    fast = dict(params.peak_flop_per_s, bf16=CPU.peak_flop_per_s["bf16"] * 5)
    from dataclasses import replace
    fields = overrides(CPU, replace(params, peak_flop_per_s=fast, gemm_efficiency=dict(params.gemm_efficiency,
                                                                                          bf16=1.0)), ("bf16",))
    assert fields["peak_flop_per_s"] == {"bf16": CPU.peak_flop_per_s["bf16"] * 5}
    assert fields["gemm_efficiency"] == {"bf16": 1.0}
    device = apply_params(CPU, replace(params, memory_bytes_per_s=3 * CPU.hbm_bytes_per_s), ())
    assert device.hbm_bytes_per_s == pytest.approx(3 * CPU.hbm_bytes_per_s) and device.hbm_efficiency == 1.0


def test_calibration_file_round_trip(synthetic, tmp_path):
    """The written file reads back to the fitted fields, and a scenario using it simulates the fitted device."""
    result = calibrate(synthetic, bootstrap=5)
    path = tmp_path / "calibration.toml"
    write_calibration(result, path)
    assert calibration_toml(calibrate(synthetic, bootstrap=5)) == path.read_text()   # seeded: reproducible
    loaded = read_calibration(path)
    assert loaded.device == "cpu" and loaded.torch_version == "2.13.0+cpu"
    assert dict(loaded.fields) == overrides(CPU, result.fit.params, result.fit.gemm_dtypes, result.fit.attention)
    assert {(l.collective, l.world_size) for l in loaded.links} == {("all_gather", 2), ("all_reduce", 2)}
    data = tomllib.loads(path.read_text())
    for key, (low, high) in data["ci95"].items():
        assert low <= high, key
    cluster = resolve_cluster(_scenario(NAMES[0], path))
    assert cluster.device.gemm_k_overhead == 40
    assert cluster.device.launch_overhead_s == pytest.approx(2e-5, rel=1e-4)
    assert str(path) in cluster.device.source["launch_overhead_s"]
    assert cluster.calibration is not None and cluster.calibration.path == str(path)


def test_calibration_for_another_device_is_rejected(synthetic, tmp_path):
    path = tmp_path / "cpu-calibration.toml"
    write_calibration(calibrate(synthetic, bootstrap=0), path)
    with pytest.raises(TopologyError, match=r"cpu-calibration\.toml.*'cpu'.*'h100-sxm'"):
        resolve_cluster(_scenario(NAMES[0], path, topology="h100-sxm"))


def test_a_calibration_file_sets_the_unaligned_ceiling(tmp_path):
    """A team that measured its GPUs' ceiling for GEMMs off the 16-byte alignment can set it."""
    path = tmp_path / "c.toml"
    path.write_text('format = "memsim-calibration-1"\ndevice = "a100-80gb-sxm"\n[fields]\n'
                    'gemm_unaligned_efficiency = 0.3\n')
    device = apply_calibration(get_device("a100-80gb-sxm"), read_calibration(path))
    assert device.gemm_unaligned_efficiency == 0.3 and "c.toml" in device.source["gemm_unaligned_efficiency"]
    path.write_text(HEADER + "gemm_unaligned_efficiency = 1.5\n")
    with pytest.raises(TopologyError, match=r"gemm_unaligned_efficiency = 1\.5 must be in \[0, 1\]"):
        resolve_cluster(_scenario(NAMES[0], path))


@pytest.mark.parametrize("text, match", [
    (None, "not found"),
    ("format = [", "not a readable calibration file"),
    ('format = "other"\ndevice = "cpu"\n', "format = 'other'"),
    (HEADER + "sm_count = 4\n", "fields.sm_count is not calibratable"),
    (HEADER + "launch_overhead_s = -1.0\n", "launch_overhead_s = -1.0"),
])
def test_bad_calibration_files(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(DataError, match=match):
        resolve_cluster(_scenario(NAMES[0], path))


def test_bad_capture_folders(synthetic, tmp_path):
    with pytest.raises(DataError, match="capture folder not found"):
        load_dataset(tmp_path / "missing")
    with pytest.raises(DataError, match="no timing"):
        load_dataset(tmp_path)
    folder = tmp_path / "mixed"
    shutil.copytree(synthetic / "timing", folder / "timing")
    (folder / "timing" / f"{NAMES[0]}.json").write_text("{not json")
    with pytest.raises(DataError, match=f"{NAMES[0]}.json: not a readable timing capture file"):
        load_dataset(folder)
    _write_timing(folder, NAMES[0], _synthetic_rows(), 0.01, {**ENV, "torch_version": "2.99.0"})
    with pytest.raises(DataError, match="torch_version = '2.99.0'"):
        calibrate(folder, bootstrap=0)


@settings(max_examples=25, deadline=None)
@given(alpha_s=st.floats(1e-6, 1e-1), beta=st.floats(1e7, 1e11), world=st.sampled_from([2, 4, 8]))
def test_link_fit_recovers_alpha_beta(alpha_s, beta, world):
    results = [{"collective": "reduce_scatter", "world_size": world, "size_bytes": size,
                "times_s": [alpha_s + link_bus_bytes("reduce_scatter", world, size) / beta] * 2}
               for size in (4096 * 4**i for i in range(8))]
    (fit,) = fit_links(results, bootstrap=0)
    bus_max = link_bus_bytes("reduce_scatter", world, 4096 * 4**7)
    # alpha is identifiable when it is not negligible against the smallest transfer, beta against the largest.
    assert fit.latency_s + bus_max / fit.bytes_per_s == pytest.approx(alpha_s + bus_max / beta, rel=1e-4)
    small = link_bus_bytes("reduce_scatter", world, 4096)
    assert fit.latency_s + small / fit.bytes_per_s == pytest.approx(alpha_s + small / beta, rel=1e-4)


def test_committed_data_calibrates(tmp_path):
    """Committed CPU captures (fp32 and bf16, GPT and LLaMA) fit, with intervals and a residual summary."""
    for name in ("gpt-tiny-fp32-flash-none-adamw", "gpt-tiny-bf16-mixed-eager-none-adamw",
                 "llama-tiny-fp32-eager-gqa-none-adamw", "llama-tiny-bf16-flash-mha-none-adamw"):
        (tmp_path / "timing").mkdir(exist_ok=True)
        shutil.copy(DATA / "timing" / f"{name}.json", tmp_path / "timing")
    shutil.copy(DATA / "collectives.json", tmp_path)
    result = calibrate(tmp_path, bootstrap=4)
    values = tomllib.loads(calibration_toml(result))
    assert values["device"] == "cpu" and values["fields"]["launch_overhead_s"] > 0
    for key, estimate in values["fitted"].items():
        low, high = values["ci95"][key]
        assert low <= high and math.isfinite(estimate), key
    assert values["residuals"]["iterations"]["n"] == len(result.dataset.names)
    assert {"all_reduce", "all_gather", "reduce_scatter"} <= set(values["links"])
