"""The GPT-3 175B / 1,024 A100 plan search without its verification, on the CLI's default executor (two local
workers here): the phases' seconds, the CPU of this process and of the workers, and digests of the outcome.

    python3 benchmarks/bench_search_whole.py [--executor local:2]

Runs `search_plans(..., top_k=10, verify=False)` as `memsim plan` calls it and prints the phases (enumerate,
estimate, replay), user CPU of this process and of its workers (getrusage), the workers' largest RSS, the sha256 of
every candidate's settings, verdict, estimate and reason (sorted JSON) and of plan_json (what `memsim plan --json`
prints, less the verification): run it in two checkouts (PYTHONPATH=CHECKOUT) to compare speed and check that the
outputs are the same bytes (docs/explore.md, "End to end on a quiet host").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):          # PYTHONPATH=CHECKOUT measures another checkout's code
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from simulator.explore.executors import open_executor  # noqa: E402
from simulator.explore.plan_report import plan_json  # noqa: E402
import simulator.explore.search as search  # noqa: E402

SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "multi" / "gpt3-175b-1024xa100-tp8-pp16-dp8.toml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executor", default="local:2")
    args = parser.parse_args()
    pool = open_executor(args.executor)
    wall = time.perf_counter()
    try:
        found = search.search_plans(SCENARIO, gpus=1024, topology="dgx-a100", top_k=10, verify=False, executor=pool)
    finally:
        pool.close()
    wall = time.perf_counter() - wall
    me, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    text = json.dumps([[c.settings, c.verdict, c.estimate, c.reason] for c in found.candidates]
                      + [[c.label for c in found.ranked], found.pruned], sort_keys=True)
    phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in found.seconds if name != "verify")
    print(f"{search.__file__}: {len(found.candidates)} candidates, {wall:.1f} s wall ({phases}), user CPU "
          f"{me.ru_utime:.1f} s here, {workers.ru_utime:.1f} s in the workers (largest {workers.ru_maxrss // 1024} MB), "
          f"sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}, plan_json "
          f"{hashlib.sha256(plan_json(found).encode()).hexdigest()[:16]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
