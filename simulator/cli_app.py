"""The `memsim` typer application: every command's options and help (`memsim run`'s work is cli_run.py's)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from simulator import cli_run
from simulator.errors import MemsimError

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
    code = cli_run.run_command(scenario=scenario, set_=set_, out=out, as_json=as_json, full=full,
                               memory_workers=memory_workers, fit_advice=fit_advice)
    if code:
        raise typer.Exit(code)


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
