"""The [model] table of a DLRM (`model.architecture = "dlrm"`): its keys, checks and the ModelConfig it resolves to."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from simulator.scenario.parsers import Invalid, int_at_least

PLACEMENTS = ("device", "host")
DLRM_KEYS = ("preset", "architecture", "embedding_rows", "embedding_tables", "embedding_dim", "lookups_per_table",
             "dense_features", "bottom_mlp", "top_mlp", "embedding_placement")
DLRM_DEFAULTS = {"lookups_per_table": 1, "dense_features": 13, "embedding_placement": "device"}

_POSITIVE = int_at_least(1)


def int_array(value: object) -> tuple[int, ...]:
    """Parser for a non-empty array of positive integers."""
    if not isinstance(value, (list, tuple)) or not value:
        raise Invalid("must be a non-empty array of positive integers")
    try:
        return tuple(_POSITIVE(n) for n in value)
    except Invalid:
        raise Invalid("must be a non-empty array of positive integers") from None


def rows_per_table(value: object) -> int | tuple[int, ...]:
    """Parser for model.embedding_rows: one count for every table (with embedding_tables) or an array per table."""
    if isinstance(value, (list, tuple)):
        return int_array(value)
    try:
        return _POSITIVE(value)
    except Invalid:
        raise Invalid("must be a positive integer (rows of every table) or an array of them (one per table)") from None


def resolve_dlrm(values: dict[str, object], explicit: Mapping[str, object],
                 fail: Callable[[str, str], Exception]) -> dict[str, object]:
    """The ModelConfig fields of a DLRM from its [model] values (preset values overridden by explicit keys).

    Transformer fields mean here: num_layers = MLP layers, hidden_size = embedding_dim, seq_length = 1 (a
    "token" is a sample: tokens_per_s counts samples), no vocabulary.

    Raises:
        whatever `fail(key, rule)` makes.
    """
    for key in explicit:
        if key not in DLRM_KEYS:
            raise fail(key, "a transformer key; model.architecture = 'dlrm' reads only "
                            + ", ".join(k for k in DLRM_KEYS if k != "architecture"))
    for key in ("embedding_rows", "embedding_dim", "bottom_mlp", "top_mlp"):
        if key not in values:
            raise fail(key, "is required for a dlrm (or give model.preset = 'dlrm-criteo-1tb')")
    fields = {key: values[key] for key in DLRM_KEYS if key in values and key != "preset"}
    for key, default in DLRM_DEFAULTS.items():
        fields.setdefault(key, default)
    rows, tables = fields["embedding_rows"], fields.get("embedding_tables")
    if isinstance(rows, int):
        if tables is None:
            raise fail("embedding_tables", "is required when model.embedding_rows is one number (rows of every table)")
        rows = (rows,) * tables
    elif tables is not None and tables != len(rows):
        raise fail("embedding_tables", f"must equal the length of model.embedding_rows = {len(rows)} (or be left out)")
    fields["embedding_rows"], fields["embedding_tables"] = rows, len(rows)
    if fields["bottom_mlp"][-1] != fields["embedding_dim"]:
        raise fail("bottom_mlp", f"must end with model.embedding_dim = {fields['embedding_dim']} (the dot interaction "
                                 f"multiplies the dense vector with the embeddings)")
    if fields["top_mlp"][-1] != 1:
        raise fail("top_mlp", "must end with 1 (the click probability)")
    layers = len(fields["bottom_mlp"]) + len(fields["top_mlp"])
    fields.update(num_layers=layers, hidden_size=fields["embedding_dim"], num_attention_heads=1, num_kv_heads=1,
                  ffn_hidden_size=fields["embedding_dim"], vocab_size=0, seq_length=1, max_position_embeddings=1,
                  activation="relu", norm="none", norm_eps=1e-5, bias=True, attention="none", dropout=0.0,
                  tied_embeddings=False, post_norm=False)
    if "preset" in values:
        fields["preset"] = values["preset"]
    return fields
