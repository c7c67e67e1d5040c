"""What would make a job fit: candidate changes to a scenario that does not fit, pruned with the fast estimate and
verified by the full simulation, cheapest first.

    from simulator.explore.fit import what_would_fit
    advice = what_would_fit("scenarios/showcase.toml", [], report)   # report: the run's, with "fits": False
    advice[0]["changes"]          # ['training.optimizer="adam-8bit"'], its simulated peak and time

Each change is a list of `--set` items (`memsim run FILE --set ...` reproduces it). Single changes come first:
recompute, a smaller micro-batch, pure 16-bit precision, 8-bit Adam, a higher ZeRO stage, ZeRO-Offload to the
host or NVMe, LoRA or QLoRA adapters, more GPUs; when none of them fits, pairs and then triples of changes along
different axes. The estimate (explore/estimate.py) ranks them; the best `verify` of those it says fit (and those it cannot estimate)
are simulated. What is reported is the simulation's answer, never the estimate's.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from simulator.errors import MemsimError
from simulator.explore.grid import toml_value
from simulator.scenario import Scenario
from simulator.scenario.loader import read_scenario_document, scenario_from_dict

DEFAULT_VERIFY = 3            # simulations spent on the advice of one run
MAX_COMBINED = 3              # changes stacked at most (recompute + 8-bit Adam + offload, say)
_QUIET_RUN = ("run.record_events=false",)   # allocator events are not in the report: verification skips them


@dataclass(frozen=True)
class Change:
    """One change to a scenario: what it is called, which axis it moves, its `--set` items, and the GPUs it uses."""

    label: str
    axis: str
    sets: tuple[str, ...]
    gpus: int


def _set(key: str, value: object) -> str:
    return f"{key}={toml_value(value)}"


class Bundled:
    """The bundled topologies, (name, Topology) each, read on first use and then kept: one per single_changes call
    (two generators look through them; a later call reads the files again, as one may have changed meanwhile)."""

    def __init__(self) -> None:
        self._loaded: list | None = None

    def topologies(self) -> list:
        if self._loaded is None:
            from simulator.network.topology import list_topologies, load_topology

            self._loaded = [(name, load_topology(name)) for name in list_topologies()]
        return self._loaded


def _recompute(s: Scenario, gpus: int, bundled: Bundled) -> list[Change]:
    modes = {"none": ("selective", "full"), "selective": ("full",)}.get(s.training.recompute, ())
    if s.training.recompute.startswith("segments:"):
        modes = ("full",)
    return [Change(f"{mode} recompute", "recompute", (_set("training.recompute", mode),), gpus) for mode in modes]


def _micro_batch(s: Scenario, gpus: int, bundled: Bundled) -> list[Change]:
    t = s.training
    sizes = []
    size = t.micro_batch_size // 2
    while size >= 1:
        if t.global_batch_size % (size * s.parallel.dp) == 0:
            sizes.append(size)
        size //= 2
    return [Change(f"micro-batch {size} (gradient accumulation keeps the global batch)", "micro_batch",
                   (_set("training.micro_batch_size", size),), gpus) for size in sizes]


def _precision(s: Scenario, gpus: int, bundled: Bundled) -> list[Change]:
    if s.training.precision in ("fp32", "bf16-mixed", "fp16-mixed"):
        return [Change("pure bf16 (weights, gradients and Adam states in bf16)", "precision",
                       (_set("training.precision", "bf16"),), gpus)]
    return []


def _optimizer(s: Scenario, gpus: int, bundled: Bundled) -> list[Change]:
    if s.training.optimizer == "adamw":
        return [Change("8-bit Adam (bitsandbytes)", "optimizer", (_set("training.optimizer", "adam-8bit"),), gpus)]
    return []


def _zero(s: Scenario, gpus: int, bundled: Bundled) -> list[Change]:
    p = s.parallel
    if p.dp == 1:
        return []
    highest = 1 if p.pp > 1 else 3
    return [Change(f"ZeRO stage {stage}", "zero", (_set("parallel.zero_stage", stage),), gpus)
            for stage in range(p.zero_stage + 1, highest + 1)]


def _one_gpu_topology(s: Scenario, bundled: Bundled) -> str | None:
    """A bundled one-GPU topology (host memory, PCIe, drives) of the scenario's device, for offload on one card."""
    from simulator.hardware.catalog import get_device

    try:
        get_device(s.cluster.topology)
    except MemsimError:
        return s.cluster.topology          # already a topology: offload runs there
    for name, topology in bundled.topologies():
        if topology.num_gpus == 1 and topology.gpu_device.name == s.cluster.topology:
            return name
    return None


def _offload(s: Scenario, gpus: int, bundled: Bundled) -> list[Change]:
    """ZeRO-Offload / ZeRO-Infinity as DeepSpeed runs them (what simulator/offload/ simulates: pp = 1, AdamW,
    16-bit mixed precision, no gradient accumulation)."""
    p, t = s.parallel, s.training
    if p.pp > 1 or t.optimizer != "adamw" or t.precision not in ("fp32", "bf16-mixed", "fp16-mixed"):
        return []
    topology = _one_gpu_topology(s, bundled) if gpus == 1 else s.cluster.topology
    if topology is None:
        return []
    base = [_set("training.framework", "deepspeed"),
            _set("training.global_batch_size", t.micro_batch_size * p.dp)]
    mixed = ""
    if t.precision == "fp32":       # DeepSpeed offloads 16-bit mixed precision: the fp32 master is what moves
        base.append(_set("training.precision", "bf16-mixed"))
        mixed = "bf16 mixed precision, "
    if topology != s.cluster.topology:
        base.append(_set("cluster.topology", topology))
    plans = [("optimizer offloaded to the CPU (ZeRO-Offload, ZeRO-2)", 2, "cpu", "none"),
             ("optimizer and parameters offloaded to the CPU (ZeRO-3)", 3, "cpu", "cpu"),
             ("optimizer offloaded to NVMe (ZeRO-Infinity)", 3, "nvme", "none"),
             ("optimizer and parameters offloaded to NVMe (ZeRO-Infinity)", 3, "nvme", "nvme")]
    return [Change(mixed + label, "offload", tuple(base + [_set("parallel.zero_stage", stage),
                                                   _set("parallel.offload_optimizer", optimizer),
                                                   _set("parallel.offload_params", params)]), gpus)
            for label, stage, optimizer, params in plans]


def _peft(s: Scenario, gpus: int, bundled: Bundled) -> list[Change]:
    """Fine-tune adapters instead of the model (a different training: only the adapters learn): LoRA with PEFT's
    defaults, and QLoRA on NF4 base weights (workload/peft.py; framework torch, tp = pp = 1, no offload)."""
    from simulator.offload.config import offloading

    p, t = s.parallel, s.training
    if t.peft != "none" or t.framework != "torch" or p.tp > 1 or p.pp > 1 or p.zero_stage > 2 or offloading(s) \
            or t.precision not in ("fp32", "bf16", "bf16-mixed", "fp16-mixed") or t.sparsity != "none" \
            or p.gradient_compression != "none" or s.model.share_layers \
            or s.model.architecture not in ("gpt", "llama", "bert", "vit"):
        return []
    return [Change("LoRA adapters (r 8, PEFT's default modules; the base model frozen)", "peft",
                   (_set("training.peft", "lora"),), gpus),
            Change("QLoRA (NF4 base weights, r 8 adapters)", "peft", (_set("training.peft", "qlora"),), gpus)]


def _host_embeddings(s: Scenario, gpus: int, bundled: Bundled) -> list[Change]:
    """A DLRM's embedding tables in host memory (offload/embeddings.py: one GPU with host memory)."""
    if s.model.architecture != "dlrm" or s.model.embedding_placement == "host" or s.parallel.dp > 1:
        return []
    topology = _one_gpu_topology(s, bundled)
    if topology is None:
        return []
    sets = [_set("model.embedding_placement", "host")]
    if topology != s.cluster.topology:
        sets.append(_set("cluster.topology", topology))
    return [Change("embedding tables in host memory (lookups and updates on the host)", "offload", tuple(sets), gpus)]


def _more_gpus(s: Scenario, gpus: int, bundled: Bundled) -> list[Change]:
    """More GPUs of the same kind: a node of the same device for a one-card job (tensor parallelism across it, or
    ZeRO-3 data parallelism), twice the nodes for a cluster job (dp doubled, its states sharded)."""
    p, t = s.parallel, s.training
    changes = []
    if gpus == 1:
        for name, topology in bundled.topologies():
            if topology.num_gpus < 2 or topology.gpu_device.name != s.cluster.topology:
                continue
            n = topology.num_gpus
            where = _set("cluster.topology", name)
            if s.model.num_attention_heads % n == 0 and s.model.num_kv_heads % n == 0:
                changes.append(Change(f"{n} GPUs ({name}), tensor parallel {n}", "gpus",
                                      (where, _set("parallel.tp", n)), n))
            batch = max(t.global_batch_size, t.micro_batch_size * n)
            batch += -batch % (t.micro_batch_size * n)
            changes.append(Change(f"{n} GPUs ({name}), ZeRO-3 data parallel {n}", "gpus",
                                  (where, _set("parallel.dp", n), _set("parallel.zero_stage", 3),
                                   _set("training.global_batch_size", batch)), n))
        return changes
    batch = max(t.global_batch_size, t.micro_batch_size * p.dp * 2)
    batch += -batch % (t.micro_batch_size * p.dp * 2)
    sets = [_set("cluster.nodes", s.cluster.nodes * 2), _set("parallel.dp", p.dp * 2),
            _set("training.global_batch_size", batch)]
    if p.zero_stage == 0:
        sets.append(_set("parallel.zero_stage", 1))
    changes.append(Change(f"twice the nodes ({s.cluster.nodes * 2}), dp {p.dp * 2}", "gpus", tuple(sets), gpus * 2))
    return changes


GENERATORS: tuple[Callable[[Scenario, int, Bundled], list[Change]], ...] = (
    _host_embeddings, _recompute, _micro_batch, _precision, _optimizer, _zero, _offload, _peft, _more_gpus)
"""The axes of change, in the order they are listed when they cost the same (and simulated in, where the estimate
cannot rank them: a DLRM's host tables first, as they are what frees its GPU)."""


def single_changes(scenario: Scenario, gpus: int) -> list[Change]:
    """Every one-axis change to `scenario` (running on `gpus` GPUs) that the generators propose."""
    bundled = Bundled()
    return [change for generate in GENERATORS for change in generate(scenario, gpus, bundled)]


def _combine(changes: Sequence[Change], size: int) -> list[Change]:
    """Changes of `size` different axes stacked (later items override earlier ones for the same key)."""
    combined = []
    for group in itertools.combinations(changes, size):
        if len({c.axis for c in group}) < size:
            continue
        keys = [item.split("=", 1)[0] for c in group for item in c.sets]
        if len(set(keys)) < len(keys):
            continue               # two changes set the same key (say, two topologies): not a combination
        sets = tuple(item for c in group for item in c.sets)
        combined.append(Change(" + ".join(c.label for c in group), "+".join(c.axis for c in group), sets,
                               max(c.gpus for c in group)))
    return combined


def _simulate(job: tuple[dict, str, list[str]]) -> dict | str:
    """The report of one candidate, or its one-line error (a module-level function: process pools ship it)."""
    from simulator.api import simulate

    document, source, sets = job
    try:
        return simulate(scenario_from_dict(document, source, sets), timelines=False, events=False).report
    except MemsimError as error:
        return str(error)


class _InProcess:
    def map(self, fn: Callable, items: Iterable) -> list:
        return [fn(item) for item in items]


def _worst(report: dict) -> dict:
    return max(report["ranks"], key=lambda r: r["peak_reserved_bytes"] + r["context_bytes"] - r["capacity_bytes"])


def _entry(change: Change, report: dict, original: dict, gpus: int) -> dict:
    worst = _worst(report)
    time_s = report["iteration_time_s"]
    return {
        "label": change.label,
        "changes": list(change.sets),
        "fits": bool(report["fits"]),
        "gpus": change.gpus,
        "peak_allocated_bytes": max(r["peak_allocated_bytes"] for r in report["ranks"]),
        "peak_reserved_bytes": max(r["peak_reserved_bytes"] for r in report["ranks"]),
        "needed_bytes": worst["peak_reserved_bytes"] + worst["context_bytes"],
        "capacity_bytes": worst["capacity_bytes"],
        "host_needed_bytes": max((r.get("host_peak_bytes", 0) for r in report["ranks"]), default=0),
        "host_capacity_bytes": min((r["host_capacity_bytes"] for r in report["ranks"] if r.get("host_capacity_bytes")),
                                   default=0),
        "iteration_time_s": time_s,
        "tokens_per_s": report["tokens_per_s"],
        # time per token against the original (the iteration's ratio when the global batch is unchanged)
        "time_ratio": original["tokens_per_s"] / report["tokens_per_s"] if report["tokens_per_s"] > 0 else 0.0,
        # GPU-seconds per token against the original: what the change costs when it also adds GPUs
        "gpu_time_ratio": (change.gpus / report["tokens_per_s"]) / (gpus / original["tokens_per_s"])
        if report["tokens_per_s"] > 0 and original["tokens_per_s"] > 0 else 0.0,
    }


def _estimable(estimate: dict) -> bool:
    """Whether the estimate covers what the candidate changes: nothing it lists under leaves_out (offload) or warns
    it leaves out (gradient compression, skipped steps)."""
    return not estimate.get("leaves_out") and not any("the estimate leaves out" in str(w)
                                                       for w in estimate.get("warnings", ()))


def _ranked(candidates: Sequence[tuple[Change, Scenario]], estimates: list) -> tuple[list, list[Change]]:
    """From the candidates' estimates: those that fit by them, cheapest first (GPU-seconds per token, then fewer
    changes), as (index, change); and those the estimate cannot judge, least estimated activation memory first."""
    may_fit, unknown = [], []
    for index, ((change, _), estimate) in enumerate(zip(candidates, estimates)):
        if isinstance(estimate, MemsimError):
            unknown.append((float("inf"), index, change))
        elif not _estimable(estimate):
            # what the estimate leaves out (offload) is kept the same across these candidates; what it covers
            # (activations, recompute, micro-batch) orders them: least activation memory first
            unknown.append((max(r["breakdown_at_peak"]["activations"] for r in estimate["ranks"]), index, change))
        elif estimate["fits"] and estimate["tokens_per_s"] > 0:
            may_fit.append((change.gpus / estimate["tokens_per_s"], len(change.sets), index, change))
    may_fit.sort(key=lambda item: (item[0], item[1]))
    unknown.sort(key=lambda item: item[:2])
    return [(index, change) for *_, index, change in may_fit], [change for *_, change in unknown]


def _keep(verify: int, unknown: int) -> int:
    """How many of the candidates the estimate ranks are simulated beside `unknown` ones it cannot judge."""
    return max(verify - unknown, verify - 1 if unknown else verify, 0)


def _chosen(candidates: list[tuple[Change, Scenario]], verify: int) -> list[Change]:
    """The candidates to simulate, at most `verify`: the cheapest that the estimate says fit (GPU-seconds per token),
    and at least one it cannot estimate when there is one (least estimated activation memory first); those it says
    do not fit are left out."""
    return list(_choose(candidates, verify))


def _choose(candidates: list[tuple[Change, Scenario]], verify: int, caches=None) -> Iterator[Change]:
    """_chosen's list, each candidate as soon as it is known (a caller can simulate it while the next is judged).

    Peak allocated first, for all (fast); the allocator replay for peak reserved (most of an estimate's time) then
    runs cheapest first on those that may fit, until enough fit by it. A candidate that does not fit by peak
    allocated does not fit by peak reserved (reserved >= allocated), and the cost, the activations and what the
    estimate leaves out do not depend on the replay: the candidates chosen are those a replay of every one gives
    (tests/test_fit_choice.py). `caches`: the estimate's (_caches), shared with earlier rounds.
    """
    from simulator.explore.estimate import estimate_reports, replayed_until_fit

    caches = _caches() if caches is None else caches
    scenarios = [scenario for _, scenario in candidates]
    estimates = estimate_reports(scenarios, errors="return", caches=caches, replay=False)
    may_fit, unknown = _ranked(candidates, estimates)
    ranked = 0
    for change, report in replayed_until_fit(((change, scenarios[index]) for index, change in may_fit),
                                             _keep(verify, len(unknown)), caches):
        if report["fits"]:
            ranked += 1
            yield change
    yield from unknown[:verify - ranked]


def _caches():
    """Estimate caches whose op times are this process's (parallel/lower.py op_times): the candidates' simulations,
    forked from here after their estimates, find the times of the ops their lowering shares with the profiles."""
    from simulator.explore.assemble import Caches
    from simulator.parallel.lower import op_times

    return Caches(op_times=op_times())


def what_would_fit(scenario: Scenario | str | os.PathLike, overrides: Sequence[str], original: dict, *,
                   verify: int = DEFAULT_VERIFY, executor=None) -> list[dict]:
    """The cheapest changes that make a job that does not fit, fit, each simulated.

    Args:
        scenario: the scenario (its file is read again: every candidate is that file with `--set` items).
        overrides: the `--set` items the run was given (kept under every candidate's).
        original: the run's report (its iteration time and tokens/s are what the ratios compare with).
        verify: how many candidates to simulate at most per round (single changes, then pairs, then triples).
        executor: an object with `map(fn, items)` (explore/executors.py); default: in this process.

    Returns:
        The simulated candidates, those that fit first, cheapest first (GPU-seconds per token, then iteration time):
        dicts with label, changes (`--set` items), fits, gpus, peak_allocated_bytes, peak_reserved_bytes,
        needed_bytes (peak reserved + memory outside the allocator, on the stage that needs most),
        capacity_bytes, host_needed_bytes and host_capacity_bytes (offload: the node's host memory; 0 without), iteration_time_s, tokens_per_s, time_ratio (time per token against the original),
        gpu_time_ratio (GPU-seconds per token against the original). Empty when the job fits or
        no change could be simulated.
    """
    if original.get("fits", True) or verify < 1:
        return []
    return _entries(*_simulated(_source(scenario), overrides, verify, executor or _InProcess()), original)


def _source(scenario: Scenario | str | os.PathLike) -> str:
    return os.fspath(scenario if isinstance(scenario, (str, os.PathLike)) else scenario.source)


def _simulated(source: str, overrides: Sequence[str], verify: int, executor,
               caches=None) -> tuple[int, list[tuple[Change, dict]]]:
    """What what_would_fit simulates, round by round until a candidate fits: (the job's GPUs, [(change, report)]).
    The executor is handed the candidates as they are chosen (a forking one starts each at once). `caches`: the
    estimate caches to use (exact memos: the same choice with any), one set for all rounds."""
    from simulator.api import check_scenario

    caches = _caches() if caches is None else caches

    document = read_scenario_document(source)
    base = scenario_from_dict(document, source, list(overrides))
    gpus = base.parallel.dp * base.parallel.tp * base.parallel.pp
    singles = single_changes(base, gpus)
    simulated: list[tuple[Change, dict]] = []
    valid_singles: list[Change] = []
    for size in range(1, MAX_COMBINED + 1):
        pool = singles if size == 1 else _combine(valid_singles, size)
        candidates = []
        for change in pool:
            try:
                candidate = scenario_from_dict(document, source, [*overrides, *change.sets])
                check_scenario(candidate)
            except MemsimError:
                continue               # a change this scenario cannot take (the run would refuse it)
            candidates.append((change, candidate))
        if size == 1:
            valid_singles = [change for change, _ in candidates]
        def job(change: Change) -> tuple[dict, str, list[str]]:
            return document, source, [*overrides, *change.sets, *_QUIET_RUN]

        for change, outcome in _round(executor, candidates, verify, caches, job):
            if isinstance(outcome, dict):
                simulated.append((change, outcome))
        if any(report["fits"] for _, report in simulated):
            break
    return gpus, simulated


def _round(executor, candidates: list[tuple[Change, Scenario]], verify: int, caches,
           job: Callable[[Change], tuple]) -> list[tuple[Change, dict | str]]:
    """The candidates _choose chooses, each with its outcome (_simulate's), in the order chosen."""
    from simulator.forked import fork_safe

    if not candidates:
        return []
    if isinstance(executor, _Forking) and fork_safe():
        return _forked_round(candidates, verify, caches, job, executor.processes())
    chosen: list[Change] = []
    # list(): `chosen` is filled as the executor draws the jobs, so every job is drawn before pairing
    outcomes = list(executor.map(_simulate, _jobs(_choose(candidates, verify, caches), chosen, job)))
    return list(zip(chosen, outcomes))


def _jobs(choice: Iterator[Change], chosen: list[Change], job: Callable[[Change], tuple]) -> Iterator[tuple]:
    """_simulate's job for each candidate as it is chosen (listed in `chosen`)."""
    for change in choice:
        chosen.append(change)
        yield job(change)


def _replayed_simulation(scenario: Scenario, job: tuple, caches) -> tuple[bool, dict | str | None]:
    """(whether the estimate with the allocator replay says the candidate fits, its _simulate outcome if so)."""
    from simulator.explore.estimate import estimate_reports

    report = estimate_reports([scenario], errors="return", caches=caches)[0]
    return (True, _simulate(job)) if report["fits"] else (False, None)


def _forked_round(candidates: list[tuple[Change, Scenario]], verify: int, caches, job: Callable[[Change], tuple],
                  processes: int) -> list[tuple[Change, dict | str]]:
    """_round where forking is safe: the replay of each candidate that may fit runs in a forked child, which goes on
    to simulate it where it fits, so the replays run side by side and each simulation starts without waiting for
    the next candidate's replay. Children start cheapest first, only while those started and not rejected by their
    replay are fewer than _keep's count, and are read in that order: the replays are of the prefix of the ranking
    _choose replays, and the candidates simulated, in their order, are those it chooses (tests/test_fit_choice.py)."""
    from simulator.explore.estimate import estimate_reports
    from simulator.forked import Forked, Unanswered, fork_map

    estimates = estimate_reports([scenario for _, scenario in candidates], errors="return", caches=caches,
                                 replay=False)
    may_fit, unknown = _ranked(candidates, estimates)
    keep = _keep(verify, len(unknown))
    ranking = iter(may_fit)
    running: deque = deque()
    out: list[tuple[Change, dict | str]] = []
    try:
        while True:
            while len(out) + len(running) < keep and len(running) < processes:
                index, change = next(ranking, (None, None))
                if change is None:
                    break
                args = (candidates[index][1], job(change), caches)
                running.append((change, args, Forked(_replayed_simulation, *args)))
            if not running:
                break
            change, args, child = running.popleft()
            try:
                fits, outcome = child.result()
            except Unanswered:
                fits, outcome = _replayed_simulation(*args)      # computed here (an error is raised here)
            if fits:
                out.append((change, outcome))
    finally:
        for *_, child in running:
            child.cancel()
    rest = unknown[:verify - len(out)]
    return out + list(zip(rest, fork_map(_simulate, [job(change) for change in rest], processes)))


def _entries(gpus: int, simulated: list[tuple[Change, dict]], original: dict) -> list[dict]:
    verified = [_entry(change, report, original, gpus) for change, report in simulated]
    verified.sort(key=lambda e: (not e["fits"], e["gpu_time_ratio"], e["iteration_time_s"], e["label"]))
    return verified


MAX_SIDE_BY_SIDE = 4           # candidate simulations at once (each holds its own simulation's memory)


class _Forking:
    """Simulates the candidates of a round side by side (simulator/forked.py): one process per core and one more,
    as the run's own process only waits meanwhile (3 candidates on 2 cores: 1.5 simulations' time, not 2)."""

    def processes(self) -> int:
        from simulator.forked import cores

        return min(cores() + 1, MAX_SIDE_BY_SIDE)

    def map(self, fn: Callable, items: Iterable) -> list:
        from simulator.forked import fork_map

        return fork_map(fn, items, self.processes())


def _speculate(source: str, overrides: Sequence[str], verify: int):
    """In a process of its own, before the job's own run says whether it fits: None where the estimate says it fits
    by peak allocated (then it most likely does, and there is nothing to prepare), else what what_would_fit
    simulates."""
    from simulator.explore.estimate import estimate_reports

    base = scenario_from_dict(read_scenario_document(source), source, list(overrides))
    caches = _caches()
    estimate = estimate_reports([base], errors="return", caches=caches, replay=False)[0]
    if isinstance(estimate, MemsimError) or estimate["fits"]:
        return None
    return _simulated(source, overrides, verify, _Forking(), caches)


class PendingAdvice:
    """what_would_fit started in a forked process (simulator/forked.py) while the job's own simulation runs, for a
    command-line run: the same list, sooner, on a machine with a free core.

        pending = PendingAdvice(path, overrides, verify)      # before simulating the job
        try:
            report = simulate(...).report
            advice = pending.result(report)                   # what what_would_fit(path, overrides, report) gives
        finally:
            pending.cancel()

    The helper first estimates the job: where the estimate says it fits, the helper stops (a fitting job costs the
    other core that estimate and its imports) and `result` computes the list here if the run says otherwise. Where forking is not
    safe or no core is idle (simulator/forked.py spare_core), `result` computes it here.
    """

    def __init__(self, scenario: Scenario | str | os.PathLike, overrides: Sequence[str], verify: int = DEFAULT_VERIFY,
                 helper: bool | None = None):
        """`helper`: whether to fork the helper (None: where forking is safe and a core is idle, simulator/forked.py
        spare_core; True: where forking is safe)."""
        from simulator.forked import Forked, fork_safe, spare_core

        self._args = (_source(scenario), list(overrides), verify)
        wanted = verify >= 1 and (spare_core() if helper is None else helper and fork_safe())
        self._job = None
        if wanted:
            # What both processes run on is imported once, before the fork (the run's process needs it anyway);
            # the helper imports the estimate's own modules.
            import numpy  # noqa: F401

            import simulator.api  # noqa: F401

            self._job = Forked(_speculate, *self._args, own_group=True)

    def result(self, original: dict) -> list[dict]:
        """what_would_fit(scenario, overrides, original, verify=verify), from the helper's work where it did it."""
        from simulator.forked import Unanswered

        if original.get("fits", True) or self._args[2] < 1:
            self.cancel()
            return []
        simulated = None
        if self._job is not None:
            try:
                simulated = self._job.result()
            except Unanswered:
                pass                     # computed here: an error it met is raised here, as without the helper
            self._job = None
        if simulated is None:
            simulated = _simulated(*self._args, _Forking())
        return _entries(*simulated, original)

    def cancel(self) -> None:
        """Stop the helper (and the simulations it forked) if it still runs."""
        if self._job is not None:
            self._job.cancel()
            self._job = None
