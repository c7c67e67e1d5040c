"""Measure this machine's CPU on the work CPU offload gives it: an Adam step over fp32 states, and streaming kernels.

Run from the repository root::

    python validation/measure_cpu_adam.py [--out validation/data/cpu/cpu_adam.json] [--trials 7]

DeepSpeed's ZeRO-Offload runs DeepSpeedCPUAdam (csrc/adam/cpu_adam_impl.cpp) over the fp32 master partition on
the host: per element it reads the parameter, the gradient and both moments (16 bytes) and writes the parameter and
both moments (12 bytes). torch's fused CPU AdamW (`torch.optim.AdamW(fused=True)` on CPU tensors, a vectorised
kernel over the same four fp32 tensors) does the same reads and writes, so it stands in for CPU-Adam here; its
rate in elements per second is what memsim's topology parameter `host.cpu_adam_elements_per_s` means. The
streaming kernels are the host work around the step (DeepSpeed unscales the fp32 gradient partition in place and
converts the updated fp32 partition into a 16-bit buffer): their bytes read plus written per second are
`host.cpu_stream_bytes_per_s`. A server CPU with many more cores and memory channels differs: the topologies
derive their values from their DRAM bandwidth (docs/validation.md says how, and compares with this machine).

Every timing is the median of `--trials` trials after a warm-up; min and max are recorded beside it (the machine
is shared, so timings are noisy). The run takes under a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path("validation/data/cpu/cpu_adam.json")
ADAM_BYTES_PER_ELEMENT = 28        # reads p, g, m, v (4 x 4 B), writes p, m, v (3 x 4 B)
SIZES = (1 << 22, 1 << 24, 1 << 26)


def _median_s(fn, trials: int) -> tuple[float, float, float]:
    """Median, min and max seconds of one call of `fn` over `trials` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def _record(name: str, elements: int, bytes_moved: int, timing: tuple[float, float, float]) -> dict:
    median_s, min_s, max_s = timing
    return {"kernel": name, "elements": elements, "bytes_read_written": bytes_moved, "median_s": median_s,
            "min_s": min_s, "max_s": max_s, "elements_per_s": elements / median_s,
            "bytes_per_s": bytes_moved / median_s}


def measure(trials: int) -> list[dict]:
    """Time the Adam step and the streaming kernels at every size of SIZES."""
    generator = torch.Generator().manual_seed(0)
    records = []
    for n in SIZES:
        parameter = torch.nn.Parameter(torch.randn(n, generator=generator))
        parameter.grad = torch.randn(n, generator=generator)
        optimizer = torch.optim.AdamW([parameter], lr=1e-3, fused=True)
        optimizer.step()                      # creates the moments (as the first step of training does)
        records.append(_record("adamw_fused_fp32", n, ADAM_BYTES_PER_ELEMENT * n,
                               _median_s(optimizer.step, trials)))
        grad = parameter.grad
        records.append(_record("mul_fp32_inplace", n, 8 * n, _median_s(lambda: grad.mul_(1.0), trials)))
        half = torch.empty(n, dtype=torch.bfloat16)
        records.append(_record("copy_fp32_to_bf16", n, 6 * n,
                               _median_s(lambda: half.copy_(parameter.detach()), trials)))
        target = torch.empty(n)
        records.append(_record("copy_fp32", n, 8 * n, _median_s(lambda: target.copy_(grad), trials)))
        del parameter, optimizer, half, target, grad
    return records


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--trials", type=int, default=7)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    records = measure(args.trials)
    largest = {r["kernel"]: r for r in records if r["elements"] == SIZES[-1]}
    summary = {
        "cpu_adam_elements_per_s": largest["adamw_fused_fp32"]["elements_per_s"],
        "cpu_stream_bytes_per_s": statistics.median(
            [largest["mul_fp32_inplace"]["bytes_per_s"], largest["copy_fp32_to_bf16"]["bytes_per_s"]]),
        "copy_bytes_per_s": largest["copy_fp32"]["bytes_per_s"],
    }
    summary["adam_traffic_over_copy_bandwidth"] = (summary["cpu_adam_elements_per_s"] * ADAM_BYTES_PER_ELEMENT
                                                   / summary["copy_bytes_per_s"])
    data = {
        "command": "python validation/measure_cpu_adam.py", "date": datetime.date.today().isoformat(),
        "cpu_model": _cpu_model(), "logical_cpus": os.cpu_count(), "torch_num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__, "python_version": platform.python_version(),
        "load_average_before": load, "trials": args.trials, "adam_bytes_per_element": ADAM_BYTES_PER_ELEMENT,
        "summary": summary, "records": records, "wall_s": time.perf_counter() - start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=args.out.parent, delete=False, suffix=".tmp") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
        handle.write("\n")
    os.replace(handle.name, args.out)
    for key, value in summary.items():
        print(f"{key}: {value:.4g}")
    print(f"wrote {args.out} ({data['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
