"""Fit memsim's device model (GEMM efficiency, bandwidth, launch overhead) and link alpha/beta to captured data.

Usage: ``python -m validation.calibrate DATA -o calibration.toml`` (also ``memsim calibrate``), where
DATA is a capture folder such as validation/data/cpu (timing/*.json, collectives.json).

The fit uses memsim's own roofline (simulator/hardware/cost.py), so fitted numbers are DeviceSpec fields:

* Stage 1, per op (profiler rows, minimum self time per call, each weighted by the square root of its
  share of its configuration's time; validation.calibration_data.op_rows): memory-bound aten ops give an
  effective bandwidth ``bw`` and a per-op overhead; GEMMs (mm, addmm, bmm) give gemm_efficiency per
  dtype and gemm_k_overhead through cost.py's shape factor (tile/wave quantization times
  k / (k + gemm_k_overhead)); CPU flash attention gives attention_efficiency.
  t = max(FLOP / (peak x efficiency(shape)), bytes / bw) + overhead.
* Stage 2, per configuration: with stage 1 fixed, launch_overhead_s (what memsim adds to each of
  its ops: dispatch, autograd and Python time per op) from the measured iteration times.
* Links: per collective and process count, t = latency_s + bus_bytes / bytes_per_s, bus bytes as
  nccl-tests counts them (all_reduce 2(n-1)/n x size, all_gather and reduce_scatter (n-1)/n x size).

Every fit is scipy.optimize.least_squares(loss="soft_l1") on log(predicted / measured); 95%
confidence intervals come from a seeded bootstrap (configurations, then their op rows, refitting both
stages; repetitions for links). A GEMM rate above twice the device's peak (DeviceSpec caps efficiency
at 2) is written as a new peak_flop_per_s with efficiency 1.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from simulator.errors import DataError, MemsimError
from simulator.hardware.catalog import FLOP_DTYPES, DeviceSpec, with_overrides
from simulator.io import atomic_write_text
from simulator.network.collectives import bus_factor
from simulator.topology import CALIBRATION_FORMAT
from validation.calibration_data import (
    ATTN, GEMM, ConfigFeatures, Dataset, OpRows, Params, device_params, load_dataset, predict_iteration_s,
    predict_ops_s,
)

__all__ = ["DeviceFit", "LinkResult", "Calibration", "overrides", "apply_params", "fit_ops", "fit_launch",
           "fit_device", "fit_links", "link_bus_bytes", "calibrate", "calibration_toml", "write_calibration", "main"]

SOFT_L1_SCALE = 0.1           # log-residual scale where soft_l1 turns from quadratic to linear (~10%)
BOOTSTRAP = 200
SEED = 0


def overrides(device: DeviceSpec, params: Params, fitted_dtypes: Sequence[str] = FLOP_DTYPES,
              attention: bool = True) -> dict[str, object]:
    """The DeviceSpec fields that carry ``params``: what a calibration file's [fields] table holds.

    GEMM efficiencies and peaks are written for ``fitted_dtypes`` (a peak only where the fit moved it);
    attention_efficiency only when ``attention``; a bandwidth above the device's hbm_bytes_per_s raises it
    (hbm_efficiency 1), otherwise hbm_efficiency carries the ratio.
    """
    dtypes = [d for d in fitted_dtypes if d in device.gemm_efficiency]
    fields: dict[str, object] = {"launch_overhead_s": float(params.launch_overhead_s)}
    if dtypes:
        fields["gemm_efficiency"] = {d: float(params.gemm_efficiency[d]) for d in dtypes}
        peaks = {d: float(params.peak_flop_per_s[d]) for d in dtypes
                 if params.peak_flop_per_s[d] != device.peak_flop_per_s[d]}
        if peaks:
            fields["peak_flop_per_s"] = peaks
        fields["gemm_k_overhead"] = int(round(params.gemm_k_overhead))
    if attention:
        fields["attention_efficiency"] = float(min(max(params.attention_efficiency, 1e-6), 1.0))
    if params.memory_bytes_per_s <= device.hbm_bytes_per_s:
        fields["hbm_efficiency"] = float(params.memory_bytes_per_s / device.hbm_bytes_per_s)
    else:
        fields["hbm_bytes_per_s"] = float(params.memory_bytes_per_s)
        fields["hbm_efficiency"] = 1.0
    return fields


def apply_params(device: DeviceSpec, params: Params, fitted_dtypes: Sequence[str] = FLOP_DTYPES,
                 attention: bool = True, source: str = "fitted by validation.calibrate") -> DeviceSpec:
    """A copy of ``device`` with ``params`` written into its fields (k overhead rounded to an integer)."""
    fields = overrides(device, params, fitted_dtypes, attention)
    notes = {}
    for key, value in fields.items():
        notes.update({f"{key}.{d}": source for d in value} if isinstance(value, dict) else {key: source})
    return with_overrides(device, **fields, source=notes)


def _rates(device: DeviceSpec, start: Params, rates: Mapping[str, float]) -> tuple[dict, dict]:
    """GEMM rates at the reference shape -> (gemm_efficiency, peak_flop_per_s) in DeviceSpec's ranges.

    An efficiency above 2 (DeviceSpec's limit) means the datasheet/measured peak is wrong for these kernels:
    the peak becomes the fitted rate and the efficiency 1.
    """
    eff, peak = dict(start.gemm_efficiency), dict(start.peak_flop_per_s)
    for dtype, rate in rates.items():
        base = device.peak_flop_per_s[dtype]
        if rate / base <= 2.0:
            eff[dtype], peak[dtype] = rate / base, base
        else:
            eff[dtype], peak[dtype] = 1.0, rate
    return eff, peak


# ----------------------------------------------------------------------------------------------------------------
# Fits


def _soft_l1(fun, x0, lower, upper):
    return least_squares(fun, x0, bounds=(lower, upper), loss="soft_l1", f_scale=SOFT_L1_SCALE, x_scale="jac")


def fit_ops(rows: OpRows, device: DeviceSpec, start: Params) -> tuple[Params, tuple[str, ...], bool]:
    """Stage 1: bandwidth, per-op overhead, GEMM rate per dtype, k overhead and attention efficiency.

    Minimizes soft_l1 of weight x log(predicted / measured) over the rows. Parameters without data (a dtype
    without GEMM rows, attention without rows) keep ``start``'s values.

    Returns:
        (params, the dtypes whose GEMM rate was fitted, whether attention was fitted).

    Raises:
        DataError: fewer than 3 rows.
    """
    if len(rows) < 3:
        raise DataError(f"the op-level fit needs at least 3 profiled op rows, got {len(rows)}")
    gemm_dtypes = tuple(d for i, d in enumerate(FLOP_DTYPES) if np.any((rows.kind == GEMM) & (rows.dtype_index == i)))
    attention = bool(np.any(rows.kind == ATTN))
    shaped = bool(gemm_dtypes)
    x0 = [math.log(start.memory_bytes_per_s), math.log(min(max(start.op_overhead_s, 1e-8), 0.09))]
    lower = [math.log(1e6), math.log(1e-9)]
    upper = [math.log(1e14), math.log(1e-1)]
    for d in gemm_dtypes:
        x0.append(math.log(start.peak_flop_per_s[d] * start.gemm_efficiency[d]))
        lower.append(math.log(1e6))
        upper.append(math.log(1e17))
    if shaped:
        x0.append(min(max(start.gemm_k_overhead, 0.0), 4000.0))
        lower.append(0.0)
        upper.append(4096.0)
    if attention:
        x0.append(math.log(min(max(start.attention_efficiency, 1e-4), 0.99)))
        lower.append(math.log(1e-5))
        upper.append(0.0)
    measured = np.log(rows.time_s)

    def unpack(x: np.ndarray) -> Params:
        rates = {d: math.exp(x[2 + i]) for i, d in enumerate(gemm_dtypes)}
        eff, peak = _rates(device, start, rates)
        k0 = float(x[2 + len(gemm_dtypes)]) if shaped else start.gemm_k_overhead
        att = math.exp(x[-1]) if attention else start.attention_efficiency
        return replace(start, gemm_efficiency=eff, peak_flop_per_s=peak, gemm_k_overhead=k0, attention_efficiency=att,
                       memory_bytes_per_s=math.exp(x[0]), op_overhead_s=math.exp(x[1]))

    def residuals(x: np.ndarray) -> np.ndarray:
        return rows.weight * (np.log(predict_ops_s(rows, device, unpack(x))) - measured)

    result = _soft_l1(residuals, np.clip(x0, lower, upper), lower, upper)
    return unpack(result.x), gemm_dtypes, attention


def fit_launch(features: Sequence[ConfigFeatures], measured_s: Sequence[float], device: DeviceSpec,
               params: Params) -> Params:
    """Stage 2: memsim's per-op launch_overhead_s from iteration times, the stage-1 numbers fixed.

    Raises:
        DataError: no configuration to fit.
    """
    if not features:
        raise DataError("the iteration-level fit needs at least one configuration with a measured iteration time")
    base = np.array([predict_iteration_s(f, device, replace(params, launch_overhead_s=0.0)) for f in features])
    counts = np.array([len(f.ops) for f in features], dtype=float)
    target = np.log(np.asarray(measured_s, dtype=float))

    def residuals(x: np.ndarray) -> np.ndarray:
        return np.log(base + counts * math.exp(x[0])) - target

    guess = min(max(float(np.median((np.exp(target) - base) / counts)), 1e-8), 0.05)
    result = _soft_l1(residuals, [math.log(guess)], [math.log(1e-10)], [math.log(0.1)])
    return replace(params, launch_overhead_s=math.exp(result.x[0]))


@dataclass(frozen=True)
class DeviceFit:
    """A device fit: params, what was fitted, the configurations used, in-sample log residuals."""

    params: Params
    gemm_dtypes: tuple[str, ...]
    attention: bool
    names: tuple[str, ...]
    op_log_residuals: tuple[float, ...]
    iteration_log_residuals: tuple[float, ...]

    def device(self, base: DeviceSpec) -> DeviceSpec:
        """``base`` with the fitted fields applied."""
        return apply_params(base, self.params, self.gemm_dtypes, self.attention)


def fit_device(dataset: Dataset, names: Sequence[str] | None = None, start: Params | None = None) -> DeviceFit:
    """Stage 1 then stage 2 on the named configurations (default all) of ``dataset``.

    Raises:
        DataError: no configuration or too few op rows.
    """
    chosen = tuple(dataset.names if names is None else names)
    if not chosen:
        raise DataError(f"{dataset.root}: no configuration to fit")
    device = dataset.device_spec
    rows = OpRows.concat([dataset.op_rows[n] for n in chosen])
    params, dtypes, attention = fit_ops(rows, device, start or device_params(device))
    features = [dataset.features[n] for n in chosen]
    measured = [dataset.iteration_s[n] for n in chosen]
    params = fit_launch(features, measured, device, params)
    op_res = np.log(predict_ops_s(rows, device, params)) - np.log(rows.time_s)
    it_res = [math.log(predict_iteration_s(f, device, params) / m) for f, m in zip(features, measured)]
    return DeviceFit(params, dtypes, attention, chosen, tuple(float(v) for v in op_res), tuple(it_res))


# ----------------------------------------------------------------------------------------------------------------
# Links


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def link_bus_bytes(collective: str, world_size: int, size_bytes: float) -> float:
    """Bytes each rank moves over its link for a collective of ``size_bytes`` (nccl-tests bus bytes,
    simulator.network.collectives.bus_factor).

    Raises:
        DataError: an unknown collective.
    """
    if collective not in COLLECTIVES:
        raise DataError(f"collective = {collective!r} is unknown; allowed: {', '.join(COLLECTIVES)}")
    return bus_factor(collective, world_size) * size_bytes


@dataclass(frozen=True)
class LinkResult:
    """Fitted t = latency_s + bus_bytes / bytes_per_s for one (collective, world size), with 95% CIs."""

    collective: str
    world_size: int
    latency_s: float
    bytes_per_s: float
    latency_ci_s: tuple[float, float] = (math.nan, math.nan)
    bytes_per_s_ci: tuple[float, float] = (math.nan, math.nan)
    median_abs_log_residual: float = math.nan
    points: int = 0


def _fit_alpha_beta(bus: np.ndarray, times: np.ndarray) -> tuple[float, float]:
    target = np.log(times)
    small = float(np.min(times))
    slope = max(float(np.polyfit(bus, times, 1)[0]), 1e-12)

    def residuals(x: np.ndarray) -> np.ndarray:
        return np.log(math.exp(x[0]) + bus / math.exp(x[1])) - target

    x0 = [math.log(max(small * 0.5, 1e-7)), math.log(min(max(1.0 / slope, 1e5), 1e13))]
    result = _soft_l1(residuals, x0, [math.log(1e-9), math.log(1e4)], [math.log(10.0), math.log(1e14)])
    return math.exp(result.x[0]), math.exp(result.x[1])


def fit_links(results: Sequence[Mapping[str, object]], bootstrap: int = BOOTSTRAP, seed: int = SEED,
              exclude_size: int | None = None) -> list[LinkResult]:
    """Fit alpha/beta per (collective, world size) from collectives.json results (every repetition a point).

    Args:
        results: the "results" list of collectives.json.
        bootstrap: bootstrap resamples of the repetitions for the CIs (0: none).
        seed: numpy Generator seed.
        exclude_size: leave this buffer size out (cross-validation by size).
    """
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for row in results:
        if exclude_size is not None and row["size_bytes"] == exclude_size:
            continue
        key = (str(row["collective"]), int(row["world_size"]))
        bus = link_bus_bytes(key[0], key[1], float(row["size_bytes"]))
        groups.setdefault(key, []).extend((bus, float(t)) for t in row["times_s"])
    rng = np.random.default_rng(seed)
    fits = []
    for (collective, world), points in sorted(groups.items()):
        data = np.array(points)
        alpha, beta = _fit_alpha_beta(data[:, 0], data[:, 1])
        predicted = alpha + data[:, 0] / beta
        residual = float(np.median(np.abs(np.log(predicted / data[:, 1]))))
        alpha_ci = beta_ci = (math.nan, math.nan)
        if bootstrap:
            draws = [_fit_alpha_beta(*data[rng.integers(0, len(data), len(data))].T) for _ in range(bootstrap)]
            a, b = np.array(draws).T
            alpha_ci = (float(np.percentile(a, 2.5)), float(np.percentile(a, 97.5)))
            beta_ci = (float(np.percentile(b, 2.5)), float(np.percentile(b, 97.5)))
        fits.append(LinkResult(collective, world, alpha, beta, alpha_ci, beta_ci, residual, len(data)))
    return fits


# ----------------------------------------------------------------------------------------------------------------
# Calibration (fit + bootstrap + file)


@dataclass(frozen=True)
class Calibration:
    """Everything a calibration file holds."""

    dataset: Dataset
    fit: DeviceFit
    intervals: Mapping[str, tuple[float, float]]
    links: tuple[LinkResult, ...] = ()
    bootstrap: int = BOOTSTRAP
    seed: int = SEED
    notes: tuple[str, ...] = field(default=())


def _param_values(fit: DeviceFit) -> dict[str, float]:
    params = fit.params
    values = {f"gemm_rate_flop_per_s.{d}": params.peak_flop_per_s[d] * params.gemm_efficiency[d]
              for d in fit.gemm_dtypes}
    values.update({"gemm_k_overhead": params.gemm_k_overhead} if fit.gemm_dtypes else {})
    values.update({"attention_efficiency": params.attention_efficiency} if fit.attention else {})
    values.update({"memory_bytes_per_s": params.memory_bytes_per_s, "op_overhead_s": params.op_overhead_s,
                   "launch_overhead_s": params.launch_overhead_s})
    return values


def calibrate(data_dir: str | Path, bootstrap: int = BOOTSTRAP, seed: int = SEED) -> Calibration:
    """Load a capture folder, fit the device (all configurations) and the links, bootstrap 95% intervals.

    Bootstrap: resample configurations with replacement, then the op rows of those with replacement, and
    refit both stages (seeded numpy Generator); intervals are the 2.5 and 97.5 percentiles.

    Raises:
        DataError: missing, corrupt or inconsistent data (see validation.calibration_data.load_dataset).
    """
    dataset = load_dataset(data_dir)
    fit = fit_device(dataset)
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {}
    names = dataset.names
    device = dataset.device_spec
    for _ in range(bootstrap):
        picked = [names[i] for i in rng.integers(0, len(names), len(names))]
        rows = OpRows.concat([dataset.op_rows[n] for n in picked])
        rows = rows.take(rng.integers(0, len(rows), len(rows)))
        params, dtypes, attention = fit_ops(rows, device, fit.params)
        params = fit_launch([dataset.features[n] for n in picked], [dataset.iteration_s[n] for n in picked],
                            device, params)
        values = _param_values(DeviceFit(params, fit.gemm_dtypes, fit.attention, (), (), ()))
        for key, value in values.items():
            draws.setdefault(key, []).append(value)
    intervals = {k: (float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))) for k, v in draws.items()}
    links = tuple(fit_links(dataset.collectives["results"], bootstrap, seed)) if dataset.collectives else ()
    low, high = dataset.memory_op_bytes
    tier = "DRAM" if high > device.l2_bytes else "last-level cache"
    notes = (f"op-level fit: {len(fit.op_log_residuals)} profiler rows (minimum self time per call) of "
             f"{len(names)} configurations; iteration-level fit: median iteration time ({dataset.clock} clock)",
             f"memory-bound ops in the data move {low}..{high} bytes (cache: {device.l2_bytes} bytes): the "
             f"{tier} tier sets hbm_efficiency; l2_bytes_per_s keeps its default",
             "launch_overhead_s is per memsim op and absorbs eager dispatch, autograd and Python time; "
             "op_overhead_s is the per-aten-op overhead of the op-level fit")
    return Calibration(dataset, fit, intervals, links, bootstrap, seed, notes)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else '"nan"'
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def _summary(log_residuals: Sequence[float]) -> dict[str, object]:
    errors = np.abs(np.expm1(np.asarray(log_residuals, dtype=float)))
    if errors.size == 0:
        return {"n": 0}
    return {"n": int(errors.size), "median_abs_rel_error": float(np.median(errors)),
            "p90_abs_rel_error": float(np.percentile(errors, 90)), "max_abs_rel_error": float(np.max(errors))}


def calibration_toml(calibration: Calibration) -> str:
    """The calibration file's text (format memsim-calibration-1, read by simulator.topology.read_calibration)."""
    ds = calibration.dataset
    device = ds.device_spec
    fields = overrides(device, calibration.fit.params, calibration.fit.gemm_dtypes, calibration.fit.attention)
    lines = ["# Written by `memsim calibrate`; apply with [cluster] calibration = \"<this file>\".",
             f"format = {_toml_value(CALIBRATION_FORMAT)}", f"device = {_toml_value(device.name)}",
             f"device_name = {_toml_value(ds.device_name)}", f"torch_version = {_toml_value(ds.torch_version)}",
             f"clock = {_toml_value(ds.clock)}", f"data_dir = {_toml_value(str(ds.root))}",
             f"data = {_toml_value(list(ds.files))}",
             f"bootstrap = {calibration.bootstrap}", f"seed = {calibration.seed}",
             f"notes = {_toml_value(list(calibration.notes))}", "", "[fields]"]
    for key, value in fields.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {_toml_value(value)}")
    for key, value in fields.items():
        if isinstance(value, dict):
            lines += ["", f"[fields.{key}]"] + [f"{k} = {_toml_value(v)}" for k, v in value.items()]
    lines += ["", "[fitted]  # the fit's own numbers (memory_bytes_per_s = hbm_bytes_per_s x hbm_efficiency)"]
    lines += [f'"{k}" = {_toml_value(float(v))}' for k, v in _param_values(calibration.fit).items()]
    lines += ["", "[ci95]  # bootstrap percentile intervals of [fitted]"]
    lines += [f'"{k}" = {_toml_value(list(v))}' for k, v in calibration.intervals.items()]
    for label, values in (("ops", calibration.fit.op_log_residuals),
                          ("iterations", calibration.fit.iteration_log_residuals)):
        lines += ["", f"[residuals.{label}]"] + [f"{k} = {_toml_value(v)}" for k, v in _summary(values).items()]
    for link in calibration.links:
        lines += ["", f"[links.{link.collective}.{link.world_size}]",
                  f"latency_s = {_toml_value(link.latency_s)}", f"bytes_per_s = {_toml_value(link.bytes_per_s)}",
                  f"latency_ci_s = {_toml_value(list(link.latency_ci_s))}",
                  f"bytes_per_s_ci = {_toml_value(list(link.bytes_per_s_ci))}",
                  f"median_abs_log_residual = {_toml_value(link.median_abs_log_residual)}",
                  f"points = {link.points}"]
    return "\n".join(lines) + "\n"


def write_calibration(calibration: Calibration, path: str | Path) -> None:
    """Write the calibration file atomically."""
    atomic_write_text(path, calibration_toml(calibration))


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 on bad input)."""
    parser = argparse.ArgumentParser(prog="python -m validation.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, help="capture folder (validation/data/<device>)")
    parser.add_argument("-o", "--output", type=Path, default=Path("calibration.toml"), help="calibration file")
    parser.add_argument("--bootstrap", type=int, default=BOOTSTRAP, help="bootstrap resamples")
    args = parser.parse_args(argv)
    try:
        calibration = calibrate(args.data, args.bootstrap)
    except MemsimError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    write_calibration(calibration, args.output)
    print(calibration_toml(calibration))
    return 0


if __name__ == "__main__":
    sys.exit(main())
