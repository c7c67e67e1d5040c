"""Micro-batch copies share their template's ops: their Runs resolve to the ids an eager copy had."""

from __future__ import annotations

import dataclasses
import functools

import pytest

import simulator.api as api
import simulator.parallel.lower_multi as lower_multi
from simulator.parallel.lower_multi import _timed_microbatches, build_stage_workloads
from simulator.parallel.rank_streams import RankStreams
from simulator.parallel.plan import make_plan
from simulator.parallel.program import Collective, Period, Run, posted_collectives
from simulator.parallel.schedule_check import load_schedule
from simulator.scenario import scenario_from_dict
from simulator.workload.graph import Op
from simulator.workload.stage import build_stage


def _doc(global_batch: int = 8, layers: int = 4, topology: str = "pcie-4x4090", **parallel) -> dict:
    return {"name": "tiny", "model": {"architecture": "gpt", "num_layers": layers, "hidden_size": 64,
                                      "num_attention_heads": 4, "vocab_size": 512, "seq_length": 32,
                                      "dropout": 0.0},
            "training": {"micro_batch_size": 1, "global_batch_size": global_batch, "precision": "bf16-mixed",
                         "framework": "megatron", "recompute": "full"},
            "parallel": parallel, "cluster": {"topology": topology},
            "run": {"warmup_iterations": 1, "iterations": 1, "record_events": False}}


def _setup(doc: dict):
    scenario = scenario_from_dict(doc)
    cluster = api.resolve_cluster(scenario)
    recipe = api.multi_recipe(scenario, cluster.device)
    p = scenario.parallel
    schedule = load_schedule(p.schedule, p.pp, recipe.accumulation_steps, p.virtual_stages)
    return (api.model_shape(scenario), recipe, api.kernel_profile(cluster.device),
            make_plan(scenario, cluster.topology), schedule, cluster.device)


def _eager_copy(ops: tuple[Op, ...], shift: int, low: int, index: int) -> list[Op]:
    """What the copy's ops were before ops were shared: every id >= low moved by shift, its own index."""
    def ids(values):
        return tuple(v + shift if v >= low else v for v in values)

    return [dataclasses.replace(o, inputs=ids(o.inputs), outputs=ids(o.outputs), allocs=ids(o.allocs),
                                frees=ids(o.frees), microbatch=index) for o in ops]


def _lowered(streams: RankStreams) -> tuple[list[tuple], list[tuple]]:
    """(op name, allocs, frees) of the compute stream's Runs and of the collectives posted on the other streams."""
    runs = [(ins.op.name, ins.allocs(), ins.frees()) for ins in streams.compute if isinstance(ins, Run)]
    posts = [(c.name, c.allocs, c.frees) for name in streams.other
             for c in posted_collectives({**streams.other, "compute": streams.compute}, name)]
    return runs, posts


@pytest.mark.parametrize("parallel", [dict(pp=4), dict(tp=2, pp=2)])
def test_copy_runs_resolve_to_the_ids_of_the_eager_copy_and_of_a_recorded_microbatch(parallel):
    shape, recipe, profile, plan, schedule, device = _setup(_doc(**parallel))
    fast = build_stage_workloads(shape, recipe, profile, plan, schedule)
    checked = 0
    for (stage, chunk), workload in fast.items():
        spec = lower_multi.stage_specs(plan)[(stage, chunk)]
        stage_input = None if spec.first else (fast[(stage - 1, chunk)].output_shape,
                                               fast[(stage - 1, chunk)].output_dtype)
        backwards = [a.microbatch for a in schedule.ranks[stage] if a.kind == "B"]
        recorded = build_stage(shape, recipe, profile, spec, schedule.microbatches, backwards[0], stage_input,
                               replay_all=True, sync_microbatch=backwards[-1])
        timed = _timed_microbatches(workload, device, {})
        for j, mb in enumerate(workload.microbatches):
            if not mb.shift:
                continue
            template = workload.microbatches[mb.copy_of]
            assert mb.forward is template.forward and mb.backward is template.backward   # shared, not copied
            for ops, timing, truth in ((mb.forward, timed[j][0], recorded.microbatches[j].forward),
                                       (mb.backward, timed[j][1], recorded.microbatches[j].backward)):
                streams = RankStreams(plan.rank_of(dp=0, pp=stage, tp=0), plan)
                streams.microbatch(timing, 0, mb.shift, mb.low)
                eager = _eager_copy(ops, mb.shift, mb.low, j)
                assert eager == list(truth)        # the eager copy is the recorded micro-batch
                tp_posts = plan.tp > 1
                expected_runs = [(o.name, o.allocs, o.frees) for o in eager
                                 if not (tp_posts and o.op_class == "collective")]
                expected_posts = [(o.name, o.allocs, o.frees) for o in eager
                                  if tp_posts and o.op_class == "collective"]
                assert _lowered(streams) == (expected_runs, expected_posts)
                assert [run.duration_s for run in streams.compute if isinstance(run, Run)] == \
                    [d for o, d in timing.pairs if not (tp_posts and o.op_class == "collective")]
                checked += 1
            assert mb.resolved() == recorded.microbatches[j]
    assert checked >= 4


def _normalized(program) -> dict:
    """Every stream's instructions with Runs resolved to their ids (shift / low dropped); Period markers (only
    where copies exist, for engine/repeats.py) are left out."""
    out = {}
    for name, instructions in program.streams.items():
        rows = []
        for ins in instructions:
            if isinstance(ins, Period):
                continue
            if isinstance(ins, Run):
                rows.append(("run", ins.op.name, ins.op.phase, ins.duration_s, ins.iteration, ins.allocs(),
                             ins.frees()))
            else:
                rows.append(ins)
        out[name] = rows
    return out


def _tensor_values(program) -> dict:
    return {tid: (t.name, t.nbytes, t.category, t.dtype, t.shape, t.persistent) for tid, t in program.tensors.items()}


@pytest.mark.parametrize("doc", [
    _doc(pp=4),
    _doc(global_batch=16, topology="dgx-a100", tp=2, pp=2, dp=2),
    _doc(global_batch=16, topology="dgx-a100", tp=2, pp=2, dp=2, zero_stage=1),
    _doc(layers=8, pp=2, tp=2, schedule="interleaved-1f1b", virtual_stages=2),
    _doc(pp=4, schedule="zb-h1"),
], ids=["pp4", "tp2-pp2-dp2", "zero1", "interleaved", "zb-h1"])
def test_pipeline_programs_allocate_and_free_what_recorded_microbatches_do(doc, monkeypatch):
    shape, recipe, profile, plan, schedule, device = _setup(doc)
    fast, workloads = lower_multi.lower_multi(shape, recipe, profile, plan, schedule, device, 1, 2)
    assert any(mb.shift for w in workloads.values() for mb in w.microbatches)
    monkeypatch.setattr(lower_multi, "build_stage", functools.partial(build_stage, replay_all=True))
    slow, recorded = lower_multi.lower_multi(shape, recipe, profile, plan, schedule, device, 1, 2)
    assert not any(mb.shift for w in recorded.values() for mb in w.microbatches)
    assert len(fast) == len(slow) == plan.pp
    for a, b in zip(fast, slow):
        assert _normalized(a) == _normalized(b)
        assert _tensor_values(a) == _tensor_values(b)


def test_a_moved_chunk_keeps_its_copies_exact():
    # A second chunk's ids move by an offset (_shift): shared op tuples move once and a copy's `low` with them,
    # so that ids below it (parameters, read as inputs) stay put and resolve as the recorded chunk's.
    shape, recipe, profile, plan, schedule, _ = _setup(_doc(pp=4))
    spec = lower_multi.stage_specs(plan)[(1, 0)]
    stage_input = ((1, 32, 64), "bf16")
    fast = build_stage(shape, recipe, profile, spec, 8, 1, stage_input)
    slow = build_stage(shape, recipe, profile, spec, 8, 1, stage_input, replay_all=True)
    offset = max(fast.tensors) + 1
    moved, moved_slow = lower_multi._shift(fast, offset), lower_multi._shift(slow, offset)
    copies = [mb for mb in moved.microbatches if mb.shift]
    assert copies and all(mb.low == fast.microbatches[mb.index].low + offset for mb in copies)
    assert all(mb.forward is moved.microbatches[mb.copy_of].forward for mb in copies)
    assert any(v < mb.low for mb in copies for op in mb.forward for v in op.inputs)    # shared inputs exist
    assert [mb.resolved() for mb in moved.microbatches] == list(moved_slow.microbatches)


@pytest.mark.parametrize("doc", [_doc(global_batch=16, pp=4), _doc(global_batch=16, topology="dgx-a100", tp=2, pp=2, dp=2)],
                         ids=["pp4", "tp2-pp2-dp2"])
def test_periods_name_exactly_the_copied_ids(doc):
    # engine/repeats.py relabels ids in [low, high) by the distance between boundaries: every id a copy moves
    # must lie there, and no shared tensor (parameters, states, buffers) may.
    shape, recipe, profile, plan, schedule, device = _setup(doc)
    programs, _ = lower_multi.lower_multi(shape, recipe, profile, plan, schedule, device, 0, 1)
    for program in programs:
        compute = program.streams["compute"]
        periods = [ins for ins in compute if isinstance(ins, Period)]
        assert periods, "a stage with copies marks their forwards"
        low, high = periods[0].low, periods[0].high
        assert {(p.low, p.high) for p in periods} == {(low, high)}
        assert [p.shift for p in periods] == sorted(p.shift for p in periods)
        moved = {v for ins in compute if isinstance(ins, Run) and ins.shift
                 for v in ins.allocs() + ins.frees() if v >= ins.low}
        assert moved and all(low <= v < high for v in moved)
        shared = {t for t, tensor in program.tensors.items() if tensor.persistent}
        assert shared and not any(low <= t < high for t in shared)
