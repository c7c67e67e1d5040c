"""Exploration: the fast estimate, plan search, sweeps, comparison, cost and energy, pictures and executors."""
