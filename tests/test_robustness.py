"""Bad input and odd plans end in a MemsimError (one line) or a correct result, never another exception."""

from __future__ import annotations

import itertools

import pytest

from simulator.api import simulate
from simulator.errors import DataError, MemsimError, PlanError, ScenarioError, ScheduleError, TopologyError
from simulator.network.spec import read_server
from simulator.parallel.schedules import Action, parse_actions
from simulator.scenario import scenario_from_dict
from simulator.scenario.limits import MAX_MICROBATCHES

_TINY = {"architecture": "gpt", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "vocab_size": 100,
         "seq_length": 16}
_PLANS = {1: ("rtx-4090", 1), 4: ("pcie-4x4090", 1), 2: ("pcie-4x4090", 2)}     # dp -> (topology, pp)


def _doc(precision: str = "bf16-mixed", zero: int = 0, dp: int = 1, **training) -> dict:
    topology, pp = _PLANS[dp]
    return {"model": dict(_TINY), "training": {"micro_batch_size": 1, "global_batch_size": 2 * dp,
                                                "precision": precision, **training},
            "parallel": {"dp": dp, "pp": pp, "zero_stage": zero}, "cluster": {"topology": topology},
            "allocator": {"kind": "exact"}, "run": {"warmup_iterations": 0, "iterations": 1}}


@pytest.mark.parametrize("precision,zero,dp", [
    (p, z, dp) for p, z, dp in itertools.product(("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp8-mixed"),
                                                 (0, 1, 2, 3), (1, 4, 2))
    if not (dp == 2 and z >= 2)])      # ZeRO-2/3 with pp > 1 is refused (tested in test_plan)
def test_every_precision_and_zero_stage_simulates(precision, zero, dp):
    """fp16-mixed + ZeRO + dp > 1 used to raise KeyError in engine/memory.py (the loss scaler's temporaries)."""
    report = simulate(scenario_from_dict(_doc(precision, zero, dp), "x.toml"), timelines=False).report
    assert report["iteration_time_s"] > 0 and report["fits"]
    assert all(rank["peak_allocated_bytes"] > 0 for rank in report["ranks"])


def test_the_issue_plan_fp16_zero1_dp4():
    doc = _doc("fp16-mixed", 1, 4)
    doc["model"]["num_layers"] = 1
    doc["parallel"]["pp"] = 1
    doc["training"]["global_batch_size"] = 4
    report = simulate(scenario_from_dict(doc, "x.toml"), timelines=False).report
    assert report["iteration_time_s"] > 0 and report["precision"] == "fp16-mixed"


def test_a_tensor_beyond_any_device_is_a_plan_error():
    """A tensor past the allocator's lifted (16 TiB) capacity used to let the engine's OutOfMemory escape."""
    doc = {"model": {**_TINY, "num_layers": 1, "hidden_size": 1 << 20, "num_attention_heads": 1,
                     "vocab_size": 1 << 24}, "cluster": {"topology": "rtx-4090"}, "run": {"warmup_iterations": 0}}
    with pytest.raises(PlanError, match=r"tensor 'wte.weight' of 70368744177664 bytes .* no device holds this job"):
        simulate(scenario_from_dict(doc, "x.toml"), timelines=False)


@pytest.mark.parametrize("key,value,rule", [
    ("model.num_channels", 2147483648, "at most 65536"),
    ("cluster.nodes", 10**9, "at most 131072"),
    ("run.iterations", 10**6, "at most 1024"),
    ("model.hidden_size", 10**7, "at most 1048576"),
])
def test_values_past_their_bound_name_the_key(key, value, rule):
    doc = _doc()
    section, name = key.split(".")
    if name == "num_channels":
        doc["model"] = {"preset": "vit-large"}
    doc[section][name] = value
    with pytest.raises(ScenarioError, match=rf"^x.toml: {key} = {value}: {rule} \("):
        scenario_from_dict(doc, "x.toml")


@pytest.mark.parametrize("global_batch", [10**9, 2**63 - 1, 2 * (MAX_MICROBATCHES + 1)])
def test_unbounded_micro_batches_are_refused(global_batch):
    """global_batch_size = 10**9 with micro-batch 1 used to be accepted and then simulate for days."""
    with pytest.raises(ScenarioError, match=r"(micro-batches per iteration|global_batch_size = \d+): at most"):
        scenario_from_dict(_doc(global_batch_size=global_batch), "x.toml")
    scenario_from_dict(_doc(global_batch_size=MAX_MICROBATCHES), "x.toml")     # the bound itself loads


@pytest.mark.parametrize("text,message", [
    ("99999999999999999999F0 0B0", "stage 999999999999... out of range: at most 65535"),
    ("0F99999999 0B99999999", "micro-batch 99999999 out of range"),
    ("\u0661F0 0B0", "expected STAGE KIND MICROBATCH"),           # an Arabic-Indic one: ASCII digits only
    ("0F\uff10 0B0", "expected STAGE KIND MICROBATCH"),           # a full-width zero
])
def test_schedule_numbers_are_ascii_and_bounded(text, message):
    """A huge stage number used to raise OverflowError in schedules._owners."""
    with pytest.raises(ScheduleError, match=message):
        parse_actions(text + "\n1F0 1B0\n")
    assert Action.from_str("0000012F3").stage == 12


def _calibration(tmp_path, extra: str, top: str = "") -> str:
    path = tmp_path / "cal.toml"
    path.write_text(f'{top}\nformat = "memsim-calibration-1"\ndevice = "rtx-4090"\n{extra}\n')
    return str(path)


@pytest.mark.parametrize("top,extra,message", [
    ('links = "x"', "", "links = 'x' must be a table of collectives"),
    ("links = [1, 2]", "", "links = \\[1, 2\\] must be a table of collectives"),
    ("", "[[links]]\na = 1", "links = \\[\\{'a': 1\\}\\] must be a table"),
    ("", "[links.all_reduce]\nx = 1", "links.all_reduce.x must be a world size"),
    ("", '[links.all_reduce.4]\nlatency_s = "inf"\nbytes_per_s = 1e9', "links.all_reduce.4.latency_s = 'inf' must"),
    ("", "[links.all_reduce.4]\nlatency_s = 1e-5\nbytes_per_s = 1e300",
     "links.all_reduce.4.bytes_per_s = 1e\\+300 is beyond any real"),
    ("", "[fields]\nhbm_bytes_per_s = 1e308", "fields.hbm_bytes_per_s = 1e\\+308 is beyond any real device"),
    ("", "[fields]\ngemm_k_overhead = 100000000000000000000", "fields.gemm_k_overhead = 1000.* is beyond"),
    ("", "[fields.peak_flop_per_s]\nbf16 = 1e30", "fields.peak_flop_per_s.bf16 = 1e\\+30 is beyond"),
    ("", "[fields]\nlaunch_overhead_s = 3600", "fields.launch_overhead_s = 3600 is beyond"),
])
def test_calibration_files_are_checked_and_named(tmp_path, top, extra, message):
    """links that are not a table used to raise AttributeError; 1e308 B/s used to run (an iteration of 4e302 s)."""
    doc = _doc()
    doc["cluster"]["calibration"] = _calibration(tmp_path, extra, top)
    with pytest.raises(DataError, match=rf"^x.toml: cluster.calibration: .*cal.toml: {message}"):
        simulate(scenario_from_dict(doc, "x.toml"), timelines=False)


def test_a_real_calibration_still_applies(tmp_path):
    doc = _doc()
    doc["cluster"]["calibration"] = _calibration(
        tmp_path, "[fields]\nhbm_bytes_per_s = 1.0e12\ngemm_k_overhead = 188\n[links.all_reduce.4]\n"
                  "latency_s = 1e-5\nbytes_per_s = 2e10")
    assert simulate(scenario_from_dict(doc, "x.toml"), timelines=False).report["iteration_time_s"] > 0


def test_a_topology_file_that_is_not_utf8(tmp_path):
    """`memsim topo show` on such a file used to raise UnicodeDecodeError in network/spec.py."""
    path = tmp_path / "t.toml"
    path.write_bytes(b"\xff\xfe[server]\n")
    with pytest.raises(TopologyError, match="t.toml: not valid TOML"):
        read_server(path)
    with pytest.raises(TopologyError, match="cannot read the topology file"):
        read_server(tmp_path)


def test_only_memsim_errors_carry_one_line():
    for error in (DataError, PlanError, ScenarioError, ScheduleError, TopologyError):
        assert issubclass(error, MemsimError) and error.exit_code == 2


@pytest.mark.parametrize("args,message", [
    (["run", "--memory-workers", "-1", "x.toml"], "Invalid value for '--memory-workers'"),
    (["run", "--memory-workers", "abc", "x.toml"], "Invalid value for '--memory-workers'"),
    (["run", "--memory-workers", "100000", "x.toml"], "less than or equal to 1024"),
    (["run", "--bogus", "x.toml"], "No such option: --bogus"),
    (["run"], "Missing argument 'scenario'"),
    (["frobnicate"], "No such command 'frobnicate'"),
    (["topo", "show"], "Missing argument 'name'"),
])
def test_usage_errors_are_one_line_and_exit_2(capsys, args, message):
    """Typer's boxed usage errors became one `memsim: error:` line like every other error."""
    from simulator.cli import _run_app

    assert _run_app(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("memsim: error: ") and message in err and err.count("\n") == 1


def test_memory_workers_beyond_any_machine_are_refused_by_the_api():
    scenario = scenario_from_dict(_doc(), "x.toml")
    for bad in (-1, 10**6, True, 1.5):
        with pytest.raises(MemsimError, match=r"memory_workers = .*: must be an integer in 0..1024"):
            simulate(scenario, timelines=False, memory_workers=bad)


def test_every_capacity_shown_is_named():
    """The table showed the device's capacity, the OOM box and memory.png the allocator's, with no word about the
    memory outside the allocator between them."""
    import io

    from rich.console import Console

    from simulator.report.summary import render_summary

    doc = {"model": {"preset": "llama-7b", "num_layers": 2}, "training": {"micro_batch_size": 1},
           "cluster": {"topology": "rtx-4090"}, "allocator": {"memory_fraction": 0.05},
           "run": {"warmup_iterations": 0}}
    report = simulate(scenario_from_dict(doc, "x.toml"), timelines=False).report
    buffer = io.StringIO()
    render_summary(report, Console(file=buffer, width=400))
    text = buffer.getvalue()
    assert "512.00 MiB of it is outside the allocator (CUDA context, NCCL, cuBLAS: allocator.context_bytes)" in text
    assert "left to the allocator (the device's memory less allocator.context_bytes)" in text


def test_every_value_the_reference_lists_is_accepted():
    """docs/scenario-reference.md (generated from the key tables) lists only values the loader takes."""
    import re

    from simulator.scenario.parsers import Invalid
    from simulator.scenario.schema import SECTION_KEYS

    checked = 0
    for specs in SECTION_KEYS.values():
        for spec in specs:
            for token in (t.strip().strip('"') for t in spec.type_doc.split("|")):
                if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", token) or token in ("int", "float", "str", "bool",
                                                                                   "path", "size", "table"):
                    continue
                value = int(token) if token.isdigit() else token
                try:
                    spec.parse(value)
                except Invalid as error:
                    raise AssertionError(f"{spec.key} = {value!r} is listed but refused: {error}") from None
                checked += 1
    assert checked > 50
