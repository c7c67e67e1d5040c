"""Upper bounds on scenario values: work no user means (a billion micro-batches, a billion nodes) is refused at load."""

from __future__ import annotations

from simulator.errors import ScenarioError
from simulator.scenario.parsers import short_repr

# The engine simulates every micro-batch, iteration and (unreduced) rank, so its cost grows with these counts:
# about 15 ms per micro-batch for a 2-layer model on one core (measured for this bound, 2026-12). Each bound is
# well beyond published training recipes and far below what would run for days. Model sizes are bounded so that
# no tensor size overflows what the allocator model tracks (16 TiB per device).
MAX_MICROBATCHES = 16384     # per iteration and data-parallel rank; GPT-3 175B: 1536 / 8 = 192 (Megatron, 2021)
MAX_GPUS = 1 << 20           # dp x tp x pp; the largest announced clusters have 100,000 to 200,000 GPUs (2024-25)
MAX_NODES = 1 << 17          # cluster.nodes: 131,072 servers (1M GPUs at 8 per node)

# key path -> (largest allowed value, what the largest published models use)
LIMITS: dict[str, tuple[int, str]] = {
    "model.num_layers": (4096, "the deepest published LLMs have about 130 layers"),
    "model.hidden_size": (1 << 20, "published LLMs are at most about 25,000 wide"),
    "model.num_attention_heads": (1 << 16, "published LLMs have at most about 200 heads"),
    "model.num_kv_heads": (1 << 16, "published LLMs have at most about 200 heads"),
    "model.ffn_hidden_size": (1 << 22, "published LLMs have MLPs at most about 100,000 wide"),
    "model.vocab_size": (1 << 24, "published vocabularies have at most about 260,000 tokens"),
    "model.seq_length": (1 << 24, "published context lengths are at most about 10 million tokens"),
    "model.max_position_embeddings": (1 << 24, "published context lengths are at most about 10 million tokens"),
    "model.linformer_k": (1 << 24, "it is below the sequence length"),
    "model.type_vocab_size": (1 << 16, "BERT has 2"),
    "model.image_size": (1 << 16, "a 65536-pixel side"),
    "model.patch_size": (1 << 16, "a 65536-pixel side"),
    "model.num_channels": (1 << 16, "images have 1 to a few hundred (hyperspectral) channels"),
    "model.num_classes": (1 << 24, "the largest label sets have about 20,000 to 1 million classes"),
    "training.micro_batch_size": (1 << 24, "16 million samples in one micro-batch"),
    "training.global_batch_size": (1 << 40, "published recipes use at most a few million samples"),
    "training.vocab_divisible_by": (1 << 16, "Megatron's default is 128"),
    "parallel.tp": (MAX_GPUS, "at most MAX_GPUS in all"),
    "parallel.pp": (MAX_GPUS, "at most MAX_GPUS in all"),
    "parallel.dp": (MAX_GPUS, "at most MAX_GPUS in all"),
    "parallel.virtual_stages": (4096, "a chunk per layer"),
    "cluster.nodes": (MAX_NODES, "1M GPUs at 8 per node"),
    "run.iterations": (1024, "each iteration is simulated"),
    "run.warmup_iterations": (1024, "each iteration is simulated"),
}


def check_limits(source: str, values: dict[str, object]) -> None:
    """Raise ScenarioError naming the key and value if any of `values` (key path -> value) passes its bound."""
    for path, value in values.items():
        bound = LIMITS.get(path)
        if bound is not None and isinstance(value, int) and value > bound[0]:
            raise ScenarioError(f"{source}: {path} = {short_repr(value)}: at most {bound[0]} ({bound[1]}); "
                                f"memsim refuses larger values (simulator/scenario/limits.py)")


def check_work(source: str, microbatches: int, gpus: int) -> None:
    """Raise ScenarioError when one iteration's micro-batches per rank or the plan's GPUs pass their bound."""
    if microbatches > MAX_MICROBATCHES:
        raise ScenarioError(f"{source}: training.global_batch_size / (training.micro_batch_size * parallel.dp) = "
                            f"{short_repr(microbatches)} micro-batches per iteration: at most {MAX_MICROBATCHES} "
                            f"(each is simulated; simulator/scenario/limits.py)")
    if gpus > MAX_GPUS:
        raise ScenarioError(f"{source}: parallel.dp x tp x pp = {short_repr(gpus)} GPUs: at most {MAX_GPUS} "
                            f"(simulator/scenario/limits.py)")
