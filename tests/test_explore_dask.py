"""Sweeps on dask.distributed: a real LocalCluster gives the local executor's table, a killed worker loses no point,
an unreachable scheduler is one line."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simulator.cli import app
from simulator.explore.executors import DaskExecutor, ExecutorSpec
from simulator.explore.journal import JOURNAL_NAME
from simulator.explore.sweep import run_sweep, sweep_spec
from tests.tiny_scenarios import tiny_gpt_on_one_4090

distributed = pytest.importorskip("distributed")

GRID = "[sweep.grid]\nmodel.num_layers = [2, 3, 4, 5]\ntraining.micro_batch_size = [1, 2, 3]\n"


def _sweep(*args: str):
    result = CliRunner().invoke(app, ["sweep", *args], catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dask") / "tiny.toml"
    path.write_text(tiny_gpt_on_one_4090("dask", GRID), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def local_table(scenario) -> bytes:
    out = scenario.parent / "local"
    result = _sweep(str(scenario), "--out", str(out), "--executor", "local:1")
    assert result.exit_code == 0, result.stderr
    return (out / "sweep.csv").read_bytes()


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  silence_logs=logging.ERROR) as running:
        yield running


@pytest.mark.slow
def test_a_sweep_on_a_local_cluster_gives_the_local_table(scenario, local_table, cluster, tmp_path):
    address = cluster.scheduler_address.removeprefix("tcp://")
    result = _sweep(str(scenario), "--out", str(tmp_path / "dask"), "--executor", f"dask://{address}")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "dask" / "sweep.csv").read_bytes() == local_table


class _KillAWorker:
    """A progress stand-in that kills a worker busy with a point as soon as the first point is journaled."""

    def __init__(self, client) -> None:
        self.client, self.killed, self.simulating = client, None, False

    def start(self, description, total, completed=0) -> None:
        self.simulating = description == "simulating"

    def advance(self, count) -> None:
        if self.killed is not None or not self.simulating:
            return
        deadline = time.monotonic() + 30
        while self.killed is None and time.monotonic() < deadline:
            busy = [worker for worker, keys in sorted(self.client.processing().items()) if keys]
            if busy:
                pid = self.client.run(os.getpid, workers=[busy[0]])[busy[0]]
                os.kill(pid, signal.SIGKILL)
                self.killed = busy[0]
            time.sleep(0.005)

    def stop(self) -> None:
        pass


@pytest.mark.slow
def test_a_worker_killed_mid_sweep_loses_no_point(scenario, local_table, tmp_path):
    spec = sweep_spec(scenario)
    executor = DaskExecutor.start(ExecutorSpec("dask-local", 2))
    try:
        killer = _KillAWorker(executor._client)
        result = run_sweep(spec, tmp_path / "out", executor, progress=killer)
    finally:
        executor.close()
    assert killer.killed is not None, "no worker was busy to kill"
    assert not result.interrupted
    journaled = (tmp_path / "out" / JOURNAL_NAME).read_text().splitlines()
    assert len(journaled) == 8      # every valid point once: 4 layer counts x micro-batch 1 and 2
    assert (tmp_path / "out" / "sweep.csv").read_bytes() == local_table


def test_an_unreachable_scheduler_is_one_line_and_writes_nothing(scenario, tmp_path):
    started = time.monotonic()
    result = _sweep(str(scenario), "--out", str(tmp_path / "out"), "--executor", "dask://127.0.0.1:9")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memsim: error: --executor dask://127.0.0.1:9: cannot reach "
                                                   "the Dask scheduler within 3 s")
    assert time.monotonic() - started < 30 and not (tmp_path / "out").exists()
