"""Hopper kernel rates memsim's catalog takes from papers or assumes: measure them on an H100 / H200 (a few minutes).

    python -m validation.cuda.hopper_kernels OUT.json [--repeats 20] [--device cuda|cpu] [--scale 1.0]

(`--device cpu --scale 0.01` only checks that the script runs.) Per case, CUDA events after warm-up, the median:
* GEMMs, bf16 and fp8 (torch._scaled_mm, e4m3 x e4m3 -> bf16, per-tensor scales), over training shapes (tokens
  2048-16384 x hidden 4096-18432 and their MLP widths): `gemm_efficiency.bf16` / `.fp8` and the shape model
  (hardware/cost.py), which the catalog's fp8 value takes from one 8192^3 measurement;
* fused attention forward + backward, bf16, causal and not, head dim 64 and 128, sequence 1024-8192, under each
  backend this install has: torch SDPA's cuDNN, flash (FlashAttention-2) and memory-efficient kernels, and the
  flash_attn (FlashAttention-2) and flash_attn_interface (FlashAttention-3) packages if installed:
  `attention_efficiency` and DeviceSpec.attention_backend_speed, which the catalog takes from the FlashAttention-3
  paper's non-causal head-dim-128 figures (hardware/measured.py);
* the memory-bound kernels of a training step by memsim op class (elementwise: add, mul, gelu and their backward;
  norm: layer_norm forward and backward; softmax: softmax and log_softmax, forward and backward; copy: the casts
  of mixed precision), 64 MB to 2 GB per call, profiled with torch.profiler and written
  as the captures' op rows (validation/capture.py summarize_profile) so that the bytes are counted as memsim's
  calibration counts them: `hbm_efficiency_by_class` (the optimizer class: validation/cuda/optimizer_step.py).

`python benchmarks/hopper_kernel_params.py --kernels OUT.json` turns the file into the catalog's figures; memsim's
values stay as they are until a reviewed change takes them from such a file (docs/validation.md, "Hopper kernels").
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from validation.cuda.microbench import check_device, time_calls, write_rows

GEMM_SHAPES = [(m, n, k) for m in (2048, 8192, 16384) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336),
                                                                    (12288, 12288), (49152, 12288), (18432, 18432))]
# (batch, heads, sequence): 16k tokens per call, as the FlashAttention-3 paper sizes its benchmark.
ATTENTION_SHAPES = [(16, 16, 1024), (8, 16, 2048), (4, 16, 4096), (2, 16, 8192)]
HEAD_DIMS = (64, 128)
MEMORY_ELEMENTS = (1 << 25, 1 << 28)       # 64 MB and 512 MB of bf16 per tensor (2 GB of fp32 for casts)
HIDDEN = 4096


def _timer(device: str):
    """A function timing `fn`: the median seconds of `repeats` calls after 3 warm-up calls, on `device`."""
    return lambda fn, repeats: statistics.median(time_calls(fn, device, 3, repeats))


def gemms(device: str, repeats: int, scale: float) -> list[dict]:
    """bf16 (and on CUDA fp8) GEMM rates over GEMM_SHAPES scaled by `scale`."""
    time_of, cases = _timer(device), []
    for shape in GEMM_SHAPES:
        m, n, k = (max(16, int(v * scale) // 16 * 16) for v in shape)
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        seconds = time_of(lambda: a @ b, repeats)
        cases.append({"kind": "gemm", "dtype": "bf16", "m": m, "n": n, "k": k, "s": seconds,
                      "flop_per_s": 2 * m * n * k / seconds})
        if device == "cuda" and hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn"):
            a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
            one = torch.ones((), device=device)
            seconds = time_of(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                              repeats)
            cases.append({"kind": "gemm", "dtype": "fp8", "m": m, "n": n, "k": k, "s": seconds,
                          "flop_per_s": 2 * m * n * k / seconds})
        del a, b
    return cases


def _attention_backends(device: str) -> dict[str, object]:
    """name -> fn(q, k, v, causal) running one forward, for each backend this install has ((b, h, s, d) tensors)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    backends: dict[str, object] = {}
    kinds = {"sdpa-cudnn": getattr(SDPBackend, "CUDNN_ATTENTION", None), "sdpa-flash": SDPBackend.FLASH_ATTENTION,
             "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}
    if device != "cuda":
        kinds = {"sdpa-math": SDPBackend.MATH}
    for name, kind in kinds.items():
        if kind is not None:
            def call(q, k, v, causal, kind=kind):
                with sdpa_kernel(kind):
                    return sdpa(q, k, v, is_causal=causal)
            backends[name] = call
    for name, module in (("flash_attn-2", "flash_attn"), ("flash_attn-3", "flash_attn_interface")):
        try:
            package = __import__(module)
        except ImportError:
            continue
        def call(q, k, v, causal, package=package):      # these take (b, s, h, d)
            out = package.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
        backends[name] = call
    return backends


def attention(device: str, repeats: int, scale: float) -> list[dict]:
    """Forward + backward rates of every backend over ATTENTION_SHAPES x HEAD_DIMS, causal and not."""
    time_of, cases = _timer(device), []
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for name, call in _attention_backends(device).items():
        for b, h, s in ATTENTION_SHAPES:
            s = max(64, int(s * scale) // 64 * 64)
            for d in HEAD_DIMS:
                q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
                grad = torch.randn(b, h, s, d, device=device, dtype=dtype)
                for causal in (True, False):
                    # memsim's count (validation/calibration_data.py): 4 b h s^2 d forward (half with a causal
                    # mask), the backward 2.5 times the forward
                    flops = 3.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                    case = {"kind": "attention", "backend": name, "shape": [b, h, s, d], "causal": causal}
                    try:
                        seconds = time_of(lambda: call(q, k, v, causal).backward(grad), repeats)
                    except (RuntimeError, TypeError) as error:     # the backend does not take this case here
                        cases.append({**case, "error": str(error).splitlines()[0][:200]})
                        continue
                    cases.append({**case, "s": seconds, "flop_per_s": flops / seconds})
                del q, k, v, grad
    return cases


def _memory_ops(device: str, elements: int) -> list[tuple[str, object]]:
    """(op class, fn) for the memory-bound kernels of a training step over tensors of `elements` values."""
    bf16 = dict(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    x, y = torch.randn(elements, **bf16), torch.randn(elements, **bf16)
    rows = torch.randn(elements // HIDDEN, HIDDEN, **bf16, requires_grad=True)
    norm = torch.nn.LayerNorm(HIDDEN, device=device, dtype=bf16["dtype"])
    master = torch.randn(elements, device=device, dtype=torch.float32)
    gelu = torch.nn.functional.gelu
    return [
        ("elementwise", lambda: torch.add(x, y)), ("elementwise", lambda: torch.mul(x, y)),
        ("elementwise", lambda: gelu(rows).backward(rows.detach())),
        ("norm", lambda: norm(rows).backward(rows.detach())),
        ("softmax", lambda: torch.softmax(rows, dim=-1).backward(rows.detach())),
        ("softmax", lambda: torch.log_softmax(rows, dim=-1).backward(rows.detach())),
        ("copy", lambda: x.copy_(master)), ("copy", lambda: master.copy_(x)),
    ]


def memory(device: str, repeats: int, scale: float) -> dict[str, object]:
    """The memory-bound kernels' op rows (validation/capture.py summarize_profile: per aten op and shapes, device
    time per call) over MEMORY_ELEMENTS scaled by `scale`, with the op class each kernel was run for."""
    from torch.profiler import ProfilerActivity, profile

    from validation.capture import kineto_inputs, summarize_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    steps, inputs, classes = [], [], {}
    for elements in MEMORY_ELEMENTS:
        elements = max(HIDDEN * 64, int(elements * scale) // HIDDEN * HIDDEN)
        ops = _memory_ops(device, elements)
        for _, fn in ops:          # warm-up outside the profile
            fn()
        for _ in range(max(1, repeats // 4)):
            with profile(activities=activities, record_shapes=True) as prof:
                for kind, fn in ops:
                    with torch.profiler.record_function(f"memsim.class.{kind}"):
                        fn()
                if device == "cuda":
                    torch.cuda.synchronize()
            steps.append(list(prof.events()))
            inputs.append(kineto_inputs(prof))
        classes.update({kind: True for kind, _ in ops})
        del ops
    summary = summarize_profile(steps, cuda=device == "cuda", step_inputs=inputs)
    summary["classes_run"] = sorted(classes)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink every size (cpu smoke runs)")
    args = parser.parse_args(argv)
    check_device("hopper_kernels", args.device)
    cases = gemms(args.device, args.repeats, args.scale) + attention(args.device, args.repeats, args.scale)
    ops = memory(args.device, args.repeats, args.scale)
    properties = {}
    if args.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        properties = {"multiprocessor_count": p.multi_processor_count, "total_memory": p.total_memory}
    write_rows(args.out, args.device, cases, extra={"format": "memsim-hopper-kernels-2", "ops": ops},
               repeats=args.repeats, scale=args.scale, **properties)
    print(f"wrote {len(cases)} GEMM / attention cases and {len(ops['rows'])} op rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
