"""The check both engines' episode tests run (tests/integration/test_episode_logprobs.py: rlslurm's transformers
server; tests/vllm/test_vllm_episodes.py: vLLM's own): an episode that calls a tool twice, kept as token ids, whose
every generated token's log-probability under the trainer equals the engine's, the tool's tokens masked."""

from __future__ import annotations

import torch

from tool_fixtures import call

TWICE = {"twice": [
    {"role": "assistant", "content": "", "tool_calls": [call("calculator", expression="2+3")]},
    {"role": "tool", "name": "calculator", "content": "5"},
    {"role": "assistant", "content": "", "tool_calls": [call("calculator", expression="5*4")]},
    {"role": "tool", "name": "calculator", "content": "20"},
    {"role": "assistant", "content": "20"}]}
TOLERANCE = 1e-4
"""|engine - trainer| log-prob per generated token: the single-turn tests' bound (test_engine_logprobs.py)."""


def episodes_for(model_dir, max_turns: int = 4):
    from transformers import AutoTokenizer

    from rlslurm.config import JobConfig
    from rlslurm.configfile import load_mapping
    from rlslurm.rl.episodes import Episodes
    from rlslurm.tools.toolbox import Toolbox

    job = load_mapping(JobConfig, {"rollout": {"max_turns": max_turns, "tools": ["calculator"]}})
    box = Toolbox.start(job.rollout, job.reward.sandbox)
    return Episodes(job, AutoTokenizer.from_pretrained(model_dir), box, context_tokens=256)


def check_twice(client, model_dir) -> dict:
    """Greedy and sampled episodes of TWICE on `client`'s engine, through the controller's own code (episodes ->
    group samples -> pack) and the torch policy's scorer; returns the figures the test prints."""
    from rlslurm.data.sample import Sample
    from rlslurm.logprobs import CausalLMScorer
    from rlslurm.rl.experience import group_samples
    from rlslurm.rl.objective import UpdateStats, pack
    from rlslurm.tinymodel import load_hf
    from rlslurm.tokenizer import PAD_ID

    episodes = episodes_for(model_dir)
    try:
        prompt = [Sample(prompt=[{"role": "user", "content": "twice"}])]
        greedy = episodes.complete(client, prompt, n=1, max_tokens=128, temperature=0.0, seed=1)
        sampled = episodes.complete(client, prompt, n=4, max_tokens=128, temperature=1.0, seed=2)
    finally:
        episodes.close()
    [g] = greedy["choices"]
    assert (g["tool_calls"], g["turns"], g["tool_errors"], g["text"], g["cut"]) == (2, 3, 0, "20", None), g
    tok = episodes.tokenizer
    masked = "".join(tok.decode([t]) for t, m in zip(g["token_ids"], g["loss_mask"]) if not m)
    assert masked == "\nT:5\nA:\nT:20\nA:"  # the template's newline after </s>, the tool turns, the next "A:"
    choices = greedy["choices"] + sampled["choices"]
    samples = group_samples(g["episode_prompt_ids"], choices, [float(i) for i in range(len(choices))])
    model, _ = load_hf(model_dir)
    batch = pack(samples, PAD_ID)
    with torch.no_grad():
        trainer = CausalLMScorer(model.float(), fused=False)(batch.ids(), batch.attention())
    gaps, tool_tokens = [], 0
    for i, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        for j, (engine_lp, model_token) in enumerate(zip(s.engine_logprobs, s.response_mask)):
            assert batch.mask[i, start + j] == model_token  # the loss sees the model's tokens, and only those
            if model_token:
                gaps.append(abs(float(trainer[i, start + j]) - engine_lp))
            else:
                tool_tokens += 1
                assert engine_lp == 0.0
    stats = UpdateStats()
    stats.observe(samples, batch, trainer, trainer)
    assert max(gaps) < TOLERANCE and stats.gap < TOLERANCE, (max(gaps), stats.gap)
    return {"generated_tokens": len(gaps), "tool_tokens": tool_tokens, "max_gap": max(gaps),
            "sampled_turns": [c["turns"] for c in sampled["choices"]]}
