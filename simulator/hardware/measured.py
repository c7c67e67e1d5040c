"""Catalog parameters derived from measurements: host-issue costs and Hopper kernel rates from this project's H200
captures (benchmarks/host_issue_params.py, benchmarks/hopper_kernel_params.py; tests check the values against them),
the SMs communication kernels take, and the attention backends' relative speeds from published kernel benchmarks."""

from __future__ import annotations

from types import MappingProxyType

from simulator.hardware.sources import AZURE

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
                    "64 and 128, sequence 1024-4096) / 989.4 TFLOP/s; the other backends (training.attention_backend) "
                    "run at attention_backend_speed times this")
_H200_STREAM = 4.15e12       # Azure ND_H200_v5 STREAM triad, the reference of the ratios below


def hopper_hbm_by_class(stream_tb_s: float, peak_tb_s: float, where: str) -> dict[str, tuple[float, str]]:
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

# Attention backends (training.attention_backend): each one's forward + backward rate relative to the backend a
# device's attention_efficiency was measured with. FlashAttention-3 paper (J. Shah et al., arXiv 2407.08608,
# 2024), H100 80GB SXM5, bf16, head dim 128, non-causal, Figure 5 (forward) and Figure 6 (backward), TFLOP/s as
# read from the figures (text extraction of the figures at subtext.edge.nugit.net, read 2026-12-02); combined as
# 3.5 / (1 / forward + 2.5 / backward) (the backward does 2.5 times the forward's FLOP), sequence 512-16k:
#   FlashAttention-2  234.6 280.6 308.3 324.6 331.3 334.4  (8k: 331 TFLOP/s, Azure ND_H100_v5 measures 327.9)
#   cuDNN             342.8 444.7 500.2 526.2 539.0 536.3
#   FlashAttention-3  348.2 456.6 531.1 566.3 581.4 583.4
# FA2 / cuDNN = 0.615-0.684 (median 0.620), FA3 / cuDNN = 1.016-1.088 (median 1.069): the medians, assumed to hold
# at causal masks and head dim 64 too (not measured: validation/cuda/hopper_kernels.py measures it).
FA3_PAPER = ("FlashAttention-3 paper (Shah et al., arXiv 2407.08608), H100 SXM5 bf16 head dim 128 Figures 5-6, "
             "forward + backward, median over sequence 512-16k")
HOPPER_BACKENDS = MappingProxyType({
    "cudnn": (1.0, f"the measured default: {HOPPER_ATTENTION[1]}"),
    "flash2": (0.620, f"{FA3_PAPER}: FlashAttention-2 at 0.615-0.684 of cuDNN's rate"),
    "flash3": (1.069, f"{FA3_PAPER}: FlashAttention-3 at 1.016-1.088 of cuDNN's rate (Hopper only)"),
})
HOPPER_DEFAULT_BACKEND = ("cuDNN fused attention: torch 2.11's SDPA ran aten::_cudnn_attention_* in every flash capture "
                          "of validation/data/cuda (H200); Transformer Engine prefers FusedAttention (cuDNN) over "
                          "FlashAttention on compute capability >= 9.0 (transformer_engine/pytorch/attention/"
                          "dot_product_attention/utils.py get_attention_backend)")
FLASH2_DEFAULT = MappingProxyType({
    "attention_backend": ("flash2", "FlashAttention-2: torch's SDPA tries its flash kernel first on sm_80 / sm_86 / "
                                    "sm_89, and Transformer Engine picks FlashAttention below compute capability 9.0"),
    "attention_backend_speed": {"flash2": (1.0, "the measured backend")},
})
