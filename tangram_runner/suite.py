"""Runner side of a `test_command` suite: the rewrite of `pytest` to the harness's bootstrap, the
report channel, and the verdict (stdlib only).

A suite passes only on what the harness itself received: at least one pytest session reported
on the channel, every session finished with exit status 0, no collection error, at least one test,
and every collected test passed (skipped or xfailed tests are not passes: user code can call
`pytest.skip`). Exit status 0 alone, "N passed" printed on stdout, or a junit file is not a pass.

Shards: where xdist cannot be counted on (the suite runs on a container image's own Python and
pytest, or no tools directory is given), `pytest` with DoP K > 1 becomes the bootstrap's launcher
(`--tangram-shards K`), which starts K bootstraps, each running its share of the collected tests
(`pytest_boot`). Each shard session says which share it ran of how many tests (a digest of the
sorted test ids); the suite passes only if every shard of the run reported, all collected the
same tests, and together they ran each of them exactly once.
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
MAX_SHARDS = MAX_SESSIONS // 2  # two sharded pytest calls in one command still fit the channel
MAX_REPORTS = 200_000
MAX_TESTS_SHOWN = 2000


def mentions_pytest(cmd: str) -> bool:
    return "pytest" in cmd or "py.test" in cmd


def rewrite(
    cmd: str, dop: int, runner_dir: str, pythonpath: list[str], python: str = "", image: bool = False
) -> str:
    """Every `pytest` / `python -m pytest` becomes the bootstrap, run by `python` (default: this
    interpreter; in a container image, the image's own). When dop > 1 (and the command sets no
    `-n` itself): `-n dop` (pytest-xdist from the tools directory `pythonpath`), or, on an
    `image`'s Python or without a tools directory, min(dop, MAX_SHARDS) shards that the bootstrap
    starts itself (`--tangram-shards`: no xdist needed)."""
    boot = (
        f"{shlex.quote(python or sys.executable)} -E -s {shlex.quote(os.path.join(runner_dir, 'pytest_boot.py'))}"
        f" --tangram-fd {REPORT_FD} --tangram-path {shlex.quote(':'.join(pythonpath) or ':')}"
    )
    if dop > 1 and " -n " not in cmd:
        if image or not pythonpath:
            boot += f" --tangram-shards {min(dop, MAX_SHARDS)}"
        else:
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
        self.shard: tuple[str, int, int, int, str] | None = None  # run, index, count, total, digest


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
        elif kind == "shard" and s.shard is None:
            fields = (ev.get("run"), ev.get("index"), ev.get("count"), ev.get("total"), ev.get("digest"))
            if all(isinstance(f, t) for f, t in zip(fields, (str, int, int, int, str), strict=True)):
                s.shard = fields

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


def _session_why(s: _Session) -> str:
    """Why one session does not pass ("" if it does). A shard may have run no test (fewer tests
    than shards): its run's total is checked instead (`_shards_why`)."""
    if s.exitstatus is None:
        return "a pytest session ended without its final report (killed, or exited early)"
    if s.collect_errors:
        return f"collection errors: {', '.join(s.collect_errors[:5])}"
    if not s.collected and s.shard is None:
        return "no test was collected"
    passed = sum(1 for phases in s.phases.values() if _outcome(phases)[0])
    if passed != (s.collected or 0):
        return f"{passed} of {s.collected} collected tests passed"
    if s.exitstatus != 0:
        return f"pytest exit status {s.exitstatus}"
    return ""


def _shard_runs(sessions: list[_Session]) -> dict[str, list[_Session]]:
    runs: dict[str, list[_Session]] = {}
    for s in sessions:
        if s.shard is not None:
            runs.setdefault(s.shard[0], []).append(s)
    return runs


def _shards_why(runs: dict[str, list[_Session]]) -> str:
    """Why the shards of a sharded run do not cover its tests exactly once ("" if they do):
    every shard 0..K-1 reported once, all collected the same tests (count and digest of their
    ids), their shares add up to that count, and no test ran in two shards."""
    for group in runs.values():
        run, _, count, total, digest = group[0].shard  # type: ignore[misc]
        if any(s.shard != (run, s.shard[1], count, total, digest) for s in group if s.shard):
            return "the shards of a pytest run collected different tests"
        indices = sorted(s.shard[1] for s in group if s.shard)
        missing = sorted(set(range(count)) - set(indices))
        if missing:
            return f"shard(s) {missing} of {count} sent no report (killed, or exited early)"
        if indices != list(range(count)):
            return f"a pytest run reported shards {indices} of {count}"
        if not total:
            return "no test was collected"
        ran = sum(s.collected or 0 for s in group)
        if ran != total:
            return f"the shards ran {ran} of {total} collected tests"
        seen: set[str] = set()
        for s in group:
            twice = seen.intersection(s.phases)
            if twice:
                return f"a test ran in two shards: {sorted(twice)[0]}"
            seen.update(s.phases)
    return ""


def verdict(ch: Channel, exit_code: int | None) -> dict[str, Any]:
    """The suite's verdict from the channel: {"passed", "detail", "collected", "deselected",
    "tests"}. Deselected tests (by `-k`/`-m` on the command line, or by configuration files in
    the workdir) are counted but do not fail the suite: a project may deselect by design (the
    shards of a run deselect the same tests: counted once)."""
    sessions = list(ch.sessions.values())
    tests: list[dict[str, Any]] = []
    why = "" if sessions else "no pytest report reached the harness (pytest did not run under it)"
    for s in sessions:
        for nodeid, phases in s.phases.items():
            ok, how = _outcome(phases)
            tests.append({"name": nodeid, "passed": ok, "detail": "" if ok else how})
        why = why or _session_why(s)
    runs = _shard_runs(sessions)
    why = why or _shards_why(runs)
    if not why and exit_code != 0:
        why = f"the test command exited with {exit_code}"
    if len(tests) > MAX_TESTS_SHOWN:
        tests = [t for t in tests if not t["passed"]][:MAX_TESTS_SHOWN]
    deselected = sum(s.deselected for s in sessions if s.shard is None)
    deselected += sum(max(s.deselected for s in group) for group in runs.values())
    return {
        "passed": not why,
        "detail": why,
        "collected": sum(s.collected or 0 for s in sessions),
        "deselected": deselected,
        "tests": tests,
    }
