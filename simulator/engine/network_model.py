"""Communication in the engine: collectives and send/recv as flows on one shared FlowNetwork, driven by simpy.

Every transfer of every rank runs on a single `FlowNetwork`, so concurrent collectives and pipeline
messages share links max-min fairly. A collective launches when its last simulated member posts it
(members the symmetry reduction does not simulate are assumed to arrive with their representative);
it is lowered by `lower_collective` and its phases run one after another (each waits its latency, then
starts its flows). A send/recv pair launches when both sides are posted (NCCL: blocking until matched);
a send or recv whose peer is not simulated launches when posted. With a `ParallelPlan`, the traffic of
unsimulated ranks that the representatives stand for (the other TP/DP groups of a stage, the other
stage-to-stage pairs) is started too, as *shadow* operations that nobody waits for but that load the
links exactly as in a full simulation.
"""

from __future__ import annotations

from collections import deque
import simpy

from simulator.errors import PlanError
from simulator.network.collectives import CollectiveSchedule, lower_collective
from simulator.network.flows import FlowNetwork
from simulator.network.topology import Topology
from simulator.parallel.plan import ParallelPlan
from simulator.parallel.program import Collective, Recv, Send

AXES_TRIED = ("tp", "dp", "pp")


class Pending:
    """A posted communication instruction: its `done` event and a description of what it waits for."""

    def __init__(self, env: simpy.Environment, rank: int, posted_s: float):
        self.done = env.event()
        self.rank = rank
        self.posted_s = posted_s
        self.start_s = posted_s     # set again when the transfer launches
        self.reason = ""


class _Operation:
    """A lowered schedule in progress: current phase, flows outstanding, who waits for it."""

    __slots__ = ("schedule", "phase", "outstanding", "waiters", "label")

    def __init__(self, schedule: CollectiveSchedule, waiters: list[Pending], label: str):
        self.schedule = schedule
        self.phase = 0
        self.outstanding = 0
        self.waiters = waiters
        self.label = label


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
    """

    def __init__(self, env: simpy.Environment, topology: Topology, simulated_ranks: tuple[int, ...],
                 plan: ParallelPlan | None = None):
        self.env = env
        self.topology = topology
        self.plan = plan
        self.simulated = frozenset(simulated_ranks)
        self.network = FlowNetwork(topology, start_s=env.now)
        self._gatherings: dict[tuple, _Gathering] = {}
        self._occurrences: dict[tuple, int] = {}
        self._sends: dict[tuple[int, int, str], deque[tuple[Send, Pending]]] = {}
        self._recvs: dict[tuple[int, int, str], deque[tuple[Recv, Pending]]] = {}
        self._owner: dict[int, _Operation] = {}
        self._timer_version = 0
        self._schedules: dict[tuple, CollectiveSchedule] = {}
        self._shadow_groups: dict[tuple, tuple[tuple[int, ...], ...]] = {}
        self.shadow_operations = 0

    # ----- posting ------------------------------------------------------------------------------------------
    def collective(self, rank: int, instruction: Collective) -> Pending:
        """Post `instruction` from `rank`; the collective launches when every simulated member posted it."""
        if rank not in instruction.group:
            raise PlanError(f"collective {instruction.name!r}: rank {rank} posts it but group = "
                            f"{list(instruction.group)} does not contain it")
        pending = Pending(self.env, rank, self.env.now)
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
        schedule = self._lower(instruction.kind, instruction.group, instruction.size_bytes)
        self._launch(schedule, waiters, instruction.name)
        for group in self._shadows(instruction.kind, instruction.group):
            self._launch(self._lower(instruction.kind, group, instruction.size_bytes), [], instruction.name)
            self.shadow_operations += 1
        return pending

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

    @staticmethod
    def _check_pair(send: Send, recv: Recv, src: int) -> None:
        if send.size_bytes != recv.size_bytes:
            raise PlanError(f"send {send.name!r} from rank {src} (tag {send.tag!r}): size_bytes = "
                            f"{send.size_bytes!r} but the matching recv {recv.name!r} expects {recv.size_bytes!r}")

    # ----- lowering and symmetry ----------------------------------------------------------------------------
    def _lower(self, kind: str, group: tuple[int, ...], size_bytes: float) -> CollectiveSchedule:
        key = (kind, group, size_bytes)
        schedule = self._schedules.get(key)
        if schedule is None:
            schedule = self._schedules[key] = lower_collective(self.topology, kind, group, size_bytes)
        return schedule

    def _represented(self, rank: int) -> tuple[int, ...]:
        """Unsimulated ranks `rank` stands for: the rest of its stage when it is the stage's representative."""
        plan = self.plan
        if plan is None or not 0 <= rank < plan.world_size:
            return ()
        stage = plan.stage_of(rank)
        if plan.rank_of(dp=0, pp=stage, tp=0) != rank:
            return ()
        return tuple(r for r in plan.stage_ranks(stage) if r not in self.simulated)

    def _shadows(self, kind: str, group: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """Groups of the same axis that unsimulated, represented ranks run the same collective over."""
        key = (kind, group)
        if key in self._shadow_groups:
            return self._shadow_groups[key]
        plan = self.plan
        found: dict[tuple[int, ...], None] = {}
        if plan is not None and len(self.simulated) < plan.world_size \
                and all(0 <= r < plan.world_size for r in group):
            members = sorted(group)
            axis = next((a for a in AXES_TRIED if sorted(plan.group_of(members[0], a)) == members), None)
            if axis is not None:
                position = {r: plan.group_of(r, axis).index(r) for r in group}
                for rank in group:
                    if rank not in self.simulated:
                        continue
                    for other in self._represented(rank):
                        shadow_group = plan.group_of(other, axis)
                        if any(r in self.simulated for r in shadow_group):
                            continue
                        # keep the members in the order the real group lists them (broadcast root first)
                        ordered = tuple(sorted(shadow_group, key=lambda r: _order_in(group, position, r, plan,
                                                                                    axis)))
                        found.setdefault(ordered, None)
        result = tuple(found)
        self._shadow_groups[key] = result
        return result

    def _shadow_pairs(self, src: int, dst: int) -> tuple[tuple[int, int], ...]:
        """Stage-to-stage pairs of unsimulated ranks that (src, dst) stand for."""
        plan = self.plan
        if plan is None or len(self.simulated) == plan.world_size \
                or not (0 <= src < plan.world_size and 0 <= dst < plan.world_size):
            return ()
        dst_stage = plan.stage_of(dst)
        pairs = []
        for other in self._represented(src):
            coords = plan.coords(other)
            peer = plan.rank_of(dp=coords.dp, pp=dst_stage, tp=coords.tp)
            if peer != other and peer not in self.simulated:
                pairs.append((other, peer))
        return tuple(pairs)

    # ----- driving the flow network -------------------------------------------------------------------------
    def _transfer(self, src: int, dst: int, size_bytes: float, waiters: list[Pending], label: str) -> None:
        self._launch(self._lower("send", (src, dst), size_bytes), waiters, label)
        for a, b in self._shadow_pairs(src, dst):
            self._launch(self._lower("send", (a, b), size_bytes), [], label)
            self.shadow_operations += 1

    def _launch(self, schedule: CollectiveSchedule, waiters: list[Pending], label: str) -> None:
        now = self.env.now
        for pending in waiters:
            pending.start_s = now
            pending.reason = ""
        operation = _Operation(schedule, waiters, label)
        self._begin_phase(operation)

    def _begin_phase(self, operation: _Operation) -> None:
        phases = operation.schedule.phases
        if operation.phase >= len(phases):
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
        self._sync()
        flows = operation.schedule.phases[operation.phase].flows
        for flow in flows:
            flow_id = self.network.start(flow, with_latency=False)
            self._owner[flow_id] = operation
            operation.outstanding += 1
        if not flows:
            operation.phase += 1
            self._begin_phase(operation)
        self._reschedule()

    def _sync(self, until_s: float = 0.0) -> None:
        """Bring the flow network to the simpy clock (or `until_s` if later); finish delivered phases."""
        until = max(self.env.now, self.network.now_s, until_s)
        finished: list[_Operation] = []
        for delivery in self.network.advance(until):
            operation = self._owner.pop(delivery.flow_id)
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


def _order_in(group: tuple[int, ...], position: dict[int, int], rank: int, plan: ParallelPlan, axis: str) -> int:
    """Sort key putting a shadow group's members in the order of the real group's axis coordinates."""
    coordinate = plan.group_of(rank, axis).index(rank)
    order = [position[r] for r in group]
    return order.index(coordinate) if coordinate in order else coordinate
