"""The GPU check's driver (bench/gpu_smoke.sh runs it): submit the job, then read the run back.

    python bench/gpu_smoke.py run examples/tiny-grpo-gpu.yaml --run-root runs/gpu-check [--set k=v ...] \
        [--check-json gpu_check.json --tests-xml gpu-tests.xml --tests-rc N --tests-s S] [--cpu]
    python bench/gpu_smoke.py report RUN_DIR [--json summary.json]     # any finished RL run, e.g. a fixture

`run` submits with `rlslurm submit CONFIG --backend local --wait` (this interpreter, bounded by
--timeout-s) while it samples `nvidia-smi --query-compute-apps` every second for each process's GPU memory
(not with --cpu), then does what `report` does and writes the check's one JSON (`check_record`: memory
per role against the plan, step split, sync GB/s, logprob gap, the gpu tests' outcome). The report reads
only the run directory:
  - every weight sync's VERIFY from events.jsonl (`sync_verified`; `sync_failed`, `sync_verify_mismatch`,
    `sync_verify_failed`):
    the first sync (the engines take the starting policy) and one per step;
  - its transport and update GB/s (`sync_update_gbps`, bytes over the UPDATE stage's seconds), and
    whether it went over NCCL (the broadcast transport on a CUDA machine: the `env` fingerprints say);
  - the trainer's measured peak GPU memory per step (`trainer_peak_gb`, `trainer_reserved_gb` in
    metrics.jsonl, rlslurm/memory_meter.py) against the plan's predicted trainer peak per GPU for the
    chosen split (plan.json: what `rlslurm plan --json` printed at submit).
It exits 0 only when the job finished every step and every sync passed VERIFY. NOT RUN ON A GPU YET.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlslurm import events as ev


@dataclass
class SyncRecord:
    version: int
    transport: str
    verified: bool
    attempts: int = 1
    update_gbps: float = 0.0
    update_bytes: int = 0
    update_s: float = 0.0


@dataclass
class Summary:
    run_dir: str
    steps_wanted: int
    steps_done: int
    done: bool
    syncs: list[SyncRecord] = field(default_factory=list)
    sync_failures: list[str] = field(default_factory=list)
    nccl: bool = False
    """The broadcast transport ran on CUDA, i.e. through a NCCL process group."""
    predicted_peak_gb: float | None = None
    predicted_terms: dict = field(default_factory=dict)
    measured_peak_allocated_gb: float | None = None
    measured_peak_reserved_gb: float | None = None
    install_s: float | None = None
    run_s: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def _predicted(plan: dict) -> tuple[float | None, dict]:
    """The chosen split's trainer peak per GPU and its terms, from plan.json."""
    chosen = plan.get("chosen") or {}
    key = (chosen.get("rollout_nodes"), chosen.get("train_gpus"))
    for split in plan.get("splits", []):
        if (split.get("rollout_nodes"), split.get("train_gpus")) == key:
            terms = {k: split[k] for k in ("resident_gb", "activations_temporaries_gb", "temporaries_gb")
                     if k in split}
            return split.get("peak_gb"), terms
    return None, {}


def _on_cuda(run: Path) -> bool:
    """Whether the trainer's rank 0 had NCCL, i.e. a GPU: its env fingerprint (diag/env_diff.py) names the
    NCCL version only when CUDA is available."""
    path = run / "env" / "train-0.json"
    return path.is_file() and json.loads(path.read_text()).get("nccl") is not None


def _figures(metrics: list[dict], key: str, old_key: str) -> list[float]:
    """Every step's non-null `key` (or, in a run written before it, `old_key`)."""
    values = (m.get(key, m.get(old_key)) for m in metrics)
    return [v for v in values if v is not None]


def summarize(run_dir: str | Path, *, install_s: float | None = None, run_s: float | None = None,
              cpu: bool = False) -> Summary:
    """What the smoke test checks, read from a finished run directory (`cpu`: the dry run, whose trainer's
    memory figure is the process's peak RSS)."""
    run = Path(run_dir)
    config = _yaml(run / "config.yaml")
    metrics, said = _jsonl(run / "metrics.jsonl"), _jsonl(run / "events.jsonl")
    plan = json.loads((run / "plan.json").read_text()) if (run / "plan.json").is_file() else {}
    steps_wanted = int((config.get("train") or {}).get("steps", 0))
    s = Summary(run_dir=str(run), steps_wanted=steps_wanted,
                steps_done=max((m.get("step", 0) for m in metrics), default=0),
                done=bool(ev.select(said, ev.DONE)), install_s=install_s, run_s=run_s)
    for e in said:
        kind = ev.kind_of(e)
        if kind == ev.SYNC_VERIFIED:
            s.syncs.append(SyncRecord(version=int(e.get("version", -1)), transport=str(e.get("transport")),
                                      verified=True, attempts=int(e.get("sync_attempts", 1)),
                                      update_gbps=float(e.get("sync_update_gbps", 0.0)),
                                      update_bytes=int(e.get("sync_update_bytes", 0)),
                                      update_s=float(e.get("sync_update_s", 0.0))))
        elif kind in (ev.SYNC_FAILED, ev.SYNC_VERIFY_MISMATCH, ev.SYNC_VERIFY_FAILED):
            s.sync_failures.append(f"{kind.name} version {e.get('version')}: "
                                   f"{e.get('reason') or e.get('mismatches') or e.get('stage')}")
    s.nccl = any(x.transport == "broadcast" for x in s.syncs) and _on_cuda(run)
    s.predicted_peak_gb, s.predicted_terms = _predicted(plan)
    # trainer_peak_gb / trainer_reserved_gb (rlslurm/memory_meter.py); runs from before the meter: train_peak_*.
    allocated = _figures(metrics, "trainer_peak_gb", "train_peak_allocated_gb")
    reserved = _figures(metrics, "trainer_reserved_gb", "train_peak_reserved_gb")
    s.measured_peak_allocated_gb = max(allocated) if allocated else None
    s.measured_peak_reserved_gb = max(reserved) if reserved else None

    if not s.done:
        s.problems.append("no `done` event: the job did not finish (see logs/ and events.jsonl)")
    if s.steps_done < steps_wanted:
        s.problems.append(f"{s.steps_done} of train.steps = {steps_wanted} steps in metrics.jsonl")
    if s.sync_failures:
        s.problems.append(f"{len(s.sync_failures)} sync failures: {s.sync_failures[0]}")
    if len(s.syncs) < steps_wanted + 1:  # the first sync, then one per step
        s.problems.append(f"{len(s.syncs)} verified syncs, expected {steps_wanted + 1} (the first + one per step)")
    if s.measured_peak_allocated_gb is None and not (cpu and _figures(metrics, "rss_peak_gb", "train_peak_rss_gb")):
        s.problems.append("no trainer_peak_gb in metrics.jsonl: no step was metered")
    return s


def render(s: Summary) -> str:
    """The lines the smoke test prints."""
    lines = [f"GPU smoke: {s.run_dir}"]
    if s.install_s is not None or s.run_s is not None:
        lines.append(f"  time: install [gpu] {s.install_s or 0:.0f} s, job {s.run_s or 0:.0f} s")
    lines.append(f"  steps: {s.steps_done} of {s.steps_wanted}, finished: {'yes' if s.done else 'no'}")
    for x in sorted(s.syncs, key=lambda r: r.version):
        mb = x.update_bytes / 1e6
        lines.append(f"  sync to v{x.version}: {x.transport}, VERIFY passed (attempts {x.attempts}), update "
                     f"{x.update_gbps:.2f} GB/s ({mb:.1f} MB in {x.update_s:.3f} s)")
    for failure in s.sync_failures:
        lines.append(f"  sync FAILED: {failure}")
    transports = sorted({x.transport for x in s.syncs})
    lines.append("  NCCL: " + ("yes (broadcast transport on CUDA)" if s.nccl else
                               f"not exercised (transport {', '.join(transports) or 'none'}; one GPU cannot hold "
                               "two NCCL ranks, see docs/gpu.md)"))
    if s.measured_peak_allocated_gb is not None and s.predicted_peak_gb:
        ratio = s.measured_peak_allocated_gb / s.predicted_peak_gb
        terms = ", ".join(f"{k} {v:.2f}" for k, v in s.predicted_terms.items())
        lines.append(f"  trainer peak memory per GPU: predicted {s.predicted_peak_gb:.2f} GB (plan: {terms}), "
                     f"measured {s.measured_peak_allocated_gb:.2f} GB allocated / "
                     f"{s.measured_peak_reserved_gb or 0:.2f} GB reserved (measured/predicted {ratio:.2f})")
    else:
        lines.append(f"  trainer peak memory per GPU: predicted {s.predicted_peak_gb} GB, measured "
                     f"{s.measured_peak_allocated_gb} GB")
    lines.append("  result: " + ("PASS" if s.ok else "FAIL: " + "; ".join(s.problems)))
    return "\n".join(lines)


class GpuSampler:
    """Every process's peak GPU memory while the job runs: `nvidia-smi --query-compute-apps` once a second
    (diag/nvidia_smi.py parses it), in a thread; {pid: peak MiB}. Nothing where nvidia-smi is absent."""

    def __init__(self, period_s: float = 1.0):
        self.binary = shutil.which("nvidia-smi")
        self.period_s, self.peaks, self.errors = period_s, {}, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        if self.binary:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        from rlslurm.diag.nvidia_smi import APP_FIELDS, _query, parse_apps

        while not self._stop.wait(self.period_s):
            try:
                for app in parse_apps(_query(self.binary, "compute-apps", APP_FIELDS, 10.0)):
                    self.peaks[app.pid] = max(self.peaks.get(app.pid, 0.0), app.memory_mib or 0.0)
            except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
                if len(self.errors) < 5:
                    self.errors.append(f"{type(e).__name__}: {e}")


def submit(config: str, run_root: str, overrides: list[str], timeout_s: float,
           sampler: GpuSampler | None = None) -> tuple[Path, float]:
    """`rlslurm submit CONFIG --backend local --wait` with this interpreter; (run dir, seconds)."""
    cmd = [sys.executable, "-m", "rlslurm.cli.main", "submit", config, "--backend", "local", "--wait",
           "--run-root", run_root, *[a for o in overrides for a in ("--set", o)]]
    print("gpu_smoke: " + " ".join(cmd), flush=True)
    started = time.monotonic()
    try:
        with sampler if sampler is not None else contextlib.nullcontext():
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise SystemExit(f"gpu_smoke: the job ran past {timeout_s:.0f} s\n{out[-3000:]}") from None
    seconds = time.monotonic() - started
    sys.stdout.write(proc.stdout[-4000:])
    sys.stderr.write(proc.stderr[-4000:])
    found = re.search(r"^run directory: (.+)$", proc.stdout, re.M)
    if not found:
        raise SystemExit(f"gpu_smoke: submit printed no run directory (exit {proc.returncode})")
    return Path(found.group(1).strip()), seconds


SHARES = ("rollout_share", "reward_share", "train_share", "sync_share")
"""The step split of the RL loop's metrics: each phase's share of the step's seconds."""


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(values) / len(values) if values else None


def _roles(run: Path) -> dict[int, str]:
    """pid -> `role-rank` from the run's placement.jsonl (trainer ranks and colocated engines)."""
    return {int(p["pid"]): f"{p['role']}-{p.get('rank', 0)}" for p in _jsonl(run / "placement.jsonl") if p.get("pid")}


def _tests(xml_path: str | None, rc: int | None, seconds: float | None) -> dict:
    """The gpu-marked tests' outcome from pytest's junit XML."""
    record: dict = {"exit_code": rc, "seconds": seconds}
    if xml_path and Path(xml_path).is_file():
        suite = ElementTree.parse(xml_path).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        record.update(counts, passed=counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"])
    return record


def check_record(s: Summary, *, cpu: bool, sampler: GpuSampler | None, tests: dict) -> dict:
    """The GPU check's one JSON: peak memory per role against the plan, the step split, sync GB/s, the
    logprob gap engine vs trainer, the gpu tests, and whether it all passed."""
    run = Path(s.run_dir)
    metrics = [m for m in _jsonl(run / "metrics.jsonl") if "policy_version" in m]
    plan = json.loads((run / "plan.json").read_text()) if (run / "plan.json").is_file() else {}
    roles = _roles(run)
    per_process = {f"{roles.get(pid, 'other')} (pid {pid})": round(mib / 1024, 3)
                   for pid, mib in (sampler.peaks if sampler else {}).items()}

    def smi_peak(prefix: str) -> float | None:
        found = [gb for name, gb in per_process.items() if name.startswith(prefix)]
        return max(found) if found else None

    rss = _figures(metrics, "rss_peak_gb", "train_peak_rss_gb")
    memory = {
        "trainer": {"predicted_peak_gb": s.predicted_peak_gb, "predicted_terms": s.predicted_terms,
                    "measured_allocated_gb": s.measured_peak_allocated_gb,
                    "measured_reserved_gb": s.measured_peak_reserved_gb,
                    "measured_nvidia_smi_gb": smi_peak("train"),
                    **({"measured_rss_gb": max(rss)} if cpu and rss else {})},
        "engine": {"predicted_gb": (plan.get("colocate") or {}).get("engine_needs_gb"),
                   "measured_nvidia_smi_gb": smi_peak("rollout")},
        "per_process_nvidia_smi_gb": per_process,
    }
    return {
        "ok": s.ok and tests.get("exit_code") in (0, 5, None), "device": "cpu (dry run)" if cpu else "cuda",
        "problems": s.problems, "run_dir": s.run_dir, "steps": s.steps_done, "install_s": s.install_s,
        "job_s": s.run_s, "gpu_tests": tests, "memory": memory,
        "step_split": {key: _mean(metrics, key) for key in ("step_s", *SHARES)},
        "sync": {"transport": sorted({x.transport for x in s.syncs}),
                 "update_gbps": [round(x.update_gbps, 4) for x in sorted(s.syncs, key=lambda r: r.version)],
                 "verified": len(s.syncs), "failures": s.sync_failures},
        "trained_samples": sum(m.get("effective_samples", 0) for m in metrics),
        "logprob_gap_engine_vs_trainer": max((m["engine_trainer_logprob_gap"] for m in metrics
                                              if "engine_trainer_logprob_gap" in m), default=None),
        "nvidia_smi_errors": sampler.errors if sampler else [],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="submit the job, wait, report")
    r.add_argument("config")
    r.add_argument("--run-root", required=True)
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    r.add_argument("--timeout-s", type=float, default=420.0)
    r.add_argument("--install-s", type=float, default=None, help="seconds the install took (printed)")
    r.add_argument("--json", default=None, help="also write the summary here")
    r.add_argument("--check-json", default=None, help="write the GPU check's record here")
    r.add_argument("--tests-xml", default=None, help="the gpu tests' junit XML")
    r.add_argument("--tests-rc", type=int, default=None, help="the gpu tests' pytest exit code")
    r.add_argument("--tests-s", type=float, default=None, help="the gpu tests' seconds")
    r.add_argument("--cpu", action="store_true", help="the dry run: no GPU, the trainer's memory is its RSS")
    q = sub.add_parser("report", help="report on a finished run directory")
    q.add_argument("run_dir")
    q.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.command == "run":
        sampler = GpuSampler()
        run_dir, seconds = submit(args.config, args.run_root, args.overrides, args.timeout_s, sampler)
        summary = summarize(run_dir, install_s=args.install_s, run_s=seconds, cpu=args.cpu)
        if args.check_json:
            record = check_record(summary, cpu=args.cpu, sampler=sampler,
                                  tests=_tests(args.tests_xml, args.tests_rc, args.tests_s))
            Path(args.check_json).write_text(json.dumps(record, indent=1))
    else:
        summary = summarize(args.run_dir)
    print(render(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({**asdict(summary), "ok": summary.ok}, indent=1))
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
