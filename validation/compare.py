"""Predicted against measured for every captured run: peak and timeline memory, iteration time (default,
held-out calibrated, calibration file) and collective times.

Usage: ``python -m validation.compare DATA [--calibration FILE] [--out DIR] [--json]`` (also
``memsim validate compare``). DATA is a capture folder (validation/data/<device>) with memory/*.json
(validation.measure_memory or the CUDA capture), timing/*.json and collectives.json.

Held-out ("cross-validated") numbers: for each configuration the device is fitted on all the others
(validation.calibrate.fit_device) and predicts it; for each collective buffer size the link is fitted
on the other sizes. Timeline error: the largest vertical gap between the measured and predicted memory
curves as a share of the measured peak, after aligning the phases (forward, backward with recompute,
optimizer with zero_grad) and, inside each phase, placing every event at its share of the bytes the
phase allocates and frees; a gap counts only where no point of the other curve within 1% of the phase
comes as close (so that a one-event reordering is not a gap).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from scipy.ndimage import maximum_filter1d, minimum_filter1d

from simulator.api import simulate
from simulator.errors import DataError, MemsimError
from simulator.io import atomic_write_text
from simulator.scenario import scenario_from_dict
from simulator.topology import apply_calibration, read_calibration
from simulator.workload.graph import BACKWARD_INPUT, BACKWARD_WEIGHT, OPTIMIZER_STEP, RECOMPUTE
from validation.calibrate import fit_device, fit_links, link_bus_bytes
from validation.calibration_data import (
    Dataset, catalog_device, check_same_capture, device_params, load_dataset, predict_iteration_s, read_json,
)
from validation.memory_comparison import scenario_document

__all__ = ["RunComparison", "CollectiveComparison", "ComparisonReport", "compare", "timeline_error",
           "measured_curve", "predicted_curve", "format_report", "main"]

SEGMENTS = ("forward", "backward", "optimizer")
_SEGMENT_OF = {"forward": "forward", "recompute": "backward", "backward": "backward", "optimizer": "optimizer",
               "zero_grad": "optimizer"}
BINS = 1000                  # progress bins per phase
WINDOW_BINS = 10             # +-1% of a phase: tolerance of the timeline gap


@dataclass(frozen=True)
class RunComparison:
    """One captured configuration: memory (bytes) and iteration time (seconds), measured and predicted."""

    name: str
    measured_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    timeline_error: float | None = None            # share of the measured peak
    measured_reserved_bytes: int | None = None     # CUDA: max_memory_reserved
    predicted_reserved_bytes: int | None = None
    measured_s: float | None = None                # median iteration time on the dataset's clock
    spread: float | None = None                    # interquartile range / median of the repetitions
    default_s: float | None = None
    heldout_s: float | None = None
    file_s: float | None = None                    # with the --calibration file

    @staticmethod
    def error(predicted: float | None, measured: float | None) -> float | None:
        """predicted / measured - 1, or None."""
        if predicted is None or not measured:
            return None
        return predicted / measured - 1.0


@dataclass(frozen=True)
class CollectiveComparison:
    """One collective, process count and size: measured median (and IQR/median) against predictions (s)."""

    collective: str
    world_size: int
    size_bytes: int
    measured_s: float
    spread: float
    default_s: float
    heldout_s: float
    file_s: float | None = None


@dataclass(frozen=True)
class ComparisonReport:
    """Every comparison of a capture folder plus summary figures."""

    data_dir: str
    device: str
    clock: str
    runs: tuple[RunComparison, ...]
    collectives: tuple[CollectiveComparison, ...] = ()
    summary: Mapping[str, object] = field(default_factory=dict)
    plots: tuple[str, ...] = ()


# ----------------------------------------------------------------------------------------------------------------
# Memory timelines


Curve = dict[str, tuple[float, np.ndarray, np.ndarray]]   # segment -> (level on entry, progress, level after)


def _segment_curve(start: float, deltas: Sequence[float]) -> tuple[float, np.ndarray, np.ndarray]:
    moved = np.abs(np.asarray(deltas, dtype=float))
    total = moved.sum()
    progress = np.cumsum(moved) / total if total > 0 else np.linspace(0.0, 1.0, len(moved))
    return start, progress, start + np.cumsum(np.asarray(deltas, dtype=float))


def _curve(events: Sequence[tuple[str, float]]) -> Curve:
    """(segment or "setup", delta) events in order -> a Curve (setup events only set the entry level)."""
    level = 0.0
    curve: Curve = {}
    grouped: dict[str, list[float]] = {s: [] for s in SEGMENTS}
    entry = {s: None for s in SEGMENTS}
    for segment, delta in events:
        if segment in grouped:
            if entry[segment] is None:
                entry[segment] = level
            grouped[segment].append(delta)
        level += delta
    previous = 0.0
    for segment in SEGMENTS:
        start = entry[segment] if entry[segment] is not None else previous
        curve[segment] = _segment_curve(start, grouped[segment])
        previous = curve[segment][2][-1] if len(grouped[segment]) else start
    return curve


def measured_curve(document: Mapping[str, object]) -> Curve:
    """The measured memory curve of a CPU memory file (events) or a CUDA capture (allocator trace)."""
    if document.get("format") == "memsim-cuda-memory-1":
        actions = document["trace"]["actions"]
        starts = sorted(document.get("phase_starts", {}).items(), key=lambda item: item[1])
        events = []
        for position, (action, size, _addr) in enumerate(document["trace"]["rows"]):
            phase = "setup"
            for name, start in starts:
                if position >= start:
                    phase = name
            sign = {"alloc": 1, "free_completed": -1}.get(actions[action] if action >= 0 else "", 0)
            if sign:
                events.append((_SEGMENT_OF.get(phase, "setup"), float(sign * size)))
        return _curve(events)
    events_table = document["events"]
    phases = events_table["phases"]
    return _curve([(_SEGMENT_OF.get(phases[row[3]], "setup"), float(row[1])) for row in events_table["rows"]])


def predicted_curve(result) -> Curve:
    """memsim's allocated-memory curve over the measured iteration, split at the phase boundaries of its spans."""
    rank = result.trace.ranks[0]
    bounds = result.trace.iteration_bounds_s
    start, end = bounds[result.scenario.run.warmup_iterations] if len(bounds) > 1 else bounds[-1]
    spans = [s for s in rank.spans if start <= s.start_s and s.end_s <= end]
    backward = min((s.start_s for s in spans if s.phase in (BACKWARD_INPUT, BACKWARD_WEIGHT, RECOMPUTE)), default=end)
    optimizer = min((s.start_s for s in spans if s.phase == OPTIMIZER_STEP), default=end)
    events, previous = [], 0
    for sample in rank.memory:
        if sample.time_s < start:
            previous = sample.allocated
            continue
        if sample.time_s > end:
            break
        segment = "forward" if sample.time_s < backward else "backward" if sample.time_s < optimizer else "optimizer"
        events.append((segment, float(sample.allocated - previous)))
        previous = sample.allocated
    curve = _curve(events)
    entry = float(next((s.allocated for s in reversed(rank.memory) if s.time_s < start), 0))
    first = curve["forward"]
    if first[0] == 0.0 and entry:
        curve = {seg: (c[0] + entry, c[1], c[2] + entry) for seg, c in curve.items()}
    return curve


def _bins(curve: tuple[float, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Lowest and highest level of a step curve in each of BINS progress bins."""
    start, progress, levels = curve
    entering = np.full(BINS, np.nan)
    lo = np.full(BINS, np.inf)
    hi = np.full(BINS, -np.inf)
    if len(progress):
        index = np.minimum((progress * BINS).astype(int), BINS - 1)
        np.minimum.at(lo, index, levels)
        np.maximum.at(hi, index, levels)
        last = np.full(BINS, np.nan)
        last[index] = levels          # the last event of a bin wins (events are in order)
        entering[1:] = last[:-1]
    entering[0] = start
    for b in range(1, BINS):          # forward-fill: the level carried into an empty bin
        if math.isnan(entering[b]):
            entering[b] = hi[b - 1] if False else (last[b - 1] if len(progress) and not math.isnan(last[b - 1])
                                                  else entering[b - 1])
    return np.minimum(lo, entering), np.maximum(hi, entering)


def timeline_error(measured: Curve, predicted: Curve, peak_bytes: float) -> float:
    """Largest gap between two aligned curves as a share of ``peak_bytes`` (see the module docstring)."""
    worst = 0.0
    size = 2 * WINDOW_BINS + 1
    for segment in SEGMENTS:
        m_lo, m_hi = _bins(measured[segment])
        p_lo, p_hi = _bins(predicted[segment])
        gaps = (m_hi - maximum_filter1d(p_hi, size), minimum_filter1d(p_lo, size) - m_lo,
                p_hi - maximum_filter1d(m_hi, size), minimum_filter1d(m_lo, size) - p_lo)
        worst = max(worst, *(float(np.max(g)) for g in gaps))
    return worst / peak_bytes if peak_bytes else 0.0


def _plot(name: str, measured: Curve, predicted: Curve, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for label, curve, style in (("measured (torch)", measured, "-"), ("memsim", predicted, "--")):
        xs, ys = [], []
        for offset, segment in enumerate(SEGMENTS):
            start, progress, levels = curve[segment]
            xs += [offset] + list(offset + progress)
            ys += [start] + list(levels)
        ax.step(xs, np.asarray(ys) / 2**20, style, where="post", label=label, linewidth=1.2)
    for boundary in (1, 2):
        ax.axvline(boundary, color="grey", linewidth=0.6)
    ax.set_xticks([0.5, 1.5, 2.5], ["forward", "backward (+ recompute)", "optimizer + zero_grad"])
    ax.set_ylabel("allocated (MiB)")
    ax.set_title(name)
    ax.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
