"""Symbolic autograd: record forward ops with what they save, then derive backward, recompute and frees.

A model builder records forward nodes on a `Tape` the way PyTorch's autograd records them: each node
names its input and output storages, the storages it saves for backward, and the backward kernels
that produce gradients for its inputs. `Tape.finish()` replays the tape as PyTorch executes it and
returns the ops of one micro-batch with exact allocation and free points:

* a forward storage is freed when both its Python life (last forward use, or an explicit `hold`) and
  every saved reference to it (released right after the saving node's backward) have ended;
* backward nodes run in reverse creation order; a gradient arriving at a storage that already has a
  gradient is accumulated in place (autograd's InputBuffer) and the newcomer freed;
* checkpointed regions (non-reentrant `torch.utils.checkpoint`) keep only their inputs in forward
  and replay their forward ops right before the backward of their last saving node, stopping early
  after the last op that saves something (torch's early stop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from simulator.workload.graph import ACTIVATIONS, BACKWARD_INPUT, DTYPE_BYTES, OTHER, Op, Tensor, slot_constructor


FLOAT_DTYPES = ("fp32", "bf16", "fp16")


def numel(shape: tuple[int, ...]) -> int:
    """Number of elements of a shape."""
    count = 1
    for dim in shape:
        count *= dim
    return count


@dataclass(frozen=True, slots=True)
class Ref:
    """A handle to a symbolic storage on the tape."""

    id: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * DTYPE_BYTES[self.dtype]


# Ref(id, shape, dtype) built fast (workload/graph.py slot_constructor): a builder makes one per tensor it records.
_new_ref = slot_constructor(Ref, ("id", "shape", "dtype"))


@dataclass(frozen=True)
class Grad:
    """A gradient a backward kernel produces for input `index` of its node.

    `alias` = the index of a node output whose gradient is passed through unchanged (no allocation,
    e.g. the backward of an addition); otherwise a new storage of `shape`/`dtype` (default: the
    input's) is allocated.
    """

    index: int
    alias: int | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class Kernel:
    """One backward kernel of a node: its cost, the gradients it produces and its transient workspace."""

    suffix: str
    op_class: str
    flops: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    dtype: str = "fp32"
    gemm_mnk: tuple[int, int, int] | None = None
    gemm_batch: int = 1
    grads: tuple[Grad, ...] = ()
    workspace: tuple[tuple[tuple[int, ...], str], ...] = ()   # (shape, dtype) transients
    phase: str = BACKWARD_INPUT


@dataclass
class _Node:
    index: int
    name: str
    op_class: str
    flops: float
    bytes_read: int
    bytes_written: int
    dtype: str
    gemm_mnk: tuple[int, int, int] | None
    gemm_batch: int
    inputs: tuple[Ref, ...]
    outputs: tuple[Ref, ...]
    saved: tuple[Ref, ...]
    workspace: tuple[tuple[tuple[int, ...], str], ...]
    kernels: tuple[Kernel, ...]
    region: int
    layer: int


@dataclass
class _Storage:
    ref: Ref
    name: str
    category: str
    requires_grad: bool
    is_param: bool = False
    last_forward_use: int = -1       # node index after which its Python reference is gone
    producer: int = -1               # node index that produced it (-1: input or parameter)
    base: int | None = None          # for a view: the id of the storage it looks into


@dataclass
class _Region:
    nodes: list[int] = field(default_factory=list)
    inputs: tuple[Ref, ...] = ()


class Tape:
    """Records the forward of one micro-batch; `finish()` turns it into ordered ops with memory events."""

    def __init__(self, microbatch: int = 0, first_tensor_id: int = 0, compress_saved: bool = False,
                 rng_state_bytes: int = 0):
        self.microbatch = microbatch
        self.compress_saved = compress_saved
        self.rng_state_bytes = rng_state_bytes
        # Whether autograd adds a second incoming gradient in place into a buffer only it holds (set by Ops
        # from the device: measured in place on CUDA, torch 2.11; out of place on CPU, torch 2.13).
        self.inplace_grad_accumulation = False
        self.saver = None      # save_on_cpu's pack/unpack hooks (offload/activations.py HostSaver), None: none
        self._next_id = first_tensor_id
        self._nodes: list[_Node] = []
        self._storages: dict[int, _Storage] = {}
        self._regions: list[_Region] = []
        self._open_region: int = -1
        self.layer = -1

    # ------------------------------------------------------------------ recording
    def storage(self, name: str, shape: tuple[int, ...], dtype: str, category: str = OTHER,
                requires_grad: bool = False, is_param: bool = False) -> Ref:
        """Declare a storage that exists before the micro-batch (parameter, input, buffer)."""
        ref = Ref(self._next_id, tuple(shape), dtype)
        self._next_id += 1
        self._storages[ref.id] = _Storage(ref, name, category, requires_grad, is_param)
        return ref

    def node(self, name: str, op_class: str, inputs: tuple[Ref, ...],
             outputs: tuple[tuple[str, tuple[int, ...], str], ...], *,
             saves: tuple[Ref | int, ...] = (), flops: float = 0.0, bytes_read: int | None = None,
             bytes_written: int | None = None, dtype: str = "fp32",
             gemm_mnk: tuple[int, int, int] | None = None, gemm_batch: int = 1,
             workspace: tuple[tuple[tuple[int, ...], str], ...] = (),
             backward: tuple[Kernel, ...] = (), requires_grad: bool | None = None,
             category: str = ACTIVATIONS) -> tuple[Ref, ...]:
        """Record one forward op. `outputs` are (name, shape, dtype); `saves` are input refs or output
        indices (ints) kept for backward. Returns the output refs."""
        index = len(self._nodes)
        grad_flows = any(self._storages[r.id].requires_grad for r in inputs) if requires_grad is None \
            else requires_grad
        out_refs = []
        for out_name, shape, out_dtype in outputs:
            ref = _new_ref(self._next_id, tuple(shape), out_dtype)
            self._next_id += 1
            self._storages[ref.id] = _Storage(ref, out_name, category, grad_flows and bool(backward),
                                              producer=index, last_forward_use=index)
            out_refs.append(ref)
        # A node autograd does not record (no input needs a gradient, e.g. below frozen weights) saves nothing.
        saved = tuple(s if isinstance(s, Ref) else out_refs[s] for s in saves) if grad_flows and backward else ()
        for ref in inputs:
            self._use(ref.id, index)
        node = _Node(
            index, name, op_class, flops,
            sum(r.nbytes for r in inputs) if bytes_read is None else bytes_read,
            sum(r.nbytes for r in out_refs) if bytes_written is None else bytes_written,
            dtype, gemm_mnk, gemm_batch, tuple(inputs), tuple(out_refs), saved, tuple(workspace),
            tuple(backward) if grad_flows else (), self._open_region, self.layer)
        self._nodes.append(node)
        if self._open_region >= 0:
            self._regions[self._open_region].nodes.append(index)
        return tuple(out_refs)

    def _use(self, tid: int, index: int) -> None:
        storage = self._storages[tid]
        storage.last_forward_use = max(storage.last_forward_use, index)
        if storage.base is not None:
            self._use(storage.base, index)

    def hold(self, *refs: Ref) -> None:
        """Keep Python references alive up to the latest recorded op (a local living to scope end)."""
        last = len(self._nodes) - 1
        for ref in refs:
            self._use(ref.id, last)

    def view(self, x: Ref, shape: tuple[int, ...], name: str, grad_copies: bool = False,
             dtype: str | None = None) -> Ref:
        """A view of x (view/transpose/expand/slice): no memory; its gradient passes through as a
        view, or is copied into x's shape when `grad_copies` (reshape of a non-contiguous grad)."""
        (out,) = self.views(x, (shape,), name, cat_grad=grad_copies, dtype=dtype)
        return out

    def views(self, x: Ref, shapes: tuple[tuple[int, ...], ...], name: str, cat_grad: bool,
              dtype: str | None = None) -> tuple[Ref, ...]:
        """Several views of x (split/chunk); with `cat_grad` backward concatenates the gradients
        into one new buffer of x's shape (SplitBackward), else one view passes its grad through."""
        grads = (Grad(0),) if cat_grad else (Grad(0, alias=0),)
        kernel = Kernel("bwd", "copy", bytes_read=x.nbytes if cat_grad else 0,
                        bytes_written=x.nbytes if cat_grad else 0, dtype=x.dtype, grads=grads)
        outs = self.node(name, "copy", (x,), tuple((f"{name}.{i}", sh, dtype or x.dtype)
                                                  for i, sh in enumerate(shapes)),
                         bytes_read=0, bytes_written=0, backward=(kernel,))
        root = self._storages[x.id].base
        root = x.id if root is None else root
        for ref in outs:
            self._storages[ref.id].base = root
        return outs

    def root(self, ref: Ref) -> int:
        """The id of the storage holding ref's memory (itself unless it is a view)."""
        base = self._storages[ref.id].base
        return ref.id if base is None else base

    def keep_until_end(self, *refs: Ref) -> None:
        """Keep references alive through the whole forward (e.g. the loss, the model's outputs)."""
        for ref in refs:
            self._storages[ref.id].last_forward_use = 1 << 60

    def begin_checkpoint(self, inputs: tuple[Ref, ...]) -> None:
        """Start a non-reentrant activation-checkpoint region whose saved inputs are `inputs`.

        torch.utils.checkpoint stashes the CPU RNG state (a tensor of `rng_state_bytes`, counted
        only when the device is the CPU) with the inputs until the region's backward is done.
        """
        if self.rng_state_bytes:
            (state,) = self.node("checkpoint.get_rng_state", "copy", (),
                                 (("checkpoint.rng_state", (self.rng_state_bytes,), "uint8"),),
                                 requires_grad=False, category=OTHER)
            inputs = tuple(inputs) + (state,)
        self._regions.append(_Region(inputs=tuple(inputs)))
        self._open_region = len(self._regions) - 1

    def end_checkpoint(self) -> None:
        """Close the open checkpoint region."""
        self._open_region = -1

    @property
    def next_tensor_id(self) -> int:
        return self._next_id

    def name_of(self, ref: Ref) -> str:
        return self._storages[ref.id].name

    # ------------------------------------------------------------------ replay
    def finish(self, loss: Ref, param_grad) -> tuple[list[Op], dict[int, Tensor]]:
        """Replay forward then backward; return the ops and every non-persistent tensor they use.

        `param_grad` is a `replay.ParamGradPolicy` (how parameter gradients land)."""
        from simulator.workload.replay import Replay

        return Replay(self, loss, param_grad).run()
