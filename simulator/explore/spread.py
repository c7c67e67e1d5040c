"""A plan search's estimates over an executor's workers: the candidates split by tp : micro-batch, each share
built, checked and estimated in one worker with that worker's caches, the reports gathered by candidate.

    for k, outcome in estimate_shares(executor, document, source, fixed, items, caches=caches):
        ...       # outcome: the report, or ("invalid", the rule a run refuses it with)

Each report is the same whichever worker computes it and whatever it computed before (the caches are exact:
assemble.Caches), so the search's output does not depend on the executor (tests/test_plan_spread.py).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Sequence

from simulator.errors import MemsimError
from simulator.explore.assemble import Caches
from simulator.explore.candidates import Settings, overrides
from simulator.explore.estimate import estimate_reports
from simulator.lifetime import collector_paused
from simulator.scenario.loader import scenario_from_dict

# A worker process's caches, kept from one share to the next (shares with the same pipeline shape reuse its
# schedules and graphs); dropped before a simulation (drop_worker_caches).
_WORKER_CACHES: list[Caches] = []

INVALID_OUTCOME = "invalid"


def rule(message: str, source: str) -> str:
    """An error message without its file prefix: the rule, to count candidates by."""
    prefix = f"{source}: "
    return message[len(prefix):] if message.startswith(prefix) else message


def _ratio(settings) -> tuple[int, int]:
    """tp : micro-batch in lowest terms: the plans of one ratio and pp have the same micro-batch count (global
    batch x tp x pp / (GPUs x micro-batch)), so the same schedules and graphs."""
    chosen = dict(settings)
    tp, mb = chosen.get("parallel.tp", 0), chosen.get("training.micro_batch_size", 0)
    common = math.gcd(tp, mb) or 1
    return tp // common, mb // common


def profile_order(settings: Sequence[Settings]) -> list[int]:
    """Indices of `settings` by tp : micro-batch, pp, (tp, micro-batch), then in enumeration order: the plans of
    one ratio and pp share their schedules and graphs, which are built once while they come together; the plans
    of one (tp, micro-batch) share their chunks' profiles whatever their pp, and a ratio's few (tp, micro-batch)
    pairs' profiles (about 100 each on the GPT-3 search) stay in the bounded profile memo
    (assemble.PROFILES_KEPT) while its pps are walked."""
    def key(k: int) -> tuple:
        chosen = dict(settings[k])
        return (_ratio(settings[k]), chosen.get("parallel.pp", 0), chosen.get("parallel.tp", 0),
                chosen.get("training.micro_batch_size", 0), k)

    return sorted(range(len(settings)), key=key)


def estimate_share(job: tuple, caches: Caches | None = None) -> list[tuple[int, object]]:
    """(k, outcome) for each (k, settings) of a share: the scenario file `document` (from `source`) with `fixed`
    and the settings as overrides, estimated with replay=False (or with the allocator replay when `replay`;
    `memory_first`: as estimate_reports takes it), in profile order; an outcome is the report or
    (INVALID_OUTCOME, the rule). A module-level function so that process-pool and Dask executors can ship it;
    `caches` default: this worker's own. The garbage collector is paused meanwhile (lifetime.collector_paused: tp 8
    slice of the GPT-3 175B / 1,024 A100 search, 612 plans: 34.5 s of CPU with it on, 26.8 s paused, same output)."""
    with collector_paused():
        return _estimate_share(job, caches)


def _estimate_share(job: tuple, caches: Caches | None) -> list[tuple[int, object]]:
    document, source, fixed, items, replay, memory_first = job
    if caches is None:
        if not _WORKER_CACHES:
            _WORKER_CACHES.append(Caches())
        caches = _WORKER_CACHES[0]
    out: list[tuple[int, object]] = []
    keys, scenarios = [], []
    for k in profile_order([settings for _, settings in items]):
        index, settings = items[k]
        try:
            scenarios.append(scenario_from_dict(document, source, fixed + overrides(settings)))
            keys.append(index)
        except MemsimError as error:
            out.append((index, (INVALID_OUTCOME, rule(str(error), source))))
    reports = estimate_reports(scenarios, errors="return", caches=caches, replay=replay, memory_first=memory_first)
    for index, report in zip(keys, reports):
        out.append((index, (INVALID_OUTCOME, rule(str(report), source)) if isinstance(report, MemsimError)
                    else report))
    return out


def drop_worker_caches() -> None:
    """Free this worker's estimate caches (a simulation needs the memory more)."""
    _WORKER_CACHES.clear()


def plan_weight(settings: Settings, global_batch: int) -> float:
    """About how long a plan's estimate (or its simulation) takes: its schedule's size (pp x micro-batches x
    virtual stages)."""
    s = dict(settings)
    micro = s.get("parallel.dp", 1) * s.get("training.micro_batch_size", 1)
    return s.get("parallel.pp", 1) * max(1, global_batch // max(1, micro)) * s.get("parallel.virtual_stages", 1)


def shares(items: Sequence[tuple[int, Settings]], global_batch: int) -> list[list[tuple[int, Settings]]]:
    """The items split by tp : micro-batch (each schedule and graph built in one worker only; each (tp,
    micro-batch)'s profiles too), heaviest share first (so that the last to finish are short)."""
    groups: dict[tuple, list[tuple[int, Settings]]] = {}
    for index, settings in items:
        groups.setdefault(_ratio(settings), []).append((index, settings))
    weighted = [(sum(plan_weight(st, global_batch) for _, st in group), key, group) for key, group in groups.items()]
    return [group for _, _, group in sorted(weighted, key=lambda item: (-item[0], item[1]))]


def estimate_shares(executor, document: dict, source: str, fixed: list[str], items: Sequence[tuple[int, Settings]],
                    global_batch: int, caches: Caches, progress: Callable[[int], None] | None = None,
                    memory_first: bool = True) -> Iterator[tuple[int, object]]:
    """(k, outcome) for every item (k, settings), in no particular order: one share in this process (with
    `caches`) when the executor runs in this process or has one worker, else one share per (tp, micro-batch)
    over its workers. `progress(done)` after each share."""
    workers = getattr(executor, "workers", 1)
    if executor is None or getattr(executor, "in_process", True) or workers <= 1:
        outcomes = estimate_share((document, source, fixed, list(items), False, memory_first), caches)
        if progress is not None:
            progress(len(outcomes))
        yield from outcomes
        return
    done = 0
    jobs = [(document, source, fixed, share, False, memory_first) for share in shares(items, global_batch)]
    for _, outcomes in executor.imap_unordered(estimate_share, jobs):
        done += len(outcomes)
        if progress is not None:
            progress(done)
        yield from outcomes


def replayed_shares(executor, document: dict, source: str, fixed: list[str], ordered: Sequence[tuple[int, Settings]],
                    enough: int) -> Iterator[tuple[int, dict]]:
    """(k, estimate with the allocator replay) for `ordered` (best first) until `enough` fit by peak reserved, as
    estimate.replayed_until_fit gives them, the replays run `executor.workers` at a time on its workers: a round
    replays as many of the next candidates as still need to fit (at least one per worker), and its results are
    taken in order up to where enough fit (a replay's report does not depend on where it ran)."""
    fitting, at = 0, 0
    workers = max(1, getattr(executor, "workers", 1))
    while fitting < enough and at < len(ordered):
        batch = ordered[at:at + max(workers, enough - fitting)]
        at += len(batch)
        jobs = [(document, source, fixed, [item], True, False) for item in batch]
        for (index, report), in executor.map(estimate_share, jobs):
            if fitting >= enough:
                return
            fitting += bool(report["fits"])
            yield index, report
