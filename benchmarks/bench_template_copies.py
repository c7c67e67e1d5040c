"""CPU per micro-batch copy made from an overlapped template (parallel/overlap_templates.py `apply`).

    python3 -m benchmarks.bench_template_copies SCENARIO.toml [--set KEY=VALUE ...] [--copies N] [--save FILE]
    python3 -m benchmarks.bench_template_copies --load FILE [--copies N]

Lowers the scenario's plan once, keeping the largest template `overlap_templates.record` makes (a template depends
on the ops, not on the number of micro-batches: a small global batch gives the same one), then makes N copies
from it (default 1,000), each with its own shift, all kept alive as the lowering keeps them, and prints the process
CPU microseconds per copy and the instructions a copy has. Only the public `record` / `apply` are used, so the same
file measures another checkout run from its root (`cd /work/main && python3 /path/to/this/file ...`). Under
cachegrind (`valgrind --tool=cachegrind --cache-sim=no`), `--copies 0` and `--copies N` give a copy's machine
instructions by difference, which the load of other jobs does not change. `--save FILE` pickles the template's
lowered instructions, `--load FILE` makes the template from them with the checkout's own `record` instead of
lowering (seconds under cachegrind instead of minutes).
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import sys
import time

sys.path.insert(0, os.getcwd())        # the checkout the command runs in, also when run as a file

from simulator.parallel import overlap_templates        # noqa: E402


class _Streams:
    """What `apply` reads and writes of rank_streams.RankStreams."""

    def __init__(self) -> None:
        self.compute: list = []
        self.other: dict[str, list] = {}
        self.count = 1000
        self.blocks: dict = {}        # Program.blocks as apply lists them (checkouts before 2026-12-03 ignore it)

    def stream(self, name: str) -> list:
        return self.other.setdefault(name, [])


class _Lowered:
    """A scratch _Streams for `record` whose `overlapped` puts back instructions a lowering made (--load)."""

    def __init__(self, compute: list, other: dict[str, list], count: int) -> None:
        self.saved = compute, other, count
        self.pending: list = []
        self.deferred = self.unsent = self.copies = self.gathering = self.blocks = ()
        self.sends: dict = {}
        self.offload_last: dict = {}

    def overlapped(self, runs, overlaps) -> None:
        self.compute, self.other, self.count = self.saved


class _Done(Exception):
    """Stops the run once the lowering is done."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", nargs="?")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--copies", type=int, default=1000)
    parser.add_argument("--save")
    parser.add_argument("--load")
    args = parser.parse_args()
    if args.load:
        with open(args.load, "rb") as file:
            compute, other, count = pickle.load(file)
        template = overlap_templates.record(_Lowered(compute, other, count), [], ())
        size = len(compute) + sum(map(len, other.values()))
    else:
        size, template = _largest(args.scenario, args.overrides, args.save)
    kept = []
    gc.disable()                       # as api.simulate_multi runs the lowering
    start = time.process_time()
    for k in range(args.copies):
        streams = _Streams()
        overlap_templates.apply(template, streams, (k + 1) * 7919)
        kept.append(streams)
    if args.copies:
        seconds = time.process_time() - start
        print(f"{seconds / args.copies * 1e6:.0f} us CPU per copy of {size} instructions ({args.copies} copies)")
    sys.stdout.flush()
    os._exit(0)                        # not the teardown of the copies, which cachegrind would count


def _largest(scenario: str, overrides: list[str], save: str | None) -> tuple[int, tuple]:
    """(instructions, template) of the largest template the scenario's lowering records; its instructions
    pickled to `save`."""
    from simulator.api import simulate
    from simulator.parallel import lower_multi
    from simulator.scenario import load_scenario

    caught: list[tuple[int, tuple, tuple]] = []
    record, lower = overlap_templates.record, lower_multi.lower_multi

    def spy(scratch, runs, overlaps):
        template = record(scratch, runs, overlaps)
        if template is not None:
            caught.append((len(scratch.compute) + sum(map(len, scratch.other.values())), template,
                           (scratch.compute, dict(scratch.other), scratch.count)))
        return template

    def lowered(*a, **k):
        lower(*a, **k)
        raise _Done

    overlap_templates.record, lower_multi.lower_multi = spy, lowered
    try:
        simulate(load_scenario(scenario, overrides), timelines=False, events=False)
    except _Done:
        pass
    finally:
        overlap_templates.record, lower_multi.lower_multi = record, lower
    if not caught:
        raise SystemExit("no overlapped template in this scenario's lowering")
    size, template, lowered_instructions = max(caught, key=lambda entry: entry[0])
    if save:
        sys.setrecursionlimit(100_000)
        with open(save, "wb") as file:
            pickle.dump(lowered_instructions, file)
    return size, template


if __name__ == "__main__":
    main()
