"""Hostile tools in a real RL job (`rlslurm submit --backend local --wait`): a model that makes, prompt by prompt,
a malformed call, a call to an unknown tool, a call with wrong arguments, and calls to user tools that raise,
hang past rollout.tool_timeout_s and return megabytes. Every step completes and trains, every response of every
step reaches the reward (nothing lost), each kind of error is counted in the step's metrics and in a
`tool_errors` event, and the trainer's log-probs of the episodes' generated tokens are the engine's.

    python -m pytest -q tests/integration/test_rl_tools_hostile.py     # ~2-4 min on 2 shared cores
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from rlslurm.events import TOOL_ERRORS, read_events
from rlslurm.rundir import RunDir, read_jsonl
from tool_fixtures import call, scripted_model

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tests" / "data" / "tools" / "hostile_tools.py"


def _turns(first: dict) -> list[dict]:
    return [first, {"role": "tool", "name": "x", "content": "x"}, {"role": "assistant", "content": "1"}]


def _calls(*calls) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": list(calls)}


HOSTILE = {  # prompt -> the error kind its scripted call makes
    "malformed": ({"role": "assistant", "content": '<tool_call>{"name": "echo", "arguments": {</tool_call>'},
                  "malformed"),
    "unknown": (_calls(call("nope")), "unknown_tool"),
    "wrong": (_calls(call("echo", words="hi")), "bad_arguments"),
    "raise": (_calls(call("boom")), "raised"),
    "hang": (_calls(call("sleepy")), "timeout"),
    "huge": (_calls(call("big")), "output_limit"),
}


def test_every_hostile_tool_is_a_counted_error_and_every_step_completes(tmp_path):
    model = scripted_model(tmp_path / "model", {q: _turns(first) for q, (first, _) in HOSTILE.items()}, hidden=64)
    rows = "".join(json.dumps({"prompt": [{"role": "user", "content": q}], "ground_truth": "1"}) + "\n"
                   for q in HOSTILE)
    (tmp_path / "train.jsonl").write_text(rows)
    job = yaml.safe_load((ROOT / "examples" / "tool-grpo.yaml").read_text())
    job["hardware"] = {"nodes": 1, "gpus_per_node": 1}
    job["placement"] = {"mode": "colocate"}
    job["parallel"] = {"micro_batch_size": 16}
    job["train"].update(steps=2, init_from=str(model))
    job["rl"].update(prompts_per_step=len(HOSTILE), samples_per_prompt=2, eval_every=2, eval_rows=len(HOSTILE))
    job["rollout"].update(max_new_tokens=96, temperature=0.3, max_turns=2, tool_timeout_s=2, tool_output_chars=500,
                          tools=[f"{TOOLS}:{name}" for name in ("echo", "boom", "sleepy", "big")])
    job["data"].update(train=str(tmp_path / "train.jsonl"), eval=str(tmp_path / "train.jsonl"))
    job["checkpoint"] = {"interval_steps": 10}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    done = subprocess.run([sys.executable, "-m", "rlslurm.cli.main", "submit", str(tmp_path / "job.yaml"), "--backend",
                           "local", "--run-root", str(tmp_path / "runs"), "--wait"], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = RunDir(Path(re.search(r"run directory: (\S+)", done.stdout).group(1)))
    steps = [r for r in read_jsonl(run.metrics) if "policy_version" in r]
    assert [r["step"] for r in steps] == [1, 2]
    kinds = {k: sum(r["tool_error_kinds"][k] for r in steps) for k in steps[0]["tool_error_kinds"]}
    print(f"FIGURE hostile_tool_errors: {kinds}, tool_s per step {[round(r['tool_s'], 2) for r in steps]}")
    for prompt, (_, kind) in HOSTILE.items():
        assert kinds[kind] >= 1, f"{prompt}: no {kind} error counted ({kinds})"
    for r in steps:
        assert r["samples"] == len(HOSTILE) * 2  # every episode of the step reached the reward: nothing lost
        assert r["tool_errors"] == sum(r["tool_error_kinds"].values()) >= 1
        assert r["tool_calls"] >= len(HOSTILE) * 2
        if r["trained"]:
            assert r["engine_trainer_logprob_gap"] < 1e-3
        assert r["step_s"] < 120  # a hanging tool costs its timeout, not the step
    events = read_events(run, TOOL_ERRORS)
    assert len(events) >= 2 and all(e["errors"] >= len(HOSTILE) for e in events[:2])
    assert read_events(run, "done")
