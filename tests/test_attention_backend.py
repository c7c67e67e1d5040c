"""training.attention_backend: each backend's rate on the device, its effect on attention ops, and its refusals."""

from __future__ import annotations

import pytest

from simulator import scenario_from_dict, simulate
from simulator.errors import ScenarioError
from simulator.hardware.attention_backend import with_attention_backend
from simulator.hardware.catalog import get_device
from simulator.hardware.measured import HOPPER_KERNELS


def _doc(topology="h100-sxm", **training):
    return {"name": "x", "model": {"architecture": "gpt", "num_layers": 2, "hidden_size": 1024,
                                   "num_attention_heads": 8, "vocab_size": 1024, "seq_length": 2048,
                                   "attention": "flash", "dropout": 0.0},
            "training": {"micro_batch_size": 4, "global_batch_size": 4, "precision": "bf16-mixed", **training},
            "cluster": {"topology": topology}, "run": {"warmup_iterations": 1, "record_events": False}}


def test_backend_rates_on_hopper():
    h100 = get_device("h100-sxm")
    assert h100.attention_backend == "cudnn"
    assert h100.attention_efficiency == HOPPER_KERNELS["attention_efficiency"]
    for backend, speed in (("cudnn", 1.0), ("flash2", 0.620), ("flash3", 1.069)):
        device = with_attention_backend(h100, backend, "flash", "bf16-mixed")
        assert device.attention_efficiency == pytest.approx(h100.attention_efficiency * speed, rel=1e-12)
    assert with_attention_backend(h100, "auto", "eager", "fp32") is h100


def test_backend_changes_only_attention_time():
    reports = {b: simulate(scenario_from_dict(_doc(attention_backend=b)), timelines=False).report
               for b in ("auto", "cudnn", "flash2", "flash3")}
    assert reports["auto"]["iteration_time_s"] == reports["cudnn"]["iteration_time_s"]
    assert reports["flash2"]["iteration_time_s"] > reports["cudnn"]["iteration_time_s"] > \
        reports["flash3"]["iteration_time_s"]
    assert reports["flash2"]["ranks"][0]["peak_allocated_bytes"] == reports["cudnn"]["ranks"][0]["peak_allocated_bytes"]


@pytest.mark.parametrize("doc, rule", [
    (_doc("a100-80gb-sxm", attention_backend="flash3"), "FlashAttention-3 has no measured rate on 'a100-80gb-sxm' "
                                                        "(FlashAttention-3 runs on Hopper, sm_90, only); allowed "
                                                        "there: auto, flash2"),
    (_doc("a100-80gb-sxm", attention_backend="cudnn"), "allowed there: auto, flash2"),
    (_doc("cpu", attention_backend="flash2"), "needs a GPU"),
    (_doc(attention_backend="flash2", precision="fp32"), "run in fp16 / bf16"),
    ({**_doc(attention_backend="cudnn"), "model": {**_doc()["model"], "attention": "eager"}},
     "needs model.attention = 'flash'"),
])
def test_refusals(doc, rule):
    with pytest.raises(ScenarioError) as error:
        simulate(scenario_from_dict(doc, source="x.toml"), timelines=False)
    text = str(error.value)
    assert text.startswith("x.toml: training.attention_backend = ") and rule in text and "\n" not in text
