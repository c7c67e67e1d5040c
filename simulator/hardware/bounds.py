"""Physical upper limits on calibratable device and link parameters: a fitted value beyond them is not a device."""

from __future__ import annotations

import math

# Each bound is far above any shipping device (so no real fit is refused) and far below the values that turn
# an iteration into 1e300 seconds. The figures they are compared with:
#   HBM: B200 8 TB/s (NVIDIA B200 datasheet, 2024); H200 4.8 TB/s (NVIDIA H200 datasheet, 2024).
#   L2: Hopper's L2 reads at roughly 10 TB/s (Chips and Cheese, "Nvidia's H100", 2023).
#   Peak FLOP/s: B200 dense FP4 9 PFLOP/s (NVIDIA B200 datasheet, 2024).
#   NVLink 5: 900 GB/s per direction per GPU (NVIDIA Blackwell architecture brief, 2024).
#   Fitted GEMM k overheads: 15 (CPU) and 188 (H200) in validation/data/*/calibration.toml.
UPPER: dict[str, tuple[float, str]] = {
    "hbm_bytes_per_s": (1e14, "100 TB/s, 12x the fastest HBM (B200, 8 TB/s)"),
    "l2_bytes_per_s": (1e15, "1 PB/s, 100x a Hopper L2"),
    "peak_flop_per_s": (1e17, "100 PFLOP/s, 11x a B200's dense FP4"),
    "gemm_k_overhead": (16384, "a GEMM with k = 16384 would run at half its rate (fits: 15 to 188)"),
    "launch_overhead_s": (1.0, "1 s per launch"),
    "host_forward_op_s": (1.0, "1 s of host time per op"),
    "host_backward_op_s": (1.0, "1 s of host time per op"),
    "host_checkpoint_s": (1.0, "1 s of host time per checkpoint"),
    "host_optimizer_tensor_s": (1.0, "1 s of host time per tensor"),
    "latency_s": (1.0, "1 s for one collective's latency"),
    "bytes_per_s": (1e14, "100 TB/s, 100x an NVLink 5 GPU's bandwidth"),
}


def check_upper(field: str, value: float) -> str | None:
    """The reason `value` cannot be real for `field` (a base name: 'peak_flop_per_s', not '.bf16'), or None."""
    bound = UPPER.get(field)
    if bound is None or not math.isfinite(value):
        return None
    limit, why = bound
    if value > limit:
        return f"is beyond any real device (at most {limit:g}: {why})"
    return None
