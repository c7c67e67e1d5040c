"""`memsim plan` and search_plans: the verified plans are their simulations, a failing simulation is reported with
its reason, offload plans are left to the simulation, and the quiet verification settings change no number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simulator import scenario_from_dict, simulate
from simulator.cli import app
from simulator.errors import MemsimError
from simulator.explore import search
from simulator.explore.candidates import AXES, Axis
from simulator.explore.estimate import estimate_reports
from simulator.explore.search import FITS, UNKNOWN, search_plans
from simulator.explore.table import outcome_of
from simulator.scenario import load_scenario
from tests.tiny_scenarios import tiny_gpt

TINY = tiny_gpt("plan-tiny", 2, 2) + "\n[run]\nwarmup_iterations = 0\n"


def _fixed(values: dict) -> tuple[Axis, ...]:
    """AXES with some axes held to the given values (a small search)."""
    return tuple(Axis(a.key, (lambda c, chosen, v=values[a.key]: v)) if a.key in values else a for a in AXES)


SMALL = _fixed({"parallel.tp": [2, 4], "parallel.pp": [1], "training.recompute": ["none", "full"]})


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "tiny.toml"
    path.write_text(TINY, encoding="utf-8")
    return path


def _plan(*args: str):
    result = CliRunner().invoke(app, ["plan", *args], catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.mark.slow
def test_plan_cli_ranks_verified_plans_that_are_their_simulations(scenario):
    result = _plan(str(scenario), "--gpus", "4", "--topology", "pcie-4x4090", "--top", "2", "--json",
                   "--executor", "local:1")
    assert result.exit_code == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["candidates"] == sum(shown["counts"].values()) and shown["counts"]["fits"] >= 2
    plans = shown["plans"]
    assert [p["rank"] for p in plans] == [1, 2] and all(p["error"] is None and p["fits"] for p in plans)
    assert plans[0]["iteration_time_s"] <= plans[1]["iteration_time_s"]
    overrides = ['cluster.topology="pcie-4x4090"', "cluster.nodes=1", *plans[0]["overrides"]]
    report = simulate(load_scenario(scenario, overrides), timelines=False).report
    assert plans[0]["iteration_time_s"] == report["iteration_time_s"]
    assert plans[0]["peak_reserved_bytes"] == max(r["peak_reserved_bytes"] for r in report["ranks"])
    assert len(shown["why_each_wins"]) == 1 and shown["why_each_wins"][0].startswith(plans[0]["plan"] + " beats ")
    assert any(line.startswith("fit but slower") for line in shown["what_stopped"])
    text = _plan(str(scenario), "--gpus", "4", "--topology", "pcie-4x4090", "--top", "2", "--executor", "local:1")
    assert text.exit_code == 0 and "why each wins" in text.stdout and "what stopped the others" in text.stdout
    assert plans[0]["plan"] in text.stdout


@pytest.mark.parametrize(("args", "fragment"), [
    (["--gpus", "6", "--topology", "pcie-4x4090"], "--gpus = 6: must be a multiple of the 4 GPUs per node"),
    (["--gpus", "4", "--topology", "pcie-4x409"], "--topology = 'pcie-4x409'"),
    (["--gpus", "4", "--topology", "pcie-4x4090", "--executor", "nope"], "--executor 'nope'"),
])
def test_plan_bad_input_is_one_line(scenario, args, fragment):
    result = _plan(str(scenario), *args)
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memsim: error: ") and fragment in lines[0], lines
    assert result.stdout == ""


def test_a_failing_simulation_is_reported_not_raised(scenario, monkeypatch):
    import simulator.api

    real = simulator.api.simulate

    def failing(s, **kwargs):
        if s.parallel.tp == 2:
            raise MemsimError(f"{s.source}: simulated failure for tp = 2")
        return real(s, **kwargs)

    monkeypatch.setattr(simulator.api, "simulate", failing)
    found = search_plans(scenario, gpus=4, topology="pcie-4x4090", top_k=40, axes=SMALL)
    failed = [v for v in found.verified if v.error is not None]
    ran = [v for v in found.verified if v.report is not None]
    assert failed and ran and all(v.error == "simulated failure for tp = 2" for v in failed)
    assert all(dict(v.candidate.settings)["parallel.tp"] == 2 for v in failed)
    assert found.verified[-len(failed):] == tuple(failed)          # failures last
    assert found.best is not None and found.best.report["fits"]


def test_quiet_verification_gives_the_same_report(scenario):
    overrides = ['cluster.topology="pcie-4x4090"', "parallel.dp=2", "parallel.tp=2", "training.global_batch_size=2"]
    loud = simulate(load_scenario(scenario, overrides), timelines=False).report
    quiet = simulate(load_scenario(scenario, overrides + search.QUIET), timelines=False).report
    assert json.dumps(loud, sort_keys=True) == json.dumps(quiet, sort_keys=True)


def _offload(parallel: dict) -> dict:
    return {"name": "tiny-offload",
            "model": {"architecture": "gpt", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                      "vocab_size": 512, "seq_length": 32, "dropout": 0.0},
            "training": {"micro_batch_size": 1, "global_batch_size": 1, "precision": "bf16-mixed",
                         "framework": "deepspeed"},
            "parallel": parallel, "cluster": {"topology": "workstation-rtx4090"}}


def test_the_estimate_says_it_leaves_offload_out():
    plain, offloaded = estimate_reports([scenario_from_dict(_offload({"zero_stage": 2}), "x.toml"),
                                         scenario_from_dict(_offload({"zero_stage": 2, "offload_optimizer": "cpu"}),
                                                            "x.toml")])
    assert plain["leaves_out"] == []
    assert offloaded["leaves_out"] and offloaded["leaves_out"][0].startswith("offload")
    assert any("the estimate leaves out offload" in w for w in offloaded["warnings"])


def test_offload_candidates_are_left_to_the_simulation(tmp_path):
    path = tmp_path / "ds.toml"
    path.write_text(TINY.replace('precision = "bf16-mixed"', 'precision = "bf16-mixed"\nframework = "deepspeed"'),
                    encoding="utf-8")
    axes = _fixed({"parallel.tp": [1], "parallel.pp": [1], "training.recompute": ["none"],
                   "parallel.zero_stage": [2], "training.micro_batch_size": [1]})
    found = search_plans(path, gpus=1, topology="workstation-rtx4090", top_k=1, verify=False, axes=axes)
    verdicts = {c.label: c.verdict for c in found.candidates}
    assert verdicts["tp1 pp1 dp1 mb1 1f1b rc-none zero2"] in (FITS, "invalid")
    offloaded = [c for c in found.candidates if "offload" in c.label]
    assert offloaded and all(c.verdict in (UNKNOWN, "invalid") for c in offloaded)
    assert any(c.verdict == UNKNOWN and c.reason.startswith("the estimate leaves out offload") for c in offloaded)
