"""The `memsim` command line: parse, call the API, render; bad input is one line on stderr, exit 2."""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from simulator.errors import MemsimError
from simulator.lifetime import keep, keep_until_exit

if TYPE_CHECKING:
    from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="memsim: simulate deep-learning training memory and time on GPU clusters.")


def _register_subcommands() -> None:
    from simulator.cli_explore import compare_command, plan_command, sweep_command
    from simulator.cli_topo import topo_app
    from simulator.cli_validate import calibrate_command, validate_app

    app.command("sweep")(sweep_command)
    app.command("compare")(compare_command)
    app.command("plan")(plan_command)
    app.add_typer(topo_app, name="topo")
    app.add_typer(validate_app, name="validate")
    app.command("calibrate")(calibrate_command)


_register_subcommands()


def _fail(message: str) -> None:
    sys.stderr.write(f"memsim: error: {message}\n")
    raise typer.Exit(2)


def _console() -> Console:
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


@app.command()
def run(
    scenario: Annotated[Path, typer.Argument(help="Scenario file (TOML).")],
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a key: section.key=value.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write report, trace, snapshot, plot here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON report.")] = False,
    full: Annotated[bool, typer.Option("--full", help="Simulate every rank (sets run.full = true).")] = False,
    memory_workers: Annotated[Optional[int], typer.Option(
        "--memory-workers", min=0, max=1024,
        help="Processes making the memory calls while the engine runs (0: none; default: by the run's size "
             "and the cores available). Results are the same.")] = None,
    fit_advice: Annotated[int, typer.Option(
        "--what-would-fit", min=0, max=20,
        help="When the job does not fit, simulate up to N candidate changes that could make it fit (report key "
             "what_would_fit; 0: none).")] = 3,
) -> None:
    """Simulate one training scenario and report memory, time and whether it fits (and, when it does not, the
    cheapest changes that make it fit, each simulated)."""
    from simulator.api import simulate
    from simulator.scenario import load_scenario

    try:
        loaded = load_scenario(scenario, (set_ or []) + (["run.full=true"] if full else []))
        # only the --out files read memory samples and allocator events (the snapshot)
        result = simulate(loaded, timelines=out is not None, events=out is not None, memory_workers=memory_workers)
        keep(result)
        if not result.report["fits"] and fit_advice > 0:
            from simulator.explore.fit import what_would_fit

            result.report["what_would_fit"] = what_would_fit(scenario, set_ or [], result.report, verify=fit_advice)
    except MemsimError as error:
        _fail(str(error))
        return
    paths: list[Path] = []
    if out is not None:
        # Files first: a run that cannot write its outputs prints nothing but the error.
        try:
            paths = write_outputs(result, out)
        except OSError as error:
            _fail(f"{out}: cannot write outputs: {error.strerror or error}")
            return
    if as_json:
        sys.stdout.write(report_json(result.report))
    else:
        from simulator.report.summary import render_summary

        render_summary(result.report, _console())
        if paths:
            _console().print("wrote " + ", ".join(str(p) for p in paths))


@app.command()
def devices(
    name: Annotated[Optional[str], typer.Argument(help="Show every number of one device with its source.")] = None,
) -> None:
    """List the devices memsim knows; with NAME, every number of that device and its source."""
    from rich.console import Console
    from rich.table import Table

    from simulator.hardware.catalog import get_device, list_devices
    from simulator.units import format_bytes

    if name is not None:
        try:
            _print_device(get_device(name))
        except MemsimError as error:
            _fail(str(error))
        return

    table = Table(title="memsim devices (cluster.topology = NAME)")
    for column in ("name", "device", "memory", "bandwidth", "L2", "bf16 dense", "fp32", "SMs"):
        table.add_column(column)
    for d in list_devices():
        table.add_row(d.name, d.display_name, format_bytes(d.memory_bytes), f"{d.hbm_bytes_per_s / 1e9:,.0f} GB/s",
                      format_bytes(d.l2_bytes), f"{d.peak_flop_per_s.get('bf16', 0) / 1e12:,.1f} TFLOP/s",
                      f"{d.peak_flop_per_s.get('fp32', 0) / 1e12:,.1f} TFLOP/s", str(d.sm_count))
    Console(width=140).print(table)


def _print_device(device) -> None:
    """One device: each field, its value and the source it comes from."""
    import dataclasses

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{device.name}: {device.display_name}", show_lines=True)
    table.add_column("field")
    table.add_column("value")
    table.add_column("source", overflow="fold")
    for field in dataclasses.fields(device):
        if field.name in ("source", "name", "display_name"):
            continue
        table.add_row(field.name, str(getattr(device, field.name)), device.source.get(field.name, ""))
    Console(width=160).print(table)


@app.command()
def presets() -> None:
    """List the model presets (model.preset = NAME)."""
    from simulator.scenario.presets import list_presets

    for name in list_presets():
        typer.echo(name)


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _click_exceptions():
    """The exceptions module of the click that typer runs on (typer >= 0.22 vendors its own as typer._click)."""
    from typer import core

    vendored = getattr(core, "_click", None)
    if vendored is not None:
        return vendored.exceptions
    import click

    return click.exceptions


def _run_app(args: list[str] | None = None) -> int:
    """Run the app with click's errors as memsim's: a usage error (unknown option or command, a bad or missing
    value) is one line on stderr and exit status 2, not click's boxed message; the exit status otherwise."""
    click = _click_exceptions()
    try:
        value = app(args=args, standalone_mode=False)
    except click.NoArgsIsHelpError as error:   # `memsim`, `memsim topo`: the help, as before
        sys.stdout.write(error.ctx.get_help() + "\n")
        return 2
    except click.UsageError as error:
        command = error.ctx.command_path if error.ctx is not None else "memsim"
        message = " ".join(error.format_message().split())
        sys.stderr.write(f"memsim: error: {message} (see {command} --help)\n")
        return 2
    except click.ClickException as error:     # a file option that cannot be opened, ...
        sys.stderr.write(f"memsim: error: {' '.join(error.format_message().split())}\n")
        return error.exit_code or 2
    except typer.Abort:
        sys.stderr.write("memsim: aborted\n")
        return 1
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def main() -> None:
    """Console-script entry point."""
    code: int | str | None = 0
    # No cyclic garbage collection in a command-line run: the process ends right after the command, and a
    # cluster-scale simulation's millions of objects (ops, instructions, spans, samples) live until then, so
    # each collection pass (the first ones right after simulate_multi re-enables it) walks them for nothing.
    gc.disable()
    keep_until_exit()            # and no releasing them one by one either: see simulator/lifetime.py
    # SIGTERM (kill, a batch system's time limit) cleans up as Ctrl-C does: temporary files and staging
    # folders are removed, outputs already in place stay whole (simulator/io.py).
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code = _run_app()
    except SystemExit as done:
        code = done.code
    except MemsimError as error:  # defensive: any command that lets one escape
        sys.stderr.write(f"memsim: error: {error}\n")
        code = 2
    if isinstance(code, str):
        sys.stderr.write(code + "\n")
        code = 1
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)            # a profiler or coverage tool writes its data at exit
    # Exit without tearing down: a cluster-scale run leaves millions of objects whose one-by-one release
    # takes seconds and changes nothing (outputs are written and closed, atomically, by now).
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:           # a closed pipe (memsim ... | head): nothing left to tell
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    main()
