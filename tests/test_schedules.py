"""Pipeline schedules: generators' exact orders, the action notation, the validator and uniform execution."""

from __future__ import annotations

import pathlib
import re

import pytest

from simulator.errors import DeadlockError, MemsimError, ScheduleError
from simulator.parallel.schedule_check import (
    Blocked, CommStep, ScheduleDeadlock, dependencies, execute_uniform, load_schedule, program, transfers, validate,
)
from simulator.parallel.schedules import (
    Action, Schedule, by_name, format_actions, gpipe, interleaved_1f1b, one_f_one_b, parse_actions, read_actions,
    zb_h1, zb_h2,
)
from simulator.trace.records import MemorySample
from simulator.testing import (
    check_bubble, check_every_action_once, check_in_flight_at_most, check_memory_never_negative,
    check_no_deadlock, check_sends_matched,
)

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "schedules.md"


def rows(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in actions) for actions in schedule.ranks]


# ---- generators ---------------------------------------------------------------------------------------

def test_one_f_one_b_order_matches_megatron():
    assert rows(one_f_one_b(3, 4)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


def test_one_f_one_b_with_fewer_microbatches_than_ranks():
    assert rows(one_f_one_b(3, 1)) == ["0F0 0B0", "1F0 1B0", "2F0 2B0"]


def test_gpipe_order():
    assert rows(gpipe(2, 3)) == ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2"]


def test_interleaved_order_places_chunk_c_of_rank_r_at_stage_c_p_plus_r():
    schedule = interleaved_1f1b(2, 4, 2)
    assert rows(schedule) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]
    assert schedule.stage_ranks == (0, 1, 0, 1)
    assert [a.chunk for a in schedule.ranks[0][:4]] == [0, 0, 1, 1]
    assert schedule.chunk_of(3) == 1 and schedule.stages_of(1) == (1, 3) and schedule.num_stages == 4


def test_interleaved_needs_microbatches_a_multiple_of_ranks():
    with pytest.raises(ScheduleError, match=r"microbatches = 6: must be a multiple of the pipeline ranks p = 4"):
        interleaved_1f1b(4, 6, 2)


def test_zb_h1_holds_back_r_weight_passes_on_rank_r():
    assert rows(zb_h1(2, 4)) == [
        "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3",
        "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3",
    ]


def test_zb_h2_warms_up_with_2p_minus_2r_minus_1_forwards():
    schedule = zb_h2(4, 8)
    for r, actions in enumerate(schedule.ranks):
        first_i = next(i for i, a in enumerate(actions) if a.kind == "I")
        assert [a.kind for a in actions[:first_i]] == ["F"] * (2 * (4 - r) - 1)
    assert schedule.split_backward and not one_f_one_b(4, 8).split_backward


def test_built_in_names_are_the_scenario_schedules():
    from simulator.parallel.schedules import SCHEDULE_NAMES
    from simulator.scenario.schema import SCHEDULES
    assert SCHEDULE_NAMES == SCHEDULES


def test_by_name_and_its_errors():
    assert by_name("1f1b", 3, 4) == one_f_one_b(3, 4)
    assert by_name("interleaved-1f1b", 2, 4, 2) == interleaved_1f1b(2, 4, 2)
    with pytest.raises(ScheduleError, match=r"schedule = '1f1c': unknown schedule .*did you mean '1f1b'"):
        by_name("1f1c", 2, 2)
    with pytest.raises(ScheduleError, match=r"virtual_stages = 2: only interleaved-1f1b"):
        by_name("zb-h1", 2, 2, 2)
    with pytest.raises(ScheduleError, match=r"1f1b: p = 0: must be an integer >= 1"):
        one_f_one_b(0, 2)
    with pytest.raises(ScheduleError, match=r"gpipe: m = True"):
        gpipe(2, True)


# ---- values -------------------------------------------------------------------------------------------

def test_action_text_round_trip_and_equality_ignores_chunk():
    assert str(Action(12, "W", 3)) == "12W3"
    assert Action.from_str("12W3") == Action(12, "W", 3)
    assert Action(2, "F", 0) == Action(2, "F", 0, chunk=1)
    with pytest.raises(ScheduleError, match=r"action kind = 'X': unknown kind"):
        Action(0, "X", 0)
    with pytest.raises(ScheduleError, match=r"action microbatch = -1: must be an integer >= 0"):
        Action(0, "F", -1)
    with pytest.raises(ScheduleError, match=r"communication actions are derived"):
        Action.from_str("0SEND_F1")


def test_schedule_rejects_bad_structure():
    with pytest.raises(ScheduleError, match=r"rank 1, position 0: action 1F0: stage 0 already runs on|"
                                             r"stage 0 already runs on rank 0"):
        Schedule("x", [[Action(0, "F", 0)], [Action(0, "B", 0)]], 1)
    with pytest.raises(ScheduleError, match=r"rank 0, position 1: action 0F5: microbatch 5 out of range 0..1"):
        Schedule("x", [[Action(0, "F", 0), Action(0, "F", 5)]], 2)
    with pytest.raises(ScheduleError, match=r"stage 4 out of range 0..1"):
        Schedule("x", [[Action(4, "F", 0)], [Action(1, "F", 0)]], 1)
    with pytest.raises(ScheduleError, match=r"chunk = 0 but stage 2 is chunk 1 of rank 0"):
        Schedule("x", [[Action(2, "F", 0, chunk=0)], []], 1, 2)
    with pytest.raises(ScheduleError, match=r"microbatches = 0: must be an integer >= 1"):
        Schedule("x", [[]], 0)
    with pytest.raises(ScheduleError, match=r"rank 0 runs stages \[0, 1\]: every rank must run 1 stage"):
        Schedule("x", [[Action(0, "F", 0), Action(1, "F", 0)], []], 1)


def test_v_shaped_placement_passes_activations_inside_a_rank_for_free():
    # ZB-V style placement: rank 0 runs stages 0 and 3, rank 1 runs stages 1 and 2.
    f = lambda s, i: Action(s, "F", i)   # noqa: E731
    b = lambda s, i: Action(s, "B", i)   # noqa: E731
    schedule = Schedule("v", [[f(0, 0), f(3, 0), b(3, 0), b(0, 0)], [f(1, 0), f(2, 0), b(2, 0), b(1, 0)]],
                        1, 2, stage_ranks=(0, 1, 1, 0))
    validate(schedule)
    assert [(t.producer.stage, t.consumer.stage) for t in transfers(schedule)] == [(0, 1), (1, 0), (2, 3), (3, 2)]
    timing = execute_uniform(schedule, 1.0, 2.0, comm=0.5)
    assert timing.iteration_time_s == pytest.approx(4 * 1.0 + 4 * 2.0 + 4 * 0.5)   # one hop in, 1->2 free
    assert timing.peak_in_flight == (2, 2) and timing.peak_activations == (1.0, 1.0)


# ---- notation -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", [gpipe(2, 3), one_f_one_b(3, 5), interleaved_1f1b(2, 4, 3), zb_h1(3, 4),
                                      zb_h2(3, 6)], ids=lambda s: s.name)
def test_format_then_parse_gives_the_same_schedule(schedule):
    for separator in (" ", ","):
        parsed = parse_actions(format_actions(schedule, separator=separator))
        assert parsed.ranks == schedule.ranks and parsed.stage_ranks == schedule.stage_ranks
        assert (parsed.microbatches, parsed.virtual_stages) == (schedule.microbatches, schedule.virtual_stages)
        assert [a.chunk for r in parsed.ranks for a in r] == [a.chunk for r in schedule.ranks for a in r]


def test_parse_reads_torch_csv_with_empty_cells_comments_and_files(tmp_path):
    text = "# two ranks\n0F0,0F1,,0B0,0B1\n\n1F0,1B0,1F1,1B1  # rank 1\n"
    path = tmp_path / "mine.csv"
    path.write_text(text)
    for source in (text, str(path), path):
        schedule = parse_actions(source)
        assert rows(schedule) == ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]
    assert parse_actions(path).name == "mine.csv" and read_actions(str(path)).microbatches == 2
    assert parse_actions(text, microbatches=2, name="two").name == "two"


@pytest.mark.parametrize("text, message", [
    ("0F0 0X0 0B0", r"^<text>: line 1: action '0X0': unknown kind 'X' \(allowed: F, B, I, W\)$"),
    ("0F0 0B0\n1F0 1F0 1B0", r"^<text>: line 2 \(rank 1\), action 2: action 1F0 repeated \(first at line 2 "
                             r"\(rank 1\), action 1\): each stage runs each microbatch's F once$"),
    ("0F0 0F1 0B0\n1F0 1B0 1F1 1B1", r"^<text>: line 1 \(rank 0\): action 0B1 missing: stage 0 runs F, then B "
                                     r"or I and W, for every microbatch 0..1$"),
    ("0F0 0I0 0B0", r"action 0I0 with 0B0: a backward is either B, or I and W"),
    ("0F0 0I0", r"action 0W0 missing"),
    ("0F0 0B0\n0F1 0B1", r"^<text>: line 2 \(rank 1\), action 1: action 0F1: stage 0 already runs on line 1 "
                         r"\(rank 0\); a stage runs on one rank$"),
    ("0F0 0B0 2F0 2B0\n1F0 1B0", r"^<text>: line 1: stage 2 out of range: 2 lines \(ranks\) run stages 0..2"),
    ("0F0 0B0\n3F0 3B0", r"stage 1 is on no line"),
    ("0F0 zz 0B0", r"^<text>: line 1: action 'zz': expected STAGE KIND MICROBATCH"),
    ("# nothing\n", r"no actions"),
    ("0F0 0B0 0F1 0B1\n1F0 1B0 1F1 1B1\n", None),
])
def test_parse_errors_name_the_line_the_action_and_the_rule(text, message):
    if message is None:
        parse_actions(text)
        return
    with pytest.raises(ScheduleError, match=message) as info:
        parse_actions(text)
    assert "\n" not in str(info.value)


def test_parse_checks_microbatches_when_given_and_reports_unreadable_files(tmp_path):
    with pytest.raises(ScheduleError, match=r"action 0F1 missing"):
        parse_actions("0F0 0B0", microbatches=2)
    with pytest.raises(ScheduleError, match=r"action 0F3: microbatch 3 out of range 0..1"):
        parse_actions("0F0 0B0 0F3 0B3", microbatches=2)
    with pytest.raises(ScheduleError, match=r"missing.txt: cannot read schedule file: No such file"):
        parse_actions(str(tmp_path / "missing.txt"))


def test_load_schedule_checks_a_scenario_schedule_against_the_plan(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n")
    assert load_schedule(str(path), 2, 2).ranks == one_f_one_b(2, 2).ranks
    assert load_schedule("zb-h2", 3, 5) == zb_h2(3, 5)
    cases = [
        ((str(path), 4, 2), rf"^parallel.schedule = '{re.escape(str(path))}': the file has 2 lines \(ranks\), "
                            r"parallel.pp = 4$"),
        ((str(path), 2, 3), r"': line 1 \(rank 0\): action 0F2 missing"),
        ((str(path), 2, 2, 2), r"the file has 1 stages per rank, parallel.virtual_stages = 2"),
        (("1f1c", 2, 2), r"^parallel.schedule = '1f1c': unknown schedule .*did you mean '1f1b'\?$"),
        (("interleaved-1f1b", 4, 6, 2), r"^parallel.schedule = 'interleaved-1f1b': microbatches = 6"),
        ((str(tmp_path / "none.txt"), 2, 2), r"none.txt': cannot read schedule file"),
    ]
    for args, message in cases:
        with pytest.raises(ScheduleError, match=message):
            load_schedule(*args)
    path.write_text("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1\n")
    with pytest.raises(ScheduleDeadlock, match=r"^parallel.schedule = '.*mine.txt': schedule 'mine.txt' deadlocks") \
            as info:
        load_schedule(str(path), 2, 2)
    assert len(info.value.blocked) == 2


# ---- validation ---------------------------------------------------------------------------------------

SWAPPED = "0F0 0B0 0F2 0F1 0F3 0B1 0B2 0B3\n1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3\n2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"


def test_swapped_action_deadlocks_and_names_every_blocked_rank():
    with pytest.raises(DeadlockError) as info:
        validate(parse_actions(SWAPPED, name="swapped"))
    error = info.value
    assert isinstance(error, ScheduleDeadlock) and isinstance(error, MemsimError) and error.exit_code == 2
    assert str(error) == (
        "schedule 'swapped' deadlocks with 20 of 24 actions left: "
        "rank 0 blocked at 0B0 (position 1) waiting for 1B0 from rank 1; "
        "rank 1 blocked at 1F1 (position 1) waiting for 0F1 from rank 0; "
        "rank 2 blocked at 2F1 (position 2) waiting for 1F1 from rank 1")
    assert error.blocked[0] == Blocked(0, 1, Action(0, "B", 0), Action(1, "B", 0), 1)


def test_backward_before_its_forward_on_the_same_rank_is_a_schedule_error():
    schedule = Schedule("x", [[Action(0, "B", 0), Action(0, "F", 0)]], 1)
    with pytest.raises(ScheduleError, match=r"rank 0: 0B0 at position 0 comes before 0F0 at position 1: F must run "
                                            r"before its B") as info:
        validate(schedule)
    assert not isinstance(info.value, DeadlockError)
    with pytest.raises(ScheduleError, match=r"0W0 at position 2 comes before 0I0 at position 3"):
        validate(Schedule("x", [[Action(0, "F", 0), Action(0, "F", 1), Action(0, "W", 0), Action(0, "I", 0),
                                 Action(0, "I", 1), Action(0, "W", 1)]], 2))


def test_validate_rejects_incomplete_schedules_and_other_values():
    with pytest.raises(ScheduleError, match=r"schedule 'x': rank 0: action 0B0 missing"):
        validate(Schedule("x", [[Action(0, "F", 0)]], 1))
    with pytest.raises(ScheduleError, match=r"must be a Schedule"):
        validate("0F0 0B0")


def test_dependencies_transfers_and_program():
    schedule = zb_h1(3, 2)
    assert dependencies(schedule, Action(1, "I", 0)) == (Action(1, "F", 0), Action(2, "I", 0))
    assert dependencies(schedule, Action(2, "I", 1)) == (Action(2, "F", 1),)
    assert dependencies(schedule, Action(0, "F", 1)) == ()
    assert dependencies(schedule, Action(1, "W", 1)) == (Action(1, "I", 1),)
    assert len(transfers(schedule)) == 2 * (3 - 1) * 2
    lowered = program(schedule)
    assert [str(step) for step in lowered[1][:4]] == ["1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1"]
    assert sum(isinstance(step, CommStep) for rank in lowered for step in rank) == 2 * len(transfers(schedule))


# ---- uniform execution --------------------------------------------------------------------------------

def test_one_f_one_b_uniform_times_are_exact():
    timing = execute_uniform(one_f_one_b(4, 8), 1.0, 2.0)
    assert timing.iteration_time_s == 33.0 and timing.busy_s == (24.0,) * 4
    assert timing.bubble_s == (9.0, 6.0, 3.0, 0.0)
    assert timing.bubble_fraction == pytest.approx(3 / 11) and timing.idle_fraction == pytest.approx(9 / 33)
    assert timing.peak_in_flight == (4, 3, 2, 1)
    first = timing.ranks[3][0]
    assert (str(first.action), first.start_s, first.end_s) == ("3F0", 3.0, 4.0)


def test_communication_delays_every_hop():
    assert execute_uniform(one_f_one_b(2, 1), 1.0, 2.0, comm=0.5).iteration_time_s == 7.0   # 1+.5+1+2+.5+2


def test_zero_bubble_figures_for_four_ranks():
    base, h1, h2 = (execute_uniform(s, 1.0, 2.0, 1.0) for s in (one_f_one_b(4, 8), zb_h1(4, 8), zb_h2(4, 8)))
    assert max(base.bubble_s) == 9.0 and max(h1.bubble_s) == 3.0 and max(h2.bubble_s) == 0.0
    assert max(h1.peak_in_flight) == 4 and max(h2.peak_in_flight) == 7
    assert h2.bubble_fraction == 0.0 and h2.iteration_time_s == 3 * 8 + 3


@pytest.mark.parametrize("kwargs, message", [
    ({"f": 0}, r"f = 0: must be a finite number > 0"),
    ({"b": float("nan")}, r"b = nan"),
    ({"comm": -1}, r"comm = -1: must be a finite number >= 0"),
    ({"w": 2.0}, r"w = 2.0: must be less than b = 2.0"),
    ({"f": True}, r"f = True"),
])
def test_execute_uniform_rejects_bad_costs(kwargs, message):
    args = {"f": 1.0, "b": 2.0} | kwargs
    with pytest.raises(ScheduleError, match=message):
        execute_uniform(one_f_one_b(2, 2), **args)


# ---- simulator.testing checkers fail with clear messages -----------------------------------------------

def test_checkers_pass_on_a_good_schedule():
    schedule = one_f_one_b(3, 4)
    assert check_sends_matched(schedule) == 16
    check_no_deadlock(schedule)
    assert check_every_action_once(schedule).iteration_time_s == 18.0
    check_bubble(schedule, 2 / 6)
    check_in_flight_at_most(schedule, 3)


def test_checkers_fail_with_clear_messages():
    with pytest.raises(AssertionError, match=r"deadlock: schedule 'swapped' deadlocks .* rank 1 blocked at 1F1"):
        check_no_deadlock(parse_actions(SWAPPED, name="swapped"))
    with pytest.raises(AssertionError, match=r"not every action runs exactly once: .*action 0B0 missing"):
        check_every_action_once(Schedule("x", [[Action(0, "F", 0)]], 1))
    with pytest.raises(AssertionError, match=r"bubble fraction 0.333333, expected 0.500000"):
        check_bubble(one_f_one_b(3, 4), 0.5)
    with pytest.raises(AssertionError, match=r"rank 0 holds 3 microbatches of activations, more than 2"):
        check_in_flight_at_most(one_f_one_b(3, 4), 2)


def test_check_sends_matched_catches_a_lost_or_reordered_message():
    lowered = [list(steps) for steps in program(one_f_one_b(2, 2))]
    recvs = [i for i, step in enumerate(lowered[1]) if isinstance(step, CommStep) and step.op == "recv"]
    lost = [list(r) for r in lowered]
    del lost[1][recvs[0]]
    with pytest.raises(AssertionError, match=r"rank 0 -> rank 1: sends without a recv \[\('activation', 0, 0\)\]"):
        check_sends_matched(lost)
    late = [list(r) for r in lowered]
    late[1][recvs[0]], late[1][recvs[1]] = late[1][recvs[1]], late[1][recvs[0]]
    with pytest.raises(AssertionError, match=r"rank 1 step 4: recv 1RECV_F0 does not come before its consumer 1F0"):
        check_sends_matched(late)
    reordered = [list(r) for r in lowered]
    reordered[1].insert(0, reordered[1].pop(recvs[1]))      # receive microbatch 1 before microbatch 0
    with pytest.raises(AssertionError, match=r"rank 0 -> rank 1: message 0 is sent as \('activation', 0, 0\) but "
                                             r"received as \('activation', 0, 1\)"):
        check_sends_matched(reordered)
    early = [list(r) for r in lowered]
    send = next(k for k, step in enumerate(early[0]) if isinstance(step, CommStep))
    early[0].insert(0, early[0].pop(send))
    with pytest.raises(AssertionError, match=r"rank 0 step 0: send 0SEND_F0 comes before its producer 0F0"):
        check_sends_matched(early)


def test_check_memory_never_negative():
    good = [MemorySample(0.0, 10, 20, (10, 0, 0, 0, 0, 0)), MemorySample(1.0, 0, 20, (0,) * 6)]
    assert check_memory_never_negative(good) == 2
    with pytest.raises(AssertionError, match=r"rank 0 at t = 1.0 s: allocated = -4 bytes < 0"):
        check_memory_never_negative(good + [MemorySample(1.0, -4, 20, (0,) * 6)])
    with pytest.raises(AssertionError, match=r"rank 0 at t = 2.0 s: \w+ = -1 bytes < 0"):
        check_memory_never_negative([MemorySample(2.0, 0, 0, (1, -1, 0, 0, 0, 0))])


def test_docs_worked_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOCS), "exec"), namespace)   # noqa: S102 - our own documentation
    assert "rank 0 blocked at 0B0" in capsys.readouterr().out
