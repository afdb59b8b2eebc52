"""A few programming problems for the demo workload: solution, a buggy first attempt, tests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    name: str
    solution: str
    buggy: str
    tests: tuple[tuple[str, str], ...]  # (name, assert snippet)
    probe: str  # an exploratory snippet a model might run mid-trajectory


PROBLEMS = (
    Problem(
        "fib",
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        "def fib(n):\n    a, b = 1, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        tuple((f"fib_{n}", f"assert fib({n}) == {v}") for n, v in [(0, 0), (1, 1), (10, 55), (30, 832040)]),
        "print([fib(i) for i in range(10)])",
    ),
    Problem(
        "is_prime",
        "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n"
        "        if n % i == 0:\n            return False\n        i += 1\n    return True\n",
        "def is_prime(n):\n    return n > 1 and all(n % i for i in range(2, n // 2))\n",
        tuple(
            (f"prime_{n}", f"assert is_prime({n}) is {v}")
            for n, v in [(1, False), (2, True), (4, False), (97, True), (7919, True), (7917, False)]
        ),
        "print([n for n in range(30) if is_prime(n)])",
    ),
    Problem(
        "reverse_words",
        "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
        "def reverse_words(s):\n    return s[::-1]\n",
        (
            ("two", "assert reverse_words('hello world') == 'world hello'"),
            ("spaces", "assert reverse_words('  a  b ') == 'b a'"),
            ("empty", "assert reverse_words('') == ''"),
        ),
        "print(reverse_words('the quick brown fox'))",
    ),
    Problem(
        "gcd",
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return abs(a)\n",
        "def gcd(a, b):\n    return min(a, b)\n",
        tuple(
            (f"gcd_{a}_{b}", f"assert gcd({a}, {b}) == {v}")
            for a, b, v in [(12, 18, 6), (17, 5, 1), (0, 9, 9)]
        ),
        "print(gcd(1071, 462))",
    ),
    Problem(
        "flatten",
        "def flatten(xs):\n    out = []\n    for x in xs:\n        out.extend(flatten(x) if isinstance(x, list) else [x])\n"
        "    return out\n",
        "def flatten(xs):\n    return [y for x in xs for y in (x if isinstance(x, list) else [x])]\n",
        (
            ("flat", "assert flatten([1, 2]) == [1, 2]"),
            ("deep", "assert flatten([1, [2, [3, [4]]]]) == [1, 2, 3, 4]"),
        ),
        "print(flatten([[1, 2], [3, [4, 5]]]))",
    ),
    Problem(
        "roman",
        "def roman(n):\n    out = ''\n    for v, s in [(1000,'M'),(900,'CM'),(500,'D'),(400,'CD'),(100,'C'),(90,'XC'),"
        "(50,'L'),(40,'XL'),(10,'X'),(9,'IX'),(5,'V'),(4,'IV'),(1,'I')]:\n        while n >= v:\n"
        "            out += s\n            n -= v\n    return out\n",
        "def roman(n):\n    return 'I' * n\n",
        tuple(
            (f"roman_{n}", f"assert roman({n}) == {s!r}")
            for n, s in [(3, "III"), (4, "IV"), (1994, "MCMXCIV")]
        ),
        "print(roman(2024))",
    ),
)
