"""The RL entrance: GRPO on the task, with rollout engines, a reward, and verified weight sync.

    rlslurm submit examples/tiny-grpo.yaml            # starts from train.init_from (the SFT export) as it is

Every trainer rank runs `run(job, run_dir)`; rank 0 is also the controller. One step reads like the
diagram in DESIGN.md, each phase inside the phase guard:

    prompts -> rollout (engines) -> reward -> advantages -> train (DDP) -> sync (DRAIN/UPDATE/VERIFY/RESUME)
    -> metrics -> checkpoint

Engines are separate server processes (rlslurm/rollout/server.py): on SLURM the rollout het component
runs them (`run_engine`) and they announce themselves in <run>/endpoints/; elsewhere the controller
spawns them beside itself. Samples carry the policy version that produced them.

Whether it learns depends less on this file than on where it starts: from a cosine-annealed SFT minimum
the first steps of a fresh Adam lose accuracy whatever the loss (plain SFT does the same); from the
constant-lr SFT of examples/tiny-sft.yaml, GRPO at lr 3e-4 takes held-out accuracy 0.374 -> 0.594 in 60
steps (tests/integration/test_rl_learns.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rlslurm import events, lifecycle
from rlslurm.checkpoint import Checkpoint, CheckpointWriter, IntervalPolicy, latest_complete
from rlslurm.config import JobConfig
from rlslurm.diag.drain_gate import DrainGate
from rlslurm.diag.env_diff import compare, read_fingerprints, write_fingerprint
from rlslurm.diag.guard import PhaseGuard
from rlslurm.dist import Topology, free_port, init_process_group
from rlslurm.errors import RlslurmError
from rlslurm.lifecycle import ExitCode
from rlslurm.rundir import RunDir
from rlslurm.tasks.arithmetic import Problem, make_splits, score
from rlslurm.tinymodel import build_model, load_hf, save_hf
from rlslurm.tokenizer import PAD_ID

log = logging.getLogger("rlslurm.jobs.rl")


@dataclass
class Sample:
    """One response, as it reaches the loss."""

    prompt_ids: list[int]
    response_ids: list[int]
    reward: float
    advantage: float
    version: int
    engine_logprobs: list[float]


@dataclass
class Experience:
    """What the controller hands every rank for one step, and what it measured making it."""

    samples: list[Sample]
    stats: dict = field(default_factory=dict)


# -- advantages --------------------------------------------------------------------------------------

def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float] | None:
    """GRPO: (r - mean) / std within one prompt's group; None for a zero-variance group (no signal)."""
    mean = sum(rewards) / len(rewards)
    var = sum((r - mean) ** 2 for r in rewards) / len(rewards)
    if var < eps * eps:
        return None
    std = math.sqrt(var)
    return [(r - mean) / (std + eps) for r in rewards]


def build_samples(problems: list[Problem], choices: list[dict], rewards: list[float], k: int,
                  encode) -> tuple[list[Sample], int]:
    """(samples, groups dropped): choices and rewards are prompt-major, k per prompt, in `problems` order;
    a group whose k rewards are all equal teaches nothing and is left out (it would only add noise)."""
    if len(choices) != len(problems) * k or len(rewards) != len(choices):
        raise RlslurmError(f"{len(choices)} responses and {len(rewards)} rewards for {len(problems)} prompts "
                           f"x {k} samples: the rollout lost or duplicated responses")
    samples, dropped = [], 0
    for g, problem in enumerate(problems):
        group = range(g * k, (g + 1) * k)
        adv = group_advantages([rewards[i] for i in group])
        if adv is None:
            dropped += 1
            continue
        prompt_ids = list(encode(problem.prompt))
        for i, a in zip(group, adv):
            c = choices[i]
            samples.append(Sample(prompt_ids, list(c["token_ids"]), rewards[i], a, int(c["policy_version"]),
                                  list(c["token_logprobs"])))
    return samples, dropped


# -- the policy on every rank ------------------------------------------------------------------------

class Policy:
    """The trained model (DDP), its optimizer and the optional frozen reference for the KL term."""

    def __init__(self, job: JobConfig, topo: Topology, model_dir: Path):
        self.job, self.topo = job, topo
        model, _ = load_hf(model_dir)
        self.model = model.float()
        self.ddp = DistributedDataParallel(self.model) if topo.world_size > 1 else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=job.train.lr,
                                           weight_decay=job.train.weight_decay)
        self.reference = None
        if job.rl.kl_coef > 0:
            self.reference, _ = load_hf(model_dir)
            self.reference.float().eval().requires_grad_(False)

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

    def update(self, samples: list[Sample], guard: PhaseGuard) -> dict:
        """One clipped policy-gradient step on this rank's share; DDP averages the gradients.

        One update per batch, so `old` equals `new` in value and the ratio is 1: the clip only starts to
        matter once a batch is reused (several epochs, or stale samples with max_staleness > 0).
        """
        clip = self.job.rl.clip_eps
        self.optimizer.zero_grad(set_to_none=True)
        if not samples:
            # DDP needs every rank in the all-reduce: a zero loss over the parameters keeps it in step.
            loss = sum(p.sum() * 0.0 for p in self.model.parameters())
            loss.backward()
            return {"loss": 0.0, "tokens": 0, "kl": 0.0, "grad_norm": 0.0}
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
        adv = torch.tensor([s.advantage for s in samples])[:, None]
        with torch.no_grad():
            old = self._logprobs(self.model, ids, attn)
        new = self._logprobs(self.ddp, ids, attn)
        ratio = torch.exp(new - old)
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
        tokens = loss_mask.sum().clamp(min=1.0)
        # GRPO's sequence-level mean: every response weighs the same whatever its length, so a long wrong
        # answer does not outvote a short right one.
        per_seq = loss_mask.sum(1).clamp(min=1.0)
        loss = -((surrogate * loss_mask).sum(1) / per_seq).mean()
        kl = torch.tensor(0.0)
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
        engine_lp = [lp for s in samples for lp in s.engine_logprobs]
        trainer_lp = [old[i, len(s.prompt_ids) - 1 + j].item() for i, s in enumerate(samples)
                      for j in range(len(s.engine_logprobs))]
        gap = max((abs(a - b) for a, b in zip(engine_lp, trainer_lp)), default=0.0)
        return {"loss": float(loss.detach()), "tokens": int(tokens), "kl": float(kl.detach()),
                "grad_norm": float(grad_norm), "engine_trainer_logprob_gap": gap}


# -- the controller (rank 0) ---------------------------------------------------------------------------

class Engines:
    """The rollout engines the controller talks to: spawned here, or announced by the rollout component."""

    def __init__(self, job: JobConfig, run: RunDir, model_dir: Path):
        from rlslurm.rollout.client import EngineClient, spawn_engine

        self.processes = []
        if os.environ.get("SLURM_HET_SIZE", "1") != "1":
            self.clients = [EngineClient(url, job.rollout.request_timeout_s)
                            for url in wait_for_endpoints(run, job.rollout.engines, job.rollout.request_timeout_s)]
        else:
            for i in range(job.rollout.engines):
                proc = spawn_engine(model_dir, port=free_port(), log_path=run.logs / f"engine-{i}.log",
                                    extra_args=["--threads", "1"],
                                    env={"RLSLURM_RUN_DIR": str(run.path), "RLSLURM_ROLE": "rollout",
                                         "RLSLURM_RANK": str(i)},
                                    timeout_s=job.rollout.request_timeout_s)
                self.processes.append(proc)
            self.clients = [p.client for p in self.processes]

    def stop(self) -> None:
        for proc in self.processes:
            proc.stop()


def wait_for_endpoints(run: RunDir, count: int, timeout_s: float, poll_s: float = 0.5) -> list[str]:
    """URLs of `count` engines from <run>/endpoints/engine-*.json, polled and bounded."""
    folder = run.path / "endpoints"
    deadline = time.monotonic() + timeout_s
    while True:
        found = sorted(folder.glob("engine-*.json")) if folder.is_dir() else []
        if len(found) >= count:
            return [json.loads(p.read_text())["url"] for p in found[:count]]
        if time.monotonic() > deadline:
            raise RlslurmError(f"only {len(found)} of {count} rollout engines announced themselves in {folder} "
                               f"within {timeout_s:.0f} s; see {run.logs}/rollout-*.log")
        log.info("waiting for %d engine endpoints in %s (%d so far)", count, folder, len(found))
        time.sleep(poll_s)


class Controller:
    """Rank 0: prompts, rollout, reward, advantages, sync, evaluation."""

    def __init__(self, job: JobConfig, run: RunDir, model_dir: Path, tokenizer):
        from rlslurm.sync.protocol import WeightSync, transport_for

        self.job, self.run, self.tokenizer = job, run, tokenizer
        self.train_set, self.held_out = make_splits(job.task)
        self.engines = Engines(job, run, model_dir)
        placement = "colocate" if job.placement.mode == "colocate" else "separate"
        self.transport = transport_for(job.sync, placement_mode=placement, weights_dir=run.path / "weights")
        self.sync = WeightSync(self.engines.clients, self.transport, job.sync, run=run)

    def close(self) -> None:
        self.transport.close()
        self.engines.stop()

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

    def rollout(self, problems: list[Problem], step: int, guard: PhaseGuard) -> list[dict]:
        """k samples per prompt from the engines; prompts split across engines in a fixed order."""
        cfg, n_eng = self.job.rollout, len(self.engines.clients)
        choices: list[dict] = []
        for i, client in enumerate(self.engines.clients):
            share = [p.prompt for j, p in enumerate(problems) if j % n_eng == i]
            if not share:
                continue
            out = client.completions(share, n=self.job.rl.samples_per_prompt, max_tokens=cfg.max_new_tokens,
                                     temperature=cfg.temperature, seed=self.job.train.seed * 7919 + step * 31 + i)
            guard.beat()
            choices.extend({**c, "engine": i, "share_index": k // self.job.rl.samples_per_prompt}
                           for k, c in enumerate(out["choices"]))
        # back to prompt order: engine i holds prompts i, i + n_eng, ...
        for c in choices:
            c["prompt_index"] = c["share_index"] * n_eng + c["engine"]
        return sorted(choices, key=lambda c: (c["prompt_index"], c["index"]))

    def reward(self, problems: list[Problem], choices: list[dict]) -> list[float]:
        return [score(problems[c["prompt_index"]], c["text"]) for c in choices]

    def experience(self, step: int, version: int, guard: PhaseGuard) -> Experience:
        k = self.job.rl.samples_per_prompt
        times = {}
        with guard.phase("data", step=step):
            problems = self.prompts(step)
        t = time.monotonic()
        with guard.phase("rollout", step=step):
            choices = self.rollout(problems, step, guard)
        times["rollout_s"] = time.monotonic() - t
        t = time.monotonic()
        with guard.phase("reward", step=step):
            rewards = self.reward(problems, choices)
        times["reward_s"] = time.monotonic() - t
        with guard.phase("advantage", step=step):
            samples, dropped = build_samples(problems, choices, rewards, k,
                                             lambda text: self.tokenizer(text)["input_ids"])
        tokens = sum(len(c["token_ids"]) for c in choices)
        versions = [int(c["policy_version"]) for c in choices]
        stats = {**times, "reward_mean": sum(rewards) / len(rewards), "samples": len(choices),
                 "effective_samples": len(samples), "zero_variance_groups": dropped,
                 "generated_tokens": tokens, "tokens_per_s": tokens / max(times["rollout_s"], 1e-9),
                 "staleness_max": max(version - v for v in versions), "reward_degraded_ratio": 0.0}
        return Experience(samples, stats)

    def evaluate(self) -> float:
        """Greedy held-out accuracy of the policy the engines serve now."""
        client = self.engines.clients[0]
        out = client.completions([p.prompt for p in self.held_out], n=1, temperature=0.0,
                                 max_tokens=self.job.rollout.max_new_tokens)
        correct = sum(score(p, c["text"]) for p, c in zip(self.held_out, out["choices"]))
        return correct / len(self.held_out)


# -- checkpoints -------------------------------------------------------------------------------------

def save(run: RunDir, job: JobConfig, topo: Topology, policy: Policy, step: int, version: int, rl_state: dict) -> float:
    """Collective: every rank's RNG is gathered; rank 0 writes model, optimizer, RNG and RL state."""
    rngs = [None] * topo.world_size
    dist.all_gather_object(rngs, {"torch": torch.get_rng_state(), "python": random.getstate()})
    seconds = [0.0]
    if topo.is_main:
        with CheckpointWriter(run, step, policy_version=version, keep=job.checkpoint.keep,
                              metadata={"job": "rl", "world_size": topo.world_size}) as ckpt:
            ckpt.save_tensors("model", {k: v.contiguous() for k, v in policy.weights().items()})
            ckpt.save_state("optimizer", policy.optimizer.state_dict())
            ckpt.save_state("rng", rngs)
            ckpt.save_json("rl_state", {**rl_state, "step": step, "policy_version": version,
                                        "data_position": step})
        seconds = [ckpt.saved.seconds]
    dist.broadcast_object_list(seconds, src=0)
    return seconds[0]


def load(ckpt: Checkpoint, policy: Policy, topo: Topology) -> dict:
    state = ckpt.load_tensors("model")
    policy.model.load_state_dict(state, strict=False)
    policy.optimizer.load_state_dict(ckpt.load_state("optimizer"))
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
            policy = Policy(job, topo, model_dir)
            controller = Controller(job, run_, model_dir, load_hf(model_dir)[1]) if topo.is_main else None
            return _loop(job, run_, topo, gate, guard, policy, controller)
    finally:
        if controller is not None:
            controller.close()
        gate.restore_signal_handlers()
        dist.destroy_process_group()


def _start(job, run, topo, policy) -> tuple[int, int, dict, bool]:
    box: list = [None, True]
    if topo.is_main:
        ckpt = latest_complete(run)
        decision = lifecycle.on_start(run, lifecycle.restart_count(), step=ckpt.step if ckpt else 0,
                                      checkpoint=ckpt.name if ckpt else None,
                                      max_no_progress_restarts=job.checkpoint.max_no_progress_restarts)
        box = [str(ckpt.path) if ckpt else None, decision.proceed]
    dist.broadcast_object_list(box, src=0)
    if not box[1]:
        return 0, 0, {}, False
    if box[0] is None:
        return 0, 0, {}, True
    state = load(Checkpoint.open(Path(box[0]), verify=False), policy, topo)
    return int(state["step"]), int(state["policy_version"]), state, True


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
    last_saved = step if step else None
    while True:
        box = [float(gate.check()), float(topo.is_main and interval.due(step))]
        flags = torch.tensor(box)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] > 0:
            def do_save():
                if last_saved != step:
                    save(run, job, topo, policy, step, version, rl_state)
                return f"step-{step:08d}"
            return lifecycle.finish_drain(run, step=step, reason=gate.reason or "drain requested by a peer rank",
                                          signal_name=gate.signal_name, save=do_save, cost_s=interval.cost_s,
                                          time_left_s=gate.kill_wait_left_s(), is_leader=topo.is_main)
        if flags[1] > 0 and last_saved != step:
            with guard.phase("checkpoint", step=step):
                interval.observe_save(step, save(run, job, topo, policy, step, version, rl_state))
            last_saved = step
        if step >= job.train.steps:
            break
        started = time.monotonic()
        box = [None]
        if controller is not None:
            box = [controller.experience(step, version, guard)]
        with guard.phase("wait_experience", step=step):
            dist.broadcast_object_list(box, src=0)
        exp: Experience = box[0]
        t = time.monotonic()
        with guard.phase("train", step=step):
            share = exp.samples[topo.rank::topo.world_size]
            stats = policy.update(share, guard)
        train_s = time.monotonic() - t
        step += 1
        version += 1
        if controller is not None:
            t = time.monotonic()
            with guard.phase("sync", step=step):
                report = controller.sync.sync(policy.weights(), version=version)
            sync_s = time.monotonic() - t
            record = {"t": time.time(), "step": step, "policy_version": version, **exp.stats,
                      "train_s": train_s, "sync_s": sync_s, **stats, **report.metrics()}
            total = exp.stats["rollout_s"] + exp.stats["reward_s"] + train_s + sync_s
            record["step_s"] = time.monotonic() - started
            for phase in ("rollout", "reward", "train", "sync"):
                record[f"{phase}_share"] = record[f"{phase}_s"] / total if total else 0.0
            record["effective_samples_per_s"] = exp.stats["effective_samples"] / record["step_s"]
            if step % job.rl.eval_every == 0 or step == job.train.steps:
                acc = controller.evaluate()
                record["held_out_accuracy"] = acc
                rl_state.setdefault("eval_history", []).append([step, acc])
            run.append_json(run.metrics, record)
            log.info("step %d v%d reward %.3f eff %d/%d rollout %.2fs train %.2fs sync %.2fs%s", step, version,
                     exp.stats["reward_mean"], exp.stats["effective_samples"], exp.stats["samples"],
                     exp.stats["rollout_s"], train_s, sync_s,
                     f" acc {record['held_out_accuracy']:.3f}" if "held_out_accuracy" in record else "")
        interval.observe_step(time.monotonic() - started)
    if last_saved != step:
        save(run, job, topo, policy, step, version, rl_state)
    if topo.is_main:
        save_hf(policy.model, run.path / "export" / "hf", max_new_tokens=job.rollout.max_new_tokens)
        events.emit(run, "done", step=step, policy_version=version,
                    held_out_accuracy=rl_state.get("eval_history", [[0, None]])[-1][1])
    return ExitCode.DONE


# -- the other components on SLURM ------------------------------------------------------------------

def run_engine(job: JobConfig, run_dir: str | Path) -> int:
    """One rollout engine server of the rollout het component; announces its URL in <run>/endpoints/."""
    from rlslurm.dist import node_address
    from rlslurm.rollout import server

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
    tmp.write_text(json.dumps({"url": f"http://{host}:{port}", "node": node, "pid": os.getpid()}))
    os.replace(tmp, folder / f"engine-{rank}.json")
    bind = "127.0.0.1" if host.startswith("127.") else "0.0.0.0"
    server.main(["--model", str(model_dir), "--host", bind, "--port", str(port), "--threads", "1"])
    return 0


def run_reward(job: JobConfig, run_dir: str | Path) -> int:
    """The reward het component: the reward service of rlslurm/reward/service.py."""
    raise RlslurmError("reward.service = 'component' is not wired into the RL job yet; use reward.service: inline")
