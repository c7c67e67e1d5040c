"""The zero-bubble split of a backward into I and W (workload/weight_split.py): a valid program, frees at last use."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from simulator.parallel import lower_multi
from simulator.workload.graph import BACKWARD_INPUT, BACKWARD_WEIGHT, RECOMPUTE, Op
from simulator.workload.stage import build_stage
from simulator.workload.weight_split import split_backward, weight_ops
from tests.test_stage_copies import _doc, _setup

PRE_EXISTING = 6        # ids 0..5 are live before the backward (saved activations, the received gradient)


def _replay_is_valid(ops: tuple[Op, ...]) -> None:
    """Every op allocates new ids, reads / writes / frees only live ones."""
    live = set(range(PRE_EXISTING))
    for op in ops:
        assert not live & set(op.allocs), op.name
        live |= set(op.allocs)
        missing = set(op.inputs + op.outputs + op.frees) - live
        assert not missing, (op.name, missing)
        live -= set(op.frees)


def _check_split(ops: list[Op], retained=None) -> None:
    split = split_backward(ops, retained)
    new = split.input_part + split.weight_part
    _replay_is_valid(new)
    by_name = {op.name: k for k, op in enumerate(ops)}
    assert [by_name[op.name] for op in new] == list(split.order)
    assert sorted(split.order) == list(range(len(ops)))
    inputs, weights = split.order[:len(split.input_part)], split.order[len(split.input_part):]
    assert list(inputs) == sorted(inputs) and list(weights) == sorted(weights)     # each part in replayed order
    assert all(op.phase != BACKWARD_WEIGHT for op in split.input_part)
    produced_in_w = {t for op in split.weight_part for t in op.allocs + op.outputs}
    assert not any(produced_in_w & set(op.inputs + op.outputs + op.allocs) for op in split.input_part)
    # Exactly the same tensors are freed, each once.
    assert sorted(t for op in new for t in op.frees) == sorted(t for op in ops for t in op.frees)
    touched_by_w = {t for op in split.weight_part for t in op.inputs + op.outputs + op.allocs}
    if retained is not None and split.weight_part:
        # What I keeps for W (torch's retained graph) is freed by the last op of W, unless W frees it itself.
        kept = {t for k in inputs for t in ops[k].frees if retained(t)}
        assert kept <= set(split.weight_part[-1].frees) | {t for op in split.weight_part for t in op.frees}
        assert {t for t in kept if t not in touched_by_w} <= set(split.weight_part[-1].frees)
        touched_by_w |= kept
    # A tensor no W op touches is freed by the op that freed it, or, when that op went to W, by the I op before.
    freed_by = {t: op.name for op in new for t in op.frees}
    for k, op in enumerate(ops):
        for t in set(op.frees) - touched_by_w:
            if split.order.index(k) < len(split.input_part):
                assert freed_by[t] == op.name
            else:
                before = [j for j in inputs if j < k]
                assert freed_by[t] == (ops[before[-1]].name if before else op.name)
    # A tensor W touches is freed in W (all of W runs after all of I).
    weight_names = {op.name for op in split.weight_part}
    for t in touched_by_w & set(freed_by):
        assert freed_by[t] in weight_names


@st.composite
def backwards(draw) -> list[Op]:
    """A random valid backward: ops of random phases reading, allocating and freeing live tensors."""
    live = list(range(PRE_EXISTING))
    next_id = PRE_EXISTING
    ops = []
    for k in range(draw(st.integers(1, 14))):
        phase = draw(st.sampled_from([BACKWARD_INPUT, BACKWARD_INPUT, BACKWARD_WEIGHT, RECOMPUTE]))
        reads = draw(st.lists(st.sampled_from(live), max_size=3, unique=True)) if live else []
        allocs = list(range(next_id, next_id + draw(st.integers(0, 2))))
        next_id += len(allocs)
        live += allocs
        frees = draw(st.lists(st.sampled_from(live), max_size=3, unique=True)) if live else []
        if draw(st.booleans()):
            reads = []                     # an accumulate_grad-like op: releases, lists no inputs
        live = [t for t in live if t not in frees]
        ops.append(Op(f"op{k}", "elementwise", phase, inputs=tuple(reads), outputs=tuple(allocs),
                      allocs=tuple(allocs), frees=tuple(frees)))
    return ops


@settings(max_examples=120, deadline=None)
@given(backwards(), st.sampled_from([None, 2, 3]))
def test_any_backward_splits_into_a_valid_program_with_frees_at_last_use(ops, modulus):
    _replay_is_valid(tuple(ops))
    _check_split(ops, None if modulus is None else (lambda t: t % modulus == 0))


def test_a_backward_without_weight_gradients_is_all_input():
    ops = [Op("a", "elementwise", BACKWARD_INPUT, inputs=(0,), outputs=(6,), allocs=(6,), frees=(0,)),
           Op("b", "elementwise", BACKWARD_INPUT, inputs=(6,), frees=(6,))]
    split = split_backward(ops)
    assert split.input_part == tuple(ops) and split.weight_part == () and split.order == (0, 1)


def test_a_linear_keeps_its_saved_input_and_output_gradient_until_its_wgrad():
    # dgrad reads (grad_out 0, x 1), wgrad reads them and frees them; an accumulate op hands wgrad's result to .grad.
    ops = [Op("fc.dgrad", "gemm", BACKWARD_INPUT, inputs=(0, 1), outputs=(6,), allocs=(6,)),
           Op("fc.wgrad", "gemm", BACKWARD_WEIGHT, inputs=(0, 1), outputs=(7,), allocs=(7,), frees=(0, 1)),
           Op("fc.accumulate_grad", "elementwise", BACKWARD_INPUT, frees=(7,)),
           Op("act.bwd", "elementwise", BACKWARD_INPUT, inputs=(6, 2), outputs=(8,), allocs=(8,), frees=(6, 2))]
    split = split_backward(ops)
    assert [op.name for op in split.input_part] == ["fc.dgrad", "act.bwd"]
    assert [op.name for op in split.weight_part] == ["fc.wgrad", "fc.accumulate_grad"]
    assert [op.frees for op in split.input_part] == [(), (6, 2)]
    assert [op.frees for op in split.weight_part] == [(0, 1), (7,)]


def test_a_release_by_a_deferred_op_of_what_only_i_used_stays_in_i():
    # The wgrad (last kernel of the node) also releases the node's input gradient 6 (its input needs none).
    ops = [Op("fc.dgrad", "gemm", BACKWARD_INPUT, inputs=(0, 1), outputs=(6,), allocs=(6,)),
           Op("fc.wgrad", "gemm", BACKWARD_WEIGHT, inputs=(0, 1), outputs=(7,), allocs=(7,), frees=(0, 1, 6))]
    split = split_backward(ops)
    assert split.input_part[0].frees == (6,) and split.weight_part[0].frees == (0, 1)


def test_a_retained_graph_keeps_what_only_i_read_until_the_end_of_w():
    # torch.distributed.pipelining: I keeps every saved activation (here 2, read by act.bwd only) until W is done.
    ops = [Op("fc.dgrad", "gemm", BACKWARD_INPUT, inputs=(0, 1), outputs=(6,), allocs=(6,)),
           Op("act.bwd", "elementwise", BACKWARD_INPUT, inputs=(6, 2), outputs=(8,), allocs=(8,), frees=(6, 2)),
           Op("fc.wgrad", "gemm", BACKWARD_WEIGHT, inputs=(0, 1), outputs=(7,), allocs=(7,), frees=(0, 1)),
           Op("fc.accumulate_grad", "elementwise", BACKWARD_INPUT, frees=(7,))]
    store, graph = split_backward(ops), split_backward(ops, lambda t: t == 2)
    assert [op.frees for op in store.input_part] == [(), (6, 2)]
    assert [op.frees for op in graph.input_part] == [(), (6,)]
    assert [op.frees for op in graph.weight_part] == [(0, 1), (7, 2)]


@pytest.fixture(scope="module")
def stage_backwards() -> list[tuple[str, tuple[Op, ...]]]:
    """Backwards of real stages: first and last stage, recompute none / full, dp 1 / 2 (the sync micro-batch)."""
    out = []
    for recompute in ("none", "full"):
        for dp in (1, 2):
            doc = _doc(pp=4 // dp, dp=dp)
            doc["training"]["recompute"] = recompute
            shape, recipe, profile, plan, schedule, _ = _setup(doc)
            for stage in (0, plan.pp - 1):
                spec = lower_multi.stage_specs(plan)[(stage, 0)]
                stage_input = None if spec.first else ((1, 32, 64), "bf16")
                workload = build_stage(shape, recipe, profile, spec, 4, 0, stage_input, sync_microbatch=3)
                for j in (0, 3):
                    out.append((f"{recompute}-dp{dp}-stage{stage}-mb{j}", workload.microbatches[j].resolved().backward))
    return out


def test_real_stage_backwards_split_validly(stage_backwards):
    for name, ops in stage_backwards:
        split = split_backward(ops)
        weights = [op for op in split.weight_part if op.phase == BACKWARD_WEIGHT]
        assert len(weights) == sum(op.phase == BACKWARD_WEIGHT for op in ops) > 0, name
        assert all(op.phase == BACKWARD_WEIGHT or op.name.endswith(".accumulate_grad") for op in split.weight_part)
        assert any(op.name.endswith(".dgrad") for op in split.input_part), name
        assert sum(weight_ops(ops)) == len(split.weight_part)


@pytest.mark.parametrize("dp", [1, 2])
def test_a_split_stage_keeps_its_data_parallel_reduction_after_the_weight_gradients(dp):
    doc = _doc(pp=4 // dp, dp=dp, schedule="zb-h1")
    shape, recipe, profile, plan, schedule, _ = _setup(doc)
    workloads = lower_multi.build_stage_workloads(shape, recipe, profile, plan, schedule)
    for (stage, _chunk), workload in workloads.items():
        for mb in workload.microbatches:
            assert mb.weight and not any(op.phase == BACKWARD_WEIGHT for op in mb.backward)
            reductions = [op.name for op in mb.backward + mb.weight if op.name.startswith("dp.")]
            assert not any(op.name.startswith("dp.") for op in mb.backward)
            assert bool(reductions) == (dp > 1 and mb.index == workload.meta.get("dp_sync_microbatch"))
