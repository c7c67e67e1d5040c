"""Measure torch.distributed.pipelining's zero-bubble split (I, then W) on a middle stage, CPU torch.

Usage: ``python -m validation.measure_zero_bubble [--out FILE] [--threads N]``

Protocol per configuration (validation/configs/cpu_memory.toml; validation/zero_bubble.py lists which):
seed torch, build the model (validation.torch_models), take its transformer blocks as a middle pipeline
stage, and run 2 warm-up micro-batches, then one tracked by validation.tracker.MemoryTracker: the input
x (micro_batch, seq, hidden) fp32 requiring grad and the output gradient dy are made before the step; the
forward (under autocast for bf16-mixed), then `stage_backward_input([y], [dy], [x], params)` (I) and
`stage_backward_weight(params, param_groups)` (W), as torch's zero-bubble schedules call them. Writes the
live bytes after the forward, the peak during I, the live bytes between I and W, the peak during W and
the live bytes after W (all categories; x, dy and the stage output y count; y and dy are dropped after I
as the pipelining runtime drops them), with the breakdown between I and W.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from validation.measure_memory import DEFAULT_CONFIGS, SEED, WARMUP_STEPS, _write_atomic, environment, load_configs
from validation.torch_models import build_model, parse_model, parse_training
from validation.tracker import MemoryTracker
from validation.zero_bubble import CONFIGURATIONS, DATA_FILE


def _micro_batch(stage, spec, training, tracker: MemoryTracker | None) -> int | None:
    """One micro-batch through the stage, I then W; the tracker's event count between I and W."""
    x = torch.randn(training.micro_batch_size, spec.seq_length, spec.hidden_size, requires_grad=True)
    dy = torch.randn(training.micro_batch_size, spec.seq_length, spec.hidden_size)
    if tracker is not None:
        tracker.set_phase("forward")
    if training.precision == "bf16-mixed":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = stage(x)
    else:
        y = stage(x)
    if tracker is not None:
        tracker.set_phase("backward")
    _, groups = stage_backward_input([y], [dy], [x], stage.parameters())
    del y, dy                       # the runtime drops its fwd_cache entry and the received gradient after I
    boundary = len(tracker._events) if tracker is not None else None
    stage_backward_weight(stage.parameters(), groups)
    return boundary


def measure(config: dict) -> dict[str, object]:
    """The live-byte levels of one tracked micro-batch (module docstring)."""
    spec, training = parse_model(config["model"]), parse_training(config["training"])
    torch.manual_seed(SEED)
    stage = build_model(spec, training).h           # the transformer blocks
    for _ in range(WARMUP_STEPS):
        _micro_batch(stage, spec, training, None)
        stage.zero_grad(set_to_none=True)
    tracker = MemoryTracker(stage, None, {})
    with tracker:
        boundary = _micro_batch(stage, spec, training, tracker)
    step = tracker.result()
    live = 0
    levels = {"forward_end_bytes": 0, "input_peak_bytes": 0, "boundary_bytes": 0, "weight_peak_bytes": 0}
    for k, event in enumerate(step.events):
        live += event.delta_bytes
        if event.phase in ("setup", "forward"):
            levels["forward_end_bytes"] = live
        elif k < boundary:
            levels["input_peak_bytes"] = max(levels["input_peak_bytes"], live)
            levels["boundary_bytes"] = live
        else:
            levels["weight_peak_bytes"] = max(levels["weight_peak_bytes"], live)
    levels["end_bytes"] = live
    levels["boundary_breakdown"] = step.live_by_category_at(step.events[boundary - 1].seq)
    return levels


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every configuration of validation.zero_bubble.CONFIGURATIONS and write the data file."""
    parser = argparse.ArgumentParser(prog="python -m validation.measure_zero_bubble",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DATA_FILE, help="output JSON file")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    configs = load_configs(DEFAULT_CONFIGS)
    results = {}
    for name in CONFIGURATIONS:
        results[name] = measure(configs[name])
        print(f"{name}: {results[name]}", file=sys.stderr)
    data = {"environment": environment(),
            "protocol": {"warmup_micro_batches": WARMUP_STEPS, "seed": SEED, "stage": "the model's blocks",
                         "tracker": "validation.tracker.MemoryTracker"},
            "configurations": results}
    _write_atomic(args.out, json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
