"""Time one iteration of GPT-3 175B at cluster scale (issue 3, point 10): 1,024 and 16,384 A100.

Run from the repository root::

    python benchmarks/bench_scale.py [--global-batch 1536] [--dp 8,128] [--timeout-s 600] [--phases]

Each case is dgx-a100 nodes with tp 8, pp 16, the given dp (nodes = dp · 16), 1F1B, micro-batch 1,
bf16-mixed, megatron, full recompute, sequence parallelism, warm-up 0, one iteration, no allocator events: the scenario of
the issue. Every case runs in its own process (`memsim run --json`) so that a case over the time limit
is stopped and reported as such. Wall time per case goes to stderr as a table, the JSON list to stdout.
With --phases each case runs in-process instead (no time limit) and also reports the CPU seconds of each
phase: building the stage workloads and lowering them, the engine's set-up of its ranks, the rest of the
engine, the report, the memory workers' CPU seconds (engine/memory_worker.py) and the wall seconds.
"""

from __future__ import annotations

import argparse
import compileall
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCENARIO = """name = "gpt3-175b-{world}-a100"
[model]
preset = "gpt3-175b"
seq_length = 2048
[training]
micro_batch_size = 1
global_batch_size = {global_batch}
precision = "bf16-mixed"
framework = "megatron"
recompute = "full"
[parallel]
tp = 8
pp = 16
dp = {dp}
sequence_parallel = true
schedule = "1f1b"
[cluster]
topology = "dgx-a100"
nodes = {nodes}
[run]
warmup_iterations = 0
record_events = false
"""


def run_case(dp: int, global_batch: int, timeout_s: float) -> dict:
    """Simulate one case in a subprocess; returns its wall seconds and key results (or the timeout)."""
    world = dp * 128
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scenario.toml"
        path.write_text(SCENARIO.format(world=world, global_batch=global_batch, dp=dp, nodes=world // 8))
        start = time.perf_counter()
        cpu_before = _children_cpu_s()
        try:
            done = subprocess.run([sys.executable, "-m", "simulator.cli", "run", str(path), "--json"],
                                  capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"dp": dp, "gpus": world, "global_batch": global_batch, "wall_s": None, "timed_out": True}
        wall_s = time.perf_counter() - start
    cpu_s = _children_cpu_s() - cpu_before
    row = {"dp": dp, "gpus": world, "global_batch": global_batch, "wall_s": wall_s, "cpu_s": cpu_s,
           "max_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
           "timed_out": False, "returncode": done.returncode}
    if done.returncode == 0:
        report = json.loads(done.stdout)
        row.update(iteration_time_s=report["iteration_time_s"], bubble_fraction=report["bubble_fraction"],
                   fits=report["fits"], mfu=report["mfu"],
                   peak_allocated_bytes=[r["peak_allocated_bytes"] for r in report["ranks"]])
    else:
        row["stderr"] = done.stderr[-2000:]
    return row


def phase_times(path: Path) -> dict:
    """Simulate the scenario at `path` in this process; CPU seconds per phase and in all."""
    import gc

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))    # the repository, installed or not

    import simulator.api as api
    from simulator.engine import rank_state
    from simulator.parallel import lower_multi
    from simulator.report import metrics
    from simulator.scenario import load_scenario

    gc.disable()           # as the command line does (simulator/cli.py)
    spent: dict[str, float] = {}

    def timed(function, phase: str):
        def wrapper(*args, **kwargs):
            start = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent[phase] = spent.get(phase, 0.0) + time.process_time() - start
        return wrapper

    lower_multi.lower_multi = timed(lower_multi.lower_multi, "lowering (with building)")
    api.simulate_programs = timed(api.simulate_programs, "engine (with set-up)")
    rank_state.RankState.__init__ = timed(rank_state.RankState.__init__, "engine set-up")
    metrics.build_multi_report = timed(metrics.build_multi_report, "report")
    start, workers = time.process_time(), _children_cpu_s()
    wall = time.perf_counter()
    api.simulate(load_scenario(path, []), timelines=False, events=False)      # as `memsim run --json` does
    spent["total"] = time.process_time() - start
    # The memory calls are made by forked workers on a machine with two cores or more (engine/memory_worker.py):
    # their CPU time is not this process's.
    spent["memory workers"] = _children_cpu_s() - workers
    spent["wall"] = time.perf_counter() - wall
    return {phase: round(seconds, 2) for phase, seconds in spent.items()}


def _phases_case(dp: int, global_batch: int) -> dict:
    """phase_times of one case, in a child process (a fresh heap per case)."""
    world = dp * 128
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scenario.toml"
        path.write_text(SCENARIO.format(world=world, global_batch=global_batch, dp=dp, nodes=world // 8))
        done = subprocess.run([sys.executable, __file__, "--phases-of", str(path)], capture_output=True, text=True,
                              check=True)
    return {"dp": dp, "gpus": world, "global_batch": global_batch, "phases_cpu_s": json.loads(done.stdout)}


def _children_cpu_s() -> float:
    """CPU seconds (user + system) used so far by finished child processes: wall time on a shared machine
    also counts other processes' load."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    """Parse the options, run every case, print the table (stderr) and the JSON (stdout)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, default=1536)
    parser.add_argument("--dp", default="8,128", help="comma-separated dp sizes (GPUs = dp · 128)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--phases", action="store_true", help="CPU seconds per phase (in-process, no time limit)")
    parser.add_argument("--phases-of", type=Path, help=argparse.SUPPRESS)     # the child process of --phases
    args = parser.parse_args()
    if args.phases_of is not None:
        json.dump(phase_times(args.phases_of), sys.stdout)
        return
    # Compile the package's bytecode first, as an installed package has it: with PYTHONDONTWRITEBYTECODE set
    # (as on the development machine) every run would otherwise compile every module again (~0.3 s).
    compileall.compile_dir(Path(__file__).resolve().parent.parent / "simulator", quiet=1)
    if args.phases:
        for dp in args.dp.split(","):
            row = _phases_case(int(dp), args.global_batch)
            print(f"dp {row['dp']:>4}  {row['gpus']:>6} GPUs  global batch {row['global_batch']:>5}  "
                  + ", ".join(f"{phase} {seconds} s" for phase, seconds in row["phases_cpu_s"].items()),
                  file=sys.stderr)
            json.dump(row, sys.stdout)
            sys.stdout.write("\n")
        return
    rows = [run_case(int(dp), args.global_batch, args.timeout_s) for dp in args.dp.split(",")]
    for row in rows:
        wall = "timeout" if row["timed_out"] else \
            f"{row['wall_s']:.1f} s wall, {row['cpu_s']:.1f} s CPU, largest RSS so far {row['max_rss_mib']:.0f} MiB"
        print(f"dp {row['dp']:>4}  {row['gpus']:>6} GPUs  global batch {row['global_batch']:>5}  {wall}",
              file=sys.stderr)
    json.dump(rows, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
