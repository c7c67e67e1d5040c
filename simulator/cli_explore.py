"""`memsim sweep` and `memsim compare`: many scenarios at once, with cost and energy, on local processes or Dask."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from simulator.errors import MemsimError

_EXECUTOR_HELP = ("Where points run: local[:N] (process pool, default one per core; local:1 in this process), "
                  "dask-local:N (a Dask LocalCluster) or dask://HOST:PORT (a running scheduler).")


def _fail(message: str) -> None:
    sys.stderr.write(f"memsim: error: {message}\n")
    raise typer.Exit(2)


class TerminalProgress:
    """A rich progress bar with an ETA on stderr; only made when stderr is a terminal."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
        )

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                  console=Console(stderr=True), transient=True)
        self._task = None
        self._running = False

    def start(self, description: str, total: int, completed: int = 0) -> None:
        """Show a bar for `total` items, `completed` of them done already."""
        if not self._running:
            self._progress.start()
            self._running = True
        if self._task is not None:
            self._progress.remove_task(self._task)
        self._task = self._progress.add_task(description, total=total, completed=completed)

    def advance(self, count: int) -> None:
        """`count` more items done."""
        self._progress.advance(self._task, count)

    def stop(self) -> None:
        """Remove the bar (again: nothing)."""
        if self._running:
            self._progress.stop()
            self._running = False


def _progress():
    return TerminalProgress() if sys.stderr.isatty() else None


def _long_running() -> None:
    """A command simulating many scenarios releases each one as it goes (see simulator/lifetime.py)."""
    from simulator.lifetime import stop_keeping

    stop_keeping()
    gc.enable()


def sweep_command(
    scenario: Annotated[Path, typer.Argument(help="Scenario file (TOML); its [sweep] table gives defaults.")],
    grid: Annotated[Optional[list[str]], typer.Option(
        "--grid", help="An axis: section.key=V1,V2,... (repeatable; replaces the [sweep] grid's axis of that key).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a key for every point.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Folder for sweep.csv, sweep.parquet, pictures.")] = None,
    resume: Annotated[Optional[Path], typer.Option(
        "--resume", help="Finish the interrupted sweep in this folder (same scenario, --grid and --set).")] = None,
    fast: Annotated[bool, typer.Option("--fast", help="Evaluate every point with the fast estimate only.")] = False,
    executor: Annotated[Optional[str], typer.Option("--executor", help=_EXECUTOR_HELP)] = None,
    tokens: Annotated[Optional[float], typer.Option(
        "--tokens", help="Token budget: adds time to train, dollars and kWh per point.")] = None,
    prices: Annotated[Optional[Path], typer.Option(
        "--prices", help="Price and power table overriding topologies/costs/prices.toml.")] = None,
    pricing: Annotated[Optional[str], typer.Option(
        "--pricing", help="rent (hourly rental) or own (purchase amortised, plus electricity).")] = None,
    amortization_years: Annotated[Optional[float], typer.Option(
        "--amortization-years", help="Years owned hardware is written off over (default: the price table's).")] = None,
) -> None:
    """Run a scenario over the product of grid axes; write the table of every point, CSV and Parquet, and pictures."""
    from simulator.explore.executors import open_executor
    from simulator.explore.sweep import run_sweep, sweep_spec

    if out is not None and resume is not None and out != resume:
        _fail(f"--out {out} and --resume {resume} name different folders: give one of them")
    if out is None and resume is None:
        _fail("give --out DIR for a new sweep, or --resume DIR to finish one")
    folder = resume if resume is not None else out
    _long_running()
    try:
        spec = sweep_spec(scenario, grid or (), set_ or (), fast=fast, tokens=tokens,
                          prices_path=None if prices is None else str(prices), pricing=pricing,
                          amortization_years=amortization_years)
        pool = open_executor(executor)
    except MemsimError as error:
        _fail(str(error))
        return
    progress = _progress()
    try:
        result = run_sweep(spec, folder, pool, resume=resume is not None, progress=progress)
    except (MemsimError, OSError, KeyboardInterrupt) as error:
        if progress is not None:
            progress.stop()
        pool.close(interrupted=True)
        if isinstance(error, KeyboardInterrupt):     # while checking points, or a second Ctrl-C
            _interrupted(folder, started=(folder / "journal.jsonl").exists())
        _fail(str(error) if isinstance(error, MemsimError)
              else f"{folder}: cannot write the sweep: {error.strerror or error}")
        return
    if progress is not None:
        progress.stop()
    pool.close(interrupted=result.interrupted)
    _print_summary(result, folder)
    if result.interrupted:
        _interrupted(folder, started=True)


def _interrupted(folder: Path, started: bool) -> None:
    if started:
        sys.stderr.write(f"memsim: interrupted; every finished point is in {folder}; finish with --resume {folder}\n")
    else:
        sys.stderr.write("memsim: interrupted before any point ran; nothing was written\n")
    raise typer.Exit(130)


MAX_LISTED = 10


def _print_summary(result, folder: Path) -> None:
    rows = result.table.rows
    ok = [row for row in rows if row["status"] == "ok"]
    fitting = [row for row in ok if row["fits"]]
    invalid = [row for row in rows if row["status"] == "invalid"]
    lines = [f"{len(result.points)} points: {len(fitting)} fit, {len(ok) - len(fitting)} do not fit, "
             f"{len(invalid)} invalid" + (f" ({result.resumed} finished before)" if result.resumed else "")]
    for row in invalid[:MAX_LISTED]:
        label = next(p.label for p in result.points if p.index == row["point"])
        reason = row["reason"].removeprefix(f"{result.source}: ")
        lines.append(f"  invalid: point {row['point']} ({label}): {reason}")
    if len(invalid) > MAX_LISTED:
        lines.append(f"  ... and {len(invalid) - MAX_LISTED} more invalid points (status and reason in sweep.csv)")
    if fitting:
        best = max(fitting, key=lambda row: (row["tokens_per_s"], -row["point"]))
        label = next(p.label for p in result.points if p.index == best["point"])
        lines.append(f"highest tokens/s that fits: point {best['point']} ({label}): {best['tokens_per_s']:,.0f} "
                     f"tokens/s, MFU {100 * best['mfu']:.3g}%")
    lines.append("wrote " + ", ".join(str(path) for path in result.written))
    sys.stdout.write("\n".join(lines) + "\n")
