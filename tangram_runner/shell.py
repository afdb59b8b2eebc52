"""The shell of a sandbox's session (`session`, stdlib only): the process and the runner's ends
of its pipes, and the loop that feeds it an action and reads its output and reports."""

from __future__ import annotations

import os
import selectors
import signal
import time
from typing import Any

from tangram_runner.forkserver import exited
from tangram_runner.launch import Proc
from tangram_runner.proc import Action

_WRITE_CHUNK = 1 << 16


def new_token() -> str:
    """A fresh random token (the runner imports no `random`: see docs/sandbox.md)."""
    return os.urandom(12).hex()


class Shell:
    """One session shell: its process (pid, pidfd), the runner's ends of its descriptors, the
    limits it was started with."""

    def __init__(self, pid: int, pidfd: int, fds: dict[str, int], limits: dict[str, Any]) -> None:
        self.pid, self.pidfd, self.limits = pid, pidfd, limits
        self.cmd, self.code, self.rep, self.out, self.err = (
            fds["cmd"],
            fds["code"],
            fds["rep"],
            fds["out"],
            fds["err"],
        )
        self.reports: dict[str, tuple[int | None, str]] = {}  # nonce -> (status, cwd)
        self._buf = b""
        self.rep_open = True

    def signal(self, sig: int) -> None:
        try:
            signal.pidfd_send_signal(self.pidfd, sig)
        except ProcessLookupError:
            pass

    def dead(self) -> bool:
        return exited(self.pidfd)

    def type(self, line: bytes) -> None:
        """Write a command line of the harness's for the shell to read (a shell that died, or
        left a pipe's worth of them unread, misses it: waiting for its answer then fails)."""
        try:
            os.write(self.cmd, line)
        except OSError:
            pass

    def read_reports(self) -> None:
        """Take what the shell reported (records `nonce status cwd` or `nonce ack`)."""
        while self.rep_open:
            try:
                chunk = os.read(self.rep, 4096)
            except BlockingIOError:
                return
            if not chunk:
                self.rep_open = False  # the shell is gone (or closed its report pipe)
                return
            self._buf += chunk
            *records, self._buf = self._buf.split(b"\0")
            for rec in records:
                nonce, _, rest = rec.decode("utf-8", "replace").partition(" ")
                status, _, cwd = rest.partition(" ")
                self.reports[nonce] = (int(status) if status.lstrip("-").isdigit() else None, cwd)

    def close_fds(self) -> None:
        for fd in (self.cmd, self.code, self.rep, self.out, self.err, self.pidfd):
            try:
                os.close(fd)
            except OSError:
                pass


def read_into(act: Action, proc: Proc | None, fd: int) -> bool | None:
    """Read what `fd` holds into `proc`'s stream (capped as any user process's; None: dropped);
    False once nothing more is there now, None at its end (or once it is closed)."""
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return False
    except OSError:
        return None
    if not chunk:
        return None
    if proc is None:
        return True
    buf = proc.bufs[proc.fds[fd]]
    room = act.cap_b - len(buf)
    buf += chunk[: max(room, 0)]
    if len(chunk) > room:
        act.output_capped = True
    return True


def drain(act: Action, sh: Shell, proc: Proc | None) -> None:
    """Read the shell's pipes dry (nothing writes to them any more, or it is stopped)."""
    for fd in (sh.out, sh.err):
        while read_into(act, proc, fd):
            pass
    sh.read_reports()


class _Feed:
    """What is left to write of an action's part of fd 3 (non-blocking, as the shell reads)."""

    def __init__(self, fd: int, payload: bytes) -> None:
        self.fd, self.view = fd, memoryview(payload)

    def write(self) -> bool:
        """Write what the pipe takes now; False once all is written (or the shell is gone)."""
        try:
            self.view = self.view[os.write(self.fd, self.view[:_WRITE_CHUNK]) :]
        except BlockingIOError:
            pass
        except OSError:  # the shell is gone
            self.view = self.view[len(self.view) :]
        return bool(self.view)


def _serve(act: Action, sh: Shell, proc: Proc | None, key: Any, feed: _Feed) -> None:
    """One descriptor `_pump` found ready."""
    if key.fd == sh.code:
        if not feed.write():
            act.sel.unregister(sh.code)
    elif key.fd == sh.rep:
        sh.read_reports()
        if not sh.rep_open:
            act.sel.unregister(sh.rep)
    elif key.fd in (sh.out, sh.err):
        if read_into(act, proc, key.fd) is None:  # the shell and all holding the pipe are gone
            act.sel.unregister(key.fd)
    elif key.fd == sh.pidfd:  # it ended: `done` sees it
        act.sel.unregister(sh.pidfd)
    elif callable(key.data):  # the action's own watches (the host's `dop` requests)
        key.data()


def pump(
    act: Action,
    sh: Shell,
    proc: Proc | None,
    done: Any,
    until: float,
    payload: bytes = b"",
    force: bool = False,
) -> None:
    """Feed `payload` to the shell's fd 3 and read its output and reports until `done()`, the
    time `until`, or (unless `force`: an interrupt) the output cap. Reaching the action's
    deadline times the action out (unless `force`)."""
    mine = {sh.out, sh.err, sh.pidfd, *([sh.rep] if sh.rep_open else [])}
    for fd in mine:
        act.sel.register(fd, selectors.EVENT_READ, None)
    feed = _Feed(sh.code, payload)
    if payload:
        act.sel.register(sh.code, selectors.EVENT_WRITE, None)
    try:
        while not done() and (force or not act.output_capped):
            left = until - time.monotonic()
            if left <= 0:
                if until >= act.deadline and not force:
                    act.timed_out = True
                return
            for key, _ in act.sel.select(min(left, 1.0)):
                _serve(act, sh, proc, key, feed)
    finally:
        for fd in (*mine, sh.code):
            if fd in act.sel.get_map():
                act.sel.unregister(fd)
