"""Reference torch ResNet (torchvision's layout written out in plain torch.nn; torchvision is not a dependency).

Statement by statement what `torchvision.models.resnet` (v1.5) runs, so that memsim's builder
(simulator/workload/resnet.py) can mirror its allocations: conv without bias → BatchNorm2d → ReLU(inplace=True)
(one module reused within a block, as torchvision does), `out += identity` in place, the downsample branch after
the main branch, AdaptiveAvgPool2d(1) (on CPU and CUDA a `mean(-1, -2)`), flatten, a biased Linear, and the
cross-entropy inside forward (like the GPT and LLaMA references). Recompute "full" checkpoints each block,
"segments:N" uses checkpoint_sequential over the blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from simulator.errors import ScenarioError

BLOCKS = ("bottleneck", "basic")
_KEYS = ("architecture", "resnet_blocks", "resnet_block", "image_size", "num_channels", "num_classes")


@dataclass(frozen=True)
class ResNetSpec:
    """A ResNet's shape (memsim ModelConfig names)."""

    architecture: str
    resnet_blocks: tuple[int, ...]
    resnet_block: str
    image_size: int
    num_channels: int
    num_classes: int

    @property
    def num_layers(self) -> int:
        """Residual blocks (the units recompute checkpoints)."""
        return sum(self.resnet_blocks)


def _int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScenarioError(f"model.{key} = {value!r} must be a positive integer")
    return value


def parse_resnet(model: Mapping[str, object]) -> ResNetSpec:
    """Resolve a resnet ``[model]`` table.

    Raises:
        ScenarioError: an unknown key or a value out of range.
    """
    unknown = sorted(set(model) - set(_KEYS))
    if unknown:
        raise ScenarioError(f"model.{unknown[0]} is not a key the torch ResNet knows; allowed: {', '.join(_KEYS)}")
    blocks = model.get("resnet_blocks", [3, 4, 6, 3])
    if not isinstance(blocks, (list, tuple)) or not blocks:
        raise ScenarioError(f"model.resnet_blocks = {blocks!r} must be a non-empty list of positive integers")
    kind = model.get("resnet_block", "bottleneck")
    if kind not in BLOCKS:
        raise ScenarioError(f"model.resnet_block = {kind!r} must be one of {', '.join(BLOCKS)}")
    return ResNetSpec("resnet", tuple(_int("resnet_blocks", n) for n in blocks), str(kind),
                      _int("image_size", model.get("image_size", 224)), _int("num_channels", model.get("num_channels", 3)),
                      _int("num_classes", model.get("num_classes", 1000)))


class Bottleneck(nn.Module):
    """torchvision Bottleneck: 1x1 → 3x3 (stride) → 1x1 (4x wider), each followed by BatchNorm2d."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, downsample: nn.Module | None) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))      # conv1 saves x; bn1 saves conv1's output; relu_ its own
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity                                # in place: nothing allocated, nothing saved
        return self.relu(out)


class BasicBlock(nn.Module):
    """torchvision BasicBlock: 3x3 (stride) → 3x3, each followed by BatchNorm2d."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int, downsample: nn.Module | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision ResNet: 7x7/2 stem, 3x3/2 max-pool, four stages, global average pool, fc; loss in forward."""

    def __init__(self, spec: ResNetSpec, recompute: str) -> None:
        super().__init__()
        block = Bottleneck if spec.resnet_block == "bottleneck" else BasicBlock
        self.recompute = recompute
        self.conv1 = nn.Conv2d(spec.num_channels, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        blocks: list[nn.Module] = []
        cin = 64
        for i, count in enumerate(spec.resnet_blocks):
            width, stride = 64 * 2 ** i, 1 if i == 0 else 2
            stage = []
            for j in range(count):
                s = stride if j == 0 else 1
                cout = width * block.expansion
                down = None
                if s != 1 or cin != cout:
                    down = nn.Sequential(nn.Conv2d(cin, cout, 1, s, bias=False), nn.BatchNorm2d(cout))
                stage.append(block(cin, width, s, down))
                cin = cout
            blocks.append(nn.Sequential(*stage))
        # Registered as layer1..layerN, like torchvision (parameter order follows).
        for i, stage in enumerate(blocks):
            self.add_module(f"layer{i + 1}", stage)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, spec.num_classes)

    def forward(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from validation.torch_models import run_blocks

        x = self.maxpool(self.relu(self.bn1(self.conv1(images))))
        blocks = nn.Sequential(*(b for name, stage in self.named_children() if name.startswith("layer")
                                 for b in stage))
        x = run_blocks(blocks, x, self.recompute)
        logits = self.fc(torch.flatten(self.avgpool(x), 1))
        return F.cross_entropy(logits, targets)


def make_images(spec: ResNetSpec, training_spec) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images (b, C, H, W) in the default dtype and int64 class targets (b,)."""
    b, side = training_spec.micro_batch_size, spec.image_size
    from validation.torch_models import BUILD_DTYPES

    images = torch.randn(b, spec.num_channels, side, side, dtype=BUILD_DTYPES[training_spec.precision])
    targets = torch.randint(0, spec.num_classes, (b,), dtype=torch.long)
    return images, targets
