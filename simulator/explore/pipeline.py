"""A pipeline schedule's structure as arrays — the dependency graph a simulated run follows and, per rank, the
micro-batches in flight before each action — and its evaluation over many plans at once with numpy.

The graph is the one the lowering builds (parallel/lower_multi.py) and the engine runs: each rank's compute
stream runs its schedule's actions in order; a received tensor's recv is posted right before the action that
needs it, so its transfer starts when the sender has produced it, the receiver has posted, and the sender's
previous send of that kind is done (sends of one kind share a stream), and takes the message's time; after the
last action the rank waits for its data-parallel reductions (posted during each chunk's last backward, queued
on one stream), the end stages all_reduce a tied embedding's gradient, and the optimizer steps. Every node ends
at max(end of each predecessor + an offset) + its cost; nodes are grouped into levels (a node's level is one
more than its predecessors'), and each level is one vectorised step over every plan sharing the structure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.parallel.schedules import Action, Schedule

# Action cost slots per (rank, chunk): F; B (or I) of the chunk's first backward, a later one, its last one
# (which reduces gradients); W likewise.
F, B_FIRST, B_LATER, B_SYNC, W_FIRST, W_LATER, W_SYNC = range(7)
SLOTS = 7
# Memory coordinates per chunk: micro-batches after F before B/I; after I before W; first B/I done; first W done.
N_F, N_I, DONE_B, DONE_W = range(4)
COORDS = 4
# Memory action types per chunk (what the action's own excursion is): F, B/I first, B/I later, W first, W later.
M_F, M_B_FIRST, M_B_LATER, M_W_FIRST, M_W_LATER = range(5)
MTYPES = 5


@dataclass(frozen=True)
class MemoryRows:
    """One rank's actions as (memory type index = chunk * MTYPES + type, coordinates before it), deduplicated:
    the allocated level before an action is the start level plus coordinates . per-coordinate bytes."""

    types: np.ndarray          # (rows,) int
    coords: np.ndarray         # (rows, v * COORDS) int


@dataclass(frozen=True)
class Structure:
    """The dependency graph of one iteration of a schedule, and each rank's memory rows.

    Node arrays (one entry per node): `cost_index` into a plan's cost table (actions: rank * v * SLOTS +
    chunk * SLOTS + slot; transfers: TRANSFER_BASE + transfer slot; tails: TAIL_BASE + ...), `preds` (nodes,
    3) with -1 for none, `offset_index` (nodes, 3) into a plan's offset table (-1: offset 0); `levels` the node
    ids of each level. `rank_last` is each rank's final node (its optimizer step); `recv_count[r]` the
    receives of rank r (each exposes its transfer); `action_counts[r]` (v, SLOTS) how many actions of each slot.
    """

    p: int
    v: int
    m: int
    split: bool
    n_nodes: int
    cost_index: np.ndarray
    preds: np.ndarray
    offset_index: np.ndarray
    levels: tuple[np.ndarray, ...]
    rank_last: np.ndarray
    rank_flush: np.ndarray          # each rank's node after its data-parallel wait
    rank_compute_end: np.ndarray    # each rank's last action node
    tied_node: np.ndarray           # each rank's tied-embedding all_reduce node (-1 if none)
    transfer_counts: np.ndarray     # (p, n transfer slots): messages of each slot a rank receives
    sends: np.ndarray               # (p, n transfer slots): messages of each slot a rank sends
    action_counts: np.ndarray       # (p, v, SLOTS)
    memory: tuple[MemoryRows, ...]
    sync_nodes: tuple[tuple[int, ...], ...]   # per rank, per chunk: the node of its synchronising backward
    joins: tuple[np.ndarray, ...] = ()        # per rank, the nodes where its compute waits for blocking sends
    steps: tuple = ()                         # evaluate's gathers per level (_steps)


def transfer_slot(kind: str, src: int) -> int:
    """A message's cost slot: activations from rank src to the next, gradients from src to the previous."""
    return 2 * src + (0 if kind == "activation" else 1)


def _slots(schedule: Schedule, rank: int) -> list[int]:
    """Each action's cost slot on `rank` (first / later / last backward per chunk)."""
    actions = schedule.ranks[rank]
    first_b: dict[int, int] = {}
    last_b: dict[int, int] = {}
    first_w: dict[int, int] = {}
    last_w: dict[int, int] = {}
    for k, a in enumerate(actions):
        if a.kind in ("B", "I"):
            first_b.setdefault(a.chunk, k)
            last_b[a.chunk] = k
        if a.kind == "W":
            first_w.setdefault(a.chunk, k)
            last_w[a.chunk] = k
    split = any(a.kind == "I" for a in actions)
    slots = []
    for k, a in enumerate(actions):
        if a.kind == "F":
            slots.append(F)
        elif a.kind in ("B", "I"):
            # With a split, the reductions run with the last W; a B on a split chunk is I then W (first W of
            # its own micro-batch): its slot is the backward's.
            sync = (k == last_b[a.chunk]) and not split
            slots.append(B_SYNC if sync else B_FIRST if k == first_b[a.chunk] else B_LATER)
        else:
            slots.append(W_SYNC if k == last_w[a.chunk] else W_FIRST if k == first_w[a.chunk] else W_LATER)
    return slots


def _memory_rows(schedule: Schedule, rank: int) -> MemoryRows:
    v = schedule.virtual_stages
    state = [0] * (v * COORDS)
    seen: dict[tuple, None] = {}
    for a in schedule.ranks[rank]:
        c = a.chunk
        base = c * COORDS
        if a.kind == "F":
            kind = M_F
        elif a.kind in ("B", "I"):
            kind = M_B_LATER if state[base + DONE_B] else M_B_FIRST
        else:
            kind = M_W_LATER if state[base + DONE_W] else M_W_FIRST
        seen.setdefault((c * MTYPES + kind, *state), None)
        if a.kind == "F":
            state[base + N_F] += 1
        elif a.kind == "B":
            state[base + N_F] -= 1
            state[base + DONE_B] = 1
        elif a.kind == "I":
            state[base + N_F] -= 1
            state[base + N_I] += 1
            state[base + DONE_B] = 1
        else:
            state[base + N_I] -= 1
            state[base + DONE_W] = 1
    rows = np.array(list(seen), dtype=np.int64).reshape(len(seen), 1 + v * COORDS)
    return MemoryRows(rows[:, 0].copy(), rows[:, 1:].copy())


def memory_rows(schedule: Schedule) -> tuple[MemoryRows, ...]:
    """Each rank's memory rows (a Structure's `memory`), without the graph."""
    return tuple(_memory_rows(schedule, r) for r in range(schedule.num_ranks))


class _Graph:
    """Nodes under construction: cost slot, predecessors and offset slots (flat lists, patched in place)."""

    def __init__(self) -> None:
        self.cost: list[int] = []
        self.preds: tuple[list[int], list[int], list[int]] = ([], [], [])
        self.offsets: tuple[list[int], list[int], list[int]] = ([], [], [])

    def add(self, cost: int, pred: int, pred2: int = -1, offsets: tuple[int, int] = (-1, -1)) -> int:
        self.cost.append(cost)
        first, second, third = self.preds
        first.append(pred)
        second.append(pred2)
        third.append(-1)
        offset_first, offset_second, offset_third = self.offsets
        offset_first.append(offsets[0])
        offset_second.append(offsets[1])
        offset_third.append(-1)
        return len(self.cost) - 1

    def columns(self, lists) -> np.ndarray:
        return np.array(lists, dtype=np.int64).reshape(3, len(self.cost)).T.copy()


def _lowered(schedule: Schedule) -> list[list[tuple]]:
    """Per rank, (recv, action, send) for each action: what schedule_check.program posts around it, as keys.
    A recv is (kind, src rank, producer key, transfer key) and a send the transfer key (kind, producing stage,
    micro-batch), or None: an F needs only the previous stage's F and a B or I only the next stage's B or I,
    so each action receives at most one message and sends at most one (program's dependencies and transfers)."""
    stages = schedule.num_stages
    owner = schedule.stage_ranks
    grad_kind = {(a.stage, a.microbatch): a.kind for actions in schedule.ranks for a in actions if a.kind in ("B", "I")}
    recvs: dict[tuple, tuple] = {}
    sends: dict[tuple, tuple] = {}
    for rank, actions in enumerate(schedule.ranks):
        for a in actions:
            stage, microbatch = a.stage, a.microbatch
            if a.kind == "F":
                if stage == 0:
                    continue
                dep, kind = (stage - 1, "F", microbatch), "activation"
            elif a.kind in ("B", "I") and stage + 1 < stages:
                dep, kind = (stage + 1, grad_kind.get((stage + 1, microbatch), "B"), microbatch), "gradient"
            else:
                continue
            src = owner[dep[0]]
            if src != rank:
                transfer = (kind, dep[0], microbatch)
                recvs[a.key] = (kind, src, dep, transfer)
                sends[dep] = transfer
    return [[(recvs.get(a.key), a, sends.get(a.key)) for a in actions] for actions in schedule.ranks]


def build_structure(schedule: Schedule, *, reduces: bool, tied: bool, reduce_at_end: bool = False,
                    blocking_sends: bool = False) -> Structure:
    """The graph of `schedule` (validated, with chunks filled in).

    `reduces`: data-parallel reductions during each chunk's last backward (dp > 1); `reduce_at_end`: they are
    posted only after the rank's last action instead (Megatron without overlap_grad_reduce: finish_grad_sync);
    `tied`: the end stages all_reduce a tied embedding's gradient before the step (pp > 1 with tied embeddings);
    `blocking_sends`: each action waits for the sends posted since the previous one to be delivered, and the
    step for the last ones (overlap_p2p_comm off: lower_multi._comm).

    Cost table of a plan (`cost_table_size`): actions, then a message time per transfer slot, then per rank its
    tied all_reduce and its step. Offset table: per (rank, chunk) the reduction queue's length and the tail its
    reductions add after the synchronising node's end.
    """
    p, v, m = schedule.num_ranks, schedule.virtual_stages, schedule.microbatches
    lowered = _lowered(schedule)
    transfer_base = p * v * SLOTS
    tail_base = transfer_base + 2 * p
    graph = _Graph()
    node_of: dict[tuple[int, str, int], int] = {}       # (stage, kind, microbatch) -> action node
    recvs: list[tuple[int, tuple]] = []                 # (recv node, (kind, src rank, producer key, transfer key))
    counts: dict[tuple, int] = {}                       # ("recv" | "send", rank, slot) and (rank, chunk, slot)
    sync_nodes = [[-1] * v for _ in range(p)]
    last = [-1] * p
    last_action = [-1] * p
    joined: list[list[int]] = [[] for _ in range(p)]
    waits: list[tuple[int, list[tuple]]] = []      # (join node, transfers whose delivery it waits for)

    def join(rank: int, unsent: list[tuple]) -> None:
        # Two transfers per join node (a node has three predecessors); patched once every recv node exists.
        for k in range(0, len(unsent), 2):
            last[rank] = graph.add(-1, last[rank])
            waits.append((last[rank], unsent[k:k + 2]))
            joined[rank].append(last[rank])
        unsent.clear()

    for rank in range(p):
        slots = iter(_slots(schedule, rank))
        unsent: list[tuple] = []
        for recv, action, send in lowered[rank]:
            if recv is not None:
                slot = transfer_slot(recv[0], recv[1])
                last[rank] = graph.add(transfer_base + slot, last[rank])
                recvs.append((last[rank], recv))
                counts["recv", rank, slot] = counts.get(("recv", rank, slot), 0) + 1
            if unsent:
                join(rank, unsent)
            slot = next(slots)
            node = graph.add(rank * v * SLOTS + action.chunk * SLOTS + slot, last[rank])
            node_of[action.key] = node
            counts[rank, action.chunk, slot] = counts.get((rank, action.chunk, slot), 0) + 1
            if slot in (B_SYNC, W_SYNC):
                sync_nodes[rank][action.chunk] = node
            last[rank] = node
            if send is not None:
                slot = transfer_slot(send[0], rank)
                counts["send", rank, slot] = counts.get(("send", rank, slot), 0) + 1
                if blocking_sends:
                    unsent.append(send)
        compute_end_node = last[rank]
        if unsent:
            join(rank, unsent)
        last_action[rank] = compute_end_node
    compute_end = list(last_action)
    transfer_counts = np.zeros((p, 2 * p), dtype=np.int64)
    sends = np.zeros((p, 2 * p), dtype=np.int64)
    action_counts = np.zeros((p, v, SLOTS), dtype=np.int64)
    for key, n in counts.items():
        if key[0] == "recv":
            transfer_counts[key[1], key[2]] = n
        elif key[0] == "send":
            sends[key[1], key[2]] = n
        else:
            action_counts[key] = n
    # A recv waits for its producer and for the sender's previous send of that kind (one stream per kind),
    # which the sender posts in the order it produces them.
    by_sender: dict[tuple[int, str], list[tuple[int, int]]] = {}
    delivered: dict[tuple, int] = {}
    for node, (kind, src, producer_key, transfer_key) in recvs:
        producer = node_of[producer_key]
        graph.preds[1][node] = producer
        by_sender.setdefault((src, kind), []).append((producer, node))
        delivered[transfer_key] = node
    for node, transfers in waits:
        for k, key in enumerate(transfers):
            graph.preds[1 + k][node] = delivered[key]
    for items in by_sender.values():
        items.sort()                       # a rank's action nodes are numbered in its order
        for (_, before), (_, node) in zip(items, items[1:]):
            graph.preds[2][node] = before
    flush = [-1] * p
    for rank in range(p):
        if reduces:
            queue = -1
            for node, chunk in sorted((n, c) for c, n in enumerate(sync_nodes[rank]) if n >= 0):
                slot = 2 * (rank * v + chunk)
                queue = graph.add(-1, queue, last[rank] if reduce_at_end else node, (slot, slot + 1))
            if queue >= 0:
                last[rank] = graph.add(-1, last[rank], queue)
        flush[rank] = last[rank]
    tied_node = [-1] * p
    if tied and p > 1:
        for rank in (0, p - 1):
            tied_node[rank] = last[rank] = graph.add(tail_base + 2 * rank, flush[0], flush[p - 1])
    step_node = [graph.add(tail_base + 2 * rank + 1, last[rank]) for rank in range(p)]
    preds = graph.columns(graph.preds)
    offset_index = graph.columns(graph.offsets)
    levels = _levels(graph.preds)
    return Structure(
        p=p, v=v, m=m, split=schedule.split_backward, n_nodes=len(graph.cost),
        cost_index=np.array(graph.cost, dtype=np.int64), preds=preds,
        offset_index=offset_index, levels=levels, steps=_steps(levels, preds, offset_index, len(graph.cost)),
        rank_last=np.array(step_node), rank_flush=np.array(flush), rank_compute_end=np.array(compute_end),
        tied_node=np.array(tied_node), transfer_counts=transfer_counts, sends=sends, action_counts=action_counts,
        memory=memory_rows(schedule),
        sync_nodes=tuple(tuple(row) for row in sync_nodes),
        joins=tuple(np.array(sorted(joined[r]), dtype=np.int64) for r in range(p)))


def cost_table_size(structure: Structure) -> int:
    """Entries of a plan's cost table for `structure` (build_structure)."""
    return structure.p * structure.v * SLOTS + 2 * structure.p + 2 * structure.p


def offset_table_size(structure: Structure) -> int:
    """Entries of a plan's offset table for `structure`."""
    return 2 * structure.p * structure.v


def _levels(preds: tuple[list[int], list[int], list[int]]) -> tuple[np.ndarray, ...]:
    """Node ids grouped by level (1 + the highest level of a predecessor), each level's ids ascending; `preds`
    the three predecessor columns (-1: none). Nodes only follow their predecessors' ids within a rank, so the
    levels are set in a topological order."""
    n = len(preds[0])
    if not n:
        return ()
    level = [0] * n
    rows = list(zip(*preds))
    for node in _topological(rows):
        best = -1
        for q in rows[node]:
            if q >= 0 and level[q] > best:
                best = level[q]
        level[node] = best + 1
    levels = np.array(level, dtype=np.int64)
    order = np.argsort(levels, kind="stable")            # ids ascending within a level
    bounds = np.cumsum(np.bincount(levels))[:-1]
    return tuple(np.split(order, bounds))


def _topological(rows: list[tuple[int, int, int]]) -> list[int]:
    """A topological order of the nodes (Kahn's algorithm; any order gives the same levels: a node's level is
    its longest path from a node without predecessors)."""
    n = len(rows)
    waiting = [0] * n
    successors: list[list[int]] = [[] for _ in range(n)]
    for node, row in enumerate(rows):
        for q in row:
            if q >= 0:
                waiting[node] += 1
                successors[q].append(node)
    order = [node for node in range(n) if waiting[node] == 0]
    for node in order:                      # the list grows while it is walked
        for s in successors[node]:
            waiting[s] -= 1
            if waiting[s] == 0:
                order.append(s)
    return order


def _steps(levels: tuple[np.ndarray, ...], preds: np.ndarray, offset_index: np.ndarray,
           n_nodes: int) -> tuple[tuple, ...]:
    """evaluate's work per level, gathered once per structure: (nodes, per slot (the predecessor column, or None
    where no node of the level has a predecessor there; the offset column, or None where none has an offset)).
    A missing predecessor is column n_nodes (time 0) and a missing offset the zero column (-1), as evaluate pads
    them. Computed over all levels at once, then cut at the levels' bounds."""
    if not levels:
        return ()
    order = np.concatenate(levels)
    sizes = np.array([len(nodes) for nodes in levels])
    firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    cuts = firsts[1:]
    columns = []
    for table, missing in ((preds, n_nodes), (offset_index, -1)):
        for k in range(3):
            column = table[order, k]
            present = column >= 0
            some = np.add.reduceat(present.astype(np.int64), firsts) > 0
            parts = np.split(np.where(present, column, missing), cuts)
            columns.append([part if any_ else None for part, any_ in zip(parts, some.tolist())])
    pred_columns, offset_columns = columns[:3], columns[3:]
    return tuple((nodes, tuple((pred_columns[k][i], offset_columns[k][i]) for k in range(3)))
                 for i, nodes in enumerate(levels))


def evaluate(structure: Structure, costs: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """End time of every node for every plan: `costs` (plans, cost_table_size), `offsets` (plans,
    offset_table_size); returns (plans, nodes). A node with cost slot -1 costs nothing.

    Each node ends at max over its three slots of (the predecessor's end + the offset) + its cost, a slot
    without a predecessor counting as time 0 and without an offset as 0.0; a level where no node has a
    predecessor or an offset in a slot takes 0.0 there as a scalar (the same values, fewer gathers)."""
    plans = costs.shape[0]
    padded_costs = np.concatenate([costs, np.zeros((plans, 1))], axis=1)
    padded_offsets = np.concatenate([offsets, np.zeros((plans, 1))], axis=1)
    node_cost = padded_costs[:, structure.cost_index]              # -1 -> the zero column
    end = np.full((plans, structure.n_nodes + 1), 0.0)              # column n: "no predecessor", time 0
    steps = structure.steps or _steps(structure.levels, structure.preds, structure.offset_index, structure.n_nodes)
    for nodes, terms in steps:
        start = None
        for column, offset in terms:
            term = end[:, column] if column is not None else 0.0
            term = term + (padded_offsets[:, offset] if offset is not None else 0.0)
            if start is None:
                start = term if isinstance(term, np.ndarray) else np.full((plans, len(nodes)), term)
            else:
                np.maximum(start, term, out=start)
        end[:, nodes] = start + node_cost[:, nodes]
    return end[:, :-1]
