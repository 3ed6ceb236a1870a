"""The rollout engine interface, and the transformers engine behind it (the CPU default).

An engine loads a model from a Hugging Face directory (config.json + safetensors + tokenizer),
generates n samples per prompt in one batched `generate` call with a KV cache, and returns for
every sample its tokens, per-token logprobs and the policy `version` of the weights that made it.
`named_weights()` yields exactly the tensors it serves (what VERIFY checksums) and `load_weights()`
copies new values into them in place. An engine that can take new tensors by reference
(`adopts_weights`, HFEngine) lets a sync stage the next version beside the served one and swap it in
with `adopt_weights()` once verified: no copy, and the old version stays whole for a rollback.
(rollout.engine vllm is vLLM's own server, rollout/vllm_serve.py: not an Engine of this interface.)

    engine = HFEngine("runs/x/checkpoints/step-00000010/hf")
    [[c]] = engine.generate(["2 + 3 ="], SamplingParams(temperature=0.0, max_new_tokens=4))
    c.token_ids, c.logprobs, c.version
"""

from __future__ import annotations

import abc
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Protocol, Sequence

import torch

from rlslurm.sync.landing import WeightLoadError  # raised here too; defined where an update lands

Prompt = str | list[int]


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """0 = greedy."""
    max_new_tokens: int = 16
    """Tokens generated per sample at most."""
    seed: int | None = None
    """Seed of the sampling RNG for this call; None continues the engine's stream."""

    def batch_key(self) -> tuple | None:
        """Requests with equal keys can share one `generate` call; None = runs alone (seeded)."""
        return None if self.seed is not None else (self.temperature, self.max_new_tokens)


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    """Log-probability of each generated token under the served weights at temperature 1."""
    finish_reason: str
    """'stop' (end-of-sequence token) or 'length' (max_new_tokens reached)."""
    version: int
    """Policy version of the weights that generated this sample."""
    prompt_token_ids: list[int] = field(default_factory=list)


class Control(Protocol):
    """How the server steers a `generate` call in progress (rlslurm/rollout/batcher.py)."""

    def step(self) -> Sequence[bool] | None:
        """Called once per decoding step (a sign of progress). Returns, per prompt of the call, whether to
        stop generating for it now (its caller left, its deadline passed, the server stops), or None."""


def model_facts(model_dir: str | Path) -> tuple[int | None, int | None]:
    """(vocab_size, context length = max_position_embeddings) from a Hugging Face config.json; None where
    it does not say (a multimodal config keeps them in text_config)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config") or {}
    return (config.get("vocab_size") or text.get("vocab_size"),
            config.get("max_position_embeddings") or text.get("max_position_embeddings"))


class Engine(abc.ABC):
    """What the server and the sync protocol need from an engine; one generate runs at a time."""

    model_name: str
    version: int
    tokenizer: object
    """The model's own Hugging Face tokenizer (a callable returning input_ids)."""
    vocab_size: int | None = None
    """Token ids a prompt may hold are [0, vocab_size) (the embedding's rows)."""
    context_tokens: int | None = None
    """Prompt + generated tokens one sequence may hold (max_position_embeddings of the served model)."""

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text through the model's tokenizer, or ids as they came."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return [int(t) for t in prompt]

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams,
                 control: Control | None = None) -> list[list[Completion]]:
        """n completions per prompt, all stamped with the current version. With `control`, it is asked at
        every decoding step which prompts to stop; a stopped prompt's completions are cut short."""

    @abc.abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors being served, under Hugging Face names (tied aliases once)."""

    @abc.abstractmethod
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy new values into served tensors in place; returns bytes loaded. Unknown names raise."""

    adopts_weights: bool = False
    """True if `adopt_weights` can serve new tensors by reference (else updates are copied in place)."""

    def adopt_weights(self, named: dict[str, torch.Tensor]) -> int:
        """Serve these tensors from now on, by reference, all or none; returns bytes adopted."""
        raise NotImplementedError(f"{type(self).__name__} copies updates in place (adopts_weights = False)")

    def checksums(self) -> dict[str, str]:
        """Per-tensor checksums of the served weights (what VERIFY compares); engines whose weights
        live in another process compute them there."""
        from rlslurm.sync.checksum import checksums

        return checksums(self.named_weights())

    def close(self) -> None:
        """Release what the engine holds beyond this process."""
        return None  # an in-process engine (HFEngine) holds nothing beyond this process


class HFEngine(Engine):
    """transformers `AutoModelForCausalLM` + `generate`; float32 on CPU by default."""

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", dtype: str = "float32",
                 version: int = 0, name: str | None = None, lora=None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir = Path(model_dir)
        self.model_name = name or self.model_dir.name
        self.version = version
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.vocab_size, self.context_tokens = model_facts(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, dtype))
        if lora is not None and lora.enabled:
            # train.lora: the trainer's LoRA layers (rlslurm/lora.py), so a sync sends the adapters alone and
            # VERIFY checks the adapters served; B starts at zero, so until the first sync this serves the base.
            from rlslurm.lora import inject

            self.model = inject(self.model, lora)
        self.model.to(self.device).eval()
        self.eos_id = self.tokenizer.eos_token_id
        if self.eos_id is None:
            self.eos_id = self.model.generation_config.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        self._lock = threading.Lock()  # generate and load_weights never overlap

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams,
                 control: Control | None = None) -> list[list[Completion]]:
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        encoded = [self.encode(p) for p in prompts]
        if any(not ids for ids in encoded):
            raise ValueError("a prompt encodes to zero tokens")
        rows = [ids for ids in encoded for _ in range(params.n)]
        width = max(len(r) for r in rows)
        # Left padding keeps every row's last prompt token in the same column, where decoding starts.
        input_ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        greedy = params.temperature == 0
        config = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else params.temperature,
            top_k=None, top_p=None, max_new_tokens=params.max_new_tokens,
            pad_token_id=self.pad_id, eos_token_id=self.eos_id,
            return_dict_in_generate=True,
        )
        recorder = _ChosenLogprobs()
        with self._lock, torch.no_grad():
            version = self.version
            if params.seed is not None:
                torch.manual_seed(params.seed)
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config,
                                      logits_processor=LogitsProcessorList([recorder]),
                                      stopping_criteria=StoppingCriteriaList([_steer(control, params.n)]
                                                                             if control is not None else []))
        new = out.sequences[:, width:]
        chosen = recorder.finish(new)
        results: list[list[Completion]] = [[] for _ in prompts]
        for row in range(len(rows)):
            tokens = new[row].tolist()
            stop = self.eos_id is not None and self.eos_id in tokens
            length = tokens.index(self.eos_id) + 1 if stop else len(tokens)
            tokens = tokens[:length]
            p = row // params.n
            results[p].append(Completion(
                prompt_index=p, sample_index=row % params.n,
                text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                token_ids=tokens, logprobs=chosen[row, :length].tolist(),
                finish_reason="stop" if stop else "length", version=version,
                prompt_token_ids=encoded[p],
            ))
        return results

    # -- weights -----------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        for name, tensor in self.model.state_dict().items():
            # Tied embeddings: one storage, sent and checked once. Empty tensors may share an address
            # with a neighbour inside an adopted bucket, so they never count as aliases.
            if tensor.numel() and tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            yield name, tensor

    adopts_weights = True

    def adopt_weights(self, named: dict[str, torch.Tensor]) -> int:
        # keep_vars: the Parameter objects themselves (tied weights are one object under two names),
        # whose `.data` is swapped; a plain state_dict() would hand out detached aliases.
        served = self.model.state_dict(keep_vars=True)
        for name, tensor in named.items():  # check everything before swapping anything: all or none
            _check_fits(self.model_name, name, served.get(name), tensor)
            if tensor.device != served[name].device:
                raise WeightLoadError(f"tensor {name!r}: engine serves it on {served[name].device}, "
                                      f"the update is on {tensor.device}")
        with self._lock, torch.no_grad():
            for name, tensor in named.items():
                served[name].data = tensor
        return sum(t.numel() * t.element_size() for t in named.values())

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        served = self.model.state_dict()
        loaded = 0
        with self._lock, torch.no_grad():
            for name, tensor in named:
                target = served.get(name)
                _check_fits(self.model_name, name, target, tensor)
                target.copy_(tensor)
                loaded += tensor.numel() * tensor.element_size()
        return loaded


class _ChosenLogprobs:
    """A logits processor that keeps, per row and step, the log-probability (temperature 1) of the token generated:
    at step t + 1 the token of step t is the last of input_ids. transformers applies the caller's processors
    before the temperature warper, so `scores` are the raw logits. Why not output_logits: it holds every step's
    logits, steps x rows x vocab floats, three times over (stacked, log-softmaxed): 22 GB resident, OOM-killed,
    for HumanEval's 82 prompts x 384 tokens with SmolLM2's 49k vocab; this holds one step's."""

    def __init__(self):
        self.previous: torch.Tensor | None = None  # the last step's log-softmax, rows x vocab
        self.chosen: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.chosen.append(self.previous.gather(-1, input_ids[:, -1:])[:, 0])
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, new: torch.Tensor) -> torch.Tensor:
        """rows x steps: the log-probabilities of `new` (the generated tokens; their last step's token is not
        in any input_ids the processor saw)."""
        if self.previous is not None:
            self.chosen.append(self.previous.gather(-1, new[:, len(self.chosen), None])[:, 0])
            self.previous = None
        return torch.stack(self.chosen, dim=1) if self.chosen else torch.zeros(new.shape[0], 0)


def _steer(control: Control, n: int):
    """A transformers StoppingCriteria that asks `control` at every step which rows (n per prompt) stop."""
    from transformers import StoppingCriteria

    class Steer(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            flags = control.step()
            rows = input_ids.shape[0]
            if not flags:
                return torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
            return torch.tensor([bool(flags[r // n]) for r in range(rows)], dtype=torch.bool, device=input_ids.device)

    return Steer()


def _check_fits(model: str, name: str, target: torch.Tensor | None, tensor: torch.Tensor) -> None:
    if target is None:
        raise WeightLoadError(f"engine {model} serves no tensor named {name!r}")
    if tuple(target.shape) != tuple(tensor.shape) or target.dtype != tensor.dtype:
        raise WeightLoadError(
            f"tensor {name!r}: engine has {target.dtype} {tuple(target.shape)}, "
            f"update has {tensor.dtype} {tuple(tensor.shape)}")
