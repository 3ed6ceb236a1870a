"""Eight hostile programs through the real reward service (code scorer, sandbox) over HTTP: each is
contained with a defined score and reason, nothing escapes, and the service answers the next request."""

from __future__ import annotations

import socket
import time

import httpx
import psutil
import pytest

from rlslurm.reward.config import RewardConfig, SandboxConfig
from rlslurm.reward.supervisor import RewardSupervisor
from rlslurm.secret import bearer

SANDBOX = SandboxConfig(cpu_s=1, wall_s=3.0, mem_mb=256, nproc=16, output_kb=16)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    cfg = RewardConfig(scorer="code", concurrency=8, timeout_s=60, sandbox=SANDBOX, health_interval_s=0.5)
    with RewardSupervisor(cfg, log_dir=tmp_path_factory.mktemp("reward")) as sup:
        yield sup


def hostile_programs(port: int, target: str, service_pid: int) -> dict[str, tuple[str, str]]:
    """name -> (program, regex its reason must match)."""
    return {
        "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                      r"wall timeout|CPU limit"),
        "memory_bomb": ("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))\n", r"memory limit"),
        "infinite_loop": ("while True:\n    pass\n", r"CPU limit|wall timeout"),
        "sleep_forever": ("import time\ntime.sleep(10**6)\n", r"wall timeout"),
        "network": (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n",
                    r"Network is unreachable"),
        "write_outside": (f"open({target!r}, 'w').write('escaped')\n", r"FileNotFoundError|PermissionError"),
        "kill_parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                        f"os.kill({service_pid}, signal.SIGKILL)\n",
                        r"ProcessLookupError|PermissionError"),
        "stdout_flood": ("import sys\nline = 'x' * 2**20\nwhile True:\n    sys.stdout.write(line)\n",
                         r"printed more than 16 KiB"),
    }


def test_hostile_programs_are_contained(service, tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    tmp_path.chmod(0o777)  # writable by anyone on the host: only the sandbox may stop the write
    target = str(tmp_path / "escaped.txt")
    http = httpx.Client(base_url=service.url, timeout=120, headers=bearer(service.token))
    pid_before = http.get("/health").json()["pid"]
    programs = hostile_programs(listener.getsockname()[1], target, pid_before)
    items = [{"id": name, "response": f"```python\n{code}```", "tests": "print('tests ran')"}
             for name, (code, _) in programs.items()]

    start = time.monotonic()
    results = {r["id"]: r for r in http.post("/score", json={"items": items}).json()["results"]}
    wall_s = time.monotonic() - start

    for name, (_, reason) in programs.items():
        r = results[name]
        assert (r["status"], r["score"]) == ("scored", 0.0), (name, r)
        assert __import__("re").search(reason, r["reason"]), (name, r["reason"])
    assert wall_s < 30, wall_s  # 8 programs on min(8, cores) slots, none past its 3 s wall limit
    with pytest.raises(TimeoutError):
        listener.accept()
    assert not (tmp_path / "escaped.txt").exists()
    # Nothing of the slot uids lives on: the pid namespace took every leftover down with the program.
    assert [p.info for p in psutil.process_iter(["pid", "uids", "name"])
            if p.info["uids"] and p.info["uids"].real >= SANDBOX.uid_base] == []

    # Still the same process, and it answers the next request.
    assert http.get("/health").json()["pid"] == pid_before and service.restarts == 0
    good = {"id": "good", "response": "def add(a, b):\n    return a + b\n", "tests": "assert add(2, 3) == 5"}
    bad = {"id": "bad", "response": "def add(a, b):\n    return a - b\n", "tests": "assert add(2, 3) == 5"}
    after = http.post("/score", json={"items": [good, bad]}).json()["results"]
    assert [r["score"] for r in after] == [1.0, 0.0]
    assert "AssertionError" in after[1]["reason"]
    metrics = http.get("/metrics").text
    assert 'rlslurm_reward_items_total{status="scored"} 10' in metrics
    assert 'rlslurm_reward_sandbox_total{status="timeout"}' in metrics


def test_an_early_exit_zero_is_not_a_pass(service):
    """A program that leaves with status 0 before its tests run (the reward hack exit 0 invites) scores 0."""
    http = httpx.Client(base_url=service.url, timeout=120, headers=bearer(service.token))
    failing = "assert add(2, 3) == 5"
    items = [{"id": "os_exit", "response": "import os\ndef add(a, b):\n    return 0\nos._exit(0)\n", "tests": failing},
             {"id": "sys_exit", "response": "import sys\ndef add(a, b):\n    return 0\nsys.exit(0)\n",
              "tests": failing},
             {"id": "prints_ok", "response": "def add(a, b):\n    return 0\nprint('ok')\nraise SystemExit\n",
              "tests": failing},
             {"id": "honest", "response": "def add(a, b):\n    return a + b\nprint('done')\n", "tests": failing}]
    results = {r["id"]: r for r in http.post("/score", json={"items": items}).json()["results"]}
    for name in ("os_exit", "sys_exit", "prints_ok"):
        assert results[name]["score"] == 0.0, results[name]
        assert "exited before the tests finished" in results[name]["reason"], results[name]
    assert results["honest"]["score"] == 1.0, results["honest"]
