"""Pipeline schedules as data: per-rank action lists, the built-in generators and torch's action notation."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterable

from simulator.errors import ScheduleError
from simulator.scenario.limits import MAX_MICROBATCHES

KINDS = ("F", "B", "I", "W")   # forward, full backward, backward for inputs only, backward for weights only
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2")
_TOKEN = re.compile(r"([0-9]+)([A-Za-z_]+)([0-9]+)")     # ASCII digits only (\d takes any script's)
MAX_STAGE_INDEX = 65535       # an action file names at most 65536 stages (ranks x virtual stages)
_COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD")
Locator = Callable[[int, "int | None"], str]    # (rank, position or None) -> "line 3" / "rank 2, position 5"


@dataclass(frozen=True)
class Action:
    """One compute step of a pipeline stage on one microbatch, written like torch's `1F0`.

    `stage` is the global stage index (0 .. ranks * virtual_stages - 1) as in torch.distributed.pipelining;
    `chunk` is the model chunk of that stage on its rank. A Schedule fills `chunk` in from its placement,
    so it is left out of equality: Action(2, "F", 0) == Action(2, "F", 0, chunk=1).
    """

    stage: int
    kind: str
    microbatch: int
    chunk: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for key in ("stage", "microbatch"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(f"action {key} = {value!r}: must be an integer >= 0")
        if self.kind not in KINDS:
            raise ScheduleError(f"action kind = {self.kind!r}: unknown kind (allowed: {', '.join(KINDS)})")
        if self.chunk is not None and (not isinstance(self.chunk, int) or isinstance(self.chunk, bool)
                                       or self.chunk < 0):
            raise ScheduleError(f"action chunk = {self.chunk!r}: must be an integer >= 0 or None")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def from_str(cls, text: str) -> "Action":
        """Parse one token such as "0F1" (stage 0, forward, microbatch 1).

        Raises:
            ScheduleError: the token is not STAGE KIND MICROBATCH or the kind is not F, B, I or W.
        """
        match = _TOKEN.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(f"action {text!r}: expected STAGE KIND MICROBATCH, e.g. 0F1 or 2W3")
        stage, kind, microbatch = match.groups()
        if kind in _COMM_KINDS:
            raise ScheduleError(f"action {text!r}: communication actions are derived by memsim; "
                                f"list compute actions only ({', '.join(KINDS)})")
        if kind not in KINDS:
            raise ScheduleError(f"action {text!r}: unknown kind {kind!r} (allowed: {', '.join(KINDS)})")
        if len(stage.lstrip('0')) > 6 or int(stage) > MAX_STAGE_INDEX:
            raise ScheduleError(f"action {text!r}: stage {stage[:12]}{'...' if len(stage) > 12 else ''} out of "
                                f"range: at most {MAX_STAGE_INDEX}")
        if len(microbatch.lstrip('0')) > 6 or int(microbatch) >= MAX_MICROBATCHES:
            raise ScheduleError(f"action {text!r}: micro-batch {microbatch[:12]}{'...' if len(microbatch) > 12 else ''}"
                                f" out of range: at most {MAX_MICROBATCHES - 1} (simulator/scenario/limits.py)")
        return cls(int(stage), kind, int(microbatch))

    @property
    def key(self) -> tuple[int, str, int]:
        """(stage, kind, microbatch): what identifies the action inside a schedule."""
        return (self.stage, self.kind, self.microbatch)


@dataclass(frozen=True)
class Schedule:
    """Per pipeline rank, the ordered actions it runs in one iteration.

    Attributes:
        name: a label ("1f1b", or a file name for a custom schedule).
        ranks: one tuple of actions per pipeline rank, in execution order.
        microbatches: m, microbatches per iteration.
        virtual_stages: v, model chunks (stages) per rank; the pipeline has ranks * v stages.
        stage_ranks: the rank of every stage. Empty means: the rank whose list names the stage
            (stages that no list names go to rank stage % ranks, Megatron's looped placement).
    """

    name: str
    ranks: tuple[tuple[Action, ...], ...]
    microbatches: int
    virtual_stages: int = 1
    stage_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ScheduleError(f"schedule name = {self.name!r}: must be a string")
        if isinstance(self.stage_ranks, (str, bytes)) or not isinstance(self.stage_ranks, Iterable):
            raise ScheduleError(f"schedule {self.name!r}: stage_ranks = {self.stage_ranks!r}: must be a list of ranks")
        for key in ("microbatches", "virtual_stages"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"schedule {self.name!r}: {key} = {value!r}: must be an integer >= 1")
        if isinstance(self.ranks, (str, bytes)) or not isinstance(self.ranks, Iterable):
            raise ScheduleError(f"schedule {self.name!r}: ranks = {self.ranks!r}: must be a list of action lists")
        rows = list(self.ranks)
        if any(isinstance(row, (str, bytes)) or not isinstance(row, Iterable) for row in rows):
            raise ScheduleError(f"schedule {self.name!r}: ranks = {self.ranks!r}: each rank needs a list of Actions")
        ranks = tuple(tuple(actions) for actions in rows)
        if not ranks:
            raise ScheduleError(f"schedule {self.name!r}: ranks = (): needs at least one pipeline rank")
        prefix = f"schedule {self.name!r}"
        placement = _placement(ranks, self.virtual_stages, tuple(self.stage_ranks), prefix, _rank_locator)
        for rank, actions in enumerate(ranks):
            for position, action in enumerate(actions):
                _check_ranges(action, rank, position, len(ranks) * self.virtual_stages, self.microbatches,
                              prefix, _rank_locator)
        chunks = _chunks(placement, len(ranks))
        filled = []
        for rank, actions in enumerate(ranks):
            row = []
            for position, action in enumerate(actions):
                chunk = chunks[action.stage]
                if action.chunk is not None and action.chunk != chunk:
                    raise ScheduleError(f"schedule {self.name!r}: {_rank_locator(rank, position)}: action "
                                        f"{action}: chunk = {action.chunk} but stage {action.stage} is "
                                        f"chunk {chunk} of rank {placement[action.stage]}")
                row.append(action if action.chunk == chunk else Action(action.stage, action.kind,
                                                                          action.microbatch, chunk))
            filled.append(tuple(row))
        object.__setattr__(self, "ranks", tuple(filled))
        object.__setattr__(self, "stage_ranks", placement)

    @property
    def num_ranks(self) -> int:
        """p, the pipeline ranks."""
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        """p * v, the pipeline stages (model chunks) over all ranks."""
        return len(self.ranks) * self.virtual_stages

    @cached_property
    def split_backward(self) -> bool:
        """Whether any backward is split into I (input gradient) and W (weight gradient). Read once per schedule
        (a walk of every action; the estimate asks it of every plan sharing a built-in schedule)."""
        return any(action.kind in ("I", "W") for actions in self.ranks for action in actions)

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that runs `stage`."""
        return self.stage_ranks[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages of `rank` in chunk order."""
        return tuple(stage for stage, owner in enumerate(self.stage_ranks) if owner == rank)

    def chunk_of(self, stage: int) -> int:
        """The model chunk index of `stage` on its rank."""
        return self.stages_of(self.rank_of(stage)).index(stage)

    def __str__(self) -> str:
        return format_actions(self, header=False)


def _rank_locator(rank: int, position: int | None) -> str:
    return f"rank {rank}" if position is None else f"rank {rank}, position {position}"


def _check_ranges(action: object, rank: int, position: int, num_stages: int, microbatches: int, prefix: str,
                  locate: Locator) -> None:
    where = f"{prefix}: {locate(rank, position)}"
    if not isinstance(action, Action):
        raise ScheduleError(f"{where}: {action!r} is not an Action")
    if action.stage >= num_stages:
        raise ScheduleError(f"{where}: action {action}: stage {action.stage} out of range "
                            f"0..{num_stages - 1} (ranks x virtual stages)")
    if action.microbatch >= microbatches:
        raise ScheduleError(f"{where}: action {action}: microbatch {action.microbatch} out of range "
                            f"0..{microbatches - 1}")


def _owners(ranks: tuple[tuple[Action, ...], ...], num_stages: int, prefix: str, locate: Locator) -> list[int]:
    """The rank whose list names each stage (-1: none); a stage named on two lists is an error."""
    owner = [-1] * num_stages
    for rank, actions in enumerate(ranks):
        for position, action in enumerate(actions):
            if not isinstance(action, Action) or action.stage >= num_stages:
                continue        # reported by the range check with its position
            if owner[action.stage] == -1:
                owner[action.stage] = rank
            elif owner[action.stage] != rank:
                raise ScheduleError(f"{prefix}: {locate(rank, position)}: action {action}: stage {action.stage} "
                                    f"already runs on {locate(owner[action.stage], None)}; a stage runs on one rank")
    return owner


def _placement(ranks: tuple[tuple[Action, ...], ...], virtual_stages: int, given: tuple[int, ...], prefix: str,
               locate: Locator) -> tuple[int, ...]:
    """The rank of each stage: `given`, or where the actions name it; every rank gets v stages."""
    p = len(ranks)
    num_stages = p * virtual_stages
    if given:
        if len(given) != num_stages or any(not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < p
                                           for r in given):
            raise ScheduleError(f"{prefix}: stage_ranks = {given!r}: must give a rank in 0..{p - 1} "
                                f"for each of the {num_stages} stages")
        owner = list(given)
        for rank, actions in enumerate(ranks):
            for position, action in enumerate(actions):
                if isinstance(action, Action) and action.stage < num_stages and owner[action.stage] != rank:
                    raise ScheduleError(f"{prefix}: {locate(rank, position)}: action {action}: stage "
                                        f"{action.stage} runs on rank {owner[action.stage]} (stage_ranks)")
    else:
        owner = _owners(ranks, num_stages, prefix, locate)
        for stage in range(num_stages):
            if owner[stage] == -1:
                owner[stage] = stage % p
    for rank in range(p):
        if owner.count(rank) != virtual_stages:
            stages = [stage for stage in range(num_stages) if owner[stage] == rank]
            raise ScheduleError(f"{prefix}: {locate(rank, None)} runs stages {stages}: every rank "
                                f"must run {virtual_stages} stage(s) (virtual_stages)")
    return tuple(owner)


def _chunks(placement: tuple[int, ...], p: int) -> list[int]:
    seen = [0] * p
    chunks = []
    for owner in placement:
        chunks.append(seen[owner])
        seen[owner] += 1
    return chunks


def check_complete(schedule: Schedule, locate: Locator | None = None, source: str | None = None) -> None:
    """Check that every (stage, microbatch) has exactly one F and one B, or one F, one I and one W.

    Args:
        schedule: the schedule to check.
        locate: names a (rank, position) in messages; default "rank R, position i".
        source: shown first in messages; default "schedule '<name>'".

    Raises:
        ScheduleError: one line naming where, the action and the rule broken.
    """
    locate = locate or _rank_locator
    where = source if source is not None else f"schedule {schedule.name!r}"
    seen: dict[tuple[int, str, int], tuple[int, int]] = {}
    for rank, actions in enumerate(schedule.ranks):
        for position, action in enumerate(actions):
            first = seen.get(action.key)
            if first is not None:
                raise ScheduleError(f"{where}: {locate(rank, position)}: action {action} repeated (first at "
                                    f"{locate(*first)}): each stage runs each microbatch's {action.kind} once")
            seen[action.key] = (rank, position)
    m = schedule.microbatches
    for stage in range(schedule.num_stages):
        rank = schedule.rank_of(stage)
        for microbatch in range(m):
            has = {kind: (stage, kind, microbatch) in seen for kind in KINDS}
            if has["B"] and (has["I"] or has["W"]):
                other = "I" if has["I"] else "W"
                position = seen[(stage, other, microbatch)]
                raise ScheduleError(f"{where}: {locate(*position)}: action {stage}{other}{microbatch} with "
                                    f"{stage}B{microbatch}: a backward is either B, or I and W")
            missing = None
            if not has["F"]:
                missing = "F"
            elif has["W"] and not has["I"]:
                missing = "I"
            elif has["I"] and not has["W"]:
                missing = "W"
            elif not has["B"] and not has["I"]:
                missing = "B"
            if missing is not None:
                raise ScheduleError(f"{where}: {locate(rank, None)}: action {stage}{missing}{microbatch} missing: "
                                    f"stage {stage} runs F, then B or I and W, for every microbatch 0..{m - 1}")


# ---- generators --------------------------------------------------------------------------------------

def _positive(name: str, **values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name}: {key} = {value!r}: must be an integer >= 1")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every forward, then every backward in microbatch order (what torch's ScheduleGPipe runs).

    Holds all m microbatches of activations at once; bubble (p-1)/(m+p-1) of the iteration.
    """
    _positive("gpipe", p=p, m=m)
    ranks = tuple(tuple([Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)])
                  for r in range(p))
    return Schedule("gpipe", ranks, m)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule).

    Rank r runs min(p-r-1, m) warm-up forwards, then alternates one forward and one backward, then
    drains the remaining backwards: at most p - r microbatches of activations on rank r.
    """
    _positive("1f1b", p=p, m=m)
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        actions = [Action(r, "F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action(r, "F", warmup + i), Action(r, "B", i)]
        actions += [Action(r, "B", i) for i in range(m - warmup, m)]
        ranks.append(tuple(actions))
    return Schedule("1f1b", tuple(ranks), m)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B: v model chunks per rank, stage c*p + r is chunk c of rank r.

    Virtual microbatch k runs chunk (k // p) % v forwards (v-1 minus that backwards) of microbatch
    (k // (p*v)) * p + k % p; rank r warms up with 2(p-r-1) + (v-1)p forwards (all of them when m == p).
    Bubble (p-1)/(v*m) of the ideal time; the first rank holds p(1 + (p-1)/(p*v)) microbatches.

    Raises:
        ScheduleError: m is not a multiple of p (Megatron's requirement for this schedule).
    """
    _positive("interleaved-1f1b", p=p, m=m, v=v)
    if m % p:
        raise ScheduleError(f"interleaved-1f1b: microbatches = {m}: must be a multiple of the pipeline "
                            f"ranks p = {p} (Megatron's interleaved schedule)")
    total = m * v

    def action(rank: int, k: int, kind: str) -> Action:
        chunk = (k // p) % v
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(chunk * p + rank, kind, (k // (p * v)) * p + k % p)

    ranks = []
    for r in range(p):
        warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
        actions = [action(r, k, "F") for k in range(warmup)]
        for i in range(total - warmup):
            actions += [action(r, warmup + i, "F"), action(r, i, "B")]
        actions += [action(r, k, "B") for k in range(total - warmup, total)]
        ranks.append(tuple(actions))
    return Schedule("interleaved-1f1b", tuple(ranks), m, v)


def _greedy_split(name: str, p: int, m: int, in_flight_cap: int) -> Schedule:
    """Order F, I and W greedily on unit costs (F = I = W, free communication), as Qi et al. 2024 draw them.

    Each rank, when free, runs the first of: an I whose gradient has arrived (the critical path), a
    forward whose input has arrived while fewer than `in_flight_cap` microbatches hold activations
    (F done, W not), a pending W (it fills what would be a bubble). The order found is the schedule.
    """
    f_done = [[-1] * m for _ in range(p)]      # time step at which F(r, i) finished, -1 = not yet
    i_done = [[-1] * m for _ in range(p)]
    next_f, next_i, next_w = [0] * p, [0] * p, [0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    step = 0
    limit = 3 * m + 2 * p + 1               # every rank is busy once the first gradient is back
    while any(w < m for w in next_w):
        if step > limit:
            raise ScheduleError(f"{name}: p = {p}, m = {m}: no order found within {limit} steps")
        step += 1                               # actions decided now run in [step - 1, step)
        now = step - 1
        chosen = []
        for r in range(p):
            i, f = next_i[r], next_f[r]
            grad_at = (i_done[r + 1][i] if r + 1 < p else f_done[r][i]) if i < f else -1
            grad_ready = 0 <= grad_at <= now
            input_ready = f < m and (r == 0 or 0 <= f_done[r - 1][f] <= now)
            held = f - next_w[r]
            if grad_ready:
                chosen.append((r, "I"))
            elif input_ready and held < in_flight_cap:
                chosen.append((r, "F"))
            elif next_w[r] < next_i[r]:
                chosen.append((r, "W"))
        for r, kind in chosen:
            if kind == "F":
                orders[r].append(Action(r, "F", next_f[r]))
                f_done[r][next_f[r]] = step
                next_f[r] += 1
            elif kind == "I":
                orders[r].append(Action(r, "I", next_i[r]))
                i_done[r][next_i[r]] = step
                next_i[r] += 1
            else:
                orders[r].append(Action(r, "W", next_w[r]))
                next_w[r] += 1
    return Schedule(name, tuple(tuple(order) for order in orders), m)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024): 1F1B's peak activation memory (p microbatches), backward split into I and W.

    Rank r runs 1F1B's warm-up, then F and I in turn, holding back its first r W passes (the ZB1P
    order of torch's ScheduleInterleavedZeroBubble with one stage per rank); the held W passes fill the
    drain. With equal F, I, W times the bubble is (p-1)(T_F + T_B - T_W), a third of 1F1B's
    (p-1)(T_F + T_B + T_W) when m >= p.
    """
    _positive("zb-h1", p=p, m=m)
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        actions = [Action(r, "F", i) for i in range(warmup)]
        weights = 0
        for i in range(m - warmup):
            actions += [Action(r, "F", warmup + i), Action(r, "I", i)]
            if i >= r:
                actions.append(Action(r, "W", weights))
                weights += 1
        for i in range(m - warmup, m):
            actions.append(Action(r, "I", i))
            if i >= r:
                actions.append(Action(r, "W", weights))
                weights += 1
        actions += [Action(r, "W", i) for i in range(weights, m)]
        ranks.append(tuple(actions))
    return Schedule("zb-h1", tuple(ranks), m)


def zb_h2(p: int, m: int) -> Schedule:
    """ZB-H2 (Qi et al. 2024): up to 2p-1 microbatches in flight buy a bubble of (p-1)(T_F + T_B - 2T_W).

    Ordered greedily on equal F, I, W times with at most 2p-1 microbatches holding activations: rank r
    warms up with 2(p-r)-1 forwards and defers W passes into the drain, so with m >= 2p-1 every rank
    is busy from its first action to its last (the paper's parallelogram).
    """
    _positive("zb-h2", p=p, m=m)
    return _greedy_split("zb-h2", p, m, 2 * p - 1)


def by_name(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The built-in schedule `name` (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2) for p ranks, m microbatches.

    Raises:
        ScheduleError: unknown name, or v > 1 for a schedule without virtual stages.
    """
    if name not in SCHEDULE_NAMES:
        from simulator.scenario.schema import did_you_mean
        raise ScheduleError(f"schedule = {name!r}: unknown schedule (allowed: {', '.join(SCHEDULE_NAMES)})"
                            f"{did_you_mean(name, SCHEDULE_NAMES)}")
    if name == "interleaved-1f1b":
        return interleaved_1f1b(p, m, v)
    if v != 1:
        raise ScheduleError(f"schedule = {name!r}: virtual_stages = {v!r}: only interleaved-1f1b runs "
                            f"more than one model chunk per rank")
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1, "zb-h2": zb_h2}[name](p, m)


# ---- torch.distributed.pipelining notation -------------------------------------------------------------

def format_actions(schedule: Schedule, separator: str = " ", header: bool = True) -> str:
    """The schedule in torch.distributed.pipelining's notation: one line per rank, e.g. `0F0 0F1 0B0 0B1`.

    Args:
        schedule: the schedule.
        separator: between actions; "," gives torch's CSV layout.
        header: start with a `#` comment naming the schedule and its shape (parse_actions skips it).
    """
    lines = []
    if header:
        lines.append(f"# {schedule.name}: {schedule.num_ranks} ranks, {schedule.microbatches} microbatches, "
                     f"{schedule.virtual_stages} virtual stage(s); one line per rank")
    lines += [separator.join(str(action) for action in actions) for actions in schedule.ranks]
    return "\n".join(lines) + "\n"


def _looks_like_path(text: str) -> bool:
    stripped = text.strip()
    return ("\n" not in stripped and (os.path.isfile(stripped) or "/" in stripped or "\\" in stripped
                                       or stripped.lower().endswith((".txt", ".csv", ".sched", ".schedule"))))


def parse_actions(text: str | os.PathLike, microbatches: int | None = None, name: str | None = None) -> Schedule:
    """Read a schedule written in torch.distributed.pipelining's notation, from text or a file path.

    One line per pipeline rank; actions `STAGE KIND MICROBATCH` (0F1, 2B0, 1I3, 1W3) separated by
    spaces or commas (torch's CSV); empty cells, blank lines and `#` comments are skipped. The stage
    count is the largest stage + 1 and must be a multiple of the ranks; a stage belongs to the rank
    whose line names it. Every (stage, microbatch) must appear with F and B, or F, I and W.

    Args:
        text: the schedule text, or a path to a file holding it.
        microbatches: m; default the largest microbatch + 1.
        name: the schedule's label; default the file name, or "custom".

    Raises:
        ScheduleError: one line naming the line, the action and the rule (unreadable file, malformed
            token, unknown kind, stage or microbatch out of range, missing or repeated action).
    """
    source = "<text>"
    if isinstance(text, os.PathLike) or (isinstance(text, str) and _looks_like_path(text)):
        source = os.fspath(text).strip() if isinstance(text, str) else os.fspath(text)
        try:
            with open(source, encoding="utf-8") as handle:
                text = handle.read()
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ScheduleError(f"{source}: cannot read schedule file: {reason}") from None
        name = name or os.path.basename(source)
    if not isinstance(text, str):
        raise ScheduleError(f"schedule text = {text!r}: must be a string or a path")
    name = name or "custom"
    rows: list[tuple[int, list[Action]]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        content = line.split("#", 1)[0]
        tokens = [token for token in re.split(r"[,\s]+", content) if token]
        if not tokens:
            continue
        actions = []
        for token in tokens:
            try:
                actions.append(Action.from_str(token))
            except ScheduleError as error:
                raise ScheduleError(f"{source}: line {lineno}: {error}") from None
        rows.append((lineno, actions))
    if not rows:
        raise ScheduleError(f"{source}: no actions: write one line of actions (e.g. 0F0 0B0) per pipeline rank")
    lines = [lineno for lineno, _ in rows]

    def locate(rank: int, position: int | None) -> str:
        where = f"line {lines[rank]} (rank {rank})"
        return where if position is None else f"{where}, action {position + 1}"

    p = len(rows)
    num_stages = 1 + max(action.stage for _, actions in rows for action in actions)
    ranks = tuple(tuple(actions) for _, actions in rows)
    owner = _owners(ranks, num_stages, source, locate)
    if num_stages % p:
        last = max((action.stage, lineno) for lineno, actions in rows for action in actions)
        raise ScheduleError(f"{source}: line {last[1]}: stage {last[0]} out of range: {p} lines (ranks) run "
                            f"stages 0..{num_stages - 1}, and every rank runs the same number of stages")
    if -1 in owner:
        raise ScheduleError(f"{source}: stage {owner.index(-1)} is on no line: stages 0..{num_stages - 1} each "
                            f"need a rank")
    m = microbatches if microbatches is not None else 1 + max(a.microbatch for _, actions in rows for a in actions)
    _positive(source, microbatches=m)
    placement = _placement(ranks, num_stages // p, (), source, locate)
    for rank, actions in enumerate(ranks):
        for position, action in enumerate(actions):
            _check_ranges(action, rank, position, num_stages, m, source, locate)
    schedule = Schedule(name, ranks, m, num_stages // p, placement)
    check_complete(schedule, locate, source)
    return schedule


def read_actions(path: str | os.PathLike, microbatches: int | None = None) -> Schedule:
    """parse_actions for a file path (a str is always taken as a path here)."""
    return parse_actions(_PathText(os.fspath(path)), microbatches)


class _PathText(os.PathLike):
    """A str path that parse_actions must not mistake for schedule text."""

    def __init__(self, path: str):
        self.path = path

    def __fspath__(self) -> str:
        return self.path
