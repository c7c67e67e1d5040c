"""Fuzz memsim with mutated repository scenarios: load, check and simulate each; count OK, rejected, escapes, time-outs.

    nice python3 benchmarks/fuzz_scenarios.py --documents 10000 --seed 0 --timeout 20 --out fuzz.json

Each document is a scenarios/**/*.toml file, shrunk (simulator.fuzz.shrink) and mutated one to three times
(simulator.fuzz.mutate_once). A child process loads it (scenario_from_dict), simulates it (timelines off, no
memory workers) and reports the outcome: "ok", "rejected" (a MemsimError: the one-line message is checked), or
"escape" (any other exception: the promise broken). A document that runs past --timeout seconds is a time-out:
the child is killed and a new one started. Escapes are printed with the document that caused them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulator.fuzz import ROOT, mutant, repository_scenarios  # noqa: E402


def _outcome(source: str, doc: dict) -> tuple[str, str]:
    from simulator.api import simulate
    from simulator.errors import MemsimError
    from simulator.scenario import scenario_from_dict

    try:
        scenario = scenario_from_dict(doc, str(ROOT / source))
        simulate(scenario, timelines=False, memory_workers=0)
    except MemsimError as error:
        message = str(error)
        if "\n" in message or not message:
            return "escape", f"MemsimError message not one line: {message!r}"
        return "rejected", message
    except Exception as error:          # noqa: BLE001 - what the fuzzer is looking for
        return "escape", f"{type(error).__name__}: {error} | {traceback.format_exc(limit=-2)!r}"
    return "ok", ""


def _child(connection) -> None:
    while True:
        item = connection.recv()
        if item is None:
            return
        connection.send(_outcome(*item))


class _Runner:
    """A child process that runs one document at a time; killed and replaced when a document times out."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("fork")
        self._start()

    def _start(self) -> None:
        self.parent, child = self.context.Pipe()
        self.process = self.context.Process(target=_child, args=(child,), daemon=True)
        self.process.start()

    def run(self, source: str, doc: dict, timeout: float) -> tuple[str, str]:
        self.parent.send((source, doc))
        if self.parent.poll(timeout):
            try:
                return self.parent.recv()
            except EOFError:
                pass
            self.process.join()
            self._start()
            return "escape", f"the child died (exit {self.process.exitcode})"
        self.process.kill()
        self.process.join()
        self._start()
        return "timeout", ""

    def close(self) -> None:
        self.parent.send(None)
        self.process.join(5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per document")
    parser.add_argument("--out", type=Path, default=None, help="write the counts and the escapes as JSON")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    scenarios = repository_scenarios()
    runner = _Runner()
    counts: Counter = Counter()
    escapes, timeouts, kinds = [], [], Counter()
    start = time.monotonic()
    try:
        for number in range(args.documents):
            item = mutant(rng, scenarios)
            outcome, detail = runner.run(item.source, item.doc, args.timeout)
            counts[outcome] += 1
            kinds.update(change.split(":")[0] for change in item.changes)
            if outcome == "escape":
                escapes.append({"document": number, "source": item.source, "changes": item.changes,
                                "error": detail[:2000]})
                print(f"ESCAPE #{number} {item.source} {item.changes}: {detail[:500]}", flush=True)
            elif outcome == "timeout":
                timeouts.append({"document": number, "source": item.source, "changes": item.changes})
            if (number + 1) % 500 == 0:
                print(f"{number + 1} documents, {dict(counts)}, {time.monotonic() - start:.0f} s", flush=True)
    finally:
        runner.close()
    summary = {"documents": sum(counts.values()), "ok": counts["ok"], "rejected": counts["rejected"],
               "escapes": counts["escape"], "timeouts": counts["timeout"], "seed": args.seed,
               "timeout_s": args.timeout, "wall_s": round(time.monotonic() - start, 1),
               "mutations": dict(sorted(kinds.items())), "escape_list": escapes, "timeout_list": timeouts}
    print(json.dumps({k: v for k, v in summary.items() if not k.endswith("_list")}, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2, default=repr) + "\n")
    return 1 if escapes else 0


if __name__ == "__main__":
    sys.exit(main())
