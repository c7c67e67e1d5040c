"""A scenario checked and resolved the way `simulate` does it, up to the point where a simulation would build
its programs: the same functions in the same order, so an invalid plan raises the same one-line MemsimError."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from simulator.api import (_check_device_options, _check_plan, _names_topology, _run_device, kernel_profile,
                           load_topology_for, model_shape, multi_recipe, recipe_for)
from simulator.errors import PlanError
from simulator.hardware.catalog import DeviceSpec
from simulator.parallel.overlap import NO_OVERLAP_CHANGE, OverlapOptions, resolve_overlap
from simulator.parallel.plan import INTERLEAVED, ParallelPlan, make_plan
from simulator.parallel.schedule_check import load_schedule
from simulator.parallel.schedules import SCHEDULE_NAMES, Schedule, by_name
from simulator.scenario import Scenario
from simulator.topology import Cluster, resolve_cluster
from simulator.workload.primitives import KernelProfile
from simulator.workload.training import Recipe, _check_data_parallel
from simulator.workload.transformer import Shape


@dataclass(frozen=True)
class Prepared:
    """What the estimate needs of one valid scenario."""

    scenario: Scenario
    cluster: Cluster
    device: DeviceSpec
    plan: ParallelPlan
    recipe: Recipe
    schedule: Schedule
    shape: Shape
    kernels: KernelProfile
    multi: bool                  # dp * tp * pp > 1 (the report has the multi-rank keys)
    overlap: OverlapOptions = NO_OVERLAP_CHANGE     # what the run overlaps (parallel/overlap.py)
    builtin: tuple | None = None  # (name, p, m, v) of a built-in schedule (its actions depend on nothing else)

    @property
    def topology(self):
        return self.cluster.topology


def prepare(scenario: Scenario, schedules=None, clusters=None, plans=None) -> Prepared:
    """Check `scenario` as `simulate(scenario)` does and resolve its cluster, plan, recipe and schedule, with the
    device as the run's kernels see it (attention backend, CUDA graphs: api._run_device) and the overlap switches.
    `schedules`: a memo (dict-like: get / setitem) of built-in schedules by (name, p, m, v) that the caller keeps
    (Caches.schedules, bounded); None builds the schedule. `clusters`: a dict the caller keeps of resolved clusters
    (`_cluster`); None resolves each. `plans`: a dict the caller keeps of parallel plans (`_plan`); None makes each.

    Raises:
        MemsimError: the error `simulate(scenario)` raises for it (same message).
    """
    p = scenario.parallel
    if scenario.model.architecture in ("resnet", "dlrm"):
        raise PlanError(f"{scenario.source}: model.architecture = {scenario.model.architecture!r}: the fast estimate "
                        f"extrapolates from repeated transformer layers; this model is simulated instead (memsim run, "
                        f"memsim sweep without --fast)")
    multi = p.dp * p.tp * p.pp > 1
    if not (multi or _names_topology(scenario)):
        _check_plan(scenario)
        cluster = _cluster(scenario, clusters)
        _check_device_options(scenario, cluster.device)
        device = _run_device(scenario, cluster.device)
        recipe = recipe_for(scenario, device)
        plan = ParallelPlan(dp=1, tp=1, pp=1, stages=_one_stage(scenario))
        schedule = by_name("1f1b", 1, recipe.accumulation_steps)
        return Prepared(scenario, cluster, device, plan, recipe, schedule, model_shape(scenario),
                        kernel_profile(device), False, builtin=("1f1b", 1, recipe.accumulation_steps, 1))
    # api._multi_setup's checks, in its order.
    _check_plan(scenario, multi=True)
    cluster = _cluster(scenario, clusters)
    _check_device_options(scenario, cluster.device)
    if cluster.topology is None and multi:
        _check_plan(scenario)
    from simulator.offload.config import offloading

    if cluster.topology is None and offloading(scenario):
        _multi_setup(scenario)          # raises its refusal (offload needs a topology)
    topology = cluster.topology if cluster.topology is not None else load_topology_for(cluster.device)
    plan = _plan(scenario, topology, plans)
    overlap = resolve_overlap(scenario, nvlink=cluster.device.nvlink_bytes_per_s_per_direction > 0, plan=plan)
    recipe = multi_recipe(scenario, cluster.device, cluster.topology)
    schedule = _schedule(p.schedule, p.pp, recipe.accumulation_steps, p.virtual_stages, schedules)
    if p.pp == 1:
        _check_data_parallel(recipe)       # what build_iteration checks first (pp > 1: _check_plan did)
    device = _run_device(scenario, cluster.device)
    builtin = ((p.schedule, p.pp, recipe.accumulation_steps, p.virtual_stages)
               if isinstance(p.schedule, str) and p.schedule in SCHEDULE_NAMES else None)
    return Prepared(scenario, cluster, device, plan, recipe, schedule, model_shape(scenario), kernel_profile(device),
                    multi, overlap, builtin)


def _cluster(scenario: Scenario, clusters) -> Cluster:
    """resolve_cluster(scenario), remembered in `clusters` by what it reads (the cluster and allocator tables,
    whether the plan is one GPU, the file named in messages): plans of one search differ in none of them, and
    resolving loads and parses the topology's files (tens of ms). A refusal raises each time."""
    if clusters is None:
        return resolve_cluster(scenario)
    p = scenario.parallel
    key = (scenario.source, scenario.cluster, scenario.allocator, p.dp * p.tp * p.pp == 1)
    found = clusters.get(key)
    if found is None:
        found = clusters[key] = resolve_cluster(scenario)
    return found


def _plan(scenario: Scenario, topology, plans) -> ParallelPlan:
    """make_plan(scenario, topology), remembered in `plans` by all it reads: the plan's degrees, placement,
    virtual stages and sequence parallelism, whether its schedule is the interleaved one or a file (the rules that
    name the schedule fail, and a failure is not remembered), the model's sizes the rules check, the file named in
    messages, and the topology's size and name. Plans differing only in recompute, ZeRO stage or a non-interleaved
    built-in schedule share one (its straddling-groups check walks every group of every axis)."""
    if plans is None:
        return make_plan(scenario, topology)
    p, model = scenario.parallel, scenario.model
    key = (getattr(scenario, "source", ""), p.dp, p.tp, p.pp, p.virtual_stages, p.placement, p.sequence_parallel,
           p.schedule == INTERLEAVED, p.schedule_is_file, model.num_attention_heads, model.num_kv_heads,
           model.ffn_hidden_size, model.num_layers, model.seq_length, topology.num_gpus, topology.gpus_per_node,
           topology.name, topology.nodes)
    found = plans.get(key)
    if found is None:
        found = plans[key] = make_plan(scenario, topology)     # a refusal raises and is not remembered
    return found


def _schedule(spec, p: int, m: int, v: int, schedules) -> Schedule:
    """load_schedule's schedule; a built-in one is built and validated once per (name, p, m, v) in `schedules`
    and shared (a Schedule is immutable and a built-in name's actions depend on nothing else). An action file is
    read each time."""
    if not (isinstance(spec, str) and spec in SCHEDULE_NAMES):
        return load_schedule(spec, p, m, v)
    key = (spec, p, m, v)
    found = schedules.get(key) if schedules is not None else None
    if found is None:
        found = load_schedule(spec, p, m, v)       # a refusal raises and is not remembered
        if schedules is not None:
            schedules[key] = found
    return found


def schedule_identity(prepared: Prepared) -> tuple:
    """What a plan's schedule's actions depend on, as a cache key: a built-in schedule's (name, p, m, v), else
    its actions (hashing every action of a long built-in schedule for each plan is what this avoids)."""
    if prepared.builtin is not None:
        return ("built-in",) + prepared.builtin
    return ("actions", prepared.schedule.name, prepared.schedule.ranks)


def _multi_setup(scenario: Scenario) -> None:
    from simulator.api import _multi_setup as setup

    setup(scenario)


def _one_stage(scenario: Scenario):
    from simulator.parallel.partition import partition_layers

    return partition_layers(scenario.model.num_layers, 1, 1)


def with_recipe(prepared: Prepared, **changes) -> Prepared:
    """`prepared` with recipe fields replaced (profiles record fewer micro-batches)."""
    return dataclasses.replace(prepared, recipe=dataclasses.replace(prepared.recipe, **changes))
