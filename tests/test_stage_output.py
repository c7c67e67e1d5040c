"""What a pipeline stage keeps for its sends and its backward: torch and DeepSpeed keep the stage output until the
backward, Megatron-LM frees it once sent; every runtime frees the stage input's gradient once sent."""

from __future__ import annotations

import pytest

from simulator import api
from simulator.parallel import lower_multi
from simulator.parallel.program import SEND_STREAM, Free, Run, Send
from simulator.scenario.loader import scenario_from_dict
from tests.test_stage_copies import _doc, _setup


def _lowered(framework: str, schedule: str = "1f1b"):
    doc = _doc(pp=4, schedule=schedule)
    doc["training"]["framework"] = framework
    shape, recipe, profile, plan, schedule_, device = _setup(doc)
    return lower_multi.lower_multi(shape, recipe, profile, plan, schedule_, device, 0, 1)


def _freed_after_sends(program, kind: str) -> list[int]:
    """The tensor each Send of `kind` frees right after it, in order (None where it frees nothing)."""
    stream = program.streams.get(f"{SEND_STREAM}.{kind}", ())
    freed = []
    for k, ins in enumerate(stream):
        if isinstance(ins, Send):
            after = stream[k + 1] if k + 1 < len(stream) else None
            freed.append(after.tensors[0] if isinstance(after, Free) else None)
    return freed


def _compute_frees(program) -> set[int]:
    ids: set[int] = set()
    for ins in program.streams["compute"]:
        ids |= set(ins.frees()) if isinstance(ins, Run) else set(ins.tensors) if isinstance(ins, Free) else set()
    return ids


def test_megatron_frees_the_output_once_sent():
    programs, workloads = _lowered("megatron")
    for program in programs[:-1]:                        # the last stage has no output to send
        workload = workloads[(program.stage, 0)]
        assert all(mb.output is None for mb in workload.microbatches)
        outputs = [mb.sent_output for mb in workload.microbatches]
        assert None not in outputs and len(set(outputs)) == len(outputs)
        # each activation send frees its micro-batch's output (1F1B sends in micro-batch order), nothing else does
        assert _freed_after_sends(program, "activation") == outputs
        assert not _compute_frees(program) & set(outputs)


@pytest.mark.parametrize("framework, schedule", [("torch", "1f1b"), ("deepspeed", "1f1b"), ("torch", "zb-h1")])
def test_the_output_is_freed_with_its_micro_batch_after_the_backward(framework, schedule):
    programs, workloads = _lowered(framework, schedule)
    for program in programs[:-1]:
        workload = workloads[(program.stage, 0)]
        assert all(mb.sent_output is None for mb in workload.microbatches)
        outputs = {mb.output: mb.index for mb in workload.microbatches}
        assert None not in outputs and len(outputs) == len(workload.microbatches)
        assert set(_freed_after_sends(program, "activation")) == {None}
        freed: dict[int, str] = {}
        for ins in program.streams["compute"]:
            if isinstance(ins, Run):
                assert not set(ins.frees()) & set(outputs), "the forward no longer frees the output"
            elif isinstance(ins, Free):
                for tid in set(ins.tensors) & set(outputs):
                    assert tid not in freed
                    freed[tid] = ins.reason
        assert freed == {tid: f"micro-batch {j} done" for tid, j in outputs.items()}


@pytest.mark.parametrize("framework, schedule", [("megatron", "1f1b"), ("torch", "zb-h1"), ("deepspeed", "gpipe")])
def test_the_input_gradient_is_freed_once_sent(framework, schedule):
    programs, workloads = _lowered(framework, schedule)
    assert all(mb.input_grad is None for mb in workloads[(0, 0)].microbatches)      # the first stage gets no input
    for program in programs[1:]:
        workload = workloads[(program.stage, 0)]
        grads = {mb.index: mb.input_grad for mb in workload.microbatches}
        assert all(workload.tensors[t].name == "grad(stage_input)" for t in grads.values())
        assert workload.tensors[grads[0]].nbytes == workload.microbatches[0].input_grad_bytes
        assert sorted(_freed_after_sends(program, "gradient")) == sorted(grads.values())
        assert not _compute_frees(program) & set(grads.values())


@pytest.mark.parametrize("framework", ["megatron", "torch"])
def test_a_sent_tensor_is_released_when_its_send_ends(framework):
    """In a whole run, each tensor a send frees leaves the allocator exactly when the transfer ends."""
    doc = _doc(pp=4, schedule="1f1b")
    doc["training"]["framework"] = framework
    doc["run"]["record_events"] = True
    trace = api.simulate_multi(scenario_from_dict(doc)).trace
    for rank in trace.ranks:
        for kind in ("activation", "gradient"):
            sends = sorted(s.end_s for s in rank.spans if s.kind == "send" and s.name.startswith(kind))
            frees = sorted(e.time_s for e in rank.allocator_events
                           if e.action == "free_completed" and e.op == f"{kind} sent")
            if kind == "activation" and framework == "torch":
                assert frees == []                         # kept until the backward instead
            else:
                assert frees == sends
            # every stage sends both ways but the first (no input gradient) and the last (no output)
            assert (len(sends) > 0) == (rank.rank != (0 if kind == "gradient" else 3))
