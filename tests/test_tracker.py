"""Tests of validation.tracker (exact storage timeline), validation.torch_models and the measured data."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from simulator.errors import ScenarioError  # noqa: E402
from validation.measure_memory import (  # noqa: E402
    DEFAULT_CONFIGS, DEFAULT_OUT, WARMUP_STEPS, load_configs, measure, step_report,
)
from validation.torch_models import (  # noqa: E402
    build_model, build_optimizer, make_batch, parse_model, parse_training, train_step,
)
from validation.tracker import MemoryTracker  # noqa: E402

TINY_GPT = "gpt-tiny-fp32-eager-drop-none-adamw"
TINY_LLAMA_FULL = "llama-tiny-fp32-flash-gqa-full-adamw"


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _deltas(step, phase=None):
    return [e.delta_bytes for e in step.events if phase is None or e.phase == phase]


# ---------------------------------------------------------------------------------------------
# Hand-made sequences with known byte counts


def test_hand_made_sequence_exact_bytes():
    model = nn.Module()  # no parameters: only the input and what the ops allocate
    x = torch.ones(10)   # 40 bytes, alive before tracking
    tracker = MemoryTracker(model, None, {"x": x}, collect_garbage=False)
    with tracker:
        tracker.set_phase("forward")
        a = x * 2                                   # +40 (mul)
        v = a.view(2, 5)                            # views allocate nothing
        a.add_(1)                                   # in-place allocates nothing
        c = torch.zeros(100, dtype=torch.bool)      # +100
        d = torch.cat([a, a])                       # +80
        del c                                       # -100
        tracker.set_phase("backward")
        e = d.to(torch.float64)                     # +160 (_to_copy)
        del a, v                                    # -40 (the view held the storage too)
        del d, e                                    # -80, -160
    step = tracker.result()
    assert _deltas(step) == [40, 40, 100, 80, -100, 160, -40, -80, -160]
    assert [step.storages[e.storage].op for e in step.events[:5]] == [
        "setup.input", "aten.mul", "aten.zeros", "aten.cat", "aten.zeros"]
    assert [e.phase for e in step.events] == ["setup"] + ["forward"] * 4 + ["backward"] * 4
    assert step.peak() == (40 + 40 + 100 + 80 + 160 - 100, 5)
    assert step.category_peaks()["activations"] == 220
    assert step.category_peaks()["other"] == 40 + 160
    assert step.live_by_category_at(3) == {"parameters": 0, "gradients": 0, "optimizer_states": 0,
                                           "activations": 220, "communication_buffers": 0, "other": 40}


def test_categories_of_parameters_gradients_and_optimizer_states():
    torch.manual_seed(0)
    model = nn.Linear(4, 2, bias=False)                          # weight: 8 fp32 = 32 bytes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(3, 4)                                        # 48 bytes
    model(x).sum().backward()
    optimizer.step()                                             # creates the 32-byte momentum buffer
    optimizer.zero_grad(set_to_none=True)
    tracker = MemoryTracker(model, optimizer, {"x": x}, collect_garbage=False)
    with tracker:
        tracker.set_phase("forward")
        loss = model(x).sum()
        tracker.set_phase("backward")
        loss.backward()
        del loss
        tracker.set_phase("optimizer")
        optimizer.step()
        tracker.set_phase("zero_grad")
        optimizer.zero_grad(set_to_none=True)
    step = tracker.result()
    by_category = {}
    for record in step.storages:
        by_category.setdefault(record.category, []).append(record.nbytes)
    assert by_category["parameters"] == [32]
    assert by_category["optimizer_states"] == [32]
    assert by_category["gradients"] == [32]
    assert sum(by_category["activations"]) == 3 * 2 * 4 + 4     # mm output (3,2) and the sum (0-dim)
    assert step.phase_peaks()["optimizer"] == 32 + 32 + 48 + 32  # params, momentum, input, gradient
    assert step.live_by_category_at(len(step.events) - 1)["gradients"] == 0  # zero_grad freed it
    assert step.optimizer_implementation() == "single_tensor"


@pytest.mark.parametrize("foreach, expected", [(None, "single_tensor"), (True, "foreach")])
def test_optimizer_implementation_is_detected(foreach, expected):
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=foreach)
    for _ in range(2):
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
    tracker = MemoryTracker(model, optimizer, collect_garbage=False)
    with tracker:
        tracker.set_phase("optimizer")
        optimizer.step()
    assert tracker.result().optimizer_implementation() == expected


def test_checkpoint_recompute_is_its_own_phase_and_rng_state_is_counted():
    block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    checkpoint(block, x, use_reentrant=False).sum().backward()  # warm-up
    tracker = MemoryTracker(block, None, {"x": x}, collect_garbage=False)
    with tracker:
        tracker.set_phase("forward")
        loss = checkpoint(block, x, use_reentrant=False).sum()
        tracker.set_phase("backward")
        loss.backward()
        del loss
    step = tracker.result()
    phases = [e.phase for e in step.events]
    first, last = phases.index("recompute"), len(phases) - 1 - phases[::-1].index("recompute")
    assert set(phases[first:last + 1]) == {"recompute"}           # one contiguous replay
    assert "backward" in phases[last + 1:]                        # depth returned to zero
    recomputed = [r.op for r in step.storages if r.phase == "recompute"]
    # Non-reentrant checkpoint stops replaying once the last saved tensor is rebuilt: the second
    # Linear's output is not saved by anything, so only the first Linear and the GELU are replayed.
    assert recomputed == ["aten.addmm", "aten.gelu"]
    # The CPU RNG state: stashed by checkpoint in forward, and saved again by fork_rng around the replay.
    rng = [r for r in step.storages if r.op == "torch.get_rng_state"]
    assert [(r.nbytes, r.category, r.phase) for r in rng] == [(5056, "other", "forward"), (5056, "other", "backward")]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4096), st.booleans()), min_size=1, max_size=30))
def test_peak_is_max_prefix_sum_of_fresh_allocations(plan):
    """Allocate sizes in order, freeing the flagged ones right away: the tracker's sums are exact."""
    tracker = MemoryTracker(nn.Module(), collect_garbage=False)
    kept, expected, live, peak = [], [], 0, 0
    with tracker:
        tracker.set_phase("forward")
        for nbytes, free_now in plan:
            t = torch.empty(nbytes, dtype=torch.uint8)
            expected.append(nbytes)
            live += nbytes
            peak = max(peak, live)
            if free_now:
                del t
                expected.append(-nbytes)
                live -= nbytes
            else:
                kept.append(t)
                del t
        kept.clear()
    step = tracker.result()
    deltas = _deltas(step)
    assert [d for d in deltas if d > 0] == [d for d in expected if d > 0]   # allocations in program order
    assert sum(deltas) == 0 and sorted(d for d in deltas if d < 0) == sorted(-n for n, _ in plan)
    assert step.peak()[0] == peak
    # Runs of consecutive releases come out in storage-index order (the canonical order).
    for before, after in zip(step.events, step.events[1:]):
        if before.delta_bytes < 0 and after.delta_bytes < 0:
            assert before.storage < after.storage


def test_tracker_is_single_use():
    tracker = MemoryTracker(nn.Module(), collect_garbage=False)
    with tracker:
        pass
    with pytest.raises(Exception, match="already used"):
        with tracker:
            pass


# ---------------------------------------------------------------------------------------------
# Real training steps: profiler cross-check, determinism, recorded data


def _prepared(name):
    config = load_configs(DEFAULT_CONFIGS)[name]
    model_spec, training_spec = parse_model(config["model"]), parse_training(config["training"])
    torch.manual_seed(0)
    model = build_model(model_spec, training_spec)
    optimizer = build_optimizer(model, training_spec)
    for _ in range(WARMUP_STEPS):
        train_step(model, optimizer, *make_batch(model_spec, training_spec), training_spec)
    return model, optimizer, *make_batch(model_spec, training_spec), training_spec


def _profiler_peak_bytes(name):
    """Peak from torch.profiler's raw [memory] events, plus the storages alive before the step."""
    model, optimizer, idx, targets, training_spec = _prepared(name)
    alive = list(model.parameters()) + list(model.buffers()) + [idx, targets]
    alive += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    baseline = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step(model, optimizer, idx, targets, training_spec)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = baseline
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.slow
@pytest.mark.parametrize("name", [TINY_GPT, TINY_LLAMA_FULL])
def test_tracker_peak_equals_profiler_peak(name):
    step, _ = measure(load_configs(DEFAULT_CONFIGS)[name])
    assert step.peak()[0] == _profiler_peak_bytes(name)


@pytest.mark.slow
def test_measurement_is_deterministic_and_matches_committed_data():
    config = load_configs(DEFAULT_CONFIGS)[TINY_GPT]
    first, second = (step_report(measure(config)[0]) for _ in range(2))
    assert first == second
    committed = json.loads((DEFAULT_OUT / f"{TINY_GPT}.json").read_text())
    if committed["environment"]["torch_version"] != torch.__version__:
        pytest.skip("committed data was measured with another torch version")
    assert first["results"] == committed["results"]
    assert first["events"]["rows"] == committed["events"]["rows"]


def test_committed_data_is_complete_and_consistent():
    configs = load_configs(DEFAULT_CONFIGS)
    summary = json.loads((DEFAULT_OUT / "summary.json").read_text())
    assert list(summary) == list(configs) and len(configs) >= 12
    for name, entry in summary.items():
        data = json.loads((DEFAULT_OUT / f"{name}.json").read_text())
        results, events = data["results"], data["events"]
        assert data["config"] == configs[name]
        assert entry["peak_allocated_bytes"] == results["peak_allocated_bytes"]
        assert sum(results["breakdown_at_peak"].values()) == results["peak_allocated_bytes"]
        live = peak = 0
        for row in events["rows"]:
            live += row[1]
            peak = max(peak, live)
        assert peak == results["peak_allocated_bytes"]
        assert live == sum(results["end_bytes"].values())
        assert results["cycle_garbage_bytes"] == 0
        assert data["optimizer_implementation"] == "single_tensor"


# ---------------------------------------------------------------------------------------------
# Configuration parsing


@pytest.mark.parametrize("model_update, message", [
    ({"attention": "paged"}, "model.attention = 'paged' must be one of eager, flash"),
    ({"hidden_size": 0}, "model.hidden_size = 0 must be a positive integer"),
    ({"num_kv_heads": 3}, "be a multiple of num_kv_heads = 3"),
    ({"colour": "red"}, "model.colour is not a key"),
    ({"dropout": 1.5}, "model.dropout = 1.5 must be a number in"),
])
def test_bad_model_values_raise_scenario_error(model_update, message):
    model = {"architecture": "llama", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
             "vocab_size": 512, "seq_length": 64, **model_update}
    with pytest.raises(ScenarioError, match=message.replace("(", r"\(")):
        parse_model(model)


@pytest.mark.parametrize("training, message", [
    ({"precision": "fp16"}, "training.precision = 'fp16' must be one of fp32, bf16, bf16-mixed"),
    ({"recompute": "segments:x"}, "training.recompute = 'segments:x' must be"),
    ({"micro_batch_size": 2, "global_batch_size": 8}, "training.global_batch_size = 8 must equal"),
])
def test_bad_training_values_raise_scenario_error(training, message):
    with pytest.raises(ScenarioError, match=message):
        parse_training(training)


def test_bf16_builds_bf16_parameters_and_restores_default_dtype():
    spec = parse_model({"architecture": "llama", "num_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
                        "num_kv_heads": 2, "vocab_size": 128, "seq_length": 16})
    model = build_model(spec, parse_training({"precision": "bf16"}))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    hd = 64 // 4
    assert model.tables.cos.shape == (16, hd) and model.tables.causal.dtype == torch.bool
    # q, o: h*h each; k, v: h*kv*hd each; MLP 3*h*ffn; 2 norms; embeddings + untied head; final norm.
    ffn = spec.ffn_hidden_size
    per_layer = 2 * 64 * 64 + 2 * 64 * 2 * hd + 3 * 64 * ffn + 2 * 64
    assert sum(p.numel() for p in model.parameters()) == per_layer + 2 * 128 * 64 + 64
