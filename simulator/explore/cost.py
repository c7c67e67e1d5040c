"""Dollars and energy of a simulated plan: the price and power table, power from utilisation, costs per token.

Power of one GPU at utilisation u (the share of an iteration its compute stream is busy, from the report):

    P_gpu(u) = idle_w + (tdp_w - idle_w) * u

the linear server power model of Fan, Weber and Barroso, "Power provisioning for a warehouse-sized computer"
(ISCA 2007), applied per GPU with the catalog's `tdp_w` as busy power. The cluster draws

    P = PUE * (gpus * P_gpu(u) + nodes * overhead_w)

(`overhead_w` only for multi-GPU topologies: a one-device scenario has no server around its GPU). Dollars per
second: rented, gpus * rent_usd_per_gpu_hour / 3600 (electricity included in the rent); owned, the purchase
(nodes * the server's price, or the GPU's price for a one-device scenario) written off linearly over
amortization_years, plus P at electricity_usd_per_kwh. The numbers and their sources: topologies/prices.toml.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from simulator.errors import DataError

PRICE_FORMAT = "memsim-prices-1"
DEFAULT_FIELDS = ("pue", "electricity_usd_per_kwh", "amortization_years")
DEVICE_FIELDS = ("rent_usd_per_gpu_hour", "purchase_usd", "idle_w")
NODE_FIELDS = ("purchase_usd", "overhead_w")
PRICINGS = ("rent", "own")
SECONDS_PER_YEAR = 365.25 * 86400
_TABLES = {"defaults": DEFAULT_FIELDS, "devices": DEVICE_FIELDS, "nodes": NODE_FIELDS}
_MEANING = {
    "rent_usd_per_gpu_hour": "the hourly rental of one GPU", "purchase_usd": "the purchase price",
    "idle_w": "the idle power of one GPU", "overhead_w": "the power of a server besides its GPUs",
}


def packaged_prices_path() -> Path:
    """topologies/costs/prices.toml, the packaged table."""
    import topologies

    return Path(topologies.__file__).resolve().parent / "costs" / "prices.toml"


@dataclass(frozen=True)
class PriceTable:
    """Prices and power: defaults (PUE, electricity, amortisation), per device and per server topology."""

    path: str                                        # the file(s) read, for messages
    defaults: Mapping[str, float]
    devices: Mapping[str, Mapping[str, float]]
    nodes: Mapping[str, Mapping[str, float]]
    sources: Mapping[str, str]                       # "devices.h100-sxm.purchase_usd" -> "source (date)"


@dataclass(frozen=True)
class Pricing:
    """How dollars are counted: "rent" or "own" (with the years owned hardware is written off over)."""

    mode: str = "rent"
    amortization_years: float | None = None          # None: the price table's default


@dataclass(frozen=True)
class ClusterShape:
    """What the cost of a run depends on: the GPU, its busy power, the server topology and their counts."""

    device: str
    tdp_w: float
    topology: str | None      # a multi-GPU topology's name; None for a one-device scenario
    nodes: int
    gpus: int

    @classmethod
    def of(cls, cluster) -> ClusterShape:
        """The shape of a resolved `simulator.topology.Cluster`."""
        topology = cluster.topology
        if topology is None:
            return cls(cluster.device.name, float(cluster.device.tdp_w), None, 1, 1)
        return cls(cluster.device.name, float(cluster.device.tdp_w), topology.name, topology.nodes,
                   topology.num_gpus)


@dataclass(frozen=True)
class Budget:
    """A token budget's time (s), dollars and energy (kWh)."""

    time_s: float
    usd: float
    kwh: float


def load_prices(user_path: str | os.PathLike | None = None) -> PriceTable:
    """The packaged price table, with a user file's entries (the same shape) replacing it field by field.

    Raises:
        DataError: a file that cannot be read, is not TOML or breaks the shape (one line naming the key).
    """
    packaged = packaged_prices_path()
    base = _read(packaged)
    if user_path is None:
        return _table(str(packaged), [base])
    return _table(f"{packaged} + {os.fspath(user_path)}", [base, _read(Path(user_path))])


def _read(path: Path) -> tuple[str, dict]:
    name = str(path)
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{name}: price table not found") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise DataError(f"{name}: not a readable price table ({' '.join(str(error).split())})") from None
    return name, document


def _table(label: str, documents: list[tuple[str, dict]]) -> PriceTable:
    merged: dict[str, dict] = {"defaults": {}, "devices": {}, "nodes": {}}
    sources: dict[str, str] = {}
    for name, document in documents:
        for key, value in document.items():
            if key == "format":
                if value != PRICE_FORMAT:
                    raise DataError(f"{name}: format = {value!r}: must be {PRICE_FORMAT!r}")
            elif key == "defaults":
                _fields(name, "defaults", value, DEFAULT_FIELDS, merged["defaults"], sources)
            elif key in ("devices", "nodes"):
                if not isinstance(value, dict):
                    raise DataError(f"{name}: {key} = {value!r}: must be a table of [{key}.NAME] tables")
                for entry, fields in value.items():
                    _fields(name, f"{key}.{entry}", fields, _TABLES[key], merged[key].setdefault(entry, {}), sources)
            else:
                raise DataError(f"{name}: {key}: unknown key{_hint(key, ('format', *_TABLES))} "
                                f"(allowed: format, defaults, devices, nodes)")
    _check_device_names(documents[-1][0], merged["devices"])
    return PriceTable(label, MappingProxyType(merged["defaults"]),
                      MappingProxyType({k: MappingProxyType(v) for k, v in sorted(merged["devices"].items())}),
                      MappingProxyType({k: MappingProxyType(v) for k, v in sorted(merged["nodes"].items())}),
                      MappingProxyType(sources))


def _fields(name: str, where: str, table: object, allowed: tuple[str, ...], into: dict, sources: dict) -> None:
    if not isinstance(table, dict):
        raise DataError(f"{name}: {where} = {table!r}: must be a table of {', '.join(allowed)}")
    for key, value in table.items():
        field = key.removesuffix("_source").removesuffix("_date")
        if field not in allowed:
            raise DataError(f"{name}: {where}.{key}: unknown key{_hint(key, allowed)} "
                            f"(allowed: {', '.join(allowed)}, each with _source and _date)")
        if key != field:
            if not isinstance(value, str):
                raise DataError(f"{name}: {where}.{key} = {value!r}: must be a string")
            continue
        low = 1.0 if key == "pue" else 0.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < low or (value == 0 and key != "idle_w"):
            rule = "a number >= 1" if key == "pue" else "a number >= 0" if key == "idle_w" else "a number > 0"
            raise DataError(f"{name}: {where}.{key} = {value!r}: must be {rule}")
        into[key] = float(value)
        sources[f"{where}.{key}"] = f"{table.get(key + '_source', name)} ({table.get(key + '_date', 'undated')})"


def _hint(word: str, options) -> str:
    from simulator.scenario.schema import did_you_mean

    return did_you_mean(word, list(options))


def _check_device_names(name: str, devices: Mapping[str, object]) -> None:
    from simulator.hardware.catalog import list_devices

    known = [device.name for device in list_devices()]
    for device in devices:
        if device not in known:
            raise DataError(f"{name}: devices.{device}: not a device of the catalog{_hint(device, known)} "
                            f"(memsim devices lists them)")


def missing_prices(table: PriceTable, shape: ClusterShape, pricing: Pricing) -> list[str]:
    """The price-table keys `shape` needs under `pricing` that the table lacks, e.g. "devices.cpu.idle_w"."""
    needed = [f"devices.{shape.device}.idle_w"]
    if shape.topology is not None:
        needed.append(f"nodes.{shape.topology}.overhead_w")
    if pricing.mode == "rent":
        needed.append(f"devices.{shape.device}.rent_usd_per_gpu_hour")
    elif shape.topology is None:
        needed.append(f"devices.{shape.device}.purchase_usd")
    else:
        needed.append(f"nodes.{shape.topology}.purchase_usd")
    return [key for key in needed if _lookup(table, key) is None]


def check_prices(table: PriceTable, shapes, pricing: Pricing) -> None:
    """Refuse a table that cannot price every shape (what a sweep or comparison is about to run on).

    Raises:
        DataError: one line naming the first missing key and what it is.
    """
    for shape in shapes:
        missing = missing_prices(table, shape, pricing)
        if missing:
            field = missing[0].rsplit(".", 1)[1]
            where = f"pricing = {pricing.mode!r}" if field in ("rent_usd_per_gpu_hour", "purchase_usd") else "energy"
            raise DataError(f"{table.path}: {missing[0]} is missing ({_MEANING[field]}, needed for {where} on "
                            f"{shape.topology or shape.device}): add it in a --prices file")


def _lookup(table: PriceTable, key: str) -> float | None:
    kind, name, field = key.split(".")
    return (table.devices if kind == "devices" else table.nodes).get(name, {}).get(field)


def busy_fraction(report: dict) -> float:
    """Mean share of an iteration the stages' compute streams are busy (0..1), from a report's ranks."""
    iteration = report["iteration_time_s"]
    ranks = report["ranks"]
    if iteration <= 0 or not ranks:
        return 0.0
    return min(1.0, max(0.0, sum(rank["compute_s"] for rank in ranks) / len(ranks) / iteration))


def cluster_power_w(table: PriceTable, shape: ClusterShape, busy: float) -> float:
    """Wall power of the whole cluster (W, PUE included) with its GPUs busy a share `busy` of the time."""
    idle = table.devices[shape.device]["idle_w"]
    gpu = idle + (max(shape.tdp_w, idle) - idle) * busy
    overhead = 0.0 if shape.topology is None else shape.nodes * table.nodes[shape.topology]["overhead_w"]
    return table.defaults["pue"] * (shape.gpus * gpu + overhead)


def cluster_usd_per_s(table: PriceTable, shape: ClusterShape, pricing: Pricing, power_w: float) -> float:
    """Dollars per second of running the cluster: rented, or owned (amortisation plus electricity)."""
    if pricing.mode == "rent":
        return shape.gpus * table.devices[shape.device]["rent_usd_per_gpu_hour"] / 3600.0
    if shape.topology is None:
        purchase = shape.gpus * table.devices[shape.device]["purchase_usd"]
    else:
        purchase = shape.nodes * table.nodes[shape.topology]["purchase_usd"]
    years = pricing.amortization_years or table.defaults["amortization_years"]
    return purchase / (years * SECONDS_PER_YEAR) + power_w / 1000.0 * table.defaults["electricity_usd_per_kwh"] / 3600.0


def per_million_tokens(table: PriceTable, shape: ClusterShape, pricing: Pricing, tokens_per_s: float,
                       busy: float) -> tuple[float, float]:
    """(dollars, kWh) per million trained tokens at `tokens_per_s` (> 0)."""
    power = cluster_power_w(table, shape, busy)
    seconds = 1e6 / tokens_per_s
    return cluster_usd_per_s(table, shape, pricing, power) * seconds, power * seconds / 3.6e6


def token_budget(tokens: float, tokens_per_s: float, usd_per_million: float, kwh_per_million: float) -> Budget:
    """Time (s), dollars and kWh to train `tokens` tokens at `tokens_per_s` (> 0)."""
    millions = tokens / 1e6
    return Budget(tokens / tokens_per_s, usd_per_million * millions, kwh_per_million * millions)
