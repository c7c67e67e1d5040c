"""Megatron tensor and sequence parallelism in the op-level workload: Korthikanti's closed forms,
sharded parameter bytes, collective sizes, and tp = 1 leaving the program unchanged."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analytic import korthikanti_activation_bytes, saved_activation_bytes_by_layer
from simulator.api import kernel_profile, model_shape, recipe_for
from simulator.engine.allocator import make_allocator
from simulator.engine.executor import EngineOptions, simulate_programs
from simulator.errors import PlanError
from simulator.parallel.lower import lower_single_rank
from simulator.scenario import scenario_from_dict
from simulator.topology import resolve_cluster
from simulator.workload.graph import (
    COLLECTIVE, COLLECTIVES, COMMUNICATION_BUFFERS, FORWARD, PARAMETERS,
)
from simulator.workload.training import build_iteration
from workload_digests import SINGLE_DEVICE_DIGESTS, workload_digest

LAYERS = 3
MIDDLE = 1


def _document(s: int, b: int, h: int, a: int, *, architecture: str = "gpt", attention: str = "eager",
              recompute: str = "none", dropout: float = 0.1, vocab: int = 1000, kv_heads: int | None = None,
              layers: int = LAYERS, precision: str = "bf16", global_batch: int | None = None) -> dict:
    model = {"architecture": architecture, "num_layers": layers, "hidden_size": h, "num_attention_heads": a,
             "vocab_size": vocab, "seq_length": s, "attention": attention, "dropout": dropout}
    if kv_heads is not None:
        model["num_kv_heads"] = kv_heads
    training = {"micro_batch_size": b, "precision": precision, "recompute": recompute}
    if global_batch is not None:
        training["global_batch_size"] = global_batch
    # A GPU profile: dropout masks are 1-byte bools (as in tests/test_closed_forms.py).
    return {"name": "tp", "model": model, "training": training, "cluster": {"topology": "h100-sxm"},
            "run": {"warmup_iterations": 0}}


def _build(doc: dict, tp: int = 1, sequence_parallel: bool = False):
    scenario = scenario_from_dict(doc)
    device = resolve_cluster(scenario).device
    recipe = dataclasses.replace(recipe_for(scenario, device), tp=tp, sequence_parallel=sequence_parallel)
    return scenario, recipe, device, build_iteration(model_shape(scenario), recipe, kernel_profile(device))


def _layer_bytes(doc: dict, tp: int, sp: bool) -> int:
    _, _, _, workload = _build(doc, tp, sp)
    by_layer = saved_activation_bytes_by_layer(workload.first_microbatch, workload.tensors)
    assert len({by_layer[i] for i in range(LAYERS)}) == 1, by_layer
    return by_layer[MIDDLE]


# ------------------------------------------------------------------------------- Korthikanti Table 2
@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("t", [2, 4, 8])
@pytest.mark.parametrize("s,b,h,a", [(2048, 1, 4096, 32), (1024, 2, 2048, 16)])
def test_gpt_block_is_korthikanti_table_2_plus_the_exact_remainder(s, b, h, a, t, sp, recompute):
    """TP: sbh(10 + 24/t + 5as/(ht)); TP+SP: sbh(34 + 5as/h)/t; TP+selective: sbh(10 + 24/t);
    TP+SP+selective: 34sbh/t. What the paper leaves out is exact: the fp32 LayerNorm statistics
    (16bs, sharded with SP) and, without recompute, the bool `~mask` of the causal mask (s^2,
    replicated) and the 0-d divisor (2 bytes) that tests/test_closed_forms.py names at t = 1."""
    got = _layer_bytes(_document(s, b, h, a, recompute=recompute), t, sp)
    expected = korthikanti_activation_bytes(s, b, h, a, t=t, sequence_parallel=sp, recompute=recompute)
    stats = 16 * b * s // (t if sp else 1)
    core = s * s + 2 if recompute == "none" else 0
    assert got - expected == stats + core


@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("t", [2, 4, 8])
def test_gpt_block_within_one_percent_of_korthikanti(t, sp, recompute):
    """At a training shape (s 2048, b 8, h 4096, a 32) the remainder is below 1% for every t."""
    s, b, h, a = 2048, 8, 4096, 32
    got = _layer_bytes(_document(s, b, h, a, recompute=recompute), t, sp)
    expected = korthikanti_activation_bytes(s, b, h, a, t=t, sequence_parallel=sp, recompute=recompute)
    assert got == pytest.approx(expected, rel=0.01)


def test_sequence_parallel_saves_the_replicated_ten_sbh_over_tp_only():
    s, b, h, a, t = 1024, 2, 2048, 16, 4
    doc = _document(s, b, h, a)
    tp_only = _layer_bytes(doc, t, False)
    with_sp = _layer_bytes(doc, t, True)
    # The 10sbh that TP replicates (LN inputs, QKV/fc1 inputs, dropout masks) and the LN statistics.
    assert tp_only - with_sp == 10 * s * b * h * (t - 1) // t + 16 * b * s * (t - 1) // t


# ------------------------------------------------------------------------------- parameters
def _param_bytes(workload) -> int:
    return sum(workload.tensors[tid].nbytes for tid in workload.persistent
               if workload.tensors[tid].category == PARAMETERS)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_gpt_parameter_bytes_per_rank_are_the_sharded_parameters(t):
    s, b, h, a, vocab = 128, 1, 256, 8, 1001        # 1001 rows: the vocabulary is padded to ceil(V/t)
    _, _, _, workload = _build(_document(s, b, h, a, vocab=vocab), t)
    rows = -(-vocab // t)
    layer = (2 * 2 * h                                  # two LayerNorms (weight, bias), replicated
             + 3 * h * h // t + 3 * h // t              # column-parallel c_attn
             + h * h // t + h                           # row-parallel c_proj, replicated bias
             + 4 * h * h // t + 4 * h // t              # column-parallel c_fc
             + 4 * h * h // t + h)                      # row-parallel mlp c_proj
    params = rows * h + s * h + LAYERS * layer + 2 * h  # tied vocab-parallel embedding, positions, ln_f
    assert workload.parameter_count == params
    assert _param_bytes(workload) == 2 * params


@pytest.mark.parametrize("t", [2, 4])
def test_llama_parameter_bytes_per_rank_with_gqa_and_untied_head(t):
    s, b, h, a, kv, vocab = 128, 1, 256, 8, 4, 1000
    scenario, _, _, workload = _build(_document(s, b, h, a, architecture="llama", dropout=0.0, kv_heads=kv,
                                                attention="flash", vocab=vocab), t)
    f = scenario.model.ffn_hidden_size
    kvd = kv * (h // a)
    layer = 2 * h + (h * h + 2 * kvd * h + h * h) // t + 3 * h * f // t
    params = 2 * (vocab // t) * h + LAYERS * layer + h
    assert workload.parameter_count == params
    assert _param_bytes(workload) == 2 * params


# ------------------------------------------------------------------------------- collectives
def _collectives(ops, phase=None):
    return [op for op in ops if op.op_class == COLLECTIVE and (phase is None or op.phase == phase)]


def test_tensor_parallel_collectives_move_the_megatron_bytes():
    s, b, h, a, vocab, t = 256, 2, 512, 8, 1000, 4
    _, _, _, workload = _build(_document(s, b, h, a, vocab=vocab), t)
    ops = workload.first_microbatch
    collectives = _collectives(ops)
    assert collectives and all(op.collective in COLLECTIVES and op.group == "tp" for op in collectives)
    sbh_bytes = s * b * h * 2
    by_name = {op.name: op for op in collectives}
    for i in range(LAYERS):
        # g: all_reduce of the row-parallel outputs in forward (b*s*h elements).
        for name in (f"layers.{i}.attn.o_proj.all_reduce", f"layers.{i}.mlp.c_proj.all_reduce"):
            assert (by_name[name].collective, by_name[name].comm_bytes, by_name[name].phase) == \
                ("all_reduce", sbh_bytes, FORWARD)
        # f: all_reduce of the column-parallel input gradient in backward.
        for name in (f"layers.{i}.attn.column_input.copy_to_tp.all_reduce",
                     f"layers.{i}.mlp.column_input.copy_to_tp.all_reduce"):
            assert (by_name[name].collective, by_name[name].comm_bytes) == ("all_reduce", sbh_bytes)
            assert by_name[name].phase != FORWARD
    # Embedding output all_reduce; LM head input-gradient all_reduce; cross-entropy: max, predicted
    # logit and sum of exp, one fp32 scalar per token each.
    assert by_name["wte.all_reduce"].comm_bytes == sbh_bytes
    assert by_name["lm_head.column_input.copy_to_tp.all_reduce"].comm_bytes == sbh_bytes
    for part in ("max", "predicted", "sum_exp"):
        assert by_name[f"loss.{part}_all_reduce"].comm_bytes == 4 * b * s
    assert len(collectives) == 4 * LAYERS + 2 + 3
    # Collectives allocate nothing without sequence parallelism (all in place).
    assert all(not op.allocs for op in collectives)


def test_sequence_parallel_collectives_and_buffer():
    s, b, h, a, t = 256, 2, 512, 8, 4
    _, _, _, workload = _build(_document(s, b, h, a), t, sequence_parallel=True)
    collectives = _collectives(workload.first_microbatch)
    sbh_bytes = s * b * h * 2
    counts: dict[tuple[str, str], int] = {}
    for op in collectives:
        if op.layer == MIDDLE:
            key = (op.collective, "fwd" if op.phase == FORWARD else "bwd")
            counts[key] = counts.get(key, 0) + 1
            assert op.comm_bytes == sbh_bytes, op.name
    # Forward: all_gather before QKV and fc1, reduce_scatter after both row-parallel linears.
    # Backward: reduce_scatter of both gathered inputs' gradients; all_gather of both row-parallel
    # output gradients and the re-gather of the saved shard in QKV's and fc1's backward.
    assert counts == {("all_gather", "fwd"): 2, ("reduce_scatter", "fwd"): 2,
                      ("reduce_scatter", "bwd"): 2, ("all_gather", "bwd"): 4}
    buffers = [workload.tensors[tid] for tid in workload.persistent
               if workload.tensors[tid].category == COMMUNICATION_BUFFERS]
    assert [(buf.nbytes, buf.persistent) for buf in buffers] == [(sbh_bytes, True)]


def test_row_parallel_reduce_scatter_output_is_a_sequence_shard():
    s, b, h, a, t = 256, 2, 512, 8, 2
    _, _, _, workload = _build(_document(s, b, h, a), t, sequence_parallel=True)
    op = next(op for op in workload.first_microbatch if op.name == "layers.0.attn.o_proj.reduce_scatter")
    (out,) = op.allocs
    assert workload.tensors[out].shape == (b, s // t, h)


# ------------------------------------------------------------------------------- tp = 1 is unchanged


def _small(architecture: str) -> dict:
    if architecture == "gpt":
        return _document(64, 2, 128, 4, recompute="selective", layers=2, global_batch=4)
    return _document(64, 2, 128, 4, architecture="llama", dropout=0.0, kv_heads=2, precision="bf16-mixed",
                     layers=2, global_batch=4)


@pytest.mark.parametrize("architecture", ["gpt", "llama"])
def test_tp_one_builds_the_same_program_as_before(architecture):
    _, _, _, default = _build(_small(architecture))
    _, _, _, explicit = _build(_small(architecture), tp=1, sequence_parallel=True)   # SP is off at tp = 1
    assert workload_digest(default) == workload_digest(explicit) == SINGLE_DEVICE_DIGESTS[architecture]
    assert not _collectives(default.first_microbatch + default.later_microbatch)


# ------------------------------------------------------------------------------- the engine runs it
@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_workload_runs_in_the_engine(sp):
    doc = _document(64, 2, 128, 4, architecture="llama", dropout=0.0, kv_heads=2, precision="bf16-mixed",
                    layers=2, global_batch=4)
    _, recipe, device, workload = _build(doc, 2, sp)
    assert workload.later_microbatch and all(op.collective for op in _collectives(workload.later_microbatch))
    program = lower_single_rank(workload, device, 0, 1, recipe.accumulation_steps)
    runs = [ins for ins in program.streams["compute"] if hasattr(ins, "duration_s")]
    assert any(run.op.op_class == COLLECTIVE for run in runs)
    assert all(run.duration_s == 0.0 for run in runs if run.op.op_class == COLLECTIVE)
    capacity = 1 << 40
    trace = simulate_programs([program], [make_allocator("exact", capacity)], [capacity], EngineOptions())
    assert trace is not None


def test_tp_must_divide_heads_and_kv_heads():
    doc = _document(64, 1, 128, 4, architecture="llama", dropout=0.0, kv_heads=2)
    with pytest.raises(PlanError, match="num_kv_heads = 2"):
        _build(doc, 4)
    with pytest.raises(PlanError, match="num_attention_heads = 4"):
        _build(_document(64, 1, 96, 4), 3)


@settings(max_examples=20, deadline=None)
@given(architecture=st.sampled_from(["gpt", "llama", "bert"]), t=st.sampled_from([1, 2, 4]), sp=st.booleans(),
       recompute=st.sampled_from(["none", "selective", "full"]), attention=st.sampled_from(["eager", "flash"]),
       precision=st.sampled_from(["bf16", "bf16-mixed", "fp32"]))
def test_every_tensor_is_allocated_once_and_freed_once(architecture, t, sp, recompute, attention, precision):
    """Memory invariant of any plan: within a micro-batch each tensor is allocated once, freed once
    after its allocation, and only parameter gradients outlive it; every collective is annotated."""
    doc = _document(32, 2, 64, 4, architecture=architecture, attention=attention, recompute=recompute,
                    dropout=0.0 if architecture == "llama" else 0.1, vocab=101, layers=2, precision=precision,
                    global_batch=4)
    _, _, _, workload = _build(doc, t, sp)
    for ops in (workload.first_microbatch, workload.later_microbatch):
        live: set[int] = set()
        for op in ops:
            for tid in op.allocs:
                assert tid not in live, op.name
                live.add(tid)
            for tid in op.frees:
                assert tid in live, op.name
                live.discard(tid)
            if op.op_class == COLLECTIVE:
                assert op.collective in COLLECTIVES and op.group == "tp" and op.comm_bytes > 0, op.name
        assert live <= set(workload.gradients)
        assert bool(_collectives(ops)) == (t > 1)
