"""The zygote: the clean, warm process every user process and every (pooled) verifier is forked
from (stdlib only).

The runner holds requests (expected outputs, test code); a process forked from it would carry
them into user code's reach. The zygote is forked by the runner first thing, before the runner
imports its own modules or reads a request (or exec'd fresh, when it must be replaced), never
receives a request, preloads the interpreter and the common stdlib, and then, per spawn, gets
only what that one process may see: a small spec (mode, uid, env, cores, limits) and
descriptors (stdin, stdout, stderr, the code or test code as a memfd, the verifier connection).
It never reads the memfds itself: the child does, after the fork, so no test code stays behind
in the zygote's memory for a later user process to find. A per-test process costs a fork, not
an interpreter start.

The zygote runs as root (it must set each child's uid), holds nothing secret, and user code can
neither signal, trace nor read it (other uid, not dumpable, seccomp). It reaps its children and
reports their exit statuses; the runner holds a pidfd of each to kill it.

Protocol on descriptor 3 (SOCK_SEQPACKET to the runner): the zygote sends b"ready" once. The
runner sends {"spawn": [spec, ...]} with every spec's descriptors, in order, as SCM_RIGHTS; the
zygote answers {"pids": [pid or null, ...], "errors": [text, ...]} with a pidfd of each child
that started, as SCM_RIGHTS. Whenever a child ends it sends {"exit": pid, "status": exit code
(negative: killed by that signal)}.
"""

from __future__ import annotations

import gc
import json
import marshal
import os
import resource
import select
import socket
import sys
from collections.abc import Callable

from tangram_runner import child, seccomp, serve, verifier

# what model-written solutions and test code import most (HumanEval, MBPP); each module here
# makes every fork a little dearer (more page tables to copy), so the list stays short. Not
# `random`: it reseeds in every forked child (`os.register_at_fork`), some 35 page faults and
# 0.15 ms per fork, user process or verifier, for the few programs that import it (4 of the
# 164 HumanEval problems); nothing the runner imports brings it in either (`tempfile`, through
# `shutil`, is imported where it is used).
PRELOAD = (
    "typing",
    "re",
    "math",
    "collections",
    "itertools",
    "functools",
    "heapq",
    "bisect",
    "string",
    "copy",
    "operator",
)
MAX_FDS = 16


def preload() -> set[str]:
    """Import PRELOAD; return the top-level module names a user file may shadow."""
    before = set(sys.modules)
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    return {n.partition(".")[0] for n in set(sys.modules) - before} - set(sys.builtin_module_names)


def child_main(spec: dict, fds: list[int], preloaded: set[str]) -> None:  # pragma: no cover - child
    """A user process or a verifier: never returns."""
    code = 127
    try:
        source, compiled = "", None
        if spec.get("code"):
            if spec.get("compiled"):  # (source, code object), compiled by the runner
                source, compiled = marshal.loads(child.read_bytes(fds[-1]))
            else:
                source = child.read_all(fds[-1])
        n = int(spec["fds"])
        child.setup(
            int(spec["uid"]),
            fds[:n],
            spec["workdir"],
            [int(c) for c in spec.get("cores", [])],
            {str(k): int(v) for k, v in spec.get("rlimits", {}).items()},
            int(spec["nofile"]),
            int(spec.get("oom_score_adj", 1000)),
        )
        mode = spec["mode"]
        if mode == "verifier":
            seccomp.set_name(b"tangram-verify")
            verifier.serve_jobs(warm=bool(spec.get("warm")))  # never returns
        if mode == "verifier-seed":
            seccomp.set_name(b"tangram-vseed")
            run_seed(bool(spec.get("warm")))  # never returns
        env = {str(k): str(v) for k, v in spec["env"].items()}
        if mode == "exec":
            child.default_signals()
            os.execve(spec["argv"][0], spec["argv"], env)
        seccomp.set_name(b"python3")  # what it is to the user (ps, /proc/self/comm)
        server = serve.Server(socket.socket(fileno=3)) if mode == "serve" else None
        child.prepare_python(env, spec["workdir"], spec["argv0"], preloaded)
        code, main, exc = child.run_main(spec["main_file"], source, compiled)
        code = child.flush() or code
        if server is not None:
            if exc is None:
                server.ready(main.__dict__)
                server.serve()
            elif not isinstance(exc, SystemExit):
                server.send(serve.exception_record(exc))
            # after SystemExit the connection just closes: the tests never ran
    except BaseException as e:
        try:
            os.write(2, f"tangram runner: {e!r}\n".encode())
        except OSError:
            pass
    os._exit(code)


def run_seed(warm: bool) -> None:  # pragma: no cover - child
    """A verifier seed: a process of the verifiers' uid, limits and filter (set up by
    `child_main` as for a verifier) that never judges a test itself and forks each new
    verifier of its sandbox, on the same protocol as the zygote's (without exit reports: the
    runner tells a verifier's end from its pidfd). A new occupant's first verifier then costs
    a fork of a small, warm process instead of a fork of the zygote and its whole set-up."""
    verifier.seed_ready(warm)
    sock = socket.socket(fileno=3)
    sock.send(b"ready")
    Zygote(sock, set(), child=_verifier_child, report_exits=False).loop()


def _verifier_child(spec: dict, fds: list[int], seed: int) -> None:  # pragma: no cover - child
    """A verifier forked from its seed: its control socket at descriptor 3, nothing else of
    the seed's; it dies with the seed (which the runner kills with the sandbox's zygote)."""
    try:
        seccomp.set_pdeathsig()
        if os.getppid() != seed:  # the seed died before the signal was armed
            os._exit(1)
        os.dup2(fds[0], verifier.CTL_FD)
        os.closerange(verifier.CTL_FD + 1, 1 << 16)
        for name, value in (spec.get("rlimits") or {}).items():  # the seed's own go unchanged
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (int(value), int(value)))
        seccomp.set_name(b"tangram-verify")
        verifier.serve_jobs(warm=bool(spec.get("warm")))  # never returns
    except BaseException:
        pass
    os._exit(1)


class Zygote:
    """The fork loop. Kept lean on purpose: every page this process writes while a child it
    forked lives is a copy-on-write fault, so the loop polls descriptors directly (no
    selectors objects) and formats its replies as bytes (JSON only for what it receives)."""

    def __init__(
        self,
        sock: socket.socket,
        preloaded: set[str],
        child: Callable[[dict, list[int], int], None] | None = None,
        report_exits: bool = True,
    ) -> None:
        self.sock = sock
        self.preloaded = preloaded
        self.child = child or (lambda spec, fds, _parent: child_main(spec, fds, preloaded))
        self.report_exits = report_exits
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)
        self.kids: dict[int, int] = {}  # pidfd -> pid

    def spawn(self, specs: list[dict], fds: list[int]) -> tuple[bytes, list[int]]:
        """Fork one child per spec: the reply and the children's pidfds (for the runner, which
        could not open them itself without racing this process's reaping)."""
        pids: list[int | None] = []
        pidfds: list[int] = []
        errors: list[str] = []
        start = 0
        me = os.getpid()
        for spec in specs:
            n = int(spec["fds"]) + (1 if spec.get("code") else 0)
            mine = fds[start : start + n]
            start += n
            env = spec.get("env")
            if env is not None and spec.get("std_env") and spec.get("mode") in ("python", "serve"):
                try:
                    child.adopt_env(env)
                except Exception:
                    pass  # (a value putenv refuses): the child sets it up and reports why
            try:
                pid = os.fork()
            except OSError as e:
                pids.append(None)
                errors.append(f"fork failed: {e}")
                continue
            if pid == 0:  # pragma: no cover - child
                self.child(spec, mine, me)
            pids.append(pid)
            pidfd = os.pidfd_open(pid)
            self.kids[pidfd] = pid
            self.poller.register(pidfd, select.POLLIN)
            pidfds.append(pidfd)
        if errors:
            return json.dumps({"pids": pids, "errors": errors}).encode(), pidfds
        return b'{"pids": [%s]}' % b", ".join(b"%d" % p for p in pids if p is not None), pidfds

    def reap(self, pidfd: int) -> None:
        pid = self.kids.pop(pidfd)
        self.poller.unregister(pidfd)
        os.close(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            code = -9
        if self.report_exits:
            self.sock.send(b'{"exit": %d, "status": %d}' % (pid, code))

    def loop(self) -> None:
        own = self.sock.fileno()
        while True:
            for fd, _ in self.poller.poll():
                if fd != own:
                    self.reap(fd)
                    continue
                try:
                    msg, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 16, MAX_FDS)
                except OSError:
                    os._exit(1)
                if not msg:
                    os._exit(0)  # the runner is gone
                pidfds: list[int] = []
                try:
                    reply, pidfds = self.spawn(json.loads(msg)["spawn"], fds)
                except Exception as e:
                    reply = json.dumps({"pids": [], "errors": [repr(e)]}).encode()
                finally:
                    for fd in fds:
                        os.close(fd)
                socket.send_fds(self.sock, [reply], pidfds)


# a program of the kind user code is, run once by the zygote before it forks anything (see
# `warm_up`): its names are the harness's own and nothing of it stays behind
WARM_UP_PROGRAM = """
from typing import List
def _f(numbers: List[float], threshold: float) -> bool:
    for i, a in enumerate(numbers):
        for j, b in enumerate(numbers):
            if i != j and abs(a - b) < threshold:
                return True
    return {"a": [x * 2 for x in range(3)], "b": f"{i}"} is None
def _check(candidate):
    assert candidate([1.0, 2.0, 3.0], 0.5) == False
_check(_f)
"""


def warm_up() -> None:
    """Pay once, here, the first-use costs every child would otherwise pay after its fork: the
    compiler's and the evaluator's lazy set-up (a child's first `compile` costs about twice
    its later ones, in page faults), and the verifier's and the object server's job path
    (`verifier.warm_up`: a test of the harness's own, its server a thread that has
    ended before this returns). What each child then touches is already made, so it is shared
    with the zygote instead of built anew."""
    try:
        exec(compile(WARM_UP_PROGRAM, "<warm-up>", "exec", dont_inherit=True), {"__name__": "__warm_up__"})
        verifier.warm_up()
        verifier.PRISTINE.restore()
    except Exception:
        pass  # a cold start is slower, not wrong


def main() -> None:
    sock = socket.socket(fileno=3)
    preloaded = preload()
    child.note_runner_modules()
    try:
        child.make_std_streams()
    except Exception:
        pass  # each user process opens its own
    warm_up()
    seccomp.set_name(b"tangram-zygote")
    seccomp.install()  # inherited by every child: none has to install it
    gc.collect()
    gc.freeze()  # forks share these pages instead of copying them on the first collection
    sock.send(b"ready")
    Zygote(sock, preloaded).loop()


if __name__ == "__main__":
    main()
