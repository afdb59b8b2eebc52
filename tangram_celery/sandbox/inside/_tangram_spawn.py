"""The runner's side of the zygote (see _tangram_zygote): starting it, spawning through it,
collecting the exit reports of its children, and the pool of verifier processes it forks.

Verifiers are pooled: a verifier process (uid of its own, forked from the zygote, never from the
runner) judges one test at a time, each in a fresh namespace, and waits for the next; so an
assert test costs one fork (its user process), not two. Test code is trusted; user code never
runs in a verifier and cannot reach one (other uid, not dumpable, seccomp).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
from typing import Any

ZYGOTE_START_TIMEOUT_S = 30.0


class SpawnFailed(Exception):
    """The zygote could not fork (the pids limit) or is gone."""


class Zygote:
    """The runner's handle on the zygote process (see _tangram_zygote)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pid: int | None = None
        self.sock: socket.socket | None = None
        self.ready = False
        self.exits: dict[int, int] = {}  # pid -> exit status reported and not yet taken
        self.verifiers = VerifierPool(self)

    def start(self, pristine: bool = False) -> None:
        """Start the zygote: exec'd fresh, or, when this process has never held a request
        (`pristine`: the runner before it serves), forked from it, which saves an interpreter
        start and shares the runner's pages."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                os.dup2(child.fileno(), 3)
                os.closerange(4, 1 << 16)
                if pristine:
                    sys.path.insert(0, os.path.dirname(self.path))
                    import _tangram_zygote

                    _tangram_zygote.main()
                os.execv(sys.executable, [sys.executable, "-E", "-s", "-S", self.path])
            finally:
                os._exit(127)
        child.close()
        self.pid, self.sock, self.ready = pid, parent, False

    def lost(self) -> None:
        """The zygote is dead (killed with everything else, or it crashed); start another later."""
        if self.sock is not None:
            self.sock.close()
        self.pid, self.sock, self.ready = None, None, False
        self.verifiers.forget()
        self.exits.clear()

    def alive(self) -> bool:
        if self.pid is None:
            return False
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid = self.pid
        if pid:
            self.lost()
            return False
        return True

    def wait_ready(self) -> None:
        assert self.sock is not None
        self.sock.settimeout(ZYGOTE_START_TIMEOUT_S)
        try:
            msg = self.sock.recv(64)
        finally:
            self.sock.settimeout(None)
        if msg != b"ready":
            raise SpawnFailed(f"zygote did not start ({msg!r})")
        self.ready = True

    def _receive(self) -> dict[str, Any] | None:
        """Read one message: record an exit report; return anything else (a spawn reply, with
        its pidfds under "pidfds")."""
        assert self.sock is not None
        msg, fds, _flags, _addr = socket.recv_fds(self.sock, 4096, 16)
        if not msg:
            raise ConnectionResetError("the zygote closed its socket")
        out: dict[str, Any] = json.loads(msg)
        if "exit" in out:
            for fd in fds:
                os.close(fd)
            self.exits[int(out["exit"])] = int(out["status"])
            return None
        out["pidfds"] = fds
        return out

    def poll(self, timeout_s: float | None = 0.0) -> bool:
        """Take the zygote's messages waiting now (or within `timeout_s`). False if it is gone."""
        if self.sock is None:
            return False
        self.sock.settimeout(timeout_s)
        try:
            while True:
                stray = self._receive()
                if stray is not None:  # a reply nobody waits for (never expected)
                    for fd in stray["pidfds"]:
                        os.close(fd)
                self.sock.settimeout(0.0)
        except (BlockingIOError, TimeoutError):
            return True
        except (OSError, ValueError):
            self.stop()
            return False
        finally:
            if self.sock is not None:
                self.sock.settimeout(None)

    def spawn(
        self, specs: list[dict[str, Any]], fds: list[int]
    ) -> tuple[list[tuple[int, int] | None], list[str]]:
        """Fork one process per spec: (pid, pidfd) of each (None where the fork failed), errors."""
        for attempt in range(2):
            if not self.alive():
                self.start()
            try:
                if not self.ready:
                    self.wait_ready()
                assert self.sock is not None
                socket.send_fds(self.sock, [json.dumps({"spawn": specs}).encode()], fds)
                reply = None
                while reply is None:
                    reply = self._receive()
            except (OSError, ValueError, SpawnFailed) as e:
                self.stop()
                if attempt:
                    raise SpawnFailed(f"zygote failed: {e!r}") from None
                continue
            pidfds = iter(reply["pidfds"])
            started = [None if pid is None else (int(pid), next(pidfds)) for pid in reply["pids"]]
            return started, [str(x) for x in reply.get("errors", [])]
        raise SpawnFailed("zygote unavailable")

    def stop(self) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        self.lost()


def memfd(data: bytes, name: str = "tangram") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class Verifier:
    """One pooled verifier process and its control socket (SOCK_SEQPACKET)."""

    def __init__(self, pid: int, pidfd: int, ctl: socket.socket, key: str) -> None:
        self.pid, self.pidfd, self.ctl, self.key = pid, pidfd, ctl, key
        self.fd = ctl.fileno()  # kept: a selector unregisters by number after the close
        self.dead = False

    def close(self) -> None:
        self.dead = True
        for close in (self.ctl.close, lambda: os.close(self.pidfd)):
            try:
                close()
            except OSError:
                pass


class VerifierPool:
    """Idle verifiers, reused while their limits (uid, cores, rlimits) match the action's."""

    def __init__(self, zygote: Zygote) -> None:
        self.zygote = zygote
        self.idle: list[Verifier] = []
        self.live: dict[int, Verifier] = {}
        self.dying: dict[int, int] = {}  # killed, exit not reported yet: pid -> its pidfd

    def pids(self) -> set[int]:
        return set(self.live) | set(self.dying)

    def still_dying(self) -> set[int]:
        """Killed verifiers that have not exited yet (their pidfd is not readable): only these
        still hold their pid; a pid whose verifier has exited may be anyone's by now."""
        poll = select.poll()
        for fd in self.dying.values():
            poll.register(fd, select.POLLIN)
        exited = {fd for fd, _ in poll.poll(0)}
        return {pid for pid, fd in self.dying.items() if fd not in exited}

    def clear_dying(self) -> None:
        for fd in self.dying.values():
            os.close(fd)
        self.dying.clear()

    def prune(self) -> None:
        """Drop verifiers whose exit the zygote reported."""
        for pid in [p for p in self.live if p in self.zygote.exits]:
            self.zygote.exits.pop(pid)
            self.died(self.live[pid])
        for pid in [p for p in self.dying if p in self.zygote.exits]:
            self.zygote.exits.pop(pid)
            os.close(self.dying.pop(pid))

    def get(self, spec: dict[str, Any]) -> Verifier:
        """An idle verifier with these limits, or a new one. Raises SpawnFailed."""
        self.prune()
        key = json.dumps(spec, sort_keys=True)
        for v in list(self.idle):
            self.idle.remove(v)
            if v.key == key and not v.dead:
                return v
            self.discard(v)  # other limits: the pool keeps only what the actions ask for now
        return self._new(spec, key)

    def prime(self, spec: dict[str, Any], warm: bool = True) -> int:
        """Make sure one verifier with these limits is idle: start one now (off an action's
        critical path) unless there is; with `warm`, it warms itself up (`_new`). Returns how
        many were started. Raises SpawnFailed."""
        self.prune()
        key = json.dumps(spec, sort_keys=True)
        if any(v.key == key and not v.dead for v in self.idle):
            return 0
        self.idle.append(self._new(spec, key, warm=warm))
        return 1

    def _new(self, spec: dict[str, Any], key: str, warm: bool = False) -> Verifier:
        """Fork a verifier; with `warm`, it runs a test of its own before it waits for jobs
        (`_tangram_verifier.warm_up`: its first job then costs what any other does)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = [memfd(b"", "null") for _ in range(3)]
        try:
            started, errors = self.zygote.spawn(
                [{**spec, "mode": "verifier", "fds": 4, "warm": warm}], [*fds, theirs.fileno()]
            )
        finally:
            for fd in fds:
                os.close(fd)
            theirs.close()
        if started[0] is None:
            mine.close()
            raise SpawnFailed(errors[0] if errors else "fork failed")
        pid, pidfd = started[0]
        v = Verifier(pid, pidfd, mine, key)
        self.live[pid] = v
        return v

    def put(self, v: Verifier) -> None:
        if not v.dead and self.live.get(v.pid) is v:
            self.idle.append(v)

    def died(self, v: Verifier) -> None:
        """Its exit was reported (and taken): forget it."""
        self.live.pop(v.pid, None)
        if v in self.idle:
            self.idle.remove(v)
        v.close()

    def discard(self, v: Verifier) -> None:
        """Kill it (a test hung in it, or its limits are stale)."""
        if self.live.pop(v.pid, None) is v:
            try:
                signal.pidfd_send_signal(v.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.dying[v.pid], v.pidfd = v.pidfd, -1  # kept until its exit is reported
        if v in self.idle:
            self.idle.remove(v)
        v.close()

    def forget(self) -> None:
        """The zygote is gone: so are (or will be, killed here) its verifiers."""
        for v in list(self.live.values()):
            try:
                signal.pidfd_send_signal(v.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            v.close()
        self.live.clear()
        self.idle.clear()
        self.clear_dying()
