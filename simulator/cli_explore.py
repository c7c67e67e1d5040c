"""`memsim sweep`, `memsim compare` and `memsim plan`: many scenarios at once, with cost and energy, on local processes or Dask."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from simulator.errors import MemsimError

_EXECUTOR_HELP = ("Where points run: local[:N] (process pool, default one per core; local:1 in this process), "
                  "dask-local:N (a Dask LocalCluster) or dask://HOST:PORT (a running scheduler).")


# Options sweep and compare share.
ExecutorOption = Annotated[Optional[str], typer.Option("--executor", help=_EXECUTOR_HELP)]
PricesOption = Annotated[Optional[Path], typer.Option(
    "--prices", help="Price and power table overriding topologies/costs/prices.toml.")]
PricingOption = Annotated[Optional[str], typer.Option(
    "--pricing", help="rent (hourly rental) or own (purchase amortised, plus electricity).")]
AmortizationOption = Annotated[Optional[float], typer.Option(
    "--amortization-years", help="Years owned hardware is written off over (default: the price table's).")]


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
    executor: ExecutorOption = None,
    tokens: Annotated[Optional[float], typer.Option(
        "--tokens", help="Token budget: adds time to train, dollars and kWh per point.")] = None,
    prices: PricesOption = None,
    pricing: PricingOption = None,
    amortization_years: AmortizationOption = None,
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


class _SearchProgress:
    """Adapts search_plans' progress(phase, done, total) calls to the terminal bar."""

    def __init__(self, bar: TerminalProgress) -> None:
        self._bar, self._phase, self._done = bar, None, 0

    def update(self, phase: str, done: int, total: int) -> None:
        if phase != self._phase:
            self._bar.start(phase, total)
            self._phase, self._done = phase, 0
        self._bar.advance(done - self._done)
        self._done = done


def compare_command(
    scenario: Annotated[Path, typer.Argument(help="Scenario file (TOML): the model, training recipe and batch.")],
    cluster: Annotated[list[str], typer.Option(
        "--cluster", help="A cluster to compare: TOPOLOGY:NODES, e.g. dgx-h100:2 (repeatable).")],
    tokens: Annotated[Optional[float], typer.Option(
        "--tokens", help="Token budget: time to train, dollars and kWh for it.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the comparison as JSON.")] = False,
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Also write compare.csv, compare.parquet, compare.json and pictures here.")] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Plans verified by the full simulation per cluster.")] = 3,
    executor: ExecutorOption = None,
    prices: PricesOption = None,
    pricing: PricingOption = None,
    amortization_years: AmortizationOption = None,
) -> None:
    """Find the best plan on each cluster (estimate, then simulation) and set them side by side with cost and energy."""
    from simulator.explore.compare import compare_clusters, comparison_json, parse_cluster
    from simulator.explore.executors import open_executor
    from simulator.explore.sweep import costing
    from simulator.scenario import load_scenario

    _long_running()
    try:
        base = load_scenario(scenario)
        budget, how, table = costing(base, tokens=tokens, prices_path=None if prices is None else str(prices),
                                     pricing=pricing, amortization_years=amortization_years)
        choices = [parse_cluster(item) for item in cluster]
        if out is not None:
            from simulator.explore.sweep import _require_pyarrow

            _require_pyarrow()
        pool = open_executor(executor)
    except MemsimError as error:
        _fail(str(error))
        return
    bar = _progress()
    try:
        comparison = compare_clusters(str(scenario), choices, prices=table, pricing=how, tokens=budget, top_k=top,
                                      executor=pool, progress=None if bar is None else _SearchProgress(bar))
        written = _write_comparison(comparison, out, scenario.stem) if out is not None else []
    except (MemsimError, OSError, KeyboardInterrupt) as error:
        if bar is not None:
            bar.stop()
        pool.close(interrupted=True)
        if isinstance(error, KeyboardInterrupt):
            sys.stderr.write("memsim: interrupted; nothing was written\n")
            raise typer.Exit(130) from None
        _fail(str(error) if isinstance(error, MemsimError) else f"{out}: cannot write outputs: {error.strerror}")
        return
    if bar is not None:
        bar.stop()
    pool.close()
    if as_json:
        sys.stdout.write(comparison_json(comparison))
        return
    _print_comparison(comparison, how.mode)
    if written:
        sys.stdout.write("wrote " + ", ".join(str(path) for path in written) + "\n")


def _write_comparison(comparison, out: Path, title: str) -> list[Path]:
    from simulator.explore.compare import comparison_json
    from simulator.explore.pictures import table_pictures
    from simulator.explore.sweep import write_file_set
    from simulator.explore.table import csv_bytes, parquet_bytes

    files = {"compare.csv": csv_bytes(comparison.best), "compare.parquet": parquet_bytes(comparison.best),
             "compare.json": comparison_json(comparison).encode("utf-8")}
    files.update(table_pictures(comparison.verified.rows, label=lambda row: f"{row['cluster']} {row['plan']}",
                                tokens=comparison.tokens, title=title))
    return write_file_set(out, files)


def _hours(seconds: float) -> str:
    return f"{seconds / 86400:,.1f} days" if seconds >= 2 * 86400 else f"{seconds / 3600:,.1f} h"


def _print_comparison(comparison, mode: str) -> None:
    from rich.console import Console
    from rich.table import Table

    budget = comparison.tokens
    title = (f"best plan per cluster, {budget:.3g} tokens, {'rented' if mode == 'rent' else 'owned'}"
             if budget is not None else f"best plan per cluster ({'rented' if mode == 'rent' else 'owned'})")
    table = Table(title=title)
    for column in ("cluster", "GPUs", "plan", "fits", "tokens/s", "MFU", "peak reserved",
                   *(("time to train", "dollars", "kWh") if budget is not None else ("$ / M tokens", "kWh / M tokens"))):
        table.add_column(column)
    for row in comparison.best.rows:
        if row["status"] != "ok":
            table.add_row(row["cluster"], str(row["gpus"]), row["reason"], "no", *[""] * (3 + (3 if budget else 2)))
            continue
        cost = ((_hours(row["time_to_train_s"]), f"${row['usd']:,.0f}", f"{row['kwh']:,.0f}") if budget is not None
                else (f"${row['usd_per_million_tokens']:,.3f}", f"{row['kwh_per_million_tokens']:,.3f}"))
        table.add_row(row["cluster"], str(row["gpus"]), row["plan"], "yes", f"{row['tokens_per_s']:,.0f}",
                      f"{100 * row['mfu']:.1f}%", f"{row['peak_reserved_bytes'] / 2**30:.1f} GiB", *cost)
    Console(width=160 if not sys.stdout.isatty() else None).print(table)


def plan_command(
    scenario: Annotated[Path, typer.Argument(help="Scenario file (TOML): the model, training recipe and global batch.")],
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs in all (a multiple of the topology's GPUs per node).")],
    topology: Annotated[str, typer.Option("--topology", help="A topology from topologies/ (e.g. dgx-a100) or a file.")],
    top: Annotated[int, typer.Option("--top", min=1, help="Plans verified by the full simulation.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the search as JSON.")] = False,
    executor: ExecutorOption = None,
) -> None:
    """Search the plans (tp, pp, dp, virtual stages, micro-batch, recompute, ZeRO, sequence parallelism, offload) of a
    scenario on N GPUs: prune with the fast estimate, verify the best with the simulation, say why each wins."""
    from simulator.explore.executors import open_executor
    from simulator.explore.plan_report import plan_json, plan_text
    from simulator.explore.search import search_plans

    _long_running()
    try:
        pool = open_executor(executor)
    except MemsimError as error:
        _fail(str(error))
        return
    bar = _progress()
    try:
        found = search_plans(scenario, gpus=gpus, topology=topology, top_k=top, executor=pool,
                             progress=None if bar is None else _SearchProgress(bar))
    except (MemsimError, KeyboardInterrupt) as error:
        if bar is not None:
            bar.stop()
        pool.close(interrupted=True)
        if isinstance(error, KeyboardInterrupt):
            sys.stderr.write("memsim: interrupted\n")
            raise typer.Exit(130) from None
        _fail(str(error))
        return
    if bar is not None:
        bar.stop()
    pool.close()
    sys.stdout.write(plan_json(found) if as_json else plan_text(found))
    sys.stdout.flush()
    sys.stderr.write("memsim: plan search took " + ", ".join(f"{phase} {s:.1f} s" for phase, s in found.seconds)
                     + "\n")
