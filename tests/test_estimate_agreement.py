"""The fast estimate agrees with the full simulation on a small sample of random plans (the 300-plan table is in
docs/explore.md), and the agreement's own arithmetic."""

from __future__ import annotations

import math

import pytest

from simulator.explore.agreement import TARGETS, Pair, draw_documents, kendall_tau, measure, summarize
from simulator.scenario.loader import scenario_from_dict
from simulator.testing import draw_examples, multi_gpu_scenarios


def test_draw_examples_is_deterministic():
    a = draw_examples(multi_gpu_scenarios(), 3, seed=5)
    b = draw_examples(multi_gpu_scenarios(), 3, seed=5)
    assert a == b and a != draw_examples(multi_gpu_scenarios(), 3, seed=6)
    for document in a:
        scenario_from_dict(document, "<drawn>")            # valid scenarios


def test_kendall_tau():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert math.isnan(kendall_tau([1.0], [2.0]))


def test_summary_counts_fit_verdicts_and_errors():
    pairs = [Pair("a", (1.0, 100, 90, True), (1.1, 100, 90, True)),
             Pair("b", (2.0, 200, 150, False), (2.0, 210, 150, True)),
             Pair("c", None, None, error="both refused")]
    s = summarize(pairs)
    assert (s["plans"], s["compared"], s["refused_by_both"], s["same_fit"], s["fitting"]) == (3, 2, 1, 0.5, 1)
    assert s["time_max"] == pytest.approx(0.1 / 1.1) and s["memory_max"] == pytest.approx(10 / 210)


@pytest.mark.slow
def test_estimate_agrees_on_a_sample():
    pairs = measure(draw_documents(5, seed=3))
    assert all(p.error is None for p in pairs), [p.error for p in pairs]
    for p in pairs:
        assert abs(p.estimate[0] / p.simulated[0] - 1) <= TARGETS["time_max"], p
        assert abs(p.estimate[1] / p.simulated[1] - 1) <= TARGETS["memory_max"], p
        assert p.estimate[3] == p.simulated[3], p
