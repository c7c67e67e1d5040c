"""Every output of a run is the same with the exact shortcuts of docs/engine.md on and off (simulate(shortcuts=))."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import simulator.api as api
from simulator.scenario import load_scenario, scenario_from_dict
from tests.test_scale_inline import _everything


@st.composite
def _plans(draw) -> dict:
    topology, (tp, pp, dp) = draw(st.sampled_from(
        [("dgx-a100", shape) for shape in ((2, 2, 2), (4, 2, 1), (1, 4, 2), (2, 1, 4))]
        + [("pcie-4x4090", shape) for shape in ((2, 2, 1), (1, 2, 2), (1, 4, 1))]))
    schedule = draw(st.sampled_from(["1f1b", "interleaved-1f1b", "zb-h1", "gpipe"]))
    parallel = {"tp": tp, "pp": pp, "dp": dp, "schedule": schedule if pp > 1 else "1f1b",
                "overlap_grad_reduce": draw(st.booleans()), "tp_backward_overlap": draw(st.booleans()),
                "bucket_size": "25 kB"}
    if schedule == "interleaved-1f1b" and pp > 1:
        parallel["virtual_stages"] = 2
    if tp > 1:
        parallel["sequence_parallel"] = draw(st.booleans())
        if parallel["sequence_parallel"] and topology != "pcie-4x4090":     # (userbuffers need NVLink)
            parallel["tp_comm_overlap"] = draw(st.booleans())
    if dp > 1:
        parallel["zero_stage"] = draw(st.sampled_from([0, 1]))
    microbatches = draw(st.sampled_from([2, 4])) * pp
    return {"name": "shortcuts", "model": {"architecture": "gpt", "num_layers": 8, "hidden_size": 64,
                                           "num_attention_heads": 4, "vocab_size": 256, "seq_length": 32,
                                           "dropout": 0.0},
            "training": {"micro_batch_size": 1, "global_batch_size": microbatches * dp, "precision": "bf16-mixed",
                         "framework": "megatron",
                         "recompute": draw(st.sampled_from(["none", "selective", "full"]))},
            "parallel": parallel,
            "cluster": {"topology": topology}, "allocator": {"kind": draw(st.sampled_from(["caching", "exact"]))},
            "run": {"warmup_iterations": 1, "iterations": 1, "record_events": True}}


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plans())
def test_outputs_are_the_same_with_shortcuts_off(doc):
    scenario = scenario_from_dict(doc)
    fast = _everything(api.simulate(scenario))
    assert fast == _everything(api.simulate(scenario, shortcuts=False))


SCENARIOS = sorted(path for path in (Path(__file__).resolve().parents[1] / "scenarios").rglob("*.toml")
                   if "seeds" not in path.parts)


@pytest.mark.scale
@pytest.mark.parametrize("path", SCENARIOS, ids=lambda path: path.stem)
def test_scenario_outputs_are_the_same_with_shortcuts_off(path):
    # The committed scenario files as a user runs them (their own keys), every output on and off: long (the
    # cluster-scale files simulate every instruction one simpy step at a time with the shortcuts off).
    scenario = load_scenario(path)
    assert _everything(api.simulate(scenario)) == _everything(api.simulate(scenario, shortcuts=False))
