"""The built-in calculator bounds its work and reports user errors as ValueError (`failed`)."""

import time

import pytest

from tangram_celery.apis.builtin import calculator


@pytest.mark.parametrize(
    "expr",
    ["9**9**9", "((2**64)**64)**64**64", "(10**1000)*(10**1000)", "2**4096", "-" * 900 + "1", "1+", "((("],
)
def test_expressions_that_would_stall_or_are_malformed_fail_fast(expr: str) -> None:
    """Nested powers, huge products, deep nesting and syntax errors are refused in well under a
    second with a ValueError (the API worker maps it to `failed`, never `error`)."""
    t0 = time.monotonic()
    with pytest.raises(ValueError):
        calculator({"expr": expr})
    assert time.monotonic() - t0 < 1.0


def test_ordinary_arithmetic_still_works() -> None:
    """Large-but-bounded results and floats are computed as before."""
    assert calculator({"expr": "2*(3+4)"}) == {"value": 14}
    assert calculator({"expr": "2**4095"})["value"] == 2**4095
    assert calculator({"expr": "2**-2"}) == {"value": 0.25}
