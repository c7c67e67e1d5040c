"""Time torch.distributed gloo collectives (all_reduce, all_gather, reduce_scatter) among local CPU processes.

Usage: ``python -m validation.collectives [--out validation/data/cpu/collectives.json] [--world-sizes 2,4]
[--repetitions N]``

Protocol: for each world size, torch.multiprocessing spawns that many processes on this machine
(gloo over the loopback interface, rendezvous through a temporary file: nothing leaves the host).
Each process uses one torch thread. After GROUP_WARMUP small all_reduces (connection set-up), for
every collective and buffer size (fp32, 4 KiB to 16 MiB): ``warmup`` untimed calls, then
``repetitions`` timed calls, each preceded by a barrier; a call's time is the slowest rank's.
Size = the full buffer in bytes, as nccl-tests counts it: the tensor all_reduce reduces,
all_gather's output, reduce_scatter's input. The file keeps every repetition (times of the slowest
rank), their median and spread.
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
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from simulator.errors import DataError, MemsimError, ScenarioError
from simulator.io import atomic_write_text

__all__ = ["COLLECTIVES", "DEFAULT_SIZES_BYTES", "DEFAULT_OUT", "measure_collectives", "main"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
DEFAULT_SIZES_BYTES = tuple(4096 * 4**i for i in range(7))   # 4 KiB ... 16 MiB
DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "cpu" / "collectives.json"
FORMAT = "memsim-collectives-1"
MAX_REPETITIONS = 50
GROUP_WARMUP = 5


def _call(name: str, world: int, buffers: dict[str, torch.Tensor]) -> None:
    if name == "all_reduce":
        dist.all_reduce(buffers["full"])
    elif name == "all_gather":
        dist.all_gather_into_tensor(buffers["full"], buffers["shard"])
    else:
        dist.reduce_scatter_tensor(buffers["shard"], buffers["full"])


def _worker(rank: int, world: int, store_path: str, sizes: Sequence[int], warmup: int, repetitions: int,
            out_dir: str) -> None:
    """One rank: join the group, time every (collective, size), write its times to out_dir/rank<r>.json."""
    torch.set_num_threads(1)
    if Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    warnings.filterwarnings("ignore", category=FutureWarning)   # torch 2.13 renames *_tensor collectives
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        for _ in range(GROUP_WARMUP):            # connection set-up happens on the first calls
            dist.all_reduce(torch.ones(1024))
        times: dict[str, dict[str, list[float]]] = {}
        for name in COLLECTIVES:
            for size in sizes:
                numel = size // 4
                full = torch.ones(numel, dtype=torch.float32)
                shard = torch.ones(numel // world, dtype=torch.float32)
                buffers = {"full": full, "shard": shard}
                for _ in range(warmup):
                    _call(name, world, buffers)
                samples = []
                for _ in range(repetitions):
                    dist.barrier()
                    start = time.perf_counter()
                    _call(name, world, buffers)
                    samples.append(time.perf_counter() - start)
                times.setdefault(name, {})[str(size)] = samples
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(times))


def _spread(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    quartiles = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 3
    median = statistics.median(ordered)
    return {"median_s": median, "min_s": ordered[0], "max_s": ordered[-1], "q1_s": quartiles[0], "q3_s": quartiles[2],
            "iqr_over_median": (quartiles[2] - quartiles[0]) / median if median > 0 else 0.0}


def measure_collectives(world_sizes: Sequence[int] = (2, 4), sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
                        warmup: int = 2, repetitions: int = 10) -> dict[str, object]:
    """Spawn each world size's processes, time every collective and size, and return the JSON document.

    Args:
        world_sizes: numbers of processes (each >= 2).
        sizes_bytes: buffer sizes in bytes (multiples of 4 * world size for every world size).
        warmup: untimed calls per (collective, size).
        repetitions: timed calls per (collective, size), 1..MAX_REPETITIONS.

    Raises:
        ScenarioError: a world size, size or repetition count out of range.
        DataError: a worker process failed.
    """
    for world in world_sizes:
        if isinstance(world, bool) or not isinstance(world, int) or world < 2:
            raise ScenarioError(f"world size = {world!r} must be an integer >= 2")
        for size in sizes_bytes:
            if size <= 0 or size % (4 * world):
                raise ScenarioError(f"size = {size!r} bytes must be a positive multiple of 4 x world size {world}")
    if not 1 <= repetitions <= MAX_REPETITIONS:
        raise ScenarioError(f"repetitions = {repetitions!r} must be in 1..{MAX_REPETITIONS}")
    if warmup < 0:
        raise ScenarioError(f"warmup = {warmup!r} must be >= 0")
    results = []
    started = time.perf_counter()
    load_before = _load_average()
    for world in world_sizes:
        with tempfile.TemporaryDirectory(prefix="memsim-gloo-") as tmp:
            store = str(Path(tmp, "store"))
            try:
                mp.spawn(_worker, args=(world, store, list(sizes_bytes), warmup, repetitions, tmp),
                         nprocs=world, join=True)
            except Exception as error:  # a worker's exception arrives as ProcessRaisedException
                reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
                raise DataError(f"gloo collectives with {world} processes failed: {reason}") from None
            per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
        for name in COLLECTIVES:
            for size in sizes_bytes:
                ranks = [rank_times[name][str(size)] for rank_times in per_rank]
                slowest = [max(values) for values in zip(*ranks)]
                results.append({"collective": name, "world_size": world, "size_bytes": size,
                                **_spread(slowest), "times_s": slowest})
    return {
        "format": FORMAT,
        "environment": {
            "torch_version": torch.__version__, "python_version": platform.python_version(),
            "backend": "gloo", "logical_cpus": os.cpu_count(), "threads_per_process": 1,
            "load_average_before": load_before, "load_average_after": _load_average(),
            "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        },
        "protocol": {"world_sizes": list(world_sizes), "sizes_bytes": list(sizes_bytes), "dtype": "fp32",
                     "warmup": warmup, "repetitions": repetitions,
                     "timing": "barrier, then time.perf_counter around one call on every rank; the slowest rank's "
                               "time per repetition",
                     "size": "full buffer bytes: all_reduce tensor, all_gather output, reduce_scatter input"},
        "wall_s": round(time.perf_counter() - started, 2),
        "results": results,
    }


def _load_average() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 on bad input)."""
    parser = argparse.ArgumentParser(prog="python -m validation.collectives", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output JSON file")
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated process counts")
    parser.add_argument("--repetitions", type=int, default=10, help="timed calls per collective and size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per collective and size")
    args = parser.parse_args(argv)
    try:
        try:
            worlds = tuple(int(w) for w in args.world_sizes.split(","))
        except ValueError:
            raise ScenarioError(f"--world-sizes = {args.world_sizes!r} must be comma-separated integers") from None
        document = measure_collectives(worlds, DEFAULT_SIZES_BYTES, args.warmup, args.repetitions)
    except MemsimError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    rows = document["results"]
    atomic_write_text(args.out, json.dumps(document, indent=1) + "\n")
    for row in rows:
        print(f"{row['collective']:15s} n={row['world_size']} {row['size_bytes']:>9d} B  "
              f"{row['median_s'] * 1e3:9.3f} ms (IQR {row['iqr_over_median']:.0%})", file=sys.stderr)
    print(f"wrote {args.out} in {document['wall_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
