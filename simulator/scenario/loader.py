"""Scenario loading: read TOML, apply --set overrides, resolve every section into a frozen Scenario."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from typing import Mapping, Sequence

from simulator.errors import ScenarioError
from simulator.scenario import schema
from simulator.scenario.cnn_model import resolve_resnet
from simulator.scenario.dlrm_model import resolve_dlrm
from simulator.scenario.hf_config import model_config_from_hf
from simulator.scenario.limits import check_limits, check_work
from simulator.scenario.presets import ALIASES, PRESETS, canonical_preset_name, list_presets, preset_values
from simulator.scenario.schema import (
    ARCH_DEFAULTS, ARCH_ONLY_KEYS, SECTION_KEYS, SECTIONS, AllocatorConfig, ClusterConfig, Invalid, ModelConfig,
    ParallelConfig, RunConfig, Scenario, SweepConfig, TrainingConfig, did_you_mean, key_names, key_spec, short_repr,
)


@dataclass(frozen=True)
class _Context:
    source: str     # shown first in every message
    base_dir: str   # relative paths in the scenario are relative to this folder ("" = cwd)


def _context(source: str) -> _Context:
    base = "" if source.startswith("<") else os.path.dirname(source)
    return _Context(source, base)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def key_error(source: str, key_path: str, value: object, allowed: str) -> ScenarioError:
    """The one-line ScenarioError `<source>: <key.path> = <value!r>: <what is allowed>`."""
    return ScenarioError(_one_line(f"{source}: {key_path} = {short_repr(value)}: {allowed}"))


def read_scenario_document(path: str | os.PathLike) -> dict:
    """Read a scenario TOML file into a plain dict (no validation).

    Raises:
        ScenarioError: the file cannot be read, is not UTF-8, or is not valid TOML.
    """
    try:
        source = os.fspath(path)
    except TypeError:
        raise ScenarioError(f"{path!r}: not a path to a scenario file") from None
    try:
        with open(source, "rb") as handle:
            data = handle.read()
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ScenarioError(_one_line(f"{source}: cannot read scenario file: {reason}")) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ScenarioError(_one_line(f"{source}: scenario file is not UTF-8 text: {exc}")) from None
    try:
        return tomllib.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ScenarioError(_one_line(f"{source}: invalid TOML: {exc}")) from None


def parse_override_value(text: str) -> object:
    """The value of a `--set` item: a TOML value (4, 0.1, true, "x", [1, 2]) or else the bare string."""
    stripped = text.strip()
    if "\n" in stripped or "\r" in stripped:
        return stripped
    try:
        return tomllib.loads(f"v = {stripped}")["v"]
    except (ValueError, RecursionError):
        return stripped


def _known_key_paths() -> list[str]:
    known = [f"{section}.{key}" for section in SECTIONS for key in key_names(section)]
    return known + [key for key in key_names(None) if key not in SECTIONS]


def _override_target(item: str, key_path: str, source: str) -> tuple[str | None, str]:
    parts = [part.strip() for part in key_path.split(".")]
    if len(parts) == 1 and parts[0] in key_names(None) and parts[0] not in SECTIONS:
        return None, parts[0]
    if len(parts) == 2 and parts[0] in SECTIONS and parts[1] in key_names(parts[0]):
        return parts[0], parts[1]
    hint = did_you_mean(key_path.strip(), _known_key_paths()) or " (expected section.key, e.g. parallel.tp)"
    raise ScenarioError(_one_line(f"{source}: --set {short_repr(item)}: unknown key path {key_path.strip()!r}{hint}"))


def grid_axis(key_path: str, values: Sequence, source: str, where: str) -> tuple[str, tuple]:
    """Check one sweep axis: a section.key a scenario has (not in [sweep]) and values that key accepts.

    Args:
        key_path: "section.key", e.g. "parallel.tp".
        values: the axis's values as TOML values (4, "dgx-a100", true).
        source: the scenario file, shown first in messages.
        where: what the user wrote, shown second ("--grid parallel.tp=1,2" or "sweep.grid").

    Returns:
        (key_path, values) with surrounding spaces removed from the key path.

    Raises:
        ScenarioError: `<source>: <where>: <key path> = <value>: <what is allowed>`.
    """
    path = key_path.strip()
    section, _, key = path.partition(".")
    if section not in SECTIONS or section == "sweep" or key not in key_names(section):
        sweepable = [known for known in _known_key_paths() if "." in known and not known.startswith("sweep.")]
        hint = did_you_mean(path, sweepable) or " (expected section.key, e.g. parallel.tp)"
        raise ScenarioError(_one_line(f"{source}: {where}: unknown key path {path!r}{hint}"))
    if not values:
        raise ScenarioError(f"{source}: {where}: {path} has no values (give them as {path}=A,B,...)")
    spec = key_spec(section, key)
    for position, value in enumerate(values):
        try:
            spec.parse(value)
        except Invalid as exc:
            raise ScenarioError(_one_line(f"{source}: {where}: {path} = {short_repr(value)}: {exc}")) from None
        if any(type(earlier) is type(value) and earlier == value for earlier in values[:position]):
            raise ScenarioError(_one_line(f"{source}: {where}: {path} = {short_repr(value)} is given twice"))
    return path, tuple(values)


def apply_overrides(doc: Mapping, overrides: Sequence[str], source: str = "<dict>") -> dict:
    """A copy of `doc` with each "section.key=value" override applied in order.

    Raises:
        ScenarioError: an override without '=', with an unknown key path, or into a non-table section.
    """
    result = _copy_tables(doc)
    if overrides is None:
        overrides = ()
    if isinstance(overrides, str):
        overrides = (overrides,)
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ScenarioError(_one_line(f"{source}: --set {short_repr(item)}: expected KEY=VALUE, e.g. parallel.tp=4"))
        key_path, _, text = item.partition("=")
        section, key = _override_target(item, key_path, source)
        value = parse_override_value(text)
        if section is None:
            result[key] = value
            continue
        table = result.get(section)
        if table is None:
            table = result[section] = {}
        if not isinstance(table, dict):
            raise key_error(source, section, table, f"must be a table to take --set {item!r}")
        lora = table.get("lora") if section == "training" and key.startswith("lora_") else None
        if isinstance(lora, dict):
            lora.pop(key[len("lora_"):], None)   # --set training.lora_rank replaces [training.lora] rank
        table[key] = value
    return result


def _copy_tables(doc: Mapping) -> dict:
    return {key: _copy_tables(value) if isinstance(value, Mapping) else value for key, value in doc.items()}


def load_scenario(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Scenario:
    """Load, override, resolve and validate a scenario TOML file.

    Args:
        path: the scenario file; relative paths inside it are relative to its folder.
        overrides: "section.key=value" strings applied after reading (value parsed as TOML,
            falling back to a bare string), e.g. "parallel.tp=4", "cluster.topology=h100-sxm".

    Raises:
        ScenarioError: with a one-line message naming the file, key path, value and rule.
    """
    doc = read_scenario_document(path)
    return scenario_from_dict(doc, source=os.fspath(path), overrides=overrides)


def scenario_from_dict(doc: dict, source: str = "<dict>", overrides: Sequence[str] = ()) -> Scenario:
    """Resolve and validate a scenario given as a dict shaped like the TOML file.

    Args:
        doc: {"name": ..., "model": {...}, "training": {...}, ...}.
        source: shown in messages; when it is a file path, relative paths resolve against its folder.
        overrides: as for load_scenario.

    Raises:
        ScenarioError: with a one-line message naming the source, key path, value and rule.
    """
    source = str(source)
    ctx = _context(source)
    if not isinstance(doc, Mapping):
        raise key_error(source, "<document>", doc, "a scenario must be a table of sections")
    doc = apply_overrides(doc, overrides, source)
    top = _parse_table(doc, None, ctx)
    tables = {section: _section_table(doc, section, ctx) for section in SECTIONS}
    if "model" not in doc:
        raise ScenarioError(f"{source}: [model] is missing: give model.preset, model.hf_config or the model's fields")
    model = _resolve_model(tables["model"], ctx)
    parallel = _resolve_parallel(tables["parallel"], model, ctx)
    training = _resolve_training(tables["training"], parallel, ctx)
    cluster = _resolve_cluster(tables["cluster"], ctx)
    allocator = AllocatorConfig(**_with_defaults(_parse_table(tables["allocator"], "allocator", ctx), "allocator"))
    run = RunConfig(**_with_defaults(_parse_table(tables["run"], "run", ctx), "run"))
    sweep = _resolve_sweep(tables["sweep"], ctx)
    _check_limits(source, model, training, parallel, cluster, run)
    name = top.get("name", _default_name(source))
    return Scenario(name=name, source=source, model=model, training=training, parallel=parallel,
                    cluster=cluster, allocator=allocator, run=run, description=top.get("description", ""),
                    sweep=sweep)


def _check_limits(source: str, *configs) -> None:
    """Every bounded key of the resolved sections (presets and hf_config included), then the work it implies."""
    values = {}
    for section, config in zip(("model", "training", "parallel", "cluster", "run"), configs):
        values.update({f"{section}.{spec.key}": getattr(config, spec.key, None) for spec in SECTION_KEYS[section]})
    check_limits(source, values)
    training, parallel = configs[1], configs[2]
    check_work(source, training.gradient_accumulation_steps, parallel.dp * parallel.tp * parallel.pp)


def _default_name(source: str) -> str:
    if source.startswith("<"):
        return "scenario"
    stem = os.path.splitext(os.path.basename(source))[0]
    return stem or "scenario"


def _section_table(doc: Mapping, section: str, ctx: _Context) -> Mapping:
    table = doc.get(section, {})
    if not isinstance(table, Mapping):
        raise key_error(ctx.source, section, table, f"must be a table ([{section}])")
    return table


def _parse_table(table: Mapping, section: str | None, ctx: _Context) -> dict[str, object]:
    """Check every key of `table` is known and parse its value; returns only the keys present."""
    prefix = "" if section is None else f"{section}."
    allowed = key_names(section)
    parsed: dict[str, object] = {}
    for key, value in table.items():
        if not isinstance(key, str):
            raise key_error(ctx.source, f"{prefix}{short_repr(key)}", value, "keys must be strings")
        if key not in allowed:
            where = "at the top level" if section is None else f"in [{section}]"
            hint = did_you_mean(key, allowed) or f" (allowed: {', '.join(allowed)})"
            raise key_error(ctx.source, prefix + key, value, f"unknown key {where}{hint}")
        if section is None and key in SECTIONS:
            continue
        spec = key_spec(section, key)
        try:
            parsed[key] = spec.parse(value)
        except Invalid as exc:
            raise key_error(ctx.source, prefix + key, value, str(exc)) from None
    return parsed


def _with_defaults(parsed: Mapping[str, object], section: str) -> dict[str, object]:
    return {spec.key: parsed.get(spec.key, spec.default) for spec in schema.SECTION_KEYS[section]}


def _resolve_path(path: str, ctx: _Context) -> str:
    path = os.path.expanduser(path)
    if os.path.isabs(path) or not ctx.base_dir:
        return os.path.normpath(path)
    return os.path.normpath(os.path.join(ctx.base_dir, path))


def _resolve_parallel(table: Mapping, model: ModelConfig, ctx: _Context) -> ParallelConfig:
    values = _with_defaults(_parse_table(table, "parallel", ctx), "parallel")
    src = ctx.source
    for key in ("tp", "pp"):
        if model.architecture in ("resnet", "dlrm") and values[key] != 1:
            raise key_error(src, f"parallel.{key}", values[key], f"a {model.architecture} is simulated with data "
                            f"parallelism only (model.architecture = {model.architecture!r}); allowed: 1")
    for heads_key in ("num_attention_heads", "num_kv_heads"):
        heads = getattr(model, heads_key)
        if heads % values["tp"]:
            raise key_error(src, "parallel.tp", values["tp"], f"must divide model.{heads_key} = {heads}")
    if values["pp"] > model.num_layers:
        raise key_error(src, "parallel.pp", values["pp"], f"must be at most model.num_layers = {model.num_layers}")
    chunks = values["pp"] * values["virtual_stages"]
    if values["virtual_stages"] > 1 and model.num_layers % chunks:
        raise key_error(src, "parallel.virtual_stages", values["virtual_stages"],
                        f"must divide model.num_layers / parallel.pp = {model.num_layers} / {values['pp']}")
    if schema.is_schedule_file(values["schedule"]):
        values["schedule"] = _resolve_path(values["schedule"], ctx)
    return ParallelConfig(**values)


MEGATRON_VOCAB_DIVISOR = 128      # Megatron-LM's --make-vocab-size-divisible-by default


LORA_TABLE_KEYS = ("rank", "alpha", "target_modules", "dropout")


def _flatten_lora(table: Mapping, ctx: _Context) -> Mapping:
    """[training.lora] rank = ... as the flat training.lora_rank = ... keys (one way or the other, not both)."""
    sub = table.get("lora")
    if sub is None:
        return table
    if not isinstance(sub, Mapping):
        raise key_error(ctx.source, "training.lora", sub, "must be a table ([training.lora]) of rank, alpha, "
                        "target_modules, dropout")
    flat = {k: v for k, v in table.items() if k != "lora"}
    for key, value in sub.items():
        if key not in LORA_TABLE_KEYS:
            hint = did_you_mean(key, LORA_TABLE_KEYS) or f" (allowed: {', '.join(LORA_TABLE_KEYS)})"
            raise key_error(ctx.source, f"training.lora.{key}", value, f"unknown key in [training.lora]{hint}")
        if f"lora_{key}" in flat:
            raise key_error(ctx.source, f"training.lora.{key}", value, f"given twice: also as training.lora_{key}")
        flat[f"lora_{key}"] = value
    return flat


def _resolve_training(table: Mapping, parallel: ParallelConfig, ctx: _Context) -> TrainingConfig:
    parsed = _parse_table(_flatten_lora(table, ctx), "training", ctx)
    unused = sorted(k for k in parsed if k.startswith("lora_"))
    if unused and parsed.get("peft", "none") == "none":
        raise key_error(ctx.source, f"training.{unused[0]}", parsed[unused[0]],
                        "has no effect with training.peft = 'none'; set training.peft = 'lora' or 'qlora'")
    values = _with_defaults(parsed, "training")
    per_step = values["micro_batch_size"] * parallel.dp
    if values["global_batch_size"] is None:
        values["global_batch_size"] = per_step
    elif values["global_batch_size"] % per_step:
        raise key_error(ctx.source, "training.global_batch_size", values["global_batch_size"],
                        f"must be a multiple of training.micro_batch_size * parallel.dp = "
                        f"{values['micro_batch_size']} * {parallel.dp} = {per_step}")
    if values["vocab_divisible_by"] is None:
        values["vocab_divisible_by"] = MEGATRON_VOCAB_DIVISOR if values["framework"] == "megatron" else 1
    return TrainingConfig(**values, data_parallel_size=parallel.dp)


def _resolve_cluster(table: Mapping, ctx: _Context) -> ClusterConfig:
    values = _with_defaults(_parse_table(table, "cluster", ctx), "cluster")
    if schema.topology_is_path(values["topology"]):
        values["topology"] = _resolve_path(values["topology"], ctx)
    if values["calibration"] is not None:
        values["calibration"] = _resolve_path(values["calibration"], ctx)
    return ClusterConfig(**values)


def _resolve_sweep(table: Mapping, ctx: _Context) -> SweepConfig:
    values = _with_defaults(_parse_table(table, "sweep", ctx), "sweep")
    axes = [grid_axis(path, axis, ctx.source, "sweep.grid") for path, axis in values["grid"]]
    paths = [path for path, _ in axes]
    for position, path in enumerate(paths):
        if path in paths[:position]:
            raise ScenarioError(f"{ctx.source}: sweep.grid: {path} is given twice")
    values["grid"] = tuple(axes)
    if values["prices"] is not None:
        values["prices"] = _resolve_path(values["prices"], ctx)
    return SweepConfig(**values)


def resolve_model_config(values: Mapping, source: str = "<dict>") -> ModelConfig:
    """Resolve a [model] table (preset / hf_config first, explicit keys override, then defaults).

    Raises:
        ScenarioError: as scenario_from_dict would for the same [model] table.
    """
    if not isinstance(values, Mapping):
        raise key_error(str(source), "model", values, "must be a table ([model])")
    return _resolve_model(values, _context(str(source)))


def _base_values(explicit: dict[str, object], ctx: _Context) -> tuple[dict[str, object], str]:
    """The preset's or the hf_config's values (parsed) and a label saying where they come from."""
    preset, hf = explicit.get("preset"), explicit.get("hf_config")
    if preset is not None and hf is not None:
        raise key_error(ctx.source, "model.hf_config", hf, "give model.preset or model.hf_config, not both")
    if preset is not None:
        canonical = canonical_preset_name(preset)
        if canonical is None:
            names = list_presets(include_aliases=True)
            raise key_error(ctx.source, "model.preset", preset,
                            f"unknown preset{did_you_mean(preset, names)} (presets: {', '.join(names)})")
        explicit["preset"] = canonical
        base, origin = preset_values(canonical), f"preset {canonical!r}"
    elif hf is not None:
        path = _resolve_path(hf, ctx)
        try:
            base = model_config_from_hf(path)
        except ScenarioError as exc:
            raise key_error(ctx.source, "model.hf_config", hf, str(exc)) from None
        explicit["hf_config"] = path
        origin = f"hf_config {path!r}"
    else:
        return {}, ""
    parsed = {}
    for key, value in base.items():
        try:
            parsed[key] = key_spec("model", key).parse(value)
        except Invalid as exc:
            raise key_error(ctx.source, f"model.{key}", value, f"{exc} (from {origin})") from None
    return parsed, origin


def _resolve_model(table: Mapping, ctx: _Context) -> ModelConfig:
    explicit = _parse_table(table, "model", ctx)
    base, origin = _base_values(explicit, ctx)
    values = {**base, **explicit}
    src = ctx.source

    def fail(key: str, rule: str) -> ScenarioError:
        where = "" if key in explicit or not origin else f" (from {origin})"
        return key_error(src, f"model.{key}", values.get(key), rule + where)

    arch = values.get("architecture")
    if arch is None:
        raise ScenarioError(f"{src}: model.architecture is missing: one of {', '.join(schema.ARCHITECTURES)} "
                            "is required (or give model.preset / model.hf_config)")
    for key, only in ARCH_ONLY_KEYS.items():
        allowed = (only,) if isinstance(only, str) else only
        if key in values and arch not in allowed:
            if key in explicit:
                names = " or ".join(repr(a) for a in allowed)
                raise fail(key, f"applies only to architecture {names} (model.architecture = {arch!r})")
            del values[key]
    if arch == "resnet":
        return ModelConfig(**resolve_resnet(values, explicit, fail))
    if arch == "dlrm":
        return ModelConfig(**resolve_dlrm(values, explicit, fail))
    required = ("num_layers", "hidden_size", "num_attention_heads")
    if arch == "vit":
        for key in ("vocab_size", "seq_length", "max_position_embeddings"):
            if key in values and key not in explicit:
                del values[key]
        if "vocab_size" in explicit:
            raise fail("vocab_size", "vit has no token vocabulary; remove the key")
        if explicit.get("tied_embeddings") is True:
            raise fail("tied_embeddings", "vit has no token embedding to tie; must be false")
    else:
        required += ("vocab_size",)
        if "seq_length" not in values and "max_position_embeddings" in values:
            values["seq_length"] = values["max_position_embeddings"]
        required += ("seq_length",)
    for key in required:
        if key not in values:
            raise ScenarioError(f"{src}: model.{key} is missing: a positive integer is required "
                                "(or give model.preset / model.hf_config)")
    for key, default in ARCH_DEFAULTS[arch].items():
        values.setdefault(key, default)
    values.setdefault("attention", "flash")
    values.setdefault("num_kv_heads", values["num_attention_heads"])
    values.setdefault("ffn_hidden_size", _default_ffn(arch, values["hidden_size"]))
    if values["hidden_size"] % values["num_attention_heads"]:
        raise fail("hidden_size", f"must be divisible by model.num_attention_heads = {values['num_attention_heads']}")
    if values["num_attention_heads"] % values["num_kv_heads"]:
        raise fail("num_kv_heads", f"must divide model.num_attention_heads = {values['num_attention_heads']}")
    if values["attention"] == "linformer" and arch not in ("bert", "vit"):
        raise fail("attention", f"'linformer' projects keys and values along the whole sequence, so it has no "
                                f"causal form: allowed with architecture bert or vit (is {arch!r})")
    if values["attention"] != "linformer" and values.get("linformer_k") is not None:
        raise fail("linformer_k", "applies only to model.attention = 'linformer'")
    if values["attention"] == "linformer" and values.get("linformer_k") is None:
        raise ScenarioError(f"{src}: model.linformer_k is missing: model.attention = 'linformer' needs the "
                            f"projected length (an integer below the sequence length)")
    if arch == "vit":
        _resolve_vit_lengths(values, explicit, fail)
    else:
        values.setdefault("max_position_embeddings", values["seq_length"])
        if arch in ("gpt", "bert") and values["seq_length"] > values["max_position_embeddings"]:
            raise fail("seq_length", f"must be at most model.max_position_embeddings = "
                       f"{values['max_position_embeddings']} ({arch} has learned positions)")
    if values.get("linformer_k") is not None and values["linformer_k"] >= values["seq_length"]:
        raise fail("linformer_k", f"must be less than the sequence length = {values['seq_length']} (else nothing "
                                  f"is compressed)")
    return ModelConfig(**values)


def _resolve_vit_lengths(values: dict[str, object], explicit: Mapping[str, object], fail) -> None:
    if values["image_size"] % values["patch_size"]:
        raise fail("image_size", f"must be divisible by model.patch_size = {values['patch_size']}")
    derived = (values["image_size"] // values["patch_size"]) ** 2 + 1
    for key in ("seq_length", "max_position_embeddings"):
        if key in explicit and explicit[key] != derived:
            raise fail(key, f"vit derives it as (image_size / patch_size)^2 + 1 = {derived}; "
                       "remove the key or match it")
        values[key] = derived
    values["vocab_size"] = 0


def _default_ffn(arch: str, hidden_size: int) -> int:
    """gpt/bert/vit: 4h; llama: 2/3 of 4h rounded up to a multiple of 256 (LLaMA's multiple_of)."""
    if arch != "llama":
        return 4 * hidden_size
    inner = 2 * (4 * hidden_size) // 3
    return 256 * ((inner + 255) // 256)


_INTRO = """# Scenario file reference

<!-- Generated by simulator.scenario.loader.reference_markdown() from the key tables in
     simulator/scenario/schema.py; tests/test_scenario_loading.py checks that this file matches. Regenerate:
     python -c "from simulator.scenario.loader import reference_markdown as r; print(r(), end='')" >FILE -->

A scenario is a TOML file with a top-level `name` and the sections `[model] [training] [parallel]
[cluster] [allocator] [run]` (and `[sweep]` for `memsim sweep` / `compare`). Only `[model]` is required; every other key has the default below.
Unknown keys are errors with a "did you mean" hint. Sizes accept a number of bytes or a string with a
unit (`"25 MB"`, `"2 GiB"`). Relative paths (`model.hf_config`, `parallel.schedule` files,
`cluster.topology` files, `cluster.calibration`) are relative to the scenario file's folder.

Any key can be overridden: `memsim run x.toml --set parallel.tp=4 --set cluster.topology=h100-sxm`.
The value is parsed as a TOML value (`4`, `0.1`, `true`, `"x"`), else taken as a bare string.

Errors are one line: `<file>: <key.path> = <value>: <what is allowed>`, e.g.
`scenarios/x.toml: parallel.tp = 3: must divide model.num_attention_heads = 32`.
"""

_MODEL_NOTES = """
`[model]` resolves in this order: the values of `preset` or `hf_config` (not both), then the explicit
keys, then the architecture's defaults. Keys that only one architecture uses (`rope_theta`: llama;
`type_vocab_size`: bert; `image_size`, `patch_size`, `num_channels`, `num_classes`: vit) are an error
for another architecture when written explicitly, and dropped when they came from a preset. Checks:
`hidden_size % num_attention_heads == 0`, `num_attention_heads % num_kv_heads == 0`, gpt/bert need
`seq_length <= max_position_embeddings`, vit needs `image_size % patch_size == 0` and derives
`seq_length` = `max_position_embeddings` = (image_size / patch_size)^2 + 1 (an explicit different value
is an error; vit has `vocab_size` 0 and no tied embeddings). A `resnet` reads only `resnet_blocks`,
`resnet_block`, `image_size`, `num_channels` and `num_classes` (any transformer key is an error); its
`num_layers` is the number of residual blocks and its `seq_length` is 1, so `tokens_per_s` counts images
(docs/model-options.md). A `dlrm` reads only its `embedding_*`, `lookups_per_table`, `dense_features`,
`bottom_mlp` and `top_mlp` keys; `tokens_per_s` counts samples.
"""

_CROSS_NOTES = {
    "training": "`gradient_accumulation_steps` = global_batch_size / (micro_batch_size * parallel.dp).\n",
    "parallel": ("Checks here: `tp` divides `model.num_attention_heads` and `model.num_kv_heads`; `pp <= "
                 "model.num_layers`; `virtual_stages` > 1 divides `model.num_layers / pp`. Whether the engine "
                 "supports a plan (and whether the cluster has `tp * pp * dp` devices) is checked elsewhere.\n"),
    "sweep": ("`memsim run` checks this table and otherwise ignores it; `memsim sweep` and `memsim compare` read it "
              "(their options override it). Axes are written like `--grid` items: `[sweep.grid]` then "
              "`parallel.tp = [1, 2, 4]` and `cluster.topology = [\"dgx-a100\", \"dgx-h100\"]`. Each key path must be "
              "a scenario key and each value one its key accepts; cross-key rules (tp divides the heads, the plan "
              "fills the cluster) are checked per point, and a point that breaks one is listed with the reason.\n"),
}

_HF_NOTES = """
## Hugging Face import (`model.hf_config`)

`model_type` llama, gpt2, bert and vit are read; missing keys take the transformers class defaults.
`seq_length` defaults to `max_position_embeddings`.

| model_type | config.json key -> memsim key |
|---|---|
| llama | num_hidden_layers -> num_layers, hidden_size, num_attention_heads, num_key_value_heads -> num_kv_heads, intermediate_size -> ffn_hidden_size, vocab_size, max_position_embeddings, rms_norm_eps -> norm_eps, rope_theta, tie_word_embeddings -> tied_embeddings |
| gpt2 | n_layer, n_embd, n_head, n_inner (null: 4h) -> ffn_hidden_size, vocab_size, n_positions -> max_position_embeddings, resid_pdrop -> dropout, layer_norm_epsilon -> norm_eps, tie_word_embeddings |
| bert | num_hidden_layers, hidden_size, num_attention_heads, intermediate_size, vocab_size, max_position_embeddings, type_vocab_size, hidden_dropout_prob -> dropout, layer_norm_eps -> norm_eps |
| vit | num_hidden_layers, hidden_size, num_attention_heads, intermediate_size, image_size, patch_size, num_channels, hidden_dropout_prob -> dropout, layer_norm_eps -> norm_eps; num_classes = len(id2label) (else num_labels, else 1000) |
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("*", "\\*")


def _table(specs: Sequence[schema.KeySpec]) -> list[str]:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for spec in specs:
        cells = (f"`{spec.key}`", spec.type_doc, spec.default_doc, spec.doc)
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return lines


def reference_markdown() -> str:
    """The text of docs/scenario-reference.md, generated from the key tables and the presets."""
    lines = [_INTRO, "## Top level", "", *_table(schema.TOP_LEVEL_KEYS), ""]
    for section in SECTIONS:
        lines += [f"## [{section}]", "", *_table(schema.SECTION_KEYS[section]), ""]
        if section == "model":
            lines += [_MODEL_NOTES.strip(), "", "Architecture defaults:", "",
                      "| architecture | " + " | ".join(ARCH_DEFAULTS["gpt"]) + " |",
                      "|---" * (len(ARCH_DEFAULTS["gpt"]) + 1) + "|"]
            for arch in schema.TRANSFORMERS:
                cells = " | ".join(schema.toml_text(ARCH_DEFAULTS[arch][key]) for key in ARCH_DEFAULTS["gpt"])
                lines.append(f"| {arch} | {cells} |")
            lines.append("")
        elif section in _CROSS_NOTES:
            lines.append(_CROSS_NOTES[section])
    lines += ["## Presets (`model.preset`)", "", "| name | values | source |", "|---|---|---|"]
    for preset in PRESETS:
        shown = ", ".join(f"{key}={value}" for key, value in preset.values)
        lines.append(f"| `{preset.name}` | {shown} | {preset.source} |")
    aliases = ", ".join(f"`{alias}` = `{target}`" for alias, target in ALIASES.items() if alias != target)
    lines += ["", f"Aliases: {aliases}.", _HF_NOTES]
    return "\n".join(lines).rstrip("\n") + "\n"
