"""Schedule validation (complete, ordered, deadlock-free) and execution with uniform per-action costs."""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

from simulator.errors import DeadlockError, ScheduleError
from simulator.parallel.schedules import SCHEDULE_NAMES, Action, Schedule, by_name, check_complete, read_actions


@dataclass(frozen=True)
class Blocked:
    """A rank that cannot go on: the action at the head of its list and the input it waits for."""

    rank: int
    position: int
    action: Action
    waiting_for: Action
    waiting_rank: int           # the rank that runs `waiting_for`

    def __str__(self) -> str:
        source = ("later on its own list" if self.waiting_rank == self.rank
                  else f"from rank {self.waiting_rank}")
        return f"rank {self.rank} blocked at {self.action} (position {self.position}) waiting for " \
               f"{self.waiting_for} {source}"


class ScheduleDeadlock(DeadlockError):
    """A schedule that cannot run to the end; `blocked` lists every stuck rank and what it waits for."""

    def __init__(self, message: str, blocked: tuple[Blocked, ...]):
        super().__init__(message)
        self.blocked = blocked


@dataclass(frozen=True)
class Transfer:
    """A point-to-point message a schedule implies: activations to the next stage or gradients to the previous."""

    kind: str                   # "activation" (after F) | "gradient" (after B or I)
    producer: Action
    consumer: Action
    src_rank: int
    dst_rank: int

    @property
    def key(self) -> tuple[str, int, int]:
        """(kind, producing stage, microbatch): what matches a send with its recv."""
        return (self.kind, self.producer.stage, self.producer.microbatch)


@dataclass(frozen=True)
class CommStep:
    """A send or recv in a rank's lowered program (torch's SEND_F / RECV_F / SEND_B / RECV_B)."""

    op: str                     # "send" | "recv"
    peer: int                   # the other rank
    transfer: Transfer

    def __str__(self) -> str:
        suffix = "F" if self.transfer.kind == "activation" else "B"
        stage = self.transfer.producer.stage if self.op == "send" else self.transfer.consumer.stage
        return f"{stage}{self.op.upper()}_{suffix}{self.transfer.producer.microbatch}"


@dataclass(frozen=True)
class TimedAction:
    """An action with its start and end time on its rank."""

    action: Action
    start_s: float
    end_s: float


@dataclass(frozen=True)
class UniformTiming:
    """What a schedule does with constant per-action costs.

    Attributes:
        ranks: per rank, its actions in order with start and end times.
        iteration_time_s: from the first start to the last end.
        busy_s: per rank, time spent computing.
        bubble_s: per rank, idle time between its own first start and last end (Qi et al.'s bubble).
        bubble_fraction: bubble_s / own span of the busiest rank (ties: the one with the most bubble).
            For 1F1B and interleaved 1F1B the busiest rank spans the iteration: (p-1)/(m+p-1) for 1F1B.
        idle_fraction: 1 - busy / iteration_time_s of the busiest rank (the ramp-up and drain included).
        peak_in_flight: per rank, the most (stage, microbatch) pairs holding activations at once: F
            started, its B (or W) not finished.
        peak_activations: peak_in_flight / virtual_stages, in microbatches of the rank's full activations.
    """

    ranks: tuple[tuple[TimedAction, ...], ...]
    iteration_time_s: float
    busy_s: tuple[float, ...]
    bubble_s: tuple[float, ...]
    bubble_fraction: float
    idle_fraction: float
    peak_in_flight: tuple[int, ...]
    peak_activations: tuple[float, ...]


@dataclass(frozen=True)
class _Index:
    position: dict[tuple[int, str, int], tuple[int, int]]   # action key -> (rank, position)
    grad_kind: dict[tuple[int, int], str]                    # (stage, microbatch) -> "B" | "I"


def _index(schedule: Schedule) -> _Index:
    position: dict[tuple[int, str, int], tuple[int, int]] = {}
    grad_kind: dict[tuple[int, int], str] = {}
    for rank, actions in enumerate(schedule.ranks):
        for i, action in enumerate(actions):
            position[action.key] = (rank, i)
            if action.kind in ("B", "I"):
                grad_kind[(action.stage, action.microbatch)] = action.kind
    return _Index(position, grad_kind)


def _dependencies(schedule: Schedule, index: _Index, action: Action) -> tuple[Action, ...]:
    return tuple(Action(*key) for key in _dependency_keys(schedule, index, action))


def _dependency_keys(schedule: Schedule, index: _Index, action: Action) -> tuple[tuple[int, str, int], ...]:
    """The keys of `_dependencies(schedule, index, action)`, without making (and checking) Actions."""
    stage, microbatch = action.stage, action.microbatch
    if action.kind == "F":
        return ((stage - 1, "F", microbatch),) if stage > 0 else ()
    if action.kind == "W":
        return ((stage, "I", microbatch),)
    if stage + 1 < schedule.num_stages:
        return ((stage, "F", microbatch), (stage + 1, index.grad_kind.get((stage + 1, microbatch), "B"), microbatch))
    return ((stage, "F", microbatch),)


def dependencies(schedule: Schedule, action: Action) -> tuple[Action, ...]:
    """The actions whose results `action` needs.

    F of stage s needs F of stage s-1 (same microbatch); B or I of stage s needs its own F and the B or I
    of stage s+1 (the gradient of its output); W needs the I of the same stage and microbatch.
    """
    return _dependencies(schedule, _index(schedule), action)


def transfers(schedule: Schedule) -> tuple[Transfer, ...]:
    """Every message the schedule implies between different ranks, in (stage, microbatch) order."""
    index = _index(schedule)
    result = []
    for rank, actions in enumerate(schedule.ranks):
        for action in actions:
            for dep in _dependency_keys(schedule, index, action):
                if dep[0] == action.stage:
                    continue
                src = schedule.rank_of(dep[0])
                if src != rank:
                    kind = "activation" if action.kind == "F" else "gradient"
                    result.append(Transfer(kind, Action(*dep), action, src, rank))
    result.sort(key=lambda t: (t.producer.stage, t.producer.microbatch, t.kind))
    return tuple(result)


def program(schedule: Schedule) -> tuple[tuple[Action | CommStep, ...], ...]:
    """Per rank, its actions with the implied sends (right after the producer) and recvs (right before the consumer)."""
    sends: dict[tuple[int, str, int], list[CommStep]] = {}
    recvs: dict[tuple[int, str, int], list[CommStep]] = {}
    for transfer in transfers(schedule):
        sends.setdefault(transfer.producer.key, []).append(CommStep("send", transfer.dst_rank, transfer))
        recvs.setdefault(transfer.consumer.key, []).append(CommStep("recv", transfer.src_rank, transfer))
    lowered = []
    for actions in schedule.ranks:
        steps: list[Action | CommStep] = []
        for action in actions:
            steps += recvs.get(action.key, [])
            steps.append(action)
            steps += sends.get(action.key, [])
        lowered.append(tuple(steps))
    return tuple(lowered)


def _check_local_order(schedule: Schedule, index: _Index) -> None:
    """F before its B or I, and I before its W, on the rank that owns the stage."""
    for rank, actions in enumerate(schedule.ranks):
        for i, action in enumerate(actions):
            if action.kind == "F":
                continue
            before = "I" if action.kind == "W" else "F"
            need = Action(action.stage, before, action.microbatch)
            _, j = index.position[need.key]
            if j > i:
                raise ScheduleError(f"schedule {schedule.name!r}: rank {rank}: {action} at position {i} comes "
                                    f"before {need} at position {j}: {before} must run before its {action.kind} "
                                    f"on the rank that owns the stage")


def _run(schedule: Schedule, index: _Index, cost_s: dict[str, float], comm_s: float, blocking_sends: bool = False
         ) -> tuple[list[list[tuple[float, float]]], tuple[Blocked, ...]]:
    """Execute every rank's list in order; an action starts when its rank is free and its inputs arrived.

    Sends are asynchronous (isend, as in torch.distributed.pipelining and Megatron's batched p2p), receives
    block. With `blocking_sends` a rank's next action also waits until the receiver of each message its last
    action sent has posted the receive (reached the consuming action), as Megatron's and DeepSpeed's blocking
    send/recv do. Returns per-rank (start, end) times, and every blocked rank when the run cannot finish.
    """
    p = schedule.num_ranks
    times: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    end: dict[tuple[int, str, int], float] = {}
    free = [0.0] * p
    waiting: dict[tuple[int, str, int], list[int]] = {}
    waiting_posts: list[list[int]] = [[] for _ in range(p)]   # rank -> ranks waiting for it to reach an action
    consumers = _consumers(schedule, index) if blocking_sends else {}
    ready = deque(range(p))
    rank_of = schedule.stage_ranks
    while ready:
        rank = ready.popleft()
        actions = schedule.ranks[rank]
        while len(times[rank]) < len(actions):
            position = len(times[rank])
            action = actions[position]
            unposted = next(((dst, at) for dst, at in consumers.get(actions[position - 1].key, ())
                             if len(times[dst]) < at), None) if position and consumers else None
            if unposted is not None:
                waiting_posts[unposted[0]].append(rank)
                break
            start = free[rank]
            missing = None
            for dep in _dependency_keys(schedule, index, action):
                done = end.get(dep)
                if done is None:
                    missing = dep
                    break
                start = max(start, done + (comm_s if rank_of[dep[0]] != rank else 0.0))
            if missing is not None:
                waiting.setdefault(missing, []).append(rank)
                break
            finish = start + cost_s[action.kind]
            times[rank].append((start, finish))
            key = action.key
            end[key] = finish
            free[rank] = finish
            ready.extend(waiting.pop(key, ()))
            if waiting_posts[rank]:
                ready.extend(waiting_posts[rank])
                waiting_posts[rank] = []
    blocked = []
    for rank, actions in enumerate(schedule.ranks):
        done = len(times[rank])
        if done < len(actions):
            action = actions[done]
            missing = [d for d in _dependencies(schedule, index, action) if d.key not in end]
            if not missing:         # waiting for the receiver of a blocking send to post its receive
                dst, at = next((dst, at) for dst, at in consumers[actions[done - 1].key] if len(times[dst]) < at)
                consumer = schedule.ranks[dst][at]
                blocked.append(Blocked(rank, done, action, consumer, dst))
                continue
            dep = missing[0]
            dep = Action(dep.stage, dep.kind, dep.microbatch, schedule.chunk_of(dep.stage))
            blocked.append(Blocked(rank, done, action, dep, rank_of[dep.stage]))
    return times, tuple(blocked)


def _consumers(schedule: Schedule, index: _Index) -> dict[tuple[int, str, int], list[tuple[int, int]]]:
    """Action key -> (rank, position) of each action on another rank that consumes its output."""
    result: dict[tuple[int, str, int], list[tuple[int, int]]] = {}
    for transfer in transfers(schedule):
        result.setdefault(transfer.producer.key, []).append(index.position[transfer.consumer.key])
    return result


def _deadlock(schedule: Schedule, blocked: tuple[Blocked, ...], blocking_sends: bool = False) -> ScheduleDeadlock:
    total = sum(len(actions) for actions in schedule.ranks)
    stuck = sum(len(schedule.ranks[b.rank]) - b.position for b in blocked)
    sends = " with blocking sends (parallel.overlap_p2p_comm = false)" if blocking_sends else ""
    return ScheduleDeadlock(f"schedule {schedule.name!r} deadlocks{sends} with {stuck} of {total} actions left: "
                            + "; ".join(str(b) for b in blocked), blocked)


def validate(schedule: Schedule, blocking_sends: bool = False) -> None:
    """Reject a schedule that cannot run.

    Checks that every (stage, microbatch) has exactly one F and one B (or one I and one W), that F comes
    before its B or I and I before its W on the owning rank, and runs the ranks' lists with blocking
    receives: F of stage s+1 waits for F of stage s, B (or I) of stage s for B (or I) of stage s+1.
    With `blocking_sends` (parallel.overlap_p2p_comm = false) a rank's next action also waits until every
    message its last action sent is received (see _run): a receiver that takes them in another order deadlocks.

    Raises:
        ScheduleError: a missing, repeated or misordered action (one line: where, the action, the rule).
        ScheduleDeadlock: a DeadlockError naming every blocked (rank, action, waiting for); its `blocked`
            attribute holds them as Blocked values.
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"schedule = {schedule!r}: must be a Schedule (see simulator.parallel.schedules)")
    check_complete(schedule)
    index = _index(schedule)
    _check_local_order(schedule, index)
    _, blocked = _run(schedule, index, {kind: 1.0 for kind in ("F", "B", "I", "W")}, 0.0, blocking_sends)
    if blocked:
        raise _deadlock(schedule, blocked, blocking_sends)


def _cost(key: str, value: object, minimum_exclusive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value in (float("inf"), float("-inf")) or (value <= 0 if minimum_exclusive else value < 0):
        rule = "> 0" if minimum_exclusive else ">= 0"
        raise ScheduleError(f"execute_uniform: {key} = {value!r}: must be a finite number {rule}")
    return float(value)


def execute_uniform(schedule: Schedule, f: float, b: float, w: float | None = None, comm: float = 0.0
                    ) -> UniformTiming:
    """Run a schedule where every action of a kind costs the same (seconds, or any one time unit).

    Args:
        schedule: a schedule (validated first).
        f: time of one F (one stage, one microbatch).
        b: time of one full backward B; a split backward costs the same in total: I = b - w, W = w.
        w: time of one W; default b / 2 (Qi et al.'s equal B and W).
        comm: time of each message between different ranks (stages on the same rank pass for free).

    Raises:
        ScheduleError, ScheduleDeadlock: as validate; or a cost that is not a finite number > 0
            (comm >= 0; w < b).
    """
    f, b, comm = _cost("f", f), _cost("b", b), _cost("comm", comm, minimum_exclusive=False)
    w = b / 2 if w is None else _cost("w", w)
    if w >= b:
        raise ScheduleError(f"execute_uniform: w = {w!r}: must be less than b = {b!r} (B = I + W, I > 0)")
    validate(schedule)
    index = _index(schedule)
    times, _ = _run(schedule, index, {"F": f, "B": b, "I": b - w, "W": w}, comm)
    p, v = schedule.num_ranks, schedule.virtual_stages
    start = min((t[0][0] for t in times if t), default=0.0)
    finish = max((t[-1][1] for t in times if t), default=0.0)
    iteration = finish - start
    busy = tuple(sum(e - s for s, e in t) for t in times)
    bubble = tuple((t[-1][1] - t[0][0]) - busy[r] if t else 0.0 for r, t in enumerate(times))
    top = max(busy)
    busiest = [r for r in range(p) if busy[r] >= top * (1 - 1e-9)]
    worst = max(busiest, key=lambda r: (bubble[r], -r))
    span = times[worst][-1][1] - times[worst][0][0] if times[worst] else 0.0
    peaks = []
    for actions in schedule.ranks:
        held = peak = 0
        for action in actions:
            if action.kind == "F":
                held += 1
                peak = max(peak, held)
            elif action.kind in ("B", "W"):
                held -= 1
        peaks.append(peak)
    timed = tuple(tuple(TimedAction(action, s, e) for action, (s, e) in zip(actions, times[r]))
                  for r, actions in enumerate(schedule.ranks))
    return UniformTiming(
        ranks=timed, iteration_time_s=iteration, busy_s=busy, bubble_s=bubble,
        bubble_fraction=bubble[worst] / span if span > 0 else 0.0,
        idle_fraction=1.0 - top / iteration if iteration > 0 else 0.0,
        peak_in_flight=tuple(peaks), peak_activations=tuple(peak / v for peak in peaks))


def load_schedule(spec: str, p: int, m: int, v: int = 1, key: str = "parallel.schedule",
                  blocking_sends: bool = False) -> Schedule:
    """The schedule a scenario names, checked against its plan and validated.

    Args:
        spec: a built-in name (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2) or a path to an action file.
        p: pipeline ranks (parallel.pp); m: microbatches per iteration; v: parallel.virtual_stages.
        key: the scenario key named in messages.
        blocking_sends: validate as the run sends (parallel.overlap_p2p_comm = false: blocking sends).

    Raises:
        ScheduleError, ScheduleDeadlock: one line `<key> = <spec>: <what is wrong>`.
    """
    path = os.fspath(spec) if isinstance(spec, (str, os.PathLike)) else spec
    try:
        if not isinstance(path, str) or path in SCHEDULE_NAMES or not any(c in path for c in "/\\."):
            schedule = by_name(path, p, m, v)
        else:
            schedule = read_actions(path, microbatches=m)
            for what, found, wanted, plan_key in (("lines (ranks)", schedule.num_ranks, p, "parallel.pp"),
                                                 ("stages per rank", schedule.virtual_stages, v,
                                                  "parallel.virtual_stages")):
                if found != wanted:
                    raise ScheduleError(f"the file has {found} {what}, {plan_key} = {wanted}")
        validate(schedule, blocking_sends)
    except ScheduleDeadlock as error:
        raise ScheduleDeadlock(f"{key} = {path!r}: {error}", error.blocked) from None
    except ScheduleError as error:
        message = str(error)
        for prefix in (f"{path}: ", f"schedule = {path!r}: "):
            if message.startswith(prefix):
                message = message[len(prefix):]
        raise ScheduleError(f"{key} = {path!r}: {message}") from None
    return schedule

