"""validation/cuda/hopper_kernels.py (run here on the CPU at toy sizes) and what benchmarks/hopper_kernel_params.py
makes of its output: per-class streaming rates, attention backends against cuDNN, GEMMs against the shape model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from simulator.hardware.catalog import get_device
from simulator.hardware.cost import gemm_efficiency
from validation.cuda import hopper_kernels

ROOT = Path(__file__).resolve().parent.parent


def _params():
    spec = importlib.util.spec_from_file_location("hopper_kernel_params",
                                                  ROOT / "benchmarks" / "hopper_kernel_params.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_runs_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(hopper_kernels, "GEMM_SHAPES", [(64, 64, 64)])
    monkeypatch.setattr(hopper_kernels, "ATTENTION_SHAPES", [(1, 2, 64)])
    monkeypatch.setattr(hopper_kernels, "HEAD_DIMS", (64,))
    monkeypatch.setattr(hopper_kernels, "MEMORY_ELEMENTS", (1 << 18,))
    out = tmp_path / "k.json"
    assert hopper_kernels.main([str(out), "--device", "cpu", "--repeats", "1"]) == 0
    document = json.loads(out.read_text())
    assert document["format"] == "memsim-hopper-kernels-2"
    kinds = {(case["kind"], case.get("backend"), case.get("causal")) for case in document["rows"]}
    assert kinds == {("gemm", None, None), ("attention", "sdpa-math", True), ("attention", "sdpa-math", False)}
    names = {row[0] for row in document["ops"]["rows"]}
    assert {"aten::native_layer_norm", "aten::native_layer_norm_backward", "aten::_softmax", "aten::copy_",
            "aten::gelu_backward"} <= names
    figures = _params().kernel_figures(out)
    assert figures["device"] == "h200-sxm" and "attention.sdpa-math.causal.efficiency" in figures


def test_figures_from_a_gpu_file(tmp_path):
    device = get_device("h100-sxm")
    peak = device.peak_flop_per_s["bf16"]
    model = peak * gemm_efficiency(device, 8192, 8192, 8192, 1, "bf16")
    rows = [{"kind": "gemm", "dtype": "bf16", "m": 8192, "n": 8192, "k": 8192, "s": 1.0, "flop_per_s": 0.9 * model}]
    for backend, rate in (("sdpa-cudnn", 0.5), ("flash_attn-2", 0.3), ("flash_attn-3", 0.55)):
        for causal in (True, False):
            rows.append({"kind": "attention", "backend": backend, "shape": [4, 16, 4096, 128], "causal": causal,
                         "s": 1.0, "flop_per_s": rate * peak * (0.8 if causal else 1.0)})
    rows.append({"kind": "attention", "backend": "sdpa-flash", "shape": [4, 16, 4096, 64], "causal": True,
                 "error": "not supported"})
    elements = 1 << 27                                # 256 MB of fp32 per tensor: above the 100 MB floor
    ops = {"rows": [["aten::copy_", [[elements], [elements], []], "c,c,", ["c10::BFloat16", "float", "Scalar"],
                     1.0, 200.0, 160.0]]}
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"environment": {"device_name": "NVIDIA H100 80GB HBM3"}, "rows": rows, "ops": ops}))
    figures = _params().kernel_figures(path)
    assert figures["device"] == "h100-sxm"
    assert figures["gemm.bf16.model_ratio_median"] == pytest.approx(0.9)
    assert figures["attention.flash_attn-2.full.speed_vs_cudnn"] == pytest.approx(0.6)
    assert figures["attention.flash_attn-3.causal.speed_vs_cudnn"] == pytest.approx(1.1)
    assert figures["attention.sdpa-cudnn.causal.efficiency"] == pytest.approx(0.4)
    assert "attention.sdpa-flash.causal.efficiency" not in figures      # its only case failed
    assert figures["streaming_bytes_per_s.copy"] == pytest.approx((2 + 4) * elements / 160e-6)
