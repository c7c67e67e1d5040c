"""Communication in the engine: collectives and send/recv as flows on one shared FlowNetwork, driven by simpy.

Every transfer of every rank runs on a single `FlowNetwork`, so concurrent collectives and pipeline
messages share links max-min fairly. A collective launches when its last simulated member posts it
(members the symmetry reduction does not simulate are assumed to arrive with their representative);
it is lowered by `lower_collective` and its phases run one after another (each waits its latency, then
starts its flows). A send/recv pair launches when both sides are posted (NCCL: blocking until matched);
a send or recv whose peer is not simulated launches when posted. With a `ParallelPlan`, the traffic of
unsimulated ranks that the representatives stand for (the other TP/DP groups of a stage, the other
stage-to-stage pairs) is started too, as *shadow* operations that nobody waits for but that load the
links exactly as in a full simulation (engine/shadows.py finds them; the shadow sends of one send, when they
share a latency, as one operation: `_shadow_transfers`).

Given the programs up front (`programs=`), the model first works out which operations can interact
(simulator/network/footprint.py: components of the union of every operation's links; a collective inside one
server has the links of the same collective on server 0, moved). A shadow whose
component holds no simulated rank's traffic cannot change any simulated time under max-min sharing and
is not started. A collective whose component holds only collectives over its own group, posted by every
simulated member from a single stream (so they never overlap), runs alone on its links: it is timed once
per (kind, group, size) by simulating it alone on a FlowNetwork and then completes after that duration,
without flows.

With `quiet`, the same is decided at run time for every other operation (docs/engine.md, "Quiet collectives"): one
launched while nothing in flight claims any resource of its footprint runs alone, without flows, claiming the
footprint until its end; an operation launched onto a live quiet claim first puts that quiet one onto the flow
network in the state it has reached alone (network/quiet.py), then runs as flows (claiming its footprint too).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
import simpy

from simulator.engine.network_analysis import analyze, any_footprint
from simulator.engine.shadows import ShadowRanks
from simulator.errors import PlanError
from simulator.network.collectives import CollectiveSchedule, Phase, lower_collective
from simulator.network.footprint import footprint, isolated_duration_s
from simulator.network.flows import FlowNetwork
from simulator.network.host import transfer_schedule
from simulator.network.quiet import alone_end_s, alone_steps, state_at
from simulator.network.topology import Topology
from simulator.parallel.plan import ParallelPlan
from simulator.parallel.program import Collective, Program, Recv, Send, Transfer


class Pending:
    """A posted communication instruction: its `done` event and a description of what it waits for."""

    def __init__(self, env: simpy.Environment, rank: int, posted_s: float):
        self.done = env.event()
        self.rank = rank
        self.posted_s = posted_s
        self.start_s = posted_s     # set again when the transfer launches
        self.reason = ""


class _Operation:
    """A lowered schedule in progress: current phase, flows outstanding, who waits for it, the resources it claims."""

    __slots__ = ("schedule", "phase", "outstanding", "waiters", "label", "claims")

    def __init__(self, schedule: CollectiveSchedule, waiters: list[Pending], label: str,
                 claims: tuple[int, ...] = ()):
        self.schedule = schedule
        self.phase = 0
        self.outstanding = 0
        self.waiters = waiters
        self.label = label
        self.claims = claims


def _end_alone(info: tuple, now: float) -> float:
    """When an operation with `NetworkModel._alone_of`'s `info` started now ends alone: the float sums of its phases
    from now, as the flow network would do them (quiet.alone_steps), or else now + its duration alone."""
    _, _, duration, steps = info
    return alone_end_s(steps, now) if steps is not None else now + duration


def _timing_groups(infos: tuple) -> tuple[tuple, tuple[int, ...]]:
    """(one of `infos` per distinct timing alone, the index in it of each info's): infos with equal steps (or, without
    steps, equal durations) end alone at the same time from any start (_end_alone), so a batch of shadows (mostly
    one timing) needs one end per timing."""
    timings, which, seen = [], [], {}
    for info in infos:
        _, _, duration, steps = info
        key = (steps,) if steps is not None else (None, duration)
        index = seen.get(key)
        if index is None:
            index = seen[key] = len(timings)
            timings.append(info)
        which.append(index)
    return tuple(timings), tuple(which)


@dataclass(slots=True, eq=False)
class _Quiet:
    """An operation running alone on its links, without flows (NetworkModel._launch): it ends at `end_s` unless it
    is materialized first (`live` False then, and its timer is ignored)."""

    schedule: CollectiveSchedule | None     # (None for shadows quiet together: `parts`)
    start_s: float
    end_s: float
    waiters: list[Pending]
    label: str
    claims: tuple[int, ...]     # the footprint's resources
    live: bool = True
    parts: tuple | None = None  # the shadows of one launch run quiet together: ((alone info, end), ...); None: one


class _Gathering:
    """A collective waiting for its simulated members."""

    __slots__ = ("instruction", "expected", "arrived")

    def __init__(self, instruction: Collective, expected: tuple[int, ...]):
        self.instruction = instruction
        self.expected = expected
        self.arrived: dict[int, Pending] = {}


class NetworkModel:
    """Collectives and point-to-point transfers of all simulated ranks on one shared FlowNetwork.

    Args:
        env: the simpy environment of the simulation.
        topology: the cluster; global rank r runs on GPU r.
        simulated_ranks: the ranks that have programs.
        plan: the parallel plan; with it, shadow traffic of unsimulated ranks is added (module docstring).
        programs: every simulated rank's program; with them, shadows that cannot reach simulated traffic
            are dropped and link-isolated collectives are timed without flows (module docstring).
        isolate: time link-isolated collectives without flows (False: every collective runs as flows).
        quiet: launch an operation nothing in flight shares a resource with without flows (module docstring).
    """

    def __init__(self, env: simpy.Environment, topology: Topology, simulated_ranks: tuple[int, ...],
                 plan: ParallelPlan | None = None, programs: list[Program] | None = None, isolate: bool = True,
                 quiet: bool = False):
        self.env = env
        self.topology = topology
        self.plan = plan
        self.simulated = frozenset(simulated_ranks)
        self.shadows = ShadowRanks(plan, self.simulated)
        self.network = FlowNetwork(topology, start_s=env.now)
        self._gatherings: dict[tuple, _Gathering] = {}
        self._occurrences: dict[tuple, int] = {}
        self._sends: dict[tuple[int, int, str], deque[tuple[Send, Pending]]] = {}
        self._recvs: dict[tuple[int, int, str], deque[tuple[Recv, Pending]]] = {}
        self._owner: dict[int, _Operation] = {}
        self._timer_version = 0
        self._refresh_pending = False      # a re-rating is scheduled at the current time (_reschedule_soon)
        self._schedules: dict[tuple, CollectiveSchedule] = {}
        self.shadow_operations = 0
        self.shadows_dropped = 0
        self.isolated_operations = 0
        self.quiet_operations = 0           # launched quiet (not counted in isolated_operations: stretches read it)
        self.materialized_operations = 0    # of those, put onto the flow network before they ended
        self._quiet = quiet
        self._flowing: dict[int, int] = {}          # resource -> operations running as flows that claim it (> 0)
        self._quiet_claims: dict[int, _Quiet] = {}  # resource -> the last quiet operation that claimed it
        self._alone_info: dict[int, tuple] = {}     # id(schedule) -> (schedule, footprint, duration alone)
        self._shadow_batches: dict[tuple, tuple] = {}   # (kind, group, size) -> its shadows' infos and union, or ()
        self._kept: set[tuple] | None = None          # shadow (kind, group, size) worth starting; None: all
        self._isolated: dict[tuple, float | None] = {}  # (kind, group, size) -> duration (None: not yet timed)
        self._footprints: dict[tuple, tuple[int, ...]] = {}   # (kind, group, moves bytes) -> any-algorithm links
        self._alone: dict[tuple[int, ...], bool] = {}     # group -> a poster is its only simulated member
        self._inline: dict[tuple, tuple] = {}     # (kind, group, size, rank) -> inline_duration_s's answer
        self._started_shadows: dict[tuple, tuple[tuple[tuple[int, ...], ...], int]] = {}   # -> (kept, dropped)
        self._shadow_sends: dict[tuple, tuple[tuple[CollectiveSchedule, ...], int, int]] = {}   # _shadow_transfers
        self._offload: dict[tuple, tuple[CollectiveSchedule, tuple[CollectiveSchedule, ...], int]] = {}   # transfer()
        if programs is not None:
            self._analyze(programs, isolate)

    # ----- posting ------------------------------------------------------------------------------------------
    def collective(self, rank: int, instruction: Collective) -> Pending:
        """Post `instruction` from `rank`; the collective launches when every simulated member posted it."""
        if rank not in instruction.group:
            raise PlanError(f"collective {instruction.name!r}: rank {rank} posts it but group = "
                            f"{list(instruction.group)} does not contain it")
        pending = Pending(self.env, rank, self.env.now)
        kind, size = instruction.kind, instruction.size_bytes
        alone = self._alone.get(instruction.group)
        if alone is None:
            alone = self._alone[instruction.group] = all(r == rank or r not in self.simulated
                                                         for r in instruction.group)
        if alone:
            # The only simulated member: it launches at once (no gathering to match members by occurrence).
            self._launch_with_shadows(kind, instruction.group, size, [pending], instruction.name)
            return pending
        base = (instruction.kind, instruction.group, instruction.name, instruction.iteration)
        count_key = (rank, *base)
        occurrence = self._occurrences.get(count_key, 0)
        self._occurrences[count_key] = occurrence + 1
        key = (*base, occurrence)
        gathering = self._gatherings.get(key)
        if gathering is None:
            expected = tuple(r for r in instruction.group if r in self.simulated)
            gathering = self._gatherings[key] = _Gathering(instruction, expected)
        elif gathering.instruction.size_bytes != instruction.size_bytes:
            raise PlanError(f"collective {instruction.name!r} (iteration {instruction.iteration}): rank {rank} "
                            f"posts size_bytes = {instruction.size_bytes!r}, another member posted "
                            f"{gathering.instruction.size_bytes!r}; all members must post the same size")
        gathering.arrived[rank] = pending
        missing = [r for r in gathering.expected if r not in gathering.arrived]
        if missing:
            pending.reason = (f"{instruction.kind} {instruction.name!r} over ranks {list(instruction.group)} "
                              f"waiting for ranks {missing}")
            for other in gathering.arrived.values():
                other.reason = pending.reason
            return pending
        del self._gatherings[key]
        waiters = [gathering.arrived[r] for r in gathering.expected]
        self._launch_with_shadows(kind, instruction.group, size, waiters, instruction.name)
        return pending

    def _shadow_launches(self, kind: str, group: tuple[int, ...], size: float) -> tuple[tuple, int]:
        """(shadow groups to start, number dropped) when (kind, group, size) launches."""
        key = (kind, group, size)
        started = self._started_shadows.get(key)
        if started is None:
            shadows = self.shadows.groups(kind, group)
            kept = tuple(g for g in shadows if self._kept is None or (kind, g, size) in self._kept)
            started = self._started_shadows[key] = (kept, len(shadows) - len(kept))
        return started

    def _launch_with_shadows(self, kind: str, group: tuple[int, ...], size: float, waiters: list[Pending],
                             label: str) -> None:
        """Launch a collective whose simulated members all posted it, and its shadows worth starting."""
        key = (kind, group, size)
        if key in self._isolated:
            self._launch_isolated(key, waiters)
        else:
            self._launch(self._lower(kind, group, size), waiters, label)
        kept, dropped = self._shadow_launches(kind, group, size)
        if not (self._quiet and len(kept) > 1 and self._launch_quiet_shadows(key, kept, label)):
            for shadow in kept:
                self._launch(self._lower(kind, shadow, size), [], label)
        self.shadow_operations += len(kept)
        self.shadows_dropped += dropped

    def timed_isolated_s(self, kind: str, group: tuple[int, ...], size_bytes: float) -> float | None:
        """The duration alone of a link-isolated collective already timed (by inline_duration_s or a launch), else
        None."""
        return self._isolated.get((kind, group, size_bytes))

    def inline_duration_s(self, rank: int, instruction: Collective) -> float | None:
        """The duration of `instruction` if `rank` may run it inline, else None (nothing is changed then).

        Inline means: `rank` is the group's only simulated member, the collective is link-isolated and none
        of its shadows is started, so it completes exactly its isolated duration after it is posted and
        touches nothing another operation can see. The caller then accounts it as posted and finished.
        The answer depends only on (kind, group, size, rank) and is remembered (each call counts the operation).
        """
        known = self.inline_answer(rank, instruction)
        if not known:
            return None
        self.isolated_operations += 1
        self.shadows_dropped += known[1]
        return known[0]

    def inline_answer(self, rank: int, instruction: Collective) -> tuple[float, int] | tuple[()]:
        """(duration, shadows dropped) when `rank` may run `instruction` inline, else (); counts nothing (the caller
        that runs it adds 1 to isolated_operations and the shadows dropped, as inline_duration_s does)."""
        key = (instruction.kind, instruction.group, instruction.size_bytes, rank)
        known = self._inline.get(key)
        if known is None:
            known = self._inline[key] = self._inline_answer(rank, instruction)
        return known

    def _inline_answer(self, rank: int, instruction: Collective) -> tuple[float, int] | tuple[()]:
        """(duration, shadows dropped) when `rank` may run `instruction` inline (`inline_duration_s`), else ()."""
        key = (instruction.kind, instruction.group, instruction.size_bytes)
        if key not in self._isolated or rank not in instruction.group:
            return ()
        alone = self._alone.get(instruction.group)
        if alone is None:
            alone = self._alone[instruction.group] = all(r == rank or r not in self.simulated
                                                         for r in instruction.group)
        if not alone:
            return ()
        kept, dropped = self._shadow_launches(*key)
        if kept:
            return ()
        duration = self._isolated[key]
        if duration is None:
            duration = self._isolated[key] = isolated_duration_s(self.topology, self._lower(*key))
        return duration, dropped

    def send(self, rank: int, instruction: Send) -> Pending:
        """Post a send from `rank`; the transfer starts when the matching recv is posted (or at once if the
        peer is not simulated)."""
        pending = Pending(self.env, rank, self.env.now)
        key = (rank, instruction.peer, instruction.tag)
        pending.reason = (f"send {instruction.name!r} to rank {instruction.peer} (tag {instruction.tag!r}) "
                          f"waiting for the matching recv")
        if instruction.peer not in self.simulated:
            self._transfer(rank, instruction.peer, instruction.size_bytes, [pending], instruction.name)
            return pending
        queue = self._recvs.get(key)
        if queue:
            recv, other = queue.popleft()
            self._check_pair(instruction, recv, rank)
            self._transfer(rank, instruction.peer, instruction.size_bytes, [pending, other], instruction.name)
        else:
            self._sends.setdefault(key, deque()).append((instruction, pending))
        return pending

    def recv(self, rank: int, instruction: Recv) -> Pending:
        """Post a recv on `rank`; the transfer starts when the matching send is posted (or at once if the
        peer is not simulated)."""
        pending = Pending(self.env, rank, self.env.now)
        key = (instruction.peer, rank, instruction.tag)
        pending.reason = (f"recv {instruction.name!r} from rank {instruction.peer} (tag {instruction.tag!r}) "
                          f"waiting for the matching send")
        if instruction.peer not in self.simulated:
            self._transfer(instruction.peer, rank, instruction.size_bytes, [pending], instruction.name)
            return pending
        queue = self._sends.get(key)
        if queue:
            send, other = queue.popleft()
            self._check_pair(send, instruction, instruction.peer)
            self._transfer(instruction.peer, rank, send.size_bytes, [other, pending], send.name)
        else:
            self._recvs.setdefault(key, deque()).append((instruction, pending))
        return pending

    def transfer(self, rank: int, instruction: Transfer) -> Pending:
        """Start an offload transfer of `rank` now (it waits for nobody), with the same transfer of every unsimulated
        rank it stands for whose links reach simulated traffic (network/host.py lowers it to flows)."""
        pending = Pending(self.env, rank, self.env.now)
        schedule, shadows, dropped = self._offload_schedules(rank, instruction)
        self._launch(schedule, [pending], instruction.name)
        for shadow in shadows:
            self._launch(shadow, [], instruction.name)
        self.shadow_operations += len(shadows)
        self.shadows_dropped += dropped
        return pending

    def _offload_schedules(self, rank: int, instruction: Transfer) -> tuple:
        """(the transfer's schedule, its shadows' schedules worth starting, shadows dropped), remembered."""
        key = (rank, instruction.route, instruction.size_bytes, instruction.cap_bytes_per_s)
        found = self._offload.get(key)
        if found is None:
            route, size, cap = instruction.route, instruction.size_bytes, instruction.cap_bytes_per_s
            others = self.shadows.represented(rank)
            kept = [r for r in others if self._kept is None or ("transfer", (r, route, cap), size) in self._kept]
            found = self._offload[key] = (transfer_schedule(self.topology, rank, route, size, cap),
                                          tuple(transfer_schedule(self.topology, r, route, size, cap) for r in kept),
                                          len(others) - len(kept))
        return found

    @staticmethod
    def _check_pair(send: Send, recv: Recv, src: int) -> None:
        if send.size_bytes != recv.size_bytes:
            raise PlanError(f"send {send.name!r} from rank {src} (tag {send.tag!r}): size_bytes = "
                            f"{send.size_bytes!r} but the matching recv {recv.name!r} expects {recv.size_bytes!r}")

    # ----- which operations interact (engine/network_analysis.py) -------------------------------------------
    def _analyze(self, programs: list[Program], isolate: bool) -> None:
        """Find the shadows worth starting and the link-isolated collectives (module docstring)."""
        analyze(self, programs, isolate)

    def _any_footprint(self, key: tuple) -> tuple[int, ...]:
        """Resources `key` may load under any of its candidate algorithms."""
        return any_footprint(self, key)

    # ----- lowering and symmetry ----------------------------------------------------------------------------
    def _lower(self, kind: str, group: tuple[int, ...], size_bytes: float) -> CollectiveSchedule:
        key = (kind, group, size_bytes)
        schedule = self._schedules.get(key)
        if schedule is None:
            schedule = self._schedules[key] = lower_collective(self.topology, kind, group, size_bytes)
        return schedule

    # ----- driving the flow network -------------------------------------------------------------------------
    def _transfer(self, src: int, dst: int, size_bytes: float, waiters: list[Pending], label: str) -> None:
        self._launch(self._lower("send", (src, dst), size_bytes), waiters, label)
        shadows, kept, dropped = self._shadow_transfers(src, dst, size_bytes)
        for schedule in shadows:
            self._launch(schedule, [], label)
        self.shadow_operations += kept
        self.shadows_dropped += dropped

    def _shadow_transfers(self, src: int, dst: int,
                          size_bytes: float) -> tuple[tuple[CollectiveSchedule, ...], int, int]:
        """(schedules to launch, shadow sends kept, dropped) for a send src -> dst (remembered).

        When every kept shadow send is one phase with the same latency (the usual case: one direct flow over
        the same kind of path), they become one schedule with all their flows in order. Nobody waits for a
        shadow, and their timers would fire at the same instant one after another (consecutive events, as they
        are created together), each starting its flow without syncing the network again (the first start of an
        instant syncs, later ones only add flows): one timer starting the flows in the same order does the same.
        """
        key = (src, dst, size_bytes)
        found = self._shadow_sends.get(key)
        if found is not None:
            return found
        pairs = self.shadows.pairs(src, dst)
        schedules = [self._lower("send", pair, size_bytes) for pair in pairs
                     if self._kept is None or ("send", pair, size_bytes) in self._kept]
        kept = len(schedules)
        dropped = len(pairs) - kept
        moving = [schedule for schedule in schedules if schedule.phases]     # no phases: nothing to launch
        if moving and all(len(s.phases) == 1 and s.phases[0].latency_s == moving[0].phases[0].latency_s
                          for s in moving):
            flows = tuple(flow for schedule in moving for flow in schedule.phases[0].flows)
            merged = CollectiveSchedule("send", (), size_bytes, "direct", "simple",
                                        (Phase(flows, moving[0].phases[0].latency_s),))
            found = ((merged,), kept, dropped)
        else:
            found = (tuple(schedules), kept, dropped)
        self._shadow_sends[key] = found
        return found

    def _launch_isolated(self, key: tuple, waiters: list[Pending]) -> None:
        """Complete a link-isolated collective after its time alone on the network (module docstring)."""
        duration = self._isolated[key]
        if duration is None:
            duration = self._isolated[key] = isolated_duration_s(self.topology, self._lower(*key))
        now = self.env.now
        for pending in waiters:
            pending.start_s = now
            pending.reason = ""
        self.isolated_operations += 1
        if len(waiters) == 1:
            waiters[0].done = self.env.timeout(duration)
            return
        timer = self.env.timeout(duration)
        timer.callbacks.append(lambda _event, ws=waiters: [w.done.succeed() for w in ws])

    def _launch(self, schedule: CollectiveSchedule, waiters: list[Pending], label: str) -> None:
        now = self.env.now
        for pending in waiters:
            pending.start_s = now
            pending.reason = ""
        if not self._quiet or not schedule.phases:
            self._begin_phase(_Operation(schedule, waiters, label))
            return
        info = self._alone_of(schedule)
        claims = info[1]
        busy = not self._flowing.keys().isdisjoint(claims)
        meets = self._live_quiet(claims, now)
        if not busy and not meets:
            end = _end_alone(info, now)
            quiet = _Quiet(schedule, now, end, waiters, label, claims)
            self._quiet_claims.update(dict.fromkeys(claims, quiet))
            self.quiet_operations += 1
            if waiters:         # (nobody waits for a shadow: its claim just expires)
                timer = self._at(end)
                timer.callbacks.append(lambda _event, q=quiet: self._quiet_done(q))
            return
        for quiet in meets:
            self._materialize(quiet)
        operation = _Operation(schedule, waiters, label, claims)
        self._claim(claims)
        self._begin_phase(operation)

    def _live_quiet(self, claims: tuple[int, ...], now: float) -> list[_Quiet]:
        """The quiet operations still running that claimed any of `claims` last, each once, in the order of `claims`
        (deterministic); one ending now is free."""
        return [quiet for quiet in dict.fromkeys(map(self._quiet_claims.get, claims))
                if quiet is not None and quiet.live and quiet.end_s > now]

    def _alone_of(self, schedule: CollectiveSchedule) -> tuple:
        """(schedule, footprint, duration alone, quiet.alone_steps), remembered per schedule object."""
        info = self._alone_info.get(id(schedule))
        if info is None:        # (the schedules are kept by the caches that hand them out: ids are not reused)
            info = self._alone_info[id(schedule)] = (schedule, footprint(self.topology, schedule),
                                                     isolated_duration_s(self.topology, schedule),
                                                     alone_steps(self.topology, schedule))
        return info

    def _launch_quiet_shadows(self, key: tuple, kept: tuple, label: str) -> bool:
        """Run the shadows `kept` of a launch of `key` quiet together, as one claim on the union of their footprints,
        if nothing in flight claims any of it (True); else launch nothing (False: each is launched on its own)."""
        batch = self._shadow_batches.get(key)
        if batch is None:
            infos = tuple(self._alone_of(self._lower(key[0], group, key[2])) for group in kept)
            batch = self._shadow_batches[key] = (infos, tuple(sorted(set().union(*(i[1] for i in infos)))),
                                                 _timing_groups(infos)) \
                if all(info[0].phases for info in infos) else ()
        if not batch:
            return False
        infos, union, (timings, which) = batch
        now = self.env.now
        if not self._flowing.keys().isdisjoint(union) or self._live_quiet(union, now):
            return False
        ends = [_end_alone(info, now) for info in timings]      # (one per distinct timing: the same floats)
        parts = tuple(zip(infos, map(ends.__getitem__, which)))
        quiet = _Quiet(None, now, max(ends), [], label, union, parts=parts)
        self._quiet_claims.update(dict.fromkeys(union, quiet))
        self.quiet_operations += len(parts)
        return True

    def _at(self, time_s: float) -> simpy.Event:
        """An event at exactly `time_s` (the engine's environment has `at`; a plain one gets a timeout)."""
        at = getattr(self.env, "at", None)
        return at(time_s) if at is not None else self.env.timeout(max(0.0, time_s - self.env.now))

    def _claim(self, claims: tuple[int, ...]) -> None:
        flowing = self._flowing
        for resource in claims:
            flowing[resource] = flowing.get(resource, 0) + 1

    def _quiet_done(self, quiet: _Quiet) -> None:
        if quiet.live:
            quiet.live = False
            for pending in quiet.waiters:
                pending.done.succeed()

    def _materialize(self, quiet: _Quiet) -> None:
        """Put a quiet operation (each part not ended yet) onto the flow network in the state it has now, having run
        alone since its start."""
        quiet.live = False
        if quiet.parts is None:
            self._materialize_one(quiet.schedule, quiet.start_s, quiet.waiters, quiet.label, quiet.claims)
            return
        now = self.env.now
        for (schedule, claims, _, _), end in quiet.parts:
            if end > now:
                self._materialize_one(schedule, quiet.start_s, [], quiet.label, claims)

    def _materialize_one(self, schedule: CollectiveSchedule, start_s: float, waiters: list[Pending], label: str,
                         claims: tuple[int, ...]) -> None:
        self.materialized_operations += 1
        now = self.env.now
        phase, ready_s, flows = state_at(self.topology, schedule, start_s, now)
        operation = _Operation(schedule, waiters, label, claims)
        operation.phase = phase
        self._claim(claims)
        if ready_s is not None:             # in the phase's latency wait: its flows start at ready_s
            timer = self._at(ready_s)
            timer.callbacks.append(lambda _event, op=operation: self._start_flows(op))
        elif flows:                         # sending: the bytes left, from now
            if not self._refresh_pending:
                self._sync()
            self._owner.update(dict.fromkeys(self.network.start_many(flows, with_latency=False), operation))
            operation.outstanding += len(flows)
            self._reschedule_soon()
        else:                               # (done by now: it ends at once)
            self._begin_phase(operation)

    def _begin_phase(self, operation: _Operation) -> None:
        phases = operation.schedule.phases
        if operation.phase >= len(phases):
            if operation.claims:
                flowing = self._flowing
                for resource in operation.claims:
                    left = flowing[resource] - 1
                    if left:
                        flowing[resource] = left
                    else:
                        del flowing[resource]       # (only claimed resources are keys: isdisjoint in _launch)
            for pending in operation.waiters:
                pending.done.succeed()
            return
        latency = phases[operation.phase].latency_s
        if latency > 0:
            timer = self.env.timeout(latency)
            timer.callbacks.append(lambda _event, op=operation: self._start_flows(op))
        else:
            self._start_flows(operation)

    def _start_flows(self, operation: _Operation) -> None:
        if not self._refresh_pending:
            self._sync()      # else: synced at this very time already; only flows were added since
        flows = operation.schedule.phases[operation.phase].flows
        if flows:
            self._owner.update(dict.fromkeys(self.network.start_many(flows, with_latency=False), operation))
            operation.outstanding += len(flows)
        else:
            operation.phase += 1
            self._begin_phase(operation)
        self._reschedule_soon()

    def _reschedule_soon(self) -> None:
        """Re-rate and set the timer once after every launch at this time (not once per launch).

        Flows started at one instant all share the instant's rates: the intermediate rates a re-rating after
        each start would give are replaced before any time passes, so one re-rating at the end of the
        instant gives the same rates and end times (each re-rating costs the whole connected component).
        """
        if self._refresh_pending:
            return
        self._refresh_pending = True
        event = self.env.event()
        event.callbacks.append(self._deferred_reschedule)
        event.succeed()

    def _deferred_reschedule(self, _event) -> None:
        self._refresh_pending = False
        self._sync()
        self._reschedule()

    def _sync(self, until_s: float = 0.0) -> None:
        """Bring the flow network to the simpy clock (or `until_s` if later); finish delivered phases."""
        until = max(self.env.now, self.network.now_s, until_s)
        finished: list[_Operation] = []
        for flow_id in self.network.advance_ids(until):
            operation = self._owner.pop(flow_id)
            operation.outstanding -= 1
            if operation.outstanding == 0:
                finished.append(operation)
        for operation in finished:
            operation.phase += 1
            self._begin_phase(operation)

    def _reschedule(self) -> None:
        target = self.network.next_event_s()
        if target is None:
            return
        self._timer_version += 1
        version = self._timer_version
        timer = self.env.timeout(max(0.0, target - self.env.now))
        timer.callbacks.append(lambda _event, v=version, t=target: self._on_timer(v, t))

    def _on_timer(self, version: int, target_s: float) -> None:
        if version != self._timer_version:
            return
        # float rounding may leave env.now a hair before the event the timer was set for
        self._sync(target_s)
        self._reschedule()

    # ----- diagnosis -----------------------------------------------------------------------------------------
    def unmatched(self) -> list[str]:
        """Every send or recv still waiting for its peer and every collective waiting for members."""
        lines = []
        for key in sorted(self._sends):
            for send, pending in self._sends[key]:
                lines.append(f"rank {pending.rank}: {pending.reason}")
        for key in sorted(self._recvs):
            for recv, pending in self._recvs[key]:
                lines.append(f"rank {pending.rank}: {pending.reason}")
        for gathering in self._gatherings.values():
            for rank in sorted(gathering.arrived):
                lines.append(f"rank {rank}: {gathering.arrived[rank].reason}")
        return lines
