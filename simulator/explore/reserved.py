"""Reserved memory: the caching allocator's overhead above the allocated peak (in development)."""

from __future__ import annotations


def reserved_bytes(prepared, rank, peak_allocated: int) -> int:
    """Reserved bytes at the peak."""
    return int(peak_allocated)
