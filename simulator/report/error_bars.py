"""An interval around the predicted iteration time: the calibration's bootstrap, or memsim's validation-set error.

* With `cluster.calibration`: the busiest rank's compute in the measured iterations is split by what sets each
  op's time — GEMM rate, memory-bound rate (memory_bytes_per_s), fused attention, the per-op launch overhead —
  and each part is rescaled to the ends of the calibration's bootstrap 95% intervals ([ci95] of the file), all
  slow together for the upper end and all fast for the lower (a conservative combination: the parameters'
  draws are not independent). Exposed communication and idle time are held as simulated.
* Without, on a GPU: the measured/predicted ratios of the public validation set (validation/published/summary.json, written
  by `memsim validate published --out`): the measured time of a run memsim predicts at T lay between T / (1 + the
  largest error) and T / (1 + the most negative one).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from simulator.workload.graph import ATTENTION, GEMM

VALIDATION_SUMMARY = Path(__file__).resolve().parents[2] / "validation" / "published" / "summary.json"
_COMPUTE_DTYPE = {"fp32": "fp32"}      # precision -> the GEMM rate key of the calibration (else bf16)


@lru_cache(maxsize=4)
def _validation_errors(path: str) -> tuple[tuple[float, ...], str]:
    """The errors of the committed validation summary, and a line naming it (() when the file is absent)."""
    try:
        data = json.loads(Path(path).read_text())
        errors = tuple(float(row["error"]) for row in data["runs"])
        stats = data["summary"]["all"]
    except (OSError, ValueError, KeyError, TypeError):
        return (), ""
    line = (f"validation/published: {stats['runs']} published runs predicted uncalibrated, median |error| "
            f"{100 * stats['median_abs_error']:.1f}%, max |error| {100 * stats['max_abs_error']:.1f}%")
    return errors, line


def validation_band(iteration_time_s: float, summary: Path = VALIDATION_SUMMARY) -> dict | None:
    """{"interval_s", "kind", "source"} from the validation set's errors, or None without a summary."""
    errors, line = _validation_errors(str(summary))
    if not errors or iteration_time_s <= 0:
        return None
    low, high = iteration_time_s / (1 + max(errors)), iteration_time_s / (1 + min(errors))
    return {"interval_s": [low, high], "kind": "validation-set", "source": line}


def _parts(spans, start_s: float, end_s: float, launch_s: float) -> tuple[float, float, float, int]:
    """(GEMM, attention, memory-bound) kernel seconds (launch overhead taken out) and the run count, in a window."""
    gemm = attention = memory = 0.0
    count = 0
    for span in spans:
        if span.phase == "comm" or span.start_s < start_s or span.end_s > end_s:
            continue
        seconds = max(0.0, span.end_s - span.start_s - launch_s)
        count += 1
        if span.kind == GEMM:
            gemm += seconds
        elif span.kind == ATTENTION:
            attention += seconds
        else:
            memory += seconds
    return gemm, attention, memory, count


def calibration_band(report: dict, scenario, calibration, device, trace, window: tuple[float, float],
                     iterations: int) -> dict | None:
    """{"interval_s", "kind", "source"} from `calibration`'s bootstrap intervals, or None when it has none."""
    ci, fitted = calibration.ci95, calibration.fitted
    if not ci:
        return None
    ranks = report["ranks"]
    busiest = max(range(len(ranks)), key=lambda k: (ranks[k]["compute_s"], -k))
    gemm, attention, memory, count = _parts(trace.ranks[busiest].spans, *window, device.launch_overhead_s)
    rate_key = f"gemm_rate_flop_per_s.{_COMPUTE_DTYPE.get(scenario.training.precision, 'bf16')}"
    terms = [(gemm, rate_key, True), (attention, "attention_efficiency", True),
             (memory, "memory_bytes_per_s", True), (count * device.launch_overhead_s, "launch_overhead_s", False)]
    base = report["iteration_time_s"]
    slow = fast = 0.0
    for seconds, key, is_rate in terms:
        if key not in ci or seconds <= 0 or fitted.get(key, 0) <= 0:
            continue
        low, high = ci[key]
        seconds /= iterations
        if is_rate:
            slow += seconds * (fitted[key] / low - 1) if low > 0 else 0.0
            fast += seconds * (fitted[key] / high - 1)
        else:
            slow += seconds * (high / fitted[key] - 1)
            fast += seconds * (low / fitted[key] - 1)
    source = (f"{calibration.path}: bootstrap 95% intervals ({calibration.bootstrap} resamples of "
              f"{calibration.data_dir or 'its data'}) of the fitted rates, applied to the busiest rank's GEMM, attention, "
              f"memory-bound and launch time; communication and idle time as simulated")
    return {"interval_s": [max(0.0, base + fast), base + slow], "kind": "calibration-bootstrap", "source": source}


def iteration_interval(report: dict, scenario, cluster, trace) -> dict:
    """The report keys `iteration_time_interval_s` ([low, high] seconds, or None) and `iteration_time_interval`
    (kind and source): the calibration's bootstrap when the cluster has a calibration, else the validation set."""
    band = None
    calibration = getattr(cluster, "calibration", None)
    bounds = trace.iteration_bounds_s
    if calibration is not None and bounds and report["iteration_time_s"] > 0:
        warmup = scenario.run.warmup_iterations
        measured = bounds[warmup:] or bounds
        band = calibration_band(report, scenario, calibration, cluster.device, trace,
                                (measured[0][0], measured[-1][1]), len(measured))
    if band is None and cluster.device.kind == "gpu":
        band = validation_band(report["iteration_time_s"])
    if band is None:
        why = ("no calibration, and the validation set holds GPU runs only" if cluster.device.kind != "gpu"
               else "no calibration and no validation summary")
        return {"iteration_time_interval_s": None, "iteration_time_interval": {"kind": "none", "source": why}}
    return {"iteration_time_interval_s": band["interval_s"],
            "iteration_time_interval": {"kind": band["kind"], "source": band["source"]}}


__all__ = ["VALIDATION_SUMMARY", "calibration_band", "iteration_interval", "validation_band"]
