"""Hypothesis properties of pipeline schedules over random (ranks, microbatches, virtual stages, schedule).

Uniform costs are small binary fractions (0.25 .. 4), so the executor's sums are exact in floating point
and the published figures (formulas.md) are asserted to 1e-9 relative; the zero-bubble figures hold exactly
with equal F, I and W times (the paper's assumption) and enough microbatches (m >= p for ZB-H1,
m >= 2p-1 for ZB-H2), which the tests say where they assume it.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from simulator.api import simulate
from simulator.errors import DeadlockError, ScheduleError
from simulator.parallel.schedule_check import ScheduleDeadlock, execute_uniform, transfers, validate
from simulator.parallel.schedules import (
    Schedule, format_actions, gpipe, interleaved_1f1b, one_f_one_b, parse_actions, zb_h1, zb_h2,
)
from simulator.scenario import scenario_from_dict
from simulator.testing import (
    check_bubble, check_every_action_once, check_in_flight_at_most, check_memory_never_negative,
    check_no_deadlock, check_sends_matched, plans, scenarios, schedules,
)

COSTS = st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
RANKS = st.integers(1, 8)
MICROBATCHES = st.integers(1, 24)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(schedules())
def test_every_action_runs_exactly_once(schedule):
    timing = check_every_action_once(schedule)
    assert sum(len(row) for row in timing.ranks) == schedule.num_stages * schedule.microbatches * \
        (3 if schedule.split_backward else 2)


@FAST
@given(schedules())
def test_every_send_has_its_recv(schedule):
    pairs = check_sends_matched(schedule)       # in order, as NCCL matches them
    # Activations cross every stage boundary between two ranks forwards, gradients backwards, once per
    # microbatch; with the looped placement every boundary crosses ranks when p > 1.
    crossings = sum(schedule.rank_of(s) != schedule.rank_of(s + 1) for s in range(schedule.num_stages - 1))
    assert crossings == (schedule.num_stages - 1 if schedule.num_ranks > 1 else 0)
    assert pairs == 2 * crossings * schedule.microbatches
    assert all(abs(t.src_rank - t.dst_rank) in (1, schedule.num_ranks - 1) for t in transfers(schedule))


@FAST
@given(schedules())
def test_built_in_schedules_never_deadlock(schedule):
    check_no_deadlock(schedule)


@FAST
@given(schedules())
def test_notation_round_trip(schedule):
    parsed = parse_actions(format_actions(schedule, separator=","))
    assert parsed.ranks == schedule.ranks and parsed.stage_ranks == schedule.stage_ranks


@FAST
@given(p=RANKS, m=MICROBATCHES, f=COSTS, b=COSTS)
def test_one_f_one_b_time_bubble_and_memory(p, m, f, b):
    for schedule in (one_f_one_b(p, m), gpipe(p, m)):
        timing = check_bubble(schedule, (p - 1) / (m + p - 1), f, b)
        assert timing.iteration_time_s == pytest.approx((m + p - 1) * (f + b), rel=1e-9)
    timing = check_in_flight_at_most(one_f_one_b(p, m), p)
    assert timing.peak_in_flight == tuple(min(p - r, m) for r in range(p))


@FAST
@given(p=RANKS, m=MICROBATCHES, f=COSTS, b=COSTS, comm=st.sampled_from([0.125, 0.5, 1.0]))
def test_communication_only_adds_time(p, m, f, b, comm):
    free = execute_uniform(one_f_one_b(p, m), f, b).iteration_time_s
    paid = execute_uniform(one_f_one_b(p, m), f, b, comm=comm).iteration_time_s
    assert paid >= free + 2 * (p - 1) * comm - 1e-9     # the first microbatch crosses every link twice


@FAST
@given(p=RANKS, k=st.integers(1, 4), v=st.integers(1, 4), f=COSTS, b=COSTS)
def test_interleaved_bubble_and_memory_match_narayanan(p, k, v, f, b):
    m = p * k
    timing = execute_uniform(interleaved_1f1b(p, m, v), f / v, b / v)
    ideal = m * (f + b)
    assert timing.iteration_time_s == pytest.approx(ideal * (1 + (p - 1) / (v * m)), rel=1e-9)
    if m > p:
        assert timing.peak_activations[0] == pytest.approx(p * (1 + (p - 1) / (p * v)), rel=1e-9)
    assert max(timing.peak_activations) == pytest.approx(timing.peak_activations[0], rel=1e-9)


@FAST
@given(p=st.integers(2, 8), data=st.data(), t=COSTS)
def test_zb_h1_cuts_the_bubble_to_a_third_at_1f1b_memory(p, data, t):
    m = data.draw(st.integers(p, 24), label="m >= p")
    base = execute_uniform(one_f_one_b(p, m), t, 2 * t)
    h1 = execute_uniform(zb_h1(p, m), t, 2 * t, t)          # T_F = T_I = T_W = t
    assert max(h1.bubble_s) == pytest.approx(max(base.bubble_s) / 3, rel=1e-9)
    assert max(h1.bubble_s) == pytest.approx((p - 1) * (t + t - t), rel=1e-9)   # (p-1)(T_F + T_B - T_W)
    # As a fraction of the iteration the ratio is (m+p-1)/(3m+p-1): about a third, a third as m grows.
    assert h1.bubble_fraction / base.bubble_fraction == pytest.approx((m + p - 1) / (3 * m + p - 1), rel=1e-9)
    assert max(h1.peak_in_flight) == max(base.peak_in_flight) == p


@FAST
@given(p=st.integers(1, 8), data=st.data(), t=COSTS)
def test_zb_h2_removes_the_bubble_at_about_twice_the_memory(p, data, t):
    m = data.draw(st.integers(2 * p - 1, 30), label="m >= 2p-1")
    h2 = execute_uniform(zb_h2(p, m), t, 2 * t, t)
    assert h2.bubble_fraction == 0.0 and max(h2.bubble_s) == 0.0      # (p-1)(T_F + T_B - 2 T_W) = 0
    assert h2.iteration_time_s == pytest.approx(3 * m * t + (p - 1) * t, rel=1e-9)
    assert max(h2.peak_in_flight) == 2 * p - 1                       # 1F1B holds p; (2p-1)/p in [1, 2)


@FAST
@given(p=RANKS, m=MICROBATCHES)
def test_zb_h2_is_never_worse_than_zb_h1(p, m):
    h1 = execute_uniform(zb_h1(p, m), 1.0, 2.0, 1.0)
    h2 = execute_uniform(zb_h2(p, m), 1.0, 2.0, 1.0)
    assert max(h2.bubble_s) <= max(h1.bubble_s) + 1e-9
    assert h2.iteration_time_s <= h1.iteration_time_s + 1e-9
    assert max(h2.peak_in_flight) <= 2 * p - 1 and max(h1.peak_in_flight) <= p


@FAST
@given(p=st.integers(3, 8), m=st.integers(2, 16))
def test_swapping_forward_and_backward_on_rank_0_deadlocks(p, m):
    lines = format_actions(one_f_one_b(p, m), header=False).splitlines()
    tokens = lines[0].split()
    i, j = tokens.index("0F1"), tokens.index("0B0")
    tokens[i], tokens[j] = tokens[j], tokens[i]
    lines[0] = " ".join(tokens)
    with pytest.raises(DeadlockError) as info:
        validate(parse_actions("\n".join(lines), name="user"))
    blocked = {(b.rank, str(b.action), str(b.waiting_for)) for b in info.value.blocked}
    assert (0, "0B0", "1B0") in blocked and (1, "1F1", "0F1") in blocked
    assert "rank 0 blocked at 0B0" in str(info.value) and "rank 1 blocked at 1F1" in str(info.value)


@settings(max_examples=80, deadline=None)
@given(schedule=schedules(max_ranks=5, max_microbatches=8), data=st.data())
def test_any_swap_is_accepted_or_rejected_with_a_reason(schedule, data):
    rank = data.draw(st.integers(0, schedule.num_ranks - 1), label="rank")
    row = list(schedule.ranks[rank])
    i = data.draw(st.integers(0, len(row) - 1), label="i")
    j = data.draw(st.integers(0, len(row) - 1), label="j")
    row[i], row[j] = row[j], row[i]
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(row)
    user = Schedule("user", ranks, schedule.microbatches, schedule.virtual_stages, schedule.stage_ranks)
    try:
        validate(user)
    except ScheduleDeadlock as error:
        assert error.blocked and all(b.waiting_for != b.action for b in error.blocked)
        return
    except ScheduleError as error:
        assert "comes before" in str(error)
        return
    check_every_action_once(user)
    check_sends_matched(user, in_order=False)   # memsim matches messages by tag; NCCL's order may differ


@settings(max_examples=40, deadline=None)
@given(plan=plans(num_attention_heads=12, num_kv_heads=4, num_layers=6, gpus_per_node=8))
def test_plans_factor_the_gpu_count(plan):
    assert plan["dp"] * plan["tp"] * plan["pp"] in (1, 2, 4, 8, 16, 32, 64)
    assert 4 % plan["tp"] == 0 and plan["pp"] <= 6


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=scenarios())
def test_memory_never_goes_negative(doc):
    result = simulate(scenario_from_dict(doc))
    assert check_memory_never_negative(result.trace) > 0
    assume(result.report["fits"])
    assert all(rank["peak_allocated_bytes"] > 0 for rank in result.report["ranks"])
