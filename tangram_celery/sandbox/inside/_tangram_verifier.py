"""The verifier of one `assert_code` test: trusted code in its own process (stdlib only).

Forked from the zygote (never from the runner, which holds every test of the request), it runs
under its own uid (not the user's: user code can neither signal nor read it) with the seccomp
filter, reads its one test's `assert_code` from a memfd only it holds, and runs it with the user
module's top-level names bound to proxies of the objects in the user's process (_tangram_proxy).
It alone holds descriptor 4, the record: `PASS` is written there only after the assert code ran
to its end, and that record is the test's verdict. The user process's exit status and output
never decide it.

Names of the user module that shadow builtins (`len`, `abs`, `AssertionError`, ...) are not
bound: the test sees the real builtins. Exact builtin values among the user's globals (a constant
`MOD = 10**9 + 7`) arrive as copies taken when the module finished.
"""

from __future__ import annotations

import builtins
import os
import socket
import sys
import traceback
from typing import Any

try:
    from tangram_celery.sandbox.inside._tangram_proxy import TEST_FILENAME, Conn, install_importer
except ImportError:  # inside the sandbox this directory is sys.path[0]
    from _tangram_proxy import TEST_FILENAME, Conn, install_importer  # type: ignore[no-redef]

SOCK_FD, RECORD_FD = 3, 4


def run(assert_code: str, trusted_path: list[str]) -> None:
    """In the verifier process, after `_tangram_child.setup` (uid, limits, seccomp): judge the
    test and write the record. Never returns."""
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115
    passed, detail = False, ""
    try:
        passed, detail = verify(Conn(socket.socket(fileno=SOCK_FD)), assert_code, trusted_path)
    except BaseException as e:
        detail = f"verifier error: {e!r}"
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    record = b"PASS" if passed else b"FAIL" + detail.encode("utf-8", "replace")[:4000]
    os.write(RECORD_FD, record)
    os._exit(0)


def verify(conn: Conn, assert_code: str, trusted_path: list[str] | None) -> tuple[bool, str]:
    """(passed, why not): run the test against the user process behind `conn`. With
    `trusted_path`, imports come from there and otherwise from the user process."""
    lines = assert_code.splitlines()
    try:
        code = compile(assert_code, TEST_FILENAME, "exec")
    except SyntaxError as e:
        return False, f"the test's assert_code does not compile: {e}"
    if trusted_path is not None:
        install_importer(conn, trusted_path)
    try:
        first = conn.receive()
    except Exception as e:
        return False, f"user code never got ready: {e}"
    if type(first) is tuple and len(first) == 4 and first[0] == "err":
        return False, f"user code raised {first[1]}: {str(first[2])[:300]} before the tests ran"
    if type(first) is not tuple or len(first) != 2 or first[0] != "ready" or type(first[1]) is not dict:
        return False, "user code sent something else than its module"
    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    shadow = set(vars(builtins))
    for name, value in first[1].items():
        if type(name) is str and name not in shadow:
            ns[name] = value
    try:
        exec(code, ns)
    except SystemExit as e:  # only the test code itself can raise it here
        if e.code in (None, 0):
            return True, ""
        return False, f"the test exited with {e.code!r}"
    except BaseException as e:
        return False, describe(e, lines)
    return True, ""


def describe(e: BaseException, lines: list[str]) -> str:
    """`Type: message (test line N: source)`, plus the user-side traceback of a remote error."""
    msg = f"{type(e).__name__}: {e}"[:600]
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == TEST_FILENAME]
    if frames:
        n = frames[-1].lineno or 0
        src = lines[n - 1].strip()[:200] if 0 < n <= len(lines) else ""
        msg += f" (test line {n}: {src})"
    for note in getattr(e, "__notes__", [])[:1]:
        msg += "\n" + str(note)[-1000:]
    return msg
