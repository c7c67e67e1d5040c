"""Tests for the roofline op cost model: exact times, dtype rates, L2 hits, wave quantization and invariants."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.errors import ScenarioError
from simulator.hardware.catalog import get_device, list_devices, with_overrides
from simulator.hardware.cost import (
    effective_flop_per_s,
    gemm_alignment_bytes,
    gemm_efficiency,
    gemm_shape_factor,
    gemm_time_s,
    gemm_unaligned_cap,
    op_cost,
    op_time_s,
    rate_dtype,
)
from simulator.workload.graph import ATTENTION, ELEMENTWISE, GEMM, NORM, OP_CLASSES, Op

REPO = Path(__file__).resolve().parents[1]
H100 = get_device("h100-sxm")
A100 = get_device("a100-80gb-sxm")
CPU = get_device("cpu")


def gemm_op(m: int, n: int, k: int, dtype: str = "bf16", batch: int = 1, width: int = 2) -> Op:
    return Op(name="mm", op_class=GEMM, phase="fwd", flops=2.0 * m * n * k * batch,
              bytes_read=width * batch * (m * k + k * n), bytes_written=width * batch * m * n, dtype=dtype,
              gemm_mnk=(m, n, k), gemm_batch=batch)


def elementwise_op(nbytes: int, dtype: str = "bf16") -> Op:
    return Op(name="gelu", op_class=ELEMENTWISE, phase="fwd", flops=nbytes / 2, bytes_read=nbytes // 2,
              bytes_written=nbytes - nbytes // 2, dtype=dtype)


def test_large_square_bf16_gemm_on_h100_is_flops_over_peak_times_efficiency():
    op = gemm_op(8192, 8192, 8192)
    eff = gemm_efficiency(H100, 8192, 8192, 8192)
    assert eff == pytest.approx(H100.gemm_efficiency["bf16"]) == pytest.approx(0.798)
    expected_s = op.flops / (989.4e12 * eff) + H100.launch_overhead_s
    assert op_time_s(op, H100) == pytest.approx(expected_s, rel=1e-12)
    assert op_cost(op, H100).bound == "compute"


def test_memory_bound_elementwise_scales_with_bytes():
    one = op_time_s(elementwise_op(2**26), H100) - H100.launch_overhead_s
    two = op_time_s(elementwise_op(2**27), H100) - H100.launch_overhead_s
    assert one == pytest.approx(2**26 / (3350e9 * H100.hbm_efficiency_by_class["elementwise"]), rel=1e-12)
    assert two == pytest.approx(2 * one, rel=1e-12)
    assert op_cost(elementwise_op(2**26), H100).bound == "hbm"


def test_l2_hits_help_only_memory_bound_ops():
    small = elementwise_op(16 * 2**20)
    hit = small.bytes_read  # the input was just written by its producer and is still in L2
    assert op_time_s(small, H100, l2_hit_bytes=hit) < op_time_s(small, H100)
    expected = max((small.bytes_written) / (3350e9 * H100.hbm_efficiency_by_class["elementwise"]),
                   hit / H100.l2_bytes_per_s)
    assert op_time_s(small, H100, l2_hit_bytes=hit) == pytest.approx(expected + H100.launch_overhead_s)
    big = gemm_op(8192, 8192, 8192)
    assert op_time_s(big, H100, l2_hit_bytes=big.bytes_read) == op_time_s(big, H100)


def test_wave_quantization_one_extra_tile_costs_a_wave():
    tile, sms = H100.gemm_tile_mn, H100.sm_count
    full = gemm_op(12 * tile, 11 * tile, 16384)      # 132 tiles = sm_count: one full wave
    extra = gemm_op(7 * tile, 19 * tile, 16384)      # 133 tiles: a second wave with one tile
    assert 12 * 11 == sms and 7 * 19 == sms + 1
    per_flop_full = (op_time_s(full, H100) - H100.launch_overhead_s) / full.flops
    per_flop_extra = (op_time_s(extra, H100) - H100.launch_overhead_s) / extra.flops
    assert op_cost(full, H100).bound == op_cost(extra, H100).bound == "compute"
    assert per_flop_extra > 1.9 * per_flop_full
    assert gemm_shape_factor(H100, 7 * tile, 19 * tile, 16384) == pytest.approx(
        133 / 264 * 16384 / (16384 + H100.gemm_k_overhead))


def test_partial_tiles_and_small_k_are_penalized():
    assert gemm_efficiency(H100, 8192, 8192, 64) < gemm_efficiency(H100, 8192, 8192, 8192)
    # a partial last tile row: 129 rows take two tile rows, like 256 would
    assert gemm_shape_factor(H100, 129, 128 * 66, 8192) == pytest.approx(129 / 256 * 8192 / (8192 + 32))
    assert gemm_shape_factor(H100, 64, 128 * 132, 8192) == pytest.approx(0.5 * 8192 / (8192 + 32))


def test_fp32_matmul_uses_fp32_rate_unless_tf32():
    fp32 = gemm_op(8192, 8192, 8192, dtype="fp32", width=4)
    tf32 = dataclasses.replace(fp32, dtype="tf32")
    assert effective_flop_per_s(fp32, H100) == pytest.approx(66.9e12 * H100.gemm_efficiency["fp32"])
    assert effective_flop_per_s(tf32, H100) == pytest.approx(494.7e12 * H100.gemm_efficiency["tf32"])
    assert op_time_s(fp32, H100) > 5 * op_time_s(tf32, H100)


def test_fp8_uses_fp8_rate_where_available_else_bf16():
    assert rate_dtype(H100, "fp8") == "fp8" and rate_dtype(A100, "fp8") == "bf16"
    fp8 = gemm_op(8192, 8192, 8192, dtype="fp8", width=1)
    bf16_rate = effective_flop_per_s(gemm_op(8192, 8192, 8192), A100)
    assert effective_flop_per_s(fp8, A100) == pytest.approx(bf16_rate)
    assert effective_flop_per_s(fp8, H100) == pytest.approx(1978.9e12 * H100.gemm_efficiency["fp8"])
    assert rate_dtype(CPU, "fp16") == "fp16" and rate_dtype(CPU, "fp8") == "bf16"


def test_attention_and_vector_classes_rates():
    attention = Op(name="sdpa", op_class=ATTENTION, phase="fwd", flops=1e12, bytes_read=10**6, dtype="bf16")
    assert effective_flop_per_s(attention, H100) == pytest.approx(989.4e12 * H100.attention_efficiency)
    norm = Op(name="ln", op_class=NORM, phase="fwd", flops=1e9, bytes_read=10**6, dtype="bf16")
    assert effective_flop_per_s(norm, H100) == pytest.approx(66.9e12)
    unshaped = Op(name="mm", op_class=GEMM, phase="fwd", flops=1e12, dtype="bf16")
    assert effective_flop_per_s(unshaped, H100) == pytest.approx(989.4e12 * 0.798)


def test_sm_fraction_slows_only_compute():
    big = gemm_op(8192, 8192, 8192)
    compute_s = op_cost(big, H100).compute_s
    assert op_cost(big, H100, sm_fraction=0.5).compute_s == pytest.approx(2 * compute_s)
    small = elementwise_op(2**26)
    assert op_time_s(small, H100, sm_fraction=0.25) == op_time_s(small, H100)


def test_cpu_uses_the_same_formula_with_measured_parameters():
    m, n, k = CPU.gemm_reference_mnk
    op = gemm_op(m, n, k, dtype="fp32", width=4)
    assert op_time_s(op, CPU) == pytest.approx(op.flops / CPU.peak_flop_per_s["fp32"] + CPU.launch_overhead_s)
    copy = elementwise_op(2**28, dtype="fp32")
    assert op_time_s(copy, CPU) == pytest.approx(2**28 / CPU.hbm_bytes_per_s + CPU.launch_overhead_s)


def test_cpu_model_reproduces_recorded_reference_measurements():
    run = json.loads((REPO / "validation/data/cpu/device_params.json").read_text())
    checked = 0
    for record in run["gemm"]:
        shape = [record["m"], record["n"], record["k"]]
        if shape != run["gemm_reference_mnk"][record["dtype"]]:
            continue
        model_s = gemm_time_s(CPU, *shape, dtype=record["dtype"])
        # exact up to the launch overhead, which the measured time contains once more
        assert model_s == pytest.approx(record["median_s"] + CPU.launch_overhead_s, rel=1e-9)
        checked += 1
    assert checked == 3


def test_errors():
    with pytest.raises(ScenarioError, match="op_class = 'matmul' is unknown"):
        op_time_s(dataclasses.replace(gemm_op(64, 64, 64), op_class="matmul"), H100)
    with pytest.raises(ScenarioError, match="dtype = 'fp4' is unknown"):
        op_time_s(dataclasses.replace(gemm_op(64, 64, 64), dtype="fp4"), H100)
    with pytest.raises(ValueError, match="sm_fraction"):
        op_time_s(gemm_op(64, 64, 64), H100, sm_fraction=0.0)
    with pytest.raises(ValueError, match="l2_hit_bytes"):
        op_time_s(elementwise_op(1024), H100, l2_hit_bytes=2048)
    with pytest.raises(ValueError, match="gemm k = 0"):
        gemm_efficiency(H100, 64, 64, 0)


H200 = get_device("h200-sxm")


def test_unaligned_gemm_is_capped_at_the_measured_rate():
    """An unpadded GPT-2 vocabulary (50,257) leaves the 16-byte-aligned kernels; the padded 50,304 keeps them."""
    for m, n, k in ((2048, 50257, 12288), (2048, 12288, 50257), (50257, 12288, 2048)):
        assert gemm_efficiency(H200, m, n, k) == 0.262 / 2            # 2-byte alignment: half the cap
    assert gemm_efficiency(H200, 4096, 50258, 768) == 0.262          # 4 bytes
    assert gemm_efficiency(H200, 4096, 50260, 768) == 0.262          # 8 bytes
    assert gemm_efficiency(H200, 2048, 50304, 12288) == gemm_efficiency(
        with_overrides(H200, gemm_unaligned_efficiency=0.0), 2048, 50304, 12288) > 0.8
    # measured on the H200 (validation/data/cuda-large): 25.59 + 17.88 + 17.10 ms for the three GEMMs
    assert 3 * gemm_time_s(H200, 2048, 50257, 12288) == pytest.approx(58.56e-3, rel=1e-3)
    assert gemm_time_s(H200, 2048, 50304, 12288) == pytest.approx(3.130e-3, rel=1e-3)
    # fp32 on CUDA cores keeps its rate (measured: 0.93-1.04 of the aligned width's); TF32 does not
    assert gemm_efficiency(H200, 2048, 50257, 768, dtype="fp32") == gemm_efficiency(
        with_overrides(H200, gemm_unaligned_efficiency=0.0), 2048, 50257, 768, dtype="fp32")
    assert gemm_efficiency(H200, 4096, 50258, 768, dtype="tf32") == 0.262
    assert gemm_efficiency(H200, 4096, 50260, 768, dtype="tf32") > 0.262
    for name in ("a100-80gb-sxm", "rtx-4090", "mi300x", "cpu"):       # not modelled there
        device = get_device(name)
        assert device.gemm_unaligned_efficiency == 0.0
        assert gemm_unaligned_cap(device, 2048, 50257, 768) is None


def test_alignment_bytes():
    assert gemm_alignment_bytes(8, 8, 8, "bf16") == 16 and gemm_alignment_bytes(8, 8, 4, "bf16") == 8
    assert gemm_alignment_bytes(4, 4, 4, "tf32") == 16 and gemm_alignment_bytes(2, 4, 4, "fp32") == 8
    assert gemm_alignment_bytes(16, 16, 16, "fp8") == 16 and gemm_alignment_bytes(16, 16, 1, "fp8") == 1
    assert gemm_alignment_bytes(2048, 50257, 12288) == 2 and gemm_alignment_bytes(2048, 50258, 12288) == 4
    assert gemm_alignment_bytes(1 << 20, 1 << 30, 1 << 12, "bf16") == 16


dims = st.integers(min_value=1, max_value=20000)


@settings(max_examples=200, deadline=None)
@given(device=st.sampled_from(list_devices()), m=dims, n=dims, k=dims, batch=st.integers(min_value=1, max_value=8),
       dtype=st.sampled_from(["fp32", "tf32", "bf16", "fp16", "fp8"]))
def test_unaligned_cap_bounds_exactly_the_unaligned_tensor_gemms(device, m, n, k, batch, dtype):
    uncapped = gemm_efficiency(with_overrides(device, gemm_unaligned_efficiency=0.0), m, n, k, batch, dtype)
    width = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}[dtype]
    alignment = 16
    while alignment > width and any(v * width % alignment for v in (m, n, k)):
        alignment //= 2
    tensor = rate_dtype(device, dtype) != "fp32"
    expected = uncapped
    if device.gemm_unaligned_efficiency and tensor and alignment < 16:
        expected = min(uncapped, device.gemm_unaligned_efficiency * min(alignment, 4) / 4)
    assert gemm_efficiency(device, m, n, k, batch, dtype) == expected


@settings(max_examples=200, deadline=None)
@given(device=st.sampled_from(list_devices()), m=dims, n=dims, k=dims,
       batch=st.integers(min_value=1, max_value=64), dtype=st.sampled_from(["fp32", "tf32", "bf16", "fp16", "fp8"]))
def test_gemm_efficiency_bounds(device, m, n, k, batch, dtype):
    eff = gemm_efficiency(device, m, n, k, batch, dtype)
    key = rate_dtype(device, dtype)
    reference = gemm_shape_factor(device, *device.gemm_reference_mnk)
    assert 0 < gemm_shape_factor(device, m, n, k, batch) <= 1
    assert 0 < eff <= device.gemm_efficiency[key] / reference * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(device=st.sampled_from(list_devices()), op_class=st.sampled_from(OP_CLASSES),
       flops=st.floats(min_value=0, max_value=1e15), read=st.integers(min_value=0, max_value=2**36),
       written=st.integers(min_value=0, max_value=2**36), hit_share=st.floats(min_value=0, max_value=1),
       extra=st.integers(min_value=1, max_value=2**30), sm_fraction=st.floats(min_value=0.05, max_value=1))
def test_op_time_invariants(device, op_class, flops, read, written, hit_share, extra, sm_fraction):
    op = Op(name="x", op_class=op_class, phase="fwd", flops=flops, bytes_read=read, bytes_written=written,
            dtype="bf16")
    hit = int((read + written) * hit_share)
    base = op_time_s(op, device)
    assert base >= device.launch_overhead_s
    # more bytes or more FLOPs never make an op faster
    assert op_time_s(dataclasses.replace(op, bytes_read=read + extra), device) >= base
    assert op_time_s(dataclasses.replace(op, flops=flops * 2 + 1), device) >= base
    # L2 hits never make it slower (L2 is at least as fast as HBM on every device), fewer SMs never faster
    assert op_time_s(op, device, l2_hit_bytes=hit) <= base * (1 + 1e-12)
    assert op_time_s(op, device, sm_fraction=sm_fraction) >= base * (1 - 1e-12)


@pytest.mark.parametrize("name", ["a100-40gb-sxm", "h100-sxm", "rtx-4090"])
def test_overridden_sm_count_changes_waves(name):
    device = get_device(name)
    doubled = with_overrides(device, sm_count=device.sm_count * 2)
    tile = device.gemm_tile_mn
    m = tile * device.sm_count  # one wave of a single-column GEMM on the original device, half on the doubled
    assert gemm_shape_factor(doubled, m, tile, 4096) == pytest.approx(0.5 * gemm_shape_factor(device, m, tile, 4096))
