"""Optimizer step kernels: torch's unfused Adam(W) pass by pass, and the fused Adam that frameworks choose."""

from __future__ import annotations

import pytest

from simulator.api import recipe_for
from simulator.hardware.catalog import get_device
from simulator.scenario import scenario_from_dict
from simulator.workload.graph import OTHER
from simulator.workload.optimizers import IdSource, MasterParam, step_ops

PARAMS = [MasterParam("w", (64, 32), 2048, "fp32", "fp32"), MasterParam("b", (64,), 64, "fp32", "fp32")]
NUMEL = 2048 + 64


def _passes(ops) -> int:
    """Elements read and written per parameter element over the whole step."""
    return sum(op.bytes_read + op.bytes_written for op in ops) // (4 * NUMEL)


@pytest.mark.parametrize("implementation", ["foreach", "single-tensor"])
def test_unfused_adamw_runs_torchs_kernels_one_by_one(implementation):
    """torch's _multi_tensor_adam / _single_tensor_adam with AdamW's default weight decay: mul_ (decay), lerp_,
    mul_, addcmul_, sqrt, div, add_ (eps), addcdiv_: 20 passes over fp32 state, as the H200 profile of
    validation/data/cuda-large shows (85.5 ms of foreach kernels for 4.28e9 parameters: 80 B each at 4.0 TB/s)."""
    tensors: dict = {}
    ops = step_ops("adamw", implementation, PARAMS, IdSource(100), tensors)
    kinds = [op.name.rsplit(".", 1)[1] for op in ops]
    per_param = ["weight_decay", "lerp", "mul", "addcmul", "sqrt", "div", "add_eps", "addcdiv"]
    assert kinds == (per_param if implementation == "foreach" else per_param * 2)
    assert _passes(ops) == 20
    adam = step_ops("adam", implementation, PARAMS, IdSource(100), {})
    assert _passes(adam) == 18 and not any("weight_decay" in op.name for op in adam)   # Adam: weight_decay 0
    # the temporaries are unchanged: sqrt(v) per parameter (foreach: all at once; single-tensor: sqrt, then
    # the denominator, the previous one released when the next is made)
    assert all(tensors[t].category == OTHER for t in tensors)
    allocated = [tensors[t].nbytes for op in ops for t in op.allocs]
    assert allocated == ([2048 * 4, 64 * 4] if implementation == "foreach" else [2048 * 4] * 2 + [64 * 4] * 2)


def test_fused_adamw_is_one_pass_without_temporaries():
    tensors: dict = {}
    (op,) = step_ops("adamw", "fused", PARAMS, IdSource(100), tensors)
    assert _passes([op]) == 7 and not op.allocs and not tensors


def _scenario(framework: str, topology: str, implementation: str = "auto", optimizer: str = "adamw"):
    return scenario_from_dict({
        "name": "t", "model": {"preset": "gpt2", "num_layers": 2},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "framework": framework,
                     "optimizer": optimizer, "optimizer_implementation": implementation},
        "cluster": {"topology": topology}})


@pytest.mark.parametrize(("framework", "topology", "optimizer", "expected"), [
    ("torch", "h100", "adamw", "foreach"),            # torch's default on CUDA
    ("torch", "cpu", "adamw", "single-tensor"),       # ... and on the host
    ("megatron", "h100", "adamw", "fused"),           # Transformer Engine's / apex's FusedAdam
    ("deepspeed", "a100", "adamw", "fused"),          # DeepSpeed's FusedAdam
    ("megatron", "cpu", "adamw", "single-tensor"),    # no fused kernel on the host
    ("megatron", "h100", "sgd", "foreach"),           # only Adam is fused by the framework here
    ("torch", "h100", "adam-8bit", "fused"),          # bitsandbytes
])
def test_auto_implementation_follows_the_framework(framework, topology, optimizer, expected):
    scenario = _scenario(framework, topology, optimizer=optimizer)
    device = get_device("cpu" if topology == "cpu" else topology)
    assert recipe_for(scenario, device).optimizer_implementation == expected
    explicit = _scenario(framework, topology, "foreach", optimizer)
    assert recipe_for(explicit, device).optimizer_implementation == "foreach"    # an explicit choice wins
