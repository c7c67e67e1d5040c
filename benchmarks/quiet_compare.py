"""A run's report with quiet collectives off and on (EngineOptions.quiet_collectives), alternated: CPU, differences.

Run from the repository root::

    python3 -m benchmarks.quiet_compare FILE [--set KEY=VALUE ...] [--repeats N]

Prints one JSON line per run (CPU seconds of `api.simulate`, by `time.process_time`) and a summary: whether the
report JSON is byte-identical, else the largest relative difference of its floats and any other difference (there
should be none: quiet collectives are exact to rounding, docs/engine.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import simulator.api as api
from simulator.scenario import load_scenario


def _run(path: str, overrides: list[str], quiet: bool) -> tuple[dict, float]:
    real = api._engine_options

    def options(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), quiet_collectives=quiet)

    api._engine_options = options
    try:
        start = time.process_time()
        report = api.simulate(load_scenario(path, overrides), timelines=False).report
        return report, time.process_time() - start
    finally:
        api._engine_options = real


def differences(a, b, path: str = "") -> tuple[float, list[str]]:
    """(largest relative difference of floats, other differences) between two JSON-like values."""
    if isinstance(a, float) and isinstance(b, float):
        return (abs(a - b) / max(abs(a), abs(b)) if a != b else 0.0), []
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return 0.0, [f"{path}: keys"]
        found = [differences(a[k], b[k], f"{path}/{k}") for k in a]
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return 0.0, [f"{path}: lengths {len(a)} != {len(b)}"]
        found = [differences(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b))]
    else:
        return 0.0, ([] if a == b else [f"{path}: {a!r} != {b!r}"])
    return max([f[0] for f in found], default=0.0), [line for f in found for line in f[1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    reports = {}
    for _ in range(args.repeats):
        for quiet in (False, True):
            report, cpu = _run(args.file, args.overrides, quiet)
            reports[quiet] = report
            print(json.dumps({"file": args.file, "set": args.overrides, "quiet": quiet, "cpu_s": round(cpu, 2),
                              "iteration_time_s": report.get("iteration_time_s")}), flush=True)
    same = json.dumps(reports[False], sort_keys=True) == json.dumps(reports[True], sort_keys=True)
    worst, other = differences(reports[False], reports[True])
    json.dump({"identical": same, "max_rel_float_diff": worst, "other_differences": other[:10]}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
