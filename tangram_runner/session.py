"""The sandbox's shell session (stdlib only): bash code of a trajectory run in one long-lived
shell, so that its working directory, variables, functions and aliases carry over from one
session action to the next (what SWE-ReX and ROCK offer). See docs/sandbox.md, "Shell sessions".

The shell is an interactive `bash` (`--noprofile --norc --noediting -i`, no terminal) of the
sandbox uid, forked by the zygote like every user process, with the limits and the environment
of the action that started it. Its descriptors are the harness's, fixed for its life:
0 the command lines the runner writes (one per action), 1 and 2 pipes the runner reads, 3 what
an action brings (a sync mark, its code, stdin, variables and, last, a fresh random nonce,
NUL-separated: the mark lets the shell skip what an interrupted action left unread),
4 the reports the shell writes back (`nonce status cwd`, NUL-terminated). An action's code is
sourced at the shell's top level from a pipe (not a function: `declare` stays global), with
fd 3 and 4 out of its reach and its stdin its own; the nonce is read only after the code ran,
so the shell's own code never held it, and a report without the action's nonce never counts.
Stdout carries nothing but output.

Between actions nothing runs: once an action's report is in, the runner stops the shell
(SIGSTOP, which nothing can catch), kills every other process of the sandbox (what the command
left in the background) and reads the pipes dry; the next session action continues it. A
command past its deadline or over the output cap is interrupted: SIGUSR1, which the shell
traps into a SIGINT to itself (an interactive bash abandons the command and returns to its
prompt), while the runner kills every other process (so a foreground child ends) and asks for
an acknowledgement; a shell that does not give one within `INTERRUPT_GRACE_S` (it trapped or
ignored the signals, or is stuck) is killed, and the next session action starts a new one. So
is a shell that exited (`exit`, `exec`, `set -e`) or was killed: the next action's result says
"session restarted" and why, and the working directory is the workdir again.
"""

from __future__ import annotations

import os
import select
import signal
import time
from typing import Any

from tangram_runner.forkserver import SpawnFailed
from tangram_runner.launch import Launch, Proc
from tangram_runner.proc import Action
from tangram_runner.reaping import KEPT, kill_others, reap_orphans, strays
from tangram_runner.shell import Shell, drain, new_token, pump

START_TIMEOUT_S = 5.0  # the shell's start, within the action's own deadline
INTERRUPT_GRACE_S = 1.5  # an interrupted command's shell has this long to come back
ACK_EVERY_S = 0.25
REAP_WAIT_S = 0.2  # at most, for the shell to reap the background jobs of its action, killed

# What the runner types into a new shell before its first action. `__tangram_pre` takes the
# action's code, stdin and variables off fd 3; the code is sourced at top level; `__tangram_post`
# reads the nonce (after the code ran) and reports. PS1/PS2 empty: no prompts in the output.
DRIVER = r"""PS1= PS2= PS3= PS4='+ '; set +o history; unset HISTFILE PROMPT_COMMAND MAIL MAILPATH
__tangram_pre() {
  local __tangram_n __tangram_kv
  while IFS= read -r -d '' -u 3 __tangram_kv && [[ $__tangram_kv != *"$1" ]]; do :; done
  IFS= read -r -d '' -u 3 __tangram_code; IFS= read -r -d '' -u 3 __tangram_stdin
  IFS= read -r -d '' -u 3 __tangram_n
  while (( __tangram_n-- > 0 )); do IFS= read -r -d '' -u 3 __tangram_kv; export "$__tangram_kv"; done
}
__tangram_post() {
  local __tangram_nonce; IFS= read -r -d '' -u 3 __tangram_nonce
  printf '%s %d %s\0' "$__tangram_nonce" "$1" "$PWD" >&4; unset __tangram_code __tangram_stdin
}
__tangram_ack() { printf '%s ack\0' "$1" >&4; }
trap 'kill -s INT $$' USR1
"""
# {sync}: where this action's part of fd 3 starts (what an interrupted one left there is skipped)
RUN_LINE = (
    '__tangram_pre {sync}; source /dev/fd/3 3< <(printf %s "$__tangram_code")'
    ' < <(printf %s "$__tangram_stdin") 4>&-; __tangram_post $?\n'
)


class Session:
    """The session of the sandbox's occupant: at most one shell, started on its first session
    action, kept (stopped) between actions, ended by `close` (the scrub between occupants)."""

    def __init__(self) -> None:
        self.shell: Shell | None = None
        self.had = False  # a shell ran for this occupant: a new one is a restart
        self.why = ""  # why the last one ended
        self._gone: list[Shell] = []  # shells ended whose pipes are still to be read and closed

    # -- life -----------------------------------------------------------------------------
    def close(self, zygote: Any = None) -> None:
        """End the session (the sandbox changes occupant): the shell is killed and collected
        (by the `zygote`, its parent, when given)."""
        self._drop("closed", zygote)
        self._bury()
        self.had, self.why = False, ""

    def _bury(self) -> None:
        for sh in self._gone:
            sh.close_fds()
        self._gone.clear()

    def _drop(self, why: str, zygote: Any = None) -> None:
        sh = self.shell
        if sh is None:
            return
        self.shell = None
        KEPT.pop(sh.pid, None)
        sh.signal(signal.SIGKILL)
        deadline = time.monotonic() + 1.0
        while not sh.dead() and time.monotonic() < deadline:
            select.select([sh.pidfd], [], [], 0.05)
        self.why = self.why or why
        if zygote is not None:
            _collect(zygote, sh.pid)
        reap_orphans()
        self._gone.append(sh)

    def _ended(self, zygote: Any) -> None:
        """The shell died on its own: say how, for the next action's result."""
        sh = self.shell
        assert sh is not None
        status = _collect(zygote, sh.pid)
        if status is None:
            self.why = "the shell ended"
        elif status < 0:
            self.why = f"the shell was killed (signal {-status})"
        else:
            self.why = f"the shell exited with status {status}"
        self._drop(self.why)  # collected above

    def _start(self, act: Action, bash: str) -> Shell | None:
        """A new shell with `act`'s limits and environment, its driver typed in and answered."""
        fds: dict[str, int] = {}
        cmd_r, fds["cmd"] = os.pipe()
        fds["out"], out_w = os.pipe()
        fds["err"], err_w = os.pipe()
        code_r, fds["code"] = os.pipe()
        fds["rep"], rep_w = os.pipe()
        limits = act.limits()
        ln = Launch("session", {**limits, "env": dict(act.env)}, user=True)
        ln.send = [cmd_r, out_w, err_w, code_r, rep_w]
        ln.mine = list(ln.send)
        ln.spec.update(fds=5, mode="exec", argv=[bash, "--noprofile", "--norc", "--noediting", "-i"])
        try:
            started, errors = act.zygote.spawn([ln.spec], ln.send)
        except SpawnFailed as e:
            started, errors = [None], [str(e)]
        finally:
            for fd in ln.mine:
                os.close(fd)
        if started[0] is None:
            act.fork_failed, act.spawn_error = True, (errors or ["the session shell did not start"])[0]
            for fd in fds.values():
                os.close(fd)
            return None
        for name in ("cmd", "out", "err", "rep", "code"):
            os.set_blocking(fds[name], False)
        sh = Shell(started[0][0], started[0][1], fds, limits)
        KEPT[sh.pid] = sh.pidfd
        self.shell = sh
        ready = new_token()
        sh.type(DRIVER.encode() + f"__tangram_ack {ready}\n".encode())
        until = min(act.deadline, time.monotonic() + START_TIMEOUT_S)
        pump(act, sh, None, lambda: ready in sh.reports or sh.dead(), until)
        drain(act, sh, None)  # bash's notes on the missing terminal, the first prompt
        if ready not in sh.reports:
            act.spawn_error = "the session shell did not start"
            self._drop("it did not start", act.zygote)
            self.why = ""
            return None
        return sh

    def _ready(self, act: Action, bash: str) -> tuple[Shell | None, str]:
        """The live shell for this action (started if need be), and why it is a new one after
        an earlier one ended ("" otherwise)."""
        self._bury()
        sh = self.shell
        if sh is not None and sh.dead():
            self._ended(act.zygote)
        elif sh is not None and sh.limits != act.limits():  # the rlimit fallback: limits per process
            self._drop("the action's limits differ from the shell's", act.zygote)
        restarted = self.why if self.had and self.shell is None else ""
        if self.shell is None:
            self.why = ""
            if self._start(act, bash) is None:
                return None, restarted
            self.had = True
        return self.shell, restarted

    # -- one action ---------------------------------------------------------------------------
    def run(self, act: Action, bash: str) -> tuple[Proc | None, dict[str, str]]:
        """Run `act`'s request (bash code) in the session: the action's process record (its
        output, and the command's exit status as its returncode; None when the shell could not
        start) and the session's facts (`cwd`, `restarted`)."""
        req = act.req
        code, stdin = req.code or "", req.stdin or ""
        act.set_deadline(float(req.timeout_s))
        sh, restarted = self._ready(act, bash)
        info = {"cwd": "", "restarted": restarted, "ended": ""}
        if sh is None or "\0" in code or "\0" in stdin:
            if sh is not None:
                act.spawn_error = "a session action's code and stdin cannot hold NUL characters"
            return None, info
        proc = Proc(sh.pid, None, "session", {sh.out: "out", sh.err: "err"}, user=True)
        if restarted:  # the command's stderr starts with it: a caller reading output sees it
            proc.bufs["err"] += f"tangram: session restarted ({restarted})\n".encode()
        nonce, sync = new_token(), new_token()
        env = [f"{k}={v}" for k, v in req.env.items()]
        payload = "\0".join([f"sync:{sync}", code, stdin, str(len(env)), *env, nonce]) + "\0"
        sh.signal(signal.SIGCONT)
        sh.type(RUN_LINE.format(sync=f"sync:{sync}").encode())
        pump(act, sh, proc, lambda: nonce in sh.reports or sh.dead(), act.deadline, payload.encode())
        status: int | None = None
        if nonce in sh.reports:
            status, info["cwd"] = sh.reports.pop(nonce)
        elif sh.dead():
            self._ended(act.zygote)
            status = _died_status(self.why)
        else:  # the deadline or the output cap: the command goes, the shell stays if it can
            proc.killed_by_runner = True
            if not self._interrupt(act, sh, proc):
                self._drop("an interrupted command did not give the shell back", act.zygote)
        keep = {1, os.getpid(), act.zygote.pid, *act.zygote.verifiers.pids(), *KEPT}
        if self.shell is not None and strays(keep):
            # one round while the shell runs, so that it reaps what it can (a zombie child of a
            # stopped shell holds a pid of the sandbox's limit until the next session action),
            # then stopped before the rest go: a trap of the shell's cannot react
            kill_others(keep, rounds=1)
            _await_reaped(sh.pid, time.monotonic() + REAP_WAIT_S)
            sh.signal(signal.SIGSTOP)
        kill_others(keep)
        drain(act, sh, proc)
        if self.shell is None:
            info["ended"] = self.why
        else:
            sh.reports.clear()
        # the facts read it as the action's main process: set, so that the action's end
        # neither kills nor closes anything of it
        proc.returncode = -signal.SIGKILL if status is None else status
        act.procs.append(proc)
        self._bury()
        return proc, info

    def _interrupt(self, act: Action, sh: Shell, proc: Proc) -> bool:
        """Abandon the running command (deadline or output cap): True once the shell is back at
        its prompt, False if it did not come back within the grace."""
        sh.signal(signal.SIGUSR1)
        keep = {1, os.getpid(), act.zygote.pid, *act.zygote.verifiers.pids(), *KEPT}
        acks: set[str] = set()
        until = time.monotonic() + INTERRUPT_GRACE_S
        while time.monotonic() < until:
            kill_others(keep, rounds=1)  # the command's foreground child ends: the trap can run
            ack = new_token()
            acks.add(ack)
            sh.type(f"__tangram_ack {ack}\n".encode())
            step = min(until, time.monotonic() + ACK_EVERY_S)
            pump(act, sh, proc, lambda: bool(acks & sh.reports.keys()) or sh.dead(), step, force=True)
            if acks & sh.reports.keys():
                return True
            if sh.dead():
                self._ended(act.zygote)
                return True  # gone all the same; the next action starts a new one
        return False


def _died_status(why: str) -> int | None:
    """The exit status of a command that ended its shell (`exit 3`), from `Session.why`."""
    tail = why.rsplit(" ", 1)[-1].rstrip(")")
    if why.startswith("the shell exited with status") and tail.isdigit():
        return int(tail)
    if why.startswith("the shell was killed") and tail.isdigit():
        return -int(tail)
    return None


def _await_reaped(pid: int, until: float) -> None:
    """Wait (until `until`) for the shell `pid` to have no child left: none alive after the
    kill, and the dead ones reaped."""
    while time.monotonic() < until:
        try:
            with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
                if not f.read().split():
                    return
        except OSError:
            return  # no such file on this kernel (CONFIG_PROC_CHILDREN), or the shell is gone
        time.sleep(0.001)


def _collect(zygote: Any, pid: int) -> int | None:
    """The exit status the zygote reports for `pid` (None if it does not within 0.5 s)."""
    deadline = time.monotonic() + 0.5
    while pid not in zygote.exits and time.monotonic() < deadline:
        if not zygote.poll(0.05):
            break
    return zygote.exits.pop(pid, None)


SESSION = Session()  # the runner's one session (a sandbox has one occupant at a time)
