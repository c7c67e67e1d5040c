"""CPU seconds, peak RSS and a digest of a plan search (estimate only, no verification) over a slice of its
candidates (docs/explore.md, "Bounded memory and a faster graph").

    python3 benchmarks/bench_search_slice.py SCENARIO --gpus 16 --topology dgx-h100 [--tp 4] [--pp 16] [--max-mb 2]

Runs `search_plans(..., verify=False)` on the candidates with the given tp / pp and micro-batch <= --max-mb (all
of them without filters), and prints the candidates, CPU seconds (time.process_time), wall seconds, the process's
peak RSS, and the sha256 of every candidate's settings, verdict, estimate and reason as sorted JSON: run it in two
checkouts (PYTHONPATH=CHECKOUT) to compare speed and check that the outputs are the same bytes.
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

import simulator.explore.search as search  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--topology", required=True)
    parser.add_argument("--tp", type=int)
    parser.add_argument("--pp", type=int)
    parser.add_argument("--max-mb", type=int)
    args = parser.parse_args()
    every = search.enumerate_plans

    def wanted(settings) -> bool:
        chosen = dict(settings)
        return ((args.tp is None or chosen["parallel.tp"] == args.tp)
                and (args.pp is None or chosen["parallel.pp"] == args.pp)
                and (args.max_mb is None or chosen["training.micro_batch_size"] <= args.max_mb))

    search.enumerate_plans = lambda axes, context: [s for s in every(axes, context) if wanted(s)]
    wall, cpu = time.perf_counter(), time.process_time()
    found = search.search_plans(args.scenario, gpus=args.gpus, topology=args.topology, top_k=3, verify=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    text = json.dumps([[c.settings, c.verdict, c.estimate, c.reason] for c in found.candidates]
                      + [[c.label for c in found.ranked], found.pruned], sort_keys=True)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"{search.__file__}: {len(found.candidates)} candidates, {cpu:.1f} s CPU, {wall:.1f} s wall, "
          f"peak RSS {peak_mb} MB, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
