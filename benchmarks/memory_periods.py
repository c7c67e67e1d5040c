"""Per simulated rank: how many memory calls the allocator ran and how many a repeated period replayed.

    python benchmarks/memory_periods.py SCENARIO.toml

Prints, per rank in the order their memory is first used: the Period boundaries met, those met while a
period was being replayed, allocator calls (malloc and free through the CachingAllocator model, catching up
included) and the calls replayed one by one from a period (engine/repeats.py; a stretch replayed in bulk,
engine/stretches.py, is not counted). A diagnostic for the scale
work of docs/performance.md: it wraps RankMemory's methods, so its own run is slower than a plain one.
"""

from __future__ import annotations

import sys
from collections import Counter

from simulator.api import simulate
from simulator.engine import memory
from simulator.scenario import load_scenario


def main(path: str) -> None:
    counts: Counter = Counter()
    order: dict[int, int] = {}
    rank_memory = memory.RankMemory
    allocate, free, replay, boundary = (rank_memory._allocate, rank_memory._free, rank_memory._replay,
                                        rank_memory.boundary)

    def counted(kind, method):
        def wrapper(self, *args):
            order.setdefault(id(self), len(order))
            counts[kind, id(self)] += 1
            return method(self, *args)
        return wrapper

    def counted_boundary(self, mark):
        order.setdefault(id(self), len(order))
        counts["boundaries", id(self)] += 1
        counts["replaying", id(self)] += self._skipping is not None
        boundary(self, mark)

    rank_memory._allocate = counted("malloc", allocate)
    rank_memory._free = counted("free", free)
    rank_memory._replay = counted("replayed", replay)
    rank_memory.boundary = counted_boundary
    try:
        result = simulate(load_scenario(path))
    finally:
        rank_memory._allocate, rank_memory._free, rank_memory._replay, rank_memory.boundary = (
            allocate, free, replay, boundary)
    print(f"{path}: iteration {result.report['iteration_time_s']:.6g} s")
    print("rank  boundaries  replaying  allocator calls  replayed one by one")
    for key, index in sorted(order.items(), key=lambda item: item[1]):
        calls = counts["malloc", key] + counts["free", key]
        print(f"{index:4d}  {counts['boundaries', key]:10d}  {counts['replaying', key]:9d}  {calls:15,d}  "
              f"{counts['replayed', key]:19,d}")
    total = sum(counts["malloc", k] + counts["free", k] for k in order)
    print(f"all   allocator calls {total:,d}, replayed {sum(counts['replayed', k] for k in order):,d}")


if __name__ == "__main__":
    main(sys.argv[1])
