"""Measure one training step's memory timeline per named configuration and write the data files.

Usage: ``python -m validation.measure_memory [--configs FILE] [--out DIR] [--only NAME] [--threads N]``

Protocol per configuration: seed torch, build model + optimizer, run 2 warm-up steps (forward,
loss, backward, optimizer.step, zero_grad(set_to_none=True)), create the input/target tensors, then
track one step with validation.tracker.MemoryTracker. Writes ``<out>/<name>.json`` and updates
``<out>/summary.json`` (name -> peak and category peaks). All sizes are in bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from simulator.errors import DataError, MemsimError, ScenarioError
from simulator.workload.graph import CATEGORIES
from validation.torch_models import (
    build_model, build_optimizer, make_batch, parse_model, parse_training, train_step,
)
from validation.tracker import PHASES, MemoryTracker, TrackedStep

__all__ = ["load_configs", "measure", "step_report", "main", "DEFAULT_CONFIGS", "DEFAULT_OUT", "WARMUP_STEPS"]

_HERE = Path(__file__).resolve().parent
DEFAULT_CONFIGS = _HERE / "configs" / "cpu_memory.toml"
DEFAULT_OUT = _HERE / "data" / "cpu" / "memory"
WARMUP_STEPS = 2
SEED = 0
EVENT_COLUMNS = ("seq", "delta_bytes", "category", "phase", "op", "storage", "module")


def load_configs(path: Path) -> dict[str, dict[str, dict[str, object]]]:
    """Read the configurations file: one top-level table per name, each with model and training tables.

    Raises:
        DataError: the file is missing or not TOML.
        ScenarioError: a configuration lacks its model/training tables or has other keys.
    """
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise DataError(f"{path}: cannot read configurations ({exc})") from exc
    configs = {}
    for name, table in data.items():
        if not isinstance(table, dict) or set(table) != {"model", "training"}:
            keys = sorted(table) if isinstance(table, dict) else type(table).__name__
            raise ScenarioError(f"{path}: {name} = {keys} must be a table with exactly model and training tables")
        configs[name] = {"model": dict(table["model"]), "training": dict(table["training"])}
    return configs


def measure(config: Mapping[str, Mapping[str, object]], seed: int = SEED) -> tuple[TrackedStep, dict[str, object]]:
    """Build, warm up and track one step of a configuration.

    Returns:
        The tracked step and the resolved specs ({"model": ..., "training": ...}).
    """
    model_spec, training_spec = parse_model(config["model"]), parse_training(config["training"])
    torch.manual_seed(seed)
    model = build_model(model_spec, training_spec)
    optimizer = build_optimizer(model, training_spec)
    for _ in range(WARMUP_STEPS):
        idx, targets = make_batch(model_spec, training_spec)
        train_step(model, optimizer, idx, targets, training_spec)
    del idx, targets
    idx, targets = make_batch(model_spec, training_spec)
    tracker = MemoryTracker(model, optimizer, {"idx": idx, "targets": targets})
    with tracker:
        train_step(model, optimizer, idx, targets, training_spec, on_phase=tracker.set_phase)
    resolved = {"model": dataclasses.asdict(model_spec), "training": dataclasses.asdict(training_spec)}
    return tracker.result(), resolved


def step_report(step: TrackedStep) -> dict[str, object]:
    """Peaks, breakdown at the peak and the compact event table of a tracked step."""
    peak, peak_seq = step.peak()
    peak_event = step.events[peak_seq]
    peak_storage = step.storages[peak_event.storage]
    setup = step.live_by_category_at(max((e.seq for e in step.events if e.phase == "setup"), default=-1))
    end = step.live_by_category_at(len(step.events) - 1)
    ops: dict[str, int] = {}
    modules: dict[str, int] = {}
    rows = []
    for event in step.events:
        record = step.storages[event.storage]
        rows.append([event.seq, event.delta_bytes, CATEGORIES.index(record.category), PHASES.index(event.phase),
                     ops.setdefault(record.op, len(ops)), event.storage,
                     modules.setdefault(record.module, len(modules))])
    return {
        "results": {
            "peak_allocated_bytes": peak,
            "peak_seq": peak_seq,
            "peak_op": peak_storage.op,
            "peak_phase": peak_event.phase,
            "peak_module": peak_storage.module,
            "breakdown_at_peak": step.live_by_category_at(peak_seq),
            "category_peaks_bytes": step.category_peaks(),
            "phase_peaks_bytes": step.phase_peaks(),
            "setup_bytes": setup,
            "end_bytes": end,
            "num_storages": len(step.storages),
            "num_events": len(step.events),
            "cycle_garbage_bytes": step.cycle_garbage_bytes,
        },
        "dispatched_ops": step.dispatched_ops,
        "storages": {
            "columns": ["nbytes", "dtype"],
            "rows": [[s.nbytes, s.dtype] for s in step.storages],
        },
        "events": {
            "columns": list(EVENT_COLUMNS),
            "note": "delta_bytes > 0 allocates, < 0 frees; op and module are those that allocated the storage; "
                    "phase is when the event happened",
            "categories": list(CATEGORIES),
            "phases": list(PHASES),
            "ops": list(ops),
            "modules": list(modules),
            "rows": rows,
        },
    }


def environment() -> dict[str, object]:
    """Torch and Python versions, thread count, CPU model and the date (UTC)."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "num_threads": torch.get_num_threads(),
        "cpu_model": cpu,
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
    }


def _dump(data: Mapping[str, object]) -> str:
    """JSON with one event row per line (diff-friendly) and the rest indented."""
    rows = data["events"]["rows"]  # type: ignore[index]
    marker = "__EVENT_ROWS__"
    shallow = {**data, "events": {**data["events"], "rows": marker}}  # type: ignore[dict-item]
    text = json.dumps(shallow, indent=1)
    body = "[\n" + ",\n".join(json.dumps(r, separators=(",", ":")) for r in rows) + "\n  ]"
    return text.replace(json.dumps(marker), body) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run(configs_path: Path, out_dir: Path, only: Sequence[str], threads: int) -> dict[str, object]:
    """Measure the selected configurations, write their files and update summary.json; return the summary."""
    configs = load_configs(configs_path)
    unknown = [n for n in only if n not in configs]
    if unknown:
        raise ScenarioError(f"--only {unknown[0]} is not a configuration in {configs_path}; "
                            f"allowed: {', '.join(configs)}")
    torch.set_num_threads(threads)
    summary_path = out_dir / "summary.json"
    summary: dict[str, object] = {}
    if only and summary_path.exists():
        summary = json.loads(summary_path.read_text())
    env = environment()
    for name in (only or list(configs)):
        step, resolved = measure(configs[name])
        report = step_report(step)
        data = {"name": name, "config": configs[name], "resolved": resolved, "environment": env,
                "protocol": {"warmup_steps": WARMUP_STEPS, "seed": SEED, "tracker": "validation.tracker.MemoryTracker"},
                "optimizer_implementation": step.optimizer_implementation(), **report}
        _write_atomic(out_dir / f"{name}.json", _dump(data))
        results = report["results"]
        summary[name] = {"peak_allocated_bytes": results["peak_allocated_bytes"],
                         "category_peaks_bytes": results["category_peaks_bytes"],
                         "breakdown_at_peak": results["breakdown_at_peak"]}
        print(f"{name}: peak {results['peak_allocated_bytes']} B at {results['peak_phase']}/{results['peak_op']}",
              file=sys.stderr)
    ordered = {n: summary[n] for n in configs if n in summary}
    _write_atomic(summary_path, json.dumps(ordered, indent=1) + "\n")
    return ordered


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 on bad input)."""
    parser = argparse.ArgumentParser(prog="python -m validation.measure_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=Path, default=DEFAULT_CONFIGS, help="configurations TOML file")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--only", action="append", default=[], help="measure only this configuration (repeatable)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        print(f"error: --threads = {args.threads} must be a positive integer", file=sys.stderr)
        return 2
    try:
        run(args.configs, args.out, args.only, args.threads)
    except MemsimError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
