"""ResNet (He et al. 2016, torchvision's layout) recorded op by op on a tape: stem, residual stages, pooled head.

Mirrors `torchvision.models.resnet` (v1.5: the stride sits on the 3x3 conv of a bottleneck) statement by
statement, as validation/torch_models.py writes it out: conv (no bias) → batch norm → in-place ReLU, `out +=
identity` in place, the downsample branch (1x1 conv with the block's stride + batch norm) run after the main
branch, then max-pool, global average pool, flatten and a biased fully connected layer into cross-entropy.
Blocks are the builder's layers: `training.recompute = "full"` checkpoints each block, `"segments:N"` groups
them as `checkpoint_sequential` does.
"""

from __future__ import annotations

from simulator.errors import PlanError
from simulator.workload.conv_ops import add_, batch_norm, conv2d, global_avg_pool, max_pool2d, relu_
from simulator.workload.primitives import Ops
from simulator.workload.tape import Ref
from simulator.workload.model_parts import Checkpointing, Params, Shape

STEM_WIDTH = 64          # torchvision: conv1 has 64 output channels; stage i's width is 64 * 2**i
EXPANSION = {True: 4, False: 1}   # bottleneck blocks widen their output 4x; basic blocks keep it


def resnet_stages(shape: Shape) -> list[tuple[int, int, int]]:
    """(width, blocks, first stride) per stage."""
    return [(STEM_WIDTH * 2 ** i, n, 1 if i == 0 else 2) for i, n in enumerate(shape.resnet_blocks)]


class ResNetBuilder:
    """Declares a ResNet's parameters and buffers (torchvision's registration order) and records one micro-batch's
    forward (the same interface as TransformerBuilder for a whole model on one pipeline stage)."""

    def __init__(self, ops: Ops, shape: Shape, param_dtype: str, checkpointing: Checkpointing, micro_batch: int):
        if not shape.resnet_blocks:
            raise PlanError("model.resnet_blocks is empty: a ResNet needs at least one stage")
        self.ops = ops
        self.tape = ops.tape
        self.m = shape
        self.pdt = param_dtype
        self.ckpt = checkpointing
        self.b = micro_batch
        self.params = Params([], [])
        self.buffers: list[Ref] = []
        self.bottleneck = shape.resnet_bottleneck
        self.top: dict[str, Ref] = {}
        self.blocks: list[dict[str, object]] = []
        self._declare()

    # ------------------------------------------------------------------ parameters
    def _p(self, name: str, shape: tuple[int, ...]) -> Ref:
        return self.params.add(self.ops, name, shape, self.pdt)

    def _conv(self, name: str, cin: int, cout: int, k: int) -> Ref:
        return self._p(f"{name}.weight", (cout, cin, k, k))

    def _bn(self, name: str, channels: int) -> tuple[Ref, Ref]:
        w, b = self._p(f"{name}.weight", (channels,)), self._p(f"{name}.bias", (channels,))
        # Buffers follow the parameters in state_dict order; they exist before the step (category other).
        self.buffers += [self.ops.buffer(f"{name}.running_mean", (channels,), self.pdt),
                         self.ops.buffer(f"{name}.running_var", (channels,), self.pdt),
                         self.ops.buffer(f"{name}.num_batches_tracked", (), "int64")]
        return w, b

    def _declare(self) -> None:
        m = self.m
        self.top["conv1"] = self._conv("conv1", m.channels, STEM_WIDTH, 7)
        self.top["bn1"] = self._bn("bn1", STEM_WIDTH)
        cin = STEM_WIDTH
        expansion = EXPANSION[self.bottleneck]
        for s, (width, count, stride) in enumerate(resnet_stages(m)):
            for i in range(count):
                pre = f"layer{s + 1}.{i}"
                block_stride = stride if i == 0 else 1
                cout = width * expansion
                block: dict[str, object] = {"stride": block_stride, "name": pre}
                if self.bottleneck:
                    block["conv1"] = self._conv(f"{pre}.conv1", cin, width, 1)
                    block["bn1"] = self._bn(f"{pre}.bn1", width)
                    block["conv2"] = self._conv(f"{pre}.conv2", width, width, 3)
                    block["bn2"] = self._bn(f"{pre}.bn2", width)
                    block["conv3"] = self._conv(f"{pre}.conv3", width, cout, 1)
                    block["bn3"] = self._bn(f"{pre}.bn3", cout)
                else:
                    block["conv1"] = self._conv(f"{pre}.conv1", cin, width, 3)
                    block["bn1"] = self._bn(f"{pre}.bn1", width)
                    block["conv2"] = self._conv(f"{pre}.conv2", width, width, 3)
                    block["bn2"] = self._bn(f"{pre}.bn2", width)
                if block_stride != 1 or cin != cout:
                    block["down_conv"] = self._conv(f"{pre}.downsample.0", cin, cout, 1)
                    block["down_bn"] = self._bn(f"{pre}.downsample.1", cout)
                self.blocks.append(block)
                cin = cout
        self.features = cin
        self.top["fc_w"] = self._p("fc.weight", (m.classes, cin))
        self.top["fc_b"] = self._p("fc.bias", (m.classes,))

    # ------------------------------------------------------------------ forward
    def forward(self, pixels: Ref, targets: Ref) -> Ref:
        """Record the forward and loss of one micro-batch; returns the loss ref."""
        ops, tape = self.ops, self.tape
        x = self._conv_bn(pixels, self.top["conv1"], self.top["bn1"], 2, 3, "conv1", "bn1")
        x = relu_(ops, x, "relu")
        x = max_pool2d(ops, x, 3, 2, 1, "maxpool")
        regions = dict(self.ckpt.block_regions(len(self.blocks)))
        closing: int | None = None
        for i, block in enumerate(self.blocks):
            tape.layer = i
            if i in regions:
                tape.begin_checkpoint((x,))
                closing = regions[i]
            x = self._block(block, x)
            if closing == i:
                tape.end_checkpoint()
                closing = None
        tape.layer = -1
        pooled = global_avg_pool(ops, x, "avgpool")
        logits = ops.linear(pooled, self.top["fc_w"], self.top["fc_b"], "fc")
        loss = ops.cross_entropy(logits, targets, "loss")
        tape.hold(pixels, x, logits)       # the forward's argument and locals live until it returns
        return loss

    def _conv_bn(self, x: Ref, w: Ref, bn: tuple[Ref, Ref], stride: int, padding: int, conv_name: str,
                 bn_name: str) -> Ref:
        y = conv2d(self.ops, x, w, stride, padding, conv_name)
        return batch_norm(self.ops, y, bn[0], bn[1], bn_name)

    def _block(self, block: dict[str, object], x: Ref) -> Ref:
        ops, pre, stride = self.ops, block["name"], block["stride"]
        if self.bottleneck:
            out = relu_(ops, self._conv_bn(x, block["conv1"], block["bn1"], 1, 0, f"{pre}.conv1", f"{pre}.bn1"),
                        f"{pre}.relu1")
            out = relu_(ops, self._conv_bn(out, block["conv2"], block["bn2"], stride, 1, f"{pre}.conv2",
                                           f"{pre}.bn2"), f"{pre}.relu2")
            out = self._conv_bn(out, block["conv3"], block["bn3"], 1, 0, f"{pre}.conv3", f"{pre}.bn3")
        else:
            out = relu_(ops, self._conv_bn(x, block["conv1"], block["bn1"], stride, 1, f"{pre}.conv1",
                                           f"{pre}.bn1"), f"{pre}.relu1")
            out = self._conv_bn(out, block["conv2"], block["bn2"], 1, 1, f"{pre}.conv2", f"{pre}.bn2")
        identity = x
        if "down_conv" in block:
            identity = self._conv_bn(x, block["down_conv"], block["down_bn"], stride, 0, f"{pre}.downsample.0",
                                     f"{pre}.downsample.1")
        out = add_(ops, out, identity, f"{pre}.add")
        out = relu_(ops, out, f"{pre}.relu3")
        self.tape.hold(x, identity)        # the block's argument and `identity` live until it returns
        return out


def resnet_parameter_count(shape: Shape) -> int:
    """Parameters of a ResNet as its builder declares them."""
    from simulator.workload.primitives import KernelProfile
    from simulator.workload.tape import Tape, numel

    builder = ResNetBuilder(Ops(Tape(), KernelProfile()), shape, "fp32", Checkpointing(), 1)
    return sum(numel(ref.shape) for ref in builder.params.refs)
