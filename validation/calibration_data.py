"""Captured data as fitting input: load a capture folder, turn profiler rows and memsim's ops into arrays, price them.

The roofline here is simulator/hardware/cost.py's formula on numpy arrays, with the numbers a calibration
fits held in `Params`; tests check it against cost.op_time_s and simulate() to the last digit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simulator.api import build_workload
from simulator.errors import DataError
from simulator.hardware.catalog import FLOP_DTYPES, DeviceSpec, get_device
from simulator.hardware.cost import ALIGNMENT_BYTES, rate_dtype
from simulator.scenario import scenario_from_dict
from simulator.workload.graph import ATTENTION as ATTENTION_CLASS
from simulator.workload.graph import DTYPE_BYTES
from simulator.workload.graph import GEMM as GEMM_CLASS
from validation.memory_comparison import scenario_document

__all__ = ["CAPTURE_FORMAT", "Params", "OpRows", "ConfigFeatures", "Dataset", "device_params", "op_rows",
           "config_features", "catalog_device", "read_json", "check_same_capture", "load_dataset", "shape_factor",
           "predict_ops_s", "predict_iteration_s"]

CAPTURE_FORMAT = "memsim-timing-2"
GEMM, ATTN, MEMORY = 0, 1, 2          # OpRows.kind
_TORCH_DTYPES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16"}
_ITEMSIZE = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "bool": 1,
             "unsigned char": 1, "signed char": 1, "short int": 2}
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
# Fused attention kernels (CPU flash; CUDA flash, memory-efficient, cuDNN): FLOP multiple of the forward.
ATTENTION_OPS = {f"aten::_scaled_dot_product_{kind}": 1.0 for kind in (
    "flash_attention_for_cpu", "flash_attention", "efficient_attention", "cudnn_attention")}
ATTENTION_OPS.update({f"{name}_backward": 2.5 for name in tuple(ATTENTION_OPS)})
# aten ops that stream their operands once (elementwise, copies, norms, softmax, optimizer updates).
MEMORY_OPS = frozenset(f"aten::{n}" for n in (
    "add", "sub", "mul", "div", "neg", "gelu", "gelu_backward", "silu", "silu_backward", "pow", "rsqrt", "sqrt",
    "masked_fill", "masked_fill_", "copy_", "add_", "mul_", "div_", "addcmul_", "addcdiv_", "lerp_", "sqrt_",
    "_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data", "native_layer_norm",
    "native_layer_norm_backward", "bernoulli_", "clone", "cat", "where", "fill_", "zero_", "mean", "sum"))
_WRITE_ONLY = ("aten::fill_", "aten::zero_", "aten::bernoulli_")   # overwrite their first input, read nothing
CUDA_DEVICES = (("H200", "h200-sxm"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"),
                ("A100-SXM4-40GB", "a100-40gb-sxm"), ("A100 80GB PCIe", "a100-80gb-pcie"), ("A100", "a100-80gb-sxm"),
                ("RTX 4090", "rtx-4090"), ("RTX 3090", "rtx-3090"), ("MI300X", "mi300x"))


@dataclass(frozen=True)
class Params:
    """The device-model numbers a calibration fits (SI units).

    gemm_efficiency and peak_flop_per_s are the DeviceSpec dicts; memory_bytes_per_s is the effective
    rate of memory-bound traffic (hbm_bytes_per_s x hbm_efficiency); op_overhead_s is the per-aten-op
    overhead of the op-level fit (reported, not applied); launch_overhead_s is what memsim adds per op.
    """

    gemm_efficiency: Mapping[str, float]
    peak_flop_per_s: Mapping[str, float]
    gemm_k_overhead: float
    attention_efficiency: float
    memory_bytes_per_s: float
    op_overhead_s: float
    launch_overhead_s: float


def device_params(device: DeviceSpec) -> Params:
    """The Params a DeviceSpec implies (op_overhead_s = launch_overhead_s)."""
    return Params(dict(device.gemm_efficiency), dict(device.peak_flop_per_s), float(device.gemm_k_overhead),
                  device.attention_efficiency, device.hbm_bytes_per_s * device.hbm_efficiency,
                  device.launch_overhead_s, device.launch_overhead_s)


@dataclass(frozen=True)
class OpRows:
    """Ops as arrays: kind (GEMM, ATTN, MEMORY), rate dtype, FLOP, bytes, GEMM shape, measured time, weight.

    ``dtype_index`` points into FLOP_DTYPES (the peak_flop_per_s / gemm_efficiency key of the row); m = 0
    marks a GEMM without a shape (no shape factor); ``time_s`` is the measured time per call (NaN for
    memsim's ops); ``weight`` is the row's weight in the op-level fit.
    """

    kind: np.ndarray
    dtype_index: np.ndarray
    flops: np.ndarray
    bytes: np.ndarray
    m: np.ndarray
    n: np.ndarray
    k: np.ndarray
    batch: np.ndarray
    time_s: np.ndarray
    weight: np.ndarray

    FIELDS = ("kind", "dtype_index", "flops", "bytes", "m", "n", "k", "batch", "time_s", "weight")

    @staticmethod
    def build(records: Sequence[tuple]) -> "OpRows":
        """From (kind, rate dtype, flops, bytes, m, n, k, batch, time_s, weight) tuples."""
        columns = list(zip(*records)) if records else [()] * 10
        index = np.array([FLOP_DTYPES.index(d) for d in columns[1]], dtype=int)
        return OpRows(np.array(columns[0], dtype=int), index, *(np.array(c, dtype=float) for c in columns[2:]))

    @staticmethod
    def concat(parts: Sequence["OpRows"]) -> "OpRows":
        """The rows of several tables, one after the other."""
        return OpRows(**{name: np.concatenate([getattr(p, name) for p in parts]) for name in OpRows.FIELDS})

    def take(self, index: np.ndarray) -> "OpRows":
        """The rows at ``index`` (repeats allowed: bootstrap)."""
        return OpRows(**{name: getattr(self, name)[index] for name in OpRows.FIELDS})

    def __len__(self) -> int:
        return len(self.kind)


def _tensor_bytes(shapes: Sequence, dtypes: Sequence) -> list[int]:
    return [int(np.prod(s)) * _ITEMSIZE[d] if s else _ITEMSIZE[d]
            for s, d in zip(shapes, dtypes) if d in _ITEMSIZE and isinstance(s, list)]


def op_rows(document: Mapping[str, object], device: DeviceSpec) -> OpRows:
    """The profiler rows of one timing document that the roofline describes (minimum self time per call).

    GEMMs: flops 2mnk x batch, bytes = operands + output. Fused attention: 4 b h s^2 d / 2 (causal)
    forward, 2.5 times that backward. Memory-bound ops: bytes = tensor inputs + an output as large as the
    largest input (in-place ops and copy_ write their first input). Each row's weight is
    sqrt(its share of the document's modelled time per step), so every configuration weighs the same and,
    inside one, ops weigh by the time they take.
    """
    records = []
    for name, shapes, _layouts, dtypes, calls, _median_us, min_us in document["ops"]["rows"]:
        if min_us <= 0 or calls <= 0:
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
            records.append((GEMM, key, 2.0 * m * n * k * batch, moved, m, n, k, batch, time_s, calls))
        elif name in ATTENTION_OPS and dtypes and dtypes[0] in _TORCH_DTYPES:
            b, h, s, d = shapes[0]
            key = rate_dtype(device, _TORCH_DTYPES[dtypes[0]])
            flops = ATTENTION_OPS[name] * 4.0 * b * h * s * s * d / 2
            records.append((ATTN, key, flops, sum(_tensor_bytes(shapes, dtypes)), 0, 0, 0, 1, time_s, calls))
        elif name in MEMORY_OPS:
            sizes = _tensor_bytes(shapes, dtypes)
            if not sizes:
                continue
            if name in _WRITE_ONLY:
                moved = sizes[0]
            elif name.endswith("_"):
                moved = sum(sizes) + (sizes[0] if name != "aten::copy_" else 0)
            else:
                moved = sum(sizes) + max(sizes)
            records.append((MEMORY, "fp32", 0.0, moved, 0, 0, 0, 1, time_s, calls))
    total = sum(r[8] * r[9] for r in records) or 1.0
    return OpRows.build([(*r[:9], math.sqrt(r[8] * r[9] / total)) for r in records])


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
        kind = GEMM if op.op_class == GEMM_CLASS else ATTN if op.op_class == ATTENTION_CLASS else MEMORY
        key = rate_dtype(device, op.dtype, kind != MEMORY)
        m, n, k = op.gemm_mnk if (kind == GEMM and op.gemm_mnk) else (0, 0, 0)
        records.append((kind, key, op.flops, op.bytes_read + op.bytes_written - hit, m, n, k, op.gemm_batch,
                        math.nan, 1.0))
        hits.append(hit)
    return ConfigFeatures(OpRows.build(records), np.array(hits, dtype=float))


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
    memory_op_bytes: tuple[int, int]              # smallest and largest memory-bound profiler row


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


def check_same_capture(path: Path, env: Mapping[str, object], reference: Mapping[str, object],
                       reference_file: str) -> None:
    """Raise DataError when ``env`` comes from another torch version or device than ``reference``."""
    for key in ("torch_version", "device", "device_name"):
        if env.get(key) is not None and reference.get(key) is not None and env[key] != reference[key]:
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
    timing: dict[str, dict] = {}
    reference: dict = {}
    reference_file = ""
    for path in paths:
        doc = read_json(path, "timing capture",
                        ("format", "name", "device", "config", "environment", "iteration", "ops"))
        if doc["format"] != CAPTURE_FORMAT:
            raise DataError(f"{path}: format = {doc['format']!r} must be {CAPTURE_FORMAT!r} (recapture it)")
        env = {**doc["environment"], "device": doc["device"]}
        if not reference:
            reference, reference_file = env, path.name
        check_same_capture(path, env, reference, reference_file)
        timing[doc["name"]] = doc
    device = str(reference["device"])
    spec = catalog_device(device, str(reference.get("device_name", "")))
    clock = "cuda_event" if device == "cuda" else "cpu"
    names = tuple(timing)
    try:
        measured = {n: float(timing[n]["iteration"][clock]["median_s"]) for n in names}
        rows = {n: op_rows(timing[n], spec) for n in names}
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise DataError(f"{root / 'timing'}: a timing file has a malformed iteration or ops table "
                        f"({error!r})") from None
    features = {n: config_features(n, timing[n]["config"], spec) for n in names}
    sizes = np.concatenate([r.bytes[r.kind == MEMORY] for r in rows.values()] + [np.zeros(0)])
    collectives = None
    files = [str(p.relative_to(root)) for p in paths]
    if (root / "collectives.json").exists():
        collectives = read_json(root / "collectives.json", "collectives", ("environment", "results"))
        torch_version = {"torch_version": collectives["environment"].get("torch_version")}
        check_same_capture(root / "collectives.json", torch_version, reference, reference_file)
        files.append("collectives.json")
    return Dataset(root, device, spec, str(reference.get("device_name", "")), str(reference["torch_version"]), clock,
                   tuple(files), names, {n: timing[n]["config"] for n in names}, measured, timing, rows, features,
                   collectives, (int(sizes.min()), int(sizes.max())) if sizes.size else (0, 0))


# ----------------------------------------------------------------------------------------------------------------
# The roofline on arrays (cost.py's formula, vectorized)


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


def unaligned_cap(rows: OpRows, device: DeviceSpec) -> np.ndarray:
    """cost.gemm_unaligned_cap on arrays, by the row's rate dtype (inf: no cap)."""
    none = np.full(len(rows.m), np.inf)
    if device.gemm_unaligned_efficiency == 0:
        return none
    width = np.array([4 if d == "tf32" else DTYPE_BYTES[d] for d in FLOP_DTYPES])[rows.dtype_index]
    common = np.gcd.reduce(np.stack([rows.m, rows.n, rows.k]).astype(np.int64), axis=0)
    alignment = np.minimum(ALIGNMENT_BYTES, width * (common & -common))
    cap = device.gemm_unaligned_efficiency * np.minimum(alignment, 4) / 4
    tensor = np.array([d != "fp32" for d in FLOP_DTYPES])[rows.dtype_index]
    return np.where((rows.m > 0) & tensor & (alignment < ALIGNMENT_BYTES), cap, none)


def predict_ops_s(rows: OpRows, device: DeviceSpec, params: Params, overhead_s: float | None = None) -> np.ndarray:
    """Seconds per row under ``params``: max(FLOP / rate, bytes / bandwidth) + overhead (default op_overhead_s)."""
    peak = np.array([params.peak_flop_per_s.get(d, 1.0) for d in FLOP_DTYPES])[rows.dtype_index]
    eff = np.array([params.gemm_efficiency.get(d, 1.0) for d in FLOP_DTYPES])[rows.dtype_index]
    reference = shape_factor(device, *[[v] for v in device.gemm_reference_mnk], [1], params.gemm_k_overhead)[0]
    shaped = shape_factor(device, rows.m, rows.n, rows.k, rows.batch, params.gemm_k_overhead)
    gemm = np.minimum(eff * np.where(rows.m > 0, shaped / reference, 1.0), unaligned_cap(rows, device))
    rate = peak * np.where(rows.kind == GEMM, gemm, np.where(rows.kind == ATTN, params.attention_efficiency, 1.0))
    overhead = params.op_overhead_s if overhead_s is None else overhead_s
    return np.maximum(rows.flops / rate, rows.bytes / params.memory_bytes_per_s) + overhead


def predict_iteration_s(features: ConfigFeatures, device: DeviceSpec, params: Params) -> float:
    """memsim's iteration time of one configuration under ``params`` (lower.timed_ops summed, vectorized)."""
    body = predict_ops_s(features.ops, device, params, overhead_s=0.0)
    total = np.maximum(body, features.l2_hit_bytes / device.l2_bytes_per_s)
    return float(total.sum() + params.launch_overhead_s * len(total))
