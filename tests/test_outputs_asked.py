"""Work only for the outputs asked for (issue 19, point 3): a report is the same byte for byte whether or not the
run kept allocator events and memory samples, and `memsim run --json` keeps neither."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from typer.testing import CliRunner

from simulator import api
from simulator.cli import app, report_json
from simulator.scenario import load_scenario
from tiny_scenarios import tiny_gpt_on_4090s

ROOT = Path(__file__).resolve().parent.parent

PLANS = {
    "dp2-pp2-1f1b": 'dp = 2\npp = 2\nschedule = "1f1b"',
    "tp2-pp2-interleaved": 'tp = 2\npp = 2\nvirtual_stages = 2\nschedule = "interleaved-1f1b"',
    "dp4-zero1": "dp = 4\nzero_stage = 1",
}


def _tiny(tmp_path: Path, plan: str, allocator: str):
    text = tiny_gpt_on_4090s(f"tiny-{plan}", 8, 8, PLANS[plan], warmup_iterations=1)
    path = tmp_path / "tiny.toml"
    path.write_text(text + f'\n[allocator]\nkind = "{allocator}"\n')
    return load_scenario(path, [])


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("allocator", ["caching", "exact"])
def test_report_does_not_depend_on_recording(tmp_path, plan, allocator):
    scenario = _tiny(tmp_path, plan, allocator)
    recorded = api.simulate(scenario, timelines=True, events=True)
    bare = api.simulate(scenario, timelines=False, events=False)
    assert report_json(bare.report) == report_json(recorded.report)
    assert any(rank.allocator_events for rank in recorded.trace.ranks)
    assert not any(rank.allocator_events for rank in bare.trace.ranks)
    assert not any(len(rank.memory) for rank in bare.trace.ranks)


@pytest.mark.parametrize("name", ["showcase.toml", "multi/llama7b-4x4090-tp2-pp2.toml"])
def test_scenario_report_does_not_depend_on_recording(name):
    scenario = load_scenario(ROOT / "scenarios" / name, [])
    recorded = api.simulate(scenario, timelines=True, events=True)
    bare = api.simulate(scenario, timelines=False, events=False)
    assert report_json(bare.report) == report_json(recorded.report)


def test_json_run_records_nothing_it_does_not_print(monkeypatch):
    """`memsim run FILE --json` asks the simulation for no memory samples and no allocator events."""
    asked = {}
    real = api.simulate

    def spy(scenario, **options):
        asked.update(options)
        return real(scenario, **options)

    monkeypatch.setattr(api, "simulate", spy)
    result = CliRunner().invoke(app, ["run", str(ROOT / "scenarios" / "showcase.toml"), "--json"])
    assert result.exit_code == 0, result.output
    assert asked["timelines"] is False and asked["events"] is False
    assert json.loads(result.stdout)["scenario"]
