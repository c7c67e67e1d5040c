"""Summarize a Trace into the JSON report of DESIGN.md: fit, peaks by category, time, MFU."""

from __future__ import annotations

from simulator.trace.records import COMM_PHASE
from simulator.workload.graph import BACKWARD_INPUT, BACKWARD_WEIGHT, CATEGORIES, FORWARD, OPTIMIZER_STEP, RECOMPUTE

_PHASE_KEYS = {FORWARD: "forward_s", BACKWARD_INPUT: "backward_s", BACKWARD_WEIGHT: "backward_s",
               RECOMPUTE: "recompute_s", OPTIMIZER_STEP: "optimizer_s"}
MODEL_PHASES = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)


def model_flops(workload) -> float:
    """FLOPs of one iteration's forward and backward (no recompute, no optimizer): the MFU numerator."""
    first = sum(op.flops for op in workload.first_microbatch if op.phase in MODEL_PHASES)
    later = sum(op.flops for op in workload.later_microbatch if op.phase in MODEL_PHASES)
    steps = workload.meta.get("accumulation_steps", 1)
    return first + later * max(steps - 1, 0)


def peak_flop_rate(device, precision: str) -> float:
    """The dense peak the MFU is measured against: fp32 for fp32 training, else the 16-bit rate."""
    rates = device.peak_flop_per_s
    if precision == "fp32":
        return rates["fp32"]
    if precision == "fp8-mixed" and rates.get("fp8"):
        return rates["fp8"]
    return rates.get("bf16") or rates["fp32"]


def span_sums(spans, start_s: float, end_s: float) -> tuple[dict[str, float], float]:
    """Seconds of compute spans inside [start_s, end_s]: per time-breakdown key, and in all (collectives and
    transfers are communication, not compute, even when a stream overlaps them)."""
    phase_time = {key: 0.0 for key in _PHASE_KEYS.values()}
    sums = getattr(spans, "phase_sums", None)
    if sums is not None:          # the engine's span columns: the same sums without making the Span objects
        summed, compute = sums(start_s, end_s, _PHASE_KEYS, "forward_s")
        return {key: summed[key] for key in phase_time}, compute
    compute = 0.0
    for span in spans:
        if span.phase == COMM_PHASE:
            continue
        if start_s <= span.start_s and span.end_s <= end_s:
            duration = span.end_s - span.start_s
            phase_time[_PHASE_KEYS.get(span.phase, "forward_s")] += duration
            compute += duration
    return phase_time, compute


def measured_window(trace, warmup: int) -> tuple[float, float, float]:
    """(start, end, mean iteration seconds) of a trace's measured iterations (all, when none is past warm-up)."""
    if not trace.iteration_bounds_s:
        return 0.0, 0.0, 0.0
    measured = trace.iteration_bounds_s[warmup:] or trace.iteration_bounds_s
    start, end = measured[0][0], measured[-1][1]
    return start, end, (end - start) / len(measured)


def blend_skipped_steps(report: dict, skipped_iteration_s: float, fraction: float) -> dict:
    """`report` with its iteration time the average over stepping and skipped iterations (training.
    skipped_steps_fraction = `fraction` of them skip the optimizer step): (1 - f) t_step + f t_skip; tokens/s and
    MFU follow it; the time breakdown, bubble and communication stay those of an iteration that steps.
    `loss_scaler` gives both times."""
    stepping = report["iteration_time_s"]
    blended = (1.0 - fraction) * stepping + fraction * skipped_iteration_s
    ratio = stepping / blended if blended > 0 else 0.0
    report["loss_scaler"] = {"skipped_steps_fraction": fraction, "step_iteration_time_s": stepping,
                             "skipped_iteration_time_s": skipped_iteration_s}
    report["iteration_time_s"] = blended
    report["tokens_per_s"] *= ratio
    report["mfu"] *= ratio
    return report


def build_report(scenario, cluster, workload, recipe, trace) -> dict:
    """The DESIGN.md report (plus extra keys) for a single-rank simulation."""
    rank_trace = trace.ranks[0]
    device = cluster.device
    warmup = scenario.run.warmup_iterations
    warnings: list[str] = []
    oom = rank_trace.oom
    workload.meta["accumulation_steps"] = recipe.accumulation_steps
    flops = model_flops(workload)
    start, end, iteration_time = measured_window(trace, warmup)
    phase_time, compute = span_sums(rank_trace.spans, start, end)
    iterations = max(1, len(trace.iteration_bounds_s) - warmup)
    for key in phase_time:
        phase_time[key] /= iterations
    compute /= iterations
    comm_total = comm_exposed = 0.0
    communication = getattr(trace, "communication", {}).get(rank_trace.rank)
    if communication is not None and end > start:
        comm_total, comm_exposed = communication.between(start, end)
        comm_total /= iterations
        comm_exposed /= iterations
    offload_traffic = host_compute = offload_exposed = 0.0
    if communication is not None and end > start:
        offload_traffic, host_compute, offload_exposed = (value / iterations for value in
                                                          communication.offload_between(start, end))
    # Idle: neither computing nor waiting on communication or offload that compute does not hide (pipeline bubbles).
    idle = max(0.0, iteration_time - compute - comm_exposed - offload_exposed)
    tokens = recipe.micro_batch_size * recipe.accumulation_steps * scenario.parallel.dp * scenario.model.seq_length
    tokens_per_s = tokens / iteration_time if iteration_time > 0 else 0.0
    peak = peak_flop_rate(device, scenario.training.precision)
    mfu = flops / iteration_time / peak if iteration_time > 0 else 0.0
    reserved_total = rank_trace.peak_reserved + cluster.context_bytes
    fits = oom is None and reserved_total <= device.memory_bytes
    if oom is not None:
        warnings.append(f"out of memory in {oom.op} allocating {oom.tensor} ({oom.requested_bytes} bytes); "
                        f"the run continued without a limit, so the peaks show what the job needs")
        fraction = getattr(scenario.allocator, "memory_fraction", 1.0)
        if fraction < 1.0:
            warnings.append(f"allocator.memory_fraction = {fraction!r} caps the caching allocator at "
                            f"{cluster.allocator_capacity_bytes} bytes of {device.memory_bytes} "
                            f"(torch.cuda.set_per_process_memory_fraction); the rest of the card stays unused")
    elif reserved_total > 0.95 * device.memory_bytes:
        warnings.append("peak reserved memory is within 5% of the device capacity")
    dts = workload.meta.get("dtypes")
    if scenario.model.share_layers and scenario.training.recompute != "none" and getattr(dts, "autocast", None):
        warnings.append("model.share_layers with autocast and training.recompute: torch casts the shared weights "
                        "again in every recomputed layer (each with its own backward); memsim replays one cast, "
                        "and under-predicts (-2.2% on a measured LLaMA case, docs/validation.md)")
    if scenario.parallel.zero_stage and scenario.parallel.dp == 1 and not recipe.offload:
        warnings.append("parallel.zero_stage has no effect with dp = 1 (nothing to shard across)")
    if scenario.parallel.prefetch_bucket_size != 50_000_000 and scenario.parallel.offload_params == "none":
        warnings.append("parallel.prefetch_bucket_size has no effect without parallel.offload_params (it times the "
                        "fetches of offloaded parameters)")
    if scenario.cluster.host_memory is not None and not recipe.offload:
        warnings.append("cluster.host_memory has no effect without offload (nothing is kept in host memory)")
    rank = {
        "rank": 0, "stage": 0, "device": device.name,
        "peak_allocated_bytes": int(rank_trace.peak_allocated),
        "peak_reserved_bytes": int(rank_trace.peak_reserved),
        "capacity_bytes": int(device.memory_bytes),
        "context_bytes": int(cluster.context_bytes),
        "oom": oom is not None,
        "breakdown_at_peak": {c: int(rank_trace.breakdown_at_peak.get(c, 0)) for c in CATEGORIES},
        "category_peaks": {c: int(rank_trace.category_peaks.get(c, 0)) for c in CATEGORIES},
        "peak_op": rank_trace.peak_op,
        "compute_s": compute, "exposed_communication_s": comm_exposed, "idle_s": idle,
        "exposed_offload_s": offload_exposed,
        "host_peak_bytes": 0, "host_pinned_bytes": 0, "nvme_peak_bytes": 0, "host_capacity_bytes": None,
    }
    return {
        "scenario": scenario.name,
        "fits": fits,
        "iteration_time_s": iteration_time,
        "tokens_per_s": tokens_per_s,
        "model_flops_per_iteration": flops,
        "mfu": mfu,
        "bubble_fraction": 0.0,
        "communication": {"total_s": comm_total, "exposed_s": comm_exposed},
        "ranks": [rank],
        "warnings": warnings,
        "device": device.name,
        "precision": scenario.training.precision,
        "framework": scenario.training.framework,
        "allocator": cluster.allocator_kind,
        "model": {"name": scenario.model.preset or scenario.model.architecture,
                  "parameters": int(workload.parameter_count),
                  **({"trainable_parameters": int(workload.meta["trainable_parameters"])}
                     if "trainable_parameters" in workload.meta else {})},
        "time_breakdown": {**phase_time, "exposed_communication_s": comm_exposed, "idle_s": idle,
                           "offload_traffic_s": offload_traffic, "host_compute_s": host_compute,
                           "exposed_offload_s": offload_exposed},
        "offload": None,
        "host_memory": [],
        "oom": None if oom is None else {
            "op": oom.op, "tensor": oom.tensor, "requested_bytes": oom.requested_bytes,
            "allocated_bytes": oom.allocated_bytes, "reserved_bytes": oom.reserved_bytes,
            "capacity_bytes": oom.capacity_bytes,
            "live_by_category": dict(oom.live_by_category),
            "largest_live": [[name, size] for name, size in oom.largest_live]},
    }


class _StageFlops:
    """The two attributes `model_flops` reads, for one pipeline stage's workload (all its chunks)."""

    def __init__(self, workloads) -> None:
        self.first_microbatch = [op for w in workloads for op in _ops(w.microbatches[0])]
        self.later_microbatch = [op for w in workloads if len(w.microbatches) > 1 for op in _ops(w.microbatches[1])]
        self.parameter_count = sum(w.parameter_count for w in workloads)
        self.meta: dict[str, object] = {}


def _ops(microbatch) -> tuple:
    """A stage micro-batch's forward, backward and (zero-bubble split) weight-gradient ops."""
    return microbatch.forward + microbatch.backward + microbatch.weight


def build_multi_report(scenario, cluster, plan, programs, workloads, recipe, trace, offload=None) -> dict:
    """The DESIGN.md report for a multi-rank simulation: one representative rank per pipeline stage.

    `bubble_fraction` is the idle share of the busiest stage (the most compute); `communication` and
    the model FLOPs (summed over stages, times tp × dp: the whole job's) come from the stage reports;
    MFU is over all dp × tp × pp GPUs. `offload`: report.offload.OffloadSummary of an offloading run (host
    memory per rank and node, bytes per route), whose host memory must fit too.
    """
    import copy

    per_rank = []
    flops_total = 0.0
    for program, rank_trace in zip(programs, trace.ranks):
        view = copy.copy(trace)
        view.ranks = [rank_trace]
        if plan.pp == 1:
            workload = workloads[0]
        else:
            workload = _StageFlops([w for (stage, _), w in sorted(workloads.items()) if stage == program.stage])
        report = build_report(scenario, cluster, workload, recipe, view)
        report["ranks"][0]["rank"] = program.rank
        report["ranks"][0]["stage"] = program.stage
        report["ranks"][0]["parameters"] = int(workload.parameter_count)   # this rank's shard
        per_rank.append(report)
        flops_total += report["model_flops_per_iteration"]
    head = dict(per_rank[0])
    ranks = [r["ranks"][0] for r in per_rank]
    busiest = max(range(len(ranks)), key=lambda k: (ranks[k]["compute_s"], -k))
    iteration_time = head["iteration_time_s"]
    flops = flops_total * plan.tp * plan.dp
    world = plan.dp * plan.tp * plan.pp
    peak = peak_flop_rate(cluster.device, scenario.training.precision)
    warnings = []
    for r in per_rank:
        for w in r["warnings"]:
            if w not in warnings:
                warnings.append(w)
    warnings += [w for w in plan.warnings if w not in warnings]
    oom = next((r["oom"] for r in per_rank if r["oom"] is not None), None)
    head.update({
        "fits": all(r["fits"] for r in per_rank),
        "model_flops_per_iteration": flops,
        "mfu": flops / iteration_time / (peak * world) if iteration_time > 0 else 0.0,
        "bubble_fraction": ranks[busiest]["idle_s"] / iteration_time if iteration_time > 0 else 0.0,
        "communication": {"total_s": max(r["communication"]["total_s"] for r in per_rank),
                          "exposed_s": max(r["communication"]["exposed_s"] for r in per_rank)},
        "ranks": ranks,
        "warnings": warnings,
        "oom": oom,
        "parallel": {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "virtual_stages": plan.virtual_stages,
                     "schedule": scenario.parallel.schedule, "world_size": world},
        "stages": [{"stage": span.stage, "chunk": span.chunk, "layers": [span.start, span.stop]}
                   for span in plan.stages],
    })
    from simulator.scenario_shape import model_shape
    from simulator.workload.transformer import model_parameter_count

    head["model"] = dict(head["model"], parameters=model_parameter_count(model_shape(scenario, padded=False)))
    if offload is not None:
        offload.fill(head, scenario)
    return head
