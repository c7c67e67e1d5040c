"""Stage partitioning: coverage, balance, end stages, explicit splits and every error message."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.errors import PlanError
from simulator.parallel.partition import (
    balanced_counts, imbalance, partition_layers, stage_layer_counts,
)


@st.composite
def layouts(draw):
    pp = draw(st.integers(1, 12))
    v = draw(st.integers(1, 4))
    layers = draw(st.integers(pp * v, pp * v + 60))
    return layers, pp, v


weights = st.floats(0.0, 6.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(layouts(), weights, weights)
def test_spans_cover_every_layer_once_in_order(layout, embedding, head):
    layers, pp, v = layout
    spans = partition_layers(layers, pp, v, embedding_weight=embedding, head_weight=head)
    assert len(spans) == pp * v
    assert [layer for span in spans for layer in span.layers] == list(range(layers))
    assert all(span.num_layers >= 1 for span in spans)
    assert [span.index for span in spans] == list(range(pp * v))
    assert all(span.stage == span.index % pp and span.chunk == span.index // pp for span in spans)
    assert [span.has_embedding for span in spans] == [i == 0 for i in range(pp * v)]
    assert [span.has_head for span in spans] == [i == pp * v - 1 for i in range(pp * v)]
    assert spans[0].stage == 0 and spans[-1].stage == pp - 1
    assert sum(stage_layer_counts(spans)) == layers


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_count_balance_differs_by_at_most_one_with_extras_first(layout):
    layers, pp, v = layout
    counts = [span.num_layers for span in partition_layers(layers, pp, v)]
    assert max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)       # the extra layers go to the earliest chunks


def _brute_force_bottleneck(layers, extras):
    """The smallest achievable max(count + extra), by enumerating compositions (small cases)."""
    n = len(extras)
    best = float("inf")

    def walk(k, left, worst):
        nonlocal best
        if k == n - 1:
            best = min(best, max(worst, left + extras[k]))
            return
        for count in range(1, left - (n - 1 - k) + 1):
            walk(k + 1, left - count, max(worst, count + extras[k]))
    walk(0, layers, 0.0)
    return best


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 5).flatmap(lambda n: st.tuples(st.integers(n, n + 9), st.lists(weights, min_size=n,
                                                                                      max_size=n))))
def test_balanced_counts_minimise_the_heaviest_chunk(case):
    layers, extras = case
    counts = balanced_counts(layers, extras)
    assert sum(counts) == layers and min(counts) >= 1
    got = max(c + e for c, e in zip(counts, extras))
    assert got == pytest.approx(_brute_force_bottleneck(layers, extras))


def test_thirty_layers_on_four_stages():
    spans = partition_layers(30, 4)
    assert [(s.start, s.stop) for s in spans] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert stage_layer_counts(spans) == (8, 8, 7, 7)
    assert imbalance(spans) == pytest.approx(8 / 7)


def test_head_weight_takes_layers_off_the_last_stage():
    assert [s.num_layers for s in partition_layers(30, 4, head_weight=2.0)] == [8, 8, 8, 6]
    assert [s.num_layers for s in partition_layers(32, 4, embedding_weight=1.0, head_weight=2.0)] == [8, 9, 9, 6]
    assert imbalance(partition_layers(32, 4)) == 1.0


def test_interleaved_chunks_follow_megatron_order():
    spans = partition_layers(8, 2, 2)
    assert [(s.stage, s.chunk, s.start, s.stop) for s in spans] == [(0, 0, 0, 2), (1, 0, 2, 4), (0, 1, 4, 6),
                                                                    (1, 1, 6, 8)]
    assert stage_layer_counts(spans) == (4, 4)


def test_single_stage_holds_embedding_and_head():
    (span,) = partition_layers(12, 1)
    assert (span.start, span.stop, span.has_embedding, span.has_head) == (0, 12, True, True)


def test_explicit_split():
    spans = partition_layers(30, 4, layers_per_stage=[6, 9, 9, 6])
    assert [(s.start, s.stop) for s in spans] == [(0, 6), (6, 15), (15, 24), (24, 30)]
    assert imbalance(spans) == 1.5


def test_large_layer_counts_are_fast():
    spans = partition_layers(10**12, 3)
    assert stage_layer_counts(spans) == (333333333334, 333333333333, 333333333333)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_layers=0, pp=1), "model.num_layers = 0: must be a positive integer"),
    (dict(num_layers=4, pp=True), "parallel.pp = True: must be a positive integer"),
    (dict(num_layers=4, pp=2, virtual_stages=0), "parallel.virtual_stages = 0: must be a positive integer"),
    (dict(num_layers=4, pp=5), "parallel.pp = 5: must be at most model.num_layers = 4 (every model chunk needs "
                               "at least one layer)"),
    (dict(num_layers=6, pp=2, virtual_stages=4), "parallel.pp × virtual_stages = 2 × 4 = 8: must be at most "
                                                 "model.num_layers = 6"),
    (dict(num_layers=8, pp=2, embedding_weight=-1.0), "embedding_weight = -1.0: must be a finite number >= 0"),
    (dict(num_layers=8, pp=2, head_weight=float("nan")), "head_weight = nan: must be a finite number >= 0"),
    (dict(num_layers=8, pp=2, layers_per_stage=5), "parallel.layers_per_stage = 5: must be a list of 2 layer "
                                                   "counts"),
    (dict(num_layers=8, pp=2, layers_per_stage=[8]), "parallel.layers_per_stage = [8]: must have 2 entries "
                                                     "(parallel.pp × virtual_stages, in model order), got 1"),
    (dict(num_layers=8, pp=2, layers_per_stage=[8, 0]), "parallel.layers_per_stage = [8, 0]: every entry must "
                                                        "be an integer >= 1, got 0"),
    (dict(num_layers=8, pp=2, layers_per_stage=[4, 4.0]), "every entry must be an integer >= 1, got 4.0"),
    (dict(num_layers=8, pp=2, layers_per_stage=[4, 5]), "parallel.layers_per_stage = [4, 5]: must sum to "
                                                        "model.num_layers = 8, sums to 9"),
])
def test_errors_name_key_value_and_rule(kwargs, message):
    with pytest.raises(PlanError) as info:
        partition_layers(**kwargs)
    text = str(info.value)
    assert message in text and "\n" not in text
