"""Resolve a scenario's [cluster] and [allocator]: the (calibrated) device a rank runs on and its memory budget."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from simulator.errors import DataError, TopologyError
from simulator.hardware.bounds import check_upper
from simulator.hardware.catalog import DeviceSpec, get_device, with_overrides
from simulator.scenario import Scenario

CALIBRATION_FORMAT = "memsim-calibration-1"
# DeviceSpec fields a calibration file may set (dict fields take a table of dtype -> value).
CALIBRATABLE_FIELDS = ("launch_overhead_s", "hbm_efficiency", "hbm_bytes_per_s", "l2_bytes_per_s",
                       "attention_efficiency", "gemm_efficiency", "gemm_k_overhead", "gemm_unaligned_efficiency",
                       "peak_flop_per_s", "comm_kernel_sms", "host_forward_op_s", "host_backward_op_s",
                       "host_checkpoint_s", "host_optimizer_tensor_s")
_DICT_FIELDS = ("gemm_efficiency", "peak_flop_per_s")


@dataclass(frozen=True)
class LinkFit:
    """A fitted collective cost t = latency_s + bus_bytes / bytes_per_s for one collective and group size."""

    collective: str
    world_size: int
    latency_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class Calibration:
    """A calibration file: the device it was fitted for, the DeviceSpec fields to apply, and link fits."""

    path: str
    device: str
    torch_version: str
    fields: Mapping[str, object]
    links: tuple[LinkFit, ...] = ()
    fitted: Mapping[str, float] = field(default_factory=dict)     # [fitted]: the fit's own rates
    ci95: Mapping[str, tuple[float, float]] = field(default_factory=dict)   # [ci95]: their bootstrap intervals
    bootstrap: int = 0
    data_dir: str = ""


@dataclass(frozen=True)
class Cluster:
    """A one-device cluster: the device, the allocator model and the bytes the allocator may use."""

    device: DeviceSpec
    nodes: int
    allocator_kind: str
    context_bytes: int              # memory outside the allocator (CUDA context, library workspaces)
    allocator_capacity_bytes: int   # device memory minus context_bytes, capped by allocator.memory_fraction
    calibration: Calibration | None = field(default=None, compare=False)
    topology: object | None = field(default=None, compare=False)   # network Topology of a multi-GPU cluster

    @property
    def capacity_bytes(self) -> int:
        return self.device.memory_bytes


def _number(path: str, key: str, value: object, integer: bool = False, table: str = "fields") -> float | int:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(value) or value < 0:
        kind = "a non-negative integer" if integer else "a finite non-negative number"
        raise DataError(f"{path}: {table}.{key} = {value!r} must be {kind}")
    beyond = check_upper(key.split(".")[0] if table == "fields" else key.rsplit(".", 1)[-1], value)
    if beyond:
        raise DataError(f"{path}: {table}.{key} = {value!r} {beyond}")
    return value


def read_calibration(path: str | Path) -> Calibration:
    """Read and check a calibration file written by `memsim calibrate` (TOML).

    Args:
        path: the file.

    Returns:
        The Calibration (fields limited to CALIBRATABLE_FIELDS).

    Raises:
        DataError: the file is missing, not TOML, of another format, or has an unknown or invalid field.
    """
    name = str(path)
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DataError(f"{name}: calibration file not found") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise DataError(f"{name}: not a readable calibration file ({error})") from None
    if data.get("format") != CALIBRATION_FORMAT:
        raise DataError(f"{name}: format = {data.get('format')!r} must be {CALIBRATION_FORMAT!r} "
                        f"(a file written by `memsim calibrate`)")
    device = data.get("device")
    if not isinstance(device, str) or not device:
        raise DataError(f"{name}: device = {device!r} must name the catalog device the fit is for")
    raw = data.get("fields", {})
    if not isinstance(raw, dict):
        raise DataError(f"{name}: fields must be a table of DeviceSpec fields")
    fields: dict[str, object] = {}
    for key, value in raw.items():
        if key not in CALIBRATABLE_FIELDS:
            raise DataError(f"{name}: fields.{key} is not calibratable; allowed: {', '.join(CALIBRATABLE_FIELDS)}")
        if key in _DICT_FIELDS:
            if not isinstance(value, dict) or not value:
                raise DataError(f"{name}: fields.{key} = {value!r} must be a table of dtype -> number")
            fields[key] = {dtype: float(_number(name, f"{key}.{dtype}", v)) for dtype, v in value.items()}
        elif key in ("gemm_k_overhead", "comm_kernel_sms"):
            fields[key] = int(_number(name, key, value, integer=True))
        else:
            fields[key] = float(_number(name, key, value))
    return Calibration(name, device, str(data.get("torch_version", "")), fields, _links(name, data.get("links", {})),
                       *_intervals(data), str(data.get("data_dir", "")))


def _links(name: str, table: object) -> tuple[LinkFit, ...]:
    """The [links.COLLECTIVE.WORLD] fits of a calibration file, checked."""
    if not isinstance(table, dict):
        raise DataError(f"{name}: links = {_short(table)} must be a table of collectives ([links.all_reduce.4])")
    links = []
    for collective, groups in sorted(table.items()):
        if not isinstance(groups, dict):
            raise DataError(f"{name}: links.{collective} must be a table of world sizes")
        for world, fit in sorted(groups.items(), key=lambda item: item[0]):
            if not (world.isascii() and world.isdigit() and len(world) <= 7 and 0 < int(world) <= 1 << 20) or not isinstance(fit, dict) \
                    or "latency_s" not in fit or "bytes_per_s" not in fit:
                raise DataError(f"{name}: links.{collective}.{world} must be a world size (1 to 1048576) with "
                                f"numbers latency_s and bytes_per_s")
            where = f"{collective}.{world}"
            latency = _number(name, f"{where}.latency_s", fit["latency_s"], table="links")
            rate = _number(name, f"{where}.bytes_per_s", fit["bytes_per_s"], table="links")
            if rate <= 0:
                raise DataError(f"{name}: links.{where}.bytes_per_s = {rate!r} must be positive")
            links.append(LinkFit(collective, int(world), float(latency), float(rate)))
    return tuple(links)


def _short(value: object) -> str:
    try:
        text = repr(value)
    except ValueError:          # an int too long for str()
        text = f"<{type(value).__name__} too large to print>"
    return text if len(text) <= 40 else text[:37] + "..."


def _intervals(data: dict) -> tuple[dict, dict, int]:
    """[fitted] rates with a numeric [ci95] interval, their intervals, and the bootstrap count."""
    fitted, ci95 = {}, {}
    intervals = data.get("ci95") if isinstance(data.get("ci95"), dict) else {}
    table = data.get("fitted") if isinstance(data.get("fitted"), dict) else {}
    for key, value in table.items():
        interval = intervals.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
                isinstance(interval, list) and len(interval) == 2
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in interval)):
            continue            # only the rates with a numeric interval feed the iteration-time interval
        fitted[key], ci95[key] = float(value), (float(interval[0]), float(interval[1]))
    bootstrap = data.get("bootstrap", 0)
    return fitted, ci95, bootstrap if isinstance(bootstrap, int) and not isinstance(bootstrap, bool) else 0


def apply_calibration(device: DeviceSpec, calibration: Calibration) -> DeviceSpec:
    """The device with the calibration's fitted fields applied (each field's source names the file).

    Raises:
        TopologyError: the calibration was fitted for another device, or a fitted value is invalid.
    """
    if calibration.device != device.name:
        raise TopologyError(f"{calibration.path}: calibration is for device {calibration.device!r} but the "
                            f"scenario's device is {device.name!r}")
    source = {}
    for key, value in calibration.fields.items():
        note = f"calibrated: {calibration.path} (torch {calibration.torch_version})"
        if isinstance(value, dict):
            source.update({f"{key}.{sub}": note for sub in value})
        else:
            source[key] = note
    if "hbm_efficiency" in calibration.fields:
        # The fit measured one rate for every memory-bound op: it replaces the catalog's rates by op class.
        device = dataclasses.replace(device, hbm_efficiency_by_class={}, source={
            k: v for k, v in device.source.items() if not k.startswith("hbm_efficiency_by_class.")})
    try:
        return with_overrides(device, **dict(calibration.fields), source=source)
    except TopologyError as error:
        raise TopologyError(f"{calibration.path}: {error}") from None


def resolve_cluster(scenario: Scenario) -> Cluster:
    """Find the device named by cluster.topology, apply cluster.calibration, and size the allocator's budget."""
    name = scenario.cluster.topology
    topology = None
    p = scenario.parallel
    try:
        device = get_device(name)
    except TopologyError as error:
        if p.dp * p.tp * p.pp == 1 and not _one_gpu(name):
            raise TopologyError(f"{scenario.source}: cluster.topology = {name!r}: "
                                f"{_multi_gpu_hint(name) or error}") from None
        topology = _multi_gpu_topology(scenario, name, error)
        device = topology.gpu_device
    calibration = None
    if scenario.cluster.calibration is not None:
        try:
            calibration = read_calibration(scenario.cluster.calibration)
        except DataError as error:
            raise DataError(f"{scenario.source}: cluster.calibration: {error}") from None
        try:
            device = apply_calibration(device, calibration)
        except TopologyError as error:
            raise TopologyError(f"{scenario.source}: cluster.calibration: {error}") from None
    if topology is None and scenario.cluster.nodes != 1:
        raise TopologyError(f"{scenario.source}: cluster.nodes = {scenario.cluster.nodes}: a single "
                            f"device topology has exactly one node")
    kind = scenario.allocator.kind
    if kind == "auto":
        kind = device.default_allocator
    context = scenario.allocator.context_bytes
    if context is None:
        context = device.context_bytes
    if context >= device.memory_bytes:
        raise TopologyError(f"{scenario.source}: allocator.context_bytes = {context}: must be less than "
                            f"the device memory ({device.memory_bytes} bytes)")
    nodes = 1 if topology is None else topology.nodes
    capacity = device.memory_bytes - context
    fraction = scenario.allocator.memory_fraction
    if fraction < 1.0:
        # torch.cuda.set_per_process_memory_fraction: the caching allocator refuses a cudaMalloc that would take
        # its reserved bytes past int(fraction x total device memory) (CUDACachingAllocator's
        # allowed_memory_maximum); the rest of the card stays unused.
        capacity = min(capacity, int(fraction * device.memory_bytes))
    return Cluster(device, nodes, kind, context, capacity, calibration, topology)


def _multi_gpu_topology(scenario: Scenario, name: str, error: TopologyError):
    """Load the multi-GPU topology cluster.topology names, with cluster.nodes servers."""
    from simulator.network.topology import list_topologies, load_topology

    if name not in list_topologies() and not name.endswith(".toml"):
        raise TopologyError(f"{scenario.source}: cluster.topology = {name!r}: {error}") from None
    try:
        return load_topology(name, nodes=scenario.cluster.nodes)
    except TopologyError as failure:
        raise TopologyError(f"{scenario.source}: cluster.topology = {name!r}: {failure}") from None


def _one_gpu(name: str) -> bool:
    """Whether `name` is a topology (bundled or a file) of one-GPU servers (a single-GPU run uses it as it is)."""
    from simulator.network.topology import list_topologies, load_topology

    if name not in list_topologies() and not name.endswith(".toml"):
        return False
    try:
        return load_topology(name).gpus_per_node == 1
    except TopologyError:
        return False


def _multi_gpu_hint(name: str) -> str:
    """For a multi-GPU topology name: say which single device to simulate instead ('' otherwise)."""
    from simulator.network.topology import list_topologies, load_topology

    if name not in list_topologies():
        return ""
    topology = load_topology(name)
    return (f"{topology.num_gpus}-GPU topology; this version simulates one device "
            f"(tp = pp = dp = 1): set cluster.topology to its GPU, {topology.gpu_device.name!r}")
