"""The trainer's torch stores (issue 29): the rendezvous of MASTER_ADDR:MASTER_PORT (rlslurm/dist.py) and the
weight-broadcast group's (rlslurm/sync/broadcast.py) bind the job's address only and admit only a process that
proves the job's secret (rlslurm/jobstore.py). A stranger's torch store client, a wrong secret and raw bytes are
refused before any key is read or written, while the job's real ranks rendezvous and run a collective; a local
RL run has no listener on every interface (`*`, 0.0.0.0, [::]). Issue 37: a stranger holding every handshake
slot with trickling connections delays no job client, has each connection closed within the handshake's
deadline, and a client turned away for load says so and retries within its own deadline."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from rl_runs import ROOT, WAIT_S
from rlslurm import jobstore, launch, secret
from rlslurm.config import load_config
from rlslurm.dist import free_port
from rlslurm.jobstore import JobStore, StoreAuthError, StoreServer
from rlslurm.sync.broadcast import BroadcastGroup

WILDCARD = {"0.0.0.0", "::", ""}

RANK = """
import gc, sys, time, torch, torch.distributed as dist
from rlslurm.dist import Topology, init_process_group
rank, port, hold_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
if rank == 1:
    time.sleep(hold_s)  # rank 0's store stands alone meanwhile: the stranger's window
started = time.monotonic()
init_process_group(Topology(rank, 2, rank, "127.0.0.1", port), timeout_s=60, backend="gloo")
joined = time.monotonic() - started
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
gc.collect()  # a group made later still reaches the store (rlslurm/dist.py holds it)
started = time.monotonic()
group = dist.new_group([0, 1])
made = time.monotonic() - started
dist.all_reduce(t, group=group)
print(f"RESULT {rank} {t.item()} {joined:.4f} {made:.4f}", flush=True)
dist.barrier()
"""


def listeners(pid: int, port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def stranger_refused(host: str, port: int, wrong_token: str = "not-the-job-secret") -> None:
    """Every way in without the job's secret fails, and none of them reads or writes a key."""
    with pytest.raises((RuntimeError, ConnectionError, OSError)):  # torch's own client: no credential to offer
        stranger = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=3))
        stranger.num_keys()
        stranger.set("stranger", "was here")
    with pytest.raises(StoreAuthError):
        JobStore(host, port, wrong_token, datetime.timedelta(seconds=3))
    with socket.create_connection((host, port), timeout=5) as raw:  # a forged request instead of the proof
        raw.settimeout(15)
        assert raw.recv(36)[:4] == b"RLSS"
        raw.sendall(b"\x00" * 64 + b"\x00\x00\x00\x0d\x00\x00\x00\x00\x02")
        leftover = b""
        try:
            while chunk := raw.recv(1024):
                leftover += chunk
        except ConnectionResetError:
            pass
        assert leftover == b"", leftover  # closed with no answer: no key served


def test_a_stranger_cannot_join_the_rendezvous_while_the_jobs_ranks_run_a_collective(tmp_path):
    secret_file = secret.ensure(tmp_path / "secret")
    port = free_port()
    env = {**os.environ, secret.ENV_VAR: str(secret_file), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port), "8"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    try:
        deadline = time.monotonic() + 30
        while not listeners(ranks[0].pid, port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert listeners(ranks[0].pid, port) == ["127.0.0.1"], "the rendezvous listens on MASTER_ADDR only"
        stranger_refused("127.0.0.1", port)
        outs = [p.communicate(timeout=90)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    results = [line.split() for out in outs for line in out.splitlines() if line.startswith("RESULT")]
    assert sorted((r[1], r[2]) for r in results) == [("0", "6.0"), ("1", "6.0")], outs


def test_a_stranger_cannot_take_a_rank_in_the_weight_broadcast_group():
    token = "the-jobs-secret"
    port = free_port()
    host: dict = {}

    def trainer():
        host["group"] = BroadcastGroup.join("127.0.0.1", port, 0, 2, 30.0, token=token)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not listeners(os.getpid(), port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listeners(os.getpid(), port) == ["127.0.0.1"]
    stranger_refused("127.0.0.1", port)
    engine = BroadcastGroup.join("127.0.0.1", port, 1, 2, 30.0, token=token)  # the job's engine still joins
    thread.join(30)
    sent, received = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    work = host["group"].broadcast_async(sent)
    engine.broadcast(received)
    work.wait()
    assert torch.equal(sent, received)


class Trickling:
    """`count` stranger connections to a store, each sending one byte of a never-finished handshake per
    `interval_s` (under the old per-read timeout of 10 s); `closed()` counts those the store has shut."""

    def __init__(self, port: int, count: int, interval_s: float = 1.0):
        self.socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]
        self.stop, self.interval_s = threading.Event(), interval_s
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            for sock in self.socks:
                try:
                    sock.send(b"x")
                except OSError:
                    pass

    def closed(self) -> int:
        shut = 0
        for sock in self.socks:
            sock.setblocking(False)
            try:
                while chunk := sock.recv(4096):  # the challenge (or BUSY), then the end
                    del chunk
                shut += 1
            except BlockingIOError:
                pass
            except OSError:
                shut += 1
        return shut

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for sock in self.socks:
            sock.close()


def test_a_stranger_holding_every_handshake_slot_delays_no_job_client():
    server = StoreServer("127.0.0.1", 0, "the-jobs-secret")
    stranger = Trickling(server.port, jobstore.MAX_PENDING_HANDSHAKES)
    try:
        time.sleep(jobstore.HANDSHAKE_GRACE_S + 0.5)  # every slot taken, by connections past their grace
        admitted = []
        for i in range(8):
            started = time.monotonic()
            store = JobStore("127.0.0.1", server.port, "the-jobs-secret", datetime.timedelta(seconds=30))
            store.set(f"k{i}", f"v{i}")
            assert store.get(f"k{i}") == f"v{i}".encode()
            admitted.append(time.monotonic() - started)
            store.close()
        deadline = stranger_start = time.monotonic()
        deadline += jobstore.HANDSHAKE_TIMEOUT_S + 5
        while stranger.closed() < len(stranger.socks) and time.monotonic() < deadline:
            time.sleep(0.25)
        shut_s = time.monotonic() - stranger_start
        shut = stranger.closed()
    finally:
        stranger.close()
        server.close()
    print(f"FIGURE store_jam: {len(stranger.socks)} trickling stranger connections; 8 job clients admitted in "
          f"{max(admitted) * 1000:.1f} ms at most; the stranger's connections all shut {shut_s:.1f} s later "
          f"({server.evicted} closed to make room), load {os.getloadavg()[0]:.2f}")
    assert max(admitted) < 2.0, admitted
    assert shut == len(stranger.socks), f"{shut} of the stranger's connections shut by the handshake's deadline"


def test_a_client_turned_away_for_load_says_so_and_retries_within_its_deadline(monkeypatch):
    monkeypatch.setattr(jobstore, "MAX_PENDING_HANDSHAKES", 2)
    monkeypatch.setattr(jobstore, "HANDSHAKE_GRACE_S", 60.0)  # the stranger's connections are never old enough
    server = StoreServer("127.0.0.1", 0, "the-jobs-secret")
    stranger = Trickling(server.port, 2)
    try:
        with pytest.raises(RuntimeError, match="did not admit this process within 2 s: .* turned away") as refused:
            JobStore("127.0.0.1", server.port, "the-jobs-secret", datetime.timedelta(seconds=2))
        assert not isinstance(refused.value, StoreAuthError) and server.busy >= 1
        threading.Timer(1.0, stranger.close).start()  # the load goes away while the next client retries
        store = JobStore("127.0.0.1", server.port, "the-jobs-secret", datetime.timedelta(seconds=20))
        store.set("k", "v")
        assert store.get("k") == b"v"
        store.close()
        with pytest.raises(StoreAuthError):  # a wrong secret is still an auth error, at once
            JobStore("127.0.0.1", server.port, "another-secret", datetime.timedelta(seconds=20))
    finally:
        stranger.close()
        server.close()


def time_init(port: int, env: dict) -> tuple[float, float]:
    """(init_process_group, new_group) seconds of the slower of 2 ranks."""
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port), "0"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in ranks]
    lines = [line.split() for out in outs for line in out.splitlines() if line.startswith("RESULT")]
    assert len(lines) == 2, outs
    return max(float(r[3]) for r in lines), max(float(r[4]) for r in lines)


def test_what_the_authenticated_rendezvous_costs(tmp_path):
    """init_process_group of 2 gloo ranks, with the job's secret (rlslurm's store) and without one (torch's
    TCPStore bound to 127.0.0.1, the fallback of a process that has no secret): a FIGURE, not a bound."""
    base = {k: v for k, v in os.environ.items() if k not in (secret.ENV_VAR, "RLSLURM_RUN_DIR")}
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with_secret = {**base, secret.ENV_VAR: str(secret.ensure(tmp_path / "secret"))}
    timings = {"secret": [], "torch": []}
    for _ in range(3):
        timings["secret"].append(time_init(free_port(), with_secret))
        timings["torch"].append(time_init(free_port(), base))

    def median(kind: str, i: int) -> float:
        return sorted(t[i] for t in timings[kind])[1]

    print("FIGURE rendezvous: 2 gloo ranks, slowest rank, median of 3 (shared machine): init_process_group "
          f"job store {median('secret', 0):.3f} s, torch TCPStore {median('torch', 0):.3f} s; new_group job store "
          f"{median('secret', 1) * 1000:.1f} ms, torch TCPStore {median('torch', 1) * 1000:.1f} ms")


def test_a_local_rl_run_listens_on_no_wildcard_address(tmp_path):
    """examples/tiny-grpo.yaml, 2 trainer ranks and broadcast sync, a few steps: every TCP listener of the
    run's processes, sampled while it runs, is on a named address (127.0.0.1 here), none on every interface."""
    path = ROOT / "examples" / "tiny-grpo.yaml"
    job = load_config(path, ("train.steps=3", "rl.eval_every=100", "checkpoint.interval_steps=100",
                             "sync.method=broadcast", "rl.prompts_per_step=16"))
    seen: dict[tuple[str, int], str] = {}
    sub = launch.submit(job, config_text=path.read_text(), backend="local", run_root=tmp_path)
    done = threading.Event()

    def sample():
        while not done.is_set():
            try:
                family = psutil.Process().children(recursive=True)
            except psutil.Error:
                continue
            for proc in family:
                try:
                    for c in proc.net_connections(kind="inet"):
                        if c.status == psutil.CONN_LISTEN:
                            seen[(c.laddr.ip, c.laddr.port)] = " ".join(proc.cmdline()[:4])
                except psutil.Error:
                    pass
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        results = launch.wait(sub, timeout_s=WAIT_S, poll_s=0.5)
    finally:
        done.set()
        sampler.join(10)
    assert [int(code) for code in results] == [0] * len(results), f"the run ended {results}; see {sub.run_dir}"
    print(f"FIGURE local_rl_listeners: {sorted(seen.items())}")
    assert len(seen) >= 3, seen  # the engine, the reward service, the rendezvous and broadcast stores
    wildcard = {addr: who for addr, who in seen.items() if addr[0] in WILDCARD}
    assert not wildcard, f"listening on every interface: {wildcard}"
