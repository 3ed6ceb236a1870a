"""Math answers through Hugging Face's math-verify: the rule scorer's path for everything that is not two
plain numbers (LaTeX, \\boxed{\\frac{1}{2}} against 0.5, \\pi/2, sqrt, sets, "7 apples").

    verify_scored("so \\\\boxed{\\\\frac{1}{2}}", "0.5", timeout_s=5)   # Scored(1.0, "math-verify: ...")
    rule_score(response, reference)                    # the rule in this process: plain numbers, else the above

Runs in a worker process (workers.py, `--math`), on its main thread: math-verify bounds its sympy work
with signal.alarm(), which only works there (off the main thread it raises instead, unless its timeouts
are switched off); the worker is killed as well when the call passes `reward.timeout_s`. In-process
callers off the main thread (tests, `rlslurm score` inline) pass timeout_s=None: no signal, and
only the input bounds below.

GSM8K: a reference or response holding `#### n` (GSM8K's answer line) is cut to what follows the last
`####`, since math-verify does not read that marker. A reference math-verify cannot parse bare (LaTeX
without $ delimiters, such as \\sqrt{2}) is parsed again inside \\boxed{}. A reference it cannot parse
at all (a word: "Paris") is compared as text with the response's final answer.
"""

from __future__ import annotations

import logging
import re
import threading

from rlslurm.reward.answers import MAX_NUMBER_DIGITS, extract_answer, gsm8k_final, rule_verdict
from rlslurm.reward.items import Scored, short

MAX_VERIFY_CHARS = 4000
"""Characters of a response's end math-verify reads: the final answer is there, and a regex pass over a
whole 64 KiB response per item is wasted work."""
_LONG_DIGITS = re.compile(r"\d{%d,}" % (MAX_NUMBER_DIGITS + 1))

# math-verify warns once per process that its timeouts are off; the callers here bound it themselves.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def verify_scored(response: str, reference: str, timeout_s: int | None) -> Scored:
    """1.0 when math-verify finds the response's answer equal to the reference; text comparison of the final
    answer when the reference is not math. `timeout_s`: math-verify's own per-step bound (None: off)."""
    from math_verify import parse, verify

    gold_text = gsm8k_final(reference).strip()
    text = gsm8k_final(response)[-MAX_VERIFY_CHARS:]
    if _LONG_DIGITS.search(text) or _LONG_DIGITS.search(gold_text):
        # sympy would hold the CPU on a number this long (or a power of it): no math, text only.
        return _as_text(response, reference)
    gold = parse(gold_text, parsing_timeout=timeout_s)
    if not gold and "\\" in gold_text:  # LaTeX without delimiters; a word ("Paris") stays text
        gold = parse(f"\\boxed{{{gold_text}}}", parsing_timeout=timeout_s)
    if not gold:
        return _as_text(response, reference)
    answer = parse(text, parsing_timeout=timeout_s)
    if not answer:
        return Scored(0.0, f"math-verify: no answer found (reference {short(gold_text)})")
    same = verify(gold, answer, timeout_seconds=timeout_s)
    return Scored(1.0 if same else 0.0, f"math-verify: answer {short(str(answer[-1]))} {'==' if same else '!='} "
                                        f"reference {short(str(gold[-1]))}")


def _as_text(response: str, reference: str) -> Scored:
    answer = extract_answer(response) or response.strip()  # a one-word answer holds no number to find
    if not answer:
        return Scored(0.0, "no answer found")
    same = "".join(answer.split()).lower() == "".join(reference.split()).lower()
    return Scored(1.0 if same else 0.0, f"answer {short(answer)} {'==' if same else '!='} reference "
                                        f"{short(reference)} (as text)")


def rule_score(response: str, reference: str, format_regex: str | None = None) -> Scored:
    """1.0 when the response's final answer equals the reference: as numbers where both are plain numbers,
    else through math-verify in this process (its signal timeouts on the main thread only)."""
    verdict = rule_verdict(response, reference, format_regex)
    if verdict is not None:
        return verdict
    main = threading.current_thread() is threading.main_thread()
    return verify_scored(response, reference, timeout_s=MATH_TIMEOUT_S if main else None)


MATH_TIMEOUT_S = 5
"""math-verify's own bound per parse and per comparison, seconds (signal.alarm: a worker's main thread)."""
