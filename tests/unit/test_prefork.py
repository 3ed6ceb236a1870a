"""rlslurm/prefork.py: a module run as a fork of a process that imported torch, with a fresh interpreter's state
(environment, stdio, signal handlers, logging, atexit), ended as the interpreter ends; rank 0's planted copy grown
into a module run, or gone when nothing grows it. Each case forks in a Python process of its own (pytest's worker
runs threads: plant() refuses to fork there)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlslurm import prefork

# A module the forks run: what it saw of its process, written where its argv says.
PROBE = '''
import atexit, json, logging, os, signal, sys, threading, time
out, how = sys.argv[1], sys.argv[2]
seen = {"argv": sys.argv[1:], "argv0": sys.argv[0], "env": os.environ.get("PROBE_ENV"), "pid": os.getpid(),
        "ppid": os.getppid(),
        "root_handlers": len(logging.getLogger().handlers), "torch_loaded": "torch" in sys.modules,
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "preforked": os.environ.get("RLSLURM_PREFORKED"), "cmdline": open("/proc/self/cmdline", "rb").read()
        .rstrip(b"\\0").decode()}
print("to stdout", flush=False)
print("to stderr", file=sys.stderr)
def late():
    time.sleep(0.3)
    with open(out + ".thread", "w") as f:
        f.write("joined")
threading.Thread(target=late).start()  # not a daemon: the interpreter's end waits for it
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
with open(out, "w") as f:
    json.dump(seen, f)
if how == "exit3":
    sys.exit(3)
if how == "raise":
    raise RuntimeError("the probe's own error")
if how == "hang":
    time.sleep(60)
'''


def _script(tmp_path: Path, body: str) -> dict:
    """Run `body` in a fresh Python that imported prefork (and torch, as the supervisor does); its last stdout line
    is JSON."""
    (tmp_path / "probe_mod.py").write_text(PROBE)
    code = textwrap.dedent("""
        import atexit, json, logging, os, signal, sys
        sys.path.insert(0, sys.argv[1])
        from pathlib import Path
        from rlslurm import prefork
        prefork.ready_titles()
        tmp = Path(sys.argv[1])
        logging.basicConfig(filename=str(tmp / "parent.log"), level=logging.INFO)
        signal.signal(signal.SIGTERM, lambda *a: None)
        atexit.register(lambda: open(tmp / "parent-atexit", "a").write("x"))
        prefork.preload({})
    """) + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_forked_module_starts_with_torch_and_a_fresh_interpreters_state(tmp_path):
    result = _script(tmp_path, """
        env = {**os.environ, "PROBE_ENV": "given", "PYTHONPATH": str(tmp)}
        with open(tmp / "out.log", "a") as out, open(tmp / "err.log", "a") as err:
            codes = {}
            for how in ("ok", "exit3", "raise"):
                task = prefork.fork_module("probe_mod", [str(tmp / f"{how}.json"), how], env, out, err)
                codes[how] = task.wait(60)
            hang = prefork.fork_module("probe_mod", [str(tmp / "hang.json"), "hang"], env, out, err)
            import subprocess, time
            try:
                hang.wait(0.5)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            hang.kill()
            codes["hang"] = hang.wait(10)
            hang.kill()  # after its end: nothing, no error
        print(json.dumps({"codes": codes, "timed_out": timed_out, "parent": os.getpid()}))
    """)
    assert result["codes"] == {"ok": 0, "exit3": 3, "raise": 1, "hang": -signal.SIGKILL} and result["timed_out"]
    seen = json.loads((tmp_path / "ok.json").read_text())
    assert seen["argv"] == [str(tmp_path / "ok.json"), "ok"] and seen["env"] == "given"
    assert seen["argv0"] == str(tmp_path / "probe_mod.py")  # as `python -m probe_mod` sets it
    assert seen["ppid"] == result["parent"] and seen["torch_loaded"] and seen["preforked"] == "1"
    # The parent's logging, SIGTERM handler and atexit handlers are not the child's; its own ran, after its thread.
    assert seen["root_handlers"] == 0 and seen["sigterm_default"]
    assert (tmp_path / "ok.json.atexit").read_text() == "ran" and (tmp_path / "ok.json.thread").read_text() == "joined"
    assert (tmp_path / "parent-atexit").read_text() == "x"  # the parent's ran once: its own exit
    assert "probe_mod" not in (tmp_path / "parent.log").read_text()
    # ps shows the command the fork stands for.
    assert seen["cmdline"] == f"{sys.executable} -u -m probe_mod {tmp_path / 'ok.json'} ok"
    out, err = (tmp_path / "out.log").read_text(), (tmp_path / "err.log").read_text()
    assert out.count("to stdout") == 4 and "to stderr" not in out
    assert err.count("to stderr") == 4 and "RuntimeError: the probe's own error" in err
    assert err.count(f"runs probe_mod, forked from pid {result['parent']} with torch, transformers") == 4


def test_a_planted_copy_grows_into_the_module_it_is_handed_or_exits_when_discarded(tmp_path):
    result = _script(tmp_path, """
        os.environ["RLSLURM_PREFORKED"] = "1"
        assert prefork.plant() and not prefork.plant()  # one at a time
        env = {**os.environ, "PROBE_ENV": "handed", "PYTHONPATH": str(tmp)}
        proc = prefork.grow("probe_mod", [str(tmp / "grown.json"), "ok"], env, str(tmp / "engine.log"))
        code = proc.wait(60)
        assert prefork.grow("probe_mod", [], env, str(tmp / "x.log")) is None  # one use
        assert prefork.plant()
        import psutil
        seed = psutil.Process().children()[0]
        title = " ".join(seed.cmdline())
        prefork.discard()
        print(json.dumps({"code": code, "parent": os.getpid(), "seed_gone": not seed.is_running(), "title": title}))
    """)
    assert result["code"] == 0 and result["seed_gone"]
    assert f"rlslurm.prefork --planted-by {result['parent']} --run-dir" in result["title"]
    seen = json.loads((tmp_path / "grown.json").read_text())
    assert seen["env"] == "handed" and seen["ppid"] == result["parent"] and seen["torch_loaded"]
    log = (tmp_path / "engine.log").read_text()
    assert "to stdout" in log and "to stderr" in log


def test_a_planted_copy_ends_with_its_parent_and_none_is_planted_where_threads_run(tmp_path):
    result = _script(tmp_path, """
        import threading, time
        os.environ["RLSLURM_PREFORKED"] = "1"
        rank = os.fork()
        if rank == 0:  # a rank that plants, then dies without growing or discarding it
            prefork.plant()
            import psutil
            open(tmp / "seed.pid", "w").write(str(psutil.Process().children()[0].pid))
            os._exit(0)
        os.waitpid(rank, 0)
        seed = int(open(tmp / "seed.pid").read())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{seed}") and \\
                open(f"/proc/{seed}/stat").read().split(")")[1].split()[0] != "Z":
            time.sleep(0.05)
        gone = not os.path.exists(f"/proc/{seed}") or open(f"/proc/{seed}/stat").read().split(")")[1].split()[0] == "Z"
        threading.Thread(target=time.sleep, args=(2,), daemon=True).start()
        print(json.dumps({"gone": gone, "planted_with_threads": prefork.plant()}))
    """)
    assert result["gone"] and result["planted_with_threads"] is False


def test_nothing_is_planted_outside_a_preforked_rank(monkeypatch):
    monkeypatch.delenv(prefork.PREFORKED_ENV, raising=False)
    assert prefork.plant() is False and prefork.grow("m", [], {}, "/dev/null") is None
    prefork.discard()  # nothing planted: nothing to do


@pytest.mark.parametrize("command, expected", [
    (["/v/bin/python", "-u", "-m", "submitit.core._submit", "/r/logs/submitit"],
     ("submitit.core._submit", ["/r/logs/submitit"])),
    (["/v/bin/python", "-m", "x"], None),
    (["bash", "-c", "echo"], None),
])
def test_the_supervisor_forks_only_submitits_module_command(command, expected):
    from rlslurm.local_supervisor import module_command

    assert module_command(command) == expected


def test_the_engines_wait_policy_is_in_the_supervisors_environment_before_torch_loads():
    import dataclasses
    import types

    from rlslurm.config import JobConfig
    from rlslurm.rl.engines import preload_env

    job = JobConfig()
    rl = dataclasses.replace(job, job=dataclasses.replace(job.job, kind="rl"))
    layout = types.SimpleNamespace(train_tasks_per_node=2, engines=1, engines_from_component=False)
    passive = "OMP_WAIT_POLICY" not in os.environ and len(os.sched_getaffinity(0)) >= 2
    expect = {"OMP_WAIT_POLICY": "PASSIVE"} if passive else {}
    in_turn = dataclasses.replace(rl, rl=dataclasses.replace(rl.rl, max_staleness=0))
    assert preload_env(in_turn, layout) == expect  # every core for the engine while the ranks wait
    sft = dataclasses.replace(job, job=dataclasses.replace(job.job, kind="sft"))
    assert preload_env(sft, layout) == {}
    assert preload_env(rl, types.SimpleNamespace(**{**vars(layout), "engines_from_component": True})) == {}
