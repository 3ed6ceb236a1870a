"""The diag bundle: everything needed to say why a job died or hung, in one redacted .tar.gz.

    bundle = collect("runs/rl-demo-20250101", out_dir=Path("."))     # or a SLURM job id + run_root
    print(bundle.summary)                                           # names the most likely cause

Contents (under diag-<run>-<stamp>/): summary.txt/.json; slurm/ (scontrol show job, sacct, sacct -c);
run/ (config.yaml, plan.json, layout.json, jobs.jsonl, submissions.jsonl, placement.jsonl, events.jsonl,
metrics tail, rendered sbatch scripts); heartbeats.txt + heartbeats/; env/ fingerprints + env-diff.txt;
stacks/ (dumps of hangs, faulthandler files, and a live py-spy dump of every process still running: on
this host directly, on a running job's nodes through `srun --overlap` into the job); collectives/ (every
rank's flight-recorder records and each GPU node's nvidia-smi snapshot, as the node agents took them on a
hang: diag/collectives.py, diag/nvidia_smi.py); gpu/ (nvidia-smi of this host, where it has GPUs); logs/
(the tail of each log); checkpoints.txt.

Redaction, everywhere, before anything is written: values of keys whose name contains TOKEN, KEY,
SECRET, PASSWORD (any case) in config, env and JSON; `NAME=value` / `name: value` with such names in
any text; common token shapes (hf_, sk-, ghp_/github_pat_, AKIA/ASIA, Bearer, xox?-, JWTs, private
key blocks, passwords in URLs); and every secret value learned from a key name is then removed from
all other text too (a token pasted into a log line without its name), as is the job's own secret
(<run>/secret, which itself is never collected).
"""

from __future__ import annotations

import io
import json
import re
import shlex
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlslurm.diag import nvidia_smi, summary as summ
from rlslurm.diag.collectives import records_dir
from rlslurm.diag.env_diff import compare, read_fingerprints
from rlslurm.diag.heartbeat import pid_alive, read_heartbeats, table
from rlslurm.diag.stack_dump import dump_stack, py_spy_binary
from rlslurm.errors import RlslurmError, SlurmParseError
from rlslurm.layout import JobLayout
from rlslurm.node import node_name
from rlslurm.outfile import replacing
from rlslurm.rundir import RunDir, find_run, read_jsonl, submitted_backend
from rlslurm.slurm import commands, parse

REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"token|key|secret|passw(or)?d|credential", re.IGNORECASE)
_ASSIGNMENT = re.compile(
    r"""(?ix)\b([a-z0-9_.-]*(?:token|key|secret|passw(?:or)?d|credential)[a-z0-9_.-]*)  # the name
        (["']?\s*[:=]\s*["']?)                                                          # = or :
        ([^\s"',}\]]+)""")
_SHAPES = [re.compile(p, f) for p, f in (
    (r"\bhf_[A-Za-z0-9]{16,}", 0),
    (r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{16,}", 0),
    (r"\bgh[pousr]_[A-Za-z0-9]{20,}", 0),
    (r"\bgithub_pat_[A-Za-z0-9_]{20,}", 0),
    (r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", 0),
    (r"\bBearer\s+[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE),
    (r"\bxox[abprs]-[A-Za-z0-9-]{10,}", 0),
    (r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}", 0),
    (r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.DOTALL),
)]
_URL_PASSWORD = re.compile(r"(://[^/\s:@]+:)[^@\s/]+@")


def _worth_learning(value: str) -> bool:
    # Replacing a learned value everywhere is only safe for values that cannot be ordinary words:
    # `sort_keys=False` in a traceback must not turn every False of the bundle into <redacted>.
    return len(value) >= 8 and not value.isalpha() and not value.isdigit() and REDACTED not in value


class Redactor:
    """Learns secret values from named keys, then scrubs structures and free text."""

    def __init__(self):
        self.secrets: set[str] = set()

    def learn(self, obj: Any, name: str = "") -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                self.learn(v, str(k))
        elif isinstance(obj, list):
            for v in obj:
                self.learn(v, name)
        elif isinstance(obj, str) and _SECRET_NAME.search(name) and _worth_learning(obj):
            self.secrets.add(obj)

    def learn_text(self, text: str) -> None:
        for m in _ASSIGNMENT.finditer(text):
            if _worth_learning(m.group(3)):
                self.secrets.add(m.group(3))

    def structure(self, obj: Any, name: str = "") -> Any:
        if isinstance(obj, dict):
            return {k: self.structure(v, str(k)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.structure(v, name) for v in obj]
        if isinstance(obj, str):
            return REDACTED if _SECRET_NAME.search(name) and obj else self.text(obj)
        return obj

    def text(self, text: str) -> str:
        for secret in sorted(self.secrets, key=len, reverse=True):
            text = text.replace(secret, REDACTED)
        text = _ASSIGNMENT.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)
        for shape in _SHAPES:
            text = shape.sub(REDACTED, text)
        return _URL_PASSWORD.sub(r"\1" + REDACTED + "@", text)


@dataclass
class Bundle:
    path: Path
    summary: str
    causes: list[summ.Cause]


def slurm_facts(job_id: str | None) -> tuple[dict[str, str], str | None]:
    """SLURM's reports on the job as it printed them (commands.JOB_REPORTS: scontrol show job, sacct,
    sacct -c), and the job's state from the first that answered; tolerant of no SLURM."""
    if not job_id:
        return {"slurm.txt": "no SLURM job id recorded for this run (a local run: SLURM was not asked)\n"}, None
    texts, state = {}, None
    for kind in commands.JOB_REPORTS:
        try:
            done = commands.job_report(kind, job_id)
        except (RlslurmError, OSError) as e:  # not installed, no answer
            texts[f"{kind}.txt"] = f"failed: {e}\n"
            continue
        texts[f"{kind}.txt"] = f"$ {shlex.join(done.argv)}\n# exit {done.returncode}\n{done.stdout}{done.stderr}"
        if done.returncode == 0 and state is None:
            state = _state_of(kind, done.stdout)
    return texts, state


def _state_of(name: str, out: str) -> str | None:
    """The job state in one report's stdout (`name` starts with its kind); None where it says none."""
    try:
        return parse.job_state(parse.scontrol_show(out) if name.startswith("scontrol") else parse.parsable2(out))
    except SlurmParseError:
        return None


def _tail(path: Path, lines: int) -> str:
    with open(path, "rb") as f:  # read only the end of a long log
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - lines * 400))
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:]) + "\n"


def _checkpoints(run: RunDir) -> str:
    if not run.checkpoints.is_dir():
        return "no checkpoints directory\n"
    rows = []
    for d in sorted(run.checkpoints.iterdir()):
        if d.is_dir():
            size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            complete = "complete" if (d / "manifest.json").is_file() else "INCOMPLETE (no manifest)"
            rows.append(f"{d.name:<28} {size / 1e6:>10.1f} MB  {complete}")
        else:
            rows.append(f"{d.name:<28} -> {d.read_text(errors='replace').strip()[:200]}")
    return "\n".join(rows or ["no checkpoints"]) + "\n"


def live_dumps(beats: list[dict], job_id: str | None, native: bool = True) -> dict[str, str]:
    """heartbeat name -> stack dump of each process whose heartbeat says running: on this host by
    dump_stack, on a node of the running SLURM job `job_id` by py-spy in an `srun --overlap` step of the
    job (SLURM's own way onto its nodes: a login node often has no ssh into them, and --overlap leaves
    the job's CPUs with it). py-spy is looked up where it is here (the shared venv), else on the PATH."""
    out = {}
    nodes = _job_nodes(job_id) if job_id else {}
    for hb in beats:
        if hb.get("state") != "running":
            continue
        name = hb["file"][:-5]
        if hb.get("host") == node_name():
            if pid_alive(hb):
                d = dump_stack(int(hb["pid"]), native=native, timeout_s=20)
                out[name] = f"# live dump of pid {hb['pid']} by {d.method}, process {d.state}\n{d.text}"
        elif hb.get("host") in nodes:
            out[name] = _srun_dump(job_id, hb["host"], nodes[hb["host"]], int(hb["pid"]), native)
    return out


def _job_nodes(job_id: str) -> dict[str, int | None]:
    """node -> het group (None: not a het job) of the job's running components, from scontrol."""
    try:
        records = commands.show_job(job_id)
    except RlslurmError:
        return {}
    return {node: int(r["HetJobOffset"]) if "HetJobOffset" in r else None
            for r in records if r.get("JobState") == "RUNNING" and r.get("NodeList") not in (None, "(null)")
            for node in parse.expand_nodelist(r["NodeList"])}


def _srun_dump(job_id: str, node: str, group: int | None, pid: int, native: bool) -> str:
    binary = py_spy_binary() or "py-spy"
    tried = []
    # As dump_stack: native frames first; a stopped process (state T) only without pausing it.
    for extra in ([["--native"]] if native else []) + [[], ["--nonblocking"]]:
        try:
            done = commands.srun_overlap(job_id, [binary, "dump", "--pid", str(pid), *extra], node=node,
                                         het_group=group, timeout_s=40)
        except RlslurmError as e:
            tried.append(str(e))
            break
        how = f"py-spy {' '.join(extra)}".strip()
        if done.returncode == 0 and "Thread" in done.stdout:
            return (f"# live dump of pid {pid} on {node} by {how} in `srun --overlap` (job {job_id}"
                    f"{'' if group is None else f', het group {group}'})\n{done.stdout}")
        err = (done.stderr or done.stdout).strip().splitlines()
        tried.append(f"{how} exit {done.returncode}: {err[-1] if err else ''}")
    return f"# no live dump of pid {pid} on {node}: " + "; ".join(tried) + "\n"


def collect(target: str | Path, *, run_root: Path | None = None, out_dir: Path | None = None,
            live: bool = True, slurm: bool = True, log_tail_lines: int = 200, native: bool = True) -> Bundle:
    """Collect, redact and summarise one run into <out_dir>/diag-<run>-<stamp>.tar.gz."""
    run, job_id = find_run(target, run_root)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    top = f"diag-{run.path.name.replace(' ', '_')}-{stamp}"
    files: dict[str, str] = {}
    red = Redactor()
    if run.secret.is_file():  # the job's own secret (rlslurm/secret.py): scrubbed wherever it shows up
        red.secrets.update(line for line in [run.secret.read_text(errors="replace").strip()] if line)

    config = yaml.safe_load(run.config.read_text()) if run.config.is_file() else None
    fps = read_fingerprints(run.env) if run.env.is_dir() else {}
    red.learn(config)
    red.learn(fps)
    for p in (run.events, run.jobs):
        red.learn(read_jsonl(p))
    logs = {str(p.relative_to(run.logs)): _tail(p, log_tail_lines)
            for p in sorted(run.logs.rglob("*")) if run.logs.is_dir() and p.is_file()}
    for text in logs.values():
        red.learn_text(text)

    local = submitted_backend(run) == "local"
    slurm_job = None if local else job_id
    slurm_texts, state = slurm_facts(slurm_job) if slurm else ({"slurm.txt": "SLURM not asked (--no-slurm)\n"}, None)
    files.update({f"slurm/{k}": v for k, v in slurm_texts.items()})
    if config is not None:
        files["run/config.yaml"] = yaml.safe_dump(red.structure(config), sort_keys=False)
    for p in (run.plan, run.layout, run.jobs, run.events, run.path / "submissions.jsonl", run.path / "placement.jsonl"):
        if p.is_file():
            files[f"run/{p.name}"] = p.read_text(errors="replace")
    if run.metrics.is_file():
        files["run/metrics.tail.jsonl"] = _tail(run.metrics, log_tail_lines)
    for p in sorted(run.path.rglob("*")):
        if p.is_file() and (p.suffix == ".sbatch" or p.name.endswith("_submission.sh")) \
                and run.checkpoints not in p.parents:
            files[f"run/sbatch/{p.relative_to(run.path)}"] = p.read_text(errors="replace")

    beats = read_heartbeats(run)
    files["heartbeats.txt"] = table(beats)
    files.update({f"heartbeats/{hb['file']}": json.dumps(red.structure(hb), indent=1) for hb in beats})
    files.update({f"env/{k}.json": json.dumps(red.structure(v), indent=1, sort_keys=True) for k, v in fps.items()})
    # The sync method the job ran (what its plan decided at submit); a run without a layout is checked
    # as strictly as broadcast needs.
    sync_method = JobLayout.read(run).sync_method if run.layout.is_file() else "broadcast"
    diff = compare(fps, sync_method=sync_method) if fps else None
    files["env-diff.txt"] = diff.render() if diff else "no env fingerprints\n"

    if run.stacks.is_dir():
        for p in sorted(run.stacks.rglob("*")):
            if p.is_file():
                files[f"stacks/{p.relative_to(run.stacks)}"] = _tail(p, 5000)
    records = records_dir(run)
    if records.is_dir():  # the flight-recorder records and nvidia-smi snapshots the node agents took on hangs
        for p in sorted(records.rglob("*")):
            if p.is_file() and not p.name.startswith("."):
                files[f"collectives/{p.relative_to(records)}"] = _tail(p, 5000)
    gpus = nvidia_smi.snapshot()
    if gpus is not None:
        files[f"gpu/nvidia-smi-{node_name()}.txt"] = gpus
    if live:
        files.update({f"stacks/live-{stamp}/{name}.txt": text
                      for name, text in live_dumps(beats, slurm_job if state == "RUNNING" else None, native).items()})
    files.update({f"logs/{k}.tail": v for k, v in logs.items()})
    files["checkpoints.txt"] = _checkpoints(run)

    facts = summ.Facts(events=read_jsonl(run.events), heartbeats=beats, logs=logs, slurm_state=state,
                       env_errors=[f.message for f in diff.errors] if diff else [])
    causes = summ.classify(facts)
    header = [f"run: {run.path}", f"job: {slurm_job or 'local (no SLURM job id)'}"
              + (f", SLURM state {state}" if state else "")]
    text = summ.render(causes, header)
    files["summary.txt"] = text
    files["summary.json"] = json.dumps({"run": str(run.path), "job_id": job_id, "slurm_state": state,
                                        "causes": [c.__dict__ for c in causes]}, indent=1)

    out_dir = Path(out_dir or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{top}.tar.gz"
    with replacing(path) as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:  # never through a link
        for name, content in sorted(files.items()):
            data = red.text(content).encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
    return Bundle(path, red.text(text) + f"bundle: {path}\n", causes)
