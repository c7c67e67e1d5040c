"""`memsim validate capture|compare|published` and `memsim calibrate`: capture torch runs, compare with them, fit the device.

Registered in simulator/cli_app.py with::

    app.add_typer(validate_app, name="validate")
    app.command("calibrate")(calibrate_command)

The validation package is imported inside each command, so `memsim run` never loads it (nor torch).
Bad input (missing or corrupt data, a capture from another torch version or device, a calibration for
another device, cuda without a GPU) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from simulator.errors import DataError, MemsimError

__all__ = ["validate_app", "calibrate_command", "capture_command", "compare_command", "published_command"]

validate_app = typer.Typer(add_completion=False, no_args_is_help=True,
                           help="Capture real torch training steps and compare memsim's predictions with them.")


def _fail(message: str) -> None:
    sys.stderr.write(f"memsim: error: {message}\n")
    raise typer.Exit(2)


@validate_app.command("capture")
def capture_command(
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    configs: Annotated[Optional[Path], typer.Option(
        "--configs", help="Configurations TOML (default: validation/configs/cpu_memory.toml; "
                          "cuda: validation/cuda/configs.toml).")] = None,
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Output folder (default validation/data/<device>).")] = None,
    only: Annotated[Optional[list[str]], typer.Option("--only", help="Capture only this configuration.")] = None,
    repetitions: Annotated[int, typer.Option("--repetitions", help="Timed steps per configuration.")] = 7,
    memory: Annotated[bool, typer.Option("--memory/--no-memory", help="Also measure the memory timeline.")] = True,
) -> None:
    """Run real torch training steps of each configuration and store time, op profile, memory and environment."""
    try:
        from validation.capture import Protocol, capture
    except ImportError as error:
        _fail(f"capture needs torch (pip install 'memsim[validation]'): {error}")
        return
    try:
        written = capture(device, configs, out, only or [], Protocol(repetitions=repetitions),
                          memory, progress=lambda line: typer.echo(line, err=True))
    except MemsimError as error:
        _fail(str(error))
        return
    typer.echo(f"wrote {len(written)} files under {written[0].parent.parent if written else out}")


@validate_app.command("compare")
def compare_command(
    data: Annotated[Path, typer.Argument(help="Capture folder, e.g. validation/data/cpu.")],
    calibration: Annotated[Optional[Path], typer.Option(
        "--calibration", help="Calibration file to evaluate too.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write a PNG timeline per run and report.json.")] = None,
    repeat: Annotated[Optional[Path], typer.Option("--repeat", help="A second capture of the same "
                                                   "configurations: report the run-to-run noise.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Predict every captured run with default, held-out calibrated and file parameters; print the errors."""
    import json

    from validation.compare import compare, format_report, report_dict

    try:
        report = compare(data, calibration, out, repeat)
    except MemsimError as error:
        _fail(str(error))
        return
    sys.stdout.write(json.dumps(report_dict(report), indent=1) + "\n" if as_json else format_report(report))


@validate_app.command("published")
def published_command(
    folder: Annotated[Optional[Path], typer.Argument(
        help="Folder of published-run files (default: validation/published).")] = None,
    only: Annotated[Optional[list[str]], typer.Option("--only", help="Predict only this run (repeatable).")] = None,
    which: Annotated[str, typer.Option("--set", help="development, holdout or all.")] = "all",
    out: Annotated[Optional[Path], typer.Option("--out", help="Also write the table as JSON to this file.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the table as JSON.")] = False,
) -> None:
    """Predict every published real training run with default parameters and print predicted vs measured time."""
    import json

    from simulator.io import atomic_write_text
    from validation.published import PUBLISHED_DIR, format_table, load_runs, report_dict, run_all

    try:
        runs = load_runs(folder or PUBLISHED_DIR, only or [], which)
        predictions = run_all(runs, progress=None if as_json else lambda line: typer.echo(line, err=True))
        document = json.dumps(report_dict(predictions), indent=1) + "\n"
        if out is not None:
            atomic_write_text(out, document)
    except MemsimError as error:
        _fail(str(error))
        return
    except OSError as error:
        _fail(f"{out}: cannot write: {error.strerror or error}")
        return
    sys.stdout.write(document if as_json else format_table(predictions))


def calibrate_command(
    data: Annotated[Path, typer.Argument(help="Capture folder, e.g. validation/data/cpu.")],
    output: Annotated[Path, typer.Option(
        "-o", "--output", help="Calibration file to write.")] = Path("calibration.toml"),
    bootstrap: Annotated[int, typer.Option("--bootstrap", help="Bootstrap resamples for the 95% intervals.")] = 200,
) -> None:
    """Fit the device model (GEMM efficiency, bandwidth, launch overhead) and link alpha/beta to captured data."""
    from validation.calibrate import calibrate, calibration_toml, write_calibration

    try:
        if bootstrap < 0:
            raise DataError(f"--bootstrap = {bootstrap} must be >= 0")
        result = calibrate(data, bootstrap)
        write_calibration(result, output)
    except MemsimError as error:
        _fail(str(error))
        return
    except OSError as error:
        _fail(f"{output}: cannot write the calibration file: {error.strerror or error}")
        return
    sys.stdout.write(calibration_toml(result))
    typer.echo(f"wrote {output}", err=True)
