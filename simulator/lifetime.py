"""Objects a command-line run keeps until the process exits instead of releasing them one by one, and pauses of
the cyclic garbage collector around work that builds millions of long-lived objects."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

# The CLI ends with os._exit once its outputs are written. A cluster-scale run builds millions of objects
# (instructions, events, spans, samples); releasing them as each function returns took ~2 s of CPU at GPT-3 175B
# on 1,024 GPUs and changes nothing. Library callers (tests, notebooks) never switch this on: their objects are
# released as usual.
_kept: list[tuple] | None = None


def keep_until_exit() -> None:
    """From now on, `keep` holds what it is given until the process ends (the CLI's os._exit)."""
    global _kept
    if _kept is None:
        _kept = []


def keep(*objects: object) -> None:
    """Hold `objects` until the process exits, when keep_until_exit was called; otherwise nothing."""
    if _kept is not None:
        _kept.append(objects)


def stop_keeping() -> None:
    """Release objects as usual again, dropping what was kept: a command that simulates many scenarios in one
    process (`memsim sweep`, `memsim compare`) would otherwise hold every one of them until it exits."""
    global _kept
    _kept = None


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off meanwhile, on again after if it was on: work that builds millions of
    objects living until it ends (a cluster-scale simulation's instructions and spans, a plan search share's
    schedules and graphs) makes each collection pass walk them all, for little cyclic garbage."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
