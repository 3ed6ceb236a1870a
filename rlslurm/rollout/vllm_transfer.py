"""rlslurm's weight-transfer engine for vLLM's own RL routes, run inside vLLM's workers.

    vllm serve DIR --weight-transfer-config '{"backend": "rlslurm"}'         # (rollout/vllm_serve.py)
    POST /init_weight_transfer_engine {"init_info": {"addr", "port", "rank_offset", "world_size", ...}}
    POST /start_weight_update; POST /update_weights {"update_info": {"kind": "broadcast" | "disk", ...}}
    POST /finish_weight_update {"weight_version": "12"}
    POST /collective_rpc {"method": "rlslurm_checksums"}     # VERIFY (rollout/vllm_verify.py, same workers)

Why an engine of our own: vLLM's built-in nccl and ipc engines use CUDA streams; on CPU there is none
that runs. This one is registered through vLLM's plugin entry point (`vllm.general_plugins` in
pyproject.toml -> `register`), so CI runs the same routes, the same start/update/finish lifecycle and
the same layerwise reload (vLLM's `initialize_layerwise_reload` / `finalize_layerwise_reload`, which
re-runs each layer's `process_weights_after_loading`: on CPU the re-pack of every linear weight) that
nccl/ipc run on a GPU. Only the wire differs: rlslurm's gloo broadcast group (rlslurm/sync/broadcast.py,
each TP worker its own rank: `rank_offset + tp_rank`) or a safetensors version on disk
(rlslurm/sync/disk.py). The tensors go from the socket or file straight into `model.load_weights` in the
worker: no byte passes through the API server or any other process, and the engine keeps no snapshot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger

log = init_logger("vllm.rlslurm.weight_transfer")  # under vLLM's logger: the engine's log shows it, from a worker

DEBUG = {"skip_retie": False}
"""Tests only (set through /collective_rpc rlslurm_debug, rollout/vllm_verify.py): `skip_retie` leaves a tied LM
head's packed GEMM on the old weights after an update, the half-applied update VERIFY must catch."""

BACKEND = "rlslurm"
"""The name the engine is registered under: `--weight-transfer-config '{"backend": "rlslurm"}'`."""


def register() -> None:
    """vLLM general plugin (entry point `vllm.general_plugins`): runs in every vLLM process, maybe twice."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "RlslurmTransferEngine")


# vLLM's base classes are importable only in the vLLM venv; this module is imported there only.
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)


@dataclass
class RlslurmInitInfo(WeightTransferInitInfo):
    """Join the trainer's broadcast group (rlslurm/sync/broadcast.py BroadcastGroup.join)."""

    addr: str
    port: int
    rank_offset: int
    """This engine's first rank in the group; its TP worker k is rank_offset + k."""
    world_size: int
    timeout_s: float = 60.0
    generation: int = 0


@dataclass
class RlslurmUpdateInfo(WeightTransferUpdateInfo):
    """One update: `broadcast` (manifest + bucket_bytes over the joined group), `disk` (a version dir, or some of
    its shard files: the trainer sends each as soon as it is written) or
    `ipc` (shared-memory handles the worker maps, rlslurm/sync/ipc.py; one worker per FIFO: TP 1)."""

    kind: str
    manifest: list[dict] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    """disk: the shards of the version at `path` to load now (empty: all of them)."""
    bucket_bytes: int = 0
    path: str = ""
    handles: list[dict] = field(default_factory=list)
    ready: dict | None = None
    timeout_s: float = 60.0


class _ModelSink:
    """What rlslurm/sync/landing.py's in-place Landing loads into: the worker's model, through its own
    `load_weights` (HF names in, TP sharding and fused projections done by vLLM)."""

    adopts_weights = False
    model_name = "vllm-worker"

    def __init__(self, model: torch.nn.Module, *, copy: bool = True):
        self.model = model
        self.copy = copy
        self.load_s = 0.0  # in model.load_weights (and the copy before it), of this update
        self.copy_s = 0.0  # of which the copy

    def load_weights(self, named) -> int:
        started = time.perf_counter()
        # Copies: vLLM's layerwise reload keeps a loaded tensor until its layer is complete, and the landing
        # receives the next buckets into the same scratch buffers (measured: gate_proj of bucket k came out
        # as bucket k+4's bytes). A disk shard's tensors are read from its file, no reused buffer (copy=False).
        named = [(name, t.clone() if self.copy else t) for name, t in named]
        self.copy_s += time.perf_counter() - started
        self.model.load_weights(named)
        self.load_s += time.perf_counter() - started
        return sum(t.numel() * t.element_size() for _, t in named)


def _retie_lm_head(model: torch.nn.Module, hf_config) -> None:
    """A tied LM head shares the embedding's weight, and vLLM's layerwise reload processes that parameter once,
    under its first name (the embedding): the CPU backend's own packed GEMM of the LM head then kept the old
    weights (measured: VERIFY found `model.embed_tokens.weight` served as two different copies after an RL
    run's first sync). Point the head at the reloaded weight again and re-pack it."""
    if not getattr(hf_config, "tie_word_embeddings", False):
        return
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or not hasattr(head, "quant_method"):
        return
    head.weight = embed.weight
    head.quant_method.process_weights_after_loading(head)


class RlslurmTransferEngine(WeightTransferEngine[RlslurmInitInfo, RlslurmUpdateInfo]):
    """gloo broadcast / disk into a vLLM worker, with vLLM's layerwise reload around it."""

    init_info_cls = RlslurmInitInfo
    update_info_cls = RlslurmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.seconds: dict[str, float] = {}  # where this update's time went, logged at its finish

    def _tp_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def init_transfer_engine(self, init_info: RlslurmInitInfo) -> None:
        from rlslurm.sync.broadcast import BroadcastGroup

        self.group = None  # a rebuilt group replaces one a failure broke
        # gloo on CPU, NCCL on a GPU worker: BroadcastGroup picks as the trainer's side does (never run on a GPU).
        # The job's secret from the file the server's environment names (RLSLURM_SECRET_FILE, vllm_serve.serve_env).
        self.group = BroadcastGroup.join(init_info.addr, init_info.port, init_info.rank_offset + self._tp_rank(),
                                         init_info.world_size, init_info.timeout_s, generation=init_info.generation)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        started = time.perf_counter()
        initialize_layerwise_reload(self.model)
        self.seconds = {"start": time.perf_counter() - started, "receive": 0.0, "load": 0.0, "copy": 0.0, "calls": 0}

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        started = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        if not DEBUG["skip_retie"]:
            _retie_lm_head(self.model, self.model_config.hf_config)
        t = {**self.seconds, "finish": time.perf_counter() - started}
        log.info("rlslurm weight transfer on TP rank %d: start %.3f s, receive %.3f s in %d update(s) (load_weights "
                 "%.3f s of it, its copy %.3f s), finish (layerwise reload, re-pack) %.3f s", self._tp_rank(),
                 t.get("start", 0.0), t.get("receive", 0.0), t.get("calls", 0), t.get("load", 0.0), t.get("copy", 0.0),
                 t["finish"])

    def receive_weights(self, update_info: RlslurmUpdateInfo) -> None:
        from rlslurm.sync import disk, ipc
        from rlslurm.sync.landing import Landing

        started = time.perf_counter()
        sink = _ModelSink(self.model, copy=update_info.kind != "disk")
        landing = Landing(sink, staged=False)
        if update_info.kind == "broadcast":
            if self.group is None:
                raise RuntimeError("no broadcast group: POST /init_weight_transfer_engine first")
            try:
                self.group.receive(update_info.manifest, update_info.bucket_bytes, landing)
            except BaseException:
                self.group = None  # broken by a peer's failure: the trainer rebuilds it
                raise
        elif update_info.kind == "disk":
            disk.receive(update_info.path, landing, files=update_info.files or None)
        elif update_info.kind == "ipc":
            ipc.receive(update_info.manifest, update_info.bucket_bytes, update_info.handles, landing,
                        ready=update_info.ready, timeout_s=update_info.timeout_s)
        else:
            raise ValueError(f"update kind {update_info.kind!r}: rlslurm's engine takes broadcast, disk or ipc")
        self.seconds["receive"] = self.seconds.get("receive", 0.0) + time.perf_counter() - started
        self.seconds["load"] = self.seconds.get("load", 0.0) + sink.load_s
        self.seconds["copy"] = self.seconds.get("copy", 0.0) + sink.copy_s
        self.seconds["calls"] = self.seconds.get("calls", 0) + 1
        log.debug("rlslurm weight transfer: %s update of %d bytes landed on TP rank %d", update_info.kind,
                  landing.bytes, self._tp_rank())

    def shutdown(self) -> None:
        self.group = None
