"""Resident runner: PID 1 inside one trajectory's sandbox (stdlib only, runs on the host's python3).

It listens on a unix socket that only root can reach, reads one JSON request per connection,
runs it as the unprivileged sandbox uid and answers one JSON line of *facts* (exit code, output,
flags such as timed_out / output_capped / disk_full); the host turns facts into a status.

Why PID 1: `kill(-1, SIGKILL)` from PID 1 reaches every other process of the sandbox (daemons,
double forks, fork bombs) and nothing outside it, and the sandboxed uid cannot signal PID 1.
Python snippets take the fast path: the runner forks itself and `exec`s the code in the child,
so no interpreter starts per action.
"""

from __future__ import annotations

import json
import os
import re
import resource
import selectors
import signal
import socket
import sys
import time
import traceback
import types

UNITS = {"python": "main.py", "bash": "main.sh", "c": "main.c"}
_PYTEST = re.compile(r"(^|[;&|(]\s*|\bexec\s+)(python3?\s+-m\s+pytest|pytest)(?=\s|$)")
_ENOSPC = ("No space left on device", "Disk quota exceeded", "File too large")
_MEMERR = ("MemoryError", "Cannot allocate memory", "std::bad_alloc")
_FORKERR = ("Resource temporarily unavailable", "BlockingIOError: [Errno 11]")
DISK_SLACK_B = 256 * 1024  # a workdir with less free space than this counts as full


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
        if not chunk:
            self._close_fd(fd)
            return False
        buf = proc.fds[fd]
        room = self.cap_b - len(buf)
        buf += chunk[: max(room, 0)]
        if len(chunk) > room:
            self.output_capped = True
        return True

    def _close_fd(self, fd: int) -> None:
        if fd in self.sel.get_map():
            self.sel.unregister(fd)
            os.close(fd)

    def _finish(self, proc: Proc) -> None:
        self._close_fd(proc.pidfd)
        _, status = os.waitpid(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        for fd in (proc.out_fd, proc.err_fd):  # drain what is there; never wait for daemons
            while fd in self.sel.get_map() and not self.output_capped and self._read(proc, fd):
                pass
            self._close_fd(fd)

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
            self._close_fd(key.fd)
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


def _norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def _write_files(req: dict) -> None:
    files = dict(req.get("files", {}))
    if req.get("code") is not None:
        files[UNITS[req["language"]]] = req["code"]
    for rel, content in files.items():
        path = os.path.join(req["workdir"], rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(content)
        os.chown(path, req["uid"], req["uid"])
        d = os.path.dirname(path)
        while d.startswith(req["workdir"]) and d != req["workdir"]:
            os.chown(d, req["uid"], req["uid"])
            d = os.path.dirname(d)


def _run_argv(req: dict) -> list[str] | None:
    lang = req["language"]
    if lang == "bash":
        return ["/bin/bash", UNITS["bash"]]
    if lang == "c":
        return ["./.tangram-main"]
    return None


def handle(req: dict) -> dict:
    """Run one request to completion and return its facts."""
    t0, t_wall = time.monotonic(), time.time() - 0.001
    act = Action(req)
    procs: list[Proc] = []
    tests: list[dict] = []
    try:
        _write_files(req)
        dop = max(1, len(req["cores"]))
        lang, code = req["language"], req.get("code")
        if lang == "c" and code is not None:
            cc = act.spawn(
                "compile",
                None,
                argv=["/usr/bin/gcc", "-O2", "-pipe", "-o", ".tangram-main", UNITS["c"], "-lm"],
            )
            done = act.wait_any()
            procs.append(cc)
            if done is None or cc.returncode != 0:
                tests = [
                    {"name": c["name"], "passed": False, "detail": "compile failed"}
                    for c in req.get("test_cases", [])
                ]
                return _facts(req, act, procs, tests, t0, compile_failed=True)
        if req.get("test_command"):
            cmd = req["test_command"]
            if dop > 1 and " -n " not in cmd:
                cmd = _PYTEST.sub(lambda m: f"{m.group(1)}python3 -m pytest -n {dop}", cmd)
            else:
                cmd = _PYTEST.sub(lambda m: f"{m.group(1)}python3 -m pytest", cmd)
            procs.append(act.spawn("command", req.get("stdin"), argv=["/bin/bash", "-c", cmd]))
            act.wait_any()
        elif req.get("test_cases"):
            tests = _run_tests(req, act, dop, procs)
        elif code is not None:
            py = [(UNITS["python"], code)] if lang == "python" else None
            procs.append(act.spawn("main", req.get("stdin"), argv=_run_argv(req), python=py))
            act.wait_any()
        return _facts(req, act, procs, tests, t0)
    finally:
        kill_all()
        act.close()
        if _disk_full(req):
            _roll_back(req, t_wall)


def _roll_back(req: dict, since: float) -> None:
    """Delete what the action wrote once it filled the quota, so the trajectory can go on."""
    for top in (req["workdir"], "/tmp"):
        for root, _dirs, names in os.walk(top):
            for name in names:
                path = os.path.join(root, name)
                try:
                    if os.lstat(path).st_mtime >= since:
                        os.unlink(path)
                except OSError:
                    pass


def _run_tests(req: dict, act: Action, dop: int, procs: list[Proc]) -> list[dict]:
    """Built-in parallel runner: up to `dop` test cases at once under the action's deadline."""
    cases = req["test_cases"]
    code, lang = req.get("code") or "", req["language"]
    results: list[dict | None] = [None] * len(cases)
    running = 0
    nxt = 0
    while nxt < len(cases) or running:
        while running < dop and nxt < len(cases):
            case = cases[nxt]
            if case.get("assert_code") is not None:
                if lang != "python":
                    results[nxt] = {
                        "name": case["name"],
                        "passed": False,
                        "detail": "assert_code tests need language python",
                    }
                    nxt += 1
                    continue
                both = [(UNITS["python"], code), ("<test>", case["assert_code"])]
                procs.append(act.spawn(nxt, case.get("stdin"), python=both))
            else:
                py = [(UNITS["python"], code)] if lang == "python" else None
                procs.append(act.spawn(nxt, case.get("stdin"), argv=_run_argv(req), python=py))
            running += 1
            nxt += 1
        if not running:
            break
        proc = act.wait_any()
        if proc is None:
            break
        running -= 1
        idx = proc.tag
        assert isinstance(idx, int)
        case = cases[idx]
        passed, detail = proc.returncode == 0, ""
        if not passed:
            detail = f"exit {proc.returncode}: {_text(proc.stderr)[-400:]}"
        elif case.get("expected_stdout") is not None:
            got = _text(proc.stdout)
            passed = _norm(got) == _norm(case["expected_stdout"])
            if not passed:
                detail = f"expected {case['expected_stdout'][:200]!r}, got {got[:200]!r}"
        results[idx] = {"name": case["name"], "passed": passed, "detail": detail}
    why = "timeout" if act.timed_out else "output limit" if act.output_capped else "not run"
    return [
        r or {"name": c["name"], "passed": False, "detail": why} for r, c in zip(results, cases, strict=True)
    ]


def _disk_full(req: dict) -> bool:
    for path in (req["workdir"], "/tmp"):
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        if st.f_bavail * st.f_frsize < DISK_SLACK_B or (st.f_files and st.f_favail == 0):
            return True
    return False


def _facts(
    req: dict, act: Action, procs: list[Proc], tests: list[dict], t0: float, compile_failed: bool = False
) -> dict:
    main = procs[-1] if procs and procs[-1].tag in ("compile", "main", "command") else None
    stderr = b"".join(p.stderr for p in procs if p.tag in ("compile", "main", "command"))
    stdout = b"".join(p.stdout for p in procs if p.tag in ("main", "command"))
    all_err = _text(b"".join(p.stderr for p in procs))
    codes = [p.returncode for p in procs if p.returncode is not None]
    return {
        "exit_code": main.returncode if main is not None else None,
        "stdout": _text(stdout),
        "stderr": _text(stderr),
        "tests": tests,
        "exec_s": time.monotonic() - t0,
        "timed_out": act.timed_out,
        "output_capped": act.output_capped,
        "disk_full": _disk_full(req) or any(s in all_err for s in _ENOSPC),
        "killed": any(c == -signal.SIGKILL for c in codes),
        "memory_error": any(s in all_err for s in _MEMERR),
        "fork_failed": any(s in all_err for s in _FORKERR),
        "compile_failed": compile_failed,
    }


def serve(sock_path: str, uid: int, workdir: str) -> None:
    """Accept one request per connection, forever."""
    for path in (workdir, "/tmp"):
        os.chown(path, uid, uid)
        os.chmod(path, 0o1777 if path == "/tmp" else 0o755)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = sock_path + ".new"
    if os.path.exists(tmp):
        os.unlink(tmp)
    srv.bind(tmp)
    os.chmod(tmp, 0o600)
    srv.listen(8)
    os.rename(tmp, sock_path)  # appears only once it accepts
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        break
                    data += chunk
                req = json.loads(data)
                out: dict
                if req.get("op") == "ping":
                    out = {"pong": True}
                else:
                    out = handle({**req, "uid": uid, "workdir": workdir})
            except Exception as e:
                out = {"runner_error": f"{e!r}\n{traceback.format_exc()[-2000:]}"}
            try:
                conn.sendall(json.dumps(out).encode() + b"\n")
            except OSError:
                pass


def main() -> None:
    args = dict(zip(sys.argv[1::2], sys.argv[2::2], strict=False))
    serve(args["--socket"], int(args["--uid"]), args["--workdir"])


if __name__ == "__main__":
    main()
