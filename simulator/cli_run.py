"""What `memsim run` does once its arguments are read: simulate, advise, write the files, print (no typer here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from simulator.errors import MemsimError
from simulator.lifetime import keep

if TYPE_CHECKING:
    from rich.console import Console


def fail(message: str) -> int:
    """Say `message` as the command line's one-line error; the exit status for it."""
    sys.stderr.write(f"memsim: error: {message}\n")
    return 2


def console() -> Console:
    from rich.console import Console

    # Piped output gets a fixed, readable width instead of rich's 80-column fallback.
    return Console() if sys.stdout.isatty() else Console(width=120)


def report_json(report: dict) -> str:
    """The report as stable JSON text (sorted keys, fixed float formatting through json)."""
    return json.dumps(report, indent=2, sort_keys=True) + "\n"


def _rank_coords(result) -> dict:
    """(dp, pp, tp) coordinates of every simulated rank of a multi-GPU result; {} for one device."""
    if result.plan is None:
        return {}
    return {rank.rank: result.plan.coords(rank.rank) for rank in result.trace.ranks}


def write_outputs(result, out_dir: Path) -> list[Path]:
    """Write report.json, trace.json, memory_snapshot.pickle and memory.png into out_dir as one set: the folder
    holds either the old four files or the new four, whatever interrupts the run or writes there beside it.

    With a parallel plan, the Chrome trace names each rank's process "rank r · stage s · dp d · tp t"
    and memory.png titles its panels "stage s (rank r, dp d, tp t)", stages side by side.
    """
    from simulator.io import OutputSet, atomic_write_text
    from simulator.report.plots import plot_memory
    from simulator.trace.chrome import write_chrome_trace
    from simulator.trace.snapshot import build_snapshot, write_snapshot

    names = ["report.json", "trace.json", "memory_snapshot.pickle", "memory.png"]
    # The four files are one set: written into a staging folder, swapped in whole (simulator/io.py OutputSet).
    with OutputSet(out_dir) as output:
        paths = [output.path(name) for name in names]
        atomic_write_text(paths[0], report_json(result.report))
        coords = _rank_coords(result) or None
        world_size = result.report.get("parallel", {}).get("world_size")
        write_chrome_trace(paths[1], result.trace, result.report["scenario"], coords_of_rank=coords,
                           world_size=world_size)
        ranks = result.trace.ranks
        snapshot = build_snapshot([r.allocator_events for r in ranks], [r.final_segments for r in ranks])
        write_snapshot(paths[2], snapshot)
        plot_memory(result.trace, paths[3], title=f"{result.report['scenario']} on {result.report['device']}",
                    coords_of_rank=coords)
    return [out_dir / name for name in names]


def run_command(scenario: Path, set_: Optional[list[str]] = None, out: Optional[Path] = None, as_json: bool = False,
                full: bool = False, memory_workers: Optional[int] = None, fit_advice: int = 3) -> int:
    """`memsim run`'s work with its options read (simulator/cli_app.py documents them); the exit status."""
    from simulator.scenario import load_scenario

    pending = None
    try:
        loaded = load_scenario(scenario, (set_ or []) + (["run.full=true"] if full else []))
        if fit_advice > 0:
            from simulator.explore.fit import PendingAdvice

            # The candidates' estimates and simulations start on another core while a one-GPU job simulates. Not
            # for a cluster job: the helper's first step, estimating the job itself, takes seconds of the core its
            # memory workers use (10 s of CPU at 16,384 GPUs), and its advice is computed after it if it does not fit.
            p = loaded.parallel
            pending = PendingAdvice(scenario, set_ or [], verify=fit_advice,
                                    helper=None if p.dp * p.tp * p.pp == 1 else False)
        from simulator.api import simulate

        # only the --out files read memory samples and allocator events (the snapshot)
        result = simulate(loaded, timelines=out is not None, events=out is not None, memory_workers=memory_workers)
        keep(result)
        if not result.report["fits"] and pending is not None:
            result.report["what_would_fit"] = pending.result(result.report)
    except MemsimError as error:
        return fail(str(error))
    finally:
        if pending is not None:
            pending.cancel()
    paths: list[Path] = []
    if out is not None:
        # Files first: a run that cannot write its outputs prints nothing but the error.
        try:
            paths = write_outputs(result, out)
        except OSError as error:
            return fail(f"{out}: cannot write outputs: {error.strerror or error}")
    if as_json:
        sys.stdout.write(report_json(result.report))
    else:
        from simulator.report.summary import render_summary

        render_summary(result.report, console())
        if paths:
            console().print("wrote " + ", ".join(str(p) for p in paths))
    return 0
