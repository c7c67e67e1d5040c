"""The public validation set: real training runs (validation/published/*.toml) predicted by memsim, uncalibrated.

Each file is one run as its authors published it: the configuration (a memsim scenario under `[scenario]`, or a
capture of this project under `capture`), the system, the measured throughput or step time, and where it comes
from (`[source]`). `memsim validate published` simulates every run with memsim's default parameters and prints
predicted against measured iteration time. Nothing here is fitted: the files hold published numbers only.

File keys (every one required unless marked):
    name                  the file's stem
    set                   "development" (looked at while the model was built) or "holdout" (kept aside, an
                          independent check)
    gpus                  GPUs of the run (checked against the scenario's dp x tp x pp)
    capture               (instead of [scenario] and [measured]) a capture file of this project, relative to the file
    [source]              reference, location, url, read (date), configuration (optional)
    [system]              framework, cluster
    [measured]            one of: iteration_time_s; tokens_per_s_per_gpu; tflops_per_gpu with flop_formula (and
                          flop_vocab for "megatron-2021")
    [scenario]            a memsim scenario without `name` (docs/scenario-reference.md)
"""

from __future__ import annotations

import json
import math
import statistics
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from simulator.errors import DataError, MemsimError

PUBLISHED_DIR = Path(__file__).resolve().parent / "published"
SETS = ("development", "holdout")
SOURCE_KEYS = ("reference", "location", "url", "read")
SYSTEM_KEYS = ("framework", "cluster")
MEASURES = ("iteration_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu")
FLOP_FORMULAS = ("megatron-2021",)


@dataclass(frozen=True)
class PublishedRun:
    """One published run: its scenario (a dict for scenario_from_dict), the measured step time and the source."""

    path: Path
    name: str
    set: str
    gpus: int
    scenario: Mapping[str, object]
    measured_s: float
    measured_as: str            # how the publication states it, e.g. "137 teraFLOP/s per GPU"
    source: Mapping[str, str]
    system: Mapping[str, str]


@dataclass(frozen=True)
class Prediction:
    """A run's measured and predicted iteration time (seconds) and what memsim attributes the time to."""

    run: PublishedRun
    predicted_s: float
    exposed_communication_s: float
    bubble_fraction: float
    fits: bool

    @property
    def error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted_s / self.run.measured_s - 1


def _fail(path: Path, key: str, rule: str) -> DataError:
    return DataError(f"{path}: {key}: {rule}")


def _table(path: Path, document: Mapping[str, object], key: str, required: Sequence[str]) -> dict[str, str]:
    table = document.get(key)
    if not isinstance(table, dict):
        raise _fail(path, key, "missing (a table with " + ", ".join(required) + ")")
    for item in required:
        value = table.get(item)
        if not isinstance(value, str) or not value.strip():
            raise _fail(path, f"{key}.{item}", "missing (a non-empty string)")
    return {k: str(v) for k, v in table.items()}


def _positive(path: Path, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _fail(path, key, f"= {value!r}: must be a positive number")
    return float(value)


def megatron_2021_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOP of one iteration with full recomputation as Narayanan et al. (SC21, Eq. 3) count them.

    96 B s l h^2 (1 + s / 6h + V / 16 l h): forward, backward and the recomputed forward of every GEMM,
    attention's two batched GEMMs and the LM head.
    """
    return 96.0 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def _measured_s(path: Path, measured: Mapping[str, object], scenario: Mapping[str, object], gpus: int
                ) -> tuple[float, str]:
    """The measured iteration time and how the source states it."""
    given = [key for key in MEASURES if key in measured]
    if len(given) != 1:
        raise _fail(path, "measured", f"needs exactly one of {', '.join(MEASURES)} (found {given or 'none'})")
    key = given[0]
    value = _positive(path, f"measured.{key}", measured[key])
    model = scenario.get("model", {}) if isinstance(scenario.get("model"), dict) else {}
    training = scenario.get("training", {}) if isinstance(scenario.get("training"), dict) else {}
    if key == "iteration_time_s":
        return value, f"{value:g} s per step"
    batch, seq = training.get("global_batch_size"), model.get("seq_length")
    if not isinstance(batch, int) or not isinstance(seq, int):
        raise _fail(path, "scenario.training.global_batch_size",
                    f"and scenario.model.seq_length must be integers to convert measured.{key}")
    if key == "tokens_per_s_per_gpu":
        return batch * seq / (value * gpus), f"{value:g} tokens/s per GPU"
    formula = measured.get("flop_formula")
    if formula not in FLOP_FORMULAS:
        raise _fail(path, "measured.flop_formula", f"= {formula!r}: required with measured.tflops_per_gpu "
                                                   f"(allowed: {', '.join(FLOP_FORMULAS)})")
    vocab = measured.get("flop_vocab")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0:
        raise _fail(path, "measured.flop_vocab", f"= {vocab!r}: required with flop_formula = {formula!r} "
                                                 "(the vocabulary the publication counts, a positive integer)")
    layers, hidden = model.get("num_layers"), model.get("hidden_size")
    if not isinstance(layers, int) or not isinstance(hidden, int):
        raise _fail(path, "scenario.model", "needs num_layers and hidden_size to count the FLOPs")
    flops = megatron_2021_flops(batch, seq, layers, hidden, vocab)
    return flops / (gpus * value * 1e12), f"{value:g} teraFLOP/s per GPU"


def _capture(path: Path, document: Mapping[str, object]) -> tuple[dict, float, str]:
    """(scenario, measured step time, how) from a capture of this project (validation/capture.py format)."""
    capture = path.parent / str(document["capture"])
    try:
        data = json.loads(capture.read_text())
        config, iteration = data["config"], data["iteration"]["cuda_event"]
        median = float(iteration["median_s"])
        device = data["environment"]["device_name"]
    except FileNotFoundError:
        raise _fail(path, "capture", f"= {document['capture']!r}: file not found") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise _fail(path, "capture", f"= {document['capture']!r}: not a CUDA timing capture ({error!r})") from None
    from validation.calibration_data import catalog_device

    scenario = {"model": dict(config["model"]), "training": dict(config["training"]),
                "cluster": {"topology": catalog_device("cuda", device).name},
                "run": {"warmup_iterations": 1, "iterations": 1, "record_events": False}}
    return scenario, median, f"{median * 1e3:.2f} ms per step (median of {len(data['iteration']['cuda_event_s'])})"


def load_run(path: str | Path) -> PublishedRun:
    """Read and check one published-run file.

    Raises:
        DataError: the file is missing, not TOML, or a field is missing or invalid (the message names the key).
    """
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as error:
        raise DataError(f"{path}: not valid TOML ({error})") from None
    name = document.get("name")
    if name != path.stem:
        raise _fail(path, "name", f"= {name!r}: must equal the file name without .toml ({path.stem!r})")
    kind = document.get("set")
    if kind not in SETS:
        raise _fail(path, "set", f"= {kind!r}: must be one of {', '.join(SETS)}")
    gpus = document.get("gpus")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise _fail(path, "gpus", f"= {gpus!r}: must be a positive integer")
    source = _table(path, document, "source", SOURCE_KEYS)
    system = _table(path, document, "system", SYSTEM_KEYS)
    if "capture" in document:
        if "scenario" in document or "measured" in document:
            raise _fail(path, "capture", "a capture gives the configuration and the measurement: no [scenario] "
                                         "or [measured] with it")
        scenario, measured_s, how = _capture(path, document)
    else:
        scenario = document.get("scenario")
        if not isinstance(scenario, dict):
            raise _fail(path, "scenario", "missing (a memsim scenario: [scenario.model], [scenario.training], ...)")
        if "name" in scenario:
            raise _fail(path, "scenario.name", "not allowed: the run's name is the scenario's")
        measured = document.get("measured")
        if not isinstance(measured, dict):
            raise _fail(path, "measured", f"missing (a table with one of {', '.join(MEASURES)})")
        measured_s, how = _measured_s(path, measured, scenario, gpus)
        scenario = {**scenario}
    parallel = scenario.get("parallel", {}) if isinstance(scenario.get("parallel"), dict) else {}
    world = 1
    for axis in ("dp", "tp", "pp"):
        value = parallel.get(axis, 1)
        world *= value if isinstance(value, int) and not isinstance(value, bool) else 0
    if world != gpus:
        raise _fail(path, "gpus", f"= {gpus}: must equal scenario.parallel dp x tp x pp = {world}")
    return PublishedRun(path, str(name), str(kind), int(gpus), {"name": name, **scenario}, measured_s, how,
                        source, system)


def load_runs(folder: str | Path = PUBLISHED_DIR, only: Sequence[str] = (), which: str = "all") -> list[PublishedRun]:
    """Every run of `folder` (sorted by name), or those named in `only`, of the set `which` ("all" for both).

    Raises:
        DataError: a file is invalid, a name in `only` has no file, or the folder holds no run.
    """
    folder = Path(folder)
    if which not in (*SETS, "all"):
        raise DataError(f"--set = {which!r}: allowed: {', '.join((*SETS, 'all'))}")
    paths = sorted(folder.glob("*.toml"))
    if not paths:
        raise DataError(f"{folder}: no published-run files (*.toml)")
    names = {p.stem for p in paths}
    for name in only:
        if name not in names:
            raise DataError(f"--only = {name!r}: no run of that name in {folder}")
    runs = [load_run(p) for p in paths if not only or p.stem in only]
    return [run for run in runs if which == "all" or run.set == which]


def predict(run: PublishedRun, memory_workers: int | None = None) -> Prediction:
    """Simulate one run with memsim's default parameters (no calibration).

    Raises:
        MemsimError: the scenario is invalid (the message names the run's file and key).
    """
    from simulator import scenario_from_dict, simulate

    scenario = scenario_from_dict(dict(run.scenario), source=str(run.path))
    report = simulate(scenario, timelines=False, events=False, memory_workers=memory_workers).report
    return Prediction(run, float(report["iteration_time_s"]), float(report["communication"]["exposed_s"]),
                      float(report["bubble_fraction"]), bool(report["fits"]))


def summary(predictions: Sequence[Prediction]) -> dict[str, object]:
    """Median and largest |error| over all runs and per set (None where a set has no run)."""
    def stats(items: Sequence[Prediction]) -> dict[str, object]:
        errors = [abs(p.error) for p in items]
        return {"runs": len(items), "median_abs_error": statistics.median(errors) if errors else None,
                "max_abs_error": max(errors) if errors else None}

    return {"all": stats(predictions), **{kind: stats([p for p in predictions if p.run.set == kind]) for kind in SETS}}


def run_all(runs: Sequence[PublishedRun], progress: Callable[[str], None] | None = None,
            memory_workers: int | None = None) -> list[Prediction]:
    """predict() for each run in order; `progress` gets one line per finished run."""
    predictions = []
    for run in runs:
        try:
            prediction = predict(run, memory_workers)
        except MemsimError as error:
            raise DataError(f"{run.path}: {error}") from None
        predictions.append(prediction)
        if progress is not None:
            progress(f"{run.name}: {prediction.predicted_s:.4g} s predicted, {run.measured_s:.4g} s measured "
                     f"({prediction.error:+.1%})")
    return predictions


def report_dict(predictions: Sequence[Prediction]) -> dict[str, object]:
    """The table as JSON-ready data (the `--json` output and validation/published/summary.json)."""
    rows = [{"name": p.run.name, "set": p.run.set, "gpus": p.run.gpus,
             "device": p.run.scenario.get("cluster", {}).get("topology"),
             "measured_s": p.run.measured_s, "measured_as": p.run.measured_as, "predicted_s": p.predicted_s,
             "error": p.error, "exposed_communication_s": p.exposed_communication_s,
             "bubble_fraction": p.bubble_fraction, "fits": p.fits, "source": p.run.source.get("location"),
             "url": p.run.source.get("url")} for p in predictions]
    return {"format": "memsim-published-1", "runs": rows, "summary": summary(predictions)}


def format_table(predictions: Sequence[Prediction]) -> str:
    """The table printed by `memsim validate published`."""
    lines = [f"{'run':<52} {'set':<11} {'GPUs':>6} {'cluster':<10} {'measured s':>11} {'memsim s':>9} "
             f"{'error':>7} {'exposed comm':>12}"]
    for p in predictions:
        topology = str(p.run.scenario.get("cluster", {}).get("topology", ""))
        lines.append(f"{p.run.name:<52} {p.run.set:<11} {p.run.gpus:>6} {topology:<10} {p.run.measured_s:>11.4g} "
                     f"{p.predicted_s:>9.4g} {p.error:>+7.1%} {p.exposed_communication_s:>11.3g}s")
    for kind, stats in summary(predictions).items():
        if stats["runs"]:
            lines.append(f"{kind}: {stats['runs']} runs, median |error| {stats['median_abs_error']:.1%}, "
                         f"max |error| {stats['max_abs_error']:.1%}")
    return "\n".join(lines) + "\n"


__all__ = ["PUBLISHED_DIR", "Prediction", "PublishedRun", "format_table", "load_run", "load_runs",
           "megatron_2021_flops", "predict", "report_dict", "run_all", "summary"]
