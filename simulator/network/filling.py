"""Progressive filling: max-min fair rates of flows over capacitated resources, and a shortcut for one level.

`max_min_rates` is the textbook algorithm on plain dicts; `fill_rates` is its loop on bookkeeping the caller
already has (FlowNetwork's per-resource flow lists), with a lazy heap; `one_level` recognises, without
filling, a component whose flows all end at one rate and returns the very float the filling would.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from itertools import compress
from operator import attrgetter
from typing import Any

_res = attrgetter("res")


def one_level(capacity: Mapping[int, float], on: Mapping[int, Mapping[int, int]], resources: Iterable[int],
              flows: Sequence[Any], levels: dict[tuple, tuple[float, float]], once: bool = False) -> float | None:
    """The rate every flow of a component gets when progressive filling freezes them all at one level, else None.

    Let s0 be the least starting share (capacity / weight) and suppose every flow is frozen at s0. A resource
    crossed `count` times by each of its n flows then goes through the states (capacity minus s0 * count,
    subtracted j times one after another as `fill_rates` does, weight - j * count) for j = 0 .. n-1, whatever the
    order in which its flows freeze: each subtraction takes off the same float. If no resource's share drops
    below s0 in any of those states, and every flow crosses a *tight* resource (share exactly s0 in all of
    them), then each step of `fill_rates` — which takes the least share — takes a share of exactly s0 (the tight
    resource of any unfrozen flow is still in play at s0, no share is lower), so by induction every flow is
    frozen at s0 and the supposition holds: the same floats as the filling, without it. Resources crossed
    different numbers of times by different flows, or levels that are not positive and finite, give None.

    Args:
        capacity: resource -> capacity in bytes/s.
        on: resource -> {flow id: times crossed} (the component's flows only).
        resources: the component's resources.
        flows: the component's flows: objects with `res`, the ids of the resources each crosses.
        levels: remembered (least, greatest) share over the states of (capacity, count, flows, s0).
        once: the caller knows that every flow crosses each of its resources once (every weight is then the
            number of flows: no need to add the counts up).
    """
    # Whole-component passes in C (map, zip, compress) rather than a Python loop per resource: this runs on
    # components of thousands of resources.
    resources = list(resources)
    if once:
        counts = list(map(len, map(on.__getitem__, resources)))
        weights = counts
    else:
        crossings = list(map(on.__getitem__, resources))
        counts = list(map(len, crossings))
        weights = [sum(crossing.values()) for crossing in crossings]
        if weights != counts:       # some flow crosses a resource more than once: all its flows must, alike
            for crossing, n, weight in zip(crossings, counts, weights):
                if weight != n and any(c * n != weight for c in crossing.values()):    # (counts are >= 1)
                    return None
    keys = list(zip(map(capacity.__getitem__, resources), weights, counts))   # (capacity, weight, flows)
    kinds = dict.fromkeys(keys)     # (in the resources' order: the span cache fills the same way every run)
    least = min([c / weight for c, weight, _ in kinds])
    if not 0.0 < least < math.inf:
        return None
    tight_kinds: set[tuple[float, int, int]] = set()
    for key in kinds:
        c, weight, n = key
        span_key = (c, weight // n, n, least)
        span = levels.get(span_key)
        if span is None:
            span = levels[span_key] = _share_span(c, weight // n, n, least)
            if len(levels) > 4096:
                del levels[next(iter(levels))]
        low, high = span
        if low < least:
            return None
        if high == least:
            tight_kinds.add(key)
    tight = set(compress(resources, map(tight_kinds.__contains__, keys)))
    if any(map(tight.isdisjoint, map(_res, flows))):     # a flow crossing no tight resource
        return None
    return least


def _share_span(capacity: float, count: int, n: int, level: float) -> tuple[float, float]:
    """(least, greatest) share of a resource whose n flows (each crossing it `count` times) freeze at `level`,
    one after another, by `fill_rates`'s float operations."""
    left = capacity
    low = high = capacity / (count * n)
    for j in range(1, n):
        left = left - level * count
        share = (0.0 if 0.0 > left else left) / (count * (n - j))
        if share < low:
            low = share
        if share > high:
            high = share
    return low, high


def max_min_rates(capacities: dict[int, float], uses: dict[int, tuple[tuple[int, int], ...]]) -> dict[int, float]:
    """Max-min fair rates by progressive filling.

    All unfrozen flows rise together; a resource saturates when the weighted sum of its flows' rates (a flow
    crossing it n times counts n times) reaches its capacity, and freezes its flows at that level.

    Args:
        capacities: resource id -> capacity in bytes/s (every resource used below must be present).
        uses: flow id -> ((resource id, times crossed), ...); a flow with no resources gets math.inf.

    Returns:
        flow id -> rate in bytes/s.
    """
    weight: dict[int, float] = {r: 0.0 for r in capacities}
    members: dict[int, list[int]] = {r: [] for r in capacities}
    rates: dict[int, float] = {}
    for flow_id in sorted(uses):
        if not uses[flow_id]:
            rates[flow_id] = math.inf
        for resource, count in uses[flow_id]:
            weight[resource] += count
            members[resource].append(flow_id)
    fill_rates(dict(capacities), weight, members, uses, list(capacities), rates)
    return rates


def fill_rates(remaining: dict[int, float], weight: dict[int, float], members: Mapping[int, Iterable[int]],
          uses: Mapping[int, tuple[tuple[int, int], ...]], resources: Iterable[int], rates: dict[int, float]) -> None:
    """Progressive filling: freeze every flow of `uses` into `rates` (both dicts are consumed).

    The loop is the textbook one: take the resource of lowest fair share (ties: lowest id), give its
    unfrozen flows (in flow id order) that share, take their rates off every resource they cross, repeat.
    `remaining` and `weight` (capacity left and times crossed by unfrozen flows, per resource) change only
    there, by the same float operations in the same order whatever the heap holds, so the rates depend only
    on which resource is taken at each step. The heap keeps, for every resource still in play, an entry
    no larger than its current share (`floor`): a share that grows (the usual case, as frozen flows leave
    their links) is not pushed at once, only when its old entry comes up; a share that shrinks (float
    rounding) is pushed at once. An entry equal to the current share is taken; a lower one is pushed again
    at the current share; a higher one is stale. So each step takes the least (share, id), as a heap
    refreshed after every change would, with far fewer pushes. Infinite capacities (inf - inf is nan, which
    no heap orders) take `_fill_eager`, the refresh-after-every-change loop.

    Args:
        remaining: resource -> capacity (bytes/s), every resource of the flows.
        weight: resource -> total times crossed by the flows of `uses`.
        members: resource -> the flows crossing it, in increasing flow id.
        uses: flow id -> ((resource, times crossed), ...) of the flows to rate.
        resources: the resources, in any order.
        rates: receives flow id -> rate.
    """
    if not all(math.isfinite(c) for c in remaining.values()):
        _fill_eager(remaining, weight, members, uses, resources, rates)
        return
    heap = [(remaining[r] / weight[r], r) for r in resources if weight[r] > 0]
    floor = dict((r, share) for share, r in heap)
    heapq.heapify(heap)
    heappop, heappush = heapq.heappop, heapq.heappush
    while heap:
        share, resource = heappop(heap)
        w = weight[resource]
        if w <= 0:
            continue
        left = remaining[resource]
        current = (0.0 if 0.0 > left else left) / w         # max(left, 0.0) / w
        if current != share:
            if share < current:                          # a floor entry come up: queue the share it grew to
                heappush(heap, (current, resource))
                floor[resource] = current
            continue
        for flow_id in members[resource]:
            if flow_id in rates:
                continue
            rates[flow_id] = current
            for other, count in uses[flow_id]:
                left = remaining[other] = remaining[other] - current * count
                w = weight[other] = weight[other] - count
                if w > 0 and other != resource:
                    fresh = (0.0 if 0.0 > left else left) / w
                    if fresh < floor[other]:             # the share shrank (rounding): queue it now
                        heappush(heap, (fresh, other))
                        floor[other] = fresh
        weight[resource] = 0


def _fill_eager(remaining: dict[int, float], weight: dict[int, float], members: Mapping[int, Iterable[int]],
                uses: Mapping[int, tuple[tuple[int, int], ...]], resources: Iterable[int],
                rates: dict[int, float]) -> None:
    """`fill_rates` with a fresh heap entry for every resource a step changed (any capacities, infinite included)."""
    heap = [(remaining[r] / weight[r], r) for r in sorted(resources) if weight[r] > 0]
    heapq.heapify(heap)
    while heap:
        share, resource = heapq.heappop(heap)
        if weight[resource] <= 0:
            continue
        current = max(remaining[resource], 0.0) / weight[resource]
        if current != share:
            continue    # stale: every change of a resource pushed a fresh entry
        touched: dict[int, None] = {}
        for flow_id in members[resource]:
            if flow_id in rates:
                continue
            rates[flow_id] = current
            for other, count in uses[flow_id]:
                remaining[other] -= current * count
                weight[other] -= count
                touched[other] = None
        weight[resource] = 0
        # One fresh entry per changed resource (pushing after every flow only adds entries that go stale).
        for other in touched:
            if weight[other] > 0 and other != resource:
                heapq.heappush(heap, (max(remaining[other], 0.0) / weight[other], other))
