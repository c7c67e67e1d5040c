"""The network model's analysis before a run: which operations can interact (footprints and their components), which
shadows are worth starting and which collectives are link-isolated (engine/network_model.py's module docstring)."""

from __future__ import annotations

from itertools import chain, compress, repeat
from operator import attrgetter, is_

from simulator.engine.rank_state import COMPUTE_STREAM
from simulator.network.collectives import candidates, lower_collective
from simulator.network.footprint import footprint, interference_components, pairs_footprint, schedule_pairs
from simulator.network.host import transfer_schedule
from simulator.parallel.program import COMM_INSTRUCTIONS, Blocking, Collective, Program, Recv, Send, Transfer

_OTHER_COMMUNICATION = frozenset(COMM_INSTRUCTIONS + (Transfer,))   # what analyze looks at, besides Blocking
_BLOCKING_KEY = attrgetter("collective.kind", "collective.group", "collective.size_bytes")
_BLOCKING_POSTER = attrgetter("collective.group", "stream")


def _streams_to_scan(program: Program) -> list[tuple[str, list]]:
    """(stream, instructions) holding every (kind, group, size) and (group, stream) of `program`'s communication
    once or more, in the order of their first occurrence: every stream, but on the compute stream only the first
    micro-batch copy of each `blocking` (Program.copies), and on each stream only the first template copy's part of
    each key (Program.blocks): copies with the same `blocking` (parts with the same key) post the same Blocking
    collectives and collectives, but for their tensor ids and event names."""
    if not program.copies and not program.blocks:
        return list(program.streams.items())
    parts: list[tuple[str, list]] = []
    for name, instructions in program.streams.items():
        skipped: list[tuple[int, int]] = []        # (start, end) of copies and parts seen before
        seen: set[int] = set()        # (the copies are kept alive by `program`: ids are not reused)
        for start, end, key in chain(((c[0], c[1], c[5]) for c in program.copies if name == COMPUTE_STREAM),
                                     ((b[0], b[1], b[2]) for b in program.blocks.get(name, ()))):
            if id(key) in seen:
                skipped.append((start, end))
            seen.add(id(key))
        scanned_to = 0
        for start, end in sorted(skipped):
            parts.append((name, instructions[scanned_to:start]))
            scanned_to = end
        parts.append((name, instructions[scanned_to:] if scanned_to else instructions))
    return parts


def analyze(model, programs: list[Program], isolate: bool) -> None:
    """Set `model`'s shadows worth starting (`_kept`) and link-isolated collectives (`_isolated`): network_model's
    module docstring."""
    real: dict[tuple, None] = {}              # (kind, group, size) of simulated ranks' operations
    posters: dict[tuple[int, ...], dict[int, set[str]]] = {}   # collective group -> rank -> streams
    for program in programs:
        rank = program.rank
        for stream, instructions in _streams_to_scan(program):
            # Only communication matters here: pick it out in C (most instructions are compute runs), and
            # Blocking instructions (a TP collective each: most of the rest) by their distinct keys, in C too.
            kinds = list(map(type, instructions))
            blocking = list(compress(instructions, map(is_, kinds, repeat(Blocking))))
            real.update(dict.fromkeys(map(_BLOCKING_KEY, blocking)))
            for group, posted_on in dict.fromkeys(map(_BLOCKING_POSTER, blocking)):   # on its own stream
                posters.setdefault(group, {}).setdefault(rank, set()).add(posted_on)
            communication = list(compress(instructions, map(_OTHER_COMMUNICATION.__contains__, kinds)))
            # Micro-batch copies share most of their comm streams' instructions: each object once, in the order
            # of its first occurrence (which keeps every key's first occurrence in order).
            for instruction in dict(zip(map(id, communication), communication)).values():
                kind = type(instruction)
                if kind is Collective:
                    real[(instruction.kind, instruction.group, instruction.size_bytes)] = None
                    posters.setdefault(instruction.group, {}).setdefault(rank, set()).add(stream)
                elif kind is Send:
                    real[("send", (rank, instruction.peer), instruction.size_bytes)] = None
                elif kind is Recv:
                    real[("send", (instruction.peer, rank), instruction.size_bytes)] = None
                elif kind is Transfer:
                    real[("transfer", (rank, instruction.route, instruction.cap_bytes_per_s),
                          instruction.size_bytes)] = None
    shadows: dict[tuple, None] = {}
    for kind, group, size in real:
        if kind == "transfer":
            rank, route, cap = group
            shadows.update(dict.fromkeys(("transfer", (r, route, cap), size)
                                         for r in model.shadows.represented(rank)))
        elif kind == "send":
            shadows.update(dict.fromkeys(("send", pair, size) for pair in model.shadows.pairs(*group)))
        else:
            shadows.update(dict.fromkeys((kind, shadow, size) for shadow in model.shadows.groups(kind, group)))
    operations = dict.fromkeys(real) | shadows
    # A shadow's footprint is the union over every algorithm NCCL could pick for it (a superset, so
    # pruning stays exact) which spares choosing the algorithm of shadows that are then dropped.
    footprints = {key: transfer_footprint(model, key) if key[0] == "transfer"
                  else footprint(model.topology, model._lower(*key)) if key in real else any_footprint(model, key)
                  for key in operations}
    component = interference_components(footprints)
    reached = {component[key] for key in real if component[key] >= 0}
    model._kept = {key for key in shadows if component[key] in reached}
    if not isolate:
        return
    groups: dict[int, set[tuple]] = {}        # component -> (is a transfer, group) of its operations
    for key in operations:
        if key in real or key in model._kept:
            groups.setdefault(component[key], set()).add((key[0] == "send", key[1]))
    for key in real:
        kind, group, _ = key
        if kind in ("send", "transfer") or component[key] < 0 or groups[component[key]] != {(False, group)}:
            continue
        streams = posters[group]
        if all(len(streams.get(r, ())) == 1 for r in group if r in model.simulated):
            model._isolated[key] = None


def transfer_footprint(model, key: tuple) -> tuple[int, ...]:
    """Resources an offload transfer ("transfer", (rank, route, cap), size) loads (its flows' routes)."""
    _, (rank, route, cap), size = key
    cache_key = ("transfer", rank, route, size > 0)
    found = model._footprints.get(cache_key)
    if found is None:
        found = model._footprints[cache_key] = footprint(model.topology,
                                                        transfer_schedule(model.topology, rank, route, 1.0, cap)) \
            if size > 0 else ()
    return found


def any_footprint(model, key: tuple) -> tuple[int, ...]:
    """Resources `key` may load under any of its candidate algorithms (one protocol each: same links)."""
    kind, group, size = key
    # The links a lowered schedule loads do not depend on its size, only on whether it moves bytes.
    cache_key = (kind, group, size > 0)
    cached = model._footprints.get(cache_key)
    if cached is not None:
        return cached
    if kind == "send" and len(group) == 2 and group[0] != group[1]:
        # One direct flow from src to dst (lower_collective's send): its route's resources, sorted.
        result = tuple(sorted(pairs_footprint(model.topology, (group,)))) if size > 0 else ()
        model._footprints[cache_key] = result
        return result
    per = model.topology.gpus_per_node
    node = group[0] // per
    if node > 0 and all(gpu // per == node for gpu in group):
        # Inside one server, lowering and routes do not depend on which server: take server 0's footprint
        # of the same local group and move it to this server's links.
        base = any_footprint(model, (kind, tuple(gpu - node * per for gpu in group), size))
        offset = model.topology.local_offset(node)
        result = model._footprints[cache_key] = tuple(resource + offset for resource in base)
        return result
    pairs: dict[tuple, None] = {}       # the (src, dst) of every algorithm's flows, each once
    first_protocol: dict[str, str] = {}
    for algorithm, protocol in candidates(model.topology, kind, group):
        first_protocol.setdefault(algorithm, protocol)
    for algorithm, protocol in first_protocol.items():
        pairs.update(schedule_pairs(lower_collective(model.topology, kind, group, size, algorithm, protocol)))
    result = model._footprints[cache_key] = tuple(sorted(pairs_footprint(model.topology, pairs)))
    return result
