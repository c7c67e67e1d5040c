"""EngineOptions: the knobs of one simulation run (below executor and rank_state, which both read them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineOptions:
    """Knobs of one simulation run."""

    record_timeline: bool = True
    record_spans: bool = True
    shadow_traffic: bool = True     # with a plan: unsimulated ranks' traffic loads the links (symmetry)
    isolated_collectives: bool = True   # time link-isolated collectives alone, without flows (exact to rounding)
    quiet_collectives: bool = True  # run an operation nothing in flight shares a link with alone, without flows
                                    # (exact to rounding, like isolated_collectives: network_model.py)
    run_ahead: bool = True          # run compute ops nothing can interleave with without yielding (exact)
    rank_lookahead: bool = True     # ... also past other ranks' events while this rank's other streams are quiet
    send_lookahead: bool = True     # ... also while a stream is in a Send whose Free follows (logged by time later)
    inline_collectives: bool = True  # the compute stream runs a link-isolated collective it waits for (exact)
    inline_overlapped: bool = True   # ... also one another stream runs beside a few compute runs (with
                                     # inline_collectives; exact: executor._overlap)
    repeats: bool = True            # replay repeated periods of memory calls instead of the allocator (exact)
    stretches: bool = True          # replay repeated stretches of runs and inlined collectives (exact)
    memory_workers: int | None = None   # processes making the memory calls while the engine runs (0: none, in
                                        # this process; None: for large runs, by cores: engine/memory_worker.py)
