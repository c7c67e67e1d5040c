"""CUDA reduction staging buffers (simulator/workload/reductions.py) against the H200 probe, and where they apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.api import kernel_profile
from simulator.hardware.catalog import get_device
from simulator.workload.primitives import KernelProfile
from simulator.workload.reductions import NO_STAGING, column_sum_staging

PROBE = json.loads((Path(__file__).resolve().parents[1] / "validation/data/cuda/reductions.json").read_text())
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def test_the_probe_ran_on_an_h200():
    env = PROBE["environment"]
    assert env["device_name"] == "NVIDIA H200"
    assert (env["multiprocessor_count"], env["max_threads_per_multiprocessor"]) == (132, 2048)
    assert len(PROBE["rows"]) == 135


@pytest.mark.parametrize("row", PROBE["rows"], ids=lambda r: f"{r[0]}-{r[1]}x{r[2]}")
def test_staging_matches_every_measured_case_to_the_byte(row):
    """The allocations of g.sum(0), of the same sum over (0, 1) of a 3-D view and of a linear layer's backward,
    minus the output (and the linear's gradients), are the staging buffer and the semaphores, in that order."""
    dtype, rows, width, sum0, sum3d, linear = row
    staging = column_sum_staging(rows, width, 132, 2048)
    predicted = [n for n in (staging.buffer_bytes, staging.semaphore_bytes) if n]
    output = width * ITEMSIZE[dtype]
    assert sum0 == [output] + predicted
    assert sum3d == sum0
    assert linear[-len(sum0):] == sum0


@given(rows=st.integers(1, 1 << 20), width=st.integers(1, 1 << 16), sms=st.integers(1, 512))
def test_staging_is_zero_or_holds_every_partial_sum(rows, width, sms):
    staging = column_sum_staging(rows, width, sms, 2048)
    if staging == NO_STAGING:
        return
    # One float per output, per cooperating block (at least two) and per lane of a block's width.
    assert staging.buffer_bytes % (4 * width) == 0
    assert staging.buffer_bytes >= 4 * width * 2
    # One int per column of output blocks.
    assert staging.semaphore_bytes % 4 == 0 and 4 <= staging.semaphore_bytes <= 4 * width


def test_few_rows_or_no_thread_count_means_no_staging():
    assert column_sum_staging(512, 768, 132, 2048) == NO_STAGING        # 128 values per thread: one block
    assert column_sum_staging(8192, 768, 132, 0) == NO_STAGING          # not modelled (CPU, ROCm)
    assert KernelProfile().column_sum_workspace(8192, 768) == ()


def test_only_nvidia_gpus_get_staging_workspaces():
    assert kernel_profile(get_device("h200-sxm")).column_sum_workspace(8192, 768) == (((50331648,), "uint8"),
                                                                                      ((24,), "uint8"))
    assert kernel_profile(get_device("rtx-4090")).column_sum_workspace(8192, 768)
    assert kernel_profile(get_device("cpu")).column_sum_workspace(8192, 768) == ()
    assert kernel_profile(get_device("mi300x")).column_sum_workspace(8192, 768) == ()
