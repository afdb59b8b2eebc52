"""A few programming problems for the demo workload: solution, a buggy first attempt, tests, and
a question whose final answer the agent computes with its code (scored by the reward models)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    name: str
    solution: str
    buggy: str
    tests: tuple[tuple[str, str], ...]  # (name, assert snippet)
    probe: str  # an exploratory snippet a model might run mid-trajectory
    question: str = ""  # asked of the agent; its final answer is printed by `answer_code`
    answer_code: str = ""  # prints "The answer is <value>." with the agent's own function
    answer: str = ""  # the reference value (what a rule verifier compares with)
    explanation: str = ""  # a reference sentence (what an embedding model compares with)


PROBLEMS = (
    Problem(
        "fib",
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        "def fib(n):\n    a, b = 1, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        tuple((f"fib_{n}", f"assert fib({n}) == {v}") for n, v in [(0, 0), (1, 1), (10, 55), (30, 832040)]),
        "print([fib(i) for i in range(10)])",
        question="What is fib(30), the 30th Fibonacci number?",
        answer_code='print(f"The answer is {fib(30)}.")',
        answer="832040",
        explanation="The 30th Fibonacci number, fib(30), is 832040.",
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
        question="How many primes are there below 100?",
        answer_code='print(f"The answer is {sum(is_prime(n) for n in range(100))}.")',
        answer="25",
        explanation="There are 25 prime numbers below 100.",
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
        question="What is reverse_words('the quick brown fox')?",
        answer_code="print(f\"The answer is {reverse_words('the quick brown fox')}.\")",
        answer="fox brown quick the",
        explanation="Reversing the words of 'the quick brown fox' gives 'fox brown quick the'.",
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
        question="What is the greatest common divisor of 1071 and 462?",
        answer_code='print(f"The answer is {gcd(1071, 462)}.")',
        answer="21",
        explanation="The greatest common divisor of 1071 and 462 is 21.",
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
        question="What is flatten([[1, 2], [3, [4, 5]]])?",
        answer_code='print(f"The answer is {flatten([[1, 2], [3, [4, 5]]])}.")',
        answer="[1, 2, 3, 4, 5]",
        explanation="Flattening [[1, 2], [3, [4, 5]]] gives the list [1, 2, 3, 4, 5].",
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
        question="How is 1994 written in Roman numerals?",
        answer_code='print(f"The answer is {roman(1994)}.")',
        answer="MCMXCIV",
        explanation="The year 1994 is written MCMXCIV in Roman numerals.",
    ),
)
