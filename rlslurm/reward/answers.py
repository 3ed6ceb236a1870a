"""Answers in a response, read the rule scorer's way: the final answer a response commits to, numbers as exact
fractions, and the rule's verdict where two plain numbers decide it (math_answers.py's math-verify decides the
rest).

    extract_answer("so the answer is 1,000.")          # "1,000."
    normalise_number("1,000.") == normalise_number("1e3")
    rule_verdict("\\boxed{19}", "19")                   # Scored(1.0, ...); None: math-verify must decide

A number of more than MAX_NUMBER_DIGITS digits or an exponent past MAX_EXPONENT is compared as text: exact
arithmetic on "1e999999999" would hold the CPU for minutes.
"""

from __future__ import annotations

import re
from fractions import Fraction

from rlslurm.reward.items import Scored, short

_GSM8K = re.compile(r"####\s*([^\n]+)")


def gsm8k_final(text: str) -> str:
    """What follows the last `####` (GSM8K's final answer line), else `text`."""
    found = _GSM8K.findall(text)
    return found[-1].strip() if found else text


_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")
_ANSWER_IS = re.compile(r"(?:answer\s*(?:is|:|=)|####)\s*([^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?")


def extract_answer(response: str) -> str | None:
    """The final answer a response commits to; None when it names none."""
    for pattern in (_BOXED, _ANSWER_IS):
        found = pattern.findall(response)
        if found:
            return found[-1].strip()
    # Spaces between digits are tokenisation, not separators: "1 9" is the answer 19.
    numbers = _NUMBER.findall(re.sub(r"(?<=\d)\s+(?=\d)", "", response))
    return numbers[-1] if numbers else None


MAX_NUMBER_DIGITS = 400
"""Digits a number may have to be compared as a number (a fraction counts both parts)."""
MAX_EXPONENT = 400
"""Largest |exponent| of a number compared as a number: 10**400 is instant, 10**(10**9) takes minutes."""
_EXPONENT = re.compile(r"[eE]([-+]?\d+)")


def normalise_number(text: str) -> Fraction | None:
    """`text` as an exact number ("1,000", " -3.50 ", "$12", "1/2", "50%", "1e3"), or None; None too for
    one too large to handle in bounded time (MAX_NUMBER_DIGITS, MAX_EXPONENT)."""
    s = "".join(text.split()).rstrip(".").removeprefix("$").replace("\\$", "")
    percent = s.endswith("%")
    s = s.removesuffix("%")
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    exponent = _EXPONENT.search(s)
    # Digits first: they bound the exponent's own digits too, so int() of it is cheap.
    if sum(c.isdigit() for c in s) > MAX_NUMBER_DIGITS or (exponent and abs(int(exponent.group(1))) > MAX_EXPONENT):
        return None
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def rule_verdict(response: str, reference: str, format_regex: str | None = None) -> Scored | None:
    """The rule's score when the format gate or plain numbers decide it; None when math-verify must."""
    if format_regex is not None and not re.search(format_regex, response):
        return Scored(0.0, "format: response does not match reward.format_regex")
    answer = extract_answer(response)
    # GSM8K's answer column is the worked solution ending in "#### 72": its final answer is the reference.
    reference = gsm8k_final(reference)
    want = normalise_number(reference)
    if answer is None and want is not None:
        return Scored(0.0, "no answer found")
    got = normalise_number(answer) if answer is not None else None
    if got is None or want is None:
        return None
    if "\\" in response and not (_BOXED.search(response) or _ANSWER_IS.search(response)):
        # The last number of LaTeX is no answer ("$\frac{72}{2}$" ends in 2): math-verify reads the expression.
        return None
    same = got == want
    return Scored(1.0 if same else 0.0, f"answer {short(answer)} {'==' if same else '!='} reference "
                                        f"{short(reference)}")
