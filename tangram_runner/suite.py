"""Runner side of a `test_command` suite: the rewrite of `pytest` to the harness's bootstrap, the
report channel, and the verdict (stdlib only).

A suite passes only on what the harness itself received: at least one pytest session reported
on the channel, every session finished with exit status 0, no collection error, at least one test,
and every collected test passed (skipped or xfailed tests are not passes: user code can call
`pytest.skip`). Exit status 0 alone, "N passed" printed on stdout, or a junit file is not a pass.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import sys
from typing import Any

PYTEST = re.compile(r"(^|[;&|(]\s*|\bexec\s+)(python3?(?:\.\d+)?\s+-m\s+pytest|py\.test|pytest)(?=\s|$)")
REPORT_FD = 3  # where the command's processes find the channel
MAX_SESSIONS = 16
MAX_REPORTS = 200_000
MAX_TESTS_SHOWN = 2000


def mentions_pytest(cmd: str) -> bool:
    return "pytest" in cmd or "py.test" in cmd


def rewrite(cmd: str, dop: int, runner_dir: str, pythonpath: list[str], python: str = "") -> str:
    """Every `pytest` / `python -m pytest` becomes the bootstrap (with `-n dop` when dop > 1),
    run by `python` (default: this interpreter; in a container image, the image's own)."""
    boot = (
        f"{shlex.quote(python or sys.executable)} -E -s {shlex.quote(os.path.join(runner_dir, 'pytest_boot.py'))}"
        f" --tangram-fd {REPORT_FD} --tangram-path {shlex.quote(':'.join(pythonpath) or ':')}"
    )
    if dop > 1 and " -n " not in cmd:
        boot += f" -n {dop}"
    return PYTEST.sub(lambda m: m.group(1) + boot, cmd)


class _Session:
    def __init__(self) -> None:
        self.collected: int | None = None
        self.collect_errors: list[str] = []
        self.phases: dict[str, list[tuple[str, str, bool]]] = {}
        self.exitstatus: int | None = None
        self.reports = 0
        self.deselected = 0


class Channel:
    """The runner's end of the report socket; `child_fd` goes to the command as descriptor 3."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setblocking(False)
        self.sock = mine
        self.child_fd = theirs.detach()
        self.sessions: dict[str, _Session] = {}
        self.open = True

    def on_readable(self) -> None:
        """Answer hellos with a fresh nonce; record reports that carry a known one."""
        for _ in range(256):
            try:
                msg = self.sock.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError:
                msg = b""
            if not msg:
                self.open = False  # every holder closed it
                return
            if msg == b"hello":
                if len(self.sessions) < MAX_SESSIONS:
                    nonce = os.urandom(16).hex()
                    self.sessions[nonce] = _Session()
                    try:
                        self.sock.send(nonce.encode())
                    except OSError:
                        pass
                continue
            self._record(msg)

    def _record(self, msg: bytes) -> None:
        try:
            ev = json.loads(msg)
            s = self.sessions.get(str(ev.get("nonce"))) if isinstance(ev, dict) else None
        except ValueError:
            return
        if s is None or s.reports >= MAX_REPORTS:
            return
        s.reports += 1
        kind = ev.get("event")
        if kind == "collected" and isinstance(ev.get("n"), int):
            s.collected = ev["n"] if s.collected is None else max(s.collected, ev["n"])
        elif kind == "deselected" and isinstance(ev.get("n"), int):
            s.deselected += ev["n"]
        elif kind == "collect_error":
            s.collect_errors.append(str(ev.get("nodeid", ""))[:500])
        elif kind == "report":
            nodeid = str(ev.get("nodeid", ""))[:500]
            s.phases.setdefault(nodeid, []).append(
                (str(ev.get("when")), str(ev.get("outcome")), bool(ev.get("xfail")))
            )
        elif kind == "finish" and isinstance(ev.get("exitstatus"), int):
            s.exitstatus = ev["exitstatus"]

    def close(self) -> None:
        self.sock.close()
        try:
            os.close(self.child_fd)
        except OSError:
            pass


def _outcome(phases: list[tuple[str, str, bool]]) -> tuple[bool, str]:
    """(passed, how) of one test from its setup/call/teardown reports."""
    for when, outcome, xfail in phases:
        if outcome == "failed":
            return False, f"failed in {when}"
        if xfail:
            return False, f"xfail ({outcome} in {when})"
    calls = [o for w, o, _ in phases if w == "call"]
    if calls and all(o == "passed" for o in calls):
        return True, "passed"
    if any(o == "skipped" for _, o, _ in phases):
        return False, "skipped"
    return False, "did not run"


def verdict(ch: Channel, exit_code: int | None) -> dict[str, Any]:
    """The suite's verdict from the channel: {"passed", "detail", "collected", "deselected",
    "tests"}. Deselected tests (by `-k`/`-m` on the command line, or by configuration files in
    the workdir) are counted but do not fail the suite: a project may deselect by design."""
    tests: list[dict[str, Any]] = []
    collected = 0
    why = ""
    if not ch.sessions:
        why = "no pytest report reached the harness (pytest did not run under it)"
    for s in ch.sessions.values():
        for nodeid, phases in s.phases.items():
            ok, how = _outcome(phases)
            tests.append({"name": nodeid, "passed": ok, "detail": "" if ok else how})
        collected += s.collected or 0
        if why:
            continue
        if s.exitstatus is None:
            why = "a pytest session ended without its final report (killed, or exited early)"
        elif s.collect_errors:
            why = f"collection errors: {', '.join(s.collect_errors[:5])}"
        elif not s.collected:
            why = "no test was collected"
        else:
            passed = sum(1 for phases in s.phases.values() if _outcome(phases)[0])
            if passed != s.collected:
                why = f"{passed} of {s.collected} collected tests passed"
            elif s.exitstatus != 0:
                why = f"pytest exit status {s.exitstatus}"
    if not why and exit_code != 0:
        why = f"the test command exited with {exit_code}"
    if len(tests) > MAX_TESTS_SHOWN:
        tests = [t for t in tests if not t["passed"]][:MAX_TESTS_SHOWN]
    deselected = sum(s.deselected for s in ch.sessions.values())
    return {
        "passed": not why,
        "detail": why,
        "collected": collected,
        "deselected": deselected,
        "tests": tests,
    }
