"""Server topology definitions: the TOML schema of topologies/*.toml, parsed and validated into frozen specs."""

from __future__ import annotations

import difflib
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from simulator.errors import TopologyError
from simulator.hardware.catalog import get_device
from simulator.units import parse_bytes, parse_bytes_per_s, parse_seconds

LINK_CLASSES = ("nvlink", "pcie", "memory", "socket", "network", "storage")
COMPONENT_KINDS = ("nvswitch", "pcie_switch", "root_complex", "root_port", "host_memory", "nic", "nvme")
CAPACITY_KINDS = ("host_memory", "nvme")     # components that hold bytes (`capacity`)
SHARING = ("none", "pair", "all")
_TOP_KEYS = ("name", "description", "gpu", "gpus", "source", "links", "components", "connect", "nic_of_gpu",
             "fabric", "host")
_LINK_KEYS = ("class", "bytes_per_s", "source", "efficiency", "efficiency_source", "latency_s", "latency_source",
              "write_bytes_per_s")
_COMPONENT_KEYS = ("kind", "names", "source", "in_switch_reduction", "capacity", "capacity_source")
_HOST_KEYS = ("cpu_adam_elements_per_s", "cpu_adam_source", "cpu_stream_bytes_per_s", "cpu_stream_source")
_CONNECT_KEYS = ("link", "a", "b", "shared")
_FABRIC_KEYS = ("link", "leaf_down_ports", "spines", "oversubscription", "rail_optimized", "nodes", "source")


@dataclass(frozen=True)
class LinkKind:
    """One kind of link, per direction: raw signalling rate, the payload fraction it delivers, latency, sources."""

    name: str
    link_class: str                 # one of LINK_CLASSES
    raw_bytes_per_s: float          # datasheet rate per direction
    efficiency: float               # payload fraction of the raw rate a bulk transfer gets
    latency_s: float                # one traversal
    source: str
    efficiency_source: str
    latency_source: str
    raw_write_bytes_per_s: float | None = None   # class "storage": the rate toward the drive (its `a` end)

    @property
    def bytes_per_s(self) -> float:
        """Payload bandwidth per direction (raw rate x efficiency): what flows share (a drive's read rate)."""
        return self.raw_bytes_per_s * self.efficiency

    @property
    def reverse_bytes_per_s(self) -> float:
        """Payload bandwidth from `b` to `a`: a drive's write rate for class "storage", else `bytes_per_s`."""
        if self.raw_write_bytes_per_s is None:
            return self.bytes_per_s
        return self.raw_write_bytes_per_s * self.efficiency


@dataclass(frozen=True)
class Component:
    """A non-GPU element of a server: switch, root complex or port, host memory, NIC."""

    name: str
    kind: str
    in_switch_reduction: bool = False   # NVSwitch with NVLS (multimem reductions in the switch)
    source: str = ""
    capacity_bytes: int = 0             # host_memory and nvme: bytes it holds (0: not given)
    capacity_source: str = ""


@dataclass(frozen=True)
class HostSpec:
    """The host CPU's rates for the work offload puts on it, each with its source (topology `[host]` table).

    `cpu_adam_elements_per_s`: parameters per second one CPU-Adam step updates using the whole server's cores
    (DeepSpeed's DeepSpeedCPUAdam: fp32 parameter, gradient and both moments); `cpu_stream_bytes_per_s`: bytes
    read plus written per second by the streaming element-wise host kernels (a dtype conversion, a scale).
    """

    cpu_adam_elements_per_s: float
    cpu_adam_source: str
    cpu_stream_bytes_per_s: float
    cpu_stream_source: str


@dataclass(frozen=True)
class Connection:
    """Links of one kind between `a[i]` and `b[i]` (or every `a` to a single `b`), both directions.

    `shared`: "none" gives each direction its own capacity; "pair" makes the two directions of each pair share
    one (host memory reads and writes); "all" makes every edge of this entry share one capacity (one DRAM
    behind several root ports).
    """

    link: str
    pairs: tuple[tuple[str, str], ...]
    shared: str = "none"


@dataclass(frozen=True)
class FabricSpec:
    """The leaf/spine network joining copies of the server: NIC link kind, leaf size, spines, layout."""

    link: str                  # link kind of NIC <-> leaf (and of leaf <-> spine, aggregated)
    leaf_down_ports: int       # NIC ports one leaf switch serves
    spines: int                # spine switches (1 = one logical non-blocking spine layer)
    oversubscription: float    # leaf downlink capacity / uplink capacity
    rail_optimized: bool       # NIC r of every node goes to the rail-r leaf of its group
    nodes: int
    source: str


@dataclass(frozen=True)
class ServerSpec:
    """One server (node) of a topology file: GPUs, components, link kinds, connections, NIC affinity, fabric."""

    name: str
    description: str
    gpu: str
    gpus: int
    source: str
    links: tuple[LinkKind, ...]
    components: tuple[Component, ...]
    connections: tuple[Connection, ...]
    nic_of_gpu: tuple[str, ...] | None
    fabric: FabricSpec
    path: str
    host: HostSpec | None = None

    def components_of(self, kind: str) -> tuple[Component, ...]:
        """The components of `kind`, in file order."""
        return tuple(c for c in self.components if c.kind == kind)

    def link(self, name: str) -> LinkKind:
        """The link kind called `name`."""
        for kind in self.links:
            if kind.name == name:
                return kind
        raise TopologyError(f"{self.path}: link kind {name!r} is not defined")


def _bad(path: str, key: str, value: object, rule: str) -> TopologyError:
    return TopologyError(f"{path}: {key} = {value!r}: {rule}")


def _check_keys(path: str, where: str, table: dict, allowed: tuple[str, ...]) -> None:
    for key in table:
        if key not in allowed:
            hint = difflib.get_close_matches(key, allowed, n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise TopologyError(f"{path}: {where}{key} is not a known key{extra}; allowed: {', '.join(allowed)}")


def _get(path: str, table: dict, key: str, where: str, kind: type | tuple[type, ...], default: object = ...):
    if key not in table:
        if default is ...:
            raise TopologyError(f"{path}: {where}{key} is required")
        return default
    value = table[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise _bad(path, where + key, value, f"must be {_kind_name(kind)}")
    if not isinstance(value, kind):
        raise _bad(path, where + key, value, f"must be {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list",
             dict: "a table"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _names(path: str, value: object, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise _bad(path, key, value, "must be a non-empty list of names")
    return tuple(value)


def _parse_link(path: str, name: str, table: object) -> LinkKind:
    where = f"links.{name}."
    if not isinstance(table, dict):
        raise _bad(path, f"links.{name}", table, "must be a table")
    _check_keys(path, where, table, _LINK_KEYS)
    link_class = _get(path, table, "class", where, str)
    if link_class not in LINK_CLASSES:
        raise _bad(path, where + "class", link_class, f"must be one of {', '.join(LINK_CLASSES)}")
    raw = table.get("bytes_per_s")
    try:
        rate = parse_bytes_per_s(raw) if raw is not None else None
        latency = parse_seconds(table["latency_s"]) if "latency_s" in table else None
    except ValueError as error:
        raise TopologyError(f"{path}: {where}: {error}") from None
    if rate is None:
        raise TopologyError(f"{path}: {where}bytes_per_s is required")
    if not math.isfinite(rate) or rate <= 0:
        raise _bad(path, where + "bytes_per_s", raw, "must be a positive bandwidth")
    if latency is None:
        raise TopologyError(f"{path}: {where}latency_s is required")
    if not math.isfinite(latency) or latency < 0:
        raise _bad(path, where + "latency_s", table["latency_s"], "must be a non-negative duration")
    efficiency = _get(path, table, "efficiency", where, (int, float))
    if not 0 < efficiency <= 1:
        raise _bad(path, where + "efficiency", efficiency, "must be in (0, 1]")
    sources = [_get(path, table, key, where, str) for key in ("source", "efficiency_source", "latency_source")]
    for key, text in zip(("source", "efficiency_source", "latency_source"), sources):
        if not text.strip():
            raise _bad(path, where + key, text, "must name where the number comes from")
    write = None
    if "write_bytes_per_s" in table:
        if link_class != "storage":
            raise _bad(path, where + "write_bytes_per_s", table["write_bytes_per_s"],
                       "only a link of class 'storage' (a drive) has a separate write rate")
        try:
            write = parse_bytes_per_s(table["write_bytes_per_s"])
        except ValueError as error:
            raise TopologyError(f"{path}: {where}: {error}") from None
        if not math.isfinite(write) or write <= 0:
            raise _bad(path, where + "write_bytes_per_s", table["write_bytes_per_s"], "must be a positive bandwidth")
    elif link_class == "storage":
        raise TopologyError(f"{path}: {where}write_bytes_per_s is required for class 'storage' (the drive's write "
                            f"rate; bytes_per_s is its read rate)")
    return LinkKind(name, link_class, float(rate), float(efficiency), float(latency), *sources,
                    None if write is None else float(write))


def _parse_component(path: str, index: int, table: object) -> list[Component]:
    where = f"components[{index}]."
    if not isinstance(table, dict):
        raise _bad(path, f"components[{index}]", table, "must be a table")
    _check_keys(path, where, table, _COMPONENT_KEYS)
    kind = _get(path, table, "kind", where, str)
    if kind not in COMPONENT_KINDS:
        raise _bad(path, where + "kind", kind, f"must be one of {', '.join(COMPONENT_KINDS)}")
    names = _names(path, table.get("names"), where + "names")
    reduction = _get(path, table, "in_switch_reduction", where, bool, False)
    if reduction and kind != "nvswitch":
        raise _bad(path, where + "in_switch_reduction", reduction, "only an nvswitch can reduce in the switch")
    source = _get(path, table, "source", where, str, "")
    capacity = 0
    capacity_source = ""
    if "capacity" in table:
        if kind not in CAPACITY_KINDS:
            raise _bad(path, where + "capacity", table["capacity"], f"only {' and '.join(CAPACITY_KINDS)} components "
                                                                     f"hold bytes")
        try:
            capacity = parse_bytes(table["capacity"])
        except ValueError as error:
            raise TopologyError(f"{path}: {where}capacity: {error}") from None
        if capacity <= 0:
            raise _bad(path, where + "capacity", table["capacity"], "must be a positive size")
        capacity_source = _get(path, table, "capacity_source", where, str)
        if not capacity_source.strip():
            raise _bad(path, where + "capacity_source", capacity_source, "must name where the number comes from")
    elif "capacity_source" in table:
        raise TopologyError(f"{path}: {where}capacity_source given without capacity")
    return [Component(name, kind, reduction, source, capacity, capacity_source) for name in names]


def _parse_host(path: str, table: object) -> HostSpec:
    """The `[host]` table: the CPU's rates for offloaded work, each with its source."""
    if not isinstance(table, dict):
        raise _bad(path, "host", table, "must be a table")
    _check_keys(path, "host.", table, _HOST_KEYS)
    values = []
    for key, parse in (("cpu_adam_elements_per_s", None), ("cpu_stream_bytes_per_s", parse_bytes_per_s)):
        if key not in table:
            raise TopologyError(f"{path}: host.{key} is required")
        raw = table[key]
        try:
            value = parse(raw) if parse is not None else raw
        except ValueError as error:
            raise TopologyError(f"{path}: host.{key}: {error}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise _bad(path, "host." + key, raw, "must be a positive rate")
        source_key = key.replace("_elements_per_s", "_source").replace("_bytes_per_s", "_source")
        source = _get(path, table, source_key, "host.", str)
        if not source.strip():
            raise _bad(path, "host." + source_key, source, "must name where the number comes from")
        values += [float(value), source]
    return HostSpec(*values)


def _parse_connection(path: str, index: int, table: object, links: dict[str, LinkKind]) -> Connection:
    where = f"connect[{index}]."
    if not isinstance(table, dict):
        raise _bad(path, f"connect[{index}]", table, "must be a table")
    _check_keys(path, where, table, _CONNECT_KEYS)
    link = _get(path, table, "link", where, str)
    if link not in links:
        hint = difflib.get_close_matches(link, sorted(links), n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise _bad(path, where + "link", link, f"is not a link kind defined under [links]{extra}")
    a = _names(path, table.get("a"), where + "a")
    b = _names(path, table.get("b"), where + "b")
    if len(b) == 1:
        b = b * len(a)
    if len(a) != len(b):
        raise _bad(path, where + "b", list(b), f"must have one name or as many as a ({len(a)})")
    shared = _get(path, table, "shared", where, str, "none")
    if shared not in SHARING:
        raise _bad(path, where + "shared", shared, f"must be one of {', '.join(SHARING)}")
    return Connection(link, tuple(zip(a, b)), shared)


def _parse_fabric(path: str, table: object, links: dict[str, LinkKind]) -> FabricSpec:
    where = "fabric."
    if not isinstance(table, dict):
        raise _bad(path, "fabric", table, "must be a table")
    _check_keys(path, where, table, _FABRIC_KEYS)
    link = _get(path, table, "link", where, str)
    if link not in links or links[link].link_class != "network":
        raise _bad(path, where + "link", link, "must name a link kind of class 'network'")
    ports = _get(path, table, "leaf_down_ports", where, int)
    spines = _get(path, table, "spines", where, int, 1)
    over = _get(path, table, "oversubscription", where, (int, float), 1.0)
    rail = _get(path, table, "rail_optimized", where, bool, True)
    nodes = _get(path, table, "nodes", where, int, 1)
    source = _get(path, table, "source", where, str)
    fabric = FabricSpec(link, ports, spines, float(over), rail, nodes, source)
    validate_fabric(fabric, path)
    return fabric


def validate_fabric(fabric: FabricSpec, path: str) -> None:
    """Check the fabric's numbers; raise TopologyError naming the key, the value and the rule."""
    if fabric.leaf_down_ports < 1:
        raise _bad(path, "fabric.leaf_down_ports", fabric.leaf_down_ports, "must be at least 1")
    if fabric.spines < 1:
        raise _bad(path, "fabric.spines", fabric.spines, "must be at least 1")
    if not math.isfinite(fabric.oversubscription) or fabric.oversubscription <= 0:
        raise _bad(path, "fabric.oversubscription", fabric.oversubscription, "must be a positive number")
    if fabric.nodes < 1:
        raise _bad(path, "fabric.nodes", fabric.nodes, "must be at least 1")


def parse_server(data: dict, path: str) -> ServerSpec:
    """Validate a topology file's TOML table into a ServerSpec.

    Args:
        data: the parsed TOML document.
        path: the file (for messages).

    Returns:
        The server spec; every name, link kind and component is checked.
    """
    _check_keys(path, "", data, _TOP_KEYS)
    name = _get(path, data, "name", "", str)
    description = _get(path, data, "description", "", str, "")
    gpu = _get(path, data, "gpu", "", str)
    try:
        get_device(gpu)
    except TopologyError as error:
        raise TopologyError(f"{path}: gpu = {gpu!r}: {error}") from None
    gpus = _get(path, data, "gpus", "", int)
    if gpus < 1:
        raise _bad(path, "gpus", gpus, "must be at least 1")
    source = _get(path, data, "source", "", str)
    raw_links = _get(path, data, "links", "", dict)
    links = {key: _parse_link(path, key, value) for key, value in raw_links.items()}
    components: list[Component] = []
    for index, table in enumerate(_get(path, data, "components", "", list, [])):
        components.extend(_parse_component(path, index, table))
    known = [f"gpu{i}" for i in range(gpus)]
    for component in components:
        if component.name in known:
            raise _bad(path, "components", component.name, "is defined twice (GPUs are gpu0..gpuN-1)")
        if "/" in component.name:
            raise _bad(path, "components", component.name, "must not contain '/'")
        known.append(component.name)
    connections = [_parse_connection(path, i, t, links)
                   for i, t in enumerate(_get(path, data, "connect", "", list, []))]
    kinds = {c.name: c.kind for c in components}
    for index, connection in enumerate(connections):
        storage = links[connection.link].link_class == "storage"
        for a, b in connection.pairs:
            if storage and connection.shared != "none":
                raise _bad(path, f"connect[{index}].shared", connection.shared, "a drive's read and write rates are "
                                                                             "its own: a 'storage' link is not shared")
            if storage and kinds.get(a) != "nvme":
                raise _bad(path, f"connect[{index}].a", a, "a link of class 'storage' must have the drive (an nvme "
                                                           "component) as its `a` end")
            if not storage and "nvme" in (kinds.get(a), kinds.get(b)):
                raise _bad(path, f"connect[{index}].link", connection.link, "an nvme component connects only by a "
                                                                          "link of class 'storage'")
    seen: set[tuple[str, str]] = set()
    for index, connection in enumerate(connections):
        for a, b in connection.pairs:
            for end in (a, b):
                if end not in known:
                    hint = difflib.get_close_matches(end, known, n=1)
                    extra = f" (did you mean {hint[0]!r}?)" if hint else ""
                    raise _bad(path, f"connect[{index}]", end, f"is not a GPU or component{extra}")
            if a == b:
                raise _bad(path, f"connect[{index}]", a, "cannot link a name to itself")
            key = (min(a, b), max(a, b))
            if key in seen:
                raise _bad(path, f"connect[{index}]", f"{a} <-> {b}", "is linked twice (aggregate parallel links "
                                                                       "into one link kind)")
            seen.add(key)
    nic_names = [c.name for c in components if c.kind == "nic"]
    nic_of_gpu = None
    if "nic_of_gpu" in data:
        nic_of_gpu = _names(path, data["nic_of_gpu"], "nic_of_gpu")
        if len(nic_of_gpu) != gpus or any(n not in nic_names for n in nic_of_gpu):
            raise _bad(path, "nic_of_gpu", list(nic_of_gpu), f"must list {gpus} NIC names (one per GPU) from "
                                                              f"{nic_names}")
    fabric = _parse_fabric(path, _get(path, data, "fabric", "", dict), links)
    host = _parse_host(path, data["host"]) if "host" in data else None
    return ServerSpec(name, description, gpu, gpus, source, tuple(links.values()), tuple(components),
                      tuple(connections), nic_of_gpu, fabric, path, host)


def read_server(path: Path) -> ServerSpec:
    """Read and validate one topology TOML file."""
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise TopologyError(f"{path}: no such topology file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise TopologyError(f"{path}: not valid TOML: {error}") from None
    except OSError as error:
        raise TopologyError(f"{path}: cannot read the topology file: {error.strerror or error}") from None
    return parse_server(data, str(path))
