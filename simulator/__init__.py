"""memsim: a discrete-event simulator of deep-learning training memory and time on GPU clusters."""

from __future__ import annotations

__all__ = ["Result", "load_scenario", "scenario_from_dict", "simulate"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported lazily so that `import simulator.units` does not load the whole engine.
    if name in ("Result", "simulate"):
        from simulator import api
        return getattr(api, name)
    if name in ("load_scenario", "scenario_from_dict"):
        from simulator import scenario
        return getattr(scenario, name)
    raise AttributeError(f"module 'simulator' has no attribute {name!r}")
