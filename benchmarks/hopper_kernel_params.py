"""Hopper kernel rates from the committed H200 captures' kernel profiles (validation/data/cuda*/timing/*.json).

The captures profile every aten op's device time per call (validation/capture.py). From them, kernel by kernel
(not step times):

* attention_efficiency: FLOP over time of every cuDNN fused-attention call (torch 2.11's SDPA backend on the
  H200), forward and backward (causal: 4 b h s^2 d / 2 forward, 2.5 times that backward), over the bf16 peak;
* streaming_bytes_per_s.<op class>: bytes over time of the memory-bound kernels that move 100 MB or more per call,
  by memsim op class (elementwise, copy, softmax, norm); `optimizer` from the AdamW step microbenchmark
  (validation/data/cuda-large/optimizer_step.json: single-tensor, foreach and fused steps on 2^30 parameters, the
  bytes memsim's optimizer ops move over the measured time);
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
from simulator.workload.optimizers import IdSource, MasterParam, step_ops  # noqa: E402
from validation.calibration_data import GEMM, MEMORY_OPS, _WRITE_ONLY, _tensor_bytes, op_rows  # noqa: E402

CAPTURES = sorted((ROOT / "validation" / "data").glob("cuda*/timing/*.json"))
OPTIMIZER_STEP = ROOT / "validation" / "data" / "cuda-large" / "optimizer_step.json"
ATTENTION = {"aten::_cudnn_attention_forward": 1.0, "aten::_cudnn_attention_backward": 2.5}
LARGE_BYTES = 100e6


def op_class(name: str) -> str:
    """memsim's op class of a memory-bound aten op (validation.calibration_data MEMORY_OPS)."""
    if name in ("aten::copy_", "aten::clone", "aten::cat"):
        return "copy"
    if "layer_norm" in name:
        return "norm"
    if "softmax" in name:
        return "softmax"
    return "elementwise"


def optimizer_rate(path: Path = OPTIMIZER_STEP) -> float:
    """Bytes memsim's AdamW ops move over the measured step times of the three implementations (bytes / s)."""
    document = json.loads(path.read_text())
    moved = seconds = 0.0
    for row in document["rows"]:
        count = row["tensors"]
        params = [MasterParam(f"p{i}", (row["numel"] // count,), row["numel"] // count, "fp32", "fp32")
                  for i in range(count)]
        ops = step_ops("adamw", row["implementation"], params, IdSource(0), {})
        moved += sum(op.bytes_read + op.bytes_written for op in ops)
        seconds += row["min_s"]
    return moved / seconds


def _moved_bytes(name: str, shapes, dtypes) -> int:
    """Bytes a memory-bound aten op moves, as validation.calibration_data.op_rows counts them."""
    sizes = _tensor_bytes(shapes, dtypes)
    if not sizes:
        return 0
    if name in _WRITE_ONLY:
        return sizes[0]
    if name.endswith("_"):
        return sum(sizes) + (sizes[0] if name != "aten::copy_" else 0)
    return sum(sizes) + max(sizes)


def measure(paths=CAPTURES) -> dict[str, float]:
    """The figures over the capture files `paths` (and the AdamW step microbenchmark)."""
    device = get_device("h200-sxm")
    attention_flops = attention_s = gemm_measured = gemm_model = 0.0
    streams: dict[str, list[float]] = {}
    for path in paths:
        document = json.loads(Path(path).read_text())
        for name, shapes, _layouts, dtypes, calls, _median_us, min_us in document["ops"]["rows"]:
            if name in ATTENTION:
                b, h, s, d = shapes[0]
                attention_flops += calls * ATTENTION[name] * 4.0 * b * h * s * s * d / 2
                attention_s += calls * min_us * 1e-6
            elif name in MEMORY_OPS and min_us > 0:
                moved = _moved_bytes(name, shapes, dtypes)
                if moved >= LARGE_BYTES:
                    totals = streams.setdefault(op_class(name), [0.0, 0.0])
                    totals[0] += moved
                    totals[1] += min_us * 1e-6
        rows = op_rows(document, device)
        for i in range(len(rows)):
            if rows.kind[i] == GEMM and rows.m[i] > 0 and rows.flops[i] >= 1e11 \
                    and FLOP_DTYPES[rows.dtype_index[i]] == "bf16":
                m, n, k, batch = (int(v) for v in (rows.m[i], rows.n[i], rows.k[i], rows.batch[i]))
                rate = device.peak_flop_per_s["bf16"] * gemm_efficiency(device, m, n, k, batch, "bf16")
                gemm_measured += float(rows.time_s[i])      # per call, min over the profiled calls
                gemm_model += float(rows.flops[i]) / rate
    figures = {"attention_efficiency": attention_flops / attention_s / device.peak_flop_per_s["bf16"]}
    figures.update({f"streaming_bytes_per_s.{kind}": moved / seconds
                    for kind, (moved, seconds) in sorted(streams.items())})
    figures["streaming_bytes_per_s.optimizer"] = optimizer_rate()
    figures.update({"gemm_model_ratio": gemm_measured / gemm_model, "captures": len(paths)})
    return figures


if __name__ == "__main__":
    for key, value in measure().items():
        print(f"{key} = {value!r}")
