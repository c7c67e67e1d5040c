"""Communication overlap: per-framework defaults, refusals, the TP pairs, and what each switch does to a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from simulator import scenario_from_dict, simulate
from simulator.errors import ScenarioError
from simulator.hardware.catalog import get_device
from simulator.hardware.cost import op_cost
from simulator.parallel.overlap import OverlapOptions, resolve_overlap
from simulator.parallel.tp_overlap import gemm_scale, plan_overlaps
from simulator.workload.graph import BACKWARD_INPUT, BACKWARD_WEIGHT, COLLECTIVE, ELEMENTWISE, FORWARD, GEMM, Op

ROOT = Path(__file__).resolve().parent.parent


def _doc(framework="megatron", **parallel):
    parallel = {"tp": 2, "sequence_parallel": True, **parallel}
    pp = parallel.get("pp", 1)
    dp = parallel.setdefault("dp", 8 // (parallel["tp"] * pp))     # one DGX H100
    gpus = parallel["tp"] * dp * pp
    return {"name": "x", "model": {"architecture": "gpt", "num_layers": 4, "hidden_size": 1024,
                                   "num_attention_heads": 16, "vocab_size": 1024, "seq_length": 1024,
                                   "dropout": 0.0},
            "training": {"framework": framework, "micro_batch_size": 2, "global_batch_size": 4 * dp},
            "parallel": parallel, "cluster": {"topology": "dgx-h100", "nodes": max(1, gpus // 8)},
            "run": {"warmup_iterations": 0, "record_events": False}}


def _run(doc):
    return simulate(scenario_from_dict(doc), timelines=False, memory_workers=0).report


@pytest.mark.parametrize("framework, expected", [
    ("megatron", OverlapOptions(False, True, False, False, False, "end")),
    ("torch", OverlapOptions(False, False, True, False, True, "end")),
    ("deepspeed", OverlapOptions(False, False, False, False, False, "bucket")),
])
def test_framework_defaults(framework, expected):
    assert resolve_overlap(scenario_from_dict(_doc(framework, pp=2)), nvlink=True) == expected


def test_megatron_interleaved_overlaps_p2p_and_zero3_deepspeed_overlaps_reductions():
    interleaved = scenario_from_dict(_doc(pp=2, schedule="interleaved-1f1b", virtual_stages=2))
    assert resolve_overlap(interleaved, nvlink=True).overlap_p2p_comm
    zero3 = scenario_from_dict(_doc("deepspeed", tp=1, zero_stage=3))
    assert resolve_overlap(zero3, nvlink=True).overlap_grad_reduce


@pytest.mark.parametrize("framework, parallel, nvlink, message", [
    ("megatron", {"sequence_parallel": False, "tp_comm_overlap": True}, True, "needs parallel.sequence_parallel"),
    ("megatron", {"tp_comm_overlap": True}, False, "needs GPUs joined by NVLink"),
    ("deepspeed", {"tp_comm_overlap": True}, True, "framework 'deepspeed' has no tensor-parallel"),
    ("deepspeed", {"tp_backward_overlap": True}, True, "blocks on its backward collectives"),
    ("torch", {"overlap_grad_reduce": False}, True, "always reduce gradients during the backward"),
    ("megatron", {"overlap_param_gather": True}, True, "needs parallel.dp > 1 and parallel.zero_stage 1 or 2"),
    ("megatron", {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2, "overlap_p2p_comm": False}, True,
     "blocking sends are modelled for the gpipe and 1f1b schedules only"),
])
def test_refusals_name_the_key_and_the_rule(framework, parallel, nvlink, message):
    scenario = scenario_from_dict(_doc(framework, **parallel), source="x.toml")
    with pytest.raises(ScenarioError) as error:
        resolve_overlap(scenario, nvlink=nvlink)
    text = str(error.value)
    assert text.startswith("x.toml: parallel.") and message in text and "\n" not in text


def test_tp_comm_overlap_refused_when_a_tp_group_spans_nodes():
    doc = _doc(tp=16, dp=1, tp_comm_overlap=True)
    doc["cluster"]["nodes"] = 2
    doc["model"]["num_attention_heads"] = 16
    with pytest.raises(ScenarioError, match=r"^x.toml: parallel.tp_comm_overlap = true: needs every tensor-parallel "
                                            r"group inside one node .* a tp group of 16 spans 2 nodes of 8 GPUs$"):
        simulate(scenario_from_dict(doc, source="x.toml"))


def test_cli_refusal_exit_2(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text('[model]\npreset = "llama-7b"\n[training]\nframework = "megatron"\n'
                    '[parallel]\ntp = 4\ntp_comm_overlap = true\n[cluster]\ntopology = "pcie-4x4090"\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "simulator.cli", "run", str(path)], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    assert done.returncode == 2
    assert "parallel.tp_comm_overlap = true: needs parallel.sequence_parallel" in done.stderr
    assert done.stderr.count("\n") == 1


def _op(name, kind, phase, collective=""):
    return Op(name, kind, phase, flops=2e12 if kind == GEMM else 0.0, bytes_read=1 << 24, bytes_written=1 << 24,
              dtype="bf16", gemm_mnk=(4096, 4096, 4096) if kind == GEMM else None,
              collective=collective, group="tp" if collective else "", comm_bytes=1 << 24 if collective else 0)


def test_plan_pairs_each_collective_with_its_gemm():
    ops = [_op("layers.0.attn.column_input.all_gather", COLLECTIVE, FORWARD, "all_gather"),
           _op("layers.0.attn.c_attn", GEMM, FORWARD),
           _op("layers.0.attn.o_proj", GEMM, FORWARD),
           _op("layers.0.attn.o_proj.reduce_scatter", COLLECTIVE, FORWARD, "reduce_scatter"),
           _op("layers.0.mlp.c_fc.all_gather_input", COLLECTIVE, BACKWARD_INPUT, "all_gather"),
           _op("layers.0.mlp.c_fc.dgrad", GEMM, BACKWARD_INPUT),
           _op("layers.0.mlp.c_fc.wgrad", GEMM, BACKWARD_WEIGHT),
           _op("layers.0.mlp.c_fc.accumulate_grad", ELEMENTWISE, BACKWARD_INPUT),
           _op("layers.0.mlp.column_input.all_gather.reduce_scatter", COLLECTIVE, BACKWARD_INPUT, "reduce_scatter")]
    device = get_device("h100-sxm")
    full = plan_overlaps(ops, OverlapOptions(tp_comm_overlap=True, tp_backward_overlap=True), 4, device)
    assert [(o.collective, o.gemm, o.method) for o in full] == [(0, 1, "ring"), (3, 2, "pipeline"), (4, 5, "bulk"),
                                                               (8, 6, "bulk")]
    assert full[0].gemm_after == 0.25 and full[1].ahead == 0.75 and full[1].gemm_before == 0.25
    backward_only = plan_overlaps(ops, OverlapOptions(tp_backward_overlap=True), 4, device)
    assert [(o.collective, o.method) for o in backward_only] == [(4, "bulk"), (8, "bulk")]
    assert plan_overlaps(ops, OverlapOptions(), 4, device) == ()
    assert plan_overlaps(ops, OverlapOptions(tp_comm_overlap=True), 1, device) == ()


def test_gemm_slows_by_the_sms_a_communication_kernel_takes():
    device = get_device("h100-sxm")
    gemm = _op("g", GEMM, FORWARD)
    assert gemm_scale(gemm, device, 0) == 1.0
    compute_s = op_cost(gemm, device).compute_s      # compute-bound: only the kernel time stretches, not the launch
    expected = (compute_s * 132 / 116 + device.launch_overhead_s) / (compute_s + device.launch_overhead_s)
    assert gemm_scale(gemm, device, 16) == pytest.approx(expected, rel=1e-12)


def test_tp_overlap_hides_communication_and_keeps_the_peak():
    off = _run(_doc(tp_backward_overlap=False))
    backward = _run(_doc())
    full = _run(_doc(tp_comm_overlap=True))
    assert full["communication"]["exposed_s"] < backward["communication"]["exposed_s"] \
        < off["communication"]["exposed_s"]
    assert full["iteration_time_s"] < off["iteration_time_s"]
    # The same bytes move; the chunks of a pipelined reduce_scatter each pay NCCL's latency once more.
    assert off["communication"]["total_s"] <= full["communication"]["total_s"] <= 1.15 * off["communication"]["total_s"]
    assert full["ranks"][0]["peak_allocated_bytes"] >= off["ranks"][0]["peak_allocated_bytes"] * 0.99


def test_deferred_reductions_are_exposed():
    overlapped = _run(_doc(overlap_grad_reduce=True))
    deferred = _run(_doc())
    assert deferred["communication"]["exposed_s"] > overlapped["communication"]["exposed_s"]
    assert deferred["iteration_time_s"] > overlapped["iteration_time_s"]


def test_blocking_sends_cost_time_and_overlapped_param_gather_saves_it():
    # GPipe's back-to-back forwards on stage 0 each wait for their send across the two nodes.
    runs = []
    for p2p in (False, True):
        doc = _doc(tp=8, pp=2, dp=1, overlap_p2p_comm=p2p, schedule="gpipe")
        doc["cluster"]["nodes"], doc["training"]["global_batch_size"] = 2, 16
        runs.append(_run(doc))
    blocking, async_sends = runs
    assert blocking["iteration_time_s"] > async_sends["iteration_time_s"]
    assert blocking["communication"]["exposed_s"] > async_sends["communication"]["exposed_s"]
    gathered_after = _run(_doc(zero_stage=1))
    gathered_beside = _run(_doc(zero_stage=1, overlap_param_gather=True))
    assert gathered_beside["iteration_time_s"] < gathered_after["iteration_time_s"]


def test_overlapped_runs_are_deterministic():
    doc = _doc(pp=2, tp_comm_overlap=True, zero_stage=1, overlap_param_gather=True, overlap_grad_reduce=True)
    assert json.dumps(_run(doc), sort_keys=True) == json.dumps(_run(doc), sort_keys=True)
