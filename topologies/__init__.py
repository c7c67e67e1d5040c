"""Cluster and hardware topology definitions (TOML files read by simulator.network.topology)."""
