"""`memsim run scenarios/showcase.toml --json` on two trees alternated, with and without the what-would-fit helper
forced on, each report compared with the first tree's.

Run from the repository root::

    python benchmarks/showcase_ab.py OLD_TREE NEW_TREE [--rounds 10] [--bytecode PREFIX]

OLD_TREE, NEW_TREE: repository checkouts (say /work/main and this one); each run imports the tree's own
`simulator` (PYTHONPATH). "forced": `simulator.forked.spare_core` patched to `fork_safe`, which is what a host with
an idle core gets (on a busy one `memsim run` forks no helper). `--bytecode PREFIX`: bytecode cached under PREFIX
(PYTHONDONTWRITEBYTECODE unset, PYTHONPYCACHEPREFIX=PREFIX), as a pip install runs; without it, the environment as
it is. Prints one line per run (variant, wall s, user s with children, same/DIFF, load) and the medians.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

FORCED = ("import sys, simulator.forked as f; f.spare_core = f.fork_safe; from simulator.cli import main; "
          "sys.argv[0] = 'memsim'; main()")


def _run(tree: str, forced: bool, scenario: str, env: dict) -> tuple[float, float, bytes]:
    command = [sys.executable, "-c", FORCED] if forced else [sys.executable, "-m", "simulator.cli"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    start = time.perf_counter()
    out = subprocess.run(command + ["run", scenario, "--json"], cwd=tree, env={**env, "PYTHONPATH": tree},
                         capture_output=True, check=True).stdout
    wall = time.perf_counter() - start
    return wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - before, out


def two_trees(description: str, rounds: int) -> argparse.ArgumentParser:
    """The arguments both showcase A/B scripts take: OLD_TREE NEW_TREE [--rounds N] [--bytecode PREFIX]."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--bytecode", metavar="PREFIX")
    return parser


def environment(bytecode: str | None) -> dict:
    """This process's environment, with bytecode cached under `bytecode` (as a pip install runs) where given."""
    env = dict(os.environ)
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = bytecode
    return env


def main() -> None:
    parser = two_trees(__doc__.splitlines()[0], 10)
    parser.add_argument("--scenario", default="scenarios/showcase.toml")
    args = parser.parse_args()
    env = environment(args.bytecode)
    scenario = os.path.abspath(args.scenario)
    reference = None
    times: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for name, tree, forced in (("old", args.old, False), ("new", args.new, False),
                                   ("old forced", args.old, True), ("new forced", args.new, True)):
            load = os.getloadavg()[0]
            wall, user, out = _run(tree, forced, scenario, env)
            reference = out if reference is None else reference
            times.setdefault(name, []).append((wall, user))
            print(f"{name}: {wall:.2f} s wall {user:.2f} s user {'same' if out == reference else 'DIFF'} "
                  f"load {load:.2f}", flush=True)
    for name, runs in times.items():
        walls, users = [w for w, _ in runs], [u for _, u in runs]
        print(f"{name}: median {statistics.median(walls):.2f} s wall ({min(walls):.2f}-{max(walls):.2f}), "
              f"{statistics.median(users):.2f} s user ({min(users):.2f}-{max(users):.2f})")


if __name__ == "__main__":
    main()
