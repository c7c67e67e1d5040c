"""Measure the transient allocations of CUDA reductions and linear backward (bias gradients) on one GPU.

Usage: ``python -m validation.cuda.probe_reductions OUT.json`` (needs a CUDA build of torch).

For each dtype, row count and width it records, with ``torch.cuda.memory._record_memory_history``, the
allocations (sizes in request order) made by (a) ``g.sum(0)`` of a contiguous (rows, width) gradient --
the bias gradient of a linear layer --, (b) ``g.sum((0, 1))`` of the same gradient viewed as (8, rows/8,
width), and (c) the backward of ``F.linear(x, w, b)`` for a (rows, width) output gradient. memsim's model
of the reduction's staging buffer (simulator/workload/reductions.py) is checked against this file.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROWS = (1024, 4096, 8192, 16384, 32768)
WIDTHS = (256, 768, 1024, 2304, 3072, 4096, 5632, 8192, 11008)


def _allocs(fn) -> list[int]:
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(context=None, max_entries=100_000)
    try:
        fn()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return [int(e["size"]) for e in trace if e["action"] == "alloc"]


def main(path: str) -> None:
    props = torch.cuda.get_device_properties(0)
    rows_out = []
    for dtype_name, dtype in DTYPES.items():
        for rows in ROWS:
            for width in WIDTHS:
                g = torch.randn(rows, width, dtype=dtype, device="cuda")
                sum0 = _allocs(lambda: g.sum(0))
                sum3d = _allocs(lambda: g.view(8, rows // 8, width).sum((0, 1)))
                x = torch.randn(rows, 512, dtype=dtype, device="cuda", requires_grad=True)
                w = torch.randn(width, 512, dtype=dtype, device="cuda", requires_grad=True)
                b = torch.randn(width, dtype=dtype, device="cuda", requires_grad=True)
                y = F.linear(x, w, b)
                linear = _allocs(lambda: y.backward(g))
                rows_out.append([dtype_name, rows, width, sum0, sum3d, linear])
                del g, x, w, b, y
        torch.cuda.empty_cache()
    document = {
        "format": "memsim-cuda-reductions-1",
        "environment": {"torch_version": torch.__version__, "cuda_version": torch.version.cuda,
                        "device_name": torch.cuda.get_device_name(0),
                        "multiprocessor_count": props.multi_processor_count,
                        "max_threads_per_multiprocessor": props.max_threads_per_multi_processor},
        "columns": ["dtype", "rows", "width", "sum0_allocs", "sum01_3d_allocs", "linear_backward_allocs"],
        "note": "allocation sizes in request order (bytes); linear backward: x (rows, 512), w (width, 512), b (width)",
        "rows": rows_out,
    }
    with open(path, "w") as handle:
        json.dump(document, handle, indent=0)


if __name__ == "__main__":
    main(sys.argv[1])
