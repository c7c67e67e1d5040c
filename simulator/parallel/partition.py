"""Pipeline stage partitioning: contiguous layer ranges per (stage, chunk), balanced or given explicitly."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from simulator.errors import PlanError


@dataclass(frozen=True)
class StageSpan:
    """The transformer layers [start, stop) of model chunk `chunk` on pipeline stage `stage`.

    `index` is the chunk's position in the model (its virtual stage, chunk * pp + stage, as in Megatron's
    interleaved schedule and torch.distributed.pipelining); the embedding lives on index 0 and the LM head
    with the loss on the last index.
    """

    stage: int
    chunk: int
    index: int
    start: int
    stop: int
    has_embedding: bool
    has_head: bool

    @property
    def num_layers(self) -> int:
        """Transformer layers in this span."""
        return self.stop - self.start

    @property
    def layers(self) -> range:
        """The layer indices of this span."""
        return range(self.start, self.stop)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sizes(num_layers: object, pp: object, virtual_stages: object) -> None:
    for key, value in (("model.num_layers", num_layers), ("parallel.pp", pp),
                       ("parallel.virtual_stages", virtual_stages)):
        if not _is_int(value) or value < 1:
            raise PlanError(f"{key} = {value!r}: must be a positive integer")
    chunks = pp * virtual_stages
    if chunks > num_layers:
        what = "parallel.pp" if virtual_stages == 1 else "parallel.pp × virtual_stages"
        shown = f"{pp}" if virtual_stages == 1 else f"{pp} × {virtual_stages} = {chunks}"
        raise PlanError(f"{what} = {shown}: must be at most model.num_layers = {num_layers} "
                        f"(every model chunk needs at least one layer)")


def _check_weight(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise PlanError(f"{key} = {value!r}: must be a finite number >= 0 (cost in units of one layer)")
    return float(value)


def _check_explicit(layers_per_stage: object, num_layers: int, chunks: int) -> tuple[int, ...]:
    shown = repr(list(layers_per_stage)) if isinstance(layers_per_stage, (list, tuple)) else repr(layers_per_stage)
    if len(shown) > 120:
        shown = shown[:117] + "..."
    key = "parallel.layers_per_stage"
    if not isinstance(layers_per_stage, (list, tuple)):
        raise PlanError(f"{key} = {shown}: must be a list of {chunks} layer counts (one per stage and chunk)")
    if len(layers_per_stage) != chunks:
        raise PlanError(f"{key} = {shown}: must have {chunks} entries (parallel.pp × virtual_stages, in model "
                        f"order), got {len(layers_per_stage)}")
    for count in layers_per_stage:
        if not _is_int(count) or count < 1:
            raise PlanError(f"{key} = {shown}: every entry must be an integer >= 1, got {count!r}")
    total = sum(layers_per_stage)
    if total != num_layers:
        raise PlanError(f"{key} = {shown}: must sum to model.num_layers = {num_layers}, sums to {total}")
    return tuple(layers_per_stage)


def _level_count(level: int, extras: Sequence[float]) -> int:
    """Layers the chunks hold when each is filled up to `level` (at least one each)."""
    return sum(max(1, math.floor(level - extra)) for extra in extras)


def balanced_counts(num_layers: int, extras: Sequence[float]) -> tuple[int, ...]:
    """Layer counts per chunk that minimise the heaviest chunk's load (layers + its fixed extra cost).

    Every chunk gets at least one layer; then layers go one at a time to the chunk whose load would be
    lowest after receiving it, the earliest chunk on ties. The bulk of that greedy fill is done at once by
    finding the highest integer level every chunk can be filled to, so the cost is O(chunks · log layers).

    Args:
        num_layers: layers to place (>= len(extras)).
        extras: fixed cost of each chunk in units of one layer (embedding, head + loss), >= 0.

    Returns:
        One count per chunk, summing to num_layers.
    """
    n = len(extras)
    low, high = 0, num_layers + math.ceil(max(extras)) + 1   # _level_count(low) = n <= num_layers < at high
    while high - low > 1:
        middle = (low + high) // 2
        if _level_count(middle, extras) <= num_layers:
            low = middle
        else:
            high = middle
    counts = [max(1, math.floor(low - extra)) for extra in extras]
    heap = [(counts[k] + 1 + extras[k], k) for k in range(n)]
    heapq.heapify(heap)
    for _ in range(num_layers - sum(counts)):
        _, k = heapq.heappop(heap)
        counts[k] += 1
        heapq.heappush(heap, (counts[k] + 1 + extras[k], k))
    return tuple(counts)


def partition_layers(num_layers: int, pp: int, virtual_stages: int = 1, embedding_weight: float = 0.0,
                     head_weight: float = 0.0,
                     layers_per_stage: Sequence[int] | None = None) -> tuple[StageSpan, ...]:
    """Split the transformer layers into contiguous spans, one per (stage, chunk), in model order.

    The model is cut into pp × virtual_stages chunks; chunk index i = chunk * pp + stage (stage i % pp runs
    chunk i // pp). The embedding sits on chunk 0 (stage 0) and the LM head with the loss on the last chunk
    (stage pp - 1). By default the split balances layer counts (Megatron's rule); `embedding_weight` and
    `head_weight` count the end stages' extra work in units of one layer so they get fewer layers. Uneven
    splits are allowed: 30 layers on pp = 4 give 8, 8, 7, 7 (extra layers to the earliest stages).

    Args:
        num_layers: transformer layers of the model (>= pp × virtual_stages).
        pp: pipeline stages.
        virtual_stages: model chunks per stage.
        embedding_weight: cost of the embedding on the first chunk, in layers (>= 0).
        head_weight: cost of the LM head and loss on the last chunk, in layers (>= 0).
        layers_per_stage: an explicit split, one count per chunk in model order (overrides balancing).

    Returns:
        The spans ordered by index (model order); they cover 0..num_layers-1 exactly once.

    Raises:
        PlanError: sizes that are not positive integers, more chunks than layers, negative weights, or an
            explicit split of the wrong length, with a non-positive entry or the wrong sum.
    """
    _check_sizes(num_layers, pp, virtual_stages)
    chunks = pp * virtual_stages
    embedding = _check_weight("embedding_weight", embedding_weight)
    head = _check_weight("head_weight", head_weight)
    if layers_per_stage is not None:
        counts = _check_explicit(layers_per_stage, num_layers, chunks)
    else:
        extras = [0.0] * chunks
        extras[0] += embedding
        extras[-1] += head
        counts = balanced_counts(num_layers, extras)
    spans = []
    start = 0
    for index, count in enumerate(counts):
        spans.append(StageSpan(stage=index % pp, chunk=index // pp, index=index, start=start, stop=start + count,
                               has_embedding=index == 0, has_head=index == chunks - 1))
        start += count
    return tuple(spans)


def stage_layer_counts(spans: Sequence[StageSpan]) -> tuple[int, ...]:
    """Layers per pipeline stage (all its chunks together), stage 0 first."""
    if not spans:
        return ()
    counts = [0] * (max(span.stage for span in spans) + 1)
    for span in spans:
        counts[span.stage] += span.num_layers
    return tuple(counts)


def imbalance(spans: Sequence[StageSpan]) -> float:
    """Most layers on a stage / fewest layers on a stage (1.0 for an even split or no spans)."""
    counts = stage_layer_counts(spans)
    if not counts or min(counts) == 0:
        return 1.0
    return max(counts) / min(counts)
