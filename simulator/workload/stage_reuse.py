"""A middle pipeline stage's workload made from another one's holding as many layers: only layer numbers differ.

Two stages that are neither first nor last, hold the same number of layers, receive the same input and run
their backwards in the same order record the same ops on the same tensor ids with the same sizes: what
differs is the layer index of each op (`Op.layer`) and the "layers.<i>" part of op and tensor names (the
builder names everything of layer i "layers.<i>...", transformer.py). Recompute regions, gradient buckets
and the optimizer step depend on positions within the stage, not on absolute layer numbers.
`relabel_layers` moves those numbers; tests/test_stage_reuse.py compares it with building each stage directly
over many plans (tp, sp, recompute modes, frameworks, interleaving, zero-bubble splits, dp with ZeRO-1).
"""

from __future__ import annotations

import re
from dataclasses import replace

from simulator.workload.graph import Op, Tensor
from simulator.workload.stage import MicrobatchStage, StageWorkload

_LAYER = re.compile(r"layers\.(\d+)")


def relabel_layers(workload: StageWorkload, start: int) -> StageWorkload:
    """`workload` (a middle stage built for layers [a, b)) as built for layers [start, start + b - a).

    Shares what does not change (tensor ids, Tensor objects whose name holds no layer number); Op and
    Tensor objects shared within `workload` (micro-batch copies) stay shared within the result.
    """
    first, stop = workload.meta["layers"]
    delta = start - first
    names: dict[str, str] = {}

    def number(match: re.Match) -> str:
        n = int(match.group(1))
        return f"layers.{n + delta}" if first <= n < stop else match.group(0)

    def rename(name: str) -> str:
        new = names.get(name)
        if new is None:
            new = names[name] = _LAYER.sub(number, name)
        return new

    tensor_memo: dict[int, Tensor] = {}

    def tensor(t: Tensor) -> Tensor:
        new = tensor_memo.get(id(t))
        if new is None:
            name = rename(t.name)
            new = tensor_memo[id(t)] = t if name == t.name else Tensor(t.id, name, t.nbytes, t.category, t.dtype,
                                                                         t.shape, t.persistent)
        return new

    tensors = _mapped_tensors(workload, tensor)

    op_memo: dict[int, Op] = {}

    def op(o: Op) -> Op:
        new = op_memo.get(id(o))
        if new is None:
            new = op_memo[id(o)] = Op(rename(o.name), o.op_class, o.phase, o.flops, o.bytes_read, o.bytes_written,
                                      o.dtype, o.gemm_mnk, o.gemm_batch, o.inputs, o.outputs, o.allocs, o.frees,
                                      o.layer + delta if o.layer >= 0 else o.layer, o.microbatch, o.collective,
                                      o.group, o.comm_bytes, o.host_allocs, o.host_frees, o.placement, o.tensors)
        return new

    seq_memo: dict[int, tuple[Op, ...]] = {}

    def ops(seq: tuple[Op, ...]) -> tuple[Op, ...]:
        new = seq_memo.get(id(seq))
        if new is None:
            new = seq_memo[id(seq)] = tuple([op(o) for o in seq])
        return new

    microbatches = tuple([_relabelled(mb, ops) for mb in workload.microbatches])
    meta = dict(workload.meta)
    meta["layers"] = (start, start + stop - first)
    return replace(workload, tensors=tensors, microbatches=microbatches, optimizer=[op(o) for o in workload.optimizer],
                   meta=meta, first_use=tuple((rename(name), ids) for name, ids in workload.first_use))


def _relabelled(mb: MicrobatchStage, ops) -> MicrobatchStage:
    """`mb` with its op sequences mapped by `ops` (the same mapped tuple for a sequence shared by copies)."""
    return replace(mb, forward=ops(mb.forward), backward=ops(mb.backward), weight=ops(mb.weight))


def _mapped_tensors(workload: StageWorkload, tensor) -> dict[int, Tensor]:
    """`workload.tensors` with every Tensor mapped by `tensor`, in the same key order.

    ~10^5 ids map to ~10^3 Tensor objects: build_stage inserts the recorded micro-batches' tensors (the
    template's block among them), then each copy's block (the template's Tensor objects in the template's
    order), then the rest. The copies' run is mapped once and repeated; found otherwise, every value is mapped.
    The result is a copy of `workload.tensors` with its values replaced (twice as fast as a new dict of 10^5).
    """
    keys = list(workload.tensors)
    values = list(workload.tensors.values())
    result = workload.tensors.copy()
    run = _copied_run(workload.microbatches, keys)
    if run is not None:
        start, block, copies = run
        stop = start + len(block) * copies
        template = [values[k] for k in block]
        if values[start:stop] == template * copies:
            head = [tensor(t) for t in values[:start]]
            result.update(zip(keys[:start], head))
            result.update(zip(keys[start:stop], [head[k] for k in block] * copies))
            result.update(zip(keys[stop:], map(tensor, values[stop:])))
            return result
    result.update(zip(keys, map(tensor, values)))
    return result


def _copied_run(microbatches: tuple[MicrobatchStage, ...], keys: list[int]) -> tuple[int, list[int], int] | None:
    """(position of the first copy's first id in `keys`, positions of the template's block, number of copies)."""
    copy = next((mb for mb in microbatches if mb.copy_of >= 0), None)
    if copy is None or copy.index <= copy.copy_of:
        return None
    low = copy.low                                              # the template's first id
    span, rest = divmod(copy.shift, copy.index - copy.copy_of)  # copy j's block starts (j - template) spans on
    if rest or span <= 0:
        return None
    first = low + span                                          # where the first copy's block starts
    start = next((k for k, tid in enumerate(keys) if tid >= first), None)
    if start is None:
        return None
    block = [k for k in range(start) if keys[k] >= low]
    return start, block, len(microbatches) - 1 - copy.copy_of
