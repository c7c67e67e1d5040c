"""Public hypothesis strategies (schedules, plans, scenarios) and invariant checkers for property tests.

Needs hypothesis (`pip install 'memsim[test]'`). The checkers raise AssertionError with a message that
says what broke, so they read well inside pytest; they return a value worth printing when they pass.

    from hypothesis import given
    from simulator.testing import schedules, check_no_deadlock

    @given(schedules())
    def test_built_in_schedules_run(schedule):
        check_no_deadlock(schedule)
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, NoReturn, Sequence

try:
    from hypothesis import strategies as st
    from hypothesis.errors import InvalidArgument
except ImportError as exc:      # pragma: no cover - depends on the environment
    raise ImportError("simulator.testing needs hypothesis: pip install 'memsim[test]'") from exc

from simulator.errors import DeadlockError, ScheduleError
from simulator.parallel.schedule_check import (
    CommStep, UniformTiming, execute_uniform, program, validate,
)
from simulator.parallel.schedules import SCHEDULE_NAMES, Action, Schedule, by_name, check_complete, parse_actions
from simulator.trace.records import MemorySample, RankTrace, Trace
from simulator.workload.graph import CATEGORIES

__all__ = [
    "check_bubble", "check_every_action_once", "check_in_flight_at_most", "check_memory_never_negative",
    "check_no_deadlock", "check_sends_matched", "draw_examples", "multi_gpu_scenarios", "plans", "random_schedules",
    "scenarios",
    "schedules",
]


def draw_examples(strategy: st.SearchStrategy, count: int, seed: int = 0) -> list:
    """`count` values of `strategy`, the same ones for the same seed (each drawn from its own seeded random
    source), outside a test: for measurements over random cases (simulator/explore/agreement.py)."""
    import random

    from hypothesis.internal.conjecture.data import ConjectureData

    out = []
    for k in range(count):
        data = ConjectureData(random=random.Random(f"{seed}:{k}"))
        out.append(data.draw(strategy))
    return out


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidArgument(message)


# ---- strategies ---------------------------------------------------------------------------------------

@st.composite
def schedules(draw, names: Sequence[str] = SCHEDULE_NAMES, min_ranks: int = 1, max_ranks: int = 8,
              min_microbatches: int = 1, max_microbatches: int = 24, max_virtual_stages: int = 4) -> Schedule:
    """Built-in schedules over random (name, ranks p, microbatches m, virtual stages v).

    interleaved-1f1b gets m a multiple of p (Megatron's rule) and 1..max_virtual_stages chunks; the
    others get v = 1. Read p, m, v back from the Schedule (num_ranks, microbatches, virtual_stages).
    """
    names = tuple(names)
    _require(bool(names) and all(name in SCHEDULE_NAMES for name in names),
             f"names = {names!r}: must be built-in schedules ({', '.join(SCHEDULE_NAMES)})")
    _require(1 <= min_ranks <= max_ranks, f"ranks: need 1 <= min_ranks = {min_ranks} <= max_ranks = {max_ranks}")
    _require(1 <= min_microbatches <= max_microbatches,
             f"microbatches: need 1 <= min_microbatches = {min_microbatches} <= max_microbatches = {max_microbatches}")
    _require(max_virtual_stages >= 1, f"max_virtual_stages = {max_virtual_stages}: must be >= 1")
    name = draw(st.sampled_from(names))
    if name != "interleaved-1f1b":
        p = draw(st.integers(min_ranks, max_ranks))
        return by_name(name, p, draw(st.integers(min_microbatches, max_microbatches)))
    ranks = [p for p in range(min_ranks, max_ranks + 1)
             if any(min_microbatches <= p * k <= max_microbatches for k in range(1, max_microbatches + 1))]
    _require(bool(ranks), f"interleaved-1f1b: no multiple of ranks {min_ranks}..{max_ranks} lies in "
                          f"microbatches {min_microbatches}..{max_microbatches}")
    p = draw(st.sampled_from(ranks))
    multiples = [p * k for k in range(1, max_microbatches // p + 1) if p * k >= min_microbatches]
    m = draw(st.sampled_from(multiples))
    return by_name(name, p, m, draw(st.integers(1, max_virtual_stages)))


@st.composite
def random_schedules(draw, min_ranks: int = 1, max_ranks: int = 4, min_microbatches: int = 1,
                     max_microbatches: int = 4, split_backward: bool = True) -> Schedule:
    """Any valid one-stage-per-rank schedule, not only the built-in ones: every rank's list is the projection of
    a random order in which the actions could run (an action is drawn once its inputs and, on its own rank, its
    F (or I) are done), so validate() accepts it. With `split_backward`, some backwards are I and W."""
    _require(1 <= min_ranks <= max_ranks, f"ranks: need 1 <= min_ranks = {min_ranks} <= max_ranks = {max_ranks}")
    _require(1 <= min_microbatches <= max_microbatches,
             f"microbatches: need 1 <= min_microbatches = {min_microbatches} <= max_microbatches = {max_microbatches}")
    p = draw(st.integers(min_ranks, max_ranks))
    m = draw(st.integers(min_microbatches, max_microbatches))
    split = {mb: split_backward and draw(st.booleans()) for mb in range(m)}
    todo = {(stage, kind, mb) for stage in range(p) for mb in range(m)
            for kind in (("F", "I", "W") if split[mb] else ("F", "B"))}
    done: set[tuple[int, str, int]] = set()

    def ready(key: tuple[int, str, int]) -> bool:
        stage, kind, mb = key
        grad = "I" if split[mb] else "B"
        if kind == "F":
            return stage == 0 or (stage - 1, "F", mb) in done
        if kind == "W":
            return (stage, "I", mb) in done
        return (stage, "F", mb) in done and (stage == p - 1 or (stage + 1, grad, mb) in done)

    ranks: list[list[str]] = [[] for _ in range(p)]
    while todo:
        options = sorted(key for key in todo if ready(key))
        key = options[draw(st.integers(0, len(options) - 1))]
        todo.remove(key)
        done.add(key)
        ranks[key[0]].append(f"{key[0]}{key[1]}{key[2]}")
    return parse_actions("\n".join(" ".join(actions) for actions in ranks), name="random")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def plans(draw, gpus: int | st.SearchStrategy[int] = st.sampled_from([1, 2, 4, 8, 16, 32, 64]),
          num_attention_heads: int | None = None, num_kv_heads: int | None = None,
          num_layers: int | None = None, gpus_per_node: int | None = None) -> dict[str, int]:
    """[parallel] tables {"dp", "tp", "pp"} with dp * tp * pp == gpus.

    tp divides num_attention_heads and num_kv_heads and, with gpus_per_node, the node (tensor
    parallelism stays inside a node); pp is at most num_layers. Unset limits are not applied.
    """
    n = draw(gpus) if isinstance(gpus, st.SearchStrategy) else gpus
    _require(isinstance(n, int) and n >= 1, f"gpus = {n!r}: must be an integer >= 1")
    for key, value in (("num_attention_heads", num_attention_heads), ("num_kv_heads", num_kv_heads),
                       ("num_layers", num_layers), ("gpus_per_node", gpus_per_node)):
        _require(value is None or (isinstance(value, int) and value >= 1), f"{key} = {value!r}: must be >= 1")
    tps = [t for t in _divisors(n)
           if (num_attention_heads is None or num_attention_heads % t == 0)
           and (num_kv_heads is None or num_kv_heads % t == 0)
           and (gpus_per_node is None or gpus_per_node % t == 0)]
    tp = draw(st.sampled_from(tps))
    pps = [q for q in _divisors(n // tp) if num_layers is None or q <= num_layers]
    pp = draw(st.sampled_from(pps))
    return {"dp": n // (tp * pp), "tp": tp, "pp": pp}


@st.composite
def scenarios(draw, architectures: Sequence[str] = ("gpt", "llama"), max_layers: int = 4,
              max_seq_length: int = 64) -> dict:
    """Small valid scenario dicts for simulator.scenario.scenario_from_dict, on the `cpu` device.

    One device (dp = tp = pp = 1); random architecture, layers, heads (GQA for llama), widths,
    vocabulary, sequence, micro-batch, gradient accumulation, precision and optimizer.
    """
    architectures = tuple(architectures)
    _require(bool(architectures) and all(a in ("gpt", "llama") for a in architectures),
             f"architectures = {architectures!r}: choose from gpt, llama")
    _require(max_layers >= 1 and max_seq_length >= 4,
             f"max_layers = {max_layers}, max_seq_length = {max_seq_length}: need >= 1 and >= 4")
    architecture = draw(st.sampled_from(architectures))
    heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([8, 16]))
    model = {
        "architecture": architecture,
        "num_layers": draw(st.integers(1, max_layers)),
        "hidden_size": heads * head_dim,
        "num_attention_heads": heads,
        "vocab_size": draw(st.integers(16, 256)),
        "seq_length": draw(st.integers(4, max_seq_length)),
    }
    if architecture == "llama":
        model["num_kv_heads"] = draw(st.sampled_from(_divisors(heads)))
    else:
        model["dropout"] = draw(st.sampled_from([0.0, 0.1]))
    micro = draw(st.integers(1, 2))
    return {
        "name": f"hypothesis-{architecture}",
        "model": model,
        "training": {
            "micro_batch_size": micro,
            "global_batch_size": micro * draw(st.integers(1, 2)),
            "precision": draw(st.sampled_from(["fp32", "bf16-mixed"])),
            "optimizer": draw(st.sampled_from(["adamw", "sgd"])),
        },
        "parallel": {"tp": 1, "pp": 1, "dp": 1},
        "cluster": {"topology": "cpu"},
    }


# GPUs per server and memory per GPU (catalog capacities, rounded) of the bundled multi-GPU topologies, for
# multi_gpu_scenarios' rough sizing only (the scenarios it draws are simulated with the catalog's real numbers).
_TOPOLOGIES = {"dgx-a100": (8, 80e9), "dgx-h100": (8, 80e9), "hgx-h200": (8, 141e9), "pcie-4x4090": (4, 24e9),
               "pcie-8xa100": (8, 80e9)}
_HEAD_DIMS = (32, 48, 64, 80, 96, 128, 160, 192, 256, 384, 512)
_SEQUENCES = (256, 512, 1024, 2048, 4096)
_MICRO_BATCHES = (1, 2, 4, 8)
# Rough bytes of model states per parameter (weights, gradients, optimizer) by optimizer, halved for pure bf16.
_STATE_BYTES = {"adamw": 16, "sgd": 8, "adam-8bit": 10}


def _rough_bytes_per_gpu(layers: int, hidden: int, vocab: int, seq: int, micro: int, tp: int, pp: int, dp: int,
                         zero: int, recompute: str, in_flight: int, optimizer: str = "adamw",
                         precision: str = "bf16-mixed") -> float:
    """A deliberately crude per-GPU footprint (bytes per parameter by optimizer, Korthikanti's 34 sbh per layer,
    the loss's fp32 logits): only used to aim drawn scenarios at a fill of the GPU's memory, never to judge one."""
    params = (12 * layers * hidden * hidden + vocab * hidden) / (tp * pp)
    per_param = _STATE_BYTES[optimizer] * (0.5 if precision == "bf16" else 1.0)
    states = params * (4 + (per_param - 4) / (dp if zero >= 1 else 1))
    per_layer = {"none": 34, "selective": 24, "full": 2}[recompute] * seq * micro * hidden / tp
    logits = 12 * seq * micro * vocab / tp
    return states + per_layer * max(1, layers // pp) * in_flight + logits


@st.composite
def multi_gpu_scenarios(draw, topologies: Sequence[str] = tuple(_TOPOLOGIES), max_nodes: int = 2,
                        max_layers: int = 8, max_microbatches: int = 8,
                        fills: Sequence[float | None] = (None, 0.6, 0.85, 0.95, 1.0, 1.05, 1.15, 1.4)) -> dict:
    """Valid multi-GPU scenario dicts (for simulator.scenario.scenario_from_dict) on the bundled topologies.

    Every GPU of `topology` x `nodes` is used: tp (dividing the heads and the node), pp (at most the layers)
    and dp; virtual stages with interleaved-1f1b; micro-batch, micro-batches per pipeline, recompute, ZeRO
    stage (2 and 3 only with pp = 1, as simulate allows; megatron at most 1), sequence parallelism, schedule,
    precision, framework and optimizer vary. Models are small in layers (a full simulation takes about a
    second) but not in width: with a `fill` from `fills` the head dimension, micro-batch and sequence are
    chosen so that a crude footprint (`_rough_bytes_per_gpu`) is that fraction of the GPU's memory, so a good
    share of the drawn plans lies near the capacity; None draws them freely.
    """
    topologies = tuple(topologies)
    _require(bool(topologies) and all(t in _TOPOLOGIES for t in topologies),
             f"topologies = {topologies!r}: choose from {', '.join(_TOPOLOGIES)}")
    _require(max_nodes >= 1 and max_layers >= 2 and max_microbatches >= 1,
             f"max_nodes = {max_nodes}, max_layers = {max_layers}, max_microbatches = {max_microbatches}: "
             f"need >= 1, >= 2, >= 1")
    topology = draw(st.sampled_from(topologies))
    per_node, capacity = _TOPOLOGIES[topology]
    nodes = draw(st.integers(1, max_nodes)) if topology.startswith(("dgx", "hgx")) else 1
    gpus = per_node * nodes
    tp = draw(st.sampled_from([t for t in _divisors(per_node) if t <= 8]))
    pp = draw(st.sampled_from([q for q in _divisors(gpus // tp) if q <= max_layers]))
    dp = gpus // (tp * pp)
    layers = draw(st.integers(max(2, pp), max_layers))
    schedule, virtual = "1f1b", 1
    if pp > 1:
        schedule = draw(st.sampled_from(["1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb-h2"]))
        if schedule == "interleaved-1f1b":
            if layers < 2 * pp:
                layers = 2 * pp if 2 * pp <= max_layers else layers
            options = [v for v in range(2, layers // pp + 1) if layers % pp == 0 and (layers // pp) % v == 0]
            if options:
                virtual = draw(st.sampled_from(options))
            else:
                schedule = "1f1b"
    if schedule == "interleaved-1f1b":
        microbatches = pp * draw(st.integers(1, max(1, max_microbatches // pp)))
    else:
        microbatches = draw(st.integers(1, max_microbatches))
    architecture = draw(st.sampled_from(["gpt", "llama"]))
    heads = draw(st.sampled_from([h for h in (8, 16, 32, 64) if h % tp == 0]))
    framework = draw(st.sampled_from(["torch", "megatron", "deepspeed"]))
    zero_options = [0] if dp == 1 else [0, 1] if (pp > 1 or framework == "megatron") else [0, 1, 2, 3]
    zero = draw(st.sampled_from(zero_options))
    recompute = draw(st.sampled_from(["none", "selective", "full"]))
    precision = draw(st.sampled_from(["bf16-mixed", "bf16-mixed", "fp16-mixed", "fp32", "bf16"]))
    optimizer = draw(st.sampled_from(["adamw", "adamw", "sgd", "adam-8bit"]))
    vocab = draw(st.sampled_from([8000, 32000, 50257]))
    fill = draw(st.sampled_from(tuple(fills)))
    if fill is None:
        head_dim = draw(st.sampled_from(_HEAD_DIMS))
        micro = draw(st.sampled_from(_MICRO_BATCHES[:3]))
        seq = draw(st.sampled_from(_SEQUENCES[:4]))
    else:
        in_flight = microbatches if schedule == "gpipe" else min(pp, microbatches)
        target = fill * capacity

        def miss(choice: tuple[int, int, int]) -> tuple[float, tuple[int, int, int]]:
            d, b, s = choice
            rough = _rough_bytes_per_gpu(layers, heads * d, vocab, s, b, tp, pp, dp, zero, recompute, in_flight,
                                         optimizer, precision)
            return abs(rough - target), choice

        head_dim, micro, seq = min(((d, b, s) for d in _HEAD_DIMS for b in _MICRO_BATCHES for s in _SEQUENCES),
                                   key=miss)
    sequence_parallel = tp > 1 and draw(st.booleans())
    model = {"architecture": architecture, "num_layers": layers, "hidden_size": heads * head_dim,
             "num_attention_heads": heads, "vocab_size": vocab, "seq_length": seq}
    if architecture == "llama":
        model["num_kv_heads"] = draw(st.sampled_from([k for k in _divisors(heads) if k % tp == 0]))
    else:
        model["max_position_embeddings"] = seq
        model["dropout"] = draw(st.sampled_from([0.0, 0.1]))
    return {
        "name": f"hypothesis-{architecture}-{topology}-tp{tp}-pp{pp}-dp{dp}",
        "model": model,
        "training": {"micro_batch_size": micro, "global_batch_size": micro * dp * microbatches,
                     "precision": precision, "framework": framework, "optimizer": optimizer,
                     "recompute": recompute},
        "parallel": {"tp": tp, "pp": pp, "dp": dp, "schedule": schedule, "virtual_stages": virtual,
                     "zero_stage": zero, "sequence_parallel": sequence_parallel},
        "cluster": {"topology": topology, "nodes": nodes},
    }


# ---- invariant checkers ---------------------------------------------------------------------------------

def _fail(message: str) -> NoReturn:
    raise AssertionError(message)


def check_every_action_once(schedule: Schedule) -> UniformTiming:
    """Every (stage, microbatch) has one F and one B (or one I and one W), and each runs exactly once.

    Returns the uniform-cost execution (F = 1, B = 2) that was counted.
    """
    try:
        check_complete(schedule)
        timing = execute_uniform(schedule, 1.0, 2.0)
    except (ScheduleError, DeadlockError) as error:
        _fail(f"not every action runs exactly once: {error}")
    ran = Counter(timed.action.key for row in timing.ranks for timed in row)
    listed = Counter(action.key for row in schedule.ranks for action in row)
    if ran != listed:
        extra = sorted(ran - listed) + sorted(listed - ran)
        _fail(f"schedule {schedule.name!r}: the run and the lists differ in {extra[:8]}")
    repeated = [key for key, count in ran.items() if count != 1]
    if repeated:
        _fail(f"schedule {schedule.name!r}: actions ran more than once: {sorted(repeated)[:8]}")
    return timing


def check_sends_matched(schedule_or_program: Schedule | Sequence[Sequence[Action | CommStep]],
                        in_order: bool = True) -> int:
    """Every send has exactly one recv on the peer rank and the other way round.

    Takes a Schedule (its sends and recvs are derived with schedule_check.program) or a lowered program:
    per rank a sequence of Actions and CommSteps. A send must follow its producer on the sending rank
    and a recv precede its consumer on the receiving rank. With `in_order`, the messages from one rank
    to another must also be received in the order they were sent, as NCCL matches point-to-point
    messages (memsim's own engine matches them by (kind, stage, microbatch), so a schedule can validate
    and still fail this).

    Returns the number of matched pairs.
    """
    lowered = program(schedule_or_program) if isinstance(schedule_or_program, Schedule) else schedule_or_program
    sends: dict[tuple[int, int], list[tuple]] = {}
    recvs: dict[tuple[int, int], list[tuple]] = {}
    for rank, steps in enumerate(lowered):
        steps = list(steps)
        position = {step.key: index for index, step in enumerate(steps) if isinstance(step, Action)}
        for index, step in enumerate(steps):
            if isinstance(step, Action):
                continue
            transfer = step.transfer
            if step.op == "send":
                if transfer.src_rank != rank or step.peer != transfer.dst_rank:
                    _fail(f"rank {rank} step {index}: send {step} names ranks {transfer.src_rank}->{transfer.dst_rank}")
                if position.get(transfer.producer.key, index) > index:
                    _fail(f"rank {rank} step {index}: send {step} comes before its producer {transfer.producer}")
                if transfer.producer.key not in position:
                    _fail(f"rank {rank} step {index}: send {step} but rank {rank} never runs {transfer.producer}")
                sends.setdefault((rank, step.peer), []).append(transfer.key)
            else:
                if transfer.dst_rank != rank or step.peer != transfer.src_rank:
                    _fail(f"rank {rank} step {index}: recv {step} names ranks {transfer.src_rank}->{transfer.dst_rank}")
                if position.get(transfer.consumer.key, -1) < index:
                    _fail(f"rank {rank} step {index}: recv {step} does not come before its consumer "
                          f"{transfer.consumer}")
                recvs.setdefault((step.peer, rank), []).append(transfer.key)
    pairs = 0
    for link in sorted(set(sends) | set(recvs)):
        sent, received = sends.get(link, []), recvs.get(link, [])
        if Counter(sent) != Counter(received):
            unmatched = sorted((Counter(sent) - Counter(received)).keys())
            unsent = sorted((Counter(received) - Counter(sent)).keys())
            _fail(f"rank {link[0]} -> rank {link[1]}: sends without a recv {unmatched[:6]}, "
                  f"recvs without a send {unsent[:6]}")
        if in_order and sent != received:
            first = next(i for i, (a, b) in enumerate(zip(sent, received)) if a != b)
            _fail(f"rank {link[0]} -> rank {link[1]}: message {first} is sent as {sent[first]} but received "
                  f"as {received[first]} (point-to-point messages match in order)")
        pairs += len(sent)
    return pairs


def check_no_deadlock(schedule: Schedule) -> None:
    """The schedule is valid and runs to the end with blocking receives (schedule_check.validate)."""
    try:
        validate(schedule)
    except DeadlockError as error:
        _fail(f"deadlock: {error}")
    except ScheduleError as error:
        _fail(f"invalid schedule: {error}")


def _samples(source: Trace | RankTrace | Iterable[MemorySample]) -> list[tuple[int, MemorySample]]:
    if isinstance(source, Trace):
        return [(rank.rank, sample) for rank in source.ranks for sample in rank.memory]
    if isinstance(source, RankTrace):
        return [(source.rank, sample) for sample in source.memory]
    return [(0, sample) for sample in source]


def check_memory_never_negative(samples: Trace | RankTrace | Iterable[MemorySample]) -> int:
    """No memory sample has negative allocated or reserved bytes, or a negative category.

    Takes a Trace, a RankTrace or MemorySamples. Returns the number of samples checked.
    """
    checked = _samples(samples)
    for rank, sample in checked:
        where = f"rank {rank} at t = {sample.time_s!r} s"
        if sample.allocated < 0:
            _fail(f"{where}: allocated = {sample.allocated} bytes < 0")
        if sample.reserved < 0:
            _fail(f"{where}: reserved = {sample.reserved} bytes < 0")
        for name, value in zip(CATEGORIES, sample.by_category):
            if value < 0:
                _fail(f"{where}: {name} = {value} bytes < 0")
    return len(checked)


def check_bubble(schedule: Schedule, expected: float, f: float = 1.0, b: float = 2.0, w: float | None = None,
                 tolerance: float = 1e-9) -> UniformTiming:
    """The schedule's bubble fraction with uniform costs is `expected` within `tolerance` (absolute).

    The bubble fraction is schedule_check.UniformTiming.bubble_fraction: the idle share of the busiest
    rank's own span, e.g. (p-1)/(m+p-1) for 1F1B. Returns the timing.
    """
    timing = execute_uniform(schedule, f, b, w)
    if abs(timing.bubble_fraction - expected) > tolerance:
        _fail(f"schedule {schedule.name!r} (p = {schedule.num_ranks}, m = {schedule.microbatches}, "
              f"v = {schedule.virtual_stages}): bubble fraction {timing.bubble_fraction:.6f}, expected "
              f"{expected:.6f} +- {tolerance:g} (f = {f}, b = {b}, w = {w})")
    return timing


def check_in_flight_at_most(schedule: Schedule, microbatches: float) -> UniformTiming:
    """No rank holds activations of more than `microbatches` microbatches at once (chunks count 1/v)."""
    timing = execute_uniform(schedule, 1.0, 2.0)
    for rank, held in enumerate(timing.peak_activations):
        if held > microbatches + 1e-9:
            _fail(f"schedule {schedule.name!r}: rank {rank} holds {held:g} microbatches of activations, "
                  f"more than {microbatches:g}")
    return timing
