"""The cost of the LoRA / QLoRA candidates in "what would make it fit", old and new alternated in one process.

Run from the repository root::

    python benchmarks/bench_fit_peft.py [--repeats 2] [--scenario scenarios/seeds/llama7b-adamw-4090.toml]

Each repeat runs `what_would_fit` on the scenario's report twice: with every generator of explore/fit.py, then
without `_peft` (the advice as it was before LoRA was a candidate). It prints the CPU time (process_time: the
steadier figure on a shared machine), the wall time and the fitting labels of each run.
"""

from __future__ import annotations

import argparse
import time

import simulator.explore.fit as fit
from simulator.api import simulate
from simulator.scenario import load_scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scenario", default="scenarios/seeds/llama7b-adamw-4090.toml")
    args = parser.parse_args()
    report = simulate(load_scenario(args.scenario), timelines=False).report
    every = fit.GENERATORS
    without = tuple(g for g in every if g is not fit._peft)
    try:
        for _ in range(args.repeats):
            for label, generators in (("with peft", every), ("without peft", without)):
                fit.GENERATORS = generators
                cpu, wall = time.process_time(), time.perf_counter()
                advice = fit.what_would_fit(args.scenario, [], report)
                print(f"{label:13s} {time.process_time() - cpu:6.1f} s CPU {time.perf_counter() - wall:6.1f} s wall  "
                      f"fits: {[e['label'] for e in advice if e['fits']]}", flush=True)
    finally:
        fit.GENERATORS = every


if __name__ == "__main__":
    main()
