"""How exactly a pipeline's steady state repeats: for each stream of the first simulated ranks, the distinct
differences between the start times of successive occurrences of its first op (one per micro-batch), printed as
hex floats. Equal periods would give one difference; float sums of durations give several that differ in their
last bits (docs/engine.md, "Turning the shortcuts off").

Run from the repository root::

    python3 -m benchmarks.period_deltas FILE [KEY=VALUE ...]
"""

from __future__ import annotations

import sys

import numpy as np

from simulator.api import simulate
from simulator.scenario import load_scenario


def main() -> None:
    path, sets = sys.argv[1], sys.argv[2:]
    result = simulate(load_scenario(path, sets), timelines=True, events=False, memory_workers=0)
    for rank in result.trace.ranks[:2]:
        for stream, log in rank.spans.streams:
            if not len(log):
                continue
            names = [info.op.name if hasattr(info, "op") else type(info).__name__ for info in log.infos]
            starts = np.array(log.starts)[[k for k, name in enumerate(names) if name == names[0]]]
            deltas = np.diff(starts)
            distinct = np.unique(deltas)
            print(f"rank {rank.spans.rank} {stream}: {names[0]} x {len(starts)}, {len(distinct)} distinct "
                  f"differences; the first 8: {' '.join(float(d).hex() for d in deltas[:8])}")


if __name__ == "__main__":
    main()
