"""Fuzzing the loader and the engine: random documents, overrides, TOML text and mutated repository scenarios."""

from __future__ import annotations

import datetime
import math
import os
import tempfile

from hypothesis import HealthCheck, given, settings, strategies as st

from simulator.api import check_scenario, simulate
from simulator.errors import MemsimError
from simulator.fuzz import ROOT as FUZZ_ROOT, mutant, repository_scenarios
from simulator.scenario import Scenario, load_scenario, scenario_from_dict
from simulator.scenario.presets import list_presets
from simulator.scenario.schema import SECTION_KEYS, SECTIONS, key_names

_ALL_KEYS = sorted({spec.key for specs in SECTION_KEYS.values() for spec in specs})

# Values that are right for some key somewhere, so that random documents get deep into validation.
_PLAUSIBLE = st.sampled_from([
    0, 1, 2, 3, 4, 8, 12, 16, 32, 64, 768, 50257, 1024, 0.0, 0.1, 0.5, 1e-5, True, False,
    "gpt", "llama", "bert", "vit", "gelu", "swiglu", "layernorm", "rmsnorm", "flash", "eager",
    "fp32", "bf16-mixed", "fp16-mixed", "adamw", "sgd", "none", "full", "selective", "segments:2",
    "segments:x", "segments:\u00b2", "powersgd:\u0663", "segments:" + "9" * 5000, "9" * 5000 + " B",
    "1f1b", "zb-h1", "interleaved-1f1b", "a/b.txt", "cpu", "nvme", "1bit", "topk:0.01",
    "topk:nan", "powersgd:4", "powersgd:-1", "25 MB", "1 GiB", "-3 MB", "1e400 GB", "unlimited", "auto",
    "dynamic", "caching", "exact", "dgx-a100", "h100-sxm", "x.toml", "", "\0", "none", *list_presets(True),
])
_SCALARS = st.one_of(
    _PLAUSIBLE, st.integers(), st.integers(-2, 70), st.floats(), st.booleans(), st.none(), st.text(max_size=8),
    st.just(10**400), st.just(10**5000), st.just(2**63), st.just(datetime.date(2024, 1, 1)), st.just(math.inf),
)
_VALUES = _SCALARS | st.lists(_SCALARS, max_size=2) | st.dictionaries(st.text(max_size=3), _SCALARS, max_size=2)
_KEYS = st.sampled_from(_ALL_KEYS) | st.text(max_size=8)

_BASE_MODEL = {"architecture": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
               "vocab_size": 100, "seq_length": 32}


@st.composite
def _section(draw, section: str) -> dict:
    """Mostly real keys with plausible values; now and then any key or any value."""
    real = st.sampled_from(key_names(section))
    keys = st.one_of(real, real, real, _KEYS)
    values = st.one_of(_PLAUSIBLE, _PLAUSIBLE, _PLAUSIBLE, _VALUES)
    return draw(st.dictionaries(keys, values, max_size=3))


_mostly = st.sampled_from([True] * 9 + [False])  # hypothesis favours the first element


@st.composite
def documents(draw) -> dict:
    """A valid small scenario with random sections, keys and values mixed in (or a random one)."""
    doc: dict = {"model": dict(_BASE_MODEL)} if draw(_mostly) else {}
    for section in draw(st.lists(st.sampled_from(SECTIONS), max_size=4)):
        table = doc[section] if isinstance(doc.get(section), dict) else {}
        table.update(draw(_section(section)))
        doc[section] = table if draw(_mostly) else draw(_SCALARS)
    if not draw(_mostly):
        doc[draw(st.sampled_from(("nmae", "name", "description")) | st.text(max_size=4))] = draw(_VALUES)
    return doc


_OVERRIDE = st.one_of(
    st.builds(lambda s, k, v: f"{s}.{k}={v}", st.sampled_from(SECTIONS + ("x",)), _KEYS,
              st.sampled_from(["4", "0", "-1", "true", '"x"', "[1", "1e999", "nan", "25 MB", "", "{a=1}", "h100"])),
    st.text(max_size=12),
)


def _check(scenario: Scenario) -> None:
    model = scenario.model
    assert model.hidden_size % model.num_attention_heads == 0
    assert model.num_attention_heads % model.num_kv_heads == 0
    assert model.num_attention_heads % scenario.parallel.tp == 0
    assert scenario.parallel.pp <= model.num_layers
    per_step = scenario.training.micro_batch_size * scenario.parallel.dp
    assert scenario.training.global_batch_size % per_step == 0
    assert scenario.training.gradient_accumulation_steps >= 1
    if model.architecture == "vit":
        assert model.seq_length == (model.image_size // model.patch_size) ** 2 + 1
    else:
        assert model.vocab_size >= 1 and model.seq_length >= 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents(), st.lists(_OVERRIDE, max_size=2) | st.just([]))
def test_random_documents_load_or_raise_memsim_error(doc, overrides):
    try:
        scenario = scenario_from_dict(doc, "fuzz.toml", overrides)
    except MemsimError as exc:
        message = str(exc)
        assert message.startswith("fuzz.toml: ") and "\n" not in message
    else:
        _check(scenario)


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.dictionaries(_KEYS, _VALUES, max_size=4), _VALUES))
def test_arbitrary_objects_raise_memsim_error(doc):
    try:
        scenario_from_dict(doc, "fuzz.toml")  # type: ignore[arg-type]
    except MemsimError as exc:
        assert "\n" not in str(exc)


_TOML_LINES = st.sampled_from([
    "[model]", "[parallel]", "[training]", "[[model]]", 'preset = "gpt2"', "preset = 'llama-7b'", "tp = 4",
    "tp = 3", "dp = 2", 'name = "x"', "hidden_size = 65", 'bucket_size = "25 MB"', "x = ", "= 1", "[model",
    'schedule = "1f1b"', "num_layers = 1e3", "model = 1", "model.preset = 'gpt2'", '"\\u0000" = 1', "a = [1,",
])


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.lists(_TOML_LINES, max_size=6).map("\n".join), st.text(max_size=40)))
def test_random_toml_text_loads_or_raises_memsim_error(text):
    handle, path = tempfile.mkstemp(suffix=".toml")
    try:
        with os.fdopen(handle, "w", encoding="utf-8", errors="surrogatepass") as file:
            file.write(text)
        try:
            scenario = load_scenario(path)
        except MemsimError as exc:
            assert str(exc).startswith(path) and "\n" not in str(exc)
        else:
            _check(scenario)
    finally:
        os.unlink(path)


# ---- mutations of the repository's scenarios, loaded and (when small) simulated -----------------------------

_REPOSITORY = repository_scenarios()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_mutated_repository_scenarios_raise_only_memsim_errors(rng):
    """simulator.fuzz mutants of scenarios/**/*.toml: loading and simulating them ends in a result or a
    one-line MemsimError (benchmarks/fuzz_scenarios.py runs 10,000; docs/robustness.md has the counts)."""
    item = mutant(rng, _REPOSITORY)
    source = str(FUZZ_ROOT / item.source)
    try:
        scenario = scenario_from_dict(item.doc, source)
        p, t = scenario.parallel, scenario.training
        if p.dp * p.tp * p.pp > 64 or t.gradient_accumulation_steps > 4 or scenario.model.num_layers > 8:
            check_scenario(scenario)          # every refusal of simulate, without the run
        else:
            simulate(scenario, timelines=False, memory_workers=0)
    except MemsimError as exc:
        assert str(exc) and "\n" not in str(exc), (item.changes, str(exc))
