"""The verifier's semantics against a user-side server (both in this process, over a real
socketpair): what legitimate tests can do with user objects, and what no user object can do to
the verdict."""

from __future__ import annotations

import builtins
import marshal
import operator
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tangram_runner import proxy
from tangram_runner.codec import encode, recv_msg, send_msg
from tangram_runner.launch import (
    MAX_RUNNER_COMPILE,
    TEST_FILENAME,
    assert_payload,
    compiled_payload,
)
from tangram_runner.proxy import Conn
from tangram_runner.serve import Server, exception_record
from tangram_runner.verifier import verify

COMPILED_BY = ["verifier"]  # who compiles the test's code: set per test by the fixture below


@pytest.fixture(autouse=True)
def user_code_patches_nothing_of_this_process() -> Iterator[None]:
    """User code runs here in a thread, not in a process of its own as in a sandbox: what a
    hostile one patches (`builtins`, `operator`) is put back after each test, or it would hold
    for every later test of the session (an `operator.eq` that says True to everything makes
    packaging's marker checks, and so the staging of the sandboxes' test tools, go wrong)."""
    saved = [(m, dict(vars(m))) for m in (builtins, operator)]
    yield
    for module, before in saved:
        now = vars(module)
        for name in [n for n in now if n not in before]:
            del now[name]
        now.update(before)


@pytest.fixture(autouse=True, params=["verifier", "runner"])
def compiled_by(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every verdict twice: the verifier compiles the test's code itself, or gets it compiled
    by the runner (`launch.assert_payload`, marshalled as the job's memfd carries it)."""
    COMPILED_BY[0] = request.param
    yield request.param
    COMPILED_BY[0] = "verifier"


def verify_as_sent(conn: Conn, test_code: str) -> tuple[bool, str]:
    if COMPILED_BY[0] == "runner":
        payload, compiled = assert_payload(test_code)
        if compiled:
            source, code = marshal.loads(payload)
            return verify(conn, source, None, code)
        return verify(conn, payload.decode(), None)
    return verify(conn, test_code, None)


def judge(user_code: str, test_code: str) -> tuple[bool, str]:
    """Run `user_code` as the user module behind a server thread; verify `test_code` against it."""
    mine, theirs = socket.socketpair()

    def user_side() -> None:
        server = Server(theirs)
        ns: dict[str, Any] = {"__name__": "__main__"}
        try:
            exec(compile(user_code, "main.py", "exec"), ns)
        except SystemExit:
            theirs.close()
            return
        except BaseException as e:
            server.send(exception_record(e))
            theirs.close()
            return
        server.ready(ns)
        server.serve()
        theirs.close()

    t = threading.Thread(target=user_side, daemon=True)
    t.start()
    try:
        return verify_as_sent(Conn(mine), test_code)
    finally:
        mine.close()
        t.join(5)


ADD = "def add(a, b):\n    return a + b\n"
HUMANEVAL_CHECK = (
    "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n\ncheck(add)\n"
)


@pytest.mark.parametrize(
    ("user", "test"),
    [
        (ADD, HUMANEVAL_CHECK),
        (ADD, "assert add(2, 3) == 5\nassert add('a', 'b') == 'ab'\nassert add([1], [2]) == [1, 2]"),
        (
            "class Stack:\n    def __init__(self):\n        self.items = []\n"
            "    def push(self, x):\n        self.items.append(x)\n    def pop(self):\n"
            "        return self.items.pop()\n    def __len__(self):\n        return len(self.items)\n",
            "s = Stack()\ns.push(1)\ns.push(2)\nassert len(s) == 2 and s.items == [1, 2]\n"
            "assert s.pop() == 2\ns.label = 'x'\nassert s.label == 'x'\nassert bool(s)",
        ),
        (
            "def gen(n):\n    for i in range(n):\n        yield i * i\n",
            "assert list(gen(4)) == [0, 1, 4, 9]\nassert sum(gen(3)) == 5\nassert 4 in list(gen(3))",
        ),
        (
            "def sqrt(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x ** 0.5\n",
            "try:\n    sqrt(-1)\n    assert False\nexcept ValueError:\n    pass\nassert sqrt(4) == 2.0",
        ),
        (
            "class Bad(ValueError):\n    pass\ndef f():\n    raise Bad('x')\n",
            "try:\n    f()\n    assert False\nexcept ValueError as e:\n    assert 'x' in str(e)",
        ),
        (
            "from collections import Counter, defaultdict, namedtuple\nP = namedtuple('P', 'x y')\n"
            "def hist(s):\n    return Counter(s.split())\ndef groups():\n    d = defaultdict(list)\n"
            "    d[1].append(2)\n    return d\ndef point():\n    return P(1, 2)\n",
            "assert hist('a b a') == {'a': 2, 'b': 1}\nassert groups() == {1: [2]}\nassert point() == (1, 2)"
            "\nassert point().x == 1\nassert point() in {(1, 2)}",
        ),
        (
            "class Meters(float):\n    pass\ndef dist():\n    return Meters(2.5)\n",
            "assert abs(dist() - 2.5) < 1e-9\nassert dist() == 2.5\nassert round(dist()) == 2",
        ),
        ("def sort_in_place(xs):\n    xs.sort()\n", "a = [3, 1, 2]\nsort_in_place(a)\nassert a == [1, 2, 3]"),
        (
            "class Box:\n    pass\ndef put(xs, d=None):\n    xs.append(Box())\n    d['n'] = [len(xs)]\n",
            "a, b = [1.5], {}\nput(a, d=b)\nassert len(a) == 2 and a[0] == 1.5 and b == {'n': [2]}",
        ),
        ("MOD = 7\ndef f(x):\n    return x % MOD\n", "assert f(10) == 3 and MOD == 7"),
        (ADD, "import math\nassert math.isclose(add(0.1, 0.2), 0.3)\nraise SystemExit(0)"),
        ("", "assert [x for x in range(3)] == [0, 1, 2]"),
        ("", "def g(x: int) -> 'str':\n    pass\nassert g.__annotations__ == {'x': int, 'return': 'str'}"),
    ],
    ids=[
        "humaneval",
        "mbpp",
        "stateful-class",
        "generator",
        "exception",
        "exception-subclass",
        "counter-defaultdict-namedtuple",
        "float-subclass",
        "in-place-mutation",
        "in-place-mutation-object-and-keyword",
        "module-constant",
        "stdlib-and-exit-0",
        "no-user-code",
        "annotations-evaluated",
    ],
)
def test_legitimate_tests_pass(user: str, test: str) -> None:
    """Given a correct solution, when its test runs in the verifier, then it passes."""
    ok, why = judge(user, test)
    assert ok, why


ALWAYS = (
    "    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n        return False\n"
)


@pytest.mark.parametrize(
    ("user", "test"),
    [
        ("def add(a, b):\n    return a - b\n", HUMANEVAL_CHECK),
        (
            "class E:\n" + ALWAYS + "    __hash__ = object.__hash__\ndef add(a, b):\n    return E()\n",
            HUMANEVAL_CHECK,
        ),
        (
            "class E(int):\n" + ALWAYS + "    __hash__ = int.__hash__\ndef add(a, b):\n    return E(0)\n",
            HUMANEVAL_CHECK,
        ),
        ("class E(list):\n" + ALWAYS + "def f():\n    return E()\n", "assert f() == [1, 2]"),
        (
            "class E(str):\n" + ALWAYS + "    __hash__ = str.__hash__\ndef f():\n    return E('no')\n",
            "assert f() == 'yes'",
        ),
        (
            "def add(a, b):\n    raise StopIteration\n",
            "assert all(map(lambda p: add(*p) == sum(p), [(1, 2), (3, 4)]))",
        ),
        ("def add(a, b):\n    raise SystemExit(0)\n", HUMANEVAL_CHECK),
        ("def add(a, b):\n    raise KeyboardInterrupt\n", HUMANEVAL_CHECK),
        ("def abs(x):\n    return 0\ndef f():\n    return 9\n", "assert abs(f() - 1) < 1e-6"),
        ("def AssertionError():\n    pass\ndef add(a, b):\n    return 0\n", HUMANEVAL_CHECK),
        (
            "import builtins, operator\nbuiltins.AssertionError = type('X', (Exception,), {})\n"
            "operator.eq = lambda a, b: True\ndef add(a, b):\n    return 0\n",
            HUMANEVAL_CHECK,
        ),
        ("raise SystemExit(0)\ndef add(a, b):\n    return a + b\n", HUMANEVAL_CHECK),
        ("1 / 0\n", HUMANEVAL_CHECK),
        (
            "class L:\n    def __len__(self):\n        return 3\ndef f():\n    return L()\n",
            "assert f() == [1, 2, 3]",
        ),
    ],
    ids=[
        "wrong",
        "always-equal-object",
        "always-equal-int-subclass",
        "always-equal-list-subclass",
        "always-equal-str-subclass",
        "stop-iteration-ends-loop",
        "system-exit-in-call",
        "keyboard-interrupt-in-call",
        "shadow-builtin-abs",
        "shadow-assertion-error",
        "patch-builtins-operator",
        "exit-before-tests",
        "crash-before-tests",
        "duck-typed-lookalike",
    ],
)
def test_wrong_solutions_fail_whatever_they_return(user: str, test: str) -> None:
    """Given a wrong solution (or one that games equality, exits, patches or shadows builtins),
    when its test runs in the verifier, then it fails."""
    ok, why = judge(user, test)
    assert not ok and why


@pytest.mark.parametrize(
    "answer",
    [("ok", True, []), ("ok", object(), []), ("ok", 5.000001, []), ("err", "AssertionError", "", ""), ("x",)],
    ids=["true", "handle", "near-miss", "assertion-error", "garbage"],
)
def test_forged_replies_cannot_pass(answer: tuple[Any, ...]) -> None:
    """Given a user side that speaks the protocol itself and answers every request (the call,
    and the base-value request for a handle) with a forged reply, when the verifier checks
    `add(2, 3) == 5`, then it fails."""
    mine, theirs = socket.socketpair()

    def forger() -> None:
        send_msg(theirs, encode(("ready", {"add": object()}), lambda o: 1))
        while recv_msg(theirs) is not None:
            send_msg(theirs, encode(answer, lambda o: 2))
        theirs.close()

    t = threading.Thread(target=forger, daemon=True)
    t.start()
    try:
        ok, why = verify_as_sent(Conn(mine), "assert add(2, 3) == 5")
    finally:
        mine.close()
        t.join(5)
    assert not ok and why


def test_a_verifier_error_message_names_the_test_line() -> None:
    """Given a failing assert, when verified, then the detail names the test line and source."""
    ok, why = judge(ADD, "x = 1\nassert add(1, 1) == 3, 'sum'")
    assert not ok and "test line 2" in why and "AssertionError: sum" in why


def test_a_verifier_warm_up_passes_and_leaves_the_interpreter_as_it_was() -> None:
    """Given a fresh verifier process state, when it warms up (a test of the harness's own
    against a server thread of its own), then the test passes and builtins, sys.path and
    sys.meta_path are as before."""
    import builtins
    import sys

    from tangram_runner.verifier import warm_up

    before = (dict(vars(builtins)), list(sys.path), list(sys.meta_path))
    assert warm_up() is True
    assert (dict(vars(builtins)), list(sys.path), list(sys.meta_path)) == before


@pytest.mark.parametrize("compiled_by", ["runner"], indirect=True)
def test_the_runner_compiles_tests_as_the_verifier_would(compiled_by: str) -> None:
    """Given assert code, when the runner prepares it for a verifier, then the verifier gets the
    source and its code object under the verifier's file name; and code that does not compile
    goes as source, for the verifier to say why."""
    assert TEST_FILENAME == proxy.TEST_FILENAME
    payload, compiled = assert_payload("assert 1 + 1 == 2")
    source, code = marshal.loads(payload)
    assert compiled and source == "assert 1 + 1 == 2" and code.co_filename == TEST_FILENAME
    payload, compiled = assert_payload("assert (")
    assert not compiled and payload == b"assert ("
    mine, theirs = socket.socketpair()
    with mine, theirs:
        ok, why = verify(Conn(mine), payload.decode(), None)
    assert not ok and "does not compile" in why


@pytest.mark.parametrize("compiled_by", ["runner"], indirect=True)
@pytest.mark.parametrize(
    "source",
    [
        "def f(:\n    pass\n",  # a syntax error: the process raises it as python3 would
        "x = 1\nif x is 1:\n    pass\n",  # a SyntaxWarning python3 prints
        "s = '\\d'\n",  # an invalid escape: a DeprecationWarning
        "x = 0\n" * (MAX_RUNNER_COMPILE // 6 + 1),  # too long to compile in the runner
    ],
    ids=["syntax-error", "syntax-warning", "deprecation-warning", "large"],
)
def test_the_runner_leaves_programs_it_cannot_compile_cleanly_to_the_process(
    compiled_by: str, source: str
) -> None:
    """Given a program that does not compile without a word from the compiler, or a very long
    one, when the runner prepares it, then it goes as source: the user process compiles it
    under the action's deadline and shows what `python3` would show."""
    payload, compiled = compiled_payload(source, "main.py")
    assert not compiled and payload == source.encode()


def test_the_runner_compiles_a_clean_program_as_python3_would() -> None:
    """Given a program that compiles cleanly, when the runner prepares it, then the process
    gets its source and a code object under the program's file name, compiled without the
    harness's own `__future__` flags."""
    source = "def f(x: int) -> int:\n    return x\nresult = f.__annotations__\n"
    payload, compiled = compiled_payload(source, "main.py")
    assert compiled
    got_source, code = marshal.loads(payload)
    assert got_source == source and code.co_filename == "main.py"
    ns: dict[str, Any] = {}
    exec(code, ns)
    assert ns["result"] == {"x": int, "return": int}
