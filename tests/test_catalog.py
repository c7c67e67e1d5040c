"""Tests for the device catalog: sources for every number, datasheet values, lookups, aliases and overrides."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.errors import MemsimError, TopologyError
from simulator.hardware.catalog import (
    ALIASES,
    CPU_RUN,
    DeviceSpec,
    get_device,
    list_devices,
    source_keys,
    with_overrides,
)

REPO = Path(__file__).resolve().parents[1]
GPU_NAMES = ["a100-80gb-sxm", "a100-40gb-sxm", "a100-80gb-pcie", "h100-sxm", "h100-pcie", "h200-sxm",
             "rtx-3090", "rtx-4090", "mi300x"]

# The table of shared/reference/hardware.md: (device, HBM GB/s, L2 MB, BF16 dense TFLOP/s, FP8 TFLOP/s or None,
# FP32 TFLOP/s, NVLink total GB/s or 0, TDP W, marketed memory GB).
TABLE = [
    ("a100-40gb-sxm", 1555, 40, 312, None, 19.5, 600, 400, 40),
    ("a100-80gb-sxm", 2039, 40, 312, None, 19.5, 600, 400, 80),
    ("a100-80gb-pcie", 1935, 40, 312, None, 19.5, 0, 300, 80),
    ("h100-sxm", 3350, 50, 989.4, 1978.9, 66.9, 900, 700, 80),
    ("h100-pcie", 2000, 50, 756, 1513, 51, 0, 350, 80),
    ("h200-sxm", 4800, 50, 989.4, 1978.9, 66.9, 900, 700, 141),
    ("rtx-3090", 936, 6, 71, None, 35.6, 0, 350, 24),
    ("rtx-4090", 1008, 72, 165.2, 330.3, 82.6, 0, 450, 24),
    ("mi300x", 5300, 256, 1307.4, 2614.9, 163.4, None, 750, 192),
]


def test_catalog_order_and_names():
    assert [spec.name for spec in list_devices()] == GPU_NAMES + ["cpu"]


@pytest.mark.parametrize("spec", list_devices(), ids=lambda spec: spec.name)
def test_every_numeric_field_has_a_source(spec: DeviceSpec):
    keys = source_keys(spec)
    assert "memory_bytes" in keys and "peak_flop_per_s.fp32" in keys and "gemm_efficiency.fp32" in keys
    missing = [key for key in keys if not spec.source.get(key, "").strip()]
    assert missing == []


@pytest.mark.parametrize("row", TABLE, ids=lambda row: row[0])
def test_hardware_table_numbers(row):
    name, hbm_gb_s, l2_mb, bf16_tflops, fp8_tflops, fp32_tflops, nvlink_total_gb_s, tdp_w, marketed_gb = row
    spec = get_device(name)
    assert spec.hbm_bytes_per_s == pytest.approx(hbm_gb_s * 1e9)
    if name == "h200-sxm":
        # The device reports 60 MiB; the table's 50 MB (H100's figure) is kept in the source.
        assert spec.l2_bytes == 60 * 2**20 and "50 MB" in spec.source["l2_bytes"]
    else:
        assert spec.l2_bytes == l2_mb * 2**20
    assert spec.peak_flop_per_s["bf16"] == pytest.approx(bf16_tflops * 1e12)
    assert spec.peak_flop_per_s["fp16"] == pytest.approx(bf16_tflops * 1e12)
    assert spec.peak_flop_per_s["fp32"] == pytest.approx(fp32_tflops * 1e12)
    if fp8_tflops is None:
        assert "fp8" not in spec.peak_flop_per_s
    else:
        assert spec.peak_flop_per_s["fp8"] == pytest.approx(fp8_tflops * 1e12)
    if nvlink_total_gb_s is not None:
        assert 2 * spec.nvlink_bytes_per_s_per_direction == pytest.approx(nvlink_total_gb_s * 1e9)
    assert spec.tdp_w == tdp_w
    # Capacity is what torch reports: a little under the marketed size read as GiB, never above it.
    assert 0.95 * marketed_gb * 2**30 < spec.memory_bytes <= marketed_gb * 2**30
    assert spec.usable_bytes == spec.memory_bytes - spec.context_bytes


def test_a100_tf32_and_sm_counts():
    assert get_device("a100-40gb-sxm").peak_flop_per_s["tf32"] == pytest.approx(156e12)
    assert {name: get_device(name).sm_count for name in GPU_NAMES} == {
        "a100-80gb-sxm": 108, "a100-40gb-sxm": 108, "a100-80gb-pcie": 108, "h100-sxm": 132, "h100-pcie": 114,
        "h200-sxm": 132, "rtx-3090": 82, "rtx-4090": 128, "mi300x": 304}


def test_pcie_rates_per_direction():
    assert get_device("a100-80gb-pcie").pcie_bytes_per_s_per_direction == pytest.approx(31.5e9, rel=1e-3)
    assert get_device("h100-pcie").pcie_bytes_per_s_per_direction == pytest.approx(63.0e9, rel=1e-3)
    assert get_device("cpu").pcie_bytes_per_s_per_direction == 0.0


def test_cublas_workspace_follows_torch_defaults():
    # Hopper: 32 MiB cuBLAS + 1 MiB cuBLASLt; other CUDA GPUs: 8 MiB + 128 KiB + 1 MiB.
    assert get_device("h100-sxm").cublas_workspace_bytes == 32 * 2**20 + 2**20
    assert get_device("a100-80gb-sxm").cublas_workspace_bytes == 4096 * 1024 * 2 + 16 * 1024 * 8 + 2**20
    assert get_device("cpu").cublas_workspace_bytes == 0 and get_device("cpu").context_bytes == 0


def test_kernel_behaviour_flags():
    for name in GPU_NAMES:
        spec = get_device(name)
        assert (spec.kind, spec.dropout_mask_dtype, spec.sdpa_flash_with_dropout, spec.default_allocator,
                spec.optimizer_foreach) == ("gpu", "bool", True, "caching", True)
    cpu = get_device("cpu")
    assert (cpu.kind, cpu.dropout_mask_dtype, cpu.sdpa_flash_with_dropout, cpu.default_allocator,
            cpu.optimizer_foreach) == ("cpu", "input", False, "exact", False)


@pytest.mark.parametrize("alias,target", sorted(ALIASES.items()))
def test_aliases(alias, target):
    assert get_device(alias).name == target
    assert get_device(alias.upper()).name == target


def test_lookup_normalizes_case_and_underscores():
    assert get_device("H100_SXM").name == "h100-sxm"
    assert get_device(" a100-40gb-sxm ").name == "a100-40gb-sxm"


@pytest.mark.parametrize("typo,suggestion", [("h10", "h100"), ("a100-80gb-sxn", "a100-80gb-sxm"),
                                             ("rtx4090", "rtx-4090"), ("mi300", "mi300x")])
def test_unknown_device_is_topology_error_with_did_you_mean(typo, suggestion):
    with pytest.raises(TopologyError) as info:
        get_device(typo)
    message = str(info.value)
    assert f"did you mean {suggestion!r}" in message
    assert "h100-sxm" in message and "cpu" in message and "\n" not in message
    assert isinstance(info.value, MemsimError)


def test_unknown_device_without_close_match_lists_known():
    with pytest.raises(TopologyError, match="known devices: a100-80gb-sxm"):
        get_device("quantum-annealer")


def test_specs_are_frozen_and_fresh():
    spec = get_device("h100")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.memory_bytes = 1  # type: ignore[misc]
    spec.peak_flop_per_s["bf16"] = 1.0  # mutating a returned dict must not leak into the catalog
    assert get_device("h100").peak_flop_per_s["bf16"] == pytest.approx(989.4e12)


def test_specs_hash_and_compare_by_value():
    assert len({get_device("h100"), get_device("h100-sxm"), get_device("a100")}) == 2
    assert with_overrides(get_device("h100"), hbm_efficiency=0.5) != get_device("h100")


def test_specs_pickle_round_trip():
    for spec in list_devices():
        assert pickle.loads(pickle.dumps(spec)) == spec


def test_with_overrides_merges_dicts_and_marks_sources():
    base = get_device("a100")
    spec = with_overrides(base, hbm_efficiency=0.9, gemm_efficiency={"bf16": 0.7},
                          source={"hbm_efficiency": "calibration: validation/data/a100.json"})
    assert spec.hbm_efficiency == 0.9 and spec.source["hbm_efficiency"] == "calibration: validation/data/a100.json"
    assert spec.gemm_efficiency == {**base.gemm_efficiency, "bf16": 0.7}
    assert "with_overrides" in spec.source["gemm_efficiency.bf16"]
    assert spec.source["gemm_efficiency.fp32"] == base.source["gemm_efficiency.fp32"]
    assert with_overrides(base, gemm_reference_mnk=[4096, 4096, 4096]).gemm_reference_mnk == (4096, 4096, 4096)
    assert base.hbm_efficiency == 0.834  # the original is untouched


def test_with_overrides_rejects_unknown_fields_and_bad_values():
    base = get_device("h100")
    with pytest.raises(TopologyError, match="did you mean 'hbm_efficiency'"):
        with_overrides(base, hbm_efficency=0.5)
    with pytest.raises(TopologyError, match="hbm_efficiency = 1.5 must be in"):
        with_overrides(base, hbm_efficiency=1.5)
    with pytest.raises(TopologyError, match="int4 = .* has an unknown dtype"):
        with_overrides(base, peak_flop_per_s={"int4": 1e15})
    with pytest.raises(TopologyError, match="gemm_efficiency .* must have the dtypes of peak_flop_per_s"):
        with_overrides(get_device("a100"), peak_flop_per_s={"fp8": 624e12})
    with pytest.raises(TopologyError, match="kind"):
        with_overrides(base, kind="tpu")
    with pytest.raises(TopologyError, match="memory_bytes"):
        with_overrides(base, memory_bytes=-1)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(GPU_NAMES + ["cpu"]),
       hbm=st.floats(min_value=1e9, max_value=1e13, allow_nan=False),
       eff=st.floats(min_value=0.01, max_value=1.0),
       memory=st.integers(min_value=2**30, max_value=2**40))
def test_with_overrides_round_trip(name, hbm, eff, memory):
    spec = with_overrides(get_device(name), hbm_bytes_per_s=hbm, hbm_efficiency=eff, memory_bytes=memory)
    assert (spec.hbm_bytes_per_s, spec.hbm_efficiency, spec.memory_bytes) == (hbm, eff, memory)
    assert all(spec.source.get(key) for key in source_keys(spec))


@settings(max_examples=40, deadline=None)
@given(field=st.sampled_from(["memory_bytes", "l2_bytes", "sm_count", "hbm_bytes_per_s", "l2_bytes_per_s"]),
       value=st.one_of(st.integers(max_value=0), st.floats(max_value=0.0, allow_nan=False)))
def test_non_positive_capacities_are_rejected(field, value):
    with pytest.raises(TopologyError, match=field):
        with_overrides(get_device("h100"), **{field: value})


def test_cpu_entry_matches_recorded_run():
    run = json.loads((REPO / "validation/data/cpu/device_params.json").read_text())
    cpu = get_device("cpu")
    assert run["date"] == CPU_RUN["date"] and run["command"] == CPU_RUN["command"]
    assert run["date"] in cpu.source["hbm_bytes_per_s"] and run["command"] in cpu.source["launch_overhead_s"]
    assert cpu.memory_bytes == run["host_memory_bytes"]
    assert cpu.hbm_bytes_per_s == pytest.approx(run["dram_copy"]["bytes_per_s"], rel=1e-12)
    assert cpu.l2_bytes == max(run["cache_bytes"].values())
    assert cpu.l2_bytes_per_s == pytest.approx(run["llc_copy"]["bytes_per_s"], rel=1e-12)
    assert cpu.sm_count == run["torch_num_threads"]
    for dtype, rate in run["peak_flop_per_s"].items():
        assert cpu.peak_flop_per_s[dtype] == pytest.approx(rate, rel=1e-12)
    assert cpu.launch_overhead_s == pytest.approx(run["op_overhead"]["median_s"], rel=1e-12)
    assert list(cpu.gemm_reference_mnk) == run["gemm_reference_mnk"]["fp32"]
    assert list(CPU_RUN["low_precision_reference_mnk"]) == run["gemm_reference_mnk"]["bf16"]


def test_l2_is_never_slower_than_hbm():
    for spec in list_devices():
        assert spec.l2_bytes_per_s >= spec.hbm_bytes_per_s * spec.hbm_efficiency, spec.name
