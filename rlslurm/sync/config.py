"""`sync:` in a job YAML: how new weights reach the rollout engines each step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlslurm.configfile import check, check_path, check_range


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    method: Literal["auto", "disk", "broadcast", "ipc"] = "auto"
    """disk = safetensors on the shared filesystem; broadcast = a process group; ipc = colocated handles;
    auto = from placement."""
    bucket_mb: float = 64.0
    """MB per bucket (broadcast, ipc) or per shard file (disk): the unit that is pipelined (bucket i+1 is filled
    while bucket i is in flight; a vLLM engine loads shard k while shard k+1 is written); smaller buckets
    overlap more, larger ones mean fewer messages. A tensor larger than this travels alone (broadcast sends it
    from the tensor itself, without a copy). Range [0.001, 100000]."""
    timeout_s: float = 60.0
    """Seconds any one stage (drain, update, verify, resume) may take before the sync fails. Range (0, 86400]."""
    verify: bool = True
    """Compare per-tensor checksums of trainer and engine before serving."""
    retries: int = 1
    """Retries of a failed verify before the step fails. Range [0, 100]."""
    weights_gb: float | None = None
    """Override: GB moved per sync; null = bf16 size of all parameters. Range (0, 1000000]."""
    weights_dir: str | None = None
    """Directory of the disk transport on the shared filesystem (sync.method disk); null = <run dir>/sync."""
    keep_versions: int = 2
    """Weight versions the disk transport keeps in weights_dir (older ones are deleted). Range [1, 1000]."""
    store_port: int = 0
    """TCP port of the broadcast group's store on trainer rank 0 (sync.method broadcast); 0 = any free port.
    Range [0, 65535]."""

    def resolved_method(self, placement: str | None) -> Literal["disk", "broadcast", "ipc"] | None:
        """The method that runs under `placement`: the one place `auto` is resolved (ipc when colocated,
        broadcast otherwise; None while the placement is undecided). The plan calls it once at submit."""
        if self.method != "auto":
            return self.method
        return {"colocate": "ipc", "separate": "broadcast"}.get(placement or "")

    def __post_init__(self):
        # At least ~1 KB: the transports cut buckets of int(bucket_mb * 2**20) bytes, and 0 bytes never ends.
        check_range(self.bucket_mb, "bucket_mb", 0.001, 100_000, note="MB")
        check_range(self.timeout_s, "timeout_s", 0, 86_400, low_open=True, note="seconds")
        check_range(self.retries, "retries", 0, 100)
        check_range(self.keep_versions, "keep_versions", 1, 1000, note="the newest version is being loaded")
        check(0 <= self.store_port <= 65535, "store_port", "must be a TCP port in [0, 65535] (0 = any free one)")
        check_range(self.weights_gb, "weights_gb", 0, 1_000_000, low_open=True, note="GB")
        check_path(self.weights_dir, "weights_dir")
