"""Exploration: a fast estimate of a run's report from the simulator's own models, plan search, sweeps."""
