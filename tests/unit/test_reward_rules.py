"""Rule verifiers and input validation at submit."""

from __future__ import annotations

import pytest

from reward_servers.backends import input_errors
from reward_servers.backends.rules import exact_match, math_equiv, to_number
from reward_servers.service import validate_request
from tangram_celery.common.config import parse_config


@pytest.mark.parametrize(
    ("response", "reference"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5"),
        ("#### 1,000", "1000"),
        ("The answer is 50%.", "1/2"),
        ("We get $x = 3$, so the answer is 3", "3.0"),
        ("\\boxed{x+1}", "x + 1"),
    ],
)
def test_math_equivalent_answers(response: str, reference: str) -> None:
    """Given equal answers written differently, when compared, then they are equivalent."""
    assert math_equiv(response, reference)


@pytest.mark.parametrize(("response", "reference"), [("\\boxed{2}", "3"), ("answer: 1/3", "0.33"), ("", "1")])
def test_math_different_answers(response: str, reference: str) -> None:
    """Given different answers, when compared, then they are not equivalent."""
    assert not math_equiv(response, reference)


def test_exact_match_ignores_case_and_spacing() -> None:
    """Given the same words with other case and spacing, when matched, then they match; others do not."""
    assert exact_match("  Paris\n", "paris") and not exact_match("Paris.", "Paris")
    assert to_number("\\frac{3}{4}") == to_number("0.75")


def test_malformed_inputs_are_named() -> None:
    """Given missing, extra and non-string inputs, when validated, then each problem is named."""
    errors = input_errors("embedding-sim", {"reference": 1, "extra": "x"})
    assert any("missing input 'response'" in e for e in errors)
    assert any("'reference' must be a string" in e for e in errors)
    assert any("unexpected input 'extra'" in e for e in errors)
    assert input_errors("hf-seq-cls", {"response": "ok"}) == []


def test_unknown_model_is_rejected_at_submit() -> None:
    """Given a config with one model, when an action names another, then the reason lists declared models."""
    cfg = parse_config(
        {
            "nodes": {"gpu": [{"name": "g", "num_gpus": 1, "gpu_memory_mb": 1024}]},
            "reward_models": [{"name": "rm", "backend": "hf-seq-cls", "path": "/m"}],
        }
    )
    assert "declared: ['rm']" in (validate_request(cfg, "nope", {"response": "x"}) or "")
    assert "missing input" in (validate_request(cfg, "rm", {}) or "")
    assert validate_request(cfg, "rm", {"prompt": "p", "response": "r"}) is None
