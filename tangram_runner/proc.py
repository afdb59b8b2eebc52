"""Processes of one action: user processes spawned through the zygote, test jobs given to pooled
verifiers, output capture with a cap, one deadline per phase, and the end-of-action kill.

The zygote forks every process and reports its exit status; the runner holds a pidfd of each, so
it kills them without pid-reuse races.
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import signal
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tangram_runner.forkserver import SpawnFailed, memfd
from tangram_runner.launch import (
    Launch,
    Proc,
    assert_payload,
    compiled_payload,
    main_file,
    user_limits,
    verifier_spec,
)
from tangram_runner.reaping import KEPT, kill_all, kill_others, reap_orphans, stop_kept, strays
from tangram_runner.spawn import Zygote
from tangram_runner.verifiers import Verifier

if TYPE_CHECKING:
    from tangram_runner.protocol import RunRequest, Seat

__all__ = [
    "Action",
    "Proc",
    "SpawnFailed",
    "Zygote",
    "code_memfd",
    "memfd",
    "prime",
    "verifier_spec",
]

VERIFIER_STREAM_CAP_B = 64 * 1024  # trusted output (the verifier's), truncated silently
EXIT_REPORT_TIMEOUT_S = 10.0  # a killed process's exit report is due at once


def code_memfd(act: Action, source: str, unit: str) -> int:
    """The memfd of a Python program the action's user processes run as `unit` (under the name
    `main_file` gives them, in `user_launch`), compiled here under that name when it can be
    (`compiled_payload`); the action knows which it is."""
    payload, compiled = compiled_payload(source, main_file(act.workdir, unit))
    fd = memfd(payload, "main.py")
    if compiled:
        act.compiled_fd = fd
    return fd


def prime(req: RunRequest, seat: Seat, zygote: Zygote, warm: bool = True) -> int:
    """Start an idle verifier with the spec a request like `req` (its nofile) will ask for in
    `seat`, unless one is idle: forked from the zygote now, it never talked to any user
    process; with `warm`, it warms itself up before it waits. How many were started (0 also when the
    zygote could not fork one)."""
    try:
        return zygote.verifiers.prime(verifier_spec(req, seat), warm)
    except SpawnFailed:
        return 0


class Action:
    """Runs the processes of one request, pumped by `wait_any` under the current deadline.
    `req` is the request as the action runs it: a resize replaces it with its new `cores`
    (`control.apply_dop`)."""

    def __init__(self, req: RunRequest, seat: Seat, zygote: Zygote) -> None:
        self.req = req
        self.seat = seat
        self.zygote = zygote
        self.workdir = seat.workdir
        self.cap_b = int(req.max_output_bytes)
        self.deadline = time.monotonic() + float(req.timeout_s)
        self.timed_out = self.output_capped = self.fork_failed = False
        self.spawn_error = ""
        # cases run at once (test cases); the host may change it while the action runs
        self.dop = max(1, len(req.cores or ()))
        self.sel = selectors.DefaultSelector()
        self.procs: list[Proc] = []
        self._zfd: int | None = None  # the zygote socket's descriptor, while watched
        self._job_seq = 0
        self.env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.workdir,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONPATH": ":".join(req.pythonpath),
            "PYTHONDONTWRITEBYTECODE": "1",
            **req.env,
        }
        # no variable of the caller's: the zygote may take this environment on as its own
        # before it forks (`child.adopt_env`) instead of each child setting it up
        self.std_env = not req.env
        self.compiled_fd: int | None = None  # the code memfd holds (source, code object)

    def set_deadline(self, seconds: float) -> None:
        """Start a phase (compile, run) with its own time limit."""
        self.deadline = time.monotonic() + seconds
        self.timed_out = False

    def limits(self) -> dict[str, Any]:
        return user_limits(self.req, self.seat)

    # -- starting processes ------------------------------------------------------------------
    def user_launch(
        self,
        tag: object,
        stdin: str | None,
        argv: list[str] | None = None,
        python: str | None = None,
        code_fd: int | None = None,
        extra_fd: int | None = None,
        env: dict[str, str] | None = None,
    ) -> Launch:
        """A user process: `argv` is exec'd, or the code in `code_fd` runs as `python` (the
        script name, e.g. main.py); with `extra_fd` (its descriptor 3) and `python`, it serves its
        objects to a verifier afterwards. `env` adds to the action's environment."""
        ln = Launch(tag, {**self.limits(), "env": {**self.env, **(env or {})}}, user=True)
        if self.std_env and not env:
            ln.spec["std_env"] = True
        ln.memfd((stdin or "").encode("utf-8", "surrogatepass"), "stdin")
        ln.pipe("out")
        ln.pipe("err")
        if extra_fd is not None:
            ln.send.append(extra_fd)
        ln.spec["fds"] = len(ln.send)
        if python is not None:
            assert code_fd is not None
            mode = "serve" if extra_fd is not None else "python"
            ln.spec.update(mode=mode, argv0=python, main_file=main_file(self.workdir, python), code=True)
            if code_fd == self.compiled_fd:
                ln.spec["compiled"] = True
            ln.send.append(code_fd)
        else:
            ln.spec.update(mode="exec", argv=argv)
        return ln

    def launch(self, launches: list[Launch]) -> list[Proc | None]:
        """Start processes through the zygote (one round trip); None where a fork failed."""
        before = self.zygote.sock
        pids: list[tuple[int, int] | None]
        try:
            pids, errors = self.zygote.spawn(
                [ln.spec for ln in launches], [fd for ln in launches for fd in ln.send]
            )
            if before is not None and self.zygote.sock is not before:  # it died and was replaced
                self._zygote_gone()
        except SpawnFailed as e:
            pids, errors = [None] * len(launches), [str(e)]
        finally:
            for ln in launches:
                for fd in ln.mine:
                    os.close(fd)
        if errors:
            self.fork_failed = True
            self.spawn_error = errors[0]
        out: list[Proc | None] = []
        for ln, started in zip(launches, pids, strict=True):
            if started is None:
                for fd in ln.streams:
                    os.close(fd)
                out.append(None)
            else:
                out.append(self._track(started[0], started[1], ln.tag, ln.streams, ln.user))
        self._watch_zygote()
        return out

    def spawn(self, *args: Any, **kwargs: Any) -> Proc | None:
        """One user process (see `user_launch`); None when the fork failed (pids limit)."""
        return self.launch([self.user_launch(*args, **kwargs)])[0]

    def start_job(self, tag: object, assert_code: str, sock_fd: int, trusted_path: list[str]) -> Proc | None:
        """Give one assert test to a pooled verifier (its own uid), connected to the user process
        at `sock_fd`; the record is the job's stream "record". None if no verifier could start."""
        pool = self.zygote.verifiers
        try:
            v = pool.get(verifier_spec(self.req, self.seat), str(self.req.verifier_group or ""))
        except SpawnFailed as e:
            self.fork_failed, self.spawn_error = True, str(e)
            return None
        self._job_seq += 1
        streams: dict[int, str] = {}
        theirs: list[int] = [sock_fd]
        for name in ("record", "out", "err"):
            r, w = os.pipe()
            streams[r] = name
            theirs.append(w)
        payload, compiled = assert_payload(assert_code)
        code = memfd(payload, "test")
        msg = json.dumps({"job": self._job_seq, "trusted_path": trusted_path, "compiled": compiled}).encode()
        try:
            socket.send_fds(v.ctl, [msg], [*theirs, code])
        except OSError as e:
            pool.discard(v)
            for fd in streams:
                os.close(fd)
            self.spawn_error = f"verifier unavailable: {e}"
            return None
        finally:
            for fd in [*theirs[1:], code]:
                os.close(fd)
        job = self._track(v.pid, None, tag, streams, user=False)
        job.verifier, job.job_id = v, self._job_seq
        self.sel.register(v.ctl.fileno(), selectors.EVENT_READ, lambda: self._job_message(job))
        return job

    def _job_message(self, job: Proc) -> None:
        """The verifier's report on its control socket: the job is done, or the verifier died."""
        v = job.verifier
        assert v is not None
        try:
            msg = v.ctl.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            msg = b""
        try:
            report = json.loads(msg) if msg else {}
            done = report.get("done") == job.job_id
        except (ValueError, AttributeError):
            report, done = {}, False
        if job.pending is None:
            job.pending = 0 if done else -signal.SIGKILL
        self._unwatch(v)
        if not done or report.get("last"):  # died, or retires after this job: no other job
            self.zygote.verifiers.discard(v)

    def _unwatch(self, v: Verifier) -> None:
        key = self.sel.get_map().get(v.fd)
        if key is not None and callable(key.data):
            self.sel.unregister(v.fd)

    def _watch_zygote(self) -> None:
        sock = self.zygote.sock
        fd = sock.fileno() if sock is not None else None
        if fd != self._zfd:
            if self._zfd is not None:  # by number: the old socket may be closed already
                self.sel.unregister(self._zfd)
            if fd is not None:
                self.sel.register(fd, selectors.EVENT_READ, self.zygote)
            self._zfd = fd

    def _track(self, pid: int, pidfd: int | None, tag: object, streams: dict[int, str], user: bool) -> Proc:
        proc = Proc(pid, pidfd, tag, streams, user)
        self.procs.append(proc)
        for fd in streams:
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, proc)
        return proc

    def watch(self, fd: int, on_readable: Callable[[], None]) -> None:
        """Call `on_readable` whenever `fd` is readable while the action runs."""
        self.sel.register(fd, selectors.EVENT_READ, on_readable)

    def kill(self, proc: Proc) -> None:
        if proc.returncode is not None:
            return
        proc.killed_by_runner = True
        if proc.verifier is not None:  # a job: its verifier goes (a test hung in it)
            self._unwatch(proc.verifier)
            self.zygote.verifiers.discard(proc.verifier)
            if proc.pending is None:
                proc.pending = -signal.SIGKILL
            return
        try:
            assert proc.pidfd is not None
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
            if self._owns(proc, fd):  # the number no longer names this process's pipe
                self.sel.unregister(fd)
            return False
        if not chunk:
            self._close_fd(proc, fd)
            return False
        buf = proc.bufs[proc.fds[fd]]
        cap = self.cap_b if proc.user else VERIFIER_STREAM_CAP_B
        room = cap - len(buf)
        buf += chunk[: max(room, 0)]
        if len(chunk) > room and proc.user and not proc.truncate_only:
            self.output_capped = True
        return True

    def _owns(self, proc: Proc, fd: int) -> bool:
        """Is `fd` still one of `proc`'s open descriptors? Once closed (a pipe at EOF), its
        number can be reused by a later process's pipe, which must be left alone."""
        key = self.sel.get_map().get(fd)
        return key is not None and key.data is proc

    def _close_fd(self, proc: Proc, fd: int) -> None:
        if self._owns(proc, fd):
            self.sel.unregister(fd)
            os.close(fd)

    def _finish(self, proc: Proc, status: int) -> None:
        proc.returncode = status
        if proc.pidfd is not None:
            os.close(proc.pidfd)
        v = proc.verifier
        if v is not None:
            self._unwatch(v)
            if status == 0:
                self.zygote.verifiers.put(v)  # ready for the next test
        for fd in list(proc.fds):  # drain what is there; never wait for daemons
            while self._owns(proc, fd) and not (proc.user and self.output_capped) and self._read(proc, fd):
                pass
            self._close_fd(proc, fd)

    def _take_exit(self) -> Proc | None:
        """A process whose exit the zygote reported (or a job its verifier reported done), now
        finished here."""
        for p in self.procs:
            if p.returncode is not None:
                continue
            if p.pending is not None:
                self._finish(p, p.pending)
                return p
            if p.pid in self.zygote.exits:
                status = self.zygote.exits.pop(p.pid)
                if p.verifier is not None:  # the verifier died under the job
                    self._unwatch(p.verifier)
                    self.zygote.verifiers.died(p.verifier)
                self._finish(p, status)
                return p
        return None

    def _zygote_gone(self) -> None:
        """The zygote died mid-action (never expected): its children are ours now; end them."""
        for p in self.procs:
            if p.returncode is None and p.verifier is not None:
                self.kill(p)
                self._finish(p, -signal.SIGKILL)
        for p in self.procs:
            if p.returncode is None:
                self.kill(p)
                status = -signal.SIGKILL
                for _ in range(100):  # until the kernel has reparented it to us
                    try:
                        status = os.waitstatus_to_exitcode(os.waitpid(p.pid, 0)[1])
                        break
                    except ChildProcessError:
                        time.sleep(0.01)
                self._finish(p, status)

    def wait_any(self, woken: Callable[[], bool] | None = None) -> Proc | None:
        """Pump output until some process exits; None once the deadline or the output cap hit,
        or as soon as `woken()` is true (e.g. the host raised the DoP)."""
        while not (self.timed_out or self.output_capped):
            done = self._take_exit()
            if done is not None:
                return done
            if woken is not None and woken():
                return None
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.timed_out = True
                break
            for key, _ in self.sel.select(min(left, 1.0)):
                data = key.data
                if data is self.zygote:
                    if not self.zygote.poll():
                        self.sel.unregister(key.fd)
                        self._zfd = None
                        self._zygote_gone()
                elif callable(data):
                    data()
                else:
                    self._read(data, key.fd)
        return None

    def end(self) -> bool:
        """Kill and reap every process of the action. Processes it started go by pidfd; anything
        else still alive (a daemon, a fork bomb) forces `kill(-1)` from PID 1, which also takes
        the zygote: True then, and the runner starts a new zygote after answering."""
        for p in self.procs:
            self.kill(p)
        pool = self.zygote.verifiers
        deadline = time.monotonic() + EXIT_REPORT_TIMEOUT_S
        while any(p.returncode is None for p in self.procs) or pool.dying:
            if self._take_exit() is not None:
                continue
            pool.prune()
            waiting = any(p.returncode is None for p in self.procs)
            if not waiting and not pool.dying:
                break
            if time.monotonic() > deadline or (waiting and not self.zygote.poll(0.5)):
                self._zygote_gone()
                pool.clear_dying()
            elif not waiting:  # only killed verifiers left: their pidfds tell their end
                pool.wait_dying(0.5)
        reap_orphans()
        stop_kept()
        keep = {1, os.getpid(), self.zygote.pid, *pool.pids(), *KEPT}
        if not strays(keep):
            return False
        if KEPT and kill_others(keep):  # the session's shell stays: no kill(-1)
            return False
        kill_all()
        self.zygote.lost()
        return True

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            if isinstance(key.data, Proc):
                self._close_fd(key.data, key.fd)
            else:
                self.sel.unregister(key.fd)
        self.sel.close()
        for p in self.procs:
            if p.returncode is None and p.pidfd is not None:
                os.close(p.pidfd)
