"""Quiet collectives (EngineOptions.quiet_collectives): operations alone on their links at run time run without flows,
and one a later operation meets is put onto the flow network in its state then; times equal the all-flows run's to
rounding (rel 1e-9; measured ~1e-13), memory peaks identical."""

from __future__ import annotations

import dataclasses

import pytest
import simpy
from hypothesis import HealthCheck, given, settings, strategies as st

import simulator.api as api
import simulator.engine.network_model as network_model
from simulator.engine.network_model import NetworkModel
from simulator.network import load_topology
from simulator.network.collectives import lower_collective
from simulator.network.footprint import isolated_duration_s
from simulator.network.quiet import alone_end_s, alone_steps, state_at
from simulator.parallel.program import Collective, Recv, Send
from simulator.scenario import scenario_from_dict

GROUP = (0, 1, 2, 3)
SIZE = 64 * 2**20


@pytest.fixture(scope="module")
def a100():
    return load_topology("dgx-a100", nodes=2)


def _model_run(topology, quiet: bool, posts) -> tuple[dict[str, float], NetworkModel]:
    """Run `posts` [(time, name, what)] on a NetworkModel of simulated ranks 0-3; what: "ring" (the all_reduce over
    GROUP), "send" (0 -> 1), or "shadow" (the send 0 -> 1 nobody waits for). Returns each name's end time."""
    env = simpy.Environment()
    model = NetworkModel(env, topology, GROUP, quiet=quiet)
    ends: dict[str, float] = {}

    def post(delay, name, what):
        yield env.timeout(delay)
        if what == "shadow":
            model._launch(model._lower("send", (0, 1), SIZE), [], name)
            return
        if what == "shadows":       # two shadows of one launch: quiet together as one claim (or each on its own)
            pairs = ((0, 1), (2, 3))
            if not (quiet and model._launch_quiet_shadows(("send", (), SIZE), pairs, name)):
                for pair in pairs:
                    model._launch(model._lower("send", pair, SIZE), [], name)
            return
        if what == "ring":
            pendings = [model.collective(r, Collective(name, "all_reduce", GROUP, SIZE)) for r in GROUP]
        else:
            pendings = [model.send(0, Send(name, 1, SIZE, name)), model.recv(1, Recv(name, 0, SIZE, name))]
        for pending in pendings:
            yield pending.done
        ends[name] = env.now

    for delay, name, what in posts:
        env.process(post(delay, name, what))
    env.run()
    return ends, model


def test_alone_steps_give_the_time_alone(a100):
    schedule = lower_collective(a100, "all_reduce", GROUP, SIZE)
    steps = alone_steps(a100, schedule)
    assert steps is not None and len(steps) == len(schedule.phases)
    assert alone_end_s(steps, 0.0) == pytest.approx(isolated_duration_s(a100, schedule), rel=1e-12, abs=0)
    assert state_at(a100, schedule, 1.0, 1.0 + 2 * alone_end_s(steps, 0.0))[0] == len(schedule.phases)


def test_a_quiet_collective_interrupted_in_a_latency_wait_and_mid_flow_ends_as_with_flows(a100):
    schedule = lower_collective(a100, "all_reduce", GROUP, SIZE)
    first = schedule.phases[0].latency_s
    alone = isolated_duration_s(a100, schedule)
    waiting, sending = first / 2, (first + alone / len(schedule.phases) / 3)
    assert state_at(a100, schedule, 0.0, waiting)[1] == first           # still in phase 0's latency wait
    phase, ready, flows = state_at(a100, schedule, 0.0, sending)
    assert ready is None and flows and all(0 < f.size_bytes < SIZE for f in flows)   # phase 0 part sent
    for at in (waiting, sending):
        posts = [(0.0, "ring", "ring"), (at, "send", "send")]
        quiet, model = _model_run(a100, True, posts)
        flows_ends, _ = _model_run(a100, False, posts)
        assert model.quiet_operations == 1 and model.materialized_operations == 1
        for name in ("ring", "send"):
            assert quiet[name] == pytest.approx(flows_ends[name], rel=1e-9, abs=0)
        assert quiet["ring"] > alone * 1.001            # the send really slowed it


def test_operations_after_a_quiet_one_ended_run_quiet(a100):
    alone = isolated_duration_s(a100, lower_collective(a100, "all_reduce", GROUP, SIZE))
    ends, model = _model_run(a100, True, [(0.0, "ring", "ring"), (alone, "send", "send")])
    assert model.quiet_operations == 2 and model.materialized_operations == 0     # (an end at now is free)
    assert ends["ring"] == pytest.approx(alone, rel=1e-12)


@pytest.mark.parametrize("shadow_first", [True, False])
def test_an_interrupted_shadow_slows_the_sender_as_with_flows(a100, shadow_first):
    send = isolated_duration_s(a100, lower_collective(a100, "send", (0, 1), SIZE))
    posts = [(0.0, "shadow", "shadow"), (send / 3, "send", "send")] if shadow_first \
        else [(0.0, "send", "send"), (send / 3, "shadow", "shadow")]
    quiet, model = _model_run(a100, True, posts)
    flows, _ = _model_run(a100, False, posts)
    assert model.materialized_operations == 1
    assert quiet["send"] == pytest.approx(flows["send"], rel=1e-9, abs=0)
    assert quiet["send"] > (send / 3 if shadow_first else 0.0) + send * 1.1


def test_shadows_quiet_together_are_materialized_each_in_its_state(a100):
    send = isolated_duration_s(a100, lower_collective(a100, "send", (0, 1), SIZE))
    posts = [(0.0, "shadows", "shadows"), (send / 3, "send", "send")]
    quiet, model = _model_run(a100, True, posts)
    flows, _ = _model_run(a100, False, posts)
    assert model.quiet_operations == 2 and model.materialized_operations == 2     # (both parts still sending)
    assert quiet["send"] == pytest.approx(flows["send"], rel=1e-9, abs=0)
    assert quiet["send"] > send / 3 + send * 1.1


def test_the_off_switch_starts_no_quiet_operation(a100):
    _, model = _model_run(a100, False, [(0.0, "ring", "ring"), (1e-3, "send", "send")])
    assert model.quiet_operations == 0 and not model._flowing and not model._quiet_claims


def _doc(tp, pp, dp, schedule, overlap, zero, recompute, microbatches) -> dict:
    parallel = {"tp": tp, "pp": pp, "dp": dp, "schedule": schedule if pp > 1 else "1f1b",
                "overlap_grad_reduce": overlap, "bucket_size": "25 kB", "zero_stage": zero}
    if schedule == "interleaved-1f1b" and pp > 1:
        parallel["virtual_stages"] = 2
    return {"name": "quiet", "model": {"architecture": "gpt", "num_layers": 8, "hidden_size": 64,
                                       "num_attention_heads": 4, "vocab_size": 256, "seq_length": 32, "dropout": 0.0},
            "training": {"micro_batch_size": 1, "global_batch_size": microbatches * pp * dp,
                         "precision": "bf16-mixed", "framework": "megatron", "recompute": recompute},
            "parallel": parallel, "cluster": {"topology": "dgx-a100", "nodes": max(1, tp * pp * dp // 8)},
            "allocator": {"kind": "caching"}, "run": {"warmup_iterations": 1, "iterations": 1}}


def _simulate(scenario, **options):
    real = api._engine_options
    models = []
    real_init = NetworkModel.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        models.append(self)

    api._engine_options = lambda *a, **k: dataclasses.replace(real(*a, **k), **options)
    network_model.NetworkModel.__init__ = init
    try:
        result = api.simulate(scenario)
    finally:
        api._engine_options = real
        network_model.NetworkModel.__init__ = real_init
    return result, models[0]


def _assert_same_to_rounding(a, b, path=""):
    if isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=0), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _assert_same_to_rounding(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_to_rounding(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from([(2, 2, 2), (4, 1, 2), (2, 1, 4), (1, 2, 4), (4, 2, 2), (2, 2, 4)]),
       schedule=st.sampled_from(["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2"]), overlap=st.booleans(),
       zero=st.sampled_from([0, 1]), recompute=st.sampled_from(["none", "full"]), microbatches=st.sampled_from([2, 4]))
def test_reports_with_quiet_collectives_equal_the_flows_runs(shape, schedule, overlap, zero, recompute, microbatches):
    # DGX A100 plans with dp > 1 inside a node: DP rings share NVLink ports with TP collectives and NICs with the
    # pipeline sends, so nothing is link-isolated statically and the quiet ones are found at run time.
    scenario = scenario_from_dict(_doc(*shape, schedule, overlap, zero, recompute, microbatches))
    quiet, model = _simulate(scenario)
    assert model.quiet_operations > 0
    peaks = [(r.peak_allocated, r.peak_reserved) for r in quiet.trace.ranks]
    for options in ({"quiet_collectives": False}, {"quiet_collectives": False, "isolated_collectives": False}):
        other, other_model = _simulate(scenario, **options)
        assert other_model.quiet_operations == 0
        _assert_same_to_rounding(quiet.report, other.report)
        assert peaks == [(r.peak_allocated, r.peak_reserved) for r in other.trace.ranks]
