"""What the one-GPU microbenchmarks share: the device check, the environment they record and their output file."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from simulator.io import atomic_write_text


def check_device(script: str, device: str) -> None:
    """Exit with one line when a CUDA run is asked for and torch sees no GPU."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{script}: torch sees no CUDA device")


def time_calls(fn, device: str, warmup: int, repetitions: int) -> list[float]:
    """Seconds of each of `repetitions` calls of `fn` after `warmup` (CUDA events on cuda, perf_counter on cpu)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repetitions):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def write_rows(out: Path, device: str, rows: list[dict], extra: dict | None = None, **protocol: object) -> None:
    """Write {"environment": torch, CUDA, device name and `protocol`, "rows": rows, **extra} atomically as JSON."""
    environment = {"torch_version": torch.__version__, "cuda": torch.version.cuda,
                   "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", **protocol}
    document = {"environment": environment, "rows": rows, **(extra or {})}
    atomic_write_text(out, json.dumps(document, indent=1) + "\n")
