"""`DeviceSpec`: one accelerator or host CPU as memsim costs it (every number with its source), its checks and the
names of its sourced fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType

from simulator.errors import TopologyError

KINDS = ("gpu", "cpu")
FLOP_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
DROPOUT_MASK_DTYPES = ("bool", "input")
ALLOCATORS = ("caching", "exact")
ATTENTION_BACKENDS = ("cudnn", "flash2", "flash3")      # training.attention_backend's values besides "auto"
MEMORY_OP_CLASSES = ("elementwise", "norm", "softmax", "embedding", "copy", "optimizer")   # workload/graph.py's
# PCIe payload rate per lane and direction (GT/s x 128b/130b / 8 bits), PCI-SIG base specifications 3.0-5.0;
# x16: Gen4 31.5 GB/s, Gen5 63.0 GB/s as in shared/reference/hardware.md.
PCIE_BYTES_PER_S_PER_LANE = MappingProxyType({3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9})


@dataclass(frozen=True)
class DeviceSpec:
    """One compute device: capacities, rates, calibratable efficiencies and the kernel behaviour torch shows on it.

    Units are SI (bytes, bytes/s, FLOP/s, seconds, watts). `peak_flop_per_s` and `gemm_efficiency` are keyed
    by compute dtype ("fp32" is the CUDA-core / vector rate, "tf32"/"bf16"/"fp16"/"fp8" tensor-core rates);
    a dtype missing from `peak_flop_per_s` is unsupported and the cost model falls back (fp8 -> bf16).
    `source` maps each numeric field (dict entries as "field.key") to where its value comes from.
    The dict fields are plain dicts so specs pickle; treat them as read-only and use `with_overrides`.
    """

    name: str
    display_name: str
    kind: str
    memory_bytes: int                    # capacity torch reports (cudaDeviceProp.totalGlobalMem); host RAM for cpu
    hbm_bytes_per_s: float               # device-memory bandwidth (datasheet peak; measured copy for cpu)
    l2_bytes: int                        # last-level on-chip cache (L2; Infinity Cache on MI300X; L3 for cpu)
    l2_bytes_per_s: float
    sm_count: int                        # SMs / CUs (torch threads for cpu): the unit of wave quantization
    peak_flop_per_s: dict[str, float]
    launch_overhead_s: float             # added to every op: kernel launch / eager dispatch
    context_bytes: int                   # outside the allocator: CUDA/HIP context and lazily loaded kernels
    cublas_workspace_bytes: int          # torch's cuBLAS(+Lt) workspace per (handle, stream), inside the allocator
    tdp_w: float
    pcie_gen: int
    pcie_lanes: int
    nvlink_bytes_per_s_per_direction: float   # GPU-GPU fabric per direction (NVLink, Infinity Fabric); 0 if none
    gemm_efficiency: dict[str, float]    # fraction of peak a large GEMM of gemm_reference_mnk reaches, by dtype
    hbm_efficiency: float                # fraction of hbm_bytes_per_s a streaming kernel reaches
    attention_efficiency: float          # fraction of the tensor peak a fused attention kernel reaches
    gemm_tile_mn: int                    # output tile edge for tile/wave quantization
    gemm_k_overhead: int                 # per-tile fixed cost in units of k (pipeline fill): k/(k + this)
    gemm_reference_mnk: tuple[int, int, int]  # the shape at which gemm_efficiency was measured
    # Most of the tensor peak a GEMM reaches when its dimensions are aligned to 4 or 8 bytes only (half of it at
    # 2 bytes, a quarter at 1: hardware/cost.py gemm_unaligned_cap); 0: not modelled.
    gemm_unaligned_efficiency: float
    dropout_mask_dtype: str              # "bool": fused CUDA dropout saves 1 byte/element; "input": input's dtype
    sdpa_flash_with_dropout: bool        # SDPA keeps its flash kernel when dropout_p > 0
    default_allocator: str               # "caching" (PyTorch CUDA caching allocator) or "exact"
    optimizer_foreach: bool              # torch optimizers default to foreach (multi-tensor) kernels
    # Resident threads per SM: sizes the global staging buffer of torch's CUDA reductions (bias and norm-weight
    # gradients, simulator/workload/reductions.py); 0 where that buffer is not modelled (CPU, ROCm).
    max_threads_per_sm: int = 0
    # torch's autograd engine runs CUDA backward on its own thread, whose cuBLAS handle gets one more workspace.
    backward_workspace_bytes: int = 0
    # SMs a communication kernel (an NCCL collective, a userbuffers pipeline / bulk kernel) holds while a GEMM runs
    # beside it: the GEMM gets the rest (parallel/tp_overlap.py). 0: communication takes no SMs (the host).
    comm_kernel_sms: int = 0
    # Measured fraction of hbm_bytes_per_s by op class (hardware/cost.py); a class not listed uses hbm_efficiency.
    hbm_efficiency_by_class: dict[str, float] = field(default_factory=dict)
    # The fused-attention backend attention_efficiency was measured with (what torch's SDPA and Transformer Engine pick
    # on the GPU: training.attention_backend = "auto"), and each backend's rate relative to it ("": none, cpu).
    attention_backend: str = ""
    attention_backend_speed: dict[str, float] = field(default_factory=dict)
    # The host thread that launches the kernels (parallel/host_issue.py): seconds of host time per forward op, per
    # backward op, per checkpointed region and per tensor an optimizer op walks. 0: the host is the device (cpu).
    host_forward_op_s: float = 0.0
    host_backward_op_s: float = 0.0
    host_checkpoint_s: float = 0.0       # per checkpointed region (charged when its recompute starts)
    host_optimizer_tensor_s: float = 0.0
    # 2:4 semi-structured sparse GEMMs run at this multiple of the dense tensor rate (sparse tensor cores with
    # torch's CUTLASS / cuSPARSELt kernels); 1.0: none (training.sparsity = "2:4" is refused).
    sparse_gemm_speedup: float = 1.0
    source: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Validate every field; raise TopologyError naming the device, the field, the value and the rule."""
        def bad(key: str, value: object, rule: str) -> TopologyError:
            return TopologyError(f"device {self.name!r}: {key} = {value!r} {rule}")

        if not self.name or self.name != self.name.strip().lower():
            raise bad("name", self.name, "must be a non-empty lower-case key")
        if self.kind not in KINDS:
            raise bad("kind", self.kind, f"must be one of {', '.join(KINDS)}")
        for key in ("memory_bytes", "l2_bytes", "sm_count", "gemm_tile_mn"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise bad(key, value, "must be a positive integer")
        for key in ("context_bytes", "cublas_workspace_bytes", "pcie_gen", "pcie_lanes", "gemm_k_overhead",
                    "max_threads_per_sm", "backward_workspace_bytes", "comm_kernel_sms"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(key, value, "must be a non-negative integer")
        for key in ("hbm_bytes_per_s", "l2_bytes_per_s"):
            if not _is_number(getattr(self, key)) or getattr(self, key) <= 0:
                raise bad(key, getattr(self, key), "must be a positive number")
        for key in ("launch_overhead_s", "tdp_w", "nvlink_bytes_per_s_per_direction", "host_forward_op_s",
                    "host_backward_op_s", "host_checkpoint_s", "host_optimizer_tensor_s"):
            if not _is_number(getattr(self, key)) or getattr(self, key) < 0:
                raise bad(key, getattr(self, key), "must be a non-negative number")
        if not _is_number(self.gemm_unaligned_efficiency) or not 0 <= self.gemm_unaligned_efficiency <= 1:
            raise bad("gemm_unaligned_efficiency", self.gemm_unaligned_efficiency, "must be in [0, 1] (0: not modelled)")
        if not _is_number(self.sparse_gemm_speedup) or self.sparse_gemm_speedup < 1:
            raise bad("sparse_gemm_speedup", self.sparse_gemm_speedup, "must be a number >= 1 (1: no sparse GEMMs)")
        for key in ("hbm_efficiency", "attention_efficiency"):
            value = getattr(self, key)
            if not _is_number(value) or not 0 < value <= 1:
                raise bad(key, value, "must be in (0, 1]")
        for key, value in self.hbm_efficiency_by_class.items():
            if key not in MEMORY_OP_CLASSES:
                raise bad(f"hbm_efficiency_by_class.{key}", value, f"names no memory-bound op class (allowed: "
                                                                   f"{', '.join(MEMORY_OP_CLASSES)})")
            if not _is_number(value) or not 0 < value <= 1:
                raise bad(f"hbm_efficiency_by_class.{key}", value, "must be in (0, 1]")
        if self.attention_backend not in ("", *ATTENTION_BACKENDS):
            raise bad("attention_backend", self.attention_backend, f"must be one of {', '.join(ATTENTION_BACKENDS)}")
        for key, value in self.attention_backend_speed.items():
            if key not in ATTENTION_BACKENDS or not _is_number(value) or value <= 0:
                raise bad(f"attention_backend_speed.{key}", value, f"must be a number > 0 for one of "
                                                                   f"{', '.join(ATTENTION_BACKENDS)}")
        if self.attention_backend and self.attention_backend_speed.get(self.attention_backend) != 1.0:
            raise bad("attention_backend_speed", self.attention_backend_speed,
                      f"must give the measured backend {self.attention_backend!r} the speed 1.0")
        if self.comm_kernel_sms >= self.sm_count:
            raise bad("comm_kernel_sms", self.comm_kernel_sms, f"must be less than sm_count = {self.sm_count}")
        if "fp32" not in self.peak_flop_per_s:
            raise bad("peak_flop_per_s", self.peak_flop_per_s, "must contain 'fp32'")
        for dtype, rate in self.peak_flop_per_s.items():
            if dtype not in FLOP_DTYPES:
                raise bad(f"peak_flop_per_s.{dtype}", rate, f"has an unknown dtype (allowed: {', '.join(FLOP_DTYPES)})")
            if not _is_number(rate) or rate <= 0:
                raise bad(f"peak_flop_per_s.{dtype}", rate, "must be a positive number")
        if sorted(self.gemm_efficiency) != sorted(self.peak_flop_per_s):
            raise bad("gemm_efficiency", sorted(self.gemm_efficiency),
                      f"must have the dtypes of peak_flop_per_s ({', '.join(sorted(self.peak_flop_per_s))})")
        for dtype, value in self.gemm_efficiency.items():
            # Above 1 is allowed: GeForce cards boost past the clock their datasheet rates are quoted at.
            if not _is_number(value) or not 0 < value <= 2:
                raise bad(f"gemm_efficiency.{dtype}", value, "must be in (0, 2]")
        mnk = self.gemm_reference_mnk
        if len(mnk) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in mnk):
            raise bad("gemm_reference_mnk", mnk, "must be three positive integers (m, n, k)")
        if self.dropout_mask_dtype not in DROPOUT_MASK_DTYPES:
            raise bad("dropout_mask_dtype", self.dropout_mask_dtype, f"must be one of {', '.join(DROPOUT_MASK_DTYPES)}")
        if self.default_allocator not in ALLOCATORS:
            raise bad("default_allocator", self.default_allocator, f"must be one of {', '.join(ALLOCATORS)}")
        if self.pcie_gen and self.pcie_gen not in PCIE_BYTES_PER_S_PER_LANE:
            raise bad("pcie_gen", self.pcie_gen, f"must be 0 or one of {sorted(PCIE_BYTES_PER_S_PER_LANE)}")
        for key, text in self.source.items():
            if not isinstance(text, str):
                raise bad(f"source.{key}", text, "must be a string")

    def __hash__(self) -> int:
        """Hash by identity-defining scalars (the dict fields are unhashable); equal specs hash equal."""
        return hash((self.name, self.memory_bytes, self.hbm_bytes_per_s, self.sm_count, self.launch_overhead_s))

    @property
    def usable_bytes(self) -> int:
        """Bytes the allocator can reserve: capacity minus what the runtime context takes."""
        return self.memory_bytes - self.context_bytes

    @property
    def pcie_bytes_per_s_per_direction(self) -> float:
        """Raw host-link rate per direction from pcie_gen and pcie_lanes (0.0 without PCIe)."""
        return PCIE_BYTES_PER_S_PER_LANE.get(self.pcie_gen, 0.0) * self.pcie_lanes


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def source_keys(spec: DeviceSpec) -> list[str]:
    """Every key `spec.source` must have: numeric fields, and "field.key" for each dict entry.

    Args:
        spec: the device.

    Returns:
        Keys in field order, e.g. ["memory_bytes", ..., "peak_flop_per_s.bf16", ...].
    """
    keys = []
    for item in dataclasses.fields(spec):
        value = getattr(spec, item.name)
        if isinstance(value, dict) and item.name != "source":
            keys.extend(f"{item.name}.{key}" for key in value)
        elif isinstance(value, tuple) or (_is_number(value) and not isinstance(value, bool)):
            keys.append(item.name)
    return keys
