"""Interrupted sweeps: a real `kill -9` and a real Ctrl-C (SIGINT) mid-sweep, then --resume: no point lost or repeated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simulator.errors import DataError
from simulator.explore.journal import JOURNAL_NAME, Journal, read_journal
from tests.tiny_scenarios import tiny_gpt_on_one_4090

REPO = Path(__file__).resolve().parent.parent
# 24 valid points of about 0.1 s each: long enough to interrupt after the first ones have finished
GRID = "[sweep.grid]\nmodel.num_layers = [2, 3, 4, 5, 6, 7, 8, 9]\ntraining.micro_batch_size = [1, 2, 4]\n"
VALID_POINTS = 24


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def _command(scenario: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "simulator.cli", "sweep", str(scenario), "--executor", "local:1", *args]


def _journal_lines(out: Path) -> list[str]:
    path = out / JOURNAL_NAME
    return path.read_text(encoding="utf-8").split("\n") if path.exists() else []


def _start_and_interrupt(scenario: Path, out: Path, sig: int) -> subprocess.CompletedProcess:
    """Start a sweep, wait until two points are journaled, then send `sig`; return the finished process."""
    process = subprocess.Popen(_command(scenario, "--out", str(out)), env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len([line for line in _journal_lines(out) if line]) < 2:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the sweep journaled nothing in 120 s"
        time.sleep(0.01)
    process.send_signal(sig)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _finish(scenario: Path, out: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(_command(scenario, "--resume", str(out)), env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same sweep run without interruption."""
    folder = tmp_path_factory.mktemp("reference")
    scenario = folder / "tiny.toml"
    scenario.write_text(tiny_gpt_on_one_4090("resume", GRID), encoding="utf-8")
    done = subprocess.run(_command(scenario, "--out", str(folder / "out")), env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return scenario, folder / "out"


@pytest.fixture
def local(reference, tmp_path) -> Path:
    """The reference scenario copied into this test's folder."""
    path = tmp_path / "tiny.toml"
    path.write_text(reference[0].read_text(), encoding="utf-8")
    return path


@pytest.mark.slow
def test_kill_9_then_resume_loses_and_repeats_no_point(reference, local, tmp_path):
    reference_out = reference[1]
    out = tmp_path / "out"
    killed = _start_and_interrupt(local, out, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    finished_before = [json.loads(line)["point"] for line in _journal_lines(out)[:-1]]
    assert 2 <= len(finished_before) < VALID_POINTS, "the kill must land mid-sweep"
    done = _finish(local, out)
    assert f"({len(finished_before)} finished before)" in done.stdout
    points = [json.loads(line)["point"] for line in _journal_lines(out) if line]
    assert sorted(points) == list(range(VALID_POINTS)) and points[:len(finished_before)] == finished_before
    for name in ("sweep.csv", "sweep.parquet", "pareto_time_cost.svg", "heatmap_tp_pp.png"):
        expected = (reference_out / name).read_bytes()
        assert (out / name).read_bytes() == expected, name


@pytest.mark.slow
def test_ctrl_c_writes_the_finished_points_and_resume_completes(reference, local, tmp_path):
    reference_out = reference[1]
    out = tmp_path / "out"
    stopped = _start_and_interrupt(local, out, signal.SIGINT)
    assert stopped.returncode == 130, stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert stopped.stderr.endswith(f"memsim: interrupted; every finished point is in {out}; "
                                   f"finish with --resume {out}\n")
    journaled = [line for line in _journal_lines(out) if line]
    table = (out / "sweep.csv").read_text(encoding="utf-8").splitlines()
    assert len(table) == 1 + len(journaled) and 2 <= len(journaled) < VALID_POINTS
    _finish(local, out)
    assert len([line for line in _journal_lines(out) if line]) == VALID_POINTS
    assert (out / "sweep.csv").read_bytes() == (reference_out / "sweep.csv").read_bytes()


def test_a_torn_last_line_is_dropped_and_cut_off(tmp_path):
    journal = Journal(tmp_path)
    journal.append(0, "a=1", {"x": 1.5})
    journal.append(1, "a=2", {"x": 2.5})
    journal.close()
    whole = (tmp_path / JOURNAL_NAME).read_bytes()
    with open(tmp_path / JOURNAL_NAME, "ab") as handle:
        handle.write(b'{"label":"a=3","outcome":{"x"')
    assert read_journal(tmp_path, {0: "a=1", 1: "a=2", 2: "a=3"}) == {0: {"x": 1.5}, 1: {"x": 2.5}}
    assert (tmp_path / JOURNAL_NAME).read_bytes() == whole
    # a damaged line before the last is not an interruption: refused
    (tmp_path / JOURNAL_NAME).write_bytes(b"{oops\n" + whole)
    with pytest.raises(DataError, match="line 1 is damaged"):
        read_journal(tmp_path, {0: "a=1", 1: "a=2"})
    # a line of another sweep is refused
    (tmp_path / JOURNAL_NAME).write_bytes(whole)
    with pytest.raises(DataError, match="line 2 is point 1 \\(a=2\\), which this sweep does not have"):
        read_journal(tmp_path, {0: "a=1", 1: "b=2"})
