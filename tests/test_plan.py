"""ParallelPlan: rank <-> coordinates, placement orders, process groups, representatives, make_plan rules."""

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.errors import PlanError
from simulator.network.topology import load_topology
from simulator.parallel.plan import AXES, Coords, ParallelPlan, make_plan, parse_placement
from simulator.scenario import scenario_from_dict

ORDERS = ["-".join(order) for order in itertools.permutations(("tp", "dp", "pp"))]


@dataclasses.dataclass(frozen=True)
class FakeTopology:
    """The four attributes make_plan reads from a Topology."""

    gpus_per_node: int
    nodes: int
    name: str = "fake"

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@st.composite
def plans(draw, placement=st.sampled_from(["auto"] + ORDERS)):
    return ParallelPlan(dp=draw(st.integers(1, 6)), tp=draw(st.integers(1, 6)), pp=draw(st.integers(1, 6)),
                        placement=draw(placement), gpus_per_node=draw(st.sampled_from([None, 1, 2, 4, 8])))


@settings(max_examples=150, deadline=None)
@given(plans())
def test_every_rank_has_unique_coordinates_and_round_trips(plan):
    seen = set()
    for rank in range(plan.world_size):
        c = plan.coords(rank)
        assert 0 <= c.dp < plan.dp and 0 <= c.pp < plan.pp and 0 <= c.tp < plan.tp
        assert plan.rank_of(dp=c.dp, pp=c.pp, tp=c.tp) == rank
        assert plan.stage_of(rank) == c.pp
        seen.add((c.dp, c.pp, c.tp))
    assert len(seen) == plan.world_size


@settings(max_examples=150, deadline=None)
@given(plans(), st.sampled_from(AXES))
def test_groups_partition_the_ranks_and_vary_only_their_axis(plan, axis):
    groups = plan.groups(axis)
    assert sorted(rank for group in groups for rank in group) == list(range(plan.world_size))
    assert len(groups) == plan.world_size // plan.size(axis)
    assert [group[0] for group in groups] == sorted(group[0] for group in groups)
    others = [a for a in AXES if a != axis]
    for group in groups:
        assert len(group) == plan.size(axis)
        assert [getattr(plan.coords(r), axis) for r in group] == list(range(plan.size(axis)))
        assert len({tuple(getattr(plan.coords(r), a) for a in others) for r in group}) == 1
        for rank in group:
            assert plan.group_of(rank, axis) == group


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([4, 8]), st.data())
def test_tp_groups_stay_inside_a_node_under_the_default_placement(gpus_per_node, data):
    tp = data.draw(st.sampled_from([d for d in (1, 2, 4, 8) if gpus_per_node % d == 0]))
    plan = ParallelPlan(dp=data.draw(st.integers(1, 8)), tp=tp, pp=data.draw(st.integers(1, 8)),
                        gpus_per_node=gpus_per_node)
    for group in plan.groups("tp"):
        assert len({plan.node_of(rank) for rank in group}) == 1
    assert plan.straddling_groups("tp") == ()


@settings(max_examples=150, deadline=None)
@given(plans())
def test_representatives_cover_the_world_once_per_stage(plan):
    reps = plan.representatives()
    assert [rep.stage for rep in reps] == list(range(plan.pp))
    assert sum(rep.multiplicity for rep in reps) == plan.world_size
    for rep in reps:
        members = plan.stage_ranks(rep.stage)
        assert rep.rank == members[0] and len(members) == rep.multiplicity
        assert all(plan.stage_of(rank) == rep.stage for rank in members)
        # the stage's ranks are exactly the union of the dp and tp groups through the representative
        closure = {r for d in plan.group_of(rep.rank, "dp") for r in plan.group_of(d, "tp")}
        assert sorted(closure) == list(members)


def test_default_order_is_megatrons():
    plan = ParallelPlan(dp=2, tp=2, pp=4)               # Megatron's parallel_state example, 16 GPUs
    assert plan.order == ("tp", "dp", "pp") and parse_placement("auto") == plan.order
    assert plan.groups("tp") == ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15))
    assert plan.groups("dp") == ((0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15))
    assert plan.groups("pp") == ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))
    assert plan.coords(13) == Coords(dp=0, pp=3, tp=1)
    assert (plan.stride("tp"), plan.stride("dp"), plan.stride("pp")) == (1, 2, 4)


def test_other_placements():
    plan = ParallelPlan(dp=2, tp=2, pp=2, placement="dp-tp-pp")
    assert plan.groups("dp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert plan.groups("tp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    plan = ParallelPlan(dp=2, tp=2, pp=3, placement="tp-pp-dp")
    assert plan.groups("pp") == ((0, 2, 4), (1, 3, 5), (6, 8, 10), (7, 9, 11))
    assert plan.rank_of(dp=1, pp=2, tp=1) == 11
    assert parse_placement(" PP-TP-DP ") == ("pp", "tp", "dp")


def _scenario(parallel=None, model=None, nodes=1, **replace):
    doc = {"model": model or {"preset": "llama-7b"}, "parallel": parallel or {}, "cluster": {"nodes": nodes}}
    scenario = scenario_from_dict(doc, source="x.toml")
    if replace:   # bypass the loader's own checks to reach make_plan's
        scenario = dataclasses.replace(scenario, parallel=dataclasses.replace(scenario.parallel, **replace))
    return scenario


def test_gpt3_175b_on_1024_a100():
    scenario = scenario_from_dict({"model": {"preset": "gpt3-175b"}, "parallel": {"tp": 8, "pp": 16, "dp": 8},
                                   "cluster": {"topology": "dgx-a100", "nodes": 128},
                                   "training": {"global_batch_size": 1536}})
    plan = make_plan(scenario, load_topology("dgx-a100", nodes=128))
    assert plan.world_size == 1024 and plan.warnings == ()
    assert plan.coords(1023) == Coords(dp=7, pp=15, tp=7)
    assert plan.group_of(9, "tp") == tuple(range(8, 16))
    assert plan.group_of(9, "dp") == (1, 9, 17, 25, 33, 41, 49, 57)
    assert plan.group_of(9, "pp") == tuple(9 + 64 * s for s in range(16))
    assert all(len({plan.node_of(r) for r in g}) == 1 for g in plan.groups("tp"))
    assert all(len({plan.node_of(r) for r in g}) == 16 for g in plan.groups("pp"))
    assert [(rep.rank, rep.multiplicity) for rep in plan.representatives()][:3] == [(0, 64), (64, 64), (128, 64)]
    assert [span.num_layers for span in plan.stages] == [6] * 16 and plan.imbalance == 1.0
    assert plan.stages[0].has_embedding and plan.stages[-1].has_head


def test_16384_gpus_is_cheap():
    scenario = scenario_from_dict({"model": {"preset": "gpt3-175b"}, "parallel": {"tp": 8, "pp": 16, "dp": 128},
                                   "cluster": {"nodes": 2048}, "training": {"global_batch_size": 1536 * 16}})
    plan = make_plan(scenario, load_topology("dgx-a100", nodes=2048))
    assert plan.world_size == 16384 and len(plan.representatives()) == 16
    assert plan.representatives()[-1].rank == 15 * 1024


def test_uneven_split_and_warnings_are_reported():
    model = {"preset": "llama-7b", "num_layers": 30}
    plan = make_plan(_scenario({"pp": 4, "dp": 2}, model=model), FakeTopology(8, 1))
    assert [s.num_layers for s in plan.stages] == [8, 8, 7, 7]
    assert plan.warnings == ("model.num_layers = 30 split unevenly over parallel.pp = 4 stages: 8, 8, 7, 7 layers "
                             "(imbalance 1.14)",)
    plan = make_plan(_scenario({"pp": 4, "dp": 2}, model=model), FakeTopology(8, 1), layers_per_stage=[6, 8, 8, 8])
    assert plan.stages[0].num_layers == 6
    plan = make_plan(_scenario({"tp": 16, "sequence_parallel": False}), FakeTopology(8, 2))
    assert plan.warnings == ("parallel.tp = 16 exceeds the 8 GPUs per node of 'fake': tensor-parallel collectives "
                             "cross the inter-node network",)
    plan = make_plan(_scenario({"dp": 8, "sequence_parallel": True}), FakeTopology(8, 1))
    assert plan.warnings == ("parallel.sequence_parallel = true has no effect with parallel.tp = 1",)
    plan = make_plan(_scenario({"dp": 2, "tp": 2, "placement": "dp-pp-tp"}), FakeTopology(4, 1))
    assert plan.warnings == () and plan.groups("tp") == ((0, 2), (1, 3))
    plan = make_plan(_scenario({"dp": 3, "pp": 8}), FakeTopology(4, 6))
    assert plan.warnings and "dp groups spread over nodes unlike the first (e.g. ranks (3, 4, 5))" in plan.warnings[0]


def test_virtual_stages_with_interleaved_schedule():
    plan = make_plan(_scenario({"pp": 4, "dp": 2, "virtual_stages": 2, "schedule": "interleaved-1f1b"}),
                     FakeTopology(8, 1))
    assert plan.virtual_stages == 2 and len(plan.stages) == 8
    assert [(s.start, s.stop) for s in plan.stage_spans(1)] == [(4, 8), (20, 24)]


@pytest.mark.parametrize("kwargs, topology, message", [
    (dict(parallel={"tp": 4, "pp": 2, "dp": 2}), FakeTopology(8, 1),
     "x.toml: parallel.dp × tp × pp = 2 × 4 × 2 = 16 must equal the 8 GPUs of cluster 'fake' × 1 node(s)"),
    (dict(parallel={"dp": 8}, placement="tp-dp"), FakeTopology(8, 1),
     "x.toml: parallel.placement = 'tp-dp': must be \"auto\" or the axes tp, dp and pp each once"),
    (dict(parallel={"dp": 8}, placement="tp-tp-pp"), FakeTopology(8, 1),
     "x.toml: parallel.placement = 'tp-tp-pp': must be"),
    (dict(model={"preset": "llama-7b", "num_attention_heads": 32, "num_kv_heads": 8}, tp=3, dp=1), FakeTopology(3, 1),
     "x.toml: parallel.tp = 3: must divide model.num_attention_heads = 32"),
    (dict(model={"preset": "llama-7b", "num_attention_heads": 32, "num_kv_heads": 2}, tp=4), FakeTopology(4, 1),
     "x.toml: parallel.tp = 4: must divide model.num_kv_heads = 2"),
    (dict(model={"preset": "llama-7b", "ffn_hidden_size": 11000}, tp=16), FakeTopology(8, 2),
     "x.toml: parallel.tp = 16: must divide model.ffn_hidden_size = 11000"),
    (dict(model={"preset": "llama-7b", "num_layers": 2}, pp=4), FakeTopology(4, 1),
     "x.toml: parallel.pp = 4: must be at most model.num_layers = 2 (every stage needs at least one layer)"),
    (dict(parallel={"pp": 2, "schedule": "interleaved-1f1b"}), FakeTopology(2, 1),
     "x.toml: parallel.virtual_stages = 1: parallel.schedule = 'interleaved-1f1b' needs virtual_stages > 1"),
    (dict(parallel={"pp": 2}, virtual_stages=2), FakeTopology(2, 1),
     "x.toml: parallel.virtual_stages = 2: only parallel.schedule = 'interleaved-1f1b' or an action file runs more "
     "than one model chunk per stage, not '1f1b'"),
    (dict(parallel={"pp": 4, "schedule": "interleaved-1f1b"}, virtual_stages=3), FakeTopology(4, 1),
     "x.toml: parallel.virtual_stages = 3: must divide model.num_layers / parallel.pp = 32 / 4 = 8 layers per stage"),
    (dict(model={"preset": "llama-7b", "num_layers": 30}, parallel={"pp": 4, "schedule": "interleaved-1f1b"},
          virtual_stages=2), FakeTopology(4, 1),
     "x.toml: parallel.virtual_stages = 2: must divide model.num_layers / parallel.pp = 30 / 4 = 7.5 layers per stage"),
    (dict(model={"preset": "llama-7b", "seq_length": 1023}, parallel={"tp": 2, "sequence_parallel": True}),
     FakeTopology(2, 1), "x.toml: parallel.sequence_parallel = true: needs model.seq_length = 1023 divisible by "
                         "parallel.tp = 2"),
])
def test_make_plan_errors(kwargs, topology, message):
    with pytest.raises(PlanError) as info:
        make_plan(_scenario(**kwargs), topology)
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text


def test_make_plan_rejects_a_bad_explicit_split():
    with pytest.raises(PlanError, match=r"^x.toml: parallel.layers_per_stage = \[16, 15\]: must sum to "
                                        r"model.num_layers = 32, sums to 31$"):
        make_plan(_scenario({"pp": 2}), FakeTopology(2, 1), layers_per_stage=[16, 15])


@pytest.mark.parametrize("call, message", [
    (lambda p: p.coords(8), "rank = 8: must be an integer in 0..7"),
    (lambda p: p.rank_of(dp=2, pp=0, tp=0), "dp = 2: must be an integer in 0..1"),
    (lambda p: p.groups("cp"), "axis = 'cp': must be one of dp, tp, pp"),
    (lambda p: p.stage_ranks(2), "stage = 2: must be an integer in 0..1"),
    (lambda p: ParallelPlan(dp=0, tp=1, pp=1), "parallel.dp = 0: must be a positive integer"),
    (lambda p: ParallelPlan(dp=1, tp=1, pp=1, gpus_per_node=0), "gpus_per_node = 0: must be a positive integer"),
])
def test_plan_accessor_errors(call, message):
    with pytest.raises(PlanError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        call(ParallelPlan(dp=2, tp=2, pp=2))
