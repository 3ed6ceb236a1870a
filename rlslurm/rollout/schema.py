"""Every body the engine server accepts, as a strict pydantic model: a field it does not know, a wrong
type, or a size past its bound is refused (400) before a route runs.

Bounds here are structural (how long a name, how many dims, how many tensors); the limits a job sets
on generation (n, max_tokens, prompt length, ...) are checked by `batcher.Limits`, which names them.
Nothing here is unpickled or evaluated: IPC handles are plain fields (rlslurm/sync/ipc.py rebuilds a
CUDA handle from them with torch's rebuild function, called by us). `completion_body` is the one body it
answers with beyond plain dicts: the OpenAI completions shape, with the policy version of every choice.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from rlslurm.rollout.bounds import MAX_LOGPROBS, as_count
from rlslurm.sync.buckets import DTYPES

MAX_TENSORS = 1 << 18
"""Tensors one update may name (a 1T-parameter MoE checkpoint has ~10^5)."""
MAX_NAME = 1024
MAX_PATH = 4096
MAX_BYTES = 1 << 44
"""16 TiB: larger than any bucket or tensor."""
MAX_SECONDS = 86400.0

Dtype = Literal[DTYPES]  # type: ignore[valid-type]
Count = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS)]
Path = Annotated[str, Field(min_length=1, max_length=MAX_PATH)]
Base64 = Annotated[str, Field(max_length=1024, pattern=r"^[A-Za-z0-9+/]*={0,2}$")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- data plane --------------------------------------------------------------------------------------

TokenIds = Annotated[list[int], Field(max_length=1 << 20)]
Whole = Annotated[int, BeforeValidator(as_count)]
"""A count as vLLM's gate reads one (rollout/bounds.py): an integer or an integral float; never a string, a bool
or NaN (pydantic alone would take "100" and true)."""


class CompletionRequest(Strict):
    """POST /v1/completions: the OpenAI fields this engine honours; any other field is a 400 naming it
    (an option silently ignored would change what the caller thinks it sampled)."""

    model: str = Field("", max_length=MAX_NAME)
    prompt: str | list[str] | TokenIds | list[TokenIds]
    n: Whole = 1
    max_tokens: Whole | None = 16
    temperature: float | None = Field(1.0, ge=0, le=100)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    logprobs: Annotated[Whole, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    stream: bool | None = False
    user: str | None = Field(None, max_length=MAX_NAME)


# -- admin: the weight-sync protocol -------------------------------------------------------------------

class Drain(Strict):
    timeout_s: Seconds = 30.0


class TensorEntry(Strict):
    """One tensor of an update's manifest (rlslurm/sync/buckets.py)."""

    name: str = Field(min_length=1, max_length=MAX_NAME)
    dtype: Dtype
    shape: list[Count] = Field(max_length=16)


Manifest = Annotated[list[TensorEntry], Field(min_length=1, max_length=MAX_TENSORS)]


class UpdateDisk(Strict):
    path: Path


class BroadcastJoin(Strict):
    addr: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1, le=1 << 16)
    world_size: int = Field(ge=2, le=1 << 16)
    timeout_s: Seconds
    generation: int = Field(0, ge=0, le=2**62)


class UpdateBroadcast(Strict):
    manifest: Manifest
    bucket_bytes: int = Field(ge=1, le=MAX_BYTES)


class ShmHandle(Strict):
    """A CPU bucket in torch's shared memory (file_system strategy): the manager's socket and the segment."""

    kind: Literal["shm"]
    manager: str = Field(max_length=MAX_PATH, pattern=r"^/.*/manager\.sock$")
    name: str = Field(max_length=64, pattern=r"^/torch_[0-9]+_[0-9]+_[0-9]+$")
    nbytes: Count


class CudaHandle(Strict):
    """A CUDA bucket: the arguments of torch's rebuild_cuda_tensor (rlslurm/sync/ipc.py encode_cuda)."""

    kind: Literal["cuda"]
    tensor_cls: Literal["Tensor"]
    storage_cls: Literal["TypedStorage", "UntypedStorage"]
    dtype: Dtype
    size: list[Count] = Field(max_length=16)
    stride: list[Count] = Field(max_length=16)
    tensor_offset: Count
    device: int = Field(ge=0, le=1024)
    handle: Base64
    storage_size_bytes: Count
    storage_offset_bytes: Count
    requires_grad: bool
    ref_counter_handle: Base64
    ref_counter_offset: Count
    event_handle: Base64 | None
    event_sync_required: bool


class Ready(Strict):
    fifo: Path
    generation: int = Field(ge=0, le=2**62)


class UpdateIpc(Strict):
    manifest: Manifest
    bucket_bytes: int = Field(ge=1, le=MAX_BYTES)
    handles: list[Annotated[ShmHandle | CudaHandle, Field(discriminator="kind")]] = Field(max_length=MAX_TENSORS)
    ready: Ready | None = None
    timeout_s: Seconds = 60.0


Checksum = Annotated[str, Field(max_length=256)]


class Verify(Strict):
    """The trainer's checksum of every tensor the engine serves (a missing one fails VERIFY)."""

    expected: dict[Annotated[str, Field(max_length=MAX_NAME)], Checksum] = Field(max_length=MAX_TENSORS)


class Resume(Strict):
    version: int = Field(ge=0, le=2**62)
    unverified_ok: bool = False


def completion_body(req: CompletionRequest, model: str, results: list) -> dict:
    """The OpenAI completions body of one request's results (a list per prompt of the engine's
    Completions), with the policy version that made them, per choice and for the whole answer."""
    choices: list[dict] = []
    versions = set()
    prompt_tokens = completion_tokens = 0
    for per_prompt in results:
        prompt_tokens += len(per_prompt[0].prompt_token_ids)
        for c in per_prompt:
            versions.add(c.version)
            completion_tokens += len(c.token_ids)
            logprobs = None
            if req.logprobs is not None:
                logprobs = {"tokens": [str(t) for t in c.token_ids], "token_logprobs": c.logprobs,
                            "top_logprobs": None, "text_offset": None}
            choices.append({"index": len(choices), "text": c.text, "finish_reason": c.finish_reason,
                            "logprobs": logprobs, "token_ids": c.token_ids, "token_logprobs": c.logprobs,
                            "policy_version": c.version})
    (version,) = versions  # one batch, one version: the batcher never mixes them
    body = {"id": f"cmpl-{time.time_ns():x}", "object": "text_completion", "created": int(time.time()),
            "model": req.model or model, "choices": choices, "policy_version": version,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    return body
