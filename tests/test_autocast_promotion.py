"""PyTorch type promotion (mul/add) and LLaMA under bf16-mixed autocast, against the measured CPU sequence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from simulator.api import build_workload
from simulator.scenario import scenario_from_dict
from simulator.topology import resolve_cluster
from simulator.workload.graph import DTYPE_BYTES, FORWARD
from simulator.workload.primitives import KernelProfile, Ops, promote_types
from simulator.workload.tape import Tape
from validation.memory_comparison import scenario_document

DATA = Path(__file__).resolve().parent.parent / "validation" / "data" / "cpu" / "memory"
FLOATS = ("fp32", "bf16", "fp16")


@given(st.sampled_from(FLOATS), st.sampled_from(FLOATS))
def test_promotion_is_symmetric_and_widens(a, b):
    out = promote_types(a, b)
    assert out == promote_types(b, a)
    assert out == (a if a == b else "fp32")
    assert promote_types(a, "bool") == a and promote_types("int64", a) == a


def _mul_backward(a_dtype: str, b_dtype: str, b_shape=(2, 4, 8, 16)):
    tape = Tape()
    ops = Ops(tape, KernelProfile(device_kind="cpu"))
    a = tape.storage("a", (2, 4, 8, 16), a_dtype, requires_grad=True)
    b = tape.storage("b", b_shape, b_dtype, requires_grad=False)
    out = ops.mul(a, b, "mul")
    loss = ops.reduce_mean(out, (), "loss")
    policy = type("Policy", (), {"has_grad": lambda self, p: False, "became_grad": lambda self, p, g: None})()
    ops_list, tensors = tape.finish(loss, policy)
    (bwd,) = [op for op in ops_list if op.name == "mul.bwd"]
    return out, [(tensors[t].nbytes, tensors[t].dtype) for t in bwd.allocs], [tensors[t].nbytes for t in bwd.frees]


def test_bf16_times_fp32_is_fp32_and_its_gradient_is_cast_back():
    n = 2 * 4 * 8 * 16
    out, allocs, frees = _mul_backward("bf16", "fp32", (8, 16))
    assert out.dtype == "fp32"
    # The gradient in the promoted dtype (a transient), then autograd's cast to the input's dtype.
    assert sorted(allocs) == sorted([(2 * n, "bf16"), (4 * n, "fp32")])
    assert 4 * n in frees


@pytest.mark.parametrize("dtype", FLOATS)
def test_same_dtype_mul_allocates_only_the_gradient(dtype):
    n = 2 * 4 * 8 * 16
    out, allocs, _ = _mul_backward(dtype, dtype)
    assert out.dtype == dtype
    assert allocs == [(DTYPE_BYTES[dtype] * n, dtype)]


def _forward_attention(ops_list, tensors, layer: int) -> list[tuple[int, str]]:
    """(delta bytes, dtype) of every forward alloc/free of layer `layer`'s attention, in order."""
    out = []
    for op in ops_list:
        if op.phase != FORWARD or not op.name.startswith(f"layers.{layer}.attn.rope_q.mul_cos") and not out:
            continue
        if op.name.startswith(f"layers.{layer}.attn.o_proj"):
            break
        out += [(tensors[t].nbytes, tensors[t].dtype) for t in op.allocs]
        out += [(-tensors[t].nbytes, tensors[t].dtype) for t in op.frees]
    return out


def test_llama_bf16_mixed_eager_attention_forward_matches_the_measured_sequence():
    """llama-tiny-bf16-mixed-eager-gqa (b=2, s=64, h=128, 4 heads, 2 kv heads): from RoPE to o_proj, the
    allocations and frees memsim predicts are the measured ones (torch 2.13 CPU storage tracker)."""
    name = "llama-tiny-bf16-mixed-eager-gqa-none-adamw"
    data = json.loads((DATA / f"{name}.json").read_text())
    events = data["events"]
    ops, modules, phases = events["ops"], events["modules"], events["phases"]
    measured = []
    started = False
    for row in events["rows"]:
        if phases[row[3]] != "forward":
            continue
        module, op = modules[row[6]], ops[row[4]]
        started = started or (module == "layers.0.self_attn" and op == "aten.mul")
        if module == "layers.0.self_attn.o_proj":
            break
        if started:
            measured.append(row[1])
    scenario = scenario_from_dict(scenario_document(name, data["config"]), source=name)
    workload = build_workload(scenario, resolve_cluster(scenario).device)
    predicted = _forward_attention(workload.first_microbatch, workload.tensors, 0)
    assert sorted(measured) == sorted(delta for delta, _ in predicted)
    q_fp32 = 2 * 64 * 128 * 4
    # RoPE's products and sum are fp32 (bf16 q times fp32 tables); repeat_kv copies fp32 k.
    assert predicted[:2] == [(q_fp32, "fp32"), (q_fp32 // 4, "bf16")]   # x * cos, then -x[..., h/2:] (bf16)
    # softmax(dtype=float32) copies the bf16 scores to fp32 first, then frees the copy after _softmax.
    scores = 2 * 4 * 64 * 64
    i = predicted.index((4 * scores, "fp32"))
    assert predicted[i:i + 3] == [(4 * scores, "fp32"), (4 * scores, "fp32"), (-4 * scores, "fp32")]


def test_llama_bf16_mixed_flash_casts_q_and_k_for_sdpa():
    """Under bf16-mixed SDPA sees fp32 q, k (RoPE) and bf16 v: autocast casts q and k, which SDPA saves."""
    name = "llama-small-bf16-mixed-flash-gqa-none-adamw"
    data = json.loads((DATA / f"{name}.json").read_text())
    scenario = scenario_from_dict(scenario_document(name, data["config"]), source=name)
    workload = build_workload(scenario, resolve_cluster(scenario).device)
    names = [op.name for op in workload.first_microbatch if op.phase == FORWARD]
    i = names.index("layers.0.attn.sdpa")
    assert names[i - 2:i] == ["layers.0.attn.q.autocast", "layers.0.attn.k.autocast"]
    assert "layers.0.attn.v.autocast" not in names
