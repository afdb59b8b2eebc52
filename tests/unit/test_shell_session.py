"""Shell sessions (`tangram_runner/session.py`): the action's field, the wire, and the shell's
driver against a plain bash (the sandbox is tests/integration/test_sandbox_session.py)."""

from __future__ import annotations

import fcntl
import os
import select
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from tangram_celery.common.actions import CodeAction, TestCase
from tangram_celery.sandbox.base import ExecRequest
from tangram_celery.sandbox.limits import to_result
from tangram_runner import session
from tangram_runner.protocol import Facts, RunRequest
from tangram_runner.session import DRIVER, RUN_LINE
from tangram_runner.shell import Shell


def test_a_session_action_is_bash_code_in_a_trajectory() -> None:
    """A session action validates as bash code of a trajectory, and its flag reaches the
    sandbox's request by name."""
    a = CodeAction(language="bash", code="cd /tmp", trajectory_id="t1", session=True)
    assert a.session
    assert ExecRequest(language="bash", code="x", session=True).session
    assert not CodeAction(language="bash", code="ls", trajectory_id="t1").session


def test_run_code_takes_session_as_an_extra() -> None:
    """`/run_code`'s `session` extra reaches the action by name (SandboxFusion clients never
    send it), and is refused there as anywhere else."""
    from tangram_celery.web.sandbox_fusion import to_action
    from tangram_celery.web.sandbox_models import RunCodeRequest

    req = RunCodeRequest(code="cd /tmp", language="bash", session=True, trajectory_id="t1")
    assert to_action(req, "t1", 256).session
    assert not to_action(RunCodeRequest(code="ls", language="bash"), "t1", 256).session
    with pytest.raises(ValidationError, match="needs language 'bash'"):
        to_action(RunCodeRequest(code="x", language="python", session=True), "t1", 256)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"language": "python"}, "needs language 'bash'"),
        ({"trajectory_id": None}, "needs a trajectory_id"),
        ({"ephemeral": True}, "needs a trajectory_id"),
        ({"test_command": "pytest -q"}, "runs code only"),
        ({"test_cases": [TestCase(name="t", stdin="", expected_stdout="")]}, "runs code only"),
        ({"code": None, "files": {"a": "b"}}, "runs code only"),
    ],
)
def test_a_session_elsewhere_is_refused_with_a_clear_error(fields: dict[str, Any], says: str) -> None:
    """Given a session action in another language, without a trajectory, one-shot, or with
    tests or no code, then it does not validate, and the error says why."""
    with pytest.raises(ValidationError, match=says):
        CodeAction(**{"language": "bash", "code": "cd /", "trajectory_id": "t1", "session": True, **fields})


def test_the_runner_request_carries_session_only_when_set() -> None:
    """RunRequest.to_dict leaves `session` out by default (the wire is as before) and carries
    it when set; Facts carry the session's facts both ways."""
    base = RunRequest.from_dict({"v": 1, **_bare()})
    assert "session" not in base.to_dict() and base.session is False
    on = base._replace(session=True)
    assert on.to_dict()["session"] is True and RunRequest.from_dict(on.to_dict()).session
    facts = Facts(exit_code=0, session={"cwd": "/tmp", "restarted": "", "ended": ""})
    assert Facts.from_dict(facts.to_dict()).session == {"cwd": "/tmp", "restarted": "", "ended": ""}
    assert "session" not in Facts().to_dict()


def test_a_restarted_or_ended_session_is_in_the_results_detail() -> None:
    """The host's result says why a session's shell is new, or why it ended."""
    req = ExecRequest(language="bash", code="pwd", session=True)
    facts = Facts(
        exit_code=0, session={"cwd": "/work", "restarted": "the shell exited with status 3", "ended": ""}
    )
    assert "session restarted: the shell exited with status 3" in to_result(facts, {}, req).detail
    ended = Facts(
        exit_code=7, session={"cwd": "", "restarted": "", "ended": "the shell exited with status 7"}
    )
    assert "session ended" in to_result(ended, {}, req).detail
    assert (
        to_result(Facts(exit_code=0, session={"cwd": "/", "restarted": "", "ended": ""}), {}, req).detail
        == ""
    )


def test_reports_are_records_of_nonce_status_and_cwd() -> None:
    """The shell's reports are NUL-terminated records, read as they come (split anywhere)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    sh = Shell(0, -1, {"cmd": -1, "code": -1, "rep": r, "out": -1, "err": -1}, {})
    os.write(w, b"abc 3 /work/a b\0de")
    sh.read_reports()
    os.write(w, b"f ack\0")
    sh.read_reports()
    assert sh.reports == {"abc": (3, "/work/a b"), "def": (None, "")}
    os.close(w)
    sh.read_reports()
    assert not sh.rep_open
    os.close(r)
    assert session._died_status("the shell exited with status 7") == 7
    assert session._died_status("the shell was killed (signal 9)") == -9
    assert session._died_status("the shell ended") is None


# -- the driver, typed into a plain bash with the session's descriptors ---------------------------
class _Bash:
    """A bash started as the runner starts the session's (descriptors 0-4), without a sandbox."""

    def __init__(self) -> None:
        cmd_r, self.cmd = os.pipe()
        self.out, out_w = os.pipe()
        self.err, err_w = os.pipe()
        code_r, self.code = os.pipe()
        self.rep, rep_w = os.pipe()
        theirs = [cmd_r, out_w, err_w, code_r, rep_w]
        self.proc = subprocess.Popen(
            [shutil.which("bash") or "/bin/bash", "--noprofile", "--norc", "--noediting", "-i"],
            close_fds=False,
            preexec_fn=lambda: _arrange(theirs),
            env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"},
            cwd="/tmp",
        )
        for fd in theirs:
            os.close(fd)
        for fd in (self.out, self.err, self.rep):
            os.set_blocking(fd, False)
        self.sh = Shell(
            self.proc.pid,
            -1,
            {"cmd": self.cmd, "code": self.code, "rep": self.rep, "out": self.out, "err": self.err},
            {},
        )
        os.write(self.cmd, DRIVER.encode() + b"__tangram_ack ready\n")
        assert self.wait("ready")
        self.read(self.out), self.read(self.err)

    def wait(self, nonce: str, timeout_s: float = 5.0) -> bool:
        while nonce not in self.sh.reports:
            if not select.select([self.rep], [], [], timeout_s)[0]:
                return False
            self.sh.read_reports()
        return True

    @staticmethod
    def read(fd: int) -> bytes:
        out = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return out
            if not chunk:
                return out
            out += chunk

    def run(
        self, code: str, stdin: str = "", env: dict[str, str] | None = None, stale: bytes = b""
    ) -> tuple[Any, bytes]:
        kv = [f"{k}={v}" for k, v in (env or {}).items()]
        nonce = f"n{len(self.sh.reports)}x"
        os.write(self.cmd, RUN_LINE.format(sync="sync:S1").encode())
        payload = "\0".join(["sync:S1", code, stdin, str(len(kv)), *kv, nonce]) + "\0"
        os.write(self.code, stale + payload.encode())
        assert self.wait(nonce)
        return self.sh.reports[nonce], self.read(self.out)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for fd in (self.cmd, self.code, self.out, self.err, self.rep):
            os.close(fd)


def _arrange(fds: list[int]) -> None:  # pragma: no cover - in the child
    """`fds[i]` becomes descriptor i; every other descriptor is closed."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 256) for fd in fds]
    for i, fd in enumerate(high):
        os.dup2(fd, i)
    os.closerange(len(fds), 1 << 16)


@pytest.fixture
def bash() -> Iterator[_Bash]:
    b = _Bash()
    try:
        yield b
    finally:
        b.close()


def test_the_driver_keeps_directory_variables_functions_and_declarations(bash: _Bash) -> None:
    """Given code run through the driver, then cd, exports, plain and `declare`d variables,
    functions and aliases are there for the next code; its status and directory are reported."""
    (status, cwd), out = bash.run(
        "cd /; export A=1; B=2; declare -A M=([k]=v); f() { echo F; }; alias g='echo G'; false"
    )
    assert (status, cwd, out) == (1, "/", b"")
    (status, cwd), out = bash.run("echo $A $B ${M[k]}; f; g; pwd")
    assert (status, out) == (0, b"1 2 v\nF\nG\n/\n")


def test_the_driver_gives_the_code_its_stdin_and_variables_and_hides_its_channels(bash: _Bash) -> None:
    """The code reads the action's stdin, sees the action's variables exported, and holds
    neither the report channel (fd 4) nor the nonce."""
    _, out = bash.run(
        "cat; echo; echo $V; (echo x >&4) 2>/dev/null || echo no4; echo ${__tangram_nonce:-none}",
        "in",
        {"V": "w"},
    )
    assert out == b"in\nw\nno4\nnone\n"


def test_the_driver_skips_what_an_interrupted_action_left_on_fd_3(bash: _Bash) -> None:
    """What an action cut short left unread on fd 3 (part of its code, its nonce) is skipped up
    to this action's sync mark."""
    (status, _), out = bash.run("echo fresh", stale=b"sync:S0\0echo stale\0\x000\0nonce-old\0half a cod")
    assert (status, out) == (0, b"fresh\n")


def _bare() -> dict[str, Any]:
    return {
        "language": "bash",
        "code": "pwd",
        "tools": {},
        "memory_mb": 64,
        "compile_memory_mb": 64,
        "files": {},
        "binary_files": {},
        "fetch_files": [],
        "max_fetch_bytes": 0,
        "test_command": None,
        "test_cases": [],
        "stdin": None,
        "timeout_s": 1.0,
        "compile_timeout_s": 1.0,
        "cores": [0],
        "nofile": 64,
        "max_output_bytes": 1024,
        "env": {},
        "pythonpath": [],
        "key": "",
        "verifier_group": "",
    }
