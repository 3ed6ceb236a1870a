# A custom reward function in verl's own form (verl's `custom_reward_function.path` / `.name`; here
# `reward.function: examples/data/verl_reward.py:compute_score`), unchanged from what a verl user writes:
# loaded from this file, called once per response as
#     compute_score(data_source, solution_str, ground_truth, extra_info=None)
# with `solution_str` the decoded response without special tokens, returning a float or a dict holding
# "score" (the other keys are logged). Modelled on verl/utils/reward_score/gsm8k.py.
import re

_SOLUTION_CLIP_CHARS = 300


def extract_solution(solution_str, method="flexible"):
    """The final answer in `solution_str`: strict = after '####' (GSM8K's form), flexible = the last integer."""
    assert method in ["strict", "flexible"]
    # Regular expression matching on very long strings can be slow: only the tail can hold the answer.
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        solutions = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str)
        return solutions[-1].replace(",", "") if solutions else None
    answers = re.findall(r"\-?[0-9]+", solution_str)
    return answers[-1] if answers else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.0, score=1.0):
    """1.0 when the response's last integer is the ground truth, `format_score` when it states another one, 0.0
    when it states none."""
    if data_source != "rlslurm/arithmetic":
        raise NotImplementedError(f"Reward function is not implemented for {data_source=}")
    answer = extract_solution(solution_str)
    if answer is None:
        return {"score": 0.0, "acc": False, "pred": ""}
    correct = answer == str(ground_truth).strip()
    return {"score": score if correct else format_score, "acc": correct, "pred": answer}
