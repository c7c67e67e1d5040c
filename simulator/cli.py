"""The `memsim` command line: parse, call the API, render; bad input is one line on stderr, exit 2.

The commands and their options are simulator/cli_app.py's typer application. `memsim run` with plainly spelled
options (the arguments typer would read into the same values, no `--help`) is read here instead and runs
without importing typer, rich or pydantic (a fifth of a second on the showcase; tests/test_cli_fast_path.py
compares the two readings); anything else goes to typer, which explains what is wrong.
"""

from __future__ import annotations

import errno
import gc
import os
import re
import signal
import sys
from pathlib import Path

from simulator.cli_run import report_json, write_outputs
from simulator.errors import MemsimError
from simulator.lifetime import keep_until_exit

__all__ = ["app", "main", "report_json", "write_outputs"]

_FLAGS = {"--json": "as_json", "--full": "full"}
_VALUES = {"--set": "set_", "--out": "out", "--memory-workers": "memory_workers", "--what-would-fit": "fit_advice"}
_RANGES = {"memory_workers": (0, 1024), "fit_advice": (0, 20)}     # cli_app.run's min / max
_DIGITS = re.compile(r"[0-9]+")


def __getattr__(name: str):
    if name == "app":                 # the typer application, imported when asked for
        from simulator.cli_app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fast_run_arguments(args: list[str]) -> dict | None:
    """`memsim run ARGS` read into cli_run.run_command's keywords where every argument is plainly spelled (one
    scenario path; --set, --out, --json, --full, --memory-workers, --what-would-fit, each value in range, as
    `--opt value` or `--opt=value`, none starting with "-", no option but --set twice); None otherwise: typer
    reads those (and says what is wrong with them)."""
    if not args or args[0] != "run" or any(key.startswith("_") and key.endswith("_COMPLETE") for key in os.environ):
        return None
    values: dict = {"scenario": None, "set_": None, "out": None, "as_json": False, "full": False,
                    "memory_workers": None, "fit_advice": 3}
    seen: set[str] = set()
    rest = iter(args[1:])
    for token in rest:
        if not token.startswith("-"):
            if values["scenario"] is not None or not token:
                return None
            values["scenario"] = Path(token)
            continue
        name, inline, value = token.partition("=")
        if name in _FLAGS and not inline:
            key = _FLAGS[name]
            values[key] = True
        elif name in _VALUES:
            key = _VALUES[name]
            value = value if inline else next(rest, None)
            if not value or value.startswith("-"):
                return None
            if key == "set_":
                values[key] = (values[key] or []) + [value]
            elif key == "out":
                values[key] = Path(value)
            else:
                low, high = _RANGES[key]
                if not _DIGITS.fullmatch(value) or not low <= int(value) <= high:
                    return None
                values[key] = int(value)
        else:
            return None
        if key in seen and key != "set_":
            return None
        seen.add(key)
    return values if values["scenario"] is not None else None


def _run_fast(values: dict) -> int:
    """cli_run.run_command with what typer's runner does around a command (Ctrl-C: 130, end of input: aborted, a
    closed pipe: 1)."""
    from simulator.cli_run import run_command

    try:
        return run_command(**values)
    except KeyboardInterrupt:
        return 130
    except EOFError:
        sys.stderr.write("\nmemsim: aborted\n")
        return 1
    except OSError as error:
        if error.errno == errno.EPIPE:
            return 1
        raise


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
    import typer

    from simulator.cli_app import app

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
        fast = fast_run_arguments(sys.argv[1:])
        code = _run_fast(fast) if fast is not None else _run_app()
    except SystemExit as done:
        code = done.code
    except MemsimError as error:  # defensive: any command that lets one escape
        sys.stderr.write(f"memsim: error: {error}\n")
        code = 2
    finally:
        from simulator.io import remove_temporaries

        remove_temporaries()     # what a signal landing before its clean-up left (simulator/io.py)
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
