"""`reward.scorer: function` through the real reward service process: a verl-style compute_score file whose
data_source picks the behaviour (as verl's default_compute_score dispatches), including functions that raise,
hang, exit, kill their process or return no number; the service stays healthy and degrades only that item."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from rlslurm.reward.config import RewardConfig
from rlslurm.reward.items import Item
from rlslurm.reward.supervisor import RewardSupervisor
from rlslurm.secret import bearer

REWARDS = '''
import math, os, sys, time

from helper import same      # a module beside the file imports, as under verl


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "raise":
        raise ValueError("no reference for " + solution_str)
    if data_source == "hang":
        open(extra_info["pidfile"], "w").write(str(os.getpid()))
        time.sleep(3600)
    if data_source == "string":
        return "high"
    if data_source == "nan":
        return math.nan
    if data_source == "dict":
        return {"score": 0.5, "acc": True}
    if data_source == "exit":
        sys.exit(3)
    if data_source == "die":
        os._exit(1)
    if data_source == "extra":
        return extra_info["bonus"]
    if data_source == "noisy":
        print("a user's debug print")
        return 2.5
    # gsm8k-like: a list ground truth arrives as a list, a text one as text
    answers = ground_truth if isinstance(ground_truth, list) else [ground_truth]
    return same(solution_str, answers)
'''


def item(i: int, source: str, response: str = "19", reference: str = "19", json_ref: bool = False,
         extra: dict | None = None) -> Item:
    return Item(id=str(i), response=response, reference=reference, reference_is_json=json_ref, data_source=source,
                extra=json.dumps(extra or {}))


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    folder = tmp_path_factory.mktemp("function")
    (folder / "rewards.py").write_text(REWARDS)
    (folder / "helper.py").write_text("def same(text, answers):\n    return float(text.strip() in answers)\n")
    cfg = RewardConfig(scorer="function", function=f"{folder}/rewards.py", concurrency=2, timeout_s=2.0,
                       health_interval_s=0.2, health_timeout_s=1.0, start_timeout_s=60)
    with RewardSupervisor(cfg, log_dir=folder) as sup:
        with httpx.Client(headers=bearer(sup.token), timeout=30) as http:
            yield sup, http


def score(service, items: list[Item]) -> list[dict]:
    sup, http = service
    reply = http.post(sup.url + "/score", json={"items": [i.__dict__ for i in items]})
    reply.raise_for_status()
    return reply.json()["results"]


def test_verl_signature_scores_and_degrades_bad_returns(service):
    results = score(service, [
        item(0, "gsm8k"), item(1, "gsm8k", response="18"),
        item(2, "gsm8k", response="19", reference=json.dumps(["19", "nineteen"]), json_ref=True),
        item(3, "gsm8k", response="[\"19\"]", reference="[\"19\"]"),   # text that looks like JSON stays text
        item(4, "dict"), item(5, "extra", extra={"extra_info": {"bonus": -1.5}}), item(6, "noisy"),
        item(7, "raise"), item(8, "string"), item(9, "nan"), item(10, "exit"),
    ])
    got = {r["id"]: r for r in results}
    assert [got[str(i)]["score"] for i in range(7)] == [1.0, 0.0, 1.0, 1.0, 0.5, -1.5, 2.5]
    assert "acc=True" in got["4"]["reason"]
    for i, words in ((7, "raised ValueError: no reference for 19"), (8, "returned str 'high', not a number"),
                     (9, "returned nan"), (10, "raised SystemExit: 3")):
        assert got[str(i)]["status"] == "unscored" and got[str(i)]["score"] is None, got[str(i)]
        assert words in got[str(i)]["reason"], got[str(i)]


def test_a_hanging_function_times_out_alone_and_its_worker_is_replaced(service, tmp_path):
    sup, http = service
    out: list = []
    pidfile = tmp_path / "hung.pid"
    hung_item = item(0, "hang", extra={"pidfile": str(pidfile)})
    hang = threading.Thread(target=lambda: out.extend(score(service, [hung_item])))
    started = time.monotonic()
    hang.start()
    time.sleep(0.5)
    during = http.get(sup.url + "/health", timeout=1.0)  # the loop is free while the function hangs
    assert during.status_code == 200 and during.json()["inflight"] == 1
    assert score(service, [item(1, "gsm8k")])[0]["score"] == 1.0  # the other worker scores meanwhile
    hang.join(30)
    assert out[0]["status"] == "error" and "reward.timeout_s = 2" in out[0]["reason"], out
    assert time.monotonic() - started < 10
    # The hung worker is gone (killed with its group), and the next items score on a fresh one.
    hung = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(hung) and psutil.Process(hung).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"hung worker {hung} still runs"
        time.sleep(0.1)
    assert [r["score"] for r in score(service, [item(2, "gsm8k"), item(3, "gsm8k")])] == [1.0, 1.0]
    metrics = http.get(sup.url + "/metrics").text
    assert "rlslurm_reward_workers_replaced_total 0" not in metrics and "workers_replaced_total" in metrics


def test_a_function_that_kills_its_worker_degrades_that_item_only(service):
    results = score(service, [item(0, "die"), item(1, "gsm8k")])
    assert results[0]["status"] == "unscored" and "died while scoring" in results[0]["reason"], results
    assert results[1]["score"] == 1.0
    assert score(service, [item(2, "gsm8k")])[0]["score"] == 1.0


def test_workers_die_with_the_service(tmp_path):
    (tmp_path / "rewards.py").write_text("def compute_score(d, s, g, extra_info=None):\n    return 1\n")
    cfg = RewardConfig(scorer="function", function=f"{tmp_path}/rewards.py", concurrency=2, max_restarts=0,
                       health_interval_s=5.0)
    with RewardSupervisor(cfg, log_dir=tmp_path) as sup:
        with httpx.Client(headers=bearer(sup.token), timeout=30) as http:
            reply = http.post(sup.url + "/score", json={"items": [item(i, "x").__dict__ for i in range(4)]})
            assert [r["score"] for r in reply.json()["results"]] == [1.0] * 4
        workers = [p for p in psutil.Process(sup.proc.pid).children(recursive=True)
                   if "rlslurm.reward.worker" in p.cmdline()]
        assert workers
        os.kill(sup.proc.pid, signal.SIGKILL)
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, [p.pid for p in alive]


def test_rule_scorer_sends_latex_to_math_verify_workers(tmp_path):
    """The rule scorer's other worker pool: plain numbers are decided in the service, LaTeX by math-verify in a
    worker (its signal timeouts on that worker's main thread), GSM8K's `#### n` reference cut to n."""
    cfg = RewardConfig(scorer="rule", concurrency=2, timeout_s=30.0)
    with RewardSupervisor(cfg, log_dir=tmp_path) as sup:
        with httpx.Client(headers=bearer(sup.token), timeout=60) as http:
            batch = [Item(id="0", response="19", reference="19"),
                     Item(id="1", response="so \\boxed{\\frac{1}{2}}", reference="0.5"),
                     Item(id="2", response="the answer is $\\pi/2$", reference="\\frac{\\pi}{2}"),
                     Item(id="3", response="she has 72 clips", reference="48/2 = 24\n#### 72"),
                     Item(id="4", response="\\boxed{3}", reference="\\sqrt{2}")]
            results = http.post(sup.url + "/score", json={"items": [i.__dict__ for i in batch]}).json()["results"]
    assert [r["score"] for r in results] == [1.0, 1.0, 1.0, 1.0, 0.0], results
    assert results[1]["reason"].startswith("math-verify")


def test_inline_scoring_from_a_thread_of_its_own_is_bounded_too(tmp_path):
    """reward.service: inline runs make_scorer's scorer on the controller's own event loop, possibly in a thread:
    score_bounded gives it the service's rules (a hang is an error, its worker killed) and close_scorer ends
    the workers."""
    import asyncio

    from rlslurm.reward.scorers import close_scorer, make_scorer, score_bounded

    (tmp_path / "rewards.py").write_text("import time\n\ndef compute_score(d, s, g, extra_info=None):\n"
                                         "    if d == 'hang':\n        time.sleep(3600)\n    return len(s)\n")
    scorer = make_scorer(RewardConfig(scorer="function", function=f"{tmp_path}/rewards.py", concurrency=1))
    out: list = []

    def controller() -> None:
        loop = asyncio.new_event_loop()
        try:
            out.append(loop.run_until_complete(score_bounded(scorer, item(0, "hang"), 1.0)))
            out.append(loop.run_until_complete(score_bounded(scorer, item(1, "x", response="abc"), 10.0)))
            out.append([p.pid for p in psutil.Process().children()  # not the module service's workers
                        if "rlslurm.reward.worker" in p.cmdline()])
            loop.run_until_complete(close_scorer(scorer))
        finally:
            loop.close()

    thread = threading.Thread(target=controller)
    thread.start()
    thread.join(60)
    hung, scored, workers = out
    assert (hung.status, hung.score) == ("error", None) and "reward.timeout_s = 1" in hung.reason
    assert (scored.status, scored.score) == ("scored", 3.0)
    assert len(workers) == 1
    gone, alive = psutil.wait_procs([psutil.Process(pid) for pid in workers if psutil.pid_exists(pid)], timeout=5)
    assert not alive


def test_a_slow_import_is_not_restarted_by_each_timeout(tmp_path):
    """A worker still importing (a user's file that imports torch, say) outlives the timeout of the item that
    started it and serves the next ones; it is not killed and started again at every item."""
    import asyncio

    from rlslurm.reward.scorers import close_scorer, make_scorer, score_bounded

    (tmp_path / "slow.py").write_text("import time\ntime.sleep(3)\n\ndef compute_score(d, s, g, extra_info=None):\n"
                                      "    return 1\n")
    scorer = make_scorer(RewardConfig(scorer="function", function=f"{tmp_path}/slow.py", concurrency=1))

    async def run():
        first = await score_bounded(scorer, item(0, "x"), 1.0)
        await asyncio.sleep(4)
        second = await score_bounded(scorer, item(1, "x"), 1.0)
        await close_scorer(scorer)
        return first, second, scorer.pool.replaced

    first, second, replaced = asyncio.run(run())
    assert first.status == "error" and (second.status, second.score) == ("scored", 1.0) and replaced == 0


VERL_GSM8K = '''import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's gsm8k rule, shortened: the number after '####' against the ground truth."""
    found = re.findall(r"#### (\\-?[0-9\\.\\,]+)", solution_str)
    if not found:
        return 0.0
    return {"score": float(found[-1].replace(",", "") == ground_truth), "index": extra_info["index"]}
'''


def test_rlslurm_score_with_a_verl_file_and_function(tmp_path):
    """A verl parquet's rows (here jsonl) and its compute_score, unchanged, through `rlslurm score` (relative
    paths, the working directory's, as a user runs it)."""
    import subprocess
    import sys

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "test", "index": i}} for i in range(6)]
    (tmp_path / "gsm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "responses.jsonl").write_text("".join(
        json.dumps({"row": i, "response": f"so #### {2 * i if i % 2 == 0 else 7}"}) + "\n" for i in range(6)))
    (tmp_path / "rewards.py").write_text(VERL_GSM8K)
    (tmp_path / "job.yaml").write_text(
        "job: {name: verl-score, kind: rl}\nplacement: {mode: colocate}\nhardware: {nodes: 1, gpus_per_node: 1}\n"
        "data: {train: gsm.jsonl, eval: gsm.jsonl}\n"
        "reward: {scorer: function, function: rewards.py, service: local}\n")
    out = subprocess.run([sys.executable, "-m", "rlslurm.cli.main", "score", "job.yaml", "--responses",
                          "responses.jsonl", "--show", "3"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "mean reward 0.5000" in out.stdout and "pass rate 0.500 (3/6" in out.stdout, out.stdout
    assert "row 1: scored 0.0 rewards.py:compute_score: index=1" in out.stdout


def test_rlslurm_score_reads_verls_generation_parquet(tmp_path):
    """verl's offline eval, as verl runs it: a parquet dataset, `main_generation`'s output (the dataset again
    with a `responses` column of n samples per row), and compute_score. Row i's samples are scored against
    row i; a file of another length, or without the column, is refused naming both."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "test", "index": i}} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    # Two samples per row: the first right, the second right on even rows only (0, 2, 4) -> 8 of 10 pass.
    generated = [{**r, "responses": [f"#### {2 * i}", f"#### {2 * i if i % 2 == 0 else -1}"]}
                 for i, r in enumerate(rows)]
    pq.write_table(pa.Table.from_pylist(generated), tmp_path / "gen.parquet")
    pq.write_table(pa.Table.from_pylist(generated[:3]), tmp_path / "short.parquet")
    (tmp_path / "rewards.py").write_text(VERL_GSM8K)
    (tmp_path / "job.yaml").write_text(
        "job: {name: verl-eval, kind: rl}\nplacement: {mode: colocate}\nhardware: {nodes: 1, gpus_per_node: 1}\n"
        "data: {train: test.parquet, eval: test.parquet}\n"
        "reward: {scorer: function, function: rewards.py, service: local}\n")

    def score(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rlslurm.cli.main", "score", "job.yaml", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)

    out = score("--responses", "gen.parquet", "--out", "scored.jsonl")
    assert out.returncode == 0, out.stderr
    assert "10 responses" in out.stdout and "pass rate 0.800 (8/10" in out.stdout, out.stdout
    scored = [json.loads(line) for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    assert [(s["row"], s["score"]) for s in scored] == [(0, 1.0), (0, 1.0), (1, 1.0), (1, 0.0), (2, 1.0), (2, 1.0),
                                                        (3, 1.0), (3, 0.0), (4, 1.0), (4, 1.0)]
    short = score("--responses", "short.parquet")
    assert short.returncode == 2 and "short.parquet: 3 rows, the split has 5" in short.stderr, short.stderr
    no_column = score("--responses", "gen.parquet", "--response-key", "answers")
    assert no_column.returncode == 2 and "no column 'answers'" in no_column.stderr, no_column.stderr
    assert "Traceback" not in short.stderr + no_column.stderr
