"""The nvidia-smi snapshot (diag/nvidia_smi.py): parsing of its query output, and a clean skip without it.

No GPU has been lent to this project, so the sample is not captured from a GPU node: it is written in the
format nvidia-smi documents for `--query-gpu` / `--query-compute-apps` with `--format=csv,noheader,nounits`
(comma + space between fields, `[N/A]` for a missing sensor), with an H200's total memory."""

from __future__ import annotations

import pytest

from rlslurm.diag import nvidia_smi
from rlslurm.diag.nvidia_smi import Gpu, GpuProcess, parse_apps, parse_gpus, render

GPUS = """0, NVIDIA H200, GPU-5b7c0e2a-1d3f-4a6b-9c8d-7e6f5a4b3c2d, 00000000:19:00.0, 81234, 143771, 97, 61, 612.45
1, NVIDIA H200, GPU-0a1b2c3d-4e5f-6a7b-8c9d-0e1f2a3b4c5d, 00000000:3B:00.0, 0, 143771, 0, 34, [N/A]
"""
APPS = """2345, GPU-5b7c0e2a-1d3f-4a6b-9c8d-7e6f5a4b3c2d, /opt/venv/bin/python3, 80112
"""


def test_gpus_and_processes_parse_with_missing_sensors_as_none():
    gpus = parse_gpus(GPUS)
    assert gpus[0] == Gpu(0, "NVIDIA H200", "GPU-5b7c0e2a-1d3f-4a6b-9c8d-7e6f5a4b3c2d", "00000000:19:00.0",
                          81234.0, 143771.0, 97.0, 61.0, 612.45)
    assert gpus[1].power_w is None and gpus[1].utilization_pct == 0
    assert parse_apps(APPS) == [GpuProcess(2345, gpus[0].uuid, "/opt/venv/bin/python3", 80112.0)]
    assert parse_apps("") == []
    text = render(gpus, parse_apps(APPS))
    assert text.splitlines() == [
        "GPU 0 NVIDIA H200 (00000000:19:00.0): memory 81,234 MiB of 143,771 MiB, utilisation 97 %, 61 C, power 612 W",
        "  pid 2345 /opt/venv/bin/python3: 80,112 MiB",
        "GPU 1 NVIDIA H200 (00000000:3B:00.0): memory 0 MiB of 143,771 MiB, utilisation 0 %, 34 C, power n/a"]


def test_a_row_of_another_shape_is_refused():
    with pytest.raises(ValueError, match="expected 9"):
        parse_gpus("0, NVIDIA H200, GPU-x\n")


def test_no_nvidia_smi_means_no_snapshot(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert nvidia_smi.snapshot() is None
