"""The host-issue clock's costs per launch, from the committed H200 captures (validation/data/cuda/timing/*.json).

Each capture times every phase of a torch training step (validation/capture.py: forward, backward with its
`loss.item()`, optimizer, zero_grad) on the wall clock (CUDA events) and the process CPU clock, and profiles the
kernels. Where the GPU is busy less than HOST_BOUND of the step (its profiled kernel time over the step's wall
time), it waits for the host, and the host's time is what the step takes. Printed (and kept in
simulator/hardware/catalog.py HOST_ISSUE, which tests/test_host_issue.py checks against this script):

* host_forward_op_s, host_backward_op_s, host_checkpoint_s: a least-squares fit, over those host-bound
  configurations, of forward CPU time + backward wall time (the autograd thread issues the backward; the
  process CPU clock would also count the main thread waiting in `loss.item()`) = forward ops x the first +
  backward and recompute ops x the second + checkpointed regions x the third (torch.utils.checkpoint's own host
  work: saving inputs and RNG state in the forward, replaying in the backward);
* host_optimizer_tensor_s: median over all eight of optimizer CPU time / the tensors memsim's optimizer ops walk
  (a foreach op walks every parameter; a single-tensor op one).

    python benchmarks/host_issue_params.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simulator import scenario_from_dict  # noqa: E402
from simulator.api import build_workload  # noqa: E402
from simulator.hardware.catalog import get_device  # noqa: E402
import numpy as np  # noqa: E402

from simulator.workload.graph import FORWARD, OPTIMIZER_STEP, RECOMPUTE  # noqa: E402

CAPTURES = ROOT / "validation" / "data" / "cuda" / "timing"
HOST_BOUND = 0.85     # GPU busy below this share of the step: the host sets its pace


def measure(folder: Path = CAPTURES) -> dict[str, float]:
    """The four host costs (seconds) from the captures in `folder`."""
    device = get_device("h200-sxm")
    counts, times, optimizer = [], [], []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        phases = data["iteration"]["phases"]
        scenario = scenario_from_dict({"name": path.stem, "model": data["config"]["model"],
                                       "training": data["config"]["training"],
                                       "cluster": {"topology": "h200-sxm"}}, source=str(path))
        workload = build_workload(scenario, device)
        ops = workload.first_microbatch
        n_forward = sum(op.phase == FORWARD for op in ops)
        regions = sum(b.phase == RECOMPUTE and a.phase != RECOMPUTE for a, b in zip(ops, ops[1:]))
        tensors = sum(op.tensors for op in workload.optimizer if op.phase == OPTIMIZER_STEP)
        optimizer.append(phases["optimizer"]["cpu_median_s"] / tensors)
        busy_s = sum(data["ops"]["self_us_per_step_by_name"].values()) * 1e-6
        if busy_s < HOST_BOUND * data["iteration"]["wall"]["median_s"]:
            counts.append([n_forward, len(ops) - n_forward, regions])
            times.append(phases["forward"]["cpu_median_s"] + phases["backward"]["wall_median_s"])
    fit, *_ = np.linalg.lstsq(np.array(counts, dtype=float), np.array(times), rcond=None)
    return {"host_forward_op_s": float(fit[0]), "host_backward_op_s": float(fit[1]), "host_checkpoint_s": float(fit[2]),
            "host_optimizer_tensor_s": statistics.median(optimizer), "host_bound_configurations": len(counts),
            "configurations": len(optimizer)}


if __name__ == "__main__":
    for key, value in measure().items():
        print(f"{key} = {value!r}")
