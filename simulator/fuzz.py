"""Mutations of scenario documents for fuzzing: wrong types, unknown keys, bad numbers and units, odd plans."""

from __future__ import annotations

import copy
import math
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path

from simulator.scenario.schema import SECTION_KEYS, SECTIONS

ROOT = Path(__file__).resolve().parents[1]

_WRONG_TYPES = ("x", "", [1, 2], {"a": 1}, True, 1.5, [], "\0", "9" * 5000)
_NUMBERS = (0, -1, -(2**63), 1, 2, 3, 5, 7, 10**12, 2**31, 2**63 - 1, 2**63, 10**30, 10**400, 1e308, -0.0,
            math.nan, math.inf, -math.inf, 0.5, 1e-300)
_UNITS = ("25 XB", "1e400 GB", "-3 MB", "GB", "1..5 MB", "\u0663 MB", "25MB", "nan GB", "inf GiB", "0 B",
          "80 GiB", "1 B", "25 MiB ", " 1 KB", "10 GB/s", "unlimited", "auto", "none")
_CHOICES = {  # values that are right somewhere, so that documents get deep into the engine
    "training.precision": ("fp32", "fp16-mixed", "bf16-mixed", "bf16", "fp8-mixed"),
    "training.framework": ("torch", "megatron", "deepspeed"),
    "training.optimizer": ("adamw", "sgd", "adam8bit", "sgd-momentum", "adafactor"),
    "training.recompute": ("none", "full", "selective", "segments:2", "segments:0", "segments:x"),
    "training.loss_scale": ("dynamic", 1024.0, 0.0, -1.0),
    "training.skipped_steps_fraction": (0.0, 0.5, 0.99),
    "training.activation_compression": ("none", "int8"),
    "training.cuda_graphs": (True, False),
    "parallel.zero_stage": (0, 1, 2, 3, 4),
    "parallel.schedule": ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "missing.txt"),
    "parallel.virtual_stages": (1, 2, 3),
    "parallel.sequence_parallel": (True, False),
    "parallel.gradient_compression": ("none", "1bit", "int8", "topk:0.01", "topk:nan", "powersgd:4", "powersgd:0"),
    "parallel.offload_optimizer": ("none", "cpu", "nvme"),
    "parallel.offload_params": ("none", "cpu", "nvme"),
    "parallel.offload_activations": ("none", "cpu", "nvme"),
    "parallel.tp_comm_overlap": ("auto", True, False),
    "parallel.overlap_grad_reduce": ("auto", True, False),
    "parallel.overlap_p2p_comm": ("auto", True, False),
    "cluster.topology": ("rtx-4090", "a100-80gb", "h100-sxm", "cpu", "pcie-4x4090", "dgx-a100", "dgx-h100",
                         "hgx-h200", "workstation-rtx4090", "nope", "x.toml"),
    "allocator.kind": ("auto", "caching", "exact"),
    "allocator.expandable_segments": (True, False),
    "allocator.memory_fraction": (1.0, 0.5, 0.01, 0.0, 1.5),
    "model.attention": ("flash", "eager", "linformer"),
    "model.preset": ("gpt2", "llama-7b", "bert-large", "vit-large", "gpt3-175b", "nope"),
    "model.architecture": ("gpt", "llama", "bert", "vit", "mamba"),
}
_DIVIDING = ("parallel.tp", "parallel.pp", "parallel.dp", "training.micro_batch_size", "training.global_batch_size",
             "model.num_attention_heads", "model.num_kv_heads", "model.hidden_size", "model.num_layers")
KINDS = ("wrong type", "unknown key", "misspelled key", "zero", "negative", "huge", "nan or inf", "malformed unit",
         "non-dividing plan", "absurd nodes", "deleted key", "section not a table", "plausible value")


@dataclass(frozen=True)
class Mutant:
    """A mutated scenario document and what was done to it."""

    source: str                  # the repository scenario it came from
    doc: dict
    changes: tuple[str, ...]


def repository_scenarios() -> dict[str, dict]:
    """Every scenarios/**/*.toml of the repository, parsed (path relative to the repository -> document)."""
    found = {}
    for path in sorted((ROOT / "scenarios").rglob("*.toml")):
        found[str(path.relative_to(ROOT))] = tomllib.loads(path.read_text(encoding="utf-8"))
    return found


def shrink(doc: dict) -> dict:
    """The document with at most 4 layers (a multiple of the stages) and 4 micro-batches per iteration, so that a
    valid mutant simulates in about a second: the engine's cost grows with layers and micro-batches, not sizes."""
    doc = copy.deepcopy(doc)
    parallel = doc.get("parallel", {})
    stages = int(parallel.get("pp", 1)) * int(parallel.get("virtual_stages", 1))
    model = doc.setdefault("model", {})
    model["num_layers"] = max(stages, min(4, int(model.get("num_layers", 4))) // stages * stages)
    training = doc.setdefault("training", {})
    micro = int(training.get("micro_batch_size", 1))
    dp = int(parallel.get("dp", 1))
    training["global_batch_size"] = micro * dp * max(1, min(4, int(training.get("global_batch_size", micro * dp))
                                                            // (micro * dp)))
    run = doc.setdefault("run", {})
    run["warmup_iterations"] = min(int(run.get("warmup_iterations", 1)), 1)
    run["iterations"] = 1
    return doc


def _key(rng: random.Random, doc: dict) -> tuple[str, str]:
    """A (section, key) of the schema, present in the document more often than not."""
    present = [(s, k) for s in SECTIONS if isinstance(doc.get(s), dict) for k in doc[s]]
    if present and rng.random() < 0.6:
        return rng.choice(present)
    section = rng.choice(SECTIONS)
    return section, rng.choice([spec.key for spec in SECTION_KEYS[section]])


def _misspell(rng: random.Random, word: str) -> str:
    if len(word) < 2:
        return word + "x"
    i = rng.randrange(len(word) - 1)
    how = rng.randrange(3)
    if how == 0:
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]       # swap two letters
    if how == 1:
        return word[:i] + word[i + 1:]                               # drop one
    return word[:i] + word[i].upper() + word[i + 1:]                 # case


def _set(doc: dict, section: str, key: str, value: object) -> None:
    table = doc.get(section)
    if not isinstance(table, dict):
        table = doc[section] = {}
    table[key] = value


def mutate_once(rng: random.Random, doc: dict, kind: str | None = None) -> str:
    """Apply one random mutation (of `kind`, else any of KINDS) to `doc` in place; returns "kind: what it did"."""
    kind = kind or rng.choice(KINDS)
    section, key = _key(rng, doc)
    path = f"{section}.{key}"
    if kind == "wrong type":
        value = rng.choice(_WRONG_TYPES)
    elif kind == "unknown key":
        key, value = rng.choice(("bogus", "x", "", "model", "0", "\u00e9")), rng.choice((1, "x"))
    elif kind == "misspelled key":
        table = doc.get(section) if isinstance(doc.get(section), dict) else {}
        value = table.pop(key, 1)
        key = _misspell(rng, key)
    elif kind == "zero":
        value = rng.choice((0, 0.0, "0", "0 B"))
    elif kind == "negative":
        value = rng.choice((-1, -0.5, -(10**9), "-1 GB"))
    elif kind == "huge":
        value = rng.choice((10**9, 10**12, 2**62, 2**63, 10**30, 1e308, "1e30 GB"))
    elif kind == "nan or inf":
        value = rng.choice((math.nan, math.inf, -math.inf, "nan", "inf"))
    elif kind == "malformed unit":
        value = rng.choice(_UNITS)
    elif kind == "non-dividing plan":
        path = rng.choice(_DIVIDING)
        section, key = path.split(".")
        value = rng.choice((3, 5, 6, 7, 9, 11, 12, 15, 24, 33, 96, 100))
    elif kind == "absurd nodes":
        section, key, value = "cluster", "nodes", rng.choice((0, 3, 64, 10**4, 10**6, 10**9, 2**31, 2**63 - 1))
    elif kind == "deleted key":
        table = doc.get(section)
        if isinstance(table, dict) and key in table:
            del table[key]
        elif rng.random() < 0.3 and section in doc:
            del doc[section]
        return f"{kind}: {path}"
    elif kind == "section not a table":
        doc[section] = rng.choice(("x", 1, [1], True))
        return f"{kind}: {section} = {doc[section]!r}"
    else:
        path = rng.choice(sorted(_CHOICES))
        section, key = path.split(".")
        value = rng.choice(_CHOICES[path])
    _set(doc, section, key, value)
    text = repr(value) if not (isinstance(value, str) and len(value) > 40) else f"'{value[:10]}...'"
    return f"{kind}: {section}.{key} = {text}"


def mutant(rng: random.Random, scenarios: dict[str, dict], small: bool = True) -> Mutant:
    """A repository scenario (shrunk with `small`) with one to three random mutations; two documents in five get
    only plausible values (other precisions, ZeRO stages, schedules, topologies...), to reach the engine."""
    source = rng.choice(sorted(scenarios))
    doc = shrink(scenarios[source]) if small else copy.deepcopy(scenarios[source])
    kind = "plausible value" if rng.random() < 0.4 else None
    changes = tuple(mutate_once(rng, doc, kind) for _ in range(rng.randint(1, 3)))
    return Mutant(source, doc, changes)
