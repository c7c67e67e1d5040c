"""Gradient compression (parallel.gradient_compression): bytes on the wire per kind, the memory of its state,
where its kernels run, the iteration time on a bandwidth-bound plan, and the combinations refused."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import subprocess
import sys

import pytest

from simulator import simulate
from simulator.api import kernel_profile, model_shape, multi_recipe
from simulator.errors import PlanError
from simulator.parallel.lower_multi import lower_data_tensor_parallel
from simulator.parallel.plan import make_plan
from simulator.parallel.program import COMM_STREAM, Blocking, Collective, Run
from simulator.scenario import scenario_from_dict
from simulator.topology import resolve_cluster
from simulator.workload.graph import (
    COLLECTIVE, COMMUNICATION_BUFFERS, GRADIENTS, OPTIMIZER_STATES, PARAMETERS,
)
from simulator.workload.training import build_iteration

ROOT = pathlib.Path(__file__).resolve().parents[1]
DP = 4


def _document(compression: str = "none", *, framework: str = "torch", precision: str = "bf16-mixed",
              dp: int = DP, stage: str = "compressed", zero: int = 0, topology: str = "pcie-4x4090",
              nodes: int = 1, hidden: int = 64, vocab: int = 512, bucket: int = 25_000_000) -> dict:
    return {"name": "compression",
            "model": {"architecture": "gpt", "num_layers": 2, "hidden_size": hidden, "num_attention_heads": 4,
                      "vocab_size": vocab, "seq_length": 32, "dropout": 0.0},
            "training": {"micro_batch_size": 1, "global_batch_size": dp, "precision": precision,
                         "framework": framework},
            "parallel": {"dp": dp, "zero_stage": zero, "gradient_compression": compression,
                         "gradient_compression_stage": stage, "bucket_size": bucket},
            "cluster": {"topology": topology, "nodes": nodes}, "run": {"warmup_iterations": 1}}


def _workload(doc: dict):
    scenario = scenario_from_dict(doc)
    device = resolve_cluster(scenario).device
    recipe = multi_recipe(scenario, device)
    return build_iteration(model_shape(scenario), recipe, kernel_profile(device))


def _dp_collectives(workload) -> list:
    ops = workload.first_microbatch + workload.later_microbatch + workload.last_microbatch + workload.optimizer
    return [op for op in ops if op.op_class == COLLECTIVE and op.group == "dp"]


def _params(workload) -> list:
    return [workload.tensors[t] for t in workload.persistent if workload.tensors[t].category == PARAMETERS
            and workload.tensors[t].name not in ("cublas_workspace",)]


def _persistent_bytes(workload, category: str) -> int:
    return sum(workload.tensors[t].nbytes for t in workload.persistent + workload.optimizer_state_ids
               if workload.tensors[t].category == category)


# ------------------------------------------------------------------------------- bytes on the wire
def test_none_all_reduces_every_gradient_once():
    workload = _workload(_document())
    collectives = _dp_collectives(workload)
    assert {op.collective for op in collectives} == {"all_reduce"}
    assert sum(op.comm_bytes for op in collectives) == 4 * workload.parameter_count


def test_int8_sends_bagua_minmax_uint8_buffers_by_all_to_all_and_all_gather():
    """Per bucket of n fp32 elements: chunk c = ceil(n / N); a compressed buffer holds N chunks of c bytes padded to
    32, each with a 32-byte min/max header; all_to_all'd, then all_gathered (Bagua, datatypes/mod.rs)."""
    workload = _workload(_document("int8"))
    buckets = workload.meta["dp_buckets"]
    collectives = _dp_collectives(workload)
    assert [op.collective for op in collectives] == ["all_to_all", "all_gather"] * len(buckets)
    for k, nbytes in enumerate(buckets):
        chunk = math.ceil(nbytes // 4 / DP)
        wire = DP * (math.ceil(chunk / 32) * 32 + 32)
        assert [op.comm_bytes for op in collectives[2 * k:2 * k + 2]] == [wire, wire]
    assert sum(op.comm_bytes for op in collectives) < 4 * workload.parameter_count / 1.9


@pytest.mark.parametrize("fraction", [0.01, 0.25])
def test_topk_all_gathers_values_and_int64_indices_of_every_gradient(fraction):
    workload = _workload(_document(f"topk:{fraction}"))
    collectives = _dp_collectives(workload)
    params = _params(workload)
    assert len(collectives) == 2 * len(params)
    assert {op.collective for op in collectives} == {"all_gather"}
    expected = sorted(DP * max(1, int(p.nbytes // 4 * fraction)) * size for p in params for size in (4, 8))
    assert sorted(op.comm_bytes for op in collectives) == expected


@pytest.mark.parametrize("rank", [1, 4])
def test_powersgd_all_reduces_p_q_and_what_is_not_worth_compressing(rank):
    """torch's _should_compress: an (n, m) gradient at r = min(n, m, R) is compressed when (n + m) r 2 < n m; P
    holds n r, Q m r elements; the rest is all_reduced as it is, in the same three all_reduces per bucket."""
    workload = _workload(_document(f"powersgd:{rank}"))
    collectives = _dp_collectives(workload)
    assert {op.collective for op in collectives} == {"all_reduce"}
    plain = p_total = q_total = 0
    for p in _params(workload):
        n = p.shape[0]
        m = p.nbytes // 4 // n
        r = min(n, m, rank)
        if (n + m) * r * 2 < n * m:
            p_total, q_total = p_total + n * r, q_total + m * r
        else:
            plain += n * m
    by_part = {part: sum(op.comm_bytes for op in collectives if op.name.endswith(part))
               for part in ("all_reduce_uncompressed", "all_reduce_p", "all_reduce_q")}
    assert by_part == {"all_reduce_uncompressed": 4 * plain, "all_reduce_p": 4 * p_total,
                       "all_reduce_q": 4 * q_total}
    assert len(collectives) == 3 * len(workload.meta["dp_buckets"])


@pytest.mark.parametrize("precision", ["fp16-mixed", "fp32"])
def test_onebit_adam_moves_sign_bits_and_scales_in_the_step(precision):
    """Compressed stage: no backward all_reduce; per 1-bit Adam tensor (one flat fp32 group under fp16, each parameter
    in fp32) padded to a multiple of N lcm(N, 8): all_to_all of Psi_p / 8 bytes, all_gather of N fp32 scales,
    all_gather of Psi_p / 8 bytes, all_gather of N scales (deepspeed/runtime/comm/nccl.py)."""
    workload = _workload(_document("1bit", framework="deepspeed", precision=precision))
    assert not [op for op in workload.first_microbatch if op.op_class == COLLECTIVE and op.group == "dp"]
    collectives = _dp_collectives(workload)
    sizes = [p.nbytes // (2 if precision == "fp16-mixed" else 4) for p in _params(workload)]
    tensors = [sum(sizes)] if precision == "fp16-mixed" else sizes
    multiple = DP * (DP * 8 // math.gcd(DP, 8))
    expected = []
    for n in tensors:
        padded = math.ceil(n / multiple) * multiple
        expected += [("all_to_all", padded // 8), ("all_gather", 4 * DP), ("all_gather", padded // 8),
                     ("all_gather", 4 * DP)]
    assert [(op.collective, op.comm_bytes) for op in collectives] == expected


def test_warmup_stages_communicate_uncompressed():
    onebit = _workload(_document("1bit", framework="deepspeed", precision="fp16-mixed", stage="warmup"))
    assert {op.collective for op in _dp_collectives(onebit)} == {"all_reduce"}
    assert sum(op.comm_bytes for op in _dp_collectives(onebit)) == 2 * onebit.parameter_count
    powersgd = _workload(_document("powersgd:2", stage="warmup"))
    assert sum(op.comm_bytes for op in _dp_collectives(powersgd)) == 4 * powersgd.parameter_count
    assert [op.name.rsplit(".", 1)[1] for op in powersgd.first_microbatch if op.name.startswith("powersgd.")] \
        == ["div", "all_reduce"] * len(powersgd.meta["dp_buckets"])


# ------------------------------------------------------------------------------- memory
def test_onebit_adam_state_is_master_moments_and_both_error_buffers():
    plain = _workload(_document(framework="deepspeed", precision="fp16-mixed"))
    psi = plain.parameter_count
    padded = math.ceil(psi / (DP * 8)) * DP * 8
    compressed = _workload(_document("1bit", framework="deepspeed", precision="fp16-mixed"))
    warmup = _workload(_document("1bit", framework="deepspeed", precision="fp16-mixed", stage="warmup"))
    assert _persistent_bytes(plain, OPTIMIZER_STATES) == 12 * psi
    assert _persistent_bytes(warmup, OPTIMIZER_STATES) == 12 * psi
    assert _persistent_bytes(compressed, OPTIMIZER_STATES) == 4 * psi + 4 * padded + 4 * psi + 4 * padded \
        + 4 * padded // DP
    # The compressed stage keeps no DDP bucket buffers: the backward all_reduce is off.
    assert _persistent_bytes(compressed, COMMUNICATION_BUFFERS) == 0
    assert _persistent_bytes(warmup, COMMUNICATION_BUFFERS) == 2 * psi


def test_hook_state_memory():
    plain = _workload(_document())
    psi = plain.parameter_count
    assert _persistent_bytes(plain, COMMUNICATION_BUFFERS) == 4 * psi          # torch DDP's bucket buffers
    powersgd = _workload(_document("powersgd:1"))
    factors = sum(op.comm_bytes for op in _dp_collectives(powersgd) if op.name.endswith(("_p", "_q")))
    assert _persistent_bytes(powersgd, COMMUNICATION_BUFFERS) == 4 * psi + 4 * psi + factors
    topk = _workload(_document("topk:0.01"))        # GRACE: a residual per gradient, no DDP buckets
    assert _persistent_bytes(topk, COMMUNICATION_BUFFERS) == 4 * psi
    int8 = _workload(_document("int8"))              # Bagua: the gradients live in its persistent buckets
    assert _persistent_bytes(int8, COMMUNICATION_BUFFERS) == 0
    assert _persistent_bytes(int8, GRADIENTS) == 4 * psi
    assert int8.gradients == ()


def test_transients_are_freed_within_the_iteration():
    """Every tensor a codec allocates is freed by the end of the iteration (persistent state excepted)."""
    for doc in (_document("int8"), _document("topk:0.05"), _document("powersgd:3"),
                _document("1bit", framework="deepspeed", precision="fp16-mixed")):
        workload = _workload(doc)
        ops = workload.first_microbatch + workload.optimizer
        live: set[int] = set()
        for op in ops:
            live |= set(op.allocs)
            live -= set(op.frees)
        codec = {t for t in live if workload.tensors[t].name.startswith(("bytegrad", "topk", "powersgd",
                                                                           "onebit"))}
        assert codec == set()


# ------------------------------------------------------------------------------- where it runs
def _program(doc: dict):
    scenario = scenario_from_dict(doc)
    cluster = resolve_cluster(scenario)
    plan = make_plan(scenario, cluster.topology)
    recipe = multi_recipe(scenario, cluster.device)
    workload = build_iteration(model_shape(scenario), recipe, kernel_profile(cluster.device))
    return lower_data_tensor_parallel(workload, cluster.device, plan, 0, 0, 1, recipe.accumulation_steps)


def test_bytegrad_kernels_run_on_the_communication_stream():
    program = _program(_document("int8"))
    comm = [i for i in program.streams[COMM_STREAM] if isinstance(i, Run)]
    assert comm and all(i.op.name.startswith("bytegrad.") for i in comm)
    assert not [i for i in program.streams["compute"] if isinstance(i, Run) and i.op.name.startswith("bytegrad.")]
    posted = [i for i in program.streams[COMM_STREAM] if isinstance(i, Collective)]
    assert [c.kind for c in posted][:2] == ["all_to_all", "all_gather"]


def test_powersgd_waits_for_each_collective_on_the_compute_stream():
    program = _program(_document("powersgd:2"))
    blocking = [i.collective.name for i in program.streams["compute"] if isinstance(i, Blocking)]
    assert blocking[:3] == ["powersgd.bucket0.all_reduce_uncompressed", "powersgd.bucket0.all_reduce_p",
                            "powersgd.bucket0.all_reduce_q"]


# ------------------------------------------------------------------------------- time
@pytest.fixture(scope="module")
def ten_gbe(tmp_path_factory) -> str:
    """pcie-4x4090 with a 10 Gb/s NIC: gradient all_reduces across two such nodes are bandwidth-bound."""
    text = (ROOT / "topologies" / "pcie-4x4090.toml").read_text()
    text = text.replace('bytes_per_s = "100 Gbps"', 'bytes_per_s = "10 Gbps"').replace(
        'name = "pcie-4x4090"', 'name = "pcie-4x4090-10gbe"')
    path = tmp_path_factory.mktemp("topology") / "slow.toml"
    path.write_text(text)
    return str(path)


def _report(doc: dict) -> dict:
    return simulate(scenario_from_dict(doc), timelines=False).report


@pytest.mark.parametrize("framework, precision, compression", [
    ("torch", "bf16-mixed", "int8"), ("torch", "bf16-mixed", "powersgd:1"), ("torch", "bf16-mixed", "topk:0.01"),
    ("deepspeed", "fp16-mixed", "1bit")])
def test_compression_shortens_a_bandwidth_bound_iteration(ten_gbe, framework, precision, compression):
    common = dict(framework=framework, precision=precision, dp=8, topology=ten_gbe, nodes=2, hidden=512,
                  vocab=8192)
    plain = _report(_document(**common))
    compressed = _report(_document(compression, **common))
    assert compressed["iteration_time_s"] < plain["iteration_time_s"]
    assert compressed["communication"]["total_s"] < plain["communication"]["total_s"]


def test_symmetry_reduction_is_exact_with_codec_kernels_on_the_comm_stream():
    doc = _document("int8")
    reduced = _report(doc)
    doc["run"]["full"] = True
    assert _report(doc) == reduced


# ------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("changes, message", [
    ({"dp": 1}, "parallel.gradient_compression = 'int8' needs parallel.dp > 1"),
    ({"framework": "megatron"}, "parallel.gradient_compression = 'int8' is Bagua's ByteGrad: it needs "
                                "training.framework = 'torch' ('megatron' reduces gradients its own way)"),
    ({"zero": 2}, "parallel.gradient_compression = 'int8' with parallel.zero_stage = 2: Bagua's ByteGrad replaces "
                  "the data-parallel all_reduce and has no reduce_scatter variant; allowed: 0"),
    ({"stage": "warmup"}, "parallel.gradient_compression_stage = 'warmup': 'int8' has no warm-up stage"),
])
def test_int8_refusals(changes, message):
    doc = _document("int8", **{k: v for k, v in changes.items() if k in ("dp", "zero", "stage")})
    if "framework" in changes:
        doc["training"]["framework"] = changes["framework"]
    with pytest.raises(PlanError) as error:
        simulate(scenario_from_dict(doc))
    assert message in str(error.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(framework="torch"), "it needs training.framework = 'deepspeed' (is 'torch')"),
    (dict(framework="deepspeed", precision="fp16-mixed", zero=1),
     "1-bit Adam has no compressed reduce_scatter (DeepSpeed: '1bit-Adam is not compatible with ZeRO')"),
    (dict(framework="deepspeed", precision="bf16-mixed"), "training.precision must be 'fp16-mixed' or 'fp32'"),
])
def test_onebit_refusals(kwargs, message):
    with pytest.raises(PlanError) as error:
        simulate(scenario_from_dict(_document("1bit", **kwargs)))
    assert message in str(error.value)


def test_powersgd_allows_zero1_and_refuses_zero2():
    assert _report(_document("powersgd:1", zero=1))["iteration_time_s"] > 0
    with pytest.raises(PlanError, match="allowed: 0, 1"):
        simulate(scenario_from_dict(_document("powersgd:1", zero=2)))


def test_warmup_without_compression_is_refused():
    with pytest.raises(PlanError, match="no compression has no warm-up stage"):
        simulate(scenario_from_dict(_document(stage="warmup")))


def test_onebit_optimizer_must_be_adam(tmp_path):
    doc = _document("1bit", framework="deepspeed", precision="fp16-mixed")
    doc["training"]["optimizer"] = "sgd"
    with pytest.raises(PlanError, match="it needs training.optimizer = 'adamw'"):
        simulate(scenario_from_dict(doc))


def test_cli_refusal_is_one_line_and_exit_2(tmp_path):
    scenario = tmp_path / "x.toml"
    scenario.write_text('name = "x"\n[model]\npreset = "gpt2"\n[parallel]\ndp = 4\ngradient_compression = "1bit"\n'
                        '[cluster]\ntopology = "pcie-4x4090"\n')
    done = subprocess.run([sys.executable, "-m", "simulator.cli", "run", str(scenario)], capture_output=True,
                          text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"memsim: error: {scenario}: parallel.gradient_compression = '1bit' is DeepSpeed's "
                                  f"1-bit Adam")


def test_compression_dataclass_round_trips():
    from simulator.workload.compression import Compression
    for text in ("none", "1bit", "int8", "topk:0.01", "powersgd:4"):
        assert Compression.parse(text).text == text
    assert dataclasses.replace(Compression.parse("1bit"), stage="warmup").compressing is False
