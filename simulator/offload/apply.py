"""Apply a rank's offload options to its iteration workload: optimizer (ZeRO-Offload), parameters, activations, a
DLRM's embedding tables; `build_iteration`: a rank's iteration built with them."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from simulator.offload.activations import HostSaver
from simulator.offload.state import HostState, OffloadConfig
from simulator.workload.training import build_iteration as build_plain_iteration


def apply_offload(workload, config: OffloadConfig, largest_param_numel: int, ids, saver=None, optimizer: str = "adamw"):
    """`workload` (an IterationWorkload, after data parallelism) with `config`'s offloading and its HostState.

    Args:
        workload: the rank's workload.
        config: what is offloaded, with the rank's host rates.
        largest_param_numel: elements of the largest parameter the rank holds.
        ids: the workload's tensor IdSource.
        saver: the save_on_cpu hooks its tapes were replayed with (offload/activations.py), or None.
        optimizer: training.optimizer (what the host keeps for host-resident embedding tables).
    """
    # imported here: a run without offload (most) does not load them
    from simulator.offload.embeddings import offload_embeddings
    from simulator.offload.optimizer import offload_optimizer
    from simulator.offload.zero3 import offload_zero3

    host = HostState()
    if saver is not None:
        host.tensors.update(saver.host_tensors)
    if config.optimizer != "none" and workload.meta.get("zero_stage") == 3:
        workload = offload_zero3(workload, config, ids, host)
    elif config.optimizer == "cpu":
        workload = offload_optimizer(workload, config, largest_param_numel, ids, host)
    if config.embeddings == "host":
        workload = offload_embeddings(workload, config, optimizer, ids, host)
    return replace(workload, host=host)


# What workload.training.build_iteration calls to apply a recipe's offload (handed in: that package does not import
# this one, which builds on it).
STEPS = SimpleNamespace(host_saver=HostSaver, apply=apply_offload)


def build_iteration(shape, recipe, profile):
    """workload.training.build_iteration with the recipe's offload applied (the entry point when it may be set)."""
    return build_plain_iteration(shape, recipe, profile, offload=STEPS)
