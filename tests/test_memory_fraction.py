"""allocator.memory_fraction (torch.cuda.set_per_process_memory_fraction): the caching allocator's reserved bytes
are capped at int(fraction x device memory); the rest of the card is not given to anyone."""

from __future__ import annotations

import pytest

from simulator import simulate
from simulator.errors import ScenarioError
from simulator.scenario import scenario_from_dict
from simulator.topology import resolve_cluster


def _doc(fraction: float, batch: int = 8) -> dict:
    return {"name": "fraction",
            "model": {"architecture": "gpt", "num_layers": 4, "hidden_size": 1024, "num_attention_heads": 16,
                      "vocab_size": 32000, "seq_length": 1024, "dropout": 0.0},
            "training": {"micro_batch_size": batch, "precision": "bf16-mixed"},
            "cluster": {"topology": "rtx-4090"}, "allocator": {"memory_fraction": fraction},
            "run": {"warmup_iterations": 1}}


def test_the_cap_is_the_fraction_of_the_whole_card():
    cluster = resolve_cluster(scenario_from_dict(_doc(0.5)))
    assert cluster.allocator_capacity_bytes == int(0.5 * cluster.device.memory_bytes)
    uncapped = resolve_cluster(scenario_from_dict(_doc(1.0)))
    assert uncapped.allocator_capacity_bytes == uncapped.device.memory_bytes - uncapped.context_bytes


def test_a_job_between_the_cap_and_the_card_runs_out_of_memory_at_the_cap():
    free = simulate(scenario_from_dict(_doc(1.0))).report
    reserved = free["ranks"][0]["peak_reserved_bytes"]
    memory = free["ranks"][0]["capacity_bytes"]
    assert free["fits"] and reserved < memory
    fraction = (reserved - 2**28) / memory          # a cap 256 MiB below what the job reserves
    capped = simulate(scenario_from_dict(_doc(fraction))).report
    assert capped["fits"] is False
    assert capped["oom"]["capacity_bytes"] == int(fraction * memory)
    assert capped["oom"]["reserved_bytes"] <= int(fraction * memory)
    assert any("allocator.memory_fraction" in w for w in capped["warnings"])
    roomy = simulate(scenario_from_dict(_doc(min(1.0, (reserved + 2**28) / memory)))).report
    assert roomy["fits"] is True and roomy["oom"] is None


@pytest.mark.parametrize("value", [0, 1.5, -0.1])
def test_values_outside_zero_one_are_refused(value):
    with pytest.raises(ScenarioError, match=r"allocator.memory_fraction = .*: must be a number in \(0, 1\]"):
        scenario_from_dict(_doc(value))
