"""`memsim compare`: the best plan of a scenario on each of several clusters (plan search: estimate, then the full
simulation of the best few), side by side with tokens/s, MFU, time to train, dollars and kWh."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from simulator.errors import ScenarioError, TopologyError
from simulator.explore.cost import ClusterShape, PriceTable, Pricing, check_prices, per_million_tokens, token_budget
from simulator.explore.table import Table, outcome_of

_CLUSTER = re.compile(r"^(?P<name>[^:\s]+):(?P<nodes>\d+)$")
MAX_NODES = 100_000


@dataclass(frozen=True)
class ClusterChoice:
    """A --cluster item: a multi-GPU topology and how many of its servers."""

    topology: str
    nodes: int
    gpus: int
    shape: ClusterShape

    @property
    def label(self) -> str:
        """As the user wrote it: "dgx-h100:2"."""
        return f"{self.topology}:{self.nodes}"


def parse_cluster(text: str) -> ClusterChoice:
    """A --cluster item, TOPOLOGY:NODES, checked against the topology files.

    Raises:
        ScenarioError | TopologyError: not NAME:NODES, nodes out of range, or an unknown topology.
    """
    from simulator.network.topology import list_topologies, load_topology
    from simulator.scenario.schema import did_you_mean

    match = _CLUSTER.match(text.strip()) if isinstance(text, str) else None
    if match is None or not 1 <= int(match["nodes"]) <= MAX_NODES:
        raise ScenarioError(f"--cluster {text!r}: must be TOPOLOGY:NODES with 1 to {MAX_NODES} nodes, e.g. dgx-h100:2")
    name, nodes = match["name"], int(match["nodes"])
    try:
        topology = load_topology(name, nodes=nodes)
    except TopologyError as error:
        hint = did_you_mean(name, list_topologies())
        raise TopologyError(f"--cluster {text!r}: {error}{hint}") from None
    device = topology.gpu_device
    return ClusterChoice(name, nodes, topology.num_gpus,
                         ClusterShape(device.name, float(device.tdp_w), topology.name, nodes, topology.num_gpus))


COLUMNS = (
    ("cluster", "str"), ("gpus", "int"), ("device", "str"), ("plan", "str"), ("overrides", "str"), ("status", "str"),
    ("reason", "str"),
    ("dp", "int"), ("tp", "int"), ("pp", "int"),
    ("fits", "bool"), ("peak_allocated_bytes", "int"), ("peak_reserved_bytes", "int"), ("iteration_time_s", "float"),
    ("tokens_per_s", "float"), ("mfu", "float"), ("bubble_fraction", "float"), ("exposed_communication_s", "float"),
    ("busy_fraction", "float"), ("estimate", "bool"), ("usd_per_million_tokens", "float"),
    ("kwh_per_million_tokens", "float"), ("time_to_train_s", "float"), ("usd", "float"), ("kwh", "float"),
    ("candidates", "int"), ("estimated_fitting", "int"), ("verified", "int"),
)


@dataclass(frozen=True)
class Comparison:
    """The best plan per cluster (`best`, one row each) and every verified plan (`verified`, for the pictures)."""

    best: Table
    verified: Table
    tokens: float | None


def _row(choice: ClusterChoice, candidate, report: dict, prices: PriceTable, pricing: Pricing,
         tokens: float | None, counts: tuple[int, int, int]) -> dict:
    row = dict.fromkeys(name for name, _ in COLUMNS)
    settings = dict(candidate.settings)
    row.update(cluster=choice.label, gpus=choice.gpus, device=choice.shape.device, plan=candidate.label,
               overrides=" ".join(candidate.overrides), status="ok", dp=settings.get("parallel.dp"), tp=settings.get("parallel.tp"),
               pp=settings.get("parallel.pp"))
    row.update(outcome_of(report))
    row["candidates"], row["estimated_fitting"], row["verified"] = counts
    if row["fits"] and row["tokens_per_s"] > 0:
        usd, kwh = per_million_tokens(prices, choice.shape, pricing, row["tokens_per_s"], row["busy_fraction"])
        row.update(usd_per_million_tokens=usd, kwh_per_million_tokens=kwh)
        if tokens is not None:
            budget = token_budget(tokens, row["tokens_per_s"], usd, kwh)
            row.update(time_to_train_s=budget.time_s, usd=budget.usd, kwh=budget.kwh)
    return row


def compare_clusters(scenario_path: str, clusters: list[ClusterChoice], *, prices: PriceTable, pricing: Pricing,
                     tokens: float | None, top_k: int, executor, progress=None) -> Comparison:
    """Search each cluster's plans (search_plans) and keep its fastest verified plan that fits.

    A cluster where no plan fits gets a row with status "none fits" and the reason (the closest estimate's
    shortfall, or what made every plan invalid).

    Raises:
        MemsimError: prices missing for a cluster's device or server, a cluster named twice, a bad scenario.
    """
    from simulator.errors import MemsimError
    from simulator.explore.search import search_plans

    labels = [choice.label for choice in clusters]
    for position, label in enumerate(labels):
        if label in labels[:position]:
            raise ScenarioError(f"--cluster {label}: given twice")
    check_prices(prices, [choice.shape for choice in clusters], pricing)
    best_rows, verified_rows = [], []
    for choice in clusters:
        def report_progress(phase: str, done: int, total: int, label=choice.label) -> None:
            if progress is not None:
                progress.update(f"{label}: {phase}", done, total)

        try:
            found = search_plans(scenario_path, gpus=choice.gpus, topology=choice.topology, nodes=choice.nodes,
                                 top_k=top_k, verify=True, executor=executor, progress=report_progress)
        except MemsimError as error:
            best_rows.append(_none_fits(choice, str(error).removeprefix(f"{scenario_path}: "), (0, 0, 0)))
            continue
        counts = (len(found.candidates), len(found.ranked), len(found.verified))
        rows = [_row(choice, v.candidate, v.report, prices, pricing, tokens, counts)
                for v in found.verified if v.report is not None]
        verified_rows += rows
        fitting = [row for row in rows if row["fits"]]
        if fitting:
            best_rows.append(fitting[0])       # verified plans come fastest first, fitting ones before the rest
        else:
            best_rows.append(_none_fits(choice, _why_none(found), counts))
    return Comparison(Table(COLUMNS, tuple(best_rows)), Table(COLUMNS, tuple(verified_rows)), tokens)


def _none_fits(choice: ClusterChoice, reason: str, counts: tuple[int, int, int]) -> dict:
    row = dict.fromkeys(name for name, _ in COLUMNS)
    row.update(cluster=choice.label, gpus=choice.gpus, device=choice.shape.device, status="none fits",
               reason=reason, fits=False)
    row["candidates"], row["estimated_fitting"], row["verified"] = counts
    return row


def _why_none(found) -> str:
    """Why no plan of a search fits: the verified ones did not, or the closest estimate's shortfall."""
    if found.verified:
        return (f"none of the {len(found.verified)} verified plans fits in the simulation "
                f"(the estimate said they would)")
    closest = min((c for c in found.candidates if c.estimate is not None), default=None,
                  key=lambda c: max(r["peak_reserved_bytes"] + r["context_bytes"] - r["capacity_bytes"]
                                    for r in c.estimate["ranks"]))
    if closest is None:
        return "no valid plan"
    return f"no plan fits; the closest, {closest.label}, {closest.reason}"


def comparison_json(comparison: Comparison) -> str:
    """The comparison as JSON: one object per cluster with the table's columns (sorted keys, stable)."""
    return json.dumps({"tokens": comparison.tokens, "clusters": list(comparison.best.rows)}, indent=2,
                      sort_keys=True) + "\n"
