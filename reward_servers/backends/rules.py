"""Rule-based verifiers: exact match and math-answer equivalence.

Pure functions of strings; they run as CPU actions, never on Triton. Score is 1.0 or 0.0.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from reward_servers.backends.base import BackendParams

_WS = re.compile(r"\s+")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")


def normalize_text(s: str) -> str:
    """Collapse whitespace, strip, lower-case."""
    return _WS.sub(" ", s).strip().lower()


def exact_match(response: str, reference: str) -> bool:
    """True when the two strings are equal up to whitespace and case."""
    return normalize_text(response) == normalize_text(reference)


def _boxed(s: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced."""
    i = s.rfind("\\boxed{")
    if i < 0:
        return None
    depth, start = 0, i + len("\\boxed{")
    for j in range(start - 1, len(s)):
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return s[start:j]
    return None


def final_answer(text: str) -> str:
    """The answer part of a solution: the last \\boxed{}, else what follows 'answer is'/'####', else all."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    low = text.lower()
    for marker in ("####", "answer is", "answer:"):
        k = low.rfind(marker)
        if k >= 0:
            return text[k + len(marker) :].strip().rstrip(".")
    return text


def to_number(s: str) -> Fraction | None:
    """An exact number from '1/2', '\\frac{1}{2}', '0.5', '1,000', '50%', '$3'; None otherwise."""
    t = _FRAC.sub(r"(\1)/(\2)", s)
    t = t.replace("$", "").replace("\\!", "").replace("\\,", "").replace(" ", "")
    t = t.replace("(", "").replace(")", "").replace("{", "").replace("}", "")
    percent = t.endswith("%") or t.endswith("\\%")
    t = t.rstrip("%").rstrip("\\").rstrip(".")
    if not _NUMBER.fullmatch(t):
        return None
    try:
        value = Fraction(t.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def math_equiv(response: str, reference: str) -> bool:
    """True when the final answers are equal numbers, or equal strings after normalisation."""
    a, b = final_answer(response), final_answer(reference)
    na, nb = to_number(a), to_number(b)
    if na is not None and nb is not None:
        return na == nb
    if na is None and nb is not None:
        # a sentence ending in the number: take the last number mentioned
        found = _NUMBER.findall(a)
        return bool(found) and to_number(found[-1]) == nb
    strip = str.maketrans("", "", "$ {}\\")
    return normalize_text(a).translate(strip) == normalize_text(b).translate(strip)


RULES = {"exact-match": exact_match, "math-equiv": math_equiv}


def verify(rule: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """Apply `rule` to one request ({response, reference}); {'score': 1.0 | 0.0}."""
    ok = RULES[rule](inputs["response"], inputs["reference"])
    return {"score": 1.0 if ok else 0.0}


class RuleBackend:
    def __init__(self, params: BackendParams) -> None:
        if params.rule not in RULES:
            raise ValueError(f"unknown rule {params.rule!r}; known: {sorted(RULES)}")
        self.rule = params.rule

    def score(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [verify(self.rule, r) for r in requests]


def make(params: BackendParams) -> RuleBackend:
    return RuleBackend(params)
