"""The RL entrance: GRPO on the task, with rollout engines, a reward, and verified weight sync.

    rlslurm submit examples/tiny-grpo.yaml            # starts from train.init_from (the SFT export) as it is
    rlslurm submit examples/smollm2-grpo.yaml         # a real pretrained model, chat template (docs/real-model.md)

Every trainer rank runs `run(job, run_dir)`; rank 0 is also the controller. One step reads like the
diagram in DESIGN.md, each phase inside the phase guard:

    prompts -> rollout (engines) -> reward -> advantages -> train (DDP) -> sync (DRAIN/UPDATE/VERIFY/RESUME)
    -> metrics -> checkpoint

Engines are separate server processes (rlslurm/rollout/server.py): on SLURM with separate placement
the rollout het component runs them (`run_engine`) and they announce themselves in <run>/endpoints/;
colocated (a plain SLURM job) or off SLURM the controller spawns them beside itself. Samples carry the
policy version that produced them.

Drain (USR1, `rlslurm drain`, SIGTERM): the trainer ranks agree at a step boundary, the controller
drains the engines, rank 0 checkpoints (model, optimizer, every rank's RNG, step = data position,
policy version, eval history) and requeues the whole het job; the next start resumes at that step and
version and syncs the new engines to it. Engine sampling is seeded by (train.seed, step, engine), so
a resumed run draws the same samples: tests/cluster/test_rl_slurm.py holds it to the uninterrupted
run's reward/loss trajectory.

The reward (`reward.service`): `inline` scores in the controller with the task's rule; `local` (the
example's default) runs the supervised reward service (rlslurm/reward/) beside the controller; `component`
runs it in a het component of its own on `reward.partition` (`run_reward`, announced in
<run>/endpoints/reward.json). Each engine's responses go to the service as they arrive, `reward.batch_size`
per request; a response it cannot score is degraded by `reward.degrade`, and each step's metrics count
reward_degraded, reward_degraded_ratio, reward_dropped and reward_restarts (see docs/reward-service.md).

Whether it learns depends less on this file than on where it starts: from a cosine-annealed SFT minimum
the first steps of a fresh Adam lose accuracy whatever the loss (plain SFT does the same); from the
constant-lr SFT of examples/tiny-sft.yaml, GRPO at lr 3e-4 takes held-out accuracy 0.374 -> 0.594 in 60
steps (tests/integration/test_rl_learns.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rlslurm import events, lifecycle
from rlslurm.checkpoint import Checkpoint, CheckpointWriter, IntervalPolicy
from rlslurm.config import JobConfig
from rlslurm.diag.drain_gate import DrainGate, agreed_reason
from rlslurm.diag.env_diff import compare, read_fingerprints, write_fingerprint
from rlslurm.diag.guard import PhaseGuard
from rlslurm.dist import Topology, compute_device, free_port, init_process_group
from rlslurm.errors import RlslurmError
from rlslurm.lifecycle import ExitCode
from rlslurm.reward.config import RewardConfig
from rlslurm.rl.experience import (Experience, GroupAssembler, Sample, build_samples, choice_id,  # noqa: F401
                                  group_advantages)
from rlslurm.rl.pipeline import THREADED_ENV, ExperiencePipeline, stamp_staleness
from rlslurm.rundir import RunDir
from rlslurm.tasks.arithmetic import ANSWER_FORMAT, Problem, make_splits
from rlslurm.tasks.prompts import PromptFormat
from rlslurm.tinymodel import build_model, load_hf, save_hf
from rlslurm.tokenizer import PAD_ID

log = logging.getLogger("rlslurm.jobs.rl")


# Sample, Experience, group_advantages and build_samples: rlslurm/rl/experience.py (imported above, and
# re-exported: the experience pipeline builds them outside this job).


# -- the policy on every rank ------------------------------------------------------------------------

class Policy:
    """The trained model (DDP), its optimizer and the optional frozen reference for the KL term."""

    def __init__(self, job: JobConfig, topo: Topology, model_dir: Path):
        self.job, self.topo = job, topo
        model, self.tokenizer = load_hf(model_dir)  # the tokenizer: the controller's, and the export's
        self.device = compute_device()
        self.model = model.float().to(self.device)
        self.ddp = DistributedDataParallel(self.model) if topo.world_size > 1 else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=job.train.lr,
                                           weight_decay=job.train.weight_decay)
        self.reference = None
        if job.rl.kl_coef > 0:
            self.reference, _ = load_hf(model_dir)
            self.reference.float().to(self.device).eval().requires_grad_(False)

    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors the engines serve, in Hugging Face names; a tied tensor once, under its first name
        (the engine dedups the same way: `lm_head.weight` is `model.embed_tokens.weight`)."""
        out, seen = {}, set()
        for name, tensor in self.model.state_dict().items():
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            out[name] = tensor.detach()
        return out

    @staticmethod
    def _logprobs(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Log-probability of every token given the ones before it: column t scores ids[:, t + 1]."""
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]

    def update(self, samples: list[Sample], guard: PhaseGuard, *, step_total: int | None = None) -> dict:
        """One clipped policy-gradient step on this rank's share; DDP averages the gradients.

        The ratio is pi_theta / pi_behaviour. A fresh sample (staleness 0) was sampled by these very
        weights, so its behaviour logprobs are the trainer's own (`old`, equal to `new` in value): the
        ratio is exactly 1 and the clip idle. A stale one (rl.max_staleness > 0) was sampled by an older
        policy: its behaviour logprobs are the engine's, and where the policy has since moved a token past
        1 +- clip_eps in the direction of its advantage, the clip stops the gradient (PPO's trust region),
        so running ahead cannot compound an update the fresh samples would not make.
        """
        clip = self.job.rl.clip_eps
        self.optimizer.zero_grad(set_to_none=True)
        if not samples:
            if not step_total:  # no rank has a sample (every group had zero variance): every rank skips
                return {"loss": 0.0, "tokens": 0, "kl": 0.0, "grad_norm": 0.0}
            # Peers train this step: join DDP's all-reduce with a zero loss through the DDP wrapper (its
            # hooks fire only after a forward through it) and take the optimizer step on the averaged
            # gradient like them, or this rank's weights drift away from theirs.
            ids = torch.full((1, 2), PAD_ID, dtype=torch.long, device=self.device)
            loss = self._logprobs(self.ddp, ids, torch.ones_like(ids)).sum() * 0.0
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                       self.job.train.grad_clip or float("inf"))
            self.optimizer.step()
            return {"loss": 0.0, "tokens": 0, "kl": 0.0, "grad_norm": float(grad_norm)}
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        ids = torch.full((len(samples), width), PAD_ID, dtype=torch.long)
        attn = torch.zeros_like(ids)
        loss_mask = torch.zeros((len(samples), width - 1))
        for i, s in enumerate(samples):
            seq = s.prompt_ids + s.response_ids
            ids[i, : len(seq)] = torch.tensor(seq)
            attn[i, : len(seq)] = 1
            # position t predicts token t+1: response tokens are predicted from len(prompt)-1 on
            loss_mask[i, len(s.prompt_ids) - 1: len(seq) - 1] = 1.0
        ids, attn, loss_mask = ids.to(self.device), attn.to(self.device), loss_mask.to(self.device)
        adv = torch.tensor([s.advantage for s in samples], device=self.device)[:, None]
        with torch.no_grad():
            old = self._logprobs(self.model, ids, attn)
        behaviour = old
        stale = [i for i, s in enumerate(samples) if s.staleness > 0]
        if stale:
            behaviour = old.clone()
            for i in stale:
                s = samples[i]
                behaviour[i, len(s.prompt_ids) - 1: len(s.prompt_ids) - 1 + len(s.engine_logprobs)] = \
                    torch.tensor(s.engine_logprobs, device=self.device)
        new = self._logprobs(self.ddp, ids, attn)
        ratio = torch.exp(new - behaviour)
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
        tokens = loss_mask.sum().clamp(min=1.0)
        # GRPO's sequence-level mean: every response weighs the same whatever its length, so a long wrong
        # answer does not outvote a short right one.
        per_seq = loss_mask.sum(1).clamp(min=1.0)
        loss = -((surrogate * loss_mask).sum(1) / per_seq).mean()
        kl = torch.tensor(0.0, device=self.device)
        if self.reference is not None:
            with torch.no_grad():
                ref = self._logprobs(self.reference, ids, attn)
            # k3 estimator (Schulman): unbiased, always >= 0
            kl = (((torch.exp(ref - new) - (ref - new) - 1) * loss_mask).sum(1) / per_seq).mean()
            loss = loss + self.job.rl.kl_coef * kl
        guard.beat()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                   self.job.train.grad_clip or float("inf"))
        self.optimizer.step()
        guard.beat()
        # The engine sampled a fresh sample with exactly these weights: a gap means a sync or masking bug.
        # A stale sample's gap is how far the policy moved since; the clip fraction says how much it bit.
        fresh = [(i, s) for i, s in enumerate(samples) if s.staleness == 0]
        engine_lp = [lp for _, s in fresh for lp in s.engine_logprobs]
        trainer_lp = [old[i, len(s.prompt_ids) - 1 + j].item() for i, s in fresh for j in range(len(s.engine_logprobs))]
        gap = max((abs(a - b) for a, b in zip(engine_lp, trainer_lp)), default=0.0)
        with torch.no_grad():
            clipped = ((ratio - 1).abs() > clip).float()
            clip_fraction = float((clipped * loss_mask).sum() / tokens)
            drift = float(((old - behaviour).abs() * loss_mask).sum() / tokens)
        return {"loss": float(loss.detach()), "tokens": int(tokens), "kl": float(kl.detach()),
                "grad_norm": float(grad_norm), "engine_trainer_logprob_gap": gap, "clip_fraction": clip_fraction,
                "stale_logprob_drift": drift}


def make_policy(job: JobConfig, topo: Topology, model_dir: Path):
    """train.backend: torch = Policy above (DDP); megatron = rlslurm/megatron/policy.py (same interface,
    GPU only: on CPU it raises an RlslurmError naming the fix)."""
    if job.train.backend == "megatron":
        from rlslurm.megatron.policy import MegatronPolicy

        return MegatronPolicy(job, topo, model_dir)
    return Policy(job, topo, model_dir)


# -- the controller (rank 0) ---------------------------------------------------------------------------

class Engines:
    """The rollout engines the controller talks to: announced by the rollout het component (separate
    placement on SLURM), or spawned here beside rank 0 (colocated, or any run off SLURM)."""

    def __init__(self, job: JobConfig, run: RunDir, model_dir: Path):
        from rlslurm.rollout.client import EngineClient, spawn_engine

        self.run = run
        self.processes = []
        if os.environ.get("SLURM_HET_SIZE", "1") != "1":
            urls = wait_for_endpoints(run, job.rollout.engines, job.rollout.request_timeout_s,
                                      job_id=lifecycle.leader_job_id(), restart_count=lifecycle.restart_count())
            self.clients = [EngineClient(url, job.rollout.request_timeout_s) for url in urls]
            for client in self.clients:  # an engine announces itself before its server listens
                client.wait_ready(job.rollout.request_timeout_s)
        else:
            node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
            for i in range(job.rollout.engines):
                proc = spawn_engine(model_dir, port=free_port(), log_path=run.logs / f"engine-{i}.log",
                                    extra_args=engine_args(job),
                                    env={"RLSLURM_RUN_DIR": str(run.path), "RLSLURM_ROLE": "rollout",
                                         "RLSLURM_RANK": str(i),
                                         # the vLLM engine's share of a GPU (rollout/vllm_engine.py)
                                         "RLSLURM_GPU_MEMORY_UTILIZATION": str(job.rollout.gpu_memory_utilization)},
                                    timeout_s=job.rollout.request_timeout_s,
                                    engine=job.rollout.engine, python=job.rollout.python)
                self.processes.append(proc)
                # A spawned engine is no SLURM task of its own, so it is recorded here: on SLURM this is
                # where a colocated engine shows it shares the trainer's node.
                run.append_json(run.path / "placement.jsonl", {
                    "t": time.time(), "role": "rollout", "rank": i, "node": node,
                    "partition": os.environ.get("SLURM_JOB_PARTITION"), "job_id": lifecycle.leader_job_id(),
                    "restart_count": lifecycle.restart_count(), "pid": proc.proc.pid, "colocated": True})
            self.clients = [p.client for p in self.processes]

    def drain(self, timeout_s: float) -> None:
        """The engines' part of a job drain: refuse new prompts, finish the ones in flight (bounded).

        The controller calls it once the trainer ranks agreed on the drain step, not the engines on
        their own signal: an engine that refused prompts in the middle of a step would fail that step.
        """
        from rlslurm.rollout.client import EngineRequestError

        states = {}
        for client in self.clients:
            try:
                answer = client.drain(timeout_s)
                states[client.url] = {"state": answer["state"], "waited_s": round(answer["waited_s"], 3),
                                      "version": answer["version"]}
            except EngineRequestError as e:  # the job checkpoints and requeues whatever an engine says
                states[client.url] = {"state": "unknown", "error": str(e)}
        events.emit(self.run, "engines_drained", role="controller", engines=states)

    def stop(self) -> None:
        for proc in self.processes:
            proc.stop()
        for client in self.clients:
            client.close()


def engine_args(job: JobConfig) -> list[str]:
    """Server flags of every engine of the job: one torch CPU thread, and the hf engine on the node's GPU
    where it has one (vLLM places itself)."""
    gpu = job.rollout.engine == "hf" and torch.cuda.is_available()
    return ["--threads", "1", *(["--device", "cuda"] if gpu else [])]


def wait_for_endpoints(run: RunDir, count: int, timeout_s: float, *, job_id: str | None, restart_count: int,
                       poll_s: float = 0.5) -> list[str]:
    """URLs of `count` engines of this start of the job, from <run>/endpoints/engine-*.json (polled,
    bounded). A requeued job finds the files of its previous allocation there until its new engines
    overwrite them: only files stamped with this job id and restart count count."""
    folder = run.path / "endpoints"
    deadline = time.monotonic() + timeout_s
    while True:
        found, stale = [], 0
        for path in sorted(folder.glob("engine-*.json")) if folder.is_dir() else []:
            record = json.loads(path.read_text())
            if (record.get("job_id"), record.get("restart_count")) == (job_id, restart_count):
                found.append(record["url"])
            else:
                stale += 1
        if len(found) >= count:
            return found[:count]
        if time.monotonic() > deadline:
            raise RlslurmError(f"only {len(found)} of {count} rollout engines of job {job_id} restart {restart_count} "
                               f"announced themselves in {folder} within {timeout_s:.0f} s ({stale} stale files "
                               f"of earlier starts); see {run.logs}/rollout-*.log")
        log.info("waiting for %d engine endpoints in %s (%d so far, %d stale)", count, folder, len(found), stale)
        time.sleep(poll_s)


def sync_host() -> str:
    """Where engines reach the broadcast group's store on this (rank 0) process: its node's address on
    SLURM (engines on the rollout nodes connect to it), loopback elsewhere (engines beside us)."""
    from rlslurm.dist import node_address

    node = os.environ.get("SLURMD_NODENAME")
    return node_address(node) if node else "127.0.0.1"


def reward_config(job: JobConfig) -> RewardConfig:
    """job.reward as the service must score this task: the rule scorer also checks the task's one answer
    form (ANSWER_FORMAT), unless reward.format_regex names another, so it scores as `score` does."""
    if job.reward.scorer == "rule" and job.reward.format_regex is None:
        return dataclasses.replace(job.reward, format_regex=ANSWER_FORMAT)
    return job.reward


def open_reward_session(job: JobConfig, run: RunDir):
    """None for reward.service = inline (the controller scores); else the service's session: the reward
    component's (announced in <run>/endpoints/reward.json) on SLURM, else a supervised one started here."""
    if job.reward.service == "inline":
        return None
    from rlslurm.reward.session import RewardSession

    # Off SLURM there is no reward component: `component` runs the same service beside the controller.
    component = job.reward.service == "component" and os.environ.get("SLURM_HET_SIZE", "1") != "1"
    return RewardSession.open(reward_config(job), run, diag=job.diag, component=component)


class Controller:
    """Rank 0: prompts, rollout, reward, advantages, sync, evaluation."""

    def __init__(self, job: JobConfig, run: RunDir, model_dir: Path, tokenizer):
        from rlslurm.sync.protocol import WeightSync, transport_for

        self.job, self.run, self.tokenizer = job, run, tokenizer
        # task.prompt_style / task.answer: the text an engine is sent for a task prompt, the rule it is scored by
        self.format = PromptFormat(job.task, tokenizer, model_dir=model_dir)
        self.train_set, self.held_out = make_splits(job.task)
        self.engines = Engines(job, run, model_dir)
        placement = "colocate" if job.placement.mode == "colocate" else "separate"
        self.transport = transport_for(job.sync, placement_mode=placement, weights_dir=run.path / "weights",
                                       host=sync_host())
        self.sync = WeightSync(self.engines.clients, self.transport, job.sync, run=run)
        self.rewards = None
        self.pipeline: ExperiencePipeline | None = None  # from the first step on (start_experience)
        try:
            self.rewards = open_reward_session(job, run)
        except BaseException:
            self.close()  # the engines it spawned must not outlive a controller that never started
            raise

    def close(self) -> None:
        pipeline = getattr(self, "pipeline", None)
        if pipeline is not None:
            pipeline.stop()  # first: the engines and the reward service go away below
        if getattr(self, "rewards", None) is not None:
            self.rewards.close()
        self.transport.close()
        self.engines.stop()
        if pipeline is not None:
            pipeline.close()  # its HTTP call in flight failed just now: it ends

    def check_env(self) -> None:
        """Before the first sync: every rank and engine on one torch (and NCCL) when broadcasting."""
        diff = compare(read_fingerprints(self.run.path), sync_method=self.transport.name)
        if diff.errors or diff.warnings:
            events.emit(self.run, "env_diff", report=diff.render(), ok=diff.ok)
        diff.raise_errors()

    def prompts(self, step: int) -> list[Problem]:
        """The step's prompts: a function of (seed, step) alone, so a resumed job draws the same ones."""
        rng = random.Random(self.job.train.seed * 1_000_003 + step)
        return rng.sample(self.train_set, self.job.rl.prompts_per_step)

    def rollout(self, problems: list[Problem], step: int, guard: PhaseGuard,
                on_choices=None) -> tuple[list[dict], list[float]]:
        """k samples per prompt from the engines, all asked at once (a step's rollout takes the slowest
        engine's time, not their sum); prompts split across engines in a fixed order. `on_choices(batch)`
        gets each engine's responses in this thread as they arrive, so the reward service scores them
        while the other engines still generate. Returns the choices in prompt order and each engine's
        seconds for its share."""
        cfg, n_eng, k = self.job.rollout, len(self.engines.clients), self.job.rl.samples_per_prompt
        shares = {i: [self.format.text(p.prompt) for j, p in enumerate(problems) if j % n_eng == i]
                  for i in range(n_eng)}

        def ask(i: int) -> tuple[int, dict, float]:
            t = time.monotonic()
            out = self.engines.clients[i].completions(shares[i], n=k, max_tokens=cfg.max_new_tokens,
                                                      temperature=cfg.temperature,
                                                      seed=self.job.train.seed * 7919 + step * 31 + i)
            return i, out, time.monotonic() - t

        choices: list[dict] = []
        engine_s = [0.0] * n_eng
        asked = [i for i in range(n_eng) if shares[i]]
        # One thread per engine: each waits on its HTTP answer; a failed request raises here after the
        # others answered (or hit rollout.request_timeout_s).
        with ThreadPoolExecutor(max_workers=max(1, len(asked)), thread_name_prefix="rollout") as pool:
            for done in as_completed([pool.submit(ask, i) for i in asked]):
                i, out, engine_s[i] = done.result()
                guard.beat()
                # back to prompt order: engine i holds prompts i, i + n_eng, ...
                batch = [{**c, "engine": i, "prompt_index": (m // k) * n_eng + i}
                         for m, c in enumerate(out["choices"])]
                if on_choices is not None:
                    on_choices(batch)
                choices.extend(batch)
        return sorted(choices, key=lambda c: (c["prompt_index"], c["index"])), engine_s

    def reward_item(self, problems: list[Problem], choice: dict):
        """One response as the reward service scores it: normalised text (task.answer = lenient: the integer
        it states) against the task's answer."""
        from rlslurm.reward.scorers import Item

        problem = problems[choice["prompt_index"]]
        return Item(id=choice_id(choice), response=self.format.answer_text(choice["text"]), prompt=problem.prompt,
                    reference=problem.target)

    # -- one step's experience: made here (synchronous) or ahead by the pipeline (rlslurm/rl/pipeline.py) --

    def start_experience(self, step: int, version: int, rl_state: dict) -> None:
        """The experience pipeline from `step` on (trainer at `version`, engines serving it), with what a
        checkpoint buffered ahead; a buffered step older than rl.max_staleness allows now is made again."""
        k = self.job.rl.max_staleness
        buffered = {}
        for entry in rl_state.get("experience_buffer", []):
            m, exp = int(entry["step"]), Experience.from_json(entry["experience"])
            if m >= step and max((version + m - step - v for v in exp.response_versions), default=0) <= k:
                buffered[m] = exp
        self.pipeline = ExperiencePipeline(self._rollout_step, self._finish_step, max_staleness=k,
                                           first_step=step, last_step=self.job.train.steps, buffered=buffered,
                                           threaded=os.environ.get(THREADED_ENV) == "1" or None).start()
        if self.pipeline.restored:
            events.emit(self.run, "experience_restored", role="controller", steps=self.pipeline.restored)

    def experience(self, step: int, version: int, guard: PhaseGuard) -> Experience:
        """The experience step `step` trains on at `version`, each sample stamped with its staleness; raises
        StalenessError for one more than rl.max_staleness versions old (a broken schedule)."""
        if getattr(self, "pipeline", None) is None:
            self.start_experience(step, version, {})
        exp = self.pipeline.take(step, guard)
        exp.stats.update(stamp_staleness(exp, version, self.job.rl.max_staleness, step))
        return exp

    def sync_weights(self, weights: dict[str, torch.Tensor], *, step: int, version: int, guard: PhaseGuard) -> dict:
        """DRAIN -> UPDATE -> VERIFY -> RESUME to `version` (the policy at step boundary `step`), between two
        rollouts: the ones scheduled on older weights finish first, the ones scheduled on these start
        after (rlslurm/rl/pipeline.py). Returns the sync's metrics."""
        t = time.monotonic()
        self.pipeline.before_sync(step, guard)
        waited_s = time.monotonic() - t
        metrics = self.sync.sync(weights, version=version).metrics()
        self.pipeline.synced(step)
        return {**metrics, "sync_wait_rollout_s": waited_s}

    def experience_buffer(self, step: int, guard: PhaseGuard) -> list[dict]:
        """The experience made ahead of step boundary `step` (rl.max_staleness > 0), for the RL state of a
        checkpoint there: the resumed run trains on it as the uninterrupted run would have."""
        return [{"step": m, "experience": exp.to_json()} for m, exp in self.pipeline.buffered(step, guard).items()]

    @staticmethod
    def forget_experience(step: int, rl_state: dict) -> None:
        """Step `step` was abandoned (SLURM stops the job): keep it out of the drain checkpoint's buffer, so
        the resumed job makes it again rather than train on what the stopping services returned."""
        if "experience_buffer" in rl_state:
            rl_state["experience_buffer"] = [e for e in rl_state["experience_buffer"] if e["step"] != step]

    def _rollout_step(self, step: int, guard) -> dict:
        """Step `step`'s prompts through the engines. Each engine's responses are scored as they arrive (the
        rule right here, or the service's requests meanwhile) and a prompt's group gets its advantages as
        soon as its last reward lands (GroupAssembler); `_finish_step` waits for what is still open."""
        with guard.phase("data", step=step):
            problems = self.prompts(step)
        assembler = GroupAssembler(problems, self.job.rl.samples_per_prompt,
                                   self.format.encode)
        scoring = self.rewards.begin(step) if self.rewards is not None else None

        def arrived(batch: list[dict]) -> None:
            assembler.add_choices(batch)
            if scoring is None:
                assembler.add_rewards({choice_id(c): self.format.score(problems[c["prompt_index"]], c["text"])
                                       for c in batch})
            else:
                scoring.submit([self.reward_item(problems, c) for c in batch],
                               on_outcomes=lambda outcomes: assembler.add_rewards({o.id: o.score for o in outcomes}))

        t = time.monotonic()
        with guard.phase("rollout", step=step):
            choices, engine_s = self.rollout(problems, step, guard, on_choices=arrived)
        return {"step": step, "choices": choices, "assembler": assembler, "scoring": scoring,
                "rollout_s": time.monotonic() - t, "rollout_engine_s": engine_s}

    def _finish_step(self, flight: dict, guard) -> Experience:
        """The rest of a step: the rewards the rollout did not hide, the last groups' advantages, stats."""
        step, choices, assembler = flight["step"], flight["choices"], flight["assembler"]
        t = time.monotonic()
        with guard.phase("reward", step=step):
            reward_stats = {"reward_degraded": 0, "reward_degraded_ratio": 0.0, "reward_dropped": 0,
                            "reward_restarts": 0}
            if flight["scoring"] is not None:
                outcomes, reward_stats = flight["scoring"].finish(guard)
                assembler.add_rewards({o.id: o.score for o in outcomes})  # any a callback has not handed over
        reward_s = time.monotonic() - t
        with guard.phase("advantage", step=step):
            samples, dropped = assembler.samples()
        rewards = assembler.rewards()
        versions: dict[int, int] = {}
        for c in choices:
            versions[int(c["policy_version"])] = versions.get(int(c["policy_version"]), 0) + 1
        tokens = sum(len(c["token_ids"]) for c in choices)
        scored = [r for r in rewards if r is not None]
        stats = {"rollout_s": flight["rollout_s"], "rollout_engine_s": flight["rollout_engine_s"], "reward_s": reward_s,
                 "reward_mean": sum(scored) / max(len(scored), 1), "samples": len(choices),
                 "effective_samples": len(samples), "zero_variance_groups": dropped, "generated_tokens": tokens,
                 "tokens_per_s": tokens / max(flight["rollout_s"], 1e-9), **reward_stats}
        return Experience(samples, stats, versions)

    def evaluate(self) -> float:
        """Greedy held-out accuracy of the policy the engines serve now."""
        client = self.engines.clients[0]
        out = client.completions([self.format.text(p.prompt) for p in self.held_out], n=1, temperature=0.0,
                                 max_tokens=self.job.rollout.max_new_tokens)
        correct = sum(self.format.score(p, c["text"]) for p, c in zip(self.held_out, out["choices"]))
        return correct / len(self.held_out)


# -- checkpoints -------------------------------------------------------------------------------------

def save(run: RunDir, job: JobConfig, topo: Topology, policy: Policy, step: int, version: int, rl_state: dict) -> float:
    """Collective: every rank's RNG is gathered; rank 0 writes model, optimizer, RNG and RL state. An
    optimizer sharded over ranks (Megatron's) has its owners write their shards into rank 0's temp dir
    first, so the checkpoint is complete only with every shard in its manifest."""
    rngs = [None] * topo.world_size
    dist.all_gather_object(rngs, {"torch": torch.get_rng_state(), "python": random.getstate()})
    seconds = [0.0]
    with contextlib.ExitStack() as stack:
        ckpt = None
        if topo.is_main:
            ckpt = stack.enter_context(CheckpointWriter(run, step, policy_version=version, keep=job.checkpoint.keep,
                                                        metadata={"job": "rl", "world_size": topo.world_size}))
        for filename in _save_shards(policy, ckpt, topo):
            ckpt.add_written(filename)
        if ckpt is not None:
            ckpt.save_tensors("model", {k: v.contiguous() for k, v in policy.weights().items()})
            ckpt.save_state("optimizer", policy.optimizer.state_dict())
            ckpt.save_state("rng", rngs)
            ckpt.save_json("rl_state", {**rl_state, "step": step, "policy_version": version,
                                        "data_position": step})
    if ckpt is not None:
        seconds = [ckpt.saved.seconds]
    dist.broadcast_object_list(seconds, src=0)
    return seconds[0]


def _save_shards(policy, ckpt: CheckpointWriter | None, topo: Topology) -> list[str]:
    """Collective where the optimizer is sharded (it has `save_shards`): rank 0 names its temp dir, each
    rank writes its shard there; rank 0 gets every file name, the others []. The torch Policy's
    optimizer is whole on rank 0: nothing to do."""
    save_shards = getattr(policy.optimizer, "save_shards", None)
    if save_shards is None:
        return []
    where = [str(ckpt.tmp) if ckpt is not None else None]
    dist.broadcast_object_list(where, src=0)
    written = [None] * topo.world_size
    dist.all_gather_object(written, save_shards(Path(where[0])))
    return sorted(name for names in written for name in names) if ckpt is not None else []


def load(ckpt: Checkpoint, policy: Policy, topo: Topology) -> dict:
    """Weights, optimizer (a sharded one then takes this rank's shard: `load_shards`), RNG; the RL state."""
    state = ckpt.load_tensors("model")
    policy.model.load_state_dict(state, strict=False)
    policy.optimizer.load_state_dict(ckpt.load_state("optimizer"))
    load_shards = getattr(policy.optimizer, "load_shards", None)
    if load_shards is not None:
        load_shards(ckpt)
    rng = ckpt.load_state("rng")[topo.rank]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return ckpt.load_json("rl_state")


# -- the job -----------------------------------------------------------------------------------------

def initial_model_dir(job: JobConfig, run: RunDir, topo: Topology) -> Path:
    """train.init_from as it is (the SFT export), or the embedded model at random init written once."""
    if job.train.init_from:
        path = Path(job.train.init_from)
        if not (path / "config.json").is_file():
            raise RlslurmError(f"train.init_from = {job.train.init_from!r} holds no config.json: point it at an "
                               "SFT export (<sft run>/export/hf)")
        return path
    path = run.path / "export" / "init"
    if topo.is_main and not (path / "config.json").is_file():
        save_hf(build_model(job.model, seed=job.train.seed), path, max_new_tokens=job.rollout.max_new_tokens)
    dist.barrier()
    return path


def run(job: JobConfig, run_dir: str | Path) -> int:
    """One trainer rank of the RL job (rank 0 also drives the controller); returns the lifecycle code."""
    run_ = RunDir(Path(run_dir)).create()
    topo = Topology.detect()
    torch.set_num_threads(1)
    init_process_group(topo, job.train.dist_timeout_s)
    gate = DrainGate(run_, poll_interval_s=0.5, kill_wait_s=job.checkpoint.kill_wait_s)
    gate.install_signal_handlers()
    guard = PhaseGuard(run_, "train", topo.rank, job.diag, gate=gate)
    write_fingerprint(run_, "train", topo.rank)
    controller = None
    try:
        with guard:
            model_dir = initial_model_dir(job, run_, topo)
            policy = make_policy(job, topo, model_dir)
            controller = Controller(job, run_, model_dir, policy.tokenizer) if topo.is_main else None
            code = _loop(job, run_, topo, gate, guard, policy, controller)
            # Leave together (done or drained): a rank tearing gloo down while a peer still talks to
            # the store that rank 0 hosts aborted with "terminate called without an active exception".
            dist.barrier()
            return code
    finally:
        if controller is not None:
            controller.close()
        gate.restore_signal_handlers()
        dist.destroy_process_group()


def _start(job, run, topo, policy) -> tuple[int, int, dict, bool]:
    path, proceed = lifecycle.agree_on_start(run, is_main=topo.is_main,
                                             max_no_progress_restarts=job.checkpoint.max_no_progress_restarts)
    if not proceed:
        return 0, 0, {}, False
    if path is None:
        return 0, 0, {}, True
    state = load(Checkpoint.open(Path(path), verify=False), policy, topo)  # rank 0 verified it
    return int(state["step"]), int(state["policy_version"]), state, True


def _stopped_by_slurm(gate: DrainGate, grace_s: float = 2.0) -> bool:
    """Whether an engine call just failed because SLURM stops the whole job (requeue, preemption,
    cancel): then our own SIGTERM comes too, within grace_s, since each node's slurmstepd signals its
    tasks on its own clock. The step in flight is given up and the drain at the boundary checkpoints."""
    deadline = time.monotonic() + grace_s
    while gate.signal_name != "SIGTERM" and time.monotonic() < deadline:
        time.sleep(0.05)  # the handler runs in this (main) thread, between two sleeps
    return gate.signal_name == "SIGTERM"


def _degraded_by_slurm_stop(exp: Experience | None, gate: DrainGate, grace_s: float = 0.5) -> int:
    """Responses of `exp` degraded because SLURM stops the job (0 when none, or no SIGTERM came): its
    SIGTERM reached the reward component too, whose service went away mid-step. Trained, they would put
    neutral rewards into the drain checkpoint; the step is given up and the resumed job makes it again."""
    degraded = exp.stats.get("reward_degraded", 0) if exp is not None else 0
    return degraded if degraded and _stopped_by_slurm(gate, grace_s) else 0


def _drain(job, run, topo, gate, controller, *, step, save, cost_s, time_left_s) -> int:
    """Every role drains at the step the trainer ranks agreed on: the engines stop taking prompts and
    finish what is in flight, the trainer checkpoints, the leader requeues the whole het job."""
    reason, signal_name = agreed_reason(gate, topo.world_size)
    if controller is not None:
        if signal_name == "SIGTERM":
            # SLURM sent SIGTERM to every step, the engines' too: they are stopping already, and
            # KillWait is for the checkpoint.
            events.emit(run, "engines_drained", role="controller", engines={}, reason="stopped by SLURM (SIGTERM)")
        else:
            controller.engines.drain(job.sync.timeout_s)
    code = lifecycle.finish_drain(run, step=step, reason=reason or "drain requested by a peer rank",
                                  signal_name=signal_name, save=save, cost_s=cost_s, time_left_s=time_left_s,
                                  is_leader=topo.is_main)
    if topo.is_main and code == ExitCode.DRAINED:
        gate.consume_control_file()  # else the requeued job would drain again at its first step
    return code


def _loop(job, run, topo, gate, guard, policy, controller) -> int:
    step, version, rl_state, proceed = _start(job, run, topo, policy)
    if not proceed:
        return ExitCode.NO_PROGRESS
    interval = IntervalPolicy(job.checkpoint, start_step=step,
                              time_limit_s=job.cluster.time_limit_min * 60.0 if os.environ.get("SLURM_JOB_ID") else None)
    if controller is not None:
        with guard.phase("sync", step=step):
            controller.check_env()
            # Engines start from the initial weights; make them serve exactly this rank's (resumed) policy.
            controller.sync.sync(policy.weights(), version=version)
        if "eval_history" not in rl_state:
            rl_state["eval_history"] = [[step, controller.evaluate()]]
            events.emit(run, "eval", step=step, held_out_accuracy=rl_state["eval_history"][-1][1])
        # rl.max_staleness > 0: from here on the next steps' rollouts run while this one trains.
        controller.start_experience(step, version, rl_state)
    last_saved = step if step else None
    first_step = True
    while True:
        # Step boundary: every rank must agree to drain / save, so they stop at the same step; the least
        # KillWait left over the ranks (after a SIGTERM) decides whether the drain checkpoint still fits.
        left = gate.kill_wait_left_s() if gate.check() else None
        flags = torch.tensor([float(gate.requested), -(left if left is not None else math.inf),
                              float(topo.is_main and interval.due(step))], device=compute_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] > 0:
            def do_save():
                if last_saved != step:
                    save(run, job, topo, policy, step, version, rl_state)
                return f"step-{step:08d}"
            time_left = None if math.isinf(flags[1]) else -flags[1].item()
            return _drain(job, run, topo, gate, controller, step=step, save=do_save, cost_s=interval.cost_s,
                          time_left_s=time_left)
        if flags[2] > 0 and last_saved != step:
            with guard.phase("checkpoint", step=step):
                interval.observe_save(step, save(run, job, topo, policy, step, version, rl_state))
            last_saved = step
        if step >= job.train.steps:
            break
        started = time.monotonic()
        box = [None]
        if controller is not None:
            try:
                box = [controller.experience(step, version, guard)]
            except RlslurmError as e:
                if not _stopped_by_slurm(gate):
                    raise
                events.emit(run, "step_abandoned", step=step, reason=f"SLURM stops the job and its engines: {e}")
            degraded = _degraded_by_slurm_stop(box[0], gate)
            if degraded:
                events.emit(run, "step_abandoned", step=step, reason=f"SLURM stops the job and its reward "
                                                                     f"service: {degraded} responses degraded")
                box = [None]
        with guard.phase("wait_experience", step=step):
            dist.broadcast_object_list(box, src=0)
        exp: Experience | None = box[0]
        if exp is None:
            if controller is not None:  # abandoned: the resumed job makes it again, not from the checkpoint
                controller.forget_experience(step, rl_state)
            continue  # to the step boundary, where every rank drains at `step` (rank 0's flag reaches them)
        t = time.monotonic()
        with guard.phase("train", step=step):
            share = exp.samples[topo.rank::topo.world_size]
            stats = policy.update(share, guard, step_total=len(exp.samples))
        train_s = time.monotonic() - t
        step += 1
        version += 1
        if controller is not None:
            t = time.monotonic()
            with guard.phase("sync", step=step):
                try:
                    sync_metrics = controller.sync_weights(policy.weights(), step=step, version=version, guard=guard)
                    if job.rl.max_staleness:  # a checkpoint at this boundary keeps the steps made ahead
                        rl_state["experience_buffer"] = controller.experience_buffer(step, guard)
                except RlslurmError as e:
                    if not _stopped_by_slurm(gate):
                        raise
                    # The trained step stands: the drain checkpoint holds it, and the resumed job's first
                    # sync puts these weights into its new engines.
                    events.emit(run, "sync_skipped", step=step, reason=f"SLURM stops the job and its engines: {e}")
                    sync_metrics = {"sync_skipped": True}
            sync_s = time.monotonic() - t
            record = {"t": time.time(), "step": step, "policy_version": version,
                      "restart_count": lifecycle.restart_count(), **exp.stats,
                      "train_s": train_s, "sync_s": sync_s, **stats, **sync_metrics}
            total = exp.stats["rollout_s"] + exp.stats["reward_s"] + train_s + sync_s
            record["step_s"] = time.monotonic() - started
            for phase in ("rollout", "reward", "train", "sync"):
                record[f"{phase}_share"] = record[f"{phase}_s"] / total if total else 0.0
            record["effective_samples_per_s"] = exp.stats["effective_samples"] / record["step_s"]
            if (step % job.rl.eval_every == 0 or step == job.train.steps) and "sync_skipped" not in sync_metrics:
                acc = controller.evaluate()
                record["held_out_accuracy"] = acc
                rl_state.setdefault("eval_history", []).append([step, acc])
            run.append_json(run.metrics, record)
            if first_step:  # requeue -> training again is measured up to here
                since = time.time() - psutil.Process().create_time()
                events.emit(run, "first_step", step=step, policy_version=version,
                            since_process_start_s=round(since, 3), device=str(policy.device))
            log.info("step %d v%d reward %.3f eff %d/%d rollout %.2fs train %.2fs sync %.2fs%s", step, version,
                     exp.stats["reward_mean"], exp.stats["effective_samples"], exp.stats["samples"],
                     exp.stats["rollout_s"], train_s, sync_s,
                     f" acc {record['held_out_accuracy']:.3f}" if "held_out_accuracy" in record else "")
        first_step = False
        if job.train.step_delay_s:
            with guard.phase("train", step=step):
                threading.Event().wait(job.train.step_delay_s)  # stands in for compute: tests signal mid-run
        interval.observe_step(time.monotonic() - started)
    if last_saved != step:
        save(run, job, topo, policy, step, version, rl_state)
    if topo.is_main:
        save_hf(policy.model, run.path / "export" / "hf", max_new_tokens=job.rollout.max_new_tokens,
                tokenizer=policy.tokenizer)
        events.emit(run, "done", step=step, policy_version=version,
                    held_out_accuracy=rl_state.get("eval_history", [[0, None]])[-1][1])
    return ExitCode.DONE


# -- the other components on SLURM ------------------------------------------------------------------

def run_engine(job: JobConfig, run_dir: str | Path) -> int:
    """One rollout engine server of the rollout het component; announces its URL in <run>/endpoints/.

    Lifecycle: it serves until the trainer's rank 0 stops the component (SIGTERM to its tasks, see
    hetjob.ComponentStep.stop) or SLURM ends the job (requeue, cancel: SIGTERM too); either way uvicorn
    finishes the requests in flight and the engine exits 0. A drain reaches it as the controller's
    /admin/drain (Engines.drain), not as a signal of its own.
    """
    from rlslurm.dist import node_address
    from rlslurm.rollout import server

    # `scancel -s USR1` and --signal=USR1@N reach every step, this one too; USR1's default action would
    # kill the engine while the trainer still finishes its step. The trainer ranks agree on the drain
    # step and the controller drains the engines then.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # uvicorn shuts down gracefully on SIGTERM (in-flight requests finish), then raises the signal again
    # under the handler found at its start: this one makes that an exit 0, so srun and SLURM see a
    # clean end of the component (a SIGTERM while it waits for the model ends it cleanly too).
    signal.signal(signal.SIGTERM, _exit_cleanly)
    run_ = RunDir(Path(run_dir))
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    write_fingerprint(run_, "rollout", rank)
    model_dir = Path(job.train.init_from) if job.train.init_from else run_.path / "export" / "init"
    deadline = time.monotonic() + job.rollout.request_timeout_s
    while not (model_dir / "config.json").is_file():  # the controller writes the random init
        if time.monotonic() > deadline:
            raise RlslurmError(f"no model in {model_dir} after {job.rollout.request_timeout_s:.0f} s")
        time.sleep(0.5)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    host, port = node_address(node), free_port()
    folder = run_.path / "endpoints"
    folder.mkdir(exist_ok=True)
    tmp = folder / f".engine-{rank}.json.tmp"
    # job id and restart count: the controller of a requeued job must not take the previous start's URL.
    tmp.write_text(json.dumps({"url": f"http://{host}:{port}", "node": node, "pid": os.getpid(),
                               "job_id": lifecycle.leader_job_id(), "restart_count": lifecycle.restart_count()}))
    os.replace(tmp, folder / f"engine-{rank}.json")
    bind = "127.0.0.1" if host.startswith("127.") else "0.0.0.0"
    argv = ["--model", str(model_dir), "--host", bind, "--port", str(port), *engine_args(job),
            "--engine", job.rollout.engine]
    if job.rollout.engine != "hf" or job.rollout.python:
        # Another engine lives in its own venv (vLLM: .venv-vllm): become its server process, so this
        # SLURM task is the server and SLURM's signals reach it directly (USR1 stays ignored across exec).
        python = job.rollout.python or sys.executable
        log.info("engine %d: exec %s -m rlslurm.rollout.server (engine %s)", rank, python, job.rollout.engine)
        os.execv(python, [python, "-m", "rlslurm.rollout.server", *argv])
    try:
        server.main(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    log.info("engine %d on %s stopped: exiting 0", rank, node)
    return 0


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


def run_reward(job: JobConfig, run_dir: str | Path) -> int:
    """The reward het component: the supervised reward service (rlslurm/reward/) on this node, announced
    in <run>/endpoints/reward.json for the controller.

    Lifecycle: it serves until the trainer's rank 0 stops the component (SIGTERM through srun), or raises
    RewardServiceError once its supervisor gave up (past reward.max_restarts); the supervisor's events
    reach the controller through the run directory, so its steps count the restarts.
    """
    from rlslurm.dist import node_address
    from rlslurm.errors import RewardServiceError
    from rlslurm.reward.session import announce
    from rlslurm.reward.supervisor import RewardSupervisor

    # USR1 (`scancel -s USR1`, --signal=USR1@N) reaches this step too: nothing here to drain, and its
    # default action would kill the service while the trainer still finishes its step.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    run_ = RunDir(Path(run_dir))
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    host = node_address(node)
    bind = "127.0.0.1" if host.startswith("127.") else "0.0.0.0"
    with RewardSupervisor(reward_config(job), run=run_, bind=bind, diag=job.diag) as sup:
        announce(run_, f"http://{host}:{sup.port}", node)
        log.info("reward service on %s:%d (bound to %s), supervised", host, sup.port, bind)
        while not stop.wait(1.0):
            if sup.failed.is_set():
                raise RewardServiceError(f"the reward service on {node} failed past reward.max_restarts = "
                                         f"{job.reward.max_restarts}; see {run_.logs}/reward-service.log")
    log.info("reward service on %s stopped: exiting 0", node)
    return 0
