"""Time memsim's pipeline stages (build, lower, simulate, report) on GPT-3 175B and smaller models.

Run from the repository root::

    python benchmarks/bench_engine.py [--repeats 3] [--models gpt3-175b,gpt3-13b] [--profile]

Each model is simulated as one rank, one micro-batch (micro-batch 1), bf16-mixed, on an
`a100-80gb-sxm`, warmup 0, 1 iteration, at op granularity, `repeats` times; every figure is the
median over the repeats. Each stage is timed in wall time (perf_counter) and CPU time
(process_time): on a shared machine the CPU time is the steadier figure. The table goes to
stderr, the JSON document to stdout. With `--profile` the first model is also run once under
cProfile and the functions with the most own time are printed to stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import json
import os
import platform
import pstats
import resource
import statistics
import sys
import time

from simulator.api import kernel_profile, model_shape, recipe_for, simulate
from simulator.engine.allocator import make_allocator
from simulator.engine.executor import EngineOptions, simulate_programs
from simulator.errors import MemsimError
from simulator.parallel.lower import lower_single_rank
from simulator.parallel.program import Run
from simulator.report.metrics import build_report
from simulator.scenario import scenario_from_dict
from simulator.topology import resolve_cluster
from simulator.workload.training import build_iteration

DEFAULT_MODELS = ("gpt3-175b", "gpt3-13b", "llama-7b", "gpt3-1.3b", "gpt2")
DEVICE = "a100-80gb-sxm"
TARGET_MODEL = "gpt3-175b"      # docs/performance.md: 96 layers, hidden 12288, one micro-batch ...
TARGET_S = 2.0                  # ... simulates in under 2 s
STAGES = ("build_s", "lower_s", "simulate_s", "report_s")
CPU_STAGES = ("build_cpu_s", "lower_cpu_s", "simulate_cpu_s", "report_cpu_s")


def scenario_document(preset: str) -> dict:
    """The benchmark scenario of a preset: one micro-batch of 1, bf16-mixed, warmup 0, 1 iteration."""
    return {
        "name": f"bench-{preset}",
        "model": {"preset": preset},
        "training": {"micro_batch_size": 1, "global_batch_size": 1, "precision": "bf16-mixed"},
        "cluster": {"topology": DEVICE},
        "run": {"warmup_iterations": 0, "iterations": 1},
    }


class _Clock:
    """Wall (perf_counter) and CPU (process_time) time of consecutive stages."""

    def __init__(self):
        self.wall_s = {}
        self.cpu_s = {}
        self._wall = time.perf_counter()
        self._cpu = time.process_time()

    def lap(self, stage: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.wall_s[stage] = wall - self._wall
        self.cpu_s[stage] = cpu - self._cpu
        self._wall, self._cpu = wall, cpu

    def figures(self) -> dict[str, float]:
        out = {f"{stage}_s": value for stage, value in self.wall_s.items()}
        out.update({f"{stage}_cpu_s": value for stage, value in self.cpu_s.items()})
        out["total_s"] = sum(self.wall_s.values())
        out["total_cpu_s"] = sum(self.cpu_s.values())
        return out


def run_once(preset: str) -> dict:
    """Run the pipeline stage by stage (as `simulator.api.simulate` does) and time each stage."""
    scenario = scenario_from_dict(scenario_document(preset), source=f"<bench {preset}>")
    cluster = resolve_cluster(scenario)
    device = cluster.device
    recipe = recipe_for(scenario, device)
    gc.collect()
    clock = _Clock()
    workload = build_iteration(model_shape(scenario), recipe, kernel_profile(device))
    clock.lap("build")
    program = lower_single_rank(workload, device, scenario.run.warmup_iterations, scenario.run.iterations,
                                recipe.accumulation_steps)
    clock.lap("lower")
    allocator = make_allocator(cluster.allocator_kind, cluster.allocator_capacity_bytes,
                               max_split_size_bytes=scenario.allocator.max_split_size,
                               roundup_power2_divisions=scenario.allocator.roundup_power2_divisions,
                               expandable_segments=scenario.allocator.expandable_segments,
                               record_events=scenario.run.record_events)
    trace = simulate_programs([program], [allocator], [cluster.allocator_capacity_bytes], EngineOptions())
    clock.lap("simulate")
    report = build_report(scenario, cluster, workload, recipe, trace)
    clock.lap("report")
    rank = trace.ranks[0]
    instructions = sum(len(stream) for stream in program.streams.values())
    ops = sum(1 for stream in program.streams.values() for ins in stream if type(ins) is Run)
    return {
        **clock.figures(),
        "layers": scenario.model.num_layers, "hidden_size": scenario.model.hidden_size,
        "parameters": report["model"]["parameters"],
        "ops": ops, "instructions": instructions, "tensors": len(workload.tensors),
        "allocator_events": len(rank.allocator_events), "memory_samples": len(rank.memory),
        "spans": len(rank.spans),
        "peak_allocated_bytes": report["ranks"][0]["peak_allocated_bytes"],
        "peak_reserved_bytes": report["ranks"][0]["peak_reserved_bytes"],
        "iteration_time_s": report["iteration_time_s"],
    }


def end_to_end_s(preset: str) -> tuple[float, float]:
    """Wall and CPU time of the public `simulate(scenario)` call, scenario loading included."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    simulate(scenario_from_dict(scenario_document(preset)))
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(preset: str, repeats: int) -> dict:
    """Median stage times over `repeats` runs, with events (instructions + allocator events) per second."""
    runs = [run_once(preset) for _ in range(repeats)]
    result = dict(runs[-1])
    for key in STAGES + ("total_s",) + CPU_STAGES + ("total_cpu_s",):
        values = [r[key] for r in runs]
        result[key] = statistics.median(values)
        result[key[:-2] + "_min_s"] = min(values)
        result[key[:-2] + "_max_s"] = max(values)
    end_to_end = [end_to_end_s(preset) for _ in range(repeats)]
    result["simulate_end_to_end_s"] = statistics.median(wall for wall, _ in end_to_end)
    result["simulate_end_to_end_cpu_s"] = statistics.median(cpu for _, cpu in end_to_end)
    events = result["instructions"] + result["allocator_events"]
    result["events"] = events
    result["events_per_s_simulate"] = events / result["simulate_s"]
    result["events_per_s_total"] = events / result["total_s"]
    return result


def machine() -> dict:
    """Where the figures were measured."""
    return {
        "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "date": datetime.date.today().isoformat(),
    }


def table(results: dict[str, dict]) -> str:
    """A fixed-width text table of the medians."""
    header = (f"{'model':<11} {'layers':>6} {'hidden':>6} {'ops':>6} {'events':>7} {'build s':>8} "
              f"{'lower s':>8} {'sim s':>8} {'report s':>8} {'total s':>8} {'cpu s':>6} {'e2e s':>6} "
              f"{'events/s':>9}")
    lines = [header, "-" * len(header)]
    for name, r in results.items():
        lines.append(f"{name:<11} {r['layers']:>6} {r['hidden_size']:>6} {r['ops']:>6} {r['events']:>7} "
                     f"{r['build_s']:>8.3f} {r['lower_s']:>8.3f} {r['simulate_s']:>8.3f} {r['report_s']:>8.3f} "
                     f"{r['total_s']:>8.3f} {r['total_cpu_s']:>6.3f} {r['simulate_end_to_end_s']:>6.3f} "
                     f"{r['events_per_s_simulate']:>9.0f}")
    return "\n".join(lines)


def profile(preset: str, top: int = 25) -> str:
    """cProfile one run; the functions with the most own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    run_once(preset)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the benchmark, print the table (stderr) and the JSON (stdout)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per model (median reported)")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated preset names")
    parser.add_argument("--profile", action="store_true", help="cProfile the first model once (stderr)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats = {args.repeats}: must be >= 1")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    results = {}
    for preset in models:
        try:
            results[preset] = measure(preset, args.repeats)
        except MemsimError as error:
            print(f"bench_engine: {error}", file=sys.stderr)
            return 2
        print(f"measured {preset}", file=sys.stderr, flush=True)
    print(table(results), file=sys.stderr)
    if args.profile and models:
        print(profile(models[0]), file=sys.stderr)
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    document = {"machine": machine(), "device": DEVICE, "repeats": args.repeats,
                "max_rss_bytes": max_rss, "results": results}
    if TARGET_MODEL in results:
        r = results[TARGET_MODEL]
        document["target"] = {"model": TARGET_MODEL, "limit_s": TARGET_S, "total_s": r["total_s"],
                              "total_cpu_s": r["total_cpu_s"], "met": r["total_s"] < TARGET_S}
        print(f"target: {TARGET_MODEL} in {r['total_s']:.3f} s wall, {r['total_cpu_s']:.3f} s CPU "
              f"(limit {TARGET_S} s): {'met' if r['total_s'] < TARGET_S else 'NOT met'}", file=sys.stderr)
    json.dump(document, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
