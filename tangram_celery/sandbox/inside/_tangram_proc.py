"""Processes of one action: user processes spawned through the zygote, the verifier forked from
the runner, output capture with a cap, one deadline per phase, and the end-of-action kill.

Every process of an action is a child of the runner (the zygote double-forks), held by a pidfd,
so it is waited for and killed without pid-reuse races.
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

VERIFIER_STREAM_CAP_B = 64 * 1024  # trusted output (the verifier's), truncated silently
DEFAULT_NOFILE = 1024
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

    def start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                os.dup2(child.fileno(), 3)
                os.closerange(4, 1 << 16)
                os.execv(sys.executable, [sys.executable, "-E", "-s", "-S", self.path])
            finally:
                os._exit(127)
        child.close()
        self.pid, self.sock, self.ready = pid, parent, False

    def lost(self) -> None:
        """The zygote was killed (and reaped) with everything else; start a new one later."""
        if self.sock is not None:
            self.sock.close()
        self.pid, self.sock, self.ready = None, None, False

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

    def spawn(self, spec: dict[str, Any], fds: list[int]) -> int:
        """Fork a user process; its pid (a child of the runner by now)."""
        for attempt in range(2):
            if not self.alive():
                self.start()
            try:
                if not self.ready:
                    self.wait_ready()
                assert self.sock is not None
                socket.send_fds(self.sock, [json.dumps(spec).encode()], fds)
                reply = json.loads(self.sock.recv(4096) or b"{}")
            except (OSError, ValueError, SpawnFailed) as e:
                self.stop()
                if attempt:
                    raise SpawnFailed(f"zygote failed: {e!r}") from None
                continue
            if "pid" in reply:
                return int(reply["pid"])
            raise SpawnFailed(str(reply.get("error", "zygote error")))
        raise SpawnFailed("zygote unavailable")

    def stop(self) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        self.lost()


class Proc:
    """One process of the current action and what it wrote so far, per stream name."""

    def __init__(self, pid: int, tag: object, streams: dict[int, str], user: bool) -> None:
        self.pid, self.tag, self.user = pid, tag, user
        self.pidfd = os.pidfd_open(pid)
        self.fds = dict(streams)  # fd -> stream name
        self.bufs = {name: bytearray() for name in streams.values()}
        self.returncode: int | None = None
        self.killed_by_runner = False  # its SIGKILL is no limit's doing

    @property
    def stdout(self) -> bytes:
        return bytes(self.bufs.get("out", b""))

    @property
    def stderr(self) -> bytes:
        return bytes(self.bufs.get("err", b""))

    def stream(self, name: str) -> bytes:
        return bytes(self.bufs.get(name, b""))


def memfd(data: bytes, name: str = "tangram") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class Action:
    """Runs the processes of one request, pumped by `wait_any` under the current deadline."""

    def __init__(self, req: dict, zygote: Zygote | None) -> None:
        self.req = req
        self.zygote = zygote
        self.uid = int(req["uid"])
        self.workdir = req["workdir"]
        self.cap_b = int(req["max_output_bytes"])
        self.deadline = time.monotonic() + float(req["timeout_s"])
        self.timed_out = self.output_capped = self.fork_failed = False
        self.spawn_error = ""
        self.sel = selectors.DefaultSelector()
        self.procs: list[Proc] = []
        self.env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.workdir,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONPATH": ":".join(req.get("pythonpath", [])),
            "PYTHONDONTWRITEBYTECODE": "1",
            **req.get("env", {}),
        }

    def set_deadline(self, seconds: float) -> None:
        """Start a phase (compile, run) with its own time limit."""
        self.deadline = time.monotonic() + seconds
        self.timed_out = False

    def limits(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "workdir": self.workdir,
            "cores": [int(c) for c in self.req.get("cores", [])],
            "rlimits": dict(self.req.get("rlimits", {})),
            "nofile": int(self.req.get("nofile") or DEFAULT_NOFILE),
        }

    # -- starting processes ------------------------------------------------------------------
    def spawn(
        self,
        tag: object,
        stdin: str | None,
        argv: list[str] | None = None,
        python: str | None = None,
        code_fd: int | None = None,
        extra_fd: int | None = None,
    ) -> Proc | None:
        """A user process from the zygote: `argv` is exec'd, or the code in `code_fd` runs as
        `python` (the script name, e.g. main.py); with `extra_fd` (descriptor 3) and `python`, it
        serves its objects to a verifier afterwards. None when the fork failed (pids limit)."""
        assert self.zygote is not None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_fd = memfd((stdin or "").encode("utf-8", "surrogatepass"), "stdin")
        fds = [in_fd, out_w, err_w]
        if extra_fd is not None:
            fds.append(extra_fd)
        spec: dict[str, Any] = {**self.limits(), "env": self.env, "fds": len(fds)}
        if python is not None:
            spec.update(mode="serve" if extra_fd is not None else "python", argv0=python, code=True)
            assert code_fd is not None
            fds.append(code_fd)
        else:
            spec.update(mode="exec", argv=argv)
        try:
            pid = self.zygote.spawn(spec, fds)
        except SpawnFailed as e:
            self.fork_failed = True
            for fd in (out_r, err_r):
                os.close(fd)
            self.spawn_error = str(e)
            return None
        finally:
            for fd in (in_fd, out_w, err_w):
                os.close(fd)
        return self._track(pid, tag, {out_r: "out", err_r: "err"}, user=True)

    def fork(self, tag: object, target: Callable[[list[int]], None], fds: list[int]) -> Proc:
        """A trusted child of the runner (the verifier): `target(fds)` runs in it with
        descriptors [stdin (empty), stdout, stderr, *fds] and must not return."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_fd = memfd(b"", "stdin")
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                target([in_fd, out_w, err_w, *fds])
            except BaseException as e:
                os.write(err_w, f"tangram verifier: {e!r}\n".encode())
            os._exit(1)
        for fd in (in_fd, out_w, err_w):
            os.close(fd)
        return self._track(pid, tag, {out_r: "out", err_r: "err"}, user=False)

    def _track(self, pid: int, tag: object, streams: dict[int, str], user: bool) -> Proc:
        proc = Proc(pid, tag, streams, user)
        self.procs.append(proc)
        for fd in streams:
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, proc)
        self.sel.register(proc.pidfd, selectors.EVENT_READ, proc)
        return proc

    def add_stream(self, proc: Proc, fd: int, name: str) -> None:
        """Capture one more descriptor of `proc` (the verifier's record) under `name`."""
        proc.fds[fd] = name
        proc.bufs[name] = bytearray()
        os.set_blocking(fd, False)
        self.sel.register(fd, selectors.EVENT_READ, proc)

    def watch(self, fd: int, on_readable: Callable[[], None]) -> None:
        """Call `on_readable` whenever `fd` is readable while the action runs."""
        self.sel.register(fd, selectors.EVENT_READ, on_readable)

    def kill(self, proc: Proc) -> None:
        if proc.returncode is None:
            proc.killed_by_runner = True
            try:
                signal.pidfd_send_signal(proc.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- pumping -----------------------------------------------------------------------------
    def _read(self, proc: Proc, fd: int) -> bool:
        """Read what is available on `fd`; False once it is drained or closed."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EBADF):
                raise
            # The number no longer names this child's pipe (EINVAL, as when reading a pidfd).
            # Stop watching it; the child's end still comes by its pidfd.
            if self._owns(proc, fd):
                self.sel.unregister(fd)
            return False
        if not chunk:
            self._close_fd(proc, fd)
            return False
        buf = proc.bufs[proc.fds[fd]]
        cap = self.cap_b if proc.user else VERIFIER_STREAM_CAP_B
        room = cap - len(buf)
        buf += chunk[: max(room, 0)]
        if len(chunk) > room and proc.user:
            self.output_capped = True
        return True

    def _owns(self, proc: Proc, fd: int) -> bool:
        """Is `fd` still one of `proc`'s open descriptors? Once closed (a pipe at EOF), its
        number can be reused by a later child's pipe or pidfd, which must be left alone."""
        key = self.sel.get_map().get(fd)
        return key is not None and key.data is proc

    def _close_fd(self, proc: Proc, fd: int) -> None:
        if self._owns(proc, fd):
            self.sel.unregister(fd)
            os.close(fd)

    def _finish(self, proc: Proc) -> None:
        self._close_fd(proc, proc.pidfd)
        _, status = os.waitpid(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        for fd in list(proc.fds):  # drain what is there; never wait for daemons
            while self._owns(proc, fd) and not (proc.user and self.output_capped) and self._read(proc, fd):
                pass
            self._close_fd(proc, fd)

    def wait_any(self) -> Proc | None:
        """Pump output until some child exits; None once the deadline or the output cap hit."""
        while not (self.timed_out or self.output_capped):
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.timed_out = True
                break
            for key, _ in self.sel.select(min(left, 1.0)):
                data = key.data
                if callable(data):
                    data()
                    continue
                if key.fd == data.pidfd:
                    self._finish(data)
                    return data
                self._read(data, key.fd)
        return None

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            if isinstance(key.data, Proc):
                self._close_fd(key.data, key.fd)
            else:
                self.sel.unregister(key.fd)
        self.sel.close()


def end_action(procs: list[Proc], zygote_pid: int | None) -> bool:
    """Kill and reap every process of the action. Processes it started go by pidfd; anything
    else still alive (a daemon, a fork bomb) forces `kill(-1)` from PID 1, which also takes the
    zygote: True then, and the runner starts a new zygote after answering."""
    for p in procs:
        if p.returncode is None:
            try:
                signal.pidfd_send_signal(p.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        if p.returncode is None:
            try:
                _, status = os.waitpid(p.pid, 0)
                p.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                p.returncode = -signal.SIGKILL
    _reap()
    if not _strays(zygote_pid):
        return False
    kill_all()
    return True


def _reap() -> None:
    """Collect orphans that ended (reparented to PID 1)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _strays(zygote_pid: int | None) -> bool:
    """Is any process other than the runner and the zygote alive (zombies do not count)?"""
    keep = {1, os.getpid(), zygote_pid}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in keep:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X"):
            return True
    return False


def kill_all() -> None:
    """SIGKILL every process of the sandbox but the runner, and reap them all."""
    if os.getpid() != 1:  # kill(-1) outside a pid namespace would hit the whole host
        raise RuntimeError("runner is not PID 1; refusing kill(-1)")
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
