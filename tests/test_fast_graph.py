"""The builders' fast constructors (workload/graph.py new_op, new_tensor) make the values Op(...) and Tensor(...) do,
and the lowering's op-time memo (parallel/lower.py op_times) gives the times computed afresh."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.api import _run_device, kernel_profile, recipe_for
from simulator.parallel import lower
from simulator.parallel.lower import lower_single_rank, timed_ops
from simulator.parallel.program import Run
from simulator.scenario import scenario_from_dict
from simulator.scenario_shape import model_shape
from simulator.topology import resolve_cluster
from simulator.workload.graph import Op, Tensor, new_op, new_tensor, slot_constructor
from simulator.workload.tape import Ref, _new_ref
from simulator.workload.training import build_iteration

ids = st.lists(st.integers(0, 10**6), max_size=4).map(tuple)
names = st.text(max_size=8)


@settings(max_examples=200, deadline=None)
@given(st.tuples(names, names, names, st.floats(allow_nan=False), st.integers(0, 10**12), st.integers(0, 10**12),
                 names, st.none() | st.tuples(st.integers(1, 10**5), st.integers(1, 10**5), st.integers(1, 10**5)),
                 st.integers(1, 64), ids, ids, ids, ids, st.integers(-1, 100), st.integers(0, 16)))
def test_new_op_is_the_op_the_constructor_makes(fields):
    made, fast = Op(*fields), new_op(*fields)
    assert type(fast) is Op
    assert fast == made and hash(fast) == hash(made) and repr(fast) == repr(made)
    assert dataclasses.astuple(fast) == dataclasses.astuple(made)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.name = "other"


def test_new_op_sets_every_field():
    # new_op names Op's first 15 fields and writes the rest at their defaults: a field added to Op must be added there
    fields = dataclasses.fields(Op)
    fast = new_op("a", "gemm", "fwd", 1.0, 2, 3, "bf16", (1, 2, 3), 1, (1,), (2,), (2,), (), 0, 0)
    for field in fields[15:]:
        assert getattr(fast, field.name) == field.default, field.name
    assert [f.name for f in fields] == list(Op.__slots__)


@settings(max_examples=100, deadline=None)
@given(st.tuples(st.integers(0, 10**9), names, st.integers(0, 10**12), names, names,
                 st.lists(st.integers(1, 10**4), max_size=4).map(tuple), st.booleans()))
def test_new_tensor_is_the_tensor_the_constructor_makes(fields):
    made, fast = Tensor(*fields), new_tensor(*fields)
    assert type(fast) is Tensor and fast == made and hash(fast) == hash(made) and repr(fast) == repr(made)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.nbytes = 0


SCENARIO = {
    "name": "op-times",
    "model": {"architecture": "llama", "num_layers": 3, "hidden_size": 256, "num_attention_heads": 4,
              "vocab_size": 1000, "seq_length": 128},
    "training": {"micro_batch_size": 2, "global_batch_size": 4, "precision": "bf16-mixed", "optimizer": "adamw"},
    "cluster": {"topology": "a100-80gb-sxm"},
    "run": {"iterations": 1, "warmup_iterations": 1},
}


def _lowered(sets: list[str]):
    scenario = scenario_from_dict(SCENARIO, "op-times.toml", sets)
    device = _run_device(scenario, resolve_cluster(scenario).device)
    recipe = recipe_for(scenario, device)
    workload = build_iteration(model_shape(scenario), recipe, kernel_profile(device))
    return workload, device, recipe


@pytest.mark.parametrize("sets", [[], ['training.optimizer="adam-8bit"'], ['training.recompute="full"'],
                                  ['training.precision="bf16"'], ['training.micro_batch_size=1']])
def test_lowering_with_the_process_op_times_is_the_lowering_without(sets, monkeypatch):
    workload, device, recipe = _lowered(sets)
    # warm: the memo filled by other workloads on this device first; cold: an empty one
    for other in ([], ['training.recompute="selective"'], ['training.micro_batch_size=1']):
        w, d, r = _lowered(other)
        lower_single_rank(w, d, 1, 1, r.accumulation_steps)
    warm = lower_single_rank(workload, device, 1, 1, recipe.accumulation_steps)
    assert lower.op_times()[device]
    monkeypatch.setattr(lower, "_op_times", {})
    cold = lower_single_rank(workload, device, 1, 1, recipe.accumulation_steps)
    assert warm == cold
    # and the times are those computed op by op without a memo
    runs = [i for i in warm.streams["compute"] if isinstance(i, Run) and i.iteration == 0]
    expected = timed_ops(workload.first_microbatch, workload.tensors, device, 0) \
        + timed_ops(workload.later_microbatch, workload.tensors, device, 0) * (recipe.accumulation_steps - 1) \
        + timed_ops(workload.optimizer, workload.tensors, device, 0)
    assert [r.duration_s for r in runs] == [r.duration_s for r in expected]


def test_the_op_times_are_bounded(monkeypatch):
    workload, device, recipe = _lowered([])
    monkeypatch.setattr(lower, "_op_times", {})
    monkeypatch.setattr(lower, "OP_TIMES_KEPT", 10)
    first = lower_single_rank(workload, device, 1, 1, recipe.accumulation_steps)
    filled = lower._op_times[device]
    assert len(filled) > 10                            # one lowering fills it past the bound ...
    assert lower.op_times() == {}                      # ... the next asks for it empty ...
    again = lower_single_rank(workload, device, 1, 1, recipe.accumulation_steps)
    assert again == first                              # ... and gets the same times


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**9), st.lists(st.integers(1, 10**4), max_size=4).map(tuple), names)
def test_new_ref_is_the_ref_the_constructor_makes(tid, shape, dtype):
    made, fast = Ref(tid, shape, dtype), _new_ref(tid, shape, dtype)
    assert type(fast) is Ref and fast == made and hash(fast) == hash(made) and repr(fast) == repr(made)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.id = 0


def test_a_slot_constructor_takes_only_leading_fields():
    with pytest.raises(TypeError):
        slot_constructor(Op, ("op_class", "name"))         # not Op's first fields
    with pytest.raises(TypeError):
        slot_constructor(Op, ("name",))                     # op_class and phase have no default
