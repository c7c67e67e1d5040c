"""Seconds of the collectives and messages of a plan's representative ranks, from the network model
(network/collectives.py: NCCL's algorithm choice and latencies, flows on the topology's links sharing them
max-min fairly), each (kind, groups, size) computed once per topology.

A simulated stage representative's collective runs together with the same collective of every other group of its
stage (the engine's shadows, docs/engine.md "Symmetry"): when those groups share no link it takes
`collective_time_s`; when they do (two data-parallel groups through one PCIe uplink), the groups' schedules are run
together on one FlowNetwork, as the engine runs them, and the representative's finishing time is taken.
"""

from __future__ import annotations

import heapq
import math

from simulator.explore.bounded import Lru
from simulator.network.collectives import REFERENCE_BYTES, candidates, collective_time_s, lower_collective
from simulator.network.flows import FlowNetwork
from simulator.network.topology import Topology


TIMES_KEPT = 200_000          # collective times remembered (a key holds the stage's other groups)
GROUPS_KEPT = 20_000          # footprints and "apart" verdicts per (kind, groups)
ASKED_KEPT = 200_000          # answers by the question as asked, before that plain memo starts over


class NetworkCosts:
    """Collective and message times on one topology, remembered per (kind, groups, bytes)."""

    def __init__(self, topology: Topology):
        self.topology = topology
        # Bounded: a search of a large cluster meets tens of thousands of (groups, size) keys.
        self._seen = Lru(TIMES_KEPT)
        # The same question, as asked, comes hundreds of times per plan: a plain dict answers it before the key
        # above is built (the stage's other groups filtered) and the bounded cache's bookkeeping is paid.
        self._asked: dict = {}
        # Faster still: the same group and `together` objects come back for every collective of a plan, and a
        # tuple's hash is not cached (the stage's groups: up to hundreds of ranks rehashed per question). Keyed by
        # their identities, each entry holding the objects so that an identity is not reused while it stands.
        self._by_identity: dict = {}
        self._footprints = Lru(GROUPS_KEPT)
        self._apart = Lru(GROUPS_KEPT)

    def collective_s(self, kind: str, group: tuple[int, ...], size_bytes: float,
                     together: tuple[tuple[int, ...], ...] = ()) -> float:
        """Seconds of one `kind` collective over the GPUs `group` (0 for one GPU), while the same collective runs
        over each group of `together` (the other groups of its stage)."""
        identity = (kind, id(group), size_bytes, id(together))
        known = self._by_identity.get(identity)
        if known is not None and known[0] is group and known[1] is together:
            return known[2]
        asked = (kind, group, size_bytes, together)
        seconds = self._asked.get(asked)
        if seconds is not None:
            self._remember(identity, group, together, seconds)
            return seconds
        if len(group) <= 1 or size_bytes <= 0:
            return 0.0
        others = tuple(g for g in together if g != group)
        key = (kind, group, float(size_bytes), others)
        seconds = self._seen.get(key)
        if seconds is None:
            seconds = self._seen[key] = self._time(kind, group, float(size_bytes), others)
        if len(self._asked) >= ASKED_KEPT:
            self._asked.clear()
        self._asked[asked] = seconds
        self._remember(identity, group, together, seconds)
        return seconds

    def _remember(self, identity: tuple, group: tuple, together: tuple, seconds: float) -> None:
        if len(self._by_identity) >= ASKED_KEPT:
            self._by_identity.clear()
        self._by_identity[identity] = (group, together, seconds)

    def send_s(self, src: int, dst: int, size_bytes: float,
               together: tuple[tuple[int, int], ...] = ()) -> float:
        """Seconds of a point-to-point message from GPU `src` to GPU `dst` (one direct flow and NCCL's p2p
        latency, as the engine lowers a Send), while the messages `together` move (the stage's other pairs)."""
        if src == dst or size_bytes <= 0:
            return 0.0
        return self.collective_s("send", (src, dst), size_bytes, together)

    def _time(self, kind: str, group: tuple[int, ...], size_bytes: float, others: tuple) -> float:
        alone = collective_time_s(self.topology, kind, group, size_bytes)
        if not others or self._apart_always(kind, group, others):
            return alone
        schedules = [lower_collective(self.topology, kind, g, size_bytes) for g in (group,) + others]
        used = [self._resources(s) for s in schedules]
        if not any(used[0] & u for u in used[1:]):
            return alone          # flows on disjoint links do not interact under max-min sharing
        return _run_together(self.topology, schedules)

    def _apart_always(self, kind: str, group: tuple[int, ...], others: tuple) -> bool:
        """True when no algorithm of `group` can share a link with any algorithm of `others`: then, whatever NCCL
        picks at any size, the flows are disjoint and the collective takes its time alone (an exact shortcut of
        the check in `_time`, which lowers every group at the size; False says only "check at the size")."""
        key = (kind, group, others)
        found = self._apart.get(key)
        if found is None:
            mine = self._footprint(kind, group)
            found = self._apart[key] = not any(mine & self._footprint(kind, g) for g in others)
        return found

    def _footprint(self, kind: str, group: tuple[int, ...]) -> frozenset[int]:
        """Every resource a `kind` collective over `group` can load, over all its (algorithm, protocol)
        candidates (flow endpoints do not depend on the size: only flow sizes do)."""
        key = (kind, group)
        found = self._footprints.get(key)
        if found is None:
            found = self._footprints[key] = frozenset().union(*(
                self._resources(lower_collective(self.topology, kind, group, REFERENCE_BYTES, algorithm, protocol))
                for algorithm, protocol in candidates(self.topology, kind, group)))
        return found

    def _resources(self, schedule) -> set[int]:
        return {resource for phase in schedule.phases for flow in phase.flows
                for resource, _ in self.topology.route(flow.src, flow.dst).resources}


def _run_together(topology: Topology, schedules) -> float:
    """Run collective schedules from time 0 on one FlowNetwork (each phase after its latency, once the previous
    phase's flows are all delivered); returns when the first schedule's last phase ends."""
    network = FlowNetwork(topology)
    phase = [0] * len(schedules)
    pending: list[set[int]] = [set() for _ in schedules]
    owner: dict[int, int] = {}
    starts = [(s.phases[0].latency_s, i) for i, s in enumerate(schedules) if s.phases]
    heapq.heapify(starts)
    finished = {i: 0.0 for i, s in enumerate(schedules) if not s.phases}

    def delivered(ids) -> None:
        for flow_id in ids:
            i = owner.pop(flow_id)
            pending[i].discard(flow_id)
            if not pending[i]:
                _next(i)

    def _next(i: int) -> None:
        phase[i] += 1
        if phase[i] < len(schedules[i].phases):
            heapq.heappush(starts, (network.now_s + schedules[i].phases[phase[i]].latency_s, i))
        else:
            finished[i] = network.now_s

    while 0 not in finished:
        next_start = starts[0][0] if starts else math.inf
        next_flow = network.next_event_s()
        next_flow = math.inf if next_flow is None else next_flow
        if next_start == math.inf and next_flow == math.inf:
            break
        if next_start <= next_flow:
            at, i = heapq.heappop(starts)
            delivered(network.advance_ids(at))
            flows = schedules[i].phases[phase[i]].flows
            ids = network.start_many(flows, with_latency=False)
            pending[i] = set(ids)
            owner.update((flow_id, i) for flow_id in ids)
            if not pending[i]:
                _next(i)
        else:
            delivered(network.advance_ids(next_flow))
    return finished.get(0, network.now_s)
