"""DLRM (Naumov et al. 2019) recorded op by op on a tape, as facebookresearch/dlrm's dlrm_s_pytorch.py runs it.

Bottom MLP over the dense features (Linear + ReLU per layer), one sum-pooled EmbeddingBag per categorical feature,
the dot interaction (T = cat([x] + embeddings).view(b, T+1, d); Z = bmm(T, Tᵀ); the strictly lower triangle
Z[:, li, lj]; R = cat([x, Zflat])), the top MLP (Linear + ReLU, a sigmoid after the last layer) and BCELoss.
ReLUs are not in place (dlrm's create_mlp uses nn.ReLU()), so each saves its own output.

`embedding_placement`:
* "device": the tables are GPU parameters with dense gradients (torch's nn.EmbeddingBag(sparse=False) default; the
  sparse-gradient variant dlrm selects with sparse=True is not simulated).
* "host": the tables live in host memory (the article's "CPU embedding layer"). The host gathers and pools the
  looked-up rows, the pooled (b, T·d) vectors are copied to the GPU before the interaction, their gradient back
  after its backward, and the host scatters it into the looked-up rows and updates them (simulator/offload/
  embeddings.py makes those transfers and host kernels; here the pooled vectors are a leaf that needs a gradient).
Not checked against torch (validation/ has no DLRM reference).
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.errors import PlanError
from simulator.workload.graph import BACKWARD_WEIGHT, DTYPE_BYTES, EMBEDDING, ELEMENTWISE, OTHER
from simulator.workload.primitives import Ops
from simulator.workload.tape import Grad, Kernel, Ref, numel
from simulator.workload.model_parts import Checkpointing, Params

PLACEMENTS = ("device", "host")


@dataclass(frozen=True)
class DLRMShape:
    """A DLRM's dimensions (resolved from [model]: simulator/scenario/dlrm_model.py)."""

    rows: tuple[int, ...]            # rows of each embedding table
    dim: int                         # embedding dimension d (the bottom MLP's output width)
    lookups: int                     # indices pooled per table and sample (1: one-hot features)
    dense: int                       # dense input features
    bottom: tuple[int, ...]          # bottom MLP widths (the last equals dim)
    top: tuple[int, ...]             # top MLP widths (the last is 1)
    placement: str = "device"        # device | host

    @property
    def tables(self) -> int:
        return len(self.rows)

    @property
    def interactions(self) -> int:
        """Pairs of the dot interaction: (T + 1) · T / 2 for T tables and the dense vector."""
        return (self.tables + 1) * self.tables // 2

    @property
    def table_elements(self) -> int:
        return sum(self.rows) * self.dim


class DLRMBuilder:
    """Declares a DLRM's parameters (dlrm's registration order: tables, bottom MLP, top MLP) and records one
    micro-batch's forward; the same interface as TransformerBuilder for a whole model on one stage."""

    def __init__(self, ops: Ops, shape, param_dtype: str, checkpointing: Checkpointing, micro_batch: int):
        d: DLRMShape = shape.dlrm
        if checkpointing.mode != "none":
            raise PlanError(f"training.recompute = {checkpointing.mode!r}: a DLRM is not checkpointed; allowed: none")
        self.ops, self.tape, self.d, self.pdt, self.b = ops, ops.tape, d, param_dtype, micro_batch
        self.params = Params([], [])
        self.buffers: list[Ref] = []
        self.tables: list[Ref] = []
        if d.placement == "device":
            self.tables = [self.params.add(ops, f"emb_l.{k}.weight", (rows, d.dim), param_dtype)
                           for k, rows in enumerate(d.rows)]
        self.bottom = self._mlp("bot_l", (d.dense,) + d.bottom)
        self.top = self._mlp("top_l", (d.dim + d.interactions,) + d.top)
        self.pooled: Ref | None = None        # host placement: the pooled embeddings copied in each micro-batch

    def _mlp(self, prefix: str, widths: tuple[int, ...]) -> list[tuple[Ref, Ref]]:
        layers = []
        for k, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
            layers.append((self.params.add(self.ops, f"{prefix}.{2 * k}.weight", (n_out, n_in), self.pdt),
                           self.params.add(self.ops, f"{prefix}.{2 * k}.bias", (n_out,), self.pdt)))
        return layers

    # ------------------------------------------------------------------ forward
    def inputs(self) -> tuple[Ref, ...]:
        """The micro-batch's inputs: dense features, the indices and offsets of every table, the labels (and, with
        host placement, the pooled embeddings the host sends)."""
        t, d, b = self.tape, self.d, self.b
        dense = t.storage("dense_x", (b, d.dense), self.pdt, OTHER)
        indices = t.storage("lS_i", (d.tables, b * d.lookups), "int64", OTHER)
        offsets = t.storage("lS_o", (d.tables, b), "int64", OTHER)
        labels = t.storage("labels", (b, 1), self.pdt, OTHER)
        refs = (dense, indices, offsets, labels)
        if d.placement == "host":
            self.pooled = t.storage("embeddings.from_host", (b, d.tables * d.dim), self.pdt, OTHER, requires_grad=True)
            refs += (self.pooled,)
        return refs

    def forward(self, inputs: tuple[Ref, ...], _targets=None) -> Ref:
        ops, tape, d, b = self.ops, self.tape, self.d, self.b
        dense, indices, offsets, labels = inputs[:4]
        x = self._run_mlp(dense, self.bottom, "bot_l", sigmoid=False)
        if d.placement == "device":
            pooled = [self._embedding_bag(table, indices, offsets, k) for k, table in enumerate(self.tables)]
        else:
            pooled = [self.pooled]
        width = (d.tables + 1) * d.dim
        cat = ops.cat((x, *pooled), (b, width), "interaction.cat")
        tri = tape.view(cat, (b, d.tables + 1, d.dim), "interaction.view")
        tri_t = tape.view(tri, (b, d.dim, d.tables + 1), "interaction.transpose")
        z = ops.bmm(tri, tri_t, (b, d.tables + 1, d.tables + 1), b, d.tables + 1, d.tables + 1, d.dim,
                    "interaction.bmm")
        flat = self._lower_triangle(z)
        r = ops.cat((x, flat), (b, d.dim + d.interactions), "interaction.cat_dense")
        p = self._run_mlp(r, self.top, "top_l", sigmoid=True)
        loss = self._bce(p, labels)
        tape.hold(x, cat, z, flat, r, p)   # dlrm's forward and interact_features keep these locals to the end
        return loss

    def _run_mlp(self, x: Ref, layers: list[tuple[Ref, Ref]], prefix: str, sigmoid: bool) -> Ref:
        for k, (w, bias) in enumerate(layers):
            x = self.ops.linear(x, w, bias, f"{prefix}.{2 * k}")
            last = k == len(layers) - 1
            if last and sigmoid:
                x = self.ops.unary(x, f"{prefix}.{2 * k + 1}.sigmoid", 4.0, save_output=True)
            else:
                x = self.ops.unary(x, f"{prefix}.{2 * k + 1}.relu", 1.0, save_output=True)
        return x

    def _embedding_bag(self, table: Ref, indices: Ref, offsets: Ref, k: int) -> Ref:
        """EmbeddingBag(mode="sum") on table k: the (b, d) sums; saves the indices, offsets and the offset2bag and
        bag_size index tensors it makes; backward allocates a dense (rows, d) gradient."""
        d, b = self.d, self.b
        n = b * d.lookups
        e = DTYPE_BYTES[table.dtype]
        name = f"emb_l.{k}"
        kernel = Kernel("bwd", EMBEDDING, flops=n * d.dim, bytes_read=b * d.dim * e + n * 8,
                        bytes_written=table.nbytes, dtype=table.dtype, grads=(Grad(0),), phase=BACKWARD_WEIGHT)
        out, _offset2bag, _bag_size = self.tape.node(
            name, EMBEDDING, (table, indices, offsets),
            ((name, (b, d.dim), table.dtype), (f"{name}.offset2bag", (n,), "int64"), (f"{name}.bag_size", (b,), "int64")),
            saves=(indices, offsets, 1, 2), flops=n * d.dim, dtype=table.dtype,
            bytes_read=n * d.dim * e + n * 8 + b * 8, bytes_written=b * d.dim * e, backward=(kernel,))
        return out

    def _lower_triangle(self, z: Ref) -> Ref:
        """Z[:, li, lj] with li, lj the strictly lower triangle (two int64 index tensors made each forward, saved):
        a gather; its backward scatters into a zeroed gradient of Z's shape."""
        d, b = self.d, self.b
        pairs = d.interactions
        (li,) = self.tape.node("interaction.li", ELEMENTWISE, (), (("interaction.li", (pairs,), "int64"),),
                               requires_grad=False)
        (lj,) = self.tape.node("interaction.lj", ELEMENTWISE, (), (("interaction.lj", (pairs,), "int64"),),
                               requires_grad=False)
        e = DTYPE_BYTES[z.dtype]
        kernel = Kernel("bwd", ELEMENTWISE, flops=b * pairs, bytes_read=b * pairs * e + 2 * pairs * 8,
                        bytes_written=z.nbytes, dtype=z.dtype, grads=(Grad(0),))
        (flat,) = self.tape.node("interaction.index", ELEMENTWISE, (z, li, lj),
                                 (("interaction.zflat", (b, pairs), z.dtype),), saves=(li, lj),
                                 flops=b * pairs, dtype=z.dtype, bytes_read=b * pairs * e + 2 * pairs * 8,
                                 bytes_written=b * pairs * e, backward=(kernel,))
        return flat

    def _bce(self, p: Ref, labels: Ref) -> Ref:
        """nn.BCELoss() (mean): saves its input and target; backward allocates the input's gradient."""
        n = numel(p.shape)
        kernel = Kernel("bwd", ELEMENTWISE, flops=4 * n, bytes_read=2 * p.nbytes, bytes_written=p.nbytes,
                        dtype=p.dtype, grads=(Grad(0),))
        (loss,) = self.tape.node("loss", ELEMENTWISE, (p, labels), (("loss", (), p.dtype),), saves=(p, labels),
                                 flops=4 * n, dtype=p.dtype, backward=(kernel,))
        return loss


def dlrm_parameter_count(shape) -> int:
    """Parameters of a DLRM, its embedding tables included wherever they are placed."""
    d: DLRMShape = shape.dlrm
    widths = [(d.dense,) + d.bottom, (d.dim + d.interactions,) + d.top]
    return d.table_elements + sum(a * b + b for w in widths for a, b in zip(w, w[1:]))
