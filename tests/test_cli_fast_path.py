"""`memsim run` read without typer (simulator/cli.py fast_run_arguments): the same values typer reads, or none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import simulator.cli_run
from simulator.cli import _run_app, fast_run_arguments

REPO = Path(__file__).resolve().parents[1]
SHOWCASE = str(REPO / "scenarios" / "showcase.toml")

PLAIN = [
    ["run", "s.toml"],
    ["run", "s.toml", "--json"],
    ["run", "--json", "s.toml", "--full"],
    ["run", "s.toml", "--set", "training.recompute=full", "--set=model.seq_length=4096", "--set", "a.b=x y"],
    ["run", "s.toml", "--out", "out dir", "--memory-workers", "3", "--what-would-fit=0"],
    ["run", "s.toml", "--what-would-fit", "20", "--memory-workers=1024", "--out=o"],
    ["run", "s.toml", "--memory-workers", "0", "--what-would-fit", "07"],
]
OTHERS = [
    ["run"], ["run", "a.toml", "b.toml"], ["run", "s.toml", "--what-would-fit", "21"],
    ["run", "s.toml", "--memory-workers", "-1"], ["run", "s.toml", "--memory-workers", "1025"],
    ["run", "s.toml", "--what-would-fit", "2.0"], ["run", "s.toml", "--what-would-fit", " 2"],
    ["run", "s.toml", "--help"], ["run", "s.toml", "--json", "--json"], ["run", "s.toml", "--out", "a", "--out", "b"],
    ["run", "s.toml", "--set"], ["run", "s.toml", "--set", "--json"], ["run", "s.toml", "--set="],
    ["run", "s.toml", "--json=1"], ["run", "s.toml", "--jso"], ["run", "s.toml", "-h"], ["run", "s.toml", "--"],
    ["run", ""], ["sweep", "s.toml"], [],
]


def _typer_reads(monkeypatch, args: list[str]) -> dict | None:
    """What typer hands `memsim run` for `args` (None: it refuses them)."""
    seen: list[dict] = []

    def record(**values):
        seen.append(values)
        return 0

    monkeypatch.setattr(simulator.cli_run, "run_command", record)
    code = _run_app(args)
    return seen[0] if seen and code == 0 else None


@pytest.mark.parametrize("args", PLAIN)
def test_plain_arguments_are_read_as_typer_reads_them(monkeypatch, capsys, args):
    fast = fast_run_arguments(args)
    assert fast is not None
    assert fast == _typer_reads(monkeypatch, args)


@pytest.mark.parametrize("args", OTHERS)
def test_other_arguments_go_to_typer(monkeypatch, capsys, args):
    fast = fast_run_arguments(args)
    assert fast is None or fast == _typer_reads(monkeypatch, args)


def test_the_fast_path_imports_no_typer_and_prints_what_typer_prints():
    code = ("import sys, simulator.cli as c; from simulator.lifetime import keep_until_exit; keep_until_exit(); "
            f"status = c._run_fast(c.fast_run_arguments(['run', {SHOWCASE!r}, '--json', '--what-would-fit', '0'])); "
            "sys.stdout.flush(); "
            "print('IMPORTED', sorted(m for m in ('typer', 'rich', 'pydantic') if m in sys.modules), status)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    report, _, tail = done.stdout.rpartition("IMPORTED")
    assert tail.split() == ["[]", "0"], done.stdout[-300:]
    # --json twice: typer reads it (the fast path takes no option twice but --set)
    typer_path = subprocess.run([sys.executable, "-m", "simulator.cli", "run", SHOWCASE, "--json", "--json",
                                 "--what-would-fit", "0"], capture_output=True, text=True, cwd=REPO)
    assert typer_path.returncode == 0
    assert json.loads(report) == json.loads(typer_path.stdout)
