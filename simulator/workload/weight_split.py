"""Zero-bubble split of one micro-batch's backward into its input-gradient part (I) and weight-gradient part (W).

Zero-bubble schedules (Qi et al. 2024) run a backward in two actions: I computes the gradients of the
stage's inputs (and passes them on), W the gradients of the weights, later. The W part is every kernel of
phase BACKWARD_WEIGHT (a linear's wgrad) plus every op that uses what one of them produced: reads or
writes it, copies it into a new buffer, or only releases such tensors (the `.grad` hand-over and
accumulation ops); everything else is I, in its replayed order. A tensor lives until its last use in
the new order, as autograd's references (and the weight-gradient store of zero-bubble implementations)
keep it:

* a tensor freed in I that a W op touches (a linear's saved input, the gradient of its output) is freed
  after the last W op that touches it (all of W runs after all of I);
* a tensor freed by a W op that no W op reads or writes (e.g. the released input gradient of an input that
  needs none) is freed where autograd releases it without the W op: after the nearest I op before it;
* every other free stays where it was.

That is what Megatron's zero-bubble implementation does (Qi et al.: each deferred wgrad's input and output
gradient wait in a WeightGradStore): WEIGHT_STORE. torch.distributed.pipelining instead runs I as
`autograd.grad(..., retain_graph=True)`, which keeps the whole graph, so every saved activation stays until
W is done (`stage_backward_input` / `stage_backward_weight`, measured: validation/zero_bubble.py):
RETAIN_GRAPH, where `split_backward(ops, retained)` frees those tensors with the last op of W (which ones:
workload/stage.py `_retained`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from simulator.workload.graph import BACKWARD_WEIGHT, Op

WEIGHT_STORE = "weight_store"        # I releases what W does not read (Megatron's zero-bubble implementation)
RETAIN_GRAPH = "retain_graph"        # I keeps every saved activation until W (torch.distributed.pipelining)


@dataclass(frozen=True)
class WeightSplit:
    """A backward split for zero-bubble schedules.

    Attributes:
        input_part: the ops of I, in replayed order, with their frees placed by the rule above.
        weight_part: the ops of W, in replayed order (empty when the backward has no weight gradients).
        order: the original index of each op of input_part + weight_part.
    """

    input_part: tuple[Op, ...]
    weight_part: tuple[Op, ...]
    order: tuple[int, ...]

    def position(self, original_index: int) -> int:
        """Where op `original_index` of the whole backward sits in input_part + weight_part."""
        return self.order.index(original_index)


def weight_ops(ops: Sequence[Op]) -> list[bool]:
    """Per op of a backward: whether it belongs to W (module docstring)."""
    produced: set[int] = set()        # tensors written by W ops
    deferred: list[bool] = []
    for op in ops:
        is_weight = op.phase == BACKWARD_WEIGHT or any(t in produced for t in op.inputs + op.outputs) \
            or (bool(op.allocs) and any(t in produced for t in op.frees)) \
            or (bool(op.frees) and not op.inputs and all(t in produced for t in op.frees))
        if is_weight:
            produced.update(op.allocs)
            produced.update(op.outputs)
        deferred.append(is_weight)
    return deferred


def split_backward(ops: Sequence[Op], retained: Callable[[int], bool] | None = None) -> WeightSplit:
    """Split `ops` (one micro-batch's backward) into I and W with the frees re-placed (module docstring).

    `retained(tensor id)`: tensors that I keeps whatever W reads (torch's retained autograd graph: the
    saved activations), freed by the last op of W instead; None: none.
    """
    deferred = weight_ops(ops)
    last_weight = max((k for k, weight in enumerate(deferred) if weight), default=None)
    touched_by_weight: dict[int, int] = {}       # tensor -> original index of the last W op touching it
    for k, op in enumerate(ops):
        if deferred[k]:
            for t in op.inputs + op.outputs + op.allocs:
                touched_by_weight[t] = k
    moved: dict[int, list[int]] = {}             # original index of the op -> frees it now carries
    kept: list[tuple[int, ...]] = []
    previous_input = -1                          # the nearest I op before the current one
    for k, op in enumerate(ops):
        stays = []
        for t in op.frees:
            last = touched_by_weight.get(t)
            if not deferred[k]:
                if retained is not None and last_weight is not None and retained(t):
                    last = last_weight                         # kept by I until W is done
                if last is not None:
                    moved.setdefault(last, []).append(t)      # all of W runs after all of I
                else:
                    stays.append(t)
            elif last is not None or previous_input < 0:
                stays.append(t)      # read or written in W (k is its last W user), or no earlier I op to carry it
            else:
                moved.setdefault(previous_input, []).append(t)
        kept.append(tuple(stays))
        if not deferred[k]:
            previous_input = k
    rebuilt = []
    for k, op in enumerate(ops):
        frees = kept[k] + tuple(moved.get(k, ()))
        rebuilt.append(op if frees == op.frees else replace(op, frees=frees))
    inputs = [k for k in range(len(ops)) if not deferred[k]]
    weights = [k for k in range(len(ops)) if deferred[k]]
    return WeightSplit(tuple(rebuilt[k] for k in inputs), tuple(rebuilt[k] for k in weights),
                       tuple(inputs + weights))
