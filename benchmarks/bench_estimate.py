"""Fast-estimate throughput: plans per second of estimate_reports on one core (docs/explore.md, "Estimate").

    python3 benchmarks/bench_estimate.py [--plans 300] [--seed 0] [--repeat 3]

Three figures over the same random plans (simulator.testing.multi_gpu_scenarios, as the agreement measurement):
cold (a fresh cache: every profile recorded), warm (the same plans again on the cache a search keeps: checks,
chunk numbers, graph evaluation and allocator replay per plan), and the vectorised graph evaluation alone
(pipeline.evaluate over every plan sharing a structure, stacked). Wall-clock, best of --repeat; on a shared machine,
compare ratios within one run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from simulator.explore.agreement import QUIET, draw_documents  # noqa: E402
from simulator.explore.assemble import Caches, numbers  # noqa: E402
from simulator.explore.estimate import estimate_reports  # noqa: E402
from simulator.explore.pipeline import evaluate  # noqa: E402
from simulator.explore.prepare import prepare  # noqa: E402
from simulator.scenario.loader import scenario_from_dict  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    scenarios = [scenario_from_dict(d, f"<{d['name']}>", QUIET) for d in draw_documents(args.plans, args.seed)]
    caches = Caches()
    start = time.perf_counter()
    estimate_reports(scenarios, errors="return", caches=caches)
    cold = time.perf_counter() - start
    warm = min(_timed(lambda: estimate_reports(scenarios, errors="return", caches=caches))
               for _ in range(args.repeat))
    plans = [numbers(caches, prepare(s)) for s in scenarios]
    groups: dict = {}
    for plan in plans:
        groups.setdefault(plan.structure_key, []).append(plan)
    stacked = [(g[0].structure, np.stack([p.costs for p in g]), np.stack([p.offsets for p in g]))
               for g in groups.values()]
    graph = min(_timed(lambda: [evaluate(s, c, o) for s, c, o in stacked]) for _ in range(args.repeat))
    # One structure with many plans: how the vectorised pass scales when plans share a schedule (a search's case).
    structure, costs, offsets = max(stacked, key=lambda item: item[0].n_nodes)
    many = 10_000
    reps = -(-many // len(costs))
    big_costs, big_offsets = np.tile(costs, (reps, 1))[:many], np.tile(offsets, (reps, 1))[:many]
    one = min(_timed(lambda: evaluate(structure, big_costs, big_offsets)) for _ in range(args.repeat))
    n = len(scenarios)
    print(f"{n} plans, {len(groups)} structures")
    print("| stage | seconds | plans/s |")
    print("|---|---|---|")
    print(f"| cold (profiles recorded) | {cold:.2f} | {n / cold:,.0f} |")
    print(f"| warm (a search's cache) | {warm:.2f} | {n / warm:,.0f} |")
    print(f"| graph evaluation alone, {len(groups)} structures | {graph:.4f} | {n / graph:,.0f} |")
    print(f"| graph evaluation, {many:,} plans on one structure ({structure.n_nodes} nodes) | {one:.4f} | "
          f"{many / one:,.0f} |")
    return 0


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    raise SystemExit(main())
