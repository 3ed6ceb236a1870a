"""GRPO with mini-batches learns: examples/tiny-grpo.yaml from the session's SFT export (conftest.py) with
rl.mini_batches = 4 (four optimizer steps per RL step, behaviour log-probs taken once before the first) in
forwards of 64 sequences per rank, 40 RL steps, on 2 gloo ranks with an engine server, end to end through
`launch.submit(..., backend="local")`.

    python -m pytest -q -s tests/integration/test_rl_minibatches.py   # ~20-50 s after the SFT; -s prints numbers

Measured here (avx2, the SFT start of issue 26's recipe): SFT 0.336 -> 0.445 after 20 steps -> 0.464 after 40
(one mini-batch per step: 0.449 / 0.452); 14 s in steps. After 20 steps the gain was +0.109, too close to the
margin for other kernel paths, hence 40. The margin is test_rl_learns.py's (its docstring says why 0.10).
"""

from __future__ import annotations

import pytest

from rl_runs import evals, steps, submit_example

MARGIN = 0.10
MINI_BATCHES = 4
STEPS = 40


@pytest.fixture(scope="module")
def minibatched(sft, tmp_path_factory) -> dict:
    job, run_dir = submit_example("tiny-grpo.yaml", tmp_path_factory.mktemp("rl-minibatches"),
                                  (f"train.init_from={sft['export']}", "rl.max_staleness=0",
                                   f"rl.mini_batches={MINI_BATCHES}", f"train.steps={STEPS}", "rl.eval_every=20"))
    rows, accs = steps(run_dir), evals(run_dir)
    print(f"\nRL with {MINI_BATCHES} mini-batches: {' -> '.join(f'{a:.3f}@{s}' for s, a in accs)} "
          f"({sum(r['step_s'] for r in rows):.1f} s in steps)")
    return {"job": job, "steps": rows, "evals": accs}


def test_rl_with_mini_batches_beats_sft_on_held_out_problems(sft, minibatched):
    base, (last_step, acc) = sft["eval"]["held_out_accuracy"], minibatched["evals"][-1]
    assert minibatched["evals"][0] == (0, base) and last_step == STEPS
    assert acc >= base + MARGIN, f"RL with mini-batches {acc:.3f} vs SFT {base:.3f}: the gain is under {MARGIN}"


def test_every_step_takes_its_mini_batches_against_one_behaviour_policy(minibatched):
    rows = minibatched["steps"]
    # A step with no trainable sample (which ones depends on the SFT start: issue 42) takes none.
    assert len(rows) == STEPS and any(r["trained"] for r in rows)
    assert [r["mini_batches"] for r in rows] == [MINI_BATCHES if r["trained"] else 0 for r in rows]
    # Fresh samples: the first mini-batch's ratio is 1 (the clip idle); the later ones' ratio is against the
    # log-probs taken before the first optimizer step, so the clip bites (it never would, were the behaviour
    # log-probs retaken after each step).
    assert max(r["clip_fraction"] for r in rows) > 0.01
    assert max(r["engine_trainer_logprob_gap"] for r in rows if r["trained"]) < 1e-3
