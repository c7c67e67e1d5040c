"""Exploration: sweeps over scenario keys, cost and energy, plan search, comparison, pictures, executors."""
