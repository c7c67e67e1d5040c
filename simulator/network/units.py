"""Connected components of a flow network's flows, searched over *units* kept between searches.

Flows are connected when they share a resource; FlowNetwork re-rates, after flows start or end, only the
components holding the resources they touched (the *seeds*). A `Unit` is a set of flows found connected through
their own resources; while none of its flows ends it stays *intact* — still connected, with the same busy
resources — and the search takes it whole instead of walking it flow by flow, so a component that loses some
of its flows (one batch of transfers ending among others) costs its broken parts only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import compress, filterfalse
from operator import attrgetter
from typing import Any

# A component of more units than this becomes one unit (`_unite`).
MAX_UNITS = 16

_res = attrgetter("res")


class Unit:
    """Flows known to be connected through their own resources (`components`), with those resources.

    A unit stays *intact* while none of its flows has ended: its flows are then still connected, its resources
    are exactly theirs and still busy. `neighbors` are the units that shared a resource with it when the later of
    the two was formed (intact pairs keep sharing it). Once one of its flows ends it is `broken` for good.
    """

    __slots__ = ("flows", "resources", "broken", "mark", "neighbors")

    def __init__(self, flows: set[int], resources: set[int]) -> None:
        self.flows = flows
        self.resources = resources
        self.broken = False
        self.mark = 0
        self.neighbors: list[Unit] = []


def components(on: Mapping[int, dict[int, int]], active: Mapping[int, Any], unit_of: dict[int, Unit],
               seeds: Iterable[int], stamp: int) -> list[tuple[set[int], set[int]]]:
    """The connected components (active flow ids, resource ids) holding `seeds` (idle seeds are skipped).

    Breadth-first, a whole frontier at a time with set operations (the components are sets: whoever uses
    them orders what needs an order), over *units* (`Unit`): an intact unit is taken whole when the search
    meets one of its flows, with the intact units it neighbours; only the other flows — *loose*: started
    since the last search, or of a unit broken since — are walked one by one. Every resource of a loose flow
    is a seed (see `seeds`), so only seeds are scanned for flows: a
    resource that is no seed carries flows of intact units only, and those units are joined through their
    `neighbors`. The loose flows are walked one new unit at a time (from a resource, through loose flows
    only), so each new unit is connected through its own resources; the new units are then linked to the
    intact units they share a resource with, or the whole component becomes one unit when it would have too
    many (`_unite`).

    Args:
        on: resource -> {flow id: times crossed} (empty or missing: idle).
        active: flow id -> its state (anything with `res`, the ids of the resources it crosses).
        unit_of: rated flow id -> its unit; updated with the new units.
        seeds: resources whose flows started or ended since the last search, and every busy resource of a unit
            broken since (FlowNetwork.start_many and FlowNetwork._end_transmissions add them).
        stamp: a number no earlier search used (marks the units taken).

    Returns:
        (flow ids, resource ids) of every component holding a busy seed, in the order of the seeds.
    """
    on_get, active_get, unit_get = on.__getitem__, active.__getitem__, unit_of.get
    dirty = set(seeds)
    seen: set[int] = set()
    found_components = []
    live = list(compress(seeds, map(on.get, seeds)))     # (idle seeds are skipped)
    i = 0
    while i < len(live):
        seed = live[i]
        i += 1
        if seed in seen:
            continue
        resources = {seed}
        scanned: set[int] = set()
        found: set[int] = set()
        taken: list[Unit] = []
        units: list[Unit] = []          # new units of loose flows
        starts = [seed]                  # seeds to walk from: this one, then those of the units taken
        while starts:
            start = starts.pop()
            if start in scanned:
                continue
            flows: set[int] = set()      # the loose flows reached from `start` through loose flows
            own: set[int] = set()        # their resources
            frontier: Iterable[int] = (start,)
            scanned.add(start)
            while frontier:
                new_flows = set().union(*map(on_get, frontier))
                new_flows -= found
                if not new_flows:
                    break
                found |= new_flows
                listed = list(new_flows)
                of = list(map(unit_get, listed))
                fresh = [unit for unit in dict.fromkeys(of) if unit is not None and not unit.broken]
                if fresh:
                    loose = [flow_id for flow_id, unit in zip(listed, of) if unit is None or unit.broken]
                    while fresh:
                        unit = fresh.pop()
                        if unit.mark == stamp:
                            continue
                        unit.mark = stamp
                        taken.append(unit)
                        found |= unit.flows
                        resources |= unit.resources
                        starts.extend(unit.resources & dirty)
                        fresh.extend([other for other in unit.neighbors
                                      if other.mark != stamp and not other.broken])
                else:
                    loose = listed
                if not loose:
                    break
                flows.update(loose)
                frontier = set().union(*map(_res, map(active_get, loose)))
                frontier -= own
                own |= frontier
                frontier -= scanned
                scanned |= frontier
            if flows:
                units.append(Unit(flows, own))
                resources |= own
        seen |= resources
        if len(resources) > 64 and i < len(live):     # drop the seeds this component covered at once
            live = list(filterfalse(seen.__contains__, live[i:]))
            i = 0
        if units:
            _unite(unit_of, found, resources, units, taken)
        found_components.append((found, resources))
    return found_components


def _unite(unit_of: dict[int, Unit], found: set[int], resources: set[int], units: list[Unit],
           taken: list[Unit]) -> None:
    """Record the new `units` of a component (`found`, `resources`) whose intact units are `taken`."""
    if len(units) + len(taken) > MAX_UNITS:
        whole = Unit(found, resources)     # the component is connected: one unit
        unit_of.update(dict.fromkeys(found, whole))
        for unit in taken:
            unit.broken = True              # (superseded: none of its flows points to it any more)
        return
    for unit in units:
        unit.neighbors = [other for other in taken if not other.resources.isdisjoint(unit.resources)]
        for other in unit.neighbors:
            other.neighbors = [near for near in other.neighbors if not near.broken]   # (kept short)
            other.neighbors.append(unit)
        unit_of.update(dict.fromkeys(unit.flows, unit))
