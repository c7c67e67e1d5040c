"""The only place that turns quantity strings ("80 GiB", "900 GB/s", "1.5 us") into SI floats/ints."""

from __future__ import annotations

import math
import re

from simulator.errors import ScenarioError

_BYTE_UNITS = {
    "b": 1, "byte": 1, "bytes": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}
_TIME_UNITS = {
    "s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9,
    "min": 60.0, "h": 3600.0,
}
_FLOP_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15, "e": 1e18}
_BIT_RATE = {"bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
             "b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12}

_NUM_UNIT = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-zµ/]*)\s*$")


def _split(text: str, what: str) -> tuple[float, str]:
    match = _NUM_UNIT.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a {what} (a number with an optional unit)")
    return float(match.group(1)), match.group(2)


def _number(value: object, what: str) -> float | None:
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a {what}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a finite {what}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a {what}")
    return None


def parse_bytes(value: object) -> int:
    """Parse a size: an int/float of bytes or a string like "80 GiB", "25 MB", "512 B"."""
    plain = _number(value, "size in bytes")
    if plain is not None:
        return int(round(plain))
    number, unit = _split(str(value), "size")
    factor = _BYTE_UNITS.get(unit.lower() if unit else "b")
    if factor is None or unit in ("Kb", "Mb", "Gb", "Tb"):
        raise ValueError(f"{value!r}: unknown size unit {unit!r} (allowed: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return int(round(number * factor))


def parse_seconds(value: object) -> float:
    """Parse a duration: a float of seconds or a string like "2 us", "1.5 ms"."""
    plain = _number(value, "duration in seconds")
    if plain is not None:
        return plain
    number, unit = _split(str(value), "duration")
    factor = _TIME_UNITS.get(unit.lower() if unit != "µs" else unit) if unit else 1.0
    if factor is None:
        raise ValueError(f"{value!r}: unknown time unit {unit!r} (allowed: s, ms, us, ns)")
    return number * factor


def parse_bytes_per_s(value: object) -> float:
    """Parse a bandwidth: bytes/s as a number, or "900 GB/s", "25 GiB/s", "200 Gbps" (bits)."""
    plain = _number(value, "bandwidth in bytes/s")
    if plain is not None:
        return plain
    number, unit = _split(str(value), "bandwidth")
    low = unit.lower()
    if unit.endswith("bps") or (unit.endswith("b/s") and not unit.endswith("B/s")):
        factor = _BIT_RATE.get(low)
        if factor is None:
            raise ValueError(f"{value!r}: unknown bandwidth unit {unit!r}")
        return number * factor / 8.0
    if low.endswith("/s"):
        size = _BYTE_UNITS.get(low[:-2])
        if size is not None:
            return number * size
    raise ValueError(f"{value!r}: unknown bandwidth unit {unit!r} (allowed: B/s, MB/s, GB/s, GiB/s, Gbps, ...)")


def parse_flop_per_s(value: object) -> float:
    """Parse a compute rate: FLOP/s as a number, or "312 TFLOP/s", "989 TFLOPS"."""
    plain = _number(value, "compute rate in FLOP/s")
    if plain is not None:
        return plain
    number, unit = _split(str(value), "compute rate")
    low = unit.lower().replace("/s", "s")
    if low.endswith("flops"):
        prefix = low[: -len("flops")]
        if prefix in _FLOP_PREFIX:
            return number * _FLOP_PREFIX[prefix]
    raise ValueError(f"{value!r}: unknown compute-rate unit {unit!r} (allowed: FLOP/s, GFLOP/s, TFLOP/s, PFLOP/s)")


def format_bytes(n: float) -> str:
    """Human form of a byte count in binary units, e.g. 1.50 GiB."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_seconds(t: float) -> str:
    """Human form of a duration, e.g. 12.3 ms."""
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"


def to_error(path: str, key: str, value: object, exc: ValueError) -> ScenarioError:
    """Wrap a unit parsing error into a one-line ScenarioError naming file and key."""
    return ScenarioError(f"{path}: {key} = {value!r}: {exc}")
