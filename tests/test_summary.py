"""Tests of the terminal summary of `memsim run` (simulator/report/summary.py)."""

from __future__ import annotations

import copy

from rich.console import Console

from simulator.report.summary import MAX_RANK_ROWS, render_summary
from simulator.workload.graph import CATEGORIES

GIB = 2**30


def _fits_report() -> dict:
    ranks = []
    for r in range(2):
        ranks.append({
            "rank": r, "stage": r, "device": "h100-sxm",
            "peak_allocated_bytes": (60 + r) * GIB, "peak_reserved_bytes": (66 + 10 * r) * GIB,
            "capacity_bytes": 80 * GIB, "oom": False,
            "breakdown_at_peak": {"parameters": 14 * GIB, "gradients": 14 * GIB,
                                  "optimizer_states": 28 * GIB, "activations": (4 + r) * GIB,
                                  "communication_buffers": GIB // 2, "other": GIB // 2},
            "compute_s": 0.6, "exposed_communication_s": 0.05, "idle_s": 0.1,
            "peak_op": f"layer{r}.mlp.fc1",
        })
    return {
        "scenario": "llama7b-h100", "fits": True, "iteration_time_s": 0.8123,
        "tokens_per_s": 40343.2, "model_flops_per_iteration": 1.7e15, "mfu": 0.4123,
        "bubble_fraction": 0.12, "communication": {"total_s": 0.2, "exposed_s": 0.05},
        "ranks": ranks, "warnings": ["bucket_size 25 MB is below the recommended minimum"],
        "device": "h100-sxm", "precision": "bf16-mixed",
        "model": {"name": "llama-7b", "parameters": 6.74e9},
        "time_breakdown": {"forward_s": 0.2, "backward_s": 0.4, "recompute_s": 0.0,
                           "optimizer_s": 0.05, "exposed_communication_s": 0.05,
                           "idle_s": 0.1123},
        "oom": None,
    }


def _oom_report() -> dict:
    report = _fits_report()
    report["fits"] = False
    report["ranks"][1]["oom"] = True
    report["ranks"][1]["peak_reserved_bytes"] = 80 * GIB
    report["oom"] = {"op": "layer7.mlp.fc1", "tensor": "layer7.mlp.fc1.out",
                     "requested_bytes": 4 * GIB, "allocated_bytes": 78 * GIB,
                     "reserved_bytes": 79 * GIB, "capacity_bytes": 80 * GIB,
                     "largest_live": [["layer0.attn.qkv.in", 2 * GIB],
                                      ["layer1.attn.qkv.in", GIB]]}
    return report


def _render(report: dict) -> str:
    console = Console(record=True, width=120)
    render_summary(report, console)
    return console.export_text()


def test_fits_report_key_strings():
    text = _render(_fits_report())
    for expected in ("llama7b-h100", "llama-7b (6.74 B parameters)", "h100-sxm", "bf16-mixed",
                     "FITS", "66.00 GiB", "76.00 GiB", "80.00 GiB", "82.5%", "95.0%",
                     "14.00 GiB", "4.00 GiB", "layer1.mlp.fc1", "812.30 ms", "40,343",
                     "41.2%", "12.0%", "idle / bubble", "112.30 ms", "exposed communication",
                     "bucket_size 25 MB is below the recommended minimum"):
        assert expected in text, expected
    assert "DOES NOT FIT" not in text and "out of memory" not in text
    # Breakdown of the most loaded rank (rank 1): activations 5 GiB of 62 GiB.
    assert "Breakdown at peak (rank 1" in text
    assert "5.00 GiB" in text and "8.1%" in text and "62.00 GiB" in text
    for label in ("parameters", "gradients", "optimizer states", "activations",
                  "communication buffers", "other"):
        assert label in text
    assert len(CATEGORIES) == 6


def test_fits_is_green_and_oom_is_red():
    console = Console(record=True, width=120, force_terminal=True, color_system="truecolor")
    render_summary(_fits_report(), console)
    html = console.export_html(inline_styles=True)
    assert "FITS" in html and "#008000" in html           # rich's "green"
    console = Console(record=True, width=120, force_terminal=True, color_system="truecolor")
    render_summary(_oom_report(), console)
    html = console.export_html(inline_styles=True)
    assert "DOES NOT FIT" in html and "#800000" in html   # rich's "red"


def test_oom_report_names_op_tensor_and_live_tensors():
    text = _render(_oom_report())
    for expected in ("DOES NOT FIT", "out of memory on rank 1", "layer7.mlp.fc1",
                     "layer7.mlp.fc1.out", "requested 4.00 GiB", "78.00 GiB allocated",
                     "79.00 GiB reserved", "short by at least 2.00 GiB",
                     "layer0.attn.qkv.in", "2.00 GiB", "layer1.attn.qkv.in", "100.0%", "0 B",
                     "layer1.mlp.fc1"):
        assert expected in text, expected
    assert "✔ FITS" not in text


def test_minimal_report_without_optional_keys():
    report = _fits_report()
    for key in ("device", "precision", "model", "time_breakdown", "oom", "warnings"):
        del report[key]
    report["mfu"] = float("nan")
    text = _render(report)
    assert "llama7b-h100" in text and "FITS" in text
    assert "Where the time went" not in text and "warnings" not in text
    assert "—" in text


def test_many_ranks_are_capped():
    report = _fits_report()
    template = report["ranks"][0]
    report["ranks"] = []
    for r in range(MAX_RANK_ROWS + 8):
        row = copy.deepcopy(template)
        row["rank"], row["stage"] = r, r // 10
        row["peak_reserved_bytes"] = (40 + r) * GIB
        report["ranks"].append(row)
    text = _render(report)
    assert "8 more ranks not shown" in text
    assert "71.00 GiB" in text and "79.00 GiB" in text      # largest reserved are listed


def test_render_is_deterministic():
    assert _render(_oom_report()) == _render(_oom_report())
