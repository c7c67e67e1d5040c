"""The showcase's run and its what-would-fit list in this one process, no forks: the CPU work itself, for an
instruction count that the machine's load does not change.

Run from the repository root::

    valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null \\
        "$(python3 -c 'import sys; print(sys.executable)')" benchmarks/showcase_inprocess.py [STAGE] > report.json

STAGE 0: the imports only; 1: and the job's simulation; 2 (default): and what would fit, printing the report
`memsim run scenarios/showcase.toml --json` prints. Differences of the counts between stages give each part's
instructions (pass the interpreter itself to valgrind, not a shim script that execs it).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    stage = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    import numpy  # noqa: F401  (what the run imports before its work, as memsim run does)

    from simulator.api import simulate
    from simulator.explore.fit import what_would_fit
    from simulator.scenario import load_scenario

    if stage < 1:
        return
    path = "scenarios/showcase.toml"
    report = simulate(load_scenario(path), timelines=False, events=False).report
    if stage < 2:
        return
    report["what_would_fit"] = what_would_fit(path, [], report)
    sys.stdout.write(json.dumps(report, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
