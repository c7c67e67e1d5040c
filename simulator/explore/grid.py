"""Sweep grids: axes from --grid and [sweep] grid, their product in a fixed order, each point as overrides."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from simulator.errors import ScenarioError
from simulator.scenario.loader import grid_axis, parse_override_value

MAX_POINTS = 1_000_000      # a larger product is refused (its table alone would not fit in memory usefully)

Axis = tuple[str, tuple]    # ("parallel.tp", (1, 2, 4))


@dataclass(frozen=True)
class Point:
    """One point of a sweep: its position in the product and one value per axis."""

    index: int
    keys: tuple[str, ...]
    values: tuple

    @property
    def overrides(self) -> tuple[str, ...]:
        """The point as --set items ("parallel.tp=2", 'cluster.topology="dgx-a100"')."""
        return tuple(f"{key}={toml_value(value)}" for key, value in zip(self.keys, self.values))

    @property
    def label(self) -> str:
        """The point in one line: "parallel.tp=2 cluster.topology=dgx-a100"."""
        return " ".join(f"{key}={value if isinstance(value, str) else toml_value(value)}"
                        for key, value in zip(self.keys, self.values)) or "(the scenario as written)"


def toml_value(value: object) -> str:
    """`value` written as a TOML value (what parse_override_value reads back as the same value)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)   # a TOML basic string for every character JSON escapes
    return repr(value)


def parse_grid_option(item: str, source: str) -> Axis:
    """One --grid item, "section.key=V1,V2,...", as an axis (each value read like a --set value).

    Raises:
        ScenarioError: no '=', an unknown key path, no values, a value the key does not accept, or a repeat.
    """
    where = f"--grid {item}"
    if not isinstance(item, str) or "=" not in item:
        raise ScenarioError(f"{source}: {where}: expected KEY=V1,V2,..., e.g. parallel.tp=1,2,4")
    key_path, _, text = item.partition("=")
    values = [parse_override_value(part) for part in text.split(",")] if text.strip() else []
    if any(value == "" for value in values):
        raise ScenarioError(f"{source}: {where}: an empty value (two commas, or a comma at an end)")
    return grid_axis(key_path, values, source, where)


def merge_axes(file_axes: tuple[Axis, ...], option_axes: list[Axis], source: str) -> tuple[Axis, ...]:
    """The [sweep] grid's axes, each replaced by a --grid axis of the same key, then the other --grid axes.

    Raises:
        ScenarioError: a key given twice with --grid.
    """
    seen: set[str] = set()
    for key, _ in option_axes:
        if key in seen:
            raise ScenarioError(f"{source}: --grid {key}: given twice (put every value in one --grid {key}=A,B)")
        seen.add(key)
    replaced = dict(option_axes)
    merged = [(key, replaced.pop(key, values)) for key, values in file_axes]
    return tuple(merged + [(key, values) for key, values in option_axes if key in replaced])


def expand(axes: tuple[Axis, ...], source: str) -> list[Point]:
    """Every point of the product, the first axis varying slowest (itertools.product order).

    Raises:
        ScenarioError: more than MAX_POINTS points.
    """
    count = 1
    for _, values in axes:
        count *= len(values)
    if count > MAX_POINTS:
        sizes = " x ".join(str(len(values)) for _, values in axes)
        raise ScenarioError(f"{source}: the grid has {sizes} = {count:,} points; at most {MAX_POINTS:,} are allowed")
    keys = tuple(key for key, _ in axes)
    return [Point(index, keys, values)
            for index, values in enumerate(itertools.product(*(values for _, values in axes)))]
