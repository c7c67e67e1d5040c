"""A tiny GPT as scenario files: on four RTX 4090s (multi-GPU plans through `memsim run`) or one (sweeps)."""

from __future__ import annotations


def tiny_gpt(name: str, layers: int, global_batch: int) -> str:
    """The name, [model] and [training] tables of the tiny GPT (hidden 64, 4 heads, vocab 512, seq 32)."""
    return f"""\
name = "{name}"

[model]
architecture = "gpt"
num_layers = {layers}
hidden_size = 64
num_attention_heads = 4
vocab_size = 512
seq_length = 32
dropout = 0.0

[training]
micro_batch_size = 1
global_batch_size = {global_batch}
precision = "bf16-mixed"
"""


def tiny_gpt_on_4090s(name: str, layers: int, global_batch: int, parallel: str, warmup_iterations: int) -> str:
    """Scenario TOML: GPT (hidden 64, 4 heads, vocab 512, seq 32, no dropout), micro-batch 1, bf16-mixed,
    pcie-4x4090, one measured iteration; `parallel` is the body of the [parallel] section."""
    return tiny_gpt(name, layers, global_batch) + f"""

[parallel]
{parallel.strip()}

[cluster]
topology = "pcie-4x4090"

[run]
warmup_iterations = {warmup_iterations}
iterations = 1
"""


def tiny_gpt_on_one_4090(name: str, sweep: str = "") -> str:
    """Scenario TOML: a two-layer GPT (hidden 64, 4 heads, vocab 512, seq 32) on one RTX 4090, global batch 4, no
    warm-up; `sweep` is appended (e.g. a [sweep.grid] table). A point simulates in about 0.1 s."""
    return tiny_gpt(name, 2, 4) + f"""
[cluster]
topology = "rtx-4090"

[run]
warmup_iterations = 0
{sweep}"""
