"""The validator and the engine agree: every schedule validate() accepts runs to the end with dp > 1."""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from simulator.api import simulate
from simulator.parallel.schedule_check import ScheduleDeadlock, load_schedule, validate
from simulator.parallel.schedules import by_name, format_actions, parse_actions
from simulator.scenario import scenario_from_dict
from simulator.testing import random_schedules

_TOPOLOGY = {2: "pcie-4x4090", 4: "dgx-a100"}     # pp -> a topology of pp x dp = 2 pp GPUs


def _simulate(schedule_text: str, pp: int, m: int, zero: int = 0, **parallel) -> dict:
    handle, path = tempfile.mkstemp(suffix=".txt")
    with os.fdopen(handle, "w") as file:
        file.write(schedule_text)
    try:
        doc = {"model": {"architecture": "gpt", "num_layers": pp, "hidden_size": 32, "num_attention_heads": 2,
                         "vocab_size": 100, "seq_length": 16},
               "training": {"micro_batch_size": 1, "global_batch_size": 2 * m},
               "parallel": {"pp": pp, "dp": 2, "zero_stage": zero, "schedule": path, **parallel},
               "cluster": {"topology": _TOPOLOGY[pp]}, "allocator": {"kind": "exact"},
               "run": {"warmup_iterations": 0, "iterations": 1}}
        return simulate(scenario_from_dict(doc, "x.toml"), timelines=False).report
    finally:
        os.unlink(path)


def test_the_issue_schedule_runs():
    """Stage 1 takes micro-batch 1 first: the engine used to deadlock (sends queued in the producer's order, and
    the data-parallel buckets and tied-embedding all_reduce waiting for micro-batch m - 1's backward)."""
    report = _simulate("0F0 0F1 0B1 0B0\n1F1 1B1 1F0 1B0\n", 2, 2)
    assert report["iteration_time_s"] > 0 and report["fits"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([2, 4]).flatmap(lambda p: random_schedules(p, p, 1, 3 if p == 2 else 2)), st.integers(0, 1))
def test_every_schedule_the_validator_accepts_runs(schedule, zero):
    validate(schedule)
    report = _simulate(format_actions(schedule), schedule.num_ranks, schedule.microbatches, zero)
    assert report["iteration_time_s"] > 0


@settings(max_examples=40, deadline=None)
@given(random_schedules(2, 4, 1, 4))
def test_random_schedules_are_valid_and_round_trip(schedule):
    validate(schedule)
    assert parse_actions(format_actions(schedule)).ranks == schedule.ranks


def test_blocking_sends_refuse_a_receiver_that_takes_another_order():
    schedule = parse_actions("0F0 0F1 0B1 0B0\n1F1 1B1 1F0 1B0\n")
    validate(schedule)                                  # asynchronous sends: it runs
    with pytest.raises(ScheduleDeadlock, match=r"with blocking sends .*rank 0 blocked at 0F1 \(position 1\) "
                                               r"waiting for 1F0 from rank 1"):
        validate(schedule, blocking_sends=True)
    for name in ("gpipe", "1f1b"):                      # the schedules blocking sends are modelled for
        validate(by_name(name, 4, 8), blocking_sends=True)


def test_load_schedule_names_the_key_for_blocking_sends(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("0F0 0F1 0B1 0B0\n1F1 1B1 1F0 1B0\n")
    with pytest.raises(ScheduleDeadlock, match=r"^parallel.schedule = '.*s.txt': schedule 's.txt' deadlocks with "):
        load_schedule(str(path), 2, 2, blocking_sends=True)
