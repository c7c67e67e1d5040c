"""Which runtimes keep a pipeline stage's output until its backward: torch and DeepSpeed do, Megatron-LM frees it."""

from __future__ import annotations

import pytest

from simulator.parallel import lower_multi
from simulator.parallel.program import Free, Run
from tests.test_stage_copies import _doc, _setup


def _lowered(framework: str, schedule: str = "1f1b"):
    doc = _doc(pp=4, schedule=schedule)
    doc["training"]["framework"] = framework
    shape, recipe, profile, plan, schedule_, device = _setup(doc)
    return lower_multi.lower_multi(shape, recipe, profile, plan, schedule_, device, 0, 1)


def test_megatron_frees_the_output_once_sent():
    _, workloads = _lowered("megatron")
    assert all(mb.output is None for w in workloads.values() for mb in w.microbatches)


@pytest.mark.parametrize("framework, schedule", [("torch", "1f1b"), ("deepspeed", "1f1b"), ("torch", "zb-h1")])
def test_the_output_is_freed_with_its_micro_batch_after_the_backward(framework, schedule):
    programs, workloads = _lowered(framework, schedule)
    for program in programs[:-1]:                        # the last stage has no output to send
        workload = workloads[(program.stage, 0)]
        outputs = {mb.output: mb.index for mb in workload.microbatches}
        assert None not in outputs and len(outputs) == len(workload.microbatches)
        freed: dict[int, str] = {}
        for ins in program.streams["compute"]:
            if isinstance(ins, Run):
                assert not set(ins.frees()) & set(outputs), "the forward no longer frees the output"
            elif isinstance(ins, Free):
                for tid in set(ins.tensors) & set(outputs):
                    assert tid not in freed
                    freed[tid] = ins.reason
        assert freed == {tid: f"micro-batch {j} done" for tid, j in outputs.items()}
