"""Sweeps on dask.distributed: a real LocalCluster gives the local executor's table, a killed worker loses no point,
an unreachable scheduler is one line.

Everything Dask runs in child processes: a Dask client leaves its event-loop thread in the process that made it,
and other tests need this one single-threaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny_scenarios import tiny_gpt_on_one_4090

pytest.importorskip("distributed")

REPO = Path(__file__).resolve().parent.parent
GRID = "[sweep.grid]\nmodel.num_layers = [2, 3, 4, 5]\ntraining.micro_batch_size = [1, 2, 3]\n"

# Serves a LocalCluster of two single-threaded worker processes until its stdin closes; prints the address.
SERVE_CLUSTER = """\
import logging, sys
from distributed import LocalCluster
with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                  silence_logs=logging.ERROR) as cluster:
    print(cluster.scheduler_address, flush=True)
    sys.stdin.read()
"""

# Runs the sweep on a dask-local:2 executor, killing a worker busy with a point once the first point is journaled.
KILL_A_WORKER = """\
import json, os, signal, sys, time
from simulator.explore.executors import DaskExecutor, ExecutorSpec
from simulator.explore.sweep import run_sweep, sweep_spec


class KillAWorker:
    def __init__(self, client):
        self.client, self.killed, self.simulating = client, None, False

    def start(self, description, total, completed=0):
        self.simulating = description == "simulating"

    def advance(self, count):
        deadline = time.monotonic() + 30
        while self.simulating and self.killed is None and time.monotonic() < deadline:
            busy = [worker for worker, keys in sorted(self.client.processing().items()) if keys]
            if busy:
                os.kill(self.client.run(os.getpid, workers=[busy[0]])[busy[0]], signal.SIGKILL)
                self.killed = busy[0]
            time.sleep(0.005)


if __name__ == "__main__":
    executor = DaskExecutor.start(ExecutorSpec("dask-local", 2))
    try:
        killer = KillAWorker(executor._client)
        result = run_sweep(sweep_spec(sys.argv[1]), sys.argv[2], executor, progress=killer)
    finally:
        executor.close()
    print(json.dumps({"killed": killer.killed, "interrupted": result.interrupted}))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def _sweep(scenario: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simulator.cli", "sweep", str(scenario), *args], env=_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dask") / "tiny.toml"
    path.write_text(tiny_gpt_on_one_4090("dask", GRID), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def local_table(scenario) -> bytes:
    out = scenario.parent / "local"
    done = _sweep(scenario, "--out", str(out), "--executor", "local:1")
    assert done.returncode == 0, done.stderr
    return (out / "sweep.csv").read_bytes()


@pytest.mark.slow
def test_a_sweep_on_a_local_cluster_gives_the_local_table(scenario, local_table, tmp_path):
    server = subprocess.Popen([sys.executable, "-c", SERVE_CLUSTER], env=_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().strip().removeprefix("tcp://")
        assert address, "the LocalCluster did not start"
        done = _sweep(scenario, "--out", str(tmp_path / "dask"), "--executor", f"dask://{address}")
    finally:
        server.stdin.close()
        server.wait(timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "dask" / "sweep.csv").read_bytes() == local_table
    # and on a LocalCluster the command starts itself
    started = _sweep(scenario, "--out", str(tmp_path / "own"), "--executor", "dask-local:2")
    assert started.returncode == 0, started.stderr
    assert (tmp_path / "own" / "sweep.csv").read_bytes() == local_table


@pytest.mark.slow
def test_a_worker_killed_mid_sweep_loses_no_point(scenario, local_table, tmp_path):
    script = tmp_path / "kill_a_worker.py"
    script.write_text(KILL_A_WORKER, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script), str(scenario), str(tmp_path / "out")], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.splitlines()[-1])
    assert outcome["killed"] is not None, "no worker was busy to kill"
    assert not outcome["interrupted"]
    journaled = (tmp_path / "out" / "journal.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["point"] for line in journaled) == [0, 1, 3, 4, 6, 7, 9, 10]   # each valid once
    assert (tmp_path / "out" / "sweep.csv").read_bytes() == local_table


def test_an_unreachable_scheduler_is_one_line_and_writes_nothing(scenario, tmp_path):
    started = time.monotonic()
    done = _sweep(scenario, "--out", str(tmp_path / "out"), "--executor", "dask://127.0.0.1:9")
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memsim: error: --executor dask://127.0.0.1:9: cannot reach "
                                                   "the Dask scheduler within 3 s"), lines
    assert time.monotonic() - started < 30 and not (tmp_path / "out").exists()
