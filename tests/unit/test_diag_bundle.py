"""Redaction of secrets and the cause classifier of `rlslurm diag` (pure functions, table-driven)."""

from __future__ import annotations

import pytest

from rlslurm.diag.bundle import Redactor, _state_of
from rlslurm.diag.summary import Facts, classify, render


@pytest.mark.parametrize("text, secret", [
    ("HF_TOKEN=hf_abcdefghijklmnopqrstuv123", "hf_abcdefghijklmnopqrstuv123"),
    ("using hf_abcdefghijklmnopqrstuv123 now", "hf_abcdefghijklmnopqrstuv123"),
    ("openai sk-abcdefghijklmnopqrstuvwxyz012345", "sk-abcdefghijklmnopqrstuvwxyz012345"),
    ("git ghp_abcdefghijklmnopqrstuvwxyz0123456789", "ghp_abcdefghijklmnopqrstuvwxyz0123456789"),
    ("aws AKIAIOSFODNN7EXAMPLE here", "AKIAIOSFODNN7EXAMPLE"),
    ("Authorization: Bearer abc.def-ghi_jkl", "abc.def-ghi_jkl"),
    ('{"db_password": "p@ss w0rd"}', "p@ss"),
    ("export MY_SECRET='s3cr3t-value'", "s3cr3t-value"),
    ("url https://user:hunter22@example.com/x", "hunter22"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", "MIIEow"),
])
def test_text_redaction(text, secret):
    out = Redactor().text(text)
    assert secret not in out and "<redacted>" in out


def test_learned_secrets_are_removed_from_all_text_but_words_are_not_learned():
    red = Redactor()
    red.learn({"reward": {"api_key": "plain-secret-42", "keep": 2}, "env.HF_TOKEN": "x"})
    red.learn_text("json.dumps(x, sort_keys=False)")
    assert red.structure({"api_key": "plain-secret-42", "name": "ok"}) == {"api_key": "<redacted>", "name": "ok"}
    assert red.text("log: connecting with plain-secret-42") == "log: connecting with <redacted>"
    assert "False" in red.text("flag False stays")


def _facts(**kw):
    return Facts(**{"host": "thishost", "now": 1000.0, **kw})


@pytest.mark.parametrize("facts, kind, words", [
    (_facts(logs={"train-0.log": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n"}),
     "oom", "out of memory"),
    (_facts(slurm_state="TIMEOUT"), "time_limit", "time limit"),
    (_facts(slurm_state="PREEMPTED"), "preempted", "preempted"),
    (_facts(slurm_state="NODE_FAIL"), "node_failure", "node failure"),
    (_facts(logs={"slurm.out": "slurmstepd: error: *** JOB 12 CANCELLED AT x DUE TO TIME LIMIT ***"}),
     "time_limit", "time limit"),
    (_facts(events=[{"kind": "sync_failed", "message": "checksum mismatch on lm_head.weight"}]),
     "sync_failure", "lm_head.weight"),
    (_facts(logs={"rollout-0.log": "vllm.v1.engine.exceptions.EngineDeadError: engine died"}),
     "engine_crash", "rollout engine crash"),
    # vLLM's own lines at a clean SIGTERM (a COMPLETED job's engine-0.log): the error after its stop is no crash.
    (_facts(slurm_state="COMPLETED", logs={"engine-0.log": (
        "(APIServer pid=30326) INFO 12-02 05:33:24 [launcher.py:254] [shutdown] API server: shutdown triggered\n"
        "(APIServer pid=30326) ERROR 12-02 05:33:24 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.\n")}),
     "finished", "finished OK"),
    (_facts(logs={"train-0.log": "rlslurm.errors.RewardServiceError: http://127.0.0.1:9 refused"}),
     "reward_down", "reward service down"),
    (_facts(env_errors=["torch differs between train and rollout"]), "env_mismatch", "env mismatch"),
    (_facts(events=[{"kind": "hang_detected", "collective": "barrier", "waiting": ["train-0"],
                     "stuck": ["rollout-1"], "message": "m"}]),
     "hang", "hang in collective barrier on ranks train-0, waiting on rollout-1"),
    (_facts(logs={"train-0.log": "Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'a'\n"}),
     "exception", "KeyError: 'a'"),
    (_facts(heartbeats=[{"state": "exited", "role": "train", "rank": 0}]), "finished", "finished OK"),
    (_facts(heartbeats=[{"state": "running", "host": "node9", "last_progress": 990.0, "phase_timeout_s": 300,
                         "role": "train", "rank": 0, "step": 4, "phase": "rollout"}]), "running", "step 4"),
    (_facts(), "unknown", "no cause found"),
])
def test_classifier_names_the_cause(facts, kind, words):
    causes = classify(facts)
    assert causes[0].kind == kind and words in causes[0].headline, causes
    assert render(causes).startswith(f"cause: {causes[0].headline}")


def test_only_the_current_attempt_decides_earlier_ones_are_evidence():
    events = [{"kind": "hang_detected", "message": "old hang", "collective": "all_reduce"},
              {"kind": "resume", "step": 40}, {"kind": "done", "step": 50}]
    (cause,) = classify(_facts(events=events))
    assert cause.kind == "finished" and "earlier attempt: hang_detected old hang" in cause.evidence


def test_slurm_state_is_read_from_scontrol_and_sacct():
    assert _state_of("scontrol-show-job.txt", "JobId=12 JobName=x\n   JobState=TIMEOUT Reason=TimeLimit") == "TIMEOUT"
    assert _state_of("sacct.txt", "JobID|State|ExitCode\n12|CANCELLED by 0|0:15\n") == "CANCELLED"


def test_a_local_runs_job_id_is_not_asked_of_slurm(tmp_path):
    import tarfile

    from rlslurm.diag.bundle import collect
    from rlslurm.rundir import RunDir

    run = RunDir(tmp_path / "local-run").create()
    run.config.write_text("job: {name: x}\n")
    run.append_json(run.path / "submissions.jsonl", {"t": 1.0, "job_id": "4242", "backend": "local"})
    bundle = collect(run.path, out_dir=tmp_path, live=False)  # slurm=True: it must see this is no SLURM job
    with tarfile.open(bundle.path) as tar:
        names = [n for n in tar.getnames() if "/slurm/" in n]
        text = tar.extractfile(names[0]).read().decode()
    assert [n.split("/", 1)[1] for n in names] == ["slurm/slurm.txt"] and "a local run" in text
    assert "job: local (no SLURM job id)" in bundle.summary
