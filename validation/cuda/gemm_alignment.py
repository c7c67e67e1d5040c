"""Time the three GEMMs of a linear layer whose output width is or is not a multiple of 16 bytes, on one GPU.

Usage: ``python -m validation.cuda.gemm_alignment OUT.json [--device cuda|cpu] [--quick] [--dtypes bf16,fp32]
[--m 2048,8192] [--k 768,...] [--n 50257,50304,...]`` (cuda needs a CUDA build of torch; cpu with --quick only
checks that the script runs; the lists default to the sweep below, "tf32" is fp32 with TF32 matmuls).

For each dtype, token count m, input width k and output width n (by default vocabularies, unpadded and padded
pairs such as 50257 / 50304), with x (m, k), w (n, k) and dy (m, n) as F.linear and its backward use them:
forward x @ w.T, input gradient dy @ w, weight gradient dy.T @ x. Each GEMM is timed with CUDA events
(3 warm-ups, then the minimum and median of 10). memsim's `gemm_unaligned_efficiency` (simulator/hardware/
catalog.py) is read off these files: validation/data/cuda-large/gemm_alignment*.json.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from validation.cuda.microbench import check_device, time_calls, write_rows

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}
# (unpadded, padded) output widths: GPT-2's vocabulary and nanoGPT's padding, BERT's and NVIDIA's padding,
# LLaMA's plus one added token, and a plain width one element off a multiple of 8.
WIDTH_PAIRS = ((50257, 50304), (30522, 30528), (32001, 32000), (4097, 4096))
TOKENS = (2048, 8192)
INPUT_WIDTHS = (768, 2048, 4096, 8192, 12288)
WARMUP, REPETITIONS = 3, 10


def measure(device: str, dtypes: list[str], tokens: list[int] | None, inputs: list[int] | None,
            outputs: list[int] | None) -> list[dict]:
    """One row per (dtype, m, k, n, gemm); None lists take the default sweep."""
    rows = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        torch.backends.cuda.matmul.allow_tf32 = dtype_name == "tf32"   # fp32: torch's default, full fp32
        default_inputs = INPUT_WIDTHS if dtype_name in ("bf16", "fp16") else (768, 4096)
        for m in tokens or TOKENS:
            for k in inputs or default_inputs:
                for n in outputs or [n for pair in WIDTH_PAIRS for n in pair]:
                    x = torch.randn(m, k, device=device, dtype=dtype)
                    w = torch.randn(n, k, device=device, dtype=dtype)
                    dy = torch.randn(m, n, device=device, dtype=dtype)
                    gemms = {"forward": lambda: x @ w.T, "input_grad": lambda: dy @ w,
                             "weight_grad": lambda: dy.T @ x}
                    for gemm, fn in gemms.items():
                        times = time_calls(fn, device, WARMUP, REPETITIONS)
                        rows.append({"dtype": dtype_name, "m": m, "k": k, "n": n, "gemm": gemm,
                                     "min_s": min(times), "median_s": statistics.median(times),
                                     "flops": 2.0 * m * n * k})
                    del x, w, dy
    torch.backends.cuda.matmul.allow_tf32 = False
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, fp32 (a smoke test)")
    parser.add_argument("--dtypes", default="bf16,fp32", help=f"comma-separated, of {', '.join(DTYPES)}")
    for flag, text in (("--m", "token counts"), ("--k", "input widths"), ("--n", "output widths")):
        parser.add_argument(flag, default=None, help=f"comma-separated {text} (default: the sweep)")
    args = parser.parse_args(argv)
    check_device("gemm_alignment", args.device)
    lists = [[int(v) for v in text.split(",")] if text else None for text in (args.m, args.k, args.n)]
    if args.quick:
        lists = [[64], [64], [257, 256]]
    dtypes = ["fp32"] if args.quick else args.dtypes.split(",")
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        raise SystemExit(f"gemm_alignment: --dtypes {','.join(unknown)} unknown (allowed: {', '.join(DTYPES)})")
    rows = measure(args.device, dtypes, *lists)
    write_rows(args.out, args.device, rows, warmup=WARMUP, repetitions=REPETITIONS,
               clock="cuda_event" if args.device == "cuda" else "perf_counter")
    for row in rows:
        print(f"{row['dtype']} m={row['m']} k={row['k']} n={row['n']} {row['gemm']:12s} "
              f"{row['min_s'] * 1e3:9.3f} ms {row['flops'] / row['min_s'] / 1e12:8.1f} TFLOP/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
