"""The host-issue clock, CUDA graphs, the Hopper numbers from the captures, and the iteration-time interval."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from simulator import scenario_from_dict, simulate
from simulator.errors import ScenarioError
from simulator.hardware.catalog import HOPPER_KERNELS, HOST_ISSUE, get_device
from simulator.parallel.host_issue import host_cost_s, host_issued, run_device
from simulator.parallel.program import Run
from simulator.workload.graph import BACKWARD_INPUT, ELEMENTWISE, FORWARD, OPTIMIZER, OPTIMIZER_STEP, Op

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_catalog_host_costs_are_the_scripts():
    measured = _script("host_issue_params").measure()
    # the least-squares fit runs in the installed LAPACK: its last bits depend on the build (1e-12 is ~4,500 ulps)
    assert {key: measured[key] for key in HOST_ISSUE} == pytest.approx(dict(HOST_ISSUE), rel=1e-12)
    assert measured["host_bound_configurations"] >= 3


def test_catalog_hopper_kernel_rates_are_the_scripts():
    measured = _script("hopper_kernel_params").measure()
    assert {key: measured[key] for key in HOPPER_KERNELS} == dict(HOPPER_KERNELS)
    assert 0.9 < measured["gemm_model_ratio"] < 1.1      # cost.py's GEMM shape model holds on the H200 kernels


def _device(forward_s=2e-6):
    return dataclasses.replace(get_device("h200-sxm"), host_forward_op_s=forward_s, host_backward_op_s=forward_s,
                               host_checkpoint_s=0.0, host_optimizer_tensor_s=0.0)


def _runs(durations, phase=FORWARD):
    return [Run(Op(f"op{i}", ELEMENTWISE, phase), d, 0) for i, d in enumerate(durations)]


def test_small_kernels_wait_for_the_host_and_large_ones_hide_it():
    host_bound = host_issued(_runs([1e-6, 1e-6, 1e-6]), _device(2e-6))
    assert [r.duration_s for r in host_bound] == pytest.approx([3e-6, 2e-6, 2e-6], abs=1e-18)
    gpu_bound = host_issued(_runs([10e-6, 10e-6, 10e-6]), _device(2e-6))
    assert [r.duration_s for r in gpu_bound] == pytest.approx([12e-6, 10e-6, 10e-6], abs=1e-18)
    cpu = get_device("cpu")
    runs = _runs([1e-6, 1e-6])
    assert host_issued(runs, cpu) is runs


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e-3), min_size=1, max_size=30), st.floats(0, 1e-4))
def test_list_time_is_the_latest_launch_plus_the_kernels_after_it(kernels, host_s):
    """E_n = max over i of (H_i + the kernels from i on): once its last waited-for op is out the GPU never idles;
    no op runs shorter than its kernel."""
    issued = host_issued(_runs(kernels), _device(host_s))
    expected = max(host_s * (i + 1) + sum(kernels[i:]) for i in range(len(kernels)))
    assert sum(r.duration_s for r in issued) == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert all(r.duration_s >= k - 1e-18 for r, k in zip(issued, kernels))


def test_recurrence_over_a_list_matches_the_closed_form():
    kernels = [5e-6, 1e-6, 1e-6, 30e-6, 1e-6, 1e-6, 1e-6]
    device = _device(4e-6)
    issued = host_issued(_runs(kernels), device)
    expected = max(4e-6 * (i + 1) + sum(kernels[i:]) for i in range(len(kernels)))
    assert sum(r.duration_s for r in issued) == pytest.approx(expected, rel=1e-12)


def test_host_costs_by_phase():
    device = get_device("h100-sxm")
    assert host_cost_s(Op("f", ELEMENTWISE, FORWARD), device) == device.host_forward_op_s
    assert host_cost_s(Op("b", ELEMENTWISE, BACKWARD_INPUT), device) == device.host_backward_op_s
    assert host_cost_s(Op("o", OPTIMIZER, OPTIMIZER_STEP, tensors=148), device) == \
        148 * device.host_optimizer_tensor_s


def _capture_doc(**training):
    data = json.loads((ROOT / "validation/data/cuda/timing/gpt-124m-bf16-mixed-flash-none-adamw.json").read_text())
    return {"name": "x", "model": data["config"]["model"], "training": {**data["config"]["training"], **training},
            "cluster": {"topology": "h200-sxm"}, "run": {"record_events": False}}


def test_cuda_graphs_remove_the_host_wait():
    eager = simulate(scenario_from_dict(_capture_doc()), timelines=False).report
    graphed = simulate(scenario_from_dict(_capture_doc(cuda_graphs=True)), timelines=False).report
    assert graphed["iteration_time_s"] < 0.8 * eager["iteration_time_s"]      # this step is launch-bound


@pytest.mark.parametrize("doc, rule", [
    ({"training": {"cuda_graphs": True}, "cluster": {"topology": "cpu"}}, "needs a GPU"),
    ({"training": {"cuda_graphs": True, "framework": "deepspeed"}}, "framework 'deepspeed'"),
    ({"training": {"cuda_graphs": True, "precision": "fp16-mixed"}}, "dynamic loss scaler"),
    ({"training": {"cuda_graphs": True, "precision": "fp16-mixed", "loss_scale": 1024.0,
                   "skipped_steps_fraction": 0.01}}, "data-dependent branch"),
    ({"training": {"cuda_graphs": True, "framework": "deepspeed"}, "parallel": {"offload_activations": "cpu"}},
     "framework 'deepspeed'"),
    ({"training": {"cuda_graphs": True}, "parallel": {"offload_activations": "cpu"}},
     "parallel.offload_activations = 'cpu': offload runs work on the host"),
])
def test_cuda_graphs_refused_where_a_step_cannot_be_captured(doc, rule):
    base = {"name": "x", "model": {"preset": "gpt2"}, "training": {}, "cluster": {"topology": "h100-sxm"}}
    base = {**base, **{k: {**base.get(k, {}), **v} for k, v in doc.items()}}
    scenario = scenario_from_dict(base, source="x.toml")
    with pytest.raises(ScenarioError) as error:
        run_device(scenario, get_device(base["cluster"]["topology"]))
    assert str(error.value).startswith("x.toml: training.cuda_graphs = true: ") and rule in str(error.value)


def test_zero3_cannot_be_graphed():
    doc = {"name": "x", "model": {"preset": "gpt2"}, "training": {"cuda_graphs": True, "global_batch_size": 8},
           "parallel": {"dp": 8, "zero_stage": 3}, "cluster": {"topology": "dgx-h100"}}
    with pytest.raises(ScenarioError, match="ZeRO-3 / FSDP"):
        simulate(scenario_from_dict(doc, source="x.toml"))


def test_interval_from_the_validation_set_and_from_a_calibration():
    plain = simulate(scenario_from_dict(_capture_doc()), timelines=False).report
    low, high = plain["iteration_time_interval_s"]
    assert plain["iteration_time_interval"]["kind"] == "validation-set"
    assert low < plain["iteration_time_s"] < high
    doc = _capture_doc()
    doc["cluster"]["calibration"] = str(ROOT / "validation/data/cuda/calibration.toml")
    calibrated = simulate(scenario_from_dict(doc), timelines=False).report
    low, high = calibrated["iteration_time_interval_s"]
    assert calibrated["iteration_time_interval"]["kind"] == "calibration-bootstrap"
    assert "bootstrap" in calibrated["iteration_time_interval"]["source"]
    assert low < calibrated["iteration_time_s"] < high
