"""memsim's zero-bubble split of a middle stage against torch.distributed.pipelining's, measured on CPU.

Usage: ``python -m validation.zero_bubble`` prints, per configuration, the measured live bytes
(validation/data/cpu/zero_bubble.json, from ``python -m validation.measure_zero_bubble``) and memsim's:
after the forward, peak during I, between I and W, peak during W, after W. memsim walks the stage's ops
(workload/stage.py with `split_weight`, framework torch: the retained autograd graph) from the same
starting point: parameters, the stage input and the output gradient; the stage output stays until the end
of I on both sides (the pipelining runtime keeps it for `stage_backward_input`: MicrobatchStage.output).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from simulator import api
from simulator.scenario import scenario_from_dict
from simulator.workload.graph import Op
from simulator.workload.stage import StageSpec, build_stage
from validation.memory_comparison import scenario_document

DATA_FILE = Path(__file__).resolve().parent / "data" / "cpu" / "zero_bubble.json"
CONFIGURATIONS = ("gpt-tiny-fp32-flash-none-adamw", "gpt-tiny-fp32-eager-drop-none-adamw",
                  "gpt-small-fp32-eager-drop-none-adamw", "gpt-small-bf16-mixed-flash-none-adamw")
LEVELS = ("forward_end_bytes", "input_peak_bytes", "boundary_bytes", "weight_peak_bytes", "end_bytes")


@dataclass(frozen=True)
class Levels:
    """Live bytes of one micro-batch on a middle stage around a zero-bubble split."""

    forward_end_bytes: int
    input_peak_bytes: int
    boundary_bytes: int
    weight_peak_bytes: int
    end_bytes: int

    def errors(self, measured: dict) -> dict[str, float]:
        """Relative error of each level against the measured ones."""
        return {key: getattr(self, key) / measured[key] - 1.0 for key in LEVELS}


def predict(name: str, config: dict, framework: str = "torch") -> Levels:
    """memsim's levels for a configuration's blocks as a middle stage, one micro-batch, I then W."""
    document = scenario_document(name, config)
    document["training"]["framework"] = framework
    scenario = scenario_from_dict(document, source=f"<{name}>")
    cluster = api.resolve_cluster(scenario)
    recipe = api.multi_recipe(scenario, cluster.device)
    model, training = config["model"], config["training"]
    activation = (training["micro_batch_size"], model["seq_length"], model["hidden_size"])
    workload = build_stage(api.model_shape(scenario, padded=False), recipe, api.kernel_profile(cluster.device),
                           StageSpec(0, model["num_layers"], False, False), 1, 0, (activation, "fp32"),
                           split_weight=True)
    microbatch, tensors = workload.microbatches[0], workload.tensors
    live = sum(tensors[t].nbytes for t in workload.persistent + (microbatch.stage_input, microbatch.grad_output))

    def walk(ops: Sequence[Op]) -> int:
        nonlocal live
        peak = live
        for op in ops:
            live += sum(tensors[t].nbytes for t in op.allocs)
            peak = max(peak, live)
            live -= sum(tensors[t].nbytes for t in op.frees)
        return peak

    walk(microbatch.forward)
    if microbatch.sent_output is not None:
        live -= tensors[microbatch.sent_output].nbytes     # megatron: released once sent (lower_multi)
    forward_end = live
    input_peak = walk(microbatch.backward)
    if microbatch.output is not None:
        live -= tensors[microbatch.output].nbytes          # released after I (lower_multi)
    # The input gradient is sent after I and released when the send ends; torch's measurement drops it there.
    live -= tensors[microbatch.input_grad].nbytes
    boundary = live
    weight_peak = walk(microbatch.weight)
    # The measured step ends when measure_zero_bubble._micro_batch returns, which drops its local x (the stage
    # input) inside the tracked region; nothing else holds it after W.
    live -= tensors[microbatch.stage_input].nbytes
    return Levels(forward_end, input_peak, boundary, weight_peak, live)


def load_measurements(path: Path = DATA_FILE) -> dict[str, dict]:
    """The committed measurements, by configuration name."""
    return json.loads(path.read_text())["configurations"]


def main() -> int:
    """Print measured and predicted levels side by side."""
    from validation.measure_memory import DEFAULT_CONFIGS, load_configs
    configs = load_configs(DEFAULT_CONFIGS)
    for name, measured in load_measurements().items():
        levels = predict(name, configs[name])
        errors = levels.errors(measured)
        print(name)
        for key in LEVELS:
            print(f"  {key:18s} measured {measured[key]:>11,d}  memsim {getattr(levels, key):>11,d}  "
                  f"{100 * errors[key]:+.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
