"""Scenario files: the frozen schema, TOML loading with --set overrides, model presets and HF import."""

from simulator.scenario.hf_config import model_config_from_hf, supported_model_types
from simulator.scenario.loader import (
    apply_overrides, load_scenario, parse_override_value, read_scenario_document, resolve_model_config,
    scenario_from_dict,
)
from simulator.scenario.presets import Preset, get_preset, list_presets, preset_values
from simulator.scenario.schema import (
    AllocatorConfig, ClusterConfig, ModelConfig, ParallelConfig, RunConfig, Scenario, TrainingConfig,
)

__all__ = [
    "AllocatorConfig", "ClusterConfig", "ModelConfig", "ParallelConfig", "Preset", "RunConfig", "Scenario",
    "TrainingConfig", "apply_overrides", "get_preset", "list_presets", "load_scenario", "model_config_from_hf",
    "parse_override_value", "preset_values", "read_scenario_document", "resolve_model_config",
    "scenario_from_dict", "supported_model_types",
]
