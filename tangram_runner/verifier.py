"""The verifier: trusted code in a process of its own that judges `assert_code` tests (stdlib
only).

Forked from the zygote (never from the runner, which holds every test of the request), it runs
under its own uid (not the user's: user code can neither signal nor read it) with the seccomp
filter. Verifiers are pooled by the runner: one judges one test at a time. Per test it gets the
`assert_code` as a memfd, a connection to that test's user process, and the write end of the
test's record, which only it holds; it runs the assert code with the user module's top-level
names bound to proxies of the objects in the user's process (proxy), and writes `PASS`
on the record only after the assert code ran to its end. That record is the test's verdict: the
user process's exit status and output never decide it.

Names of the user module that shadow builtins (`len`, `abs`, `AssertionError`, ...) are not
bound: the test sees the real builtins. Exact builtin values among the user's globals (a constant
`MOD = 10**9 + 7`) arrive as copies taken when the module finished.
"""

from __future__ import annotations

import builtins
import json
import marshal
import os
import socket
import sys
import traceback
import types
from typing import Any

from tangram_runner import child
from tangram_runner.proxy import (
    TEST_FILENAME,
    Conn,
    RemoteModule,
    install_importer,
)
from tangram_runner.serve import Server

CTL_FD = 3
MAX_JOBS = 1000  # then a fresh verifier takes over (bounds what tests leave behind)
# A verifier larger than this after a job retires too: what a test left allocated counts against
# the sandbox's memory, and a verifier may go on to judge later occupants' tests (its group,
# `verifiers`), whose user processes share that memory. About four times a fresh one.
MAX_RSS_MB = 64


def serve_jobs(warm: bool = False) -> None:
    """In a verifier process, after `child.setup` (uid, limits, seccomp), with the
    runner's control socket at descriptor 3: judge one test per job until the socket closes.
    Never returns.

    A job brings [the connection to the user process, the record's write end, stdout, stderr, the
    assert code as a memfd]. Each test runs in a fresh namespace; what a test changes in
    builtins, sys.path, sys.meta_path, the recursion limit and the standard streams is put back,
    and modules imported from the user process are dropped, before the next job rather than
    after this one: a verifier forked for a new occupant often judges a single test and is
    then killed, and a restore touches every builtin (copy-on-write faults on pages shared
    with the zygote) for nothing then. The standard streams go back at once. With `warm`, one
    test of the harness's own runs first (`warm_up`).

    Its last job's report says so (`"last": true`: after `MAX_JOBS`, or when a job left it
    above `MAX_RSS_MB`), and it exits: the runner never gives it another job."""
    null, out, err = std_io()
    ctl = socket.socket(fileno=CTL_FD)
    clean = PRISTINE
    dirty = False  # a job or the warm-up ran since the last restore
    if warm:
        warm_up()
        dirty = True
    for n in range(MAX_JOBS):
        try:
            msg, fds, _flags, _addr = socket.recv_fds(ctl, 1 << 16, 8)
        except OSError:
            break
        if not msg:
            break
        if len(fds) != 5:
            break
        if dirty:  # put back what the previous job changed, before this one (see below)
            clean.restore()
        dirty = True
        job = _judge(msg, fds, null, out, err, clean.streams)
        last = n == MAX_JOBS - 1 or rss_mb() > MAX_RSS_MB
        try:
            ctl.send(json.dumps({"done": job.get("job"), **({"last": True} if last else {})}).encode())
        except OSError:
            break
        if last:
            break
    os._exit(0)


def _judge(msg: bytes, fds: list[int], null: int, out: Any, err: Any, streams: Any) -> dict[str, Any]:
    """One job (`serve_jobs`): its verdict written to its record, its descriptors closed and the
    standard streams put back (`streams`: the pristine ones); returns the job's message."""
    rpc, record, job_out, job_err, code_fd = fds
    os.dup2(job_out, 1)
    os.dup2(job_err, 2)
    os.close(job_out)
    os.close(job_err)
    sys.stdout, sys.stderr = out, err
    passed, detail = False, ""
    sock = socket.socket(fileno=rpc)
    try:
        job = json.loads(msg)
        trusted = [str(p) for p in job["trusted_path"]]
        if job.get("compiled"):  # (source, code object), compiled by the runner
            source, compiled = marshal.loads(child.read_bytes(code_fd))
            passed, detail = verify(Conn(sock), source, trusted, compiled)
        else:
            passed, detail = verify(Conn(sock), child.read_all(code_fd), trusted)
    except BaseException as e:
        detail = f"verifier error: {e!r}"
        job = {}
    for stream in (out, err, sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os.write(record, b"PASS" if passed else b"FAIL" + detail.encode("utf-8", "replace")[:4000])
    for fd in (record, code_fd):
        os.close(fd)
    sock.close()
    os.dup2(null, 1)  # the job's output pipes close here: the runner sees their end
    os.dup2(null, 2)
    sys.stdin, sys.stdout, sys.stderr = streams
    return job


def rss_mb() -> float:
    """This process's resident memory, MiB (0 when /proc cannot tell)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    except (OSError, ValueError, IndexError):
        return 0.0


_io: list[Any] = []  # (/dev/null's descriptor, stdout, stderr), once per process (or seed)


def std_io() -> tuple[int, Any, Any]:
    """/dev/null at descriptors 0, 1 and 2 (a job's output pipes replace 1 and 2 while it
    runs), and text streams on 1 and 2. Made once per process: a verifier forked from a seed
    (`seed_ready`) inherits the seed's and builds nothing."""
    if not _io:
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        if null > 2:
            os.close(null)
        out = open(1, "w", closefd=False)  # noqa: SIM115
        err = open(2, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115
        _io.extend((0, out, err))
    return _io[0], _io[1], _io[2]


def seed_ready(warm: bool) -> None:
    """In a verifier seed (`zygote.run_seed`), before it forks any verifier: the
    standard streams made, and with `warm` one test of the harness's own judged (`warm_up`)
    and everything it changed put back. Each verifier forked from the seed then starts warm
    and clean: no uid switch, no limits, no filter to install, no streams to make, and the
    first-use costs of the job path paid once per sandbox rather than once per occupant. The
    seed itself never judges a test of anyone's."""
    std_io()
    if warm:
        warm_up()
        PRISTINE.restore()


WARM_UP_TEST = "assert f(1) == [1, '1'] and len(f(2)) == 2 and 'x' not in f(3)"


def warm_up() -> bool:
    """Judge one test of the harness's own against a server of the harness's own (a thread of
    this process, no user process involved): a freshly forked verifier pays its first-use
    costs (copy-on-write faults on the pages a job touches) here, before it waits for the
    next occupant's first test, instead of during it. True when the test passed."""
    import _thread

    mine, theirs = socket.socketpair()
    served = _thread.allocate_lock()
    served.acquire()

    def serve() -> None:
        try:
            srv = Server(theirs)
            srv.ready({"f": lambda x: [x, str(x)]})
            srv.serve()
        except Exception:
            pass
        finally:
            served.release()

    _thread.start_new_thread(serve, ())
    try:
        passed, _ = verify(Conn(mine), WARM_UP_TEST, None)
    except Exception:
        passed = False
    finally:
        mine.close()
        served.acquire(timeout=5.0)
        theirs.close()
    return passed


class _Clean:
    """What a test may change in the verifier's interpreter, as it was before any test."""

    def __init__(self) -> None:
        self.builtins = dict(vars(builtins))
        self.path = list(sys.path)
        self.meta_path = list(sys.meta_path)
        self.limit = sys.getrecursionlimit()
        self.streams = (sys.stdin, sys.stdout, sys.stderr)

    def restore(self) -> None:
        b = vars(builtins)
        for k in [k for k in b if k not in self.builtins]:
            del b[k]
        for k, v in self.builtins.items():
            if b.get(k) is not v:
                b[k] = v
        sys.path[:] = self.path
        sys.meta_path[:] = self.meta_path
        sys.setrecursionlimit(self.limit)
        sys.stdin, sys.stdout, sys.stderr = self.streams
        for name in [n for n, m in sys.modules.items() if isinstance(m, RemoteModule)]:
            del sys.modules[name]


# What a verifier starts from, taken when the zygote imports this module (before it forks any
# verifier), so that a new verifier copies nothing to take it: a test's changes are undone
# against it (`serve_jobs`).
PRISTINE = _Clean()
# the names a user module may not bind in a test's namespace (see the module doc), made once
# here rather than per test (a set of every builtin's name: pages written in every verifier)
BUILTIN_NAMES = frozenset(PRISTINE.builtins)


def verify(
    conn: Conn, assert_code: str, trusted_path: list[str] | None, compiled: types.CodeType | None = None
) -> tuple[bool, str]:
    """(passed, why not): run the test against the user process behind `conn`. With
    `trusted_path`, imports come from there and otherwise from the user process. `compiled`:
    `assert_code` compiled already (by the runner, `launch.assert_payload`)."""
    lines = assert_code.splitlines()
    if compiled is not None:
        code = compiled
    else:
        try:
            code = compile(assert_code, TEST_FILENAME, "exec", dont_inherit=True)
        except SyntaxError as e:
            return False, f"the test's assert_code does not compile: {e}"
    if trusted_path is not None:
        install_importer(conn, trusted_path)
    try:
        first = conn.receive()
    except Exception as e:
        return False, f"user code never got ready: {e}"
    if type(first) is tuple and len(first) == 4 and first[0] == "err":
        return False, f"user code raised {first[1]}: {str(first[2])[:300]} before the tests ran"
    if type(first) is not tuple or len(first) != 2 or first[0] != "ready" or type(first[1]) is not dict:
        return False, "user code sent something else than its module"
    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    for name, value in first[1].items():
        if type(name) is str and name not in BUILTIN_NAMES:
            ns[name] = value
    try:
        exec(code, ns)
    except SystemExit as e:  # only the test code itself can raise it here
        if e.code in (None, 0):
            return True, ""
        return False, f"the test exited with {e.code!r}"
    except BaseException as e:
        return False, describe(e, lines)
    return True, ""


def describe(e: BaseException, lines: list[str]) -> str:
    """`Type: message (test line N: source)`, plus the user-side traceback of a remote error."""
    msg = f"{type(e).__name__}: {e}"[:600]
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == TEST_FILENAME]
    if frames:
        n = frames[-1].lineno or 0
        src = lines[n - 1].strip()[:200] if 0 < n <= len(lines) else ""
        msg += f" (test line {n}: {src})"
    for note in getattr(e, "__notes__", [])[:1]:
        msg += "\n" + str(note)[-1000:]
    return msg
