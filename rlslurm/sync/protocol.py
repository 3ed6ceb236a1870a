"""The weight-sync protocol, run by the controller (trainer rank 0) once per step:

    DRAIN   every engine refuses new requests and finishes the ones in flight
    UPDATE  the transport (disk, broadcast or ipc) lands the new weights on every engine; both
            sides checksum each tensor as it passes (the trainer its own tensor as it copies it
            out, the engine what landed, rlslurm/sync/landing.py), not in a pass of their own
    VERIFY  the trainer's per-tensor checksums are compared with each engine's; a mismatch
            re-runs UPDATE up to `sync.retries` times, then the engines roll back, stay drained,
            and SyncVerifyError (and a `sync_verify_failed` event) says which tensors of which
            engine differed. An engine swaps the verified tensors in only now, so it never serves
            a half update
    RESUME  every engine serves again, stamping samples with version + 1

    sync = WeightSync(clients, transport_for(layout.sync_method, cfg.sync, weights_dir=d), cfg.sync)
    report = sync.sync(dict(model.state_dict()), version=step + 1, step=step + 1)
    metrics.update(report.metrics())

Every stage runs under `sync.timeout_s`: a dead or stuck engine raises SyncStageError (event
`sync_failed`) instead of hanging the job. Each stage's seconds, bytes and GB/s are in the returned
SyncReport.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

import torch

from rlslurm import events
from rlslurm.errors import RlslurmError, SyncVerifyError
from rlslurm.rundir import RunDir
from rlslurm.sync.buckets import Fault
from rlslurm.sync.checksum import Checksum, checksums, compare, finish
from rlslurm.sync.config import SyncConfig

log = logging.getLogger(__name__)

STAGES = ("drain", "update", "verify", "resume")


class SyncStageError(RlslurmError):
    """A weight-sync stage failed or ran past sync.timeout_s (dead engine, refusal, broken group)."""

    exit_code = 6


class Transport(Protocol):
    name: str

    def send(self, tensors: Mapping[str, torch.Tensor], engines: Sequence, version: int,
             timeout_s: float, sums: dict[str, Checksum] | None = None) -> int:
        """Put `tensors` into every (drained) engine; returns the bytes moved. With `sums`, add the
        checksum of each of the trainer's own tensors, taken as it is copied out."""

    def close(self) -> None: ...


@dataclass
class StageStat:
    seconds: float = 0.0
    bytes: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 and self.bytes else 0.0


@dataclass
class SyncReport:
    transport: str
    version: int
    step: int | None = None
    attempts: int = 0
    stages: dict[str, StageStat] = field(default_factory=lambda: {s: StageStat() for s in STAGES})

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages.values())

    def metrics(self) -> dict[str, float]:
        """Flat `sync_<stage>_s` / `_bytes` / `_gbps` keys for the per-step metrics line."""
        out: dict[str, float] = {"sync_s": self.seconds, "sync_attempts": self.attempts}
        for name, s in self.stages.items():
            out.update({f"sync_{name}_s": s.seconds, f"sync_{name}_bytes": s.bytes,
                        f"sync_{name}_gbps": s.gbps})
        return out


class Update(dict):
    """The tensors one sync sends, and the checksums of the served tensors it leaves as they are (train.lora: the
    frozen base, rlslurm/lora.py): VERIFY holds the engines to both, so an update of some tensors still names
    every tensor served (an engine refuses an expectation that leaves one out)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], unchanged: Mapping[str, str]):
        super().__init__(tensors)
        self.unchanged = dict(unchanged)


class WeightSync:
    """DRAIN -> UPDATE -> VERIFY -> RESUME over `engines` (EngineClient-like) with one transport."""

    def __init__(self, engines: Sequence, transport: Transport, config: SyncConfig, *,
                 run: RunDir | None = None, clock: Callable[[], float] = time.monotonic):
        self.engines = list(engines)
        self.transport = transport
        self.config = config
        self.run = run
        self.clock = clock

    def sync(self, tensors: Mapping[str, torch.Tensor], version: int, *, step: int | None = None,
             engines: Sequence | None = None) -> SyncReport:
        """One sync of `tensors` to `version`; `step` (the step boundary it follows) goes into its events.
        `engines`: the engines of this sync from now on (the controller's in rotation, plus replaced ones
        to readmit); default: the same as the last sync's."""
        if engines is not None:
            self.engines = list(engines)
        cfg, timeout_s = self.config, self.config.timeout_s
        report = SyncReport(self.transport.name, version, step)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        # What VERIFY holds the engines to: checksums of the trainer's own tensors (a transport's
        # fault hook corrupts only its copies), taken by the first UPDATE as it copies them out.
        expected: dict[str, str] | None = None

        self._stage(report, "drain", lambda: self._each(lambda e: e.drain(timeout_s)))
        problems: list[dict] = []
        for attempt in range(cfg.retries + 1):
            report.attempts = attempt + 1
            sums: dict[str, Checksum] | None = {} if cfg.verify and expected is None else None
            self._stage(report, "update",
                        lambda sums=sums: self.transport.send(tensors, self.engines, version, timeout_s, sums))
            if not cfg.verify:
                break
            if expected is None:  # the trainer's side of the checksums: its last step, like the engines'
                started = self.clock()
                expected = {**getattr(tensors, "unchanged", {}), **self._expected(tensors, sums)}
                report.stages["update"].seconds += self.clock() - started
            answers = self._stage(report, "verify", lambda expected=expected: self._verify(expected, timeout_s))
            report.stages["verify"].bytes += nbytes * (len(self.engines) + 1)
            problems = [
                {"engine": e.url, **p}
                for e, a in zip(self.engines, answers)
                # The engine's verdict and our own reading of its checksums must both agree.
                for p in (a["mismatches"] or compare(expected, a["checksums"]))
            ]
            if not problems:
                break
            log.error("sync to version %d: verify failed on attempt %d/%d: %d tensors differ, e.g. %s",
                      version, attempt + 1, cfg.retries + 1, len(problems), problems[0])
            self._event(report, events.SYNC_VERIFY_MISMATCH, version=version, attempt=attempt + 1,
                        mismatches=problems[:8])
        if problems:
            self._fail_verify(version, problems, report)
        self._stage(report, "resume",
                    lambda: self._each(lambda e: e.resume(version, timeout_s, unverified_ok=not cfg.verify)))
        self._event(report, events.SYNC_VERIFIED, version=version, transport=self.transport.name,
                    **report.metrics())
        log.info("sync to version %d via %s: %.2f s (update %.3f GB/s)", version, self.transport.name,
                 report.seconds, report.stages["update"].gbps)
        return report

    def _fail_verify(self, version: int, problems: list[dict], report: SyncReport):
        # The engines stay drained on their last verified weights: nothing unverified is served.
        rolled = []
        for e in self.engines:
            try:
                rolled.append((e.url, e.rollback(self.config.timeout_s)["ok"]))
            except RlslurmError as err:
                rolled.append((e.url, f"rollback failed: {err}"))
        first = problems[0]
        self._event(report, events.SYNC_VERIFY_FAILED, version=version, transport=self.transport.name,
                    attempts=report.attempts, engine=first["engine"], mismatches=problems[:8], rollback=rolled)
        raise SyncVerifyError(
            f"weight sync to version {version} via {self.transport.name} failed verification "
            f"{report.attempts} times: {len(problems)} tensors differ (first: {first['name']!r} on "
            f"{first['engine']}: expected {first['expected']}, engine has {first['actual']}); "
            f"engines rolled back and left drained (a vLLM server keeps no previous weights: it stays paused until "
            f"a sync passes): {rolled}")

    def _verify(self, expected: dict[str, str], timeout_s: float) -> list[dict]:
        return self._each(lambda e: e.verify(expected, timeout_s))

    @staticmethod
    def _expected(tensors: Mapping[str, torch.Tensor], sums: dict[str, Checksum]) -> dict[str, str]:
        """The trainer's checksums as strings; any tensor the transport did not checksum, now."""
        done = {**finish(sums), **checksums((n, t) for n, t in tensors.items() if n not in sums)}
        return {n: done[n] for n in tensors}

    def _each(self, call: Callable) -> list:
        with ThreadPoolExecutor(max(1, len(self.engines))) as pool:
            return [f.result() for f in [pool.submit(call, e) for e in self.engines]]

    def _stage(self, report: SyncReport, name: str, work: Callable):
        started = self.clock()
        pool = ThreadPoolExecutor(1, thread_name_prefix=f"sync-{name}")
        try:
            result = pool.submit(work).result(timeout=self.config.timeout_s)
        except FutureTimeout:
            self._event(report, events.SYNC_FAILED, stage=name, version=report.version, reason="timeout")
            raise SyncStageError(f"weight sync stage {name} ran past sync.timeout_s = "
                                 f"{self.config.timeout_s} s (engines {[e.url for e in self.engines]})") from None
        except RlslurmError as e:
            if isinstance(e, SyncVerifyError):
                raise
            self._event(report, events.SYNC_FAILED, stage=name, version=report.version, reason=str(e))
            raise SyncStageError(f"weight sync stage {name} failed: {e}") from e
        except Exception as e:  # a broken process group, a connection reset, ...
            self._event(report, events.SYNC_FAILED, stage=name, version=report.version, reason=repr(e))
            raise SyncStageError(f"weight sync stage {name} failed: {type(e).__name__}: {e}") from e
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        stat = report.stages[name]
        stat.seconds += self.clock() - started
        if name == "update":
            stat.bytes += int(result)
        return result

    def _event(self, report: SyncReport, kind: events.EventKind, **fields) -> None:
        if self.run is not None:
            step = {} if report.step is None else {"step": report.step}
            events.emit(self.run, kind, role="controller", **step, **fields)


def transport_for(method: str, config: SyncConfig, *, weights_dir: str | Path, host: str = "127.0.0.1",
                  fault: Fault | None = None) -> Transport:
    """The transport of `method` (disk, broadcast or ipc): the job's layout.sync_method, which the plan
    resolved from sync.method once at submit (rlslurm/layout.py); `config` gives its settings."""
    from rlslurm.sync.broadcast import BroadcastTransport
    from rlslurm.sync.disk import DiskTransport
    from rlslurm.sync.ipc import IpcTransport

    fault = fault if fault is not None else Fault.from_env()
    if method == "disk":
        return DiskTransport(config.weights_dir or weights_dir, keep=config.keep_versions, fault=fault,
                             shard_bytes=int(config.bucket_mb * 2**20))
    if method == "broadcast":
        return BroadcastTransport(host, bucket_mb=config.bucket_mb, port=config.store_port or None, fault=fault)
    if method == "ipc":
        return IpcTransport(bucket_mb=config.bucket_mb, fault=fault)
    raise ValueError(f"no sync transport {method!r}: the layout names disk, broadcast or ipc (sync.method auto "
                     "is resolved by the plan, rlslurm/layout.py)")
