"""The memory side alone: dump a run's logged memory calls, then make them with the tree in the current directory.

    python benchmarks/memory_apply.py dump SCENARIO.toml GLOBAL_BATCH OUT.pkl
    python benchmarks/memory_apply.py time OUT.pkl [RANKS] [REPEATS]      # from the tree to time (cwd)
    valgrind --tool=callgrind --callgrind-out-file=/dev/null PYTHON benchmarks/memory_apply.py time OUT.pkl 0 1

`dump` runs the scenario at that global batch in-process (memory_workers=0, no timelines, no events) and pickles
each rank's fresh RankMemory, program and logged calls as memory_log.apply receives them. `time` unpickles them
(with the classes of the tree it runs in: run it from an old worktree to compare) and makes the calls, printing the
least CPU seconds per rank over REPEATS and a digest of the outcomes (equal digests: the same results). On a
loaded host CPU times vary by half; callgrind's instruction count ("Collected") does not: `time ... 1` with the
mode `load` as RANKS (unpickle only) gives the count to subtract.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import sys
import time


def dump(path: str, global_batch: int, out: str) -> None:
    from simulator.api import simulate
    from simulator.engine import executor
    from simulator.scenario import load_scenario
    scenario = load_scenario(path)
    scenario = dataclasses.replace(scenario, training=dataclasses.replace(scenario.training,
                                                                          global_batch_size=global_batch))
    dumps, apply = [], executor.apply

    def dumping(memory, program, words, times):
        dumps.append(pickle.dumps((memory, program, words, times), protocol=5))
        apply(memory, program, words, times)
    executor.apply = dumping
    try:
        simulate(scenario, timelines=False, events=False, memory_workers=0)
    finally:
        executor.apply = apply
    with open(out, "wb") as f:
        pickle.dump(dumps, f)
    print(f"{out}: {len(dumps)} ranks, {[len(d) for d in dumps]} bytes")


def time_apply(out: str, ranks: str, repeats: int) -> None:
    from simulator.engine.memory_log import apply
    with open(out, "rb") as f:
        dumps = pickle.load(f)
    chosen = range(len(dumps)) if ranks == "all" else [] if ranks == "load" else [int(r) for r in ranks.split(",")]
    best: dict[int, float] = {}
    digests = set()
    for _ in range(repeats):
        outcomes = []
        for k in chosen:
            memory, program, words, times = pickle.loads(dumps[k])
            start = time.process_time()
            apply(memory, program, words, times)
            best[k] = min(best.get(k, float("inf")), time.process_time() - start)
            o = memory.outcome()
            outcomes.append(repr((o.peak_allocated, o.peak_reserved, o.peak_time_s, o.peak_op, o.peak_breakdown,
                                  o.category_peaks, o.segments, o.samples, o.oom)))
        digests.add(hashlib.sha256(repr(outcomes).encode()).hexdigest()[:12])
    print("least CPU s per rank", {k: round(v, 3) for k, v in best.items()}, "outcome digest", sorted(digests))


if __name__ == "__main__":
    sys.setrecursionlimit(100_000)         # deep linked block lists pickle recursively
    sys.path.insert(0, ".")
    if sys.argv[1] == "dump":
        dump(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        time_apply(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "all",
                   int(sys.argv[4]) if len(sys.argv) > 4 else 3)
