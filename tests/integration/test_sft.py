"""The SFT entrance for real: two processes over gloo train examples/tiny-sft.yaml, then the export is
reloaded with AutoModelForCausalLM + AutoTokenizer and measured again.

One run of the example (~1-2 min on 2 cores; the session's, which the RL tests share) feeds every test of the
module.
"""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlslurm.evaluate import greedy_accuracy
from rlslurm.events import read_events
from rlslurm.jobs.sft import batch_indices, weights_sha256
from rlslurm.rundir import RunDir, read_jsonl
from rlslurm.tasks.arithmetic import make_splits

WORLD = 2


@pytest.fixture(scope="module")
def sft_run(sft) -> dict:
    """The session's SFT of the example (tests/integration/conftest.py: `rlslurm submit`, local backend, 2 ranks
    over gloo), shared with the RL tests that start from its export. The same entry point under srun is
    tests/cluster/test_sft_slurm.py's."""
    return {"run": RunDir(sft["run_dir"]), "wall_s": sft["eval"]["wall_s"], "job": sft["job"]}


def test_both_ranks_finish_with_identical_weights(sft_run):
    finished = read_events(sft_run["run"], "sft_finished")
    assert sorted(e["rank"] for e in finished) == list(range(WORLD))
    assert len({e["step"] for e in finished}) == 1, finished
    assert len({e["weights_sha256"] for e in finished}) == 1, finished


def test_stops_at_the_dev_target_and_records_each_evaluation(sft_run):
    """train.stop_at_accuracy: every rank stops at the first evaluation (every train.eval_every_steps) whose
    dev-split accuracy reaches the target, well inside train.steps; the held-out split is not the dev one."""
    job, rows = sft_run["job"], read_jsonl(sft_run["run"].metrics)
    (finished, *_) = read_events(sft_run["run"], "sft_finished")
    dev = [r for r in rows if r["kind"] == "sft_dev"]
    assert [r["step"] for r in dev] == list(range(job.train.eval_every_steps, finished["step"] + 1,
                                                  job.train.eval_every_steps))
    assert dev[-1]["dev_accuracy"] >= job.train.stop_at_accuracy > max(r["dev_accuracy"] for r in dev[:-1])
    assert finished["stopped_by"] == "stop_at_accuracy" and finished["step"] < job.train.steps


def test_loss_decreases(sft_run):
    steps = [r for r in read_jsonl(sft_run["run"].metrics) if r["kind"] == "sft_step"]
    (finished, *_) = read_events(sft_run["run"], "sft_finished")
    assert [r["step"] for r in steps] == list(range(1, finished["step"] + 1))
    first = sum(r["loss"] for r in steps[:20]) / 20
    last = sum(r["loss"] for r in steps[-20:]) / 20
    assert last < 0.5 * first, (first, last)


def test_export_reloads_and_reproduces_the_recorded_accuracy(sft_run):
    run, job = sft_run["run"], sft_run["job"]
    export = run.path / "export" / "hf"
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    finished = read_events(run, "sft_finished")
    assert weights_sha256(model) == finished[0]["weights_sha256"], "the export is not the trained weights"
    assert not list(export.parent.glob(".hf.*")), "a temp or old export directory was left behind"

    _, held_out = make_splits(job.task)
    measured = greedy_accuracy(model, tokenizer, held_out, max_new_tokens=job.rollout.max_new_tokens)
    (recorded,) = [r for r in read_jsonl(run.metrics) if r["kind"] == "sft_eval"]
    assert recorded["held_out_total"] == len(held_out) == job.task.eval_size
    assert measured.correct == recorded["held_out_correct"]
    print(f"\nheld-out greedy accuracy {measured.accuracy:.3f} ({measured.correct}/{measured.total}); "
          f"SFT wall {sft_run['wall_s']:.1f} s")
    # The embedded default must learn (RL starts from something) yet leave room for RL to improve.
    assert 0.15 <= measured.accuracy <= 0.8, measured.accuracy


def test_batches_split_the_global_batch_between_ranks():
    for step in (0, 7, 31):  # 31 crosses an epoch boundary of 100 examples at a global batch of 8
        parts = [batch_indices(100, 8, seed=3, step=step, rank=r, world=2) for r in range(2)]
        assert len(parts[0]) == len(parts[1]) == 4
        assert not set(parts[0]) & set(parts[1])
        assert parts == [batch_indices(100, 8, seed=3, step=step, rank=r, world=2) for r in range(2)]
    epoch0 = sorted(i for s in range(12) for r in range(2) for i in batch_indices(100, 8, 3, s, r, 2))[:96]
    assert len(set(epoch0)) == 96, "the first epoch must not repeat an example"
    assert batch_indices(100, 8, 3, 0, 0, 2) != batch_indices(100, 8, 4, 0, 0, 2), "the seed must matter"
