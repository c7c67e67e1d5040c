"""Per rank, at each Period boundary: whether the allocator's state repeats an earlier one, or is replayed.

    python benchmarks/memory_states.py SCENARIO.toml GLOBAL_BATCH

Runs in-process (memory_workers=0, no timelines, no events), wrapping RankMemory.boundary to compute each
boundary's state as repeats.py does (live tensors named relative to the boundary, CachingAllocator.state_key),
and prints per rank: boundaries, those met while a period was replayed, the first replayed one, and every 8th
boundary's allocated, reserved and inactive-split bytes and block count (how the layout drifts). A diagnostic
for docs/engine.md "When the caching allocator's layout repeats late"; its own run is slower than a plain one.
"""

from __future__ import annotations

import dataclasses
import sys


def main(path: str, global_batch: int) -> None:
    from simulator.api import simulate
    from simulator.engine import memory
    from simulator.engine.repeats import relative
    from simulator.scenario import load_scenario
    scenario = load_scenario(path)
    scenario = dataclasses.replace(scenario, training=dataclasses.replace(scenario.training,
                                                                          global_batch_size=global_batch))
    rows: dict[int, list] = {}
    boundary = memory.RankMemory.boundary

    def recorded(self, mark):
        row = None
        if self._skipping is None:
            handles = self.handles
            labels = dict(zip(handles.values(), relative(tuple(handles), mark.shift, mark.low, mark.high)))
            state = self.allocator.state_key(labels)
            row = (state[4], state[5], state[8], sum(len(segment[6]) for segment in state[0]))
        rows.setdefault(id(self), []).append(row)
        boundary(self, mark)

    memory.RankMemory.boundary = recorded
    try:
        simulate(scenario, timelines=False, events=False, memory_workers=0)
    finally:
        memory.RankMemory.boundary = boundary
    for rank, marks in enumerate(rows.values()):
        replayed = [i for i, row in enumerate(marks) if row is None]
        print(f"rank {rank}: {len(marks)} boundaries, {len(replayed)} replayed, first replayed "
              f"{replayed[0] if replayed else None}")
        for i in range(0, len(marks), 8):
            if marks[i] is not None:
                print(f"  {i:5d}  allocated {marks[i][0]:,d}  reserved {marks[i][1]:,d}  inactive split "
                      f"{marks[i][2]:,d}  blocks {marks[i][3]}")


if __name__ == "__main__":
    sys.path.insert(0, ".")
    main(sys.argv[1], int(sys.argv[2]))
