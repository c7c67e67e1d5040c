"""What `memsim plan` prints: the verified plans ranked, why each beats the next (its time against the next's, part
by part), and what stopped the other candidates (invalid, does not fit and by how much, slower and where)."""

from __future__ import annotations

import json

from simulator.explore.search import FITS, INVALID, NO_FIT, UNKNOWN, PlanSearch, Verified

PARTS = ("compute_s", "exposed_communication_s", "idle_s")
PART_NAMES = {"compute_s": "compute", "exposed_communication_s": "exposed communication", "idle_s": "bubble (idle)"}
MAX_RULES = 8


def seconds(x: float, signed: bool = False) -> str:
    """A duration in s, or ms under a second: "24.91 s", "6.2 ms" (signed: "+0.41 s")."""
    sign = "+" if signed and x >= 0 else ""
    return f"{sign}{x * 1e3:.3g} ms" if abs(x) < 1 else f"{sign}{x:.4g} s"


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def time_parts(report: dict) -> dict[str, float]:
    """The busiest stage's iteration split into compute, exposed communication and idle (they add up to about
    the iteration: the rest is communication hidden behind compute)."""
    busiest = max(report["ranks"], key=lambda r: (r["compute_s"], -r["stage"]))
    return {key: float(busiest[key]) for key in PARTS}


def _difference(mine: dict, other: dict) -> str:
    """Where `mine` is faster than `other`, largest part first: "compute -0.41 s, bubble (idle) -0.10 s"."""
    a, b = time_parts(mine), time_parts(other)
    deltas = sorted(((a[k] - b[k], k) for k in PARTS), key=lambda item: (item[0], item[1]))
    scale = max(abs(d) for d, _ in deltas) if deltas else 0.0
    return ", ".join(f"{PART_NAMES[k]} {seconds(d, True)}" for d, k in deltas if scale and abs(d) >= 1e-3 * scale) \
        or "the same parts"


def _fits(v: Verified) -> bool:
    return v.report is not None and bool(v.report["fits"])


def plan_rows(found: PlanSearch) -> list[dict]:
    """One row per verified plan, in the simulation's order, with its estimate beside the simulated numbers."""
    rows = []
    for k, v in enumerate(found.verified, start=1):
        row = {"rank": k, "plan": v.candidate.label, "overrides": v.candidate.overrides, "error": v.error,
               "estimated_iteration_time_s": v.candidate.estimate["iteration_time_s"] if v.candidate.estimate else None,
               "estimate_left_out": v.candidate.reason if v.candidate.verdict == UNKNOWN else None}
        if v.report is not None:
            r = v.report
            row.update(fits=bool(r["fits"]), iteration_time_s=r["iteration_time_s"], tokens_per_s=r["tokens_per_s"],
                       mfu=r["mfu"], bubble_fraction=r["bubble_fraction"],
                       exposed_communication_s=r["communication"]["exposed_s"],
                       peak_reserved_bytes=max(x["peak_reserved_bytes"] for x in r["ranks"]),
                       peak_allocated_bytes=max(x["peak_allocated_bytes"] for x in r["ranks"]),
                       time_parts=time_parts(r))
        rows.append(row)
    return rows


def why_each_wins(found: PlanSearch) -> list[str]:
    """For each verified plan that fits, what makes it faster than the next one that fits."""
    fitting = [v for v in found.verified if _fits(v)]
    lines = []
    for k, (v, nxt) in enumerate(zip(fitting, fitting[1:]), start=1):
        gain = nxt.report["iteration_time_s"] - v.report["iteration_time_s"]
        lines.append(f"{v.candidate.label} beats {nxt.candidate.label} by {seconds(gain)} per iteration: "
                     f"{_difference(v.report, nxt.report)}")
    return lines


def what_stopped(found: PlanSearch) -> list[str]:
    """Why the candidates that are not among the verified winners lost: counts per reason."""
    verified = {v.candidate.settings for v in found.verified}
    lines = []
    invalid = [c for c in found.candidates if c.verdict == INVALID]
    if invalid:
        lines.append(f"invalid (a run refuses them): {len(invalid):,}")
        for reason, count in [item for item in found.pruned if item[0] not in ("does not fit",)][:MAX_RULES]:
            lines.append(f"  {count:,} x {reason}")
        rules = len([item for item in found.pruned if item[0] != "does not fit"])
        if rules > MAX_RULES:
            lines.append(f"  ... and {rules - MAX_RULES} more rules")
    no_fit = [c for c in found.candidates if c.verdict == NO_FIT]
    if no_fit:
        closest = min(no_fit, key=lambda c: _excess(c.estimate))
        lines.append(f"do not fit (estimate): {len(no_fit):,}; the closest, {closest.label}, {closest.reason}")
    for v in found.verified:
        if v.error is not None:
            lines.append(f"verification failed: {v.candidate.label}: {v.error}")
        elif not v.report["fits"]:
            lines.append(f"does not fit in the simulation (the estimate said it would): {v.candidate.label}")
    best = next((v for v in found.verified if _fits(v)), None)
    slower = [c for c in found.ranked if c.settings not in verified]
    if slower and best is not None and best.candidate.estimate is not None:
        head = best.candidate.estimate
        by_part: dict[str, int] = {}
        for c in slower:
            a, b = time_parts(c.estimate), time_parts(head)
            part = max(PARTS, key=lambda k: (a[k] - b[k], k))
            by_part[part] = by_part.get(part, 0) + 1
        times = [c.estimate["iteration_time_s"] for c in slower]
        lines.append(f"fit but slower (estimate {seconds(min(times))} to {seconds(max(times))} per iteration, not verified): "
                     f"{len(slower):,}; where each loses most against {best.candidate.label}: "
                     + ", ".join(f"{PART_NAMES[k]} {n:,}" for k, n in sorted(by_part.items(), key=lambda i: -i[1])))
    unknown = [c for c in found.candidates if c.verdict == UNKNOWN and c.settings not in verified]
    if unknown:
        lines.append(f"not verified, the estimate leaves out what they do: {len(unknown):,} ({unknown[0].reason})")
    return lines


def _excess(report: dict) -> int:
    return max(r["peak_reserved_bytes"] + r["context_bytes"] - r["capacity_bytes"] for r in report["ranks"])


def plan_text(found: PlanSearch) -> str:
    """The search as text: summary, the ranked table, why each wins, what stopped the others."""
    counts = {verdict: sum(1 for c in found.candidates if c.verdict == verdict)
              for verdict in (INVALID, NO_FIT, FITS, UNKNOWN)}
    lines = [f"{found.scenario} on {found.gpus:,} GPUs ({found.nodes} x {found.topology}): "
             f"{len(found.candidates):,} candidate plans: {counts[INVALID]:,} invalid, {counts[NO_FIT]:,} do not fit, "
             f"{counts[FITS]:,} fit (estimate)" + (f", {counts[UNKNOWN]:,} left to the simulation" if counts[UNKNOWN]
                                                   else "")
             + f"; {len(found.verified)} verified by simulation", ""]
    header = (f"{'#':>2}  {'plan':<44} {'fits':<4} {'iteration':>10} {'estimate':>10} {'tokens/s':>11} {'MFU':>6} "
              f"{'bubble':>7} {'exposed':>10} {'peak reserved':>13}")
    lines.append(header)
    for row in plan_rows(found):
        if row["error"] is not None:
            lines.append(f"{row['rank']:>2}  {row['plan']:<44} simulation failed: {row['error']}")
            continue
        estimate = (seconds(row["estimated_iteration_time_s"]) if row["estimated_iteration_time_s"] is not None
                    and row["estimate_left_out"] is None else "-")
        lines.append(f"{row['rank']:>2}  {row['plan']:<44} {'yes' if row['fits'] else 'no':<4} "
                     f"{seconds(row['iteration_time_s']):>10} {estimate:>10} {row['tokens_per_s']:>11,.0f} "
                     f"{100 * row['mfu']:>5.1f}% {100 * row['bubble_fraction']:>6.1f}% "
                     f"{seconds(row['exposed_communication_s']):>10} {_gib(row['peak_reserved_bytes']):>13}")
    why = why_each_wins(found)
    if why:
        lines += ["", "why each wins (simulated; busiest stage, the next plan's time subtracted):"]
        lines += [f"  {line}" for line in why]
    stopped = what_stopped(found)
    if stopped:
        lines += ["", "what stopped the others:"] + [f"  {line}" for line in stopped]
    return "\n".join(lines) + "\n"


def plan_json(found: PlanSearch) -> str:
    """The search as JSON (sorted keys; no timings, so the same search gives the same bytes): counts, the ranked
    verified plans, the reasons."""
    counts = {verdict: sum(1 for c in found.candidates if c.verdict == verdict)
              for verdict in (INVALID, NO_FIT, FITS, UNKNOWN)}
    document = {
        "scenario": found.scenario, "gpus": found.gpus, "topology": found.topology, "nodes": found.nodes,
        "candidates": len(found.candidates), "counts": counts,
        "pruned": [{"reason": reason, "count": count} for reason, count in found.pruned],
        "plans": plan_rows(found), "why_each_wins": why_each_wins(found),
        "what_stopped": what_stopped(found),
    }
    return json.dumps(document, indent=2, sort_keys=True) + "\n"
