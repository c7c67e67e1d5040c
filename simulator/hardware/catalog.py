"""The device catalog: the DeviceSpec of every accelerator and the host CPU memsim knows, and lookups."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Mapping
from types import MappingProxyType

from simulator.errors import TopologyError
from simulator.hardware.device_spec import (  # noqa: F401  callers import these from the catalog
    ATTENTION_BACKENDS, FLOP_DTYPES, DeviceSpec, source_keys,
)
from simulator.hardware.measured import (  # noqa: F401  HOPPER_KERNELS, HOST_ISSUE: tests import them from here
    COMM_SMS, FLASH2_DEFAULT, HOPPER_ATTENTION, HOPPER_BACKENDS, HOPPER_DEFAULT_BACKEND, HOPPER_KERNELS, HOST_FIELDS,
    HOST_ISSUE, hopper_hbm_by_class,
)
from simulator.hardware.sources import (  # noqa: F401  the source strings the entries below cite
    MIB, HW_MD, A100_WP, H100_DS, H200_DS, GA102_WP, AD102_WP, MI300X_DS, ZZC, AZURE, CHSASANK, TILELANG,
    L2_5120, CUBLAS_WS, CONTEXT, LAUNCH, THREADS_PER_SM, UNALIGNED_HOPPER, UNALIGNED_OTHERS,
)


# ----------------------------------------------------------------------------------------------------------------
# Shared fields. Source strings are in sources.py (datasheet and whitepaper numbers are those of
# shared/reference/hardware.md; measured fractions cite the public run they come from, ratios computed here:
# measured / datasheet peak); values derived from measurements are in measured.py.
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
                                     "seq 8192) / 312; FlashAttention-2 paper reports 50-73% of peak on A100"),
        **FLASH2_DEFAULT)


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
        hbm_efficiency_by_class=hbm_by_class, attention_backend=("cudnn", HOPPER_DEFAULT_BACKEND),
        attention_backend_speed=dict(HOPPER_BACKENDS))


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
                hopper_hbm_by_class(2.97, 3.35, f"the H100 SXM's ({AZURE} ND_H100_v5)")),
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
                hopper_hbm_by_class(2.97, 3.35, "(assumed equal to h100-sxm) the H100 SXM's")),
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
                HOPPER_ATTENTION, hopper_hbm_by_class(4.15, 4.8, "the H200's own")),
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
                **FLASH2_DEFAULT,
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
                **FLASH2_DEFAULT,
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
               attention_backend=("flash2", "the ROCm FlashAttention-2 of the measurement above (torch's SDPA on "
                                            "MI300X uses it)"),
               attention_backend_speed={"flash2": (1.0, "the measured backend")},
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
                               hbm_efficiency_by_class=dict(spec.hbm_efficiency_by_class),
                               attention_backend_speed=dict(spec.attention_backend_speed))


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
