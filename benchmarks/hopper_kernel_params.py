"""Hopper kernel rates from the committed H200 captures' kernel profiles (validation/data/cuda*/timing/*.json).

The captures profile every aten op's device time per call (validation/capture.py). From them, kernel by kernel
(not step times):

* attention_efficiency: FLOP over time of every cuDNN fused-attention call (torch 2.11's SDPA backend on the
  H200), forward and backward (causal: 4 b h s^2 d / 2 forward, 2.5 times that backward), over the bf16 peak;
* streaming_bytes_per_s: bytes over time of the memory-bound kernels (elementwise, copies, norms, optimizer
  updates) that move 100 MB or more per call: the rate a large training step's memory-bound kernels reach;
* gemm_model_ratio: measured over memsim's shape-model time of the bf16 GEMMs of 1e11 FLOP or more (1 means
  hardware/cost.py's GEMM efficiency needs no change).

    python benchmarks/hopper_kernel_params.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simulator.hardware.catalog import FLOP_DTYPES, get_device  # noqa: E402
from simulator.hardware.cost import gemm_efficiency  # noqa: E402
from validation.calibration_data import GEMM, MEMORY, op_rows  # noqa: E402

CAPTURES = sorted((ROOT / "validation" / "data").glob("cuda*/timing/*.json"))
ATTENTION = {"aten::_cudnn_attention_forward": 1.0, "aten::_cudnn_attention_backward": 2.5}
LARGE_BYTES = 100e6


def measure(paths=CAPTURES) -> dict[str, float]:
    """The three figures over the capture files `paths`."""
    device = get_device("h200-sxm")
    attention_flops = attention_s = stream_bytes = stream_s = gemm_measured = gemm_model = 0.0
    for path in paths:
        document = json.loads(Path(path).read_text())
        for name, shapes, _layouts, _dtypes, calls, _median_us, min_us in document["ops"]["rows"]:
            if name in ATTENTION:
                b, h, s, d = shapes[0]
                attention_flops += calls * ATTENTION[name] * 4.0 * b * h * s * s * d / 2
                attention_s += calls * min_us * 1e-6
        rows = op_rows(document, device)
        for i in range(len(rows)):
            time_s = float(rows.time_s[i])
            if rows.kind[i] == MEMORY and rows.bytes[i] >= LARGE_BYTES:
                stream_bytes += float(rows.bytes[i])
                stream_s += time_s
            elif rows.kind[i] == GEMM and rows.m[i] > 0 and rows.flops[i] >= 1e11 \
                    and FLOP_DTYPES[rows.dtype_index[i]] == "bf16":
                m, n, k, batch = (int(v) for v in (rows.m[i], rows.n[i], rows.k[i], rows.batch[i]))
                rate = device.peak_flop_per_s["bf16"] * gemm_efficiency(device, m, n, k, batch, "bf16")
                gemm_measured += time_s           # per call, min over the profiled calls (op_rows)
                gemm_model += float(rows.flops[i]) / rate
    return {"attention_efficiency": attention_flops / attention_s / device.peak_flop_per_s["bf16"],
            "streaming_bytes_per_s": stream_bytes / stream_s, "gemm_model_ratio": gemm_measured / gemm_model,
            "captures": len(paths)}


if __name__ == "__main__":
    for key, value in measure().items():
        print(f"{key} = {value!r}")
