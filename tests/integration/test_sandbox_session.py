"""Shell sessions (`session=True` bash actions, `tangram_runner/session.py`) in real sandboxes,
on every backend: what carries over between a trajectory's session actions, and what never does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus
from tangram_celery.sandbox import ExecRequest
from tangram_celery.sandbox.base import ExecResult

# every process of the sandbox as "STATE (name)" (zombies included: state Z)
PROCS = (
    "for p in /proc/[0-9]*; do s=$(cat $p/stat 2>/dev/null) || continue; c=${s#*(}; st=${s##*) };"
    ' echo "${st%% *} (${c%%)*})"; done'
)


@pytest.fixture(scope="module")
def box(sandbox_factory: Callable[..., Any]) -> Any:
    return sandbox_factory(prewarm=1)


def traj() -> str:
    return f"s-{uuid.uuid4().hex[:8]}"


def run(box: Any, tid: str, code: str, session: bool = True, timeout_s: float = 5.0, **kw: Any) -> ExecResult:
    req = ExecRequest(
        language="bash", code=code, session=session, timeout_s=timeout_s, cores=(0,), memory_mb=128, **kw
    )
    return box.run(tid, req)


def live(box: Any, tid: str, name: str) -> list[str]:
    """Processes called `name` alive in the trajectory's sandbox (not zombies), seen by a plain
    bash action."""
    out = run(box, tid, PROCS, session=False).stdout
    return [line for line in out.splitlines() if line.endswith(f"({name})") and not line.startswith("Z ")]


def test_directory_variables_functions_and_aliases_carry_over(box: Any) -> None:
    """Given a session action that changes directory, exports, declares, defines a function and
    an alias, when the next session action runs, then all of these are there; its status and
    output are the command's."""
    tid = traj()
    first = run(
        box,
        tid,
        "mkdir -p /tmp/d && cd /tmp/d; export A=1; B=2; declare -A M=([k]=v); f() { echo F; }; alias g='echo G'",
    )
    assert (first.status, first.stdout, first.stderr) == (ActionStatus.OK, "", ""), first
    second = run(
        box, tid, "pwd; echo $A $B ${M[k]}; f; g; bash -c 'echo child sees ${A:-nothing} ${B:-nothing}'"
    )
    assert second.stdout == "/tmp/d\n1 2 v\nF\nG\nchild sees 1 nothing\n", second
    failed = run(box, tid, "false")
    assert (failed.status, failed.exit_code) == (ActionStatus.FAILED, 1), failed
    box.close_trajectory(tid)


def test_stdin_and_the_requests_variables_reach_the_command(box: Any) -> None:
    """A session action's stdin is its command's, and the request's variables are exported in
    the session (they stay, as an `export` would)."""
    tid = traj()
    res = run(box, tid, "cat; echo; echo $E", stdin="from stdin", env={"E": "e1"})
    assert res.stdout == "from stdin\ne1\n", res
    assert run(box, tid, "echo $E").stdout == "e1\n"
    box.close_trajectory(tid)


@pytest.mark.parametrize("command", ["sleep 100; echo after", "while :; do :; done; echo after"])
def test_a_timeout_kills_the_command_not_the_session(box: Any, command: str) -> None:
    """Given a session with a directory and a variable, when a command (a child process, or a
    loop inside the shell itself) runs past its deadline, then the action times out, nothing
    after it in the command ran, no process of it is left, and the next session action has the
    same directory and variable."""
    tid = traj()
    run(box, tid, "cd /tmp; export KEEP=yes")
    t0 = time.monotonic()
    res = run(box, tid, command, timeout_s=1.0)
    assert res.status is ActionStatus.TIMEOUT and "after" not in res.stdout, res
    assert time.monotonic() - t0 < 4.0
    after = run(box, tid, "pwd; echo $KEEP")
    assert (after.status, after.stdout, after.detail) == (ActionStatus.OK, "/tmp\nyes\n", ""), after
    assert live(box, tid, "sleep") == []
    box.close_trajectory(tid)


def test_exit_ends_the_session_and_the_next_action_says_it_restarted(box: Any) -> None:
    """Given a session whose command runs `exit 7`, then that action's exit code is 7 and its
    detail says the session ended; the next session action runs in a new shell, in the workdir
    without the old variables, and its stderr and detail say the session restarted."""
    tid = traj()
    run(box, tid, "cd /tmp; export GONE=1")
    ended = run(box, tid, "exit 7")
    assert (ended.status, ended.exit_code) == (ActionStatus.FAILED, 7), ended
    assert "session ended: the shell exited with status 7" in ended.detail
    again = run(box, tid, "pwd; echo ${GONE:-unset}")
    assert (again.status, again.stdout) == (ActionStatus.OK, "/work\nunset\n"), again
    assert again.stderr.startswith("tangram: session restarted (the shell exited with status 7)")
    assert "session restarted" in again.detail
    later = run(box, tid, "true")
    assert "restarted" not in later.detail + later.stderr
    box.close_trajectory(tid)


def test_a_background_job_does_not_outlive_its_action(box: Any) -> None:
    """Given a session action that starts `sleep 100 &` (and a detached one), when it has ended,
    then no sleep is alive, in the session or seen from a plain action, and the session goes on."""
    tid = traj()
    probe = run(box, tid, "sleep 30 & " + PROCS).stdout  # while its action runs, it is seen
    assert any(line.endswith("(sleep)") and line[0] != "Z" for line in probe.splitlines()), probe
    res = run(box, tid, "sleep 100 & setsid sleep 101 & nohup sleep 102 >/dev/null 2>&1 & echo started")
    assert (res.status, res.stdout) == (ActionStatus.OK, "started\n"), res
    assert live(box, tid, "sleep") == []
    seen = run(box, tid, PROCS, session=False).stdout  # reaped too: no pid of the limit held
    assert not [line for line in seen.splitlines() if line.endswith("(sleep)")], seen
    inside = run(box, tid, PROCS).stdout
    assert [line for line in inside.splitlines() if line.endswith("(sleep)") and line[0] != "Z"] == [], inside
    box.close_trajectory(tid)


def test_output_over_the_cap_is_an_output_limit_and_the_session_survives(box: Any) -> None:
    """A command that writes without end is stopped at the output cap (output_limit, the output
    truncated at the cap), and the session keeps its state."""
    tid = traj()
    run(box, tid, "cd /tmp")
    res = run(box, tid, "yes", max_output_bytes=4096)
    assert res.status is ActionStatus.OUTPUT_LIMIT and len(res.stdout) == 4096, (res.status, len(res.stdout))
    assert run(box, tid, "pwd").stdout == "/tmp\n"
    box.close_trajectory(tid)


@pytest.mark.parametrize(
    ("command", "status"),
    [
        ("python3 -c 'x = bytearray(1 << 30)'; echo after", ActionStatus.MEMORY_LIMIT),
        ("bomb() { bomb | bomb & }; bomb; sleep 1; echo after", ActionStatus.PIDS_LIMIT),
        ("head -c 30000000 /dev/zero > /tmp/fill; echo after", ActionStatus.DISK_LIMIT),
    ],
    ids=["memory", "pids", "disk"],
)
def test_limits_give_the_same_statuses_and_the_session_goes_on(
    box: Any, command: str, status: ActionStatus
) -> None:
    """A session command that hits the memory, pids or disk limit ends with that limit's
    status, as in a plain action, and the session keeps its directory and variables."""
    tid = traj()
    run(box, tid, "cd /tmp; export K=1")
    res = run(box, tid, command, timeout_s=4.0)
    assert res.status is status, res
    after = run(box, tid, "pwd; echo $K")
    assert (after.status, after.stdout) == (ActionStatus.OK, "/tmp\n1\n"), after
    box.close_trajectory(tid)


def test_a_plain_bash_action_is_unaffected_by_the_session(box: Any) -> None:
    """Given a session that changed directory and variables, a bash action without `session`
    of the same trajectory runs as before (workdir, none of the variables), shares the files,
    and leaves the session as it was."""
    tid = traj()
    run(box, tid, "cd /tmp; export S=1; echo shared > /work/f")
    plain = run(box, tid, "pwd; echo ${S:-unset}; cat /work/f", session=False)
    assert (plain.status, plain.stdout) == (ActionStatus.OK, "/work\nunset\nshared\n"), plain
    assert run(box, tid, "pwd; echo $S").stdout == "/tmp\n1\n"
    box.close_trajectory(tid)


def test_one_trajectory_never_sees_anothers_session(box: Any) -> None:
    """Two trajectories' sessions are two shells in two sandboxes: one's directory, variables and
    functions are not the other's."""
    a, b = traj(), traj()
    run(box, a, "cd /tmp; export SECRET=a-only; f() { echo a; }")
    seen = run(box, b, "pwd; echo ${SECRET:-none}; type f >/dev/null 2>&1 && echo f || echo nof")
    assert seen.stdout == "/work\nnone\nnof\n", seen
    assert run(box, a, "echo $SECRET").stdout == "a-only\n"
    box.close_trajectory(a)
    box.close_trajectory(b)


def test_a_shell_that_ignores_the_interrupt_is_replaced(box: Any) -> None:
    """Given a command that traps away the interrupt and loops in the shell, when it times out,
    then the shell is killed within the grace (the action says the session ended), and the next
    session action runs in a new shell."""
    tid = traj()
    run(box, tid, "cd /tmp")
    t0 = time.monotonic()
    res = run(box, tid, "trap '' INT USR1; while :; do :; done", timeout_s=1.0)
    assert res.status is ActionStatus.TIMEOUT and "session ended" in res.detail, res
    assert time.monotonic() - t0 < 6.0
    again = run(box, tid, "pwd")
    assert again.stdout == "/work\n" and "session restarted" in again.detail, again
    box.close_trajectory(tid)


def test_the_shell_is_stopped_between_actions(box: Any) -> None:
    """Between actions the session's shell does not run: it is stopped, also after another
    action of the sandbox uid sent it SIGCONT."""
    tid = traj()
    pid = run(box, tid, "echo $$").stdout.strip()
    run(box, tid, f"kill -CONT {pid}; sleep 0.1", session=False)
    state = run(box, tid, f"cut -d' ' -f3 /proc/{pid}/stat", session=False)
    assert state.stdout.strip() == "T", state
    assert run(box, tid, "echo $$").stdout.strip() == pid
    box.close_trajectory(tid)


def test_a_recycled_sandbox_has_no_session_of_its_previous_occupant(box: Any) -> None:
    """Given an occupant with a session, when its sandbox is scrubbed for the next occupant,
    then the old shell is gone and the new occupant's first session action starts a new one
    (no 'restarted': it never had one)."""
    if not hasattr(box, "ready") or not hasattr(box, "_recycle"):
        pytest.skip("this backend keeps no ready pool")
    assert box.ready.wait_full(60)
    h = box.ready.take()
    req = ExecRequest(
        language="bash", code="cd /tmp; export OLD=1; echo $$", session=True, cores=(0,), memory_mb=128
    )
    old_pid = box._exec(h, req).stdout.strip()
    fresh = box._recycle(h)
    assert fresh is not None
    res = box._exec(
        fresh,
        ExecRequest(
            language="bash",
            code="pwd; echo ${OLD:-none}; echo $$; " + PROCS,
            session=True,
            cores=(0,),
            memory_mb=128,
        ),
    )
    lines = res.stdout.splitlines()
    assert lines[:2] == ["/work", "none"] and lines[2] != old_pid, res
    assert sum("(bash)" in line and not line.startswith("Z ") for line in lines[3:]) == 1, res
    assert "restarted" not in res.detail + res.stderr
    box._teardown(fresh)
