"""CPU seconds of a multi-rank run's engine, by part: lowering, ranks' set-up, network analysis, memory calls, the rest.

Run from the repository root::

    python3 -m benchmarks.bench_engine_phases FILE [--set KEY=VALUE ...] [--resumes] [--functions]

(`-m` from the root, so that the tree's own `simulator` is imported, not an installed one.)

Lowers FILE's programs (as `memsim run` does), then runs `simulate_programs` once in this process with the memory
calls made here (`memory_workers=0`, no timelines or allocator events, as `memsim run --json`), timing with
`time.process_time` (the steadier figure on a shared host): `RankState` set-up (`init`), the network model's analysis
(`analyze`), `memory_log.apply` (`apply`) and everything else (`engine`). `--resumes` also counts the simpy resumes
of the streams' processes (executor._stream_process steps) and the stretches replayed, under cProfile.
`--functions` also times the set-up's inline planning and the parts of stretch replay (`FUNCTIONS`, CPU seconds
inside each, nested ones included in their callers'). `--no-quiet` turns EngineOptions.quiet_collectives off; the row
gives the network model's operation counters (isolated, quiet, materialized, shadow). `--counts` also counts
`RankState.quiet`'s answers (true, true by passing a pending Send's Free, false, false at a pending Send with a Free
after it), simpy steps (events processed) and stretch replays in the timed run (the wrappers cost a little CPU);
`--no-send-lookahead` turns EngineOptions.send_lookahead off.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
import time

import simulator.api as api
import simulator.engine.executor as executor
from simulator.engine import network_model, rank_state
from simulator.parallel.lower_multi import lower_multi
from simulator.parallel.overlap import resolve_overlap
from simulator.scenario import load_scenario
from simulator.workload.training import build_iteration


def _lower(path: str, overrides: list[str]) -> tuple:
    scenario = load_scenario(path, overrides)
    cluster, topology, plan, recipe, schedule = api._multi_setup(scenario)
    device = api._run_device(scenario, cluster.device)
    shape, profile = api.model_shape(scenario), api.kernel_profile(device)
    workload = build_iteration(shape, recipe, profile) if scenario.parallel.pp == 1 else None
    overlap = resolve_overlap(scenario, nvlink=device.nvlink_bytes_per_s_per_direction > 0, plan=plan)
    programs, _ = lower_multi(shape, recipe, profile, plan, schedule, device, scenario.run.warmup_iterations,
                              scenario.run.iterations, workload, False, overlap)
    return scenario, cluster, topology, plan, programs


def _functions():
    from simulator.engine import stretch_record, stretches
    return [(rank_state.RankState, "_plan_inline"), (stretches, "runs_match"),
            (stretches.Stretches, "_inline_starts"), (stretch_record.StretchRecord, "times"),
            (stretches.Stretches, "_apply"), (stretches.Stretches, "replay")]


def _counting() -> dict:
    """Wrap RankState.quiet, the environment's step and Stretches.replay to count into the dict returned."""
    from simulator.engine import stretches
    from simulator.parallel.program import Free, Send
    counts = {"quiet_true": 0, "quiet_true_past_send": 0, "quiet_false": 0, "quiet_false_at_send_free": 0,
              "simpy_steps": 0, "stretch_replays": 0}
    quiet, replay, step = rank_state.RankState.quiet, stretches.Stretches.replay, executor._Environment.step

    def counted_quiet(self):
        answer = quiet(self)
        if answer:
            counts["quiet_true"] += 1
            counts["quiet_true_past_send"] += self.deferring
        else:
            counts["quiet_false"] += 1
            name, (index, instruction, _) = self._loud or ("", (0, None, None))
            after = self.program.streams[name][index + 1:index + 2] if name else ()
            counts["quiet_false_at_send_free"] += type(instruction) is Send and bool(after) and type(after[0]) is Free
        return answer

    def counted_replay(self, *args):
        done = replay(self, *args)
        counts["stretch_replays"] += done is not None
        return done

    def counted_step(self):
        counts["simpy_steps"] += 1
        return step(self)

    rank_state.RankState.quiet = counted_quiet
    stretches.Stretches.replay = counted_replay
    executor._Environment.step = counted_step
    return counts


def _timed(owner, name: str, spent: dict, key: str) -> None:
    real = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return real(*args, **kwargs)
        finally:
            spent[key] += time.process_time() - start

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--resumes", action="store_true")
    parser.add_argument("--functions", action="store_true")
    parser.add_argument("--no-quiet", action="store_true", help="EngineOptions(quiet_collectives=False)")
    parser.add_argument("--counts", action="store_true")
    parser.add_argument("--no-send-lookahead", action="store_true", help="EngineOptions(send_lookahead=False)")
    args = parser.parse_args()
    gc.disable()                     # as api.simulate_multi
    start = time.process_time()
    scenario, cluster, topology, plan, programs = _lower(args.file, args.overrides)
    lowering = time.process_time() - start
    spent = {"init": 0.0, "analyze": 0.0, "apply": 0.0}
    _timed(rank_state.RankState, "__init__", spent, "init")
    _timed(network_model.NetworkModel, "_analyze", spent, "analyze")
    _timed(executor, "apply", spent, "apply")
    functions: dict[str, float] = {}
    if args.functions:
        for owner, name in _functions():
            functions[name] = 0.0
            _timed(owner, name, functions, name)
    options = executor.EngineOptions(record_timeline=False, memory_workers=0, quiet_collectives=not args.no_quiet,
                                     send_lookahead=not args.no_send_lookahead)
    counts = _counting() if args.counts else {}

    def run():
        allocators = [api._allocator(scenario, cluster, False) for _ in programs]
        return executor.simulate_programs(programs, allocators, [cluster.allocator_capacity_bytes] * len(programs),
                                          options, topology=topology, plan=plan)

    models: list = []
    real_init = network_model.NetworkModel.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        models.append(self)

    network_model.NetworkModel.__init__ = init
    start = time.process_time()
    run()
    total = time.process_time() - start
    row = {"file": args.file, "set": args.overrides, "lowering_s": round(lowering, 2), "simulate_s": round(total, 2),
           **{f"{key}_s": round(value, 2) for key, value in spent.items()},
           "engine_s": round(total - sum(spent.values()), 2), "quiet": not args.no_quiet,
           **{f"{name}_s": round(value, 2) for name, value in functions.items()}}
    row.update(counts)
    if models:
        row.update({name: getattr(models[0], name) for name in ("isolated_operations", "quiet_operations",
                                                               "materialized_operations", "shadow_operations")})
    if args.resumes:
        profiler = cProfile.Profile()
        profiler.runcall(run)
        stats = pstats.Stats(profiler).stats
        row["resumes"] = sum(calls[1] for (path, _, name), calls in stats.items() if name == "_stream_process")
        row["stretch_replays"] = sum(calls[1] for (path, _, name), calls in stats.items()
                                     if name == "_apply" and path.endswith("stretches.py"))
    json.dump(row, sys.stdout)
    print()


if __name__ == "__main__":
    main()
