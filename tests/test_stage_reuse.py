"""A middle stage made by moving another one's layer numbers equals building it directly, over many plans."""

from __future__ import annotations

import pytest

import simulator.parallel.lower_multi as lower_multi
from simulator.parallel.lower_multi import build_stage_workloads, stage_backward_order, stage_specs
from simulator.workload.graph import Tensor
from simulator.workload.stage import build_stage
from simulator.workload.stage_reuse import relabel_layers
from tests.test_stage_copies import _setup


def _doc(layers: int, schedule: str, recompute: str, framework: str, microbatches: int, nodes: int = 1,
         **parallel) -> dict:
    return {"name": "reuse", "model": {"architecture": "gpt", "num_layers": layers, "hidden_size": 64,
                                       "num_attention_heads": 4, "vocab_size": 512, "seq_length": 32,
                                       "dropout": 0.0},
            "training": {"micro_batch_size": 1, "global_batch_size": microbatches * parallel.get("dp", 1),
                         "precision": "bf16-mixed", "framework": framework, "recompute": recompute},
            "parallel": dict(parallel, schedule=schedule, bucket_size="25 kB"),
            "cluster": {"topology": "dgx-a100", "nodes": nodes},
            "run": {"warmup_iterations": 1, "iterations": 1, "record_events": False}}


CASES = [
    (8, "1f1b", "full", "megatron", 8, 1, dict(tp=2, pp=4, sequence_parallel=True)),
    (16, "1f1b", "none", "torch", 8, 1, dict(pp=8)),
    (13, "1f1b", "selective", "deepspeed", 8, 1, dict(pp=8)),            # uneven layer counts
    (12, "1f1b", "segments:2", "torch", 5, 1, dict(tp=2, pp=4)),
    (16, "interleaved-1f1b", "full", "megatron", 8, 1, dict(pp=4, tp=2, virtual_stages=2)),
    (8, "interleaved-1f1b", "none", "torch", 4, 1, dict(tp=4, pp=2, virtual_stages=2)),
    (8, "zb-h1", "full", "megatron", 6, 1, dict(pp=4, tp=2)),
    (16, "zb-h1", "selective", "torch", 8, 1, dict(pp=8)),
    (8, "1f1b", "full", "megatron", 6, 2, dict(tp=2, pp=4, dp=2, sequence_parallel=True, zero_stage=1)),
    (16, "zb-h1", "none", "megatron", 8, 2, dict(pp=8, dp=2, zero_stage=1)),
    (8, "interleaved-1f1b", "selective", "torch", 4, 2, dict(tp=2, pp=4, dp=2, virtual_stages=2)),
    (8, "1f1b", "full", "megatron", 2, 1, dict(tp=2, pp=4)),                # fewer micro-batches than stages
]


def _inputs(doc: dict):
    return _setup(doc)[:5]          # shape, recipe, profile, plan, schedule


def _structure(workload) -> tuple:
    """Everything a workload holds, in order, with the objects it shares named by first appearance."""
    names: dict[int, int] = {}
    kept = []

    def name(obj) -> int:
        kept.append(obj)
        return names.setdefault(id(obj), len(names))

    tensors = [(tid, name(t), t) for tid, t in workload.tensors.items()]
    microbatches = [(mb, mb.copy_of, name(mb.forward), name(mb.backward), name(mb.weight),
                     [(name(o), o) for o in mb.forward + mb.backward + mb.weight]) for mb in workload.microbatches]
    return (tensors, microbatches, [(name(o), o) for o in workload.optimizer], workload.persistent,
            workload.optimizer_state_ids, workload.gradients, workload.parameter_count, workload.output_shape,
            workload.output_dtype, sorted(workload.meta.items(), key=lambda kv: kv[0]), workload.first_use)


@pytest.mark.parametrize("layers,schedule,recompute,framework,microbatches,nodes,parallel", CASES)
def test_reused_stages_equal_direct_builds(monkeypatch, layers, schedule, recompute, framework, microbatches,
                                           nodes, parallel):
    shape, recipe, profile, plan, schedule_ = _inputs(_doc(layers, schedule, recompute, framework, microbatches,
                                                           nodes, **parallel))
    relabelled = []

    def counting(workload, start):
        relabelled.append(start)
        return relabel_layers(workload, start)

    monkeypatch.setattr(lower_multi, "relabel_layers", counting)
    workloads = build_stage_workloads(shape, recipe, profile, plan, schedule_)
    assert relabelled, "no stage was made by moving layer numbers"
    specs = stage_specs(plan)
    previous = None
    for span in sorted(plan.stages, key=lambda s: s.index):
        first_backward, last_backward, split = stage_backward_order(schedule_, span.stage, span.chunk)
        direct = build_stage(shape, recipe, profile, specs[(span.stage, span.chunk)], schedule_.microbatches,
                             first_backward, previous, sync_microbatch=last_backward, split_weight=split)
        got = workloads[(span.stage, span.chunk)]
        assert got == direct
        assert _structure(got) == _structure(direct)
        previous = (direct.output_shape, direct.output_dtype)


def test_relabel_moves_only_the_stage_layers():
    shape, recipe, profile, plan, schedule = _inputs(_doc(16, "1f1b", "full", "megatron", 4, 1, pp=8))
    specs = stage_specs(plan)
    spec1, spec2 = specs[(1, 0)], specs[(2, 0)]
    previous = ((1, 32, 64), "bf16")
    one = build_stage(shape, recipe, profile, spec1, 4, 0, previous)
    moved = relabel_layers(one, spec2.start)
    assert moved.meta["layers"] == (spec2.start, spec2.stop)
    layers = {o.layer for mb in moved.microbatches for o in mb.forward + mb.backward}
    assert layers == set(range(spec2.start, spec2.stop))
    names = {t.name for t in moved.tensors.values()}
    assert any(n.startswith(f"layers.{spec2.start}.") for n in names)
    assert not any(n.startswith(f"layers.{spec1.start}.") for n in names)
    assert relabel_layers(one, spec1.start) == one


def test_relabel_maps_a_changed_copy_entry_on_its_own():
    """A copy's id whose Tensor is not its template's any more (the copies' run is not repeated) keeps its own."""
    shape, recipe, profile, plan, schedule = _inputs(_doc(16, "1f1b", "none", "torch", 6, 1, pp=8))
    spec1, spec2 = stage_specs(plan)[(1, 0)], stage_specs(plan)[(2, 0)]
    one = build_stage(shape, recipe, profile, spec1, 6, 0, ((1, 32, 64), "bf16"))
    copy = one.microbatches[-1]
    assert copy.shift and copy.copy_of >= 0
    tid = next(t for t in copy.forward[0].outputs if t >= copy.low) + copy.shift
    expected = relabel_layers(one, spec2.start).tensors
    changed = one.tensors[tid]
    one.tensors[tid] = Tensor(changed.id, changed.name, changed.nbytes + 1, changed.category, changed.dtype,
                              changed.shape, changed.persistent)
    got = relabel_layers(one, spec2.start).tensors
    assert list(got) == list(expected)
    assert got[tid].nbytes == expected[tid].nbytes + 1 and got[tid].name == expected[tid].name
    assert {k: t for k, t in got.items() if k != tid} == {k: t for k, t in expected.items() if k != tid}
