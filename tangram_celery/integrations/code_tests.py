"""Test cases in the formats RL datasets carry them, as one Tangram action's test cases.

verl's `ground_truth` for code (codecontests, apps, taco, ...) is JSON with `inputs` and
`outputs` (stdin -> expected stdout), optionally `fn_name` (call a function with JSON arguments
read from stdin) or `assert_case` (Python asserts appended to the code). All of a problem's cases
go into one action, so the program is compiled once and the cases run in parallel on the cores
the scheduler grants, instead of one sandbox request per case.
"""

from __future__ import annotations

import json
from typing import Any

from tangram_celery.common.actions import TestCase

MAX_CASES = 10_000

# Reads one JSON value per stdin line as the arguments, calls `fn_name` (a function, or a method
# of class Solution) and prints the result (JSON for containers/None/bools, str otherwise).
_FN_HARNESS = """

def __tangram_call():
    import json as _j, sys as _s
    _raw = _s.stdin.read()
    _args = [_j.loads(line) for line in _raw.split("\\n") if line.strip()]
    _fn = globals().get({fn!r})
    if _fn is None and "Solution" in globals():
        _fn = getattr(globals()["Solution"](), {fn!r})
    if _fn is None:
        raise SystemExit("function {fn} not found")
    _r = _fn(*_args)
    print(_j.dumps(_r) if isinstance(_r, (dict, list, tuple, bool)) or _r is None else _r)


__tangram_call()
"""


def extract_code(completion: str) -> str | None:
    """The code of a model's completion: the last ```python block, else the first ``` block
    (a language tag on its first line dropped), else None."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    parts = completion.split("```")
    if len(parts) >= 3:
        block = parts[1]
        first, _, rest = block.partition("\n")
        return rest if first.strip().isalpha() else block
    return None


def parse_ground_truth(ground_truth: str | dict[str, Any]) -> dict[str, Any]:
    """The test-case dict of a dataset row (JSON text or a dict). Raises ValueError."""
    data = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(data, dict):
        raise ValueError("test cases must be a JSON object with inputs/outputs or assert_case")
    return data


def to_test_cases(code: str, tests: dict[str, Any]) -> tuple[str, list[TestCase]]:
    """(code to run, test cases) for one problem. Raises ValueError on a malformed spec."""
    asserts = tests.get("assert_case")
    if isinstance(asserts, list) and asserts:
        cases = [TestCase(name=f"case-{i}", assert_code=str(a) or "pass") for i, a in enumerate(asserts)]
        return code, _bounded(cases)
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ValueError("test cases need lists 'inputs' and 'outputs' (or 'assert_case')")
    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise ValueError("no test cases")
    fn = tests.get("fn_name")
    if fn:
        if not str(fn).isidentifier():
            raise ValueError(f"fn_name {fn!r} is not an identifier")
        code = code + _FN_HARNESS.format(fn=str(fn))
    cases = [
        TestCase(name=f"case-{i}", stdin=_text(i_), expected_stdout=_text(o))
        for i, (i_, o) in enumerate(zip(inputs, outputs, strict=True))
    ]
    return code, _bounded(cases)


def _text(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):  # some datasets keep lines as a list
        return "\n".join(str(x) for x in v)
    return json.dumps(v)


def _bounded(cases: list[TestCase]) -> list[TestCase]:
    if len(cases) > MAX_CASES:
        raise ValueError(f"{len(cases)} test cases; at most {MAX_CASES} per action")
    return cases
