"""Data parallelism and ZeRO in the op-level workload: model-state bytes per rank against the ZeRO
paper's formulas, communication volume, DDP buckets, no_sync, ZeRO-3 gathers, and dp = 1 unchanged."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.api import kernel_profile, model_shape, recipe_for
from simulator.engine.allocator import make_allocator
from simulator.engine.executor import EngineOptions, simulate_programs
from simulator.errors import PlanError
from simulator.parallel.lower import lower_single_rank
from simulator.scenario import scenario_from_dict
from simulator.topology import resolve_cluster
from simulator.workload.data_parallel import DDP_FIRST_BUCKET_BYTES, gradient_buckets, shard_numel
from simulator.workload.graph import (
    COLLECTIVE, COMMUNICATION_BUFFERS, DTYPE_BYTES, GRADIENTS, OPTIMIZER_STATES, PARAMETERS,
)
from simulator.workload.training import build_iteration
from workload_digests import SINGLE_DEVICE_DIGESTS, workload_digest

MODEL_STATES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATES)
K_ADAM = 12     # fp32 master + two fp32 Adam moments (ZeRO paper)


def _document(framework: str = "deepspeed", *, h: int = 128, vocab: int = 1000, tied: bool = False,
              global_batch: int = 2, precision: str = "bf16-mixed", layers: int = 2,
              architecture: str = "gpt") -> dict:
    model = {"architecture": architecture, "num_layers": layers, "hidden_size": h, "num_attention_heads": 4,
             "vocab_size": vocab, "seq_length": 64, "tied_embeddings": tied}
    if architecture == "llama":
        model.update(num_kv_heads=2, dropout=0.0)
    training = {"micro_batch_size": 2, "global_batch_size": global_batch, "precision": precision,
                "framework": framework}
    return {"name": "dp", "model": model, "training": training, "cluster": {"topology": "h100-sxm"},
            "run": {"warmup_iterations": 0}}


def _build(doc: dict, dp: int = 1, stage: int = 0, bucket: int = 200_000, accumulation: int | None = None):
    scenario = scenario_from_dict(doc)
    device = resolve_cluster(scenario).device
    recipe = recipe_for(scenario, device)
    recipe = dataclasses.replace(recipe, dp=dp, zero_stage=stage, bucket_size_bytes=bucket,
                                 accumulation_steps=accumulation or recipe.accumulation_steps)
    return recipe, device, build_iteration(model_shape(scenario), recipe, kernel_profile(device))


def _model_state_bytes(workload) -> dict[str, int]:
    """Bytes per category held when the optimizer steps: persistent tensors, optimizer states and
    the gradients zero_grad frees."""
    out = dict.fromkeys(MODEL_STATES + (COMMUNICATION_BUFFERS,), 0)
    for tid in workload.persistent + workload.optimizer_state_ids + workload.gradients:
        tensor = workload.tensors[tid]
        if tensor.category in out:
            out[tensor.category] += tensor.nbytes
    return out


def _dp_collectives(ops):
    return [op for op in ops if op.op_class == COLLECTIVE and op.group == "dp"]


def _paper_elements(ops) -> int:
    """Elements moved as the ZeRO paper counts: all_reduce 2n, reduce_scatter and all_gather n."""
    return sum((2 if op.collective == "all_reduce" else 1) * op.comm_bytes // DTYPE_BYTES[op.dtype]
               for op in _dp_collectives(ops))


# ------------------------------------------------------------------------------- ZeRO formulas
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4, 8])
def test_deepspeed_model_states_match_the_zero_paper(dp, stage):
    """DP (2+2+K)Ψ; ZeRO-1 2Ψ+2Ψ+KΨ/N; ZeRO-2 2Ψ+(2+K)Ψ/N; ZeRO-3 (2+2+K)Ψ/N, bytes exact
    (every tensor here has a multiple of 8 elements, so no shard is padded)."""
    _, _, workload = _build(_document(), dp, stage)
    psi = workload.parameter_count
    got = _model_state_bytes(workload)
    expected_params = 2 * psi // (dp if stage == 3 else 1)
    expected_grads = 2 * psi // (dp if stage >= 2 else 1)
    expected_states = K_ADAM * psi // (dp if stage >= 1 else 1)
    assert (got[PARAMETERS], got[GRADIENTS], got[OPTIMIZER_STATES]) == \
        (expected_params, expected_grads, expected_states)
    total = got[PARAMETERS] + got[GRADIENTS] + got[OPTIMIZER_STATES]
    formula = {0: (2 + 2 + K_ADAM) * psi, 1: 4 * psi + K_ADAM * psi // dp,
               2: 2 * psi + (2 + K_ADAM) * psi // dp, 3: (2 + 2 + K_ADAM) * psi // dp}[stage]
    assert total == formula


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_megatron_distributed_optimizer_is_6_plus_12_over_dp(dp):
    _, _, workload = _build(_document("megatron"), dp, 1)
    psi = workload.parameter_count
    got = _model_state_bytes(workload)
    assert got[PARAMETERS] + got[GRADIENTS] + got[OPTIMIZER_STATES] == 6 * psi + 12 * psi // dp
    assert got[COMMUNICATION_BUFFERS] == 0          # main_grad is its own bucket


def test_torch_conventions_shard_fp32_bytes():
    """torch (autocast): fp32 parameters and gradients, Adam moments on the parameters (8 bytes)."""
    _, _, workload = _build(_document("torch"), 4, 3)
    psi = workload.parameter_count
    got = _model_state_bytes(workload)
    assert (got[PARAMETERS], got[GRADIENTS], got[OPTIMIZER_STATES]) == (psi, psi, 2 * psi)


def test_zero3_parameter_shards_are_total_over_dp_padded_per_tensor():
    """DeepSpeed pads each parameter to a multiple of dp: shard = ceil(n / dp) per tensor, so the
    bytes per rank exceed total / dp by less than one element per tensor."""
    dp = 8
    _, _, workload = _build(_document(h=132, vocab=1001), dp, 3)
    shards = [workload.tensors[tid] for tid in workload.persistent
              if workload.tensors[tid].category == PARAMETERS]
    psi = workload.parameter_count
    assert sum(t.shape[0] for t in shards) >= psi / dp
    assert sum(t.nbytes for t in shards) - 2 * psi / dp < 2 * len(shards)
    assert sum(t.shape[0] for t in shards) == workload.meta["dp_shard_numel"]


# ------------------------------------------------------------------------------- communication
@pytest.mark.parametrize("framework", ["deepspeed", "torch", "megatron"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_communication_per_step_is_2_psi_or_3_psi(framework, stage):
    """ZeRO paper: DP and ZeRO-1/2 move 2Ψ elements per step, ZeRO-3 3Ψ (untied embeddings).
    torch's ZeRO-1 (DDP all_reduce + ZeroRedundancyOptimizer's parameter gather) moves 3Ψ."""
    if framework == "megatron" and stage > 1:
        pytest.skip("megatron has no ZeRO-2/3")
    _, _, workload = _build(_document(framework), 4, stage)
    psi = workload.parameter_count
    ops = workload.first_microbatch + workload.later_microbatch + workload.optimizer
    expected = 3 * psi if stage == 3 or (framework == "torch" and stage == 1) else 2 * psi
    assert _paper_elements(ops) == expected
    assert all(op.comm_bytes > 0 and op.collective in ("all_reduce", "reduce_scatter", "all_gather")
               for op in _dp_collectives(ops))


def test_zero3_with_tied_embeddings_gathers_the_shared_weight_in_each_module():
    """A tied weight is gathered by the embedding and again by the head, in forward and backward."""
    doc = _document(tied=True)
    _, _, workload = _build(doc, 4, 3)
    psi = workload.parameter_count
    extra = 2 * 1000 * 128
    assert _paper_elements(workload.first_microbatch + workload.optimizer) == 3 * psi + extra


# ------------------------------------------------------------------------------- DDP buckets
def _position(ops, name):
    return next(i for i, op in enumerate(ops) if op.name == name)


@pytest.mark.parametrize("bucket", [50_000, 200_000, 10**9])
def test_ddp_buckets_cover_every_gradient_once_and_reduce_when_full(bucket):
    recipe, _, workload = _build(_document("torch"), 2, 0, bucket)
    ops = workload.first_microbatch
    params = [t for t in workload.tensors.values() if t.category == PARAMETERS and t.persistent]
    copies = [op for op in ops if op.name.startswith("dp.copy_grad.")]
    assert sorted(op.name[len("dp.copy_grad."):] for op in copies) == sorted(t.name for t in params)
    reduces = [op for op in _dp_collectives(ops)]
    assert all(op.collective == "all_reduce" for op in reduces)
    assert sum(op.comm_bytes for op in reduces) == 4 * workload.parameter_count
    buffers = [workload.tensors[t] for t in workload.persistent
               if workload.tensors[t].category == COMMUNICATION_BUFFERS]
    assert [b.nbytes for b in buffers] == [op.comm_bytes for op in reduces]
    assert reduces[0].comm_bytes < DDP_FIRST_BUCKET_BYTES + 4 * 1000 * 128 or bucket < DDP_FIRST_BUCKET_BYTES
    # Every bucket's all_reduce follows the copies of all its gradients, and buckets go in order.
    order = sorted(params, key=lambda t: t.id, reverse=True)
    nbytes = {t.id: t.nbytes for t in order}
    first_cap = min(DDP_FIRST_BUCKET_BYTES, bucket)
    buckets = gradient_buckets([t.id for t in order], nbytes, bucket, first_cap)
    names = {t.id: t.name for t in order}
    last = -1
    for b in buckets:
        at = _position(ops, f"dp.bucket{b.index}.all_reduce")
        assert all(_position(ops, f"dp.copy_grad.{names[p]}") < at for p in b.param_ids)
        assert at > last
        last = at
    # Reduced during backward: the first bucket's all_reduce comes before the last weight gradient.
    if len(buckets) > 1:
        assert _position(ops, "dp.bucket0.all_reduce") < max(_position(ops, op.name) for op in copies)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=40), limit=st.integers(1, 20000),
       first=st.one_of(st.none(), st.integers(1, 20000)))
def test_gradient_buckets_partition_in_order_and_close_at_the_limit(sizes, limit, first):
    ids = list(range(len(sizes)))
    buckets = gradient_buckets(ids, dict(enumerate(sizes)), limit, first)
    assert [p for b in buckets for p in b.param_ids] == ids
    for b in buckets:
        assert b.nbytes == sum(sizes[p] for p in b.param_ids)
        cap = first if (first is not None and b.index == 0) else limit
        assert b.nbytes - sizes[b.param_ids[-1]] < cap           # closes as soon as it reaches the cap
        if b is not buckets[-1]:
            assert b.nbytes >= cap


def test_no_sync_until_the_last_microbatch():
    _, _, workload = _build(_document("torch", global_batch=8), 2, 0)
    assert not _dp_collectives(workload.first_microbatch + workload.later_microbatch)
    assert len(_dp_collectives(workload.last_microbatch)) == len(workload.meta["dp_buckets"])
    _, _, single = _build(_document("torch", global_batch=2), 2, 0)
    assert _dp_collectives(single.first_microbatch) and not single.last_microbatch


def test_zero2_reduces_every_microbatch_into_one_gradient_shard():
    _, _, workload = _build(_document(global_batch=8), 4, 2)
    (shard,) = workload.gradients
    for ops in (workload.first_microbatch, workload.later_microbatch):
        assert all(op.collective == "reduce_scatter" for op in _dp_collectives(ops))
        assert sum(op.comm_bytes for op in _dp_collectives(ops)) == 2 * workload.parameter_count
    allocating = [op for op in workload.first_microbatch + workload.later_microbatch if shard in op.allocs]
    assert len(allocating) == 1 and allocating[0].microbatch == 0
    assert not workload.last_microbatch


# ------------------------------------------------------------------------------- memory invariants
def _check_lists(workload, allowed_live: set[int]):
    for ops in (workload.first_microbatch, workload.later_microbatch, workload.last_microbatch):
        live: set[int] = set()
        for op in ops:
            for tid in op.allocs:
                assert tid not in live and not workload.tensors[tid].persistent, op.name
                live.add(tid)
            for tid in op.frees:
                assert tid in live, op.name
                live.discard(tid)
        assert live <= allowed_live


@settings(max_examples=25, deadline=None)
@given(framework=st.sampled_from(["torch", "deepspeed", "megatron"]), stage=st.integers(0, 3),
       dp=st.sampled_from([2, 4]), accumulation=st.sampled_from([1, 3]),
       architecture=st.sampled_from(["gpt", "llama"]), bucket=st.sampled_from([30_000, 300_000]))
def test_every_tensor_is_allocated_once_and_freed_once(framework, stage, dp, accumulation, architecture, bucket):
    if framework == "megatron" and stage > 1:
        with pytest.raises(PlanError, match="zero_stage"):
            _build(_document(framework, architecture=architecture), dp, stage, bucket, accumulation)
        return
    _, _, workload = _build(_document(framework, architecture=architecture, global_batch=4 * accumulation),
                            dp, stage, bucket, accumulation)
    _check_lists(workload, set(workload.gradients))
    assert set(workload.persistent).isdisjoint(workload.optimizer_state_ids)


def test_zero3_holds_at_most_two_gathered_segments():
    _, _, workload = _build(_document(layers=4), 4, 3)
    live: set[int] = set()
    gathers: dict[int, int] = {}          # gathered tensor -> index of its all_gather
    most = 0
    for op in workload.first_microbatch:
        if op.collective == "all_gather":
            for tid in op.allocs:
                gathers[tid] = id(op)
        live |= {t for t in op.allocs if t in gathers}
        live -= set(op.frees)
        most = max(most, len({gathers[t] for t in live}))
    assert most == 2
    assert not live


def test_data_parallel_workload_runs_in_the_engine():
    recipe, device, workload = _build(_document(), 4, 3)
    program = lower_single_rank(workload, device, 0, 2, recipe.accumulation_steps)
    capacity = 1 << 40
    trace = simulate_programs([program], [make_allocator("exact", capacity)], [capacity], EngineOptions())
    rank = trace.ranks[0]
    assert rank.peak_allocated > 0 and rank.oom is None
    assert all(sample.allocated >= 0 and min(sample.by_category) >= 0 for sample in rank.memory)


def test_zero3_lowers_peak_parameters_below_zero2():
    peaks = {}
    for stage in (2, 3):
        recipe, device, workload = _build(_document(layers=4), 8, stage)
        program = lower_single_rank(workload, device, 0, 1, recipe.accumulation_steps)
        capacity = 1 << 40
        trace = simulate_programs([program], [make_allocator("exact", capacity)], [capacity], EngineOptions())
        peaks[stage] = trace.ranks[0].category_peaks[PARAMETERS]
    assert peaks[3] < peaks[2] / 2


# ------------------------------------------------------------------------------- dp = 1 unchanged


def _small(architecture: str) -> dict:
    model = {"architecture": architecture, "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
             "vocab_size": 1000, "seq_length": 64, "attention": "eager", "dropout": 0.1}
    training = {"micro_batch_size": 2, "precision": "bf16", "recompute": "selective", "global_batch_size": 4}
    if architecture == "llama":
        model.update(dropout=0.0, num_kv_heads=2)
        training.update(precision="bf16-mixed", recompute="none")
    return {"name": "tp", "model": model, "training": training, "cluster": {"topology": "h100-sxm"},
            "run": {"warmup_iterations": 0}}


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("architecture", ["gpt", "llama"])
def test_dp_one_builds_the_same_program_as_before(architecture, stage):
    _, _, workload = _build(_small(architecture), 1, stage, 25_000_000)
    assert workload_digest(workload) == SINGLE_DEVICE_DIGESTS[architecture]
    assert not workload.last_microbatch and "dp" not in workload.meta


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [({"dp": 0}, "parallel.dp = 0"), ({"zero_stage": 4}, "zero_stage = 4"),
                                          ({"bucket_size_bytes": 0}, "bucket_size = 0")])
def test_bad_data_parallel_options_are_plan_errors(kwargs, match):
    scenario = scenario_from_dict(_document())
    device = resolve_cluster(scenario).device
    recipe = dataclasses.replace(recipe_for(scenario, device), **kwargs)
    with pytest.raises(PlanError, match=match):
        build_iteration(model_shape(scenario), recipe, kernel_profile(device))


def test_shard_numel_pads_up():
    assert [shard_numel(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_loss_scaler_survives_zero_sharding(stage):
    """fp16-mixed keeps the loss scaler's kernels when ZeRO replaces the optimizer step: the sharded step used to
    drop the temporaries' tensors while the kept unscale op still allocated them (KeyError). DeepSpeed's scaler
    checks its gradient shard (an fp32 copy and its sum), all_reduces the overflow flag, then unscales."""
    from simulator.api import simulate

    doc = _document("deepspeed", precision="fp16-mixed")
    doc["parallel"] = {"dp": 8, "zero_stage": stage}
    doc["training"]["global_batch_size"] = 16
    doc["cluster"] = {"topology": "hgx-h200"}
    report = simulate(scenario_from_dict(doc), timelines=False).report
    scaler = [op for op in _workload_ops(doc) if op.name.startswith("grad_scaler.")]
    assert [op.name for op in scaler] == ["grad_scaler.zero.shard.float", "grad_scaler.zero.shard.sum",
                                          "grad_scaler.overflow_all_reduce", "grad_scaler.unscale_and_clip"]
    assert [len(op.allocs) for op in scaler] == [1, 1, 0, 0]
    assert report["ranks"][0]["peak_allocated_bytes"] > 0


def _workload_ops(doc: dict):
    """The optimizer ops of the dp workload of `doc` (rank 0's)."""
    scenario = scenario_from_dict(doc)
    device = resolve_cluster(scenario).device
    recipe = dataclasses.replace(recipe_for(scenario, device), dp=scenario.parallel.dp,
                                 zero_stage=scenario.parallel.zero_stage)
    return build_iteration(model_shape(scenario), recipe, kernel_profile(device)).optimizer
