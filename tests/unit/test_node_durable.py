"""The one node-name helper and the one fsync helper."""

from __future__ import annotations

import socket

import pytest

from rlslurm.durable import fsync
from rlslurm.events import START, emit
from rlslurm.node import node_name
from rlslurm.rundir import RunDir


def test_node_name_is_slurms_name_else_the_hostname_and_events_carry_it(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    assert node_name() == socket.gethostname()
    monkeypatch.setenv("SLURMD_NODENAME", "n3")
    assert node_name() == "n3"
    assert emit(RunDir(tmp_path).create(), START, step=0, restart_count=0)["host"] == "n3"


def test_fsync_takes_files_and_directories_and_names_a_missing_path(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    fsync(tmp_path / "f")
    fsync(tmp_path)
    with pytest.raises(FileNotFoundError):
        fsync(tmp_path / "missing")
