"""Predicted against measured for every captured run: peak and timeline memory, iteration time (default,
held-out calibrated, calibration file) and collective times.

Usage: ``python -m validation.compare DATA [--calibration FILE] [--repeat DIR] [--out DIR] [--json]`` (also
``memsim validate compare``). DATA is a capture folder (validation/data/<device>) with memory/*.json
(validation.measure_memory or the CUDA capture), timing/*.json and collectives.json.

Held-out ("cross-validated") numbers: for each configuration the device is fitted on all the others
(validation.calibrate.fit_device) and predicts it; for each collective buffer size the link is fitted
on the other sizes. Timeline error: the largest vertical gap between the measured and predicted memory
curves as a share of the measured peak, after aligning the phases (forward, backward with recompute,
optimizer with zero_grad) and, inside each phase, giving every event (one storage in the measurement, one
allocate or free call in memsim) its share of the bytes the phase allocates and frees, over which the
level ramps linearly -- so a group of frees memsim makes at once lines up with the same frees made one by
one; a gap counts only where no point of the other curve within 1% of the phase comes as close.
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

from simulator.api import build_workload, simulate
from simulator.errors import DataError, MemsimError
from simulator.io import atomic_write_text
from simulator.network.collectives import collective_time_s
from simulator.network.topology import load_topology
from simulator.scenario import scenario_from_dict
from simulator.topology import apply_calibration, read_calibration, resolve_cluster
from simulator.workload.graph import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, OPTIMIZER_STEP, RECOMPUTE
from validation.calibrate import fit_device, fit_links, link_bus_bytes
from validation.calibration_data import (
    Dataset, catalog_device, check_same_capture, device_params, load_dataset, predict_iteration_s, read_json,
)
from validation.memory_comparison import scenario_document

__all__ = ["RunComparison", "CollectiveComparison", "ComparisonReport", "compare", "repeat_noise", "timeline_error",
           "measured_curve", "predicted_curve", "format_report", "report_dict", "main"]

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
        events = [("setup", float(document["results"]["before_step"]["allocated_bytes"]))]
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


_PHASE_SEGMENT = {FORWARD: "forward", BACKWARD_INPUT: "backward", BACKWARD_WEIGHT: "backward",
                  RECOMPUTE: "backward", OPTIMIZER_STEP: "optimizer"}


def predicted_curve(result, workload) -> Curve:
    """memsim's allocated-memory curve over the last simulated iteration, each sample labelled by its instruction.

    The engine records one memory sample per Alloc/Free instruction and one per op that allocates or frees,
    so the last iteration is the last 3 + sum(allocs? + frees?) samples (micro-batch inputs, ops, input
    release, zero_grad; one micro-batch per step); its inputs count as set-up, as in the measurement.
    """
    labels = ["setup"]
    for op in [*workload.first_microbatch, "inputs", *workload.optimizer, "zero_grad"]:
        if isinstance(op, str):
            labels.append("optimizer")
            continue
        labels += [_PHASE_SEGMENT[op.phase]] * (bool(op.allocs) + bool(op.frees))
    samples = result.trace.ranks[0].memory
    if len(samples) <= len(labels):
        raise DataError(f"{result.scenario.source}: the simulation recorded {len(samples)} memory samples, fewer "
                        f"than one iteration ({len(labels)})")
    window = samples[-len(labels):]
    previous = samples[-len(labels) - 1].allocated
    events = [("setup", float(previous))]
    for label, sample in zip(labels, window):
        events.append((label, float(sample.allocated - previous)))
        previous = sample.allocated
    return _curve(events)


def _points(curve: tuple[float, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The curve as (progress, level) corner points: each event ramps linearly over its share of the bytes."""
    start, progress, levels = curve
    return np.concatenate([[0.0], progress]), np.concatenate([[start], levels])


def _bins(curve: tuple[float, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Lowest and highest level of the piecewise-linear curve in each of BINS progress bins."""
    xs, ys = _points(curve)
    edges = np.linspace(0.0, 1.0, BINS + 1)
    at_edges = np.interp(edges, xs, ys)
    lo = np.minimum(at_edges[:-1], at_edges[1:])
    hi = np.maximum(at_edges[:-1], at_edges[1:])
    index = np.minimum((xs * BINS).astype(int), BINS - 1)
    np.minimum.at(lo, index, ys)
    np.maximum.at(hi, index, ys)
    return lo, hi


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
            px, py = _points(curve[segment])
            xs += list(offset + px)
            ys += list(py)
        ax.plot(xs, np.asarray(ys) / 2**20, style, label=label, linewidth=1.1)
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


# ----------------------------------------------------------------------------------------------------------------
# Comparisons


def _memory_scenario(name: str, document: Mapping[str, object]) -> dict:
    """The scenario that predicts a memory capture: the cpu device with the exact allocator, or the GPU
    with the caching allocator."""
    doc = scenario_document(name, dict(document["config"]))
    if document.get("format") == "memsim-cuda-memory-1":
        env = document["environment"]
        doc["cluster"] = {"topology": catalog_device("cuda", str(env.get("device_name", ""))).name}
        doc["allocator"] = {"kind": "caching"}
    doc["run"] = {"warmup_iterations": int(document.get("protocol", {}).get("warmup_steps", 1)) if document.get("format") == "memsim-cuda-memory-1" else 1, "iterations": 1, "record_events": False}
    return doc


def _memory_runs(root: Path, reference: Mapping[str, object] | None, plots: Path | None) -> dict[str, dict]:
    """Peak, reserved and timeline comparisons of every memory/*.json (name -> RunComparison fields)."""
    found: dict[str, dict] = {}
    for path in sorted((root / "memory").glob("*.json")):
        if path.name == "summary.json":
            continue
        document = read_json(path, "memory capture", ("name", "config", "environment"))
        if reference is not None:
            env = {**document["environment"], "device": document.get("device", reference.get("device"))}
            check_same_capture(path, env, {k: reference.get(k) for k in ("torch_version", "device")}, "timing/")
        scenario = scenario_from_dict(_memory_scenario(document["name"], document), source=str(path))
        result = simulate(scenario)
        workload = build_workload(scenario, resolve_cluster(scenario).device)
        rank = result.report["ranks"][0]
        cuda = document.get("format") == "memsim-cuda-memory-1"
        try:
            if cuda:
                peak = int(document["results"]["max_memory_allocated_bytes"])
                reserved = int(document["results"]["max_memory_reserved_bytes"])
            else:
                peak, reserved = int(document["results"]["peak_allocated_bytes"]), None
            measured = measured_curve(document)
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise DataError(f"{path}: malformed memory capture ({error!r})") from None
        predicted = predicted_curve(result, workload)
        found[document["name"]] = {
            "measured_peak_bytes": peak, "predicted_peak_bytes": int(rank["peak_allocated_bytes"]),
            "timeline_error": timeline_error(measured, predicted, peak),
            "measured_reserved_bytes": reserved,
            "predicted_reserved_bytes": int(rank["peak_reserved_bytes"]) if cuda else None,
        }
        if plots is not None:
            _plot(document["name"], measured, predicted, plots / f"{document['name']}.png")
    return found


def _time_runs(dataset: Dataset, calibration: Path | None) -> dict[str, dict]:
    """Iteration time: measured, default device, held-out fit (leave one configuration out), calibration file."""
    device = dataset.device_spec
    default = device_params(device)
    file_params = None
    if calibration is not None:
        loaded = read_calibration(calibration)
        if loaded.torch_version and loaded.torch_version != dataset.torch_version:
            raise DataError(f"{calibration}: fitted on torch {loaded.torch_version} but {dataset.root} was captured "
                            f"with torch {dataset.torch_version}")
        file_params = device_params(apply_calibration(device, loaded))
    found = {}
    for name in dataset.names:
        others = [n for n in dataset.names if n != name]
        heldout = fit_device(dataset, others) if others else None
        spread = dataset.timing[name]["iteration"][dataset.clock]
        features = dataset.features[name]
        found[name] = {
            "measured_s": dataset.iteration_s[name], "spread": float(spread["iqr_over_median"]),
            "default_s": predict_iteration_s(features, device, default),
            "heldout_s": predict_iteration_s(features, device, heldout.params) if heldout else None,
            "file_s": predict_iteration_s(features, device, file_params) if file_params else None,
        }
    return found


def _capture_topology(environment: Mapping[str, object]):
    """The topology an NCCL capture names (validation.collectives --topology), else None (gloo)."""
    name = environment.get("topology")
    if environment.get("backend") != "nccl" or not name:
        return None
    try:
        return load_topology(str(name))
    except MemsimError as error:
        raise DataError(f"collectives.json: topology = {name!r}: {error}") from None


def _default_collective_s(topology, device, kind: str, world: int, size: int) -> float:
    """memsim's uncalibrated prediction: the network model on the capture's topology (NCCL), else launch
    overhead + bus bytes at half the device's copy bandwidth (gloo over loopback)."""
    if topology is not None:
        if world > topology.num_gpus:
            raise DataError(f"collectives.json: world size {world} is larger than topology {topology.name!r} "
                            f"({topology.num_gpus} GPUs)")
        return collective_time_s(topology, kind, tuple(range(world)), float(size))
    return device.launch_overhead_s + link_bus_bytes(kind, world, float(size)) / (device.hbm_bytes_per_s / 2)


def _collectives(dataset: Dataset, calibration: Path | None) -> tuple[CollectiveComparison, ...]:
    """Collective times: default (_default_collective_s), held out by size, calibration file."""
    if not dataset.collectives:
        return ()
    results = dataset.collectives["results"]
    topology = _capture_topology(dataset.collectives.get("environment", {}))
    device = dataset.device_spec
    links = {}
    if calibration is not None:
        links = {(l.collective, l.world_size): l for l in read_calibration(calibration).links}
    heldout = {}
    for size in sorted({int(r["size_bytes"]) for r in results}):
        heldout[size] = {(f.collective, f.world_size): f for f in fit_links(results, bootstrap=0, exclude_size=size)}
    rows = []
    for r in results:
        key = (str(r["collective"]), int(r["world_size"]))
        bus = link_bus_bytes(key[0], key[1], float(r["size_bytes"]))
        fit = heldout[int(r["size_bytes"])].get(key)
        link = links.get(key)
        rows.append(CollectiveComparison(
            key[0], key[1], int(r["size_bytes"]), float(r["median_s"]), float(r["iqr_over_median"]),
            _default_collective_s(topology, device, key[0], key[1], int(r["size_bytes"])),
            fit.latency_s + bus / fit.bytes_per_s if fit else math.nan,
            link.latency_s + bus / link.bytes_per_s if link else None))
    return tuple(rows)


def repeat_noise(data_dir: str | Path, repeat_dir: str | Path) -> tuple[tuple[str, float, float], ...]:
    """(name, median here, median in the repeat) for every configuration both folders captured (seconds).

    Two captures of the same configurations with the same code measure the machine's run-to-run noise.

    Raises:
        DataError: a folder is missing or corrupt, or the two come from different torch versions or devices.
    """
    first, second = load_dataset(data_dir), load_dataset(repeat_dir)
    check_same_capture(Path(repeat_dir), {"torch_version": second.torch_version, "device": second.device},
                       {"torch_version": first.torch_version, "device": first.device}, str(data_dir))
    return tuple((n, first.iteration_s[n], second.iteration_s[n]) for n in first.names if n in second.iteration_s)


def _median_abs(values: Sequence[float | None]) -> float | None:
    present = [abs(v) for v in values if v is not None and math.isfinite(v)]
    return statistics.median(present) if present else None


def compare(data_dir: str | Path, calibration: str | Path | None = None, out_dir: str | Path | None = None,
            repeat: str | Path | None = None) -> ComparisonReport:
    """Compare memsim with every captured run of a capture folder.

    Args:
        data_dir: capture folder (memory/, timing/, collectives.json; memory alone is enough).
        calibration: a calibration file to evaluate as well (in-sample if fitted on this data).
        out_dir: write one PNG per memory capture (measured and predicted timelines) and report.json here.
        repeat: a second capture of the same configurations: adds the run-to-run difference of the medians.

    Raises:
        DataError: missing or corrupt data, captures from different torch versions or devices, a calibration
            file from another torch version.
        TopologyError: a calibration file for another device.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"{root}: capture folder not found (expected validation/data/<device>)")
    has_timing = any((root / "timing").glob("*.json"))
    dataset = load_dataset(root) if has_timing else None
    calibration_path = Path(calibration) if calibration is not None else None
    reference = None
    if dataset is not None:
        reference = {"torch_version": dataset.torch_version, "device": dataset.device}
    plots = Path(out_dir) if out_dir is not None else None
    memory = _memory_runs(root, reference, plots)
    if not memory and dataset is None:
        raise DataError(f"{root}: no memory/*.json or timing/*.json capture files (run `memsim validate capture`)")
    times = _time_runs(dataset, calibration_path) if dataset is not None else {}
    names = list(dict.fromkeys([*memory, *times]))
    runs = tuple(RunComparison(name, **memory.get(name, {}), **times.get(name, {})) for name in names)
    collectives = _collectives(dataset, calibration_path) if dataset is not None else ()
    summary = _summary(runs, collectives)
    if repeat is not None:
        pairs = repeat_noise(root, repeat)
        summary["repeat_configurations"] = len(pairs)
        summary["median_abs_run_to_run_difference"] = _median_abs([b / a - 1 for _, a, b in pairs])
        summary["max_abs_run_to_run_difference"] = max((abs(b / a - 1) for _, a, b in pairs), default=None)
    report = ComparisonReport(str(root), dataset.device if dataset else "cpu", dataset.clock if dataset else "",
                              runs, collectives, summary,
                              tuple(str(plots / f"{n}.png") for n in memory) if plots else ())
    if plots is not None:
        atomic_write_text(plots / "report.json", json.dumps(report_dict(report), indent=1) + "\n")
    return report


def _summary(runs: Sequence[RunComparison], collectives: Sequence[CollectiveComparison]) -> dict[str, object]:
    error = RunComparison.error
    peaks = [error(r.predicted_peak_bytes, r.measured_peak_bytes) for r in runs]
    summary: dict[str, object] = {
        "max_abs_peak_error": max((abs(p) for p in peaks if p is not None), default=None),
        "max_timeline_error": max((r.timeline_error for r in runs if r.timeline_error is not None), default=None),
        "max_abs_reserved_error": max((abs(e) for e in (error(r.predicted_reserved_bytes, r.measured_reserved_bytes)
                                                        for r in runs) if e is not None), default=None),
        "median_abs_time_error_default": _median_abs([error(r.default_s, r.measured_s) for r in runs]),
        "median_abs_time_error_heldout": _median_abs([error(r.heldout_s, r.measured_s) for r in runs]),
        "median_abs_time_error_file": _median_abs([error(r.file_s, r.measured_s) for r in runs]),
        "median_time_spread": _median_abs([r.spread for r in runs]),
        "median_abs_collective_error_default": _median_abs([error(c.default_s, c.measured_s) for c in collectives]),
        "median_abs_collective_error_heldout": _median_abs([error(c.heldout_s, c.measured_s) for c in collectives]),
        "median_abs_collective_error_file": _median_abs([error(c.file_s, c.measured_s) for c in collectives]),
        "median_collective_spread": _median_abs([c.spread for c in collectives]),
    }
    return summary


def report_dict(report: ComparisonReport) -> dict[str, object]:
    """The report as JSON-ready data."""
    return {"data_dir": report.data_dir, "device": report.device, "clock": report.clock,
            "runs": [asdict(r) for r in report.runs], "collectives": [asdict(c) for c in report.collectives],
            "summary": dict(report.summary), "plots": list(report.plots)}


def _pct(value: float | None, width: int = 8) -> str:
    return f"{100 * value:+{width - 1}.2f}%" if value is not None and math.isfinite(value) else " " * (width - 1) + "-"


def _ms(value: float | None) -> str:
    return f"{value * 1e3:9.2f}" if value is not None and math.isfinite(value) else "        -"


def format_report(report: ComparisonReport) -> str:
    """The comparison as plain-text tables (errors are predicted / measured - 1)."""
    error = RunComparison.error
    lines = [f"memsim vs measured: {report.data_dir} (device {report.device}; times on the {report.clock or '-'} "
             f"clock, held-out = fitted on the other configurations)", "",
             f"{'configuration':46s} {'peak err':>8s} {'timeline':>8s} {'reserved':>8s} {'measured':>9s} "
             f"{'IQR':>6s} {'default':>9s} {'err':>8s} {'held-out':>9s} {'err':>8s} {'file':>9s} {'err':>8s}",
             f"{'':46s} {'':>8s} {'(of pk)':>8s} {'err':>8s} {'ms':>9s} {'':>6s} {'ms':>9s} {'':>8s} {'ms':>9s} "
             f"{'':>8s} {'ms':>9s} {'':>8s}"]
    for r in report.runs:
        timeline = f"{100 * r.timeline_error:7.2f}%" if r.timeline_error is not None else "       -"
        spread = f"{100 * r.spread:5.1f}%" if r.spread is not None else "     -"
        lines.append(f"{r.name:46s} {_pct(error(r.predicted_peak_bytes, r.measured_peak_bytes))} {timeline} "
                     f"{_pct(error(r.predicted_reserved_bytes, r.measured_reserved_bytes))} {_ms(r.measured_s)} "
                     f"{spread} {_ms(r.default_s)} {_pct(error(r.default_s, r.measured_s))} {_ms(r.heldout_s)} "
                     f"{_pct(error(r.heldout_s, r.measured_s))} {_ms(r.file_s)} {_pct(error(r.file_s, r.measured_s))}")
    if report.collectives:
        lines += ["", f"{'collective':15s} {'n':>2s} {'bytes':>9s} {'measured':>9s} {'IQR':>6s} {'default':>9s} "
                      f"{'err':>8s} {'held-out':>9s} {'err':>8s} {'file':>9s} {'err':>8s}"]
        for c in report.collectives:
            lines.append(f"{c.collective:15s} {c.world_size:2d} {c.size_bytes:9d} {_ms(c.measured_s)} "
                         f"{100 * c.spread:5.1f}% {_ms(c.default_s)} {_pct(error(c.default_s, c.measured_s))} "
                         f"{_ms(c.heldout_s)} {_pct(error(c.heldout_s, c.measured_s))} {_ms(c.file_s)} "
                         f"{_pct(error(c.file_s, c.measured_s))}")
    lines += ["", "summary:"]
    for key, value in report.summary.items():
        if isinstance(value, int):
            lines.append(f"  {key:40s} {value:8d}")
        elif value is not None:
            lines.append(f"  {key:40s} {100 * value:8.2f}%")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 on bad input)."""
    parser = argparse.ArgumentParser(prog="python -m validation.compare", description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, help="capture folder (validation/data/<device>)")
    parser.add_argument("--calibration", type=Path, default=None, help="calibration file to evaluate too")
    parser.add_argument("--out", type=Path, default=None, help="write PNG timelines and report.json here")
    parser.add_argument("--repeat", type=Path, default=None, help="a second capture: run-to-run noise")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = compare(args.data, args.calibration, args.out, args.repeat)
    except MemsimError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    sys.stdout.write(json.dumps(report_dict(report), indent=1) + "\n" if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
