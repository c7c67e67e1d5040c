"""Issue 19's targets: `python3 -m simulator.cli run FILE --json` wall time and peak RSS per committed scenario.

Run from the repository root::

    python benchmarks/bench_targets.py [--old COMMIT] [--repeats 2] [--only NAME,...] [--timeout-s 600]

Each repeat runs every target with the old code (a detached git worktree of COMMIT, default `main`) and with
this tree, alternately (the order swaps every repeat), each in its own process: wall seconds and the largest
summed resident set of its process tree (memory workers included, sampled every 0.1 s), the load average when
it started (the machine may be shared), and whether both gave the same report bytes. `--old none` times this
tree only. A table goes to stderr, the JSON list to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from cli_timing import compared_trees, run_cli

ROOT = Path(__file__).resolve().parent.parent
MULTI = ROOT / "scenarios" / "multi"
GB = 1e9

# name: (scenario file, target wall s, target peak RSS bytes or None), as issue 19 states them.
TARGETS = {
    "showcase": (ROOT / "scenarios" / "showcase.toml", 1.0, None),
    "llama13b-16xh100": (MULTI / "llama13b-16xh100-tp8-pp2.toml", 5.0, None),
    "gpt3-175b-1024xa100": (MULTI / "gpt3-175b-1024xa100-tp8-pp16-dp8.toml", 10.0, 1 * GB),
    "gpt3-175b-16384xa100": (MULTI / "gpt3-175b-16384xa100-tp8-pp16-dp128.toml", 12.0, None),
    "gpt-530b-2520xa100": (MULTI / "gpt-530b-2520xa100-tp8-pp35-v3.toml", 20.0, None),
    "gpt-1t-3072xa100": (MULTI / "gpt-1t-3072xa100-tp8-pp64-v2.toml", 20.0, 4 * GB),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="main", help="commit to compare with (a git worktree); none: skip")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated target names (default: all)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"--only: unknown target(s) {unknown}; known: {', '.join(TARGETS)}")
    rows = []
    with compared_trees(args.old, ROOT) as trees:
        for repeat in range(args.repeats):
            for name in names:
                scenario, target_s, target_rss = TARGETS[name]
                order = sorted(trees, reverse=repeat % 2 == 0)      # old first on even repeats
                digests = {}
                for which in order:
                    load = os.getloadavg()[0]
                    timed = run_cli(trees[which], scenario, args.timeout_s)
                    if timed.returncode == 0:
                        digests[which] = timed.md5      # a stopped or failed run has no report to compare
                    row = {"target": name, "code": which, "repeat": repeat, "wall_s": round(timed.wall_s, 2),
                           "peak_rss_gb": round(timed.peak_rss_bytes / GB, 3), "returncode": timed.returncode,
                           "load_1min": round(load, 2), "target_s": target_s,
                           "target_rss_gb": target_rss / GB if target_rss else None, "error": timed.error}
                    rows.append(row)
                    status = "timeout" if timed.returncode is None else f"rc {timed.returncode}"
                    print(f"{name:22s} {which:3s} #{repeat} {timed.wall_s:8.2f} s {timed.peak_rss_bytes / GB:6.2f} GB "
                          f"(target {target_s:g} s) load {load:4.1f} {status} {timed.error}", file=sys.stderr,
                          flush=True)
                if len(digests) == 2 and len(trees) == 2:
                    same = digests["old"] == digests["new"]
                    for row in rows[-2:]:
                        row["same_report"] = same
                    print(f"{'':22s} reports {'identical' if same else 'DIFFER'}", file=sys.stderr, flush=True)
    json.dump(rows, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
