"""A test session killed before its teardown (SIGTERM or SIGKILL to pytest) leaves its local Slurm up; the next
session's `slurm_cluster` fixture stops such a cluster on its ports before it starts its own
(rlslurm/slurm/localcluster.py `orphaned_clusters`). Here on a second real cluster beside the session's, on ports of
its own, whose claimed owner has exited."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlslurm.slurm.localcluster import LocalCluster, orphaned_clusters

pytestmark = pytest.mark.cluster


def test_a_cluster_whose_session_is_gone_is_found_and_stopped_and_a_live_sessions_is_not(slurm_cluster):
    port_base = slurm_cluster.cluster.port_base + 100  # clear of the session's cluster (slurmd at +184..+190)
    other = LocalCluster(Path(tempfile.mkdtemp(prefix="rlslurm-cluster-")), port_base=port_base, node_network=False)
    try:
        other.claim()  # this process: alive, so not orphaned
        other.up(timeout_s=30)
        daemons = other.running()
        assert {"slurmctld", "munged"} <= set(daemons) and len(daemons) == 9, daemons
        assert orphaned_clusters(port_base) == []
        assert not slurm_cluster.cluster.orphaned()  # the session's own: claimed by this live session

        session = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        other.claim(session.pid)
        assert orphaned_clusters(port_base) == []  # its session still runs
        session.kill()  # ended without its teardown
        session.wait()
        assert orphaned_clusters(port_base + 1) == []  # another port base: not this session's to stop
        (found,) = orphaned_clusters(port_base)
        assert found.dir == other.dir
        found.down()
        assert other.running() == {}
        assert orphaned_clusters(port_base) == []
    finally:
        other.down()
        shutil.rmtree(other.dir, ignore_errors=True)
