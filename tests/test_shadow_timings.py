"""network_model._timing_groups: a batch of shadows' ends computed once per distinct timing are each shadow's own."""

from __future__ import annotations

import random

from simulator.engine.network_model import _end_alone, _timing_groups


def test_one_end_per_timing_gives_every_shadows_end():
    rng = random.Random(3)
    steps = [((1e-6, 0.25), (2e-6, None)), ((1e-6, 0.25), (2e-6, None)), ((3e-6, 0.125),), None]
    infos = tuple((object(), (1, 2), rng.choice([0.5, 0.75]), rng.choice(steps)) for _ in range(40))
    timings, which = _timing_groups(infos)
    assert len(timings) < len(infos) and len(which) == len(infos)
    for now in (0.0, 1.0 / 3.0, 12.5, 1e9 + 0.1):
        ends = [_end_alone(info, now) for info in timings]
        assert tuple(zip(infos, map(ends.__getitem__, which))) == tuple((info, _end_alone(info, now))
                                                                        for info in infos)
        assert max(ends) == max(_end_alone(info, now) for info in infos)


def test_infos_of_different_timings_are_kept_apart():
    a = (None, (), 0.5, None)
    b = (None, (), 0.5, ((0.5, None),))       # steps summing to the same duration still another group
    c = (None, (), 0.25, None)
    timings, which = _timing_groups((a, b, c, a))
    assert timings == (a, b, c) and which == (0, 1, 2, 0)
