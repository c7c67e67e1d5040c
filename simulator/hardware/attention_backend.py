"""`training.attention_backend`: the device with its fused-attention rate set for the chosen backend (cuDNN,
FlashAttention-2 or -3), or the refusal where the run cannot use that backend."""

from __future__ import annotations

import dataclasses

from simulator.errors import ScenarioError
from simulator.hardware.device_spec import ATTENTION_BACKENDS, DeviceSpec

BACKEND_CHOICES = ("auto", *ATTENTION_BACKENDS)
_NAMES = {"cudnn": "cuDNN fused attention", "flash2": "FlashAttention-2", "flash3": "FlashAttention-3"}


def with_attention_backend(device: DeviceSpec, backend: str, attention: str, precision: str,
                           source: str = "") -> DeviceSpec:
    """`device` with attention_efficiency for `backend` ("auto": as measured, the backend torch's SDPA and Transformer
    Engine pick on it): the measured efficiency x that backend's relative speed (DeviceSpec.attention_backend_speed).

    Args:
        device: the cluster's device (a calibration's attention_efficiency is kept and scaled alike).
        backend: training.attention_backend.
        attention: model.attention ("flash" is the fused kernel; eager and linformer run unfused matmuls).
        precision: training.precision (the fused kernels run in fp16 / bf16).
        source: the scenario file, for the message.

    Raises:
        ScenarioError: one line naming the key and the rule.
    """
    if backend == "auto":
        return device
    prefix = f"{source}: " if source else ""
    rule = None
    if device.kind != "gpu":
        rule = f"needs a GPU (the device is {device.name!r})"
    elif attention != "flash":
        rule = f"needs model.attention = 'flash' (the fused kernel); here {attention!r} runs unfused matmuls"
    elif precision == "fp32":
        rule = "the fused attention kernels run in fp16 / bf16: needs training.precision other than fp32"
    elif backend not in device.attention_backend_speed:
        available = ", ".join(sorted(device.attention_backend_speed)) or "none"
        only = " (FlashAttention-3 runs on Hopper, sm_90, only)" if backend == "flash3" else ""
        rule = (f"{_NAMES[backend]} has no measured rate on {device.name!r}{only}; allowed there: auto, {available}")
    if rule is not None:
        raise ScenarioError(f"{prefix}training.attention_backend = {backend!r}: {rule}")
    speed = device.attention_backend_speed[backend]
    return dataclasses.replace(device, attention_efficiency=min(1.0, device.attention_efficiency * speed))


__all__ = ["BACKEND_CHOICES", "with_attention_backend"]
