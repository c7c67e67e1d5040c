"""LoRA in plain torch on the reference models (no peft package): frozen base, adapters as PEFT's lora.Linear.

``apply_lora`` freezes every parameter, stores the frozen model in the compute dtype (bf16 under "bf16-mixed", as
PEFT users load a model with torch_dtype = bfloat16; float buffers follow, as ``Module.to`` does), and replaces each
targeted ``nn.Linear`` (a module whose dotted name ends with a target, PEFT's rule) by ``LoraLinear``:
``base(x) + lora_B(lora_A(dropout(x))) * (alpha / r)``, adapters in the build dtype (fp32 under bf16-mixed),
registered after the base layer. The optimizer then takes only the parameters that require gradients.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from simulator.errors import ScenarioError

LORA_KEYS = ("peft", "lora_rank", "lora_alpha", "lora_target_modules", "lora_dropout")
DEFAULT_TARGETS = {"llama": ("q_proj", "v_proj"), "gpt": ("c_attn",)}


@dataclass(frozen=True)
class LoraSpec:
    """The adapters of a measured configuration (memsim's training.peft and lora_* keys)."""

    rank: int = 8
    alpha: float = 8.0
    targets: tuple[str, ...] = ("auto",)
    dropout: float = 0.0


def parse_lora(training: Mapping[str, object]) -> LoraSpec | None:
    """The LoraSpec of a [training] table with peft = "lora", None without peft.

    Raises:
        ScenarioError: peft other than none / lora (the CPU has no 4-bit kernels), or a bad lora_* value.
    """
    peft = training.get("peft", "none")
    if peft == "none":
        return None
    if peft != "lora":
        raise ScenarioError(f"training.peft = {peft!r}: the CPU reference measures lora only (QLoRA's NF4 kernels "
                            f"need a GPU)")
    rank = training.get("lora_rank", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ScenarioError(f"training.lora_rank = {rank!r} must be a positive integer")
    targets = training.get("lora_target_modules", ("auto",))
    targets = tuple(targets.split(",")) if isinstance(targets, str) else tuple(targets)
    return LoraSpec(rank, float(training.get("lora_alpha", 8.0)), targets, float(training.get("lora_dropout", 0.0)))


class LoraLinear(nn.Module):
    """PEFT's lora.Linear forward: the frozen base layer plus the scaled low-rank update."""

    def __init__(self, base: nn.Linear, spec: LoraSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(base.in_features, spec.rank, bias=False, dtype=dtype)
        self.lora_B = nn.Linear(spec.rank, base.out_features, bias=False, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=5 ** 0.5)
        nn.init.zeros_(self.lora_B.weight)            # PEFT's init: the update starts at zero
        self.scaling = spec.alpha / spec.rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)                   # frozen: saves only the weight (for x's gradient)
        # allocs: dropout out (+ mask) if p > 0, A out (b,s,r), B out (b,s,out), scaled, sum.
        return result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def apply_lora(model: nn.Module, architecture: str, spec: LoraSpec, precision: str) -> nn.Module:
    """Freeze `model`, move it to the compute dtype and wrap its targeted linears (module docstring)."""
    adapter_dtype = next(model.parameters()).dtype
    for param in model.parameters():
        param.requires_grad_(False)
    if precision == "bf16-mixed":
        model.to(torch.bfloat16)
    targets = DEFAULT_TARGETS[architecture] if spec.targets == ("auto",) else spec.targets
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if targets == ("all-linear",):          # PEFT: every linear but the output layer
        wrapped = [name for name in linears if name != "lm_head"]
    else:
        wrapped = [name for name in linears if any(name == t or name.endswith("." + t) for t in targets)]
    if not wrapped:
        raise ScenarioError(f"training.lora_target_modules = {list(targets)} names no linear of the model")
    for name in wrapped:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoraLinear(getattr(parent, child), spec, adapter_dtype))
    return model
