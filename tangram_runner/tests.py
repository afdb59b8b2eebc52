"""The built-in test runner: up to `dop` test cases at once under the action's deadline, each in
a fresh user process from the zygote (stdlib only).

- stdin -> expected_stdout: the user process gets the stdin; the runner compares its output with
  the expected one itself. Expected outputs never leave the runner.
- assert_code: the user process runs the code and then serves its objects; a verifier (from the
  zygote too, under its own uid) runs the assert code against them, and the test passes only on the
  verifier's own `PASS` record. The user process's exit status and output do not count.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

from tangram_runner.langs import UNITS
from tangram_runner.proc import Action, Proc

if TYPE_CHECKING:
    from tangram_runner.protocol import RunRequest

PYTHON_UNIT = UNITS["python"]  # the file a Python program runs as (`python3 main.py`)


def norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


class _Slot:
    """One test in flight: its user process and, for assert tests, its verifier."""

    def __init__(self, idx: int, user: Proc | None, verifier: Proc | None = None) -> None:
        self.idx, self.user, self.verifier = idx, user, verifier
        self.result: dict[str, Any] | None = None

    def done(self) -> bool:
        return all(p is None or p.returncode is not None for p in (self.user, self.verifier))


def run_tests(
    req: RunRequest,
    act: Action,
    dop: int,
    code_fd: int | None,
    trusted_path: list[str],
    argv: list[str] | None,
) -> tuple[list[dict[str, Any]], Proc | None]:
    """(one outcome per test case, the user process of the first test, whose output the action
    shows). `argv` runs the program (None: python, from `code_fd`). Up to `dop` cases run at
    once; the host may change it while they run (`act.dop`, `control`): each case still
    runs exactly once."""
    cases = req.test_cases
    results: list[dict[str, Any] | None] = [None] * len(cases)
    slots: dict[int, _Slot] = {}  # pid -> slot
    running: set[_Slot] = set()
    first: Proc | None = None
    nxt = 0
    act.dop = dop

    def more() -> bool:  # the DoP was raised while cases are left: start them now
        return nxt < len(cases) and len(running) < act.dop

    while nxt < len(cases) or running:
        while len(running) < act.dop and nxt < len(cases):
            idx = nxt
            nxt += 1
            slot = _start_case(req, act, idx, cases[idx], code_fd, trusted_path, argv)
            if not isinstance(slot, _Slot):  # it could not start: its outcome
                results[idx] = slot
                continue
            if idx == 0:
                first = slot.user
            running.add(slot)
            for p in (slot.user, slot.verifier):
                if p is not None:
                    slots[p.pid] = slot
        if not running:
            break
        proc = act.wait_any(more)
        if proc is None:
            if act.timed_out or act.output_capped:
                break
            continue
        slot = slots[proc.pid]
        if proc is slot.verifier and slot.user is not None:
            act.kill(slot.user)  # its verdict is in; the user process has nothing left to do
        if slot.done():
            running.discard(slot)
            if results[slot.idx] is None:
                results[slot.idx] = slot.result or _judge(cases[slot.idx], slot)
    why = "timeout" if act.timed_out else "output limit" if act.output_capped else "not run"
    out = [r or _fail(c, why) for r, c in zip(results, cases, strict=True)]
    return out, first


def _start_case(
    req: RunRequest,
    act: Action,
    idx: int,
    case: dict[str, Any],
    code_fd: int | None,
    trusted_path: list[str],
    argv: list[str] | None,
) -> _Slot | dict[str, Any]:
    """Start test case `idx`: its slot, or its outcome when it cannot run."""
    lang = req.language
    if case.get("assert_code") is not None:
        if lang != "python":
            return _fail(case, "assert_code tests need language python")
        slot = _start_assert(req, act, idx, case, code_fd, trusted_path)
    else:
        py = PYTHON_UNIT if lang == "python" else None
        slot = _Slot(idx, act.spawn(idx, case.get("stdin"), argv=argv, python=py, code_fd=code_fd))
    if slot.user is None:
        return _fail(case, f"could not start: {act.spawn_error}")
    return slot


def _fail(case: dict, detail: str) -> dict[str, Any]:
    return {"name": case["name"], "passed": False, "detail": detail}


def _start_assert(
    req: RunRequest, act: Action, idx: int, case: dict, code_fd: int | None, trusted_path: list[str]
) -> _Slot:
    """The user process, and the test given to a pooled verifier connected to it."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        user = act.spawn(
            idx, case.get("stdin"), python=PYTHON_UNIT, code_fd=code_fd, extra_fd=theirs.fileno()
        )
    finally:
        theirs.close()
    if user is None:
        mine.close()
        return _Slot(idx, None)
    try:
        job = act.start_job(("verifier", idx), case["assert_code"], mine.fileno(), trusted_path)
    finally:
        mine.close()
    slot = _Slot(idx, user, job)
    if job is None:  # the user process sees its connection close and ends
        slot.result = _fail(case, f"could not start a verifier: {act.spawn_error}")
    return slot


def _judge(case: dict, slot: _Slot) -> dict[str, Any]:
    user = slot.user
    assert user is not None
    if slot.verifier is None:  # stdin -> expected stdout, compared here
        if user.returncode != 0:
            return _fail(case, f"exit {user.returncode}: {text(user.stderr)[-400:]}")
        got = text(user.stdout)
        if norm(got) != norm(case["expected_stdout"]):
            return _fail(case, f"expected {case['expected_stdout'][:200]!r}, got {got[:200]!r}")
        return {"name": case["name"], "passed": True, "detail": ""}
    record = slot.verifier.stream("record")
    if record == b"PASS":
        return {"name": case["name"], "passed": True, "detail": ""}
    detail = text(record[4:]) if record.startswith(b"FAIL") else "the verifier ended without a verdict"
    err = text(user.stderr).strip()
    if err:
        detail += f"\nuser stderr: {err[-400:]}"
    verr = text(slot.verifier.stderr).strip()
    if verr and not record.startswith(b"FAIL"):
        detail += f"\nverifier: {verr[-400:]}"
    return _fail(case, detail)
