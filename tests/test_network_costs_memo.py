"""NetworkCosts answers a question asked with the same group objects from their identities: the same seconds as
a fresh NetworkCosts gives for equal tuples, whether the objects come back or are made anew."""

from __future__ import annotations

import random

from simulator.explore.network_costs import NetworkCosts
from simulator.network import load_topology


def test_answers_by_identity_equal_the_answers_of_equal_tuples_asked_afresh():
    topology = load_topology("dgx-a100", nodes=2)
    memo = NetworkCosts(topology)
    rng = random.Random(7)
    kept = []                           # objects asked again later (their identities are remembered)
    hits = 0
    for step in range(300):
        if kept and rng.random() < 0.6:
            kind, group, size, together = rng.choice(kept)
            hits += 1
        else:
            ranks = rng.sample(range(16), 8)
            group = tuple(sorted(ranks[:4]))
            together = (group, tuple(sorted(ranks[4:]))) if rng.random() < 0.5 else ()
            kind = rng.choice(["all_reduce", "all_gather", "reduce_scatter"])
            size = float(rng.choice([1 << 20, 1 << 26]))
            kept.append((kind, group, size, together))
        # equal tuples made anew: answered without the identity memo of `memo`
        fresh = NetworkCosts(topology).collective_s(kind, tuple(list(group)), size,
                                                   tuple(tuple(list(g)) for g in together))
        assert memo.collective_s(kind, group, size, together) == fresh
    assert hits > 100 and len(memo._by_identity) == len(kept)    # every question kept by its objects' identities
