"""Plans per second of the columnar estimate (explore/columnar) on a plan search's candidates, one core, CPU
seconds (time.process_time), against the per-plan estimate_reports on a sample (docs/explore.md, "Speed").

    python3 benchmarks/bench_columnar.py --set gpt3 [--plans 600] [--old 100] [--seed 0] [--memory-first]
    python3 benchmarks/bench_columnar.py --set llama13b [--plans 0]          # 0: every candidate

Sets: gpt3 = scenarios/multi/gpt3-175b-1024xa100-tp8-pp16-dp8.toml on 1,024 GPUs of dgx-a100 (14,760
candidates), llama13b = scenarios/multi/llama13b-16xh100-tp8-pp2.toml on 16 GPUs of dgx-h100 (4,263). --plans
random candidates (in enumeration order) are estimated cold (fresh caches) and warm (the same caches again), with
the phases' CPU seconds; --old of them (drawn at random) by estimate_reports(replay=False), cold and warm, on their own
caches, and the two compared field by field (==).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from simulator.errors import MemsimError  # noqa: E402
from simulator.explore import assemble  # noqa: E402
from simulator.explore.assemble import Caches  # noqa: E402
from simulator.explore.candidates import AXES, Context, enumerate_plans, overrides  # noqa: E402
from simulator.explore.columnar import estimate_table, report_fields  # noqa: E402
from simulator.explore.columnar.table import INVALID, MEMORY_ONLY  # noqa: E402
from simulator.explore.estimate import estimate_reports  # noqa: E402
from simulator.scenario.loader import read_scenario_document, scenario_from_dict  # noqa: E402

SETS = {"gpt3": ("scenarios/multi/gpt3-175b-1024xa100-tp8-pp16-dp8.toml", 1024, "dgx-a100"),
        "llama13b": ("scenarios/multi/llama13b-16xh100-tp8-pp2.toml", 16, "dgx-h100")}

BUILT = [0, 0.0]          # graphs built, their CPU seconds


def _counting(build):
    def counted(*args, **kwargs):
        start = time.process_time()
        BUILT[0] += 1
        try:
            return build(*args, **kwargs)
        finally:
            BUILT[1] += time.process_time() - start
    return counted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=sorted(SETS), default="gpt3")
    parser.add_argument("--plans", type=int, default=600, help="random candidates (0: all)")
    parser.add_argument("--old", type=int, default=100, help="of them, drawn at random, estimated per plan too")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-first", action="store_true")
    parser.add_argument("--no-warm", action="store_true")
    parser.add_argument("--unbounded", action="store_true",
                        help="caches that keep everything (profiles, chunk models, graphs; the default bounds drop "
                             "them on a large set, so the warm run recomputes what was dropped)")
    args = parser.parse_args()
    path, gpus, topology = SETS[args.set]
    source = str(Path(__file__).resolve().parent.parent / path)
    document = read_scenario_document(source)
    fixed = [f'cluster.topology="{topology}"', f"cluster.nodes={gpus // 8}"]
    base = scenario_from_dict(document, source, fixed)
    model, training = base.model, base.training
    context = Context(gpus, 8, model.num_layers, model.num_attention_heads, model.num_kv_heads,
                      training.global_batch_size, training.framework, optimizer=training.optimizer,
                      precision=training.precision)
    every = list(enumerate_plans(AXES, context))
    picked = sorted(random.Random(args.seed).sample(range(len(every)), args.plans)) if 0 < args.plans < len(every) \
        else range(len(every))
    rows = [every[k] for k in picked]
    assemble.build_structure = _counting(assemble.build_structure)
    print(f"{args.set}: {len(rows)} of {len(every)} candidates, memory_first={args.memory_first}")
    caches = Caches()
    if args.unbounded:
        for name in ("profiles", "chunks", "structures", "schedules", "outputs", "layouts", "memory_rows", "clusters"):
            getattr(caches, name).max_weight = float("inf")
    runs = [("cold", caches)] + ([] if args.no_warm else [("warm", caches)])
    table = None
    for name, cache in runs:
        BUILT[0], BUILT[1] = 0, 0.0
        start = time.process_time()
        table = estimate_table(rows, document=document, source=source, fixed=fixed, caches=cache,
                               memory_first=args.memory_first)
        seconds = time.process_time() - start
        counts = {s: table.status.count(s) for s in sorted(set(table.status))}
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in table.seconds.items())
        print(f"columnar {name}: {seconds:.2f} s CPU, {len(rows) / seconds:,.1f} plans/s ({phases}; "
              f"{table.structures} group evaluations, {BUILT[0]} graphs built in {BUILT[1]:.2f} s; {counts}; "
              f"{table.fallbacks} fallbacks)")
    if args.old:
        sample = [rows[k] for k in sorted(random.Random(args.seed + 1).sample(range(len(rows)), min(args.old, len(rows))))]
        scenarios = []
        for settings in sample:
            try:
                scenarios.append(scenario_from_dict(document, source, fixed + overrides(settings)))
            except MemsimError as error:
                scenarios.append(error)
        valid = [s for s in scenarios if not isinstance(s, MemsimError)]
        old_caches = Caches()
        for name in ("cold", "warm"):
            BUILT[0], BUILT[1] = 0, 0.0
            start = time.process_time()
            reports = estimate_reports(valid, errors="return", caches=old_caches, replay=False,
                                       memory_first=args.memory_first)
            seconds = time.process_time() - start
            print(f"per plan {name}: {len(sample)} plans, {seconds:.2f} s CPU, {len(sample) / seconds:,.1f} plans/s "
                  f"({BUILT[0]} graphs built in {BUILT[1]:.2f} s)")
        small = estimate_table(sample, document=document, source=source, fixed=fixed, caches=old_caches,
                               memory_first=args.memory_first)
        got = iter(reports)
        same = 0
        for k, scenario in enumerate(scenarios):
            report = scenario if isinstance(scenario, MemsimError) else next(got)
            if isinstance(report, MemsimError):
                same += small.status[k] == INVALID and str(small.errors[k]) == str(report)
            elif report.get("memory_only"):
                same += small.status[k] == MEMORY_ONLY and small.peak_allocated[k] == tuple(
                    r["peak_allocated_bytes"] for r in report["ranks"])
            else:
                same += small.fields(k) == report_fields(report)
        print(f"equal fields: {same} of {len(sample)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
