"""Hopper kernel rates memsim's catalog needs and no capture has measured yet: run on an H100 / H200 (about a minute).

    python -m validation.cuda.hopper_kernels OUT.json [--repeats 20]

Measures, with CUDA events after warm-up, per case the median time and the rate:
* bf16 and fp8 (torch._scaled_mm, e4m3 x e4m3 -> bf16, per-tensor scales) GEMMs over training shapes
  (tokens 2048-16384 x hidden 4096-18432 and their MLP widths): `gemm_efficiency.fp8` and the shape model;
* scaled_dot_product_attention forward + backward under each backend torch offers here (flash, cuDNN,
  memory-efficient; causal, bf16, head dim 64 and 128, sequence 2048-8192): `attention_efficiency` per backend;
* memory-bound kernels (copy with and without a dtype cast, add, torch._foreach_add_ over 64 tensors) from 16 MB
  to 4 GB: `hbm_efficiency` by size.
The JSON holds the environment (device, torch, CUDA, driver) and every case; memsim's values stay as they are
until a reviewed change takes them from such a file (docs/validation.md, "Hopper kernels").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

GEMM_SHAPES = [(m, n, k) for m in (2048, 8192, 16384) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336),
                                                                    (12288, 12288), (49152, 12288), (18432, 18432))]
ATTENTION = [(b, h, s, d) for (b, h, s) in ((4, 32, 2048), (1, 32, 8192), (1, 96, 2048)) for d in (64, 128)]
MEMORY_BYTES = [16 << 20, 256 << 20, 1 << 30, 4 << 30]


def _time(torch, fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _gemms(torch, repeats: int) -> list[dict]:
    cases = []
    for m, n, k in GEMM_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        seconds = _time(torch, lambda: a @ b, repeats)
        cases.append({"kind": "gemm", "dtype": "bf16", "m": m, "n": n, "k": k, "s": seconds,
                      "flop_per_s": 2 * m * n * k / seconds})
        if hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn"):
            a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
            one = torch.ones((), device="cuda")
            seconds = _time(torch, lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                            out_dtype=torch.bfloat16), repeats)
            cases.append({"kind": "gemm", "dtype": "fp8", "m": m, "n": n, "k": k, "s": seconds,
                          "flop_per_s": 2 * m * n * k / seconds})
        del a, b
    return cases


def _attention(torch, repeats: int) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cases = []
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": getattr(SDPBackend, "CUDNN_ATTENTION", None),
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for b, h, s, d in ATTENTION:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        flops = 3.5 * 4 * b * h * s * s * d / 2          # causal forward + backward (2.5 x the forward)
        for name, backend in backends.items():
            if backend is None:
                continue

            def step():
                with sdpa_kernel(backend):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
            try:
                seconds = _time(torch, step, repeats)
            except RuntimeError as error:          # the backend does not take this shape here
                cases.append({"kind": "attention", "backend": name, "shape": [b, h, s, d], "error": str(error)[:200]})
                continue
            cases.append({"kind": "attention", "backend": name, "shape": [b, h, s, d], "s": seconds,
                          "flop_per_s": flops / seconds})
    return cases


def _memory(torch, repeats: int) -> list[dict]:
    cases = []
    for size in MEMORY_BYTES:
        x = torch.empty(size // 4, device="cuda", dtype=torch.float32)
        y = torch.empty_like(x)
        half = torch.empty(size // 4, device="cuda", dtype=torch.bfloat16)
        lists = [torch.empty(size // 4 // 64, device="cuda") for _ in range(64)]
        for name, fn, moved in (("copy", lambda: y.copy_(x), 2 * size), ("add", lambda: torch.add(x, y, out=y), 3 * size),
                                ("cast_fp32_to_bf16", lambda: half.copy_(x), size + size // 2),
                                ("cast_bf16_to_fp32", lambda: x.copy_(half), size + size // 2),
                                ("foreach_add_", lambda: torch._foreach_add_(lists, 1.0), 2 * size)):
            seconds = _time(torch, fn, repeats)
            cases.append({"kind": "memory", "op": name, "bytes": moved, "s": seconds, "bytes_per_s": moved / seconds})
        del x, y, half, lists
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        sys.stderr.write("memsim: error: hopper_kernels needs torch with CUDA\n")
        return 2
    if not torch.cuda.is_available():
        sys.stderr.write("memsim: error: hopper_kernels needs a CUDA GPU (none is visible)\n")
        return 2
    environment = {"device_name": torch.cuda.get_device_name(), "torch_version": torch.__version__,
                   "cuda_version": torch.version.cuda,
                   "multiprocessor_count": torch.cuda.get_device_properties(0).multi_processor_count}
    cases = _gemms(torch, args.repeats) + _attention(torch, args.repeats) + _memory(torch, args.repeats)
    args.out.write_text(json.dumps({"format": "memsim-hopper-kernels-1", "environment": environment,
                                    "cases": cases}, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
