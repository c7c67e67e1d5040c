"""The public entry points: build a scenario's programs, simulate them, summarize into a Result."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from simulator import lifetime
from simulator.engine.allocator import make_allocator
from simulator.engine.executor import EngineOptions, simulate_programs
from simulator.engine.memory_worker import MAX_CHOSEN_WORKERS
from simulator.errors import MemsimError, PlanError
from simulator.hardware.attention_backend import with_attention_backend
from simulator.hardware.catalog import DeviceSpec
from simulator.parallel.host_issue import run_device
from simulator.parallel.lower import lower_single_rank
from simulator.report.error_bars import iteration_interval
from simulator.report.metrics import blend_skipped_steps, build_report, measured_window
from simulator.scenario import Scenario
from simulator.scenario_shape import model_shape  # noqa: F401  (explore and callers import it from here)
from simulator.topology import Cluster, resolve_cluster
from simulator.trace.records import Trace
from simulator.workload.compression import Compression, check_compression
from simulator.workload.loss_scaler import check_loss_scale, skipped_step
from simulator.workload.primitives import KernelProfile
from simulator.workload.peft import LoraConfig, check_peft, resolve_targets
from simulator.workload.sparsity import check_sparsity
from simulator.offload.apply import build_iteration
from simulator.workload.training import IterationWorkload, Recipe

if TYPE_CHECKING:
    from simulator.parallel.plan import ParallelPlan


@dataclass
class Result:
    """A simulation's outcome: the JSON report (DESIGN.md contract) and the full trace."""

    report: dict
    trace: Trace
    scenario: Scenario
    plan: ParallelPlan | None = None     # the parallel plan of a multi-rank simulation


def kernel_profile(device: DeviceSpec) -> KernelProfile:
    """What the device's kernels save (dropout mask dtype, flash attention with dropout)."""
    return KernelProfile(dropout_mask_dtype=device.dropout_mask_dtype,
                         flash_with_dropout=device.sdpa_flash_with_dropout, device_kind=device.kind,
                         library_workspace_bytes=device.cublas_workspace_bytes,
                         backward_workspace_bytes=device.backward_workspace_bytes,
                         sm_count=device.sm_count if device.kind == "gpu" else 0,
                         max_threads_per_sm=device.max_threads_per_sm)


# Frameworks whose Adam on a GPU is a fused multi-tensor kernel: Megatron-LM's megatron/core/optimizer imports
# Transformer Engine's FusedAdam, else apex's (torch's AdamW only when neither is installed); DeepSpeed builds its
# FusedAdam unless the config asks for torch_adam or offloads the optimizer.
FUSED_ADAM_FRAMEWORKS = ("megatron", "deepspeed")


def recipe_for(scenario: Scenario, device: DeviceSpec) -> Recipe:
    """Resolve the training options (optimizer implementation 'auto' = what torch picks there, or the framework's
    fused Adam: FUSED_ADAM_FRAMEWORKS)."""
    t = scenario.training
    implementation = t.optimizer_implementation
    if implementation == "auto":
        if t.optimizer == "adam-8bit" or (t.framework in FUSED_ADAM_FRAMEWORKS and t.optimizer == "adamw"
                                          and device.kind == "gpu"):
            implementation = "fused"
        else:
            implementation = "foreach" if device.optimizer_foreach else "single-tensor"
    accumulation = t.global_batch_size // (t.micro_batch_size * scenario.parallel.dp)
    return Recipe(t.micro_batch_size, accumulation, t.precision, t.framework, t.optimizer,
                  implementation, t.recompute, t.activation_compression, loss_scale=t.loss_scale,
                  skipped_steps_fraction=t.skipped_steps_fraction, lora=lora_config(scenario))


def lora_config(scenario: Scenario) -> LoraConfig:
    """training.peft and the lora_* keys resolved against the model's block linears (refusals name the file)."""
    t, m = scenario.training, scenario.model
    if t.peft == "none":
        return LoraConfig()
    try:
        targets = resolve_targets(t.lora_target_modules, m.architecture, m.activation)
    except PlanError as error:
        raise PlanError(f"{scenario.source}: {error}") from None
    return LoraConfig(t.peft, t.lora_rank, t.lora_alpha, targets, t.lora_dropout)


def _check_peft(scenario: Scenario, device: DeviceSpec) -> None:
    """Refuse LoRA / QLoRA combinations memsim does not simulate (workload/peft.py), with the file."""
    config = lora_config(scenario)
    if not config.enabled:
        return
    from simulator.offload.config import offloading

    t, p, m = scenario.training, scenario.parallel, scenario.model
    h, kvd = m.hidden_size, m.num_kv_heads * m.head_dim
    dims = {"q": (h, h), "k": (kvd, h), "v": (kvd, h), "o": (h, h), "qkv": (h + 2 * kvd, h),
            "gate": (m.ffn_hidden_size, h), "up": (m.ffn_hidden_size, h), "down": (h, m.ffn_hidden_size),
            "fc1": (m.ffn_hidden_size, h), "fc2": (h, m.ffn_hidden_size)}
    try:
        check_peft(config, precision=t.precision, framework=t.framework, tp=p.tp, pp=p.pp, zero_stage=p.zero_stage,
                   offloading=offloading(scenario), compression=p.gradient_compression, sparsity=t.sparsity,
                   shared_layers=m.share_layers, device_kind=device.kind, device=device.name,
                   shapes={key: dims[key] for key in config.targets})
    except PlanError as error:
        raise PlanError(f"{scenario.source}: {error}") from None


def _check_plan(scenario: Scenario, multi: bool = False) -> None:
    p = scenario.parallel
    src = scenario.source
    m = scenario.model
    if m.architecture != "llama" and m.num_kv_heads != m.num_attention_heads:
        raise PlanError(f"{src}: model.num_kv_heads = {m.num_kv_heads}: architecture {m.architecture!r} "
                        f"has no grouped-query attention; it must equal model.num_attention_heads = "
                        f"{m.num_attention_heads}")
    if m.architecture == "resnet":
        _check_resnet(scenario)
    if m.architecture == "dlrm":
        _check_dlrm(scenario)
    recompute = scenario.training.recompute
    if recompute.startswith("segments:") and int(recompute.split(":")[1]) > m.num_layers:
        raise PlanError(f"{src}: training.recompute = {recompute!r}: more segments than "
                        f"model.num_layers = {m.num_layers}")
    if m.attention == "linformer" and p.tp > 1:
        raise PlanError(f"{src}: model.attention = 'linformer' with parallel.tp = {p.tp}: Megatron-LM's tensor "
                        f"parallelism has no Linformer layer; allowed: tp = 1")
    if m.share_layers and p.pp > 1:
        raise PlanError(f"{src}: model.share_layers = true with parallel.pp = {p.pp}: the shared layer's parameters "
                        f"would live on every pipeline stage with their gradients summed across stages, which is "
                        f"not simulated; allowed: pp = 1")
    for key in ("tp", "pp", "dp"):
        value = getattr(p, key)
        if value != 1 and not multi:
            raise PlanError(f"{src}: parallel.{key} = {value}: this version simulates one device "
                            f"(tp = pp = dp = 1); multi-device plans are not available yet")
    if multi and p.pp > 1 and p.dp > 1 and p.zero_stage > 1:
        raise PlanError(f"{src}: parallel.zero_stage = {p.zero_stage}: ZeRO-2/3 with parallel.pp = {p.pp} > 1 is "
                        f"not supported: gradients or parameters sharded across micro-batches conflict with "
                        f"pipeline gradient accumulation (DeepSpeed's PipelineEngine refuses it too); "
                        f"allowed with pp > 1: 0, 1")
    try:
        check_compression(Compression.parse(p.gradient_compression, p.gradient_compression_stage), dp=p.dp,
                          zero_stage=p.zero_stage, framework=scenario.training.framework,
                          precision=scenario.training.precision, optimizer=scenario.training.optimizer)
        t = scenario.training
        check_loss_scale(t.precision, t.framework, t.loss_scale, t.skipped_steps_fraction)
    except PlanError as error:
        raise PlanError(f"{src}: {error}") from None
    from simulator.offload.config import check_offload
    from simulator.scenario.size import check_size

    check_size(scenario)
    t = scenario.training
    check_offload(scenario, t.global_batch_size // (t.micro_batch_size * p.dp))


def _check_resnet(scenario: Scenario) -> None:
    """Refuse what a ResNet does not have or memsim does not simulate for it (workload/resnet.py), in one line."""
    t, src = scenario.training, scenario.source
    # parallel.tp and parallel.pp other than 1 are refused by the loader (data parallelism only).
    rules = (("training.recompute", t.recompute, t.recompute == "selective",
              "selective recompute checkpoints attention, which a ResNet has not; allowed: none, full, segments:N"),
             ("training.sparsity", t.sparsity, t.sparsity != "none",
              "2:4 sparsity is simulated for transformer MLP linears only; allowed: none"),
             ("training.attention_backend", t.attention_backend, t.attention_backend != "auto",
              "a ResNet has no attention; allowed: auto"),
             ("training.framework", t.framework, t.framework == "megatron",
              "Megatron-LM trains transformers; allowed for a resnet: torch, deepspeed"),
             ("training.precision", t.precision, t.precision == "fp8-mixed",
              "fp8 convolutions are not simulated; allowed for a resnet: fp32, fp16-mixed, bf16-mixed, bf16"))
    for key, value, broken, rule in rules:
        if broken:
            raise PlanError(f"{src}: {key} = {value!r} with model.architecture = 'resnet': {rule}")


def _check_dlrm(scenario: Scenario) -> None:
    """Refuse what is not simulated for a DLRM (workload/dlrm.py), in one line."""
    m, t, p, src = scenario.model, scenario.training, scenario.parallel, scenario.source
    host = m.embedding_placement == "host"
    rules = (("training.precision", t.precision, t.precision != "fp32",
              "a DLRM is simulated in fp32 (dlrm_s_pytorch's default); allowed: fp32"),
             ("training.recompute", t.recompute, t.recompute != "none", "a DLRM is not checkpointed; allowed: none"),
             ("training.framework", t.framework, t.framework != "torch", "allowed for a dlrm: torch"),
             ("training.sparsity", t.sparsity, t.sparsity != "none", "allowed for a dlrm: none"),
             ("training.attention_backend", t.attention_backend, t.attention_backend != "auto",
              "a DLRM has no attention; allowed: auto"),
             ("training.optimizer", t.optimizer, host and t.optimizer not in ("sgd", "adamw"),
              "the host updates the looked-up rows as torch's sparse SGD or SparseAdam does; allowed with "
              "model.embedding_placement = 'host': sgd, adamw"),
             ("parallel.dp", p.dp, host and p.dp != 1,
              "host-resident tables shared by data-parallel ranks are not simulated; allowed with "
              "model.embedding_placement = 'host': 1"),
             ("parallel.offload_activations", p.offload_activations, p.offload_activations != "none",
              "allowed for a dlrm: none"),
             ("parallel.offload_optimizer", p.offload_optimizer, p.offload_optimizer != "none",
              "allowed for a dlrm: none (model.embedding_placement = 'host' puts the tables and their update on the "
              "host)"))
    for key, value, broken, rule in rules:
        if broken:
            raise PlanError(f"{src}: {key} = {value!r} with model.architecture = 'dlrm': {rule}")


def _check_device_options(scenario: Scenario, device: DeviceSpec) -> None:
    """Refuse options the resolved device cannot run (2:4 sparsity without sparse tensor cores, an attention backend
    it has no rate for, CUDA graphs off a GPU or where the step cannot be captured), with the file."""
    _run_device(scenario, device)
    _check_peft(scenario, device)
    m, h = scenario.model, scenario.model.hidden_size
    shapes = [(m.ffn_hidden_size, h), (h, m.ffn_hidden_size)]
    try:
        check_sparsity(scenario.training.sparsity, precision=scenario.training.precision, tp=scenario.parallel.tp,
                       device=device.name, speedup=device.sparse_gemm_speedup, mlp_shapes=shapes)
    except PlanError as error:
        raise PlanError(f"{scenario.source}: {error}") from None


def _run_device(scenario: Scenario, device: DeviceSpec) -> DeviceSpec:
    """The cluster's device as the run's kernels see it: the attention backend's rate, no host launch cost under CUDA
    graphs (refusals name the key)."""
    t = scenario.training
    device = with_attention_backend(device, t.attention_backend, scenario.model.attention, t.precision,
                                    scenario.source)
    return run_device(scenario, device)


def build_workload(scenario: Scenario, device: DeviceSpec) -> IterationWorkload:
    """The iteration workload of the scenario's (single) rank."""
    return build_iteration(model_shape(scenario), recipe_for(scenario, device), kernel_profile(device))


def simulate(scenario: Scenario, *, timelines: bool = True, events: bool = True,
             memory_workers: int | None = None, shortcuts: bool = True) -> Result:
    """Simulate a scenario and summarize it (the job not fitting is a result, not an error).

    `timelines` False: keep no memory samples (`Result.trace.ranks[k].memory` is empty). The report does not
    read them, only the memory plot and the Chrome trace's counters do; at GPT-3 175B on 1,024 GPUs keeping
    them costs a fifth of the run. Every other result is the same either way (tests/test_stretches.py).
    `events` False: keep no allocator events whatever `run.record_events` says (`allocator_events` is empty);
    only the memory snapshot reads them, and the report is the same byte for byte (tests/test_outputs_asked.py).
    `memory_workers`: processes making the memory calls while the engine runs (0: in this process; None:
    chosen by the run's size and the cores available: simulator/engine/memory_worker.py). Results are the same.
    `shortcuts` False: none of the exact shortcuts of docs/engine.md (run-ahead, rank lookahead, inlined
    collectives, repeated periods, repeated stretches, overlapped copies made from a template): every
    instruction simulated one simpy step at a time, every memory call made on the allocator. Results are the
    same byte for byte (tests/test_shortcuts_off.py); it exists to show that.
    """
    p = scenario.parallel
    if p.dp * p.tp * p.pp > 1 or _names_topology(scenario):
        _check_plan(scenario, multi=True)
        return simulate_multi(scenario, timelines=timelines, events=events, memory_workers=memory_workers,
                              shortcuts=shortcuts)
    _check_plan(scenario)
    cluster = resolve_cluster(scenario)
    _check_device_options(scenario, cluster.device)
    device = _run_device(scenario, cluster.device)
    recipe = recipe_for(scenario, device)
    workload = build_iteration(model_shape(scenario), recipe, kernel_profile(device))
    program = lower_single_rank(workload, device, scenario.run.warmup_iterations, scenario.run.iterations,
                                recipe.accumulation_steps)
    trace = simulate_programs([program], [_allocator(scenario, cluster, events)],
                              [cluster.allocator_capacity_bytes],
                              _engine_options(timelines, memory_workers, shortcuts))
    report = build_report(scenario, cluster, workload, recipe, trace)
    fraction = scenario.training.skipped_steps_fraction
    if fraction > 0:
        skipping = dataclasses.replace(workload, optimizer=skipped_step(workload.optimizer))
        program = lower_single_rank(skipping, device, scenario.run.warmup_iterations, scenario.run.iterations,
                                    recipe.accumulation_steps)
        skipped = simulate_programs([program], [_allocator(scenario, cluster, False)],
                                    [cluster.allocator_capacity_bytes],
                                    _engine_options(False, memory_workers, shortcuts))
        blend_skipped_steps(report, measured_window(skipped, scenario.run.warmup_iterations)[2], fraction)
    report.update(iteration_interval(report, scenario, cluster, trace))
    return Result(report, trace, scenario)


def _allocator(scenario: Scenario, cluster, events: bool = True):
    """A fresh allocator model for one rank of `scenario` on `cluster` (events kept if both `events` and
    run.record_events ask for them)."""
    return make_allocator(cluster.allocator_kind, cluster.allocator_capacity_bytes,
                          max_split_size_bytes=scenario.allocator.max_split_size,
                          roundup_power2_divisions=scenario.allocator.roundup_power2_divisions,
                          expandable_segments=scenario.allocator.expandable_segments,
                          record_events=scenario.run.record_events and events)


def _names_topology(scenario: Scenario) -> bool:
    """Whether cluster.topology names a topology (bundled or a file) rather than a catalog device, or offload asks
    for one: such runs take the multi-rank path, whose network carries the offload traffic."""
    from simulator.hardware.catalog import get_device
    from simulator.network.topology import list_topologies
    from simulator.offload.config import offloading

    name = scenario.cluster.topology
    try:
        get_device(name)
    except MemsimError:
        return name in list_topologies() or name.endswith(".toml")
    return offloading(scenario)


def multi_recipe(scenario: Scenario, device: DeviceSpec, topology=None) -> Recipe:
    """recipe_for plus the parallel options (tp, sequence parallelism, dp, ZeRO, bucket size) and, on `topology`,
    the offload options (DeepSpeed's ZeRO with offload runs on one GPU too: zero_stage is kept at dp = 1)."""
    from simulator.offload.config import offload_config

    p = scenario.parallel
    offload = offload_config(scenario, topology, p.dp * p.tp * p.pp) if topology is not None else None
    zero = p.zero_stage if p.dp > 1 or (offload is not None and offload.optimizer != "none") else 0
    return dataclasses.replace(recipe_for(scenario, device), tp=p.tp, sequence_parallel=p.sequence_parallel and p.tp > 1,
                               dp=p.dp, zero_stage=zero, bucket_size_bytes=int(p.bucket_size), offload=offload,
                               gradient_compression=p.gradient_compression,
                               compression_stage=p.gradient_compression_stage)


def _engine_options(timelines: bool, memory_workers: int | None, shortcuts: bool = True) -> EngineOptions:
    """The engine's options for `simulate(..., timelines, memory_workers, shortcuts)`."""
    options = EngineOptions() if shortcuts else EngineOptions(run_ahead=False, rank_lookahead=False,
                                                               send_lookahead=False, inline_collectives=False,
                                                               repeats=False, stretches=False)
    if memory_workers is not None:
        if isinstance(memory_workers, bool) or not isinstance(memory_workers, int) \
                or not 0 <= memory_workers <= MAX_CHOSEN_WORKERS:
            raise MemsimError(f"memory_workers = {memory_workers!r}: must be an integer in 0..{MAX_CHOSEN_WORKERS} "
                              f"(0: in this process)")
        options = dataclasses.replace(options, memory_workers=memory_workers)
    return options if timelines else dataclasses.replace(options, record_timeline=False)


def simulate_multi(scenario: Scenario, *, timelines: bool = True, events: bool = True,
                   memory_workers: int | None = None, shortcuts: bool = True) -> Result:
    """Simulate a dp × tp × pp plan on a multi-GPU cluster: one representative rank per pipeline stage
    (`run.full`: every rank; the report still lists the representatives). `timelines`, `events`: as for
    `simulate`; `shortcuts` too.

    With tp = pp = dp = 1 on a one-device cluster this gives the same result as `simulate`.
    Python's cyclic garbage collector is paused meanwhile: a cluster-scale run creates millions of
    objects that live until the end (ops, instructions, spans, memory samples), and each collection
    pass walks all of them (half the CPU time at GPT-3 175B on 1,024 GPUs; results are unaffected).
    """
    with lifetime.collector_paused():
        return _simulate_multi(scenario, timelines, events, memory_workers, shortcuts)


def check_scenario(scenario: Scenario) -> Cluster:
    """Raise the MemsimError `simulate(scenario)` would raise before it runs, without building or running anything.

    The same checks in the same order: the plan's rules, the cluster (device, topology, calibration, context),
    the parallel plan on the topology and the pipeline schedule. Cheap (milliseconds): sweeps call it on
    every point to list the invalid ones with the reason a run would give.

    Returns:
        The resolved `Cluster` (device, nodes, topology).
    """
    p = scenario.parallel
    if p.dp * p.tp * p.pp > 1 or _names_topology(scenario):       # the path `simulate` takes
        _check_plan(scenario, multi=True)
        return _multi_setup(scenario)[0]
    _check_plan(scenario)
    cluster = resolve_cluster(scenario)
    _check_device_options(scenario, cluster.device)
    return cluster


def _multi_setup(scenario: Scenario) -> tuple:
    """What a multi-rank simulation resolves before lowering: (cluster, topology, plan, recipe, schedule)."""
    from simulator.parallel.plan import make_plan
    from simulator.parallel.schedule_check import load_schedule
    from simulator.offload.config import offloading
    from simulator.parallel.overlap import resolve_overlap

    cluster = resolve_cluster(scenario)
    device = cluster.device
    _check_device_options(scenario, device)
    p = scenario.parallel
    if cluster.topology is None and p.dp * p.tp * p.pp > 1:
        _check_plan(scenario)        # a one-device cluster: the one-device refusal names the key
    if cluster.topology is None and offloading(scenario):
        raise PlanError(f"{scenario.source}: cluster.topology = {scenario.cluster.topology!r} is one device without "
                        f"host memory or PCIe links; offload needs a topology (one GPU: 'workstation-rtx4090')")
    topology = cluster.topology if cluster.topology is not None else load_topology_for(device)
    plan = make_plan(scenario, topology)
    overlap = resolve_overlap(scenario, nvlink=device.nvlink_bytes_per_s_per_direction > 0, plan=plan)   # refusals
    recipe = multi_recipe(scenario, device, cluster.topology)
    schedule = load_schedule(p.schedule, p.pp, recipe.accumulation_steps, p.virtual_stages,
                             blocking_sends=not overlap.overlap_p2p_comm)
    return cluster, topology, plan, recipe, schedule


def _simulate_multi(scenario: Scenario, timelines: bool, events: bool, memory_workers: int | None,
                    shortcuts: bool = True) -> Result:
    """simulate_multi's work, with the garbage collector paused."""
    from simulator.parallel.lower_multi import lower_multi
    from simulator.parallel.overlap import resolve_overlap
    from simulator.report.metrics import build_multi_report

    cluster, topology, plan, recipe, schedule = _multi_setup(scenario)
    device = _run_device(scenario, cluster.device)
    p = scenario.parallel
    shape, profile = model_shape(scenario), kernel_profile(device)
    workload = build_iteration(shape, recipe, profile) if p.pp == 1 else None
    full = scenario.run.full and plan.world_size > 1
    overlap = resolve_overlap(scenario, nvlink=device.nvlink_bytes_per_s_per_direction > 0, plan=plan)
    programs, workloads = lower_multi(shape, recipe, profile, plan, schedule, device,
                                      scenario.run.warmup_iterations, scenario.run.iterations, workload, full,
                                      overlap, templates=shortcuts)
    allocators = [_allocator(scenario, cluster, events) for _ in programs]
    trace = simulate_programs(programs, allocators, [cluster.allocator_capacity_bytes] * len(programs),
                              _engine_options(timelines, memory_workers, shortcuts), topology=topology, plan=plan)
    offload = None
    if recipe.offload is not None:
        from simulator.report.offload import OffloadSummary

        offload = OffloadSummary(scenario, cluster, plan, programs, trace, full)
    if full:
        # The report lists each stage's representative (dp = tp = 0), as the reduced simulation does.
        keep = [k for k, program in enumerate(programs)
                if plan.coords(program.rank).dp == 0 and plan.coords(program.rank).tp == 0]
        shown = dataclasses.replace(trace, ranks=[trace.ranks[k] for k in keep])
        report = build_multi_report(scenario, cluster, plan, [programs[k] for k in keep], workloads, recipe, shown,
                                    offload)
    else:
        shown = trace
        report = build_multi_report(scenario, cluster, plan, programs, workloads, recipe, trace, offload)
    fraction = scenario.training.skipped_steps_fraction
    if fraction > 0:
        # The same plan with every optimizer step skipped (the loss scaler's kernels only), simulated alone.
        skipping = dataclasses.replace(workload, optimizer=skipped_step(workload.optimizer)) if workload else None
        others, _ = lower_multi(shape, recipe, profile, plan, schedule, device, scenario.run.warmup_iterations,
                                scenario.run.iterations, skipping, full, overlap, skipped_steps=True,
                                templates=shortcuts)
        skipped = simulate_programs(others, [_allocator(scenario, cluster, False) for _ in others],
                                    [cluster.allocator_capacity_bytes] * len(others),
                                    _engine_options(False, memory_workers, shortcuts), topology=topology, plan=plan)
        blend_skipped_steps(report, measured_window(skipped, scenario.run.warmup_iterations)[2], fraction)
    report.update(iteration_interval(report, scenario, cluster, shown))
    lifetime.keep(programs, workloads)
    return Result(report, trace, scenario, plan)


def load_topology_for(device: DeviceSpec):
    """A one-GPU topology for `device` (the multi-rank path on a one-device cluster has no communication)."""
    return _OneGpu(device)


@dataclass(frozen=True)
class _OneGpu:
    """The minimal topology make_plan needs for a one-device cluster."""

    device: DeviceSpec
    num_gpus: int = 1
    gpus_per_node: int = 1
    nodes: int = 1

    @property
    def name(self) -> str:
        return self.device.name

    @property
    def gpu_device(self) -> DeviceSpec:
        return self.device
