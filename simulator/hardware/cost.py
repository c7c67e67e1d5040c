"""Roofline cost of one op on one device: max(compute, HBM, L2 time) + launch overhead, shape-aware GEMM efficiency.

    time = max(flops / (peak[dtype] * efficiency(op class, shape) * sm_fraction),
               hbm_bytes / (hbm_bytes_per_s * hbm_efficiency[op class]),
               l2_hit_bytes / l2_bytes_per_s) + launch_overhead_s
    hbm_bytes = bytes_read + bytes_written - l2_hit_bytes

Rates: GEMM and attention ops run on the tensor rate of their dtype ("fp32" uses the fp32 CUDA-core rate,
not tf32, unless the op says "tf32"; "fp8" falls back to bf16 on devices without fp8); every other op class
(elementwise, norm, softmax, embedding, optimizer, copy) runs at the fp32 vector rate and is in practice
bound by its bytes, at device.hbm_efficiency_by_class of its class where measured, else device.hbm_efficiency.
GEMM efficiency = device.gemm_efficiency[dtype] scaled by the shape's tile and wave
quantization and a small-k penalty, relative to the shape at which that efficiency was measured, and capped
by device.gemm_unaligned_efficiency when a dimension is not a multiple of 16 bytes of its dtype (cuBLAS then
leaves its aligned tensor-core kernels: an unpadded vocabulary of 50,257 is the common case).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

from simulator.errors import ScenarioError
from simulator.hardware.catalog import DeviceSpec
from simulator.workload.graph import ATTENTION, DTYPE_BYTES, GEMM, OP_CLASSES, SPARSE_GEMM, Op

TENSOR_OP_CLASSES = (GEMM, ATTENTION, SPARSE_GEMM)
# Which peak_flop_per_s key a tensor op of each dtype runs at, first available wins.
_TENSOR_RATE_ORDER = MappingProxyType({
    "fp32": ("fp32",),
    "tf32": ("tf32", "fp32"),
    "bf16": ("bf16", "fp16"),
    "fp16": ("fp16", "bf16"),
    "fp8": ("fp8", "bf16", "fp16"),
    "int8": ("fp8", "bf16", "fp16"),
    "uint8": ("fp8", "bf16", "fp16"),
})
KNOWN_OP_DTYPES = tuple(sorted(set(DTYPE_BYTES) | {"tf32"}))


@dataclass(frozen=True)
class OpCost:
    """The terms of one op's roofline time on one device (seconds); `bound` names the largest term."""

    compute_s: float
    hbm_s: float
    l2_s: float
    launch_s: float
    total_s: float
    bound: str          # "compute" | "hbm" | "l2"
    flop_per_s: float   # effective compute rate used (peak x efficiency x sm_fraction)


def rate_dtype(device: DeviceSpec, dtype: str, tensor_op: bool = True) -> str:
    """The `device.peak_flop_per_s` key an op of `dtype` runs at.

    Args:
        device: the device.
        dtype: the op's compute dtype ("fp32", "tf32", "bf16", "fp16", "fp8", or a storage dtype).
        tensor_op: True for GEMM/attention (tensor cores); False uses the fp32 vector rate.

    Returns:
        A key of device.peak_flop_per_s.

    Raises:
        ScenarioError: `dtype` is not a dtype memsim knows.
    """
    if dtype not in KNOWN_OP_DTYPES:
        raise ScenarioError(f"op dtype = {dtype!r} is unknown (allowed: {', '.join(KNOWN_OP_DTYPES)})")
    if not tensor_op:
        return "fp32"
    for key in _TENSOR_RATE_ORDER.get(dtype, ("fp32",)):
        if key in device.peak_flop_per_s:
            return key
    return "fp32"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


ALIGNMENT_BYTES = 16    # NVIDIA, "Matrix Multiplication Background" user's guide: tensor cores are used best
                        # when M, N and K are multiples of 16 bytes (a requirement before cuBLAS 11.0)


def gemm_alignment_bytes(m: int, n: int, k: int, dtype: str = "bf16") -> int:
    """The largest power of two, in bytes of `dtype` and at most ALIGNMENT_BYTES, that divides m, n and k.

    Each of m, n and k is a leading dimension of one operand in one of a linear layer's three training GEMMs
    (forward, input gradient, weight gradient), so all three count.
    """
    common = math.gcd(m, n, k)
    width = 4 if dtype == "tf32" else DTYPE_BYTES.get(dtype, 4)
    return min(ALIGNMENT_BYTES, width * (common & -common))


def gemm_unaligned_cap(device: DeviceSpec, m: int, n: int, k: int, dtype: str = "bf16") -> float | None:
    """The most of the tensor peak a GEMM reaches when its dimensions miss the 16-byte alignment, or None.

    None when the shape is aligned, the op runs on CUDA cores (fp32 without TF32: no tensor-core path to
    lose) or the device does not model it (gemm_unaligned_efficiency 0). Otherwise the device's
    gemm_unaligned_efficiency at 4- or 8-byte alignment, half of it at 2 bytes and a quarter at 1 byte.
    """
    if device.gemm_unaligned_efficiency == 0 or rate_dtype(device, dtype) == "fp32":
        return None
    alignment = gemm_alignment_bytes(m, n, k, dtype)
    if alignment >= ALIGNMENT_BYTES:
        return None
    return device.gemm_unaligned_efficiency * min(alignment, 4) / 4


def gemm_shape_factor(device: DeviceSpec, m: int, n: int, k: int, batch: int = 1) -> float:
    """Fraction of a full-speed GEMM a shape keeps: tile and wave quantization times a small-k penalty.

    Output tiles of gemm_tile_mn x gemm_tile_mn are spread over sm_count SMs in waves; the useful share is
    m*n*batch / (waves * sm_count * tile^2), which combines partial tiles (small m or n) with the idle SMs of
    the last wave (tiles / (ceil(tiles / sm_count) * sm_count)). Each tile also pays a fixed pipeline fill
    worth gemm_k_overhead k-steps: k / (k + gemm_k_overhead).

    Args:
        device: the device (tile size, SM count, k overhead).
        m, n, k: the GEMM's dimensions (batched dims folded into m, or given as batch).
        batch: number of independent GEMMs of this shape in one launch.

    Returns:
        A factor in (0, 1].

    Raises:
        ValueError: a dimension is not a positive integer.
    """
    for label, value in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"gemm {label} = {value!r} must be a positive integer")
    tile = device.gemm_tile_mn
    tiles = _ceil_div(m, tile) * _ceil_div(n, tile) * batch
    slots = _ceil_div(tiles, device.sm_count) * device.sm_count
    useful = (m * n * batch) / (slots * tile * tile)
    return useful * k / (k + device.gemm_k_overhead)


def gemm_efficiency(device: DeviceSpec, m: int, n: int, k: int, batch: int = 1, dtype: str = "bf16") -> float:
    """Fraction of `device`'s peak a GEMM of this shape and dtype reaches.

    Equals device.gemm_efficiency[dtype] at device.gemm_reference_mnk and scales with gemm_shape_factor
    elsewhere, so a shape with fewer idle SMs than the reference can slightly exceed it; at most
    gemm_unaligned_cap when the shape misses the 16-byte alignment.

    Args:
        device: the device.
        m, n, k: GEMM dimensions.
        batch: independent GEMMs of this shape in one launch.
        dtype: compute dtype (mapped as in rate_dtype).

    Returns:
        The efficiency (> 0).

    Raises:
        ValueError: a dimension is not a positive integer.
        ScenarioError: unknown dtype.
    """
    key = rate_dtype(device, dtype)
    reference = gemm_shape_factor(device, *device.gemm_reference_mnk)
    efficiency = device.gemm_efficiency[key] * gemm_shape_factor(device, m, n, k, batch) / reference
    cap = gemm_unaligned_cap(device, m, n, k, dtype)
    return efficiency if cap is None else min(efficiency, cap)


def effective_flop_per_s(op: Op, device: DeviceSpec) -> float:
    """The FLOP rate `op` computes at on `device` (peak of its dtype times its class/shape efficiency).

    Raises:
        ScenarioError: unknown op class or dtype.
    """
    if op.op_class not in OP_CLASSES:
        raise ScenarioError(f"op {op.name!r}: op_class = {op.op_class!r} is unknown "
                            f"(allowed: {', '.join(OP_CLASSES)})")
    tensor_op = op.op_class in TENSOR_OP_CLASSES
    key = rate_dtype(device, op.dtype, tensor_op)
    peak = device.peak_flop_per_s[key]
    if op.op_class in (GEMM, SPARSE_GEMM):
        # A 2:4 sparse GEMM: the sparse tensor-core rate, with the dense GEMM's shape efficiency (assumed).
        speedup = device.sparse_gemm_speedup if op.op_class == SPARSE_GEMM else 1.0
        if op.gemm_mnk is None:
            return peak * device.gemm_efficiency[key] * speedup
        m, n, k = op.gemm_mnk
        return peak * gemm_efficiency(device, m, n, k, op.gemm_batch, op.dtype) * speedup
    if op.op_class == ATTENTION:
        return peak * device.attention_efficiency
    return peak


def op_cost(op: Op, device: DeviceSpec, l2_hit_bytes: int = 0, sm_fraction: float = 1.0) -> OpCost:
    """Every term of `op`'s roofline time on `device`.

    Args:
        op: the op (flops, bytes_read, bytes_written, dtype, op_class, gemm_mnk).
        device: the device.
        l2_hit_bytes: bytes of the op's traffic served by L2 instead of HBM (0..bytes_read+bytes_written).
        sm_fraction: share of the SMs the op gets (communication kernels may hold the rest), in (0, 1].

    Returns:
        OpCost with compute_s, hbm_s, l2_s, launch_s, total_s and the bound term.

    Raises:
        ValueError: negative flops/bytes, l2_hit_bytes out of range, sm_fraction outside (0, 1].
        ScenarioError: unknown op class or dtype.
    """
    if op.flops < 0 or op.bytes_read < 0 or op.bytes_written < 0:
        raise ValueError(f"op {op.name!r}: flops, bytes_read and bytes_written must be >= 0 "
                         f"(got {op.flops}, {op.bytes_read}, {op.bytes_written})")
    traffic_bytes = op.bytes_read + op.bytes_written
    if not 0 <= l2_hit_bytes <= traffic_bytes:
        raise ValueError(f"op {op.name!r}: l2_hit_bytes = {l2_hit_bytes} must be in [0, {traffic_bytes}]")
    if not (isinstance(sm_fraction, (int, float)) and 0 < sm_fraction <= 1):
        raise ValueError(f"op {op.name!r}: sm_fraction = {sm_fraction!r} must be in (0, 1]")
    rate = effective_flop_per_s(op, device) * sm_fraction
    compute_s = op.flops / rate if op.flops else 0.0
    efficiency = device.hbm_efficiency_by_class.get(op.op_class, device.hbm_efficiency)
    hbm_s = (traffic_bytes - l2_hit_bytes) / (device.hbm_bytes_per_s * efficiency)
    l2_s = l2_hit_bytes / device.l2_bytes_per_s
    terms = (("compute", compute_s), ("hbm", hbm_s), ("l2", l2_s))
    bound, longest_s = max(terms, key=lambda term: term[1])
    return OpCost(compute_s=compute_s, hbm_s=hbm_s, l2_s=l2_s, launch_s=device.launch_overhead_s,
                  total_s=longest_s + device.launch_overhead_s, bound=bound, flop_per_s=rate)


def op_time_s(op: Op, device: DeviceSpec, l2_hit_bytes: int = 0, sm_fraction: float = 1.0) -> float:
    """Seconds `op` takes on `device` (see the module docstring for the formula).

    Args:
        op: the op.
        device: the device.
        l2_hit_bytes: bytes served by L2 instead of HBM; they only help when the op is memory-bound.
        sm_fraction: share of SMs available to the op, in (0, 1].

    Returns:
        The op's time in seconds, launch overhead included.

    Raises:
        ValueError: invalid l2_hit_bytes, sm_fraction, or negative costs on the op.
        ScenarioError: unknown op class or dtype.
    """
    return op_cost(op, device, l2_hit_bytes, sm_fraction).total_s


def gemm_time_s(device: DeviceSpec, m: int, n: int, k: int, batch: int = 1, dtype: str = "bf16") -> float:
    """Seconds for a plain GEMM C = A @ B (A: m x k, B: k x n, C written once), e.g. for sweeps and checks.

    Raises:
        ValueError: a dimension is not a positive integer.
        ScenarioError: unknown dtype.
    """
    gemm_shape_factor(device, m, n, k, batch)  # validates the dimensions
    width = 4 if dtype == "tf32" else DTYPE_BYTES.get(dtype, 0)
    if width == 0:
        rate_dtype(device, dtype)  # raises for an unknown dtype
    op = Op(name="gemm", op_class=GEMM, phase="fwd", flops=2.0 * m * n * k * batch,
            bytes_read=width * batch * (m * k + k * n), bytes_written=width * batch * m * n, dtype=dtype,
            gemm_mnk=(m, n, k), gemm_batch=batch)
    return op_time_s(op, device)


__all__ = ["ALIGNMENT_BYTES", "OpCost", "TENSOR_OP_CLASSES", "KNOWN_OP_DTYPES", "effective_flop_per_s",
           "gemm_alignment_bytes", "gemm_efficiency", "gemm_shape_factor", "gemm_time_s", "gemm_unaligned_cap",
           "op_cost", "op_time_s", "rate_dtype"]
