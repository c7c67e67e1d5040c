"""Plan search: every plan of candidates.AXES for a scenario's model and global batch on N GPUs, checked as a run
checks it, estimated (estimate.py), and the best K verified by the full simulation.

    from simulator.explore.search import search_plans
    found = search_plans(scenario, gpus=1024, topology="dgx-a100")
    found.verified[0].report          # the simulated report of the fastest plan that fits
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from simulator.errors import MemsimError, ScenarioError, TopologyError
from simulator.explore.assemble import Caches
from simulator.explore.candidates import AXES, Axis, Context, Settings, enumerate_plans, overrides
from simulator.explore.estimate import replayed_until_fit
from simulator.explore.spread import drop_worker_caches, estimate_shares, plan_weight, replayed_shares, rule
from simulator.scenario import Scenario
from simulator.scenario.loader import read_scenario_document, scenario_from_dict

INVALID, NO_FIT, FITS, UNKNOWN = "invalid", "does-not-fit", "fits", "estimate-leaves-out"


@dataclass(frozen=True)
class Candidate:
    """One plan: its settings, and its estimate or why it was set aside.

    Attributes:
        settings: (scenario key, value) pairs, e.g. (("parallel.tp", 8), ...); `overrides` gives them as
            `memsim run --set` arguments.
        verdict: INVALID (a run refuses it: `reason` is the one-line error), NO_FIT (the estimate does not fit:
            `reason` says by how much), FITS, UNKNOWN (the estimate leaves out what the plan does, e.g. offload:
            `reason` says what; only a simulation can judge it).
        estimate: the estimated report (None when invalid).
        reason: why it was set aside, or None.
    """

    settings: Settings
    verdict: str
    estimate: dict | None = None
    reason: str | None = None

    @property
    def overrides(self) -> list[str]:
        return overrides(self.settings)

    @property
    def label(self) -> str:
        """The settings in short: tp8 pp16 dp8 mb1 1f1b v1 full zero1 sp."""
        s = dict(self.settings)
        parts = [f"tp{s.get('parallel.tp')}", f"pp{s.get('parallel.pp')}", f"dp{s.get('parallel.dp')}",
                 f"mb{s.get('training.micro_batch_size')}", str(s.get("parallel.schedule"))]
        if s.get("parallel.virtual_stages", 1) != 1:
            parts.append(f"v{s['parallel.virtual_stages']}")
        parts += [f"rc-{s.get('training.recompute')}", f"zero{s.get('parallel.zero_stage')}"]
        if s.get("parallel.sequence_parallel"):
            parts.append("sp")
        for key, value in self.settings:
            if key in _OFFLOAD:
                if value != "none":
                    parts.append(f"offload-{_OFFLOAD[key]}-{value}")
            elif key not in _LABELLED:
                parts.append(f"{key.split('.')[-1]}={value}")
        return " ".join(parts)


_LABELLED = {"parallel.tp", "parallel.pp", "parallel.dp", "training.micro_batch_size", "parallel.schedule",
             "parallel.virtual_stages", "training.recompute", "parallel.zero_stage", "parallel.sequence_parallel"}
_OFFLOAD = {"parallel.offload_optimizer": "opt", "parallel.offload_params": "params",
            "parallel.offload_activations": "act"}


@dataclass(frozen=True)
class Verified:
    """A top candidate run through the full simulation: its report, or the error the run raised."""

    candidate: Candidate
    report: dict | None
    error: str | None = None


@dataclass(frozen=True)
class PlanSearch:
    """The outcome of `search_plans`.

    Attributes:
        scenario: the scenario's name; gpus, topology, nodes: the cluster searched.
        candidates: every enumerated plan, in enumeration order.
        ranked: the candidates that fit, fastest estimate first: the first top_k by peak reserved (allocator
            replay), the rest by peak allocated (a necessary condition; their estimate has "reserved_replayed":
            False).
        verified: the best `top_k` of `ranked`, simulated, ordered by the simulation (fitting first, then
            iteration time); empty without verification.
        pruned: (reason, count) for the candidates set aside: each rule a run refuses, and "does not fit".
        seconds: (phase, seconds): enumerate (the axes' combinations), estimate (each plan built from the file and
            its overrides, checked and estimated without the allocator replay), replay (the allocator replay of the
            fastest until top_k fit), verify.
    """

    scenario: str
    gpus: int
    topology: str
    nodes: int
    candidates: tuple[Candidate, ...]
    ranked: tuple[Candidate, ...]
    verified: tuple[Verified, ...]
    pruned: tuple[tuple[str, int], ...]
    seconds: tuple[tuple[str, float], ...]

    @property
    def best(self) -> Verified | None:
        """The fastest verified plan that fits (None if none)."""
        return next((v for v in self.verified if v.report is not None and v.report["fits"]), None)


class InProcess:
    """The default executor: `map` runs in this process, in order."""

    def map(self, fn: Callable, items: Iterable) -> list:
        return [fn(item) for item in items]


# Verification runs without memory timelines and allocator events: neither is read by the report
# (tests/test_stretches.py for timelines; tests/test_plan_search.py checks the report is unchanged).
QUIET = ["run.record_events=false"]


def simulate_candidate(job: tuple) -> tuple[dict | None, str | None]:
    """Simulate one candidate (document, source, overrides[, memory workers]): (its report, None), or (None, the
    one-line reason) when the run fails. A module-level function so that process-pool and Dask executors can ship
    it. The memory workers (None: chosen by the run, engine/memory_worker.py) change no result."""
    from simulator.api import simulate

    document, source, settings, *rest = job
    drop_worker_caches()
    try:
        return simulate(scenario_from_dict(document, source, settings + QUIET), timelines=False,
                        events=False, memory_workers=rest[0] if rest else None).report, None
    except MemsimError as error:
        return None, rule(str(error), source)
    except Exception as error:          # noqa: BLE001
        # A failure inside the simulator is this candidate's, not the search's: reported with its reason.
        return None, f"the simulation failed: {type(error).__name__}: {error}"


def _document(scenario: Scenario | str | os.PathLike) -> tuple[dict, str]:
    source = scenario if isinstance(scenario, (str, os.PathLike)) else scenario.source
    source = os.fspath(source)
    if not os.path.isfile(source):
        raise ScenarioError(f"{source}: plan search needs the scenario's file (its candidates are that file with "
                            f"--set overrides, checked as `memsim run` checks them)")
    return read_scenario_document(source), source


def _verified_order(v: Verified) -> tuple:
    """Fitting first, then the rest that ran, then failures; each by iteration time (a stable sort keeps the
    estimate's order among equals)."""
    if v.report is None:
        return (2, 0.0)
    return (0 if v.report["fits"] else 1, v.report["iteration_time_s"])


def _shortfall(report: dict) -> str:
    worst = max(report["ranks"], key=lambda r: r["peak_reserved_bytes"] + r["context_bytes"] - r["capacity_bytes"])
    need = worst["peak_reserved_bytes"] + worst["context_bytes"]
    return (f"does not fit: stage {worst['stage']} needs {need / 2**30:.1f} GiB of {worst['capacity_bytes'] / 2**30:.1f}"
            f" GiB ({(need - worst['capacity_bytes']) / 2**30:+.1f} GiB)")


def verification_memory_workers(executor, jobs: int) -> int | None:
    """The memory workers of each verified simulation: none where a process pool of this machine already runs a
    simulation on every core (two GPT-3 175B / 1,024-GPU runs side by side on 2 cores: 21.3-22.0 s of wall with
    their workers, 17.3-19.8 s without, docs/explore.md); else the run's own choice (None)."""
    from simulator.explore.executors import ProcessExecutor, available_cores

    busy = isinstance(executor, ProcessExecutor) and min(executor.workers, jobs) >= available_cores()
    return 0 if busy else None


def simulation_order(settings: Sequence[Settings], global_batch: int) -> list[int]:
    """Indices of `settings`, heaviest simulation first, ties in the given order. A simulation's CPU grows with
    its schedule's size (spread.plan_weight: pp x micro-batches x virtual stages): the GPT-3 175B / 1,024 A100
    search's ten verified plans took 17-24 s (size 384) to 42-51 s (2,304) each (docs/explore.md)."""
    return sorted(range(len(settings)), key=lambda i: (-plan_weight(settings[i], global_batch), i))


def _spread(executor) -> bool:
    """Whether the estimates and replays go to the executor's workers (more than one, not in this process)."""
    return not getattr(executor, "in_process", True) and getattr(executor, "workers", 1) > 1


def search_plans(scenario: Scenario | str | os.PathLike, *, gpus: int, topology: str, nodes: int | None = None,
                 top_k: int = 10, verify: bool = True, executor=None,
                 progress: Callable[[str, int, int], None] | None = None,
                 axes: Sequence[Axis] = AXES, shortcuts: bool = True) -> PlanSearch:
    """Search the plans of `axes` for the scenario's model and global batch on `gpus` GPUs of `topology`.

    Args:
        scenario: a Scenario loaded from a file, or the file's path (candidates are the file with overrides).
        gpus: GPUs in all; a multiple of the topology's GPUs per node.
        topology: a topology name from topologies/ (or a path).
        nodes: servers (default gpus / GPUs per node; must agree with gpus).
        top_k: how many of the fastest fitting estimates to verify.
        verify: run the full simulation on the top_k.
        executor: an object with `map(fn, items)` (e.g. a process pool); default: this process.
        progress: called as progress(phase, done, total) while it works.
        axes: the plan axes (candidates.AXES).
        shortcuts: a plan whose peak allocated memory does not fit gets its memory numbers only (estimate_reports'
            memory_first: the same verdict, reason and memory keys, without its times). False: every plan is
            estimated in full (the same search otherwise; tests/test_plan_spread.py).

    Raises:
        MemsimError: an unknown topology, gpus not a multiple of its node, nodes disagreeing, no candidate
            valid, top_k < 1.
    """
    from simulator.network.topology import load_topology

    clock = time.perf_counter()
    document, source = _document(scenario)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise MemsimError(f"--gpus = {gpus!r}: must be a whole number of GPUs >= 1")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise MemsimError(f"--top = {top_k!r}: must be a whole number >= 1")
    try:
        one = load_topology(topology, nodes=1)
    except TopologyError as error:
        raise TopologyError(f"--topology = {topology!r}: {error}") from None
    per_node = one.gpus_per_node
    if gpus % per_node:
        raise MemsimError(f"--gpus = {gpus}: must be a multiple of the {per_node} GPUs per node of {topology!r}")
    if nodes is None:
        nodes = gpus // per_node
    elif nodes * per_node != gpus:
        raise MemsimError(f"--nodes = {nodes}: {nodes} x {per_node} GPUs per node of {topology!r} is not --gpus = {gpus}")
    base = scenario_from_dict(document, source, [f'cluster.topology="{topology}"', f"cluster.nodes={nodes}"])
    model = base.model
    context = Context(gpus, per_node, model.num_layers, model.num_attention_heads, model.num_kv_heads,
                      base.training.global_batch_size, base.training.framework,
                      optimizer=base.training.optimizer, precision=base.training.precision)
    fixed = [f'cluster.topology="{topology}"', f"cluster.nodes={nodes}"]
    settings_list = list(enumerate_plans(axes, context))
    candidates: list[Candidate | None] = [None] * len(settings_list)
    runner = executor if executor is not None else InProcess()
    enumerated = time.perf_counter()
    caches = Caches()
    # Peak allocated first (fast): a plan that does not fit by it does not fit at all (reserved >= allocated).
    # The allocator replay for peak reserved then runs on the plans that may fit, fastest first, until top_k
    # fit by it: the ranking and the plans verified are those a replay of every plan would give. Each plan is
    # built from the file with its overrides where it is estimated (spread.py: over the executor's workers).
    estimates: dict[int, object] = {}
    tick = None if progress is None else (lambda done: progress("estimate", done, len(settings_list)))
    for k, outcome in estimate_shares(runner, document, source, fixed, list(enumerate(settings_list)),
                                      base.training.global_batch_size, caches, tick, memory_first=shortcuts):
        estimates[k] = outcome
    replaying = time.perf_counter()
    may_fit = sorted((e["iteration_time_s"], k) for k, e in estimates.items()
                     if isinstance(e, dict) and e["fits"] and not e.get("leaves_out"))
    if _spread(runner):
        estimates.update(replayed_shares(runner, document, source, fixed,
                                         [(k, settings_list[k]) for _, k in may_fit], top_k))
    else:
        estimates.update(replayed_until_fit(
            ((k, scenario_from_dict(document, source, fixed + overrides(settings_list[k]))) for _, k in may_fit),
            top_k, caches))
    for k, settings in enumerate(settings_list):
        estimate = estimates[k]
        if not isinstance(estimate, dict):
            candidates[k] = Candidate(settings, INVALID, reason=estimate[1])
        elif estimate.get("leaves_out"):
            candidates[k] = Candidate(settings, UNKNOWN, estimate,
                                      "the estimate leaves out " + ", ".join(estimate["leaves_out"]))
        elif not estimate["fits"]:
            candidates[k] = Candidate(settings, NO_FIT, estimate, _shortfall(estimate))
        else:
            candidates[k] = Candidate(settings, FITS, estimate)
    estimated = time.perf_counter()
    done = tuple(c for c in candidates if c is not None)
    if not any(c.verdict != INVALID for c in done):
        reasons = sorted({c.reason for c in done})
        raise MemsimError(f"{source}: no valid plan on {gpus} GPUs of {topology!r} ({len(done)} candidates; "
                          f"e.g. {reasons[0] if reasons else 'none enumerated'})")
    ranked = tuple(c for _, _, c in sorted((c.estimate["iteration_time_s"], k, c) for k, c in enumerate(done)
                                           if c.verdict == FITS))
    verified: tuple[Verified, ...] = ()
    # Plans the estimate cannot judge (offload) are verified only where too few others fit: offload trades speed
    # for memory, so it matters when the GPU-only plans do not fit (their estimated time, offload's host traffic
    # left out, orders them).
    unknown = tuple(c for _, _, c in sorted((c.estimate["iteration_time_s"], k, c) for k, c in enumerate(done)
                                            if c.verdict == UNKNOWN))
    if verify and (ranked or unknown):
        top = ranked[:top_k] + unknown[:max(0, top_k - len(ranked))]
        workers = verification_memory_workers(runner, len(top))
        # Heaviest first, so that the last to finish are short (the pool hands each worker its next job as it
        # frees up); the results are put back in rank order before the sort.
        order = simulation_order([c.settings for c in top], base.training.global_batch_size)
        outcomes = runner.map(simulate_candidate, [(document, source, fixed + top[i].overrides, workers)
                                                   for i in order])
        by_rank = dict(zip(order, outcomes))
        results = []
        for i, candidate in enumerate(top):
            report, error = by_rank[i]
            results.append(Verified(candidate, report, error))
            if progress is not None:
                progress("verify", len(results), len(top))
        verified = tuple(sorted(results, key=_verified_order))
    counts: dict[str, int] = {}
    for c in done:
        if c.verdict in (INVALID, NO_FIT):
            key = "does not fit" if c.verdict == NO_FIT else c.reason
            counts[key] = counts.get(key, 0) + 1
    finished = time.perf_counter()
    return PlanSearch(base.name, gpus, topology, nodes, done, ranked, verified,
                      tuple(sorted(counts.items(), key=lambda item: (-item[1], item[0]))),
                      (("enumerate", enumerated - clock), ("estimate", replaying - enumerated),
                       ("replay", estimated - replaying),
                       ("verify", finished - estimated)))
