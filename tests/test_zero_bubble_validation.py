"""memsim's zero-bubble split against torch.distributed.pipelining's, measured on this machine's CPU.

The measured levels are committed in validation/data/cpu/zero_bubble.json (`python -m
validation.measure_zero_bubble`); the comparison runs from them. With torch installed one configuration is
re-measured and must reproduce the committed bytes.
"""

from __future__ import annotations

import pytest

from validation.measure_memory import DEFAULT_CONFIGS, load_configs
from validation.zero_bubble import CONFIGURATIONS, LEVELS, load_measurements, predict

CONFIGS = load_configs(DEFAULT_CONFIGS)
MEASURED = load_measurements()
# Measured: the forward and the end of W exactly; between I and W within 1.2%; I's and W's peaks within 2.1%
# (torch defers the norms' weight gradients to W too; memsim computes them in I).
TOLERANCE = 0.03


def test_every_configuration_is_measured():
    assert set(MEASURED) == set(CONFIGURATIONS)


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_levels_match_torch_pipelining(name):
    levels = predict(name, CONFIGS[name])
    measured = MEASURED[name]
    assert levels.forward_end_bytes == measured["forward_end_bytes"]
    assert levels.end_bytes == measured["end_bytes"]        # every weight gradient, to the byte, after W
    for key, error in levels.errors(measured).items():
        assert abs(error) <= TOLERANCE, (key, getattr(levels, key), measured[key])


@pytest.mark.parametrize("name", CONFIGURATIONS[:2])
def test_torch_retains_the_graph_where_megatron_stores_only_what_w_reads(name):
    # Between I and W torch holds every saved activation: the measured level is far above what a weight-gradient
    # store needs, which memsim gives for framework = "megatron".
    torch_levels, store = predict(name, CONFIGS[name]), predict(name, CONFIGS[name], framework="megatron")
    assert store.boundary_bytes < 0.9 * torch_levels.boundary_bytes
    assert store.boundary_bytes < 0.9 * MEASURED[name]["boundary_bytes"]


@pytest.mark.torch
@pytest.mark.slow
def test_remeasured_split_reproduces_committed_bytes():
    pytest.importorskip("torch")
    from validation.measure_zero_bubble import measure
    name = CONFIGURATIONS[0]
    levels = measure(CONFIGS[name])
    assert {key: levels[key] for key in LEVELS} == {key: MEASURED[name][key] for key in LEVELS}
