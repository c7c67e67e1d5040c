"""Golden JSON reports for three small scenarios: any change in a number of the report is a visible diff.

The goldens live in tests/golden/<name>.json. When a change to the model is intended, rewrite them with

    MEMSIM_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py

and review the diff of tests/golden/ before committing it. Floats are compared with a relative
tolerance of 1e-9, integers, booleans and strings exactly, and the key sets must be equal.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from pathlib import Path

import pytest

from simulator.api import simulate
from simulator.scenario import scenario_from_dict

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
UPDATE_ENV = "MEMSIM_UPDATE_GOLDEN"
REL_TOL = 1e-9

SCENARIOS = {
    # GPT on the cpu device, exact allocator: fp32, eager attention with dropout, gradient accumulation 2.
    "tiny-gpt-cpu": """
name = "tiny-gpt-cpu"
[model]
architecture = "gpt"
num_layers = 2
hidden_size = 64
num_attention_heads = 4
vocab_size = 256
seq_length = 32
attention = "eager"
[training]
micro_batch_size = 2
global_batch_size = 4
precision = "fp32"
optimizer = "adamw"
[cluster]
topology = "cpu"
[allocator]
kind = "exact"
""",
    # LLaMA (GQA, SwiGLU, RMSNorm) on the cpu device, exact allocator: bf16-mixed with full recompute.
    "tiny-llama-cpu": """
name = "tiny-llama-cpu"
[model]
architecture = "llama"
num_layers = 2
hidden_size = 64
num_attention_heads = 4
num_kv_heads = 2
vocab_size = 256
seq_length = 32
[training]
micro_batch_size = 2
global_batch_size = 2
precision = "bf16-mixed"
optimizer = "adamw"
recompute = "full"
[cluster]
topology = "cpu"
[allocator]
kind = "exact"
""",
    # GPT-2 small (124M) at a short sequence on an RTX 4090 with the caching allocator.
    "gpt2-small-rtx4090": """
name = "gpt2-small-rtx4090"
[model]
preset = "gpt2"
seq_length = 128
[training]
micro_batch_size = 2
global_batch_size = 2
precision = "bf16-mixed"
optimizer = "adamw"
[cluster]
topology = "rtx-4090"
[allocator]
kind = "caching"
[run]
iterations = 2
""",
}


def report_for(name: str) -> dict:
    """Simulate the golden scenario `name` and return its JSON report, round-tripped through JSON."""
    scenario = scenario_from_dict(tomllib.loads(SCENARIOS[name]), source=f"<golden {name}>")
    return json.loads(json.dumps(simulate(scenario).report))


def golden_diff(expected: object, actual: object, path: str = "report") -> list[str]:
    """Readable differences between a golden value and a new one (empty when they match).

    Floats match within a relative tolerance of REL_TOL (an int in one and a float in the other is a
    difference); everything else must be equal and of the same JSON type.
    """
    if isinstance(expected, dict) and isinstance(actual, dict):
        lines = [f"{path}.{key}: missing (golden has {expected[key]!r})" for key in expected if key not in actual]
        lines += [f"{path}.{key}: new key = {actual[key]!r}" for key in actual if key not in expected]
        for key in expected:
            if key in actual:
                lines += golden_diff(expected[key], actual[key], f"{path}.{key}")
        return lines
    if isinstance(expected, list) and isinstance(actual, list):
        lines = [] if len(expected) == len(actual) else \
            [f"{path}: {len(actual)} items, golden has {len(expected)}"]
        for index, (old, new) in enumerate(zip(expected, actual)):
            lines += golden_diff(old, new, f"{path}[{index}]")
        return lines
    if type(expected) is not type(actual):
        return [f"{path}: golden {expected!r} ({type(expected).__name__}), got {actual!r} ({type(actual).__name__})"]
    if isinstance(expected, float):
        if math.isclose(expected, actual, rel_tol=REL_TOL, abs_tol=0.0):
            return []
        relative = abs(actual - expected) / abs(expected) if expected else math.inf
        return [f"{path}: golden {expected!r}, got {actual!r} (relative change {relative:.3g})"]
    return [] if expected == actual else [f"{path}: golden {expected!r}, got {actual!r}"]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_report_matches_golden(name):
    golden_path = GOLDEN_DIR / f"{name}.json"
    report = report_for(name)
    if os.environ.get(UPDATE_ENV) == "1":
        GOLDEN_DIR.mkdir(exist_ok=True)
        golden_path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if not golden_path.exists():
        pytest.fail(f"{golden_path} is missing; create it with {UPDATE_ENV}=1 python -m pytest tests/test_golden.py",
                    pytrace=False)
    expected = json.loads(golden_path.read_text(encoding="utf-8"))
    diff = golden_diff(expected, report)
    if diff:
        pytest.fail(f"{name}: the report differs from {golden_path.name} in {len(diff)} place(s):\n  "
                    + "\n  ".join(diff)
                    + f"\nIf the change is intended: {UPDATE_ENV}=1 python -m pytest tests/test_golden.py", pytrace=False)


def test_goldens_have_no_stale_files():
    assert sorted(p.stem for p in GOLDEN_DIR.glob("*.json")) == sorted(SCENARIOS)


def test_golden_diff_tolerances():
    base = {"a": 1.0, "b": 2, "c": [True, "x"], "d": {"e": 0.0}}
    assert golden_diff(base, json.loads(json.dumps(base))) == []
    assert golden_diff(base, {**base, "a": 1.0 + 1e-10}) == []
    assert golden_diff(base, {**base, "a": 1.0 + 1e-8}) == ["report.a: golden 1.0, got 1.00000001 (relative change 1e-08)"]
    assert golden_diff(base, {**base, "b": 3}) == ["report.b: golden 2, got 3"]
    assert golden_diff(base, {**base, "b": 2.0}) == ["report.b: golden 2 (int), got 2.0 (float)"]
    assert golden_diff(base, {**base, "c": [1, "x"]}) == ["report.c[0]: golden True (bool), got 1 (int)"]
    assert golden_diff(base, {**base, "d": {"e": 1e-300}})[0].startswith("report.d.e: golden 0.0, got 1e-300")
    missing = {key: value for key, value in base.items() if key != "b"}
    assert golden_diff(base, {**missing, "z": None}) == ["report.b: missing (golden has 2)", "report.z: new key = None"]
    assert golden_diff(base, {**base, "c": [True]}) == ["report.c: 1 items, golden has 2"]
