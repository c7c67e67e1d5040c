"""The `memsim` command-line contract: exit codes, one-line errors, the JSON report, --out files, determinism."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simulator.api import simulate
from simulator.cli import app
from simulator.hardware.catalog import list_devices
from simulator.scenario import load_scenario
from simulator.scenario.presets import list_presets

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((REPO / "scenarios").glob("*.toml"))
OUT_FILES = ["memory.png", "memory_snapshot.pickle", "report.json", "trace.json"]

TINY_GPT = """\
name = "cli-tiny-gpt"
[model]
architecture = "gpt"
num_layers = 2
hidden_size = 64
num_attention_heads = 4
vocab_size = 256
seq_length = 32
[training]
micro_batch_size = 2
global_batch_size = 4
precision = "fp32"
[cluster]
topology = "cpu"
[allocator]
kind = "exact"
"""

TINY_LLAMA = """\
name = "cli-tiny-llama"
[model]
architecture = "llama"
num_layers = 2
hidden_size = 64
num_attention_heads = 4
num_kv_heads = 2
vocab_size = 256
seq_length = 32
[cluster]
topology = "cpu"
"""

# Small GPT on a GPU with the caching allocator, gradient accumulation and two measured iterations:
# the most stateful path, used for --out and determinism.
SMALL_4090 = """\
name = "cli-small-4090"
[model]
architecture = "gpt"
num_layers = 2
hidden_size = 128
num_attention_heads = 4
vocab_size = 512
seq_length = 64
[training]
micro_batch_size = 2
global_batch_size = 4
precision = "bf16-mixed"
[cluster]
topology = "rtx-4090"
[allocator]
kind = "caching"
[run]
iterations = 2
"""

# LLaMA-7B weights alone (fp32 under bf16-mixed) exceed a 24 GB card: a clear "does not fit".
NOT_FITTING = """\
name = "cli-llama7b-4090"
[model]
preset = "llama-7b"
seq_length = 256
[training]
precision = "bf16-mixed"
[cluster]
topology = "rtx-4090"
"""

# The DESIGN.md "JSON report" contract: key -> type (dicts: nested contracts).
RANK_CONTRACT = {
    "rank": int, "stage": int, "device": str,
    "peak_allocated_bytes": int, "peak_reserved_bytes": int, "capacity_bytes": int, "oom": bool,
    "breakdown_at_peak": {"parameters": int, "gradients": int, "optimizer_states": int,
                          "activations": int, "communication_buffers": int, "other": int},
    "compute_s": float, "exposed_communication_s": float, "idle_s": float,
}
REPORT_CONTRACT = {
    "scenario": str, "fits": bool, "iteration_time_s": float, "tokens_per_s": float,
    "model_flops_per_iteration": float, "mfu": float, "bubble_fraction": float,
    "communication": {"total_s": float, "exposed_s": float},
    "ranks": [RANK_CONTRACT], "warnings": [str],
}


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _env(hash_seed: str = "0") -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["PYTHONHASHSEED"] = hash_seed
    env["COLUMNS"] = "120"
    return env


def _memsim_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "simulator.cli", *args]


def _memsim(*args: str, cwd: Path, hash_seed: str = "0") -> subprocess.CompletedProcess:
    """Run `python -m simulator.cli ARGS` in a fresh process."""
    return subprocess.run(_memsim_cmd(*args), cwd=cwd, env=_env(hash_seed), capture_output=True, text=True,
                          timeout=300)


def _invoke(*args: str):
    """Run the typer app in this process (fast); exceptions other than exits are not swallowed."""
    result = CliRunner().invoke(app, list(args), catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def _assert_one_line_error(exit_code: int, stdout: str, stderr: str, fragments: tuple[str, ...]) -> str:
    assert exit_code == 2, f"exit {exit_code}, stderr: {stderr!r}"
    assert "Traceback" not in stderr and "Traceback" not in stdout
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    line = lines[0]
    assert line.startswith("memsim: error: "), line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} missing from {line!r}"
    assert stdout == "", f"nothing may reach stdout on an error, got {stdout!r}"
    return line


def _check_contract(value, contract, path: str = "report") -> None:
    if isinstance(contract, dict):
        assert isinstance(value, dict), f"{path}: expected an object, got {value!r}"
        missing = [key for key in contract if key not in value]
        assert not missing, f"{path}: missing contract keys {missing}"
        for key, sub in contract.items():
            _check_contract(value[key], sub, f"{path}.{key}")
    elif isinstance(contract, list):
        assert isinstance(value, list), f"{path}: expected a list, got {value!r}"
        for index, item in enumerate(value):
            _check_contract(item, contract[0], f"{path}[{index}]")
    elif contract is int:
        assert type(value) is int, f"{path}: expected int, got {value!r}"
    elif contract is float:
        assert type(value) is float, f"{path}: expected float, got {value!r}"
    else:
        assert type(value) is contract, f"{path}: expected {contract.__name__}, got {value!r}"


def _check_report(report: dict, pp: int = 1) -> None:
    """The DESIGN.md contract plus the invariants that any report must satisfy."""
    _check_contract(report, REPORT_CONTRACT)
    assert report["ranks"], "ranks lists at least one rank"
    assert sorted({rank["stage"] for rank in report["ranks"]}) == list(range(pp))
    for rank in report["ranks"]:
        assert rank["peak_reserved_bytes"] >= rank["peak_allocated_bytes"] > 0
        assert sum(rank["breakdown_at_peak"].values()) == rank["peak_allocated_bytes"]
        assert all(v >= 0 for v in rank["breakdown_at_peak"].values())
        assert rank["compute_s"] > 0 and rank["idle_s"] >= 0
    assert report["iteration_time_s"] > 0 and report["tokens_per_s"] > 0
    assert 0 < report["mfu"] < 1 and 0 <= report["bubble_fraction"] < 1
    assert report["fits"] == (not any(rank["oom"] for rank in report["ranks"])
                              and all(rank["peak_reserved_bytes"] <= rank["capacity_bytes"]
                                      for rank in report["ranks"])
                              and all(node["fits"] for node in report["host_memory"]))


# --- bad input: exit 2, one line on stderr naming file, key and value ------------------------------

def _tiny_with(**replace: str) -> str:
    """TINY_GPT with the value of each `key = ...` line replaced by the given TOML text."""
    lines = []
    for line in TINY_GPT.splitlines():
        key = line.split("=")[0].strip()
        lines.append(f"{key} = {replace[key]}" if "=" in line and key in replace else line)
    return "\n".join(lines) + "\n"


UNKNOWN_KEY = TINY_GPT.replace("seq_length = 32", "seq_length = 32\nseq_lenght = 64")


FILE_ERRORS = [
    # (id, scenario text, fragments the message must contain besides the file name)
    ("unknown-key", UNKNOWN_KEY,
     ("model.seq_lenght = 64", "unknown key", "did you mean 'seq_length'")),
    ("unknown-section", TINY_GPT.replace("[training]", "[trainig]"),
     ("trainig", "unknown key", "did you mean 'training'")),
    ("wrong-type-int", _tiny_with(num_layers='"2"'), ("model.num_layers = '2'", "positive integer")),
    ("wrong-type-choice", _tiny_with(precision="16"), ("training.precision = 16", "must be one of", "bf16-mixed")),
    ("wrong-type-bool", TINY_GPT + '[parallel]\nsequence_parallel = "yes"\n',
     ("parallel.sequence_parallel = 'yes'", "true or false")),
    ("heads-not-dividing-hidden", _tiny_with(hidden_size="66"),
     ("model.hidden_size = 66", "divisible by model.num_attention_heads = 4")),
    ("kv-heads-not-dividing-heads", TINY_LLAMA.replace("num_kv_heads = 2", "num_kv_heads = 3"),
     ("model.num_kv_heads = 3", "must divide model.num_attention_heads = 4")),
    ("zero-layers", _tiny_with(num_layers="0"), ("model.num_layers = 0", "positive integer")),
    ("negative-hidden", _tiny_with(hidden_size="-64"), ("model.hidden_size = -64", "positive integer")),
    ("zero-micro-batch", _tiny_with(micro_batch_size="0"), ("training.micro_batch_size = 0", "positive integer")),
    ("negative-size", TINY_GPT + '[parallel]\nbucket_size = "-25 MB"\n', ("parallel.bucket_size = '-25 MB'", "size")),
    ("unknown-preset", '[model]\npreset = "llama-8b"\n', ("model.preset = 'llama-8b'", "unknown preset",
                                                          "did you mean 'llama-7b'")),
    ("unknown-device", _tiny_with(topology='"a100-80gb-sx"'), ("cluster.topology = 'a100-80gb-sx'", "a100-80gb-sxm")),
    ("malformed-toml", 'name = "x"\n[model\nnum_layers = 2\n', ("invalid TOML", "line 2")),
    ("hf-config-missing", '[model]\nhf_config = "nowhere/config.json"\n',
     ("model.hf_config = 'nowhere/config.json'", "nowhere/config.json")),
    ("multi-device-plan", TINY_GPT + "[parallel]\ntp = 2\n", ("parallel.tp = 2",)),
]


@pytest.mark.parametrize("text,fragments", [case[1:] for case in FILE_ERRORS], ids=[case[0] for case in FILE_ERRORS])
def test_bad_scenario_file_is_one_line_exit_2(tmp_path, text, fragments):
    path = _write(tmp_path, "bad.toml", text)
    result = _invoke("run", str(path), "--json")
    _assert_one_line_error(result.exit_code, result.stdout, result.stderr, (str(path), *fragments))


def test_hf_config_malformed_json(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": ', encoding="utf-8")
    path = _write(tmp_path, "hf.toml", '[model]\nhf_config = "hf/config.json"\n')
    result = _invoke("run", str(path))
    line = _assert_one_line_error(result.exit_code, result.stdout, result.stderr,
                                  (str(path), "model.hf_config = 'hf/config.json'", "config.json"))
    assert "JSON" in line


def test_missing_scenario_file(tmp_path):
    path = tmp_path / "nope.toml"
    result = _invoke("run", str(path))
    _assert_one_line_error(result.exit_code, result.stdout, result.stderr, (str(path), "cannot read"))


SET_ERRORS = [
    ("no-equals", ["model.num_layers"], ("--set 'model.num_layers'", "KEY=VALUE")),
    ("unknown-key", ["model.num_layer=3"], ("'model.num_layer'", "did you mean 'model.num_layers'")),
    ("unknown-section", ["foo.bar=1"], ("'foo.bar'", "unknown key path")),
    ("bad-value", ["model.num_layers=abc"], ("model.num_layers = 'abc'", "positive integer")),
    ("heads", ["model.num_attention_heads=5"], ("model.hidden_size = 64", "num_attention_heads = 5")),
    ("multi-device-tp", ["parallel.tp=2"], ("parallel.tp = 2", "one device")),
    ("multi-device-dp", ["parallel.dp=4", "training.global_batch_size=8"], ("parallel.dp = 4",)),
    ("unknown-device", ["cluster.topology=h100-sxn"], ("cluster.topology = 'h100-sxn'", "h100-sxm")),
]


@pytest.mark.parametrize("overrides,fragments", [case[1:] for case in SET_ERRORS], ids=[case[0] for case in SET_ERRORS])
def test_bad_set_is_one_line_exit_2(tmp_path, overrides, fragments):
    path = _write(tmp_path, "tiny.toml", TINY_GPT)
    args = [arg for item in overrides for arg in ("--set", item)]
    result = _invoke("run", str(path), *args)
    _assert_one_line_error(result.exit_code, result.stdout, result.stderr, (str(path), *fragments))


def test_out_path_that_is_a_file_is_one_line_exit_2(tmp_path):
    path = _write(tmp_path, "tiny.toml", TINY_GPT)
    blocker = _write(tmp_path, "blocker", "not a directory")
    result = _invoke("run", str(path), "--json", "--out", str(blocker))
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memsim: error: ") and str(blocker) in lines[0]
    assert "Traceback" not in result.stderr


def test_errors_in_a_real_process(tmp_path):
    """The same contract end to end (python -m simulator.cli): exit status, stderr, no traceback."""
    bad = _write(tmp_path, "bad.toml", UNKNOWN_KEY)
    done = _memsim("run", str(bad), "--json", cwd=tmp_path)
    _assert_one_line_error(done.returncode, done.stdout, done.stderr,
                           (str(bad), "model.seq_lenght = 64", "did you mean 'seq_length'"))
    tiny = _write(tmp_path, "tiny.toml", TINY_GPT)
    done = _memsim("run", "tiny.toml", "--set", "parallel.tp=2", cwd=tmp_path)
    _assert_one_line_error(done.returncode, done.stdout, done.stderr, (tiny.name, "parallel.tp = 2"))


def test_console_script_reports_errors(tmp_path):
    script = shutil.which("memsim")
    if script is None:
        pytest.skip("the memsim console script is not installed (pip install -e .)")
    done = subprocess.run([script, "run", "missing.toml"], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=120)
    _assert_one_line_error(done.returncode, done.stdout, done.stderr, ("missing.toml", "cannot read"))


# --- results ---------------------------------------------------------------------------------------

def test_json_prints_only_the_report_with_every_contract_key(tmp_path):
    path = _write(tmp_path, "tiny.toml", TINY_GPT)
    done = _memsim("run", str(path), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    report = json.loads(done.stdout)  # raises if anything but one JSON document is on stdout
    assert done.stdout == json.dumps(report, indent=2, sort_keys=True) + "\n"
    _check_report(report)
    assert report["scenario"] == "cli-tiny-gpt"
    assert report["fits"] is True and report["ranks"][0]["oom"] is False
    assert report["ranks"][0]["device"] == "cpu"


def test_job_that_does_not_fit_exits_0_with_fits_false(tmp_path):
    path = _write(tmp_path, "big.toml", NOT_FITTING)
    done = _memsim("run", str(path), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    _check_report(report)
    assert report["fits"] is False
    rank = report["ranks"][0]
    assert rank["oom"] is True
    assert rank["peak_allocated_bytes"] > rank["capacity_bytes"]  # the run continued past the OOM
    assert any("out of memory" in warning for warning in report["warnings"])


def test_human_summary_exits_0_and_says_whether_it_fits(tmp_path):
    fits = _invoke("run", str(_write(tmp_path, "tiny.toml", TINY_LLAMA)))
    assert fits.exit_code == 0 and fits.stderr == ""
    assert "cli-tiny-llama" in fits.stdout and "FITS" in fits.stdout


@pytest.mark.slow
def test_out_dir_files_equal_json_and_are_deterministic(tmp_path):
    """Two processes (different hash seeds) write byte-identical outputs; report.json == --json."""
    path = _write(tmp_path, "small.toml", SMALL_4090)
    runs = [("1", ["--json"]), ("2", [])]
    procs = [subprocess.Popen(_memsim_cmd("run", str(path), *flags, "--out", str(tmp_path / f"out{seed}")),
                              cwd=tmp_path, env=_env(seed), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for seed, flags in runs]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stderr
    first, second = tmp_path / "out1", tmp_path / "out2"
    for folder in (first, second):
        assert sorted(p.name for p in folder.iterdir()) == OUT_FILES  # no temporary files left
    assert (first / "report.json").read_text(encoding="utf-8") == outputs[0][0]
    report = json.loads(outputs[0][0])
    _check_report(report)
    assert "wrote" in outputs[1][0] and "report.json" in outputs[1][0]
    for name in OUT_FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), f"{name} differs between runs"
    trace = json.loads((first / "trace.json").read_text(encoding="utf-8"))
    assert trace["traceEvents"]
    with open(first / "memory_snapshot.pickle", "rb") as handle:
        snapshot = pickle.load(handle)
    assert snapshot["segments"] and snapshot["device_traces"]
    assert (first / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_out_dir_overwrites_previous_outputs(tmp_path):
    path = _write(tmp_path, "tiny.toml", TINY_GPT)
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("stale", encoding="utf-8")
    result = _invoke("run", str(path), "--json", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == OUT_FILES
    assert (out / "report.json").read_text(encoding="utf-8") == result.stdout


# --- listings ---------------------------------------------------------------------------------------

def test_devices_lists_every_catalog_device():
    result = _invoke("devices")
    assert result.exit_code == 0 and result.stderr == ""
    names = [device.name for device in list_devices()]
    assert names
    rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    listed = [row.split("│")[1].strip() for row in rows]
    assert listed == names


def test_presets_lists_the_presets():
    result = _invoke("presets")
    assert result.exit_code == 0 and result.stderr == ""
    assert result.stdout.splitlines() == list(list_presets())
    assert {"gpt2", "llama-7b", "bert-large", "vit-large"} <= set(result.stdout.split())


# --- example scenarios --------------------------------------------------------------------------------

# What each example's opening comment says about fitting (keeps the comments honest).
EXPECTED_FITS = {
    "bert-large-a100.toml": True,
    "gpt2-cpu.toml": True,
    "gpt2-rtx4090.toml": True,
    "llama7b-rtx4090-recompute.toml": False,
    "llama7b-rtx4090-zero-infinity.toml": True,
    "llama7b-rtx4090-zero-offload.toml": False,      # the host's 128 GB, not the GPU (docs/offload.md)
    "showcase.toml": False,
    "vit-large-h100.toml": True,
}


def test_example_scenarios_are_the_documented_set():
    assert sorted(p.name for p in SCENARIOS) == sorted(EXPECTED_FITS)


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_example_scenario_runs(path):
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# "), f"{path.name} must open with a comment saying what question it answers"
    scenario = load_scenario(path)
    report = simulate(scenario).report
    _check_report(report, pp=scenario.parallel.pp)
    assert report["fits"] is EXPECTED_FITS[path.name]
    assert report["scenario"] == scenario.name


def test_showcase_sequence_length_is_settable():
    path = REPO / "scenarios" / "showcase.toml"
    base = load_scenario(path)
    assert (base.model.preset, base.cluster.topology) == ("llama-7b", "a100-80gb-sxm")
    assert (base.training.optimizer, base.training.precision, base.training.micro_batch_size) == \
        ("adamw", "bf16-mixed", 1)
    assert base.model.seq_length == 2048
    assert load_scenario(path, ["model.seq_length=4096"]).model.seq_length == 4096
