"""`memsim sweep`: a scenario over the product of its grid axes: check every point, run the valid ones, keep a
journal of finished points, and write the table (CSV, Parquet) and its pictures.

Bad input (a key that does not exist, a value of the wrong type, every point invalid, a price table without a
device used, an executor that cannot start) is refused before anything is written. Finished points go to the
journal one by one; the table and pictures are written from it, all together, at the end or on an interrupt.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from simulator.errors import DataError, ScenarioError
from simulator.explore.cost import PriceTable, Pricing, check_prices, load_prices
from simulator.explore.grid import Axis, Point, expand, merge_axes, parse_grid_option
from simulator.explore.journal import Journal, fingerprint, read_header, read_journal, write_header
from simulator.explore.table import PointCheck, Table, build_table, csv_bytes, parquet_bytes
from simulator.explore.tasks import PointTask, check_points, simulate_point
from simulator.scenario import read_scenario_document, scenario_from_dict

TABLE_REFRESH_S = 30.0          # while running, the tables are rewritten from the journal at most this often
CHECK_BATCH = 64                # points checked per executor task


@dataclass(frozen=True)
class SweepSpec:
    """A sweep: the scenario (its tables and --set items), the axes, the mode and how cost is counted."""

    source: str
    document: dict = field(repr=False)
    sets: tuple[str, ...]
    axes: tuple[Axis, ...]
    fast: bool
    tokens: float | None
    pricing: Pricing
    prices: PriceTable = field(repr=False)

    @property
    def mode(self) -> str:
        """"fast" (the estimate only) or "full" (the simulation)."""
        return "fast" if self.fast else "full"


def sweep_spec(scenario_path: str | os.PathLike, grid_items=(), sets=(), *, fast: bool = False,
               tokens: float | None = None, prices_path: str | None = None, pricing: str | None = None,
               amortization_years: float | None = None) -> SweepSpec:
    """Read the scenario and combine its [sweep] table with the command line's options (which win).

    Raises:
        MemsimError: the scenario, a --grid item, a --set item or the price table is bad (one line).
    """
    source = os.fspath(scenario_path)
    _require_pyarrow()
    document = read_scenario_document(source)
    base = scenario_from_dict(document, source, tuple(sets))
    axes = merge_axes(base.sweep.grid, [parse_grid_option(item, source) for item in grid_items], source)
    costs = costing(base, tokens=tokens, prices_path=prices_path, pricing=pricing,
                    amortization_years=amortization_years)
    return SweepSpec(source, document, tuple(sets), axes, fast or base.sweep.fast, *costs)


def costing(base, *, tokens: float | None, prices_path: str | None, pricing: str | None,
            amortization_years: float | None) -> tuple[float | None, Pricing, PriceTable]:
    """(token budget, pricing, price table): the command line's options, else the scenario's [sweep] table.

    Raises:
        MemsimError: --pricing not rent or own, a budget or amortisation period not > 0, a bad price table.
    """
    source = base.source
    mode = pricing or base.sweep.pricing
    if mode not in ("rent", "own"):
        raise ScenarioError(f"{source}: --pricing {mode!r}: must be rent or own")
    for name, value in (("--tokens", tokens), ("--amortization-years", amortization_years)):
        if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            raise ScenarioError(f"{source}: {name} {value!r}: must be a number > 0")
    return (tokens if tokens is not None else base.sweep.tokens,
            Pricing(mode, amortization_years or base.sweep.amortization_years),
            load_prices(prices_path or base.sweep.prices))


def _require_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise DataError("memsim sweep writes its table as Parquet with pyarrow, which is not installed "
                        "(pip install 'memsim[cluster]')") from None


@dataclass
class SweepResult:
    """What a sweep did: its points, their checks and outcomes, the table, the files written."""

    source: str
    points: list[Point]
    checks: list[PointCheck]
    outcomes: dict[int, dict]
    table: Table
    written: list[Path]
    resumed: int = 0                 # points found finished in the journal
    interrupted: bool = False


def _tasks(spec: SweepSpec, points, memory_workers: int | None) -> list[PointTask]:
    return [PointTask(spec.document, spec.source, spec.sets + point.overrides, memory_workers) for point in points]


def check_sweep(spec: SweepSpec, points: list[Point], executor, progress=None) -> list[PointCheck]:
    """Check every point as a run would before it starts; batches go through the executor."""
    tasks = _tasks(spec, points, None)
    batches = [tasks[start:start + CHECK_BATCH] for start in range(0, len(tasks), CHECK_BATCH)]
    checks: list[list[PointCheck] | None] = [None] * len(batches)
    if progress is not None:
        progress.start("checking points", len(points))
    for index, batch in executor.imap_unordered(check_points, batches):
        checks[index] = batch
        if progress is not None:
            progress.advance(len(batch))
    return [check for batch in checks for check in batch]


def _first_invalid(spec: SweepSpec, points, checks) -> str:
    point, check = next((p, c) for p, c in zip(points, checks) if c.reason is not None)
    reason = check.reason.removeprefix(f"{spec.source}: ")
    return f"point {point.index} ({point.label}): {reason}"


def run_sweep(spec: SweepSpec, out_dir: str | os.PathLike, executor, *, resume: bool = False,
              progress=None) -> SweepResult:
    """Run a sweep into `out_dir` (or finish the one there, with `resume`).

    `progress`, when given, is told `start(description, total, completed=0)` for each phase (checking, then
    simulating or estimating) and `advance(count)` as items finish; the caller stops it. Ctrl-C while points
    run stops the executor and writes the table of what finished (`SweepResult.interrupted`).

    Raises:
        MemsimError: every point invalid, prices missing for a device used, `out_dir` holding another sweep
            (or, with `resume`, no sweep or a different one), a damaged journal. Nothing is written then.
    """
    out = Path(out_dir)
    points = expand(spec.axes, spec.source)
    checks = check_sweep(spec, points, executor, progress)
    valid = [point for point, check in zip(points, checks) if check.reason is None]
    if not valid:
        raise ScenarioError(f"{spec.source}: all {len(points)} points of the sweep are invalid; "
                            f"{_first_invalid(spec, points, checks)}")
    shapes = sorted({check.shape for check in checks if check.shape is not None},
                    key=lambda s: (s.device, s.topology or "", s.nodes))
    check_prices(spec.prices, shapes, spec.pricing)
    labels = {point.index: point.label for point in points}
    header = {"scenario": spec.source, "fingerprint": fingerprint(spec.document, spec.sets, spec.axes, spec.mode),
              "mode": spec.mode, "points": len(points),
              "axes": [[key, list(values)] for key, values in spec.axes], "sets": list(spec.sets)}
    outcomes = _open_output(out, header, labels, resume)
    resumed = len(outcomes)
    pending = [point for point in valid if point.index not in outcomes]
    interrupted = False
    journal = Journal(out)
    written_at = time.monotonic()
    try:
        if progress is not None:
            progress.start("simulating" if not spec.fast else "estimating", len(valid), completed=resumed)
        # points run in this process may fork the engine's memory workers; pool and Dask workers do not
        memory_workers = None if executor.in_process else 0
        for position, outcome in _evaluate(spec, valid, pending, executor, memory_workers):
            point = pending[position]
            journal.append(point.index, point.label, outcome)
            outcomes[point.index] = outcome
            if progress is not None:
                progress.advance(1)
            if time.monotonic() - written_at > TABLE_REFRESH_S:
                _write_tables(out, build_table(spec.axes, points, checks, outcomes, spec.prices, spec.pricing,
                                               spec.tokens))
                written_at = time.monotonic()
    except KeyboardInterrupt:
        interrupted = True
        executor.close(interrupted=True)
    finally:
        journal.close()
    outcomes = read_journal(out, labels)        # the tables come from the journal, whatever interrupted what
    table = build_table(spec.axes, points, checks, outcomes, spec.prices, spec.pricing, spec.tokens)
    written = _write_outputs(out, table, spec)
    return SweepResult(spec.source, points, checks, outcomes, table, written, resumed, interrupted)


ESTIMATE_BLOCK = 128            # --fast: valid points estimated together, in fixed blocks of point order


def _evaluate(spec: SweepSpec, valid: list[Point], pending: list[Point], executor, memory_workers):
    """(position in `pending`, outcome) pairs as the executor finishes them.

    With --fast, the valid points are cut into fixed blocks of ESTIMATE_BLOCK in point order and every block
    with a pending point is estimated whole (its finished points are not journaled again): each point is
    always evaluated beside the same others, so its numbers do not depend on the executor or on a resume. A block
    is estimated by the columnar estimate (explore/columnar: the same outcomes as estimate_reports').
    """
    if not spec.fast:
        yield from executor.imap_unordered(simulate_point, _tasks(spec, pending, memory_workers))
        return
    from simulator.explore.columnar.points import estimate_points

    position = {point.index: k for k, point in enumerate(pending)}
    blocks = [valid[start:start + ESTIMATE_BLOCK] for start in range(0, len(valid), ESTIMATE_BLOCK)]
    blocks = [block for block in blocks if any(point.index in position for point in block)]
    for number, outcomes in executor.imap_unordered(estimate_points, [_tasks(spec, b, 0) for b in blocks]):
        for point, outcome in zip(blocks[number], outcomes):
            if point.index in position:
                yield position[point.index], outcome


def _open_output(out: Path, header: dict, labels: dict[int, str], resume: bool) -> dict[int, dict]:
    """Start the output folder (a new sweep) or read back the finished points (resume)."""
    existing = read_header(out) if out.is_dir() else None
    if not resume:
        if existing is not None:
            raise DataError(f"{out}: holds a sweep already; pass --resume {out} to finish it, or another --out")
        out.mkdir(parents=True, exist_ok=True)
        write_header(out, header)
        return {}
    if existing is None:
        raise DataError(f"{out}: no sweep to resume here (no sweep.json); start one with --out {out}")
    for key in ("mode", "axes", "sets", "points", "fingerprint"):
        if existing.get(key) != header[key]:
            what = "the scenario's tables" if key == "fingerprint" else key
            raise DataError(f"{out}: the sweep there differs from this one in {what}; "
                            f"resume it with the same scenario, --grid and --set items (and --fast or not)")
    return read_journal(out, labels)


def _write_tables(out: Path, table: Table) -> list[Path]:
    return write_file_set(out, {"sweep.csv": csv_bytes(table), "sweep.parquet": parquet_bytes(table)})


def _write_outputs(out: Path, table: Table, spec: SweepSpec) -> list[Path]:
    from simulator.explore.pictures import table_pictures

    files = {"sweep.csv": csv_bytes(table), "sweep.parquet": parquet_bytes(table)}
    keys = [key for key, _ in spec.axes]

    def label(row: dict) -> str:
        return " ".join(f"{key.rpartition('.')[2]}={row[key]}" for key in keys) or f"point {row['point']}"

    files.update(table_pictures(table.rows, label=label, tokens=spec.tokens, title=Path(spec.source).stem))
    return write_file_set(out, files)


def write_file_set(out: Path, files: dict[str, bytes]) -> list[Path]:
    """Write files as a set: every one to a temporary file first (fsync'd), then each renamed over its target,
    so a failure before the renames leaves the old set whole, and readers never see a half-written file."""
    out.mkdir(parents=True, exist_ok=True)
    staged: list[tuple[str, Path]] = []
    try:
        for name in sorted(files):
            handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out)
            staged.append((temporary, out / name))
            with os.fdopen(handle, "wb") as stream:
                stream.write(files[name])
                stream.flush()
                os.fsync(stream.fileno())
            os.chmod(temporary, 0o644)
        for temporary, target in staged:
            os.replace(temporary, target)
    except BaseException:
        for temporary, _ in staged:
            if os.path.exists(temporary):
                os.unlink(temporary)
        raise
    return [target for _, target in staged]
