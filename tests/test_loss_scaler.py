"""The fp16 loss scaler (workload/loss_scaler.py): torch GradScaler's temporaries against torch on the CPU, each
framework's device state, static scales, skipped steps and their time, the refusals."""

from __future__ import annotations

import weakref

import pytest

from simulator import simulate
from simulator.errors import PlanError
from simulator.scenario import scenario_from_dict
from simulator.workload.graph import OTHER
from simulator.workload.loss_scaler import (
    CHUNK_ELEMENTS, MAX_TENSORS_PER_LAUNCH, make_loss_scaler, multi_tensor_launches, skipped_step,
)
from simulator.workload.optimizers import IdSource, MasterParam

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class _Storages(TorchDispatchMode):
    """Every new storage an aten op makes (+bytes) and its release (-bytes), in order; in-place ops (a name ending in
    "_") return storages that exist already."""

    def __init__(self):
        super().__init__()
        self.events: list[int] = []
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name.endswith("_"):
            return out
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key not in self._seen and storage.nbytes():
                    self._seen.add(key)
                    nbytes = storage.nbytes()
                    self.events.append(nbytes)
                    weakref.finalize(storage, self.events.append, -nbytes)
        return out


def _measured_step(fused: bool) -> list[int]:
    """The storages torch.amp.GradScaler("cpu") makes in scaler.step + scaler.update (the optimizer's own step
    allocates nothing: fused AdamW, or SGD without momentum)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True) if fused else \
        torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(2):                                   # the second step is the one measured
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 16)).float().sum()
        scaler.scale(loss).backward()
        log = _Storages()
        with log:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
    import gc
    gc.collect()
    return log.events


def _simulated_step(fused: bool) -> list[int]:
    tensors: dict = {}
    ids = IdSource(0)
    scaler = make_loss_scaler("torch", "dynamic", ids, tensors)
    params = [MasterParam("weight", (16, 16), 256, "fp32", "fp32"), MasterParam("bias", (16,), 16, "fp32", "fp32")]
    before, after = scaler.ops(params, ids, tensors, self_unscaling=fused)
    events = []
    for op in before + after:
        events += [tensors[t].nbytes for t in op.allocs]
        events += [-tensors[t].nbytes for t in op.frees]
    return events


@pytest.mark.parametrize("fused", [False, True])
def test_grad_scaler_temporaries_match_torch_on_cpu(fused):
    """Same allocations (sizes, in order), same peak of live temporaries, all released by update() (torch 2.13)."""
    measured, simulated = _measured_step(fused), _simulated_step(fused)
    assert [e for e in simulated if e > 0] == [e for e in measured if e > 0]

    def peak(events):
        live = top = 0
        for e in events:
            live += e
            top = max(top, live)
        return top, live

    assert peak(simulated) == peak(measured)


def test_device_state_per_framework():
    def state_bytes(framework, scale):
        tensors: dict = {}
        scaler = make_loss_scaler(framework, scale, IdSource(0), tensors)
        assert all(tensors[t].persistent and tensors[t].category == OTHER for t in scaler.state)
        return sum(tensors[t].nbytes for t in scaler.state)

    assert state_bytes("torch", "dynamic") == 8                  # fp32 scale + int32 growth tracker
    assert state_bytes("megatron", "dynamic") == 20              # scale, min_scale, growth/backoff factors, found_inf
    assert state_bytes("megatron", 1024.0) == 8                  # ConstantGradScaler: scale + found_inf
    assert state_bytes("deepspeed", "dynamic") == state_bytes("deepspeed", 1024.0) == 0   # host-side scale


def test_multi_tensor_apply_launches():
    assert multi_tensor_launches([10] * MAX_TENSORS_PER_LAUNCH) == 1
    assert multi_tensor_launches([10] * (MAX_TENSORS_PER_LAUNCH + 1)) == 2
    assert multi_tensor_launches([320 * CHUNK_ELEMENTS]) == 1
    assert multi_tensor_launches([320 * CHUNK_ELEMENTS + 1]) == 2
    assert multi_tensor_launches([1000 * CHUNK_ELEMENTS]) == 4          # ceil(1000 / 320)


def _doc(framework: str = "torch", precision: str = "fp16-mixed", **training) -> dict:
    return {"name": "scaler",
            "model": {"architecture": "gpt", "num_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
                      "vocab_size": 1024, "seq_length": 64, "dropout": 0.0},
            "training": {"micro_batch_size": 2, "precision": precision, "framework": framework, **training},
            "cluster": {"topology": "rtx-4090"}, "run": {"warmup_iterations": 1}}


@pytest.mark.parametrize("framework", ["torch", "megatron", "deepspeed"])
def test_skipped_steps_average_the_iteration_time(framework):
    plain = simulate(scenario_from_dict(_doc(framework))).report
    fraction = 0.25
    mixed = simulate(scenario_from_dict(_doc(framework, skipped_steps_fraction=fraction))).report
    times = mixed["loss_scaler"]
    assert times["step_iteration_time_s"] == plain["iteration_time_s"]
    assert times["skipped_iteration_time_s"] < times["step_iteration_time_s"]
    assert mixed["iteration_time_s"] == pytest.approx(
        (1 - fraction) * times["step_iteration_time_s"] + fraction * times["skipped_iteration_time_s"], rel=1e-12)
    assert mixed["tokens_per_s"] > plain["tokens_per_s"]
    assert mixed["ranks"] == plain["ranks"]         # memory and the per-rank times are a stepping iteration's


def test_skipped_steps_with_data_parallel_and_zero():
    doc = _doc("deepspeed", skipped_steps_fraction=0.5, global_batch_size=8)
    doc["parallel"] = {"dp": 4, "zero_stage": 2}
    doc["cluster"] = {"topology": "pcie-4x4090"}
    times = simulate(scenario_from_dict(doc)).report["loss_scaler"]
    assert 0 < times["skipped_iteration_time_s"] < times["step_iteration_time_s"]


def test_a_skipped_step_runs_only_the_scaler():
    from simulator.api import kernel_profile, model_shape, recipe_for
    from simulator.topology import resolve_cluster
    from simulator.workload.training import build_iteration
    scenario = scenario_from_dict(_doc())
    device = resolve_cluster(scenario).device
    workload = build_iteration(model_shape(scenario), recipe_for(scenario, device), kernel_profile(device))
    skipped = skipped_step(workload.optimizer)
    assert skipped and all(op.name.startswith("grad_scaler.") for op in skipped)
    assert len(skipped) < len(workload.optimizer)


def test_static_scale_has_its_effect_or_is_refused():
    dynamic = simulate(scenario_from_dict(_doc("megatron"))).report["ranks"][0]
    static = simulate(scenario_from_dict(_doc("megatron", loss_scale=1024.0))).report["ranks"][0]
    assert dynamic["category_peaks"][OTHER] - static["category_peaks"][OTHER] == 3 * 512   # three 512-byte blocks
    with pytest.raises(PlanError, match="torch's GradScaler only scales dynamically"):
        simulate(scenario_from_dict(_doc("torch", loss_scale=1024.0)))
    with pytest.raises(PlanError, match="applies to training.precision = 'fp16-mixed' only"):
        simulate(scenario_from_dict(_doc("megatron", "bf16-mixed", loss_scale=1024.0)))
    with pytest.raises(PlanError, match="only the fp16 loss scaler skips steps"):
        simulate(scenario_from_dict(_doc("torch", "bf16-mixed", skipped_steps_fraction=0.1)))


def test_fp16_with_zero_offload_runs_and_averages_skipped_steps():
    """DeepSpeed's ZeRO-Offload checks for overflow and unscales on the host's fp32 gradients (loss_scaler.
    kept_with_offload leaves the overflow all_reduce in the GPU step): the run works and averages skipped steps."""
    import pathlib
    from simulator.scenario import load_scenario
    root = pathlib.Path(__file__).resolve().parents[1]
    scenario = load_scenario(root / "scenarios" / "llama7b-rtx4090-zero-offload.toml",
                             ["model.num_layers=2", "training.precision=fp16-mixed",
                              "training.skipped_steps_fraction=0.1"])
    report = simulate(scenario, timelines=False).report
    assert 0 < report["loss_scaler"]["skipped_iteration_time_s"] < report["loss_scaler"]["step_iteration_time_s"]
