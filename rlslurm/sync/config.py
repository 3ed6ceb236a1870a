"""`sync:` in a job YAML: how new weights reach the rollout engines each step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    method: Literal["auto", "disk", "broadcast", "ipc"] = "auto"
    """disk = safetensors on the shared filesystem; broadcast = a process group; ipc = colocated handles; auto = from placement."""
    bucket_mb: float = 64.0
    """MB per bucket (broadcast, ipc): the unit that is pipelined (bucket i+1 is filled while bucket i is
    in flight); smaller buckets overlap more, larger ones mean fewer messages. A tensor larger than
    this travels alone (broadcast sends it from the tensor itself, without a copy)."""
    timeout_s: float = 60.0
    """Seconds any one stage (drain, update, verify, resume) may take before the sync fails."""
    verify: bool = True
    """Compare per-tensor checksums of trainer and engine before serving."""
    retries: int = 1
    """Retries of a failed verify before the step fails."""
    weights_gb: float | None = None
    """Override: GB moved per sync; null = bf16 size of all parameters."""
    weights_dir: str | None = None
    """Directory of the disk transport on the shared filesystem; null = <run dir>/sync."""
    keep_versions: int = 2
    """Weight versions the disk transport keeps in weights_dir (older ones are deleted)."""
    store_port: int = 0
    """TCP port of the broadcast group's store on trainer rank 0; 0 = any free port."""

    def __post_init__(self):
        check(self.bucket_mb > 0, "bucket_mb", "must be > 0 (MB)")
        check(self.timeout_s > 0, "timeout_s", "must be > 0 (seconds)")
        check(self.retries >= 0, "retries", "must be >= 0")
        check(self.keep_versions >= 1, "keep_versions", "must be >= 1 (the newest version is being loaded)")
        check(0 <= self.store_port <= 65535, "store_port", "must be a TCP port (0 = any free one)")
        check(self.weights_gb is None or self.weights_gb > 0, "weights_gb", "must be > 0 (GB)")
