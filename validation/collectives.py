"""Time torch.distributed collectives (all_reduce, all_gather, reduce_scatter): gloo among local CPU processes,
or NCCL among the GPUs of one machine.

Usage: ``python -m validation.collectives [--backend gloo|nccl] [--topology NAME] [--out FILE]
[--world-sizes 2,4] [--repetitions N]`` (default out: validation/data/cpu/collectives.json for gloo,
validation/data/cuda/collectives.json for nccl).

Protocol: for each world size, torch.multiprocessing spawns that many processes on this machine
(gloo over the loopback interface, or NCCL with one GPU per process; rendezvous through a temporary file:
nothing leaves the host). Each process uses one torch thread. After GROUP_WARMUP small all_reduces
(connection set-up), for every collective and buffer size (fp32; gloo 4 KiB to 16 MiB, NCCL 4 KiB to
1 GiB): ``warmup`` untimed calls, then ``repetitions`` timed calls, each preceded by a barrier (and, with
NCCL, a device synchronization before and after the call); a call's time is the slowest rank's. With
NCCL, ``--topology`` names the memsim topology of the machine (e.g. dgx-h100): validation.compare then
predicts every collective with memsim's network model on that topology.
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
from simulator.network.topology import list_topologies

__all__ = ["BACKENDS", "COLLECTIVES", "DEFAULT_SIZES_BYTES", "NCCL_SIZES_BYTES", "DEFAULT_OUT", "measure_collectives",
           "main"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
BACKENDS = ("gloo", "nccl")
DEFAULT_SIZES_BYTES = tuple(4096 * 4**i for i in range(7))   # 4 KiB ... 16 MiB
NCCL_SIZES_BYTES = tuple(4096 * 4**i for i in range(10))     # 4 KiB ... 1 GiB
DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "cpu" / "collectives.json"
DEFAULT_OUTS = {"gloo": DEFAULT_OUT, "nccl": Path(__file__).resolve().parent / "data" / "cuda" / "collectives.json"}
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
            out_dir: str, backend: str = "gloo") -> None:
    """One rank: join the group, time every (collective, size), write its times to out_dir/rank<r>.json."""
    torch.set_num_threads(1)
    if Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    warnings.filterwarnings("ignore", category=FutureWarning)   # torch 2.13 renames *_tensor collectives
    nccl = backend == "nccl"
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if nccl else (lambda: None)
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        for _ in range(GROUP_WARMUP):            # connection set-up happens on the first calls
            dist.all_reduce(torch.ones(1024, device=device))
        sync()
        times: dict[str, dict[str, list[float]]] = {}
        for name in COLLECTIVES:
            for size in sizes:
                numel = size // 4
                full = torch.ones(numel, dtype=torch.float32, device=device)
                shard = torch.ones(numel // world, dtype=torch.float32, device=device)
                buffers = {"full": full, "shard": shard}
                for _ in range(warmup):
                    _call(name, world, buffers)
                sync()
                samples = []
                for _ in range(repetitions):
                    dist.barrier()
                    sync()
                    start = time.perf_counter()
                    _call(name, world, buffers)
                    sync()
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
                        warmup: int = 2, repetitions: int = 10, backend: str = "gloo",
                        topology: str | None = None) -> dict[str, object]:
    """Spawn each world size's processes, time every collective and size, and return the JSON document.

    Args:
        world_sizes: numbers of processes (each >= 2).
        sizes_bytes: buffer sizes in bytes (multiples of 4 * world size for every world size).
        warmup: untimed calls per (collective, size).
        repetitions: timed calls per (collective, size), 1..MAX_REPETITIONS.
        backend: "gloo" (CPU processes) or "nccl" (one GPU per process).
        topology: with nccl, the memsim topology of this machine (recorded for validation.compare).

    Raises:
        ScenarioError: a bad backend, topology, world size, size or repetition count.
        DataError: NCCL without enough GPUs, or a worker process failed.
    """
    if backend not in BACKENDS:
        raise ScenarioError(f"--backend = {backend!r} must be one of {', '.join(BACKENDS)}")
    if topology is not None:
        if backend != "nccl":
            raise ScenarioError(f"--topology = {topology!r} applies to --backend nccl only")
        if topology not in list_topologies():
            raise ScenarioError(f"--topology = {topology!r} is not a memsim topology; allowed: "
                                f"{', '.join(list_topologies())}")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < max(world_sizes, default=0):
            raise DataError(f"--backend nccl with world sizes {list(world_sizes)} needs {max(world_sizes)} GPUs; "
                            f"torch {torch.__version__} sees {gpus}")
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
                mp.spawn(_worker, args=(world, store, list(sizes_bytes), warmup, repetitions, tmp, backend),
                         nprocs=world, join=True)
            except Exception as error:  # a worker's exception arrives as ProcessRaisedException
                reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
                raise DataError(f"{backend} collectives with {world} processes failed: {reason}") from None
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
            "backend": backend, "logical_cpus": os.cpu_count(), "threads_per_process": 1,
            **({"device_name": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                "nccl_version": ".".join(map(str, torch.cuda.nccl.version()))} if backend == "nccl" else {}),
            **({"topology": topology} if topology else {}),
            "load_average_before": load_before, "load_average_after": _load_average(),
            "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        },
        "protocol": {"world_sizes": list(world_sizes), "sizes_bytes": list(sizes_bytes), "dtype": "fp32",
                     "warmup": warmup, "repetitions": repetitions,
                     "timing": "barrier, then time.perf_counter around one call on every rank (NCCL: device "
                               "synchronized before and after); the slowest rank's time per repetition",
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
    parser.add_argument("--backend", default="gloo", help="gloo (CPU processes) or nccl (one GPU per process)")
    parser.add_argument("--topology", default=None, help="nccl: the memsim topology of this machine (e.g. dgx-h100)")
    parser.add_argument("--out", type=Path, default=None, help="output JSON file")
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated process counts")
    parser.add_argument("--repetitions", type=int, default=10, help="timed calls per collective and size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per collective and size")
    args = parser.parse_args(argv)
    try:
        try:
            worlds = tuple(int(w) for w in args.world_sizes.split(","))
        except ValueError:
            raise ScenarioError(f"--world-sizes = {args.world_sizes!r} must be comma-separated integers") from None
        sizes = NCCL_SIZES_BYTES if args.backend == "nccl" else DEFAULT_SIZES_BYTES
        document = measure_collectives(worlds, sizes, args.warmup, args.repetitions, args.backend, args.topology)
        out = args.out or DEFAULT_OUTS[args.backend]
    except MemsimError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    rows = document["results"]
    atomic_write_text(out, json.dumps(document, indent=1) + "\n")
    for row in rows:
        print(f"{row['collective']:15s} n={row['world_size']} {row['size_bytes']:>9d} B  "
              f"{row['median_s'] * 1e3:9.3f} ms (IQR {row['iqr_over_median']:.0%})", file=sys.stderr)
    print(f"wrote {out} in {document['wall_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
