"""The host-issue clock: a rank's host thread launches its kernels one by one, and the GPU waits when it falls behind.

Each op costs the host `host_cost_s` (framework dispatch and the CUDA launch: DeviceSpec.host_forward_op_s,
host_backward_op_s, host_optimizer_tensor_s x the tensors an optimizer op walks, and host_checkpoint_s at the first
op of each recomputed region: torch.utils.checkpoint's own work, forward and backward). Over one op list, from a moment
the host and the GPU are in step,

    H_i = H_(i-1) + h_i                     (the host has launched op i)
    S_i = max(E_(i-1), H_i),  E_i = S_i + k_i   (op i starts when the GPU is free and it has been launched)

and op i's run lasts E_i - E_(i-1): its kernel time k_i plus what the GPU waited for the host. The lists start
in step because the host waits for the GPU between them in the runs memsim models: torch's training step reads
the loss (`loss.item()`) after the backward and synchronizes after the step; Megatron's pipeline waits for each
step's p2p calls (`batch_p2p_sync`). The slack a host may have built up before such a point is not carried over
(an upper bound on the wait of a list's first ops). A collective's or an offload copy's launch costs the host
too; its own run stays 0 s (its stream times it). CUDA graphs (`training.cuda_graphs`) replay a captured step with
no per-kernel host work: the clock is off (api.py gives the device zero host costs).
"""

from __future__ import annotations

import dataclasses

from simulator.errors import ScenarioError
from simulator.hardware.catalog import DeviceSpec
from simulator.offload.config import OFFLOAD_KEYS, offloading
from simulator.parallel.program import Run
from simulator.workload.graph import (BACKWARD_INPUT, BACKWARD_WEIGHT, COLLECTIVE, OFFLOAD_CLASSES, OPTIMIZER_STEP,
                                     RECOMPUTE, Op)

_BACKWARD = (BACKWARD_INPUT, BACKWARD_WEIGHT)


def host_cost_s(op: Op, device: DeviceSpec) -> float:
    """Seconds of host time to launch `op` on `device` (recompute ops cost a backward op's: the autograd thread
    replays them)."""
    if op.phase == OPTIMIZER_STEP:
        return device.host_optimizer_tensor_s * op.tensors
    if op.phase in _BACKWARD or op.phase == RECOMPUTE:
        return device.host_backward_op_s
    return device.host_forward_op_s


def host_active(device: DeviceSpec) -> bool:
    """Whether launching costs the host anything on `device` (False on the cpu device and under CUDA graphs)."""
    return bool(device.host_forward_op_s or device.host_backward_op_s or device.host_optimizer_tensor_s
                or device.host_checkpoint_s)


def host_costs(ops: list[Op], device: DeviceSpec) -> list[tuple[float, float]]:
    """Per op of one list, in order: (its launch's host seconds, torch.utils.checkpoint's seconds when it starts a
    recomputed region, else 0)."""
    out = []
    previous = ""
    for op in ops:
        starts = op.phase == RECOMPUTE and previous != RECOMPUTE
        out.append((host_cost_s(op, device), device.host_checkpoint_s if starts else 0.0))
        previous = op.phase
    return out


def on_gpu(op: Op) -> bool:
    """Whether `op`'s run waits for the host here (collectives and offload traffic are timed on their streams)."""
    return not (op.op_class == COLLECTIVE or op.op_class in OFFLOAD_CLASSES)


def host_issued(runs: list[Run], device: DeviceSpec) -> list[Run]:
    """`runs` (one op list, in order) with each duration grown by the time the GPU waits for the host to launch it.

    Args:
        runs: the timed runs of one list (parallel/lower.py timed_ops), starting with host and GPU in step.
        device: the device (its host costs).

    Returns:
        New runs (the same ops); equal to `runs` when no run waits.
    """
    if not host_active(device):
        return runs
    host = gpu = 0.0
    out: list[Run] = []
    for run, (cost, checkpoint) in zip(runs, host_costs([run.op for run in runs], device)):
        op = run.op
        host += cost
        if checkpoint:
            host += checkpoint
        if not on_gpu(op):
            out.append(run)           # timed on its own stream (network model, offload transfers)
            continue
        end = max(gpu, host) + run.duration_s
        duration_s = end - gpu
        out.append(run if duration_s == run.duration_s else Run(op, duration_s, run.iteration, run.shift, run.low))
        gpu = end
    return out


def run_device(scenario, device: DeviceSpec) -> DeviceSpec:
    """The device as the run's kernels see it: with `training.cuda_graphs`, launching costs the host nothing.

    Raises:
        ScenarioError: CUDA graphs where the run cannot capture its step (one line naming the key and the rule).
    """
    t, p = scenario.training, scenario.parallel
    if not t.cuda_graphs:
        return device
    rule = None
    if device.kind != "gpu":
        rule = f"needs a GPU (the device is {device.name!r})"
    elif t.framework == "deepspeed":
        rule = "framework 'deepspeed' does not capture its training step as CUDA graphs (allowed: false)"
    elif p.zero_stage == 3 and p.dp > 1:
        rule = ("ZeRO-3 / FSDP gathers parameters from host-side module hooks whose order depends on the step: not "
                "capturable (allowed with parallel.zero_stage 0-2)")
    elif t.precision == "fp16-mixed" and t.loss_scale == "dynamic":
        rule = ("the dynamic loss scaler decides on the host, every step, whether to skip it (a data-dependent "
                "branch a graph cannot hold): set training.loss_scale to a number")
    elif t.skipped_steps_fraction > 0:
        rule = (f"training.skipped_steps_fraction = {t.skipped_steps_fraction!r}: a skipped step is the loss "
                f"scaler's data-dependent branch, which a replayed graph cannot take (allowed with graphs: 0)")
    elif offloading(scenario):
        key = next((f"parallel.{k}" for k in OFFLOAD_KEYS if getattr(p, k) != "none"), "model.embedding_placement")
        value = getattr(p, key[9:]) if key.startswith("parallel.") else scenario.model.embedding_placement
        rule = (f"{key} = {value!r}: offload runs work on the host (CPU-Adam, pinned-memory "
                f"hooks, drive reads) between the kernels, which a graph cannot capture (allowed with graphs: none)")
    if rule is not None:
        raise ScenarioError(f"{scenario.source}: training.cuda_graphs = true: {rule}")
    return dataclasses.replace(device, host_forward_op_s=0.0, host_backward_op_s=0.0, host_checkpoint_s=0.0,
                               host_optimizer_tensor_s=0.0)


__all__ = ["host_active", "host_cost_s", "host_costs", "host_issued", "on_gpu", "run_device"]
