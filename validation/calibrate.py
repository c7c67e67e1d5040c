"""Fit memsim's device model (GEMM efficiency by shape, memory bandwidth, launch overhead) and link alpha/beta to captured data.

Usage: ``python -m validation.calibrate DATA -o calibration.toml`` (also ``memsim calibrate``), where
DATA is a capture folder such as validation/data/cpu (timing/*.json, collectives.json).

The fit uses memsim's own roofline (simulator/hardware/cost.py), so fitted numbers are DeviceSpec fields:

* Stage 1, per op (profiler rows, minimum self time per call): memory-bound aten ops give an
  effective bandwidth ``bw`` and a per-op overhead; GEMMs (mm, addmm, bmm) give gemm_efficiency per
  dtype and gemm_k_overhead through cost.py's shape factor (tile/wave quantization times
  k / (k + gemm_k_overhead)); CPU flash attention gives attention_efficiency.
  t = max(FLOP / (peak x efficiency(shape)), bytes / bw) + overhead.
* Stage 2, per configuration: with stage 1 fixed, launch_overhead_s (what memsim adds to each of
  its ops: dispatch, autograd and Python time per op) from the measured iteration times.
* Links: per collective and process count, t = latency_s + bus_bytes / bytes_per_s, bus bytes as
  nccl-tests counts them (all_reduce 2(n-1)/n x size, all_gather and reduce_scatter (n-1)/n x size).

Every fit is scipy.optimize.least_squares(loss="soft_l1") on log(predicted / measured); 95%
confidence intervals come from a seeded bootstrap over rows (stage 1), configurations (stage 2)
and repetitions (links).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from simulator.errors import DataError, MemsimError
from simulator.hardware.catalog import DeviceSpec, get_device, with_overrides
from simulator.io import atomic_write_text
from simulator.topology import CALIBRATION_FORMAT
from simulator.api import build_workload
from simulator.hardware.cost import rate_dtype
from simulator.scenario import scenario_from_dict
from simulator.workload.graph import ATTENTION, GEMM
from validation.memory_comparison import scenario_document

CAPTURE_FORMAT = "memsim-timing-1"

__all__ = ["Params", "DeviceFit", "LinkResult", "Calibration", "device_params", "fit_ops", "fit_launch",
           "fit_device", "fit_links", "predict_iteration_s", "predict_ops_s", "link_bus_bytes", "calibrate",
           "calibration_toml", "write_calibration", "main"]

SOFT_L1_SCALE = 0.1           # log-residual scale where soft_l1 turns from quadratic to linear (~10%)
BOOTSTRAP = 200
SEED = 0
_DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Params:
    """The device-model numbers a calibration fits (all SI).

    memory_bytes_per_s is the effective rate of memory-bound traffic (hbm_bytes_per_s x hbm_efficiency);
    op_overhead_s is the per-aten-op overhead of stage 1 (reported, not applied); launch_overhead_s is
    memsim's per-op overhead (stage 2).
    """

    gemm_efficiency: Mapping[str, float]
    gemm_k_overhead: float
    attention_efficiency: float
    memory_bytes_per_s: float
    op_overhead_s: float
    launch_overhead_s: float


def device_params(device: DeviceSpec) -> Params:
    """The Params a DeviceSpec implies (op_overhead_s = launch_overhead_s)."""
    return Params(dict(device.gemm_efficiency), float(device.gemm_k_overhead), device.attention_efficiency,
                  device.hbm_bytes_per_s * device.hbm_efficiency, device.launch_overhead_s, device.launch_overhead_s)


def apply_params(device: DeviceSpec, params: Params, source: str = "calibration") -> DeviceSpec:
    """A copy of ``device`` with ``params`` written into its fields (k overhead rounded to an integer)."""
    return with_overrides(device, **overrides(device, params), source={"launch_overhead_s": source})


def overrides(device: DeviceSpec, params: Params) -> dict[str, object]:
    """The DeviceSpec fields that carry ``params`` (bandwidth above the datasheet raises hbm_bytes_per_s)."""
    fields: dict[str, object] = {
        "gemm_efficiency": {k: float(min(v, 2.0)) for k, v in params.gemm_efficiency.items()},
        "gemm_k_overhead": int(round(params.gemm_k_overhead)),
        "attention_efficiency": float(min(max(params.attention_efficiency, 1e-6), 1.0)),
        "launch_overhead_s": float(params.launch_overhead_s),
    }
    if params.memory_bytes_per_s <= device.hbm_bytes_per_s:
        fields["hbm_efficiency"] = float(params.memory_bytes_per_s / device.hbm_bytes_per_s)
    else:
        fields["hbm_bytes_per_s"] = float(params.memory_bytes_per_s)
        fields["hbm_efficiency"] = 1.0
    return fields


# ----------------------------------------------------------------------------------------------------------------
# Capture folders: timing files, collectives, and the features of each configuration


_TORCH_DTYPES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16"}
_ITEMSIZE = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "bool": 1,
             "unsigned char": 1, "signed char": 1, "short int": 2}
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu": 1.0,
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward": 2.5}
# aten ops that stream their operands once (elementwise, copies, norms, softmax, optimizer updates).
MEMORY_OPS = frozenset(f"aten::{n}" for n in (
    "add", "sub", "mul", "div", "neg", "gelu", "gelu_backward", "silu", "silu_backward", "pow", "rsqrt", "sqrt",
    "masked_fill", "masked_fill_", "copy_", "add_", "mul_", "div_", "addcmul_", "addcdiv_", "lerp_", "sqrt_",
    "_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data", "native_layer_norm",
    "native_layer_norm_backward", "bernoulli_", "clone", "cat", "where", "fill_", "zero_", "mean", "sum"))
_SCALAR_INPUTS = ("aten::fill_", "aten::zero_", "aten::bernoulli_")   # overwrite their first input, read nothing


@dataclass(frozen=True)
class OpRows:
    """Ops as arrays for the vectorized roofline: kind 0 GEMM, 1 attention, 2 memory-bound.

    ``dtype_index`` points into ``dtypes`` (the gemm_efficiency key of each row); ``peak`` is the FLOP rate
    of the row's rate dtype; m, n, k = 0 marks a GEMM without a shape (no shape factor); ``time_s`` is the
    measured time per call (NaN for predictions only).
    """

    kind: np.ndarray
    dtype_index: np.ndarray
    dtypes: tuple[str, ...]
    peak: np.ndarray
    flops: np.ndarray
    bytes: np.ndarray
    m: np.ndarray
    n: np.ndarray
    k: np.ndarray
    batch: np.ndarray
    time_s: np.ndarray

    @staticmethod
    def build(records: Sequence[tuple], dtypes: Sequence[str] = _DTYPES) -> "OpRows":
        """From (kind, dtype key, peak, flops, bytes, m, n, k, batch, time_s) tuples."""
        keys = tuple(dtypes)
        columns = list(zip(*records)) if records else [()] * 10
        return OpRows(np.array(columns[0], dtype=int), np.array([keys.index(d) for d in columns[1]], dtype=int),
                      keys, *(np.array(c, dtype=float) for c in columns[2:]))

    @staticmethod
    def concat(parts: Sequence["OpRows"]) -> "OpRows":
        """Rows of several tables (same dtypes) one after the other."""
        first = parts[0]
        arrays = {name: np.concatenate([getattr(p, name) for p in parts])
                  for name in ("kind", "dtype_index", "peak", "flops", "bytes", "m", "n", "k", "batch", "time_s")}
        return OpRows(dtypes=first.dtypes, **arrays)

    def take(self, index: np.ndarray) -> "OpRows":
        """The rows at ``index`` (repeats allowed: bootstrap)."""
        arrays = {name: getattr(self, name)[index]
                  for name in ("kind", "dtype_index", "peak", "flops", "bytes", "m", "n", "k", "batch", "time_s")}
        return OpRows(dtypes=self.dtypes, **arrays)


def _numel(shape: Sequence[int]) -> int:
    return int(np.prod(shape)) if shape else 1


def _tensor_bytes(shapes: Sequence, dtypes: Sequence) -> list[int]:
    return [_numel(s) * _ITEMSIZE[d] for s, d in zip(shapes, dtypes) if d in _ITEMSIZE and isinstance(s, list)
            and (s or d != "double")]


def op_rows(document: Mapping[str, object], device: DeviceSpec) -> OpRows:
    """The profiler rows of one timing document that the roofline describes (minimum self time per call).

    GEMMs: flops 2mnk x batch, bytes = operands + output. Attention (CPU flash): 4 b h s^2 d / 2 (causal)
    forward, 2.5x that backward. Memory-bound ops: bytes = tensor inputs + an output of the largest input
    (in-place ops and copy_ write their first input).
    """
    records = []
    for name, shapes, dtypes, _calls, _median_us, min_us in document["ops"]["rows"]:
        if min_us <= 0:
            continue
        time_s = min_us * 1e-6
        if name in GEMM_OPS:
            first = 1 if name in ("aten::addmm", "aten::baddbmm") else 0
            if len(shapes) < first + 2 or len(dtypes) < first + 2 or dtypes[first] not in _TORCH_DTYPES:
                continue
            a, b = shapes[first], shapes[first + 1]
            batch = a[0] if len(a) == 3 else 1
            m, k, n = a[-2], a[-1], b[-1]
            key = rate_dtype(device, _TORCH_DTYPES[dtypes[first]])
            moved = sum(_tensor_bytes(shapes, dtypes)) + batch * m * n * _ITEMSIZE[dtypes[first]]
            records.append((0, key, device.peak_flop_per_s[key], 2.0 * m * n * k * batch, moved, m, n, k, batch,
                            time_s))
        elif name in ATTENTION_OPS and dtypes[0] in _TORCH_DTYPES:
            b, h, s, d = shapes[0]
            key = rate_dtype(device, _TORCH_DTYPES[dtypes[0]])
            flops = ATTENTION_OPS[name] * 4.0 * b * h * s * s * d / 2
            records.append((1, key, device.peak_flop_per_s[key], flops, sum(_tensor_bytes(shapes, dtypes)),
                            0, 0, 0, 1, time_s))
        elif name in MEMORY_OPS:
            sizes = _tensor_bytes(shapes, dtypes)
            if not sizes:
                continue
            if name in _SCALAR_INPUTS:
                moved = sizes[0]
            elif name.endswith("_"):
                moved = sum(sizes) + (sizes[0] if name != "aten::copy_" else 0)
            else:
                moved = sum(sizes) + max(sizes)
            records.append((2, "fp32", device.peak_flop_per_s["fp32"], 0.0, moved, 0, 0, 0, 1, time_s))
    return OpRows.build(records)


@dataclass(frozen=True)
class ConfigFeatures:
    """memsim's ops of one configuration's iteration as rows (bytes = traffic not served by L2)."""

    ops: OpRows
    l2_hit_bytes: np.ndarray


def config_features(name: str, config: Mapping[str, object], device: DeviceSpec) -> ConfigFeatures:
    """Build memsim's workload for a captured configuration and describe its ops (L2 hits as lower.timed_ops)."""
    scenario = scenario_from_dict(scenario_document(name, dict(config)), source=f"<{name}>")
    workload = build_workload(scenario, device)
    records, hits = [], []
    previous: dict[int, int] = {}
    for op in [*workload.first_microbatch, *workload.optimizer]:
        hit = 0
        if previous and sum(previous.values()) <= device.l2_bytes:
            hit = min(sum(previous.get(t, 0) for t in op.inputs), op.bytes_read)
        previous = {t: workload.tensors[t].nbytes for t in op.outputs if t in workload.tensors}
        kind = 0 if op.op_class == GEMM else 1 if op.op_class == ATTENTION else 2
        key = rate_dtype(device, op.dtype, kind < 2)
        m, n, k = op.gemm_mnk if (kind == 0 and op.gemm_mnk) else (0, 0, 0)
        records.append((kind, key, device.peak_flop_per_s[key], op.flops, op.bytes_read + op.bytes_written - hit,
                        m, n, k, op.gemm_batch, math.nan))
        hits.append(hit)
    return ConfigFeatures(OpRows.build(records), np.array(hits, dtype=float))


CUDA_DEVICES = (("H200", "h200-sxm"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"),
                ("A100-SXM4-40GB", "a100-40gb-sxm"), ("A100 80GB PCIe", "a100-80gb-pcie"), ("A100", "a100-80gb-sxm"),
                ("RTX 4090", "rtx-4090"), ("RTX 3090", "rtx-3090"), ("MI300X", "mi300x"))


def catalog_device(device: str, device_name: str) -> DeviceSpec:
    """The catalog DeviceSpec a capture ran on: "cpu", or the GPU whose name torch reported.

    Raises:
        DataError: a GPU memsim's catalog does not have.
    """
    if device == "cpu":
        return get_device("cpu")
    for marker, key in CUDA_DEVICES:
        if marker.lower() in device_name.lower():
            return get_device(key)
    raise DataError(f"device_name = {device_name!r}: no catalog device matches this GPU "
                    f"(known: {', '.join(m for m, _ in CUDA_DEVICES)})")


@dataclass(frozen=True)
class Dataset:
    """A capture folder loaded for fitting: per configuration the measured iteration time, op rows and features."""

    root: Path
    device: str                                   # "cpu" | "cuda"
    device_spec: DeviceSpec
    device_name: str
    torch_version: str
    clock: str                                    # which measured clock iteration_s holds
    files: tuple[str, ...]                        # data files used, relative to root
    names: tuple[str, ...]
    configs: Mapping[str, Mapping[str, object]]
    iteration_s: Mapping[str, float]
    timing: Mapping[str, Mapping[str, object]]    # the timing documents
    op_rows: Mapping[str, OpRows]
    features: Mapping[str, ConfigFeatures]
    collectives: Mapping[str, object] | None
    bytes_range: tuple[int, int]


def read_json(path: Path, what: str, required: Sequence[str]) -> dict:
    """Parse a data file and check its top-level keys.

    Raises:
        DataError: missing file, invalid JSON, or a required key absent (naming the file).
    """
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: {what} file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path}: not a readable {what} file ({error})") from None
    missing = [key for key in required if not isinstance(data, dict) or key not in data]
    if missing:
        raise DataError(f"{path}: not a {what} file (key {missing[0]!r} is missing)")
    return data


def check_same_capture(path: Path, env: Mapping[str, object], reference: Mapping[str, object], reference_file: str) -> None:
    """Raise DataError when ``env`` comes from another torch version or device than ``reference``."""
    for key in ("torch_version", "device", "device_name"):
        if key in env and key in reference and env[key] != reference[key]:
            raise DataError(f"{path}: captured with {key} = {env[key]!r} but {reference_file} has "
                            f"{reference[key]!r}; one data folder must hold one torch version on one device")


def load_dataset(data_dir: str | Path) -> Dataset:
    """Load a capture folder: timing/*.json (required) and collectives.json (optional).

    Raises:
        DataError: the folder or its timing files are missing, a file is corrupt, or files come from
            different torch versions or devices.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"{root}: capture folder not found (expected validation/data/<device>)")
    paths = sorted((root / "timing").glob("*.json"))
    if not paths:
        raise DataError(f"{root}: no timing/*.json capture files (run `memsim validate capture`)")
    timing, reference, reference_file = {}, None, ""
    for path in paths:
        doc = read_json(path, "timing capture", ("format", "name", "device", "config", "environment", "iteration", "ops"))
        if doc["format"] != CAPTURE_FORMAT:
            raise DataError(f"{path}: format = {doc['format']!r} must be {CAPTURE_FORMAT!r}")
        env = {**doc["environment"], "device": doc["device"]}
        if reference is None:
            reference, reference_file = env, path.name
        check_same_capture(path, env, reference, reference_file)
        timing[doc["name"]] = doc
    device = str(reference["device"])
    spec = catalog_device(device, str(reference.get("device_name", "")))
    clock = "cuda_event" if device == "cuda" else "cpu"
    names = tuple(timing)
    rows = {n: op_rows(timing[n], spec) for n in names}
    features = {n: config_features(n, timing[n]["config"], spec) for n in names}
    memory_bytes = np.concatenate([r.bytes[r.kind == 2] for r in rows.values()] + [np.zeros(0)])
    collectives = None
    files = [str(p.relative_to(root)) for p in paths]
    if (root / "collectives.json").exists():
        collectives = read_json(root / "collectives.json", "collectives", ("environment", "results"))
        check_same_capture(root / "collectives.json", {"torch_version": collectives["environment"].get("torch_version")},
                           reference, reference_file)
        files.append("collectives.json")
    return Dataset(root, device, spec, str(reference.get("device_name", "")), str(reference["torch_version"]), clock,
                   tuple(files), names, {n: timing[n]["config"] for n in names},
                   {n: float(timing[n]["iteration"][clock]["median_s"]) for n in names}, timing, rows, features,
                   collectives, (int(memory_bytes.min()) if memory_bytes.size else 0,
                                 int(memory_bytes.max()) if memory_bytes.size else 0))


def shape_factor(device: DeviceSpec, m, n, k, batch, k_overhead: float) -> np.ndarray:
    """cost.gemm_shape_factor on arrays, with a real-valued k overhead (1 where m = 0: no shape)."""
    m, n, k, batch = (np.asarray(v, dtype=float) for v in (m, n, k, batch))
    shaped = m > 0
    m1, n1, k1 = (np.where(shaped, v, 1.0) for v in (m, n, k))
    tile, sms = device.gemm_tile_mn, device.sm_count
    tiles = np.ceil(m1 / tile) * np.ceil(n1 / tile) * batch
    slots = np.ceil(tiles / sms) * sms
    factor = (m1 * n1 * batch) / (slots * tile * tile) * k1 / (k1 + k_overhead)
    return np.where(shaped, factor, 1.0)


# ----------------------------------------------------------------------------------------------------------------
# The roofline on arrays (cost.py's formula, vectorized)


def predict_ops_s(rows: OpRows, device: DeviceSpec, params: Params, overhead_s: float | None = None) -> np.ndarray:
    """Seconds per row under ``params``: max(FLOP / rate, bytes / bw) + overhead (default op_overhead_s)."""
    eff = np.array([params.gemm_efficiency.get(d, 1.0) for d in rows.dtypes])[rows.dtype_index]
    ref_mnk = [np.array([v]) for v in device.gemm_reference_mnk]
    reference = shape_factor(device, *ref_mnk, np.array([1.0]), params.gemm_k_overhead)[0]
    gemm_factor = eff * np.where(rows.m > 0, shape_factor(device, rows.m, rows.n, rows.k, rows.batch,
                                                          params.gemm_k_overhead) / reference, 1.0)
    rate = rows.peak * np.where(rows.kind == 0, gemm_factor, np.where(rows.kind == 1, params.attention_efficiency, 1.0))
    compute = rows.flops / rate
    overhead = params.op_overhead_s if overhead_s is None else overhead_s
    return np.maximum(compute, rows.bytes / params.memory_bytes_per_s) + overhead


def predict_iteration_s(features: ConfigFeatures, device: DeviceSpec, params: Params) -> float:
    """memsim's iteration time of one configuration under ``params`` (lower.timed_ops summed, vectorized)."""
    body = predict_ops_s(features.ops, device, params, overhead_s=0.0)
    total = np.maximum(body, features.l2_hit_bytes / device.l2_bytes_per_s)
    return float(total.sum() + params.launch_overhead_s * len(total))


# ----------------------------------------------------------------------------------------------------------------
# Fits


def _soft_l1(fun, x0, lower, upper):
    return least_squares(fun, x0, bounds=(lower, upper), loss="soft_l1", f_scale=SOFT_L1_SCALE, x_scale="jac")


def fit_ops(rows: OpRows, device: DeviceSpec, start: Params) -> Params:
    """Stage 1: fit bandwidth, per-op overhead, GEMM efficiency per dtype, k overhead and attention efficiency.

    Parameters without data (a dtype with no GEMM row, attention without rows) keep ``start``'s value.

    Raises:
        DataError: fewer than 3 rows.
    """
    if len(rows.kind) < 3:
        raise DataError(f"stage-1 fit needs at least 3 profiled op rows, got {len(rows.kind)}")
    gemm_dtypes = [d for i, d in enumerate(rows.dtypes) if np.any((rows.kind == 0) & (rows.dtype_index == i))]
    has_attention = bool(np.any(rows.kind == 1))
    has_gemm = bool(gemm_dtypes)
    names = ["log_bw", "log_overhead"] + [f"log_eff_{d}" for d in gemm_dtypes] + (["k0"] if has_gemm else []) \
        + (["log_att"] if has_attention else [])
    x0 = [math.log(start.memory_bytes_per_s), math.log(max(start.op_overhead_s, 1e-7))]
    x0 += [math.log(min(max(start.gemm_efficiency.get(d, 1.0), 1e-3), 1.9)) for d in gemm_dtypes]
    x0 += [min(max(start.gemm_k_overhead, 0.0), 4000.0)] if has_gemm else []
    x0 += [math.log(min(max(start.attention_efficiency, 1e-3), 0.99))] if has_attention else []
    lower = [math.log(1e6), math.log(1e-8)] + [math.log(1e-4)] * len(gemm_dtypes) + ([0.0] if has_gemm else []) \
        + ([math.log(1e-4)] if has_attention else [])
    upper = [math.log(1e14), math.log(1e-1)] + [math.log(2.0)] * len(gemm_dtypes) + ([4096.0] if has_gemm else []) \
        + ([0.0] if has_attention else [])
    measured = np.log(rows.time_s)

    def unpack(x: np.ndarray) -> Params:
        values = dict(zip(names, x))
        eff = dict(start.gemm_efficiency)
        eff.update({d: math.exp(values[f"log_eff_{d}"]) for d in gemm_dtypes})
        return replace(start, gemm_efficiency=eff, memory_bytes_per_s=math.exp(values["log_bw"]),
                       op_overhead_s=math.exp(values["log_overhead"]),
                       gemm_k_overhead=values.get("k0", start.gemm_k_overhead),
                       attention_efficiency=math.exp(values["log_att"]) if has_attention else start.attention_efficiency)

    def residuals(x: np.ndarray) -> np.ndarray:
        return np.log(predict_ops_s(rows, device, unpack(x))) - measured

    result = _soft_l1(residuals, np.clip(x0, lower, upper), lower, upper)
    return unpack(result.x)


def fit_launch(features: Sequence[ConfigFeatures], measured_s: Sequence[float], device: DeviceSpec,
               params: Params) -> Params:
    """Stage 2: memsim's per-op launch_overhead_s from iteration times, stage-1 numbers fixed.

    Raises:
        DataError: no configuration to fit.
    """
    if not features:
        raise DataError("stage-2 fit needs at least one configuration with a measured iteration time")
    base = np.array([predict_iteration_s(f, device, replace(params, launch_overhead_s=0.0)) for f in features])
    counts = np.array([len(f.ops.kind) for f in features], dtype=float)
    target = np.log(np.asarray(measured_s, dtype=float))

    def residuals(x: np.ndarray) -> np.ndarray:
        return np.log(base + counts * math.exp(x[0])) - target

    guess = max(float(np.median((np.exp(target) - base) / counts)), 1e-7)
    result = _soft_l1(residuals, [math.log(min(guess, 0.05))], [math.log(1e-9)], [math.log(0.1)])
    return replace(params, launch_overhead_s=math.exp(result.x[0]))


@dataclass(frozen=True)
class DeviceFit:
    """A device fit: the params, the configurations it used, and its in-sample residuals (log ratios)."""

    params: Params
    names: tuple[str, ...]
    op_log_residuals: tuple[float, ...]
    iteration_log_residuals: tuple[float, ...]


def fit_device(dataset: Dataset, names: Sequence[str] | None = None) -> DeviceFit:
    """Stage 1 then stage 2 on the named configurations (default all) of ``dataset``.

    Raises:
        DataError: no configuration or too few op rows.
    """
    chosen = tuple(names if names is not None else dataset.names)
    device = dataset.device_spec
    rows = OpRows.concat([dataset.op_rows[n] for n in chosen])
    start = device_params(device)
    params = fit_ops(rows, device, start)
    features = [dataset.features[n] for n in chosen]
    measured = [dataset.iteration_s[n] for n in chosen]
    params = fit_launch(features, measured, device, params)
    op_res = np.log(predict_ops_s(rows, device, params)) - np.log(rows.time_s)
    it_res = [math.log(predict_iteration_s(f, device, params) / m) for f, m in zip(features, measured)]
    return DeviceFit(params, chosen, tuple(float(v) for v in op_res), tuple(it_res))


# ----------------------------------------------------------------------------------------------------------------
# Links


BUS_FACTORS = {"all_reduce": lambda n: 2.0 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def link_bus_bytes(collective: str, world_size: int, size_bytes: float) -> float:
    """Bytes each rank moves over its link for a collective of ``size_bytes`` (nccl-tests bus bytes).

    Raises:
        DataError: an unknown collective.
    """
    if collective not in BUS_FACTORS:
        raise DataError(f"collective = {collective!r} is unknown; allowed: {', '.join(BUS_FACTORS)}")
    return BUS_FACTORS[collective](world_size) * size_bytes


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


def _param_values(params: Params) -> dict[str, float]:
    values = {f"gemm_efficiency.{k}": v for k, v in params.gemm_efficiency.items()}
    values.update({"gemm_k_overhead": params.gemm_k_overhead, "attention_efficiency": params.attention_efficiency,
                   "memory_bytes_per_s": params.memory_bytes_per_s, "op_overhead_s": params.op_overhead_s,
                   "launch_overhead_s": params.launch_overhead_s})
    return values


def calibrate(data_dir: str | Path, bootstrap: int = BOOTSTRAP, seed: int = SEED) -> Calibration:
    """Load a capture folder, fit the device (all configurations) and links, and bootstrap 95% intervals.

    Raises:
        DataError: missing, corrupt or inconsistent data (see validation.dataset.load_dataset).
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
        rows = rows.take(rng.integers(0, len(rows.kind), len(rows.kind)))
        params = fit_ops(rows, device, fit.params)
        params = fit_launch([dataset.features[n] for n in picked], [dataset.iteration_s[n] for n in picked],
                            device, params)
        for key, value in _param_values(params).items():
            draws.setdefault(key, []).append(value)
    intervals = {k: (float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))) for k, v in draws.items()}
    links = tuple(fit_links(dataset.collectives["results"], bootstrap, seed)) if dataset.collectives else ()
    notes = [f"stage 1: {len(fit.op_log_residuals)} profiler rows (minimum self time per call) of {len(names)} "
             f"configurations; stage 2: iteration times ({dataset.clock} clock)",
             f"memory-bound ops of the data move {dataset.bytes_range[0]}..{dataset.bytes_range[1]} bytes; the "
             f"{'DRAM' if dataset.bytes_range[1] > device.l2_bytes else 'last-level-cache'} tier is the only one "
             f"with data, so hbm_efficiency is the rate of that tier and l2_bytes_per_s keeps its default"]
    return Calibration(dataset, fit, intervals, links, bootstrap, seed, tuple(notes))


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
    fields = overrides(device, calibration.fit.params)
    lines = ["# Written by `memsim calibrate`; apply with [cluster] calibration = \"<this file>\".",
             f"format = {_toml_value(CALIBRATION_FORMAT)}", f"device = {_toml_value(device.name)}",
             f"device_name = {_toml_value(ds.device_name)}", f"torch_version = {_toml_value(ds.torch_version)}",
             f"clock = {_toml_value(ds.clock)}", f"data = {_toml_value(list(ds.files))}",
             f"bootstrap = {calibration.bootstrap}", f"seed = {calibration.seed}",
             f"notes = {_toml_value(list(calibration.notes))}", "", "[fields]"]
    for key, value in fields.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {_toml_value(value)}")
    for key, value in fields.items():
        if isinstance(value, dict):
            lines += ["", f"[fields.{key}]"] + [f"{k} = {_toml_value(v)}" for k, v in value.items()]
    lines += ["", "[fitted]  # the fit's own numbers (memory_bytes_per_s = hbm_bytes_per_s x hbm_efficiency)"]
    lines += [f'"{k}" = {_toml_value(float(v))}' for k, v in _param_values(calibration.fit.params).items()]
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
