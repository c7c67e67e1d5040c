"""memsim's memory model against measured torch training steps on this machine's CPU.

The measured numbers are committed in validation/data/cpu/memory/ (from
`python -m validation.measure_memory`); the comparison runs from them without torch. With torch
installed, a few configurations are re-measured here and must reproduce the committed bytes.
"""

from __future__ import annotations

import pytest

from validation.memory_comparison import compare, load_measurement, measured_files, predict
from simulator.workload.graph import CATEGORIES

FILES = measured_files()


def test_enough_configurations_are_committed():
    names = {path.stem for path in FILES}
    assert len(names) >= 8
    assert any(n.startswith("gpt") for n in names) and any(n.startswith("llama") for n in names)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_peak_and_category_peaks_match_measurement(path):
    comparison = compare(path)
    assert abs(comparison.peak_error) <= 0.01, (comparison.measured_peak, comparison.predicted_peak)
    for category in CATEGORIES:
        error = comparison.category_error(category)
        assert abs(error) <= 0.02, (category, comparison.measured_categories, comparison.predicted_categories)


REMEASURED = ["gpt-tiny-fp32-eager-drop-none-adamw", "llama-tiny-bf16-mixed-eager-gqa-none-adamw",
              "llama-tiny-fp32-flash-gqa-full-adamw"]


@pytest.mark.torch
@pytest.mark.parametrize("name", REMEASURED)
def test_remeasured_step_reproduces_committed_bytes_and_memsim(name):
    pytest.importorskip("torch")
    from validation.measure_memory import measure, step_report

    committed = load_measurement(next(p for p in FILES if p.stem == name))
    step, _ = measure(committed["config"])
    fresh = step_report(step)["results"]
    assert fresh["peak_allocated_bytes"] == committed["results"]["peak_allocated_bytes"]
    assert fresh["category_peaks_bytes"] == committed["results"]["category_peaks_bytes"]
    predicted, _ = predict(name, committed["config"])
    assert abs(predicted / fresh["peak_allocated_bytes"] - 1) <= 0.01
