"""Measure this machine's CPU with torch (GEMM rates, memory and cache bandwidth, per-op overhead) for the `cpu` device.

Run from the repository root::

    python benchmarks/cpu_device_params.py [--out validation/data/cpu/device_params.json]

It prints a summary and writes a JSON file (atomically) whose numbers feed the `cpu` entry of
`simulator/hardware/catalog.py`. Every timing is the median of several trials; the spread
(min, max) is recorded next to it, because CPU timings on a shared machine are noisy.
The whole run takes well under a minute on a 2-core machine.
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

DEFAULT_OUT = Path("validation/data/cpu/device_params.json")

# (dtype, m, n, k): the first shape of each dtype is the reference "large GEMM" whose rate becomes
# the device's peak_flop_per_s (the catalog's gemm_reference_mnk). The others check the shape model.
# bf16/fp16 use 512^3: on a CPU without AVX-512 BF16/FP16 those matmuls run at ~1 GFLOP/s, and a
# 2048^3 product would take tens of seconds.
GEMM_SHAPES: tuple[tuple[str, int, int, int], ...] = (
    ("fp32", 2048, 2048, 2048),
    ("fp32", 512, 512, 512),
    ("fp32", 256, 256, 256),
    ("fp32", 4096, 1024, 64),
    ("fp32", 4096, 256, 1024),
    ("bf16", 512, 512, 512),
    ("bf16", 256, 256, 256),
    ("fp16", 512, 512, 512),
)
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _time_call_s(fn, min_total_s: float, trials: int, max_calls: int) -> tuple[float, float, float]:
    """Median, min and max seconds per call of `fn` over `trials` trials after one warm-up call."""
    fn()
    start = time.perf_counter()
    fn()
    one_s = max(time.perf_counter() - start, 1e-9)
    calls = max(1, min(max_calls, int(min_total_s / one_s)))
    per_call_s = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call_s.append((time.perf_counter() - start) / calls)
    return statistics.median(per_call_s), min(per_call_s), max(per_call_s)


def measure_gemms(trials: int) -> list[dict[str, object]]:
    """Time torch.mm at GEMM_SHAPES; returns one record per shape with the achieved FLOP rate."""
    records = []
    generator = torch.Generator().manual_seed(0)
    for dtype, m, n, k in GEMM_SHAPES:
        a = torch.randn(m, k, generator=generator).to(TORCH_DTYPES[dtype])
        b = torch.randn(k, n, generator=generator).to(TORCH_DTYPES[dtype])
        out = torch.empty(m, n, dtype=TORCH_DTYPES[dtype])
        median_s, min_s, max_s = _time_call_s(lambda: torch.mm(a, b, out=out), 0.25, trials, 10_000)
        flops = 2.0 * m * n * k
        records.append({
            "dtype": dtype, "m": m, "n": n, "k": k, "flops": flops,
            "median_s": median_s, "min_s": min_s, "max_s": max_s,
            "flop_per_s": flops / median_s,
        })
    return records


def measure_copy_bytes_per_s(nbytes: int, trials: int) -> dict[str, float]:
    """Bandwidth of dst.copy_(src) on fp32 buffers of `nbytes` each, counting bytes read + written."""
    numel = nbytes // 4
    src = torch.ones(numel, dtype=torch.float32)
    dst = torch.empty(numel, dtype=torch.float32)
    median_s, min_s, max_s = _time_call_s(lambda: dst.copy_(src), 0.3, trials, 100_000)
    moved = 2.0 * numel * 4
    return {"buffer_bytes": numel * 4, "bytes_moved": moved, "median_s": median_s,
            "min_s": min_s, "max_s": max_s, "bytes_per_s": moved / median_s}


def measure_op_overhead_s(trials: int) -> dict[str, float]:
    """Seconds per eager op for tiny ops (x + y on one-element tensors, which allocates its result)."""
    x = torch.ones(1)
    y = torch.ones(1)
    median_s, min_s, max_s = _time_call_s(lambda: torch.add(x, y), 0.2, trials, 200_000)
    return {"median_s": median_s, "min_s": min_s, "max_s": max_s}


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def cache_sizes_bytes() -> dict[str, int]:
    """Sizes of cpu0's caches by level from Linux sysfs ({'L1d': ..., 'L2': ..., 'L3': ...}); empty if unavailable."""
    sizes: dict[str, int] = {}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    if not base.is_dir():
        return sizes
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    for index in sorted(base.glob("index*")):
        level = _read_text(str(index / "level"))
        kind = _read_text(str(index / "type"))
        size = _read_text(str(index / "size"))
        if not level or not size or kind == "Instruction":
            continue
        factor = units.get(size[-1], 1)
        number = int(size[:-1]) if size[-1] in units else int(size)
        name = f"L{level}" + ("d" if kind == "Data" else "")
        sizes[name] = number * factor
    return sizes


def host_memory_bytes() -> int:
    """MemTotal from /proc/meminfo in bytes (0 if unavailable)."""
    for line in _read_text("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or platform.processor()."""
    for line in _read_text("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _load_average() -> list[float]:
    """The 1/5/15-minute load averages (other processes competing for the cores), or [] if unknown."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return []


def run(trials: int) -> dict[str, object]:
    """Run every measurement and return the JSON-ready result."""
    torch.manual_seed(0)
    caches = cache_sizes_bytes()
    llc_bytes = max(caches.values()) if caches else 8 * 2**20
    gemms = measure_gemms(trials)
    dram = measure_copy_bytes_per_s(256 * 2**20, trials)
    # Source and destination together take half the last-level cache, so repeated copies hit it.
    llc = measure_copy_bytes_per_s(llc_bytes // 4, trials)
    overhead = measure_op_overhead_s(trials)
    peak: dict[str, float] = {}
    reference: dict[str, list[int]] = {}
    for record in gemms:
        if record["dtype"] not in peak:
            peak[record["dtype"]] = record["flop_per_s"]
            reference[record["dtype"]] = [record["m"], record["n"], record["k"]]
    return {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python benchmarks/cpu_device_params.py", *sys.argv[1:]]),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cache_bytes": caches,
        "host_memory_bytes": host_memory_bytes(),
        "load_average_before": _load_average(),
        "trials": trials,
        "gemm": gemms,
        "peak_flop_per_s": peak,
        "gemm_reference_mnk": reference,
        "dram_copy": dram,
        "llc_copy": llc,
        "op_overhead": overhead,
    }


def write_json_atomic(path: Path, data: dict[str, object]) -> None:
    """Write `data` as indented JSON to `path` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, measure, print a summary and write the JSON file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    parser.add_argument("--trials", type=int, default=5, help="timed trials per measurement (median is kept)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a shared VM an OpenMP parallel region "
                             "waits for descheduled workers, ~30 ms per op under load; 0 keeps torch's default)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = run(args.trials)
    result["wall_s"] = round(time.perf_counter() - started, 2)
    print(f"{result['cpu_model']}: {result['torch_num_threads']} torch threads, caches {result['cache_bytes']}")
    for record in result["gemm"]:
        spread = (record["max_s"] - record["min_s"]) / record["median_s"]
        print(f"  {record['dtype']:>4} mm {record['m']}x{record['n']}x{record['k']}: "
              f"{record['flop_per_s'] / 1e9:8.1f} GFLOP/s (spread {spread:.0%})")
    print(f"  DRAM copy: {result['dram_copy']['bytes_per_s'] / 1e9:.1f} GB/s, "
          f"LLC copy: {result['llc_copy']['bytes_per_s'] / 1e9:.1f} GB/s, "
          f"tiny op: {result['op_overhead']['median_s'] * 1e6:.2f} us, total {result['wall_s']} s")
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
