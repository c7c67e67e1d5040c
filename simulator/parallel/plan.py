"""The parallel plan: dp/tp/pp axes, rank <-> coordinates by placement order, process groups, validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NoReturn, Sequence

from simulator.errors import PlanError
from simulator.parallel.partition import StageSpan, imbalance, partition_layers, stage_layer_counts

if TYPE_CHECKING:
    from simulator.network.topology import Topology
    from simulator.scenario.schema import ModelConfig, ParallelConfig, Scenario

AXES = ("dp", "pp", "tp")                 # coordinate order of Coords
DEFAULT_ORDER = ("tp", "dp", "pp")        # fastest to slowest: Megatron's default (TP in a node, PP across)
INTERLEAVED = "interleaved-1f1b"


@dataclass(frozen=True)
class Coords:
    """A rank's position on every parallel axis."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class Representative:
    """One rank standing for an equivalence class of ranks that run identical programs."""

    rank: int
    stage: int
    multiplicity: int      # ranks in the class (the representative included)


def parse_placement(placement: object) -> tuple[str, ...]:
    """The axis order, fastest to slowest, of a placement string ("auto" = tp-dp-pp).

    Raises:
        PlanError: anything but "auto" or an order of tp, dp and pp joined by "-".
    """
    rule = ('must be "auto" or the axes tp, dp and pp each once, fastest to slowest, joined by "-" '
            '(e.g. "tp-dp-pp")')
    if not isinstance(placement, str):
        raise PlanError(f"parallel.placement = {placement!r}: {rule}")
    text = placement.strip().lower()
    if text == "auto":
        return DEFAULT_ORDER
    order = tuple(part.strip() for part in text.split("-"))
    if sorted(order) != sorted(AXES):
        raise PlanError(f"parallel.placement = {placement!r}: {rule}")
    return order


@dataclass(frozen=True)
class ParallelPlan:
    """dp × tp × pp ranks laid out by `placement`; rank r runs on GPU id r of the topology.

    Ranks are a mixed-radix number over the axes in placement order, fastest first: with the default
    "tp-dp-pp", rank = tp + tp_size * (dp + dp_size * pp), as Megatron's parallel_state orders them.
    """

    dp: int
    tp: int
    pp: int
    virtual_stages: int = 1
    placement: str = "auto"
    sequence_parallel: bool = False
    gpus_per_node: int | None = None          # None: every rank on one node
    stages: tuple[StageSpan, ...] = ()        # layer spans per (stage, chunk), model order; () if unknown
    warnings: tuple[str, ...] = ()
    order: tuple[str, ...] = field(init=False)
    _strides: tuple[int, int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for key in ("dp", "tp", "pp", "virtual_stages"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"parallel.{key} = {value!r}: must be a positive integer")
        gpn = self.gpus_per_node
        if gpn is not None and (isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1):
            raise PlanError(f"gpus_per_node = {gpn!r}: must be a positive integer or None")
        order = parse_placement(self.placement)
        strides = {}
        stride = 1
        for axis in order:
            strides[axis] = stride
            stride *= self.size(axis)
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "_strides", tuple(strides[axis] for axis in AXES))

    # ----- sizes ---------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Ranks in the plan: dp × tp × pp."""
        return self.dp * self.tp * self.pp

    def size(self, axis: str) -> int:
        """The degree of `axis` ("dp", "tp" or "pp")."""
        return getattr(self, self._axis(axis))

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours along `axis`."""
        return self._strides[AXES.index(self._axis(axis))]

    @property
    def imbalance(self) -> float:
        """Most / fewest layers on a pipeline stage (1.0 when even or when no stages are known)."""
        return imbalance(self.stages)

    @staticmethod
    def _axis(axis: str) -> str:
        if axis not in AXES:
            raise PlanError(f"axis = {axis!r}: must be one of dp, tp, pp")
        return axis

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise PlanError(f"rank = {rank!r}: must be an integer in 0..{self.world_size - 1}")

    # ----- rank <-> coordinates -----------------------------------------------------------------------------
    def coords(self, rank: int) -> Coords:
        """The (dp, pp, tp) coordinates of `rank`."""
        if type(rank) is not int or not 0 <= rank < self.dp * self.tp * self.pp:   # fast path: a valid int
            self._check_rank(rank)
        dp_s, pp_s, tp_s = self._strides
        return Coords(dp=rank // dp_s % self.dp, pp=rank // pp_s % self.pp, tp=rank // tp_s % self.tp)

    def rank_of(self, *, dp: int, pp: int, tp: int) -> int:
        """The rank at coordinates (dp, pp, tp)."""
        dp_s, pp_s, tp_s = self._strides
        if type(dp) is int and type(pp) is int and type(tp) is int \
                and 0 <= dp < self.dp and 0 <= pp < self.pp and 0 <= tp < self.tp:     # fast path: valid ints
            return dp * dp_s + pp * pp_s + tp * tp_s
        for axis, value in (("dp", dp), ("pp", pp), ("tp", tp)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.size(axis):
                raise PlanError(f"{axis} = {value!r}: must be an integer in 0..{self.size(axis) - 1}")
        dp_s, pp_s, tp_s = self._strides
        return dp * dp_s + pp * pp_s + tp * tp_s

    def stage_of(self, rank: int) -> int:
        """The pipeline stage (pp coordinate) of `rank`."""
        return self.coords(rank).pp

    def node_of(self, rank: int) -> int:
        """The node holding `rank` (0 when gpus_per_node is unknown)."""
        self._check_rank(rank)
        return 0 if self.gpus_per_node is None else rank // self.gpus_per_node

    # ----- groups -------------------------------------------------------------------------------------------
    def group_of(self, rank: int, axis: str) -> tuple[int, ...]:
        """The `axis` process group containing `rank`, in coordinate order."""
        coord = getattr(self.coords(rank), self._axis(axis))
        stride = self.stride(axis)
        base = rank - coord * stride
        return tuple(base + i * stride for i in range(self.size(axis)))

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Every process group of `axis`, ordered by first rank; each lists its ranks in coordinate order.

        The groups of one axis partition the ranks; members differ only in their `axis` coordinate.
        """
        stride, size = self.stride(axis), self.size(axis)
        span = stride * size
        return tuple(tuple(block + offset + i * stride for i in range(size))
                     for block in range(0, self.world_size, span) for offset in range(stride))

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """All ranks of pipeline stage `stage`, ascending."""
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < self.pp:
            raise PlanError(f"stage = {stage!r}: must be an integer in 0..{self.pp - 1}")
        return tuple(sorted(self.rank_of(dp=d, pp=stage, tp=t) for d in range(self.dp) for t in range(self.tp)))

    def representatives(self) -> tuple[Representative, ...]:
        """One rank per pipeline stage (its lowest: dp = tp = 0) with the stage's dp × tp ranks as multiplicity.

        On a homogeneous cluster every rank of a stage (the members of its dp and tp groups) runs the same
        program, so simulating the representative and scaling by the multiplicity covers the world.
        """
        return tuple(Representative(rank=self.rank_of(dp=0, pp=stage, tp=0), stage=stage,
                                    multiplicity=self.dp * self.tp) for stage in range(self.pp))

    def stage_spans(self, stage: int) -> tuple[StageSpan, ...]:
        """The layer spans of `stage`, chunk order (empty when the plan has no partition)."""
        return tuple(span for span in self.stages if span.stage == stage)

    def straddling_groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Groups of `axis` whose ranks are not spread over nodes like the first group's (empty if uniform).

        Groups are compared by how many members each node holds (sorted), so a TP group of 3 that spans
        nodes 0 and 1 on 8-GPU nodes breaks the symmetry the per-stage reduction relies on.
        """
        if self.gpus_per_node is None:
            return ()
        def shape(group: tuple[int, ...]) -> tuple[int, ...]:
            counts: dict[int, int] = {}
            for rank in group:
                node = rank // self.gpus_per_node
                counts[node] = counts.get(node, 0) + 1
            return tuple(sorted(counts.values()))
        groups = self.groups(axis)
        first = shape(groups[0])
        return tuple(group for group in groups if shape(group) != first)


def _prefix(source: str) -> str:
    return f"{source}: " if source else ""


def _validate_model(p: ParallelConfig, model: ModelConfig, fail: Callable[[str], NoReturn]) -> None:
    """Check the rules that tie the plan to the model; `fail` raises with the message."""
    schedule, schedule_is_file = p.schedule, p.schedule_is_file
    for key in ("num_attention_heads", "num_kv_heads", "ffn_hidden_size"):
        value = getattr(model, key)
        if value % p.tp:
            fail(f"parallel.tp = {p.tp}: must divide model.{key} = {value}")
    if p.pp > model.num_layers:
        fail(f"parallel.pp = {p.pp}: must be at most model.num_layers = {model.num_layers} "
             f"(every stage needs at least one layer)")
    v = p.virtual_stages
    if schedule == INTERLEAVED and v == 1:
        fail(f"parallel.virtual_stages = 1: parallel.schedule = {INTERLEAVED!r} needs virtual_stages > 1")
    if v > 1 and schedule != INTERLEAVED and not schedule_is_file:
        fail(f"parallel.virtual_stages = {v}: only parallel.schedule = {INTERLEAVED!r} or an action file runs "
             f"more than one model chunk per stage, not {schedule!r}")
    if v > 1 and model.num_layers % (p.pp * v):
        per_stage = model.num_layers / p.pp
        shown = f"{per_stage:g}" if model.num_layers % p.pp else f"{model.num_layers // p.pp}"
        fail(f"parallel.virtual_stages = {v}: must divide model.num_layers / parallel.pp = "
             f"{model.num_layers} / {p.pp} = {shown} layers per stage")
    if p.sequence_parallel and p.tp > 1 and model.seq_length % p.tp:
        fail(f"parallel.sequence_parallel = true: needs model.seq_length = {model.seq_length} divisible by "
             f"parallel.tp = {p.tp}")


def make_plan(scenario: Scenario, topology: Topology, *, layers_per_stage: Sequence[int] | None = None,
              embedding_weight: float = 0.0, head_weight: float = 0.0) -> ParallelPlan:
    """Build and validate the parallel plan of `scenario` on `topology`.

    Args:
        scenario: a loaded Scenario (its `parallel`, `model` and `source` are used).
        topology: a network Topology (`num_gpus`, `gpus_per_node`, `nodes`, `name`).
        layers_per_stage: an explicit layer split, one count per (stage, chunk) in model order.
        embedding_weight: cost of the embedding in layers when balancing stages (>= 0).
        head_weight: cost of the LM head and loss in layers when balancing stages (>= 0).

    Returns:
        The ParallelPlan with its stage partition and warnings (tp across nodes, sequence parallelism
        without tp, groups spread unevenly over nodes, uneven layer split).

    Raises:
        PlanError: one line naming the key, the value and the rule that fails.
    """
    p, model = scenario.parallel, scenario.model
    prefix = _prefix(getattr(scenario, "source", ""))

    def fail(message: str) -> NoReturn:
        raise PlanError(prefix + message)

    try:
        order = parse_placement(p.placement)
    except PlanError as exc:
        raise PlanError(prefix + str(exc)) from None
    world, gpus, gpn = p.dp * p.tp * p.pp, topology.num_gpus, topology.gpus_per_node
    if world != gpus:
        fail(f"parallel.dp × tp × pp = {p.dp} × {p.tp} × {p.pp} = {world} must equal the {gpus} GPUs of "
             f"cluster {topology.name!r} × {topology.nodes} node(s)")
    _validate_model(p, model, fail)
    try:
        stages = partition_layers(model.num_layers, p.pp, p.virtual_stages, embedding_weight, head_weight,
                                  layers_per_stage)
    except PlanError as exc:
        raise PlanError(prefix + str(exc)) from None
    warnings = []
    if p.tp > gpn:
        warnings.append(f"parallel.tp = {p.tp} exceeds the {gpn} GPUs per node of {topology.name!r}: "
                        f"tensor-parallel collectives cross the inter-node network")
    if p.sequence_parallel and p.tp == 1:
        warnings.append("parallel.sequence_parallel = true has no effect with parallel.tp = 1")
    plan = ParallelPlan(dp=p.dp, tp=p.tp, pp=p.pp, virtual_stages=p.virtual_stages, placement=p.placement,
                        sequence_parallel=p.sequence_parallel, gpus_per_node=gpn, stages=stages)
    for axis in order:
        odd = plan.straddling_groups(axis)
        if odd:
            warnings.append(f"parallel.placement = {p.placement!r}: {len(odd)} of {world // plan.size(axis)} "
                            f"{axis} groups spread over nodes unlike the first (e.g. ranks {odd[0][:8]}); "
                            f"ranks of a stage may not be symmetric")
    counts = stage_layer_counts(stages)
    if len(set(counts)) > 1:
        warnings.append(f"model.num_layers = {model.num_layers} split unevenly over parallel.pp = {p.pp} stages: "
                        f"{', '.join(map(str, counts))} layers (imbalance {imbalance(stages):.3g})")
    return ParallelPlan(dp=p.dp, tp=p.tp, pp=p.pp, virtual_stages=p.virtual_stages, placement=p.placement,
                        sequence_parallel=p.sequence_parallel, gpus_per_node=gpn, stages=stages,
                        warnings=tuple(warnings))


__all__ = ["AXES", "DEFAULT_ORDER", "Coords", "ParallelPlan", "Representative", "make_plan", "parse_placement"]
