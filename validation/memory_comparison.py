"""Predict measured CPU training steps with memsim (cpu device, exact allocator) and compare memory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from simulator.api import simulate
from simulator.errors import DataError
from simulator.scenario import scenario_from_dict
from simulator.workload.graph import CATEGORIES

DATA_DIR = Path(__file__).parent / "data" / "cpu" / "memory"


@dataclass(frozen=True)
class MemoryComparison:
    """Measured against predicted peaks of one configuration (bytes, and relative errors)."""

    name: str
    measured_peak: int
    predicted_peak: int
    measured_categories: dict[str, int]
    predicted_categories: dict[str, int]

    @property
    def peak_error(self) -> float:
        return self.predicted_peak / self.measured_peak - 1.0

    def category_error(self, category: str) -> float:
        """Relative error of a category's own peak (0 when both are 0)."""
        measured = self.measured_categories[category]
        predicted = self.predicted_categories[category]
        if measured == 0:
            return 0.0 if predicted == 0 else float("inf")
        return predicted / measured - 1.0


def scenario_document(name: str, config: dict) -> dict:
    """The memsim scenario for a measured configuration: its model and training on the cpu device."""
    return {
        "name": name,
        "model": dict(config["model"]),
        "training": dict(config["training"]),
        "cluster": {"topology": "cpu"},
        "allocator": {"kind": "exact"},
        "run": {"warmup_iterations": 1, "iterations": 1, "record_events": False},
    }


def predict(name: str, config: dict) -> tuple[int, dict[str, int]]:
    """memsim's peak allocated bytes and per-category peaks for one configuration."""
    result = simulate(scenario_from_dict(scenario_document(name, config), source=f"<{name}>"))
    rank = result.report["ranks"][0]
    return rank["peak_allocated_bytes"], dict(rank["category_peaks"])


def load_measurement(path: Path) -> dict:
    """Read one measured configuration (validation/data/cpu/memory/<name>.json)."""
    try:
        data = json.loads(path.read_text())
        data["config"], data["results"]["peak_allocated_bytes"]
    except FileNotFoundError:
        raise DataError(f"{path}: measured data file not found") from None
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise DataError(f"{path}: not a memsim memory measurement ({error})") from None
    return data


def compare(path: Path) -> MemoryComparison:
    """Compare memsim with one measured configuration file."""
    data = load_measurement(path)
    results = data["results"]
    peak, categories = predict(data["name"], data["config"])
    return MemoryComparison(data["name"], results["peak_allocated_bytes"], peak,
                            {c: results["category_peaks_bytes"][c] for c in CATEGORIES}, categories)


def measured_files(directory: Path = DATA_DIR) -> list[Path]:
    """Every measured configuration file, in name order (summary.json excluded)."""
    return sorted(p for p in directory.glob("*.json") if p.name != "summary.json")


def main() -> int:
    """Print the comparison table for every committed measurement."""
    print(f"{'configuration':48s} {'measured':>12s} {'memsim':>12s} {'error':>8s}  worst category")
    for path in measured_files():
        c = compare(path)
        worst = max(CATEGORIES, key=lambda cat: abs(c.category_error(cat)))
        print(f"{c.name:48s} {c.measured_peak:12d} {c.predicted_peak:12d} {100 * c.peak_error:+7.3f}%  "
              f"{worst} {100 * c.category_error(worst):+.3f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
