"""CPU seconds per plan of the fast estimate on a slice of a plan search's candidates (docs/explore.md, "Sharing
across plans").

    python3 benchmarks/bench_search_estimate.py [--tp 8 --pp 16 --dp 8] [--plans 20] [--seed 0]

Draws --plans random candidates with the given tp, pp and dp from the GPT-3 175B search on 1,024 A100
(scenarios/multi/gpt3-175b-1024xa100-tp8-pp16-dp8.toml, dgx-a100, 128 nodes), estimates them (peak allocated
only, as the search's first pass) in two halves on one cache, and prints each half's CPU seconds
(time.process_time): the first half pays for what the slice shares, the second shows the warm cost per plan.
Run it in two checkouts one after the other to compare code.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from simulator.errors import MemsimError  # noqa: E402
from simulator.explore.assemble import Caches  # noqa: E402
from simulator.explore.candidates import AXES, Context, enumerate_plans, overrides  # noqa: E402
from simulator.explore.estimate import estimate_reports  # noqa: E402
from simulator.scenario.loader import read_scenario_document, scenario_from_dict  # noqa: E402

SOURCE = "scenarios/multi/gpt3-175b-1024xa100-tp8-pp16-dp8.toml"
FIXED = ['cluster.topology="dgx-a100"', "cluster.nodes=128"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for axis, default in (("tp", 8), ("pp", 16), ("dp", 8)):
        parser.add_argument(f"--{axis}", type=int, default=default)
    parser.add_argument("--plans", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    source = str(Path(__file__).resolve().parent.parent / SOURCE)
    document = read_scenario_document(source)
    base = scenario_from_dict(document, source, FIXED)
    model, training = base.model, base.training
    context = Context(1024, 8, model.num_layers, model.num_attention_heads, model.num_kv_heads,
                      training.global_batch_size, training.framework, optimizer=training.optimizer,
                      precision=training.precision)
    wanted = (args.tp, args.pp, args.dp)
    pool = [s for s in enumerate_plans(AXES, context)
            if tuple(dict(s)[f"parallel.{a}"] for a in ("tp", "pp", "dp")) == wanted]
    picked = random.Random(args.seed).sample(pool, min(args.plans, len(pool)))
    scenarios = []
    for settings in picked:
        try:
            scenarios.append(scenario_from_dict(document, source, FIXED + overrides(settings)))
        except MemsimError:
            pass
    caches = Caches()
    half = len(scenarios) // 2
    print(f"{len(scenarios)} candidates with tp {args.tp}, pp {args.pp}, dp {args.dp}")
    for name, part in (("first half", scenarios[:half]), ("second half", scenarios[half:])):
        start = time.process_time()
        estimate_reports(part, errors="return", caches=caches, replay=False)
        seconds = time.process_time() - start
        print(f"{name}: {len(part)} plans, {seconds:.2f} s CPU, {seconds / max(1, len(part)):.3f} s per plan")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
