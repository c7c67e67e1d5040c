"""The columnar estimate: report fields of many plans at once (table.py), for plan searches and `sweep --fast`."""

from simulator.explore.columnar.table import Columns, estimate_columns, estimate_table, report_fields

__all__ = ["Columns", "estimate_columns", "estimate_table", "report_fields"]
