"""Scenario value parsers: each turns a TOML value into a checked one or raises Invalid saying what is allowed."""

from __future__ import annotations

import difflib
import math
from typing import Callable

from simulator import units

MAX_INT = 2**63 - 1  # largest count or size accepted (int64, what numpy and torch can hold)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2")
MIN_MAX_SPLIT_SIZE_BYTES = 20 * 2**20  # kLargeBuffer: torch rejects a smaller max_split_size_mb


def short_repr(value: object) -> str:
    """repr() for error messages: at most 120 characters, safe for ints too long to print."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for str() (sys.int_info.default_max_str_digits)
        text = f"<{type(value).__name__} too large to print>"
    return text if len(text) <= 120 else text[:117] + "..."

class Invalid(ValueError):
    """A value breaks its key's rule; the message says what is allowed (the loader adds file and key)."""


def did_you_mean(word: object, options: tuple[str, ...] | list[str]) -> str:
    """A "; did you mean 'x'?" hint for the closest option to `word`, or "" when none is close."""
    if not isinstance(word, str):
        return ""
    lowered = {option.lower(): option for option in options}
    word = word.lower()
    matches = difflib.get_close_matches(word, list(lowered), n=1, cutoff=0.6)
    if not matches and len(word) >= 3:
        matches = [option for option in lowered if option.startswith(word)][:1]
    return f"; did you mean {lowered[matches[0]]!r}?" if matches else ""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_at_least(minimum: int) -> Callable[[object], int]:
    """Parser for an integer from `minimum` to MAX_INT (booleans and floats are rejected)."""
    def parse(value: object) -> int:
        if not _is_int(value) or value < minimum:
            raise Invalid("must be a positive integer" if minimum == 1 else f"must be an integer >= {minimum}")
        if value > MAX_INT:
            raise Invalid(f"must be at most 2**63 - 1 = {MAX_INT}")
        return value
    return parse


def int_between(low: int, high: int) -> Callable[[object], int]:
    """Parser for an integer in low..high inclusive."""
    def parse(value: object) -> int:
        if not _is_int(value) or not low <= value <= high:
            raise Invalid(f"must be an integer from {low} to {high}")
        return value
    return parse


def to_float(value: object) -> float:
    """A finite float from an int or float (bools, strings, NaN, infinities and huge ints rejected)."""
    if _is_int(value) and abs(value) < 2**1000:
        return float(value)
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise Invalid("must be a finite number")


def positive_float(value: object) -> float:
    """Parser for a finite number > 0."""
    number = to_float(value)
    if number <= 0:
        raise Invalid("must be a number > 0")
    return number


def unit_fraction(value: object) -> float:
    """Parser for a fraction in (0, 1]."""
    number = to_float(value)
    if not 0.0 < number <= 1.0:
        raise Invalid("must be a number in (0, 1]")
    return number


def fraction_below_one(value: object) -> float:
    """Parser for a probability or fraction in [0, 1)."""
    number = to_float(value)
    if not 0.0 <= number < 1.0:
        raise Invalid("must be a number in [0, 1)")
    return number


def boolean(value: object) -> bool:
    """Parser for true/false (no 0/1, no strings)."""
    if not isinstance(value, bool):
        raise Invalid("must be true or false")
    return value


def choice(options: tuple[str, ...]) -> Callable[[object], str]:
    """Parser for one of `options` (exact spelling), with a did-you-mean hint."""
    def parse(value: object) -> str:
        if isinstance(value, str) and value in options:
            return value
        raise Invalid(f"must be one of {', '.join(options)}{did_you_mean(value, options)}")
    return parse


def text(value: object) -> str:
    """Parser for a non-empty string without NUL characters."""
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise Invalid("must be a non-empty string")
    return value


def module_list(value: object) -> tuple[str, ...]:
    """Parser for module names: "auto", "all-linear", a comma-separated string or an array of names."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(v, str) for v in items):
        raise Invalid('must be "auto", "all-linear", "q_proj,v_proj" or an array of module names')
    names = tuple(v.strip() for v in items)
    if any(not n for n in names) or len(set(names)) != len(names):
        raise Invalid("module names must be non-empty and given once each")
    return names


def string(value: object) -> str:
    """Parser for any string (possibly empty)."""
    if not isinstance(value, str):
        raise Invalid("must be a string")
    return value


def optional_path(value: object) -> str | None:
    """Parser for a path string, or "none" for no file."""
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    try:
        return text(value)
    except Invalid:
        raise Invalid('must be a path string or "none"') from None


def size_bytes(value: object, minimum: int = 0) -> int:
    """Parser for a size: bytes as a number or a string with a unit ("25 MB", "2 GiB")."""
    try:
        parsed = units.parse_bytes(value)
    except (ValueError, OverflowError, TypeError) as exc:
        raise Invalid(f"must be a size: bytes as a number or a string like '25 MB' ({exc})") from None
    if not minimum <= parsed <= MAX_INT:
        raise Invalid(f"must be a size from {minimum} to {MAX_INT} bytes")
    return parsed


def _count(text: str) -> int | None:
    """The integer written in `text` (ASCII digits only), or None."""
    text = text.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        return None
    return int(text)


def recompute_mode(value: object) -> str:
    """Parser for none | selective | full | "segments:N" (N >= 1), normalised."""
    if isinstance(value, str):
        if value in ("none", "selective", "full"):
            return value
        head, sep, count = value.partition(":")
        segments = _count(count)
        if sep and head.strip() == "segments" and segments is not None and segments >= 1:
            return f"segments:{segments}"
    modes = ("none", "selective", "full", "segments")
    head = value.partition(":")[0].strip() if isinstance(value, str) else value
    hint = "" if head in modes else did_you_mean(head, modes)
    raise Invalid(f'must be none, selective, full or "segments:N" with N >= 1{hint}')


def gradient_compression(value: object) -> str:
    """Parser for none | 1bit | int8 | "topk:F" (0 < F < 1) | "powersgd:R" (R >= 1), normalised."""
    if isinstance(value, str):
        if value in ("none", "1bit", "int8"):
            return value
        head, sep, arg = value.partition(":")
        head, arg = head.strip(), arg.strip()
        if sep and head == "topk":
            try:
                fraction = float(arg)
            except ValueError:
                fraction = math.nan
            if 0.0 < fraction < 1.0:
                return f"topk:{fraction!r}"
        rank = _count(arg)
        if sep and head == "powersgd" and rank is not None and rank >= 1:
            return f"powersgd:{rank}"
    kinds = ("none", "1bit", "int8", "topk", "powersgd")
    head = value.partition(":")[0].strip() if isinstance(value, str) else value
    hint = "" if head in kinds else did_you_mean(head, kinds)
    raise Invalid(f'must be none, 1bit, int8, "topk:F" with 0 < F < 1 or "powersgd:R" with R >= 1{hint}')


def loss_scale(value: object) -> str | float:
    """Parser for "dynamic" or a static loss scale > 0."""
    if value == "dynamic" and isinstance(value, str):
        return value
    try:
        return positive_float(value)
    except Invalid:
        raise Invalid('must be "dynamic" or a number > 0') from None


def _looks_like_path(value: str) -> bool:
    return "/" in value or "\\" in value or "." in value


def schedule_name(value: object) -> str:
    """Parser for a schedule name or a path to an action file (anything with '/', '\\' or '.')."""
    if isinstance(value, str) and (value in SCHEDULES or (_looks_like_path(value) and "\0" not in value)):
        return value
    raise Invalid(f"must be one of {', '.join(SCHEDULES)} or a path to an action file"
                  f"{did_you_mean(value, SCHEDULES)}")


def is_schedule_file(schedule: str) -> bool:
    """Whether a parsed `parallel.schedule` names a file rather than a built-in schedule."""
    return schedule not in SCHEDULES


def topology_name(value: object) -> str:
    """Parser for a topology name from topologies/ or a path to a topology file."""
    try:
        return text(value)
    except Invalid:
        raise Invalid("must be a topology name (e.g. dgx-a100) or a path to a topology TOML file") from None


def topology_is_path(topology: str) -> bool:
    """Whether a parsed `cluster.topology` is a file path rather than a name."""
    return "/" in topology or "\\" in topology or topology.endswith(".toml")


def max_split_size(value: object) -> int | None:
    """Parser for "unlimited" (None) or a size >= 20 MiB."""
    if isinstance(value, str) and value.strip().lower() == "unlimited":
        return None
    try:
        return size_bytes(value, MIN_MAX_SPLIT_SIZE_BYTES)
    except Invalid:
        raise Invalid(f'must be "unlimited" or a size >= 20 MiB ({MIN_MAX_SPLIT_SIZE_BYTES} bytes)') from None


def roundup_power2_divisions(value: object) -> int | None:
    """Parser for "none" (None) or a power of two from 1 to 16."""
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    if _is_int(value) and value in (1, 2, 4, 8, 16):
        return value
    raise Invalid('must be "none" or a power of two from 1 to 16')


def auto_or_bool(value: object) -> str | bool:
    """Parser for "auto" (the framework's default, resolved by parallel/overlap.py) or true / false."""
    if isinstance(value, bool) or value == "auto":
        return value
    raise Invalid('must be "auto", true or false')


def context_bytes(value: object) -> int | None:
    """Parser for "auto" (None: the device's default) or a size."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        return size_bytes(value)
    except Invalid:
        raise Invalid('must be "auto" or a size >= 0 (bytes or a string like "500 MiB")') from None


def host_memory_size(value: object) -> int | None:
    """Parser for "auto" (None: the topology's host memory) or a size > 0."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        size = size_bytes(value)
    except Invalid:
        size = 0
    if size <= 0:
        raise Invalid('must be "auto" or a size > 0 (bytes or a string like "256 GB")')
    return size
