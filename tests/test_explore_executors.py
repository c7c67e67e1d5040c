"""Executors: --executor parsing, results in order whatever the pool, a dead pool worker's items resubmitted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from simulator.errors import ExecutorError
from simulator.explore.executors import ExecutorSpec, InlineExecutor, ProcessExecutor, open_executor, parse_executor


@pytest.mark.parametrize(("text", "spec"), [
    ("local", ExecutorSpec("local", None)), ("local:3", ExecutorSpec("local", 3)),
    ("dask-local:2", ExecutorSpec("dask-local", 2)), ("dask://sched.example:8786", ExecutorSpec("dask", None,
                                                                                                "sched.example:8786")),
])
def test_specs(text, spec):
    assert parse_executor(text) == spec and spec.text == text


@pytest.mark.parametrize("text", ["", "lokal", "local:0", "local:x", "dask-local", "dask://host", "dask:host:1"])
def test_bad_specs_are_one_line(text):
    with pytest.raises(ExecutorError) as refused:
        parse_executor(text)
    assert "\n" not in str(refused.value) and str(refused.value).startswith(f"--executor {text!r}:")


def test_local_one_runs_here():
    assert isinstance(open_executor("local:1"), InlineExecutor)


def _square_or_die_once(item: tuple[int, str]) -> int:
    """Squares a number; the first call for 3 kills its worker process (a marker file remembers the death)."""
    number, marker = item
    if number == 3 and not Path(marker).exists():
        Path(marker).write_text("died")
        os._exit(1)
    return number * number


def test_a_dead_worker_loses_no_item(tmp_path):
    executor = ProcessExecutor(2)
    try:
        items = [(number, str(tmp_path / "died")) for number in range(8)]
        assert sorted(executor.imap_unordered(_square_or_die_once, items)) == [(k, k * k) for k in range(8)]
        assert (tmp_path / "died").exists()
        assert executor.map(_square_or_die_once, items[::-1]) == [k * k for k in reversed(range(8))]
    finally:
        executor.close()
