"""Exact storage-level memory tracker for one torch training step: an ordered allocation/free timeline.

A ``TorchDispatchMode`` sees every aten op's outputs; each *new* storage (keyed by its untyped
storage's data_ptr) is one allocation of ``storage.nbytes()`` bytes, and a ``weakref.finalize`` on
the storage records its release. Views and in-place ops add nothing. Storages alive before the
step (parameters, gradients, buffers, optimizer states, inputs) are enumerated on entry; a storage
first seen as an op *input* (made outside the dispatcher) is counted from that op, as
``aten.<op>:input``.

Blind spots: memory a kernel allocates and frees inside one op (CPU scratch buffers), and Python
scalars that autograd saves as wrapped 8-byte tensors (``t * 0.125`` on a tensor that requires grad;
the dispatch mode receives a float) -- validation.torch_models avoids that pattern. The CPU
RNG-state tensor that ``torch.utils.checkpoint`` stashes (5,056 bytes, made outside the dispatcher)
is seen by wrapping ``torch.get_rng_state`` while the tracker is active: op name
``torch.get_rng_state``, category other (host-side state, not device memory on a GPU).

Determinism: Python's cyclic garbage collector is disabled during the step, so every release
happens by reference counting at a fixed point; runs of consecutive releases are put in
storage-index order (torch frees some groups, e.g. autocast's weight-cast cache, in hash-map
order); a ``gc.collect()`` at exit reports what reference cycles held (``cycle_garbage_bytes``,
0 in every measured configuration).

Phases: "setup" (alive before the step), "forward", "recompute" (module forwards replayed during
backward by checkpointing, detected with global module hooks), "backward", "optimizer", "zero_grad".
Categories, assigned after the step from storage identity (first match wins): parameters, gradients
(was some parameter's ``.grad``), optimizer_states (in ``optimizer.state``), activations (allocated
in forward or recompute), other.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from simulator.errors import MemsimError
from simulator.workload.graph import ACTIVATIONS, CATEGORIES, GRADIENTS, OPTIMIZER_STATES, OTHER, PARAMETERS

__all__ = ["PHASES", "StorageRecord", "TrackerEvent", "TrackedStep", "MemoryTracker"]

SETUP, FORWARD, RECOMPUTE, BACKWARD, OPTIMIZER, ZERO_GRAD = (
    "setup", "forward", "recompute", "backward", "optimizer", "zero_grad")
PHASES = (SETUP, FORWARD, RECOMPUTE, BACKWARD, OPTIMIZER, ZERO_GRAD)
RNG_STATE_OP = "torch.get_rng_state"


@dataclass(frozen=True)
class StorageRecord:
    """One storage's life: size, dtype, the op/phase/module that allocated it, its category.

    ``op`` is ``aten.<name>`` for storages allocated during the step and ``setup.<kind>`` (param,
    grad, buffer, optimizer_state, input) for storages alive before it.
    """

    index: int
    nbytes: int
    dtype: str
    op: str
    phase: str
    module: str
    category: str


@dataclass(frozen=True)
class TrackerEvent:
    """An allocation (delta_bytes > 0) or a release (< 0) of storage ``storage``, in ``phase``."""

    seq: int
    delta_bytes: int
    storage: int
    phase: str


@dataclass(frozen=True)
class TrackedStep:
    """The timeline of one tracked step: storages (by index), ordered events and op counts per phase."""

    storages: tuple[StorageRecord, ...]
    events: tuple[TrackerEvent, ...]
    dispatched_ops: Mapping[str, Mapping[str, int]]
    cycle_garbage_bytes: int = 0   # freed only by the gc.collect() at exit (held by reference cycles)
    phase_starts: Mapping[str, int] | None = None   # phase -> number of events recorded before it began

    def peak(self) -> tuple[int, int]:
        """(peak live bytes, seq of the first event reaching it) over the event sequence."""
        live = peak = 0
        peak_seq = -1
        for event in self.events:
            live += event.delta_bytes
            if live > peak:
                peak, peak_seq = live, event.seq
        return peak, peak_seq

    def live_by_category_at(self, seq: int) -> dict[str, int]:
        """Live bytes per category (all CATEGORIES keys) just after event ``seq``."""
        live = {c: 0 for c in CATEGORIES}
        for event in self.events:
            if event.seq > seq:
                break
            live[self.storages[event.storage].category] += event.delta_bytes
        return live

    def category_peaks(self) -> dict[str, int]:
        """Each category's own peak of live bytes over the step (all CATEGORIES keys)."""
        live = {c: 0 for c in CATEGORIES}
        peaks = dict(live)
        for event in self.events:
            category = self.storages[event.storage].category
            live[category] += event.delta_bytes
            peaks[category] = max(peaks[category], live[category])
        return peaks

    def phase_peaks(self) -> dict[str, int]:
        """Peak of total live bytes within each phase, counting the level on entry (0 if never entered)."""
        starts = dict(self.phase_starts or {})
        live = 0
        peaks = {p: 0 for p in PHASES}
        for position, event in enumerate(self.events):
            for phase, start in starts.items():
                if start == position:
                    peaks[phase] = max(peaks[phase], live)
            live += event.delta_bytes
            peaks[event.phase] = max(peaks[event.phase], live)
        for phase, start in starts.items():
            if start == len(self.events):
                peaks[phase] = max(peaks[phase], live)
        return peaks

    def optimizer_implementation(self) -> str:
        """"fused", "foreach" or "single_tensor", from the aten ops dispatched in the optimizer phase."""
        ops = self.dispatched_ops.get(OPTIMIZER, {})
        if any(name.startswith("aten._fused_") for name in ops):
            return "fused"
        if any(name.startswith("aten._foreach_") for name in ops):
            return "foreach"
        return "single_tensor"


@dataclass(frozen=True)
class _Live:
    """Bookkeeping of one tracked storage: what StorageRecord holds, plus its release hook (private)."""

    index: int
    nbytes: int
    dtype: str
    op: str
    phase: str
    module: str
    finalizer: weakref.finalize


class MemoryTracker(TorchDispatchMode):
    """Record every storage allocated and released while active; see the module docstring.

    Usage::

        tracker = MemoryTracker(model, optimizer, {"idx": idx, "targets": targets})
        with tracker:
            train_step(..., on_phase=tracker.set_phase)
        step = tracker.result()
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 inputs: Mapping[str, torch.Tensor] | None = None, collect_garbage: bool = True) -> None:
        """Args:
            model: the module whose parameters, gradients and buffers are enumerated and named.
            optimizer: its optimizer (state tensors are enumerated and categorized), or None.
            inputs: other tensors alive before the step (token ids, targets), by name.
            collect_garbage: run a full ``gc.collect()`` on entry and exit (about 0.2 s each);
                without it ``cycle_garbage_bytes`` is not measured.
        """
        super().__init__()
        self._collect_garbage = collect_garbage
        self._model = model
        self._optimizer = optimizer
        self._inputs = dict(inputs or {})
        self._module_names = {id(m): name for name, m in model.named_modules()}
        self._by_key: dict[int, _Live] = {}     # data_ptr -> live storage
        self._records: list[_Live] = []         # by index, alive or not
        self._events: list[TrackerEvent] = []
        self._grad_indices: dict[int, None] = {}  # ordered set of storage indices that were a .grad
        self._dispatched: dict[str, dict[str, int]] = {}
        self._base_phase = SETUP
        self._phase_starts: dict[str, int] = {}
        self._recompute_depth = 0
        self._module_stack: list[tuple[str, bool]] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._active = False
        self._finished: TrackedStep | None = None
        self._gc_was_enabled = False
        self._original_get_rng_state = torch.get_rng_state

    # -- phases and module hooks -------------------------------------------------------------

    @property
    def phase(self) -> str:
        """The current phase; "recompute" while a module forward runs inside backward."""
        if self._base_phase == BACKWARD and self._recompute_depth > 0:
            return RECOMPUTE
        return self._base_phase

    def set_phase(self, phase: str) -> None:
        """Enter a phase (forward, backward, optimizer, zero_grad); snapshots gradients on the way."""
        if phase not in PHASES[1:] or phase == RECOMPUTE:
            raise MemsimError(f"tracker phase = {phase!r} must be one of forward, backward, optimizer, zero_grad")
        self._snapshot_grads()
        self._base_phase = phase
        self._phase_starts.setdefault(phase, len(self._events))

    def _pre_hook(self, mod: nn.Module, args: object) -> None:
        in_backward = self._base_phase == BACKWARD
        self._recompute_depth += int(in_backward)
        self._module_stack.append((self._module_names.get(id(mod), ""), in_backward))

    def _post_hook(self, mod: nn.Module, args: object, output: object) -> None:
        # always_call=True: also runs when forward raises (checkpoint's early stop of a recompute).
        if self._module_stack:
            _, counted = self._module_stack.pop()
            self._recompute_depth -= int(counted)

    # -- storage bookkeeping -----------------------------------------------------------------

    def _track(self, tensor: torch.Tensor, op: str) -> None:
        if tensor.device.type == "meta" or tensor.is_sparse:
            return
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        key = storage.data_ptr()
        if nbytes == 0 or key in self._by_key:
            return
        module = self._module_stack[-1][0] if self._module_stack else ""
        index = len(self._records)
        finalizer = weakref.finalize(storage, self._release, key, index)
        live = _Live(index, nbytes, str(tensor.dtype).removeprefix("torch."), op, self.phase, module, finalizer)
        self._by_key[key] = live
        self._records.append(live)
        self._events.append(TrackerEvent(len(self._events), nbytes, live.index, live.phase))

    def _release(self, key: int, index: int) -> None:
        live = self._by_key.get(key)
        if not self._active or live is None or live.index != index:
            return
        del self._by_key[key]
        self._events.append(TrackerEvent(len(self._events), -live.nbytes, index, self.phase))

    def _index_of(self, tensor: torch.Tensor) -> int | None:
        live = self._by_key.get(tensor.untyped_storage().data_ptr())
        return None if live is None else live.index

    def _snapshot_grads(self) -> None:
        for p in self._model.parameters():
            if p.grad is not None:
                index = self._index_of(p.grad)
                if index is not None:
                    self._grad_indices[index] = None

    def _setup_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        for p in self._model.parameters():
            yield "setup.param", p
            if p.grad is not None:
                yield "setup.grad", p.grad
        for b in self._model.buffers():
            yield "setup.buffer", b
        for t in _optimizer_tensors(self._optimizer):
            yield "setup.optimizer_state", t
        for t in self._inputs.values():
            yield "setup.input", t

    def _get_rng_state(self) -> torch.Tensor:
        """torch.get_rng_state, tracked: its tensor is made outside the dispatcher."""
        state = self._original_get_rng_state()
        if self._active:
            self._track(state, RNG_STATE_OP)
        return state

    # -- dispatch mode -----------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"aten.{func.overloadpacket.__name__}"
        # Inputs first: a storage never seen before was made outside the dispatcher (by Python code
        # or C++ that bypasses it); count it from its first use. None occur in the measured models.
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf, f"{name}:input")
        out = func(*args, **kwargs)
        counts = self._dispatched.setdefault(self.phase, {})
        counts[name] = counts.get(name, 0) + 1
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf, name)
        return out

    def __enter__(self) -> MemoryTracker:
        if self._active or self._finished is not None:
            raise MemsimError("tracker = already used; a MemoryTracker records exactly one step")
        if self._collect_garbage:
            gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        self._active = True
        for kind, tensor in self._setup_tensors():
            self._track(tensor, kind)
        torch.get_rng_state = self._get_rng_state
        self._hooks = [
            nn_module.register_module_forward_pre_hook(self._pre_hook),
            nn_module.register_module_forward_hook(self._post_hook, always_call=True),
        ]
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            torch.get_rng_state = self._original_get_rng_state
            for handle in self._hooks:
                handle.remove()
            self._snapshot_grads()
            before = len(self._events)
            if self._collect_garbage:
                gc.collect()  # frees recorded here were held by reference cycles (should be none)
            cycle_bytes = -sum(e.delta_bytes for e in self._events[before:])
            self._finished = self._finish(cycle_bytes)
            self._active = False
            for live in self._records:
                live.finalizer.detach()
            if self._gc_was_enabled:
                gc.enable()

    # -- results -----------------------------------------------------------------------------

    def _finish(self, cycle_garbage_bytes: int) -> TrackedStep:
        params = {i: None for i in map(self._index_of, self._model.parameters()) if i is not None}
        states = {i: None for i in map(self._index_of, _optimizer_tensors(self._optimizer)) if i is not None}
        setup_params = {r.index: None for r in self._records if r.op == "setup.param"}
        setup_states = {r.index: None for r in self._records if r.op == "setup.optimizer_state"}

        def category(r: _Live) -> str:
            if r.index in params or r.index in setup_params:
                return PARAMETERS
            if r.index in self._grad_indices:
                return GRADIENTS
            if r.index in states or r.index in setup_states:
                return OPTIMIZER_STATES
            if r.op == RNG_STATE_OP:
                return OTHER
            if r.phase in (FORWARD, RECOMPUTE):
                return ACTIVATIONS
            return OTHER

        storages = tuple(StorageRecord(r.index, r.nbytes, r.dtype, r.op, r.phase, r.module, category(r))
                         for r in self._records)
        dispatched = {phase: dict(ops) for phase, ops in self._dispatched.items()}
        events = _canonical_order(self._events, set(self._phase_starts.values()))
        return TrackedStep(storages, events, dispatched, cycle_garbage_bytes, dict(self._phase_starts))

    def result(self) -> TrackedStep:
        """The recorded step (available once the ``with`` block has exited)."""
        if self._finished is None:
            raise MemsimError("tracker = not finished; call result() after the with-block exits")
        return self._finished


def _canonical_order(events: list[TrackerEvent], boundaries: set[int]) -> tuple[TrackerEvent, ...]:
    """Sort each run of consecutive releases (same phase, no phase start inside) by storage index.

    torch releases some groups of storages in hash-map order (autocast's cache of weight casts at
    the end of the autocast region), which varies from run to run; the order inside a run of
    releases changes no peak, so sorting it makes the timeline reproducible. Seqs are renumbered.
    """
    ordered: list[TrackerEvent] = []
    run: list[TrackerEvent] = []
    for position, event in enumerate([*events, None]):
        if run and (event is None or event.delta_bytes > 0 or event.phase != run[0].phase
                    or position in boundaries):
            ordered.extend(sorted(run, key=lambda e: e.storage))
            run = []
        if event is not None and event.delta_bytes < 0:
            run.append(event)
        elif event is not None:
            ordered.append(event)
    return tuple(TrackerEvent(seq, e.delta_bytes, e.storage, e.phase) for seq, e in enumerate(ordered))


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor in optimizer.state (exp_avg, exp_avg_sq, step, momentum_buffer...), in order."""
    if optimizer is None:
        return []
    found = []
    for state in optimizer.state.values():
        found.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return found
