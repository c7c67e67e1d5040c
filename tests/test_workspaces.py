"""Every lazily allocated cuBLAS workspace is allocated exactly once per rank, whatever the stage's ops are called."""

from __future__ import annotations

import pytest

from simulator.api import kernel_profile, model_shape, multi_recipe, recipe_for
from simulator.parallel.lower import COMPUTE, lower_single_rank
from simulator.parallel.lower_multi import lower_multi
from simulator.parallel.plan import make_plan
from simulator.parallel.program import Alloc
from simulator.parallel.schedule_check import load_schedule
from simulator.scenario import scenario_from_dict
from simulator.topology import resolve_cluster
from simulator.workload.training import build_iteration


def _scenario(pp: int, recompute: str):
    return scenario_from_dict({
        "name": "workspaces",
        "model": {"architecture": "gpt", "num_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
                  "vocab_size": 512, "seq_length": 64},
        "training": {"micro_batch_size": 1, "global_batch_size": 16, "recompute": recompute,
                     "framework": "megatron"},
        "parallel": {"pp": pp, "dp": 8 // pp},
        "cluster": {"topology": "dgx-a100"},
    })


def _first_use_allocs(program) -> list[int]:
    return [t for ins in program.streams[COMPUTE] if isinstance(ins, Alloc) and ins.reason.endswith("(first use)")
            for t in ins.tensors]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_each_stage_allocates_every_workspace_once(recompute):
    """A one-layer stage with full recompute has its first forward GEMM and the first GEMM of its backward (the
    recomputed one) under one name: both workspace groups are still allocated (one used to be dropped)."""
    scenario = _scenario(2, recompute)
    cluster = resolve_cluster(scenario)
    plan = make_plan(scenario, cluster.topology)
    recipe = multi_recipe(scenario, cluster.device)
    schedule = load_schedule("1f1b", 2, recipe.accumulation_steps)
    programs, workloads = lower_multi(model_shape(scenario), recipe, kernel_profile(cluster.device), plan, schedule,
                                      cluster.device, 1, 1)
    for program in programs:
        workload = workloads[(program.stage, 0)]
        expected = sorted(t for _, ids in workload.first_use for t in ids)
        assert len(expected) == 3          # the forward handle's cuBLAS and cuBLASLt, the autograd thread's
        assert sorted(_first_use_allocs(program)) == expected


def test_whole_model_allocates_every_workspace_once():
    scenario = _scenario(1, "full")
    device = resolve_cluster(scenario).device
    workload = build_iteration(model_shape(scenario), recipe_for(scenario, device), kernel_profile(device))
    program = lower_single_rank(workload, device, 1, 1, 2)
    assert sorted(_first_use_allocs(program)) == sorted(t for _, ids in workload.first_use for t in ids)
