"""The GPU check (bench/gpu_smoke.sh) minus its CUDA steps, end to end on this CPU, so it cannot rot before a
GPU box runs it: the carried-wheel install from a local folder (a wheel of this repository, built here
without network), the gpu-marked tests (they skip: their collection and the junit record are what run),
the 2-step RL job with the Megatron trainer and the transformers engine synced over ipc, and the one JSON.

    python -m pytest -q -s tests/integration/test_gpu_check_dry_run.py     # ~1-2 min on 2 cores

The model is shrunk for these CPUs (GPU_CHECK_SET); everything else is the script the box runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from installed import ROOT, build_wheel

pytestmark = pytest.mark.slow

SMALL = "model.layers=2 model.hidden=128 model.heads=4 model.kv_heads=2 model.ffn_hidden=256"
"""The job's model, cut down for two shared CPU cores (the box runs examples/tiny-grpo-gpu.yaml as it is). The
batch stays: 8 prompts x 16 samples, enough that some answers of a random model are right and the step
trains (4 x 4 trained nothing: no logprob gap to report)."""


def test_gpu_check_runs_on_cpu_from_carried_wheels_and_writes_its_json(tmp_path):
    wheels = tmp_path / "whl"
    build_wheel(wheels)  # the wheel CI installs and runs from outside the checkout (tests/installed.py)
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(wheels),
           "GPU_CHECK_SET": SMALL, "GPU_CHECK_BUDGET_S": "500",
           "GPU_CHECK_TESTS": f"{ROOT}/tests/integration/test_megatron_policy.py "
                              f"{ROOT}/tests/integration/test_torch_backend_device.py"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_smoke.sh"), "--cpu", str(out)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=560)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # The job ran on the installed wheel, not on the checkout's tree.
    assert f"rlslurm from {out}/site/rlslurm/__init__.py" in (out / "versions.txt").read_text()
    record = json.loads((out / "gpu_check.json").read_text())
    assert record["ok"] and record["device"] == "cpu (dry run)" and record["steps"] == 2, record
    assert record["trained_samples"] > 0, record  # else there is no logprob gap to report
    tests = record["gpu_tests"]
    assert tests["exit_code"] == 0 and tests["tests"] > 0 and tests["skipped"] == tests["tests"], tests
    memory = record["memory"]
    assert memory["trainer"]["predicted_peak_gb"] > 0 and memory["trainer"]["measured_rss_gb"] > 0
    assert memory["engine"]["predicted_gb"] > 0 and memory["per_process_nvidia_smi_gb"] == {}
    split = record["step_split"]
    assert split["step_s"] > 0 and 0.5 < sum(split[k] for k in ("rollout_share", "reward_share", "train_share",
                                                                 "sync_share")) <= 1.01, split
    assert record["sync"]["transport"] == ["ipc"] and record["sync"]["verified"] == 3
    assert all(g > 0 for g in record["sync"]["update_gbps"]) and not record["sync"]["failures"]
    # bf16 Megatron against the fp32 engine: a gap, but a small one (a wrong sync or mask is ~1 or more)
    assert 0 <= record["logprob_gap_engine_vs_trainer"] < 0.5
