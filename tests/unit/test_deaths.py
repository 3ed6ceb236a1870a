"""diag/deaths.py: the cgroup and counter parsers on what this machine's kernel wrote, and the node agent's
death watch on a process tree of files (the real OOM kill: tests/integration/test_diag_causes.py)."""

from __future__ import annotations

import json
from pathlib import Path

from rlslurm import events
from rlslurm.diag.deaths import DeathWatch, keyed, memory_cgroup, memory_dir, oom_kills
from rlslurm.rundir import RunDir

# /proc/self/cgroup of a shell on the 2-core CI machine (cgroup v1, memory in a hierarchy of its own).
V1 = """9:name=systemd:/
8:pids:/
7:blkio:/
6:freezer:/
5:devices:/
4:memory:/process_api/eb16ede1774ab2cfc1e47c4f138868b9
3:cpuset:/
2:cpuacct:/
1:cpu:/
0::/
"""
# cgroup v2 only (as on a current Debian host): one line.
V2 = "0::/system.slice/slurmstepd.scope/job_12/step_0/user/task_1\n"
OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"  # memory.oom_control after the kill (v1)
EVENTS = "low 0\nhigh 0\nmax 14\noom 1\noom_kill 1\noom_group_kill 0\n"  # memory.events (v2)


def test_the_memory_cgroup_of_either_version(tmp_path):
    assert memory_cgroup(V1) == (1, "/process_api/eb16ede1774ab2cfc1e47c4f138868b9")
    assert memory_cgroup(V2) == (2, "/system.slice/slurmstepd.scope/job_12/step_0/user/task_1")
    assert memory_cgroup("1:cpu:/\n") is None
    assert memory_dir(1, "/a/b", root=tmp_path) == tmp_path / "memory" / "a" / "b"
    assert memory_dir(2, "/a/b", root=tmp_path) == tmp_path / "unified" / "a" / "b"  # hybrid
    (tmp_path / "cgroup.controllers").touch()
    assert memory_dir(2, "/a/b", root=tmp_path) == tmp_path / "a" / "b"  # v2 only


def test_the_oom_kill_counter_of_either_version(tmp_path):
    assert keyed(OOM_CONTROL)["oom_kill"] == 1 and keyed(EVENTS) == {
        "low": 0, "high": 0, "max": 14, "oom": 1, "oom_kill": 1, "oom_group_kill": 0}
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "memory.oom_control").write_text(OOM_CONTROL)
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "memory.events").write_text(EVENTS.replace("oom_kill 1", "oom_kill 3"))
    assert (oom_kills(tmp_path / "v1"), oom_kills(tmp_path / "v2"), oom_kills(tmp_path / "none")) == (1, 3, None)


class Machine:
    """A /proc and a /sys/fs/cgroup of files, a run directory, and which pids live."""

    def __init__(self, tmp_path: Path):
        self.proc, self.cg = tmp_path / "proc", tmp_path / "cgroup"
        self.run = RunDir(tmp_path / "run")
        self.run.heartbeats.mkdir(parents=True)
        self.live: set[int] = set()
        self.vmstat(0)

    def vmstat(self, kills: int) -> None:
        self.proc.mkdir(parents=True, exist_ok=True)
        (self.proc / "vmstat").write_text(f"pgfault 12\noom_kill {kills}\n")

    def rank(self, rank: int, pid: int, group: str | None, state: str = "running") -> dict:
        hb = {"role": "train", "rank": rank, "pid": pid, "host": "n1", "state": state, "phase": "train", "step": 7}
        (self.run.heartbeats / f"train-{rank}.json").write_text(json.dumps(hb))
        (self.proc / str(pid)).mkdir(parents=True, exist_ok=True)
        (self.proc / str(pid) / "cgroup").write_text(f"4:memory:/{group}\n" if group else "1:cpu:/\n")
        self.live.add(pid)
        return hb

    def counter(self, group: str, kills: int) -> None:
        d = self.cg / "memory" / group
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")
        (d / "memory.limit_in_bytes").write_text(str(256 << 20))
        (d / "memory.max_usage_in_bytes").write_text(str(255 << 20))

    def watch(self) -> DeathWatch:
        return DeathWatch(self.run, proc=self.proc, cgroup_root=self.cg, alive=lambda hb: hb["pid"] in self.live)


def test_a_rank_gone_while_its_heartbeat_runs_is_named_with_its_cgroups_oom_kill(tmp_path):
    m = Machine(tmp_path)
    m.counter("step_0/task_1", 0)
    beats = [m.rank(0, 100, "step_0/task_0"), m.rank(1, 101, "step_0/task_1")]
    watch = m.watch()
    assert watch.look(beats) == []
    m.counter("step_0/task_1", 1)  # the kernel killed a process in rank 1's cgroup
    m.vmstat(1)
    m.live.discard(101)
    (died,) = watch.look(beats[:1])
    assert (died["rank"], died["rank_pid"], died["oom_killed"], died["cgroup_oom_kills"], died["node_oom_kills"]) == \
        (1, 101, True, 1, 1)
    assert died["memory_limit_bytes"] == 256 << 20 and died["memory_peak_bytes"] == 255 << 20
    assert events.read_events(m.run, events.RANK_DIED) == [died]
    assert watch.look(beats[:1]) == []  # said once


def test_a_kill_elsewhere_on_the_node_is_not_this_ranks_oom_when_its_cgroup_says_none(tmp_path):
    m = Machine(tmp_path)
    m.counter("task_1", 0)
    beats = [m.rank(0, 100, None), m.rank(1, 101, "task_1")]
    watch = m.watch()
    watch.look(beats)
    m.vmstat(1)  # another process of the node was OOM-killed
    m.live.discard(101)
    (died,) = watch.look(beats[:1])
    assert (died["oom_killed"], died["cgroup_oom_kills"], died["node_oom_kills"]) == (False, 0, 1)
    # Without a cgroup counter, the node's count is all there is: both kills since the agent first saw rank 0.
    m.live.discard(100)
    m.vmstat(2)
    (died,) = watch.look([])
    assert (died["rank"], died["oom_killed"], died["cgroup"], died["node_oom_kills"]) == (0, True, None, 2)


def test_a_look_while_the_killed_rank_exits_does_not_hide_the_kill(tmp_path):
    """Seen in CI: the agent looked while the OOM-killed rank was still freeing its memory (alive, the counters
    already grown, and, in cgroup v1, moved to the root cgroup on its way out); that look became the baseline
    and the kill read as +0."""
    m = Machine(tmp_path)
    m.counter("task_1", 0)
    m.counter("", 0)  # the root cgroup's own counter
    beats = [m.rank(0, 100, None), m.rank(1, 101, "task_1")]
    watch = m.watch()
    watch.look(beats)
    m.counter("task_1", 1)
    m.vmstat(1)
    (m.proc / "101" / "cgroup").write_text("4:memory:/\n")  # exiting: back in the root cgroup, still alive
    assert watch.look(beats) == []
    m.live.discard(101)
    (died,) = watch.look(beats[:1])
    assert (died["oom_killed"], died["cgroup_oom_kills"], died["node_oom_kills"]) == (True, 1, 1), died
    assert died["cgroup"].endswith("memory/task_1")


def test_a_rank_killed_in_its_cap_before_the_agent_saw_it_there_is_named_from_the_cap(tmp_path):
    """Seen in CI: a rank caps itself (rlslurm/memcap.py) after the agent's last look had found it in the node's own
    memory cgroup; the kernel killed it in its cap, whose count the agent never read: `rank_died` said no OOM."""
    m = Machine(tmp_path)
    m.counter("", 0)  # the cgroup the agent saw the rank in
    beats = [m.rank(0, 100, None), m.rank(1, 101, "")]
    watch = m.watch()
    watch.host = "n1"
    watch.look(beats)
    m.counter("rlslurm-rank-101", 1)  # its cap, made at its start: the kill is counted there alone
    events.emit(m.run, events.MEMORY_CAPPED, host="n1", pid=101, rank=1, capped=True, hbm_gb=0.1,
                cgroup=str(m.cg / "memory" / "rlslurm-rank-101"))
    m.live.discard(101)
    (died,) = watch.look(beats[:1])
    assert (died["rank_pid"], died["oom_killed"], died["cgroup_oom_kills"]) == (101, True, 1), died
    assert died["cgroup"].endswith("rlslurm-rank-101") and died["memory_limit_bytes"] == 256 << 20


def test_a_clean_end_and_the_agents_own_kill_are_not_deaths(tmp_path):
    m = Machine(tmp_path)
    beats = [m.rank(0, 100, None), m.rank(1, 101, None)]
    watch = m.watch()
    watch.look(beats)
    m.rank(0, 100, None, state="exited")  # its last heartbeat write, then its exit
    m.live -= {100, 101}
    watch.spared.add(101)  # a hang's kill by the agent: the hang_action event says so
    assert watch.look([]) == [] and events.read_events(m.run, events.RANK_DIED) == []


def test_a_capped_rank_that_died_between_two_looks_is_named_when_the_agent_leaves_on_its_dead_parent(tmp_path):
    """Seen in CI: a rank OOM-killed in its cap 0.5 s after its first heartbeat, between two looks, so no look saw it
    alive; the agent then left on its dead parent (rank 0) with no `rank_died` at all. Every exit of the watch
    ends with one last look at the run's capped ranks."""
    from rlslurm.diag.config import DiagConfig
    from rlslurm.diag.watchdog import Watchdog

    m = Machine(tmp_path)
    m.counter("rlslurm-rank-101", 0)
    cap = m.cg / "memory" / "rlslurm-rank-101"
    (cap / "cgroup.procs").write_text("101\n")
    events.emit(m.run, events.MEMORY_CAPPED, host="n1", pid=101, rank=1, capped=True, hbm_gb=0.1, cgroup=str(cap))
    parent = {"gone": False}

    def sleep(_s):  # between the first look and the second: the kernel kills the rank in its cap, rank 0 dies
        m.counter("rlslurm-rank-101", 1)
        (cap / "cgroup.procs").write_text("")
        parent["gone"] = True

    dog = Watchdog(m.run, DiagConfig(watch_interval_s=1), host="n1", sleep=sleep)
    dog.deaths = m.watch()
    dog.deaths.host = "n1"
    dog.parent_gone = lambda: parent["gone"]
    assert dog.watch() == 0
    (died,) = events.read_events(m.run, events.RANK_DIED)
    assert (died["rank"], died["rank_pid"], died["oom_killed"], died["cgroup_oom_kills"]) == (1, 101, True, 1), died
