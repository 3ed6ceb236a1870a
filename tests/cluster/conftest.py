"""The real local Slurm cluster for tests/cluster: started once per session in a temp dir, torn down after.

    python -m pytest -q tests/cluster          # needs root and Debian's slurmctld/slurmd/munge
    python -m pytest -q -m "not cluster" tests # everything else, where no cluster can run

A cluster that cannot start is a test error with the reason, never a skip: a skipped cluster test
would prove nothing.

The fixture `slurm_cluster` sets SLURM_CONF for the session (every SLURM client reads it) and yields a
`ClusterHandle`: `.conf`, `.dir`, `.up_s` (measured bring-up time) and `.kick()` (the backfill nudge a
requeued het job needs on an idle test cluster; see rlslurm/slurm/localcluster.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlslurm import launch
from rlslurm.config import load_config
from rlslurm.errors import RlslurmError
from rlslurm.slurm.localcluster import LocalCluster, orphaned_clusters

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ClusterHandle:
    cluster: LocalCluster
    up_s: float

    @property
    def conf(self) -> Path:
        return self.cluster.conf

    @property
    def dir(self) -> Path:
        return self.cluster.dir

    def kick(self) -> None:
        self.cluster.kick()


def _cannot_start(reason: str):
    raise RuntimeError(f"the local Slurm cluster cannot start: {reason} "
                       '(deselect these tests with -m "not cluster" where no cluster can run)')


@pytest.fixture(scope="session")
def slurm_cluster():
    missing = [b for b in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun") if shutil.which(b) is None]
    if missing:
        _cannot_start(f"not installed: {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0:
        _cannot_start("the local cluster runs its daemons as root (SlurmUser=root); this user is not root")
    cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="rlslurm-cluster-")))
    for stale in orphaned_clusters(cluster.port_base):  # a killed session's, on the ports this one needs
        print(f"stopping the local Slurm of a test session that is gone: {stale.dir}")
        stale.down()
        shutil.rmtree(stale.dir, ignore_errors=True)
    cluster.claim()
    try:
        up_s = cluster.up(timeout_s=30)
    except (RlslurmError, OSError) as e:
        cluster.down()
        _cannot_start(f"{e}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield ClusterHandle(cluster, up_s)
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        cluster.down()
        shutil.rmtree(cluster.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def sft_export(tmp_path_factory) -> Path:
    """A short SFT of examples/tiny-sft.yaml (held-out accuracy ~0.05): some samples of a group are right
    and some wrong, so GRPO has signal. Local backend: it is only the starting point. One for the session: the RL
    het job tests (test_rl_slurm.py) and GRPO on the verl parquet (test_rl_data_slurm.py) start from it."""
    path = ROOT / "examples" / "tiny-sft.yaml"
    job = load_config(path, ["train.steps=400", "task.eval_size=200"])
    sub = launch.submit(job, config_text=path.read_text(), backend="local",
                        run_root=tmp_path_factory.mktemp("sft"))
    assert [int(c) for c in launch.wait(sub, timeout_s=300, poll_s=0.5)] == [0, 0]
    export = sub.run_dir / "export" / "hf"
    assert (export / "config.json").is_file()
    return export


@pytest.fixture(scope="module", autouse=True)
def _cancel_and_tidy_at_end(slurm_cluster):
    """After each module (before the session stops the cluster): its jobs cancelled, what they left ended."""
    import spine_util as su

    yield
    for line in su.cleanup():
        print(f"\ncleanup: {line}")


OUTLIVE_GRACE_S = 45.0
"""How long a process of an ended job may take to go after the test (SLURM's KillWait is 30 s here)."""


@pytest.fixture(autouse=True)
def _nothing_outlives_its_job():
    """After every cluster test: no process of a job the test submitted and that has ended in SLURM is left on
    the machine (a killed parent's children included: `spine_util.leftovers`). Jobs still live (a module's
    shared job) are the module's cleanup's. A leftover fails the test, named, and is ended."""
    import psutil

    import spine_util as su
    from waiting import wait_for

    first = len(su.TRACKED)
    yield
    ended = [run for job_id, run in su.TRACKED[first:]
             if su.state(job_id) not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING")]
    left: list[str] = []
    try:
        wait_for("no process of an ended job", lambda: not any(su.leftovers(run) for run in ended), OUTLIVE_GRACE_S,
                 poll_s=0.5)
    except AssertionError:  # the wait's own message names no process; the listing below does
        left = [line for run in ended for line in su.leftovers(run)]
        for p in psutil.process_iter(["cmdline"]):
            if p.info["cmdline"] and any(str(run) in a for a in p.info["cmdline"] for run in ended):
                with contextlib.suppress(psutil.Error):
                    p.kill()
    if left:
        pytest.fail(f"{len(left)} processes outlived their ended job by {OUTLIVE_GRACE_S:g} s:\n" + "\n".join(left))
