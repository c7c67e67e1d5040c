"""The sweep table: every point's keys, outcome, cost and energy; written as CSV and Parquet bytes.

A point's outcome comes from a report dict, of the full simulation or of the fast estimate alike
(`outcome_of`); cost and energy are added from the price table when the rows are made, so the journal holds
only what was simulated. Rows are in point order and hold no timestamps: the same sweep gives the same bytes.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass

from simulator.explore.cost import (
    ClusterShape, PriceTable, Pricing, busy_fraction, per_million_tokens, token_budget,
)

# What the journal keeps of a report, with the column type of each.
OUTCOME_COLUMNS = (
    ("fits", "bool"), ("peak_allocated_bytes", "int"), ("peak_reserved_bytes", "int"),
    ("iteration_time_s", "float"), ("tokens_per_s", "float"), ("mfu", "float"), ("bubble_fraction", "float"),
    ("exposed_communication_s", "float"), ("busy_fraction", "float"), ("estimate", "bool"),
)
COST_COLUMNS = (("usd_per_million_tokens", "float"), ("kwh_per_million_tokens", "float"))
BUDGET_COLUMNS = (("time_to_train_s", "float"), ("usd", "float"), ("kwh", "float"))


def outcome_of(report: dict) -> dict:
    """The table's metrics of one report (`memsim run --json` shape; "estimate": true for the fast estimate).

    Peaks are the largest over the report's ranks (one or more per pipeline stage), like the fit verdict.
    """
    ranks = report["ranks"]
    return {
        "fits": bool(report["fits"]),
        "peak_allocated_bytes": max(int(rank["peak_allocated_bytes"]) for rank in ranks),
        "peak_reserved_bytes": max(int(rank["peak_reserved_bytes"]) for rank in ranks),
        "iteration_time_s": float(report["iteration_time_s"]),
        "tokens_per_s": float(report["tokens_per_s"]),
        "mfu": float(report["mfu"]),
        "bubble_fraction": float(report["bubble_fraction"]),
        "exposed_communication_s": float(report["communication"]["exposed_s"]),
        "busy_fraction": busy_fraction(report),
        "estimate": bool(report.get("estimate", False)),
    }


@dataclass(frozen=True)
class PointCheck:
    """What checking a point found: the error a run would give, or the cluster it runs on and its plan."""

    reason: str | None
    shape: ClusterShape | None = None
    plan: tuple[int, int, int] = (1, 1, 1)        # (dp, tp, pp)


@dataclass(frozen=True)
class Table:
    """Columns (name, type) and rows (one dict per point, None where a value does not apply)."""

    columns: tuple[tuple[str, str], ...]
    rows: tuple[dict, ...]


def axis_type(values: tuple) -> str:
    """The column type of an axis: int, float or bool when every value is one, else str."""
    if all(isinstance(v, bool) for v in values):
        return "bool"
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return "int"
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return "float"
    return "str"


def build_table(axes, points, checks: list[PointCheck], outcomes: dict[int, dict], prices: PriceTable,
                pricing: Pricing, tokens: float | None) -> Table:
    """The rows of every checked point: invalid ones with their reason, finished ones with outcome and cost.

    Points that are valid but have no outcome yet (an interrupted sweep) are left out.
    """
    kinds = [(key, axis_type(values)) for key, values in axes]
    columns = (("point", "int"), *kinds, ("device", "str"), ("gpus", "int"), ("dp", "int"), ("tp", "int"),
               ("pp", "int"), ("status", "str"), ("reason", "str"), *OUTCOME_COLUMNS, *COST_COLUMNS,
               *(BUDGET_COLUMNS if tokens is not None else ()))
    rows = []
    for point, check in zip(points, checks):
        outcome = outcomes.get(point.index)
        if check.reason is None and outcome is None:
            continue
        row = dict.fromkeys(name for name, _ in columns)
        row["point"] = point.index
        for (key, kind), value in zip(kinds, point.values):
            row[key] = str(value) if kind == "str" else value
        reason = check.reason if check.reason is not None else outcome.get("error")
        if check.shape is not None:
            row.update(device=check.shape.device, gpus=check.shape.gpus)
            row["dp"], row["tp"], row["pp"] = check.plan
        row["status"] = "invalid" if reason is not None else "ok"
        row["reason"] = reason
        if reason is None:
            row.update({name: outcome[name] for name, _ in OUTCOME_COLUMNS})
            if outcome["fits"] and outcome["tokens_per_s"] > 0:
                usd, kwh = per_million_tokens(prices, check.shape, pricing, outcome["tokens_per_s"],
                                              outcome["busy_fraction"])
                row.update(usd_per_million_tokens=usd, kwh_per_million_tokens=kwh)
                if tokens is not None:
                    budget = token_budget(tokens, outcome["tokens_per_s"], usd, kwh)
                    row.update(time_to_train_s=budget.time_s, usd=budget.usd, kwh=budget.kwh)
        rows.append(row)
    return Table(columns, tuple(rows))


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)            # shortest text that reads back as the same float
    return str(value)


def csv_bytes(table: Table) -> bytes:
    """The table as CSV (a header, then one line per row; empty cells where a value does not apply)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([name for name, _ in table.columns])
    for row in table.rows:
        writer.writerow([_cell(row[name]) for name, _ in table.columns])
    return buffer.getvalue().encode("utf-8")


def parquet_bytes(table: Table) -> bytes:
    """The table as Parquet (typed columns, nulls where a value does not apply)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string()}
    schema = pa.schema([(name, types[kind]) for name, kind in table.columns])
    arrays = {name: [row[name] for row in table.rows] for name, _ in table.columns}
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pydict(arrays, schema=schema), buffer)
    return buffer.getvalue()
