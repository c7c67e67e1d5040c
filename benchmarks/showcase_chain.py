"""The showcase's critical chain in CPU seconds per process, a measure the host's load changes less than wall time:
`memsim run scenarios/showcase.toml --json` with the what-would-fit helper forced, every fork and answer logged.

Run from the repository root::

    python benchmarks/showcase_chain.py OLD_TREE NEW_TREE [--rounds 6] [--bytecode PREFIX]

Per run: the run's CPU when it forks the helper, the helper's CPU when it forks its last replay child, each replay
child's CPU, and "chain" = the run's CPU at the fork + the helper's at its last fork + the longest replay child (an
approximation of the wall on idle cores; two cores cannot beat total / 2 either). Reports are compared with the
first run's.
"""

from __future__ import annotations

import collections
import os
import statistics
import subprocess
import sys
import tempfile

from showcase_ab import environment, two_trees     # (benchmarks/ is on sys.path: run as a script)

# The instrumented run (executed in each tree with PYTHONPATH=tree): log "pid ppid cpu event" lines to $LOG.
INSTRUMENTED = r'''
import os, sys, time, functools
LOG = os.environ["LOG"]
def log(what):
    with open(LOG, "a") as f:
        f.write(f"{os.getpid()} {os.getppid()} {time.process_time():.4f} {what}\n")
import simulator.forked as forked
forked.spare_core = forked.fork_safe
class Logged(forked.Forked):
    def __init__(self, fn, *args, **kwargs):
        log(f"fork {getattr(fn, '__name__', '?')}")
        super().__init__(fn, *args, **kwargs)
forked.Forked = Logged
_answer = forked.write_answer
def write_answer(fd, answer):
    log("answer"); _answer(fd, answer)
forked.write_answer = write_answer
import simulator.explore.fit as fit
_replayed = fit._replayed_simulation
@functools.wraps(_replayed)
def replayed(*args, **kwargs):
    log("> replay"); return _replayed(*args, **kwargs)
fit._replayed_simulation = replayed
import simulator.cli_run as cli_run
_run = cli_run.run_command
def run_command(*args, **kwargs):
    code = _run(*args, **kwargs); log("done"); return code
cli_run.run_command = run_command
import simulator.cli as cli
sys.argv = ["memsim", "run", "scenarios/showcase.toml", "--json"]
cli.main()
'''


def _chain(log: str) -> dict:
    events = collections.defaultdict(list)
    for line in open(log):
        pid, ppid, cpu, what = line.split(None, 3)
        events[pid].append((float(cpu), what.strip(), ppid))
    main = next(iter(events))
    helper = next(p for p, e in events.items() if e[0][2] == main)
    kids = [p for p, e in events.items() if e[0][2] == helper]
    replays = [p for p in kids if any(what == "> replay" for _, what, _ in events[p])]
    end = {p: max(cpu for cpu, *_ in e) for p, e in events.items()}
    forks = [cpu for cpu, what, _ in events[helper] if what.startswith("fork")]
    at_fork = next(cpu for cpu, what, _ in events[main] if what.startswith("fork"))
    return {"chain": at_fork + forks[-1] + max(end[p] for p in replays), "run at fork": at_fork,
            "helper at last fork": forks[-1], "longest replay child": max(end[p] for p in replays),
            "all": sum(end.values())}


def main() -> None:
    args = two_trees(__doc__.splitlines()[0], 6).parse_args()
    env = environment(args.bytecode)
    runs: dict[str, list[dict]] = {}
    reference = None
    with tempfile.TemporaryDirectory() as folder:
        log = os.path.join(folder, "log")
        for _ in range(args.rounds):
            for name, tree in (("old", args.old), ("new", args.new)):
                if os.path.exists(log):
                    os.remove(log)
                out = subprocess.run([sys.executable, "-c", INSTRUMENTED], cwd=tree, capture_output=True, check=True,
                                     env={**env, "PYTHONPATH": tree, "LOG": log}).stdout
                reference = out if reference is None else reference
                found = _chain(log)
                runs.setdefault(name, []).append(found)
                print(f"{name}: " + " ".join(f"{k} {v:.3f}" for k, v in found.items()) +
                      f" {'same' if out == reference else 'DIFF'} load {os.getloadavg()[0]:.2f}", flush=True)
    for name, found in runs.items():
        print(f"{name}: medians " + ", ".join(f"{k} {statistics.median(f[k] for f in found):.3f}" for k in found[0]))


if __name__ == "__main__":
    main()
