"""The model-level pieces every builder shares: Shape (a ModelConfig reduced to numbers), Params, Checkpointing."""

from __future__ import annotations

from dataclasses import dataclass

from simulator.workload.primitives import Ops
from simulator.workload.tape import Ref


@dataclass(frozen=True)
class Shape:
    """The dimensions a builder needs (a ModelConfig reduced to numbers)."""

    architecture: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    positions: int
    activation: str
    norm: str
    bias: bool
    attention: str
    dropout: float
    tied: bool
    post_norm: bool = False
    patch: int = 16
    channels: int = 3
    classes: int = 1000
    type_vocab: int = 2
    shared_layers: bool = False     # ALBERT: every layer uses the first layer's parameters
    linformer_k: int = 0            # attention "linformer": the projected sequence length
    mlp_sparsity: str = "none"      # "2:4": the MLP linears run torchao's SemiSparseLinear (workload/sparsity.py)
    resnet_blocks: tuple[int, ...] = ()   # resnet: residual blocks per stage (workload/resnet.py)
    resnet_bottleneck: bool = True        # resnet: bottleneck (1x1, 3x3, 1x1) blocks, else basic (3x3, 3x3)
    image: int = 224                      # resnet: input image side in pixels
    dlrm: object = None                   # dlrm: a workload.dlrm.DLRMShape

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass
class Params:
    """Parameter refs of the whole model, in module registration order (torch's parameters())."""

    refs: list[Ref]
    names: list[str]

    def add(self, ops: Ops, name: str, shape: tuple[int, ...], dtype: str) -> Ref:
        ref = ops.param(name, shape, dtype)
        self.refs.append(ref)
        self.names.append(name)
        return ref


@dataclass(frozen=True)
class Checkpointing:
    """Which regions are replayed in backward: 'none', 'selective', 'full' or 'segments:N'."""

    mode: str = "none"

    @property
    def selective(self) -> bool:
        return self.mode == "selective"

    def block_regions(self, num_layers: int) -> list[tuple[int, int]]:
        """(first, last) layer index of each checkpointed group of blocks."""
        if self.mode == "full":
            return [(i, i) for i in range(num_layers)]
        if self.mode.startswith("segments:"):
            segments = int(self.mode.split(":")[1])
            size = num_layers // segments
            if size == 0:
                return []        # fewer layers than segments (a short pipeline stage): no region
            # torch.utils.checkpoint.checkpoint_sequential: segments of `size` blocks, the last
            # segment (whatever remains) runs without checkpointing.
            return [(start, start + size - 1) for start in range(0, size * (segments - 1), size)]
        return []
