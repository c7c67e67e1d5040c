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

    python benchmarks/hopper_kernel_params.py                      # the catalog's figures from the captures
    python benchmarks/hopper_kernel_params.py --kernels OUT.json      # from validation/cuda/hopper_kernels.py

With --kernels: the same streaming rates by op class from the file's op rows; per attention backend its
efficiency and its speed relative to SDPA's cuDNN kernel on the same case (DeviceSpec.attention_backend_speed),
median over the cases, causal and not apart; per GEMM dtype the measured rate over hardware/cost.py's shape model
(median and range) and the efficiency at the largest shape.
"""

from __future__ import annotations

import json
import statistics
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


def _add_streams(rows, streams: dict[str, list[float]]) -> None:
    """Add the bytes and seconds of the large memory-bound op rows (capture format) to `streams` by op class."""
    for name, shapes, _layouts, dtypes, calls, _median_us, min_us in rows:
        if name in MEMORY_OPS and min_us > 0:
            moved = _moved_bytes(name, shapes, dtypes)
            if moved >= LARGE_BYTES:
                totals = streams.setdefault(op_class(name), [0.0, 0.0])
                totals[0] += moved
                totals[1] += min_us * 1e-6


def measure(paths=CAPTURES) -> dict[str, float]:
    """The figures over the capture files `paths` (and the AdamW step microbenchmark)."""
    device = get_device("h200-sxm")
    attention_flops = attention_s = gemm_measured = gemm_model = 0.0
    streams: dict[str, list[float]] = {}
    for path in paths:
        document = json.loads(Path(path).read_text())
        _add_streams(document["ops"]["rows"], streams)
        for name, shapes, _layouts, dtypes, calls, _median_us, min_us in document["ops"]["rows"]:
            if name in ATTENTION:
                b, h, s, d = shapes[0]
                attention_flops += calls * ATTENTION[name] * 4.0 * b * h * s * s * d / 2
                attention_s += calls * min_us * 1e-6
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


def kernel_figures(path: Path) -> dict[str, object]:
    """The figures of one validation/cuda/hopper_kernels.py file (module docstring)."""
    from validation.calibration_data import catalog_device

    document = json.loads(Path(path).read_text())
    name = document["environment"]["device_name"]
    device = get_device("h200-sxm") if name == "cpu" else catalog_device("cuda", name)
    streams: dict[str, list[float]] = {}
    _add_streams(document["ops"]["rows"], streams)
    figures: dict[str, object] = {"device": device.name}
    figures.update({f"streaming_bytes_per_s.{kind}": moved / seconds
                    for kind, (moved, seconds) in sorted(streams.items())})
    cases = [case for case in document["rows"] if "s" in case]
    peak = device.peak_flop_per_s["bf16"]
    cudnn = {(tuple(c["shape"]), c["causal"]): c["flop_per_s"] for c in cases
             if c["kind"] == "attention" and c["backend"] == "sdpa-cudnn"}
    for backend in sorted({c["backend"] for c in cases if c["kind"] == "attention"}):
        for causal in (True, False):
            mine = [c for c in cases if c["kind"] == "attention" and c["backend"] == backend and c["causal"] == causal]
            if not mine:
                continue
            tag = f"attention.{backend}.{'causal' if causal else 'full'}"
            figures[f"{tag}.efficiency"] = statistics.median(c["flop_per_s"] / peak for c in mine)
            ratios = [c["flop_per_s"] / cudnn[(tuple(c["shape"]), causal)] for c in mine
                      if (tuple(c["shape"]), causal) in cudnn]
            if ratios:
                figures[f"{tag}.speed_vs_cudnn"] = statistics.median(ratios)
    for dtype in ("bf16", "fp8"):
        mine = [c for c in cases if c["kind"] == "gemm" and c["dtype"] == dtype]
        if not mine or dtype not in device.peak_flop_per_s:
            continue
        ratios = [c["flop_per_s"] / (device.peak_flop_per_s[dtype]
                                     * gemm_efficiency(device, c["m"], c["n"], c["k"], 1, dtype)) for c in mine]
        largest = max(mine, key=lambda c: c["m"] * c["n"] * c["k"])
        figures[f"gemm.{dtype}.model_ratio_median"] = statistics.median(ratios)
        figures[f"gemm.{dtype}.model_ratio_range"] = [min(ratios), max(ratios)]
        figures[f"gemm.{dtype}.efficiency_at_largest"] = largest["flop_per_s"] / device.peak_flop_per_s[dtype]
    return figures


if __name__ == "__main__":
    if sys.argv[1:2] == ["--kernels"] and len(sys.argv) == 3:
        results = kernel_figures(Path(sys.argv[2]))
    elif len(sys.argv) == 1:
        results = measure()
    else:
        sys.exit("usage: python benchmarks/hopper_kernel_params.py [--kernels FILE]")
    for key, value in results.items():
        print(f"{key} = {value!r}")
