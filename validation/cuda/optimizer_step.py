"""Time one AdamW step and measure its temporaries, per torch implementation, on one GPU.

Usage: ``python -m validation.cuda.optimizer_step OUT.json [--device cuda|cpu] [--numel N] [--tensors K]``
(cuda needs a CUDA build of torch; cpu with a small --numel only checks that the script runs).

K fp32 parameters of N elements in all (default 2**30 in 64 tensors) with fp32 gradients; for each of
torch.optim.AdamW's single-tensor, foreach and fused implementations (default hyper-parameters, so weight
decay 0.01): two warm-up steps (the first creates the states), then five timed steps (CUDA events) and
the step's temporaries: `max_memory_allocated` during a step minus the memory allocated before it.
memsim's optimizer model (simulator/workload/optimizers.py) is compared with this file in
tests/test_cuda_large.py: validation/data/cuda-large/optimizer_step.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from validation.cuda.microbench import check_device, write_rows

IMPLEMENTATIONS = {"single-tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
WARMUP, REPETITIONS = 2, 5


def measure(device: str, numel: int, tensors: int) -> list[dict]:
    """One row per implementation: step times and the step's temporary bytes (cuda)."""
    rows = []
    sizes = [numel // tensors] * tensors
    for name, flags in IMPLEMENTATIONS.items():
        params = [torch.nn.Parameter(torch.randn(size, device=device)) for size in sizes]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.AdamW(params, **flags)
        for _ in range(WARMUP):
            optimizer.step()
        times, temporaries = [], []
        for _ in range(REPETITIONS):
            if device == "cuda":
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                optimizer.step()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
                temporaries.append(torch.cuda.max_memory_allocated() - before)
            else:
                t0 = time.perf_counter()
                optimizer.step()
                times.append(time.perf_counter() - t0)
        rows.append({"implementation": name, "numel": sum(sizes), "tensors": tensors, "min_s": min(times),
                     "median_s": statistics.median(times), "temporary_bytes": max(temporaries, default=None)})
        del optimizer, params
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--numel", type=int, default=2**30)
    parser.add_argument("--tensors", type=int, default=64)
    args = parser.parse_args(argv)
    check_device("optimizer_step", args.device)
    rows = measure(args.device, args.numel, args.tensors)
    write_rows(args.out, args.device, rows, warmup=WARMUP, repetitions=REPETITIONS)
    for row in rows:
        print(f"{row['implementation']:13s} {row['numel']:,d} elements: {row['min_s'] * 1e3:9.3f} ms, "
              f"temporaries {row['temporary_bytes']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
