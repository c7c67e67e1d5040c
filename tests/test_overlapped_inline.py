"""Overlapped collectives run by the compute stream (executor._overlap) and replayed in stretches change no output."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import simulator.api as api
import simulator.engine.executor as executor
from simulator.engine.executor import EngineOptions
from simulator.engine.stretches import Stretches
from simulator.scenario import scenario_from_dict
from test_scale_inline import _doc, _everything


def _spy(monkeypatch) -> tuple[list[bool], list[int]]:
    """executor._overlap and Stretches._apply spied on: whether each overlap ran inline, and per applied record its
    overlapped collectives."""
    ran: list[bool] = []
    applied: list[int] = []
    real_overlap, real_apply = executor._overlap, Stretches._apply

    def overlap(*args):
        done = real_overlap(*args)
        ran.append(done is not None)
        return done

    def apply(self, state, network, index, shift, now_s, record, starts):
        applied.append(len(record.overlaps))
        return real_apply(self, state, network, index, shift, now_s, record, starts)

    monkeypatch.setattr(executor, "_overlap", overlap)
    monkeypatch.setattr(Stretches, "_apply", apply)
    return ran, applied


CASES = [    # (nodes, global batch, parallel plan): Megatron's overlapped TP backward is on by default
    (4, 32, {"tp": 8, "pp": 4, "dp": 1, "sequence_parallel": True}),
    (2, 16, {"tp": 8, "pp": 2, "dp": 1, "schedule": "interleaved-1f1b", "virtual_stages": 2}),
    (4, 48, {"tp": 8, "pp": 2, "dp": 2, "sequence_parallel": True, "tp_comm_overlap": True}),
]


@pytest.mark.parametrize("nodes, global_batch, parallel", CASES)
def test_overlapped_inline_changes_nothing(monkeypatch, nodes, global_batch, parallel):
    # Every output with the overlapped collectives run (and replayed) by the compute stream equals the one where
    # each goes through its comm stream as simpy steps, and the one with no shortcut at all.
    doc = _doc(nodes, global_batch, **parallel)
    doc["training"]["recompute"] = "selective"
    ran, applied = _spy(monkeypatch)
    fast = _everything(api.simulate(scenario_from_dict(doc)))
    assert sum(ran) > 0 and any(applied)        # both paths taken: the comparisons compare different computations
    assert fast == _everything(api.simulate(scenario_from_dict(doc), shortcuts=False))
    ran.clear()
    monkeypatch.setattr(api, "EngineOptions", lambda: EngineOptions(inline_overlapped=False))
    assert fast == _everything(api.simulate(scenario_from_dict(doc)))
    assert not ran
    monkeypatch.setattr(api, "EngineOptions", lambda: EngineOptions(stretches=False))
    assert fast == _everything(api.simulate(scenario_from_dict(doc)))


def test_shortcuts_off_turns_it_off(monkeypatch):
    ran, _ = _spy(monkeypatch)
    api.simulate(scenario_from_dict(_doc(2, 8, tp=8, pp=2, dp=1)), shortcuts=False)
    assert not ran


@st.composite
def _plans(draw) -> dict:
    nodes, (tp, pp, dp) = draw(st.sampled_from([(1, (8, 1, 1)), (1, (4, 2, 1)), (2, (8, 2, 1)), (1, (2, 2, 2)),
                                                (4, (8, 2, 2))]))
    parallel = {"tp": tp, "pp": pp, "dp": dp, "tp_backward_overlap": draw(st.booleans()),
                "sequence_parallel": draw(st.booleans()), "overlap_grad_reduce": draw(st.booleans()),
                "schedule": draw(st.sampled_from(["1f1b", "zb-h1", "gpipe"])) if pp > 1 else "1f1b"}
    if parallel["sequence_parallel"]:
        parallel["tp_comm_overlap"] = draw(st.booleans())
    doc = _doc(nodes, draw(st.sampled_from([2, 4, 8])) * pp * dp, **parallel)
    doc["training"]["recompute"] = draw(st.sampled_from(["none", "selective", "full"]))
    doc["allocator"] = {"kind": draw(st.sampled_from(["caching", "exact"]))}
    return doc


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(_plans())
def test_random_plans_on_and_off(monkeypatch, doc):
    fast = _everything(api.simulate(scenario_from_dict(doc)))
    with monkeypatch.context() as patch:
        patch.setattr(api, "EngineOptions", lambda: EngineOptions(inline_overlapped=False))
        assert fast == _everything(api.simulate(scenario_from_dict(doc)))
    assert fast == _everything(api.simulate(scenario_from_dict(doc), shortcuts=False))
