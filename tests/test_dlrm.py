"""DLRM workload (workload/dlrm.py) and its embedding tables in host memory (offload/embeddings.py)."""

from __future__ import annotations

import pytest

from simulator import simulate
from simulator.api import model_shape
from simulator.errors import MemsimError
from simulator.scenario import scenario_from_dict
from simulator.workload.transformer import model_parameter_count

ROWS = [4000, 1000, 3000]


def _doc(placement="device", optimizer="sgd", **training) -> dict:
    return {"name": "dlrm",
            "model": {"architecture": "dlrm", "embedding_rows": ROWS, "embedding_dim": 16, "bottom_mlp": [32, 16],
                      "top_mlp": [32, 1], "embedding_placement": placement},
            "training": {"micro_batch_size": 256, "precision": "fp32", "optimizer": optimizer, **training},
            "cluster": {"topology": "workstation-rtx4090"}, "run": {"warmup_iterations": 1, "record_events": False}}


def _run(doc: dict) -> dict:
    return simulate(scenario_from_dict(doc)).report


def test_parameter_count_and_the_criteo_preset():
    mlps = (13 * 32 + 32 + 32 * 16 + 16) + ((16 + 6) * 32 + 32 + 32 + 1)     # 3 tables + dense: 4 * 3 / 2 = 6 pairs
    assert model_parameter_count(model_shape(scenario_from_dict(_doc()))) == sum(ROWS) * 16 + mlps
    criteo = scenario_from_dict({"model": {"preset": "dlrm-criteo-1tb"}}).model
    assert criteo.embedding_tables == 26 and sum(criteo.embedding_rows) == 177_944_275


def test_host_placement_moves_the_tables_and_their_traffic():
    device, host = _run(_doc()), _run(_doc("host"))
    table = sum(ROWS) * 16 * 4
    gpu_d, gpu_h = device["ranks"][0]["category_peaks"], host["ranks"][0]["category_peaks"]
    assert gpu_d["parameters"] - gpu_h["parameters"] == pytest.approx(table, abs=4096)   # 512-byte rounding
    assert gpu_d["gradients"] > gpu_h["gradients"] + table - 4096                        # no dense table gradient
    rank = host["ranks"][0]
    assert rank["host_breakdown_at_peak"]["parameters"] == table
    pooled = 256 * 3 * 16 * 4
    assert host["offload"]["embeddings"] == "host"
    assert host["offload"]["h2d_bytes"] == host["offload"]["d2h_bytes"] == pooled        # one micro-batch each way
    assert host["time_breakdown"]["offload_traffic_s"] > 0 and host["time_breakdown"]["host_compute_s"] > 0


def test_sparse_adam_keeps_two_dense_moments_on_the_host():
    sgd, adam = _run(_doc("host")), _run(_doc("host", "adamw"))
    table = sum(ROWS) * 16 * 4
    assert adam["ranks"][0]["host_peak_bytes"] - sgd["ranks"][0]["host_peak_bytes"] == 2 * table
    assert adam["offload"]["host_dram_bytes"] > sgd["offload"]["host_dram_bytes"]


def test_a_host_that_cannot_hold_the_tables_does_not_fit():
    report = _run({**_doc("host"), "cluster": {"topology": "workstation-rtx4090", "host_memory": "100 kB"}})
    assert report["fits"] is False and any("host memory" in w for w in report["warnings"])


@pytest.mark.parametrize("change, words", [
    ({"training": {"precision": "bf16-mixed"}}, "training.precision = 'bf16-mixed' with model.architecture = 'dlrm'"),
    ({"training": {"optimizer": "sgd-momentum"}}, "training.optimizer = 'sgd-momentum'"),
    ({"model": {"bottom_mlp": [32, 8]}}, "model.bottom_mlp = (32, 8): must end with model.embedding_dim = 16"),
    ({"model": {"num_layers": 4}}, "model.num_layers = 4: a transformer key"),
    ({"model": {"embedding_rows": 1000}}, "model.embedding_tables"),
    ({"model": {"embedding_placement": "disk"}}, "model.embedding_placement = 'disk'"),
    ({"cluster": {"topology": "rtx-4090"}}, "offload needs a topology"),
])
def test_refusals_are_one_line(change, words):
    doc = _doc("host")
    for section, values in change.items():
        doc[section] = {**doc[section], **values}
    with pytest.raises(MemsimError) as error:
        _run(doc)
    assert words in str(error.value) and "\n" not in str(error.value)
