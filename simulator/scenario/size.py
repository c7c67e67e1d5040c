"""Refuse, before anything is built, a run too large to simulate here: too many GPUs, nodes or micro-batches."""

from __future__ import annotations

from simulator.errors import PlanError
from simulator.scenario.limits import MAX_GPUS  # noqa: F401  dp × tp × pp (limits.py refuses it at load already)
# Layer-micro-batches the run lowers: simulated ranks × micro-batches × (warm-up + measured iterations) × layers per
# rank. Measured resident memory (issue 19, `memsim run --json`): GPT-3 175B on 1,024 A100 (16 × 192 × 2 × 6 =
# 36,864) 2.9 GB; the 1T GPT on 3,072 A100 (64 × 512 × 2 × 2 = 131,072) ~12 GB: ~85 KB each. 2**22 is ~350 GB.
MAX_LAYER_MICROBATCHES = 1 << 22


def check_size(scenario) -> None:
    """Raise PlanError (one line, naming the keys) when the plan is beyond MAX_GPUS or MAX_LAYER_MICROBATCHES."""
    src, p, t, run = scenario.source, scenario.parallel, scenario.training, scenario.run
    world = p.dp * p.tp * p.pp
    if world > MAX_GPUS:
        raise PlanError(f"{src}: parallel.dp × tp × pp = {p.dp} × {p.tp} × {p.pp} = {world} GPUs: more than memsim "
                        f"simulates (at most {MAX_GPUS:,})")
    nodes = scenario.cluster.nodes
    if isinstance(nodes, int) and nodes > MAX_GPUS:
        raise PlanError(f"{src}: cluster.nodes = {nodes}: more than memsim simulates (at most {MAX_GPUS:,})")
    m = t.global_batch_size // max(1, t.micro_batch_size * p.dp)
    ranks = world if run.full else p.pp
    iterations = run.warmup_iterations + run.iterations
    layers = max(1, -(-scenario.model.num_layers // p.pp))
    size = ranks * m * iterations * layers
    if size > MAX_LAYER_MICROBATCHES:
        full = " (run.full: every rank)" if run.full else ""
        raise PlanError(f"{src}: {m:,} micro-batches per pipeline (training.global_batch_size / (micro_batch_size × "
                        f"parallel.dp)) × {iterations} iterations (run.warmup_iterations + run.iterations) × "
                        f"{ranks:,} simulated ranks{full} × {layers} layers each = {size:,} layer-micro-batches: "
                        f"more than memsim simulates in memory (at most {MAX_LAYER_MICROBATCHES:,}, ~85 KB each)")
