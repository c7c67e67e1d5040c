"""CPU seconds of one scenario's lowering (lower_multi) with overlapped copies made from templates and without.

    python3 -m benchmarks.bench_lowering_templates SCENARIO.toml [--set KEY=VALUE ...] [--repeats N]

Lowers the scenario's plan N times each way (default 2), alternating off and on in one process, and checks that
the programs are equal; prints the process CPU seconds of each lowering (time.process_time: the load of other
jobs on the machine inflates wall time, not this). parallel/overlap_templates.py says what a template is.
"""

from __future__ import annotations

import argparse
import time

from simulator.api import simulate
from simulator.parallel import lower_multi
from simulator.scenario import load_scenario


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    seconds: dict[bool, list[float]] = {False: [], True: []}
    real = lower_multi.lower_multi

    def timed(*a, **k):
        made = {}
        for _ in range(args.repeats):
            for on in (False, True):
                start = time.process_time()
                made[on] = real(*a, **dict(k, templates=on))[0]
                seconds[on].append(time.process_time() - start)
        if [p.streams for p in made[False]] != [p.streams for p in made[True]]:
            raise SystemExit("programs differ")
        raise _Done

    lower_multi.lower_multi = timed
    try:
        simulate(load_scenario(args.scenario, args.overrides), timelines=False, events=False)
    except _Done:
        pass
    for on in (False, True):
        print(f"templates {'on ' if on else 'off'}: " + ", ".join(f"{s:.2f}" for s in seconds[on]) + " s CPU")


class _Done(Exception):
    """Stops the run once the lowerings are timed."""


if __name__ == "__main__":
    main()
