"""A sweep's memory of finished points: its header (what the sweep is) and an append-only, fsync'd journal.

One JSON line per finished point, written and fsync'd before the next is recorded, so an interruption or a
`kill -9` loses at most the line being written; a torn last line is dropped (and cut off) when the journal is
read back. `--resume DIR` reads the header to check it is the same sweep, then skips every journaled point.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from simulator.errors import DataError
from simulator.io import atomic_write_text

FORMAT = "memsim-sweep-1"
HEADER_NAME = "sweep.json"
JOURNAL_NAME = "journal.jsonl"


def fingerprint(document: dict, sets, axes, mode: str) -> str:
    """sha256 of what decides every point's outcome: the scenario's tables (not [sweep]), --set items, axes, mode."""
    what = {"document": {k: v for k, v in document.items() if k != "sweep"}, "sets": list(sets),
            "axes": [[key, list(values)] for key, values in axes], "mode": mode}
    text = json.dumps(what, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_header(out_dir: Path) -> dict | None:
    """The header of the sweep in `out_dir`, or None when there is none.

    Raises:
        DataError: a header that is not a memsim sweep header.
    """
    path = out_dir / HEADER_NAME
    try:
        header = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise DataError(f"{path}: not a readable sweep header ({' '.join(str(error).split())})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DataError(f"{path}: not a memsim sweep header (format must be {FORMAT!r})")
    return header


def write_header(out_dir: Path, header: dict) -> None:
    """Write the header atomically."""
    atomic_write_text(out_dir / HEADER_NAME, json.dumps({"format": FORMAT, **header}, indent=2, sort_keys=True) + "\n")


def read_journal(out_dir: Path, labels: dict[int, str]) -> dict[int, dict]:
    """The outcomes journaled in `out_dir` by point index; a torn last line is dropped and cut off the file.

    Args:
        labels: each point's label by index, to check every line belongs to this sweep.

    Raises:
        DataError: a damaged line before the last, or a line naming a point this sweep does not have.
    """
    path = out_dir / JOURNAL_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    lines = data.split(b"\n")
    complete, torn = lines[:-1], lines[-1]
    outcomes: dict[int, dict] = {}
    good_bytes = 0
    for number, line in enumerate(complete, start=1):
        record = _record(line)
        if record is None:
            if number == len(complete) and not torn:
                break                   # the last line is damaged: as good as torn
            raise DataError(f"{path}: line {number} is damaged; only the last line may be (an interrupted write)")
        index, label = record["point"], record["label"]
        if labels.get(index) != label:
            raise DataError(f"{path}: line {number} is point {index} ({label}), which this sweep does not have "
                            f"there ({labels.get(index, 'no such point')})")
        outcomes.setdefault(index, record["outcome"])
        good_bytes += len(line) + 1
    if good_bytes != len(data):
        with open(path, "r+b") as handle:
            handle.truncate(good_bytes)
            os.fsync(handle.fileno())
    return outcomes


def _record(line: bytes) -> dict | None:
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if (isinstance(record, dict) and isinstance(record.get("point"), int) and isinstance(record.get("label"), str)
            and isinstance(record.get("outcome"), dict)):
        return record
    return None


class Journal:
    """Appends finished points to `out_dir`/journal.jsonl, each line on disk (fsync) before append returns."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / JOURNAL_NAME
        self._handle = open(self.path, "ab")

    def append(self, index: int, label: str, outcome: dict) -> None:
        """Record one finished point."""
        line = json.dumps({"point": index, "label": label, "outcome": outcome}, sort_keys=True,
                          separators=(",", ":")) + "\n"
        self._handle.write(line.encode("utf-8"))
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def close(self) -> None:
        """Close the file."""
        self._handle.close()
