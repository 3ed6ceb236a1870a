"""A real hang, caught by the real node agent: 2 gloo ranks in a loop of all_reduce under the phase guard.

One rank stalls in its "data" phase (a long sleep, or SIGSTOP) while the other waits in all_reduce;
the watchdog (a separate process from the ranks) must see it within timeout + 5 s, dump both stacks
with py-spy, name the stalled rank in a `hang_detected` event and carry out the policy.

This file is also the rank program: `python tests/integration/test_hang_watchdog.py RUN_DIR STALL_STEP`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from rlslurm.diag.bundle import collect
from rlslurm.diag.config import DiagConfig
from rlslurm.diag.heartbeat import read_heartbeats
from rlslurm.diag.watchdog import Watchdog
from rlslurm.events import read_events
from rlslurm.lifecycle import ExitCode
from rlslurm.rundir import RunDir

TIMEOUT_S = 3.0
CONFIG = DiagConfig(heartbeat_interval_s=0.2, hang_timeout_s=TIMEOUT_S, watch_interval_s=0.25,
                    kill_grace_s=2.0, hang_policy="requeue", stack_dump_timeout_s=10.0)


def rank_main(run_dir: str, stall_step: int) -> None:
    """The rank program: data phase (rank 1 may stall in it), then an all_reduce in the train phase."""
    import torch
    import torch.distributed as dist

    from rlslurm.diag.guard import PhaseGuard
    from rlslurm.dist import Topology, init_process_group

    topo = Topology.detect()
    init_process_group(topo, timeout_s=120, backend="gloo")
    run = RunDir(Path(run_dir))
    guard = PhaseGuard(run, "train", topo.rank, CONFIG, job_id="4242")
    with guard:
        for step in range(100_000):
            with guard.phase("data", step=step):
                x = torch.ones(1000) * (topo.rank + 1)
                if topo.rank == 1 and step == stall_step:
                    print(f"rank 1 stalls at step {step}", flush=True)
                    time.sleep(3600)  # the bug under test: a data loader that never returns
            with guard.phase("train", step=step):
                dist.all_reduce(x)
                guard.beat()
            time.sleep(0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ranks(run: RunDir, stall_step: int) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        env.pop("SLURMD_NODENAME", None)
        procs.append(subprocess.Popen([sys.executable, __file__, str(run.path), str(stall_step)], env=env,
                                      stdout=open(run.logs / f"train-{rank}.log", "w"), stderr=subprocess.STDOUT))
    return procs


def _wait_for_steps(run: RunDir, step: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = read_heartbeats(run)
        if len(beats) == 2 and all((b.get("step") or 0) >= step for b in beats):
            return
        time.sleep(0.1)
    raise AssertionError(f"ranks did not reach step {step} in {timeout_s} s: {read_heartbeats(run)}")


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


@pytest.fixture
def run(tmp_path):
    return RunDir(tmp_path / "run dir").create()


def test_stalled_data_phase_is_detected_dumped_and_requeued(run):
    procs = _start_ranks(run, stall_step=3)
    try:
        _wait_for_steps(run, 3)
        stalled_at = time.time()
        requeued: list[str] = []
        dog = Watchdog(run, CONFIG, requeue=lambda job: requeued.append(job) or f"recorded {job}")
        box = {}
        t = threading.Thread(target=lambda: box.update(code=dog.watch()))
        t.start()
        t.join(TIMEOUT_S + 25)
        assert not t.is_alive(), "watchdog did not act"
        assert box["code"] == ExitCode.HANG_DETECTED

        (hang,) = read_events(run, "hang_detected")
        assert hang["t"] - stalled_at <= TIMEOUT_S + 5, hang["t"] - stalled_at
        assert hang["stuck"] == ["train-1"] and hang["waiting"] == ["train-0"]
        assert hang["collective"] == "all_reduce"
        assert "train-1 in the data phase step 3" in hang["message"]
        assert "1 rank in all_reduce of train step" in hang["message"]
        stacks = {p.name: p.read_text() for p in Path(hang["stacks_dir"]).iterdir()}
        assert len(stacks) == 2
        rank0 = next(v for k, v in stacks.items() if k.endswith("train-0.txt"))
        rank1 = next(v for k, v in stacks.items() if k.endswith("train-1.txt"))
        assert "all_reduce" in rank0 and "rank_main" in rank1 and "all_reduce" not in rank1

        (action,) = read_events(run, "hang_action")
        assert requeued == ["4242"] and action["requeue"] == "recorded 4242"
        assert (run.control / "drain").read_text().startswith("hang detected")
        for p in procs:  # the wedged ranks were killed so the job's exit path runs
            assert p.wait(10) in (-signal.SIGTERM, -signal.SIGKILL)
    finally:
        _stop(procs)


def test_sigstopped_rank_detected_by_the_agent_process(run):
    procs = _start_ranks(run, stall_step=10**9)
    try:
        _wait_for_steps(run, 2)
        os.kill(procs[1].pid, signal.SIGSTOP)
        (run.path / "config.yaml").write_text(json.dumps({"diag": {
            "heartbeat_interval_s": 0.2, "hang_timeout_s": TIMEOUT_S, "watch_interval_s": 0.25,
            "hang_policy": "dump"}}))
        agent = subprocess.Popen([sys.executable, "-m", "rlslurm.diag.watchdog", "--run-dir", str(run.path)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + TIMEOUT_S + 20
        while not read_events(run, "hang_action") and time.monotonic() < deadline:
            time.sleep(0.2)
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=10)
        assert agent.returncode == 0, out
        (hang,) = read_events(run, "hang_detected")
        files = sorted(Path(hang["stacks_dir"]).iterdir())
        texts = [f.read_text() for f in files]
        evidence = f"{hang}\n--- agent\n{out}\n--- stacks\n" + "\n".join(texts)
        assert hang["stuck"] == ["train-1"] and hang["waiting"] == ["train-0"], evidence
        assert "process stopped (state T)" in hang["message"]
        assert "stopped (state T)" in texts[1] and "py-spy --nonblocking" in texts[1]
        assert "all_reduce" in texts[0]
        assert all(p.poll() is None for p in procs)  # policy dump: nobody killed
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        _stop(procs)


def test_a_stopped_rank_is_named_20_times_out_of_20_under_load(run):
    """The attribution of the SIGSTOP test, 20 times on the same two real ranks, with two CPU burners beside
    them: each round stops rank 1 at a random moment (in its data phase, in the all_reduce, in a heartbeat
    write), lets rank 0 block, and has the watchdog judge every rank as hung at once (its clock jumped past
    the timeout). The stopped rank must be the stuck one and its peer the waiting one every time: the process
    states are read in one look before any dump, so a dump taken a moment later cannot change the verdict."""
    import random

    procs = _start_ranks(run, stall_step=10**9)
    burners = [subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 300\n"
                                 "while time.time() < end: pass"]) for _ in range(2)]
    rng = random.Random(20)
    verdicts = []
    try:
        _wait_for_steps(run, 2)
        for round_ in range(20):
            time.sleep(rng.uniform(0.0, 0.05))
            os.kill(procs[1].pid, signal.SIGSTOP)
            try:
                time.sleep(0.5)  # rank 0 runs into the all_reduce that rank 1 no longer answers
                # Python frames only: native unwinding doubles a round's time and judges nothing more here.
                dog = Watchdog(run, dataclasses.replace(CONFIG, native_stacks=False),
                               clock=lambda: time.time() + 3600)
                watched = dog.watched()
                report = dog.report(watched, watched)
                verdicts.append((report.elsewhere, report.waiting))
                assert report.elsewhere == ["train-1"] and report.waiting == ["train-0"], (round_, report.message)
                assert report.collective == "all_reduce" and "process stopped (state T)" in report.message
            finally:
                os.kill(procs[1].pid, signal.SIGCONT)
            before = max(b.get("step") or 0 for b in read_heartbeats(run))
            _wait_for_steps(run, before + 1)
    finally:
        for p in burners:
            p.kill()
        _stop(procs)
    assert verdicts == [(["train-1"], ["train-0"])] * 20


def _toy_ranks(run: RunDir, env_extra: dict[str, str], diag: dict, world: int = 2) -> list[subprocess.Popen]:
    """jobs/toytrain.py as `world` local ranks with the faults of `env_extra`, its own config in the run."""
    (run.path / "config.yaml").write_text(json.dumps({
        "job": {"name": "toy", "kind": "toy"}, "train": {"steps": 1000},
        "checkpoint": {"interval_steps": 1000, "cost_s": 0.5},
        "diag": {"heartbeat_interval_s": 0.2, "hang_timeout_s": TIMEOUT_S, "watch_interval_s": 0.25,
                 "phase_timeouts_s": {"start": 120}, **diag}}))
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **env_extra}
        for key in ("SLURMD_NODENAME", "SLURM_JOB_ID", "RLSLURM_LEADER_JOB_ID"):
            env.pop(key, None)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "rlslurm.jobs.toytrain", "--run-dir", str(run.path), "--config", str(run.config)],
            env=env, stdout=open(run.logs / f"train-{rank}.log", "w"), stderr=subprocess.STDOUT))
    return procs


def _agent_acts(run: RunDir) -> tuple[dict, dict]:
    """Run the node agent until it acts on the hang (exit 76); the fault the toy injected and the hang it saw."""
    agent = subprocess.run([sys.executable, "-m", "rlslurm.diag.watchdog", "--run-dir", str(run.path),
                            "--parent-pid", "0"], capture_output=True, text=True, timeout=TIMEOUT_S + 90)
    assert agent.returncode == ExitCode.HANG_DETECTED, agent.stdout + agent.stderr
    (fault,) = read_events(run, "fault_injected")
    (hang,) = read_events(run, "hang_detected")
    return fault, hang


def test_toy_entrance_spinning_rank_is_caught_by_its_own_guard_and_both_ranks_are_ended(run):
    """jobs/toytrain.py wears the guard itself: a rank spinning in Python (RLSLURM_TEST_STALL=1@6:spin)
    is named with its phase and frame, its peer waits in DDP's gradient all-reduce, policy fail ends both."""
    from rlslurm.jobs.toytrain import STALL_ENV

    procs = _toy_ranks(run, {STALL_ENV: "1@6:spin"}, {"hang_policy": "fail", "kill_grace_s": 1.0})
    try:
        fault, hang = _agent_acts(run)
        assert hang["t"] - fault["t"] <= TIMEOUT_S + 5
        assert hang["stuck"] == ["train-1"] and hang["waiting"] == ["train-0"] and hang["collective"] == "all_reduce"
        assert "train-1 in the data phase step 6 at Faults.stall (" in hang["message"], hang["message"]
        for p in procs:
            assert p.wait(10) in (-signal.SIGTERM, -signal.SIGKILL)
    finally:
        _stop(procs)


def test_a_rank_that_skips_an_all_reduce_is_named_with_the_op_and_sequence_number(run):
    """The classic desync: rank 1 skips the loss all_reduce of step 5 (RLSLURM_TEST_SKIP_COLLECTIVE), its next
    collective meets rank 0's out of order and both hang, each inside a collective. Their stacks alone show two
    waiting ranks; the flight recorders the agent reads name rank 1, the all_reduce and its sequence number."""
    from rlslurm.jobs.toytrain import SKIP_ENV

    procs = _toy_ranks(run, {SKIP_ENV: "1@5"}, {"hang_policy": "fail", "kill_grace_s": 1.0})
    try:
        fault, hang = _agent_acts(run)
        evidence = f"{fault}\n{hang}"
        assert fault["fault"] == "skip_collective" and fault["seq"] > 1, evidence
        who = hang["attribution"]
        assert who["verdict"] == "skipped" and who["ranks"] == ["train-1"], evidence
        assert who["op"] == "all_reduce" and who["seq"] == fault["seq"], evidence
        assert f"train-1 skipped all_reduce #{fault['seq']}" in hang["message"], evidence
        assert hang["stuck"] == ["train-1"] and hang["waiting"] == ["train-0"], evidence
        records = json.loads(Path(hang["records"]).read_text())
        assert {r["rank"] for r in records["ranks"]} == {"train-0", "train-1"}
        for p in procs:
            assert p.wait(10) in (-signal.SIGTERM, -signal.SIGKILL)
        bundle = collect(run.path, out_dir=run.path.parent / "bundle", live=False, slurm=False)
        assert bundle.causes[0].kind == "desync", bundle.summary
        assert f"cause: collective desync: train-1 skipped all_reduce #{fault['seq']}" in bundle.summary
        with tarfile.open(bundle.path) as tar:
            names = [m.name.split("/", 1)[1] for m in tar.getmembers()]
        assert f"collectives/{Path(hang['stacks_dir']).name}/{hang['host']}.json" in names, names
    finally:
        _stop(procs)


if __name__ == "__main__":
    rank_main(sys.argv[1], int(sys.argv[2]))
