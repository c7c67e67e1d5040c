"""How well the fast estimate agrees with the full simulation on random plans (simulator.testing's
multi_gpu_scenarios): iteration time and peak memory errors, the same fit verdict, Kendall's tau of iteration time.

    python3 -m simulator.explore.agreement --plans 300 --seed 0 --executor local:2      # the table of docs/explore.md
    python3 -m simulator.explore.agreement --plans 300 --seed 0 --index 64 --index 299  # two plans of that sample
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import numpy as np

from simulator.errors import MemsimError

# The targets of issue 17 (point 2): median / max relative errors, fit agreement, rank correlation.
TARGETS = {"time_median": 0.05, "time_max": 0.15, "memory_median": 0.03, "memory_max": 0.10, "same_fit": 0.98,
           "kendall_tau": 0.9}
QUIET = ["run.record_events=false", "run.warmup_iterations=1", "run.iterations=1"]


@dataclass(frozen=True)
class Pair:
    """One plan: its name, the estimate's and the simulation's iteration time, largest peak reserved and allocated
    memory over stages, and fit verdicts; `error` when one side refused it (then the other must refuse it too)."""

    name: str
    estimate: tuple[float, int, int, bool] | None
    simulated: tuple[float, int, int, bool] | None
    error: str | None = None


def _numbers(report: dict) -> tuple[float, int, int, bool]:
    return (float(report["iteration_time_s"]), max(int(r["peak_reserved_bytes"]) for r in report["ranks"]),
            max(int(r["peak_allocated_bytes"]) for r in report["ranks"]), bool(report["fits"]))


def simulate_document(document: dict) -> tuple[tuple | None, str | None]:
    """Simulate one drawn scenario dict: (its numbers, None) or (None, the one-line error). Module-level: executors
    ship it to their workers."""
    from simulator.api import simulate
    from simulator.scenario.loader import scenario_from_dict

    try:
        scenario = scenario_from_dict(document, f"<{document['name']}>", QUIET)
        return _numbers(simulate(scenario, timelines=False, memory_workers=0).report), None
    except MemsimError as error:
        return None, str(error)


def draw_documents(count: int, seed: int) -> list[dict]:
    """`count` random multi-GPU scenario dicts (simulator.testing.multi_gpu_scenarios), named uniquely."""
    from simulator.testing import draw_examples, multi_gpu_scenarios

    documents = draw_examples(multi_gpu_scenarios(), count, seed)
    for k, document in enumerate(documents):
        document["name"] = f"{document['name']}-{seed}-{k}"
    return documents


def measure(documents: list[dict], executor=None) -> list[Pair]:
    """Estimate every document (one vectorised call) and simulate each (on `executor`, else in this process)."""
    from simulator.explore.estimate import estimate_reports
    from simulator.scenario.loader import scenario_from_dict

    scenarios, errors = [], {}
    for k, document in enumerate(documents):
        try:
            scenarios.append((k, scenario_from_dict(document, f"<{document['name']}>", QUIET)))
        except MemsimError as error:
            errors[k] = str(error)
    estimates = dict(zip((k for k, _ in scenarios), estimate_reports([s for _, s in scenarios], errors="return")))
    runner = executor.map if executor is not None else lambda fn, items: [fn(item) for item in items]
    simulated = runner(simulate_document, documents)
    pairs = []
    for k, document in enumerate(documents):
        estimate = estimates.get(k)
        sim, sim_error = simulated[k]
        if k in errors or isinstance(estimate, MemsimError) or sim_error is not None:
            est_error = errors.get(k) or (str(estimate) if isinstance(estimate, MemsimError) else None)
            pairs.append(Pair(document["name"], None if est_error else _numbers(estimate), sim,
                              error=f"estimate: {est_error}; simulation: {sim_error}"))
            continue
        pairs.append(Pair(document["name"], _numbers(estimate), sim))
    return pairs


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b of two equally long sequences (ties counted as neither concordant nor discordant)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(x) < 2:
        return float("nan")
    dx = np.sign(x[:, None] - x[None, :])
    dy = np.sign(y[:, None] - y[None, :])
    upper = np.triu_indices(len(x), 1)
    dx, dy = dx[upper], dy[upper]
    concordant = float(np.sum(dx * dy))
    denominator = math.sqrt(float(np.sum(dx != 0)) * float(np.sum(dy != 0)))
    return concordant / denominator if denominator else float("nan")


def summarize(pairs: list[Pair]) -> dict:
    """The agreement numbers over the plans both sides ran (and how many each side refused)."""
    both = [p for p in pairs if p.estimate is not None and p.simulated is not None]
    refused_alike = sum(1 for p in pairs if p.estimate is None and p.simulated is None)
    refused_apart = [p for p in pairs if (p.estimate is None) != (p.simulated is None)]
    time = np.array([abs(p.estimate[0] - p.simulated[0]) / p.simulated[0] for p in both])
    # Memory over the plans that fit in the simulation: one that runs out stops where its allocator did, so its
    # simulated peak is not the plan's.
    ran = [p for p in both if p.simulated[3]] or both
    memory = np.array([abs(p.estimate[1] - p.simulated[1]) / p.simulated[1] for p in ran])
    allocated = np.array([abs(p.estimate[2] - p.simulated[2]) / p.simulated[2] for p in ran])
    fits = [p for p in both if p.simulated[3] and p.estimate[3]]
    result = {
        "plans": len(pairs), "compared": len(both), "memory_compared": len(ran), "refused_by_both": refused_alike,
        "refused_by_one": len(refused_apart),
        "time_median": float(np.median(time)), "time_max": float(time.max()),
        "memory_median": float(np.median(memory)), "memory_max": float(memory.max()),
        "allocated_median": float(np.median(allocated)), "allocated_max": float(allocated.max()),
        "same_fit": sum(1 for p in both if p.estimate[3] == p.simulated[3]) / len(both),
        "fitting": len(fits),
        "kendall_tau": kendall_tau([p.estimate[0] for p in fits], [p.simulated[0] for p in fits]),
    }
    return result


def table(summary: dict) -> str:
    """The summary as a Markdown table with the targets and whether each is met."""
    def pct(x: float) -> str:
        return f"{100 * x:.2f}%"

    rows = [("iteration time error, median", pct(summary["time_median"]), "<= 5%",
             summary["time_median"] <= TARGETS["time_median"]),
            ("iteration time error, max", pct(summary["time_max"]), "<= 15%", summary["time_max"] <= TARGETS["time_max"]),
            (f"peak reserved error, median ({summary['memory_compared']} plans fitting in the simulation)",
             pct(summary["memory_median"]), "<= 3%",
             summary["memory_median"] <= TARGETS["memory_median"]),
            ("peak reserved error, max", pct(summary["memory_max"]), "<= 10%",
             summary["memory_max"] <= TARGETS["memory_max"]),
            ("peak allocated error, median / max", f"{pct(summary['allocated_median'])} / {pct(summary['allocated_max'])}",
             "", None),
            ("same fit verdict", pct(summary["same_fit"]), ">= 98%", summary["same_fit"] >= TARGETS["same_fit"]),
            (f"Kendall's tau of iteration time ({summary['fitting']} plans fitting in both)",
             f"{summary['kendall_tau']:.4f}", ">= 0.9", summary["kendall_tau"] >= TARGETS["kendall_tau"])]
    lines = [f"{summary['compared']} of {summary['plans']} plans compared ({summary['refused_by_both']} refused by "
             f"both, {summary['refused_by_one']} by one side only)", "",
             "| measure | value | target | met |", "|---|---|---|---|"]
    for name, value, target, met in rows:
        lines.append(f"| {name} | {value} | {target} | {'' if met is None else 'yes' if met else 'no'} |")
    return "\n".join(lines) + "\n"


def worst(pairs: list[Pair], count: int = 10) -> str:
    """The plans with the largest time or memory error (for looking into them)."""
    both = [p for p in pairs if p.estimate is not None and p.simulated is not None]
    scored = sorted(both, key=lambda p: -max(abs(p.estimate[0] / p.simulated[0] - 1),
                                             abs(p.estimate[1] / p.simulated[1] - 1)))
    lines = []
    for p in scored[:count]:
        lines.append(f"{p.name}: time {p.estimate[0]:.4g} / {p.simulated[0]:.4g} s "
                     f"({100 * (p.estimate[0] / p.simulated[0] - 1):+.1f}%), reserved {p.estimate[1] / 2**30:.3f} / "
                     f"{p.simulated[1] / 2**30:.3f} GiB ({100 * (p.estimate[1] / p.simulated[1] - 1):+.1f}%), fits "
                     f"{p.estimate[3]} / {p.simulated[3]}")
    for p in pairs:
        if (p.estimate is None) != (p.simulated is None):
            lines.append(f"{p.name}: refused by one side: {p.error}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--executor", default="local:1")
    parser.add_argument("--worst", type=int, default=10, help="also list the N plans with the largest errors")
    parser.add_argument("--index", type=int, action="append", default=[],
                        help="only plan K of the --plans drawn (repeatable): one outlier looked into alone")
    args = parser.parse_args(argv)
    documents = draw_documents(args.plans, args.seed)
    bad = [k for k in args.index if not 0 <= k < len(documents)]
    if bad:
        sys.stderr.write(f"agreement: error: --index {bad[0]}: must be in 0..{len(documents) - 1} (--plans "
                         f"{args.plans})\n")
        return 2
    if args.index:
        documents = [documents[k] for k in args.index]
    from simulator.explore.executors import open_executor

    try:
        pool = open_executor(args.executor)
    except MemsimError as error:
        sys.stderr.write(f"agreement: error: {error}\n")
        return 2
    try:
        pairs = measure(documents, None if pool.in_process else pool)
    finally:
        pool.close()
    sys.stdout.write(table(summarize(pairs)))
    if args.worst:
        sys.stdout.write("\n" + worst(pairs, args.worst))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
