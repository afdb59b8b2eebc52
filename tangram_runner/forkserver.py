"""The runner's side of a fork server (the zygote's protocol, see `zygote`): starting the zygote,
spawning through a fork server and collecting the exit reports of its children. The runner's
handle on the zygote is `spawn.Zygote`; the verifiers of assert tests are forked by a seed of
their own, on the same protocol (`verifiers.VerifierSeed`).

The runner imports this module, and nothing else of its own, before it forks the zygote
(`runner.main`): what it imports is in the zygote's heap too.
"""

from __future__ import annotations

import json
import os
import select
import socket
from typing import Any

from tangram_runner import boot

ZYGOTE_START_TIMEOUT_S = 30.0


class SpawnFailed(Exception):
    """The zygote could not fork (the pids limit) or is gone."""


class ForkServer:
    """The runner's handle on a process that forks children on request (zygote's
    protocol): the zygote, or a verifier seed. Subclasses start it and tell whether it lives."""

    name = "fork server"

    def __init__(self) -> None:
        self.pid: int | None = None
        self.sock: socket.socket | None = None
        self.ready = False
        self.exits: dict[int, int] = {}  # pid -> exit status reported and not yet taken
        self.ignored: set[int] = set()  # children whose exit report nobody will take

    def ignore(self, pid: int) -> None:
        """Drop the exit report of this child, now or when it comes."""
        if self.exits.pop(pid, None) is None:
            self.ignored.add(pid)

    def start(self) -> None:
        raise NotImplementedError

    def _ended(self) -> bool:
        """Has the process ended (it is then collected, or left to its parent)?"""
        raise NotImplementedError

    def _kill(self) -> None:
        """SIGKILL it (and collect it, where this process is its parent)."""
        raise NotImplementedError

    def alive(self) -> bool:
        if self.pid is None:
            return False
        if self._ended():
            self.lost()
            return False
        return True

    def stop(self) -> None:
        if self.pid is not None:
            self._kill()
        self.lost()

    def lost(self) -> None:
        """The process is dead (killed, or it crashed); start another later."""
        if self.sock is not None:
            self.sock.close()
        self.pid, self.sock, self.ready = None, None, False
        self.exits.clear()
        self.ignored.clear()

    def wait_ready(self) -> None:
        assert self.sock is not None
        self.sock.settimeout(ZYGOTE_START_TIMEOUT_S)
        try:
            msg = self.sock.recv(64)
        finally:
            self.sock.settimeout(None)
        if msg != b"ready":
            raise SpawnFailed(f"{self.name} did not start ({msg!r})")
        self.ready = True

    def _receive(self) -> dict[str, Any] | None:
        """Read one message: record an exit report; return anything else (a spawn reply, with
        its pidfds under "pidfds")."""
        assert self.sock is not None
        msg, fds, _flags, _addr = socket.recv_fds(self.sock, 4096, 16)
        if not msg:
            raise ConnectionResetError(f"the {self.name} closed its socket")
        out: dict[str, Any] = json.loads(msg)
        if "exit" in out:
            for fd in fds:
                os.close(fd)
            pid = int(out["exit"])
            if pid in self.ignored:
                self.ignored.discard(pid)
            else:
                self.exits[pid] = int(out["status"])
            return None
        out["pidfds"] = fds
        return out

    def poll(self, timeout_s: float | None = 0.0) -> bool:
        """Take the messages waiting now (or within `timeout_s`). False if it is gone."""
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
                    raise SpawnFailed(f"{self.name} failed: {e!r}") from None
                continue
            pidfds = iter(reply["pidfds"])
            started = [None if pid is None else (int(pid), next(pidfds)) for pid in reply["pids"]]
            return started, [str(x) for x in reply.get("errors", [])]
        raise SpawnFailed(f"{self.name} unavailable")


def fork_zygote(pristine: bool = True) -> tuple[int, socket.socket]:
    """Start the zygote (`zygote.main`): (its pid, the runner's end of its socket). `pristine`: forked
    from this process, which must never have held a request. The runner does so first thing,
    before it imports its own modules (`runner.main`): a fork copies the page tables of every
    page the zygote holds, and every user process is such a fork, so what the runner alone
    uses (hashlib and its libcrypto, the request handling) stays out of the zygote: 7.7 MiB
    of anonymous memory instead of 8.9, fewer pages to copy and tear down per user process
    (and fewer page faults and less CPU each: benchmarks/fork_faults.py). Otherwise exec'd
    fresh (`boot.argv`: the package from where this process has it, never the working directory)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.dup2(child.fileno(), 3)
            os.closerange(4, 1 << 16)
            if pristine:
                from tangram_runner import zygote

                zygote.main()
            cmd = boot.argv(boot.python(), boot.ROOT, "zygote")
            os.execv(cmd[0], cmd)
        finally:
            os._exit(127)
    child.close()
    return pid, parent


def exited(pidfd: int) -> bool:
    """Has the process behind `pidfd` ended (a zombie counts)? Its pidfd is readable then."""
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    return bool(poll.poll(0))


def memfd(data: bytes, name: str = "tangram") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
