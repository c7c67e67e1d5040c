"""`memsim run`'s "what would make it fit": each listed change is simulated, and `memsim run --set ...` with it gives
the same answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simulator.api import simulate
from simulator.cli import app
from simulator.explore.fit import PendingAdvice, single_changes, what_would_fit
from simulator.scenario import load_scenario

REPO = Path(__file__).resolve().parents[1]
SHOWCASE = REPO / "scenarios" / "showcase.toml"


@pytest.fixture(scope="module")
def showcase_advice():
    report = simulate(load_scenario(SHOWCASE), timelines=False).report
    return report, what_would_fit(SHOWCASE, [], report)


def test_the_showcase_gets_simulated_changes_that_fit(showcase_advice):
    original, advice = showcase_advice
    assert original["fits"] is False
    fitting = [entry for entry in advice if entry["fits"]]
    assert fitting, advice
    # cheapest first: GPU-seconds per token never decrease down the fitting part of the list
    ratios = [entry["gpu_time_ratio"] for entry in fitting]
    assert ratios == sorted(ratios)
    for entry in fitting:
        assert entry["needed_bytes"] <= entry["capacity_bytes"]
        assert entry["changes"] and all("=" in item for item in entry["changes"])


def test_each_listed_change_is_what_memsim_run_with_it_gives(showcase_advice):
    original, advice = showcase_advice
    for entry in advice:
        report = simulate(load_scenario(SHOWCASE, entry["changes"]), timelines=False).report
        assert report["fits"] == entry["fits"]
        assert report["iteration_time_s"] == entry["iteration_time_s"]
        assert max(r["peak_reserved_bytes"] for r in report["ranks"]) == entry["peak_reserved_bytes"]
        assert entry["time_ratio"] == pytest.approx(original["tokens_per_s"] / report["tokens_per_s"])


def test_the_advice_prepared_beside_the_run_is_what_would_fit_gives(showcase_advice):
    original, advice = showcase_advice
    pending = PendingAdvice(SHOWCASE, [], helper=True)   # forked where that is safe, before the run's answer
    assert pending.result(original) == advice
    stopped = PendingAdvice(SHOWCASE, [], helper=True)
    stopped.cancel()                                 # no helper: computed in this process
    assert stopped.result(original) == advice
    fits = PendingAdvice(SHOWCASE, [], helper=True)
    assert fits.result({**original, "fits": True}) == []


def test_a_job_that_fits_gets_no_advice():
    scenario = load_scenario(SHOWCASE, ['cluster.topology="h200-sxm"', 'training.optimizer="adam-8bit"'])
    report = simulate(scenario, timelines=False).report
    assert report["fits"] is True
    assert what_would_fit(SHOWCASE, ['cluster.topology="h200-sxm"', 'training.optimizer="adam-8bit"'], report) == []


def test_changes_follow_the_scenario():
    base = load_scenario(SHOWCASE, ["training.micro_batch_size=4", "training.global_batch_size=8"])
    labels = [c.label for c in single_changes(base, 1)]
    assert any(label.startswith("micro-batch 2") for label in labels)
    assert any(label.startswith("micro-batch 1") for label in labels)
    assert not any("ZeRO stage" in label for label in labels)          # dp = 1: nothing to shard over
    assert any("8-bit Adam" in label for label in labels)
    sgd = load_scenario(SHOWCASE, ['training.optimizer="sgd"', 'training.recompute="full"'])
    labels = [c.label for c in single_changes(sgd, 1)]
    assert not any("recompute" in label or "8-bit" in label or "offload" in label for label in labels)
    pipeline = load_scenario(REPO / "scenarios" / "multi" / "llama7b-4x4090-tp2-pp2.toml",
                             ["parallel.tp=1", "parallel.dp=2", "training.global_batch_size=8"])
    zero = [c for c in single_changes(pipeline, 4) if c.axis == "zero"]
    assert [c.sets for c in zero] == [("parallel.zero_stage=1",)]      # ZeRO-2/3 are refused with pp > 1


def test_cli_json_carries_the_list_and_the_option_turns_it_off():
    runner = CliRunner()
    done = runner.invoke(app, ["run", str(SHOWCASE), "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert report["fits"] is False
    assert any(entry["fits"] for entry in report["what_would_fit"])
    off = runner.invoke(app, ["run", str(SHOWCASE), "--json", "--what-would-fit", "0"])
    assert off.exit_code == 0
    assert "what_would_fit" not in json.loads(off.stdout)
    human = runner.invoke(app, ["run", str(SHOWCASE)])
    assert "What would make it fit" in human.stdout


@pytest.mark.slow
def test_a_job_no_single_change_rescues_gets_a_combination():
    path = REPO / "scenarios" / "seeds" / "llama7b-adamw-4090.toml"
    report = simulate(load_scenario(path), timelines=False).report
    advice = what_would_fit(path, [], report)
    fitting = [entry for entry in advice if entry["fits"]]
    assert fitting and all(" + " in entry["label"] for entry in fitting)


def test_lora_and_qlora_are_candidates_where_they_are_simulated(showcase_advice):
    labels = [c.label for c in single_changes(load_scenario(SHOWCASE), 1)]
    assert any(label.startswith("LoRA adapters") for label in labels)
    assert any(label.startswith("QLoRA") for label in labels)
    for refused in (['training.framework="megatron"'], ['training.peft="lora"'], ['training.precision="fp8-mixed"']):
        labels = [c.label for c in single_changes(load_scenario(SHOWCASE, refused), 1)]
        assert not any("LoRA" in label for label in labels), refused
    # On the 80 GB A100 the adapters fit alone; the listed entry is what `memsim run --set training.peft=...` gives.
    _, advice = showcase_advice
    lora = next(entry for entry in advice if entry["changes"] == ['training.peft="lora"'])
    assert lora["fits"] and lora["time_ratio"] < 1


@pytest.mark.parametrize("path, helper", [("scenarios/gpt2-cpu.toml", None),
                                          ("scenarios/multi/llama7b-4x4090-tp2-pp2.toml", False)])
def test_the_advice_helper_is_forked_for_one_gpu_jobs_only(monkeypatch, path, helper):
    """A cluster job's advice is not started beside it (the helper's estimate of the job would take the core its
    memory workers use); a one-GPU job's may be."""
    from simulator import cli_run
    import simulator.explore.fit as fit

    asked = []

    class Recorded(PendingAdvice):
        def __init__(self, *args, helper=None, **kwargs):
            asked.append(helper)
            super().__init__(*args, helper=False, **kwargs)     # (nothing forked by the test itself)

    monkeypatch.setattr(fit, "PendingAdvice", Recorded)
    assert cli_run.run_command(REPO / path, as_json=True) == 0
    assert asked == [helper]
