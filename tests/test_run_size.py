"""A run too large to simulate is refused in one line, naming the keys, before anything is built (issue 19)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from simulator.cli import app

GPT3 = Path(__file__).resolve().parents[1] / "scenarios" / "multi" / "gpt3-175b-1024xa100-tp8-pp16-dp8.toml"


@pytest.mark.parametrize("sets, words", [
    # within scenario/limits.py's 16,384 micro-batches per iteration, beyond what the lowering holds with every rank
    (["training.global_batch_size=8000", "run.full=true"],
     ["training.global_batch_size", "run.iterations", "run.full", "layer-micro-batches"]),
    (["training.global_batch_size=80000000"], ["training.global_batch_size", "micro-batches per iteration"]),
    (["cluster.nodes=1000000000", "parallel.dp=62500000", "training.global_batch_size=62500000"],
     ["parallel.dp = 62500000", "at most 1048576"]),
    (["cluster.nodes=2000000"], ["cluster.nodes = 2000000"]),
])
def test_a_run_beyond_what_memsim_simulates_is_refused_at_once(sets, words):
    args = ["run", str(GPT3), "--json"]
    for item in sets:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memsim: error: ")
    for word in words:
        assert word in lines[0]


def test_the_check_needs_no_topology():
    """check_scenario (what sweeps call on every point) refuses it too, without building the cluster."""
    from simulator.api import check_scenario
    from simulator.errors import PlanError
    from simulator.scenario import load_scenario

    scenario = load_scenario(GPT3, ["training.global_batch_size=8000", "run.full=true"])
    with pytest.raises(PlanError, match="layer-micro-batches"):
        check_scenario(scenario)
