"""Zero-bubble schedules simulated end to end: I and W run apart, bubble and memory as Qi et al. publish them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st
from typer.testing import CliRunner

from simulator.api import simulate
from simulator.cli import app
from simulator.parallel import lower_multi
from simulator.parallel.program import Run
from simulator.parallel.schedule_check import execute_uniform, load_schedule
from simulator.scenario import scenario_from_dict
from simulator.testing import check_memory_never_negative
from simulator.workload.graph import BACKWARD_WEIGHT
from tests.test_stage_copies import _doc, _setup

P = 4
# The closed form runs equal stages with free communication; memsim's first and last stages carry the
# embedding and the head and the iteration includes sends and the optimizer step (as for 1F1B,
# tests/test_multi_scenarios.py). Measured here: 0.249 / 0.159 / 0.107 against 0.273 / 0.177 / 0.120.
BUBBLE_TOLERANCE = 0.05


def _scenario_doc(schedule: str, microbatches: int = 8, **parallel) -> dict:
    parallel = {"pp": P, **parallel}
    doc = _doc(global_batch=microbatches * parallel.get("dp", 1), layers=8, schedule=schedule, **parallel)
    doc["model"].update(hidden_size=256, seq_length=256, num_attention_heads=8)
    doc["training"]["recompute"] = "none"
    return doc


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    return {name: simulate(scenario_from_dict(_scenario_doc(name)), timelines=False).report
            for name in ("1f1b", "zb-h1", "zb-h2")}


@pytest.fixture(scope="module")
def uniform() -> dict[str, float]:
    """Each schedule's bubble fraction with stage 1's F, I and W times (execute_uniform)."""
    shape, recipe, profile, plan, schedule, device = _setup(_scenario_doc("zb-h1"))
    workloads = lower_multi.build_stage_workloads(shape, recipe, profile, plan, schedule)
    forward, backward, weight = lower_multi._timed_microbatches(workloads[(1, 0)], device, {})[2]
    f, i, w = (sum(duration for _, duration in timed.pairs) for timed in (forward, backward, weight))
    assert w > 0 and i > 0
    return {name: execute_uniform(load_schedule(name, P, 8), f, i + w, w).bubble_fraction
            for name in ("1f1b", "zb-h1", "zb-h2")}


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2"])
def test_the_bubble_is_the_closed_form_of_the_stage_times(reports, uniform, name):
    assert abs(reports[name]["bubble_fraction"] - uniform[name]) <= BUBBLE_TOLERANCE


def test_deferring_weight_gradients_shrinks_the_bubble(reports):
    bubbles = [reports[name]["bubble_fraction"] for name in ("1f1b", "zb-h1", "zb-h2")]
    assert bubbles[0] > bubbles[1] > bubbles[2] > 0
    times = [reports[name]["iteration_time_s"] for name in ("1f1b", "zb-h1", "zb-h2")]
    assert times[0] > times[1] > times[2]


def _activations(report: dict) -> list[int]:
    return [r["category_peaks"]["activations"] for r in sorted(report["ranks"], key=lambda r: r["stage"])]


def test_zb_h1_peaks_at_the_activations_of_1f1b(reports):
    # Rank r holds back r W passes: the later ranks hold more than under 1F1B, never more than rank 0.
    base, h1 = _activations(reports["1f1b"]), _activations(reports["zb-h1"])
    assert h1[0] == base[0] and max(h1) == base[0]
    assert all(h > b for h, b in zip(h1[1:], base[1:]))


def test_zb_h2_holds_about_2p_minus_1_over_p_of_the_1f1b_activations(reports):
    base, h2 = _activations(reports["1f1b"]), _activations(reports["zb-h2"])
    assert h2[0] / base[0] == pytest.approx((2 * P - 1) / P, rel=0.03)      # measured 1.738 vs 1.75


def test_torch_pipelining_keeps_each_held_back_w_s_whole_graph():
    # torch's I retains the autograd graph until W (validation/zero_bubble.py measures it): rank r's r held-back
    # W passes then cost as much as full micro-batches, and every rank holds about p of them, like 1F1B's rank 0.
    doc = _scenario_doc("zb-h1")
    doc["training"]["framework"] = "torch"
    torch_h1 = _activations(simulate(scenario_from_dict(doc), timelines=False).report)
    megatron_h1 = _activations(simulate(scenario_from_dict(_scenario_doc("zb-h1")), timelines=False).report)
    assert all(a >= 0.98 * torch_h1[0] for a in torch_h1)     # less only by the outputs kept: p - r on rank r
    assert megatron_h1[-1] < 0.7 * megatron_h1[0]


def _collapsed(kinds) -> list[str]:
    return [k for j, k in enumerate(kinds) if j == 0 or kinds[j - 1] != k]


def test_i_and_w_run_as_separate_actions_in_schedule_order():
    shape, recipe, profile, plan, schedule, device = _setup(_scenario_doc("zb-h1"))
    programs, workloads = lower_multi.lower_multi(shape, recipe, profile, plan, schedule, device, 0, 1)
    kind_of = {id(op): kind for w in workloads.values() for mb in w.microbatches
               for kind, ops in (("F", mb.forward), ("I", mb.backward), ("W", mb.weight)) for op in ops}
    for stage, program in enumerate(programs):
        ran = [kind_of[id(ins.op)] for ins in program.streams["compute"]
               if isinstance(ins, Run) and id(ins.op) in kind_of]
        assert _collapsed(ran) == _collapsed([a.kind for a in schedule.ranks[stage]])
        assert not any(ins.op.phase == BACKWARD_WEIGHT and kind_of.get(id(ins.op)) != "W"
                       for ins in program.streams["compute"] if isinstance(ins, Run))


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_the_reduced_run_equals_the_full_run(name, tmp_path):
    doc = _scenario_doc(name, pp=2, dp=2, microbatches=4)
    reduced = simulate(scenario_from_dict(doc), timelines=False).report
    doc["run"]["full"] = True
    full = simulate(scenario_from_dict(doc), timelines=False).report
    assert reduced["iteration_time_s"] == full["iteration_time_s"]
    by_rank = {r["rank"]: r["peak_allocated_bytes"] for r in full["ranks"]}
    assert all(by_rank[r["rank"]] == r["peak_allocated_bytes"] for r in reduced["ranks"])


def test_a_custom_schedule_with_weights_out_of_order_runs_from_the_command_line(tmp_path):
    (tmp_path / "late-w.txt").write_text("0F0 0F1 0I0 0I1 0W1 0W0\n1F0 1I0 1F1 1I1 1W1 1W0\n")
    doc = _scenario_doc("late-w.txt", pp=2, dp=2, microbatches=2)
    lines = ["[model]", "architecture = 'gpt'"]
    lines += [f"{k} = {v!r}" for k, v in doc["model"].items() if k != "architecture"]
    for section in ("training", "parallel", "cluster", "run"):
        lines += [f"[{section}]"] + [f"{k} = {json.dumps(v)}" for k, v in doc[section].items()]
    path = tmp_path / "s.toml"
    path.write_text(f"name = 'late-w'\n" + "\n".join(lines) + "\n")
    result = CliRunner().invoke(app, ["run", str(path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["iteration_time_s"] > 0 and all(r["peak_allocated_bytes"] > 0 for r in report["ranks"])


@settings(max_examples=10, deadline=None)
@given(framework=st.sampled_from(["torch", "megatron", "deepspeed"]),
       recompute=st.sampled_from(["none", "selective", "full"]), dp=st.sampled_from([1, 2]),
       schedule=st.sampled_from(["zb-h1", "zb-h2"]), microbatches=st.integers(1, 6))
def test_a_split_iteration_ends_with_the_memory_of_1f1b(framework, recompute, dp, schedule, microbatches):
    # Whatever I keeps for W is released by the iteration's end: the state left (parameters, gradients,
    # optimizer states, buffers) is 1F1B's to the byte, and no sample goes negative on the way.
    ends = []
    for name in ("1f1b", schedule):
        doc = _scenario_doc(name, microbatches=microbatches, pp=4 // dp, dp=dp)
        doc["training"].update(framework=framework, recompute=recompute)
        trace = simulate(scenario_from_dict(doc)).trace
        check_memory_never_negative(trace)
        ends.append([(rank.memory[-1].allocated, rank.memory[-1].by_category) for rank in trace.ranks])
    assert ends[0] == ends[1]
