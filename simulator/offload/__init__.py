"""CPU and NVMe offload (ZeRO-Offload, ZeRO-Infinity, activation offload): host tensors, host memory, the passes."""
