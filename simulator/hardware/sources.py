"""Where the catalog's numbers come from: datasheets, whitepapers, public benchmark repositories and estimates,
as the source strings its entries cite (shared/reference/hardware.md holds the datasheet figures)."""

from __future__ import annotations

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
UNALIGNED_OTHERS = ("not modelled (0): NVIDIA's 'Matrix Multiplication Background' guide names the 16-byte rule "
                    "for every tensor-core GPU, but the H200 figure comes from Hopper's TMA kernels and was not "
                    "measured here; a calibration file can set it")
