"""Child processes of one action: fork/exec (or fork + in-process Python), output capture with a
cap, one wall-clock deadline, and `kill_all` for the whole process tree."""

from __future__ import annotations

import errno
import os
import resource
import selectors
import signal
import sys
import time
import traceback
import types

RUNNER_MODULE_PREFIX = "_tangram_"


class Proc:
    """One child process of the current action and the output read from it so far."""

    def __init__(self, pid: int, out_fd: int, err_fd: int, tag: object) -> None:
        self.pid, self.tag = pid, tag
        self.fds = {out_fd: bytearray(), err_fd: bytearray()}
        self.out_fd, self.err_fd = out_fd, err_fd
        self.pidfd = os.pidfd_open(pid)
        self.returncode: int | None = None

    @property
    def stdout(self) -> bytes:
        return bytes(self.fds[self.out_fd])

    @property
    def stderr(self) -> bytes:
        return bytes(self.fds[self.err_fd])


class Action:
    """Runs one request: children spawned with `spawn`, pumped by `wait` under one deadline."""

    def __init__(self, req: dict) -> None:
        self.req = req
        self.uid = int(req["uid"])
        self.workdir = req["workdir"]
        self.cap_b = int(req["max_output_bytes"])
        self.deadline = time.monotonic() + float(req["timeout_s"])
        self.timed_out = self.output_capped = False
        self.sel = selectors.DefaultSelector()
        self.env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.workdir,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONPATH": ":".join(req.get("pythonpath", [])),
            "PYTHONDONTWRITEBYTECODE": "1",
            **req.get("env", {}),
        }

    # -- child side --------------------------------------------------------------------------
    def _child_setup(self, stdin: bytes, out_w: int, err_w: int) -> None:
        """In the forked child: new session, limits, fds, drop to the sandbox uid."""
        os.setsid()
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")  # the OOM killer takes user code, never the runner
        except OSError:
            pass
        try:
            os.sched_setaffinity(0, [int(c) for c in self.req["cores"]])
        except (OSError, ValueError):
            pass  # the cgroup cpuset binds anyway
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        for name, value in self.req.get("rlimits", {}).items():
            lim = getattr(resource, "RLIMIT_" + name)
            resource.setrlimit(lim, (int(value), int(value)))
        fd = os.memfd_create("stdin")
        os.write(fd, stdin)
        os.lseek(fd, 0, os.SEEK_SET)
        os.dup2(fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 65536)
        os.setgroups([])
        os.setgid(self.uid)
        os.setuid(self.uid)
        os.chdir(self.workdir)
        os.umask(0o022)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)

    def _run_python(self, sources: list[tuple[str, str]]) -> int:
        """Run Python sources in this (forked) interpreter as `python3 main.py` would."""
        os.environ.clear()
        os.environ.update(self.env)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115
        sys.argv = [sources[0][0]]
        extra = [p for p in self.env["PYTHONPATH"].split(":") if p]
        sys.path[:] = [self.workdir, *extra, *[p for p in sys.path if p.startswith("/usr/lib")]]
        import site

        user_site = f"{self.workdir}/.local/lib/python{sys.version_info[0]}.{sys.version_info[1]}"
        site.addsitedir(user_site + "/site-packages")
        code = 0
        for name in [m for m in sys.modules if m.startswith(RUNNER_MODULE_PREFIX)]:
            del sys.modules[name]  # a user's own module of the same name must win
        main = types.ModuleType("__main__")
        main.__file__ = sources[0][0]
        sys.modules["__main__"] = main
        scope = main.__dict__
        try:
            for path, src in sources:
                exec(compile(src, path, "exec"), scope)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        except BaseException as e:
            tb = e.__traceback__.tb_next if e.__traceback__ else None  # hide the runner's frame
            traceback.print_exception(type(e), e, tb)
            code = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                code = code or 1
        return code

    # -- parent side -------------------------------------------------------------------------
    def spawn(
        self,
        tag: object,
        stdin: str | None,
        argv: list[str] | None = None,
        python: list[tuple[str, str]] | None = None,
    ) -> Proc:
        """Start one child: `argv` is exec'd; `python` sources run in a fork of the runner."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 127
            try:
                self._child_setup((stdin or "").encode(), out_w, err_w)
                if python is not None:
                    code = self._run_python(python)
                else:
                    assert argv is not None
                    os.execve(argv[0], argv, self.env)
            except BaseException as e:
                os.write(2, f"tangram runner: {e!r}\n".encode())
            os._exit(code)
        os.close(out_w)
        os.close(err_w)
        proc = Proc(pid, out_r, err_r, tag)
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, proc)
        self.sel.register(proc.pidfd, selectors.EVENT_READ, proc)
        return proc

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
        buf = proc.fds[fd]
        room = self.cap_b - len(buf)
        buf += chunk[: max(room, 0)]
        if len(chunk) > room:
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
        for fd in (proc.out_fd, proc.err_fd):  # drain what is there; never wait for daemons
            while self._owns(proc, fd) and not self.output_capped and self._read(proc, fd):
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
                proc = key.data
                if key.fd == proc.pidfd:
                    self._finish(proc)
                    return proc
                self._read(proc, key.fd)
        return None

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            self._close_fd(key.data, key.fd)
        self.sel.close()


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
