"""Offload through `simulate` and `memsim run`: the bytes each route moves (exact), the host memory it needs, the
time it costs (in the right direction when the PCIe bandwidth changes), and the refusals."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from simulator import scenario_from_dict, simulate
from simulator.cli import app
from simulator.errors import MemsimError
from simulator.network.topology import topology_dir
from simulator.offload.host_memory import pinned_block_bytes
from simulator.offload.zero3 import fetch_distance, sub_groups


def tiny(parallel: dict, training: dict | None = None, topology: str = "workstation-rtx4090",
         layers: int = 2) -> dict:
    """A tiny GPT (hidden 64, vocab 512, seq 32) on one GPU, micro-batch 1, bf16-mixed."""
    return {"name": "tiny-offload",
            "model": {"architecture": "gpt", "num_layers": layers, "hidden_size": 64, "num_attention_heads": 4,
                      "vocab_size": 512, "seq_length": 32, "dropout": 0.0},
            "training": {"micro_batch_size": 1, "global_batch_size": 1, "precision": "bf16-mixed",
                         **(training or {})},
            "parallel": parallel, "cluster": {"topology": topology}}


ZERO_OFFLOAD = {"zero_stage": 2, "offload_optimizer": "cpu"}
DEEPSPEED = {"framework": "deepspeed"}


def run(data: dict) -> dict:
    return simulate(scenario_from_dict(data, source="x.toml")).report


def _topology_variant(tmp_path, name: str, old: str, new: str) -> str:
    text = (topology_dir() / f"{name}.toml").read_text()
    assert old in text
    path = tmp_path / f"{name}-{abs(hash(new)) % 1000}.toml"
    path.write_text(text.replace(old, new))
    return str(path)


def test_zero_offload_moves_each_parameter_as_deepspeed_does():
    report = run(tiny(ZERO_OFFLOAD, DEEPSPEED))
    params = report["ranks"][0]["parameters"]
    offload = report["offload"]
    assert offload["d2h_bytes"] == 4 * params            # fp32 gradient partition to the host
    assert offload["h2d_bytes"] == 2 * params            # updated bf16 partition back
    assert offload["host_dram_bytes"] == (8 + 28 + 6) * params    # unscale, CPU-Adam, fp32 -> bf16 conversion
    assert offload["nvme_read_bytes"] == offload["nvme_write_bytes"] == 0
    rank = report["ranks"][0]
    assert rank["breakdown_at_peak"]["optimizer_states"] == 0 and rank["category_peaks"]["optimizer_states"] == 0
    largest = 512 * 64                                   # the token embedding
    pinned = 2 * pinned_block_bytes(4 * params) + pinned_block_bytes(2 * params) + pinned_block_bytes(2 * largest)
    assert rank["host_pinned_bytes"] == pinned
    assert rank["host_peak_bytes"] == pinned + 2 * 4 * params     # + CPU-Adam's moments (pageable)
    assert report["host_memory"] == [{"node": 0, "ranks": 1, "peak_bytes": rank["host_peak_bytes"],
                                      "peak_time_s": pytest.approx(report["host_memory"][0]["peak_time_s"]),
                                      "capacity_bytes": 128 * 10**9, "fits": True}]
    breakdown = report["time_breakdown"]
    assert breakdown["host_compute_s"] > 0 and breakdown["offload_traffic_s"] > 0
    assert report["iteration_time_s"] == pytest.approx(
        breakdown["forward_s"] + breakdown["backward_s"] + breakdown["optimizer_s"] + breakdown["exposed_offload_s"]
        + breakdown["idle_s"])
    assert not any("zero_stage has no effect" in w for w in report["warnings"])


def test_zero_offload_frees_the_gpu_of_master_weights_and_adam_states():
    on_gpu = run(tiny({"zero_stage": 2}, DEEPSPEED))
    offloaded = run(tiny(ZERO_OFFLOAD, DEEPSPEED))
    params = offloaded["ranks"][0]["parameters"]
    assert on_gpu["ranks"][0]["category_peaks"]["optimizer_states"] >= 12 * params     # fp32 master + 2 moments
    assert offloaded["ranks"][0]["peak_allocated_bytes"] < on_gpu["ranks"][0]["peak_allocated_bytes"]
    assert on_gpu["offload"] is None and on_gpu["ranks"][0]["host_peak_bytes"] == 0


def test_activation_offload_copies_every_saved_tensor_out_and_back():
    plain = run(tiny({}))
    offloaded = run(tiny({"offload_activations": "cpu"}))
    moved = offloaded["offload"]
    assert moved["d2h_bytes"] == moved["h2d_bytes"] > 0
    rank = offloaded["ranks"][0]
    assert rank["category_peaks"]["activations"] < plain["ranks"][0]["category_peaks"]["activations"]
    assert rank["host_breakdown_at_peak"]["activations"] >= moved["d2h_bytes"]    # pinned blocks round up
    breakdown = offloaded["time_breakdown"]
    assert breakdown["exposed_offload_s"] == pytest.approx(breakdown["offload_traffic_s"])   # save_on_cpu: in line
    assert offloaded["iteration_time_s"] > plain["iteration_time_s"]


def test_a_pcie_bound_plan_slows_down_when_pcie_narrows(tmp_path):
    slow = _topology_variant(tmp_path, "workstation-rtx4090", 'bytes_per_s = "31.5 GB/s"', 'bytes_per_s = "7.875 GB/s"')
    for topology, pcie in (("workstation-rtx4090", 31.5e9), (slow, 7.875e9)):
        result = simulate(scenario_from_dict(tiny({"offload_activations": "cpu"}, topology=topology, layers=4)))
        copies = [s for s in result.trace.ranks[0].spans if s.kind in ("d2h", "h2d") and s.iteration == 1]
        moved = sum(s.bytes for s in copies)
        # save_on_cpu's copies run one after another on the compute stream: each its route latency (pcie4 0.5 us +
        # ddr5 0.1 us) plus its bytes at the PCIe payload rate
        expected = len(copies) * 0.6e-6 + moved / (pcie * 0.794)
        assert result.report["time_breakdown"]["offload_traffic_s"] == pytest.approx(expected, rel=1e-9)
        assert result.report["time_breakdown"]["exposed_offload_s"] == pytest.approx(expected, rel=1e-9)
        if pcie < 31.5e9:
            assert result.report["iteration_time_s"] > wide["iteration_time_s"]
        wide = result.report


def test_a_job_that_overflows_the_host_does_not_fit(tmp_path):
    small = _topology_variant(tmp_path, "workstation-rtx4090", 'capacity = "128 GB"', 'capacity = "1 MB"')
    report = run(tiny(ZERO_OFFLOAD, DEEPSPEED, topology=small))
    assert report["fits"] is False and report["ranks"][0]["oom"] is False
    assert report["host_memory"][0]["fits"] is False
    assert any("host memory of node 0" in w and "does not fit" in w for w in report["warnings"])


def test_data_parallel_zero_offload_shares_the_host_and_agrees_with_full_simulation():
    data = tiny({**ZERO_OFFLOAD, "dp": 8}, {**DEEPSPEED, "global_batch_size": 8}, topology="dgx-a100")
    reduced = run(data)
    full = run({**data, "run": {"full": True}})
    assert reduced["iteration_time_s"] == full["iteration_time_s"]
    assert reduced["host_memory"] == full["host_memory"]
    node = reduced["host_memory"][0]
    assert node["ranks"] == 8 and node["peak_bytes"] == 8 * reduced["ranks"][0]["host_peak_bytes"]
    params = reduced["ranks"][0]["parameters"]
    assert reduced["offload"]["d2h_bytes"] == pytest.approx(4 * params / 8, rel=0.01)   # this rank's partition


def test_same_scenario_same_report():
    data = tiny({**ZERO_OFFLOAD, "offload_activations": "cpu"}, DEEPSPEED)
    assert json.dumps(run(data), sort_keys=True) == json.dumps(run(data), sort_keys=True)


def test_zero3_offload_moves_each_parameter_as_deepspeed_stage3_does():
    base = run(tiny({"zero_stage": 3, "offload_optimizer": "cpu"}, DEEPSPEED))
    params = base["ranks"][0]["parameters"]
    moved = base["offload"]
    assert moved["d2h_bytes"] == 8 * params          # into the host gradient buffer, then into the fp32 gradient
    assert moved["h2d_bytes"] == (4 + 2) * params    # the buffer back to the GPU; the updated fp16 partition
    assert moved["host_dram_bytes"] == 42 * params
    nvme = run(tiny({"zero_stage": 3, "offload_optimizer": "nvme"}, DEEPSPEED))["offload"]
    assert nvme["nvme_read_bytes"] == 16 * params    # master, moments and gradient swapped in for the step
    assert nvme["nvme_write_bytes"] == (4 + 12) * params    # gradients swapped out; master and moments written back
    cpu_params = run(tiny({"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}, DEEPSPEED))
    fetched = cpu_params["offload"]["h2d_bytes"] - 4 * params      # no fp16 copy after the step: fetches instead
    assert fetched > 2 * params                       # every segment fetched for its forward and its backward
    nvme_params = run(tiny({"zero_stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme"}, DEEPSPEED))
    assert nvme_params["offload"]["nvme_read_bytes"] == 16 * params + fetched
    assert nvme_params["offload"]["nvme_write_bytes"] == (4 + 12 + 2) * params
    assert nvme_params["ranks"][0]["nvme_peak_bytes"] == (16 + 2) * params
    gpu = run(tiny({"zero_stage": 3}, DEEPSPEED, layers=8))["ranks"][0]["category_peaks"]["parameters"]
    offloaded = {"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}
    one_at_a_time = run(tiny({**offloaded, "prefetch_bucket_size": 0}, DEEPSPEED, layers=8))
    assert one_at_a_time["ranks"][0]["category_peaks"]["parameters"] < gpu / 2    # the shards live on the host
    deep = run(tiny(offloaded, DEEPSPEED, layers=8))                  # 50 M elements: every segment fetched ahead
    assert deep["ranks"][0]["category_peaks"]["parameters"] > gpu


def test_sub_groups_and_the_prefetch_distance():
    assert sub_groups(2_500_000_000) == [10**9, 10**9, 500_000_000] and sub_groups(10) == [10]
    numels = [40, 40, 40, 40]
    assert [fetch_distance(numels, j, 0) for j in range(4)] == [0, 0, 0, 0]
    assert [fetch_distance(numels, j, 50) for j in range(4)] == [0, 1, 2, 2]     # one segment of 40 < 50 in between
    assert [fetch_distance(numels, j, 10**9) for j in range(4)] == [0, 1, 2, 3]


def test_prefetching_offloaded_parameters_hides_their_fetches():
    def exposed(bucket: int) -> float:
        data = tiny({"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu",
                     "prefetch_bucket_size": bucket}, DEEPSPEED, layers=4)
        return run(data)["time_breakdown"]["exposed_offload_s"]

    assert exposed(0) > exposed(50_000_000)
    report = run(tiny({"zero_stage": 3, "prefetch_bucket_size": 10}, DEEPSPEED))
    assert any("prefetch_bucket_size has no effect" in w for w in report["warnings"])


def test_zero_infinity_needs_drives(tmp_path):
    data = tiny({"zero_stage": 3, "offload_optimizer": "nvme"}, DEEPSPEED, topology="pcie-4x4090")
    data["parallel"]["dp"] = 4
    data["training"]["global_batch_size"] = 4
    path = tmp_path / "x.toml"
    path.write_text(_toml(data))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2
    message = result.stderr if hasattr(result, "stderr") else result.output
    assert "cluster.topology = 'pcie-4x4090' has no NVMe drive: parallel.offload_optimizer = 'nvme'" in message
    assert "dgx-a100, dgx-h100, workstation-rtx4090" in message


@pytest.mark.parametrize("parallel, training, topology, fragments", [
    (ZERO_OFFLOAD, DEEPSPEED, "rtx-4090", ("cluster.topology = 'rtx-4090'", "offload needs a topology")),
    ({"offload_activations": "nvme"}, {}, None, ("parallel.offload_activations = 'nvme'", "allowed: 'none', 'cpu'")),
    (ZERO_OFFLOAD, {}, None, ("training.framework = 'torch'", "ZeRO-Offload")),
    ({"zero_stage": 1, "offload_optimizer": "cpu"}, DEEPSPEED, None, ("parallel.zero_stage = 1", "allowed: 2, 3")),
    ({"zero_stage": 2, "offload_optimizer": "nvme"}, DEEPSPEED, None, ("parallel.zero_stage = 2", "allowed: 3")),
    ({"zero_stage": 2, "offload_optimizer": "cpu", "offload_params": "cpu"}, DEEPSPEED, None,
     ("parallel.offload_params = 'cpu' with parallel.zero_stage = 2",)),
    ({"zero_stage": 3, "offload_params": "cpu"}, DEEPSPEED, None, ("parallel.offload_optimizer = 'none'",)),
    (ZERO_OFFLOAD, {**DEEPSPEED, "optimizer": "sgd"}, None, ("training.optimizer = 'sgd'", "allowed: 'adamw'")),
    (ZERO_OFFLOAD, {**DEEPSPEED, "global_batch_size": 2}, None, ("2 gradient accumulation steps",)),
    ({"offload_activations": "cpu"}, {"recompute": "full"}, None, ("training.recompute = 'full'",)),
    ({"offload_activations": "cpu"}, {"framework": "megatron"}, None, ("training.framework = 'megatron'",)),
    ({"offload_activations": "cpu", "pp": 2}, {"global_batch_size": 2}, "pcie-4x4090", ("parallel.pp = 2",)),
])
def test_what_is_not_simulated_is_refused_in_one_line(tmp_path, parallel, training, topology, fragments):
    data = tiny(parallel, training, topology=topology or "workstation-rtx4090")
    if topology == "pcie-4x4090":
        data["parallel"]["dp"] = 2
    path = tmp_path / "x.toml"
    path.write_text(_toml(data))
    result = CliRunner().invoke(app, ["run", str(path), "--json"])
    assert result.exit_code == 2, result.output
    message = result.stderr if hasattr(result, "stderr") else result.output
    assert len(message.strip().splitlines()) == 1 and "Traceback" not in message
    for fragment in fragments:
        assert fragment in message
    with pytest.raises(MemsimError):
        run(data)


def _toml(data: dict) -> str:
    lines = [f'name = "{data["name"]}"']
    for section in ("model", "training", "parallel", "cluster", "run"):
        if section not in data:
            continue
        lines.append(f"[{section}]")
        for key, value in data[section].items():
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def test_the_llama7b_offload_scenarios_answer_as_their_comments_say():
    from pathlib import Path

    from simulator import load_scenario

    scenarios = Path(__file__).resolve().parents[1] / "scenarios"
    offload = simulate(load_scenario(scenarios / "llama7b-rtx4090-zero-offload.toml")).report
    rank = offload["ranks"][0]
    assert offload["fits"] is False and rank["oom"] is False
    assert rank["peak_reserved_bytes"] < 24e9 and offload["host_memory"][0]["peak_bytes"] > 128e9
    assert offload["time_breakdown"]["host_compute_s"] > offload["time_breakdown"]["backward_s"]   # CPU-bound
    infinity = simulate(load_scenario(scenarios / "llama7b-rtx4090-zero-infinity.toml")).report
    assert infinity["fits"] is True and infinity["ranks"][0]["nvme_peak_bytes"] > 100e9
    assert infinity["time_breakdown"]["offload_traffic_s"] > 0.8 * infinity["iteration_time_s"]    # drive-bound


def test_the_chrome_trace_shows_copies_as_memcpy_and_the_host_step_as_cpu_work():
    from simulator.trace.chrome import chrome_trace

    result = simulate(scenario_from_dict(tiny({"zero_stage": 3, "offload_optimizer": "nvme"}, DEEPSPEED)))
    trace = chrome_trace(result.trace, "x")
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    categories = {e["name"].split(".")[-1]: e.get("cat") for e in events if e.get("name", "").count("offload.") or
                  "grad_to_host" in e.get("name", "") or "to_fp32_grad" in e.get("name", "")}
    assert categories["cpu_adam"] == "cpu_op"
    assert categories["swap_in"] == "io"
    assert categories["to_fp32_grad"] == "gpu_memcpy"
