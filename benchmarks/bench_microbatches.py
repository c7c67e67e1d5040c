"""Wall time against micro-batches per pipeline (issue 19, point 1): GPT-3 175B on 1,024 A100, 1F1B and interleaved.

Run from the repository root::

    python benchmarks/bench_microbatches.py [--m 32,64,128,256,512,1024] [--schedules 1f1b,interleaved]
                                            [--old COMMIT] [--timeout-s 600]

Each point is `python3 -m simulator.cli run scenarios/multi/gpt3-175b-1024xa100-tp8-pp16-dp8.toml --json` with
`--set training.global_batch_size=8m` (dp 8, micro-batch 1: m micro-batches per pipeline), and for the interleaved
schedule `parallel.schedule=interleaved-1f1b`, `parallel.virtual_stages=2`. With `--old` every point also runs with
that commit (a git worktree), alternately. The issue's criterion: from m = 64 to m = 1,024 the time at most doubles.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from cli_timing import compared_trees, run_cli

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "multi" / "gpt3-175b-1024xa100-tp8-pp16-dp8.toml"
DP = 8
SCHEDULES = {"1f1b": (), "interleaved": ("parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="32,64,128,256,512,1024")
    parser.add_argument("--schedules", default="1f1b,interleaved")
    parser.add_argument("--old", default="none", help="commit to alternate with (a git worktree); none: skip")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args()
    counts = [int(v) for v in args.m.split(",")]
    schedules = args.schedules.split(",")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        parser.error(f"--schedules: unknown {unknown}; known: {', '.join(SCHEDULES)}")
    rows = []
    with compared_trees(args.old, ROOT) as trees:
        for schedule in schedules:
            for index, m in enumerate(counts):
                sets = (f"training.global_batch_size={DP * m}",) + SCHEDULES[schedule]
                extra = tuple(word for item in sets for word in ("--set", item))
                for which in sorted(trees, reverse=index % 2 == 0):
                    load = os.getloadavg()[0]
                    timed = run_cli(trees[which], SCENARIO, args.timeout_s, extra)
                    rows.append({"schedule": schedule, "m": m, "code": which, "wall_s": round(timed.wall_s, 2),
                                 "peak_rss_gb": round(timed.peak_rss_bytes / 1e9, 3), "load_1min": round(load, 2),
                                 "returncode": timed.returncode, "md5": timed.md5, "error": timed.error})
                    print(f"{schedule:12s} m {m:5d} {which:3s} {timed.wall_s:8.2f} s {timed.peak_rss_bytes / 1e9:6.2f} GB "
                          f"load {load:4.1f} rc {timed.returncode} {timed.error}", file=sys.stderr, flush=True)
    json.dump(rows, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
