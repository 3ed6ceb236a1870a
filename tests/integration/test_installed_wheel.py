"""rlslurm from its wheel, anywhere (issue 39): the wheel of this checkout installed NOT editable into a venv of
its own (tests/installed.py), then, from a directory outside the checkout as a user on a cluster runs it, SFT ->
GRPO from its export -> report -> diag on the local backend, a few steps each. Every other test runs from the
checkout's root, where its top-level `jobs/` and `diag/` folders import by those bare names; that hid
`from jobs.sft_eval import ...` in the installed `rlslurm.jobs.sft` (ModuleNotFoundError: No module named 'jobs').
The same het job on the local Slurm: tests/cluster/test_installed_wheel_slurm.py.

    python -m pytest -q -s tests/integration/test_installed_wheel.py     # ~1 min on 2 cores
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import pytest

from installed import ROOT, build_wheel, installed_venv

pytestmark = pytest.mark.slow

SFT = ("train.steps=20", "train.warmup_steps=2", "train.stop_at_accuracy=null", "task.eval_size=50")
"""A few SFT steps: what is shown here is that the installed entrances run, not what they learn."""
GRPO = ("train.steps=2", "rl.prompts_per_step=8", "rl.eval_every=2", "task.eval_size=50")


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("wheel")
    return installed_venv(root / "venv", build_wheel(root / "whl"))


def _sets(overrides: tuple[str, ...]) -> list[str]:
    return [arg for kv in overrides for arg in ("--set", kv)]


def _run_dir(output: str) -> Path:
    (line,) = re.findall(r"^run directory: (.+)$", output, re.MULTILINE)
    return Path(line)


def test_sft_grpo_report_and_diag_run_from_the_installed_wheel_outside_the_checkout(venv, tmp_path):
    elsewhere = tmp_path / "my-project"
    elsewhere.mkdir()
    where = venv.check(elsewhere)
    print(f"\nrlslurm from {where}")

    sft = venv.run(["rlslurm", "submit", str(ROOT / "examples" / "tiny-sft.yaml"), "--backend", "local", "--wait",
                    "--run-root", "runs", *_sets(SFT)], cwd=elsewhere)
    assert sft.returncode == 0, sft.stdout[-3000:] + sft.stderr[-3000:]
    sft_dir = elsewhere / _run_dir(sft.stdout)
    assert sft_dir.is_relative_to(elsewhere / "runs")
    export = sft_dir / "export" / "hf"
    assert (export / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (sft_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "sft_step"] == list(range(1, 21))

    grpo = venv.run(["rlslurm", "submit", str(ROOT / "examples" / "tiny-grpo.yaml"), "--backend", "local", "--wait",
                     "--run-root", "runs", "--set", f"train.init_from={export}", *_sets(GRPO)], cwd=elsewhere)
    assert grpo.returncode == 0, grpo.stdout[-3000:] + grpo.stderr[-3000:]
    rl_dir = elsewhere / _run_dir(grpo.stdout)
    done = [json.loads(line) for line in (rl_dir / "events.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "done"]
    assert [(e["step"], e["policy_version"]) for e in done] == [(2, 2)]

    report = venv.run(["rlslurm", "report", str(rl_dir)], cwd=elsewhere)
    assert report.returncode == 0, report.stdout + report.stderr
    assert (rl_dir / "report" / "report.png").stat().st_size > 0 and (rl_dir / "report" / "report.html").is_file()

    diag = venv.run(["rlslurm", "diag", str(rl_dir)], cwd=elsewhere)
    assert diag.returncode == 0, diag.stdout + diag.stderr
    assert "cause: finished OK" in diag.stdout, diag.stdout
    (bundle,) = elsewhere.glob("diag-*.tar.gz")
    with tarfile.open(bundle) as tar:
        assert any(name.endswith("events.jsonl") for name in tar.getnames())
    # Nothing of the checkout was written to by the runs: they and their outputs are in the user's directory.
    assert not (ROOT / "runs" / rl_dir.name).exists() and not (ROOT / "runs" / sft_dir.name).exists()
