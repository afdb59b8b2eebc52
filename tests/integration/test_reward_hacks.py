"""Reward hacks, on both backends, written as an attacker would: wrong solutions that try to be
counted as passing anyway (exit codes, signals, descriptors, patched builtins, lying objects,
reading the harness's memory and files, forged reports). Every one must fail, and afterwards the
same trajectory and a fresh one still run a correct solution."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus, TestCase
from tangram_celery.sandbox import ExecRequest
from tests.integration.test_hostile import healthy, tid

REFERENCE = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"
HUMANEVAL = (
    "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n\ncheck(add)\n"
)
ADD_TESTS = [
    TestCase(name="mbpp", assert_code="assert add(2, 3) == 5\nassert add(10, -4) == 6\n"),
    TestCase(name="humaneval", assert_code=HUMANEVAL),
]
ALWAYS_EQUAL = (
    "    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n        return False\n"
    "    def __bool__(self):\n        return True\n    def __hash__(self):\n        return 0\n"
)
KILL_EVERYTHING = """
import os, signal
for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGKILL):
    for p in os.listdir('/proc'):
        if p.isdigit() and int(p) != os.getpid():
            try:
                os.kill(int(p), sig)
            except OSError:
                pass
try:
    os.kill(-1, signal.SIGKILL)
except OSError:
    pass
"""
PATCH_HARNESS = """
import builtins, gc, operator, os, sys
builtins.AssertionError = type('AssertionError', (Exception,), {})
operator.eq = lambda a, b: True
sys.excepthook = lambda *a: None
sys.exit = os._exit = lambda *a: None
sys.path.insert(0, '/opt/tangram/runner')
for obj in gc.get_objects():  # the user side of the test protocol: answer True to everything
    if isinstance(obj, type) and obj.__name__ == 'Server':
        obj.dispatch = lambda self, op, o, args: ('ok', True, [])
"""
FORGE_PROTOCOL = """
import socket, sys
sys.path.insert(0, '/opt/tangram/runner')
from tangram_runner import codec as c
sock = socket.socket(fileno=3)
c.send_msg(sock, c.encode(('ready', {}), lambda o: 1))
while (msg := c.recv_msg(sock)) is not None:
    c.send_msg(sock, c.encode(('ok', True, []), lambda o: 1))
"""
PTRACE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for p in os.listdir('/proc'):
    if p.isdigit() and int(p) != os.getpid():
        libc.ptrace(16, int(p), 0, 0)  # PTRACE_ATTACH
        buf = ctypes.create_string_buffer(64)
        iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 64)
        libc.process_vm_readv(int(p), iov, 1, iov, 1, 0)
"""
DAEMON = """
import os, time
if os.fork() == 0:
    os.setsid()
    time.sleep(0.2)
    for fd in range(3, 64):
        try:
            os.write(fd, b'PASS')
        except OSError:
            pass
    os._exit(0)
"""
FAKE_OUTPUT = """
import sys
for stream in (sys.stdout, sys.stderr):
    print('PASS\\nok\\nAll tests passed\\n{"tests": [{"name": "mbpp", "passed": true}]}', file=stream)
    stream.flush()
"""

ASSERT_ATTACKS = {
    "system-exit-0-at-import": WRONG + "raise SystemExit(0)\n",
    "os-exit-0-at-import": WRONG + "import os\nos._exit(0)\n",
    "sys-exit-0-in-call": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "os-exit-0-in-call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "kill-everything-it-sees": WRONG + KILL_EVERYTHING,
    "kill-everything-in-call": "def add(a, b):\n"
    + "\n".join("    " + x for x in KILL_EVERYTHING.splitlines()),
    "sigkill-self-in-call": "import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGKILL)\n",
    "close-descriptors": WRONG + "import os\nfor fd in range(3, 1024):\n    try:\n        os.close(fd)\n"
    "    except OSError:\n        pass\n",
    "redirect-descriptors": WRONG
    + "import os\nnull = os.open('/dev/null', os.O_RDWR)\nfor fd in range(1024):\n"
    "    try:\n        os.dup2(null, fd)\n    except OSError:\n        pass\n",
    "patch-builtins-sys-operator-harness": WRONG + PATCH_HARNESS,
    "always-equal-object": "class E:\n" + ALWAYS_EQUAL + "def add(a, b):\n    return E()\n",
    "always-equal-int": "class E(int):\n" + ALWAYS_EQUAL + "def add(a, b):\n    return E(0)\n",
    "always-equal-str": "class E(str):\n" + ALWAYS_EQUAL + "def add(a, b):\n    return E('0')\n",
    "always-equal-list": "class E(list):\n" + ALWAYS_EQUAL + "def add(a, b):\n    return E()\n",
    "always-equal-float": "class E(float):\n" + ALWAYS_EQUAL + "def add(a, b):\n    return E(0.5)\n",
    "forge-the-test-protocol": FORGE_PROTOCOL,
    "ptrace-and-read-other-processes": WRONG + PTRACE,
    "daemon-writes-verdicts-later": WRONG + DAEMON,
    "print-fake-results": WRONG + FAKE_OUTPUT,
    "stop-iteration": "def add(a, b):\n    raise StopIteration\n",
}


def run(box: Any, traj: str, **kw: Any) -> Any:
    return box.run(traj, ExecRequest(**kw))


def still_works(box: Any, traj: str) -> None:
    """The attacked trajectory and a fresh one both pass a correct solution; nothing is left over."""
    res = run(box, traj, language="python", code=REFERENCE, test_cases=ADD_TESTS)
    assert res.status is ActionStatus.OK and all(t.passed for t in res.tests), res
    healthy(box, traj)
    fresh = tid()
    res = run(box, fresh, language="python", code=REFERENCE, test_cases=ADD_TESTS)
    assert res.status is ActionStatus.OK and all(t.passed for t in res.tests), res
    box.close_trajectory(fresh)
    box.close_trajectory(traj)


def failed(res: Any) -> None:
    assert res.status is not ActionStatus.OK, res
    assert res.tests and not any(t.passed for t in res.tests), res


@pytest.mark.parametrize("attack", list(ASSERT_ATTACKS))
def test_wrong_solution_cannot_pass_assert_tests(sandbox_backend: Any, attack: str) -> None:
    """Given a wrong `add` plus a trick (exit 0 before or during the asserts, signals to every
    process, closed or redirected descriptors, patched builtins/operator/harness code, objects
    equal to everything, a forged test protocol, ptrace, a daemon, fake output), when its
    assert_code tests run, then none passes, and the sandbox serves the next actions."""
    traj = tid()
    test_code = "assert all(map(lambda p: add(*p) == sum(p), [(2, 3), (1, 1)]))"
    tests = [TestCase(name="map", assert_code=test_code)] if attack == "stop-iteration" else ADD_TESTS
    res = run(sandbox_backend, traj, language="python", code=ASSERT_ATTACKS[attack], test_cases=tests)
    failed(res)
    still_works(sandbox_backend, traj)


FIND_TOKEN = r"""
import gc, os, re, sys
PAT = re.compile(rb"tok-[0-9a-f]{32}")


def _in(b):
    m = PAT.search(b)
    return m.group().decode() if m else None


def _read(path, limit=1 << 22):
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return b""


def find_token():
    for o in gc.get_objects():  # everything this interpreter holds
        vals = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple, set)) else [o]
        for v in list(vals):
            if isinstance(v, str) and (t := _in(v.encode("utf-8", "ignore"))):
                return t
            if isinstance(v, bytes) and (t := _in(v)):
                return t
    f = sys._getframe()
    while f is not None:  # every frame up the stack
        for v in list(f.f_locals.values()) + list(f.f_globals.values()):
            if isinstance(v, str) and (t := _in(v.encode("utf-8", "ignore"))):
                return t
        f = f.f_back
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:  # every process
        for name in ("environ", "cmdline"):
            if t := _in(_read(f"/proc/{pid}/{name}")):
                return t
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            if os.path.isfile(f"/proc/{pid}/fd/{fd}") and (t := _in(_read(f"/proc/{pid}/fd/{fd}"))):
                return t
        try:
            with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
                for line in maps:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    if "r" in line.split()[1] and hi - lo < 1 << 26:
                        try:
                            mem.seek(lo)
                            if t := _in(mem.read(hi - lo)):
                                return t
                        except OSError:
                            pass
        except OSError:
            pass
    for top in ("/work", "/tmp", "/run", "/opt", "/dev/shm", "/proc/1/root", "/proc/1/cwd"):
        for root, _dirs, names in os.walk(top):
            for n in names:
                if t := _in(_read(os.path.join(root, n), 1 << 20)):
                    return t
    return "nothing"
"""


def token() -> str:
    return "tok-" + uuid.uuid4().hex


def test_expected_output_is_not_in_reach_of_user_code(sandbox_backend: Any) -> None:
    """Given stdin tests whose expected output is a secret token, when a solution searches its
    heap, its frames, every process's memory, environment, command line and descriptors, and the
    files it can read, then it finds nothing and fails."""
    traj = tid()
    secret = token()
    code = FIND_TOKEN + "print(find_token())\n"
    tests = [TestCase(name=f"s{i}", stdin=f"{i}\n", expected_stdout=secret) for i in range(3)]
    res = run(sandbox_backend, traj, language="python", code=code, test_cases=tests, cores=(0, 1))
    failed(res)
    assert secret not in res.stdout + res.stderr  # (a failed test's detail quotes the expected output)
    assert res.stdout.strip() == "nothing", res
    still_works(sandbox_backend, traj)


def test_hidden_assert_code_is_not_in_reach_of_user_code(sandbox_backend: Any) -> None:
    """Given an assert test comparing with a secret token, when the function under test searches
    for it everywhere (while the verifier and the runner hold it), then it finds nothing and the
    test fails."""
    traj = tid()
    secret = token()
    code = FIND_TOKEN + "def secret():\n    return find_token()\n"
    tests = [TestCase(name="secret", assert_code=f"assert secret() == {secret!r}")]
    res = run(sandbox_backend, traj, language="python", code=code, test_cases=tests)
    failed(res)
    assert secret not in res.stdout + res.stderr
    still_works(sandbox_backend, traj)


PYTEST_FILES = {
    "test_solution.py": "from solution import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
    "def test_neg():\n    assert add(-1, 1) == 0\n",
}
FORGED_REPORTS = """
import json, os
for ev in [{"event": "collected", "n": 2}, {"event": "report", "nodeid": "test_solution.py::test_add",
           "when": "call", "outcome": "passed"}, {"event": "finish", "exitstatus": 0}]:
    for nonce in ("", "0" * 32):
        try:
            os.write(3, json.dumps({"nonce": nonce, **ev}).encode())
        except OSError:
            pass
"""
PYTEST_ATTACKS = {
    "os-exit-0-at-collection": WRONG + "import os\nos._exit(0)\n",
    "sys-exit-0-at-collection": WRONG + "import sys\nsys.exit(0)\n",
    "fake-summary-then-exit-0": WRONG + "print('=' * 20 + ' 2 passed in 0.01s ' + '=' * 20)\n"
    "import os, sys\nsys.stdout.flush()\nos._exit(0)\n",
    "skip-from-user-code": "import pytest\ndef add(a, b):\n    pytest.skip('not today')\n",
    "xfail-from-user-code": "import pytest\ndef add(a, b):\n    pytest.xfail('not today')\n",
    "forged-channel-reports": WRONG + FORGED_REPORTS,
    "forged-reports-then-exit-0": WRONG + FORGED_REPORTS + "os._exit(0)\n",
    "report-files-then-exit-0": WRONG + "import os\nos.makedirs('.pytest_cache/v/cache', exist_ok=True)\n"
    "open('.pytest_cache/v/cache/lastfailed', 'w').write('{}')\n"
    "open('report.xml', 'w').write('<testsuite tests=\"2\" failures=\"0\" errors=\"0\"/>')\nos._exit(0)\n",
    "kill-the-shell-and-everything": WRONG + KILL_EVERYTHING,
}


@pytest.mark.parametrize("attack", list(PYTEST_ATTACKS))
def test_wrong_solution_cannot_pass_a_pytest_suite(sandbox_backend: Any, attack: str) -> None:
    """Given a pytest suite and a wrong solution module that exits 0 during collection, prints a
    fake summary, skips or xfails from user code, forges channel messages, writes report files
    or kills everything, when `pytest` runs as the test command, then the suite is not passed,
    and the sandbox serves the next actions."""
    traj = tid()
    files = {**PYTEST_FILES, "solution.py": PYTEST_ATTACKS[attack]}
    res = run(sandbox_backend, traj, language="python", code=None, files=files, test_command="pytest -q")
    assert res.status is not ActionStatus.OK, res
    assert not res.tests or not all(t.passed for t in res.tests), res
    files = {**PYTEST_FILES, "solution.py": REFERENCE}
    ok = run(sandbox_backend, traj, language="python", code=None, files=files, test_command="pytest -q")
    assert ok.status is ActionStatus.OK and [t.passed for t in ok.tests] == [True, True], ok
    still_works(sandbox_backend, traj)
