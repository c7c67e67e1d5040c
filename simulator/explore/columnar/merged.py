"""Several schedule graphs evaluated in one pass: every (plan, node) of every structure in one flat array, one
numpy step per level for all of them (pipeline.evaluate takes one step per level per structure). Each node ends at
the same floats: the same three slots, in order, of (predecessor end + offset), then + cost."""

from __future__ import annotations

import numpy as np

from simulator.explore.pipeline import Structure

# Entry indices are 32-bit below this many entries (the gathers move half the bytes), levels sorted as 16-bit keys
# below this many levels (numpy's stable sort of 16-bit keys is a radix sort, linear); past them, 64-bit.
INDEX32_ENTRIES = 2 ** 31
RADIX_LEVELS = 2 ** 15


def evaluate_many(items: list[tuple[Structure, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """pipeline.evaluate(structure, costs, offsets) for each item, computed together (equal values)."""
    if not items:
        return []
    ends_size = sum(costs.shape[0] * (s.n_nodes + 1) for s, costs, _ in items)
    flat_cost = np.zeros(ends_size)
    flat_offsets = []
    nodes, levels, pred_idx, off_idx = [], [], [[], [], []], [[], [], []]
    offsets_size = sum(offsets.shape[0] * (offsets.shape[1] + 1) for _, _, offsets in items)
    index = np.int32 if max(ends_size, offsets_size) < INDEX32_ENTRIES else np.int64
    base = offset_base = 0
    for structure, costs, offsets in items:
        plans = costs.shape[0]
        width = structure.n_nodes + 1
        padded_costs = np.concatenate([costs, np.zeros((plans, 1))], axis=1)
        block = np.zeros((plans, width))
        block[:, :-1] = padded_costs[:, structure.cost_index]
        flat_cost[base:base + plans * width] = block.ravel()
        padded_offsets = np.concatenate([offsets, np.zeros((plans, 1))], axis=1)
        owidth = padded_offsets.shape[1]
        flat_offsets.append(padded_offsets.ravel())
        order = np.concatenate(structure.levels)
        level = np.repeat(np.arange(len(structure.levels)), [len(part) for part in structure.levels])
        rows = np.arange(plans, dtype=index)[:, None]
        nodes.append((base + rows * width + order[None, :].astype(index)).ravel())
        levels.append(np.broadcast_to(level[None, :], (plans, len(order))).ravel())
        for k in range(3):
            pred = structure.preds[order, k]
            pred = np.where(pred >= 0, pred, structure.n_nodes)
            pred_idx[k].append((base + rows * width + pred[None, :].astype(index)).ravel())
            off = structure.offset_index[order, k]
            off = np.where(off >= 0, off, owidth - 1)
            off_idx[k].append((offset_base + rows * owidth + off[None, :].astype(index)).ravel())
        base += plans * width
        offset_base += plans * owidth
    level = np.concatenate(levels)
    # Any order of the entries within a level gives the same ends.
    by_level = np.argsort(level.astype(np.int16) if len(level) and level.max() < RADIX_LEVELS else level,
                          kind="stable")
    bounds = np.searchsorted(level[by_level], np.arange(level.max() + 2 if len(level) else 1))
    node = np.concatenate(nodes)[by_level]
    preds = [np.concatenate(p)[by_level] for p in pred_idx]
    offs = [np.concatenate(o)[by_level] for o in off_idx]
    all_offsets = np.concatenate(flat_offsets) if flat_offsets else np.zeros(0)
    end = np.zeros(ends_size)
    for a, b in zip(bounds[:-1], bounds[1:]):
        start = end[preds[0][a:b]] + all_offsets[offs[0][a:b]]
        for k in (1, 2):
            np.maximum(start, end[preds[k][a:b]] + all_offsets[offs[k][a:b]], out=start)
        at = node[a:b]
        end[at] = start + flat_cost[at]
    out, base = [], 0
    for structure, costs, _ in items:
        plans, width = costs.shape[0], structure.n_nodes + 1
        out.append(end[base:base + plans * width].reshape(plans, width)[:, :-1])
        base += plans * width
    return out
