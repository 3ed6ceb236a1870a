"""The job's secret: made once at submit (0600), kept by a resume, read only from an owner-only file,
compared in constant time, and never carried by a diag bundle."""

from __future__ import annotations

import os
import stat
import tarfile
import threading

import pytest

from rlslurm import secret
from rlslurm.config import JobConfig
from rlslurm.diag.bundle import collect
from rlslurm.errors import RunDirError
from rlslurm.launch import prepare


def test_ensure_makes_one_owner_only_token_and_keeps_it(tmp_path):
    path = secret.ensure(tmp_path / "run" / "secret")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = secret.read(path)
    assert len(token) >= 40 and secret.ensure(path) == path and secret.read(path) == token
    assert [p.name for p in path.parent.iterdir()] == ["secret"]  # no temporary file left behind


def test_racing_processes_agree_on_one_token(tmp_path):
    path = tmp_path / "secret"
    tokens = []
    threads = [threading.Thread(target=lambda: tokens.append(secret.read(secret.ensure(path)))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(tokens)) == 1


@pytest.mark.parametrize("mode, content, words", [
    (0o644, "tok\n", "mode 644: group or others may read it; chmod 600"),
    (0o600, "\n", "is empty"),
])
def test_read_refuses_a_readable_or_empty_file(tmp_path, mode, content, words):
    path = tmp_path / "secret"
    path.write_text(content)
    os.chmod(path, mode)
    with pytest.raises(RunDirError, match=words):
        secret.read(path)
    with pytest.raises(RunDirError, match="python -m rlslurm.secret"):
        secret.read(tmp_path / "missing")


def test_a_server_without_a_secret_file_refuses_to_start(monkeypatch):
    monkeypatch.delenv(secret.ENV_VAR, raising=False)
    with pytest.raises(RunDirError, match="--secret-file"):
        secret.from_env_or(None)


def test_matches_only_the_bearer_token():
    token = "abc-DEF_123"
    assert secret.matches("Bearer abc-DEF_123", token) and secret.matches("bearer abc-DEF_123", token)
    for presented in (None, "", "abc-DEF_123", "Basic abc-DEF_123", "Bearer abc-DEF_12", "Bearer abc-DEF_1234",
                      "Bearer ", "Bearer ABC-DEF_123"):
        assert not secret.matches(presented, token), presented
    assert secret.bearer(token) == {"Authorization": "Bearer abc-DEF_123"} and secret.bearer(None) == {}


def test_submit_makes_the_runs_secret_and_a_bundle_never_carries_it(tmp_path):
    run, _plan = prepare(JobConfig(), config_text="job: {}\n", run_root=tmp_path / "runs")
    assert stat.S_IMODE(run.secret.stat().st_mode) == 0o600
    token = secret.read(run.secret)
    # Leaked where nothing names it a secret: a log line, an event.
    (run.logs / "engine-0.log").write_text(f"started with {token} by mistake\n")
    run.append_json(run.events, {"kind": "note", "text": f"client sent {token}"})
    bundle = collect(run.path, out_dir=tmp_path / "out", live=False, slurm=False)
    with tarfile.open(bundle.path) as tar:
        members = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    assert any(name.endswith("logs/engine-0.log.tail") for name in members)
    assert not [name for name, text in members.items() if token in text]
    assert not [name for name in members if name.endswith("/secret")]
