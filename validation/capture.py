"""Capture real torch training steps (time, per-op profile, environment; CUDA memory) into validation/data/<device>/.

Usage: ``python -m validation.capture [--device cpu|cuda] [--configs FILE] [--out DIR] [--only NAME]
[--repetitions N] [--memory/--no-memory]`` (also ``memsim validate capture``).

Protocol per configuration (the configurations file of validation.measure_memory): seed torch, build
model + optimizer with validation.torch_models, run ``warmup_steps`` steps, then ``repetitions`` timed
steps (wall clock and process CPU time per step and per phase; CUDA: CUDA events), then
``profiled_steps`` steps under torch.profiler (record_shapes) whose ops are summarized per (name,
input shapes, input dtypes): calls per step, median and minimum self time per call. Writes
``<out>/timing/<name>.json``. With ``memory`` the step's memory timeline is measured too: on CPU by
validation.measure_memory (exact storage tracker, ``<out>/memory/``), on CUDA with
``torch.cuda.memory._record_memory_history`` (allocated *and* reserved, ``<out>/memory/<name>.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from simulator.errors import DataError, MemsimError, ScenarioError
from simulator.io import atomic_write_text
from validation import measure_memory
from validation.torch_models import build_model, build_optimizer, make_batch, parse_model, parse_training, train_step

__all__ = ["CaptureFailed", "DEVICES", "DEFAULT_CONFIGS", "DATA_ROOT", "Protocol", "capture", "capture_one", "environment",
           "summarize_profile", "main"]

_HERE = Path(__file__).resolve().parent
DEVICES = ("cpu", "cuda")
DEFAULT_CONFIGS = {"cpu": measure_memory.DEFAULT_CONFIGS, "cuda": _HERE / "cuda" / "configs.toml"}
DATA_ROOT = _HERE / "data"
SEED = 0
OP_COLUMNS = ("name", "input_shapes", "input_layouts", "input_dtypes", "calls_per_step", "median_us", "min_us")
STEP_PHASES = ("forward", "backward", "optimizer", "zero_grad")
FORMAT = "memsim-timing-2"


class CaptureFailed(MemsimError):
    """Some configurations failed inside torch; the others were written (exit status 1, not bad input)."""

    exit_code = 1


@dataclasses.dataclass(frozen=True)
class Protocol:
    """How many steps a capture runs: warm-up, timed repetitions, profiled steps; CPU threads."""

    warmup_steps: int = 3
    repetitions: int = 7
    profiled_steps: int = 3
    threads: int = 1

    def __post_init__(self) -> None:
        for key in ("warmup_steps", "repetitions", "profiled_steps", "threads"):
            value = getattr(self, key)
            minimum = 0 if key == "warmup_steps" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ScenarioError(f"capture {key} = {value!r} must be an integer >= {minimum}")


# ----------------------------------------------------------------------------------------------------------------
# Environment


def _load_average() -> list[float]:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return []


def environment(device: str) -> dict[str, object]:
    """Torch/Python versions, device name, threads, CPU model, load average and the date (UTC)."""
    env: dict[str, object] = {"device": device, **measure_memory.environment(), "logical_cpus": os.cpu_count(),
                              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                              "load_average": _load_average()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update({
            "device_name": torch.cuda.get_device_name(0),
            "cuda_version": torch.version.cuda,
            "compute_capability": f"{props.major}.{props.minor}",
            "device_memory_bytes": int(props.total_memory),
            "multiprocessor_count": int(props.multi_processor_count),
            # The caching allocator's and cuBLAS's settings change reserved memory and the workspace size.
            "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
        })
    else:
        env["device_name"] = env["cpu_model"]
    return env


# ----------------------------------------------------------------------------------------------------------------
# Steps


def _cuda_train_step(model, optimizer, idx, targets, training_spec, on_phase: Callable[[str], None]) -> float:
    """train_step with CUDA autocast (validation.torch_models.train_step autocasts on "cpu")."""
    on_phase("forward")
    if training_spec.precision == "bf16-mixed":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx, targets)
    else:
        loss = model(idx, targets)
    on_phase("backward")
    loss.backward()
    value = loss.item()
    del loss
    on_phase("optimizer")
    optimizer.step()
    on_phase("zero_grad")
    optimizer.zero_grad(set_to_none=True)
    return value


class _PhaseClock:
    """Timestamps at each phase change of one step: wall and process CPU time; on CUDA also a CUDA event
    (recorded on the stream, no synchronization, so the timed step runs as it would untimed)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[tuple[str, float, float, object]] = []

    def __call__(self, phase: str) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((phase, time.perf_counter(), time.process_time(), event))

    def phase_times(self, end_wall_s: float, end_cpu_s: float,
                    end_event: object = None) -> dict[str, tuple[float, float]]:
        """(wall or CUDA-event seconds, process CPU seconds) of each phase; call after the step finished."""
        marks = [*self.marks, ("end", end_wall_s, end_cpu_s, end_event)]
        times = {}
        for a, b in zip(marks, marks[1:]):
            wall = a[3].elapsed_time(b[3]) / 1e3 if a[3] is not None and b[3] is not None else b[1] - a[1]
            times[a[0]] = (wall, b[2] - a[2])
        return times


def _device_context(device: str):
    return torch.device("cuda") if device == "cuda" else contextlib.nullcontext()


def _spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max, quartiles and relative spreads of a sample (seconds)."""
    ordered = sorted(values)
    median = statistics.median(ordered)
    quartiles = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else [median] * 3
    return {
        "median_s": median, "min_s": ordered[0], "max_s": ordered[-1],
        "q1_s": quartiles[0], "q3_s": quartiles[2],
        "range_over_median": (ordered[-1] - ordered[0]) / median if median > 0 else 0.0,
        "iqr_over_median": (quartiles[2] - quartiles[0]) / median if median > 0 else 0.0,
    }


def _row_major(shape: Sequence[int], strides: Sequence[int]) -> bool:
    step = 1
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != step:
            return False
        step *= max(int(dim), 1)
    return True


def _layout(shape: object, strides: object) -> str:
    """"c" row-major contiguous, "t" last two dims transposed (column-major), "x" other strides, "" no tensor."""
    if not isinstance(shape, list) or not isinstance(strides, list) or not shape or len(strides) != len(shape):
        return ""
    if _row_major(shape, strides):
        return "c"
    if len(shape) >= 2 and _row_major([*shape[:-2], shape[-1], shape[-2]], [*strides[:-2], strides[-1], strides[-2]]):
        return "t"
    return "x"


def kineto_inputs(prof: profile) -> dict[tuple[int, str], tuple[list, list]]:
    """(correlation id, name) -> (input dtypes, input strides) of a finished profile's CPU op events.

    torch before 2.13 leaves FunctionEvent without ``input_dtypes``/``structured_input_strides``; the
    profiler's own kineto events carry them (FunctionEvent.id is the kineto correlation id).
    """
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    table: dict[tuple[int, str], tuple[list, list]] = {}
    if results is None:
        return table
    for event in results.events():
        if str(event.device_type()).endswith("CPU"):
            strides = (event.structured_input_strides() if hasattr(event, "structured_input_strides")
                       else event.strides() if hasattr(event, "strides") else [])
            table[(int(event.correlation_id()), event.name())] = (list(event.dtypes()), list(strides))
    return table


def _input_dtypes_strides(event: object, inputs_by_id: Mapping[tuple[int, str], tuple[list, list]]
                          ) -> tuple[list, list]:
    """An event's input dtypes and strides: its own fields, else the kineto event with its id and name."""
    dtypes = list(getattr(event, "input_dtypes", None) or [])
    strides = list(getattr(event, "structured_input_strides", None) or [])
    if not dtypes and not strides:
        dtypes, strides = inputs_by_id.get((int(getattr(event, "id", -1)), getattr(event, "name", "")), ([], []))
    return list(dtypes), list(strides)


def summarize_profile(steps: Sequence[Sequence[object]], cuda: bool = False,
                      step_inputs: Sequence[Mapping[tuple[int, str], tuple[list, list]]] = ()) -> dict[str, object]:
    """Aggregate profiler events of several steps per (name, input shapes, input dtypes).

    Args:
        steps: for each profiled step, its FunctionEvents (``prof.events()``).
        cuda: also aggregate device kernels (self device time) by kernel name.
        step_inputs: for each step, ``kineto_inputs`` of its profile (torch versions whose FunctionEvents
            lack input dtypes and strides).

    Returns:
        {"columns": OP_COLUMNS, "rows": [...]} sorted by total time (largest first), self CPU per step
        by op name, and with ``cuda`` the kernel table.
    """
    per_call: dict[tuple[str, str, str, str], list[float]] = {}
    by_name: dict[str, float] = {}
    kernels: dict[str, list[float]] = {}
    for position, events in enumerate(steps):
        inputs_by_id = step_inputs[position] if position < len(step_inputs) else {}
        for event in events:
            if getattr(event, "is_user_annotation", False):
                continue
            device_type = str(getattr(event, "device_type", "DeviceType.CPU"))
            if device_type.endswith("CUDA"):
                if cuda:
                    kernels.setdefault(event.name, []).append(float(event.self_device_time_total))
                continue
            shapes = list(event.input_shapes or [])
            dtypes, strides = _input_dtypes_strides(event, inputs_by_id)
            layouts = [_layout(shape, stride) for shape, stride in zip(shapes, strides + [None] * len(shapes))]
            key = (event.name, json.dumps(shapes, separators=(",", ":")), ",".join(layouts),
                   json.dumps(dtypes, separators=(",", ":")))
            # On CUDA an op's time is that of the kernels it launched (self device time), not its host time.
            us = float(event.self_device_time_total if cuda else event.self_cpu_time_total)
            if cuda and us <= 0:
                continue
            per_call.setdefault(key, []).append(us)
            by_name[event.name] = by_name.get(event.name, 0.0) + us
    n = max(len(steps), 1)
    rows = []
    for (name, shapes, layouts, dtypes), times in per_call.items():
        rows.append([name, json.loads(shapes), layouts, json.loads(dtypes), len(times) / n,
                     round(statistics.median(times), 3), round(min(times), 3)])
    rows.sort(key=lambda r: (-r[4] * r[5], r[0], json.dumps(r[1]), r[2]))
    summary: dict[str, object] = {
        "columns": list(OP_COLUMNS),
        "note": ("self device time (kernels the op launched)" if cuda else "self CPU time (wall clock)")
                + " per call in microseconds, profiler on; calls_per_step averaged over the profiled steps; "
                  "input_layouts per input: c contiguous, t transposed, x other strides",
        "rows": rows,
        "self_us_per_step_by_name": {k: round(v / n, 3) for k, v in sorted(by_name.items(), key=lambda i: -i[1])},
    }
    if cuda:
        summary["kernels"] = {
            "columns": ["name", "calls_per_step", "median_us", "total_us_per_step"],
            "rows": sorted(([k, len(v) / n, round(statistics.median(v), 3), round(sum(v) / n, 3)]
                            for k, v in kernels.items()), key=lambda r: -r[3]),
        }
    return summary


def capture_one(name: str, config: Mapping[str, Mapping[str, object]], device: str,
                protocol: Protocol = Protocol()) -> dict[str, object]:
    """Run one configuration's capture protocol and return its timing document (see the module docstring).

    Raises:
        DataError: ``device`` is "cuda" but no CUDA device is available.
        ScenarioError: the configuration is invalid.
    """
    _check_device(device)
    model_spec, training_spec = parse_model(config["model"]), parse_training(config["training"])
    cuda = device == "cuda"
    if cuda:
        _release_cuda_cache()
    step = _cuda_train_step if cuda else train_step
    with _device_context(device):
        torch.manual_seed(SEED)
        model = build_model(model_spec, training_spec)
        optimizer = build_optimizer(model, training_spec)
        for _ in range(protocol.warmup_steps):
            idx, targets = make_batch(model_spec, training_spec)
            step(model, optimizer, idx, targets, training_spec, on_phase=lambda _p: None)
        wall, cpu, event_ms = [], [], []
        phases: dict[str, dict[str, list[float]]] = {p: {"wall_s": [], "cpu_s": []} for p in STEP_PHASES}
        for _ in range(protocol.repetitions):
            idx, targets = make_batch(model_spec, training_spec)
            clock = _PhaseClock(cuda)
            if cuda:
                torch.cuda.synchronize()
                start_event = torch.cuda.Event(enable_timing=True)
                end_event = torch.cuda.Event(enable_timing=True)
                start_event.record()
            w0, c0 = time.perf_counter(), time.process_time()
            step(model, optimizer, idx, targets, training_spec, on_phase=clock)
            if cuda:
                end_event.record()
                torch.cuda.synchronize()
                event_ms.append(start_event.elapsed_time(end_event))
            w1, c1 = time.perf_counter(), time.process_time()
            wall.append(w1 - w0)
            cpu.append(c1 - c0)
            for phase, (pw, pc) in clock.phase_times(w1, c1, end_event if cuda else None).items():
                phases[phase]["wall_s"].append(pw)
                phases[phase]["cpu_s"].append(pc)
        profiled, profiled_wall = [], []
        step_inputs: list[dict[tuple[int, str], tuple[list, list]]] = []
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        for _ in range(protocol.profiled_steps):
            idx, targets = make_batch(model_spec, training_spec)
            w0 = time.perf_counter()
            with profile(activities=activities, record_shapes=True) as prof:
                step(model, optimizer, idx, targets, training_spec, on_phase=lambda _p: None)
                if cuda:
                    torch.cuda.synchronize()
            profiled_wall.append(time.perf_counter() - w0)
            profiled.append(list(prof.events()))
            step_inputs.append(kineto_inputs(prof))
    iteration: dict[str, object] = {
        "wall_s": wall, "cpu_s": cpu, "wall": _spread(wall), "cpu": _spread(cpu),
        # Per phase: wall clock on CPU, CUDA-event time on CUDA ("wall_median_s"), process CPU time.
        "phases": {p: {"wall_median_s": statistics.median(v["wall_s"]), "cpu_median_s": statistics.median(v["cpu_s"])}
                   for p, v in phases.items() if v["wall_s"]},
    }
    if cuda:
        event_s = [ms / 1e3 for ms in event_ms]
        iteration.update({"cuda_event_s": event_s, "cuda_event": _spread(event_s)})
    return {
        "format": FORMAT,
        "name": name,
        "device": device,
        "config": {k: dict(v) for k, v in config.items()},
        "resolved": {"model": dataclasses.asdict(model_spec), "training": dataclasses.asdict(training_spec)},
        "environment": environment(device),
        "protocol": {**dataclasses.asdict(protocol), "seed": SEED,
                     "clocks": "wall = time.perf_counter, cpu = time.process_time (whole process)"
                               + ("; cuda_event = torch.cuda.Event elapsed_time" if cuda else "")},
        "iteration": iteration,
        "profiled_step_wall_s": profiled_wall,
        "ops": summarize_profile(profiled, cuda, step_inputs),
    }


# ----------------------------------------------------------------------------------------------------------------
# CUDA memory snapshot


_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
            "segment_unmap", "snapshot", "oom")


def cuda_memory_capture(name: str, config: Mapping[str, Mapping[str, object]],
                        protocol: Protocol = Protocol(), max_entries: int = 1_000_000) -> dict[str, object]:
    """Allocated and reserved memory on CUDA: the allocator's whole history from the model build on.

    ``_record_memory_history`` is on from before the model is built, through the warm-up steps and one
    measured step. Returns a compact document: peaks over the measured step (``max_memory_allocated`` /
    ``max_memory_reserved`` after ``reset_peak_memory_stats``), the segments at its end, the measured
    step's allocator trace (``trace``, phases in ``phase_starts``) and everything before it (``history``,
    labelled by ``marks``: build, warm-up steps and their phases), each as rows [action index, size,
    address offset from the lowest segment] (actions in ``actions``). Run it in a fresh process (the
    capture of one configuration per process, as validation/cuda/run.sh does) so that reserved memory
    is this configuration's alone.

    Raises:
        DataError: no CUDA device is available.
    """
    _check_device("cuda")
    model_spec, training_spec = parse_model(config["model"]), parse_training(config["training"])
    _release_cuda_cache()   # reserved memory must start from this configuration alone
    marks: list[tuple[str, int]] = []

    def mark(label: str) -> None:
        marks.append((label, len(_device_trace(torch.cuda.memory._snapshot()))))

    # context=None: no tracebacks (only actions, sizes and addresses are kept); gathering stacks failed
    # inside a non-reentrant checkpoint's recompute in backward (torch 2.11, H200).
    torch.cuda.memory._record_memory_history(context=None, max_entries=max_entries)
    try:
        with torch.device("cuda"):
            mark("build")
            torch.manual_seed(SEED)
            model = build_model(model_spec, training_spec)
            optimizer = build_optimizer(model, training_spec)
            for step in range(max(protocol.warmup_steps, 1)):
                mark(f"warmup{step + 1}.batch")
                idx, targets = make_batch(model_spec, training_spec)
                _cuda_train_step(model, optimizer, idx, targets, training_spec,
                                 on_phase=lambda phase, step=step: mark(f"warmup{step + 1}.{phase}"))
            mark("measured.batch")
            idx, targets = make_batch(model_spec, training_spec)
            torch.cuda.synchronize()
            before = {"allocated_bytes": torch.cuda.memory_allocated(),
                      "reserved_bytes": torch.cuda.memory_reserved()}
            torch.cuda.reset_peak_memory_stats()
            mark("measured.step")
            _cuda_train_step(model, optimizer, idx, targets, training_spec, on_phase=mark)
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
            peaks = {"max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
                     "max_memory_reserved_bytes": torch.cuda.max_memory_reserved()}
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    segments = snapshot.get("segments", [])
    base = min((int(s["address"]) for s in segments), default=0)
    rows = []
    for entry in _device_trace(snapshot):
        action = entry.get("action", "")
        rows.append([_ACTIONS.index(action) if action in _ACTIONS else -1, int(entry.get("size", 0)),
                     int(entry.get("addr", 0)) - base])
    step_start = dict(marks)["measured.step"]
    columns = ["action", "size", "address_offset"]
    return {
        "format": "memsim-cuda-memory-1",
        "name": name,
        "device": "cuda",
        "config": {k: dict(v) for k, v in config.items()},
        "environment": environment("cuda"),
        "protocol": {**dataclasses.asdict(protocol), "seed": SEED,
                     "method": "torch.cuda.memory._record_memory_history (context=None) + _snapshot from the "
                               "model build through the warm-up steps and one measured step"},
        "results": {**peaks, "before_step": before,
                    "end_reserved_bytes": sum(int(s["total_size"]) for s in segments),
                    "end_allocated_bytes": sum(int(s.get("allocated_size", 0)) for s in segments)},
        "segments": {"columns": ["total_size", "allocated_size", "stream", "segment_type"],
                     "rows": [[int(s["total_size"]), int(s.get("allocated_size", 0)), int(s.get("stream", 0)),
                               str(s.get("segment_type", ""))] for s in segments]},
        "phase_starts": {label: position - step_start for label, position in marks
                         if position >= step_start and label in STEP_PHASES},
        "trace": {"columns": columns, "actions": list(_ACTIONS), "rows": rows[step_start:]},
        "history": {"columns": columns, "actions": list(_ACTIONS), "rows": rows[:step_start],
                    "marks": [[label, position] for label, position in marks if position <= step_start]},
    }


def _release_cuda_cache() -> None:
    """Free what earlier configurations left in the caching allocator and reset its peak statistics."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _device_trace(snapshot: Mapping[str, object]) -> list[dict]:
    traces = snapshot.get("device_traces", [])
    return list(traces[0]) if traces else []


# ----------------------------------------------------------------------------------------------------------------
# Driver


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise ScenarioError(f"--device = {device!r} must be one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise DataError("--device = 'cuda': no CUDA device is available here (torch.cuda.is_available() is False, "
                        f"torch {torch.__version__}); capture on a machine with a GPU or use --device cpu")


def _compact_rows(document: dict[str, object]) -> str:
    """Indented JSON whose long row tables are written one row per line."""
    markers: dict[str, str] = {}

    def walk(node: object) -> object:
        if isinstance(node, dict):
            out = {}
            for key, value in node.items():
                if key == "rows" and isinstance(value, list):
                    marker = f"__ROWS_{len(markers)}__"
                    markers[marker] = "[\n" + ",\n".join(json.dumps(r, separators=(",", ":")) for r in value) + "\n]"
                    out[key] = marker
                elif key in ("wall_s", "cpu_s", "cuda_event_s") and isinstance(value, list):
                    marker = f"__ROWS_{len(markers)}__"
                    markers[marker] = json.dumps(value)
                    out[key] = marker
                else:
                    out[key] = walk(value)
            return out
        return node

    text = json.dumps(walk(document), indent=1)
    for marker, body in markers.items():
        text = text.replace(json.dumps(marker), body)
    return text + "\n"


def capture(device: str, configs: Path | None = None, out_dir: Path | None = None,
            only: Sequence[str] = (), protocol: Protocol = Protocol(), memory: bool = True,
            progress: Callable[[str], None] | None = None) -> list[Path]:
    """Capture every selected configuration of ``configs`` on ``device`` into ``out_dir``.

    Args:
        device: "cpu" or "cuda".
        configs: configurations TOML (validation.measure_memory format); default DEFAULT_CONFIGS[device].
        out_dir: output root (default validation/data/<device>); timing files go to <out_dir>/timing/.
        only: configuration names to capture (default all).
        protocol: warm-up, repetitions, profiled steps, CPU threads.
        memory: also measure the memory timeline (<out_dir>/memory/<name>.json).
        progress: called with one line per finished configuration.

    Returns:
        The paths written.

    Raises:
        DataError: unreadable configurations file, or cuda without a GPU.
        ScenarioError: an unknown name in ``only`` or an invalid configuration.
    """
    _check_device(device)
    configs = Path(configs) if configs is not None else DEFAULT_CONFIGS[device]
    out = Path(out_dir) if out_dir is not None else DATA_ROOT / device
    table = measure_memory.load_configs(configs)
    unknown = [n for n in only if n not in table]
    if unknown:
        raise ScenarioError(f"--only {unknown[0]} is not a configuration in {configs}; allowed: {', '.join(table)}")
    names = list(only) or list(table)
    torch.set_num_threads(protocol.threads)
    written: list[Path] = []
    if memory and device == "cpu":
        measure_memory.run(configs, out / "memory", names, protocol.threads)
        written.extend(out / "memory" / f"{n}.json" for n in names)
    failed: list[str] = []
    for name in names:
        try:
            if memory and device == "cuda":
                # Memory first: in a fresh process the allocator then holds this configuration alone.
                mem_path = out / "memory" / f"{name}.json"
                atomic_write_text(mem_path, _compact_rows(cuda_memory_capture(name, table[name], protocol)))
                written.append(mem_path)
            document = capture_one(name, table[name], device, protocol)
            path = out / "timing" / f"{name}.json"
            atomic_write_text(path, _compact_rows(document))
            written.append(path)
        except (RuntimeError, SystemError) as error:
            # A torch failure in one configuration (out of memory, a kernel error) must not lose the others.
            failed.append(name)
            if progress is not None:
                first_line = str(error).splitlines()[0] if str(error) else ""
                progress(f"{name}: failed in torch: {type(error).__name__}: {first_line}")
            continue
        if progress is not None:
            it = document["iteration"]
            progress(f"{name}: iteration median {it['wall']['median_s'] * 1e3:.2f} ms wall, "
                     f"{it['cpu']['median_s'] * 1e3:.2f} ms cpu (range {it['wall']['range_over_median']:.0%})")
    if failed:
        raise CaptureFailed(f"{len(failed)} of {len(names)} configurations failed in torch: {', '.join(failed)} "
                            f"(the others were written under {out})")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 on bad input)."""
    parser = argparse.ArgumentParser(prog="python -m validation.capture", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--configs", type=Path, default=None,
                        help="configurations TOML file (default: validation/configs/cpu_memory.toml on cpu, "
                             "validation/cuda/configs.toml on cuda)")
    parser.add_argument("--out", type=Path, default=None, help="output root (default validation/data/<device>)")
    parser.add_argument("--only", action="append", default=[], help="capture only this configuration (repeatable)")
    parser.add_argument("--repetitions", type=int, default=Protocol.repetitions, help="timed steps")
    parser.add_argument("--warmup", type=int, default=Protocol.warmup_steps, help="warm-up steps")
    parser.add_argument("--profiled", type=int, default=Protocol.profiled_steps, help="profiled steps")
    parser.add_argument("--threads", type=int, default=Protocol.threads, help="torch intra-op threads (CPU)")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory timeline")
    args = parser.parse_args(argv)
    try:
        protocol = Protocol(args.warmup, args.repetitions, args.profiled, args.threads)
        capture(args.device, args.configs, args.out, args.only, protocol, args.memory,
                progress=lambda line: print(line, file=sys.stderr, flush=True))
    except MemsimError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
