"""The device catalog: `DeviceSpec` (one accelerator or host CPU, every number with its source) and lookups."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from simulator.errors import TopologyError

KINDS = ("gpu", "cpu")
FLOP_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
DROPOUT_MASK_DTYPES = ("bool", "input")
ALLOCATORS = ("caching", "exact")
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


# ----------------------------------------------------------------------------------------------------------------
# Sources. Datasheet and whitepaper numbers are those of shared/reference/hardware.md; measured fractions cite
# the public run they come from (ratios computed here: measured / datasheet peak).
MIB = 2**20
HW_MD = "shared/reference/hardware.md"
A100_WP = f"NVIDIA A100 datasheet and Ampere GA100 architecture whitepaper (2020); {HW_MD}"
H100_DS = f"NVIDIA H100 Tensor Core GPU datasheet and Hopper architecture whitepaper; {HW_MD}"
H200_DS = f"NVIDIA H200 datasheet (141 GB HBM3e, 4.8 TB/s; compute as H100 SXM); {HW_MD}"
GA102_WP = f"NVIDIA Ampere GA102 architecture whitepaper, RTX 3090 column (dense, FP32 accumulate); {HW_MD}"
AD102_WP = f"NVIDIA Ada Lovelace architecture whitepaper, RTX 4090 column (dense, FP32 accumulate); {HW_MD}"
MI300X_DS = f"AMD Instinct MI300X data sheet and CDNA 3 white paper (dense); {HW_MD}"
ZZC = ("github.com/zzc0721/torch-performance-test-data database.md (torch.mm, best of square sizes 1024..10240, "
       "30 timed after 6 warm-ups)")
AZURE = "github.com/Azure/AI-benchmarking-guide Azure_Results (read in fork samuel-bohman/AI-benchmarking-guide)"
CHSASANK = ("github.com/chsasank/device-benchmarks README (torch tensor copy, bytes read + written, "
            "up to 0.38 GB buffers)")
TILELANG = "github.com/tile-ai/tilelang tilelang/carver/arch"
L2_5120 = ("5120 B/clk of L2 read bandwidth (A100 whitepaper: 2.3x V100's 2048 B/clk; PMC10448217 Table 3 lists "
           "7219 GB/s for A100 at 1410 MHz and 8986 GB/s for H100 at 1755 MHz = 5120 B/clk)")
CUBLAS_WS = ("torch aten/src/ATen/cuda/CublasHandlePool.cpp (pytorch/pytorch@26a39059): cuBLAS workspace "
             "{ws} + cuBLASLt workspace {lt} per (handle, stream), allocated through the caching allocator")
CONTEXT = ("estimate, calibratable: CUDA context with lazy module loading measured 287,047,680 B after a first "
           "tensor (pytorch/pytorch#86509) and 426 MiB (unslothai/unsloth-zoo#1053, RTX 6000 Ada, CUDA 13.0); "
           "~300-400 MB per pytorch/pytorch#107667 and #109888; rounded up to 512 MiB for kernels that "
           "cuBLAS/cuDNN/attention load lazily during training")
LAUNCH = ("estimate, calibratable: eager torch op ~5-7 us on the host (pytorch/pytorch#41383), raw cuLaunchKernel "
          "~3 us (meta-pytorch/tritonbench#1017), 1.1-1.3 us per kernel on the GPU under graph replay "
          "(pytorch/pytorch#161104); 5 us = the eager cost that bounds small kernels")
THREADS_PER_SM = ("CUDA C++ Programming Guide, 'Technical Specifications per Compute Capability': {n} resident "
                  "threads per SM for compute capability {cc}; torch max_threads_per_multi_processor = 2048 on an "
                  "H200 (validation/data/cuda/reductions.json)")
UNALIGNED_HOPPER = (
    "measured on one H200, torch 2.11 + CUDA 13.0 (validation/data/cuda-large/gemm_alignment*.json: python -m "
    "validation.cuda.gemm_alignment): the forward, input- and weight-gradient GEMMs of linear layers with output "
    "widths 4097, 30522, 32001, 50257, 50258, 50260 (inputs 768-12288, 2048-8192 tokens) ran, FLOP over summed "
    "time, at 0.255-0.271 of the tensor peak with 4- or 8-byte alignment (bf16, fp16, tf32) and 0.127-0.132 "
    "with 2-byte alignment, whatever the shape, where the 16-byte-aligned widths next to them ran at 0.7-0.8; "
    "assumed for the H100 (the same sm_90 cuBLAS kernels)")
COMM_SMS = ("16 SMs: Transformer Engine's userbuffers pipeline and bulk overlap kernels default to num_sm = 16 "
            "and launch the GEMM beside them on the other SMs (transformer_engine/pytorch/module/base.py initialize_ub, "
            "get_default_config, TE 2.x); NCCL runs one CTA per channel and uses 16 channels for NVLS collectives by "
            "default (NCCL_NVLS_NCHANNELS); assumption, calibratable, for the async NCCL collectives beside GEMMs")
# benchmarks/host_issue_params.py on validation/data/cuda (tests/test_host_issue.py checks these against it).
HOST_ISSUE = MappingProxyType({"host_forward_op_s": 3.983194043398322e-05, "host_backward_op_s": 4.282698798076848e-05,
                               "host_checkpoint_s": 0.001926009729854365,
                               "host_optimizer_tensor_s": 1.1171897290239924e-05})
HOST_SOURCE = ("derived from the committed H200 captures (validation/data/cuda/timing; host Intel Xeon, torch 2.11 "
               "eager, 2026-11-30) by benchmarks/host_issue_params.py: {what}; calibratable; another host CPU or torch "
               "build differs")
_HOST_FIT = ("least-squares fit over the 6 host-bound configurations (GPU busy under 85% of the step) of forward CPU "
             "+ backward wall time = forward ops, backward ops and checkpointed regions times three costs")
HOST_FIELDS = {
    "host_forward_op_s": (HOST_ISSUE["host_forward_op_s"], HOST_SOURCE.format(what=f"{_HOST_FIT}, per forward op")),
    "host_backward_op_s": (HOST_ISSUE["host_backward_op_s"],
                           HOST_SOURCE.format(what=f"{_HOST_FIT}, per backward or recompute op")),
    "host_checkpoint_s": (HOST_ISSUE["host_checkpoint_s"],
                          HOST_SOURCE.format(what=f"{_HOST_FIT}, per checkpointed region (torch.utils.checkpoint)")),
    "host_optimizer_tensor_s": (HOST_ISSUE["host_optimizer_tensor_s"], HOST_SOURCE.format(
        what="median over the 8 configurations of optimizer CPU time per tensor an optimizer op walks (8.0-35.0 us)")),
}
UNALIGNED_OTHERS = ("not modelled (0): NVIDIA's 'Matrix Multiplication Background' guide names the 16-byte rule "
                    "for every tensor-core GPU, but the H200 figure comes from Hopper's TMA kernels and was not "
                    "measured here; a calibration file can set it")
GPU_FLAGS = MappingProxyType({"dropout_mask_dtype": "bool", "sdpa_flash_with_dropout": True,
                              "default_allocator": "caching", "optimizer_foreach": True})
GPU_GEMM_SHAPE = MappingProxyType({
    "gemm_tile_mn": (128, "128x128 output tiles: cuBLAS/CUTLASS kernels named *tilesize128x128* (e.g. "
                          "sm80_xmma_gemm_..._tilesize128x128x8 in Stanford CS336 2025 lecture 6 profiles); NVIDIA's "
                          "'Matrix Multiplication Background' guide uses 128x128/256x128 tiles for wave quantization"),
    "gemm_k_overhead": (32, "assumption, calibratable: filling the multi-stage shared-memory pipeline costs about "
                            "one k-block (32-64) of main-loop time per tile"),
    "gemm_reference_mnk": ((8192, 8192, 8192), "shape of the large-GEMM measurements quoted in gemm_efficiency "
                                               "(8192^3 or the best square size)"),
    "gemm_unaligned_efficiency": (0.0, UNALIGNED_OTHERS),
})


def _build(**fields: object) -> DeviceSpec:
    """Make a DeviceSpec from fields given as (value, source) pairs (dict fields: {key: (value, source)})."""
    values: dict[str, object] = {}
    source: dict[str, str] = {}
    for key, item in fields.items():
        if isinstance(item, Mapping):
            values[key] = {sub: pair[0] for sub, pair in item.items()}
            source.update({f"{key}.{sub}": pair[1] for sub, pair in item.items()})
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], str):
            values[key], source[key] = item
        else:
            values[key] = item
    return DeviceSpec(source=source, **values)


def _nvidia(**fields: object) -> DeviceSpec:
    """An NVIDIA GPU: the shared GEMM-shape constants, launch/context estimates and CUDA kernel flags."""
    hopper = fields.pop("hopper")
    ws, lt = (33_554_432 if hopper else 8_519_680), 1_048_576
    defaults: dict[str, object] = {
        "kind": "gpu", "launch_overhead_s": (5e-6, LAUNCH), "context_bytes": (512 * MIB, CONTEXT),
        "comm_kernel_sms": (16, COMM_SMS), **HOST_FIELDS,
        "max_threads_per_sm": (2048, THREADS_PER_SM.format(cc="8.0 and 9.0", n=2048)),
        "backward_workspace_bytes": (ws, f"{ws:,} B: the cuBLAS workspace of the autograd thread's own handle "
                                         "(no cuBLASLt one: backward GEMMs have no bias epilogue); measured on an "
                                         "H200, torch 2.11: a second 33,554,432 B allocation at the first backward "
                                         "matmul (validation/data/cuda/memory/)"),
        "cublas_workspace_bytes": (ws + lt, CUBLAS_WS.format(
            ws=f"{ws:,} B ({'32 MiB on sm90' if hopper else ':4096:2:16:8 = 8 MiB + 128 KiB off sm90'})",
            lt=f"{lt:,} B (1024 KiB default)")),
        **GPU_GEMM_SHAPE, **GPU_FLAGS,
    }
    return _build(**{**defaults, **fields})


def _a100(name: str, display: str, memory: tuple[int, str], hbm: float, tdp: float, nvlink: tuple[float, str],
          eff: dict[str, tuple[float, str]]) -> DeviceSpec:
    assumed = "" if name == "a100-80gb-sxm" else "assumed equal to a100-80gb-sxm (no measurement found): "
    return _nvidia(
        hopper=False, name=name, display_name=display, memory_bytes=memory,
        sparse_gemm_speedup=(2.0, f"{A100_WP}: 624 TFLOP/s FP16/BF16 with sparsity = 2 x 312 dense"),
        hbm_bytes_per_s=(hbm, A100_WP), l2_bytes=(40 * MIB, f"{A100_WP}; deviceQuery 'L2 Cache Size: 41943040 bytes' "
                                                            "(samridh-dev/votess#10)"),
        l2_bytes_per_s=(5120 * 1.41e9, f"{L2_5120} x 1410 MHz boost"), sm_count=(108, A100_WP),
        peak_flop_per_s={"fp32": (19.5e12, A100_WP), "tf32": (156e12, A100_WP), "bf16": (312e12, A100_WP),
                         "fp16": (312e12, A100_WP)},
        tdp_w=(tdp, A100_WP), pcie_gen=(4, A100_WP), pcie_lanes=(16, A100_WP),
        nvlink_bytes_per_s_per_direction=nvlink, gemm_efficiency=eff,
        hbm_efficiency=(0.834, f"{assumed}{AZURE} ND_A100_v4 (A100-SXM4-80GB): STREAM triad 1.70 TB/s / 2.039 "
                               "TB/s"),
        attention_efficiency=(0.575, f"{assumed}{AZURE} ND_A100_v4: FlashAttention-2 179.5 TFLOP/s (head dim 64, "
                                     "seq 8192) / 312; FlashAttention-2 paper reports 50-73% of peak on A100"))


def _hopper(name: str, display: str, memory: tuple[int, str], hbm: tuple[float, str], l2: tuple[int, str],
            clock_mhz: float, sms: tuple[int, str], peaks: dict[str, tuple[float, str]], tdp: tuple[float, str],
            nvlink: tuple[float, str], eff: dict[str, tuple[float, str]], hbm_eff: tuple[float, str],
            attn: tuple[float, str], hbm_by_class: dict[str, tuple[float, str]]) -> DeviceSpec:
    return _nvidia(
        hopper=True, name=name, display_name=display, memory_bytes=memory, hbm_bytes_per_s=hbm, l2_bytes=l2,
        sparse_gemm_speedup=(2.0, f"{H100_DS}: 1,979 TFLOP/s FP16/BF16 with sparsity = 2 x 989.4 dense"),
        l2_bytes_per_s=(5120 * clock_mhz * 1e6, f"{L2_5120} x {clock_mhz:g} MHz boost (assumes Hopper keeps A100's "
                                                  "per-clock L2 width)"),
        sm_count=sms, peak_flop_per_s=peaks, tdp_w=tdp, pcie_gen=(5, H100_DS), pcie_lanes=(16, H100_DS),
        nvlink_bytes_per_s_per_direction=nvlink, gemm_efficiency=eff, hbm_efficiency=hbm_eff,
        attention_efficiency=attn, gemm_unaligned_efficiency=(0.262, UNALIGNED_HOPPER),
        hbm_efficiency_by_class=hbm_by_class)


# benchmarks/hopper_kernel_params.py on the committed H200 captures (tests/test_host_issue.py checks it): cuDNN
# fused attention (torch 2.11's SDPA on sm_90) and the memory-bound kernels moving >= 100 MB per call, kernel by kernel.
HOPPER_KERNELS = MappingProxyType({
    "attention_efficiency": 0.3024641225655175,
    "streaming_bytes_per_s.copy": 2803885686728.1914, "streaming_bytes_per_s.elementwise": 4137321244767.5493,
    "streaming_bytes_per_s.norm": 1698643180387.9033, "streaming_bytes_per_s.softmax": 3001788321025.814,
    "streaming_bytes_per_s.optimizer": 3688669296936.8354})
_HOPPER_RUN = ("measured on one H200 (torch 2.11 + CUDA 13.0, 2026-11-30): benchmarks/hopper_kernel_params.py over the "
               "kernel profiles of validation/data/cuda*/timing (13 captures)")
HOPPER_ATTENTION = (HOPPER_KERNELS["attention_efficiency"],
                    f"{_HOPPER_RUN}: FLOP over time of every cuDNN fused-attention call, forward and backward (head dim "
                    "64 and 128, sequence 1024-4096) / 989.4 TFLOP/s; FlashAttention-2 reaches 0.331 (Azure ND_H100_v5, "
                    "327.9 TFLOP/s), FlashAttention-3 ~0.75 (its paper): not torch's default backends")
_H200_STREAM = 4.15e12       # Azure ND_H200_v5 STREAM triad, the reference of the ratios below


def _hopper_hbm_by_class(stream_tb_s: float, peak_tb_s: float, where: str) -> dict[str, tuple[float, str]]:
    """A Hopper GPU's measured hbm_efficiency per op class: the H200's measured rate of that class's kernels over the
    H200's STREAM triad, times this GPU's STREAM triad, over its datasheet bandwidth."""
    classes = {}
    for key, rate in HOPPER_KERNELS.items():
        if not key.startswith("streaming_bytes_per_s."):
            continue
        kind = key.split(".", 1)[1]
        what = ("the AdamW step microbenchmark (validation/data/cuda-large/optimizer_step.json, single-tensor, foreach "
                "and fused)" if kind == "optimizer" else f"{kind} kernels moving >= 100 MB per call")
        ratio = rate / _H200_STREAM
        classes[kind] = (ratio * stream_tb_s / peak_tb_s,
                         f"{_HOPPER_RUN}: {what} at {rate / 1e12:.2f} TB/s = {ratio:.3f} of the H200's STREAM triad "
                         f"(4.15 TB/s, {AZURE}); applied to {where} STREAM triad {stream_tb_s} TB/s / {peak_tb_s} TB/s")
    return classes


_H100_SXM_PEAKS = MappingProxyType({"fp32": (66.9e12, H100_DS), "tf32": (494.7e12, H100_DS),
                                   "bf16": (989.4e12, H100_DS), "fp16": (989.4e12, H100_DS),
                                   "fp8": (1978.9e12, H100_DS)})
_H100_EFF = MappingProxyType({"fp32": (0.777, f"{ZZC}: H100 80GB HBM3 fp32 51.88 and 52.11 TFLOP/s / 66.9"),
             "tf32": (0.813, "zzc0721/torch-performance-test-data issue #79: H100 TF32 402.15 TFLOP/s / 494.7"),
             "bf16": (0.798, f"{ZZC}: H100 80GB HBM3 bf16 783.66, 789.24, 797.51 TFLOP/s (median) / 989.4"),
             "fp16": (0.768, f"{ZZC}: H100 80GB HBM3 fp16 758.14, 760.04, 761.84 TFLOP/s (median) / 989.4"),
             "fp8": (0.652, f"{AZURE} ND_H100_v5: cuBLASLt FP8 8192^3 1290.1 TFLOP/s / 1978.9")})


@functools.lru_cache(maxsize=1)
def _catalog() -> tuple[DeviceSpec, ...]:
    """Build the catalog once; callers only ever see copies (see _copy)."""
    a100_80_eff = {"fp32": (0.984, f"{ZZC}: A100 SXM4 80GB fp32 19.18 TFLOP/s / 19.5"),
                   "tf32": (0.848, "assumed equal to bf16 (no torch TF32 measurement found)"),
                   "bf16": (0.848, f"{ZZC}: A100 SXM4 80GB bf16 264.53 TFLOP/s / 312"),
                   "fp16": (0.829, f"{ZZC}: A100 SXM4 80GB fp16 258.74 TFLOP/s / 312")}
    a100_40_eff = {"fp32": (0.929, f"{ZZC}: A100 40GB fp32 18.11 TFLOP/s / 19.5"),
                   "tf32": (0.790, "assumed equal to bf16 (no torch TF32 measurement found)"),
                   "bf16": (0.790, f"{ZZC}: A100 40GB bf16 246.33 TFLOP/s / 312"),
                   "fp16": (0.794, f"{ZZC}: A100 40GB fp16 247.63 TFLOP/s / 312")}
    pcie_eff = {key: (value, f"assumed equal to a100-40gb-sxm (300 W part; no measurement found): {text}")
                for key, (value, text) in a100_40_eff.items()}
    h100_pcie_eff = {key: (value, f"assumed equal to h100-sxm (no measurement found; 350 W part may clock lower): "
                                  f"{text}") for key, (value, text) in _H100_EFF.items()}
    h100_sxm_ds = "torch total_memory=81090MB (MiB) for 'NVIDIA H100 80GB HBM3' printed in Stanford CS336 2025 " \
                  "lecture 6; 81089 MiB in an ml-engineering all_reduce benchmark; deviceQuery 81106 MBytes " \
                  "(thamada/nvidia-smi) - varies with the driver by < 0.1%"
    pcie_link_a100 = "PCIe card: NVLink only through an optional 2-GPU bridge (600 GB/s total), not modeled"
    return (
        _a100("a100-80gb-sxm", "NVIDIA A100 80GB SXM4",
              (81251 * MIB, "deviceQuery 'Total amount of global memory: 81251 MBytes' for NVIDIA A100-SXM4-80GB; "
                            "torch OOM 'total capacity of 79.35 GiB' (OSU-NLP-Group/TableLlama#10); marketed 80 GB"),
              2039e9, 400, (300e9, f"NVLink3 600 GB/s total = 300 GB/s per direction; {A100_WP}"), a100_80_eff),
        _a100("a100-40gb-sxm", "NVIDIA A100 40GB SXM4",
              (42_298_834_944, "deviceQuery 'NVIDIA A100-SXM4-40GB: 40339 MBytes (42298834944 bytes)', driver 12.2 "
                               "(bottlerocket-os/bottlerocket#3873); Paddle docs show 40536 MiB with an older "
                               "driver"),
              1555e9, 400, (300e9, f"NVLink3 600 GB/s total = 300 GB/s per direction; {A100_WP}"), a100_40_eff),
        _a100("a100-80gb-pcie", "NVIDIA A100 80GB PCIe",
              (80_998 * MIB, "deviceQuery 'Total amount of global memory' 79.10 GiB for an A100 80GB PCIe, quoted "
                             "in a public CUDA benchmark README ('Machines for Benchmark'); uncertain to ~5 MiB"),
              1935e9, 300, (0.0, pcie_link_a100), pcie_eff),
        _hopper("h100-sxm", "NVIDIA H100 80GB SXM5", (81090 * MIB, h100_sxm_ds), (3350e9, H100_DS),
                (50 * MIB, f"{H100_DS}; deviceQuery 'L2 Cache Size: 52428800 bytes' (thamada/nvidia-smi)"), 1980,
                (132, H100_DS), _H100_SXM_PEAKS, (700, H100_DS),
                (450e9, f"NVLink4 900 GB/s total = 450 GB/s per direction; {H100_DS}"), _H100_EFF,
                (0.887, f"{AZURE} ND_H100_v5: STREAM triad 2.97 TB/s / 3.35 TB/s"),
                (HOPPER_ATTENTION[0], f"assumed equal to the H200 (the same sm_90 kernels and clocks): "
                                      f"{HOPPER_ATTENTION[1]}"),
                _hopper_hbm_by_class(2.97, 3.35, f"the H100 SXM's ({AZURE} ND_H100_v5)")),
        _hopper("h100-pcie", "NVIDIA H100 80GB PCIe",
                (81008 * MIB, "torch get_device_properties 'NVIDIA H100 PCIe ... total_memory=81008MB, "
                              "multi_processor_count=114' quoted in a public repository"),
                (2000e9, H100_DS), (50 * MIB, f"{H100_DS}; chipsandcheese.com 2023-07-02 (H100 PCIe: 50 MB L2)"),
                1755, (114, f"{H100_DS}; chipsandcheese.com 2023-07-02 (114 SMs)"),
                {"fp32": (51e12, H100_DS), "tf32": (378e12, H100_DS), "bf16": (756e12, H100_DS),
                 "fp16": (756e12, H100_DS), "fp8": (1513e12, H100_DS)},
                (350, H100_DS), (0.0, "PCIe card: NVLink only through an optional bridge, not modeled"),
                h100_pcie_eff, (0.887, "assumed equal to h100-sxm (Azure STREAM triad 2.97/3.35)"),
                (HOPPER_ATTENTION[0], f"assumed equal to the H200: {HOPPER_ATTENTION[1]}"),
                _hopper_hbm_by_class(2.97, 3.35, "(assumed equal to h100-sxm) the H100 SXM's")),
        _hopper("h200-sxm", "NVIDIA H200 141GB SXM",
                (143156 * MIB, "torch get_device_properties 'NVIDIA H200 ... total_memory=143156MB, "
                               "multi_processor_count=132, L2_cache_size=60MB' (ai-bot-pro/achatbot "
                               "deploy/modal/src/llm/vllm/vlm/skywork_r1v.py); marketed 141 GB"),
                (4800e9, H200_DS),
                (60 * MIB, "device-reported L2_cache_size=60MB (torch, ai-bot-pro/achatbot skywork_r1v.py); the "
                           f"table in {HW_MD} lists 50 MB, H100's figure, which NVIDIA's H200 datasheet omits"),
                1980, (132, "multi_processor_count=132 (torch, ai-bot-pro/achatbot skywork_r1v.py)"),
                {key: (value, H200_DS) for key, (value, _) in _H100_SXM_PEAKS.items()}, (700, H200_DS),
                (450e9, f"NVLink4 900 GB/s total = 450 GB/s per direction; {H200_DS}"),
                {"fp32": (0.767, f"{ZZC}: H200 fp32 51.34 TFLOP/s / 66.9"),
                 "tf32": (0.813, "assumed equal to h100-sxm (zzc0721 issue #79: 402.15/494.7)"),
                 "bf16": (0.799, f"{ZZC}: H200 bf16 790.29 TFLOP/s / 989.4"),
                 "fp16": (0.768, f"{ZZC}: H200 fp16 759.40 TFLOP/s / 989.4"),
                 "fp8": (0.657, f"{AZURE} ND_H200_v5: cuBLASLt FP8 8192^3 1300.6 TFLOP/s / 1978.9")},
                (0.865, f"{AZURE} ND_H200_v5: STREAM triad 4.15 TB/s / 4.8 TB/s"),
                HOPPER_ATTENTION, _hopper_hbm_by_class(4.15, 4.8, "the H200's own")),
        _nvidia(hopper=False, name="rtx-3090", display_name="NVIDIA GeForce RTX 3090",
                memory_bytes=(25_286_672_384, "cudaDeviceProp totalGlobalMem 25286672384 bytes "
                                              "(Jumperkables/cuda-benchmarking 00_deviceQuery/README.md); HF "
                                              "transformers docs show total_memory=24268MB with an older driver"),
                hbm_bytes_per_s=(936e9, GA102_WP),
                l2_bytes=(6 * MIB, f"{GA102_WP}; L2 Cache Size 6291456 bytes (Jumperkables/cuda-benchmarking)"),
                l2_bytes_per_s=(2722.7e9, f"{TILELANG}/rtx3090.py l2_bandwidth (sustained 2345.8 GB/s there)"),
                sm_count=(82, GA102_WP), max_threads_per_sm=(1536, THREADS_PER_SM.format(cc="8.6", n=1536)),
                peak_flop_per_s={"fp32": (35.6e12, GA102_WP), "tf32": (35.6e12, GA102_WP),
                                 "bf16": (71e12, GA102_WP), "fp16": (71e12, GA102_WP)},
                tdp_w=(350, GA102_WP), pcie_gen=(4, GA102_WP), pcie_lanes=(16, GA102_WP),
                sparse_gemm_speedup=(2.0, f"{GA102_WP}: third-generation Tensor Cores with fine-grained structured "
                                          "sparsity, the 'with sparsity' rates twice the dense ones"),
                nvlink_bytes_per_s_per_direction=(0.0, "none by default; an optional NVLink bridge gives 112.5 "
                                                       f"GB/s total ({HW_MD}), not modeled"),
                gemm_efficiency={
                    "fp32": (0.696, f"{ZZC}: RTX 3090 fp32 24.46, 24.79, 24.84 TFLOP/s (median) / 35.6"),
                    "tf32": (1.0, "assumed: GeForce tensor rates run at or above the datasheet boost clock "
                                  "(bf16 measured 1.08x); no TF32 measurement found"),
                    "bf16": (1.079, f"{ZZC}: RTX 3090 bf16 76.34, 76.58, 76.68 TFLOP/s (median) / 71: boost clocks "
                                    "above the rated 1695 MHz"),
                    "fp16": (1.065, f"{ZZC}: RTX 3090 fp16 75.48, 75.64, 75.88 TFLOP/s (median) / 71")},
                hbm_efficiency=(0.888, f"{CHSASANK}: Nvidia 3090 831 GB/s / 936 GB/s"),
                attention_efficiency=(0.6, "assumed: FlashAttention-2 paper reports 50-73% of peak on A100; no "
                                           "RTX 3090 measurement found")),
        _nvidia(hopper=False, name="rtx-4090", display_name="NVIDIA GeForce RTX 4090",
                memory_bytes=(25_756_696_576, "deviceQuery 'NVIDIA GeForce RTX 4090: 24564 MBytes (25756696576 "
                                              "bytes)', CUDA 12.1 Linux, quoted in public READMEs; newer drivers "
                                              "report 24081-24207 MiB"),
                hbm_bytes_per_s=(1008e9, AD102_WP),
                l2_bytes=(72 * MIB, f"{AD102_WP}; torch L2_cache_size=72MB"),
                l2_bytes_per_s=(4510e9 * 2.53 / 2.23, f"{TILELANG}/rtx4090.py: 4510 GB/s measured at 2.23 GHz, "
                                                      "scaled to 2.53 GHz"),
                sm_count=(128, f"{AD102_WP}; torch multi_processor_count=128"),
                max_threads_per_sm=(1536, THREADS_PER_SM.format(cc="8.9", n=1536)),
                peak_flop_per_s={"fp32": (82.6e12, AD102_WP), "tf32": (82.6e12, AD102_WP),
                                 "bf16": (165.2e12, AD102_WP), "fp16": (165.2e12, AD102_WP),
                                 "fp8": (330.3e12, AD102_WP)},
                tdp_w=(450, AD102_WP), pcie_gen=(4, AD102_WP), pcie_lanes=(16, AD102_WP),
                sparse_gemm_speedup=(2.0, f"{AD102_WP}: 330.4 TFLOP/s FP16 (FP32 accumulate) with sparsity = 2 x "
                                          "165.2 dense"),
                nvlink_bytes_per_s_per_direction=(0.0, f"no NVLink and no P2P on RTX 4090 ({HW_MD})"),
                gemm_efficiency={
                    "fp32": (0.662, f"{ZZC}: RTX 4090 24GB fp32 46.48-55.01 TFLOP/s (median 54.72) / 82.6"),
                    "tf32": (1.0, "assumed equal to bf16 (no TF32 measurement found)"),
                    "bf16": (1.008, f"{ZZC}: RTX 4090 24GB bf16 162.39-173.31 TFLOP/s (median 166.6) / 165.2"),
                    "fp16": (1.008, f"{ZZC}: RTX 4090 24GB fp16 162.35-171.06 TFLOP/s (median 166.4) / 165.2"),
                    "fp8": (1.0, "assumed equal to bf16 (no FP8 measurement found)")},
                hbm_efficiency=(0.905, f"{CHSASANK}: Nvidia 4090 912 GB/s / 1008 GB/s"),
                attention_efficiency=(0.6, "assumed: FlashAttention-2 paper reports 50-73% of peak on A100; no "
                                           "RTX 4090 measurement found")),
        _build(name="mi300x", display_name="AMD Instinct MI300X", kind="gpu",
               sparse_gemm_speedup=(1.0, "no 2:4 path in torch on ROCm: aten/src/ATen/native/sparse/cuda/"
                                         "SparseSemiStructuredTile.cu is compiled out under USE_ROCM (the hardware's "
                                         "structured sparsity is not reachable from torch's semi-structured tensors)"),
               memory_bytes=(196592 * MIB, "torch get_device_properties 'AMD Instinct MI300X ... "
                                           "total_memory=196592MB, multi_processor_count=304' (ROCm/ROCm#4203)"),
               hbm_bytes_per_s=(5300e9, MI300X_DS),
               l2_bytes=(256 * MIB, f"256 MB AMD Infinity Cache (the last level before HBM); {MI300X_DS}"),
               l2_bytes_per_s=(17.2e12, "AMD CDNA 3 white paper: Infinity Cache peak 17.2 TB/s (ServeTheHome "
                                        "launch coverage: '17TB/s of peak bandwidth')"),
               sm_count=(304, "304 compute units (ROCm/ROCm#4203 multi_processor_count=304)"),
               peak_flop_per_s={"fp32": (163.4e12, MI300X_DS), "tf32": (653.7e12, MI300X_DS),
                                "bf16": (1307.4e12, MI300X_DS), "fp16": (1307.4e12, MI300X_DS),
                                "fp8": (2614.9e12, MI300X_DS)},
               launch_overhead_s=(5e-6, f"assumed as for CUDA: {LAUNCH}"),
               context_bytes=(512 * MIB, f"assumed as for CUDA (no ROCm measurement found): {CONTEXT}"),
               max_threads_per_sm=(0, "not modelled: torch's ROCm reduction config sizes ctas_per_output by "
                                      "other rules (Reduce.cuh USE_ROCM), and no MI300X measurement exists here"),
               backward_workspace_bytes=(0, "not modelled: the autograd thread's hipBLAS(Lt) workspace was not "
                                            "measured on ROCm"),
               comm_kernel_sms=(16, f"assumed as for CUDA (RCCL's channels, no MI300X measurement): {COMM_SMS}"),
               **{key: (value, f"assumed as for CUDA (no ROCm host measurement): {text}")
                  for key, (value, text) in HOST_FIELDS.items()},
               cublas_workspace_bytes=(134_217_728 + 79_691_776, "torch CublasHandlePool.cpp (pytorch/pytorch@"
                                       "26a39059), ROCm: hipBLAS workspace 128 MiB on gfx94x + hipBLASLt 76 MiB"),
               tdp_w=(750, MI300X_DS), pcie_gen=(5, MI300X_DS), pcie_lanes=(16, MI300X_DS),
               nvlink_bytes_per_s_per_direction=(448e9, "Infinity Fabric: 7 links x 128 GB/s bidirectional = 448 "
                                                        f"GB/s per direction; {MI300X_DS}"),
               gemm_efficiency={
                   "fp32": (0.443, "assumed equal to the fp8 measurement (no torch fp32 measurement found)"),
                   "tf32": (0.443, "assumed equal to the fp8 measurement (no measurement found)"),
                   "bf16": (0.443, "assumed equal to the fp8 measurement (no torch bf16 measurement found)"),
                   "fp16": (0.443, "assumed equal to the fp8 measurement (no torch fp16 measurement found)"),
                   "fp8": (0.443, f"{AZURE} ND_MI300X_v5: hipBLASLt FP8 8192^3 1159.23 TFLOP/s / 2614.9")},
               hbm_efficiency=(0.772, f"{AZURE} ND_MI300X_v5: STREAM triad 4.09 TB/s / 5.3 TB/s"),
               attention_efficiency=(0.251, f"{AZURE} ND_MI300X_v5: FlashAttention-2 328.6 TFLOP/s / 1307.4"),
               **{**GPU_GEMM_SHAPE, "gemm_unaligned_efficiency": (0.0, "not modelled (0): no hipBLASLt "
                                                                      "measurement of unaligned shapes")},
               **GPU_FLAGS),
        _cpu(),
    )


# The `cpu` entry: one run of benchmarks/cpu_device_params.py, stored in validation/data/cpu/device_params.json
# (tests/test_catalog.py checks these constants against that file).
CPU_RUN = MappingProxyType({
    "date": "2026-11-29", "command": "python benchmarks/cpu_device_params.py",
    "memory_bytes": 25276063744, "dram_bytes_per_s": 9985118150.28081,
    "llc_bytes": 33554432, "llc_bytes_per_s": 16731626112.638214,
    "threads": 1, "fp32": 66732614311.54159,
    "bf16": 892923667.0531281, "fp16": 1199731460.120759,
    "op_overhead_s": 3.6071604776477634e-06, "reference_mnk": (2048, 2048, 2048),
    "low_precision_reference_mnk": (512, 512, 512),
})


def _cpu() -> DeviceSpec:
    run = f"benchmarks/cpu_device_params.py run on {CPU_RUN['date']} ('{CPU_RUN['command']}'), " \
          "validation/data/cpu/device_params.json"
    measured = f"measured: {run}"
    k_overhead = 16
    # bf16/fp16 were measured at 512^3 (2048^3 takes minutes without AVX-512 BF16/FP16): their efficiency at
    # the 2048^3 reference is set so the shape model reproduces the 512^3 measurement (tile 16 divides both,
    # one thread, so only the k factor differs).
    low_k = CPU_RUN["low_precision_reference_mnk"][2]
    ref_k = CPU_RUN["reference_mnk"][2]
    low_eff = (ref_k / (ref_k + k_overhead)) / (low_k / (low_k + k_overhead))
    return _build(
        name="cpu", display_name="Host CPU (this machine, torch eager)", kind="cpu",
        sparse_gemm_speedup=(1.0, "no sparse tensor cores; torch's 2:4 kernels are CUDA-only"),
        memory_bytes=(CPU_RUN["memory_bytes"], f"MemTotal from /proc/meminfo, {run}"),
        hbm_bytes_per_s=(CPU_RUN["dram_bytes_per_s"], f"{measured} (256 MiB tensor copy, bytes read + written)"),
        l2_bytes=(CPU_RUN["llc_bytes"], f"last-level cache size from sysfs, {run}"),
        l2_bytes_per_s=(CPU_RUN["llc_bytes_per_s"], f"{measured} (copy of buffers filling half the LLC)"),
        sm_count=(CPU_RUN["threads"], f"torch intra-op threads of the run (1: on this shared 2-vCPU VM a "
                                      f"parallel region waits ~30 ms for descheduled workers), {run}"),
        peak_flop_per_s={"fp32": (CPU_RUN["fp32"], f"{measured} (torch.mm 2048^3)"),
                         "bf16": (CPU_RUN["bf16"], f"{measured} (torch.mm 512^3; no AVX-512 BF16 on this CPU)"),
                         "fp16": (CPU_RUN["fp16"], f"{measured} (torch.mm 512^3; no AVX-512 FP16 on this CPU)")},
        launch_overhead_s=(CPU_RUN["op_overhead_s"], f"{measured} (torch.add on one-element tensors)"),
        context_bytes=(0, "no device context on the host"),
        cublas_workspace_bytes=(0, "no cuBLAS on the host"),
        max_threads_per_sm=(0, "no CUDA reduction kernel on the host: its staging buffers do not apply"),
        backward_workspace_bytes=(0, "no cuBLAS handle on the autograd thread on the host"),
        comm_kernel_sms=(0, "gloo collectives run on host threads, not on compute units the kernels share"),
        **{key: (0.0, "0: the host is the device; its dispatch cost is launch_overhead_s") for key in HOST_ISSUE},
        tdp_w=(0.0, "not modeled: a slice of a shared cloud VM has no meaningful TDP"),
        pcie_gen=(0, "the host is the PCIe root, not a device on it"), pcie_lanes=(0, "no PCIe link"),
        nvlink_bytes_per_s_per_direction=(0.0, "no GPU fabric"),
        gemm_efficiency={"fp32": (1.0, "1 by definition: peak_flop_per_s is the measured rate at "
                                       "gemm_reference_mnk"),
                         **{dtype: (low_eff, "k-factor ratio 2048^3 / 512^3 so that gemm_efficiency at 512^3 is 1: "
                                             "the rate was measured there") for dtype in ("bf16", "fp16")}},
        hbm_efficiency=(1.0, "1 by definition: hbm_bytes_per_s is a measured copy rate"),
        attention_efficiency=(1.0, "assumed: CPU SDPA runs matmul kernels at the measured GEMM rate"),
        gemm_tile_mn=(16, "assumption: oneDNN/MKL AVX2 micro-kernels block the output in ~16-wide panels"),
        gemm_k_overhead=(k_overhead, "assumption, calibratable: per-panel packing cost of ~16 k-steps (fp32 "
                                     "4096x1024x64 ran at 0.60 of the 2048^3 rate in the run; model 0.81)"),
        gemm_reference_mnk=(CPU_RUN["reference_mnk"], f"fp32 reference shape of the run, {run}"),
        gemm_unaligned_efficiency=(0.0, "not modelled (0): the 16-byte rule is one of tensor-core kernels"),
        dropout_mask_dtype="input", sdpa_flash_with_dropout=False, default_allocator="exact",
        optimizer_foreach=False,
    )


ALIASES = MappingProxyType({"a100": "a100-80gb-sxm", "h100": "h100-sxm", "h200": "h200-sxm"})


def _copy(spec: DeviceSpec) -> DeviceSpec:
    """A copy with its own dicts, so a caller mutating one cannot change the catalog."""
    return dataclasses.replace(spec, peak_flop_per_s=dict(spec.peak_flop_per_s),
                               gemm_efficiency=dict(spec.gemm_efficiency), source=dict(spec.source),
                               hbm_efficiency_by_class=dict(spec.hbm_efficiency_by_class))


def list_devices() -> list[DeviceSpec]:
    """All catalog devices in catalog order (fresh copies on every call)."""
    return [_copy(spec) for spec in _catalog()]


def get_device(name: str) -> DeviceSpec:
    """Look a device up by key or alias ("a100" -> 80GB SXM, "h100" -> SXM, "h200"); case and '_' are ignored.

    Args:
        name: a catalog key such as "h100-sxm" or an alias.

    Returns:
        The DeviceSpec.

    Raises:
        TopologyError: unknown name; the message lists the known names and a did-you-mean.
    """
    key = str(name).strip().lower().replace("_", "-")
    key = ALIASES.get(key, key)
    devices = _catalog()
    for spec in devices:
        if spec.name == key:
            return _copy(spec)
    known = [spec.name for spec in devices]
    close = difflib.get_close_matches(key, known + sorted(ALIASES), n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise TopologyError(f"device = {name!r} is unknown{hint}; known devices: {', '.join(known)} "
                        f"(aliases: {', '.join(f'{a} -> {t}' for a, t in ALIASES.items())})")


def with_overrides(spec: DeviceSpec, **fields: object) -> DeviceSpec:
    """A copy of `spec` with fields replaced (for calibration files and what-if studies).

    Dict fields (peak_flop_per_s, gemm_efficiency, source) are merged key by key. A numeric field overridden
    without a matching entry in `source=` gets the source "overridden by with_overrides (no source given)".

    Args:
        spec: the device to start from.
        **fields: DeviceSpec field names and new values; `source={"field": "where it comes from"}` is optional.

    Returns:
        A new, validated DeviceSpec.

    Raises:
        TopologyError: an unknown field (with a did-you-mean) or an invalid value.
    """
    names = [item.name for item in dataclasses.fields(DeviceSpec)]
    for key in fields:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TopologyError(f"device {spec.name!r}: override {key!r} is not a DeviceSpec field{hint}")
    given_source = dict(fields.pop("source", {}) or {})
    updates: dict[str, object] = {}
    source = dict(spec.source)
    note = "overridden by with_overrides (no source given)"
    for key, value in fields.items():
        if isinstance(getattr(spec, key), dict):
            if not isinstance(value, dict):
                raise TopologyError(f"device {spec.name!r}: override {key} = {value!r} must be a dict")
            updates[key] = {**getattr(spec, key), **value}
            source.update({f"{key}.{sub}": note for sub in value})
        else:
            updates[key] = tuple(value) if isinstance(value, list) else value
            source[key] = note
    source.update(given_source)
    return dataclasses.replace(spec, source=source, **updates)
