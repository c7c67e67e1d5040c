"""Sweep throughput: points per second of `memsim sweep` per executor and worker count (docs/explore.md).

    python3 benchmarks/bench_sweep.py [--workload tiny|llama7b|llama7b-wide] [--executors local:1,...] [--fast]

Each executor runs the same sweep into a fresh folder; the table says the valid points, the seconds from the
first check to the last point (executor start-up excluded, shown apart) and points per second, and checks that
every executor wrote the same sweep.csv bytes. The check of every point is included (it is part of a sweep). Wall-clock times: on a shared machine, alternate and repeat.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from simulator.explore.executors import open_executor  # noqa: E402
from simulator.explore.sweep import run_sweep, sweep_spec  # noqa: E402

TINY = """\
name = "bench-tiny"
[model]
architecture = "gpt"
num_layers = 2
hidden_size = 64
num_attention_heads = 4
vocab_size = 512
seq_length = 32
dropout = 0.0
[training]
micro_batch_size = 1
global_batch_size = 8
[cluster]
topology = "rtx-4090"
[run]
warmup_iterations = 0
[sweep.grid]
model.num_layers = [2, 3, 4, 5, 6, 7, 8, 9]
training.micro_batch_size = [1, 2, 4, 8]
"""

LLAMA7B = """\
name = "bench-llama7b"
[model]
preset = "llama-7b"
seq_length = 2048
[training]
micro_batch_size = 1
global_batch_size = 16
framework = "megatron"
[cluster]
topology = "pcie-4x4090"
[sweep.grid]
parallel.tp = [1, 2, 4]
parallel.pp = [1, 2, 4]
parallel.dp = [1, 2, 4]
training.recompute = ["full", "selective"]
"""

# for --fast: 4,032 points, those with dp x tp x pp = 8 x nodes valid
LLAMA7B_WIDE = """\
name = "bench-llama7b-wide"
[model]
preset = "llama-7b"
seq_length = 2048
[training]
micro_batch_size = 1
global_batch_size = 512
framework = "megatron"
[cluster]
topology = "dgx-a100"
[sweep.grid]
cluster.nodes = [1, 2, 4, 8]
parallel.tp = [1, 2, 4, 8]
parallel.pp = [1, 2, 4, 8]
parallel.dp = [1, 2, 4, 8, 16, 32, 64]
training.micro_batch_size = [1, 2, 4]
training.recompute = ["none", "selective", "full"]
"""

WORKLOADS = {"tiny": TINY, "llama7b": LLAMA7B, "llama7b-wide": LLAMA7B_WIDE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny")
    parser.add_argument("--executors", default="local:1,local:2,dask-local:1,dask-local:2")
    parser.add_argument("--fast", action="store_true", help="the fast estimate instead of the simulation")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    scenario = folder / f"{args.workload}.toml"
    scenario.write_text(WORKLOADS[args.workload], encoding="utf-8")
    spec = sweep_spec(scenario, fast=args.fast)
    tables: dict[str, bytes] = {}
    print(f"workload {args.workload}, {'--fast' if args.fast else 'full simulation'}")
    print("| executor | start-up (s) | valid points | sweep (s) | points/s |")
    print("|---|---|---|---|---|")
    try:
        for text in args.executors.split(","):
            started = time.perf_counter()
            executor = open_executor(text)
            ready = time.perf_counter()
            try:
                result = run_sweep(spec, folder / text.replace(":", "-"), executor)
            finally:
                executor.close()
            seconds = time.perf_counter() - ready
            valid = sum(check.reason is None for check in result.checks)
            tables[text] = (folder / text.replace(":", "-") / "sweep.csv").read_bytes()
            print(f"| {text} | {ready - started:.2f} | {valid} | {seconds:.2f} | {valid / seconds:.2f} |")
        same = len(set(tables.values())) == 1
        print(f"every executor wrote the same sweep.csv: {same}")
        if not same:
            sys.exit(1)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
